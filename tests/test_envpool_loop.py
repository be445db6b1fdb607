"""EnvPool's own loop on the drop-in (issue 40 item 5): ``recv()`` then
``send(actions, infos["env_id"])``, for every ``(n_env, envs_per_worker, batch_size)`` layout,
double buffering on, off or ``"auto"``, each transport; and under faults.

Hypothesis properties, checked from the data alone (``loop_envs``: each env's observation
carries its id, its step in the episode, the last action it received and its episode):

* every ``recv`` returns exactly ``batch_size`` rows; ``infos["env_id"]`` is an int64 array of
  distinct envs, each one sent a step not received yet (as EnvPool's); no env is received
  twice per send and none is lost (at the end, sends equal receives per env, the envs left in
  flight short of a batch stepped exactly once, as their state shows);
* each row (observation, reward, flags, infos) is its env's own result of the action it was
  sent: what the same env, alone in gymnasium's ``SyncVectorEnv`` in this process, returns for
  the same actions, next-step autoreset included;
* under a fault (an env that raises, kills its process or hangs; a process killed by the
  test), the drop-in raises as gymnasium's ``AsyncVectorEnv`` does, the error naming the env
  that failed (or its process's); every call returns or raises within its deadline; what was
  handed out before the error was each env's own, none twice; after the error an env that
  raised is reset and the loop goes on, a process that died or hung raises at once on every
  later use; ``close()`` leaves nothing running or mapped;
* the core with restarts on (``BatchEnvManager(restart_workers=True)``), driven by the same
  loop through kills, hangs and env errors: every slot sent comes back exactly once per send,
  the ones a restart or rebuild answered flagged ``interrupted``, ids unique, nothing lost, every
  other result the env's own; a result nobody asked for only as documented (a process restarted
  while the slot was idle hands out its fresh reset, ``interrupted``). A slot is sent again as
  soon as it is received, its process booting or not (``test_a_request_sent_to_a_booting_process``).

The examples are seeded (``ENVMANAGER_LOOP_SEED``, default 40) and bounded to about a minute on
two cores; ``ENVMANAGER_LOOP_EXAMPLES=10`` runs ten times as many.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import envmanager
from envmanager.core.process import ProcessState
from envmanager.errors import WorkerDiedError, WorkerError, WorkerTimeoutError
from loop_envs import LoopEnv, LoopEnvFn, reference, step_reference
from test_fault_schedules import assert_nothing_left, kill

N_MAX = 12
#: Examples per property; ``ENVMANAGER_LOOP_EXAMPLES`` multiplies them (a long run: 10).
SCALE = float(os.environ.get("ENVMANAGER_LOOP_EXAMPLES", "1"))
#: The examples' seed (fixed: CI runs the same ones); ``ENVMANAGER_LOOP_SEED`` picks others.
SEED = int(os.environ.get("ENVMANAGER_LOOP_SEED", "40"))
EXAMPLES = {name: max(1, round(count * SCALE))
            for name, count in {"plain": 100, "raise": 30, "sigkill": 25, "hang": 6, "kill": 25, "core": 60}.items()}
#: ``ENVMANAGER_MAILBOX`` / ``ENVMANAGER_TRANSPORT`` per transport (read when the pool is built).
TRANSPORTS = {
    "mailbox": {"ENVMANAGER_MAILBOX": "on", "ENVMANAGER_TRANSPORT": "step_queue"},
    "step_queue": {"ENVMANAGER_MAILBOX": "off", "ENVMANAGER_TRANSPORT": "step_queue"},
    "portable": {"ENVMANAGER_MAILBOX": "off", "ENVMANAGER_TRANSPORT": "portable"},
}
#: What the fault runs did (printed with ``-s``): outcomes by error type.
TALLY: collections.Counter[str] = collections.Counter()
#: The bound on any one call without faults: a loaded 2-core machine, never a deadline met.
CALL_BOUND = 60.0


class Hung(AssertionError):
    """A call ran past its bound."""


@contextlib.contextmanager
def bounded(seconds: float, what: str) -> Iterator[None]:
    """``what`` returns or raises within ``seconds``: past them, ``Hung`` is raised inside it
    (SIGALRM; pytest-timeout's own alarm, if set and sooner, is kept and restored)."""
    started = time.monotonic()
    old_handler = signal.getsignal(signal.SIGALRM)
    old_left, _ = signal.getitimer(signal.ITIMER_REAL)
    mine = not old_left or seconds < old_left

    def alarm(signum: int, frame: Any) -> None:
        raise Hung(f"{what} still running after {seconds:.1f} s")

    if mine:
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if mine:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_left:
                signal.setitimer(signal.ITIMER_REAL, max(old_left - (time.monotonic() - started), 1e-3))
    took = time.monotonic() - started
    assert took < seconds, f"{what} took {took:.1f} s, past its bound ({seconds:.1f} s)"


def row_infos(infos: dict[str, Any], k: int) -> dict[str, Any]:
    """Row ``k`` of gymnasium's batched infos (flat keys; ``env_id`` is EnvPool's)."""
    return {key: value[k] for key, value in infos.items()
            if not key.startswith("_") and key != "env_id" and infos[f"_{key}"][k]}


def action_of(env_id: int, k: int, shift: int) -> int:
    """The action env ``env_id`` is sent the ``k``-th time: a fixed sequence per env."""
    return (env_id + 2 * k + shift) % 3


class EnvPoolLoop:
    """The loop's bookkeeping on a vector env: which envs were sent a step not received yet
    (and its action), sends and receives per env, each env's reference; every ``recv`` checked."""

    def __init__(self, v: Any, n: int, batch_size: int, shift: int, seed: int) -> None:
        self.v, self.n, self.batch_size, self.shift, self.seed = v, n, batch_size, shift, seed
        self.outstanding: dict[int, int] = {}  # env -> the action in flight
        self.sends = [0] * n
        self.receives = [0] * n
        self.refs: list[Any] = []
        self.bound = CALL_BOUND

    def reset(self, again: bool = False) -> None:
        """``reset(seed=...)``: each env starts an episode, its reference with it. ``again``: a
        reset after an error (steps in flight were dropped, so the envs went on where their
        references did not): each reference takes on its env's episode and steps so far."""
        with bounded(self.bound, "reset()"):
            obs, _ = self.v.reset(seed=self.seed)
        self.outstanding.clear()
        for ref in self.refs:
            ref.close()
        self.refs = [reference(i, self.seed + i) for i in range(self.n)]
        if again:
            with bounded(self.bound, "get_attr()"):
                total = self.v.get_attr("total_steps")
            for i in range(self.n):
                env = self.refs[i].envs[0].unwrapped
                env.episode, env.total_steps = int(obs[i][3]), total[i]
        for i in range(self.n):
            expected = self.refs[i].envs[0].unwrapped._obs()
            np.testing.assert_array_equal(obs[i], expected, err_msg=f"env {i}: reset")
        self.sends, self.receives = [0] * self.n, [0] * self.n

    def send(self, ids: np.ndarray | None = None) -> None:
        """``send(actions, ids)`` (``None``: every env, as ``send(actions)``)."""
        listed = list(range(self.n)) if ids is None else ids.tolist()
        actions = np.array([action_of(i, self.sends[i], self.shift) for i in listed], dtype=np.int64)
        with bounded(self.bound, "send()"):
            if ids is None:
                self.v.send(actions)
            else:
                self.v.send(actions, ids)
        for i, a in zip(listed, actions.tolist(), strict=True):
            assert i not in self.outstanding, f"env {i} was sent twice without a recv, and send() took it"
            self.outstanding[i] = a
            self.sends[i] += 1

    def recv(self) -> np.ndarray:
        """One ``recv()``, every row checked against its env's reference; returns the ids."""
        with bounded(self.bound, "recv()"):
            obs, rewards, terminations, truncations, infos = self.v.recv()
        ids = infos["env_id"]
        b = self.batch_size
        assert type(ids) is np.ndarray and ids.dtype == np.int64 and ids.shape == (b,), \
            f"infos['env_id'] is {ids!r}, not {b} int64 ids"
        assert obs.shape == (b, 4) and rewards.shape == terminations.shape == truncations.shape == (b,), \
            (obs.shape, rewards.shape, terminations.shape, truncations.shape)
        listed = ids.tolist()
        assert len(set(listed)) == b, f"an env twice in one batch: {listed}"
        for k, i in enumerate(listed):
            assert i in self.outstanding, f"env {i} received without a step in flight (twice for one send?): {listed}"
            action = self.outstanding.pop(i)
            self.receives[i] += 1
            e_obs, e_reward, e_term, e_trunc, e_infos = step_reference(self.refs[i], action)
            where = f"env {i} (row {k} of {listed}), its step {self.sends[i]} (action {action})"
            np.testing.assert_array_equal(obs[k], e_obs, err_msg=f"{where}: observation")
            got = (rewards[k], terminations[k], truncations[k])
            assert got == (e_reward, e_term, e_trunc), f"{where}: reward and flags {got}, expected {(e_reward, e_term, e_trunc)}"
            assert row_infos(infos, k) == row_infos(e_infos, 0), f"{where}: infos {row_infos(infos, k)}"
        return ids

    def drain(self) -> list[int]:
        """Receive while a batch can come; returns the envs left in flight (fewer than a batch)."""
        while len(self.outstanding) >= self.batch_size:
            self.recv()
        return sorted(self.outstanding)

    def check_left(self, raised: int | None = None) -> None:
        """The envs left in flight stepped once more, the others not at all: every env's state
        (``t``, ``episode``, steps over its life) is its reference's once those are stepped too.
        ``raised``: an env left in flight whose step raised (no ``recv`` saw it): that step
        counts in its life, nothing else moved."""
        for i, action in self.outstanding.items():
            if i == raised:
                self.refs[i].envs[0].unwrapped.total_steps += 1
            else:
                step_reference(self.refs[i], action)
        with bounded(self.bound, "get_attr()"):
            state = [self.v.get_attr(name) for name in ("t", "episode", "total_steps")]
        for i in range(self.n):
            ref = self.refs[i].envs[0].unwrapped
            got = tuple(values[i] for values in state)
            assert got == (ref.t, ref.episode, ref.total_steps), f"env {i}: state {got}, expected " \
                f"{(ref.t, ref.episode, ref.total_steps)} (sent {self.sends[i]}, received {self.receives[i]})"
            assert self.sends[i] == self.receives[i] + (i in self.outstanding), (i, self.sends[i], self.receives[i])

    def close(self) -> None:
        for ref in self.refs:
            ref.close()


def worker_pids(v: Any) -> set[int]:
    return {w.pid for w in v._manager.processes if w.pid is not None}


# ---------------------------------------------------------------------------------------------
# 1. No faults


@st.composite
def layouts(draw: st.DrawFn, max_n: int = N_MAX) -> dict[str, Any]:
    n = draw(st.integers(1, max_n))
    transport = draw(st.sampled_from(sorted(TRANSPORTS)))
    return {
        "n": n,
        # packed processes most often: there EnvPool's loop used to fail
        "envs_per_worker": draw(st.one_of(st.just("auto"), st.integers(1, n), st.integers(min(2, n), n))),
        "batch_size": draw(st.integers(1, n)),
        "double_buffer": draw(st.sampled_from([False, True, "auto"])),
        "transport": transport,
        "shared_memory": True if transport == "mailbox" else draw(st.booleans()),
        # per env, its step times (cycled): the order envs finish in varies with them
        "step_times": draw(st.lists(st.lists(st.sampled_from([0.0, 0.0, 0.0005, 0.002]), min_size=1, max_size=3),
                                    min_size=n, max_size=n)),
    }


def make_vector(layout: dict[str, Any], per_env: dict[int, dict[str, Any]], worker_timeout: float) -> Any:
    per_env = {i: {"step_time": layout["step_times"][i], **per_env.get(i, {})} for i in range(layout["n"])}
    v = envmanager.AsyncVectorEnv(
        [LoopEnvFn(per_env, env_id=i) for i in range(layout["n"])], context="fork",
        envs_per_worker=layout["envs_per_worker"], batch_size=layout["batch_size"],
        double_buffer=layout["double_buffer"], shared_memory=layout["shared_memory"], worker_timeout=worker_timeout)
    try:
        check_transport(v._manager, layout["transport"])
    except BaseException:
        v.close()
        raise
    m = v._manager
    event(f"{m.envs_per_worker} envs per process{', double buffered' if m.double_buffer else ''}, "
          f"{'a multiple' if m.envs_per_worker == 1 or layout['batch_size'] % m.envs_per_worker == 0 else 'no multiple'} "
          "of the batch")
    return v


@contextlib.contextmanager
def on_transport(transport: str) -> Iterator[None]:
    """Pools built inside use ``transport`` (its ``TRANSPORTS`` environment, set meanwhile)."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in TRANSPORTS[transport].items():
            env.setenv(name, value)
        yield


def check_transport(m: Any, transport: str) -> None:
    """The transport asked for is the one the pool uses."""
    from envmanager.wire.transport import PortableAnswers

    assert (m.pool.mailboxes is not None) == (transport == "mailbox"), transport
    assert isinstance(m.pool.queue, PortableAnswers) == (transport == "portable"), transport


@hypothesis_seed(SEED)
@settings(max_examples=EXAMPLES["plain"], deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), rounds=st.integers(1, 30), shift=st.integers(0, 2), seed=st.integers(0, 1000))
@example(layout={"n": 12, "envs_per_worker": 5, "batch_size": 7, "double_buffer": True, "transport": "mailbox",
                 "shared_memory": True, "step_times": [[0.0, 0.002]] * 12}, rounds=30, shift=0, seed=0)
@example(layout={"n": 12, "envs_per_worker": 5, "batch_size": 7, "double_buffer": False, "transport": "portable",
                 "shared_memory": False, "step_times": [[0.0005]] * 12}, rounds=30, shift=1, seed=1)
def test_envpool_loop_every_layout(layout: dict[str, Any], rounds: int, shift: int, seed: int) -> None:
    with on_transport(layout["transport"]):
        v = make_vector(layout, {}, worker_timeout=30.0)
    pids = worker_pids(v)
    loop = EnvPoolLoop(v, layout["n"], layout["batch_size"], shift, seed)
    try:
        loop.reset()
        loop.send()
        for _ in range(rounds):
            loop.send(loop.recv())
        loop.drain()
        loop.check_left()
        b = loop.batch_size
        assert sum(loop.receives) == b * (rounds + layout["n"] // b)
    finally:
        loop.close()
        with bounded(CALL_BOUND, "close()"):
            v.close()
    assert_nothing_left(pids)


# ---------------------------------------------------------------------------------------------
# 2. Faults, on the drop-in (no restarts: gymnasium has none)

#: The drop-in's ``worker_timeout`` under faults: a hang costs this much.
FAULT_TIMEOUT = 3.0
#: What a call may take beyond its deadline here: a loaded 2-core machine.
MARGIN = 30.0
FAULT_MAX_N = 6
#: The faults: ``LoopEnv``'s, once (``raise``: the env raises; ``sigkill``: it kills its process;
#: ``hang``: it sleeps past the deadline), or ``kill``: the test SIGKILLs the env's process
#: between a ``recv`` and the next ``send``.
FAULTS = ("raise", "sigkill", "hang", "kill")


#: "At once": a call on a process given up raises without waiting for anything.
AT_ONCE = 5.0


class FaultRun:
    """The loop through one fault: ``kind`` on env ``slot`` (at its ``at``-th step, or the test
    kills its process after ``recv`` number ``at``)."""

    def __init__(self, layout: dict[str, Any], kind: str, slot: int, at: int, shift: int, seed: int) -> None:
        self.layout, self.kind, self.slot, self.at = layout, kind, slot, at
        self.commands = tempfile.mkdtemp(prefix="envpool-loop-")
        self.marker = os.path.join(self.commands, "struck")
        per_env = {} if kind == "kill" else {slot: {"once": kind, "fault_at": at, "marker": self.marker}}
        try:
            with on_transport(layout["transport"]):
                self.v = make_vector(layout, per_env, worker_timeout=FAULT_TIMEOUT)
        except BaseException:
            shutil.rmtree(self.commands, ignore_errors=True)
            raise
        self.pids = worker_pids(self.v)
        self.loop = EnvPoolLoop(self.v, layout["n"], layout["batch_size"], shift, seed)
        self.loop.bound = FAULT_TIMEOUT + MARGIN
        self.killed = False
        m = self.v._manager
        self.process_slots = [s for s in range(layout["n"]) if m.slot_process[s] == m.slot_process[slot]]

    def fired(self) -> bool:
        return self.killed or os.path.exists(self.marker)

    def play(self, rounds: int) -> BaseException | None:
        """The loop, until the end or the first error (returned); our own checks raise."""
        loop = self.loop
        try:
            loop.reset()
            loop.send()
            for r in range(rounds):
                ids = loop.recv()
                if self.kind == "kill" and r == self.at:
                    pid = self.v._manager.process_of(self.slot).pid
                    kill(pid)
                    self.killed = True
                loop.send(ids)
            loop.drain()
            # A step that raised and that no recv waited for is not reported (its result was
            # never asked for): only then may a fault that fired go unreported.
            unreported = self.kind == "raise" and self.fired() and self.slot in loop.outstanding
            loop.check_left(raised=self.slot if unreported else None)
        except AssertionError:
            raise
        except Exception as exc:
            return exc
        assert not self.fired() or unreported, f"{self.kind} on env {self.slot} fired, yet nothing raised"
        return None

    def check_error(self, error: BaseException) -> None:
        """gymnasium's terms: the env's own exception chained to the worker's account naming it;
        a process that died or hung: the package's error naming the env (or its process's)."""
        assert self.fired(), f"{error!r}, yet {self.kind} on env {self.slot} did not fire"
        if self.kind == "raise":
            assert isinstance(error, ValueError) and f"env {self.slot} failed on purpose" in str(error), repr(error)
            cause = error.__cause__
            assert isinstance(cause, WorkerError) and cause.worker_id == self.slot, f"{error!r} from {cause!r}"
        elif self.kind == "sigkill":
            assert isinstance(error, WorkerDiedError) and error.worker_id == self.slot, repr(error)
            assert sorted(error.worker_ids) == self.process_slots, repr(error)
        elif self.kind == "hang":
            assert isinstance(error, WorkerTimeoutError) and error.hung and error.worker_id == self.slot, repr(error)
            assert sorted(error.worker_ids) == self.process_slots, repr(error)
        else:
            assert isinstance(error, WorkerDiedError) and sorted(error.worker_ids) == self.process_slots, repr(error)

    def after_error(self, error: BaseException) -> None:
        """An env that raised: reset, and the loop goes on (its results each env's own again).
        A process that died or hung is given up: a reset raises its error at once."""
        loop = self.loop
        if self.kind == "raise":
            loop.reset(again=True)
            loop.send()
            for _ in range(3):
                loop.send(loop.recv())
            loop.drain()
            loop.check_left()
            return
        for what, call in (("reset()", lambda: self.v.reset(seed=0)), ("get_attr()", lambda: self.v.get_attr("t"))):
            with bounded(AT_ONCE, f"{what} after a process was given up"), \
                    pytest.raises((WorkerDiedError, WorkerTimeoutError)) as again:
                call()
            assert type(again.value) is type(error) and again.value.worker_ids == error.worker_ids, \
                f"{what}: {again.value!r}, the process given up: {error!r}"

    def close(self) -> None:
        try:
            self.pids |= worker_pids(self.v)
        finally:
            self.loop.close()
            with bounded(MARGIN, "close()"):
                self.v.close()
            shutil.rmtree(self.commands, ignore_errors=True)
        assert_nothing_left(self.pids)


@st.composite
def faults(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    layout = draw(layouts(max_n=FAULT_MAX_N))
    n = layout["n"]
    measured = layout["envs_per_worker"] == "auto"
    if measured and n == 1:
        layout["envs_per_worker"] = 1
    # "auto" may step env_fns[0] in a throwaway process first to measure it (documented): a
    # fault of env 0 would happen there, once, and never in the run
    first = 1 if measured and n > 1 else 0
    return {
        "layout": layout,
        "slot": draw(st.integers(first, n - 1)),
        "at": draw(st.integers(1, 4) if kind != "kill" else st.integers(0, 5)),
        "rounds": draw(st.integers(2, 10)),
    }


@pytest.mark.parametrize("kind", FAULTS)
def test_envpool_loop_under_faults(kind: str) -> None:
    @hypothesis_seed(SEED)
    @settings(max_examples=EXAMPLES[kind], deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(fault=faults(kind), shift=st.integers(0, 2), seed=st.integers(0, 1000))
    def prop(fault: dict[str, Any], shift: int, seed: int) -> None:
        run = FaultRun(fault["layout"], kind, fault["slot"], fault["at"], shift, seed)
        try:
            error = run.play(fault["rounds"])
            outcome = "no error" if error is None else type(error).__name__
            event(f"{kind}: {outcome}")
            TALLY[f"{outcome}{'' if run.fired() else ' (did not fire)'}"] += 1
            if error is not None:
                run.check_error(error)
                run.after_error(error)
        finally:
            run.close()

    TALLY.clear()
    prop()
    print(f"{kind}:", dict(sorted(TALLY.items())))


# ---------------------------------------------------------------------------------------------
# 3. Faults on the core with restarts on: the same loop on BatchEnvManager's send_batch /
# receive_batch, through kills, hangs and env errors, every one absorbed by a restart (or an
# env rebuilt in its process)


class CoreRun:
    """``BatchEnvManager(restart_workers=True)`` (no limits) through ``env_faults`` (``(slot,
    kind, at)``: ``LoopEnv``'s, once each) and ``kills`` (``(round, slot)``: the test SIGKILLs
    the slot's process before that round's receive)."""

    def __init__(self, layout: dict[str, Any], env_faults: list[tuple[int, str, int]], kills: list[tuple[int, int]],
                 shift: int, seed: int) -> None:
        from envmanager.core.batch import BatchEnvManager

        self.layout, self.n, self.batch_size = layout, layout["n"], layout["batch_size"]
        self.shift, self.seed, self.kills = shift, seed, kills
        self.commands = tempfile.mkdtemp(prefix="envpool-core-")
        self.markers = {slot: os.path.join(self.commands, f"{slot}.struck") for slot, _, _ in env_faults}
        self.kinds = {slot: kind for slot, kind, _ in env_faults}
        per_env = {i: {"step_time": layout["step_times"][i]} for i in range(self.n)}
        for slot, kind, at in env_faults:
            per_env[slot].update(once=kind, fault_at=at, marker=self.markers[slot])
        self.hangs = sum(kind == "hang" for _, kind, _ in env_faults)
        try:
            with on_transport(layout["transport"]):
                self.m = BatchEnvManager(
                    LoopEnvFn(per_env), self.n, envs_per_worker=layout["envs_per_worker"], context="fork",
                    shared_memory=layout["shared_memory"], double_buffer=layout["double_buffer"], timeout=FAULT_TIMEOUT,
                    restart_workers=True, max_lifetime_restarts=-1, restarts_rate_limit_n=-1)
            check_transport(self.m, layout["transport"])
        except BaseException:
            if hasattr(self, "m"):
                self.m.close()
            shutil.rmtree(self.commands, ignore_errors=True)
            raise
        self.process = self.m.slot_process.tolist()
        self.pids = self.seen_pids()
        self.killed: set[int] = set()  # processes the test killed
        self.outstanding: dict[int, int] = {}
        self.sends, self.receives = [0] * self.n, [0] * self.n
        self.generation = [0] * self.n
        self.refs: list[Any] = []
        self.interrupted = 0
        self.unasked = 0  # interrupted results of slots that were idle when their process restarted
        self.bound = FAULT_TIMEOUT * (1 + self.hangs) + MARGIN

    def seen_pids(self) -> set[int]:
        return {w.pid for w in self.m.processes if w.pid is not None}

    def fired(self, slot: int) -> bool:
        return slot in self.markers and os.path.exists(self.markers[slot])

    def replaced(self, slot: int) -> bool:
        """Whether ``slot``'s env may have been replaced: its process killed, or an env of that
        process killed it or hung (a restart), or its own env raised (a rebuild)."""
        p = self.process[slot]
        if p in self.killed or (self.fired(slot) and self.kinds[slot] == "raise"):
            return True
        return any(self.fired(s) and self.kinds[s] != "raise" for s in self.markers if self.process[s] == p)

    def reset(self) -> None:
        with bounded(self.bound, "send_reset() / receive_reset_batch()"):
            self.m.send_reset({i: (self.seed + i, None) for i in range(self.n)})
            batch = self.m.receive_reset_batch(None)
        assert sorted(batch.slots.tolist()) == list(range(self.n)) and not batch.interrupted, batch
        self.refs = [reference(i, self.seed + i) for i in range(self.n)]
        for i in range(self.n):
            np.testing.assert_array_equal(self.m.results.observation[i], self.refs[i].envs[0].unwrapped._obs(),
                                          err_msg=f"slot {i}: reset")

    def send(self, slots: np.ndarray) -> None:
        listed = slots.tolist()
        actions = np.array([action_of(i, self.sends[i], self.shift) for i in listed], dtype=np.int64)
        with bounded(self.bound, "send_batch()"):
            self.m.send_batch(slots, actions)
        for i, a in zip(listed, actions.tolist(), strict=True):
            assert i not in self.outstanding, f"slot {i} sent twice without a receive, and send_batch took it"
            self.outstanding[i] = a
            self.sends[i] += 1

    def receive(self, min_count: int) -> np.ndarray:
        """One ``receive_batch(min_count)``, every slot checked; returns the slots."""
        with bounded(self.bound, "receive_batch()"):
            batch = self.m.receive_batch(min_count)
        r = self.m.results
        slots = batch.slots.tolist()
        assert batch.slots.dtype == np.int64 and len(slots) >= min_count, batch
        assert len(set(slots)) == len(slots), f"a slot twice in one batch: {slots}"
        assert batch.interrupted <= set(slots), batch
        rows = [(r.observation[i].copy(), float(r.reward[i]), bool(r.terminated[i]), bool(r.truncated[i])) for i in slots]
        generations = [int(batch.generations[i]) for i in slots]
        for i, (obs, reward, terminated, truncated), g in zip(slots, rows, generations, strict=True):
            if i in self.outstanding:
                action: int | None = self.outstanding.pop(i)
                self.receives[i] += 1
            else:  # only a restart of its process while it was idle hands out a result nobody asked for
                assert i in batch.interrupted, f"slot {i} received without a step in flight (twice for one send?): {slots}"
                action = None
                self.unasked += 1
            where = f"slot {i} (of {slots}), its step {self.sends[i]} (action {action}, generation {g})"
            if i in batch.interrupted:  # a restart's or a rebuild's fresh reset answers the step
                self.interrupted += 1
                assert self.replaced(i), f"{where}: interrupted, yet neither its process nor its env failed"
                assert g > self.generation[i], f"{where}: interrupted, yet the generation it had ({self.generation[i]})"
                self.refs[i].close()
                self.refs[i] = reference(i)
                expected: tuple[Any, ...] = (self.refs[i].envs[0].unwrapped._obs(), 0.0, False, False)
            elif g != self.generation[i]:  # replaced while not in flight: a fresh env took the step
                assert self.replaced(i), f"{where}: a new generation, yet neither its process nor its env failed"
                assert action is not None
                self.refs[i].close()
                self.refs[i] = reference(i)
                expected = step_reference(self.refs[i], action)[:4]
            else:
                assert action is not None
                expected = step_reference(self.refs[i], action)[:4]
            self.generation[i] = g
            np.testing.assert_array_equal(obs, expected[0], err_msg=f"{where}: observation")
            assert (reward, terminated, truncated) == expected[1:], \
                f"{where}: reward and flags {(reward, terminated, truncated)}, expected {expected[1:]}"
        self.pids |= self.seen_pids()
        return batch.slots

    def wait_back(self, slots: list[int]) -> None:
        """Until the processes of ``slots`` have nothing in flight (what finishes is kept)."""
        with bounded(self.bound, "wait_idle()"):
            self.m.wait_idle(slots)

    def play(self, rounds: int) -> None:
        """EnvPool's loop: what each receive hands out is sent again at once, whatever its
        process is doing (a restart on its way back answers it with its fresh reset)."""
        self.reset()
        self.send(np.arange(self.n, dtype=np.int64))
        for r in range(rounds):
            for at, slot in self.kills:
                if at == r:
                    self.pids |= self.seen_pids()
                    pid = self.m.process_of(slot).pid
                    assert pid is not None
                    kill(pid)
                    self.killed.add(self.process[slot])
            received = self.receive(min(self.batch_size, len(self.outstanding))).tolist()
            if received:
                self.send(np.array(received, dtype=np.int64))
        while self.outstanding:  # every step sent comes back, once
            self.receive(1)
        self.wait_back(list(range(self.n)))  # restarts still on their way: what they hand out is checked too
        self.receive(0)
        assert self.sends == self.receives
        if self.killed or any(self.fired(s) for s in self.markers):
            assert self.m.restarts >= 1, "a fault fired, yet nothing was restarted or rebuilt"

    def close(self) -> None:
        try:
            self.pids |= self.seen_pids()
        finally:
            for ref in self.refs:
                ref.close()
            with bounded(MARGIN, "close()"):
                self.m.close()
            shutil.rmtree(self.commands, ignore_errors=True)
        assert_nothing_left(self.pids)


@st.composite
def core_schedules(draw: st.DrawFn) -> dict[str, Any]:
    layout = draw(layouts(max_n=FAULT_MAX_N))
    n = layout["n"]
    if layout["envs_per_worker"] == "auto":  # (the core's "auto" measures env 0 in a throwaway process)
        layout["envs_per_worker"] = draw(st.integers(1, n))
    rounds = draw(st.integers(2, 12))
    slot = st.integers(0, n - 1)
    env_faults = draw(st.lists(st.tuples(slot, st.sampled_from(["raise", "raise", "sigkill", "sigkill", "hang"]),
                                         st.integers(1, 5)), max_size=3, unique_by=lambda f: f[0]))
    hangs = [f for f in env_faults if f[1] == "hang"]
    env_faults = [f for f in env_faults if f[1] != "hang"] + hangs[:1]  # a hang costs the deadline: one at most
    kills = draw(st.lists(st.tuples(st.integers(0, rounds - 1), slot), max_size=3))
    return {"layout": layout, "rounds": rounds, "env_faults": env_faults, "kills": kills}


@hypothesis_seed(SEED)
@settings(max_examples=EXAMPLES["core"], deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=core_schedules(), shift=st.integers(0, 2), seed=st.integers(0, 1000))
def test_envpool_loop_on_the_core_with_restarts(schedule: dict[str, Any], shift: int, seed: int) -> None:
    run = CoreRun(schedule["layout"], schedule["env_faults"], schedule["kills"], shift, seed)
    try:
        run.play(schedule["rounds"])
        event(f"restarts: {min(run.m.restarts, 3)}{'+' if run.m.restarts > 3 else ''}, interrupted: {min(run.interrupted, 1)}")
    finally:
        run.close()


# ---------------------------------------------------------------------------------------------
# A step or reset sent to a process that is booting (restarted, its boot plan not done)


@pytest.mark.parametrize("ask", ["step", "seeded reset"])
@pytest.mark.parametrize("transport, shared_memory", [("mailbox", True), ("step_queue", True), ("step_queue", False)],
                         ids=["mailbox", "step-queue", "pickled"])
def test_a_request_sent_to_a_booting_process(transport: str, shared_memory: bool, ask: str) -> None:
    """EnvPool's loop on the core with restarts on: slot 0 (process 0, with slot 1) was received;
    slot 1's env kills the process; the restart starts in the receive that hands out slot 2
    (process 1); slot 0, idle, is sent again at once, as the loop does (or reset with a seed).
    One fault is one restart; the restart's fresh reset answers slot 0 once, ``interrupted``
    (a reset: with the seed it asked for), and slot 1 once. (Before the fix the worker took the
    step ahead of its boot plan: a second restart, a lost step, or the un-reset env's step handed
    out as the fresh reset.)"""
    from envmanager.core.batch import BatchEnvManager

    commands = tempfile.mkdtemp(prefix="envpool-boot-")
    per_env = {1: {"once": "sigkill", "fault_at": 1, "marker": os.path.join(commands, "struck")}}
    with on_transport(transport):
        m = BatchEnvManager(LoopEnvFn(per_env), 3, envs_per_worker=2, context="fork", timeout=FAULT_TIMEOUT,
                            shared_memory=shared_memory, restart_workers=True, max_lifetime_restarts=-1,
                            restarts_rate_limit_n=-1)
    pids = {w.pid for w in m.processes if w.pid is not None}
    one = np.ones(1, dtype=np.int64)
    try:
        m.send_reset({i: (i, None) for i in range(3)})
        m.receive_reset_batch(None)
        m.send_batch([0], one)
        assert m.receive_batch(1).slots.tolist() == [0]
        m.send_batch([1], one)  # env 1 kills process 0 (slots 0 and 1)
        m.send_batch([2], one)
        time.sleep(0.5)  # both are in: slot 2's answer, process 0's death
        with bounded(MARGIN, "receive_batch()"):
            batch = m.receive_batch(1)
        if batch.slots.tolist() != [2] or m.process_of(0).state is not ProcessState.BOOTING:
            pytest.skip(f"the premise did not hold: {batch}, process 0 {m.process_of(0).state}")  # (a slow machine)
        pids |= {w.pid for w in m.processes if w.pid is not None}
        fresh = [0.0, 0.0, -1.0, 1.0]
        if ask == "step":
            m.send_batch([0], one)  # idle: the loop sends it again at once
        else:
            m.send_reset({0: (1234, None)})
            with bounded(MARGIN, "receive_reset_batch([0])"):
                reset = m.receive_reset_batch([0])
            assert reset.slots.tolist() == [0] and reset.infos[0]["seed"] == 1234, reset
            assert m.results.observation[0].tolist() == fresh
        results: dict[int, list[tuple[list[float], bool]]] = {0: [], 1: []}
        with bounded(MARGIN, "receive_batch() until slot 1 is back and nothing is in flight"):
            while not results[1] or m.in_flight() or m.unreceived():
                got = m.receive_batch(0 if not m.in_flight() else 1)
                for s in got.slots.tolist():
                    results[s].append((m.results.observation[s].tolist(), s in got.interrupted))
        pids |= {w.pid for w in m.processes if w.pid is not None}
        assert m.restarts == 1, f"one fault, {m.restarts} restarts"
        assert results[1] == [([0.0, 1.0, -1.0, 1.0], True)], results  # (env 1's fresh reset)
        assert results[0] == ([(fresh, True)] if ask == "step" else []), results
        assert m.idle_worker_ids == [0, 1, 2]
    finally:
        m.close()
        shutil.rmtree(commands, ignore_errors=True)
    assert_nothing_left(pids)


class GatedEnv(LoopEnv):
    """``LoopEnv`` whose steps and resets wait for the file ``open<env_id>`` in ``gates`` once
    ``slow<env_id>`` is there: the test holds an env (or a restarted process's fresh one) in
    its call as long as it wants."""

    def __init__(self, env_id: int, gates: str) -> None:
        super().__init__(env_id)
        self.gates = gates

    def _wait_if_slow(self) -> None:
        if os.path.exists(f"{self.gates}/slow{self.env_id}"):
            wait_for_file(f"{self.gates}/open{self.env_id}")

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        self._wait_if_slow()
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> Any:
        self._wait_if_slow()
        return super().step(action)


def wait_for_file(path: str, seconds: float = 60.0) -> None:
    """Until ``path`` exists (at most ``seconds``)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.002)


class GatedEnvFn:
    def __init__(self, gates: str) -> None:
        self.gates = gates

    def __call__(self, worker_id: int) -> GatedEnv:
        return GatedEnv(worker_id, self.gates)


@pytest.mark.parametrize("ask", ["step", "seeded reset"])
@pytest.mark.parametrize("transport", ["mailbox", "step_queue", "portable"])
def test_answers_not_handed_out_when_their_process_restarts_come_back_as_its_fresh_reset(transport: str, ask: str,
                                                                                          tmp_path: Any) -> None:
    """Process 0 (slots 0 and 1) answered a step (or a seeded reset), not handed out yet, when
    the test kills it: its restart's fresh env resets env 0 into row 0 at once, env 1 only once
    slot 2 (process 1, held meanwhile) answered. A batch of the three hands out slots 0 and 1
    once each, ``interrupted``, with the fresh reset (a reset: with the seed it asked for), and
    slot 2 with its own answer. (Before the fix it handed them out as their own answers: slot
    0's row already held the fresh reset, and neither was ``interrupted``.) Handed out before
    the fresh reset was sent, they are their own answers
    (``test_an_answer_taken_before_a_restart_carries_the_generation_that_answered``)."""
    from envmanager.core.batch import BatchEnvManager

    gates = str(tmp_path)
    with on_transport(transport):
        m = BatchEnvManager(GatedEnvFn(gates), 3, envs_per_worker=2, context="fork", timeout=MARGIN,
                            double_buffer=False, restart_workers=True, max_lifetime_restarts=-1,
                            restarts_rate_limit_n=-1)
    check_transport(m, transport)
    pids = {w.pid for w in m.processes if w.pid is not None}
    fresh = {0: [0.0, 0.0, -1.0, 1.0], 1: [0.0, 1.0, -1.0, 1.0]}
    opened: list[int] = []

    def open_gates() -> None:
        """Slot 2's call once the fresh env 0 is in row 0; the fresh env 1's reset once slot 2 is in."""
        deadline = time.monotonic() + MARGIN
        while m.results.observation[0].tolist() != fresh[0] and time.monotonic() < deadline:
            time.sleep(0.002)
        open(f"{gates}/open2", "w").close()
        opened.append(2)
        while 2 in m.waiting_worker_ids and time.monotonic() < deadline:
            time.sleep(0.002)
        open(f"{gates}/open1", "w").close()
        opened.append(1)

    try:
        m.send_reset({i: (i, None) for i in range(3)})
        m.receive_reset_batch(None)
        open(f"{gates}/slow2", "w").close()
        if ask == "step":
            m.send_batch([0, 1, 2], np.ones(3, dtype=np.int64))
            theirs = {0: [1.0, 0.0, 1.0, 1.0], 2: [1.0, 2.0, 1.0, 1.0]}
        else:
            m.send_reset({0: (1234, None), 1: (99, None), 2: (7, None)})
            theirs = {0: [0.0, 0.0, -1.0, 2.0], 2: [0.0, 2.0, -1.0, 2.0]}
        with bounded(MARGIN, "wait_idle([0, 1])"):
            m.wait_idle([0, 1])  # process 0's answer is in, not handed out
        assert m.results.observation[0].tolist() == theirs[0]
        open(f"{gates}/slow1", "w").close()
        kill(m.process_of(0).pid)  # type: ignore[arg-type]
        gate_opener = threading.Thread(target=open_gates, daemon=True)
        gate_opener.start()
        results: dict[int, list[tuple[list[float], bool, int, Any]]] = {0: [], 1: [], 2: []}
        with bounded(MARGIN, "receiving until every slot is back"):
            wanted = 3  # a batch of every slot asked (EnvPool's loop, reset_wait)
            while m.in_flight() or m.unreceived() or m.resets_in_flight or not all(results.values()):
                if ask == "step":
                    got = m.receive_batch(wanted if m.in_flight() else 0)
                else:
                    got = m.receive_reset_batch(None)
                wanted = 1
                for s in got.slots.tolist():
                    results[s].append((m.results.observation[s].tolist(), s in got.interrupted,
                                       int(got.generations[s]), got.infos.get(s, {}).get("seed")))
        gate_opener.join(MARGIN)
        pids |= {w.pid for w in m.processes if w.pid is not None}
        assert opened == [2, 1], opened  # (the premise: the fresh env 0 wrote row 0 first)
        assert m.restarts == 1
        seeds = {0: 1234, 1: 99, 2: 7} if ask != "step" else dict.fromkeys(range(3))
        if ask != "step":  # the seeds came after the fresh reset was sent: a second one, with them
            fresh = {s: [*row[:3], 2.0] for s, row in fresh.items()}
        assert results == {0: [(fresh[0], True, 1, seeds[0])], 1: [(fresh[1], True, 1, seeds[1])],
                           2: [(theirs[2], False, 0, seeds[2])]}
        assert m.idle_worker_ids == [0, 1, 2]
    finally:
        m.close()
    assert_nothing_left(pids)


def test_a_voided_answer_is_cut_short_with_its_process_when_the_restart_is_given_up(tmp_path: Any) -> None:
    """Double buffered: process 0's lane 1 (slot 0) answered, its lane 2 (slot 1) is held in
    its step, when the test kills it. The restart's fresh reset voids slot 0's answer; the test
    kills the fresh process too, and the one restart allowed is spent: the process is given up.
    Both slots fail with its error, raised once, and count as idle; slot 2 (process 1) comes back
    with its step. (Voided but not cut short, slot 0 stayed in flight for good.)"""
    from envmanager.core.batch import BatchEnvManager
    from envmanager.errors import RestartLimitError

    gates = str(tmp_path)
    m = BatchEnvManager(GatedEnvFn(gates), 3, envs_per_worker=2, context="fork", timeout=MARGIN, double_buffer=True,
                        restart_workers=True, max_lifetime_restarts=1, restarts_rate_limit_n=-1)
    assert list(m.slot_lanes)[:2] == [1, 2]
    pids = {w.pid for w in m.processes if w.pid is not None}
    first = m.process_of(0).pid
    killed: list[int] = []

    def kill_the_fresh_process() -> None:
        """Once the fresh env 0's reset is in row 0: kill its process, then let slot 2 answer."""
        deadline = time.monotonic() + MARGIN
        while m.results.observation[0].tolist() != [0.0, 0.0, -1.0, 1.0] and time.monotonic() < deadline:
            time.sleep(0.002)
        fresh = m.process_of(0).pid
        assert fresh is not None and fresh != first
        killed.append(fresh)
        kill(fresh)
        open(f"{gates}/open2", "w").close()

    try:
        m.send_reset({i: (i, None) for i in range(3)})
        m.receive_reset_batch(None)
        for i in (1, 2):
            open(f"{gates}/slow{i}", "w").close()
        m.send_batch([0, 1, 2], np.ones(3, dtype=np.int64))
        with bounded(MARGIN, "until slot 0's answer is taken"):
            while not m.unreceived():  # (waits on process 1, held: slot 0's answer is taken meanwhile, kept)
                with contextlib.suppress(WorkerTimeoutError):
                    m.wait_idle([2], timeout=0.05)
        assert m.status.tolist() == [3, 2, 2]  # ARRIVED, IN_FLIGHT, IN_FLIGHT
        kill(first)  # type: ignore[arg-type]
        killer = threading.Thread(target=kill_the_fresh_process, daemon=True)
        killer.start()
        with bounded(MARGIN, "receive_batch(3)"), pytest.raises(RestartLimitError) as raised:
            m.receive_batch(3)
        killer.join(MARGIN)
        pids |= set(killed)
        assert raised.value.worker_id in (0, 1) and raised.value.process == 0
        handed: list[int] = []
        with bounded(MARGIN, "receive_batch() until nothing is in flight"):
            while m.in_flight() or m.unreceived():
                handed += m.receive_batch(1 if m.in_flight() else 0).slots.tolist()
        assert handed == [2] and m.results.observation[2].tolist() == [1.0, 2.0, 1.0, 1.0]
        assert m.failure_of(0) is raised.value and m.failure_of(1) is raised.value
        assert m.idle_worker_ids == [0, 1, 2] and m.restarts == 1
    finally:
        m.close()
    assert_nothing_left(pids)


@pytest.mark.parametrize("sent", [False, True], ids=["reset-not-sent", "reset-sent"])
def test_a_seeded_reset_joins_the_boot_reset(sent: bool) -> None:
    """The seeds and options of a reset asked during a boot go into the boot's reset; if it was
    sent already, a second reset of every env follows it (the last answer ends the boot); the
    boot's plan from the start (should the process fail again) carries them too."""
    from types import SimpleNamespace

    from envmanager.core.pool import WorkerPool
    from envmanager.core.process import Boot
    from envmanager.wire.messages import EnvironmentCommand as Cmd
    from envmanager.wire.messages import Reset

    boot = Boot([(Cmd.ATTACH, None), (Cmd.RESET, Reset((0, 1, 2), (7, None, None), (None, None, None)))], [], False)
    if sent:
        boot.plan.clear()
    pool = WorkerPool.__new__(WorkerPool)
    pool.processes = [SimpleNamespace(boot=boot)]  # type: ignore[list-item]
    pool.join_boot(0, Cmd.RESET, (11,), Reset((1,), (1234,), ({"a": 1},)))
    pool.join_boot(0, Cmd.STEP, (12,))
    merged = (Cmd.RESET, Reset((0, 1, 2), (7, 1234, None), (None, {"a": 1}, None)))
    assert boot.plan == ([merged] if sent else [(Cmd.ATTACH, None), merged])
    assert boot.all_steps == [(Cmd.ATTACH, None), merged]
    assert [(r.cmd, r.slots) for r in boot.lost] == [(Cmd.RESET, (11,)), (Cmd.STEP, (12,))]
