"""Collection goals: which episodes a sampler call admits, and when it is done.

The rule that keeps exact-episode sampling unbiased: whether an episode counts is decided when
it **starts** (by a quota per env slot), never by when it ends. An episode cut by a worker
restart fills its admission (kept, flagged), unless it was cut before its first step: nothing
of it was seen, so its admission is given back (counted). Results come in (worker, admission) order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from envmanager.sampler.batches import Step

__all__ = ["Goal", "EpisodeQuotas", "SampleCount", "StepCount", "spread"]


def spread(n: int, n_workers: int) -> list[int]:
    """``n`` episodes as per-slot quotas, fixed before collection starts (round robin)."""
    return [n // n_workers + (1 if i < n % n_workers else 0) for i in range(n_workers)]


class Goal:
    """What one collection call wants: the sampler asks ``admit`` when a slot could start an
    episode, ``step_budget`` before it sends steps, and reports every recorded episode's end."""

    record_partial = False  # hand out the steps of episodes still running when done (obtain_steps)

    def __init__(self, n_workers: int) -> None:
        self.episodes: list[list[tuple[list[Step], bool]]] = [[] for _ in range(n_workers)]
        self.empty_cut = 0  # admitted episodes cut before their first step

    def admit(self, slot: int) -> bool:
        """Start (and record) an episode on ``slot`` now? Decided once, at its start."""
        raise NotImplementedError

    def step_budget(self, in_flight: int) -> int | None:
        """How many more steps may be sent (``None``: no limit)."""
        return None

    def recorded_step(self, slot: int) -> None:
        """An admitted episode recorded a step."""

    def finished(self, slot: int, steps: list[Step], interrupted: bool) -> None:
        """An admitted episode ended (or was cut, ``interrupted``); one cut before its first
        step is only counted (``empty_cut``)."""
        if interrupted and not steps:
            self.empty_cut += 1
            return
        self.episodes[slot].append((steps, interrupted))

    def done(self) -> bool:
        raise NotImplementedError

    def progress(self) -> tuple[int, int, str]:
        """``(done, total, unit)`` for a progress bar."""
        raise NotImplementedError


class EpisodeQuotas(Goal):
    """Exactly ``quotas[slot]`` episodes per slot, each started during this call."""

    def __init__(self, quotas: Sequence[int]) -> None:
        super().__init__(len(quotas))
        self.quotas = list(quotas)
        self.admitted = [0] * len(quotas)

    def admit(self, slot: int) -> bool:
        if self.admitted[slot] >= self.quotas[slot]:
            return False
        self.admitted[slot] += 1
        return True

    def finished(self, slot: int, steps: list[Step], interrupted: bool) -> None:
        if interrupted and not steps:  # cut before its first step: admitted again
            self.admitted[slot] -= 1
        super().finished(slot, steps, interrupted)

    def done(self) -> bool:
        return all(len(e) == q for e, q in zip(self.episodes, self.quotas, strict=True))

    def progress(self) -> tuple[int, int, str]:
        return sum(len(e) for e in self.episodes), sum(self.quotas), "episodes"


class SampleCount(Goal):
    """garage's ``obtain_samples``: whole episodes until at least ``num_samples`` steps. An
    episode is admitted while finished plus running admitted steps (``running()``) stay below it."""

    def __init__(self, n_workers: int, num_samples: int, running: Callable[[], int]) -> None:
        super().__init__(n_workers)
        self.num_samples = num_samples
        self.running = running
        self.steps = 0  # steps of finished episodes
        self.active: set[int] = set()

    def admit(self, slot: int) -> bool:
        if self.steps + self.running() >= self.num_samples:
            return False
        self.active.add(slot)
        return True

    def finished(self, slot: int, steps: list[Step], interrupted: bool) -> None:
        super().finished(slot, steps, interrupted)
        self.steps += len(steps)
        self.active.discard(slot)

    def done(self) -> bool:
        return self.steps >= self.num_samples and not self.active

    def progress(self) -> tuple[int, int, str]:
        return min(self.steps, self.num_samples), self.num_samples, "steps"


class StepCount(Goal):
    """Exactly ``n`` transitions; episodes still running at the end continue in the next call."""

    record_partial = True

    def __init__(self, n_workers: int, n: int) -> None:
        super().__init__(n_workers)
        self.n = n
        self.recorded = 0

    def admit(self, slot: int) -> bool:
        return self.recorded < self.n

    def step_budget(self, in_flight: int) -> int | None:
        return self.n - self.recorded - in_flight

    def recorded_step(self, slot: int) -> None:
        self.recorded += 1

    def done(self) -> bool:
        return self.recorded >= self.n

    def progress(self) -> tuple[int, int, str]:
        return self.recorded, self.n, "steps"
