"""RayMLAgentsEnvManager's failure paths on a real Ray session: fake Unity players over real gRPC on
two node actors (``n_nodes=2``, both on this machine's Ray node), each hosting two consecutive
worker ids. What each test checks is data: the worker ids an error names, which players were
replaced (their pids), that every step handed over holds the actions its player got (the players
echo them) with none lost, and that nothing is left running."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

import psutil
import pytest

pytest.importorskip("mlagents_envs")
ray = pytest.importorskip("ray", reason="the Ray variant needs the extra: pip install 'envmanager[ray]'")

from envmanager import RestartLimitError  # noqa: E402
from envmanager.mlagents import (  # noqa: E402
    UnityEnvironmentFactory,
    UnityPortInUseError,
    ray_env_manager,
)
from envmanager.mlagents.ray_env_manager import RayMLAgentsEnvManager, RayPlayerError  # noqa: E402
from envmanager.testing.fake_unity import free_base_port  # noqa: E402
from player_policies import UniquePolicy  # noqa: E402
from ray_helpers import alive, ray_session  # noqa: E402,F401 (the module's session)

B = "FakeBehavior?team=0"
N_ENV = 4  # node 0: worker ids 0, 1; node 1: 2, 3


@pytest.fixture(autouse=True)
def _session(ray_session):  # noqa: F811
    """The user's session (left running by every manager), shared by the module; the test
    checks the processes it started (Ray's own are this process's children too)."""
    from ray import cloudpickle as ray_cloudpickle

    ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the factories below travel by value
    yield
    assert ray.is_initialized()


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test check (Ray's processes are this process's children)."""
    yield


@dataclasses.dataclass(frozen=True)
class PerWorker:
    """Fake players with extra flags for some worker ids (until the file ``extra_until`` exists);
    ``fail_if``: a file that, once it exists, makes building any player fail (a node that cannot
    start again)."""

    base: UnityEnvironmentFactory
    extra: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    fail_if: str = ""
    extra_until: str = ""

    def __call__(self, worker_id, side_channels):
        if self.fail_if and os.path.exists(self.fail_if):
            raise RuntimeError(f"player {worker_id} cannot be built here")
        extra = () if self.extra_until and os.path.exists(self.extra_until) else self.extra.get(worker_id, ())
        args = self.base.additional_args + tuple(extra)
        return dataclasses.replace(self.base, additional_args=args)(worker_id, side_channels)


class Run:
    """A manager on fake players, and what came back: per worker the steps checked (each
    ActionInfo against what its player echoed) and the interrupted ones."""

    def __init__(self, fake_player, tmp_path, extra=None, fail_if="", extra_until="", **kwargs):
        self.record = tmp_path / "players.jsonl"
        path = fake_player({"record": str(self.record), "behaviors": [{
            "agents": 1, "continuous": 1, "discrete": [], "observation_shapes": [[1], [1]], "echo_actions": True,
            "episode_length": 0}]})
        self.base_port = free_base_port(N_ENV)
        base = UnityEnvironmentFactory(path, base_port=self.base_port, timeout_wait=10)
        options = {"timeout": 30, "n_nodes": 2, "restarts_rate_limit_n": 10, **kwargs}
        self.manager = RayMLAgentsEnvManager(PerWorker(base, extra or {}, fail_if, extra_until), N_ENV, **options)
        self.checked = dict.fromkeys(range(N_ENV), 0)
        self.interrupted = dict.fromkeys(range(N_ENV), 0)
        self.pids = set()  # every node actor, worker and player seen

    def start(self):
        self.manager.set_policy(B, UniquePolicy())
        self.manager.reset(config={"gravity": 1.0})
        self.check(self.manager.first_step_infos)
        self.note_pids()
        return self

    def note_pids(self):
        for info in self.manager.node_info():
            self.pids |= {info["pid"], *info["worker_pids"], *(p for p in info["player_pids"].values() if p)}

    def check(self, steps):
        for step in steps:
            w, info = step.worker_id, step.brain_name_to_action_info.get(B)
            if step.interrupted:
                assert info is None
                self.interrupted[w] += 1
                continue
            if info is None:  # a reset handed over by reset()
                continue
            decision, _ = step.current_all_step_result[B]
            sent = dict(zip(info.agent_ids, info.env_action.continuous[:, 0].tolist(), strict=True))
            got = dict(zip(decision.agent_id.tolist(), decision.obs[1][:, 0].tolist(), strict=True))
            assert got == sent, f"worker {w}: the env got {got}, the step's ActionInfo says {sent}"
            self.checked[w] += 1

    def steps_until(self, done, seconds=60.0):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.check(self.manager.get_steps())
            self.note_pids()
            if done():
                return
        raise AssertionError(f"not done in {seconds:g} s of get_steps calls")

    def players(self):
        """pid -> [worker id, STEP inputs], from the players' record."""
        out = {}
        for r in map(json.loads, self.record.read_text().splitlines()):
            if r["event"] == "start":
                out[r["pid"]] = [r["port"] - self.base_port, 0]
            elif r["event"] == "input" and r["command"] == "STEP":
                out[r["pid"]][1] += 1
        return out

    def no_step_lost(self):
        """Each worker's players got the steps it handed over, plus at most one per player (the
        step in flight when it stopped or the run ended)."""
        by_worker: dict[int, list] = {}
        for w, n in self.players().values():
            by_worker.setdefault(w, []).append(n)
        for w in range(N_ENV):
            got = sum(by_worker.get(w, []))
            assert 0 <= got - self.checked[w] <= len(by_worker.get(w, [])), (w, got, self.checked[w], by_worker)

    def close(self):
        self.manager.close()
        self.note_pids_after_close()

    def note_pids_after_close(self):
        left = alive(sorted(self.pids), timeout=20)
        running = [(p, " ".join(psutil.Process(p).cmdline())[:100]) for p in left if psutil.pid_exists(p)]
        assert not left, f"left running: {running}"


