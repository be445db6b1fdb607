"""RaySampler's fault matrix: the faults of ``test_sampler_faults.py`` on a Ray node, and the
node's own (its actor killed, or hung), on a real local Ray session with real env processes.

Two layers restart: a node's ``Sampler`` restarts its env processes (``restart_workers``), the
driver restarts nodes (``restart_nodes``). A fault goes to the layer it happens in, and what a
layer does not absorb goes to the one above (as RLlib's sub-env and env-runner restarts):

* ``on``: both restart; an env fault is absorbed inside its node, a policy fault restarts the node;
* ``nodes`` (the default): an env fault escapes its node's sampler, so the node is restarted;
* ``off``: ``RayNodeError`` naming the node, its ``cause`` the global slot; a node whose sampler
  can go on serves on, one that is dead, hung or gave up a process raises at once after that.

Each case checks the data of every call (``check_rows``: no id spans two env episodes, the
recorded action is what the env got, no step lost or repeated, cut episodes flagged and
listed), that every call returns within its deadline, and that no process is left running.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from envmanager.errors import InvalidInputError, ManagerClosedError, WorkerDiedError, WorkerError, WorkerTimeoutError  # noqa: E402
from envmanager.ray import RayNodeError, RaySampler  # noqa: E402
from envmanager.sampler import TransitionBatch  # noqa: E402
from fault_envs import (  # noqa: E402
    ENV_FAULTS,
    POLICY_FAULTS,
    FailsToMake,
    FaultFactory,
    FaultPolicy,
    check_rows,
    pid_of,
    update_raising_once,
)
from ray_helpers import NODE_START_S, alive, node_trees, ray_session  # noqa: E402,F401

N, NODE, SLOT = 4, 1, 3  # two nodes of two slots (one env process each); the fault strikes slot 3, on node 1
TIMEOUT = 60.0  # the driver's deadline per node request
ENV_TIMEOUT = 30.0  # each node manager's deadline per answer (its env processes' start-up too)
HANG = 10.0  # the deadline a hang is judged by: the env's in its node, or the node's in the driver
MARGIN = 30.0  # what a call may take beyond its deadline here: restarts of a node, a loaded machine
MODES = {"on": (True, True), "nodes": (False, True), "off": (False, False)}  # (restart_workers, restart_nodes)

pytestmark = pytest.mark.timeout(300)  # a case starts two or three nodes, and may wait out a hang


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):  # noqa: F811
    yield


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test leak check (Ray's processes live for the module): each case
    checks that every process its nodes ran is gone after close."""
    yield


def make(fault: str | None, marker: str, mode: str, slow_node_0: float = 0.0, **options) -> RaySampler:
    workers, nodes = MODES[mode]
    defaults = {"nodes": 2, "envs_per_node": 2, "envs_per_worker": 2, "fragment_steps": 16, "seed": 0, "timeout": TIMEOUT,
                "start_timeout": NODE_START_S, "env_timeout": ENV_TIMEOUT, "restart_workers": workers, "restart_nodes": nodes}
    factory = FaultFactory(fault, marker, slow_node_0, slot=SLOT, slow=(0, 1))
    return RaySampler(factory, FaultPolicy(fault, marker, slot=SLOT), **{**defaults, **options})


