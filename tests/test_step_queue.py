"""The parent's wait on the step queue: spin, then block, and back off from spinning when the
spins catch nothing (a spin that never catches an answer only burns the parent's core)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

from envmanager.wire.step_queue import MAX_SPIN_SKIP, StepQueue, write_frame


class CountingPoller:
    """``select.poll`` that counts the waits that spun (more than one ``poll(0)`` in a wait)."""

    def __init__(self, poller):
        self.poller, self.zero_polls, self.blocking_polls = poller, 0, 0

    def poll(self, timeout_ms):
        if timeout_ms == 0:
            self.zero_polls += 1
        else:
            self.blocking_polls += 1
        return self.poller.poll(timeout_ms)


def make_queue(spin_s: float) -> tuple[StepQueue, CountingPoller]:
    queue = StepQueue(mp.get_context("fork"))
    queue.watch([], [])
    queue.spin_s = spin_s
    counter = CountingPoller(queue._poller)
    queue._poller = counter
    return queue, counter


def spun(counter: CountingPoller, wait) -> bool:
    before = counter.zero_polls
    wait()
    return counter.zero_polls - before > 1  # the first poll(0) only looks


def test_spins_that_catch_nothing_back_off_to_blocking():
    queue, counter = make_queue(spin_s=200e-6)
    try:
        spins = [spun(counter, lambda: queue.wait(0.001)) for _ in range(200)]
        assert queue.wait(0.001) == [] and counter.blocking_polls == 201  # every wait ended blocked
        # back-off 1, 2, 4, ... up to MAX_SPIN_SKIP (64) waits between spins
        assert MAX_SPIN_SKIP == 64
        assert [i for i, s in enumerate(spins) if s] == [0, 2, 5, 10, 19, 36, 69, 134, 199]
    finally:
        queue.reader.close()
        queue.writer.close()


def test_a_spin_that_catches_an_answer_ends_the_back_off():
    queue, counter = make_queue(spin_s=100e-6)
    try:
        assert [spun(counter, lambda: queue.wait(0.001)) for _ in range(5)] == [True, False, True, False, False]
        # the back-off is now 4 waits; a spin that catches an answer resets it to 1
        queue.spin_s = 5.0  # long enough for the answer below, whatever the load
        timer = threading.Timer(0.01, write_frame, (queue.writer.fileno(), b"x"))
        timer.start()
        assert spun(counter, lambda: queue.wait(10.0))
        timer.join()
        assert os.read(queue.reader.fileno(), 64) == b"\x00\x00\x00\x01x"  # the frame (big-endian length), read off
        queue.spin_s = 100e-6
        # the next failed spin skips one wait only (with the back-off of 4 kept it would skip 4)
        assert [spun(counter, lambda: queue.wait(0.001)) for _ in range(3)] == [True, False, True]
    finally:
        queue.reader.close()
        queue.writer.close()
