"""The samplers' fault matrix: every fault the sampling layer exists to absorb, in both samplers
(parent-side ``Sampler``; worker-side ``WorkerPolicySampler`` under fork and spawn, one and
several envs per process), with restarts on and off. Each case checks the data, not only the
error: no episode id spans two env episodes, the recorded action is the one the env received,
no step is lost or duplicated, cut episodes are flagged and listed, every call returns or
raises within its deadline, and nothing is left running (the suite's no-leak fixture)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from envmanager.errors import (
    EnvManagerError,
    InvalidInputError,
    ManagerClosedError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from envmanager.sampler import Sampler, TransitionBatch, WorkerPolicySampler
from fault_envs import ENV_FAULTS, FAULT_SLOT, POLICY_FAULTS, FaultFactory, FaultPolicy, check_rows, update_raising_once
from process_helpers import alive

N = 4  # env slots
TIMEOUT = 3.0  # the managers' deadline per answer (a hung env is judged after it) ...
SPAWN_TIMEOUT = 15.0  # ... and its start-up too: a spawned worker imports numpy and gymnasium first
MARGIN = 30.0  # what a call may take beyond its deadline here: restarts, spawn, a loaded machine
VARIANTS = {
    "sampler": ("sampler", 1, "fork"),
    "sampler-k2": ("sampler", 2, "fork"),
    "worker-fork-k1": ("worker", 1, "fork"),
    "worker-spawn-k2": ("worker", 2, "spawn"),  # two processes to start, not four: spawn imports in each
}


def make(variant: str, fault: str | None, marker: str, restarts: bool, step_s: float = 0.0):
    kind, k, context = VARIANTS[variant]
    options = {"seed": 0, "envs_per_worker": k, "context": context, "timeout": timeout_of(variant), "restart_workers": restarts}
    cls = Sampler if kind == "sampler" else WorkerPolicySampler
    return cls(FaultFactory(fault, marker, step_s), N, FaultPolicy(fault, marker), **options)


def collect(sampler):
    """About 30 steps from every slot (episodes of 3-8 steps: several resets each)."""
    return sampler.obtain_steps(30 * N) if isinstance(sampler, Sampler) else sampler.obtain_steps(30)


def timeout_of(variant: str) -> float:
    return SPAWN_TIMEOUT if VARIANTS[variant][2] == "spawn" else TIMEOUT


def process_of(variant: str) -> int:
    return FAULT_SLOT // VARIANTS[variant][1]


def named_process(error: BaseException) -> set[int]:
    return set(getattr(error, "processes", None) or [getattr(error, "process", None)])


# ---------------------------------------------------------------------------------------------
# Env faults: in a step, in a reset, in an env update; raise, SIGKILL, hang


@pytest.mark.parametrize("fault", [*ENV_FAULTS, "update_raise"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_env_fault_with_restarts_is_absorbed(variant, fault, tmp_path):
    marker = str(tmp_path / "struck")
    with make(variant, fault, marker, restarts=True) as sampler:
        if fault == "update_raise":
            sampler.update(env_update=update_raising_once(marker))
        pid = sampler.manager.process_of(FAULT_SLOT).pid
        started = time.monotonic()
        first = collect(sampler)
        assert time.monotonic() - started < timeout_of(variant) + MARGIN
        empty_before = sampler.stats.counters.get("empty_cut_episodes", 0)  # (the first call's)
        second = sampler.obtain_exact_episodes(2)
        counters, cut = dict(sampler.stats.counters), list(sampler.cut_episodes)
        assert sampler.manager.restart_count(FAULT_SLOT) == 1 and sampler.manager.generation(FAULT_SLOT) == 1
        # The env that raised is rebuilt in its process, a neighbour's env untouched: in a step
        # or reset; in an env update too where the worker applies it (the parent-side sampler
        # applies updates by a call, whose failure takes the process's path).
        rebuilt = fault.endswith("_raise") and (fault != "update_raise" or VARIANTS[variant][0] == "worker")
        if rebuilt:
            assert sampler.manager.process_of(FAULT_SLOT).pid == pid
            assert all(sampler.manager.generation(s) == 0 for s in range(N) if s != FAULT_SLOT)
        else:
            assert sampler.manager.process_of(FAULT_SLOT).pid != pid
    assert rebuilt or not alive([pid], timeout=5.0)
    assert counters["worker_restarts"] == 1 and counters.get("failed_episodes", 0) == 0
    assert len(first) == 30 * N
    if VARIANTS[variant][0] == "worker":  # exactly its steps from every slot
        assert np.bincount(first.worker_ids).tolist() == [30] * N
    check_rows(first, cut, N)
    check_rows(second, cut, N)
    check_rows(TransitionBatch.concatenate([first, second]), cut, N, whole=False)  # across calls too
    assert second.n_episodes + counters.get("empty_cut_episodes", 0) - empty_before - sum(
        1 for e in cut if e not in first.episode_ids and e not in second.episode_ids and e % N == FAULT_SLOT) <= 2 * N
    no_arena = VARIANTS[variant][0] == "worker" and VARIANTS[variant][2] != "fork"
    if no_arena and fault in ("step_kill", "step_hang"):  # the fragment's rows died with the process: counted
        assert counters["lost_fragments"] >= 1
    elif fault.startswith("step"):  # an episode was running: cut, kept, flagged, listed
        assert counters["interrupted_episodes"] >= 1 and first.interrupted.any()
        assert set(first.episode_ids[first.interrupted].tolist()) <= set(cut)
    if fault == "update_raise":  # replayed on the restarted process (or rebuilt env): every episode ran with it
        assert (first.env_versions == 1).all() and (second.env_versions == 1).all()


@pytest.mark.parametrize("variant", ["sampler", "worker-fork-k1"])
def test_a_reset_that_raises_cuts_its_episode_before_its_first_step_in_both_samplers(variant, tmp_path):
    # Slot 1's third reset raises (restarts on): the episode that reset began is cut before its
    # first step -- counted as such, its id used (never given to the next episode), and another
    # episode admitted in its place. The worker-side sampler counted nothing and gave the next
    # episode that id.
    marker = str(tmp_path / "struck")
    with make(variant, "reset_raise", marker, restarts=True) as sampler:
        batch = sampler.obtain_exact_episodes(3)
        counters = dict(sampler.stats.counters)
    ids = sorted(set(batch.episode_ids[batch.worker_ids == FAULT_SLOT].tolist()))
    assert ids == [FAULT_SLOT, N + FAULT_SLOT, 3 * N + FAULT_SLOT]  # the third (2N + 1) was cut
    assert counters["empty_cut_episodes"] == 1 and counters["interrupted_episodes"] == 1
    assert counters["episodes_started"] == 3 * N + 1 and counters.get("failed_episodes", 0) == 0
    assert batch.n_episodes == 3 * N and not batch.episode_interrupted.any()


@pytest.mark.parametrize("fault", [*ENV_FAULTS, "update_raise"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_env_fault_without_restarts_names_the_slot(variant, fault, tmp_path):
    marker = str(tmp_path / "struck")
    how = fault.split("_")[1]
    with make(variant, fault, marker, restarts=False) as sampler:
        if fault == "update_raise":
            sampler.update(env_update=update_raising_once(marker))
        pid = sampler.manager.process_of(FAULT_SLOT).pid
        started = time.monotonic()
        with pytest.raises(EnvManagerError) as caught:
            for _ in range(3):
                collect(sampler)
        assert time.monotonic() - started < timeout_of(variant) + MARGIN
        error = caught.value
        # A process that died or hung is named with every slot it hosted (which env did it is
        # unknown); an env that raised, by its own slot.
        assert FAULT_SLOT in error.worker_ids and process_of(variant) in named_process(error), error
        if how == "raise":  # the env's own error with its traceback; the process serves on
            assert isinstance(error, WorkerError) and error.worker_id == FAULT_SLOT and "blew up" in error.remote_traceback
            batch = collect(sampler)  # carries on: the failed episode is dropped and counted
            check_rows(batch, sampler.cut_episodes, N)
            assert len(batch) == 30 * N and not batch.interrupted.any()
            if fault == "update_raise":  # applied at last, before any episode of the slot
                assert (batch.env_versions == 1).all()
        else:  # killed or hung: the process is given up, named on this and every later call, at once
            assert isinstance(error, WorkerDiedError if how == "kill" else WorkerTimeoutError)
            if how == "hang":
                assert error.hung is True
            assert not alive([pid], timeout=5.0), "the failed process was left running"
            again = time.monotonic()
            with pytest.raises(type(error)) as later:
                collect(sampler)
            assert later.value is error and time.monotonic() - again < TIMEOUT
        if fault.startswith("step"):  # the episode it ran failed (or, with no arena, the fragment was lost): counted
            counters = sampler.stats.counters
            assert counters["failed_episodes"] + counters["lost_fragments"] >= 1


# ---------------------------------------------------------------------------------------------
# Policy faults: it raises, or gives too few actions, a fraction, a value out of range


@pytest.mark.parametrize("restarts", [True, False])
@pytest.mark.parametrize("fault", POLICY_FAULTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_policy_fault(variant, fault, restarts, tmp_path):
    marker = str(tmp_path / "struck")
    worker_side = VARIANTS[variant][0] == "worker"
    with make(variant, fault, marker, restarts) as sampler:
        started = time.monotonic()
        if worker_side and restarts:  # in the worker: the process goes through a restart
            batches = [collect(sampler)]
            assert sampler.manager.restart_count(FAULT_SLOT) == 1
        else:
            expected = (RuntimeError if fault == "policy_raise" else InvalidInputError) if not worker_side else WorkerError
            with pytest.raises(expected) as caught:  # the slot's step 2: within a few calls, however
                for _ in range(3):                     # unevenly a loaded machine spreads the steps
                    collect(sampler)
            error = caught.value
            if worker_side:  # named, with the worker's traceback
                process = process_of(variant)
                assert process in named_process(error) and error.worker_id // VARIANTS[variant][1] == process
                why = {"policy_raise": "policy blew up", "policy_count": "rows", "policy_dtype": "integer actions only",
                       "policy_range": "Discrete(3)"}[fault]
                assert why in error.remote_traceback or why in str(error), error
            else:  # the parent's own exception: nothing was sent
                assert sampler.manager.restart_count(FAULT_SLOT) == 0
            batches = [collect(sampler), collect(sampler)]  # the sampler carries on
        assert time.monotonic() - started < timeout_of(variant) + MARGIN
        cut = list(sampler.cut_episodes)
    assert marker and all(len(b) == 30 * N for b in batches)
    for batch in batches:
        check_rows(batch, cut, N)
        assert set(batch.next_observations[:, 1].tolist()) <= {0.0, 1.0, 2.0}, "an env got an action that does not fit"
    check_rows(TransitionBatch.concatenate(batches), cut, N, whole=False)  # across calls: nothing lost or repeated


# ---------------------------------------------------------------------------------------------
# Close from another thread in the middle of a call


@pytest.mark.parametrize("variant", VARIANTS)
def test_close_mid_call_ends_the_call(variant, tmp_path):
    sampler = make(variant, None, str(tmp_path / "unused"), restarts=True, step_s=0.05)
    pids = [w.pid for w in sampler.manager.processes]
    raised: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(20):
                collect(sampler)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.0)
    sampler.close()
    thread.join(timeout_of(variant) + MARGIN)
    assert not thread.is_alive(), "a call went on after close()"
    assert len(raised) == 1 and isinstance(raised[0], ManagerClosedError), raised
    assert not alive(pids, timeout=5.0)
    sampler.close()  # idempotent


def test_a_death_found_while_env_updates_are_applied_cuts_that_episode_before_it_begins(tmp_path):
    """A process dies while idle; the collection that follows admits its slot (the death not seen
    yet), then applies a pending env update to another slot, and that call's wait finds the death
    and restarts the process. The slot's episode is cut before it began (admitted again), not reset
    into a process whose fresh reset is on its way ("worker 1 is busy; it cannot be reset now",
    fault schedule seed 57000)."""
    import os
    import signal

    import psutil

    with Sampler(FaultFactory(None, str(tmp_path / "m"), 0.0), 2, FaultPolicy(None, str(tmp_path / "m")), seed=0,
                 context="fork", timeout=TIMEOUT, restart_workers=True) as sampler:
        sampler.obtain_exact_episodes(2)  # both slots idle, no episode running
        sampler.update(env_update=lambda env: None)  # due on each slot before its next episode
        pid = sampler.manager.process_of(1).pid
        os.kill(pid, signal.SIGKILL)
        dead_by = time.monotonic() + 10
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < dead_by:
            time.sleep(0.01)  # dead, not reaped: the first wait of the next call finds it
        batch = sampler.obtain_steps(20)
        check_rows(batch, sampler.cut_episodes, 2)
        assert len(batch) >= 20 and sampler.manager.restart_count(1) == 1
        after = sampler.obtain_exact_episodes(1)  # slot 1 goes on from its fresh env (it may have
        check_rows(after, sampler.cut_episodes, 2)  # had no row in the 20 steps: its restart runs)
        assert set(after.worker_ids.tolist()) == {0, 1} and not after.interrupted.any()
        check_rows(TransitionBatch.concatenate([batch, after]), sampler.cut_episodes, 2, whole=False)


def _kill_own_process_on(slot: int, slow: int):
    """An env update that SIGKILLs its worker process when it runs on ``slot``'s env, and takes
    three seconds on ``slow``'s (its wait then blocks on the pipes and the processes' ends)."""
    def update(env):
        import os
        import signal

        if env.unwrapped.slot == slot:
            os.kill(os.getpid(), signal.SIGKILL)
        if env.unwrapped.slot == slow:
            time.sleep(3.0)  # (room for a loaded machine's parent to see the other death first)
    return update


def test_every_call_after_two_give_ups_raises_the_error_the_caller_saw_first(tmp_path):
    """Restarts off, two processes lost in one call: process 1 died while idle (found dead by the
    wait of slot 0's env update, which takes seconds: given up first), process 0 dies in slot 1's
    update (the error the call hit). The call raises the first give-up's error, the other chained to it, and every later
    call raises that same one, as WorkerPolicySampler does (it raised the other one, then this one:
    fault schedule seed 58000, no-restarts-sampler-2)."""
    import os
    import signal

    import psutil

    with Sampler(FaultFactory(None, str(tmp_path / "m"), 0.0), N, FaultPolicy(None, str(tmp_path / "m")), seed=0,
                 envs_per_worker=2, context="fork", timeout=TIMEOUT, restart_workers=False) as sampler:
        sampler.obtain_exact_episodes(1)  # every slot idle, no episode running
        sampler.update(env_update=_kill_own_process_on(1, slow=0))  # due on each slot before its next episode
        pid = sampler.manager.process_of(2).pid
        os.kill(pid, signal.SIGKILL)
        dead_by = time.monotonic() + 10
        while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < dead_by:
            time.sleep(0.01)  # dead, not reaped: the first wait of the next call finds it
        with pytest.raises(WorkerDiedError) as first:
            sampler.obtain_steps(8)
        assert named_process(first.value) == {1}  # the first given up ...
        assert named_process(first.value.__context__) == {0}  # ... the one this call hit chained to it
        for _ in range(2):
            with pytest.raises(WorkerDiedError) as again:
                sampler.obtain_steps(8)
            assert again.value is first.value
        assert {sampler.manager.failure_of(s) is not None for s in range(N)} == {True}  # both given up


@pytest.mark.parametrize("call", ["obtain_steps", "obtain_samples", "obtain_exact_episodes"])
def test_every_process_dead_while_idle_is_restarted_and_the_call_collects(call, tmp_path):
    """Restarts on, every process killed while idle: the next call admits every slot (the deaths
    not seen yet), its resets find the deaths, both processes restart, and all four admitted
    episodes are cut before their first step; the call admits again and collects. Every goal counts
    such episodes (``obtain_steps`` and ``obtain_samples`` did not, and raised "nothing is
    running and the collection is not done": fault schedule seed 60000, restarts-sampler-2)."""
    import os
    import signal

    import psutil

    with Sampler(FaultFactory(None, str(tmp_path / "m"), 0.0), N, FaultPolicy(None, str(tmp_path / "m")), seed=0,
                 envs_per_worker=2, context="fork", timeout=TIMEOUT, restart_workers=True) as sampler:
        pids = [p.pid for p in sampler.manager.processes]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        dead_by = time.monotonic() + 10
        while any(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids) and time.monotonic() < dead_by:
            time.sleep(0.01)  # dead, not reaped: the resets of the next call find them
        started = time.monotonic()
        batch = {"obtain_steps": lambda: sampler.obtain_steps(8),
                 "obtain_samples": lambda: sampler.obtain_samples(0, 8),
                 "obtain_exact_episodes": lambda: sampler.obtain_exact_episodes(1)}[call]()
        assert time.monotonic() - started < TIMEOUT + MARGIN
        check_rows(batch, sampler.cut_episodes, N)
        assert len(batch) >= 8 and not batch.interrupted.any()
        assert [sampler.manager.restart_count(s) for s in range(N)] == [1] * N  # each process once
        assert sampler.stats.counters["empty_cut_episodes"] == N
        if call == "obtain_exact_episodes":
            assert sorted(batch.worker_ids[batch.dones].tolist()) == list(range(N))  # one whole episode each
