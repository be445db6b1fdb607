"""``envs_per_worker="auto"``: how many envs one worker process should host (and in how many lanes), on this machine.

With at least as many envs as cores, env 0's ``unwrapped`` is stepped in a throwaway process and
the step board timed here: even, CPU-bound steps get the layout ``envmanager.core.layout`` predicts
fastest; uneven or waiting steps, or an env that could not be measured, one env per process
(first-ready never waits for a slow neighbour, waits overlap). How it measures and chooses:
docs/guide/step-semantics.md and docs/guide/performance.md.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import cloudpickle
import numpy as np

from envmanager.core.cores import affinity, machine_cores
from envmanager.core.layout import (
    BATCH,
    BOARD_INFOS,
    DEFAULT_COSTS,
    NO_INFOS,
    NOTICE_INFOS,
    Caller,
    Costs,
    Prediction,
    best_layout,
)
from envmanager.core.platforms import mailbox_enabled
from envmanager.core.process import kill_group, start
from envmanager.errors import InvalidInputError
from envmanager.wire import factory as packed_factory
from envmanager.wire.mailbox import ANSWERS, BUSY, INFO_KINDS, INFO_WORDS, REQUESTS, Mailboxes, mailbox_supported
from envmanager.wire.shm import SharedFile
from envmanager.worker.family import family, kill_family

logger = logging.getLogger(__name__)

__all__ = ["AUTO", "StepCost", "board_costs", "choose_double_buffer", "choose_envs_per_worker", "choose_layout",
           "costs_here", "describe", "measure_step_cost", "model_choice", "usable_cores"]

AUTO = "auto"
UNEVEN_RATIO = 3.0  # 90th percentile / median of the CPU times above this: uneven...
UNEVEN_MIN_S = 50e-6  # ...if the slow tenth is also this much slower (below a message's cost it does not matter)
CPU_BOUND = 0.5  # CPU time / wall time not spent waiting for a CPU below this: the step mostly waits
MEASURE_S = 0.1  # seconds of stepping at most
MAX_STEPS = 200
DEADLINE_S = 1.0  # the reset and steps, once the env is built
START_TIMEOUT_S = 60.0  # the process starting and the env built (spawn imports the env's modules)
CLOSE_GRACE_S = 1.0  # the env's close() after answering, before the process is killed
_BUILT = "built"
_PING = b"p"
#: ``board_costs``: the processes it times the board at (one env each), and rounds per size.
BOARD_PROCESSES = (1, 64)
BOARD_ROUNDS = 200


@dataclass(frozen=True)
class StepCost:
    """One env's measured step: wall and CPU seconds (median, 90th percentile), and the CPU
    share of the steps' time not spent waiting for a CPU (at most 1)."""

    median_s: float
    p90_s: float
    cpu_median_s: float
    cpu_p90_s: float
    cpu_share: float
    steps: int
    round_trip_s: float | None = None  # a ping to the measuring process and back (``_round_trip``)
    round_trip_cpu_s: float | None = None  # this process's CPU per ping (a write and a read on a pipe)
    infos: str = NO_INFOS  # what its infos are: none, flat scalars the board holds, or more (notices)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def usable_cores() -> int:
    """CPU cores the workers may run on: this process's (they inherit them), within its control group's quota."""
    mine = affinity()
    cores = len(mine) if mine is not None else os.cpu_count() or 1
    return max(1, min(cores, machine_cores()))


def _infos_kind(info: Any) -> str:
    """What an info is to the step board: nothing, flat scalars its info rows hold, or more (a notice)."""
    if not info:
        return NO_INFOS
    if (len(info) < INFO_WORDS and all(type(k) is str for k in info)
            and all(type(v) in INFO_KINDS for v in info.values())):
        return BOARD_INFOS
    return NOTICE_INFOS


def step_cost(env: Any) -> StepCost | str:
    """Time a few steps of ``env.unwrapped`` with sampled actions: the cost, or why it is not stepped."""
    if getattr(env, "render_mode", None) == "human":
        return "not stepped: render_mode='human' (it would open a window)"
    base = getattr(env, "unwrapped", env)
    base.reset(seed=0)
    space = base.action_space
    space.seed(0)
    times: list[float] = []
    cpus: list[float] = []
    preempted = 0.0  # seconds the steps spent runnable but waiting for a CPU
    waited = _runnable_wait()
    infos = NO_INFOS
    end = time.perf_counter() + MEASURE_S
    while len(times) < MAX_STEPS and time.perf_counter() < end:
        action = space.sample()
        q0 = waited() if waited else 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        _, _, terminated, truncated, info = base.step(action)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        preempted += (waited() - q0) if waited else 0.0
        if infos != NOTICE_INFOS:
            infos = max(infos, _infos_kind(info), key=(NO_INFOS, BOARD_INFOS, NOTICE_INFOS).index)
        if terminated or truncated:
            base.reset()
    # preemption (a busy machine) stretches wall times, not CPU times: judge evenness on CPU
    # time, and the CPU share against the wall time less the time spent waiting for a CPU
    # (Linux's schedstat; elsewhere against the fastest step, which one clean step makes right)
    cpu_median = statistics.median(cpus)
    if waited:
        running = sum(times) - preempted
        share = min(1.0, sum(cpus) / running) if running > 0 else 1.0
    else:
        share = min(1.0, cpu_median / min(times)) if min(times) > 0 else 1.0
    return StepCost(statistics.median(times), _percentile(times, 0.9), cpu_median, _percentile(cpus, 0.9), share, len(times),
                    infos=infos)


