"""What the Ctrl-C programs of ``test_interrupts.py`` share: started as from a terminal, a thread
pressing Ctrl-C at random moments, and an end that takes the presses still on their way; for the
PettingZoo layers' programs, work made slower than the grace after a section, and a check of
each env's results against the ones before."""

from __future__ import annotations

import faulthandler
import inspect
import itertools
import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np

from envmanager.wire.interrupts import DEFERRED


def as_from_a_terminal() -> None:
    """SIGINT delivered and raised as ``KeyboardInterrupt`` (the test runner's child may have it
    blocked); a program still running after 100 s shows where it is (stderr)."""
    faulthandler.dump_traceback_later(100)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)


class Presser:
    """A thread sending this process SIGINT every 0.1 ms to ``most_s`` (at random, from ``seed``)
    until ``stop``."""

    def __init__(self, seed: int, most_s: float = 0.002) -> None:
        self._most_s = most_s
        self._stop, self._go = threading.Event(), threading.Event()
        self._rng = random.Random(seed)
        self._thread = threading.Thread(target=self._press, daemon=True)
        self._thread.start()
        # Pressing starts once this returns (on a loaded machine a press came while ``start()``
        # still waited for the thread: a KeyboardInterrupt in the program's set-up, not its loop).
        self._go.set()

    def _press(self) -> None:
        self._go.wait()
        while not self._stop.is_set():
            time.sleep(self._rng.uniform(0.0001, self._most_s))
            if not self._stop.is_set():
                os.kill(os.getpid(), signal.SIGINT)

    def stop(self) -> None:
        """Stop pressing; the presses still on their way, or held back by the library, are taken here."""
        self._stop.set()
        while self._thread.is_alive():  # (one held back to the end of the last call comes a moment after it)
            try:
                self._thread.join()
            except KeyboardInterrupt:
                pass
        for _ in range(3):
            try:
                time.sleep(0.05)
                with DEFERRED:
                    pass
            except KeyboardInterrupt:
                pass


def slowed(owner: Any, name: str, every: int = 3, seconds: float = 0.015) -> None:
    """``owner.<name>`` (a function, method or classmethod) made ``seconds`` slower on every ``every``-th call, a
    sleep first: work that takes longer than the grace that holds a Ctrl-C after a call's last section
    (``interrupts.GRACE_S``), as a large batch's does. A Ctrl-C there must be held by a section of its own."""
    original = inspect.getattr_static(owner, name)
    kind = type(original) if isinstance(original, (classmethod, staticmethod)) else None
    function = original.__func__ if kind is not None else original
    calls = itertools.count()

    def slow(*args: Any, **kwargs: Any) -> Any:
        if next(calls) % every == 0:
            time.sleep(seconds)
        return function(*args, **kwargs)

    setattr(owner, name, slow if kind is None else kind(slow))


class EnvRows:
    """What a program knows of each of ``n`` envs of ``pettingzoo_envs.ScheduleParallelEnv`` (two agents, each
    observing ``[slot, agent, episode, t, last action received, nonce]``; agent 0 terminates after
    ``episode_length(slot, episode)`` steps, agent 1 a step later), from the rows handed out to it: each result is
    checked against the one before it, and a result taken twice is known by its rows, equal to those kept (every
    result moves ``t`` or ``episode`` of each agent in it). Problems go to ``problems``.

    Each env's record is one tuple, kept in one store: a check cut short by a Ctrl-C is done again as a whole."""

    SLOT, AGENT, EPISODE, T, LAST, NONCE = range(6)
    AGENTS = 2

    def __init__(self, reset: Any, problems: list[str]) -> None:
        self.problems = problems
        #: Per env: its latest rows (an agent not in a result keeps its last) and which agents act next.
        self.state = [(rows.copy(), np.ones(self.AGENTS, np.bool_)) for rows in reset]
        self.taken = 0  # results taken (for the report)

    @classmethod
    def action(cls, i: int, a: int, row: np.ndarray) -> int:
        """What agent ``a`` of env ``i`` is given after its result ``row``."""
        return int(row[cls.T] + i + a) % 4

    def actions(self, ids: list[int]) -> np.ndarray:
        """The action rows of envs ``ids``, agent by agent (those of agents that do not act, never read, too)."""
        return np.array([self.action(i, a, self.state[i][0][a]) for i in ids for a in range(self.AGENTS)], np.int64)

    def take(self, i: int, o: np.ndarray, present: np.ndarray, terminated: np.ndarray, start: bool | None = None) -> None:
        """Env ``i``'s next result: rows ``o`` (per agent), the agents in it and those that terminated; ``start``
        (if known) whether it says it is a reset."""
        from schedule_envs import episode_length

        EPISODE, T, LAST = self.EPISODE, self.T, self.LAST
        rows, acting = self.state[i]
        p = present
        if p.any() and (o[p] == rows[p]).all():
            return  # taken already
        what = f"env {i}: {rows[:, [EPISODE, T]].tolist()} -> {o[:, [EPISODE, T]].tolist()} (present {p.tolist()})"
        ended = not acting.any()
        if (o[p][:, self.SLOT] != i).any() or (o[p][:, self.NONCE] != rows[0, self.NONCE]).any():
            self.problems.append(f"{what}: another env's rows, or a fresh env's")
        elif ended:
            if not (p.all() and (o[:, EPISODE] == rows[:, EPISODE].max() + 1).all() and (o[:, T] == 0).all()):
                self.problems.append(f"{what}: not the next episode's reset")
        else:
            for a in range(self.AGENTS):
                if not acting[a]:
                    if p[a]:
                        self.problems.append(f"{what}: agent {a} is back after it was done")
                elif not p[a] or o[a, EPISODE] != rows[a, EPISODE] or o[a, T] != rows[a, T] + 1:
                    self.problems.append(f"{what}: agent {a}'s step lost, doubled or out of order")
                elif o[a, LAST] != self.action(i, a, rows[a]):
                    self.problems.append(f"{what}: agent {a} received {o[a, LAST]}, not {self.action(i, a, rows[a])}")
                elif terminated[a] != (o[a, T] >= episode_length(i, int(o[a, EPISODE])) + a):
                    self.problems.append(f"{what}: agent {a} terminated: {terminated[a]}")
        if start is not None and start != ended:
            self.problems.append(f"{what}: episode_start {start}, after a result that {'ended' if ended else 'did not end'} "
                                 "its episode")
        self.state[i] = (np.where(p[:, None], o, rows), p & ~terminated)
        self.taken += 1

    def in_step_with(self, episodes: list[int], steps: list[int]) -> None:
        """The envs' own counts (``episode``, ``t``): every result they gave was seen."""
        for i, (rows, _) in enumerate(self.state):
            seen = (int(rows[:, self.EPISODE].max()), int(rows[:, self.T].max()))
            if seen != (episodes[i], steps[i]):
                self.problems.append(f"env {i} is at episode {episodes[i]} step {steps[i]}, the program saw {seen}")