class Run:
    """Calls on one sampler: each timed, its data checked against the episodes listed as cut
    when it returned, and the processes its nodes run noted (to check they end with it)."""

    def __init__(self, sampler: RaySampler, timeout: float = TIMEOUT) -> None:
        self.sampler, self.timeout = sampler, timeout
        self.batches: list[TransitionBatch] = []
        self.pids = set(node_trees(sampler))
        self.started = sampler.node_info()  # each node's processes as first started

    def __call__(self, episodes: bool = False) -> TransitionBatch:
        started = time.monotonic()
        try:
            batch = self.sampler.obtain_exact_episodes(1) if episodes else self.sampler.obtain_steps(40)
        finally:
            assert time.monotonic() - started < self.timeout + MARGIN, "a call took longer than its deadline"
            self.pids |= set(node_trees(self.sampler))
        check_rows(batch, self.sampler.cut_episodes, N)
        self.batches.append(batch)
        return batch

    def until(self, handled, after: int = 3) -> None:
        """Collect until ``handled()`` (the fault was absorbed) and slot ``SLOT`` delivered after
        that (first-ready: the other node goes on meanwhile), then ``after`` calls more, the
        last of whole episodes."""
        give_up = time.monotonic() + 120  # a bound on the loop, not a timing assertion
        delivered = False
        while not delivered and time.monotonic() < give_up:
            done = handled()
            delivered = SLOT in self().worker_ids and done
        assert delivered, "the fault was never absorbed, or its slot never delivered again"
        for i in range(after):
            self(episodes=i == after - 1)

    def raises(self) -> RayNodeError:
        """Collect until a call raises ``RayNodeError``; it names the faulty node."""
        give_up = time.monotonic() + 120  # a bound on the loop, not a timing assertion
        with pytest.raises(RayNodeError) as caught:
            while time.monotonic() < give_up:
                self()
        assert caught.value.node == NODE, caught.value
        return caught.value

    def node_restarted(self) -> bool:
        return self.sampler.restart_count(NODE) >= 1

    def worker_restarted(self) -> bool:
        return self.sampler.stats.counters.get("worker_restarts", 0) >= 1

    def raises_at_once(self, like: RayNodeError) -> None:
        """A node given up: every later call raises its error at once."""
        started, held = time.monotonic(), self.sampler.buffered_steps
        with pytest.raises(RayNodeError) as later:
            self.sampler.obtain_steps(40)
        assert time.monotonic() - started < HANG, "an error already known waited for a deadline"
        assert self.sampler.buffered_steps == held, "the call took steps it did not hand out"
        assert later.value.node == NODE and type(later.value.cause) is type(like.cause)

    def slot_pids(self) -> set[int]:
        """The env processes that ran slot ``SLOT`` (its observations carry their pid)."""
        rows = [b.next_observations[b.worker_ids == SLOT, 2] for b in self.held()]
        return {pid_of(n) for r in rows for n in r.tolist()}

    def held(self) -> list[TransitionBatch]:
        """Every row the driver booked, in booking order: those the calls handed out, then those
        still buffered (a node's error may come before any call returned, or while it holds rows)."""
        return [*self.batches, *self.sampler._buffer]

    def running(self, slots: set[int]) -> set[int]:
        """Ids of the episodes of ``slots`` whose last row the driver booked is not an episode's
        end: read from the rows, not from the sampler's records."""
        held = self.held()
        if not held:
            return set()
        rows = TransitionBatch.concatenate(held)
        last = [np.flatnonzero(rows.worker_ids == s)[-1:] for s in slots]
        return {int(rows.episode_ids[i]) for r in last for i in r.tolist() if not rows.dones[i]}

    def close(self) -> TransitionBatch | None:
        """Close; check that no process outlived it and the data of every row booked across the
        calls. Returns the rows handed out (``None``: a node failed before any call returned)."""
        try:
            self.pids |= set(node_trees(self.sampler))
            cut = list(self.sampler.cut_episodes)
            held = self.held()
        finally:
            self.sampler.close()
        assert not alive(sorted(self.pids)), "processes of the nodes outlived the sampler"
        if held:  # across calls: nothing lost or repeated
            check_rows(TransitionBatch.concatenate(held), cut, N, whole=False)
        return TransitionBatch.concatenate(self.batches) if self.batches else None


def good_actions(batch: TransitionBatch) -> bool:
    """No env got an action that does not fit ``Discrete(3)``."""
    return set(batch.next_observations[:, 1].tolist()) <= {0.0, 1.0, 2.0}


# ---------------------------------------------------------------------------------------------
# Env faults on a node: in a step, a reset, an env update; raise, SIGKILL, hang