def _runnable_wait() -> Callable[[], float] | None:
    """A clock of the seconds this thread waited for a CPU while runnable (Linux's schedstat), or
    ``None``. The file stays open: only the throwaway measuring process measures, its exit closes it."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except (OSError, AttributeError):
        return None

    def waited() -> float:
        return int(os.pread(fd, 128, 0).split()[1]) * 1e-9

    try:
        waited()
    except (OSError, ValueError, IndexError, AttributeError):
        os.close(fd)
        return None
    return waited


def _measuring_process(factory: bytes, conn: Any, parent_pid: int) -> None:
    """The throwaway process: build env 0, answer its cost (or why not), then close it once the
    parent has noted what the env started (our orphans cannot be found once we are gone)."""
    from envmanager.worker.main import own_process_group, watch_parent

    own_process_group()
    threading.Thread(target=watch_parent, args=(parent_pid, os.getppid()), daemon=True).start()
    env = None
    try:
        env = packed_factory.load(factory)(0)
        conn.send(_BUILT)
        answer: StepCost | str = step_cost(env)
    except BaseException as exc:  # the parent falls back to 1
        answer = f"measuring failed: {exc!r}"
    try:
        conn.send(answer)
        while conn.poll(START_TIMEOUT_S):  # pings to echo (the parent times round trips), then its go
            message = conn.recv_bytes()
            if message != _PING:  # the go (or anything else): close the env and exit
                break
            conn.send_bytes(_PING)
        if env is not None:
            env.close()
    except BaseException:
        pass


def measure_step_cost(env_factory: Callable[[int], Any] | bytes, context: Any = None, *, daemon: bool = True,
                      start_timeout: float = START_TIMEOUT_S, deadline_s: float = DEADLINE_S) -> StepCost | str:
    """Build env 0 (``env_factory``: a callable or its cloudpickle) in a throwaway process of
    ``context`` and time a few steps: the cost, or why not. The process and all it started are
    gone on return."""
    from envmanager.core.pool import get_context

    ctx = context if context is not None and not isinstance(context, str) else get_context(context)
    factory = env_factory if isinstance(env_factory, bytes) else cloudpickle.dumps(env_factory)
    reader, writer = ctx.Pipe()
    process = ctx.Process(target=_measuring_process, args=(factory, writer, os.getpid()),
                          name="envmanager-auto", daemon=daemon)
    answered = False
    try:
        try:
            start(process)
        except Exception as exc:  # e.g. a daemonic caller, which may not have children
            return f"the measuring process could not start: {exc!r}"
        finally:
            writer.close()
        if not reader.poll(start_timeout):
            return f"env 0 not built within {start_timeout:g} s"
        first = reader.recv()
        if first != _BUILT:  # building failed: the answer says why
            answered = True
            return first
        if not reader.poll(deadline_s):
            return f"no answer within {deadline_s:g} s"
        answer = reader.recv()
        answered = True
        if isinstance(answer, StepCost):
            trip, cpu = _round_trip(reader, deadline_s)
            answer = replace(answer, round_trip_s=trip, round_trip_cpu_s=cpu)
        return answer
    except (EOFError, OSError):
        return f"the measuring process died (exit code {process.exitcode})"
    finally:
        _reap(process, reader, answered)


def _round_trip(conn: Any, deadline_s: float, pings: int = 12) -> tuple[float | None, float | None]:
    """The median seconds of a ping to the measuring process and back, each side asleep until the
    other writes (a request's round trip where processes share cores), and this process's median
    CPU per ping (a write and a read on a pipe); ``None``s if the process stops answering."""
    times, cpus = [], []
    try:
        for _ in range(pings):
            c0, t0 = time.thread_time(), time.perf_counter()
            conn.send_bytes(_PING)
            if not conn.poll(deadline_s):
                return None, None
            conn.recv_bytes()
            times.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
    except (EOFError, OSError):
        return None, None
    return statistics.median(times), statistics.median(cpus)


def board_costs(processes: tuple[int, int] = BOARD_PROCESSES, rounds: int = BOARD_ROUNDS) -> tuple[float, float] | None:
    """The parent's CPU per step of a whole batch on the step board, fitted as ``parent_s +
    parent_process_s * P`` at two sizes (``processes`` of one env): the board's operations and the
    hot path's numpy work around them, against stand-ins in this process answering at once (not
    timed); the lower quartile of ``rounds`` rounds. ``None`` where no shared file can hold a board."""
    p_lo, p_hi = processes
    t_lo, t_hi = (_board_round(n, rounds) for n in processes)
    if t_lo is None or t_hi is None:
        return None
    slope = max(0.0, (t_hi - t_lo) / (p_hi - p_lo))
    return max(0.0, t_lo - slope * p_lo), slope


def _board_round(n: int, rounds: int) -> float | None:
    """``board_costs`` at ``n`` processes of one env: the lower quartile of ``rounds`` steps."""
    file = SharedFile.create()
    if file is None:
        return None
    box = Mailboxes(file, n)
    mapping = file.map(box.layout.nbytes)  # the stand-ins' side, as a worker maps it
    try:
        words = np.frombuffer(mapping, np.int64)
        words[[box.layout.region(p) // 8 for p in range(n)]] = BUSY  # every stand-in awake: no wake-up owed
        blocks = box.layout.board_lines * 8
        asked = np.frombuffer(mapping, np.int64, blocks, box.layout.block(REQUESTS))
        answered = np.frombuffer(mapping, np.int64, blocks, box.layout.block(ANSWERS))
        slots, owners = np.arange(n), np.arange(n)
        actions, batch = np.zeros(n, np.int64), np.ones(n, np.int64)
        status, observations, out, rewards = np.zeros(n, np.uint8), np.zeros((n, 4)), np.zeros((n, 4)), np.zeros(n)
        spent = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            actions[slots] = batch
            status[slots] = 1
            box.post_steps(box.slot_word[slots], owners, time.monotonic())
            t1 = time.perf_counter()
            answered[:] = asked  # the stand-ins: every step answered, its results in place
            t2 = time.perf_counter()
            got = box.steps_answered()
            if got is None:
                raise RuntimeError("the board lost an answer")
            status[got] = 0
            out[got] = observations[got]
            rewards[got].sum()
            spent.append(t1 - t0 + time.perf_counter() - t2)
        del words, asked, answered  # (views of the mapping: closing it needs them gone)
        return _percentile(spent, 0.25)
    finally:
        try:
            mapping.close()
        except BufferError:  # a view still alive (an error above): the mapping goes with it
            pass
        box.close()


def costs_here(cost: StepCost, board: tuple[float, float] | None = None) -> Costs:
    """The model's costs here: the round trip and a pipe's CPU from ``cost``'s pings, the parent's
    turnaround on the board from ``board`` (timed now if not given); the defaults where one is missing."""
    d = DEFAULT_COSTS
    board = board if board is not None else board_costs()
    parent_s, parent_process_s = board if board is not None else (d.parent_s, d.parent_process_s)
    return replace(d, board=mailbox_supported() and mailbox_enabled(True),  # (ENVMANAGER_MAILBOX=off: pipes)
                   round_trip_s=cost.round_trip_s or d.round_trip_s, pipe_s=cost.round_trip_cpu_s or d.pipe_s,
                   parent_s=parent_s, parent_process_s=parent_process_s)


def model_choice(cost: StepCost, n_env: int, cores: int, caller: Caller = BATCH, lanes: int | None = None,
                 costs: Costs | None = None) -> tuple[Prediction, Costs]:
    """The model's best layout for ``n_env`` envs of ``cost`` on ``cores`` cores, and the costs it used."""
    costs = costs if costs is not None else costs_here(cost)
    best, _ = best_layout(n_env, cost.cpu_median_s, cores, costs, caller, cost.infos, lanes=lanes)
    return best, costs


