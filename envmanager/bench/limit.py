"""The ``scale`` scenarios' limit: what the machine does with no IPC at all, measured in the run.

``P`` processes (``min(cores, n_env)``), each building env ``i`` of the scenario and stepping it
in process with env ``i``'s actions, start together (a barrier: each says it is ready, and once
all are, one event starts them) and step for the same fixed time;
their step rates summed are the limit. One env's rate differs between machines of one kind (1.7x
for Pong on two 16-core machines), and ``P`` processes stepping together share caches, memory
bandwidth and turbo headroom, so neither a rate from elsewhere nor ``P`` times one env's rate
alone is the limit (``P`` times the rate alone is reported beside it, to compare).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envmanager.bench.common import START_METHOD
from envmanager.bench.scenarios import Scenario, env_columns

__all__ = ["LIMIT_SECONDS", "ProcessRate", "processes_rate", "summed", "describe"]

#: Seconds each process steps its env (after the barrier).
LIMIT_SECONDS = 1.0
#: Seconds each process steps before the barrier (first-step costs, caches): not counted.
WARMUP_SECONDS = 0.1
#: Seconds to build the envs and meet at the barrier, and for the results after the run.
START_DEADLINE = 120.0
CHECK_EVERY = 8  # steps between looks at the clock


@dataclass(frozen=True)
class ProcessRate:
    """What one of the limit's processes did: its pid, env-steps, and its timed window (``start``,
    ``end``: ``time.monotonic()``, one clock for every process on Linux)."""

    pid: int
    steps: int
    start: float
    end: float

    @property
    def rate(self) -> float:
        return self.steps / (self.end - self.start)


def _step_alone(scenario: Scenario, env_id: int, column: list[Any], seconds: float, go: Any, conn: Any) -> None:
    """A limit process: build env ``env_id``, warm up, say so, wait for ``go``, step for ``seconds``."""
    env = None
    try:
        env = scenario.factory(env_id)
        env.reset(seed=env_id)
        step, reset, rows = env.step, env.reset, len(column)
        k = 0
        warm_until = time.monotonic() + WARMUP_SECONDS
        while time.monotonic() < warm_until:
            _, _, terminated, truncated, _ = step(column[k % rows])
            k += 1
            if terminated or truncated:
                reset()
        conn.send(("ready",))
        if not go.wait(timeout=START_DEADLINE):
            raise TimeoutError(f"not started in {START_DEADLINE:g} s")
        done = 0
        start = now = time.monotonic()
        end = start + seconds
        while now < end:
            for _ in range(CHECK_EVERY):
                _, _, terminated, truncated, _ = step(column[k % rows])
                k += 1
                if terminated or truncated:
                    reset()
            done += CHECK_EVERY
            now = time.monotonic()
        conn.send(("ok", os.getpid(), done, start, now))
    except BaseException as exc:  # the parent says which process failed, and why
        conn.send(("error", os.getpid(), f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if env is not None:
            env.close()
        conn.close()


def processes_rate(scenario: Scenario, processes: int, actions: np.ndarray,
                   seconds: float = LIMIT_SECONDS) -> list[ProcessRate]:
    """Start ``processes`` processes (this process's start method and affinity), env ``i`` in
    process ``i`` with its own column of ``actions``; they step together for ``seconds``. What each
    did, in order; ``sum(p.rate for p in ...)`` is the limit. Raises ``RuntimeError`` when one of
    them fails (every one is ended and reaped first)."""
    ctx: Any = multiprocessing.get_context(START_METHOD)  # typeshed's BaseContext lacks Process
    columns = env_columns(actions)
    go = ctx.Event()  # not ctx.Barrier: its shared counter lives in multiprocessing's heap, an fd kept open
    pipes = [ctx.Pipe(duplex=False) for _ in range(processes)]
    started: list[Any] = []
    ok = False
    try:
        for i, (_, send) in enumerate(pipes):
            p = ctx.Process(target=_step_alone, args=(scenario, i, columns[i % len(columns)], seconds, go, send),
                            name=f"envmanager-bench-limit-{i}", daemon=True)
            p.start()
            started.append(p)
            send.close()  # the child's end
        _answers(pipes, started, "ready", START_DEADLINE)
        go.set()
        answers = _answers(pipes, started, "ok", START_DEADLINE + seconds)
        ok = True
        return [ProcessRate(pid, steps, start, end) for _, pid, steps, start, end in answers]
    finally:
        for p in started:
            if not ok:  # a failed one: the others may wait for ``go`` or step on
                p.kill()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for receive, send in pipes:
            receive.close()
            send.close()


def _answers(pipes: list[Any], started: list[Any], expected: str, within: float) -> list[tuple[Any, ...]]:
    """One answer from every process within ``within`` seconds, each of kind ``expected``; else
    ``RuntimeError`` saying which process failed and why."""
    deadline = time.monotonic() + within
    answers = []
    for i, (receive, _) in enumerate(pipes):
        if not receive.poll(max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"limit process {i} did not answer in {within:g} s")
        try:
            answer = receive.recv()
        except EOFError:
            raise RuntimeError(f"limit process {i} ended without an answer (exit code {started[i].exitcode})") from None
        if answer[0] == "error":
            raise RuntimeError(f"limit process {i} (pid {answer[1]}) failed: {answer[2]}")
        assert answer[0] == expected, answer
        answers.append(answer)
    return answers


def summed(rates: Sequence[ProcessRate]) -> float:
    """The limit of one measurement: the processes' rates summed."""
    return float(sum(p.rate for p in rates))


def describe(process_rates: Sequence[Sequence[ProcessRate]], single_env_rate: Sequence[float]) -> dict[str, Any]:
    """The JSON of a limit measured this way: per repeat, every process's rate and their sum, and
    the limit against the processes' count times one env's rate alone (``single_env_rate``: what
    stepping together costs, shared caches and turbo)."""
    sums = [summed(r) for r in process_rates]
    limit = statistics.median(sums) if sums else None
    processes = len(process_rates[0]) if process_rates else None
    alone = statistics.median(single_env_rate) if single_env_rate else None
    return {
        "kind": "processes stepping one env each in process, started together, rates summed",
        "processes": processes,
        "seconds": LIMIT_SECONDS,
        "sum_per_repeat": sums,
        "process_steps_per_second": [[p.rate for p in r] for r in process_rates],
        "sum_vs_processes_x_one_env_alone": None if not alone or limit is None or not processes
        else limit / (processes * alone),
    }
