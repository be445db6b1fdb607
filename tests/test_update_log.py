"""The one versioned env update log (``envmanager.core.updates``) and its one applier: the log
against a model under random sequences of records, refused records and reads; the applier the
same through a call (the parent-side sampler) and in the worker's rollout (the worker-side
sampler); ``update()`` one return type for the local samplers."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envmanager.core.updates import Due, Pickled, UpdateLog, apply
from envmanager.errors import InvalidInputError
from envmanager.sampler import Sampler, WorkerPolicySampler
from sampler_envs import RandomPolicy, kind_env

N = 3


class Tape:
    """A stand-in env: what was applied to it, in order."""

    def __init__(self) -> None:
        self.seen: list[int] = []


def tag(label: int):
    def update(env) -> None:
        env.seen.append(label)
    return update


def closure_over_lock():
    """An update closing over a lock: cloudpickle refuses it."""
    lock = threading.Lock()

    def update(env) -> None:
        with lock:
            env.seen.append(-1)
    return update


# One operation: a good record (one label for every slot, or per slot with gaps), a refused one,
# or a read of what slot ``s`` at version ``have`` needs (applied to a fresh tape and compared).
good_all = st.integers(0, 99).map(lambda label: ("all", label))
good_each = st.lists(st.one_of(st.none(), st.integers(0, 99)), min_size=N, max_size=N).map(lambda labels: ("each", labels))
bad = st.sampled_from(["not callable", "wrong length", "unpicklable", "bad pickled"]).map(lambda why: ("bad", why))
read = st.tuples(st.integers(0, N - 1), st.integers(-1, 12)).map(lambda r: ("due", r))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(good_all, good_each, bad, read), max_size=25))
def test_the_log_matches_a_model_and_a_refused_record_changes_nothing(ops):
    log, model = UpdateLog(N), []  # model: per version, the label per slot (None: nothing)
    for kind, arg in ops:
        if kind == "all":
            assert log.record(tag(arg)) == len(model) + 1
            model.append([arg] * N)
        elif kind == "each":
            assert log.record([None if a is None else tag(a) for a in arg]) == len(model) + 1
            model.append(list(arg))
        elif kind == "bad":
            update = {"not callable": 3, "wrong length": [tag(1)] * (N + 1), "unpicklable": closure_over_lock(),
                      "bad pickled": Pickled((b"x",) * (N - 1))}[arg]
            with pytest.raises(InvalidInputError):
                log.record(update)
        else:
            slot, have = arg
            due = log.due(slot, have)
            assert due.version == max(have, len(model))
            expected = [(v + 1, labels[slot]) for v, labels in enumerate(model) if v + 1 > have and labels[slot] is not None]
            assert [v for v, _ in due.updates] == [v for v, _ in expected]
            tape = Tape()
            assert apply(tape, due, have) == due.version
            assert tape.seen == [label for _, label in expected]
        assert log.version == len(model)  # moved by every good record, by no refused one
    # A restarted node's replay: every entry, in order; a slice recorded by another log as it is.
    other = UpdateLog(2)
    for entry in log.since(0):
        other.append(other.prepare(entry.sliced(1, 3)))
    assert other.version == log.version
    tape = Tape()
    apply(tape, other.due(0, 0), 0)
    assert tape.seen == [labels[1] for labels in model if labels[1] is not None]


def test_apply_skips_what_the_env_has_and_an_update_that_raises_propagates():
    log = UpdateLog(1)
    for label in (1, 2, 3):
        log.record(tag(label))
    tape = Tape()
    assert apply(tape, log.due(0, 0), 1) == 3 and tape.seen == [2, 3]  # (the worker's own version counts)
    log.record(lambda env: (_ for _ in ()).throw(RuntimeError("update blew up")))
    with pytest.raises(RuntimeError, match="update blew up"):
        apply(Tape(), log.due(0, 3), 3)
    assert apply(Tape(), Due(7, ()), 2) == 7


def add_bonus(value):
    def update(env) -> None:
        env.unwrapped.bonus = env.unwrapped.bonus * 10 + value
    return update


def test_an_env_update_reaches_a_call_path_env_and_a_rollout_env_identically():
    """The same updates — one for every slot, one per slot with a gap, order-sensitive — give
    the same env in the parent-side sampler (applied through a call) and the worker-side one
    (applied in the rollout): one applier, so one result."""
    updates = [add_bonus(1), [add_bonus(2), None], add_bonus(3)]
    bonuses = {}
    for kind in ("call", "rollout"):
        if kind == "call":
            sampler = Sampler(kind_env, 2, RandomPolicy(), seed=0, context="fork")
        else:
            sampler = WorkerPolicySampler(kind_env, 2, RandomPolicy(), seed=0, context="fork")
        try:
            for update in updates:
                sampler.update(env_update=update)
            batch = sampler.obtain_exact_episodes(1)
            assert batch.lengths.tolist() and (batch.env_versions == 3).all()
            bonuses[kind] = [float(batch.observations[batch.worker_ids == s][0, 2]) for s in (0, 1)]
        finally:
            sampler.close()
    assert bonuses["call"] == bonuses["rollout"] == [123.0, 13.0]


def test_update_returns_the_versions_pair_everywhere_and_a_bad_update_moves_no_version():
    for cls in (Sampler, WorkerPolicySampler):
        sampler = cls(kind_env, 2, RandomPolicy(), seed=0, context="fork")
        try:
            assert sampler.update(agent_update=RandomPolicy()) == (1, 0)
            assert sampler.update(env_update=add_bonus(1)) == (1, 1)
            assert sampler.update(agent_update=RandomPolicy(), env_update=add_bonus(2), version=5) == (5, 2)
            with pytest.raises(InvalidInputError):
                sampler.update(agent_update=RandomPolicy(), env_update=closure_over_lock())
            with pytest.raises(InvalidInputError):
                sampler.update(env_update=[add_bonus(1)] * 3)
            assert (sampler.policy_version, sampler.env_version) == (5, 2)  # the refused ones changed nothing
            batch = sampler.obtain_exact_episodes(1)
            assert (batch.env_versions == 2).all() and (batch.policy_versions == 5).all()
            assert np.allclose(batch.observations[:, 2], 12.0)
        finally:
            sampler.close()