def describe(costs: Costs) -> str:
    """The costs a choice used (measured, then the model's constants), for its log line."""
    return (f"round trip {costs.round_trip_s * 1e6:.0f} us, the parent's CPU {costs.pipe_s * 1e6:.1f} us per pipe round "
            f"trip and {costs.parent_s * 1e6:.1f} us per step + {costs.parent_process_s * 1e6:.2f} us per process on the "
            f"board{'' if costs.board else ' (no board here: pipes)'}; constants: {costs.notice_s * 1e6:.0f} us per "
            f"notice, the worker {costs.worker_s * 1e6:.0f} us per request + {costs.worker_env_s * 1e6:.1f} us per env")


def _reap(process: Any, conn: Any, answered: bool) -> None:
    """Note what the measuring process started (it waits for our go once it has answered), let
    it close its env for :data:`CLOSE_GRACE_S`, then kill it and all it started."""
    if process.pid is None:  # never started
        conn.close()
        return
    started = family(process.pid)
    try:
        if answered:
            conn.send(None)  # go: close the env and exit
    except OSError:
        pass
    conn.close()
    process.join(CLOSE_GRACE_S if answered else 0.0)
    started.update(family(process.pid))
    if process.is_alive():
        process.kill()
    process.join()
    kill_family(started)
    kill_group(process.pid)
    process.close()


