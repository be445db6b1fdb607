"""What the sampler hands a learner: ``TransitionBatch`` (one row per transition, numpy arrays;
named apart from the core's ``StepBatch``) and ``EpisodeBatch`` (whole episodes, contiguous).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from envmanager.wire import shm

__all__ = ["TransitionBatch", "EpisodeBatch", "stack_values"]

# Fields with one row per transition (``agent_infos`` / ``env_infos`` are dicts of such arrays).
ROW_FIELDS = (
    "observations", "actions", "rewards", "terminated", "truncated", "next_observations",
    "worker_ids", "episode_ids", "policy_versions", "env_versions", "interrupted", "valid",
)


def stack_values(values: Sequence[Any]) -> Any:
    """Stack per-step values into one array (dicts and tuples of arrays stay trees)."""
    if not values:
        return np.zeros((0,))
    first = values[0]
    if isinstance(first, dict):
        return {k: stack_values([v[k] for v in values]) for k in first}
    if isinstance(first, tuple):
        return tuple(stack_values([v[i] for v in values]) for i in range(len(first)))
    return np.stack([np.asarray(v) for v in values])


def _objects(values: Sequence[Any]) -> np.ndarray:
    """An object array holding ``values`` as they are, one per row."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _stack_or_objects(values: Sequence[Any]) -> Any:
    """Env infos come in any shape: stacked when they can be, else an object array."""
    try:
        return stack_values(values)
    except (ValueError, TypeError, KeyError, IndexError):
        return _objects(values)


