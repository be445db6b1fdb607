"""The parent's half of a rollout fragment (``envmanager.sampler.rollout`` is the worker's):
what a request in flight is read against, a slot's rows taken from the answer or out of the
arena, and those rows as a ``TransitionBatch`` stamped with policy and env versions."""

from __future__ import annotations

import mmap
from typing import Any, NamedTuple

import numpy as np

from envmanager.core.calls import CallRequest
from envmanager.sampler.batches import TransitionBatch, info_columns
from envmanager.sampler.rollout import ARENAS, FIELDS, Arena
from envmanager.wire import shm

__all__ = ["SentFragment", "answer_rows", "arena_rows", "fragment_batch", "fill_agent_infos", "release_arena"]


class SentFragment(NamedTuple):
    """A fragment request in flight on one process, and what the answer is read against."""

    call: CallRequest
    policy_version: int
    env_before: list[int]  # each slot's env version when sent: that of an episode going on
    env_reached: list[int]  # ... and what episodes started in the fragment have


def answer_rows(arrays: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    """The first ``n`` rows of the ``i``-th slot of a process, from an answer that carried them."""
    return {f: shm.tree_map(lambda a: a[i, :n], arrays[f]) for f in FIELDS}


def arena_rows(arena: Arena, s: int, n: int) -> dict[str, Any]:
    """The first ``n`` rows of slot ``s``, copied out of the shared arena."""
    return {f: shm.tree_map(lambda a: a[s, :n].copy(), getattr(arena, f)) for f in FIELDS}


def fragment_batch(s: int, fields: dict[str, Any], infos: dict[str, np.ndarray] | None, env_infos: list[dict] | None,
                   env_versions: dict[int, int], sent: SentFragment, i: int, running: int) -> TransitionBatch:
    """Rows (at least one) of slot ``s``, the ``i``-th of its process, as a batch. The episode
    ``running`` when sent (-1: none) has the env version it started with; new ones what they
    applied (``env_reached`` if unknown), looked up once per run of equal ids."""
    n = len(fields["rewards"])
    ids = fields["episodes"]
    firsts = np.concatenate(([0], np.flatnonzero(ids[1:] != ids[:-1]) + 1))
    per_run = [sent.env_before[i] if e == running else env_versions.get(e, sent.env_reached[i]) for e in ids[firsts].tolist()]
    versions = np.repeat(np.array(per_run, dtype=np.int64), np.diff(np.append(firsts, n)))
    return TransitionBatch(
        observations=fields["observations"], actions=fields["actions"], rewards=fields["rewards"],
        terminated=fields["terminated"], truncated=fields["truncated"], next_observations=fields["next_observations"],
        worker_ids=np.full(n, s, dtype=np.int64), episode_ids=ids.astype(np.int64, copy=False),
        policy_versions=np.full(n, sent.policy_version, dtype=np.int64), env_versions=versions,
        interrupted=np.zeros(n, dtype=bool), valid=np.ones(n, dtype=bool), agent_infos=infos or {},
        env_infos=info_columns(env_infos) if env_infos else {},
    )


def fill_agent_infos(chunk: TransitionBatch, template: dict[str, np.ndarray]) -> None:
    """Agent infos for rows recovered from a dead worker: each key of ``template``, filled with
    NaN (floats) or 0."""
    chunk.agent_infos = {k: np.full((len(chunk), *v.shape[1:]), np.nan if v.dtype.kind == "f" else 0, dtype=v.dtype)
                         for k, v in template.items()}


def release_arena(token: str, mapping: mmap.mmap) -> None:
    """Forget an arena and close its mapping (from ``close`` or when the sampler is collected)."""
    ARENAS.pop(token, None)
    try:
        mapping.close()
    except BufferError:  # a view still alive somewhere: the mapping goes with it
        pass

