"""What the bench's runners share: the start method, the cores, progress in chunks (and the
timed loop's clocks: wall time and the parent's CPU time), lockstep driving, one factory per
env. Imported by the backends, the peers and the unity runners alike."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from envmanager.bench import pinning
from envmanager.core.platforms import default_start_method

if TYPE_CHECKING:  # scenarios imports ``cores`` from here
    from envmanager.bench.scenarios import Scenario

__all__ = ["START_METHOD", "Tick", "Progress", "RunStats", "LAST_RUN", "cores", "worker_cores", "env_fns", "lockstep"]

#: One start method for every backend's workers (gymnasium scenarios), so start-up choices
#: cannot tilt the comparison: the platform's default (``fork`` on Linux, ``spawn`` elsewhere).
START_METHOD = default_start_method()

Tick = Callable[[int], None]


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_cores(scenario: Scenario) -> int:
    """The cores the workers run on: every usable one, or all but the parent's when pinned (at
    most ``scenario.pin_workers`` of them, where it says)."""
    if not scenario.pin:
        return cores()
    return cores() - 1 if scenario.pin_workers is None else min(cores() - 1, scenario.pin_workers)


class RunStats:
    """The last timed loop's clocks: wall seconds, the parent's CPU seconds (every thread of
    this process, none of its children), and for our backends (``None``: a peer) the answers
    the parent took and the seconds it spun waiting for them (CPU a saturated parent, whose
    answers are always ready, would not spend)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_s = 0.0
        self.answers: int | None = None
        self.spun_s: float | None = None


#: What the last ``Progress.stop`` measured (the runner reads it after each backend's run).
LAST_RUN = RunStats()


class Progress:
    """Hands env-steps to ``tick`` in chunks of ~1/50 of a run: a call per step would cost
    more than the step. ``done`` counts them all."""

    def __init__(self, tick: Tick, scenario: Scenario, steps: int) -> None:
        self.tick, self.chunk = tick, max(scenario.n_env, steps // 50)
        self.done = self._reported = 0
        self._start = self._cpu = 0.0
        #: Our backends set it: their manager's worker pool (it counts answers and spins).
        self.pool: Callable[[], Any] | None = None
        self._answers, self._spun = 0, 0.0

    def start(self) -> float:
        """The timed loop starts: pin (the pinned scenarios), start the clocks; the wall clock."""
        pinning.pin_for_timing()
        LAST_RUN.__init__()  # type: ignore[misc]
        pool = self.pool() if self.pool else None
        self._answers, self._spun = (pool.answers, pool.spun_s()) if pool is not None else (0, 0.0)
        self._cpu = time.process_time()
        self._start = time.perf_counter()
        return self._start

    def stop(self) -> float:
        """The timed loop ended: its wall seconds (the parent's CPU seconds in ``LAST_RUN``)."""
        elapsed = time.perf_counter() - self._start
        LAST_RUN.cpu_s = time.process_time() - self._cpu
        LAST_RUN.seconds = elapsed
        pool = self.pool() if self.pool else None
        if pool is not None:
            LAST_RUN.answers, LAST_RUN.spun_s = pool.answers - self._answers, pool.spun_s() - self._spun
        return elapsed

    def add(self, n: int) -> None:
        self.done += n
        if self.done - self._reported >= self.chunk:
            self.tick(self.done - self._reported)
            self._reported = self.done

    def close(self) -> None:
        self.tick(self.done - self._reported)
        self._reported = self.done


def lockstep(step: Callable[[dict[int, Any]], list], table: list[dict[int, Any]], n: int, rounds: int,
             progress: Progress) -> None:
    """Drive a first-ready ``step(actions) -> finished`` in lockstep: every round sends all
    ``n`` actions, then waits until all ``n`` came back."""
    nothing: dict[int, Any] = {}
    for k in range(rounds):
        got = len(step(table[k % len(table)]))
        while got < n:
            got += len(step(nothing))
        progress.add(n)


def env_fns(scenario: Scenario) -> list[Callable[[], Any]]:
    return [functools.partial(scenario.factory, i) for i in range(scenario.n_env)]