#: Every env fault with restarts on and off; with node restarts only, one of each way out of a
#: node's sampler (it raised and serves on, it gave a process up, a hang) and the replayed update.
ENV_CASES = [(f, m) for f in (*ENV_FAULTS, "update_raise") for m in ("on", "off")] + [
    (f, "nodes") for f in ("step_raise", "step_kill", "reset_hang", "update_raise")]


@pytest.mark.parametrize("fault, mode", ENV_CASES)
def test_env_fault(fault, mode, tmp_path):
    marker = str(tmp_path / "struck")
    how = fault.split("_")[1]
    run = Run(make(fault, marker, mode, env_timeout=HANG if how == "hang" else ENV_TIMEOUT))
    try:
        if fault == "update_raise":
            run.sampler.update(env_update=update_raising_once(marker, slot=SLOT))
        if mode == "off":
            error = run.raises()
            cause = error.cause
            assert SLOT in cause.worker_ids and f"{SLOT}" in str(cause) and "slots 2–3" in str(error), error
            if how == "raise":  # the env's own error and traceback; the node serves on
                assert isinstance(cause, WorkerError) and cause.worker_id == SLOT and "blew up" in cause.remote_traceback
                run.until(lambda: True)
            else:  # the env's process is given up: named, killed, and raised at once from now on
                assert isinstance(cause, WorkerDiedError if how == "kill" else WorkerTimeoutError), cause
                assert how == "kill" or cause.hung is True
                # the fault may strike before any call returned: the process is known from the start
                # (node 1's one process runs slots 2 and 3: envs_per_worker=2), its rows name it too
                process = run.started[NODE]["worker_pids"]
                assert len(process) == 1 and run.slot_pids() <= set(process), (process, run.slot_pids())
                assert not alive(process, timeout=5.0), "the failed env process was left running"
                # the node's episodes the driver holds rows of and never saw end are the failed ones
                failed = run.running({2, 3})
                assert run.sampler.stats.counters.get("failed_episodes", 0) == len(failed), failed
                assert not failed & run.sampler.open_episodes
                run.raises_at_once(error)
        else:
            run.until(run.worker_restarted if mode == "on" else run.node_restarted)
        stats, cut = run.sampler.stats.stats(), list(run.sampler.cut_episodes)
        node_restarts = run.sampler.restart_count(NODE)
        assert run.sampler.restart_count(0) == 0
    finally:
        everything = run.close()
    assert node_restarts == (1 if mode == "nodes" else 0)
    assert stats.get("worker_restarts", 0) == (1 if mode == "on" else 0)  # inside the node
    # only a node given up may raise before a call returned (its fault can strike in the first)
    assert everything is not None or (mode == "off" and how != "raise")
    assert everything is None or good_actions(everything)
    if mode != "off" or how == "raise":  # every slot delivered (else node 1 was given up, maybe before it did)
        assert set(everything.worker_ids.tolist()) == set(range(N))
    if mode == "on" and fault.startswith("step"):  # its running episode (one step done) cut and listed, its
        # rows kept (flagged unless handed out before the cut was known: check_rows, call by call)
        assert [e for e in cut if e % N == SLOT] and set(cut) & set(everything.episode_ids.tolist())
    if mode == "nodes":  # the lost requests are counted; what the node ran and the driver saw is cut
        assert stats["lost_requests"] >= 1 and all(e % N in (2, 3) for e in cut)
    if fault == "update_raise":  # replayed on a restarted process or node, or tried again before the next episode
        assert (everything.env_versions == 1).all()


