"""``envs_per_worker="auto"``: how many envs one worker process should host (and in how many lanes), on this machine.

One env is built and stepped in a **throwaway process** before any worker starts (same start
method, killed with everything it started once it has answered): a few steps with sampled
actions, for at most :data:`MEASURE_S` of stepping and :data:`DEADLINE_S` for the reset and
steps; starting the process and building the env have the workers' start-up deadline
(``timeout``), since spawn imports the env's modules there. Nothing of it touches the user's
env 0 or this process: the measured env is ``env.unwrapped``, reset and stepped directly, so
wrappers that record (SB3's ``Monitor``, gymnasium's ``RecordVideo``, episode statistics) see
no step; an env with ``render_mode="human"`` is not stepped at all (it would open a window;
such steps wait on the display, and get a process each). The measuring process also answers a
few pings, whose round trip (both sides asleep until the other writes) is what a request costs
where processes share cores, and times a reference loop (``layout.speed``). The rule:

* even, CPU-bound steps (the slowest tenth of the steps' CPU times within :data:`UNEVEN_RATIO`
  x their median or within :data:`UNEVEN_MIN_S` of it -- a spread smaller than one message's
  cost does not hold first-ready back, and cheap steps resumed after preemption on a cold
  cache vary by more than 3x --, and the CPU time at least :data:`CPU_BOUND` of the step's wall time),
  cheap or expensive: the layout the model of ``envmanager.core.layout`` predicts fastest --
  processes x envs per process, and one lane or two -- for this step, round trip, Python
  speed, number of cores and caller (``choose_layout``). On 2 cores cheap envs get one process
  and the parent the other core (they spin, the mailbox carries requests and answers; double
  buffered), costly ones a process per core or more;
* anything else -- uneven or waiting steps (sleep, I/O, a simulator in another process), an
  env that did not finish the measurement within the deadline, or one that failed: one env
  per process, so first-ready stepping never waits for a slow neighbour and waits overlap.

When every env can have a core and the parent one too (fewer envs than cores) nothing is
measured: one env per process.

Both tests hold on a busy machine: evenness is judged on CPU time, which preemption does not
stretch, and the CPU share against the wall time less the time spent runnable but waiting for
a CPU (Linux's schedstat; elsewhere against the fastest step's wall time), not the raw wall time.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import cloudpickle

from envmanager.core.layout import BATCH, REFERENCE, Caller, best_layout, speed
from envmanager.core.process import descendants, kill_all, start
from envmanager.errors import InvalidInputError

logger = logging.getLogger(__name__)

__all__ = ["AUTO", "StepCost", "choose_double_buffer", "choose_envs_per_worker", "choose_layout", "measure_step_cost",
           "usable_cores"]

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
#: A request's round trip where processes share cores, as a multiple of an idle ping's (measured
#: on the reference machine: 150-250 us against 55-85 us pings; the other processes wait for a core).
LOADED_ROUND_TRIP = 3.0
_PING = b"p"


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
    speed: float = 1.0  # how many times slower than the reference machine Python ran there (``layout.speed``)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def step_cost(env: Any) -> StepCost | str:
    """Time a few steps of ``env.unwrapped`` with sampled actions (its wrappers see nothing);
    the cost, or why the env is not stepped."""
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
    end = time.perf_counter() + MEASURE_S
    while len(times) < MAX_STEPS and time.perf_counter() < end:
        action = space.sample()
        q0 = waited() if waited else 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        _, _, terminated, truncated, _ = base.step(action)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        preempted += (waited() - q0) if waited else 0.0
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
                    speed=speed())


def _runnable_wait() -> Callable[[], float] | None:
    """A clock of the seconds this thread has waited for a CPU while runnable (Linux's
    ``/proc/thread-self/schedstat``, read in ~2 µs), or ``None`` where there is none. The file
    stays open: only the throwaway measuring process measures, and its exit closes it."""
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
    """The throwaway process: build env 0, answer its cost (or why not), then -- once the parent
    has noted what the env started (our orphans cannot be found once we are gone) -- close it."""
    from envmanager.worker.main import watch_parent

    try:  # own process group: Ctrl-C goes to the parent, and killing the group reaches what the env started
        os.setpgid(0, 0)
    except (OSError, AttributeError):
        pass
    threading.Thread(target=watch_parent, args=(parent_pid, os.getppid()), daemon=True).start()
    env = None
    try:
        env = cloudpickle.loads(factory)(0)
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
    """Build env 0 (``env_factory(0)``, a callable or its cloudpickle) in a throwaway process of
    ``context`` (a multiprocessing context, by default the platform's) and time a few steps;
    the cost, or why it could not be measured. The process and all it started are gone on return."""
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
            answer = replace(answer, round_trip_s=_round_trip(reader, deadline_s))
        return answer
    except (EOFError, OSError):
        return f"the measuring process died (exit code {process.exitcode})"
    finally:
        _reap(process, reader, answered)


def _round_trip(conn: Any, deadline_s: float, pings: int = 12) -> float | None:
    """The median seconds of a ping to the measuring process and back, each side asleep until the
    other writes: what a request round trip costs where processes share cores (``None`` if the
    process stops answering)."""
    times = []
    try:
        for _ in range(pings):
            start = time.perf_counter()
            conn.send_bytes(_PING)
            if not conn.poll(deadline_s):
                return None
            conn.recv_bytes()
            times.append(time.perf_counter() - start)
    except (EOFError, OSError):
        return None
    return statistics.median(times)


def _reap(process: Any, conn: Any, answered: bool) -> None:
    """Note what the measuring process started (it waits for our go once it has answered), let
    it close its env for :data:`CLOSE_GRACE_S`, then kill it and all it started."""
    if process.pid is None:  # never started
        conn.close()
        return
    family = descendants(process.pid)
    try:
        if answered:
            conn.send(None)  # go: close the env and exit
    except OSError:
        pass
    conn.close()
    process.join(CLOSE_GRACE_S if answered else 0.0)
    family += descendants(process.pid)
    if process.is_alive():
        process.kill()
    process.join()
    kill_all(family)
    if hasattr(os, "killpg"):
        try:
            os.killpg(process.pid, signal.SIGKILL)  # anything left in its process group
        except (ProcessLookupError, PermissionError):
            pass
    process.close()


def choose_envs_per_worker(env_factory: Callable[[int], Any] | bytes, n_env: int, cores: int | None = None,
                           context: Any = None, *, daemon: bool = True, start_timeout: float = START_TIMEOUT_S,
                           caller: Caller = BATCH, double_buffer: bool | str = AUTO) -> int:
    """The ``envs_per_worker`` for ``n_env`` envs of ``env_factory`` on ``cores`` cores (see
    ``choose_layout``)."""
    return choose_layout(env_factory, n_env, cores, context, daemon=daemon, start_timeout=start_timeout, caller=caller,
                         double_buffer=double_buffer)[0]


def choose_layout(env_factory: Callable[[int], Any] | bytes, n_env: int, cores: int | None = None, context: Any = None,
                  *, daemon: bool = True, start_timeout: float = START_TIMEOUT_S, caller: Caller = BATCH,
                  double_buffer: bool | str = AUTO) -> tuple[int, bool]:
    """``(envs_per_worker, double_buffer)`` for ``n_env`` envs on ``cores`` cores: one env per
    process where each can have a core (nothing measured), or where the steps are uneven or wait
    (first-ready then never waits for a slow neighbour, and waits overlap); otherwise the layout
    the model of ``envmanager.core.layout`` predicts fastest for the measured step and round
    trip, this ``caller`` (what it costs the parent per env-step, whether it steps in lockstep)
    and ``double_buffer`` (``True``/``False`` fix the lanes). The choice and its prediction are
    logged."""
    cores = cores or usable_cores()
    if n_env < cores:  # every env a core, and the parent one too
        logger.info("envs_per_worker='auto' chose 1 for %d envs on %d cores: nothing to pack", n_env, cores)
        return 1, False
    cost = measure_step_cost(env_factory, context, daemon=daemon, start_timeout=start_timeout)
    why = _one_each(cost)
    if why is not None:
        logger.info("envs_per_worker='auto' chose 1 for %d envs on %d cores: %s", n_env, cores, why)
        return 1, False
    assert isinstance(cost, StepCost)
    costs = REFERENCE.scaled(cost.speed)  # Python's speed measured beside the step (this machine's speed varies)
    if cost.round_trip_s:  # a ping between two idle processes: a loaded round trip takes about twice that
        costs = replace(costs, round_trip_s=LOADED_ROUND_TRIP * cost.round_trip_s)
    costs = replace(costs, parent_env_s=costs.parent_env_s * caller.parent_env_s / BATCH.parent_env_s)
    lanes = None if double_buffer == AUTO else (2 if double_buffer else 1)
    best, _ = best_layout(n_env, cost.cpu_median_s, cores, costs, lockstep=caller.lockstep, lanes=lanes)
    logger.info("envs_per_worker='auto' chose %d for %d envs on %d cores (%s): %s; even CPU-bound steps of %.0f us, "
                "round trip %s", best.layout.envs_per_worker, n_env, cores, caller.name, best, cost.cpu_median_s * 1e6,
                "unmeasured" if cost.round_trip_s is None else f"{cost.round_trip_s * 1e6:.0f} us")
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
    two lanes per process when the parent has a core of its own --
    more usable cores (this process's CPU affinity) than worker processes -- and each process
    hosts at least two envs. Where the workers take every core, the parent's second answer per
    process is CPU taken from the envs: measured on 2 shared cores, double buffering lost
    (0.67x on CartPole, 0.92x at 50 us per step), so it stays off there."""
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