def node_of(manager, index):
    return next(info for info in manager.node_info() if info["index"] == index)


@pytest.mark.timeout(120)
def test_a_node_lost_with_a_step_in_flight_is_replaced_by_the_reset(fake_player, tmp_path):
    """Node 1's actor dies while its players step; the trainer then resets every env (ML-Agents
    does on a team swap or a lesson that needs it): node 1 is started again, its players come
    back as interrupted resets, the others as plain ones, and stepping goes on."""
    run = Run(fake_player, tmp_path, extra={2: ("--step-latency", "0.3"), 3: ("--step-latency", "0.3")}).start()
    try:
        run.steps_until(lambda: min(run.checked.values()) >= 2 and set(run.manager.manager.waiting_worker_ids) >= {2, 3})
        lost = node_of(run.manager, 1)
        os.kill(lost["pid"], signal.SIGKILL)
        assert run.manager.reset() == N_ENV
        resets = {s.worker_id: s.interrupted for s in run.manager.first_step_infos}
        assert resets == {0: False, 1: False, 2: True, 3: True}
        assert run.manager.restart_counts == [0, 0, 1, 1]
        new = node_of(run.manager, 1)
        assert new["pid"] != lost["pid"] and set(new["player_pids"].values()).isdisjoint(lost["player_pids"].values())
        assert alive([lost["pid"], *lost["worker_pids"], *lost["player_pids"].values()], timeout=20) == []
        before = dict(run.checked)
        run.check(run.manager.first_step_infos)
        run.steps_until(lambda: all(run.checked[w] >= before[w] + 2 for w in range(N_ENV)))
        resets = run.manager.manager.reset()  # the pool's own, as the core's: nothing before a reset
        assert sorted(info.worker_id for info in resets) == list(range(N_ENV))
        assert all(info.previous_result is None and info.action is None for info in resets), resets
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_errors_name_the_trainers_worker_ids(fake_player, tmp_path):
    """Worker 3's player (node 1's second) stops past its limits: the error names worker 3, the
    run's other players were served until then with nothing lost — and after it, worker 2 too,
    its node-mate, whose step was in flight on the node that raised."""
    crash = ("--crash-after-steps", "3", "--crash-mode", "exit", "--crash-exit-code", "0")
    run = Run(fake_player, tmp_path, extra={3: crash}, max_lifetime_restarts=0).start()
    try:
        with pytest.raises(RestartLimitError) as caught:
            run.steps_until(lambda: False)
        error = caught.value
        assert error.worker_id == 3 and error.worker_ids == [3] and str(error).startswith("worker 3 "), error
        assert "max_lifetime_restarts" in str(error) and run.checked[3] == 3
        assert run.manager.manager.failure_of(3) is error
        before = dict(run.checked)
        run.steps_until(lambda: all(run.checked[w] >= before[w] + 3 for w in (0, 1, 2)))
        assert run.checked[3] == 3 and run.manager.manager.failure_of(2) is None
    finally:
        run.close()
    run.no_step_lost()


