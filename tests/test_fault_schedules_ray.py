"""Randomized fault schedules on ``RaySampler`` (issue 30, item 8), on a local Ray session: two
nodes of two global slots, stepped through seeded random interleavings of collections
(``obtain_steps``, ``obtain_exact_episodes``, ``obtain_samples``), policy and env updates, env
errors in ``step`` or ``reset``, a policy that raises, env worker processes killed (SIGKILL), an
env that hangs past its node's deadline, a node's actor killed, and ``close()`` — with both
layers restarting (``on``: env processes in their node, nodes in the driver), nodes only
(``nodes``, the default) or neither (``off``). After every call, from the data alone
(``schedule_envs``), what no fault may break:

* every call returns or raises within its deadline (a bound, not a timing measurement);
* a row belongs to the slot it names; no episode id spans two env episodes, nor one env episode
  two ids; within an id no step is lost or duplicated, across calls too; a cut id's later rows
  are flagged ``interrupted``, and an id that ended never comes back;
* the recorded action is the one the env received; the policy version stamped is the one whose
  weights chose it (the policy's own ``params``), never ahead of the one in force, and episodes
  started in a call run the versions in force then; an env version is the one its env ran;
* an error names the node a fault was caused on, its ``cause`` the global slot that failed, of
  the type the restart setting says; a node given up raises its error again at once;
* after ``close()`` no node actor and no env process it ran is left, no shared memory of theirs.

Ray is slow to start: the module holds one session, and CI plays ``ENVMANAGER_FAULT_SCHEDULES``
schedules in all (default 3, one per restart setting) of up to ``ENVMANAGER_FAULT_STEPS``
operations (default 12), seeds ``SEED .. SEED + count - 1`` from ``ENVMANAGER_FAULT_SEED``
(printed; seed ``s`` plays restart setting ``s % 3``, so ``ENVMANAGER_FAULT_SEED=s
ENVMANAGER_FAULT_SCHEDULES=1`` replays schedule ``s`` alone). The long run: the fault-model guide.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from envmanager.errors import (  # noqa: E402
    EnvManagerError,
    ManagerClosedError,
    RestartLimitError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from envmanager.ray import RayNodeError, RaySampler  # noqa: E402
from ray_helpers import alive, node_trees, ray_session  # noqa: E402,F401
from schedule_envs import (  # noqa: E402
    EPISODE,
    LAST,
    NONCE,
    SLOT,
    VERSION,
    ScheduleFactory,
    SchedulePolicy,
    T,
    command,
    set_version,
)

NODES, PER_NODE = 2, 2
N = NODES * PER_NODE  # global slots
ENV_TIMEOUT = 15.0  # each node's deadline per env answer, start-up too (a loaded machine): a hang costs this much
NODE_TIMEOUT = 30.0  # the driver's deadline per node request
MARGIN = 60.0  # what a call may take beyond its deadlines here: node restarts on a loaded 2-core machine
MODES = {"on": (True, True), "nodes": (False, True), "off": (False, False)}  # (restart_workers, restart_nodes)
SCHEDULES = int(os.environ.get("ENVMANAGER_FAULT_SCHEDULES", "3"))
SEED = int(os.environ.get("ENVMANAGER_FAULT_SEED", "20300"))
STEPS = int(os.environ.get("ENVMANAGER_FAULT_STEPS", "12"))  # operations per schedule, at most
#: What the schedules did, printed after each run: operations, errors by type, rows, restarts.
TALLY: collections.Counter[str] = collections.Counter()

pytestmark = pytest.mark.timeout(600 + 200 * SCHEDULES)


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):  # noqa: F811
    import cloudpickle
    from ray import cloudpickle as ray_cloudpickle

    import schedule_envs

    cloudpickle.register_pickle_by_value(schedule_envs)  # Ray workers need not import the tests directory
    ray_cloudpickle.register_pickle_by_value(schedule_envs)
    yield


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test leak check (Ray's processes live for the module): each
    schedule checks that every process its nodes ran is gone after close."""
    yield


@contextlib.contextmanager
def within(seconds: float, what: str):
    started = time.monotonic()
    yield
    took = time.monotonic() - started
    assert took < seconds, f"{what} took {took:.1f} s, past its deadline ({seconds:.1f} s)"


def _env_workers(actor_pid: int) -> list[int]:
    """The env worker processes of a node, oldest first: its actor's forkserver's children (a
    worker forked from the forkserver has its command line, so it is told apart by its parent)."""
    workers = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(actor_pid).children():
            with contextlib.suppress(psutil.Error):
                cmdline = " ".join(child.cmdline())
                below = child.children() if "forkserver" in cmdline else [] if "resource_tracker" in cmdline else [child]
                workers += [(p.create_time(), p.pid) for p in below]
    return [pid for _, pid in sorted(workers)]