def info_columns(infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Env infos (one dict per row) as columns, none dropped: a key only some rows have
    (``info["episode"]`` on an episode's last step) is an object array, ``None`` elsewhere."""
    keys = sorted(set().union(*infos)) if infos else []
    return {k: _stack_or_objects([i[k] for i in infos]) if all(k in i for i in infos) else _objects([i.get(k) for i in infos])
            for k in keys}


def take_rows(value: Any, index: Any) -> Any:
    """``value[index]`` of every array in a tree of dicts and tuples."""
    return shm.tree_map(lambda a: a[index], value)


def _cat(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return {k: _cat([v[k] for v in values]) for k in first}
    if isinstance(first, tuple):
        return tuple(_cat([v[i] for v in values]) for i in range(len(first)))
    return np.concatenate(values)


def _cat_common(dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The keys every batch has, concatenated (a batch without a key drops it: infos vary)."""
    return {k: _cat([d[k] for d in dicts]) for k in dicts[0] if all(k in d for d in dicts)}


def _cat_infos(dicts: Sequence[dict[str, Any]], lengths: Sequence[int]) -> dict[str, Any]:
    """Env infos of batches of ``lengths`` rows, every key kept: concatenated where every batch
    has it alike, else an object array of its rows (``None`` for those of a batch without it)."""
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for d in dicts for k in d):
        if all(k in d for d in dicts):
            try:
                out[k] = _cat([d[k] for d in dicts])
                continue
            except (ValueError, TypeError, KeyError, IndexError):  # stacked in one, objects in another
                pass
        out[k] = _objects([take_rows(d[k], i) if k in d else None for d, n in zip(dicts, lengths, strict=True) for i in range(n)])
    return out


@dataclasses.dataclass
class TransitionBatch:
    """Transitions, one row each. ``next_observations``: the observation a step led to (the
    final one at an episode's end); ``policy_versions`` / ``env_versions``: the versions that
    produced the step; ``interrupted``: its episode was cut by a worker restart; ``valid``:
    ``False`` for steps a ``LearnerFeed`` masked as too stale.
    """

    observations: Any
    actions: Any
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    next_observations: Any
    worker_ids: np.ndarray
    episode_ids: np.ndarray
    policy_versions: np.ndarray
    env_versions: np.ndarray
    interrupted: np.ndarray
    valid: np.ndarray
    agent_infos: dict[str, Any] = dataclasses.field(default_factory=dict)
    env_infos: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def dones(self) -> np.ndarray:
        return self.terminated | self.truncated

    def select(self, index: Any) -> TransitionBatch:
        """The rows ``index`` (a slice, an index array or a boolean mask), as a new batch."""
        values = {f: take_rows(getattr(self, f), index) for f in ROW_FIELDS}
        infos = {"agent_infos": take_rows(self.agent_infos, index), "env_infos": take_rows(self.env_infos, index)}
        return TransitionBatch(**values, **infos)

    def split(self, n: int) -> list[TransitionBatch]:
        """``n`` consecutive pieces of (nearly) equal size: minibatches (fewer, none empty, when
        the batch has fewer than ``n`` rows)."""
        n = max(1, min(n, len(self)))
        bounds = np.linspace(0, len(self), n + 1).astype(int)
        return [self.select(slice(a, b)) for a, b in itertools.pairwise(bounds)]

    @classmethod
    def concatenate(cls, batches: Sequence[TransitionBatch]) -> TransitionBatch:
        """One batch with the rows of ``batches``, in order."""
        if not batches:
            raise ValueError("concatenate needs at least one batch")
        batches = [b for b in batches if len(b)] or list(batches[:1])
        values = {f: _cat([getattr(b, f) for b in batches]) for f in ROW_FIELDS}
        return TransitionBatch(
            **values,
            agent_infos=_cat_common([b.agent_infos for b in batches]),
            env_infos=_cat_infos([b.env_infos for b in batches], [len(b) for b in batches]),
        )

    @classmethod
    def from_steps(cls, steps: Sequence[Step]) -> TransitionBatch:
        """Build a batch from per-step records (see ``Step``)."""
        agent_keys = steps[0].agent_info.keys() if steps else ()
        return cls(
            observations=stack_values([s.observation for s in steps]),
            actions=stack_values([s.action for s in steps]),
            rewards=np.array([s.reward for s in steps], dtype=np.float64),
            terminated=np.array([s.terminated for s in steps], dtype=bool),
            truncated=np.array([s.truncated for s in steps], dtype=bool),
            next_observations=stack_values([s.next_observation for s in steps]),
            worker_ids=np.array([s.worker_id for s in steps], dtype=np.int64),
            episode_ids=np.array([s.episode_id for s in steps], dtype=np.int64),
            policy_versions=np.array([s.policy_version for s in steps], dtype=np.int64),
            env_versions=np.array([s.env_version for s in steps], dtype=np.int64),
            interrupted=np.array([s.interrupted for s in steps], dtype=bool),
            valid=np.ones(len(steps), dtype=bool),
            agent_infos={k: stack_values([s.agent_info[k] for s in steps]) for k in agent_keys},
            env_infos=info_columns([s.env_info for s in steps]),
        )


@dataclasses.dataclass
class Step:
    """One transition as recorded by the sampler, before stacking."""

    observation: Any
    action: Any
    reward: float
    terminated: bool
    truncated: bool
    next_observation: Any
    worker_id: int
    episode_id: int
    policy_version: int
    env_version: int
    agent_info: dict[str, Any]
    env_info: dict[str, Any]
    interrupted: bool = False


@dataclasses.dataclass
class EpisodeBatch(TransitionBatch):
    """Whole episodes, their steps contiguous. ``lengths[i]`` steps belong to episode ``i``;
    ``last_observations[i]`` is its final observation; ``episode_interrupted[i]`` marks an
    episode cut by a worker restart (kept and counted, never dropped)."""

    lengths: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    last_observations: Any = None
    episode_interrupted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def n_episodes(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64) if self.n_episodes else np.zeros(0, np.int64)

    @property
    def returns(self) -> np.ndarray:
        """Undiscounted return of each episode."""
        return np.add.reduceat(self.rewards, self.starts) if self.n_episodes else np.zeros(0)

    def episode(self, i: int) -> EpisodeBatch:
        """Episode ``i`` alone."""
        start = int(self.starts[i])
        rows = TransitionBatch.select(self, slice(start, start + int(self.lengths[i])))
        return EpisodeBatch.from_transitions([rows], [bool(self.episode_interrupted[i])])

    def split_episodes(self) -> list[EpisodeBatch]:
        """One ``EpisodeBatch`` per episode."""
        return [self.episode(i) for i in range(self.n_episodes)]

    def padded(self, field: str, max_length: int | None = None, fill: float = 0) -> np.ndarray:
        """``field`` as an array ``(n_episodes, max_length, ...)``, padded with ``fill``."""
        values = getattr(self, field)
        length = int(self.lengths.max()) if max_length is None and self.n_episodes else (max_length or 0)
        out = np.full((self.n_episodes, length, *values.shape[1:]), fill, dtype=values.dtype)
        for i, (start, n) in enumerate(zip(self.starts.tolist(), self.lengths.tolist(), strict=True)):
            n = min(n, length)
            out[i, :n] = values[start : start + n]
        return out

    @classmethod
    def from_transitions(cls, episodes: Sequence[TransitionBatch], interrupted: Sequence[bool]) -> EpisodeBatch:
        """One batch from per-episode transition batches (each one whole episode)."""
        if not episodes:
            raise ValueError("an EpisodeBatch needs at least one episode")
        flat = TransitionBatch.concatenate(list(episodes))
        lengths = np.array([len(e) for e in episodes], dtype=np.int64)
        last = stack_values([take_rows(e.next_observations, -1) for e in episodes])
        values = {f.name: getattr(flat, f.name) for f in dataclasses.fields(TransitionBatch)}
        return cls(**values, lengths=lengths, last_observations=last, episode_interrupted=np.asarray(interrupted, dtype=bool))

    @classmethod
    def concatenate(cls, batches: Sequence[TransitionBatch]) -> TransitionBatch:
        episode_batches = [b for b in batches if isinstance(b, EpisodeBatch)]
        if batches and len(episode_batches) == len(batches):
            return cls.from_transitions([e for b in episode_batches for e in b.split_episodes()],
                                        [x for b in episode_batches for x in b.episode_interrupted.tolist()])
        return TransitionBatch.concatenate(batches)
