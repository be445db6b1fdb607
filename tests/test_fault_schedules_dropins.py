"""Randomized fault schedules for the drop-ins (issue 30, item 8): gymnasium's ``AsyncVectorEnv``
and SB3's ``SubprocVecEnv`` on envmanager, driven through random interleavings of steps, resets,
env errors, worker kills and hangs (with restarts on and off where the drop-in takes them), and
checked after every call from the data alone, in each library's own terms:

* every call returns or raises within its deadline, and ``close()`` leaves nothing running or
  mapped (``test_fault_schedules``' checks);
* every row is its env's: no step lost or duplicated, the action the env received is the one
  given, an episode ends only at its length, an autoreset starts the next episode of the same env;
* SB3: a restart cuts an episode as ``done`` with ``TimeLimit.truncated`` and ``interrupted``, its
  ``terminal_observation`` the last one the caller saw, and the fresh env's reset in its place;
  a refused or failed call raises the package's error naming a slot that failed;
* gymnasium: the next-step autoreset (a reset step reaches no env and pays no reward); an env that
  raised surfaces as its own exception, chained to the worker's account naming its slot.

The seed, the count and the length of the schedules: ``test_fault_schedules``' variables.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

from envmanager.errors import EnvManagerError, RestartLimitError, WorkerDiedError, WorkerError, WorkerTimeoutError
from schedule_envs import EPISODE, LAST, NONCE, SLOT, ScheduleEnvFn, T, command, episode_length
from test_fault_schedules import MARGIN, SLOTS, TALLY, N, assert_nothing_left, kill, run, within

#: The drop-ins' deadline per answer; their start-up has it too, so it is longer than the core
#: schedules' (a loaded 2-core machine took more than 4 s to fork 4 processes of a test process with torch loaded).
TIMEOUT = 6.0


class DropInSchedule:
    """What both drop-ins' schedules share: the faults on command and the checks of an error."""

    restarts = False
    v: Any  # the vector env under test

    def __init__(self, k: int) -> None:
        self.k = k
        self.commands = tempfile.mkdtemp(prefix="schedule-")
        self.armed: dict[int, set[str]] = {s: set() for s in range(N)}
        self.faulted: set[int] = set()  # processes killed or hung
        self.raised: set[int] = set()  # slots whose env raised (restarts on: rebuilt)
        self.rebuilding: set[int] = set()  # slots whose env raised in a step, until their fresh reset is seen
        self.hangs = 0
        self.given_up: BaseException | None = None
        self.last: np.ndarray | None = None  # every env's last observation seen
        self.pids: set[int] = set()

    def fns(self) -> list[ScheduleEnvFn]:
        return [ScheduleEnvFn(i, self.commands) for i in range(N)]

    def process(self, slot: int) -> int:
        return slot // self.k

    def bound(self) -> float:
        return TIMEOUT * (1 + self.hangs) + MARGIN

    def fired(self, slot: int, kinds: tuple[str, ...]) -> bool:
        gone = {kind for kind in self.armed[slot] & set(kinds)
                if not os.path.exists(os.path.join(self.commands, f"{slot}.{kind}"))}
        self.armed[slot] -= gone
        return bool(gone)

    def note_fired(self) -> None:
        """A command that acted: its env raised (restarts on: rebuilt) or its process hung. A
        rebuild whose own reset raises restarts the process (``envmanager.core.process``): the
        slot's neighbours are cut short too."""
        for slot in range(N):
            if not self.armed[slot]:
                continue
            stepped, reset = self.fired(slot, ("step_raise",)), self.fired(slot, ("reset_raise",))
            if stepped or reset:
                self.raised.add(slot)
            if stepped:
                self.rebuilding.add(slot)
            if reset and slot in self.rebuilding:
                self.faulted.add(self.process(slot))
            if self.fired(slot, ("step_hang",)):
                self.faulted.add(self.process(slot))

    def check_error(self, error: BaseException) -> None:
        """An error of a step or reset: the package's, naming a slot that failed."""
        TALLY[type(error).__name__] += 1
        if isinstance(error, RestartLimitError):
            raise AssertionError(f"restart limits are off, yet: {error}") from error
        if isinstance(error, WorkerTimeoutError):
            assert error.hung and not self.restarts, error
            hung = [s for s in error.worker_ids if self.fired(s, ("step_hang",))]
            assert hung, f"{error}: none of them hung"
            self.faulted |= {self.process(s) for s in hung}
            self.given_up = error
        elif isinstance(error, WorkerDiedError):
            assert not self.restarts, f"a dead worker with restarts on was not restarted: {error}"
            assert {self.process(s) for s in error.worker_ids} & self.faulted, f"{error}: none of them was killed"
            self.given_up = error
        elif isinstance(error, WorkerError):
            assert not self.restarts, f"an env error with restarts on was not restarted: {error}"
            assert self.fired(error.worker_id, ("step_raise", "reset_raise")), f"{error} names a slot that raised nothing"
            assert "on command" in (error.remote_traceback or ""), error
        else:
            raise error

    def check_given_up(self, error: BaseException) -> None:
        """A call after a process was given up raises at once the error of a process that failed
        for good (the first one's, or another's that failed in the same call)."""
        assert isinstance(error, (WorkerDiedError, WorkerTimeoutError))
        self.note_fired()
        assert {self.process(s) for s in error.worker_ids} & self.faulted, f"{error}: none of them was killed or hung"

    def check_reset(self, obs: np.ndarray) -> None:
        """A reset of every env: each starts an episode (a new one of the same env, or a fresh env)."""
        self.note_fired()
        for i in range(N):
            o = obs[i]
            assert o[SLOT] == i and o[T] == 0 and o[LAST] == -1, f"slot {i}: reset gave {o}"
            prev = None if self.last is None else self.last[i]
            if prev is not None and o[NONCE] == prev[NONCE]:
                assert o[EPISODE] > prev[EPISODE], f"slot {i}: a reset that started no new episode"
            elif prev is not None:
                assert self.process(i) in self.faulted or i in self.raised, f"slot {i}: a new env, yet no fault"
        self.last = obs.copy()

    # -- faults ---------------------------------------------------------------------------------

    def env_raises(self, slot: int, kind: str) -> None:
        if kind not in self.armed[slot]:
            command(self.commands, slot, kind)
            self.armed[slot].add(kind)

    def env_hangs(self, slot: int) -> None:
        if self.hangs == 0:  # one per schedule at most: each costs the deadline
            command(self.commands, slot, "step_hang")
            self.armed[slot].add("step_hang")
            self.hangs += 1

    def kill_worker(self, slot: int) -> None:
        pid = self.manager().process_of(slot).pid
        assert pid is not None
        self.pids.add(pid)
        kill(pid)
        self.faulted.add(self.process(slot))

    def manager(self) -> Any:
        raise NotImplementedError

    def use_after_give_up(self) -> None:
        """A process given up: a reset and a step of the vector env raise at once."""
        assert self.given_up is not None
        with within(TIMEOUT + MARGIN, "a call after a process was given up"), \
                pytest.raises((WorkerDiedError, WorkerTimeoutError)) as again:
            self.v.reset()
            self.v.step(np.zeros(N, dtype=np.int64))
        self.check_given_up(again.value)

    def teardown(self) -> None:
        try:
            if self.given_up is not None:
                self.use_after_give_up()
        finally:
            try:
                self.pids |= {w.pid for w in self.manager().processes if w.pid is not None}
            finally:
                with within(TIMEOUT + MARGIN, "close()"):
                    self.v.close()
                shutil.rmtree(self.commands, ignore_errors=True)
        assert_nothing_left(self.pids)


