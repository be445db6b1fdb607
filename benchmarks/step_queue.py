"""Measure the step queue: one shared queue of results, many writers, one reader.

Each of ``--writers`` processes answers a request from its own pipe by posting a small notice
(~150 bytes, like a step notice) on the shared queue; the parent sends a request to every
writer, then takes all the notices. Compared: ``multiprocessing.Queue`` (a feeder thread per
writer, a lock), ``multiprocessing.SimpleQueue`` (a lock around each write), and envmanager's
``StepQueue`` (a pipe whose notices are single atomic writes, no lock).

    python benchmarks/step_queue.py --writers 2 --rounds 20000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from envmanager.wire.messages import EnvironmentCommand, Stepped, encode_answer
from envmanager.wire.step_queue import StepQueue

# What a step answer carries when infos are empty and everything is in shared memory.
ANSWER = Stepped(env_times=(1e-5,), generations=(0,))


def _writer(kind: str, index: int, conn, queue) -> None:
    while True:
        if conn.recv() is None:
            return
        header, payload = encode_answer(EnvironmentCommand.STEP, index, 1, time.monotonic(), ANSWER)
        if kind == "StepQueue":
            StepQueue.post(queue.fileno(), conn, header, payload)
        else:  # the same bytes as StepQueue.post sends
            queue.put(header + payload)


def measure(kind: str, writers: int, rounds: int) -> float:
    """Round trips per second: a request to every writer, then every notice back."""
    ctx = mp.get_context("fork")
    if kind == "StepQueue":
        step_queue = StepQueue(ctx)
        step_queue.watch([], [])
        shared = step_queue.writer

        def get_all(n: int) -> None:  # notices come several per read
            got = 0
            while got < n:
                step_queue.wait(5.0)
                got += len(step_queue.take())
    else:
        queue = ctx.Queue() if kind == "Queue" else ctx.SimpleQueue()
        shared = queue

        def get_all(n: int) -> None:
            for _ in range(n):
                queue.get()
    pipes, procs = [], []
    for i in range(writers):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_writer, args=(kind, i, child, shared), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        for warm in (True, False):
            start = time.perf_counter()
            for _ in range(rounds // 10 if warm else rounds):
                for pipe in pipes:
                    pipe.send(1)
                get_all(len(pipes))
            elapsed = time.perf_counter() - start
        return rounds / elapsed
    finally:
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--rounds", type=int, default=20000)
    args = parser.parse_args()
    kinds = ("Queue", "SimpleQueue", "StepQueue")
    print(f"{'writers':>8}{'mp.Queue':>14}{'mp.SimpleQueue':>16}{'StepQueue':>14}   (round trips/s, median of 3)")
    for n in args.writers:
        runs = [[measure(kind, n, args.rounds) for kind in kinds] for _ in range(3)]  # interleaved
        rates = [sorted(run[i] for run in runs)[1] for i in range(len(kinds))]
        print(f"{n:>8}{rates[0]:>14,.0f}{rates[1]:>16,.0f}{rates[2]:>14,.0f}")


if __name__ == "__main__":
    main()
