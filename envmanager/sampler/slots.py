"""One record per env slot: the episode it runs, changed only by core events.

Each sampler keeps one :class:`EpisodeSlots`. A record's fields are read-only and every change
is one of its own methods (Sample Factory's ``ActorState``); what numbers, counts or lists an
episode goes through ``EpisodeSlots``, so a cut is one step (``replaced`` closes the episode it
cuts). Episode ids are the parent's: the ``k``-th episode of slot ``s`` of ``n`` is ``k * n + s``,
whichever process generation runs it. A restarted process gets its slots' first seeds only if
no episode used them yet, and every env update again. The states and the three ways an episode
closes (ENDED, CUT, FAILED) are drawn in ``docs/architecture.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from envmanager.errors import InvalidInputError, failed_slots
from envmanager.sampler.batches import Step
from envmanager.sampler.stats import Stats

if TYPE_CHECKING:
    from envmanager.core.batch import BatchEnvManager

__all__ = ["EpisodeState", "Outcome", "EpisodeSlot", "EpisodeSlots", "EpisodeIds", "Closed", "failed_slots", "raise_given_up"]


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


@dataclass(frozen=True, slots=True)
class EpisodeSlot:
    """Everything about one slot's episode (see the module doc); it changes only through its
    own methods (assigning a field raises)."""

    slot: int
    seed: int | None = None  # the first reset's seed, until an episode used it
    state: EpisodeState = EpisodeState.NONE
    episode_id: int = -1
    started: int = 0  # episodes started on this slot so far
    generation: int = 0  # the generation of the slot's env (process restarts + rebuilds)
    env_version: int = 0  # env updates applied to that env
    recording: bool = False  # admitted by the current collection call
    # Parent-side policy: the observation to act on, the step in flight, the steps recorded.
    observation: Any = None
    sent: tuple[Any, Any, dict[str, Any], int] | None = None  # (observation, action, agent info, policy version)
    steps: list[Step] = field(default_factory=list)
    taken: int = 0  # steps of the running episode already handed out (``take_steps``)

    def _set(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def start(self, episode_id: int, recording: bool, state: EpisodeState) -> None:
        """Episode ``episode_id`` starts here (``EpisodeSlots.start`` numbers it)."""
        assert self.state is EpisodeState.NONE, f"slot {self.slot} already runs episode {self.episode_id}"
        self._set(episode_id=episode_id, started=self.started + 1, state=state, recording=recording, observation=None,
                  sent=None, steps=[], taken=0)

    def ready(self, observation: Any) -> None:
        """The slot's reset or step was answered and its episode goes on."""
        self._set(observation=observation, sent=None, state=EpisodeState.READY)

    def step_sent(self, sent: tuple[Any, Any, dict[str, Any], int]) -> None:
        """A step is in flight: ``(observation, action, agent info, policy version)``."""
        self._set(sent=sent, state=EpisodeState.STEPPING)

    def record(self, step: Step) -> None:
        self.steps.append(step)

    def take_steps(self) -> list[Step]:
        """The running episode's steps recorded so far, handed out (it goes on recording)."""
        steps = self.steps
        self._set(steps=[], taken=self.taken + len(steps))
        return steps

    def stop_recording(self) -> int:
        """The running episode goes on unrecorded; returns how many steps it drops."""
        dropped = len(self.steps)
        self._set(recording=False, steps=[])
        return dropped

    def advanced(self, started: int, running: int) -> None:
        """Worker-side: a fragment started ``started`` episodes here and ``running`` goes on (-1: none)."""
        runs = running >= 0
        self._set(started=self.started + started, seed=None if started else self.seed, recording=runs,
                  state=EpisodeState.RUNNING if runs else EpisodeState.NONE, episode_id=running if runs else self.episode_id)

    def take_seed(self) -> int | None:
        """The seed for the slot's next reset, used once."""
        seed = self.seed
        self._set(seed=None)
        return seed

    def close(self, outcome: Outcome) -> Closed:
        """The episode is over: its steps flagged if ``CUT``, dropped if ``FAILED``."""
        if self.state is EpisodeState.NONE:
            return Closed(-1, [], False, outcome)
        steps = self.steps
        if outcome is Outcome.CUT:
            steps = [replace(step, interrupted=True) for step in steps]
        elif outcome is Outcome.FAILED:
            steps = []
        closed = Closed(self.episode_id, steps, self.recording, outcome, self.taken)
        self._set(state=EpisodeState.NONE, recording=False, observation=None, sent=None, steps=[])
        return closed

    def replaced(self, generation: int | None) -> None:
        """A fresh env of ``generation`` (``None``: its next answer brings it): every update is due again."""
        self._set(generation=self.generation if generation is None else generation, env_version=0)

    def applied(self, version: int) -> None:
        """The slot's env has every update up to ``version``."""
        self._set(env_version=max(self.env_version, version))


