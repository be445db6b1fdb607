"""The worker's half of the worker-side policy: rollout fragments written in place.

A worker process steps all of its envs in lockstep, one batched policy call per tick, and
writes every transition into a *fragment arena* (per slot up to ``capacity`` rows, and a row
count raised after every tick); one CALL answer per fragment announces the rows, with the infos.
Forked workers share the parent's mapping (it reads rows in place, also a killed worker's),
others send private arrays in the answer (``docs/guide/sampler.md``). ``run_local`` runs the
same loop in one process: the bench's reference.
"""

from __future__ import annotations

import mmap
import operator
import os
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from envmanager.core.actions import ActionChecker
from envmanager.core.updates import Due
from envmanager.core.updates import apply as apply_updates
from envmanager.errors import InvalidInputError
from envmanager.sampler.batches import stack_values
from envmanager.wire import shm
from envmanager.wire.marks import CALL, RESET, STEP, mark
from envmanager.wire.messages import Rebuild
from envmanager.worker.envs import ENV_RAISES, Stopped, envs_here, marks_here, remote_exception

__all__ = ["FIELDS", "ArenaSpec", "Arena", "RegisteredFactory", "RolloutRequest", "rollout", "run_local", "capacity_for"]

#: Shared mappings by token, made in the parent before its workers fork (inherited by them).
ARENAS: dict[str, mmap.mmap] = {}
#: The arrays of a fragment, per slot and row.
FIELDS = ("observations", "next_observations", "actions", "rewards", "terminated", "truncated", "episodes")


# ---------------------------------------------------------------------------------------------
# The arena


@dataclass(frozen=True)
class ArenaSpec:
    """What an arena holds: ``n_slots`` x ``capacity`` rows of the given layouts (``shm``'s)."""

    token: str
    n_slots: int
    capacity: int
    observation: Any
    action: Any


class Arena:
    """Arrays ``[n_slots, capacity, ...]`` over one buffer (``rows``: ``[n_slots]``)."""

    def __init__(self, spec: ArenaSpec, buffer: Any) -> None:
        n, c = spec.n_slots, spec.capacity
        offset = 0

        def take(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            nonlocal offset
            arr = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)
            offset += shm._aligned(arr.nbytes)
            return arr

        def build(tree: Any) -> Any:
            if isinstance(tree, dict):
                return {k: build(v) for k, v in tree.items()}
            if isinstance(tree, tuple) and not isinstance(tree, shm._Leaf):
                return tuple(build(v) for v in tree)
            return take((n, c, *tree.shape), np.dtype(tree.dtype))

        self.rows = take((n,), np.int64)
        self.started = take((n,), np.int64)  # episodes each slot started in this fragment
        self.observations = build(spec.observation)
        self.next_observations = build(spec.observation)
        self.actions = build(spec.action)
        self.rewards = take((n, c), np.float64)
        self.terminated = take((n, c), np.bool_)
        self.truncated = take((n, c), np.bool_)
        self.episodes = take((n, c), np.int64)
        self.nbytes = offset

    @staticmethod
    def nbytes_for(spec: ArenaSpec) -> int:
        n, c = spec.n_slots, spec.capacity
        obs, act = shm._leaves(spec.observation), shm._leaves(spec.action)
        arrays = 2 + 2 * len(obs) + len(act) + 4
        per_row = sum(int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
                      for leaf in (*obs, *obs, *act)) + 8 + 1 + 1 + 8
        return 16 * n + n * c * per_row + 64 * (arrays + 1)

    def view(self, first: int, k: int) -> Arena:
        """The rows of slots ``first .. first + k - 1`` (views, not copies)."""
        out = object.__new__(Arena)
        for name in ("rows", "started", *FIELDS):
            setattr(out, name, shm.tree_map(lambda a: a[first:first + k], getattr(self, name)))
        out.nbytes = self.nbytes
        return out


