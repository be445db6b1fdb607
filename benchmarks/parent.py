"""The parent's CPU per answer when it never waits: the real manager, its workers stopped, and a
stand-in worker in the parent answering every request at once through the real mailbox.

On a many-core machine the parent is the one serial part, and its CPU per answer when answers
are always ready caps the whole machine; a pinned run cannot show it once the workers are the
bound (the parent then waits, and its looks for answers cost it too). Here nothing waits: the
parent's loop is the bench's batch-level loop (``receive_batch``, the next actions, ``send_batch``)
and the stand-in's own cost (take the request, encode an answer, post it) is measured alone and
taken out. Needs the mailbox (x86, Linux).

    python -m benchmarks.parent            # 1 and 4 env-steps per answer, with and without infos
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
import timeit
from typing import Any

import numpy as np

from envmanager.bench.scenarios import burn_env
from envmanager.core.batch import BatchEnvManager
from envmanager.wire.mailbox import WorkerMailbox
from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.wire.messages import Stepped, decode_request_header, encode_answer


def _stand_ins(m: BatchEnvManager, lane: int, infos: bool) -> Any:
    """Stop the workers; return a function answering every request waiting, as they would."""
    box = m.pool.mailboxes
    if box is None:
        raise RuntimeError("no mailbox here (it needs x86 and the step queue)")
    for w in m.pool.workers:
        os.kill(w.pid, signal.SIGSTOP)
    fakes = []
    for w in m.pool.workers:
        fake = WorkerMailbox(box.file, box.layout, w.index)
        fake._taken, fake._posted = box._sent[w.index], box._seen[w.index]
        fake.busy()
        fakes.append(fake)
    info = {k: {"t": 1} for k in range(lane)} if infos else None

    def answer() -> None:
        for p, fake in enumerate(fakes):
            while (data := fake.take()) is not None:
                _, seq, _ = decode_request_header(data)  # type: ignore[arg-type]
                header, payload = encode_answer(Cmd.STEP, p, seq, 0.0, Stepped([1e-6] * lane, info))
                fake.post(header + payload)

    def alone() -> None:  # the stand-in's work for one answer, without a parent
        header, payload = encode_answer(Cmd.STEP, 0, 1, 0.0, Stepped([1e-6] * lane, info))
        decode_request_header(b"\x01" + bytes(9))
        fakes[0].post(header + payload)
        fakes[0]._posted -= 1

    return answer, alone


def per_answer(n: int, envs_per_worker: int, infos: bool = True, rounds: int = 5000) -> tuple[float, float]:
    """(µs of parent CPU per answer, env-steps per answer) for ``n`` envs, double buffered."""
    lane = envs_per_worker // 2
    m = BatchEnvManager(functools.partial(burn_env, 0.0), n, envs_per_worker=envs_per_worker, double_buffer=True,
                        info_columns=True, spin_s=50e-6, context="fork")
    try:
        m.send_reset({i: (i, None) for i in range(n)})
        m.receive_reset_batch()
        answer, alone = _stand_ins(m, lane, infos)
        actions, position = np.zeros((256, n), dtype=np.int64), np.ones(n, dtype=np.int64)
        m.send_batch(np.arange(n), actions[0])
        answer()

        def turn() -> None:
            slots = m.receive_batch(1, info_columns=True).slots
            p = position[slots]
            m.send_batch(slots, actions[p % 256, slots])
            position[slots] = p + 1
            answer()

        before = m.pool.answers
        best = min(timeit.repeat(turn, number=rounds, repeat=5, timer=time.process_time)) / rounds
        answers = (m.pool.answers - before) / (5 * rounds)
        own = min(timeit.repeat(alone, number=rounds, repeat=5, timer=time.process_time)) / rounds
        return (best / answers - own) * 1e6, float(lane)
    finally:
        for w in m.pool.workers:
            if w.pid is not None:
                os.kill(w.pid, signal.SIGKILL)
        m.close(0.1)


def main() -> int:
    print("| env-steps per answer | infos | parent CPU per answer |\n|---:|---|---:|")
    for n, k in ((2, 2), (8, 8)):
        for infos in (False, True):
            us, lane = per_answer(n, k, infos)
            what = '{"t": n} each' if infos else "none"
            print(f"| {lane:.0f} | {what} | {us:.1f} µs |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
