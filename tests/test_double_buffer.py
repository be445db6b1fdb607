"""Double buffering: two requests in flight per process, one per lane (half of its slots).

Real worker processes and real gymnasium envs; every slot's results are checked, and the
faults of a process with both halves in flight (SIGKILL, hang, env error) name its slots,
lose nothing, file nothing twice and restart within the limits.
"""

from __future__ import annotations

import os
import signal

import gymnasium as gym
import numpy as np
import pytest

from envmanager import InvalidInputError, RestartLimitError, SubprocessEnvManager, WorkerDiedError, WorkerTimeoutError
from envmanager.core.auto import choose_double_buffer
from envmanager.core.batch import BatchEnvManager
from envmanager.testing.envs import ControlledEnv, EnvFactory

N, K = 8, 4  # 8 slots, 4 per process: 2 processes of 2 lanes (slots 0-1 | 2-3, 4-5 | 6-7)


def manager(factory=None, n=N, k=K, **kwargs) -> BatchEnvManager:
    return BatchEnvManager(factory or EnvFactory(), n, envs_per_worker=k, double_buffer=True, timeout=30, **kwargs)


def reset_all(m: BatchEnvManager) -> None:
    m.send_reset({s: (s, None) for s in range(m.n_env)})
    m.receive_reset_batch()


def wait_arrived(m: BatchEnvManager, slots: set[int], seconds: float = 30.0) -> None:
    """Wait until ``slots`` answered (ARRIVED), without handing them out."""
    m.wait_for(lambda: slots <= set(m._state.arrived), seconds, "the first half", lambda: sorted(slots))


def test_lanes_split_each_process_into_halves():
    with manager() as m:
        assert m.double_buffer
        assert m.slot_lanes == [1, 1, 2, 2, 1, 1, 2, 2]


def test_first_ready_results_are_every_slots_own_and_none_is_lost():
    """Each half is sent again as soon as it is back while the other half steps: every slot's
    observation counts its own steps and echoes its own last action."""
    with manager() as m:
        reset_all(m)
        counts = np.zeros(N, dtype=np.int64)
        rng = np.random.default_rng(0)
        last = rng.integers(0, 3, N)
        m.send_batch(np.arange(N), last)
        assert m.waiting_worker_ids == list(range(N))  # both halves in flight
        while counts.min() < 50:
            batch = m.receive_batch(1)
            slots = batch.slots
            obs = m.results.observation[slots]
            counts[slots] += 1
            np.testing.assert_array_equal(obs[:, 0], counts[slots])  # steps in the episode
            np.testing.assert_array_equal(obs[:, 1], slots)  # its own env
            np.testing.assert_array_equal(obs[:, 2], last[slots])  # the action it was sent
            np.testing.assert_array_equal(m.results.reward[slots], last[slots])
            assert batch.infos == {s: {"t": int(c)} for s, c in zip(slots.tolist(), counts[slots].tolist(), strict=True)}
            last[slots] = rng.integers(0, 3, len(slots))
            m.send_batch(slots, last[slots])
        m.drain()


def test_each_slot_keeps_its_own_lanes_timings_when_both_lanes_come_back_together():
    """Both lanes of a process answered before one receive: every slot's env time is its own
    env's step (each sleeps a different time), not 0 or the other lane's."""
    sleeps = {0: 0.01, 1: 0.02, 2: 0.03, 3: 0.04}
    factory = EnvFactory(per_env={i: {"step_time": t} for i, t in sleeps.items()})
    with manager(factory, n=4, k=4) as m:
        reset_all(m)
        m.send_batch(np.arange(4), np.zeros(4, dtype=np.int64))
        wait_arrived(m, {0, 1, 2, 3})
        assert sorted(m.receive_batch(1).slots.tolist()) == [0, 1, 2, 3]
        envs = {slot: m.timings(slot)[0] for slot in range(4)}
        assert all(envs[s] >= sleeps[s] for s in range(4)), envs  # each slept at least its own time
        assert envs[0] < sleeps[2] and envs[1] < sleeps[3], envs  # lane 0's own, not lane 1's (30, 40 ms)