@pytest.mark.timeout(240)
def test_a_silent_node_is_replaced_at_its_own_deadline_while_the_other_answers(fake_player, tmp_path, monkeypatch):
    """Node 1's actor stops (SIGSTOP: alive, silent) while node 0 keeps answering: node 1 is
    replaced once its own deadline passed (the core's 30 s + a 1 s margin; the core's deadline is
    also each player's start-up deadline, which CI's load stretched past 10 s), its players
    come back interrupted; node 0's were never interrupted and stepped on meanwhile; nothing is lost."""
    monkeypatch.setattr(ray_env_manager, "RAY_MARGIN", 1.0)
    run = Run(fake_player, tmp_path, timeout=30).start()
    try:
        run.steps_until(lambda: min(run.checked.values()) >= 2)
        silent = node_of(run.manager, 1)
        os.kill(silent["pid"], signal.SIGSTOP)
        during = dict(run.checked)
        run.steps_until(lambda: run.interrupted[2] and run.interrupted[3], seconds=120)  # 31 s, then a node's start
        assert run.checked[0] > during[0] + 5 and run.checked[1] > during[1] + 5  # node 0 served meanwhile
        assert run.interrupted == {0: 0, 1: 0, 2: 1, 3: 1} and run.manager.restart_counts == [0, 0, 1, 1]
        assert node_of(run.manager, 1)["pid"] != silent["pid"]
        assert alive([silent["pid"], *silent["worker_pids"], *silent["player_pids"].values()], timeout=20) == []
        run.steps_until(lambda: run.checked[2] > during[2] + 2 and run.checked[3] > during[3] + 2)
    finally:
        run.close()
    run.no_step_lost()


@pytest.mark.timeout(120)
def test_a_player_restarted_inside_a_node_call_goes_on(fake_player, tmp_path):
    """Worker 1's process dies while the trainer holds its result; a call on worker 0 only (as
    ML-Agents' analytics) lets node 0 notice and restart it. Stepping goes on: worker 1 comes
    back interrupted, once, and every step holds the actions its player got."""
    run = Run(fake_player, tmp_path, extra={1: ("--reset-latency", "1")}).start()
    try:
        run.steps_until(lambda: min(run.checked.values()) >= 2 and 1 not in run.manager.manager.waiting_worker_ids)
        worker = node_of(run.manager, 0)["worker_pids"][1]
        os.kill(worker, signal.SIGKILL)
        assert alive([worker], timeout=10) == []
        run.manager.manager.call_on([0], "behavior_specs")  # as _send_analytics
        before = dict(run.checked)
        run.steps_until(lambda: run.interrupted[1] == 1 and run.checked[1] >= before[1] + 2)
        assert run.interrupted == {0: 0, 1: 1, 2: 0, 3: 0} and run.manager.restart_counts == [0, 1, 0, 0]
    finally:
        run.close()
    run.no_step_lost()


