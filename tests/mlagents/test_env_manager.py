"""MLAgentsEnvManager: fake Unity players under the real mlagents_envs client, over real gRPC."""
from __future__ import annotations

import dataclasses
import json
import socket
import time

import pytest

pytest.importorskip("mlagents_envs")
psutil = pytest.importorskip("psutil")

import numpy as np  # noqa: E402
from mlagents_envs.base_env import ActionTuple  # noqa: E402
from mlagents_envs.side_channel.engine_configuration_channel import EngineConfig  # noqa: E402

from envmanager import EnvManagerError, InvalidInputError, ManagerClosedError, RestartLimitError  # noqa: E402
from envmanager.mlagents import (  # noqa: E402
    ActionInfo,
    EnvironmentStep,
    MLAgentsEnvManager,
    UnityEnvironmentFactory,
    UnityPortInUseError,
    normalize_engine_config,
    normalize_env_parameters,
)
from envmanager.testing.fake_unity import free_base_port  # noqa: E402
from process_helpers import ctrl_c_twice_in_close  # noqa: E402

B = "FakeBehavior?team=0"
WALKER, PICKER = "Walker?team=0", "Picker?team=1"


# ---------------------------------------------------------------------------------------------
# Helpers


class TargetPolicy:
    """Picks the target shown one-hot in observation 0 (never a masked action); records calls."""

    def __init__(self, n_branch: int, n_discrete: int = 1) -> None:
        self.n_branch, self.n_discrete = n_branch, n_discrete
        self.calls: list[tuple[int, list[int]]] = []

    def get_action(self, decision_steps, worker_id):
        self.calls.append((worker_id, list(decision_steps.agent_id)))
        actions = np.zeros((len(decision_steps), self.n_discrete), np.int32)
        actions[:, 0] = np.argmax(decision_steps.obs[0][:, : self.n_branch], axis=1)
        return ActionInfo.for_steps(decision_steps, ActionTuple(discrete=actions), {"value": 0.0})


def per_worker(base: UnityEnvironmentFactory, extra_args: dict) -> object:
    """A user factory ``(worker_id, side_channels) -> BaseEnv`` giving some workers extra flags
    (a closure, so cloudpickle ships it by value to the workers)."""

    def make(worker_id, side_channels):
        args = base.additional_args + tuple(extra_args.get(worker_id, ()))
        return dataclasses.replace(base, additional_args=args)(worker_id, side_channels)

    return make


def slow_to_close(base: UnityEnvironmentFactory) -> object:
    """A user factory whose envs take 30 s to close (a player slow to quit; a closure, as ``per_worker``)."""

    def make(worker_id, side_channels):
        env = base(worker_id, side_channels)
        close = env._close

        def slow(*args, **kwargs):
            time.sleep(30)
            return close(*args, **kwargs)

        env._close = slow
        return env

    return make


def start(fake_player, config, n_env, *, extra_args=None, timeout_wait=10, wrap=None, **kwargs):
    """An MLAgentsEnvManager on fake players at a free base port (retried if the port is taken);
    ``wrap(factory)``: the factory it is given."""
    path = fake_player(config)
    for attempt in range(3):
        base = UnityEnvironmentFactory(path, base_port=free_base_port(n_env), timeout_wait=timeout_wait)
        factory = per_worker(base, extra_args) if extra_args else base
        factory = wrap(factory) if wrap is not None else factory
        try:
            return MLAgentsEnvManager(factory, n_env, **{"timeout": 30, **kwargs})
        except UnityPortInUseError:
            if attempt == 2:
                raise


def steps_until(manager, done, seconds=60.0):
    """Call get_steps until ``done(all steps so far)`` (for at most ``seconds``); returns the steps."""
    got: list[EnvironmentStep] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got += manager.get_steps()
        if done(got):
            return got
    raise AssertionError(f"condition not reached in {seconds:g} s of get_steps calls")


def by_worker(steps, worker_id):
    return [s for s in steps if s.worker_id == worker_id]


def stat(step, key):
    return [value for value, _ in step.environment_stats.get(key, [])]


# ---------------------------------------------------------------------------------------------
# Stepping