def choose_envs_per_worker(env_factory: Callable[[int], Any] | bytes, n_env: int, cores: int | None = None,
                           context: Any = None, *, daemon: bool = True, start_timeout: float = START_TIMEOUT_S,
                           caller: Caller = BATCH, double_buffer: bool | str = AUTO) -> int:
    """The ``envs_per_worker`` ``choose_layout`` chooses."""
    return choose_layout(env_factory, n_env, cores, context, daemon=daemon, start_timeout=start_timeout, caller=caller,
                         double_buffer=double_buffer)[0]


def choose_layout(env_factory: Callable[[int], Any] | bytes, n_env: int, cores: int | None = None, context: Any = None,
                  *, daemon: bool = True, start_timeout: float = START_TIMEOUT_S, caller: Caller = BATCH,
                  double_buffer: bool | str = AUTO) -> tuple[int, bool]:
    """``(envs_per_worker, double_buffer)`` for ``n_env`` envs on ``cores`` cores: one env per
    process where each can have a core (nothing measured) or the steps are uneven or wait; else the
    layout the model predicts fastest with the costs measured here, for this ``caller`` and
    ``double_buffer`` (``True``/``False`` fix the lanes). The choice is logged in one line."""
    cores = cores or usable_cores()
    # Fewer envs than cores: every env a core, and the parent one too (nothing measured).
    cost = "nothing to pack" if n_env < cores else measure_step_cost(env_factory, context, daemon=daemon,
                                                                     start_timeout=start_timeout)
    why = _one_each(cost)
    if why is not None:
        logger.info("envs_per_worker='auto' chose 1 for %d envs on %d cores: %s", n_env, cores, why)
        return 1, False
    assert isinstance(cost, StepCost)
    lanes = None if double_buffer == AUTO else (2 if double_buffer else 1)
    best, costs = model_choice(cost, n_env, cores, caller, lanes)
    logger.info("envs_per_worker='auto' chose %d for %d envs on %d cores (%s): %s; even CPU-bound steps of %.0f us%s; "
                "costs: %s", best.layout.envs_per_worker, n_env, cores, caller.name, best,
                cost.cpu_median_s * 1e6, {NO_INFOS: "", BOARD_INFOS: " with flat infos (on the board)",
                                          NOTICE_INFOS: " with infos in notices"}[cost.infos], describe(costs))
    return best.layout.envs_per_worker, best.layout.double_buffer


def _one_each(cost: StepCost | str) -> str | None:
    """Why these steps get a process each (they could not be measured, wait, or are uneven), or ``None``."""
    if isinstance(cost, str):
        return cost
    if cost.cpu_share < CPU_BOUND:
        return f"steps mostly wait ({cost.cpu_share:.0%} on the CPU)"
    if cost.cpu_p90_s > UNEVEN_RATIO * cost.cpu_median_s and cost.cpu_p90_s - cost.cpu_median_s > UNEVEN_MIN_S:
        return (f"uneven steps (CPU time p90 {cost.cpu_p90_s * 1e6:.0f} us > {UNEVEN_RATIO:g} x median "
                f"{cost.cpu_median_s * 1e6:.0f} us)")
    return None


def choose_double_buffer(n_procs: int, envs_per_worker: int, cores: int | None = None, asked: bool | str = AUTO) -> bool:
    """Whether to double buffer: ``asked`` (``True`` needs 2+ envs per process), or for ``"auto"``
    two lanes where the parent has a core of its own (more usable cores than worker processes)
    and each process hosts 2+ envs. Where the workers take every core, the parent's second answer
    is CPU taken from the envs (on 2 shared cores: 0.67x on CartPole, 0.92x at 50 us per step)."""
    if asked != AUTO:
        if not isinstance(asked, bool):
            raise InvalidInputError(f"double_buffer must be True, False or 'auto', got {asked!r}")
        return asked and envs_per_worker >= 2
    cores = cores or usable_cores()
    if envs_per_worker < 2:
        choice, why = False, "one env per process: nothing to split"
    elif n_procs >= cores:
        choice, why = False, f"{n_procs} worker processes on {cores} cores: the parent has no core of its own"
    else:
        choice, why = True, f"{n_procs} worker processes on {cores} cores: the parent has a core of its own"
    logger.info("double_buffer='auto' is %s: %s", "on" if choice else "off", why)
    return choice