def capacity_for(nbytes: int, n_slots: int, observation: Any, action: Any, most: int = 4096) -> int:
    """Rows per slot that fit in ``nbytes`` (at most ``most``; at least 1)."""
    empty = Arena.nbytes_for(ArenaSpec("", n_slots, 0, observation, action))
    per_slot_row = Arena.nbytes_for(ArenaSpec("", n_slots, 1, observation, action)) - empty
    return int(max(1, min(most, (nbytes - empty) // max(per_slot_row, 1))))


# ---------------------------------------------------------------------------------------------
# The worker's state (per process: a fork copies the parent's, so it is keyed by pid)


@dataclass(slots=True)
class _Slot:
    """The worker's own state of one slot's episode (garage's worker owns its episode): the
    parent books what each fragment reports and commands the rest, and keeps no second copy."""

    obs: Any = None
    running: bool = False
    episode: int = -1  # the running (or last) episode's id, as the parent gave it
    env_version: int = 0

    def rebuilt(self) -> None:
        """A fresh env: no episode, no env update applied."""
        self.obs, self.running, self.env_version = None, False, 0

    def update(self, env: Any, due: Due) -> None:
        self.env_version = apply_updates(env, due, self.env_version)

    def start(self, obs: Any, episode: int) -> None:
        self.obs, self.running, self.episode = obs, True, episode

    def stepped(self, obs: Any, done: bool) -> None:
        """A step of the running episode answered ``obs``; it goes on unless ``done``."""
        self.obs, self.running = obs, self.running and not done

    def stop(self) -> int:
        """The running episode stops here (the parent let it go, or a failure ended it): its id."""
        self.running = False
        return self.episode


class _Process:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.envs: dict[int, Any] = {}
        self.slots: dict[int, _Slot] = {}
        self.agent: tuple[bytes, Any] | None = None  # the payload it was unpickled from, and the agent
        self.arena: tuple[ArenaSpec, int, Arena, bool] | None = None
        self.checker: ActionChecker | None = None


_here: _Process | None = None


def _process() -> _Process:
    global _here
    if _here is None or _here.pid != os.getpid():
        _here = _Process()
    return _here


class RegisteredFactory:
    """The user's env factory, recording each env it makes by slot in its process, so that a
    rollout request can step every env of that process (a restarted process records anew)."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory

    def __call__(self, slot: int) -> Any:
        env = self.factory(slot)
        _process().envs[slot] = env
        return env


# ---------------------------------------------------------------------------------------------
# One fragment


@dataclass(frozen=True, kw_only=True)
class RolloutRequest:
    """One fragment for one process. Per slot (in ``slots`` order): ``steps`` most rows,
    ``starts`` episodes that may start (-1: any), the id its next episode gets (``ids``, then
    ``+ id_stride`` for each one after), whether to let its running episode go, a seed for its
    next reset, and the env updates due before its next episode starts."""

    slots: tuple[int, ...]
    first: int  # row of slots[0] in a shared arena
    spec: ArenaSpec
    shared: bool
    agent: bytes
    steps: tuple[int, ...]
    starts: tuple[int, ...]
    ids: tuple[int, ...]
    id_stride: int
    let_go: tuple[bool, ...]  # what the parent's records do not run, the worker lets go
    seeds: tuple[Any, ...]
    env_updates: tuple[Due, ...]
    generations: tuple[int, ...] = ()  # each slot's env generation in the parent: a newer one is remade here first
    replays: tuple[tuple[str, tuple, dict], ...] = ()  # the core's replayed calls, for an env remade here


def _act(agent: Any, observations: Any, ids: np.ndarray, checker: ActionChecker) -> tuple[Any, dict[str, Any]]:
    """The agent's actions for ``ids``, checked against the action space (as the envs get and
    the arena records them), and its infos."""
    get_actions = getattr(agent, "get_actions", None)
    if get_actions is not None:
        out = get_actions(observations, ids)
    else:
        rows = [agent.get_action(shm.tree_map(operator.itemgetter(j), observations)) for j in range(len(ids))]
        pairs = [r if isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], dict) else (r, {}) for r in rows]
        out = (stack_values([a for a, _ in pairs]), {k: stack_values([i[k] for _, i in pairs]) for k in pairs[0][1]})
    actions, infos = out if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) else (out, {})
    for key, value in infos.items():
        if len(value) != len(ids):
            raise InvalidInputError(f"agent info {key!r} has {len(value)} rows for {len(ids)} envs")
    return checker.batch(actions, ids), infos


def _rows(actions: Any) -> Any:
    """Each env's action: rows of an array (numpy scalars for Discrete: gymnasium checks those
    faster than Python ints), or per-env trees for Dict/Tuple spaces."""
    if not isinstance(actions, (dict, tuple)):
        return actions
    first = actions
    while isinstance(first, (dict, tuple)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return [shm.tree_map(operator.itemgetter(j), actions) for j in range(len(first))]


def rollout(env: Any, request: RolloutRequest) -> dict[str, Any]:
    """Run in a worker (a CALL on its first slot): one fragment of every slot of the process."""
    proc = _process()
    # Keyed by the payload, not the version number: an update may be given a number a worker
    # already holds (``update(..., version=v)`` from a second learner feed), and must act all the same.
    if proc.agent is None or proc.agent[0] != request.agent:
        proc.agent = (request.agent, cloudpickle.loads(request.agent))
    k = len(request.slots)
    if proc.arena is None or proc.arena[:2] != (request.spec, request.first) or proc.arena[3] != request.shared:
        if request.shared:
            arena = Arena(request.spec, ARENAS[request.spec.token]).view(request.first, k)
        else:
            spec = ArenaSpec("", k, request.spec.capacity, request.spec.observation, request.spec.action)
            arena = Arena(spec, bytearray(Arena.nbytes_for(spec)))
        proc.arena = (request.spec, request.first, arena, request.shared)
    if proc.checker is None:
        proc.checker = ActionChecker(proc.envs[request.slots[0]].action_space)
    states = [proc.slots.setdefault(s, _Slot()) for s in request.slots]
    here = envs_here()
    assert here is not None, "a rollout runs in a worker process"
    locals_ = tuple(here.env_ids.index(s) for s in request.slots)
    stale = [i for i, n in enumerate(locals_) if request.generations and request.generations[i] > here.generations[n]]
    if stale:  # they raised, and the supervisor rebuilds them here (anything raised fails the request: a restart)
        none = (None,) * len(stale)
        here.rebuild(Rebuild(tuple(locals_[i] for i in stale), none, none, request.replays,
                             tuple(request.generations[i] for i in stale)))
        for i in stale:
            states[i].rebuilt()
    envs = [proc.envs[s] for s in request.slots]
    out = run_fragment(proc.agent[1], envs, states, proc.arena[2], request, proc.checker)
    out["generations"] = here.stamp(locals_)  # the answer's stamp: its envs' generations
    return out


def run_fragment(agent: Any, envs: list[Any], states: list[_Slot], arena: Arena, request: RolloutRequest,
                 checker: ActionChecker) -> dict[str, Any]:
    """Step ``envs`` in lockstep with ``agent``, writing rows into ``arena``. An env that raises
    ends its slot's part of the fragment, an agent that fails ends it for every slot it acted
    for; either is reported per slot in ``failures``, and the rows written before stay."""
    k = len(envs)
    ids = np.array(request.slots, dtype=np.int64)
    ids.flags.writeable = False  # the agent gets this one array tick after tick (all slots acting)
    arena.rows[:] = 0  # rows written and episodes started per slot: the answer's counts too
    arena.started[:] = 0
    starts = list(request.starts)
    next_ids = list(request.ids)
    failures: dict[int, Any] = {}
    env_raised: list[int] = []  # the failures that are the env's own (the agent's are not)
    cut: dict[int, int] = {}  # slot -> the episode a failure ended
    versions: list[dict[int, int]] = [{} for _ in range(k)]
    infos: list[list[Any] | None] = [None] * k
    # Which env is in which call, for the parent should this process hang or die: one store
    # before each env call, none while the agent acts (``envmanager.wire.marks``).
    record = marks_here()
    words, at = record.words, record.at
    words[at] = 0
    step_marks = [mark(s, STEP) for s in request.slots]
    ticks: list[tuple[int, list[int], dict[str, Any]]] = []
    seeds = list(request.seeds)  # each used once, by the first episode this fragment starts
    for i, st in enumerate(states):
        if request.let_go[i]:  # the parent discarded it (exact episodes start afresh)
            st.stop()

    def ready(i: int, t: int) -> bool:
        """Whether slot ``i``, ``t`` rows in, takes a step this tick (starting an episode if it may)."""
        if t >= request.steps[i] or i in failures:
            return False
        st = states[i]
        if st.running:
            return True
        if starts[i] == 0:
            return False
        resetting = False
        try:
            due = request.env_updates[i]
            if due.updates:
                words[at] = mark(request.slots[i], CALL)  # (named as the rollout)
            st.update(envs[i], due)
            words[at] = mark(request.slots[i], RESET)
            resetting = True
            obs, _ = envs[i].reset(seed=seeds[i])
            words[at] = 0
        except Stopped:
            raise
        except ENV_RAISES as exc:  # an env's sys.exit() or KeyboardInterrupt too: its error
            failures[i] = remote_exception(request.slots[i], exc)
            env_raised.append(i)
            if not resetting:
                return False
        else:
            st.start(obs, next_ids[i])
            versions[i][st.episode] = st.env_version
        # The episode began (one whose reset raised is cut before its first step, as the Sampler
        # counts it): its id and seed are used, its admission taken.
        seeds[i], next_ids[i] = None, next_ids[i] + request.id_stride
        arena.started[i] += 1
        starts[i] -= 1 if starts[i] > 0 else 0
        return i not in failures

    active = [i for i in range(k) if ready(i, 0)]
    t = 0
    flat = isinstance(arena.observations, np.ndarray)
    steps = request.steps
    while active:
        sel: Any = slice(None) if len(active) == k else np.array(active)
        if flat:  # one array: rows written env by env, in place (no stacking)
            row, next_row = arena.observations[:, t], arena.next_observations[:, t]
            for i in active:
                row[i] = states[i].obs
            observations = row if len(active) == k else row[active]
        else:
            observations = stack_values([states[i].obs for i in active])
            shm.write(arena.observations, (sel, t), observations)
        try:
            actions, agent_info = _act(agent, observations, ids if len(active) == k else ids[active], checker)
        except Exception as exc:  # the agent raised, or gave actions that do not fit: these episodes end here
            for i in active:
                failures[i] = remote_exception(request.slots[i], exc)
                cut[i] = states[i].stop()
            break
        shm.write(arena.actions, (sel, t), actions)
        done: list[int] = []
        nexts: list[Any] = []
        rewards, terms, truncs = arena.rewards[:, t], arena.terminated[:, t], arena.truncated[:, t]
        episodes = arena.episodes[:, t]
        per_env = _rows(actions)
        for j, i in enumerate(active):
            try:
                words[at] = step_marks[i]
                obs, reward, term, trunc, info = envs[i].step(per_env[j])
            except Stopped:
                raise
            except ENV_RAISES as exc:
                failures[i] = remote_exception(request.slots[i], exc)
                env_raised.append(i)
                cut[i] = states[i].stop()
                continue
            done.append(i)
            if flat:
                next_row[i] = obs
            else:
                nexts.append(obs)
            rewards[i], terms[i], truncs[i], episodes[i] = reward, term, trunc, states[i].episode  # in place
            slot_infos = infos[i]
            if info and slot_infos is None:
                slot_infos = infos[i] = [{}] * t
            if slot_infos is not None:
                slot_infos.append(info)
            states[i].stepped(obs, term or trunc)
        words[at] = 0  # the agent acts next: in no env's call
        if done:
            if len(done) != len(active):
                sel = np.array(done)
            if not flat:
                shm.write(arena.next_observations, (sel, t), stack_values(nexts))
            arena.rows[sel] = t + 1  # after the row: a reader never sees half a row
            if len(done) != len(active):
                kept = [active.index(i) for i in done]
                agent_info = {key: np.asarray(value)[kept] for key, value in agent_info.items()}
            ticks.append((t, done, agent_info))
        t += 1
        active = [i for i in done if (states[i].running and t < steps[i]) or ready(i, t)]
    rows = arena.rows.tolist()
    n = max(rows, default=0)
    return {
        "rows": rows, "started": arena.started.tolist(),
        "running": [st.episode if st.running else -1 for st in states],  # what each slot goes on with
        "cut": [cut.get(i, -1) for i in range(k)],  # the episode a failure ended
        "env_version": [st.env_version for st in states],
        "env_versions": versions, "env_infos": infos, "failures": failures, "env_raised": sorted(env_raised),
        "agent_infos": _agent_infos(ticks, k, n),
        "arrays": None if request.shared else {name: shm.tree_map(lambda a: a[:, :n], getattr(arena, name)) for name in FIELDS},
    }


def _agent_infos(ticks: list[tuple[int, list[int], dict[str, Any]]], k: int, n: int) -> dict[str, np.ndarray]:
    """The policy's infos as arrays ``[k, n, ...]`` (row ``t`` of slot ``i``: its ``t``-th step)."""
    if not ticks or not ticks[0][2]:
        return {}
    out: dict[str, np.ndarray] = {}
    for key, first in ticks[0][2].items():
        first = np.asarray(first)
        full = np.zeros((k, n, *first.shape[1:]), dtype=first.dtype)
        for t, active, info in ticks:
            full[active, t] = info[key]
        out[key] = full
    return out


def run_local(envs: list[Any], agent: Any, steps: int, spec: ArenaSpec, states: list[_Slot] | None = None,
              arena: Arena | None = None) -> tuple[dict[str, Any], Arena, list[_Slot]]:
    """The rollout loop in this process over ``envs``: ``steps`` rows each. Pass ``states`` and
    ``arena`` back in to go on where the last call stopped."""
    k = len(envs)
    arena = arena or Arena(spec, bytearray(Arena.nbytes_for(spec)))
    states = states or [_Slot() for _ in envs]
    request = RolloutRequest(slots=tuple(range(k)), first=0, spec=spec, shared=True, agent=b"",
                             steps=(steps,) * k, starts=(-1,) * k, id_stride=k, let_go=(False,) * k, seeds=(None,) * k,
                             ids=tuple(st.episode + k if st.episode >= 0 else i for i, st in enumerate(states)),
                             env_updates=(Due(0, ()),) * k)
    return run_fragment(agent, envs, states, arena, request, ActionChecker(envs[0].action_space)), arena, states