@pytest.mark.timeout(120)
def test_workers_two_behaviours_masks_terminal_and_interrupted(fake_player, tmp_path, process_gone):
    record = tmp_path / "players.jsonl"
    config = {"record": str(record), "behaviors": [
        {"name": WALKER, "agents": 2, "continuous": 2, "discrete": [], "episode_length": [2, 3]},
        {"name": PICKER, "agents": 2, "discrete": [3, 2], "action_masks": [[0], []],
         "episode_length": 2, "episode_end": "interrupt"},
    ]}
    manager = start(fake_player, config, 3)
    try:
        specs = manager.training_behaviors
        assert set(specs) == {WALKER, PICKER}
        assert specs[WALKER].action_spec.continuous_size == 2
        assert specs[PICKER].action_spec.discrete_branches == (3, 2)
        picker = TargetPolicy(3, 2)
        manager.set_policy(PICKER, picker)  # the walker has no policy: it gets empty actions
        assert manager.reset() == 3
        for step in manager.first_step_infos:
            decision, terminal = step.current_all_step_result[PICKER]
            assert decision.action_mask[0].tolist() == [[True, False, False]] * 2
            assert decision.action_mask[1].tolist() == [[False, False]] * 2
            assert len(terminal) == 0 and step.brain_name_to_action_info == {}

        steps = steps_until(manager, lambda got: all(len(by_worker(got, w)) >= 4 for w in range(3)))
        for w in range(3):
            mine = by_worker(steps, w)[:4]
            walker_ends = [list(s.current_all_step_result[WALKER][1].agent_id) for s in mine]
            assert walker_ends == [[], [0], [1], [0]]  # episode lengths 2 and 3, terminated
            picker_ends = [s.current_all_step_result[PICKER][1] for s in mine]
            assert [list(t.agent_id) for t in picker_ends] == [[], [2, 3], [], [2, 3]]
            assert all(t.interrupted.all() for t in picker_ends)  # max_step_reached
            assert [stat(s, "Fake/Step") for s in mine] == [[1.0], [2.0], [3.0], [4.0]]
            assert all(stat(s, "Fake/MaskViolations") == [0.0] for s in mine)  # masks respected
            for s in mine:  # the ActionInfo that led to each step comes with it
                assert set(s.brain_name_to_action_info) == {PICKER}
                assert s.brain_name_to_action_info[PICKER].agent_ids == [2, 3]
                decision, terminal = s.current_all_step_result[PICKER]
                ended = dict(zip(terminal.agent_id, terminal.reward, strict=True))  # a finished agent's reward
                rewards = {a: ended.get(a, r) for a, r in zip(decision.agent_id, decision.reward, strict=True)}
                assert rewards == {2: 1.0, 3: 1.0}
        assert {w for w, _ in picker.calls} == {0, 1, 2}

        # A wrong action is rejected before anything is sent; stepping then goes on in order.
        manager.set_policy(PICKER, lambda_policy(lambda dec: ActionTuple(discrete=np.zeros((len(dec), 1), np.int32))))
        with pytest.raises(InvalidInputError, match=r"discrete actions of shape \(2, 1\); expected \(2, 2\)"):
            steps_until(manager, lambda got: False)
        manager.set_policy(PICKER, picker)
        more = steps_until(manager, lambda got: all(by_worker(got, w) for w in range(3)))
        for w in range(3):
            before = stat(by_worker(steps, w)[-1], "Fake/Step")[0]
            assert stat(by_worker(more, w)[0], "Fake/Step")[0] > before

        starts = [r for r in map(json.loads, record.read_text().splitlines()) if r["event"] == "start"]
        ports = sorted(r["port"] for r in starts)
        assert len(ports) == 3 and ports == list(range(ports[0], ports[0] + 3))  # base_port + worker_id
        pids = manager.player_pids
        assert sorted(pids.values()) == sorted(r["pid"] for r in starts)
    finally:
        manager.close()
    assert all(process_gone(pid) for pid in pids.values())
    left = [p for p in psutil.Process().children(recursive=True)
            if any("fake_unity" in part or "envmanager-worker" in part for part in p.cmdline())]
    assert left == []
    with pytest.raises(ManagerClosedError):
        manager.get_steps()


def lambda_policy(choose):
    class Policy:
        def get_action(self, decision_steps, worker_id):
            return ActionInfo.for_steps(decision_steps, choose(decision_steps))

    return Policy()


# ---------------------------------------------------------------------------------------------
# Side channels


