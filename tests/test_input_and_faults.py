"""Bad input is rejected before any worker is sent anything; faults name every worker they hit.

Issue #8. Real worker processes and real gymnasium envs. Every rejected input is checked to
have reached no worker: afterwards no slot is waiting, the envs' own step counters are
unchanged, and a valid step still works (and executes exactly one env step).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest
from gymnasium import spaces

import envmanager
from envmanager import (
    AsyncVectorEnv,
    EnvManagerError,
    InvalidInputError,
    SubprocessEnvManager,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from envmanager.testing.envs import ControlledEnv, EnvFactory

CTX = "fork"


# ----------------------------------------------------------------------------------------------
# Helpers


def _infrastructure(proc: psutil.Process) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def our_children() -> list[psutil.Process]:
    """Child processes of this test (zombies included), multiprocessing's helpers excluded."""
    return [p for p in psutil.Process().children(recursive=True) if not _infrastructure(p)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``seconds`` (a SIGKILL is delivered
    asynchronously; this is a bound, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return gone(pid)


def step_all(m: SubprocessEnvManager, actions: dict) -> dict[int, envmanager.StepInfo]:
    """``m.step(actions)``, then receive until every slot in ``actions`` has its result."""
    got = {i.worker_id: i for i in m.step(actions)}
    while len(got) < len(actions):
        got.update({i.worker_id: i for i in m.receive_steps(timeout=10)})
    assert sorted(got) == sorted(actions)
    return got


def step_until_error(m: SubprocessEnvManager, limit: int = 50, seconds: float = 20.0):
    """Step every idle slot until something raises: at least ``limit`` steps, for up to
    ``seconds`` (a killed process needs the CPU once to die, which a loaded machine delays)."""
    deadline = time.monotonic() + seconds
    n = 0
    while n < limit or time.monotonic() < deadline:
        m.step(dict.fromkeys(m.idle_worker_ids, 1))
        n += 1
    raise AssertionError(f"no error was raised in {n} steps and {seconds} s")


def assert_nothing_sent(m: SubprocessEnvManager, expected_steps: list[int], what: object) -> None:
    """No slot is waiting for anything, and the envs executed no step beyond ``expected_steps``."""
    assert m.waiting_worker_ids == [], f"after rejecting {what!r}: workers {m.waiting_worker_ids} were sent something"
    assert m.idle_worker_ids == list(range(m.n_env)), f"after rejecting {what!r}: idle {m.idle_worker_ids}"
    assert m.get_attr("total_steps") == expected_steps, f"after rejecting {what!r}: an env was stepped"


def discrete_manager(n_env: int = 2, **kwargs) -> SubprocessEnvManager:
    return SubprocessEnvManager(EnvFactory(), n_env, context=CTX, timeout=10, **kwargs)


# ----------------------------------------------------------------------------------------------
# 1. Discrete actions: SubprocessEnvManager

BAD_DISCRETE = [
    pytest.param(0.5, id="float-0.5"),
    pytest.param(1.0, id="float-1.0"),
    pytest.param(np.float32(1.7), id="np.float32-1.7"),
    pytest.param("1", id="str-1"),
    pytest.param(7, id="int-7"),
    pytest.param(-1, id="int-minus-1"),
]


@pytest.mark.parametrize("bad", BAD_DISCRETE)
def test_step_rejects_bad_discrete_action_before_sending(bad):
    with discrete_manager(2) as m:  # one process per slot: a partial send would show
        m.reset()
        assert m.action_space == spaces.Discrete(3)
        expected = [0, 0]
        # The bad action in either position (slot 1 is sent after slot 0 when sending in order).
        for actions in ({0: bad, 1: 1}, {0: 1, 1: bad}):
            with pytest.raises(InvalidInputError):
                m.step(actions)
            assert_nothing_sent(m, expected, actions)
        # The sequence form (one action per slot) checks the same way.
        with pytest.raises(InvalidInputError):
            m.step([bad, 1])
        assert_nothing_sent(m, expected, [bad, 1])
        # Valid actions work afterwards: a numpy integer and a Python int; one step each.
        got = step_all(m, {0: np.int64(2), 1: 1})
        assert got[0].current_result.observation[0] == 1 and got[1].current_result.observation[0] == 1
        assert got[0].current_result.observation[2] == 2.0 and got[1].current_result.observation[2] == 1.0
        assert got[0].current_result.reward == 2.0 and got[1].current_result.reward == 1.0
        assert m.get_attr("total_steps") == [1, 1]


@pytest.mark.parametrize("bad", BAD_DISCRETE)
def test_send_batch_rejects_bad_discrete_action_before_sending(bad):
    with discrete_manager(2) as m:
        m.reset()
        for actions in (np.array([bad, 1]), np.array([1, bad])):
            with pytest.raises(InvalidInputError):
                m.send_batch(np.array([0, 1]), actions)
            assert_nothing_sent(m, [0, 0], actions)
        # A valid batch afterwards: int64 actions, one step each.
        m.send_batch(np.array([0, 1]), np.array([2, 1], dtype=np.int64))
        batch = m.receive_batch(min_count=2, timeout=10)
        assert sorted(batch.slots.tolist()) == [0, 1]
        np.testing.assert_array_equal(m.results.observation[:, 0], [1, 1])  # one step into the episode
        np.testing.assert_array_equal(m.results.observation[:, 2], [2, 1])  # the actions taken
        assert m.get_attr("total_steps") == [1, 1]


def test_valid_integer_actions_of_every_kind_are_accepted():
    with discrete_manager(2) as m:
        m.reset()
        for n, (a0, a1) in enumerate(((np.int64(0), 2), (np.int32(1), np.uint8(2)), (2, np.int16(0))), 1):
            got = step_all(m, {0: a0, 1: a1})
            assert [got[0].current_result.observation[2], got[1].current_result.observation[2]] == [int(a0), int(a1)]
            assert m.get_attr("total_steps") == [n, n]
        m.send_batch([0, 1], [1, 2])  # Python ints, a list batch
        m.receive_batch(min_count=2, timeout=10)
        np.testing.assert_array_equal(m.results.observation[:, 2], [1, 2])


# ----------------------------------------------------------------------------------------------
# 2. Box actions


class RecordingBoxEnv(gym.Env):
    """Box(-1, 1, (2,), float32) actions; remembers the last action it was given."""

    def __init__(self, env_id: int = 0) -> None:
        self.env_id = env_id
        self.observation_space = spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.last_action = None
        self.total_steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.total_steps += 1
        self.last_action = np.array(action, copy=True)
        return np.full(2, self.total_steps, np.float32), 0.0, False, False, {}


def box_manager() -> SubprocessEnvManager:
    return SubprocessEnvManager(RecordingBoxEnv, 2, context=CTX, timeout=10)


BAD_BOX = [
    pytest.param(np.array([np.nan, 0.0], np.float32), id="nan-float32"),
    pytest.param([0.0, float("nan")], id="nan-list"),
    pytest.param(np.array([1e40, 0.0]), id="float64-overflows-float32"),
    pytest.param(np.array([0.0, -1e40]), id="float64-overflows-float32-negative"),
]


@pytest.mark.parametrize("bad", BAD_BOX)
def test_box_action_nan_or_overflow_is_rejected_before_sending(bad):
    good = np.array([0.25, -0.25], np.float32)
    with box_manager() as m:
        m.reset()
        for actions in ({0: bad, 1: good}, {0: good, 1: bad}):
            with pytest.raises(InvalidInputError):
                m.step(actions)
            assert_nothing_sent(m, [0, 0], actions)
        for batch in (np.stack([np.asarray(bad, np.float64), good]), np.stack([good, np.asarray(bad, np.float64)])):
            with pytest.raises(InvalidInputError):
                m.send_batch(np.array([0, 1]), batch)
            assert_nothing_sent(m, [0, 0], batch)
        # A valid step afterwards reaches both envs, once.
        step_all(m, {0: good, 1: good})
        assert m.get_attr("total_steps") == [1, 1]
        for last in m.get_attr("last_action"):
            np.testing.assert_array_equal(last, good)


def test_box_action_out_of_bounds_is_passed_through_unchanged():
    with box_manager() as m:
        m.reset()
        step_all(m, {0: np.array([5.0, -5.0], np.float32), 1: [1.5, -3.0]})  # float32 and a float64 list
        assert m.get_attr("total_steps") == [1, 1]
        last0, last1 = m.get_attr("last_action")
        np.testing.assert_array_equal(last0, np.array([5.0, -5.0], np.float32))
        np.testing.assert_array_equal(last1, np.array([1.5, -3.0], np.float32))
        # The batch level too (a float64 batch that float32 holds).
        m.send_batch(np.array([0, 1]), np.array([[2.0, 0.5], [-7.0, 100.0]]))
        m.receive_batch(min_count=2, timeout=10)
        last0, last1 = m.get_attr("last_action")
        np.testing.assert_array_equal(last0, np.array([2.0, 0.5], np.float32))
        np.testing.assert_array_equal(last1, np.array([-7.0, 100.0], np.float32))


# ----------------------------------------------------------------------------------------------
# 3. The gymnasium drop-in


def make_vector(**kwargs) -> AsyncVectorEnv:
    return AsyncVectorEnv([lambda: ControlledEnv(0), lambda: ControlledEnv(1)], context=CTX, worker_timeout=10, **kwargs)


@pytest.mark.parametrize("bad", BAD_DISCRETE)
def test_vector_step_hands_values_to_the_env_as_gymnasium_does(bad):
    # The drop-in follows gymnasium: values out of a Discrete's range, fractions, strings reach
    # the env, which decides (ControlledEnv takes anything float() takes). Only a wrong number of
    # actions is refused (test_vector_rejection_is_a_value_error_subclass).
    envs = make_vector()
    try:
        envs.reset(seed=0)
        for steps, actions in enumerate((np.array([bad, 1]), np.array([1, bad]), [bad, 1]), start=1):
            obs, rewards, _, _, _ = envs.step(actions)
            expected = [float(a) for a in actions]
            np.testing.assert_array_equal(obs[:, 2], expected)  # the actions the envs took
            np.testing.assert_array_equal(rewards, expected)
            assert envs.get_attr("total_steps") == (steps, steps)
    finally:
        envs.close()


def test_vector_rejection_is_a_value_error_subclass():
    assert issubclass(InvalidInputError, ValueError)
    envs = make_vector()
    try:
        envs.reset(seed=0)
        for actions in (np.array([0, 1, 2]), [1]):  # three actions for two envs, one for two
            with pytest.raises(InvalidInputError):
                envs.step(actions)
        assert envs.get_attr("total_steps") == (0, 0), "a rejected step reached an env"
    finally:
        envs.close()


@pytest.mark.parametrize(
    "env_ids",
    [
        pytest.param(["0", 1], id="str-and-int"),
        pytest.param(np.array(["0", "1"]), id="str-array"),
        pytest.param([0.0, 1.0], id="floats"),
    ],
)
def test_vector_send_rejects_non_integer_env_ids_before_sending(env_ids):
    envs = make_vector(batch_size=1)
    try:
        envs.reset(seed=0)
        with pytest.raises(ValueError):
            envs.send(np.array([1, 1]), env_ids=env_ids)
        assert envs.get_attr("total_steps") == (0, 0), "a step was sent despite the bad env_ids"
        # Nothing is outstanding: recv has nothing to wait for.
        with pytest.raises(gym.error.NoAsyncCallError):
            envs.recv()
        # A valid send afterwards: both envs step once.
        envs.send(np.array([2, 1]), env_ids=[0, 1])
        got = {}
        for _ in range(2):
            obs, rewards, _, _, infos = envs.recv()
            assert obs.shape == (1, 4) and rewards.shape == (1,)
            got[int(infos["env_id"][0])] = (obs[0, 0], obs[0, 2])
        assert got == {0: (1.0, 2.0), 1: (1.0, 1.0)}
        assert envs.get_attr("total_steps") == (1, 1)
    finally:
        envs.close()


# ----------------------------------------------------------------------------------------------
# 4. A factory that returns something that is not an environment


def test_factory_returning_a_non_env_fails_at_construction_saying_so():
    with pytest.raises((EnvManagerError, TypeError)) as caught:
        SubprocessEnvManager(lambda i: 42, 2, context=CTX, timeout=10)
    assert "not an environment" in str(caught.value)
    if isinstance(caught.value, WorkerError):
        assert caught.value.worker_id == 0
    assert our_children() == [], "worker processes were left behind"


# ----------------------------------------------------------------------------------------------
# 5. An env that raises does not take the other env of its process with it


def test_env_error_keeps_sibling_result_and_only_failed_env_needs_reset():
    factory = EnvFactory(per_env={1: {"fault": "raise", "fault_at": 3}})
    with SubprocessEnvManager(factory, 2, envs_per_worker=2, context=CTX, timeout=10) as m:
        m.reset()
        env0_counter = []  # env 0's steps-in-episode, in the order its results came back
        env0_episode = set()
        with pytest.raises(WorkerError) as caught:
            for _ in range(10):
                for info in m.step({0: 1, 1: 1}):
                    if info.worker_id == 0:
                        env0_counter.append(info.current_result.observation[0])
                        env0_episode.add(info.current_result.observation[3])
        err = caught.value
        assert err.worker_id == 1, str(err)
        assert err.worker_ids == [1]
        assert "failed on purpose at step 3" in str(err)
        assert env0_counter == [1, 2]
        # Env 0's transition of that same step is not lost: the next receive returns it.
        late = m.receive_steps(timeout=10)
        assert [i.worker_id for i in late] == [0]
        assert late[0].current_result.observation[0] == 3
        assert late[0].interrupted is False
        env0_episode.add(late[0].current_result.observation[3])
        assert m.get_attr("total_steps") == [3, 3]
        # Env 1 is refused until it is reset, and nothing is sent to env 0 with it either.
        with pytest.raises(InvalidInputError, match="must be reset"):
            m.step({0: 1, 1: 1})
        with pytest.raises(InvalidInputError, match="must be reset"):
            m.step({1: 1})
        assert m.get_attr("total_steps") == [3, 3]
        assert m.waiting_worker_ids == []
        # Env 0 keeps stepping, without a reset: its counter goes on by one per step.
        for expected in (4, 5):
            (info,) = m.step({0: 2})
            assert info.worker_id == 0
            assert info.current_result.observation[0] == expected
            env0_episode.add(info.current_result.observation[3])
        assert env0_episode == {1.0}, "env 0 was reset"
        # Once env 1 is reset (alone), both step again; env 0 still has not been reset.
        m.set_attr("fault", None, worker_ids=[1])
        m.send_reset({1: (None, None)})
        (reset1,) = m.receive_resets([1], timeout=10)
        assert reset1.worker_id == 1 and reset1.current_result.observation[0] == 0
        got = step_all(m, {0: 1, 1: 1})
        assert got[0].current_result.observation[0] == 6 and got[0].current_result.observation[3] == 1
        assert got[1].current_result.observation[0] == 1
        assert m.get_attr("resets") == [1, 2]


class ExitingEnv(ControlledEnv):
    """Env 1 calls ``sys.exit(4)`` (a pygame-style "window closed") or raises KeyboardInterrupt at
    its third step."""

    def __init__(self, env_id, how):
        super().__init__(env_id)
        self.how = how

    def step(self, action):
        if self.env_id == 1 and self.total_steps == 2:
            self.total_steps += 1
            if self.how == "exit":
                sys.exit(4)
            raise KeyboardInterrupt
        return super().step(action)


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_an_envs_sys_exit_or_keyboard_interrupt_is_its_error_and_the_process_serves_on(how):
    """They ended the worker quietly: "died (exit code 0)", no exception, no traceback."""
    with SubprocessEnvManager(functools.partial(ExitingEnv, how=how), 2, envs_per_worker=2, context=CTX, timeout=10) as m:
        m.reset()
        pid = m.processes[0].pid
        step_all(m, {0: 1, 1: 1})
        step_all(m, {0: 1, 1: 1})
        with pytest.raises(WorkerError) as caught:
            step_all(m, {0: 1, 1: 1})
        err = caught.value
        raised = "builtins.SystemExit" if how == "exit" else "builtins.KeyboardInterrupt"
        assert err.worker_ids == [1] and err.exc_type == raised
        assert ("sys.exit(4)" if how == "exit" else "raise KeyboardInterrupt") in err.remote_traceback
        assert [i.worker_id for i in m.receive_steps(timeout=10)] == [0]  # the sibling's step is not lost
        m.reset()
        assert step_all(m, {0: 1, 1: 1})[1].current_result.observation[0] == 1
        assert m.processes[0].pid == pid and m.get_attr("total_steps") == [4, 4]


# ----------------------------------------------------------------------------------------------
# 6. A dead process hosting several slots: every slot is named


def test_died_error_names_every_slot_of_the_dead_process():
    with SubprocessEnvManager(EnvFactory(), 4, envs_per_worker=2, context=CTX, timeout=10) as m:
        m.reset()
        victim = m.process_of(2)
        assert victim is m.process_of(3) and victim is not m.process_of(1)
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as caught:
            step_until_error(m)
        err = caught.value
        message = str(err)
        assert err.worker_ids == [2, 3], message
        assert err.worker_id in (2, 3), message
        assert "process 1" in message, message
        assert re.search(r"slots 2\s*[–-]\s*3|slots 2, 3", message), message
        assert "SIGKILL" in message, message
        # The other process's slots are not affected.
        assert m.failure_of(0) is None and m.failure_of(1) is None


# ----------------------------------------------------------------------------------------------
# 7. A start-up that times out in several processes: one error names them all


def _sleeps_forever(worker_id):
    time.sleep(60)


def test_startup_timeout_names_every_hanging_slot():
    with pytest.raises(WorkerTimeoutError) as caught:
        SubprocessEnvManager(_sleeps_forever, 4, context=CTX, timeout=1.5)
    err = caught.value
    assert err.worker_ids == [0, 1, 2, 3], str(err)
    assert our_children() == [], "worker processes were left behind"


# ----------------------------------------------------------------------------------------------
# 8. close(): a straggler's own-session child is killed with it


class HangingCloseEnv(ControlledEnv):
    """Starts a child in a session of its own (as mlagents starts Unity players) and hangs in
    ``close()``; the child's pid goes to a file so the test can find it."""

    def __init__(self, env_id: int, pid_dir: str) -> None:
        super().__init__(env_id)
        self.player = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        path = os.path.join(pid_dir, f"player-{env_id}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(self.player.pid))
        os.replace(path + ".tmp", path)

    def close(self) -> None:
        time.sleep(30)


class LeakyCloseEnv(HangingCloseEnv):
    """Its ``close()`` returns at once and leaves its own-session child running (a buggy env)."""

    def close(self) -> None:
        pass


def test_close_kills_the_own_session_child_an_env_s_close_left_running(tmp_path):
    pid_dir = str(tmp_path)
    m = SubprocessEnvManager(lambda i: LeakyCloseEnv(i, pid_dir), 2, envs_per_worker=2, context=CTX, timeout=10)
    players = []
    try:
        m.reset()
        players = [int((tmp_path / f"player-{i}.pid").read_text()) for i in range(2)]
        assert not any(gone(p) for p in players), "the envs' children should be running"
        m.close()
        assert all(wait_gone(p) for p in players), "a child the env's close() left outlived close()"
    finally:
        m.close(timeout=0.0)
        for p in players:
            if not gone(p):
                os.kill(p, signal.SIGKILL)


def test_close_kills_own_session_child_of_a_straggler(tmp_path):
    pid_dir = str(tmp_path)
    m = SubprocessEnvManager(lambda i: HangingCloseEnv(i, pid_dir), 1, context=CTX, timeout=10)
    player = None
    try:
        m.reset()
        with open(tmp_path / "player-0.pid") as f:
            player = int(f.read())
        worker_pid = m.processes[0].pid
        assert not gone(player), "the env's child should be running"
        assert os.getsid(player) != os.getsid(worker_pid), "the child should be in a session of its own"
        m.close(timeout=1.0)
        assert gone(worker_pid), "close() returned with the worker still running"
        assert wait_gone(player), f"the straggler's child {player} outlived close()"
    finally:
        m.close(timeout=0.0)
        if player is not None and not gone(player):
            os.kill(player, signal.SIGKILL)


class SimulatorEnv(ControlledEnv):
    """Starts a simulator in a session of its own each time it is made (as mlagents starts Unity
    players), or at its first reset (``at_reset``: as MineRL starts Minecraft), its pid in a file
    of its own; action 2 raises (the env is then rebuilt)."""

    def __init__(self, env_id: int, pid_dir: str, at_reset: bool = False) -> None:
        super().__init__(env_id)
        self.pid_dir, self.player = pid_dir, None
        if not at_reset:
            self._start()

    def _start(self) -> None:
        self.player = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        path = os.path.join(self.pid_dir, f"player-{self.env_id}-{self.player.pid}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(self.player.pid))
        os.replace(path + ".tmp", path)

    def reset(self, *, seed=None, options=None):
        if self.player is None:
            self._start()
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if action == 2:
            raise RuntimeError("the simulator went away")
        return super().step(action)

    def close(self) -> None:
        if self.player is not None:
            self.player.kill()
            self.player.wait()


def players_of(tmp_path, env_id: int) -> list[int]:
    return sorted(int(f.read_text()) for f in tmp_path.glob(f"player-{env_id}-*.pid"))


@pytest.mark.parametrize("at_reset", [False, True])
def test_a_crashed_worker_s_own_session_simulator_is_killed(tmp_path, at_reset):
    """A worker that dies by itself never closes its envs, and once it is gone its simulators in
    sessions of their own can no longer be found below it: they are killed all the same. One
    started at the first reset, after the worker said it was ready, outlived it."""
    pid_dir = str(tmp_path)
    m = SubprocessEnvManager(lambda i: SimulatorEnv(i, pid_dir, at_reset), 2, context=CTX, timeout=10)
    players: list[int] = []
    try:
        m.reset()
        players = players_of(tmp_path, 0) + players_of(tmp_path, 1)
        assert len(players) == 2 and not any(gone(p) for p in players)
        os.kill(m.processes[1].pid, signal.SIGKILL)  # a native env's crash
        with pytest.raises(WorkerDiedError) as caught:
            step_until_error(m)
        assert caught.value.worker_ids == [1]
        assert wait_gone(players[1]), "the dead worker's simulator outlived it"
        assert not gone(players[0]), "the other worker's simulator was killed"
        m.close()
        assert wait_gone(players[0])
    finally:
        m.close(timeout=0.0)
        for p in players_of(tmp_path, 0) + players_of(tmp_path, 1):
            if not gone(p):
                os.kill(p, signal.SIGKILL)


class LaunchedSimulatorEnv(SimulatorEnv):
    """Starts its simulator at the first reset as a launcher script does: in a session of its own,
    from a shell that exits at once, so that it is nobody's child (not below the worker, not in
    its group: only the tag the worker put in its environment finds it); its ``close()`` forgets
    it. A step hangs once the file ``hang-<env id>`` is there."""

    def _start(self) -> None:
        path = os.path.join(self.pid_dir, f"player-{self.env_id}-launched.pid")
        subprocess.run(["sh", "-c", f"setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $! > {path}.tmp"], check=True)
        os.replace(path + ".tmp", path)
        self.player = True

    def step(self, action):
        if os.path.exists(os.path.join(self.pid_dir, f"hang-{self.env_id}")):
            time.sleep(3600)
        return super().step(action)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("end", ["closed", "hung", "killed"])
def test_a_simulator_a_launcher_daemonized_is_killed_with_its_worker(tmp_path, end):
    """A simulator started the way launcher scripts start them (``setsid sim &`` from a shell
    that exits) is never below the worker: one the env's ``close()`` left running outlived a
    worker that closed, and one of a worker the parent killed (hung) outlived it too; only a
    worker dying by itself had its tag looked for. Each is killed now, the other worker's kept."""
    from envmanager.errors import WorkerTimeoutError

    pid_dir = str(tmp_path)
    m = SubprocessEnvManager(lambda i: LaunchedSimulatorEnv(i, pid_dir, at_reset=True), 2, context=CTX, timeout=5)
    players: list[int] = []
    try:
        m.reset()
        players = players_of(tmp_path, 0) + players_of(tmp_path, 1)
        assert len(players) == 2 and not any(gone(p) for p in players)
        if end == "closed":
            m.close()
            assert wait_gone(players[0]) and wait_gone(players[1]), "a closed worker's simulator outlived it"
            return
        if end == "hung":
            (tmp_path / "hang-1").touch()
            with pytest.raises(WorkerTimeoutError) as caught:
                step_until_error(m)
        else:
            os.kill(m.processes[1].pid, signal.SIGKILL)
            with pytest.raises(WorkerDiedError) as caught:
                step_until_error(m)
        assert caught.value.worker_ids == [1]
        assert wait_gone(players[1]), "the simulator outlived its worker"
        assert not gone(players[0]), "the other worker's simulator was killed"
    finally:
        m.close(timeout=0.0)
        for p in players:
            if not gone(p):
                os.kill(p, signal.SIGKILL)


def test_the_tag_of_a_dead_worker_is_no_later_worker_s_given_its_pid():
    """A worker's pid reused by a later worker (another manager's, or a restart) once the first
    was reaped: the later one's simulators carry a tag of their own, and the scan for the dead
    worker's tag leaves them alone (it killed them, matching ``<parent pid>:<worker pid>``)."""
    from envmanager.worker.family import TAG, tagged

    parent, pid = os.getpid(), 4242
    later = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, TAG: f"{parent}:{pid}:later"})
    try:
        for _ in range(100):  # (its environment is readable once it has exec'd)
            if TAG in psutil.Process(later.pid).environ():
                break
            time.sleep(0.01)
        assert later.pid in tagged(parent, pid, "later")
        assert later.pid not in tagged(parent, pid, "dead")
    finally:
        later.kill()
        later.wait()


def test_a_restarted_worker_s_simulators_are_killed_those_of_rebuilt_envs_too(tmp_path):
    """Restarts on: an env that raised is rebuilt in its process (a new simulator); the process
    then crashes and is restarted. Every simulator of the dead process is gone, its replacement's
    runs, and close() ends it."""
    pid_dir = str(tmp_path)
    m = SubprocessEnvManager(lambda i: SimulatorEnv(i, pid_dir), 1, context=CTX, timeout=10, restart_workers=True,
                             restarts_rate_limit_n=5)
    try:
        m.reset()
        first, pid = players_of(tmp_path, 0), m.processes[0].pid
        infos = m.step({0: 2})
        while not infos:
            infos = m.receive_steps(timeout=10)
        assert infos[0].interrupted, "the env that raised should have been rebuilt"
        assert m.processes[0].pid == pid, "an env that raised is rebuilt in place, not its process restarted"
        rebuilt = [p for p in players_of(tmp_path, 0) if p not in first]
        assert len(rebuilt) == 1 and wait_gone(first[0]) and not gone(rebuilt[0])
        os.kill(m.processes[0].pid, signal.SIGKILL)
        restarted = []
        for _ in range(200):
            restarted = [i for i in m.step(dict.fromkeys(m.idle_worker_ids, 1)) if i.interrupted]
            if restarted:
                break
        assert restarted and m.processes[0].pid != pid
        assert wait_gone(rebuilt[0]), "the rebuilt env's simulator outlived its process"
        replacement = [p for p in players_of(tmp_path, 0) if p not in first + rebuilt]
        assert len(replacement) == 1 and not gone(replacement[0])
        m.close()
        assert wait_gone(replacement[0])
    finally:
        m.close(timeout=0.0)
        for p in players_of(tmp_path, 0):
            if not gone(p):
                os.kill(p, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------
# 9. An env error in a process hosting several slots names the process


@pytest.mark.parametrize("slot", [2, 3])
def test_worker_error_names_the_process(slot):
    factory = EnvFactory(per_env={slot: {"fault": "raise", "fault_at": 1}})
    with SubprocessEnvManager(factory, 4, envs_per_worker=2, context=CTX, timeout=10) as m:
        m.reset()
        with pytest.raises(WorkerError) as caught:
            step_until_error(m)
        err = caught.value
        message = str(err)
        assert err.worker_id == slot, message
        assert f"worker {slot}" in message, message
        assert "process 1" in message, message
        assert "failed on purpose" in err.remote_traceback


def test_reset_says_which_dropped_step_failed(caplog):
    """EnvPool's loop left a step in flight that no recv() returned, and it raised: reset()
    drops it, as it drops every result not returned, but logs the error naming the env and
    the exception — not lost — and every env is reset."""
    fns = [lambda i=i: ControlledEnv(i, fault="raise" if i == 3 else None, fault_at=2) for i in range(4)]
    envs = AsyncVectorEnv(fns, batch_size=4, context=CTX)
    try:
        envs.reset(seed=0)
        envs.send(np.zeros(4, dtype=np.int64))
        envs.recv()
        envs.send(np.zeros(1, dtype=np.int64), env_ids=[3])  # env 3 raises in it; nobody receives it
        with caplog.at_level("WARNING", logger="envmanager"):
            obs, _ = envs.reset(seed=1)
        dropped = [r.getMessage() for r in caplog.records if "dropped a step" in r.getMessage()]
        assert len(dropped) == 1 and "worker 3" in dropped[0] and "failed on purpose" in dropped[0], dropped
        assert obs[:, 0].tolist() == [0, 0, 0, 0] and envs.get_attr("resets") == (2, 2, 2, 2)
    finally:
        envs.close()