# ---------------------------------------------------------------------------------------------
# SB3's SubprocVecEnv


class SB3Schedule(DropInSchedule):
    """``SubprocVecEnv`` of ``N`` envs (``k`` per process), stepped in lockstep through faults."""

    def __init__(self, k: int, restarts: bool) -> None:
        super().__init__(k)
        from envmanager.sb3 import SubprocVecEnv

        self.restarts = restarts
        self.v = SubprocVecEnv(self.fns(), "fork", envs_per_worker=k, timeout=TIMEOUT, restart_workers=restarts,
                               max_lifetime_restarts=-1, restarts_rate_limit_n=-1)
        self.pids = {w.pid for w in self.v.manager.processes if w.pid is not None}
        self.must_reset = True
        try:
            self.reset()
        except BaseException:
            self.v.close()
            raise

    def manager(self) -> Any:
        return self.v.manager

    def reset(self) -> None:
        try:
            with within(self.bound(), "reset()"):
                obs = self.v.reset()
        except EnvManagerError as error:
            self.check_error(error)
            self.must_reset = True  # as after a failed step: its envs are reset again before they step
            return
        self.check_reset(obs)
        self.must_reset = False

    def step(self, chosen: tuple[int, ...]) -> None:
        if self.must_reset:  # after a failed step SB3's envs are reset before they step again
            return
        actions = np.array(chosen)
        try:
            with within(self.bound(), "step()"):
                obs, rewards, dones, infos = self.v.step(actions)
        except EnvManagerError as error:
            self.check_error(error)
            self.must_reset = True
            return
        self.note_fired()
        assert self.last is not None
        for i in range(N):
            o, p, info = obs[i], self.last[i], infos[i]
            assert o[SLOT] == i, f"a row of slot {o[SLOT]:.0f} handed out as slot {i}'s"
            if info.get("interrupted"):
                TALLY["interrupted"] += 1
                assert self.restarts, f"slot {i}: an interrupted step without restarts"
                assert i in self.raised or self.process(i) in self.faulted, f"slot {i} cut, yet nothing failed"
                assert dones[i] and info["TimeLimit.truncated"] and rewards[i] == 0, (i, info)
                assert np.array_equal(info["terminal_observation"], p), f"slot {i}: not cut where it was last seen"
                assert o[T] == 0 and o[LAST] == -1 and o[NONCE] != p[NONCE], f"slot {i}: cut, yet {o} is no fresh env"
                self.rebuilding.discard(i)
                continue
            seen = info["terminal_observation"] if dones[i] else o
            assert (seen[NONCE], seen[EPISODE]) == (p[NONCE], p[EPISODE]), \
                f"slot {i}: one episode's step landed in another env episode: {p} -> {seen}"
            assert seen[T] == p[T] + 1, f"slot {i}: a step lost or duplicated: t {p[T]:.0f} -> {seen[T]:.0f}"
            assert seen[LAST] == actions[i], f"slot {i}: the env received {seen[LAST]:.0f}, {actions[i]} was given"
            assert bool(dones[i]) == (seen[T] >= episode_length(i, int(seen[EPISODE]))), f"slot {i}: done is wrong"
            if dones[i]:
                assert not info["TimeLimit.truncated"]
                assert (o[NONCE], o[EPISODE], o[T], o[LAST]) == (p[NONCE], p[EPISODE] + 1, 0, -1), \
                    f"slot {i}: the autoreset after {seen} gave {o}"
        self.last = obs.copy()


