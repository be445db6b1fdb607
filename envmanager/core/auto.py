"""``envs_per_worker="auto"``: how many envs one worker process should host, on this machine.

One env is built and stepped in the parent, in a background thread, before any worker starts:
a few steps with sampled actions, for at most :data:`MEASURE_S` of stepping and
:data:`DEADLINE_S` in all (construction included). The rule:

* even, CPU-bound steps (the slowest tenth within :data:`UNEVEN_RATIO` x the median, at least
  half the wall time on the CPU), cheap or expensive: pack the envs into one process per core,
  ``max(1, n_env // cores)`` envs each -- one message then carries several steps, the
  per-message cost (a pipe round trip, ~60 µs) is shared, and no more processes compete for
  the cores than there are cores (``envmanager bench --scenario sweep``: packing is ahead from
  5 µs to 5 ms per step);
* anything else -- uneven or waiting steps (sleep, I/O, a simulator in another process), or an
  env that did not finish the measurement within the deadline: one env per process, so
  first-ready stepping never waits for a slow neighbour and waits overlap.

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
UNEVEN_RATIO = 3.0  # 90th percentile / median above this: uneven
CPU_BOUND = 0.5  # thread CPU time / wall time below this: the step mostly waits
MEASURE_S = 0.1  # seconds of stepping at most
MAX_STEPS = 200
DEADLINE_S = 0.5  # the whole measurement, env construction included


@dataclass(frozen=True)
class StepCost:
    """One env's measured step: median and 90th-percentile wall seconds, median CPU / median wall."""

    median_s: float
    p90_s: float
    cpu_share: float
    steps: int


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
        median = statistics.median(times)  # medians: robust to the thread being preempted
        times.sort()
        out.append(StepCost(median, times[int(0.9 * (len(times) - 1))],
                            statistics.median(cpus) / median if median > 0 else 1.0, len(times)))
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
    elif cost.p90_s > UNEVEN_RATIO * cost.median_s:
        choice, why = 1, f"uneven steps (p90 {cost.p90_s * 1e6:.0f} us > {UNEVEN_RATIO:g} x median {cost.median_s * 1e6:.0f} us)"
    elif cost.cpu_share < CPU_BOUND:
        choice, why = 1, f"steps mostly wait ({cost.cpu_share:.0%} on the CPU)"
    else:
        choice, why = packed, f"even CPU-bound steps (median {cost.median_s * 1e6:.0f} us): {n_env} envs // {cores} cores"
    logger.info("envs_per_worker='auto' chose %d for %d envs on %d cores: %s", choice, n_env, cores, why)
    return choice
