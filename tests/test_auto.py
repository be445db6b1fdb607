"""``envs_per_worker="auto"``: the choice follows one env's step cost, is logged, and results stay right."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import time
from dataclasses import replace

import gymnasium as gym
import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envmanager
from envmanager import InvalidInputError, SubprocessEnvManager
from envmanager.core import auto
from envmanager.core.layout import (
    BATCH,
    BOARD_INFOS,
    DEFAULT_COSTS,
    NO_INFOS,
    NOTICE_INFOS,
    SB3,
    STEP_INFO,
    VECTOR,
    VECTOR_PARTIAL,
    best_layout,
)
from envmanager.testing.envs import EnvFactory
from process_helpers import alive


def test_cheap_envs_are_packed_where_the_parent_keeps_a_core(caplog):
    """On 2 cores, cheap even steps: one process of all the envs, double buffered (it and the
    parent each have a core: they spin, the mailbox carries requests and answers; measured 2x
    the processes-per-core layout on CartPole), and the choice is logged with its prediction."""
    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        assert auto.choose_layout(EnvFactory(), 8, cores=2) == (8, True)
    lines = [r.getMessage() for r in caplog.records if "chose 8" in r.getMessage()]
    assert len(lines) == 1  # one line: the choice, its prediction and the costs it used
    assert "predicted" in lines[0] and "double buffered" in lines[0]
    assert "round trip" in lines[0] and "per process on the board" in lines[0] and "per notice" in lines[0]
    cores = auto.usable_cores()
    with SubprocessEnvManager(EnvFactory(), 4 * cores, envs_per_worker="auto", double_buffer="auto", context="fork",
                              timeout=30) as m:
        assert m.envs_per_worker * len(m.processes) >= m.n_env > m.envs_per_worker * (len(m.processes) - 1)
        infos = m.reset(seed=3)
        assert [i.current_result.observation[1] for i in infos] == list(range(4 * cores))
        done = 0
        todo = dict.fromkeys(range(m.n_env), 1)
        while done < 3 * m.n_env:
            infos = m.step(todo)
            todo = {i.worker_id: 2 for i in infos}
            for i in infos:  # obs = [t, env_id, last action, episode]: right env, right action
                assert i.current_result.observation[1] == i.worker_id
                assert i.current_result.observation[2] == i.action
            done += len(infos)


def test_expensive_even_cpu_bound_envs_are_packed_too(caplog, monkeypatch):
    # the sweep shows packing ahead at 1 ms and 5 ms per step as well: fewer processes than
    # cores compete, and a message still carries several steps. The step is given as measured on
    # a quiet machine (a loaded one measures it as waiting or uneven, and rightly chooses 1:
    # measure_step_cost has tests of its own); the choice and the run are real.
    cost = auto.StepCost(median_s=2e-3, p90_s=2.1e-3, cpu_median_s=2e-3, cpu_p90_s=2.1e-3, cpu_share=1.0, steps=50,
                         round_trip_s=80e-6, round_trip_cpu_s=10e-6)
    monkeypatch.setattr(auto, "measure_step_cost", lambda *args, **kwargs: cost)
    cores = auto.usable_cores()
    with (caplog.at_level(logging.INFO, logger="envmanager.core.auto"),
          SubprocessEnvManager(EnvFactory(cpu_time=2e-3), 2 * cores, envs_per_worker="auto", context="fork", timeout=30) as m):
        assert m.envs_per_worker == 2
        assert len(m.processes) == cores
        m.reset(seed=0)
        actions = [1, 2] * cores
        infos = m.step(actions)
        while len(infos) < m.n_env:
            infos += m.receive_steps()
        assert all(i.current_result.reward == i.action == actions[i.worker_id] for i in infos)
    assert any("chose 2" in r.getMessage() and "CPU-bound" in r.getMessage() for r in caplog.records)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_busy_machine_does_not_make_a_cpu_bound_env_look_waiting_or_uneven():
    # more spinning processes than cores: the measuring thread is preempted, which stretches
    # its wall times (the old rule then chose 1); CPU times and the fastest steps are not
    cores = auto.usable_cores()
    ctx = multiprocessing.get_context("fork")
    spinners = [ctx.Process(target=_spin, args=(30.0,), daemon=True) for _ in range(cores + 1)]
    for p in spinners:
        p.start()
    try:
        cost = auto.measure_step_cost(EnvFactory(cpu_time=3e-4))
        assert not isinstance(cost, str), cost
        assert cost.cpu_share >= auto.CPU_BOUND
        assert cost.cpu_p90_s <= auto.UNEVEN_RATIO * cost.cpu_median_s
        assert auto.choose_envs_per_worker(EnvFactory(cpu_time=3e-4), 8, cores=2) > 1  # packed, by the model
    finally:
        for p in spinners:
            p.kill()
            p.join(10)


def test_uneven_cpu_bound_envs_get_a_process_each(caplog):
    # one step in five burns 20x more CPU: packing would make first-ready wait for the slow ones
    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        assert auto.choose_envs_per_worker(EnvFactory(cpu_time=[5e-5] * 4 + [1e-3]), 8, cores=2) == 1
    assert any("uneven" in r.getMessage() for r in caplog.records)


def test_waiting_envs_get_a_process_each():
    choice = auto.choose_envs_per_worker(EnvFactory(step_time=3e-4), 8, cores=2)
    assert choice == 1  # sleeps: cheap in wall time, but packing would serialize the waits


def test_an_env_that_does_not_answer_in_time_falls_back_to_one(caplog):
    gate = "/nonexistent/envmanager-auto-gate"  # each step waits for this file (60 s at most)
    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        assert auto.choose_envs_per_worker(EnvFactory(gate=gate), 8, cores=2) == 1
    assert any("no answer within" in r.getMessage() for r in caplog.records)


def test_an_env_that_fails_falls_back_to_one(caplog):
    def broken(env_id):
        raise RuntimeError("no env here")

    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        assert auto.choose_envs_per_worker(broken, 8, cores=2) == 1
    assert any("no env here" in r.getMessage() for r in caplog.records)


def test_drop_ins_take_auto(caplog):
    fns = [lambda: gym.make("CartPole-v1") for _ in range(4)]
    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        vec = envmanager.AsyncVectorEnv(fns, envs_per_worker="auto", context="fork")
    try:
        # the drop-in builds with the choice it logged (which choice is test_auto's business above)
        chosen = [int(r.getMessage().split("chose ")[1].split()[0]) for r in caplog.records if "chose" in r.getMessage()]
        assert chosen and vec._manager.envs_per_worker == chosen[-1]
        obs, _ = vec.reset(seed=1)
        ref = gym.vector.SyncVectorEnv(fns)
        ref_obs, _ = ref.reset(seed=1)
        np.testing.assert_array_equal(obs, ref_obs)
        actions = np.array([0, 1, 1, 0])
        np.testing.assert_array_equal(vec.step(actions)[0], ref.step(actions)[0])
        ref.close()
    finally:
        vec.close()
    sb3 = pytest.importorskip("stable_baselines3")  # noqa: F841
    from envmanager.sb3 import SubprocVecEnv

    venv = SubprocVecEnv(fns, envs_per_worker="auto", start_method="fork")
    try:
        assert venv.reset().shape == (4, 4)
    finally:
        venv.close()


def test_drop_ins_default_to_auto_and_the_core_to_one_process_per_slot(caplog):
    cores = auto.usable_cores()
    fns = [lambda: gym.make("CartPole-v1") for _ in range(2 * cores)]
    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        vec = envmanager.AsyncVectorEnv(fns, context="fork")
    try:
        chosen = [int(r.getMessage().split("chose ")[1].split()[0]) for r in caplog.records if "chose" in r.getMessage()]
        assert chosen and vec._manager.envs_per_worker == chosen[-1]
    finally:
        vec.close()
    vec = envmanager.AsyncVectorEnv(fns, context="fork", envs_per_worker=1)  # gymnasium's layout on request
    try:
        assert vec._manager.envs_per_worker == 1
    finally:
        vec.close()
    with SubprocessEnvManager(EnvFactory(), 2 * cores, context="fork") as m:
        assert m.envs_per_worker == 1 and len(m.processes) == 2 * cores


def test_nothing_is_measured_when_there_is_nothing_to_pack(caplog):
    def never(env_id):
        raise AssertionError("built")

    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        assert auto.choose_envs_per_worker(never, 3, cores=4) == 1  # a core each, and one for the parent
    assert any("nothing to pack" in r.getMessage() for r in caplog.records)


class Recorded(gym.Wrapper):
    """Appends "<event> <pid>" to a file for construction, reset and step (as a recording
    wrapper, SB3's ``Monitor`` or gymnasium's ``RecordVideo``, would write what it sees)."""

    def __init__(self, env: gym.Env, path: str) -> None:
        super().__init__(env)
        self.path = path
        self._write("built")

    def _write(self, event: str) -> None:
        with open(self.path, "a") as f:
            f.write(f"{event} {os.getpid()}\n")

    def reset(self, **kwargs):
        self._write("reset")
        return self.env.reset(**kwargs)

    def step(self, action):
        self._write("step")
        return self.env.step(action)


def test_measuring_builds_env_0_elsewhere_and_its_wrappers_see_no_step(tmp_path, caplog):
    cores = auto.usable_cores()
    path = str(tmp_path / "events")
    fns = [lambda i=i: Recorded(gym.make("CartPole-v1"), path) if i == 0 else gym.make("CartPole-v1")
           for i in range(2 * cores)]
    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        vec = envmanager.AsyncVectorEnv(fns, context="fork")
    try:
        assert any("CPU-bound" in r.getMessage() or "uneven" in r.getMessage() for r in caplog.records)
        with open(path) as f:
            events = [line.split() for line in f]
        assert {e for e, _ in events} == {"built"}, events  # measured, yet nothing recorded a step or reset
        worker_pids = {p.pid for p in psutil.Process().children()}
        builders = {int(pid) for _, pid in events}
        # gymnasium's dummy env (in this process, as gymnasium builds one), the throwaway
        # measuring process (gone by now), and env 0's worker
        measuring = builders - worker_pids - {os.getpid()}
        assert len(measuring) == 1 and not alive(list(measuring), timeout=0)
        vec.reset(seed=0)
        vec.step(np.zeros(2 * cores, dtype=np.int64))
        with open(path) as f:
            assert [line.split()[0] for line in f][-2:] == ["reset", "step"]
    finally:
        vec.close()


def test_an_env_rendering_to_a_window_is_not_stepped(caplog):
    # CartPole with render_mode="human" would open a window on its first step (pygame)
    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        assert auto.choose_envs_per_worker(lambda i: gym.make("CartPole-v1", render_mode="human"), 8, cores=2) == 1
    assert any("render_mode='human'" in r.getMessage() for r in caplog.records)


class StartsAHelper(gym.Env):
    """Starts a process of its own (as a simulator would, in a session of its own), then hangs."""

    observation_space = gym.spaces.Discrete(2)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, path: str) -> None:
        helper = subprocess.Popen(["sleep", "60"], start_new_session=True)
        with open(path, "w") as f:
            f.write(str(helper.pid))

    def reset(self, *, seed=None, options=None):
        return 0, {}

    def step(self, action):
        time.sleep(60)
        return 0, 0.0, False, False, {}


def test_a_hung_measurement_is_killed_with_what_the_env_started(tmp_path, caplog):
    path = str(tmp_path / "helper")
    with caplog.at_level(logging.INFO, logger="envmanager.core.auto"):
        assert auto.choose_envs_per_worker(lambda i: StartsAHelper(path), 8, cores=2) == 1
    assert any("no answer within" in r.getMessage() for r in caplog.records)
    with open(path) as f:
        helper = int(f.read())
    assert not alive([helper], timeout=5), "the env's own process outlived the measurement"


def test_measuring_works_under_every_start_method(caplog):
    for method in multiprocessing.get_all_start_methods():
        cost = auto.measure_step_cost(EnvFactory(cpu_time=1e-4), multiprocessing.get_context(method))
        assert not isinstance(cost, str), (method, cost)
        assert cost.steps > 10 and cost.cpu_median_s > 0


def test_auto_with_partial_batches_lays_out_as_the_model_says_and_every_env_is_sent_again_when_back():
    # partial batches send envs one at a time: a packed process takes each as it comes back
    fns = [lambda: gym.make("CartPole-v1") for _ in range(4)]
    vec = envmanager.AsyncVectorEnv(fns, envs_per_worker="auto", batch_size=1, context="fork")
    try:
        assert 1 <= vec._manager.envs_per_worker <= 4
        vec.reset(seed=0)
        vec.send(np.zeros(4, dtype=np.int64))
        for _ in range(12):  # each env is sent again as soon as it is back
            *_, infos = vec.recv()
            vec.send(np.zeros(1, dtype=np.int64), infos["env_id"])
    finally:
        vec.close()


@pytest.mark.parametrize("bad", ["Auto", "", 0, 1.5, True])
def test_other_values_are_rejected(bad):
    with pytest.raises(InvalidInputError, match="auto"):
        SubprocessEnvManager(EnvFactory(), 2, envs_per_worker=bad)


class LeavesAHelper(StartsAHelper):
    """Answers in time, but its ``close()`` leaves its helper process running."""

    def step(self, action):
        return 0, 0.0, False, False, {}


def test_what_a_measured_env_started_is_gone_even_if_its_close_left_it(tmp_path):
    path = str(tmp_path / "helper")
    assert auto.choose_envs_per_worker(lambda i: LeavesAHelper(path), 8, cores=2) > 1
    with open(path) as f:
        helper = int(f.read())
    assert not alive([helper], timeout=5), "the env's own process outlived the measurement"


def _choose_in_a_daemon(conn) -> None:
    conn.send(auto.measure_step_cost(EnvFactory(), multiprocessing.get_context("fork")))


def test_a_caller_that_may_not_start_processes_gets_the_reason_and_one():
    # a daemonic process may not have children: no measuring process, a reason instead of an error
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    daemon = ctx.Process(target=_choose_in_a_daemon, args=(writer,), daemon=True)
    daemon.start()
    writer.close()
    try:
        assert reader.poll(30)
        answer = reader.recv()
    finally:
        daemon.join(10)
        reader.close()
    assert isinstance(answer, str) and "could not start" in answer and "daemonic" in answer


# -- the choice's properties, over measured costs (the measurement stood in for: no process) ----

even_costs = st.builds(
    auto.StepCost,
    median_s=st.just(0.0), p90_s=st.just(0.0),
    cpu_median_s=st.floats(1e-6, 20e-3), cpu_p90_s=st.just(0.0), cpu_share=st.floats(auto.CPU_BOUND, 1.0),
    steps=st.just(100), round_trip_s=st.none() | st.floats(5e-6, 2e-3), round_trip_cpu_s=st.none() | st.floats(1e-6, 1e-4),
    infos=st.sampled_from([NO_INFOS, BOARD_INFOS, NOTICE_INFOS]),
).map(lambda c: replace(c, median_s=c.cpu_median_s, p90_s=c.cpu_median_s * 1.1, cpu_p90_s=c.cpu_median_s * 1.1))
boards = st.tuples(st.floats(1e-6, 1e-4), st.floats(0.0, 5e-6))
callers = st.sampled_from([BATCH, STEP_INFO, VECTOR, VECTOR_PARTIAL, SB3])
#: (envs, cores), often near each other: where one env per process turns into packing.
machines = st.integers(1, 128).flatmap(lambda c: st.tuples(st.integers(max(1, c - 3), c + 3) | st.integers(1, 256), st.just(c)))


def _stand_in(monkeypatch, cost, board) -> list[int]:
    """``measure_step_cost`` and ``board_costs`` answer ``cost`` and ``board``; the list counts the measurements."""
    calls: list[int] = []

    def measured(*args, **kwargs):
        calls.append(1)
        return cost

    monkeypatch.setattr(auto, "measure_step_cost", measured)
    monkeypatch.setattr(auto, "board_costs", lambda *args, **kwargs: board)
    return calls


@settings(max_examples=300, deadline=None)
@given(machines, even_costs, boards, callers, st.sampled_from([auto.AUTO, True, False]))
def test_auto_never_has_more_processes_than_cores_nor_a_core_idle_while_envs_are_packed(machine, cost, board, caller,
                                                                                        double_buffer):
    n, cores = machine
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = _stand_in(monkeypatch, cost, board)
        k, db = auto.choose_layout(EnvFactory(), n, cores, caller=caller, double_buffer=double_buffer)
    processes = -(-n // k)
    assert processes <= cores
    if n < cores:  # every env a core, and the parent one: nothing measured
        assert (k, db, calls) == (1, False, [])
        return
    if k >= 2:  # packed only where a thinner split overfills the regime (cores - 1 with the parent's own, or cores)
        room = cores - 1 if processes + 1 <= cores else cores
        assert -(-n // (k - 1)) > room
    assert not db or (k >= 2 and (double_buffer is True or not caller.lockstep))
    # and it is the model's choice with the costs measured here
    best, _ = best_layout(n, cost.cpu_median_s, cores, auto.costs_here(cost, board), caller, cost.infos,
                          lanes=None if double_buffer == auto.AUTO else (2 if double_buffer else 1))
    assert (k, db) == (best.layout.envs_per_worker, best.layout.double_buffer)


@settings(max_examples=200, deadline=None)
@given(machines, even_costs, boards, st.floats(3.01, 50.0), st.floats(0.0, 0.49))
def test_uneven_or_waiting_envs_get_one_process_each_whatever_the_machine(machine, cost, board, spread, share):
    n, cores = machine
    uneven = replace(cost, cpu_p90_s=cost.cpu_median_s * spread + auto.UNEVEN_MIN_S)
    waiting = replace(cost, cpu_share=share)
    for measured in (uneven, waiting, "measuring failed: no env"):
        with pytest.MonkeyPatch.context() as monkeypatch:
            _stand_in(monkeypatch, measured, board)
            assert auto.choose_layout(EnvFactory(), n, cores) == (1, False)


class Named(gym.Env):
    """Returns a string in every step's info (no info row of the step board holds one)."""

    observation_space = gym.spaces.Discrete(2)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return 0, {}

    def step(self, action):
        return 0, 0.0, False, False, {"name": "named"}


