"""The one supervisor of remote work: what a fault of a unit leads to, how often each unit and
env was replaced, and when a unit is late.

A **unit** (a worker process, a Ray sampler node, a node of Unity players) is replaced as a whole
and hosts **slots** (envs). Each pool has one :class:`Supervisor`, which alone decides, counts and
keeps the deadline clocks: see "The supervisor" in docs/architecture.md. Core only: no Ray, no processes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from time import monotonic
from typing import NamedTuple

from envmanager.core.restart import RestartPolicy
from envmanager.errors import EnvManagerError, NodeError, NodeRestartLimitError, RestartLimitError

logger = logging.getLogger(__name__)

__all__ = ["Supervisor", "Fault", "Restart", "Rebuild", "GiveUp", "Decision"]


@dataclass(frozen=True)
class Fault:
    """A fault as its pool saw it: ``error`` (restarts off raise it), ``event`` (a restart's log line),
    whether the unit ``serves`` on (it answered), and ``envs`` that raised, to rebuild in place (if any)."""

    error: EnvManagerError
    event: str
    serves: bool = False
    envs: tuple[int, ...] = ()


class Restart(NamedTuple):
    """Replace the unit; its slots' ``generations`` from now on (the new unit is told them)."""

    generations: tuple[int, ...]


class Rebuild(NamedTuple):
    """Remake the envs of ``slots`` inside their unit; their ``generations`` from now on."""

    slots: tuple[int, ...]
    generations: tuple[int, ...]


class GiveUp(NamedTuple):
    """Raise ``error``; ``given_up``: the unit serves no more (its error on every later use)."""

    error: EnvManagerError
    given_up: bool


Decision = Restart | Rebuild | GiveUp


class Supervisor:
    """Decisions, restart counts, generations, terminal errors and deadline clocks of units.

    ``units``: each unit's slots (``0..n-1`` over all units); ``timeout``: seconds a unit's
    oldest request may take before it is hung; ``kind``: for log lines; ``per_slot``: a quota per
    slot, not per unit (a Unity player, whether it restarts on its node or with it);
    ``generations``: each slot's to go on from (units started in place of lost ones, just now)."""

    def __init__(self, policy: RestartPolicy, timeout: float, units: Sequence[Sequence[int]], kind: str = "process",
                 per_slot: bool = False, generations: Sequence[int] | None = None) -> None:
        self.policy, self.timeout, self.kind, self.per_slot = policy, float(timeout), kind, per_slot
        self.units = [tuple(u) for u in units]
        self._unit_of = {s: u for u, slots in enumerate(self.units) for s in slots}
        #: Per slot: how often its env was replaced (its unit restarted, or itself rebuilt).
        self._generations = list(generations) if generations is not None else [0] * len(self._unit_of)
        #: Per unit: its restarts, rebuilds of its envs included (the unit's quota).
        self._counts = [max((self._generations[s] for s in u), default=0) for u in self.units]
        #: Restarts so far, of every unit: the one count samplers and drop-ins read (the sum, kept).
        self.restarts = sum(self._counts)
        for key in self._keys(range(len(self.units))):
            if self._quota(key):
                policy.record(key)  # restarted just now, with the unit this one replaces
        self._failures: dict[int, EnvManagerError] = {}  # unit -> its terminal error
        #: Per unit: when its oldest request's clock started: written by the pools' hot paths, judged while one is in flight.
        self.clocks = [0.0] * len(self.units)

    # -- decisions -------------------------------------------------------------------------------

    def on_fault(self, unit: int, fault: Fault) -> Decision:
        """``unit`` failed: restart it, rebuild ``fault.envs`` in it (it serves on), or give up,
        within the policy; recorded, counted and logged here, once. A unit that cannot serve on
        (or is past the limits) is given up: :meth:`check` raises its error from now on."""
        rebuild = fault.serves and bool(fault.envs)
        keys = self._keys([unit], fault.envs if rebuild else None)
        reason = next(filter(None, (self.policy.refusal(k, self._quota(k)) for k in keys)), None)
        if reason is not None:
            error, given_up = self._refused(unit, fault.error, reason), not fault.serves or self.policy.enabled
            return GiveUp(self.give_up(unit, error) if given_up else error, given_up)
        slots = fault.envs if rebuild else self.units[unit]
        for key in keys:
            self.policy.record(key)
        self._counts[unit] += 1
        self.restarts += 1
        for s in slots:
            self._generations[s] += 1
        logger.warning("%s (restart %d of %s %d)", fault.event, self._counts[unit], self.kind, unit)
        generations = tuple(self._generations[s] for s in slots)
        return Rebuild(slots, generations) if rebuild else Restart(generations)

    def already(self, unit: int, seen: dict[int, int]) -> Restart | None:
        """If an env of the generations ``seen`` (slot -> generation) was replaced since, the fault was decided: that restart."""
        return Restart(self.generations(unit)) if any(self._generations[s] != g for s, g in seen.items()) else None

    def answered(self, slot: int, generation: int) -> None:
        """An answer says ``slot``'s env is of a newer ``generation``: its unit replaced it itself
        (a Unity player its node's core restarted, on the count its node went on from): counted."""
        known = self._generations[slot]
        if generation > known:
            self._generations[slot] = generation
            self._counts[self._unit_of[slot]] += generation - known
            self.restarts += generation - known
            for key in self._keys([self._unit_of[slot]], (slot,)):
                self.policy.record(key)

    def _keys(self, units: Sequence[int] | range, envs: Sequence[int] | None = None) -> list[int]:
        """The quotas a restart of ``units`` (or a rebuild of ``envs``) counts against."""
        return list(envs or [s for u in units for s in self.units[u]]) if self.per_slot else list(units)

    def _quota(self, key: int) -> int:
        return self._generations[key] if self.per_slot else self._counts[key]

    def _refused(self, unit: int, failure: EnvManagerError, reason: str) -> EnvManagerError:
        """A refused fault's error: with restarts off the failure itself (a node's saying it was
        not restarted, and why); past the limits a ``RestartLimitError`` naming the unit."""
        if isinstance(failure, NodeError):
            if self.policy.enabled:
                return NodeRestartLimitError(reason, failure)
            return NodeError(failure.node, failure.worker_ids, f"{failure.message}; not restarted: {reason}",
                             failure.cause, failure.remote_traceback)
        if not self.policy.enabled:
            return failure
        slots = self.units[unit]
        named = getattr(failure, "worker_id", None)
        return RestartLimitError(named if named in slots else slots[0], reason, failure, slots, unit)

    # -- counts and units given up ---------------------------------------------------------------

    def restart_count(self, unit: int) -> int:
        """How often ``unit`` was restarted or had an env rebuilt (its quota's count)."""
        return self._counts[unit]

    def generation(self, slot: int) -> int:
        """How often ``slot``'s env was replaced: its unit restarted, or itself rebuilt."""
        return self._generations[slot]

    def generations(self, unit: int) -> tuple[int, ...]:
        """The generations of ``unit``'s slots (what a unit started now is told)."""
        return tuple(self._generations[s] for s in self.units[unit])

    def give_up(self, unit: int, error: EnvManagerError) -> EnvManagerError:
        """``unit`` is given up: its first such ``error`` is raised on every later use (returned)."""
        return self._failures.setdefault(unit, error)

    def failure(self, unit: int) -> EnvManagerError | None:
        """``unit``'s terminal error, if it was given up."""
        return self._failures.get(unit)

    def first_failure(self) -> tuple[int, EnvManagerError] | None:
        """The unit given up first and its error (the one every later use raises again)."""
        return next(iter(self._failures.items()), None)

    def check(self, unit: int | None = None) -> None:
        """Raise ``unit``'s terminal error (if ``None``: the first given up's)."""
        failure = self._failures.get(unit) if unit is not None else next(iter(self._failures.values()), None)
        if failure is not None:
            raise failure

    # -- deadlines: one clock per unit, for its oldest request in flight --------------------------

    def start_clock(self, unit: int, now: float | None = None) -> None:
        """``unit``'s oldest request in flight is a new one (sent, or the one ahead answered): its clock starts ``now``."""
        self.clocks[unit] = monotonic() if now is None else now

    def late(self, started: float, now: float) -> bool:
        """Whether a request whose clock started at ``started`` is past the deadline at ``now``."""
        return now >= started + self.timeout

    def left(self, unit: int) -> float:
        """Seconds before ``unit`` (a request in flight) is late."""
        return max(0.0, self.clocks[unit] + self.timeout - monotonic())

    def soonest(self, units: Sequence[int]) -> float:
        """Seconds until the first of ``units`` (requests in flight) can be late (at most the timeout)."""
        return min((self.left(u) for u in units), default=self.timeout)

    def overdue(self, units: Sequence[int]) -> list[int]:
        """Those of ``units`` (requests in flight) whose oldest request missed the deadline, now."""
        now = monotonic()
        return [u for u in units if self.late(self.clocks[u], now)]