# ---------------------------------------------------------------------------------------------
# Policy faults on a node: it raises, or gives too few actions, a fraction, a value out of range


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("fault", POLICY_FAULTS)
def test_policy_fault(fault, mode, tmp_path):
    marker = str(tmp_path / "struck")
    run = Run(make(fault, marker, mode))
    try:
        if mode == "on":  # the node's fault: restarted, its episodes cut, collection goes on
            run.until(run.node_restarted)
        else:  # the node's error, naming it; nothing was sent to an env; the node serves on
            error = run.raises()
            expected = RuntimeError if fault == "policy_raise" else InvalidInputError
            assert isinstance(error.cause, expected), error
            why = {"policy_raise": "policy blew up", "policy_count": "rows", "policy_dtype": "integer",
                   "policy_range": "Discrete(3)"}[fault]
            assert why in str(error), error
            run.until(lambda: True)
        node_restarts = run.sampler.restart_count(NODE)
        stats, cut = run.sampler.stats.stats(), list(run.sampler.cut_episodes)
    finally:
        everything = run.close()
    assert node_restarts == (1 if mode == "on" else 0) and stats.get("worker_restarts", 0) == 0
    assert good_actions(everything) and set(everything.worker_ids.tolist()) == set(range(N))
    if mode == "on":  # its requests lost with it, what it ran and the driver saw cut
        assert stats["lost_requests"] >= 1 and all(e % N in (2, 3) for e in cut)


# ---------------------------------------------------------------------------------------------
# The node's own faults: its actor killed (a lost raylet: test_ray_cluster.py), or hung


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("fault", ["node_kill", "node_hang"])
def test_node_fault(fault, mode, tmp_path):
    marker = str(tmp_path / "struck")
    if fault == "node_kill":
        run = Run(make(None, marker, mode))
    else:  # an env hangs past the driver's deadline, long before its node's own (60 s): the node is hung
        run = Run(make("step_hang", marker, mode, timeout=HANG, env_timeout=None), timeout=HANG)
    try:
        run.sampler.update(agent_update=5)
        run()
        old = run.sampler.node_info()[NODE]
        if fault == "node_kill":  # once the driver holds an episode of the node still running
            give_up = time.monotonic() + 60  # a bound on the loop, not a timing assertion
            while not {e % N for e in run.sampler.open_episodes} & {2, 3} and time.monotonic() < give_up:
                run()
            running = {e for e in run.sampler.open_episodes if e % N in (2, 3)}
            assert running == run.running({2, 3}), running
            run.sampler.kill_node(NODE)
        if mode == "on":
            run.until(run.node_restarted, after=4)
            assert run.sampler.node_info()[NODE]["pid"] != old["pid"]
        else:
            error = run.raises()
            assert ("died" if fault == "node_kill" else "hung") in str(error) and "restarts are disabled" in str(error)
            if fault == "node_kill":  # answers the node finished before its death may be booked after it,
                # ending episodes running at the kill and going on with others: the failed ones are the
                # episodes the driver holds rows of and never saw end, and none of them continues
                failed, rows = run.running({2, 3}), TransitionBatch.concatenate(run.held())
                assert run.sampler.stats.counters.get("failed_episodes", 0) == len(failed), failed
                assert running <= failed | set(rows.episode_ids[rows.dones].tolist()), running
                assert not failed & run.sampler.open_episodes
            run.raises_at_once(error)
        node_restarts = run.sampler.restart_count(NODE)
        stats, cut = run.sampler.stats.stats(), list(run.sampler.cut_episodes)
    finally:
        run.close()
    assert not alive([old["pid"], *old["worker_pids"]], timeout=5.0), "the lost node's processes outlived it"
    assert node_restarts == (1 if mode == "on" else 0)
    if mode == "on":  # the new node serves with the newest weights; what the old one ran is cut
        last = TransitionBatch.concatenate(run.batches[-3:])
        assert {2, 3} <= set(last.worker_ids.tolist()) and (last.policy_versions == 1).all()
        assert (last.agent_infos["params"] == 5).all()
        assert stats["lost_requests"] >= 1 and stats["interrupted_episodes"] >= len(cut) >= 1
        assert all(e % N in (2, 3) for e in cut)