class FakeAgentManager:
    """What MLAgentsEnvManager uses of ML-Agents' AgentManager."""

    class Queue:
        def __init__(self, items):
            self.items = list(items)

        def empty(self):
            return not self.items

        def get_nowait(self):
            return self.items.pop(0)

    def __init__(self, policies=()):
        self.policy_queue = self.Queue(policies)
        self.experiences, self.stats, self.episodes_ended = [], [], 0

    def add_experiences(self, decision_steps, terminal_steps, worker_id, action_info):
        self.experiences.append((worker_id, len(decision_steps), len(terminal_steps), action_info))

    def record_environment_stats(self, stats, worker_id):
        self.stats.append((worker_id, stats))

    def end_episode(self):
        self.episodes_ended += 1


@pytest.mark.timeout(120)
def test_env_parameters_and_engine_settings_reach_players_and_come_back(fake_player):
    engine = EngineConfig(width=64, height=48, quality_level=2, time_scale=7.0, target_frame_rate=30,
                          capture_frame_rate=50)
    manager = start(fake_player, {"behaviors": [{"agents": 2, "episode_length": 0}]}, 2, engine_config=engine)
    try:
        policy = TargetPolicy(3)
        agent_manager = FakeAgentManager([policy])
        manager.set_agent_manager(B, agent_manager)
        manager.on_training_started(B, {"trainer_type": "ppo"})
        assert manager.training_started == {B: {"trainer_type": "ppo"}}
        sampler = {"sampler_type": "uniform", "sampler_parameters": {"min_value": 1.0, "max_value": 2.0, "seed": 7}}
        assert manager.reset(config={"gravity": 9.5, "mass": sampler}) == 2
        assert agent_manager.episodes_ended == 1
        for step in manager.first_step_infos:
            assert stat(step, "Fake/EnvParam/gravity") == [9.5]
            assert 1.0 <= stat(step, "Fake/EnvParam/mass")[0] <= 2.0
            assert stat(step, "Fake/Engine/time_scale") == [7.0]
            assert (stat(step, "Fake/Engine/width"), stat(step, "Fake/Engine/height")) == ([64.0], [48.0])
            assert stat(step, "Fake/Engine/quality_level") == [2.0]
            assert stat(step, "Fake/Engine/target_frame_rate") == [30.0]
            assert stat(step, "Fake/Engine/capture_frame_rate") == [50.0]
            assert stat(step, "Fake/Seed") == [float(step.worker_id)]  # seed + worker_id

        # Bad values are refused before anything is sent.
        with pytest.raises(InvalidInputError, match="gravity"):
            manager.set_env_parameters({"gravity": "heavy"})
        with pytest.raises(InvalidInputError, match="width and height"):
            manager.set_engine_config(width=10)
        replayed = manager.manager.replay_calls
        for bad in ({"gravity": 1e39}, {"mass": {**sampler, "sampler_parameters": {"min_value": 1, "max_value": 2,
                                                                                    "seed": 2**40}}}):
            with pytest.raises(InvalidInputError, match="side channel"):  # (a float32, an int32 on the wire)
                manager.set_env_parameters(bad)
        with pytest.raises(InvalidInputError, match="side channel"):
            manager.set_engine_config(time_scale=1e39)
        assert manager.env_parameters["gravity"] == 9.5 and manager.manager.replay_calls == replayed  # nothing kept

        manager.set_env_parameters({"reward_scale": 3.0})
        manager.set_engine_config(time_scale=20)
        steps = steps_until(manager, lambda got: all(by_worker(got, w) for w in range(2)))
        # The reset steps went to the agent manager first, and its queued policy was taken.
        assert manager.policies[B] is policy and {w for w, _ in policy.calls} == {0, 1}
        for w in range(2):
            first = by_worker(steps, w)[0]
            assert stat(first, "Fake/EnvParam/reward_scale") == [3.0]
            assert stat(first, "Fake/Engine/time_scale") == [20.0]
            assert "Fake/EnvParam/gravity" not in first.environment_stats  # sent once, on reset
            assert list(first.current_all_step_result[B][0].reward) == [3.0, 3.0]
        assert manager.process_steps(steps) == len(steps)
        reset_experiences = agent_manager.experiences[:2]
        assert [(w, n) for w, n, _, _ in reset_experiences] == [(0, 2), (1, 2)]
        assert all(info == ActionInfo.empty() for *_, info in reset_experiences)
        assert all(info.agent_ids == [0, 1] for *_, info in agent_manager.experiences[2:])
        # the players' stats with each step; and per policy call, how many players it acted for
        # (TargetPolicy has no batched call: one each)
        calls = [stats for _, stats in agent_manager.stats if "Env Manager/Players per Inference" in stats]
        assert len(agent_manager.stats) - len(calls) == len(agent_manager.experiences)
        assert calls and all(v == 1.0 for stats in calls for v, _ in stats["Env Manager/Players per Inference"])
        assert manager.manager.replay_calls == [
            ("set_engine_config", ({"time_scale": 20.0},), {}),
            ("set_env_parameters", ({"gravity": 9.5, "mass": normalize_env_parameters({"m": sampler})["m"],
                                     "reward_scale": 3.0},), {}),
        ]
    finally:
        manager.close()