@pytest.mark.timeout(120)
def test_a_node_that_cannot_start_again_ends_the_run_naming_it(fake_player, tmp_path):
    """Node 1's actor dies and its replacement cannot build its players (the node may be restarted,
    its players not past one restart each): the run ends at once with RayPlayerError naming node 1,
    worker ids 2 and 3 and what the players raised (no retry loop)."""
    marker = tmp_path / "no-more-players"
    run = Run(fake_player, tmp_path, fail_if=str(marker), max_lifetime_restarts=1, restarts_rate_limit_n=-1).start()
    try:
        run.steps_until(lambda: min(run.checked.values()) >= 1)
        marker.touch()
        os.kill(node_of(run.manager, 1)["pid"], signal.SIGKILL)
        with pytest.raises(RayPlayerError) as caught:
            run.steps_until(lambda: False)
        assert caught.value.node == 1 and "worker ids [2, 3]" in str(caught.value), caught.value
        assert "cannot be built here" in str(caught.value)
        assert caught.value.worker_ids == [2, 3] and caught.value.cause is not None
        assert run.manager.restart_counts == [0, 0, 0, 0]  # nothing came back from the replacement
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_a_node_lost_past_the_limits_is_given_up_with_the_one_error_shape(fake_player, tmp_path):
    """Node 1's actor dies twice (one restart allowed): replaced once, counted once by the pool's
    supervisor; then refused with a ``RestartLimitError`` (also ``RayPlayerError``) naming node 1,
    worker ids 2 and 3, the limit and the loss — the shape a process past the limits raises —
    and the same error at once on every later use of node 1."""
    run = Run(fake_player, tmp_path, max_lifetime_restarts=1, restarts_rate_limit_n=-1).start()
    pool = run.manager.manager
    try:
        run.steps_until(lambda: min(run.checked.values()) >= 1)
        os.kill(node_of(run.manager, 1)["pid"], signal.SIGKILL)
        run.steps_until(lambda: run.interrupted[2] and run.interrupted[3])
        assert pool.supervisor.restarts == pool.supervisor.restart_count(1) == 1
        os.kill(node_of(run.manager, 1)["pid"], signal.SIGKILL)
        with pytest.raises(RestartLimitError) as caught:
            run.steps_until(lambda: False)
        error = caught.value
        assert isinstance(error, RayPlayerError) and error.node == 1 and error.worker_ids == [2, 3], error
        assert "max_lifetime_restarts" in error.reason and "worker ids [2, 3]" in str(error)
        assert isinstance(error.failure, RayPlayerError) and "lost" in str(error.failure)
        assert pool.supervisor.restarts == 1 and pool.failure_of(2) is error and pool.failure_of(0) is None
        with pytest.raises(RestartLimitError) as again:  # node 1 given up: its error, at once
            pool.call_on([3], "behavior_specs")
        assert again.value is error
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_port_taken_is_a_clear_error_and_nothing_is_left(fake_player, tmp_path):
    """Worker 3's port is taken: the manager raises UnityPortInUseError naming it (from node 1's
    start) and the nodes it started are gone."""
    import socket

    path = fake_player({"record": str(tmp_path / "players.jsonl"), "behaviors": [{"agents": 1}]})
    base_port = free_base_port(N_ENV)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", base_port + 3))
        taken.listen()
        with pytest.raises(UnityPortInUseError) as caught:
            RayMLAgentsEnvManager(UnityEnvironmentFactory(path, base_port=base_port, timeout_wait=10), N_ENV,
                                  n_nodes=2, timeout=30)
    assert (caught.value.port, caught.value.worker_id) == (base_port + 3, 3)
    players = [r["pid"] for r in map(json.loads, (tmp_path / "players.jsonl").read_text().splitlines())
               if r["event"] == "start"]
    assert len(players) == 3 and alive(players, timeout=20) == []  # worker 3's never started
    assert ours_running() == []