ACTIONS = st.tuples(*[st.integers(0, 3)] * N)
SB3_OPS = st.one_of(
    st.tuples(st.just("step"), ACTIONS),
    st.tuples(st.just("step"), ACTIONS),
    st.tuples(st.just("step"), ACTIONS),
    st.tuples(st.just("reset")),
    st.tuples(st.just("env_raises"), SLOTS, st.sampled_from(["step_raise", "step_raise", "reset_raise"])),
    st.tuples(st.just("kill_worker"), SLOTS),
    st.tuples(st.just("env_hangs"), SLOTS).filter(lambda op: op[1] == 0),
)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("restarts", [True, False], ids=["restarts", "no-restarts"])
def test_sb3_fault_schedules(k: int, restarts: bool) -> None:
    pytest.importorskip("stable_baselines3")
    run(lambda: SB3Schedule(k, restarts), SB3_OPS)


# ---------------------------------------------------------------------------------------------
# gymnasium's AsyncVectorEnv (no restarts: gymnasium has none)


class GymnasiumSchedule(DropInSchedule):
    """``AsyncVectorEnv`` of ``N`` envs (``k`` per process), next-step autoreset, through faults."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        from envmanager import AsyncVectorEnv

        self.v = AsyncVectorEnv(self.fns(), context="fork", envs_per_worker=k, worker_timeout=TIMEOUT)
        self.pids = {w.pid for w in self.manager().processes if w.pid is not None}
        self.must_reset = True
        try:
            self.reset(0)
        except BaseException:
            self.v.close()
            raise

    def manager(self) -> Any:
        return self.v._manager

    def failed(self, error: BaseException) -> None:
        """gymnasium's terms: an env's own exception, chained to the worker's account of it."""
        if not isinstance(error, EnvManagerError):
            assert isinstance(error, RuntimeError) and "on command" in str(error), error
            assert isinstance(error.__cause__, WorkerError), f"{error!r} is not chained to the worker's account"
            error = error.__cause__
        self.check_error(error)
        self.must_reset = True

    def reset(self, seed: int) -> None:
        try:
            with within(self.bound(), "reset()"):
                obs, _ = self.v.reset(seed=seed)
        except (EnvManagerError, RuntimeError) as error:
            self.failed(error)
            return
        self.check_reset(obs)
        self.must_reset = False

    def step(self, chosen: tuple[int, ...]) -> None:
        if self.must_reset:
            return
        actions = np.array(chosen)
        try:
            with within(self.bound(), "step()"):
                obs, rewards, terminated, truncated, _ = self.v.step(actions)
        except (EnvManagerError, RuntimeError) as error:
            self.failed(error)
            return
        assert self.last is not None
        for i in range(N):
            o, p = obs[i], self.last[i]
            assert o[SLOT] == i, f"a row of slot {o[SLOT]:.0f} handed out as slot {i}'s"
            assert not truncated[i]
            if p[T] >= episode_length(i, int(p[EPISODE])):  # next-step autoreset: this step reset the env
                assert (o[NONCE], o[EPISODE], o[T], o[LAST]) == (p[NONCE], p[EPISODE] + 1, 0, -1), \
                    f"slot {i}: the autoreset after {p} gave {o}"
                assert rewards[i] == 0 and not terminated[i]
                continue
            assert (o[NONCE], o[EPISODE]) == (p[NONCE], p[EPISODE]), \
                f"slot {i}: one episode's step landed in another env episode: {p} -> {o}"
            assert o[T] == p[T] + 1, f"slot {i}: a step lost or duplicated: t {p[T]:.0f} -> {o[T]:.0f}"
            assert o[LAST] == actions[i], f"slot {i}: the env received {o[LAST]:.0f}, {actions[i]} was given"
            assert bool(terminated[i]) == (o[T] >= episode_length(i, int(o[EPISODE])))
        self.last = obs.copy()


GYMNASIUM_OPS = st.one_of(
    st.tuples(st.just("step"), ACTIONS),
    st.tuples(st.just("step"), ACTIONS),
    st.tuples(st.just("step"), ACTIONS),
    st.tuples(st.just("reset"), st.integers(0, 1000)),
    st.tuples(st.just("env_raises"), SLOTS, st.sampled_from(["step_raise", "step_raise", "reset_raise"])),
    st.tuples(st.just("kill_worker"), SLOTS),
    st.tuples(st.just("env_hangs"), SLOTS).filter(lambda op: op[1] == 0),
)


@pytest.mark.parametrize("k", [1, 2])
def test_gymnasium_fault_schedules(k: int) -> None:
    run(lambda: GymnasiumSchedule(k), GYMNASIUM_OPS)