# ---------------------------------------------------------------------------------------------
# Faults


@pytest.mark.timeout(120)
def test_crashed_player_restarts_alone_with_params_replayed_until_quota(fake_player, process_gone):
    # Worker 1's player stops (exit code 0) on its 4th step; every incarnation does.
    stops = ["--crash-after-steps", "3", "--crash-mode", "exit", "--crash-exit-code", "0"]
    manager = start(fake_player, {"behaviors": [{"agents": 1, "episode_length": 0}]}, 3, extra_args={1: stops})
    try:
        manager.set_policy(B, TargetPolicy(3))
        manager.reset(config={"gravity": 4.0})
        pids = manager.player_pids
        steps = steps_until(manager, lambda got: any(s.interrupted for s in got))
        restarted = next(s for s in steps if s.interrupted)
        assert restarted.worker_id == 1 and [s.worker_id for s in steps if s.interrupted] == [1]
        assert restarted.brain_name_to_action_info == {}
        assert stat(restarted, "Fake/EnvParam/gravity") == [4.0]  # replayed before its reset
        assert stat(restarted, "Fake/Step") == []  # a fresh reset, not a step
        # Only that worker was restarted; the others stepped on meanwhile, never reset.
        assert manager.restart_counts == [0, 1, 0]
        new_pids = manager.player_pids
        assert new_pids[0] == pids[0] and new_pids[2] == pids[2] and new_pids[1] != pids[1]
        assert process_gone(pids[1])
        last_regular = max(i for i, s in enumerate(steps) if s.worker_id == 1 and not s.interrupted)
        during = {s.worker_id for s in steps[last_regular + 1:]}
        assert {0, 2} <= during
        for w in (0, 2):
            counts = [stat(s, "Fake/Step")[0] for s in by_worker(steps, w)]
            assert counts == list(np.arange(1.0, len(counts) + 1))

        # The new player stops again: restarting it again would break the rate limit.
        with pytest.raises(RestartLimitError, match="restarts_rate_limit_n") as caught:
            steps_until(manager, lambda got: False)
        assert caught.value.worker_id == 1
        assert "return code 0" in str(caught.value)  # the player's own exit, as mlagents saw it
        # The other workers are still served.
        assert {s.worker_id for s in steps_until(manager, lambda got: len(got) >= 4)} <= {0, 2}
    finally:
        manager.close()
    assert all(process_gone(pid) for pid in [*pids.values(), *new_pids.values()])


