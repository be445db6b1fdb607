"""The step board (``envmanager.wire.mailbox``): steps asked and answered per env through words
in shared memory, in one process (the parent's ``Mailboxes`` and the workers' ``WorkerMailbox``
over one mapping), then through real worker processes.

What is checked: an answer is taken once, with the slot it answers; one that carries more than
the board holds waits for its notice; a notice or answer of a step taken out of flight (a failed
process) is never taken for a newer one, and the ordinals go on across a replacement; wake-ups
are owed only to a worker that may be asleep; infos in the info rows come back equal to what the
envs returned (values and types), their schema announced before any answer relies on it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from envmanager.core.batch import BatchEnvManager
from envmanager.testing.envs import EnvFactory
from envmanager.wire.mailbox import (
    INFO_KINDS,
    INFO_WORDS,
    MARGIN_NS,
    Mailboxes,
    WorkerMailbox,
    mailbox_supported,
    schema_id,
)
from envmanager.wire.messages import lanes_of

pytestmark = pytest.mark.skipif(not mailbox_supported(), reason="the mailbox is x86 only (its store order)")

SLOTS = [(0, 1, 2), (3,), (4, 5)]  # three processes hosting 3, 1 and 2 envs


@contextlib.contextmanager
def board() -> Iterator[tuple[Mailboxes, list[WorkerMailbox]]]:
    """The parent's side and every worker's, over one mapping (a fresh one each time)."""
    made = Mailboxes.create(len(SLOTS), SLOTS)
    assert made is not None
    workers = [WorkerMailbox(made.file, made.layout, p) for p in range(len(SLOTS))]
    for w in workers:
        w.busy()
    try:
        yield made, workers
    finally:
        for w in workers:
            w.close()
        made.close()


def ask(made: Mailboxes, slots: list[int]) -> np.ndarray:
    """Post steps of ``slots``; the processes owed a wake-up."""
    slots_ = np.array(slots, dtype=np.int64)
    processes = np.array(sorted({p for p, own in enumerate(SLOTS) for s in slots if s in own}), dtype=np.int64)
    return made.post_steps(made.slot_word[slots_], processes, time.monotonic())


def answer_all(workers: list[WorkerMailbox], raw: bool = True) -> dict[int, list[int]]:
    """Every worker answers what it was asked; the locals each answered."""
    answered = {}
    for p, w in enumerate(workers):
        locals_, ordinals = w.steps()
        if locals_:
            w.write_infos(locals_, None)
            w.answer_steps(locals_, ordinals, [1e-6] * len(locals_), raw)
            answered[p] = locals_
    return answered


def taken(made: Mailboxes) -> list[int]:
    got = made.steps_answered()
    return [] if got is None else sorted(got.tolist())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True), min_size=1, max_size=12))
def test_each_step_asked_is_answered_once_with_its_slot(batches):
    """Batches of distinct idle slots asked in any order (a slot asked again once taken): each
    answer is taken exactly once, for the slot asked; nothing is in flight at the end."""
    with board() as (made, workers):
        idle = set(range(6))
        for batch in batches:
            batch = [s for s in batch if s in idle]
            if not batch:
                continue
            ask(made, batch)
            idle -= set(batch)
            assert {p for p in range(3) if made.busy(p)} == {p for p, own in enumerate(SLOTS) if set(own) & set(batch)} | {
                p for p, own in enumerate(SLOTS) if set(own) - idle}
            answered = answer_all(workers)
            assert sum(len(v) for v in answered.values()) == len(batch)
            got = taken(made)
            assert got == sorted(batch) and taken(made) == []  # once
            idle |= set(got)
        assert not any(made.busy(p) for p in range(3))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_lanes_answered_one_at_a_time_are_each_taken_once(data):
    """Double buffered (each process's envs in two lanes, as ``lanes_of``): batches of idle slots
    asked, each process answering its part lane by lane, a lane whole or in pieces, some with a
    notice, in any order, the board looked at after each answer: every step is taken exactly once,
    for the slot asked."""
    lanes = lanes_of([len(own) for own in SLOTS], True)
    with board() as (made, workers):
        idle = set(range(6))
        for _ in range(data.draw(st.integers(1, 8))):
            batch = [s for s in data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True)) if s in idle]
            if not batch:
                continue
            ask(made, batch)
            idle -= set(batch)
            pieces = []  # (process, locals, ordinals): lanes, some cut in two
            for p, w in enumerate(workers):
                locals_, ordinals = w.steps()
                for lane in (1, 2):
                    own = [(i, o) for i, o in zip(locals_, ordinals, strict=True) if lanes[SLOTS[p][i]] == lane]
                    cut = data.draw(st.integers(0, len(own))) if own else 0
                    pieces += [(p, part) for part in (own[:cut], own[cut:]) if part]
            got: list[int] = []
            for n in data.draw(st.permutations(range(len(pieces)))):
                p, part = pieces[n]
                locals_, ordinals = [i for i, _ in part], [o for _, o in part]
                raw = data.draw(st.booleans())
                workers[p].write_infos(locals_, None)
                workers[p].answer_steps(locals_, ordinals, [1e-6] * len(part), raw)
                got += taken(made)
                if not raw:  # its notice, as the pool takes it after the board
                    assert made.take_notice(p, made.slot_word[[SLOTS[p][i] for i in locals_]].tolist(), ordinals,
                                            time.monotonic())
                    got += [SLOTS[p][i] for i in locals_]
            assert sorted(got) == sorted(batch) and taken(made) == []  # each once
            idle |= set(got)
        assert not any(made.busy(p) for p in range(3))


def test_an_answer_with_a_notice_waits_for_it_and_a_stale_notice_is_dropped():
    with board() as (made, workers):
        ask(made, [0, 1])
        locals_, ordinals = workers[0].steps()
        assert locals_ == [0, 1]
        workers[0].answer_steps(locals_, ordinals, [1e-6, 1e-6], raw=False)  # infos follow in a notice
        assert taken(made) == [] and made.busy(0)  # the board alone does not file it
        words = made.slot_word[[0, 1]].tolist()
        assert not made.take_notice(0, words, [o - 1 for o in ordinals], time.monotonic())  # an older step's: stale
        assert made.take_notice(0, words, ordinals, time.monotonic())
        assert not made.take_notice(0, words, ordinals, time.monotonic())  # once
        assert not made.busy(0) and taken(made) == []


def test_steps_cut_with_a_failed_process_are_never_taken_and_the_ordinals_go_on():
    with board() as (made, workers):
        ask(made, [3])
        old_locals, old_ordinals = workers[1].steps()
        assert made.steps_in_flight(1) == [3]
        assert made.cut_steps(1) == [3] and not made.busy(1)
        workers[1].answer_steps(old_locals, old_ordinals, [1e-6], raw=True)  # the old process's last word...
        made.reset(1)  # ...and its replacement
        assert taken(made) == []  # never taken
        assert not made.take_notice(1, made.slot_word[[3]].tolist(), old_ordinals, time.monotonic())
        fresh = WorkerMailbox(made.file, made.layout, 1)
        try:
            assert fresh.steps() == ([], [])  # nothing asked of it yet
            ask(made, [3])
            locals_, ordinals = fresh.steps()
            assert locals_ == [0] and ordinals[0] > old_ordinals[0]  # ordinals go on
            fresh.answer_steps(locals_, ordinals, [1e-6], raw=True)
            assert taken(made) == [3]
        finally:
            fresh.close()


def test_a_wake_up_is_owed_only_to_a_worker_that_may_be_asleep():
    with board() as (made, workers):
        now = time.monotonic_ns()
        workers[0].busy()
        workers[1].spinning(now + 100 * MARGIN_NS)
        workers[2].sleeping()
        assert ask(made, [0, 3, 4]).tolist() == [2]
        answer_all(workers)
        taken(made)
        workers[0].spinning(now)  # its spin ends before it could see the step
        assert ask(made, [1]).tolist() == [0]


_VALUES = {
    int: st.integers(-(2**63), 2**63 - 1), float: st.floats(allow_nan=False), bool: st.booleans(),
    np.float64: st.floats(allow_nan=False).map(np.float64), np.float32: st.floats(width=32, allow_nan=False).map(np.float32),
    np.int64: st.integers(-(2**63), 2**63 - 1).map(np.int64), np.int32: st.integers(-(2**31), 2**31 - 1).map(np.int32),
    np.bool_: st.booleans().map(np.bool_),
}
_INFOS = st.dictionaries(st.sampled_from(["t", "x", "lives", "reward_ctrl", "is_success"]),
                         st.sampled_from(sorted(INFO_KINDS, key=str)).flatmap(lambda kind: _VALUES[kind]), max_size=5)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_INFOS, _INFOS, _INFOS), min_size=1, max_size=4))
# An env's new keys first used, then another env's known keys with another type: the first's
# schema was once lost from the announcement (answered raw, never filed).
@example([({}, {"t": False, "x": 0.0}, {"t": False, "x": False}), ({}, {"t": False}, {"t": False, "x": 0.0})])
def test_infos_in_the_info_rows_come_back_as_the_envs_returned_them(steps):
    """Process 0's three envs return these infos step after step: a schema's first use is
    announced (as a notice would, here handed over directly); every answer then comes back with
    each env's own info, values and types as returned."""
    with board() as (made, workers):
        w = workers[0]
        for infos in steps:
            ask(made, [0, 1, 2])
            locals_, ordinals = w.steps()
            schemas = w.write_infos(locals_, list(infos))
            assert schemas is not None  # scalars of the kinds the rows hold always fit
            if schemas:  # a first use: the answer goes with a notice that announces them
                w.answer_steps(locals_, ordinals, [1e-6] * 3, raw=False)
                assert made.take_notice(0, made.slot_word[[0, 1, 2]].tolist(), ordinals, time.monotonic(), tuple(schemas))
                assert {s for s, _, _ in schemas} <= {schema_id(k, d) for _, k, d in schemas}
                continue
            w.answer_steps(locals_, ordinals, [1e-6] * 3, raw=True)
            got = made.steps_answered()
            assert got is not None and sorted(got.tolist()) == [0, 1, 2]
            back: dict[int, dict] = {s: {} for s in range(3)}
            for rows, keys, columns, python in made.infos(np.sort(got)):
                lists = [c.tolist() if py else list(c) for c, py in zip(columns, python, strict=True)]
                back.update((s, dict(zip(keys, values, strict=True)))
                            for s, values in zip(rows.tolist(), zip(*lists, strict=True), strict=True))
            for slot, info in enumerate(infos):
                assert back[slot] == info
                assert [type(v) for v in back[slot].values()] == [type(v) for v in info.values()]


def test_an_answer_whose_schema_was_not_announced_yet_waits_for_its_notice():
    """Two lanes: the first lane's answer announces the schema in a notice, the second lane's
    relies on it on the board alone; seen first, the second waits until the notice is taken."""
    with board() as (made, workers):
        w = workers[0]
        ask(made, [0, 1])
        _, ordinals = w.steps()
        schemas = w.write_infos([0], [{"t": 1}])
        w.answer_steps([0], ordinals[:1], [1e-6], raw=False)  # lane 1: the notice (not taken yet)
        assert w.write_infos([1], [{"t": 1}]) == []  # lane 2: the schema is this worker's already
        w.answer_steps([1], ordinals[1:], [1e-6], raw=True)
        assert made.steps_answered() is None  # slot 1's schema is unknown here yet: it waits
        assert made.take_notice(0, made.slot_word[[0]].tolist(), ordinals[:1], time.monotonic(), tuple(schemas))
        got = made.steps_answered()
        assert got is not None and got.tolist() == [1]
        assert [(rows.tolist(), keys, [c.tolist() for c in columns]) for rows, keys, columns, _ in made.infos(got)] == [
            ([1], ("t",), [[1]])]


@pytest.mark.parametrize("info", [{"nested": {"a": 1}}, {"array": np.zeros(2)}, {"big": 2**70}, {"none": None},
                                  {1: 2}, {f"k{i}": i for i in range(INFO_WORDS)}])
def test_infos_the_rows_cannot_hold_travel_in_a_notice(info):
    with board() as (made, workers):
        ask(made, [3])
        locals_, _ = workers[1].steps()
        assert workers[1].write_infos(locals_, [info]) is None


def test_the_board_carries_the_steps_of_real_workers_with_their_infos(monkeypatch):
    """Real worker processes on the board (the mailbox forced on): every answer is the env's own,
    its infos (``{"t": n}``) too, slot by slot, with partial batches of a process's envs."""
    monkeypatch.setenv("ENVMANAGER_MAILBOX", "on")
    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")
    with BatchEnvManager(EnvFactory(), 5, envs_per_worker=3, timeout=30, info_columns=True) as m:
        assert m.pool.mailboxes is not None
        m.send_reset({s: (s, None) for s in range(5)})
        m.receive_reset_batch()
        steps = np.zeros(5, dtype=np.int64)
        rng = np.random.default_rng(0)
        for _ in range(40):
            chosen = [s for s in range(5) if rng.random() < 0.6] or [int(rng.integers(5))]
            m.send_batch(chosen, np.ones(len(chosen), dtype=np.int64))
            steps[chosen] += 1
            got: list[int] = []
            while len(got) < len(chosen):
                batch = m.receive_batch(1, timeout=30)
                slots = batch.slots
                np.testing.assert_array_equal(m.results.observation[slots, 1], slots)  # each its own env
                np.testing.assert_array_equal(m.results.observation[slots, 0], steps[slots])  # of its own step
                ts = {int(s): int(t) for b in batch.info_columns
                      for s, t in zip(b.slots, b.columns[b.keys.index("t")], strict=True)}
                ts.update({s: i["t"] for s, i in batch.infos.items()})
                assert ts == {int(s): int(steps[s]) for s in slots}  # its own info
                got += slots.tolist()
            assert sorted(got) == sorted(chosen)