@pytest.mark.parametrize("limit", [2, 1])
def test_a_restarted_node_that_fails_to_start_is_restarted_again_within_the_limits(limit, tmp_path):
    armed, struck = tmp_path / "armed", str(tmp_path / "struck")
    sampler = RaySampler(FailsToMake(str(armed), struck, SLOT), FaultPolicy(None, struck, slot=SLOT), nodes=2,
                         envs_per_node=2, envs_per_worker=2, fragment_steps=16, seed=0, timeout=TIMEOUT,
                         start_timeout=NODE_START_S, env_timeout=ENV_TIMEOUT, restart_workers=False, restart_nodes=True,
                         max_lifetime_restarts=limit, restarts_rate_limit_n=-1)
    run = Run(sampler)
    try:
        run()
        old = sampler.node_info()[NODE]
        armed.touch()
        sampler.kill_node(NODE)
        if limit == 2:  # the kill's restart fails to start, the next one serves
            run.until(lambda: sampler.restart_count(NODE) == 2, after=2)
            assert sampler.node_info()[NODE]["pid"] != old["pid"]
        else:  # no restart left for the failed start: the node is given up, its start's error named
            error = run.raises()
            assert "restart" in str(error) and "could not be made" in repr(error.__dict__), error
            run.raises_at_once(error)
        assert os.path.exists(struck), "the restarted node's start never failed"
        restarts = sampler.restart_count(NODE)
    finally:
        run.close()
    assert restarts == limit


def test_a_node_that_never_starts_again_is_given_up_at_the_deadline_with_the_limits_lifted(tmp_path):
    """No limit ends the restarts of a node whose every start fails: the request deadline does
    (the call returned only once the env could be made again)."""
    armed, struck = tmp_path / "armed", str(tmp_path / "struck")
    sampler = RaySampler(FailsToMake(str(armed), struck, SLOT, once=False), FaultPolicy(None, struck, slot=SLOT), nodes=2,
                         envs_per_node=2, envs_per_worker=2, fragment_steps=16, seed=0, timeout=HANG, start_timeout=NODE_START_S,
                         env_timeout=ENV_TIMEOUT, restart_workers=False, restart_nodes=True, max_lifetime_restarts=-1,
                         restarts_rate_limit_n=-1)
    run = Run(sampler, timeout=HANG + NODE_START_S)  # one start may take start_timeout past the deadline
    try:
        run()
        armed.touch()
        sampler.kill_node(NODE)
        error = run.raises()
        assert "could not be made" in repr(error.__dict__), error
        assert sampler.restart_count(NODE) >= 2  # restarted again while the deadline allowed
        run.raises_at_once(error)
    finally:
        run.close()


# ---------------------------------------------------------------------------------------------
# Close from another thread in the middle of a call


def test_close_mid_call_ends_the_call(tmp_path):
    sampler = make(None, str(tmp_path / "unused"), "on", fragment_steps=64)
    pids = node_trees(sampler)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(1000):
                sampler.obtain_steps(64)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(2.0)
    sampler.close()
    thread.join(TIMEOUT + MARGIN)
    assert not thread.is_alive(), "a call went on after close()"
    assert len(raised) == 1 and isinstance(raised[0], ManagerClosedError), raised
    assert not alive(pids)
    sampler.close()  # idempotent
    assert ray.is_initialized()  # the user's session is left running


# ---------------------------------------------------------------------------------------------
# What the driver holds when a fault is found


def test_a_cut_inside_a_node_flags_the_rows_the_driver_holds(tmp_path):
    """A restart inside node 1 cuts an episode whose first step came in an earlier fragment (one
    step per slot a fragment) that the driver still holds: those rows are flagged when handed
    out, and the episode no longer counts as running."""
    sampler = make("step_raise", str(tmp_path / "struck"), "on", fragment_steps=2)
    pids = node_trees(sampler)
    try:
        give_up = time.monotonic() + 60  # a bound on the loop, not a timing assertion
        while not sampler.stats.counters.get("worker_restarts") and time.monotonic() < give_up:
            sampler._top_up()
            sampler._wait()  # booked, nothing handed out
        cut = list(sampler.cut_episodes)
        assert [e for e in cut if e % N == SLOT] and not set(cut) & sampler.open_episodes
        batch = sampler.obtain_steps(sampler.buffered_steps)
        pids += node_trees(sampler)
    finally:
        sampler.close()
    assert not alive(pids)
    check_rows(batch, cut, N)  # every row of a cut episode in it is flagged
    assert batch.interrupted.any()


