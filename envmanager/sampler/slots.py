"""One record per env slot: the episode it runs, changed only by core events.

garage's workers own their episodes; Sample Factory keeps one state per env. Here each sampler
keeps one :class:`EpisodeSlots` (the Ray node runs a ``Sampler``, so it keeps one too), and
every fault reaches a record through one of three events (drawn in ``docs/architecture.md``)::

    NONE ──start──► STARTING ──reset answered──► READY ──step sent──► STEPPING
      ▲                                            ▲                      │
      │                                            └──── step answered ───┘
      │             (worker-side sampler: RUNNING, the worker steps it fragment by fragment)
      │
      └── closed as ENDED  (terminated or truncated)
                    CUT    (an answer from a newer process generation: the process was
                            replaced, the episode's rows are kept and flagged)
                    FAILED (an error no restart absorbed: restarts off, or past the limits)

Episode ids are the parent's, given before an episode starts: the ``k``-th episode started on
slot ``s`` of ``n`` is ``k * n + s``, whichever process generation runs it, so no id spans two
env episodes and ids do not depend on the order answers arrive in. What a restarted process
needs again is replayed from here: its slots' first seeds only if no episode used them yet,
and every env update in order (a fresh env starts at env version 0; the updates are the
sampler's ``UpdateLog``, ``envmanager.core.updates``).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from envmanager.errors import InvalidInputError
from envmanager.sampler.batches import Step
from envmanager.sampler.stats import Stats

logger = logging.getLogger(__name__)

__all__ = ["EpisodeState", "Outcome", "EpisodeSlot", "EpisodeSlots", "EpisodeIds", "failed_slots"]


class EpisodeState(enum.Enum):
    NONE = "none"  # no episode: the next one may start
    STARTING = "starting"  # admitted, id given; env updates and reset on their way
    READY = "ready"  # observation in hand, no step in flight
    STEPPING = "stepping"  # a step in flight
    RUNNING = "running"  # stepped inside the worker (worker-side policy)


class Outcome(enum.Enum):
    ENDED = "ended"
    CUT = "cut"
    FAILED = "failed"
    DISCARDED = "discarded"  # let go unrecorded by the sampler (exact episodes start afresh)


@dataclass
class EpisodeSlot:
    """Everything about one slot's episode (see the module doc)."""

    slot: int
    seed: int | None = None  # the first reset's seed, until an episode used it
    state: EpisodeState = EpisodeState.NONE
    episode_id: int = -1
    started: int = 0  # episodes started on this slot so far
    generation: int = 0  # the process generation the slot's env lives in
    env_version: int = 0  # env updates applied to that env
    recording: bool = False  # admitted by the current collection call
    # Parent-side policy: the observation to act on, the step in flight, the steps recorded.
    observation: Any = None
    sent: tuple[Any, Any, dict[str, Any], int] | None = None  # (observation, action, agent info, policy version)
    steps: list[Step] = field(default_factory=list)


class EpisodeIds(NamedTuple):
    """How a sampler numbers its episodes: the ``k``-th on slot ``s`` is ``k * stride + offset
    + s`` (``stride`` defaults to the number of slots), ``k`` counting on from ``started[s]``.
    A Ray node numbers its slots from its offset among all slots, and a restarted node goes on
    from what the driver saw."""

    offset: int = 0
    stride: int | None = None
    started: Sequence[int] | None = None