def test_the_costs_are_this_machines():
    """The round trip and the pipe's CPU from the measuring process's pings, the parent's
    turnaround from the board's own operations timed here; defaults only where one is missing."""
    cost = auto.measure_step_cost(EnvFactory())
    assert not isinstance(cost, str), cost
    assert cost.round_trip_s and cost.round_trip_cpu_s and 0 < cost.round_trip_cpu_s <= 2 * cost.round_trip_s
    assert cost.infos == BOARD_INFOS  # ControlledEnv returns {"t": n}: flat, on the board
    board = auto.board_costs()
    assert board is not None and board[0] > 0 and board[1] >= 0
    costs = auto.costs_here(cost, board)
    assert (costs.round_trip_s, costs.pipe_s, costs.parent_s, costs.parent_process_s) == (
        cost.round_trip_s, cost.round_trip_cpu_s, *board)
    unmeasured = auto.costs_here(replace(cost, round_trip_s=None, round_trip_cpu_s=None), board)
    assert unmeasured.round_trip_s == DEFAULT_COSTS.round_trip_s and unmeasured.pipe_s == DEFAULT_COSTS.pipe_s
    plain = auto.measure_step_cost(lambda i: gym.make("CartPole-v1"))
    assert not isinstance(plain, str) and plain.infos == NO_INFOS  # CartPole's infos are empty
    named = auto.measure_step_cost(lambda i: Named())
    assert not isinstance(named, str) and named.infos == NOTICE_INFOS  # a string: pickled in a notice


def test_the_board_is_timed_as_the_processes_grow(monkeypatch):
    """``board_costs`` fits the turnaround at two sizes: a board that costs more per process gives
    a steeper slope. (The added cost, 20 us per process, is far above what a loaded machine's
    preemptions make of the fit: with 0.5 us a 2-core VM read the slope lower with it than
    without.)"""
    from envmanager.wire.mailbox import Mailboxes

    flat = auto.board_costs(rounds=50)
    real = Mailboxes.post_steps

    def slower(self, words, processes, now):  # 20 us more per process asked
        end = time.perf_counter() + 20e-6 * len(processes)
        while time.perf_counter() < end:
            pass
        return real(self, words, processes, now)

    monkeypatch.setattr(Mailboxes, "post_steps", slower)
    steep = auto.board_costs(rounds=50)
    assert flat is not None and steep is not None
    assert steep[1] > flat[1] + 10e-6, (flat, steep)