def ours_running():
    """Node actors and their env workers still running under this process (Ray's own idle
    workers aside)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "PlayerNode" in cmdline or "fake_unity" in cmdline:
            out.append(p.pid)
    return alive(out, timeout=20)


@pytest.mark.timeout(60)
def test_a_lost_node_s_ray_node_is_used_again_when_it_is_the_only_one_alive():
    """The replacement of a node actor that died on a single-node cluster goes on that node at
    once (no other is coming): it was waited for as long as ``wait_s``, 10 s per replacement."""
    from envmanager.mlagents.ray_player_nodes import live_ray_nodes
    from envmanager.ray.session import RaySession

    session = RaySession.join(None, None)
    try:
        only = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        assert len(only) == 1
        assert live_ray_nodes(session, exclude=only[0], wait_s=600) == only  # (past the test's own timeout if waited)
        assert live_ray_nodes(session, exclude="another", wait_s=600) == only
    finally:
        session.leave()


@pytest.mark.parametrize("n_nodes", [0, 1.5, "2", True, N_ENV + 1])
def test_a_bad_node_count_is_refused_before_anything_starts(fake_player, tmp_path, n_nodes):
    from envmanager.errors import InvalidInputError

    path = fake_player({"record": str(tmp_path / "players.jsonl"), "behaviors": [{"agents": 1}]})
    with pytest.raises(InvalidInputError, match="n_nodes must be"):
        RayMLAgentsEnvManager(UnityEnvironmentFactory(path, base_port=free_base_port(N_ENV), timeout_wait=10), N_ENV,
                              n_nodes=n_nodes, timeout=30)
    assert not (tmp_path / "players.jsonl").exists() and ours_running() == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("restarts", ["off", "past the limits"])
def test_a_node_that_answered_a_players_error_and_then_died_is_told_for_both(fake_player, tmp_path, monkeypatch,
                                                                             restarts):
    """Worker 3's player stops after 3 steps and its node cannot restart it (restarts off, or
    none allowed): node 1 answers that error, and its actor is killed once the answer is in the
    driver, before the pool took it. The player's error is raised once, for worker 3; then node
    1's death, naming node 1 and worker ids 2 and 3, which are given up (its error at once on
    every later use), not the player's error again; node 0 goes on. The core's case:
    ``test_an_env_error_sent_before_its_process_died_is_the_envs_and_the_death_the_processs``."""
    from envmanager.mlagents.ray_player_nodes import PlayerNodeState

    killed: list[int] = []
    get = PlayerNodeState.get

    def get_then_kill(node, ref, timeout=None):
        value, error = get(node, ref, timeout)  # the answer, in the driver
        if node.index == 1 and error is not None and not killed:
            killed.append(node.info["pid"])
            os.kill(node.info["pid"], signal.SIGKILL)
            assert alive(killed, timeout=20) == [], "node 1's actor outlived its kill"
        return value, error

    monkeypatch.setattr(PlayerNodeState, "get", get_then_kill)
    crash = ("--crash-after-steps", "3", "--crash-mode", "exit", "--crash-exit-code", "0")
    options = {"restart_workers": False} if restarts == "off" else {"max_lifetime_restarts": 0}
    run = Run(fake_player, tmp_path, extra={3: crash}, **options).start()
    pool = run.manager.manager
    try:
        with pytest.raises(Exception) as caught:  # the player's error, for worker 3
            run.steps_until(lambda: False)
        error = caught.value
        assert killed and not isinstance(error, RayPlayerError) and error.worker_ids == [3], repr(error)
        assert isinstance(error, RestartLimitError) == (restarts != "off"), repr(error)
        with pytest.raises(RayPlayerError) as caught:  # then node 1's death
            run.steps_until(lambda: False)
        died = caught.value
        assert died.node == 1 and died.worker_ids == [2, 3] and "lost" in str(died), died
        assert ("restarts are disabled" in str(died)) == (restarts == "off"), died
        assert pool.failure_of(2) is died and pool.failure_of(3) is died and pool.failure_of(0) is None
        with pytest.raises(RayPlayerError) as again:  # given up: its error, at once
            pool.call_on([2], "behavior_specs")
        assert again.value is died
        before = dict(run.checked)
        run.steps_until(lambda: run.checked[0] >= before[0] + 2 and run.checked[1] >= before[1] + 2)
        assert pool.supervisor.restarts == 0
    finally:
        run.close()
    assert alive(killed, timeout=5) == []


@pytest.mark.timeout(180)
def test_a_player_its_node_gave_up_steps_again_once_the_node_is_replaced(fake_player, tmp_path):
    """Worker 3's player stops twice within its node's rate limit (one restart per 4 s): the node
    gives it up and the trainer gets its RestartLimitError. Once that window has passed, node 1 is
    lost and the pool's supervisor restarts it with both its players (within the limits): worker 3
    is stepped again on the new node, with every action its player got. The player's old error
    was kept for it, so it was never stepped again and waited for nothing."""
    healed = tmp_path / "healed"
    crash = ("--crash-after-steps", "3", "--crash-mode", "exit", "--crash-exit-code", "0")
    run = Run(fake_player, tmp_path, extra={3: crash}, extra_until=str(healed), restarts_rate_limit_n=1,
              restarts_rate_limit_period_s=4.0).start()
    pool = run.manager.manager
    try:
        with pytest.raises(RestartLimitError) as caught:  # its second stop, within the window
            run.steps_until(lambda: False)
        assert caught.value.worker_ids == [3] and pool.failure_of(3) is caught.value, repr(caught.value)
        healed.touch()  # its players from now on do not stop
        run.steps_until(lambda: min(run.checked[w] for w in (0, 1, 2)) >= 3)
        time.sleep(4.5)  # the rate window passes
        os.kill(node_of(run.manager, 1)["pid"], signal.SIGKILL)
        before = dict(run.checked)
        run.steps_until(lambda: run.interrupted[2] >= 1 and run.interrupted[3] >= 2
                        and min(run.checked[w] - before[w] for w in range(N_ENV)) >= 2)
        assert pool.failure_of(3) is None and pool.supervisor.restart_count(1) >= 1
    finally:
        run.close()
    run.no_step_lost()