class EpisodeSlots:
    """The records of ``n`` slots and the episodes cut so far."""

    def __init__(self, seeds: Sequence[int | None], stats: Stats, ids: EpisodeIds = EpisodeIds()) -> None:
        self.n = len(seeds)
        self.stats = stats
        started = list(ids.started) if ids.started is not None else [0] * self.n
        if len(started) != self.n:
            raise InvalidInputError(f"expected {self.n} episode counts, got {len(started)}")
        self.slots = [EpisodeSlot(i, seed, started=int(k)) for i, (seed, k) in enumerate(zip(seeds, started, strict=True))]
        self.id_offset = ids.offset
        self.id_stride = self.n if ids.stride is None else ids.stride
        #: Ids of the episodes a process restart cut, in the order seen.
        self.cut_episodes: list[int] = []

    def __getitem__(self, slot: int) -> EpisodeSlot:
        return self.slots[slot]

    def __iter__(self) -> Iterator[EpisodeSlot]:
        return iter(self.slots)

    def in_state(self, *states: EpisodeState) -> list[int]:
        return [r.slot for r in self.slots if r.state in states]

    # ------------------------------------------------------------------------------------------
    # Episodes

    def next_id(self, slot: int) -> int:
        """The id the slot's next episode gets."""
        return self.slots[slot].started * self.id_stride + self.id_offset + slot

    def start(self, slot: int, recording: bool, state: EpisodeState = EpisodeState.STARTING) -> int:
        """An episode starts on ``slot`` (admitted by this call when ``recording``): its id."""
        record = self.slots[slot]
        assert record.state is EpisodeState.NONE, f"slot {slot} already runs episode {record.episode_id}"
        record.episode_id = self.next_id(slot)
        record.started += 1
        record.state, record.recording = state, recording
        record.observation, record.sent, record.steps = None, None, []
        self.stats.count("episodes_started")
        return record.episode_id

    def advanced(self, slot: int, started: int, running: int) -> None:
        """Worker-side: a fragment started ``started`` episodes on ``slot`` (ids in order from
        ``next_id``) and ``running`` goes on (-1: none)."""
        record = self.slots[slot]
        record.started += started
        if started:
            record.seed = None
            self.stats.count("episodes_started", started)
        if running >= 0:
            record.state, record.episode_id, record.recording = EpisodeState.RUNNING, running, True
        else:
            record.state, record.recording = EpisodeState.NONE, False

    def take_seed(self, slot: int) -> int | None:
        """The seed for the slot's next reset, used once."""
        record = self.slots[slot]
        seed, record.seed = record.seed, None
        return seed

    def close(self, slot: int, outcome: Outcome) -> list[Step]:
        """The slot's episode is over: ``ENDED``, ``CUT`` (listed, counted) or ``FAILED``
        (counted, its recorded steps dropped and counted). Returns the steps recorded."""
        record = self.slots[slot]
        steps = record.steps
        if record.state is EpisodeState.NONE:
            return []
        if outcome is Outcome.CUT:
            for step in steps:
                step.interrupted = True
            self.cut_episodes.append(record.episode_id)
            self.stats.count("interrupted_episodes")
        elif outcome is Outcome.DISCARDED:
            self.stats.count("discarded_episodes")
        elif outcome is Outcome.FAILED:
            self.stats.count("failed_episodes")
            if steps:
                self.stats.count("dropped_steps", len(steps))
            steps = []
        record.state, record.recording = EpisodeState.NONE, False
        record.observation, record.sent, record.steps = None, None, []
        return steps

    def replaced(self, slot: int, generation: int) -> bool:
        """The core's event: the slot's process is now ``generation``. A newer one has fresh
        envs: the running episode is cut and every env update is due again. Returns whether
        the generation changed."""
        record = self.slots[slot]
        if generation == record.generation:
            return False
        record.generation, record.env_version = generation, 0
        return True

    # ------------------------------------------------------------------------------------------
    # Env versions (the updates themselves are in the sampler's ``UpdateLog``)

    def applied(self, slot: int, version: int) -> None:
        """The slot's env has every update up to ``version``."""
        record = self.slots[slot]
        record.env_version = max(record.env_version, version)


def failed_slots(error: BaseException) -> list[int]:
    """The slots an envmanager error names (every slot of a process given up)."""
    ids = getattr(error, "worker_ids", None)
    if ids:
        return [int(s) for s in ids]
    slot = getattr(error, "worker_id", None)
    return [int(slot)] if isinstance(slot, int) and slot >= 0 else []