def test_a_slot_in_flight_is_refused_before_anything_is_sent_and_the_other_lane_goes(tmp_path):
    gate = str(tmp_path / "open")
    with manager(EnvFactory(gate=gate), n=4) as m:
        reset_all(m)
        m.send_batch([0, 1], [1, 1])
        with pytest.raises(InvalidInputError, match="still stepping"):
            m.send_batch([1, 2], [1, 1])  # slot 1 is in flight: nothing of the batch is sent
        assert m.waiting_worker_ids == [0, 1]
        m.send_batch([2, 3], [2, 2])  # the other lane
        assert m.waiting_worker_ids == [0, 1, 2, 3]
        assert m.idle_worker_ids == []
        open(gate, "w").close()
        got = []
        while len(got) < 4:
            got += m.receive_batch(1).slots.tolist()
        assert sorted(got) == [0, 1, 2, 3]
        np.testing.assert_array_equal(m.results.observation[:, 2], [1, 1, 2, 2])


def test_a_lane_is_reset_while_the_other_steps(tmp_path):
    gate = str(tmp_path / "open")
    with manager(EnvFactory(per_env={0: {"gate": gate}, 1: {"gate": gate}}), n=4) as m:
        reset_all(m)
        m.send_batch([0, 1], [1, 1])
        m.send_reset({2: (7, None), 3: (8, None)})
        open(gate, "w").close()
        resets = m.receive_reset_batch()
        assert resets.slots.tolist() == [2, 3] and resets.infos[2]["seed"] == 7
        steps = m.receive_batch(2)
        assert sorted(steps.slots.tolist()) == [0, 1]


def kill_with_both_halves_in_flight(m: BatchEnvManager, tmp_path) -> int:
    """Steps to process 0 whose first half blocks: both halves in flight; then SIGKILL it."""
    reset_all(m)
    m.send_batch(np.arange(4), np.ones(4, dtype=np.int64))
    w = m.processes[0]
    assert m.waiting_worker_ids == [0, 1, 2, 3]
    os.kill(w.pid, signal.SIGKILL)
    return w.pid


def test_sigkill_with_both_halves_in_flight_restarts_and_each_slot_comes_back_once(tmp_path):
    gate = str(tmp_path / "never")
    with manager(EnvFactory(per_env={0: {"gate": gate}}), n=4, restart_workers=True) as m:
        old = kill_with_both_halves_in_flight(m, tmp_path)
        got: list[int] = []
        interrupted: set[int] = set()
        while len(got) < 4:
            batch = m.receive_batch(1)
            got += batch.slots.tolist()
            interrupted |= batch.interrupted
        assert sorted(got) == [0, 1, 2, 3]  # nothing lost, nothing twice
        assert interrupted == {0, 1, 2, 3}
        assert m.results.observation[:, 0].tolist() == [0, 0, 0, 0]  # fresh episodes
        assert m.restart_count(0) == 1 and m.generation(0) == 1 and m.processes[0].pid != old
        assert not m.in_flight() and not m.unreceived()
        # The fresh envs have no gate problem for slots 1-3; slot 0 is still gated: step the rest.
        m.send_batch([2, 3], [2, 2])
        assert sorted(m.receive_batch(2).slots.tolist()) == [2, 3]


def test_sigkill_with_one_half_answered_and_the_other_in_flight(tmp_path):
    """The first half's answer arrived (not handed out yet) when the process died: its slots
    come back once, interrupted, as the second half's do."""
    gate = str(tmp_path / "never")
    factory = EnvFactory(per_env={2: {"gate": gate}, 3: {"gate": gate}})
    with manager(factory, n=4, restart_workers=True) as m:
        reset_all(m)
        m.send_batch(np.arange(4), np.ones(4, dtype=np.int64))
        wait_arrived(m, {0, 1})
        os.kill(m.processes[0].pid, signal.SIGKILL)
        m.wait_idle()  # the restart's reset is filed while slots 0 and 1 still wait to be handed out
        got: list[int] = []
        interrupted: set[int] = set()
        while len(got) < 4:
            batch = m.receive_batch(1)
            got += batch.slots.tolist()
            interrupted |= batch.interrupted
        assert sorted(got) == [0, 1, 2, 3] and interrupted == {0, 1, 2, 3}
        assert m.restart_count(0) == 1


def test_sigkill_after_one_half_was_handed_out_cuts_its_next_episode_once(tmp_path):
    """The first half's real step result is handed out before the restart's reset is: each
    slot then gets exactly one interrupted result, after its real one."""
    gate = str(tmp_path / "never")
    factory = EnvFactory(per_env={2: {"gate": gate}, 3: {"gate": gate}})
    with manager(factory, n=4, restart_workers=True) as m:
        reset_all(m)
        m.send_batch(np.arange(4), np.ones(4, dtype=np.int64))
        first = m.receive_batch(2)
        assert sorted(first.slots.tolist()) == [0, 1] and not first.interrupted
        assert m.results.observation[[0, 1], 0].tolist() == [1, 1]  # the real step
        os.kill(m.processes[0].pid, signal.SIGKILL)
        events: list[tuple[int, bool]] = []
        while len(events) < 4:
            batch = m.receive_batch(1)
            events += [(s, s in batch.interrupted) for s in batch.slots.tolist()]
        assert sorted(events) == [(0, True), (1, True), (2, True), (3, True)]
        assert not m.unreceived() and not m.in_flight()


