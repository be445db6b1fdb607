"""``envs_per_worker="auto"``: how many envs one worker process should host, on this machine.

One env is built and stepped in the parent, in a background thread, before any worker starts:
a few steps with sampled actions, for at most :data:`MEASURE_S` of stepping and
:data:`DEADLINE_S` in all (construction included). The rule:

* even, CPU-bound steps (the slowest tenth of the steps' CPU times within :data:`UNEVEN_RATIO`
  x their median or within :data:`UNEVEN_MIN_S` of it -- a spread smaller than one message's
  cost does not hold first-ready back, and cheap steps resumed after preemption on a cold
  cache vary by more than 3x --, and the CPU time at least :data:`CPU_BOUND` of the step's wall time),
  cheap or expensive: pack the envs into one process per core, ``max(1, n_env // cores)``
  envs each -- one message then carries several steps, the per-message cost (a pipe round
  trip, ~60 µs) is shared, and no more processes compete for the cores than there are cores
  (``envmanager bench --scenario sweep``: packing is ahead from 5 µs to 5 ms per step);
* anything else -- uneven or waiting steps (sleep, I/O, a simulator in another process), or an
  env that did not finish the measurement within the deadline: one env per process, so
  first-ready stepping never waits for a slow neighbour and waits overlap.

Both tests hold on a busy machine: evenness is judged on CPU time, which preemption does not
stretch, and the CPU share against the fastest tenth of the wall times (the steps that ran
without being preempted), not their median.

Measuring in the parent rather than in a worker keeps the worker protocol unchanged and costs
no extra process start (gymnasium's ``AsyncVectorEnv`` builds a dummy env in the parent too).
The thread is abandoned (daemon) if the env hangs, and the choice then falls back to 1; such an
env is still stepping in the parent when the workers start (with ``fork``, a lock it holds is
copied held), which is why the deadline is short and the fallback logged.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["AUTO", "StepCost", "choose_envs_per_worker", "measure_step_cost", "usable_cores"]

AUTO = "auto"
UNEVEN_RATIO = 3.0  # 90th percentile / median of the CPU times above this: uneven...
UNEVEN_MIN_S = 50e-6  # ...if the slow tenth is also this much slower (below a message's cost it does not matter)
CPU_BOUND = 0.5  # median CPU time / fastest wall times below this: the step mostly waits
MEASURE_S = 0.1  # seconds of stepping at most
MAX_STEPS = 200
DEADLINE_S = 0.5  # the whole measurement, env construction included


@dataclass(frozen=True)
class StepCost:
    """One env's measured step: wall and CPU seconds (median, 90th percentile), and the CPU
    share of a step that was not preempted (median CPU / 10th-percentile wall, at most 1)."""

    median_s: float
    p90_s: float
    cpu_median_s: float
    cpu_p90_s: float
    cpu_share: float
    steps: int


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _measure(env_factory: Callable[[int], Any], out: list) -> None:
    try:
        env = env_factory(0)
        try:
            env.reset(seed=0)
            space = env.action_space
            space.seed(0)
            times: list[float] = []
            cpus: list[float] = []
            end = time.perf_counter() + MEASURE_S
            while len(times) < MAX_STEPS and time.perf_counter() < end:
                action = space.sample()
                c0, t0 = time.thread_time(), time.perf_counter()
                _, _, terminated, truncated, _ = env.step(action)
                dt = time.perf_counter() - t0
                cpus.append(time.thread_time() - c0)
                times.append(dt)
                if terminated or truncated:
                    env.reset()
        finally:
            env.close()
        # preemption (a busy machine) stretches wall times, not CPU times: judge evenness on CPU
        # time, and the CPU share against the fastest wall times
        cpu_median, fastest = statistics.median(cpus), _percentile(times, 0.1)
        share = min(1.0, cpu_median / fastest) if fastest > 0 else 1.0
        out.append(StepCost(statistics.median(times), _percentile(times, 0.9), cpu_median,
                            _percentile(cpus, 0.9), share, len(times)))
    except BaseException as exc:  # reported by the caller, which falls back to 1
        out.append(exc)


def measure_step_cost(env_factory: Callable[[int], Any], deadline_s: float = DEADLINE_S) -> StepCost | str:
    """Build env 0 and time a few steps in a thread; the cost, or why it could not be measured."""
    out: list = []
    thread = threading.Thread(target=_measure, args=(env_factory, out), name="envmanager-auto", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive() or not out:
        return f"no answer within {deadline_s:g} s"
    if isinstance(out[0], BaseException):
        return f"measuring failed: {out[0]!r}"
    return out[0]


def choose_envs_per_worker(env_factory: Callable[[int], Any], n_env: int, cores: int | None = None) -> int:
    """The ``envs_per_worker`` for ``n_env`` envs of ``env_factory`` on ``cores`` cores (see the module doc)."""
    cores = cores or usable_cores()
    cost = measure_step_cost(env_factory)
    packed = max(1, n_env // cores)
    if isinstance(cost, str):
        choice, why = 1, cost
    elif cost.cpu_share < CPU_BOUND:
        choice, why = 1, f"steps mostly wait ({cost.cpu_share:.0%} on the CPU)"
    elif cost.cpu_p90_s > UNEVEN_RATIO * cost.cpu_median_s and cost.cpu_p90_s - cost.cpu_median_s > UNEVEN_MIN_S:
        choice, why = 1, (f"uneven steps (CPU time p90 {cost.cpu_p90_s * 1e6:.0f} us > {UNEVEN_RATIO:g} x "
                          f"median {cost.cpu_median_s * 1e6:.0f} us)")
    else:
        choice, why = packed, f"even CPU-bound steps (median {cost.median_s * 1e6:.0f} us): {n_env} envs // {cores} cores"
    logger.info("envs_per_worker='auto' chose %d for %d envs on %d cores: %s", choice, n_env, cores, why)
    return choice
