"""The one supervisor of remote work: what a fault of a unit leads to, and when a unit is late.

A **unit** is what runs remote work and can be replaced as a whole: a worker process of the
core's pool (``envmanager.core.pool``), a node of the Ray sampler (``envmanager.ray.nodes``), a
node of Unity players (``envmanager.mlagents.ray_env_manager``). Each pool is an instance of
:class:`Supervisor` and keeps only its transport (pipes and mailboxes, or Ray actors) and its own
start, kill and replay. The supervisor holds, in one place:

- the **decision** after a fault (died, hung, raised): restart — recorded in the one
  :class:`~envmanager.core.restart.RestartPolicy`, logged once, counted once
  (:attr:`Supervisor.restarts`, :meth:`Supervisor.restart_count`) — or give up;
- the **terminal error** of each unit given up (:meth:`Supervisor.give_up`): raised at once on
  every later use (:meth:`Supervisor.check`), past the limits a ``RestartLimitError`` naming the
  unit, with the remote traceback and the cause;
- the **deadline** of each unit's oldest request (a clock per unit; :meth:`Supervisor.overdue`
  names the units past it). The core pool keeps its clocks on its processes, set on the hot path
  without a call here, and asks :meth:`Supervisor.late` only when a deadline can be due.

Core only: no Ray, no processes; the pools call in on faults and for deadlines, never per answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic

from envmanager.core.restart import RestartPolicy
from envmanager.errors import EnvManagerError

logger = logging.getLogger(__name__)

__all__ = ["Supervisor"]


class Supervisor:
    """Restart-or-give-up decisions, terminal errors and request deadlines for numbered units.

    ``policy``: the one restart policy (its ``counts`` are the restart counts); ``timeout``:
    seconds a unit's oldest request may take before the unit counts as hung; ``kind``: what a
    unit is (``"process"``, ``"node"``), for log lines."""

    def __init__(self, policy: RestartPolicy, timeout: float, kind: str = "process") -> None:
        self.policy = policy
        self.timeout = float(timeout)
        self.kind = kind
        self._failures: dict[int, EnvManagerError] = {}  # unit -> its terminal error
        self._clocks: dict[int, float] = {}  # unit -> when its oldest request's clock started

    # ------------------------------------------------------------------------------------------
    # Decisions

    @property
    def restarts(self) -> int:
        """Restarts so far, of every unit (a rebuild of an env in its process is one too)."""
        return sum(self.policy.counts.values())

    def restart_count(self, unit: int) -> int:
        return self.policy.counts.get(unit, 0)

    def refusal(self, unit: int) -> str | None:
        """Why ``unit`` may not be restarted now (restarts off, past a limit), or ``None``."""
        return self.policy.refusal(unit)

    def decide(self, unit: int, event: str, refused: Callable[[str], EnvManagerError]) -> EnvManagerError | None:
        """``unit`` failed: ``None`` if it is to be restarted (recorded, and ``event`` — what
        happened and what is done, as a log line says it — logged here, once), else the error
        to raise: ``refused(reason)``, the pool's own shape of it (``RestartLimitError`` past
        the limits). Giving up is the caller's next step (:meth:`give_up`), as only it knows
        whether the unit can serve on (a process whose env raised, with restarts off, can)."""
        reason = self.refusal(unit)
        if reason is not None:
            return refused(reason)
        self.restarting(unit, event)
        return None

    def restarting(self, unit: int, event: str) -> None:
        """Record a restart of ``unit`` the policy allowed (``refusal`` was ``None``); log ``event``."""
        self.policy.record(unit)
        self._clocks.pop(unit, None)
        logger.warning("%s (restart %d of %s %d)", event, self.policy.counts[unit], self.kind, unit)

    def give_up(self, unit: int, error: EnvManagerError) -> EnvManagerError:
        """``unit`` is given up: ``error`` is raised on every later use of it (:meth:`check`)."""
        self._failures.setdefault(unit, error)
        self._clocks.pop(unit, None)
        return self._failures[unit]

    def failure(self, unit: int) -> EnvManagerError | None:
        """``unit``'s terminal error, if it was given up."""
        return self._failures.get(unit)

    def first_failure(self) -> tuple[int, EnvManagerError] | None:
        """The unit given up first and its error: the one a caller saw first, so the one every
        later use raises again (``None`` while none is)."""
        return next(iter(self._failures.items()), None)

    def check(self, unit: int | None = None) -> None:
        """Raise ``unit``'s terminal error (if ``None``: the first given up's, :meth:`first_failure`)."""
        if unit is not None:
            failure = self._failures.get(unit)
        else:
            first = self.first_failure()
            failure = first[1] if first is not None else None
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------------------------------
    # Deadlines: one clock per unit, for its oldest request in flight

    def start_clock(self, unit: int) -> None:
        """A request was sent to ``unit``: its clock starts unless an older request's runs."""
        self._clocks.setdefault(unit, monotonic())

    def next_clock(self, unit: int, more: bool) -> None:
        """``unit``'s oldest request was answered: the next one's clock starts now (``more``),
        else none runs."""
        if more:
            self._clocks[unit] = monotonic()
        else:
            self._clocks.pop(unit, None)

    def stop_clock(self, unit: int) -> None:
        self._clocks.pop(unit, None)

    def left(self, unit: int) -> float:
        """Seconds before ``unit`` is late (the whole timeout if no request of it is in flight)."""
        started = self._clocks.get(unit)
        return self.timeout if started is None else max(0.0, started + self.timeout - monotonic())

    def soonest(self) -> float:
        """Seconds until the first unit can be late (the whole timeout if none is waited on)."""
        return min((self.left(u) for u in self._clocks), default=self.timeout)

    def overdue(self) -> list[int]:
        """The units whose oldest request missed the deadline, judged now."""
        now = monotonic()
        return sorted(u for u, started in self._clocks.items() if now >= started + self.timeout)

    def late(self, started: float, now: float) -> bool:
        """Whether a request whose clock started at ``started`` is past the deadline at ``now``
        (for a pool that keeps its clocks itself)."""
        return now >= started + self.timeout