def test_sigkill_with_both_halves_in_flight_and_no_restarts_names_the_slots(tmp_path):
    gate = str(tmp_path / "never")
    with manager(EnvFactory(per_env={0: {"gate": gate}}), n=8) as m:
        reset_all(m)
        m.send_batch(np.arange(8), np.ones(8, dtype=np.int64))
        got = []
        while len(got) < 4:  # process 1 answers both its halves
            got += m.receive_batch(1).slots.tolist()
        assert sorted(got) == [4, 5, 6, 7]
        os.kill(m.processes[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as caught:
            m.receive_batch(1)
        assert caught.value.worker_ids == [0, 1, 2, 3] and "killed by SIGKILL" in str(caught.value)
        with pytest.raises(WorkerDiedError):  # raised once for both halves, then as the process's failure
            m.receive_batch(1)
        with pytest.raises(WorkerDiedError):
            m.send_batch([2, 3], [1, 1])
        m.send_batch([4, 5, 6, 7], np.ones(4, dtype=np.int64))  # the other process lives on
        assert sorted(m.receive_batch(4).slots.tolist()) == [4, 5, 6, 7]


def test_hang_with_both_halves_in_flight_names_the_process_and_restarts_within_limits(tmp_path):
    gate = str(tmp_path / "never")
    factory = EnvFactory(per_env={0: {"gate": gate}})
    with BatchEnvManager(factory, 4, envs_per_worker=4, double_buffer=True, timeout=1.0, restart_workers=True,
                         max_lifetime_restarts=1) as m:
        reset_all(m)
        m.send_batch(np.arange(4), np.ones(4, dtype=np.int64))
        batch = m.receive_batch(4, timeout=30)  # hung: restarted, both halves come back interrupted
        assert sorted(batch.slots.tolist()) == [0, 1, 2, 3] and batch.interrupted == {0, 1, 2, 3}
        m.send_batch(np.arange(4), np.ones(4, dtype=np.int64))  # hangs again: past the limit
        with pytest.raises(RestartLimitError) as caught:
            m.receive_batch(4, timeout=30)
        assert isinstance(caught.value.failure, WorkerTimeoutError)
        assert caught.value.worker_ids == [0, 1, 2, 3]


def test_env_error_in_one_half_with_restarts_off_leaves_the_other_half_in_flight():
    factory = EnvFactory(per_env={0: {"fault": "raise", "fault_at": 2}})
    with manager(factory, n=4) as m:
        reset_all(m)
        ones = np.ones(4, dtype=np.int64)
        m.send_batch(np.arange(4), ones)
        assert sorted(m.receive_batch(4).slots.tolist()) == [0, 1, 2, 3]
        m.send_batch(np.arange(4), ones)
        got, errors = [], []
        while len(got) + len(errors) < 4:
            try:
                got += m.receive_batch(1).slots.tolist()
            except Exception as exc:  # the env's own error, for slot 0 only
                errors.append(exc)
                got_error_slot = exc.worker_id
        assert got_error_slot == 0 and sorted(got) == [1, 2, 3]
        assert m.results.observation[[1, 2, 3], 0].tolist() == [2, 2, 2]


def test_close_with_both_halves_in_flight_ends_everything(tmp_path):
    gate = str(tmp_path / "never")
    m = manager(EnvFactory(gate=gate))
    reset_all(m)
    m.send_batch(np.arange(N), np.ones(N, dtype=np.int64))
    pids = [w.pid for w in m.processes]
    m.close(timeout=1.0)
    for pid in pids:  # reaped: no such process (the no_leaks fixture checks shared memory and fds)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_step_info_level_steps_each_half_as_it_comes_back():
    with SubprocessEnvManager(EnvFactory(cpu_time=1e-4), 4, envs_per_worker=4, double_buffer=True) as m:
        m.reset(seed=0)
        seen = dict.fromkeys(range(4), 0)
        while min(seen.values()) < 20:
            for info in m.step(dict.fromkeys(m.idle_worker_ids, 1)):
                seen[info.worker_id] += 1
                assert info.current_result.observation[0] == seen[info.worker_id]
                assert info.previous_result is not None


def test_auto_chooses_double_buffering_only_when_the_parent_has_a_core_of_its_own():
    assert choose_double_buffer(1, 8, cores=2)  # one process of 8 on 2 cores: the parent has one
    assert not choose_double_buffer(2, 4, cores=2)  # 2 processes on 2 shared cores
    assert not choose_double_buffer(8, 1, cores=64)  # one env per process: nothing to split
    assert choose_double_buffer(16, 4, cores=64)
    assert not choose_double_buffer(64, 4, cores=64)
    with BatchEnvManager(EnvFactory(), 4, envs_per_worker=2, double_buffer="auto") as m:
        assert m.double_buffer == choose_double_buffer(2, 2)  # honours this process's affinity
    with pytest.raises(InvalidInputError):
        BatchEnvManager(EnvFactory(), 2, double_buffer="yes")


def test_gymnasium_drop_in_double_buffered_equals_sync():
    import envmanager

    fns = [lambda: gym.make("CartPole-v1") for _ in range(4)]
    ours = envmanager.AsyncVectorEnv(fns, envs_per_worker=4, double_buffer=True)
    sync = gym.vector.SyncVectorEnv(fns)
    try:
        assert ours._manager.double_buffer
        o1, _ = ours.reset(seed=3)
        o2, _ = sync.reset(seed=3)
        np.testing.assert_array_equal(o1, o2)
        rng = np.random.default_rng(0)
        for _ in range(300):
            a = rng.integers(0, 2, 4)
            r1, r2 = ours.step(a), sync.step(a)
            for x, y in zip(r1[:4], r2[:4], strict=True):
                np.testing.assert_array_equal(x, y)
    finally:
        ours.close()
        sync.close()


def test_gymnasium_auto_double_buffers_partial_batches_only():
    """Lockstep ``step()`` waits for both halves: ``"auto"`` leaves it off there; partial
    batches follow the core rule (the parent's own core), as does ``SubprocessEnvManager``."""
    import envmanager

    fns = [lambda i=i: ControlledEnv(i) for i in range(4)]
    lockstep = envmanager.AsyncVectorEnv(fns, envs_per_worker=4)
    partial = envmanager.AsyncVectorEnv(fns, envs_per_worker=4, batch_size=2)
    try:
        assert not lockstep._manager.double_buffer
        assert partial._manager.double_buffer == choose_double_buffer(1, 4)
    finally:
        lockstep.close()
        partial.close()


def test_gymnasium_partial_batches_double_buffered():
    """EnvPool-style send/recv with a batch of half the envs: each half of the one process
    comes back as a batch and goes out again while the other half steps."""
    import envmanager

    fns = [lambda i=i: ControlledEnv(i) for i in range(4)]
    vec = envmanager.AsyncVectorEnv(fns, envs_per_worker=4, batch_size=2, double_buffer=True)
    try:
        vec.reset(seed=0)
        vec.send(np.ones(4, dtype=np.int64))
        steps = np.zeros(4, dtype=np.int64)
        for _ in range(40):
            obs, _reward, *_, infos = vec.recv()
            ids = infos["env_id"]
            assert sorted(ids.tolist()) in ([0, 1], [2, 3])
            steps[ids] += 1
            np.testing.assert_array_equal(obs[:, 0], steps[ids])
            np.testing.assert_array_equal(obs[:, 1], ids)
            vec.send(np.ones(2, dtype=np.int64), ids)
        vec.recv()
        vec.recv()
    finally:
        vec.close()


def test_sb3_drop_in_double_buffered():
    pytest.importorskip("stable_baselines3")
    from envmanager.sb3 import SubprocVecEnv

    vec = SubprocVecEnv([lambda i=i: ControlledEnv(i, episode_length=5) for i in range(4)], start_method="fork",
                        envs_per_worker=4, double_buffer=True)
    try:
        assert vec.manager.double_buffer
        obs = vec.reset()
        assert obs[:, 0].tolist() == [0, 0, 0, 0]
        for t in range(1, 12):
            obs, rewards, dones, _infos = vec.step(np.full(4, 2))
            assert rewards.tolist() == [2.0] * 4
            assert dones.tolist() == [t % 5 == 0] * 4
            assert obs[:, 1].tolist() == [0, 1, 2, 3]
    finally:
        vec.close()