class RaySchedule:
    """One ``RaySampler`` over ``N`` global slots on ``NODES`` nodes, its rows checked call by
    call and across calls."""

    def __init__(self, mode: str, rng: random.Random) -> None:
        self.mode = mode
        self.restart_workers, self.restart_nodes = MODES[mode]
        self.commands = tempfile.mkdtemp(prefix="schedule-")
        self.options = {"envs_per_worker": rng.choice([1, 2]), "first_ready": rng.random() < 0.7,
                        "fragment_steps": rng.choice([2, 4, 8]), "in_flight": rng.choice([1, 2])}
        self.s = RaySampler(ScheduleFactory(self.commands), SchedulePolicy(self.commands), nodes=NODES,
                            envs_per_node=PER_NODE, seed=0, timeout=NODE_TIMEOUT, start_timeout=120.0,
                            env_timeout=ENV_TIMEOUT, restart_workers=self.restart_workers,
                            restart_nodes=self.restart_nodes, max_lifetime_restarts=-1, restarts_rate_limit_n=-1,
                            **self.options)
        self.pids = set(node_trees(self.s))
        self.armed: dict[int | str, set[str]] = {s: set() for s in [*range(N), "policy"]}
        self.faulted: dict[int, set[str]] = {n: set() for n in range(NODES)}  # what was done to each node
        self.hangs = 0
        self.policy_version = self.env_version = 0
        self.env_of: dict[int, tuple[float, float]] = {}  # episode id -> its env episode (nonce, episode)
        self.id_of: dict[tuple[float, float], int] = {}
        self.last_t: dict[int, float] = {}  # episode id -> its last step handed out
        self.ended: set[int] = set()  # ids whose last step was handed out: they never come back
        self.cut: set[int] = set()  # ids listed as cut when a call returned: later rows come flagged
        self.given_up: BaseException | None = None
        self.closed = False

    def bound(self) -> float:
        return NODE_TIMEOUT + ENV_TIMEOUT * (1 + self.hangs) + MARGIN

    def fired(self, who: int | str, kinds: tuple[str, ...]) -> bool:
        """Whether a command of ``kinds`` written for ``who`` has acted (its file is gone)."""
        gone = {kind for kind in self.armed[who] & set(kinds)
                if not os.path.exists(os.path.join(self.commands, f"{who}.{kind}"))}
        self.armed[who] -= gone
        return bool(gone)

    def note(self) -> None:
        with contextlib.suppress(Exception):
            self.pids |= set(node_trees(self.s))

    # -- what comes back ------------------------------------------------------------------------

    def rows(self, batch: Any, started_now: bool) -> None:
        """What must hold of a call's rows, and of them against every earlier call's.
        ``started_now``: whole episodes, each started during the call."""
        obs, nxt, ids = batch.observations, batch.next_observations, batch.episode_ids
        assert (batch.worker_ids == obs[:, SLOT]).all() and (batch.worker_ids == nxt[:, SLOT]).all(), \
            "a row under the wrong slot"
        assert (batch.actions == nxt[:, LAST]).all(), "a recorded action is not the one the env received"
        assert (batch.policy_versions == batch.agent_infos["params"]).all(), "rows stamped with a policy not used"
        assert (batch.policy_versions <= self.policy_version).all(), "a policy version stamped that is not out yet"
        assert (batch.env_versions == batch.rewards).all() and (batch.env_versions == nxt[:, VERSION]).all(), \
            "rows stamped with an env version the env did not run"
        assert (batch.env_versions <= self.env_version).all()
        if started_now:
            assert (batch.policy_versions == self.policy_version).all(), \
                f"episodes of this call ran policy versions {set(batch.policy_versions.tolist())}, " \
                f"{self.policy_version} in force"
            assert (batch.env_versions == self.env_version).all(), \
                f"episodes of this call ran env versions {set(batch.env_versions.tolist())}, {self.env_version} in force"
        listed = self.s.cut_episodes
        assert len(set(listed)) == len(listed), "an episode listed as cut twice"
        assert set(ids[batch.interrupted].tolist()) <= set(listed), "rows flagged interrupted of an episode not cut"
        for episode in dict.fromkeys(ids.tolist()):
            at = np.flatnonzero(ids == episode)
            assert episode not in self.ended, f"episode id {episode} came back after it ended"
            if episode in self.cut:
                assert batch.interrupted[at].all(), f"episode {episode}'s rows after its cut are not flagged"
            assert episode % N == batch.worker_ids[at[0]] and len(set(batch.worker_ids[at].tolist())) == 1
            envs = set(zip(nxt[at, NONCE].tolist(), nxt[at, EPISODE].tolist(), strict=True))
            assert len(envs) == 1, f"episode id {episode} spans two env episodes: {envs}"
            env = envs.pop()
            assert self.env_of.setdefault(episode, env) == env, f"episode id {episode} spans two env episodes"
            assert self.id_of.setdefault(env, episode) == episode, f"env episode {env} under two ids"
            ts = nxt[at, T].tolist()
            first = self.last_t.get(episode, 0.0) + 1
            assert ts == [first + i for i in range(len(ts))], f"episode {episode}: a step lost or duplicated: {ts}"
            assert (obs[at[1:]] == nxt[at[:-1]]).all(), f"episode {episode}: rows do not follow each other"
            assert len(set(batch.env_versions[at].tolist())) == 1, f"episode {episode} ran two env versions"
            self.last_t[episode] = ts[-1]
            if batch.dones[at[-1]]:
                self.ended.add(episode)
        self.cut |= set(listed)
        TALLY["rows"] += len(batch)
        TALLY["interrupted rows"] += int(batch.interrupted.sum())

    def call(self, what: str, fn: Any, started_now: bool = False) -> None:
        try:
            with within(self.bound(), what):
                batch = fn()
        except EnvManagerError as error:
            self.failed(error)
            return
        finally:
            self.note()
        self.rows(batch, started_now)
        if what == "obtain_exact_episodes()":
            assert sorted(batch.worker_ids[np.r_[0, np.cumsum(batch.lengths)[:-1]]].tolist()) == list(range(N)), \
                "not one episode per slot"

    def failed(self, error: EnvManagerError) -> None:
        """Check an error against the faults caused, and book what it means."""
        TALLY[type(error).__name__] += 1
        if isinstance(error, RestartLimitError):
            raise AssertionError(f"restart limits are off, yet: {error}") from error
        if not isinstance(error, RayNodeError):
            raise error
        assert not self.restart_nodes, f"a node fault with node restarts on was not restarted: {error}"
        node = error.node
        slots = list(range(node * PER_NODE, (node + 1) * PER_NODE))
        assert error.worker_ids == slots, error
        cause = error.cause
        TALLY[f"cause {type(cause).__name__}"] += 1
        if cause is None:  # the node itself died (its actor killed)
            assert "died" in str(error) and "kill_node" in self.faulted[node], f"{error}: that node was not killed"
        elif isinstance(cause, WorkerTimeoutError):
            assert cause.hung and [s for s in cause.worker_ids if self.fired(s, ("step_hang",))], \
                f"{error}: none of its slots hung"
        elif isinstance(cause, WorkerDiedError):
            assert set(cause.worker_ids) <= set(slots) and "kill_worker" in self.faulted[node], \
                f"{error}: no env process of that node was killed"
        elif isinstance(cause, WorkerError):
            assert cause.worker_id in slots, f"{error}: its cause names slot {cause.worker_id}, of another node"
            assert self.fired(cause.worker_id, ("step_raise", "reset_raise")), f"{error}: that slot raised nothing"
        elif isinstance(cause, RuntimeError) and "policy_raise" in str(cause):
            assert self.fired("policy", ("raise",)), error
        else:
            raise AssertionError(f"an error naming no fault caused: {error!r}") from error
        failure = self.s._pool.failure(self.s._pool.nodes[node])
        if failure is not None:
            assert failure is error, (failure, error)
            self.given_up = error

    # -- operations -----------------------------------------------------------------------------

    def collect(self, steps: int) -> None:
        self.call("obtain_steps()", lambda: self.s.obtain_steps(steps))

    def episodes(self) -> None:
        self.call("obtain_exact_episodes()", lambda: self.s.obtain_exact_episodes(1), started_now=True)

    def samples(self, steps: int) -> None:
        self.call("obtain_samples()", lambda: self.s.obtain_samples(0, steps), started_now=True)

    def update(self, policy: bool, env: bool) -> None:
        if policy:
            self.policy_version += 1
        if env:
            self.env_version += 1
        self.s.update(agent_update=self.policy_version if policy else None,
                      env_update=set_version(self.env_version) if env else None)

    def env_raises(self, slot: int, kind: str) -> None:
        if kind not in self.armed[slot]:  # (one that acted may still await its report: its error stays for a later call)
            command(self.commands, slot, kind)
            self.armed[slot].add(kind)
            self.faulted[slot // PER_NODE].add("env_raises")

    def policy_raises(self) -> None:
        if "raise" not in self.armed["policy"]:
            command(self.commands, "policy", "raise")
            self.armed["policy"].add("raise")

    def env_hangs(self, slot: int) -> None:
        if self.hangs == 0:  # one per schedule at most: each costs the deadline
            command(self.commands, slot, "step_hang")
            self.armed[slot].add("step_hang")
            self.faulted[slot // PER_NODE].add("env_hangs")
            self.hangs += 1

    def kill_worker(self, node: int, which: int) -> None:
        workers = _env_workers(self.s.node_info()[node]["pid"])
        if workers:
            pid = workers[which % len(workers)]
            self.pids.add(pid)
            self.faulted[node].add("kill_worker")
            TALLY["worker processes killed"] += 1
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            alive([pid], timeout=10.0)

    def kill_node(self, node: int) -> None:
        pid = self.s.node_info()[node]["pid"]
        self.pids.add(pid)
        self.faulted[node].add("kill_node")
        self.s.kill_node(node)
        assert not alive([pid], timeout=30.0), "a killed node's actor still runs"

    def close(self) -> None:
        """``close()`` mid-schedule: every later call raises ``ManagerClosedError`` at once."""
        with within(NODE_TIMEOUT + MARGIN, "close()"):
            self.s.close()
        self.closed = True
        with within(NODE_TIMEOUT, "a call after close()"), pytest.raises(ManagerClosedError):
            self.s.obtain_steps(1)

    def use_after_give_up(self) -> None:
        assert self.given_up is not None
        with within(NODE_TIMEOUT, "a call after a node was given up"), pytest.raises(RayNodeError) as again:
            self.s.obtain_steps(N)
        assert again.value is self.given_up, (again.value, self.given_up)

    def teardown(self) -> None:
        try:
            if self.given_up is not None and not self.closed:
                self.use_after_give_up()
            self.note()
        finally:
            with within(NODE_TIMEOUT + MARGIN, "close()"):
                self.s.close()
            shutil.rmtree(self.commands, ignore_errors=True)
        left = alive(sorted(self.pids), timeout=30.0)
        assert not left, f"processes of the nodes left running after close(): {left}"
        shm = [name for name in os.listdir("/dev/shm") if any(name.startswith(f"envmgr_{pid}_") for pid in self.pids)]
        assert not shm, f"shared memory of the nodes left in /dev/shm: {shm}"


def draw(rng: random.Random) -> tuple:
    """One operation, collections weighted up (faults need steps to act)."""
    kind = rng.choices(["collect", "episodes", "samples", "update", "env_raises", "policy_raises", "env_hangs",
                        "kill_worker", "kill_node", "close"],
                       weights=[9, 2, 1, 2, 3, 1, 1, 2, 1, 0.3])[0]
    if kind == "collect":
        return (kind, rng.randint(1, 12))
    if kind == "samples":
        return (kind, rng.randint(1, 8))
    if kind == "update":
        return (kind, rng.random() < 0.7, rng.random() < 0.5)
    if kind == "env_raises":
        return (kind, rng.randrange(N), rng.choice(["step_raise", "step_raise", "reset_raise"]))
    if kind == "env_hangs":
        return (kind, rng.randrange(N))
    if kind == "kill_worker":
        return (kind, rng.randrange(NODES), rng.randrange(4))
    if kind == "kill_node":
        return (kind, rng.randrange(NODES))
    return (kind,)


def play(mode: str, seed: int) -> None:
    """One schedule: seed ``seed``'s operations on a fresh sampler, in restart setting ``mode``."""
    rng = random.Random(seed)
    schedule = [draw(rng) for _ in range(rng.randint(STEPS // 2, STEPS))]
    target = RaySchedule(mode, rng)
    print(f"  seed {seed} ({mode}, {target.options}): {schedule}")
    TALLY["schedules"] += 1
    try:
        for op in schedule:
            if target.closed:
                break
            if target.given_up is not None:  # nothing else can happen: use it once more, then close
                target.use_after_give_up()
                break
            getattr(target, op[0])(*op[1:])
            TALLY[op[0]] += 1
        TALLY["node restarts"] += target.s.restarts if not target.closed else 0
        TALLY["worker restarts"] += int(target.s.stats.counters.get("worker_restarts", 0))
    except BaseException as exc:
        exc.add_note(f"fault schedule seed {seed} ({mode}; ENVMANAGER_FAULT_SEED={seed} ENVMANAGER_FAULT_SCHEDULES=1 "
                     f"replays it): {schedule}")
        raise
    finally:
        target.teardown()


@pytest.mark.parametrize("mode", list(MODES))
def test_ray_sampler_fault_schedules(mode: str) -> None:
    index = list(MODES).index(mode)
    seeds = [SEED + i for i in range(SCHEDULES) if (SEED + i) % len(MODES) == index]  # a seed's mode: seed % 3
    print(f"\nray fault schedules ({mode}): seeds {seeds} of up to {STEPS} operations (ENVMANAGER_FAULT_SEED to repeat)")
    TALLY.clear()
    for seed in seeds:
        play(mode, seed)
    print(f"ray fault schedules ({mode}):", dict(sorted(TALLY.items())))