@pytest.mark.timeout(120)
def test_hung_player_is_restarted_and_the_orphan_killed(fake_player, process_gone):
    # Worker 0's player stops answering on its 3rd step and has no watchdog of its own: only
    # the manager can end it once the deadline has cut its worker off.
    hang = ["--crash-after-steps", "2", "--crash-mode", "hang"]
    config = {"parent_watchdog": False, "behaviors": [{"agents": 1, "episode_length": 0}]}
    manager = start(fake_player, config, 2, extra_args={0: hang}, timeout=8, timeout_wait=60)
    try:
        manager.set_policy(B, TargetPolicy(3))
        manager.reset()
        hung_pid = manager.player_pids[0]
        steps = steps_until(manager, lambda got: any(s.interrupted for s in got))
        assert [s.worker_id for s in steps if s.interrupted] == [0]
        assert manager.restart_counts == [1, 0]
        assert manager.player_pids[0] != hung_pid
        # Gone, whoever got it first: the pool kills the hung worker's process tree, and the
        # adapter kills a player its restarted worker left behind (it logs that it did).
        assert process_gone(hung_pid)
        assert len(by_worker(steps, 1)) > 2  # worker 1 kept stepping
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_player_left_by_a_worker_killed_before_a_reset_is_killed_by_the_reset(fake_player, process_gone):
    """Worker 1's player hangs in its 3rd step; its worker is SIGKILLed meanwhile (the player,
    with no watchdog, lives on as an orphan no process tree leads to); the trainer then resets
    every env: the restart happens in the reset's drain (its interrupted answer dropped), and the
    reset kills the orphan."""
    import os
    import signal

    hang = ["--crash-after-steps", "2", "--crash-mode", "hang"]
    config = {"parent_watchdog": False, "behaviors": [{"agents": 1, "episode_length": 0}]}
    manager = start(fake_player, config, 2, extra_args={1: hang}, timeout_wait=60)
    try:
        manager.set_policy(B, TargetPolicy(3))
        manager.reset()
        orphan = manager.player_pids[1]
        steps_until(manager, lambda got: len(by_worker(got, 1)) >= 2 and 1 in manager.manager.waiting_worker_ids)
        os.kill(manager.manager.processes[1].pid, signal.SIGKILL)
        assert manager.reset() == 2
        assert manager.restart_counts == [0, 1] and manager.player_pids[1] != orphan
        assert process_gone(orphan, timeout=5)  # by the reset, not at close
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_a_worker_dying_during_a_settings_change_is_restarted_with_it(fake_player):
    """Worker 1's process dies while a settings change waits for its answer (stopped, then killed
    once the call is in flight): no error reaches the trainer — the restart replays the change —
    and its fresh reset reports the new value."""
    import os
    import signal
    import threading

    manager = start(fake_player, {"behaviors": [{"agents": 1, "episode_length": 0}]}, 2)
    try:
        manager.set_policy(B, TargetPolicy(3))
        manager.reset(config={"gravity": 1.0})
        steps_until(manager, lambda got: {s.worker_id for s in got} == {0, 1})
        worker = manager.manager.processes[1]
        os.kill(worker.pid, signal.SIGSTOP)
        raised = []

        def change():
            try:
                manager.set_env_parameters({"gravity": 2.0})
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=change)
        thread.start()
        deadline = time.monotonic() + 10
        while worker.request is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.request is not None  # the call is in flight on it
        os.kill(worker.pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive() and raised == []
        steps = steps_until(manager, lambda got: any(s.interrupted for s in got))
        (restarted,) = [s for s in steps if s.interrupted]
        assert restarted.worker_id == 1 and stat(restarted, "Fake/EnvParam/gravity")[-1] == 2.0
        assert manager.restart_counts == [0, 1]
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_results_taken_before_a_re_reset_that_raises_are_kept():
    """A settings change re-resets a worker restarted before it (its fresh reset had the old
    settings), after taking what came in meanwhile: another worker's step among it. When that
    reset raises (past the restart limits here), what was taken stays in the caller's list, for
    the next ``get_steps``: no step lost, none stepped again on an older observation. (The core's
    own workers stand in for the players: the replay helper is the core's.)"""
    import os
    import signal

    from envmanager import SubprocessEnvManager
    from envmanager.mlagents.replay import reset_restarted
    from envmanager.testing.envs import EnvFactory
    from process_helpers import alive

    factory = EnvFactory(per_env={0: {"fault": "raise_reset", "fault_at": 2}})  # a restarted env's second reset
    with SubprocessEnvManager(factory, 2, timeout=30, restart_workers=True, max_lifetime_restarts=1,
                              restarts_rate_limit_n=-1) as m:
        m.reset()
        dead = m.process_of(0).pid
        os.kill(dead, signal.SIGKILL)
        assert not alive([dead])
        m.send_step({0: 1, 1: 1})  # worker 0's step is cut: its restart's fresh reset answers it
        m.wait_idle(timeout=30)  # worker 0 restarted (its fresh reset in), worker 1's step in: both kept
        assert m.restart_count(0) == 1
        held: list = []
        with pytest.raises(EnvManagerError):
            reset_restarted(m, held)
        assert sorted((info.worker_id, info.interrupted) for info in held) == [(0, True), (1, False)]
        assert held[[i.worker_id for i in held].index(1)].current_result.observation[0] == 1  # its step


def stepping_with_worker_1_restarted(fake_player, **options):
    """A manager on two fake players, both stepped, then worker 1 killed: returns it once the
    restart's fresh reset is in and not taken, and ``restart(times)``, which kills worker 1 again
    and returns once it is on its way back from restart ``times``."""
    import os
    import signal

    manager = start(fake_player, {"behaviors": [{"agents": 1, "episode_length": 0}]}, 2, **options)
    manager.set_policy(B, TargetPolicy(3))
    manager.reset(config={"gravity": 1.0})
    steps_until(manager, lambda got: {s.worker_id for s in got} == {0, 1})
    core = manager.manager
    core.wait_idle(timeout=30)

    def restart(times):
        os.kill(core.processes[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while core.restart_count(1) < times or (times == 1 and 1 not in core._state.arrived):
            assert time.monotonic() < deadline, "worker 1 was not restarted"
            core._take(core.pool.wait(0.05))

    try:
        restart(1)
    except BaseException:
        manager.close()
        raise
    return manager, restart


@pytest.mark.timeout(120)
def test_a_ctrl_c_in_a_settings_change_s_re_reset_leaves_the_worker_stepping(fake_player):
    """A settings change re-resets a worker restarted before it; a Ctrl-C in the wait for that
    reset (interruptible) left it owed and never taken: the worker was never stepped again. The
    next ``get_steps`` takes it, and the worker's steps go on from a reset with the new value."""
    manager, _ = stepping_with_worker_1_restarted(fake_player)
    core = manager.manager
    try:
        receive_resets = core.receive_resets

        def pressed_in_the_wait(*args, **kwargs):  # as ``interrupts.blocking`` raises a Ctrl-C held back
            core.receive_resets = receive_resets
            raise KeyboardInterrupt

        core.receive_resets = pressed_in_the_wait
        with pytest.raises(KeyboardInterrupt):
            manager.set_env_parameters({"gravity": 2.0})
        assert core.receive_resets == receive_resets  # (it was asked)
        steps = steps_until(manager, lambda got: len(by_worker(got, 1)) >= 3, seconds=20)
        first = by_worker(steps, 1)[0]
        assert first.interrupted and stat(first, "Fake/EnvParam/gravity")[-1] == 2.0
        assert not any(s.interrupted for s in by_worker(steps, 1)[1:])
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_a_held_re_reset_of_a_worker_restarted_again_is_not_taken_for_one_in_flight(fake_player):
    """A settings change re-resets a restarted worker (its fresh reset held, not handed out yet);
    the worker is restarted again. ``get_steps`` took its boot for a re-reset a Ctrl-C cut short
    and raised "no reset was sent to worker(s) [1]" (found by the fault schedules, seed 64400)."""
    manager, restart = stepping_with_worker_1_restarted(fake_player, restarts_rate_limit_n=-1)
    core = manager.manager
    try:
        manager.set_env_parameters({"gravity": 2.0})
        assert [info.interrupted for info in manager._held if info.worker_id == 1] == [True]  # re-reset, held
        restart(2)  # and now on its way back from a second restart
        assert 1 in core.waiting_worker_ids and core.resets_in_flight == []
        steps = steps_until(manager, lambda got: len(by_worker(got, 1)) >= 3, seconds=30)
        assert [stat(s, "Fake/EnvParam/gravity")[-1:] for s in by_worker(steps, 1) if s.interrupted][-1] == [2.0]
    finally:
        manager.close()


@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_error(fake_player):
    path = fake_player({"behaviors": [{"agents": 1}]})
    base = free_base_port(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        with pytest.raises(UnityPortInUseError) as caught:
            MLAgentsEnvManager(UnityEnvironmentFactory(path, base_port=base, timeout_wait=10), 2, timeout=30)
    err = caught.value
    assert isinstance(err, EnvManagerError)
    assert (err.port, err.base_port, err.worker_id) == (base + 1, base, 1)
    assert f"port {base + 1} (base_port {base} + worker_id 1) is in use" in str(err)
    assert "pass a different base_port or worker_id offset" in str(err)


@pytest.mark.timeout(120)
def test_a_close_cut_short_by_ctrl_c_twice_is_finished_by_the_next(fake_player, monkeypatch, process_gone):
    """As the core's (``test_core_faults.py``): Ctrl-C while the players close, and again while
    close() ends the workers by force; the next close() ends every worker. It dropped the core
    manager as its close() began: the next one did nothing and the workers ran on."""
    manager = start(fake_player, {"behaviors": [{"agents": 1, "episode_length": 0}]}, 2, wrap=slow_to_close)
    core = manager.manager  # (held here: its __del__ is not what should end them)
    pids = [w.pid for w in core.processes]
    presses = ctrl_c_twice_in_close(monkeypatch)
    try:
        with pytest.raises(KeyboardInterrupt):
            manager.close()
        assert presses == ["wait", "stop"] and core.closed
        with pytest.raises(ManagerClosedError):
            manager.get_steps()
        manager.close()
        assert all(process_gone(pid, timeout=5.0) for pid in pids), "a close cut short left workers running"
        assert manager.closed
    finally:
        core.close(timeout=0.0)


# ---------------------------------------------------------------------------------------------
# No players needed


def test_parameter_and_engine_config_checks():
    assert normalize_env_parameters({"a": 1, "b": True}) == {"a": 1.0, "b": 1.0}
    assert normalize_env_parameters({"g": {"sampler_type": "gaussian", "mean": 0, "st_dev": 2}}) == {
        "g": {"sampler_type": "gaussian", "mean": 0.0, "st_dev": 2.0, "seed": 0}}
    constant = {"sampler_type": "constant", "sampler_parameters": {"value": 3}}
    assert normalize_env_parameters({"c": constant}) == {"c": 3.0}
    ranges = {"sampler_type": "multirange_uniform", "intervals": [[1, 2], [4, 5]], "seed": 3}
    assert normalize_env_parameters({"r": ranges}) == {
        "r": {"sampler_type": "multirangeuniform", "intervals": [(1.0, 2.0), (4.0, 5.0)], "seed": 3}}
    bad_values = ({"x": "1"}, {"x": {"sampler_type": "uniform", "min_value": 1}}, {"x": {"sampler_type": "poisson"}},
                  {"": 1}, ["x"])
    for bad in bad_values:
        with pytest.raises(InvalidInputError):
            normalize_env_parameters(bad)
    assert normalize_engine_config(EngineConfig.default_config()) == {
        "width": 80, "height": 80, "quality_level": 1, "time_scale": 20.0, "target_frame_rate": -1,
        "capture_frame_rate": 60}
    assert normalize_engine_config(None, time_scale=5) == {"time_scale": 5.0}
    for bad in ({"x": 1e39}, {"x": {"sampler_type": "uniform", "min_value": -1e39, "max_value": 1}},
                {"x": {"sampler_type": "gaussian", "mean": 0, "st_dev": 1, "seed": 2**31}},
                {"x": {"sampler_type": "multirange_uniform", "intervals": [[1, 1e40]]}}):
        with pytest.raises(InvalidInputError, match="side channel"):  # what the worker could not encode
            normalize_env_parameters(bad)
    for bad in ({"height": 3}, {"speed": 1}, {"quality_level": "high"}, {"time_scale": 1e39},
                {"width": 2**31, "height": 1}):
        with pytest.raises(InvalidInputError):
            normalize_engine_config(bad)
    assert ActionInfo.empty() == ([], [], {}, []) and EnvironmentStep.empty(3) == ({}, 3, {}, {}, False)
    err = UnityPortInUseError(5005, 5004, 1)
    assert str(err).startswith("port 5005 (base_port 5004 + worker_id 1) is in use")


@pytest.mark.timeout(60)
def test_worker_timers_merge_into_the_trainers(fake_player):
    """The workers' mlagents_envs timers come with their steps and are merged into this thread's
    under workers/worker_root, as ML-Agents' manager merges them (its timers.json)."""
    from mlagents_envs.timers import get_timer_tree, reset_timers

    manager = start(fake_player, {"behaviors": [{"agents": 1, "episode_length": 0}]}, 2)
    try:
        manager.set_policy(B, TargetPolicy(3))
        manager.reset()
        reset_timers()
        steps = steps_until(manager, lambda got: len(got) >= 10)
        workers = get_timer_tree()["children"]["workers"]
        step_timer = workers["children"]["worker_root"]["children"]["UnityEnvironment.step"]
        assert step_timer["count"] == len(steps) and workers["count"] >= 1
    finally:
        reset_timers()
        manager.close()
