"""What the bench's runners share: the start method, the cores, progress in chunks, lockstep
driving, one factory per env. Imported by the backends, the peers and the unity runners alike."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from envmanager.bench.scenarios import Scenario
from envmanager.core.platforms import default_start_method

__all__ = ["START_METHOD", "Tick", "Progress", "cores", "env_fns", "lockstep"]

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


class Progress:
    """Hands env-steps to ``tick`` in chunks of ~1/50 of a run: a call per step would cost
    more than the step. ``done`` counts them all."""

    def __init__(self, tick: Tick, scenario: Scenario, steps: int) -> None:
        self.tick, self.chunk = tick, max(scenario.n_env, steps // 50)
        self.done = self._reported = 0

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
