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

from envmanager.protocol import EnvironmentCommand, encode_notice, encode_payload
from envmanager.transport import StepQueue

PAYLOAD = [(0, None, None, None, None, {}, 1e-5)]  # what a step notice carries


def _writer(kind: str, index: int, conn, queue) -> None:
    while True:
        if conn.recv() is None:
            return
        notice = encode_notice(EnvironmentCommand.STEP, index, 1, time.monotonic(), False)
        if kind == "StepQueue":
            StepQueue.post(queue, conn, notice, encode_payload(PAYLOAD))
        else:  # the same bytes as StepQueue.post sends
            queue.put(notice + encode_payload(PAYLOAD))


def measure(kind: str, writers: int, rounds: int) -> float:
    """Round trips per second: a request to every writer, then every notice back."""
    ctx = mp.get_context("fork")
    if kind == "StepQueue":
        step_queue = StepQueue(ctx)
        shared, get = step_queue.writer, step_queue.reader.recv_bytes
    elif kind == "Queue":
        queue = ctx.Queue()
        shared, get = queue, queue.get
    else:
        queue = ctx.SimpleQueue()
        shared, get = queue, queue.get
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
                for _ in pipes:
                    get()
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
