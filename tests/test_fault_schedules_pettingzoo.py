"""Randomized fault schedules for PettingZoo's envs on envmanager: ``ParallelVectorEnv`` driven
through random interleavings of lockstep steps, EnvPool-style sends and receives of some envs,
resets, env errors, worker kills and hangs, with restarts on and off, and checked after every
call from the data alone (``pettingzoo_envs.ScheduleParallelEnv``: two agents that die at
different times, each observing its env's slot, its own index, the episode, the step, the last
action it received and the env object's nonce):

* every call returns or raises within its deadline, and ``close()`` leaves nothing running or
  mapped (``test_fault_schedules``' checks);
* every row is its env's and its agent's: no step lost or duplicated, an agent that acted
  received the action given for it, an agent that died is absent and reads no action, an env
  ends when its last agent does and its next result is its next episode's reset (no action read);
* with restarts, an env whose process restarted (or that raised: rebuilt) comes back as a fresh
  env's reset flagged ``restarted``, and only such an env; without, the error is the package's,
  naming a slot that failed, and a process given up fails every later call at once.

The seed, the count and the length of the schedules: ``test_fault_schedules``' variables.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

pytest.importorskip("pettingzoo", minversion="1.24")

from envmanager.errors import EnvManagerError, InvalidInputError, WorkerDiedError, WorkerTimeoutError
from pettingzoo_envs import ScheduleParallelEnv, ScheduleParallelFn
from schedule_envs import episode_length
from test_fault_schedules import MARGIN, SLOTS, TALLY, N, run, within
from test_fault_schedules_dropins import TIMEOUT, DropInSchedule

SLOT, AGENT, EPISODE, T, LAST, NONCE = range(6)
AGENTS = len(ScheduleParallelEnv.possible_agents)


class PettingZooSchedule(DropInSchedule):
    """``ParallelVectorEnv`` of ``N`` envs (``k`` per process) through faults. ``last`` holds each
    env's latest rows handed out (agents by index); ``active`` and ``ended`` its latest flags."""

    def __init__(self, k: int, restarts: bool) -> None:
        super().__init__(k)
        from envmanager.pettingzoo import ParallelVectorEnv

        self.restarts = restarts
        self.v = ParallelVectorEnv([ScheduleParallelFn(i, self.commands) for i in range(N)], envs_per_worker=k,
                                   context="fork", timeout=TIMEOUT, restart_workers=restarts, max_lifetime_restarts=-1,
                                   restarts_rate_limit_n=-1)
        self.pids = {w.pid for w in self.manager().processes if w.pid is not None}
        self.rows: list[np.ndarray | None] = [None] * N  # each env's rows (agent by index) last handed out
        self.active = np.zeros((N, AGENTS), np.bool_)
        self.ended = np.zeros(N, np.bool_)
        self.sent: dict[int, np.ndarray] = {}  # envs sent a step not received yet: the actions given
        self.must_reset = True
        try:
            self.reset(0)
        except BaseException:
            self.v.close()
            raise

    def manager(self) -> Any:
        return self.v.manager

    def failed(self, error: BaseException) -> None:
        """The package's error, naming a slot that failed; what was in flight is dropped by the
        next reset, which every env needs before it steps again."""
        if isinstance(error, InvalidInputError):
            raise error
        self.check_error(error)
        self.must_reset = True

    # -- the checks ---------------------------------------------------------------------------

    def check_batch(self, batch: Any, actions: dict[int, np.ndarray], sent: set[int]) -> None:
        """Every env of ``batch``: a step of an env sent one (with ``actions``), or the fresh
        reset of an env whose process restarted (sent one or not: then it was idle)."""
        self.note_fired()
        ids = batch.env_ids.tolist()
        assert len(set(ids)) == len(ids), f"an env handed out twice in one batch: {ids}"
        obs = batch.observation.reshape(len(ids), AGENTS, -1)
        present = batch.present.reshape(len(ids), AGENTS)
        active = batch.active.reshape(len(ids), AGENTS)
        for row, i in enumerate(ids):
            o, p = obs[row], self.rows[i]
            assert p is not None
            for a in range(AGENTS):
                if present[row, a]:
                    assert (o[a, SLOT], o[a, AGENT]) == (i, a), f"env {i} agent {a}: handed {o[a]}"
            if batch.restarted[row]:
                TALLY["restarted"] += 1
                assert self.restarts, f"env {i}: restarted without restarts"
                assert i in self.raised or self.process(i) in self.faulted, f"env {i} restarted, yet nothing failed"
                assert batch.episode_start[row] and present[row].all() and active[row].all(), f"env {i}: {batch}"
                assert (o[:, T] == 0).all() and (o[:, LAST] == -1).all() and (o[:, NONCE] != p[0, NONCE]).all(), \
                    f"env {i}: restarted, yet {o} is no fresh env"
                self.rebuilding.discard(i)
            else:
                assert i in sent, f"env {i} handed out, yet it was sent nothing and did not restart"
                if self.ended[i]:  # its last agent was done: this step is the next episode's reset, no action read
                    assert batch.episode_start[row] and present[row].all() and active[row].all()
                    assert (o[:, NONCE] == p[0, NONCE]).all() and (o[:, EPISODE] == p[0, EPISODE] + 1).all() and \
                        (o[:, T] == 0).all() and (o[:, LAST] == -1).all(), f"env {i}: the reset after {p} gave {o}"
                else:
                    assert not batch.episode_start[row], f"env {i}: an episode started mid-episode"
                    for a in range(AGENTS):
                        if not self.active[i, a]:
                            assert not present[row, a], f"env {i}: agent {a} is back after it died"
                            continue
                        assert present[row, a], f"env {i}: agent {a} acted, yet its result is missing"
                        self.check_agent_step(i, a, o[a], p[a], actions[i][a])
                        done = o[a, T] >= episode_length(i, int(o[a, EPISODE])) + a
                        assert bool(batch.terminated[row * AGENTS + a]) == done and active[row, a] == (not done), \
                            f"env {i} agent {a}: t {o[a, T]:.0f}, terminated {batch.terminated[row * AGENTS + a]}"
            assert bool(batch.episode_end[row]) == (not active[row].any()), f"env {i}: episode_end is wrong"
            self.rows[i] = np.where(present[row][:, None], o, p)  # an absent agent keeps its last rows
            self.active[i], self.ended[i] = active[row], batch.episode_end[row]

    @staticmethod
    def check_agent_step(i: int, a: int, o: np.ndarray, p: np.ndarray, action: int) -> None:
        """Agent ``a`` of env ``i`` acted: its next step of the same episode, with ``action``."""
        what = f"env {i} agent {a}"
        assert (o[NONCE], o[EPISODE]) == (p[NONCE], p[EPISODE]), \
            f"{what}: one episode's step landed in another env episode: {p} -> {o}"
        assert o[T] == p[T] + 1, f"{what}: a step lost or duplicated: t {p[T]:.0f} -> {o[T]:.0f}"
        assert o[LAST] == action, f"{what}: received {o[LAST]:.0f}, {action} was given"

    def check_reset_batch(self, batch: Any) -> None:
        """A reset of every env: each starts an episode (a new one of the same env, or a fresh env)."""
        self.note_fired()
        assert batch.env_ids.tolist() == list(range(N))
        obs = batch.observation.reshape(N, AGENTS, -1)
        assert batch.present.all() and batch.active.all() and batch.episode_start.all()
        for i in range(N):
            o, p = obs[i], self.rows[i]
            assert (o[:, SLOT] == i).all() and (o[:, AGENT] == np.arange(AGENTS)).all(), f"env {i}: reset gave {o}"
            assert (o[:, T] == 0).all() and (o[:, LAST] == -1).all(), f"env {i}: reset gave {o}"
            if p is not None and o[0, NONCE] == p[0, NONCE]:
                assert o[0, EPISODE] > p[0, EPISODE], f"env {i}: a reset that started no new episode"
            elif p is not None:
                assert self.process(i) in self.faulted or i in self.raised, f"env {i}: a new env, yet no fault"
            self.rows[i] = o.copy()
        self.active[:], self.ended[:] = True, False
        self.sent.clear()

    # -- the operations ------------------------------------------------------------------------

    def actions(self, chosen: tuple[int, ...], ids: list[int]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """The vector's action rows for envs ``ids`` (inactive agents' rows: garbage, never read)."""
        rows = np.array([chosen[(i * AGENTS + a) % len(chosen)] for i in ids for a in range(AGENTS)], np.int64)
        given = {i: rows[n * AGENTS:(n + 1) * AGENTS] for n, i in enumerate(ids)}
        return np.where(self.active[ids].reshape(-1), rows, -7), given

    def reset(self, seed: int) -> None:
        try:
            with within(self.bound(), "reset()"):
                batch = self.v.reset(seed=seed)
        except EnvManagerError as error:
            self.failed(error)
            return
        self.check_reset_batch(batch)
        self.must_reset = False

    def step(self, chosen: tuple[int, ...]) -> None:
        """A lockstep ``step()`` of every env (first the envs sent a step are received)."""
        if self.must_reset:
            return
        if self.sent:
            self.recv(len(self.sent))
            if self.must_reset or self.sent:
                return
        rows, given = self.actions(chosen, list(range(N)))
        try:
            with within(self.bound(), "step()"):
                batch = self.v.step(rows)
        except EnvManagerError as error:
            self.failed(error)
            return
        assert batch.env_ids.tolist() == list(range(N)), batch.env_ids
        self.check_batch(batch, given, set(range(N)))

    def send(self, chosen: tuple[int, ...], which: tuple[bool, ...]) -> None:
        """EnvPool's half: a step of the idle envs picked by ``which``."""
        if self.must_reset:
            return
        ids = [i for i in range(N) if which[i] and i not in self.sent]
        if not ids:
            return
        rows, given = self.actions(chosen, ids)
        try:
            with within(self.bound(), "send()"):
                self.v.send(rows, env_ids=ids)
        except EnvManagerError as error:
            self.failed(error)
            return
        self.sent.update(given)

    def recv(self, wanted: int) -> None:
        """EnvPool's other half: at least ``wanted`` (at most all sent) envs' results."""
        if self.must_reset or not self.sent:
            return
        wanted = max(1, min(wanted, len(self.sent)))
        try:
            with within(self.bound(), "recv()"):
                batch = self.v.recv(wanted)
        except EnvManagerError as error:
            self.failed(error)
            return
        ids = batch.env_ids.tolist()
        assert len(ids) >= wanted or batch.restarted.any(), f"recv({wanted}) returned {ids}"
        given = {i: self.sent[i] for i in ids if i in self.sent}
        self.check_batch(batch, given, set(self.sent))
        for i in ids:
            self.sent.pop(i, None)

    def use_after_give_up(self) -> None:
        """A process given up: a reset and a step raise at once."""
        assert self.given_up is not None
        with within(TIMEOUT + MARGIN, "a call after a process was given up"), \
                pytest.raises((WorkerDiedError, WorkerTimeoutError)) as again:
            self.v.reset()
            self.v.step(np.zeros(N * AGENTS, dtype=np.int64))
        self.check_given_up(again.value)


ACTIONS = st.tuples(*[st.integers(0, 3)] * (N * AGENTS))
PETTINGZOO_OPS = st.one_of(
    st.tuples(st.just("step"), ACTIONS),
    st.tuples(st.just("step"), ACTIONS),
    st.tuples(st.just("send"), ACTIONS, st.tuples(*[st.booleans()] * N)),
    st.tuples(st.just("recv"), st.integers(1, N)),
    st.tuples(st.just("reset"), st.integers(0, 1000)),
    st.tuples(st.just("env_raises"), SLOTS, st.sampled_from(["step_raise", "step_raise", "reset_raise"])),
    st.tuples(st.just("kill_worker"), SLOTS),
    st.tuples(st.just("env_hangs"), SLOTS).filter(lambda op: op[1] == 0),
)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("restarts", [True, False], ids=["restarts", "no-restarts"])
def test_pettingzoo_fault_schedules(k: int, restarts: bool) -> None:
    run(lambda: PettingZooSchedule(k, restarts), PETTINGZOO_OPS)