def test_episodes_of_a_call_that_raised_are_dropped_and_counted(tmp_path):
    """``obtain_exact_episodes`` raises node 1's policy error while node 0 (slow) still collects
    its episodes: they arrive during a later call, which drops them, counted as ``dropped_steps``."""
    sampler = make("policy_raise", str(tmp_path / "struck"), "off", slow_node_0=0.1)
    pids = node_trees(sampler)
    try:
        with pytest.raises(RayNodeError, match="policy blew up"):
            sampler.obtain_exact_episodes(3)
        batches, give_up = [], time.monotonic() + 60  # a bound on the loop, not a timing assertion
        while not any(0 in b.worker_ids for b in batches) and time.monotonic() < give_up:
            batches.append(sampler.obtain_steps(8))
        dropped = sampler.stats.counters["dropped_steps"]
        pids += node_trees(sampler)
    finally:
        sampler.close()
    assert not alive(pids)
    assert dropped >= 2 * 3 * 3  # three episodes of at least three steps from each of node 0's slots
    check_rows(TransitionBatch.concatenate(batches), [], N, whole=False)


def test_a_round_cut_by_a_nodes_error_keeps_the_fragments_that_came(tmp_path):
    """Wait-for-all rounds, restarts off: node 1's policy raises at its second step (its envs take
    a second a step) after node 0's fragment came. The call raises node 1's error and keeps node
    0's fragment; the next calls hand it out first, so node 0's episodes have every step from their
    first. (The round dropped it while node 0's episodes went on: their first steps were lost,
    fault schedule seed 60128.)"""
    marker = str(tmp_path / "struck")
    sampler = RaySampler(FaultFactory("policy_raise", marker, 1.0, slot=SLOT, slow=(2, 3)),
                         FaultPolicy("policy_raise", marker, slot=SLOT), nodes=2, envs_per_node=2, envs_per_worker=2,
                         fragment_steps=8, first_ready=False, seed=0, timeout=TIMEOUT, start_timeout=NODE_START_S,
                         env_timeout=ENV_TIMEOUT, restart_workers=False, restart_nodes=False)
    pids = node_trees(sampler)
    try:
        with pytest.raises(RayNodeError, match="policy blew up") as caught:
            sampler.obtain_steps(8)
        assert caught.value.node == NODE
        kept = sampler.buffered_steps
        batches = [sampler.obtain_steps(8) for _ in range(3)]  # node 0's kept fragment, then a round's two
        pids += node_trees(sampler)
    finally:
        sampler.close()
    assert not alive(pids)
    assert kept == 8  # node 0's fragment
    rows = TransitionBatch.concatenate(batches)
    check_rows(rows, [], N, whole=False)
    assert set(rows.worker_ids.tolist()) == set(range(N))
    first_steps = {e: rows.next_observations[rows.episode_ids == e, 0][0] for e in np.unique(rows.episode_ids).tolist()}
    assert set(first_steps.values()) == {1.0}, f"episodes handed out without their first steps: {first_steps}"


