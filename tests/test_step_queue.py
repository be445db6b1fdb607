"""The parent's wait on the step queue: spin, then block, and back off from spinning when the
spins catch nothing (a spin that never catches an answer only burns the parent's core). Tested
against a fake clock and a fake poller, never the machine's: the back-off is a rule about what
spins caught, not about time."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from envmanager.wire.spin import MAX_SPIN_SKIP, MIN_SIZED_S, SpinPolicy
from envmanager.wire.step_queue import StepQueue, write_frame


class FakeClock:
    """A clock (ns) that moves ``step`` every time it is read."""

    def __init__(self, step: int = 10_000) -> None:
        self.now, self.step = 0, step

    def __call__(self) -> int:
        self.now += self.step
        return self.now

    def seconds(self) -> float:
        return self() * 1e-9


class FakePoller:
    """``select.poll`` that answers from a script: ``ready_after`` zero-timeout polls, then an
    event on the queue; counts zero polls and blocking polls (with their timeouts)."""

    def __init__(self, fd: int, clock: FakeClock | None = None) -> None:
        self.fd, self.zero_polls, self.blocking = fd, 0, []
        self.ready_after: int | None = None
        self.clock = clock  # a blocking poll lets its timeout pass on it

    def poll(self, timeout_ms):
        if timeout_ms == 0:
            self.zero_polls += 1
            if self.ready_after is not None:
                self.ready_after -= 1
                if self.ready_after < 0:
                    self.ready_after = None
                    return [(self.fd, 1)]
            return []
        self.blocking.append(timeout_ms)
        if self.clock is not None:
            self.clock.now += timeout_ms * 1_000_000
        return []


def make_queue(spin_s: float) -> tuple[StepQueue, FakePoller]:
    queue = StepQueue(mp.get_context("fork"))
    queue.watch([], [])
    queue.set_spin(spin_s)
    queue.clock = clock = FakeClock()
    poller = FakePoller(queue.reader.fileno(), clock)
    queue._poller = poller
    return queue, poller


def close(queue: StepQueue) -> None:
    queue.reader.close()
    queue.writer.close()


def spun(poller: FakePoller, wait) -> bool:
    before = poller.zero_polls
    wait()
    return poller.zero_polls - before > 1  # the first poll(0) only looks


def test_spin_policy_backs_off_after_spins_that_catch_nothing():
    clock = FakeClock()
    policy = SpinPolicy(200e-6, clock=clock.seconds)
    looks = []

    def never() -> bool:
        looks.append(1)
        return False

    spins = []
    for _ in range(200):
        before = len(looks)
        policy.spin(never, 1.0)
        spins.append(len(looks) - before > 1)
    # back-off 1, 2, 4, ... up to MAX_SPIN_SKIP (64) waits between spins
    assert MAX_SPIN_SKIP == 64
    assert [i for i, s in enumerate(spins) if s] == [0, 2, 5, 10, 19, 36, 69, 134, 199]


def test_spin_policy_a_catch_ends_the_back_off_and_ready_at_once_costs_nothing():
    clock = FakeClock()
    policy = SpinPolicy(100e-6, clock=clock.seconds)
    assert not policy.spin(lambda: False, 1.0)  # the back-off is now 1 wait, then 2
    assert policy.budget() == (0.0, False)  # the skipped wait (the floor: no spin)
    assert not policy.spin(lambda: False, 1.0)  # back-off 2 next
    answers = iter([False, False, True])
    assert policy.spin(lambda: True, 1.0)  # ready at once: no spin, the back-off untouched
    assert policy.budget() == (0.0, False) and policy.budget() == (0.0, False)  # the 2 skips
    assert policy.spin(lambda: next(answers), 1.0)  # a full spin that catches: back-off 1
    assert not policy.spin(lambda: False, 1.0)
    assert policy.budget() == (0.0, False)
    assert policy.budget() == (100e-6, True)  # one skip only: the catch reset it


def test_spin_policy_floor_and_limit():
    clock = FakeClock(step=1_000)  # 1 us per read
    policy = SpinPolicy(100e-6, floor_s=20e-6, clock=clock.seconds)
    looks = []
    policy.spin(lambda: looks.append(1) and False, 1.0)  # a full spin: ~100 looks
    assert 90 <= len(looks) <= 110
    looks.clear()
    policy.spin(lambda: looks.append(1) and False, 1.0)  # backing off: the floor, ~20 looks
    assert 15 <= len(looks) <= 25
    looks.clear()
    policy = SpinPolicy(100e-6, clock=clock.seconds)
    policy.spin(lambda: looks.append(1) and False, 10e-6)  # the caller's limit cuts it
    assert len(looks) <= 12


def test_the_queue_spins_then_blocks_and_stops_spinning_where_waits_outlast_its_spin():
    queue, poller = make_queue(spin_s=200e-6)
    try:
        spins = [spun(poller, lambda: queue.wait(0.001)) for _ in range(20)]
        # The first wait spins 200 us, then blocks its 1 ms: waits take longer than twice the
        # spin allowed, so the next ones block at once (a wake-up costs little next to them).
        assert [i for i, s in enumerate(spins) if s] == [0]
        assert queue.spin is not None and queue.spin.typical is not None and queue.spin.typical >= 1e-3
        assert len(poller.blocking) == 20 and all(ms == 1 for ms in poller.blocking)  # every wait ended blocked
    finally:
        close(queue)
    queue, poller = make_queue(spin_s=200e-6)
    try:
        poller.ready_after = 3  # the spin catches an answer on its fourth look
        assert queue.wait(1.0) == [] and queue._readable  # the spin caught it; not an ended process
        assert poller.zero_polls == 4 and not poller.blocking  # no block
    finally:
        close(queue)


def test_the_queue_answers_at_once_without_spinning_and_reads_only_what_poll_saw():
    queue, poller = make_queue(spin_s=200e-6)
    try:
        poller.ready_after = 0
        assert queue.wait(1.0) == [] and poller.zero_polls == 1 and not poller.blocking
        write_frame(queue.writer.fileno(), b"")  # a wake-up: an empty frame, no answer
        assert queue.take() == []
        assert queue.wait(0.0) == [] and not queue._readable
        write_frame(queue.writer.fileno(), b"")
        assert queue.take() == []  # not read: the last poll did not see it readable
        assert queue.take(everything=True) == []  # read (and dropped: a wake-up)
    finally:
        close(queue)


def test_a_sized_spin_covers_twice_the_typical_wait_at_least_its_minimum_and_does_not_back_off():
    policy = SpinPolicy(2e-3, floor_s=20e-6, clock=FakeClock(step=1_000).seconds, sized=True)
    assert policy.budget() == (2e-3, True)  # no wait seen yet: the cap
    for _ in range(60):
        policy.waited(30e-6)
    assert policy.budget() == (pytest.approx(MIN_SIZED_S), True)  # twice 30 us is below the minimum
    for _ in range(60):
        policy.waited(400e-6)
    assert policy.budget()[0] == pytest.approx(2 * 400e-6, rel=0.01)
    policy.caught(False)  # a late message: no back-off, the next wait spins as long
    assert policy.budget()[0] == pytest.approx(2 * 400e-6, rel=0.01)
    for _ in range(60):
        policy.waited(5e-3)  # waits longer than half the cap: a wake-up costs little next to them
    assert policy.budget() == (20e-6, True)  # the floor only