class Closed(NamedTuple):
    """An episode a record closed: its id (-1: none was running), the steps it recorded (none
    once ``FAILED``: dropped, counted), whether it was recording, and how it ended."""

    episode_id: int
    steps: list[Step]
    recording: bool
    outcome: Outcome
    taken: int = 0  # steps an earlier call already handed out (obtain_steps)


class EpisodeIds(NamedTuple):
    """How a sampler numbers its episodes: the ``k``-th on slot ``s`` is ``k * stride + offset
    + s`` (``stride`` defaults to the number of slots), ``k`` counting on from ``started[s]``
    (a Ray node's slots among all slots; a restarted node goes on from what the driver saw)."""

    offset: int = 0
    stride: int | None = None
    started: Sequence[int] | None = None


class EpisodeSlots:
    """The records of ``n`` slots, their episode ids and the episodes cut so far."""

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

    def recorded_running(self) -> int:
        """Steps recorded so far by the episodes running and recording (admitted by this call)."""
        return sum(len(r.steps) for r in self.slots if r.recording)

    def next_id(self, slot: int) -> int:
        return self.slots[slot].started * self.id_stride + self.id_offset + slot

    def start(self, slot: int, recording: bool, state: EpisodeState = EpisodeState.STARTING) -> int:
        """An episode starts on ``slot`` (admitted by this call when ``recording``): its id."""
        episode_id = self.next_id(slot)
        self.slots[slot].start(episode_id, recording, state)
        self.stats.count("episodes_started")
        return episode_id

    def stop_recording(self) -> int:
        """A collection call admits its own episodes: those running go on unrecorded, their
        steps nobody took dropped (counted). Returns how many were dropped."""
        dropped = sum(record.stop_recording() for record in self.slots)
        if dropped:
            self.stats.count("dropped_steps", dropped)
        return dropped

    def advanced(self, slot: int, started: int, running: int) -> None:
        """Worker-side: a fragment started ``started`` episodes on ``slot`` (ids in order from
        ``next_id``) and ``running`` goes on (-1: none)."""
        self.slots[slot].advanced(started, running)
        if started:
            self.stats.count("episodes_started", started)

    def close(self, slot: int, outcome: Outcome) -> Closed:
        """The slot's episode is over: ``ENDED``, ``CUT`` (listed, counted), ``FAILED``
        (counted, its recorded steps dropped and counted) or ``DISCARDED``. Returns it."""
        record = self.slots[slot]
        if record.state is not EpisodeState.NONE:
            if outcome is Outcome.CUT:
                self.cut_episodes.append(record.episode_id)
                self.stats.count("interrupted_episodes")
            elif outcome is Outcome.DISCARDED:
                self.stats.count("discarded_episodes")
            elif outcome is Outcome.FAILED:
                self.stats.count("failed_episodes")
                if record.steps:
                    self.stats.count("dropped_steps", len(record.steps))
        return record.close(outcome)

    def replaced(self, slot: int, generation: int | None) -> Closed | None:
        """The slot's env is of ``generation`` (``None``: a fresh one, whose next answer brings
        it). Another than the record's cuts the running episode (``CUT``) and makes every env
        update due again. Returns the cut (``episode_id`` -1 if none ran), or ``None``."""
        if generation == self.slots[slot].generation:
            return None
        closed = self.close(slot, Outcome.CUT)
        self.slots[slot].replaced(generation)
        return closed


def raise_given_up(manager: BatchEnvManager, episodes: EpisodeSlots) -> None:
    """A process the pool gave up on: its error at once on every call of a sampler (the first
    one given up's, the same every time); the episodes on the slots it names failed."""
    failure = manager.first_failure()
    if failure is not None:
        slots = failed_slots(failure) or [s for s in range(manager.n_env) if manager.failure_of(s) is failure]
        for s in slots:
            episodes.close(s, Outcome.FAILED)
        raise failure
