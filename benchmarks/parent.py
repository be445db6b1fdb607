"""The parent's CPU when it never waits: the real manager, its workers stopped, and stand-in
workers in the parent answering every step at once through the real mailbox (its step board).

On a many-core machine the parent is the one serial part: its CPU per lockstep ``step()`` holds
every worker idle once per step, and it must not grow with the processes (issue 40: at most
15 µs + 1 µs per process). A run on real cores cannot show it once the workers are the bound
(the parent then waits); here nothing waits. The stand-ins' own work (take the board's
requests, write an info, post the answer words) is timed apart and left out. Needs the mailbox
(x86, Linux).

    python -m benchmarks.parent            # the drop-in's step() with 1, 4, 16, 64 processes, and
                                           # the batch level's CPU per answer (1 and 4 env-steps)
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from envmanager.bench.scenarios import burn_env
from envmanager.core.batch import BatchEnvManager
from envmanager.wire.mailbox import WorkerMailbox
from envmanager.wire.messages import Stepped, StepsAnswer, encode_steps_answer

#: The issue's budget for the parent's CPU per step() with P processes: this + PER_PROCESS_US * P.
BUDGET_US, PER_PROCESS_US = 15.0, 1.0


class StandIns:
    """The pool's worker processes stopped (SIGSTOP), and in their place one stand-in per process,
    in this process, answering whatever the board asks at once: the results stay as they are in
    shared memory; with ``infos`` each env's info is ``{"t": n}``, in the board's info rows (the
    first answer announces its schema in a notice, as a worker does)."""

    def __init__(self, manager: BatchEnvManager, infos: bool) -> None:
        box = manager.pool.mailboxes
        if box is None:
            raise RuntimeError("no mailbox here (it needs x86 and the step queue; ENVMANAGER_MAILBOX=on)")
        self.workers = manager.pool.processes
        # The stand-ins answer at once: nobody sleeps, nobody is woken (the stopped workers would
        # never read a wake-up; their pipes would fill). The pool does not look at the cores again.
        box.allow_spin(True)
        box._permission_changed = 0
        manager.pool._next_core_check = float("inf")
        for w in self.workers:
            os.kill(w.pid, signal.SIGSTOP)
        self.fakes = []
        for w in self.workers:
            fake = WorkerMailbox(box.file, box.layout, w.index)
            fake._taken, fake._posted = box._sent[w.index], box._seen[w.index]
            fake.busy()
            self.fakes.append(fake)
        self.infos = infos
        self.t = 0

    def answer(self) -> None:
        """Answer every step asked for."""
        self.t += 1
        for p, fake in enumerate(self.fakes):
            locals_, ordinals = fake.steps()
            if not locals_:
                continue
            times = [1e-6] * len(locals_)
            raw = True
            if self.infos:
                schemas = fake.write_infos(locals_, [{"t": self.t}] * len(locals_))
                if schemas:  # the schema's first use: announced in a notice
                    stepped = Stepped(times, {int(i): {"t": self.t} for i in locals_})
                    answer = StepsAnswer(tuple(locals_), tuple(ordinals), stepped, tuple(schemas))
                    header, payload = encode_steps_answer(p, time.monotonic(), answer)
                    fake.post(header + payload)
                    raw = False
            fake.answer_steps(locals_, ordinals, times, raw)

    def kill(self) -> None:
        for w in self.workers:
            if w.pid is not None:
                os.kill(w.pid, signal.SIGKILL)


def _cpu_us(parent: list[Any], stand_in: Any, rounds: int) -> float:
    """µs of this process's CPU per round in the ``parent`` calls, the stand-in's left out
    (best of 5 repeats of ``rounds`` rounds)."""
    clock = time.process_time_ns
    best = float("inf")
    for _ in range(5):
        spent = 0
        for _ in range(rounds):
            t0 = clock()
            parent[0]()
            t1 = clock()
            stand_in()
            t2 = clock()
            parent[1]()
            spent += clock() - t2 + t1 - t0
        best = min(best, spent / rounds / 1e3)
    return best


def per_step(processes: int, infos: bool = False, envs_per_worker: int = 1, rounds: int = 3000, sb3: bool = False) -> float:
    """µs of parent CPU per lockstep ``step()`` of ``envmanager.AsyncVectorEnv`` (``sb3``: of
    ``envmanager.sb3.SubprocVecEnv``) with ``processes`` stand-in processes of ``envs_per_worker``
    envs (answering at once; ``infos``: ``{"t": n}``)."""
    n = processes * envs_per_worker
    fns = [functools.partial(burn_env, 0.0, i) for i in range(n)]
    vec: Any
    if sb3:
        from envmanager.sb3 import SubprocVecEnv

        vec = SubprocVecEnv(fns, "fork", envs_per_worker=envs_per_worker)
        vec.reset()
    else:
        import envmanager

        vec = envmanager.AsyncVectorEnv(fns, envs_per_worker=envs_per_worker, double_buffer=False, context="fork")
        vec.reset(seed=0)
    stand_ins = None
    try:
        assert vec._manager is not None
        stand_ins = StandIns(vec._manager, infos)
        actions = np.zeros(n, dtype=np.int64)
        _cpu_us([lambda: vec.step_async(actions), vec.step_wait], stand_ins.answer, 50)  # warm up (the schema's notice)
        return _cpu_us([lambda: vec.step_async(actions), vec.step_wait], stand_ins.answer, rounds)
    finally:
        if stand_ins is not None:
            stand_ins.kill()
        if sb3:
            vec._manager.close(0.1)
        else:
            vec.close(terminate=True)


def per_answer(n: int, envs_per_worker: int, infos: bool = True, rounds: int = 5000) -> tuple[float, float]:
    """(µs of parent CPU per env-step, env-steps per receive) of the batch level's first-ready loop
    (``receive_batch``, the next actions, ``send_batch``) for ``n`` envs, double buffered (the
    stand-ins answer every step asked, so each receive takes all ``n``)."""
    m = BatchEnvManager(functools.partial(burn_env, 0.0), n, envs_per_worker=envs_per_worker, double_buffer=True,
                        info_columns=True, spin_s=50e-6, context="fork")
    stand_ins = None
    try:
        m.send_reset({i: (i, None) for i in range(n)})
        m.receive_reset_batch()
        stand_ins = StandIns(m, infos)
        actions, position = np.zeros((256, n), dtype=np.int64), np.ones(n, dtype=np.int64)
        m.send_batch(np.arange(n), actions[0])
        stand_ins.answer()
        slots: list[np.ndarray] = []

        def receive() -> None:
            slots.append(m.receive_batch(1, info_columns=True).slots)

        def send() -> None:
            got = slots.pop()
            p = position[got]
            m.send_batch(got, actions[p % 256, got])
            position[got] = p + 1

        receive()
        before = m.pool.answers  # (on the board an answer is one env-step)
        us = _cpu_us([send, receive], stand_ins.answer, rounds)
        steps = (m.pool.answers - before) / (5 * rounds)
        return us / steps, steps
    finally:
        if stand_ins is not None:
            stand_ins.kill()
        m.close(0.1)


def main() -> int:
    info = '{"t": n}'
    print("| processes | infos | parent CPU per step() | budget (15 + 1 × P) | the SB3 drop-in's step_async + step_wait |\n"
          "|---:|---|---:|---:|---:|")
    for processes in (1, 4, 16, 64):
        for infos in (False, True):
            us, budget = per_step(processes, infos), BUDGET_US + PER_PROCESS_US * processes
            sb3 = per_step(processes, infos, sb3=True)
            print(f"| {processes} | {info if infos else 'none'} | {us:.1f} µs | {budget:.0f} µs | {sb3:.1f} µs |", flush=True)
    print("\n| envs | infos | parent CPU per env-step (batch level, first-ready) |\n|---:|---|---:|")
    for n, k in ((2, 2), (8, 8)):
        for infos in (False, True):
            us, steps = per_answer(n, k, infos)
            print(f"| {steps:.0f} | {info + ' each' if infos else 'none'} | {us:.1f} µs |", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("ENVMANAGER_MAILBOX", "on")  # the stand-ins answer through the mailbox
    sys.exit(main())