def test_every_request_a_node_raised_on_before_its_restart_is_answered_lost(tmp_path):
    """Node restarts only: slot 3's env process dies in node 1's first fragment (its envs take a
    quarter of a second a step), and node 1's sampler, which gave the process up, raises the second
    fragment asked of it at once; both errors are in before the driver looks again. The next call restarts
    node 1 once, and every request that died with it is answered as lost (counted), the second
    error's too: a request taken with an error and then skipped (its node restarted meanwhile)
    was never answered, and an episode request lost that way left ``obtain_exact_episodes``
    waiting with nothing in flight, without end (fault schedule seed 60225)."""
    marker = str(tmp_path / "struck")
    sampler = RaySampler(FaultFactory("step_kill", marker, 0.25, slot=SLOT, slow=(2, 3)), FaultPolicy(None, marker),
                         nodes=2, envs_per_node=2, envs_per_worker=1, fragment_steps=24, first_ready=True, in_flight=2,
                         seed=0, timeout=TIMEOUT, start_timeout=NODE_START_S, env_timeout=ENV_TIMEOUT, restart_workers=False,
                         restart_nodes=True)
    pids = node_trees(sampler)
    try:
        first = sampler.obtain_steps(8)  # node 0's first fragment; node 1's two are still stepping
        assert set(first.worker_ids.tolist()) <= {0, 1}
        time.sleep(5.0)  # node 1's two requests end with its errors meanwhile (the first by its 10th step)
        started = time.monotonic()
        episodes = sampler.obtain_exact_episodes(1)
        assert time.monotonic() - started < TIMEOUT + MARGIN
        restarts, lost = sampler.restart_count(NODE), sampler.stats.counters.get("lost_requests", 0)
        pids += node_trees(sampler)
    finally:
        sampler.close()
    assert not alive(pids)
    assert sorted(episodes.worker_ids[episodes.dones].tolist()) == list(range(N))  # one whole episode each
    assert restarts == 1
    assert lost == 3  # node 1's two fragments and the episode request asked of it before the restart


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("mode", ["off", "nodes", "on"])
def test_a_node_that_answered_an_env_error_and_then_died_is_told_for_both(mode, in_flight, tmp_path):
    """Slot 3's env raises in node 1's first fragment (its second episode's second step comes
    within the fragment's 20 steps a slot), and node 1's actor is killed once that answer is in
    the driver, before any call took it (``in_flight=2``: its next fragment, under way, dies
    with it, so the error and the death are found in one wait). Restarts off: the env's error is
    raised once, for slot 3, and the node serves on for it; its death is raised next, naming the
    node, which is given up (its error at once from then on), not the env's error again. Node
    restarts: the node is restarted once (for the error or for the death, not both); "on": the
    env is rebuilt in its node and the node restarted for its death. The core's case:
    ``test_an_env_error_sent_before_its_process_died_is_the_envs_and_the_death_the_processs``."""
    marker = str(tmp_path / "struck")
    workers, nodes = MODES[mode]
    sampler = RaySampler(FaultFactory("step_raise", marker, 0.02, slot=SLOT, slow=(2, 3)), FaultPolicy(None, marker),
                         nodes=2, envs_per_node=2, envs_per_worker=2, fragment_steps=40, in_flight=in_flight, seed=0,
                         timeout=TIMEOUT, start_timeout=NODE_START_S, env_timeout=ENV_TIMEOUT, restart_workers=workers,
                         restart_nodes=nodes)
    run = Run(sampler)
    try:
        old = sampler.node_info()[NODE]
        sampler._top_up()  # node 1's first fragments under way
        head = sampler._pool.nodes[NODE].queue[0].ref
        assert ray.wait([head], timeout=TIMEOUT)[0], "node 1's first fragment never ended"
        sampler.kill_node(NODE)  # its answer (the env's error, unless absorbed in the node) waits in the driver
        assert not alive([old["pid"]], timeout=30.0), "node 1's actor outlived its kill"
        if mode == "off":
            error = run.raises()  # the env's, once, for its slot: the node serves on
            assert isinstance(error.cause, WorkerError) and not isinstance(error.cause, WorkerDiedError), error
            assert error.cause.worker_id == SLOT and "blew up" in error.cause.remote_traceback, error.cause
            assert "died" not in str(error) and sampler._pool.failure(sampler._pool.nodes[NODE]) is None, error
            died = run.raises()  # then the node's death, which gives it up
            assert "died" in str(died) and "restarts are disabled" in str(died) and died.cause is None, died
            assert sampler._pool.failure(sampler._pool.nodes[NODE]) is died
            run.raises_at_once(died)
        else:
            run.until(run.node_restarted)
            assert sampler.node_info()[NODE]["pid"] != old["pid"]
        restarts, stats = sampler.restart_count(NODE), sampler.stats.stats()
        assert sampler.restart_count(0) == 0
    finally:
        run.close()
    assert not alive([old["pid"], *old["worker_pids"]], timeout=5.0), "the lost node's processes outlived it"
    assert restarts == (0 if mode == "off" else 1)
    assert stats.get("worker_restarts", 0) == (1 if mode == "on" else 0)
