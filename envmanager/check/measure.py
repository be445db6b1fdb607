"""Brief runs of one layout of envs: env-steps/s now, and what to expect when the machine is yours.

Each run steps the envs with sampled actions for a warm-up, then for ``measure_s`` seconds,
and measures two things:

* **now**: env-steps per second of wall time. On a shared machine this is what other programs
  leave over (Linux shares the CPU per session: with other sessions busy, a whole group of
  processes may get less than one core, and parallel layouts gain nothing now);
* **expected**: the same from what the load does not stretch.
  In this process: the wall time less the time this thread was runnable but waited for a CPU
  (Linux's schedstat; elsewhere the wall time). Through envmanager: the lowest of three bounds
  -- the cores' CPU (``cores`` / (CPU per env-step of workers and parent)), the parent's CPU
  (it is one thread), and each process's cycle (its envs' time per request less the time the
  worker waited for a CPU, plus the fastest turnaround seen -- a request's round trip less the
  env time in it -- plus the parent's CPU per request), so ``num_envs`` / cycle. Taking away
  all waiting for a CPU, ours included, leaves the CPU bound to count what the layout's own
  processes take from each other.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

from envmanager.check.probes import Cleanup
from envmanager.core import BatchEnvManager

__all__ = ["Measurement", "in_process", "in_processes", "WARMUP_S"]

WARMUP_S = 0.2


@dataclass
class Measurement:
    now: float  # env-steps/s of wall time
    expected: float  # env-steps/s the load does not change (see the module doc)
    bound: str  # what bounds ``expected``


def _run_delay(pid: int | None = None) -> float:
    """Seconds this thread (or process ``pid``'s main thread) has been runnable but waiting for
    a CPU: what other programs stretch (Linux's schedstat; 0 where unknown)."""
    try:
        with open("/proc/thread-self/schedstat" if pid is None else f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0


class _Window:
    """Runs ``step()`` (it returns the env-steps it made) through a warm-up and a timed window,
    calling ``start()`` and ``stop()`` at the window's edges."""

    def __init__(self, step: Callable[[], int], start: Callable[[], None], stop: Callable[[], None]) -> None:
        self.step, self.start, self.stop = step, start, stop

    def run(self, measure_s: float) -> tuple[int, float]:
        end_warmup = time.perf_counter() + WARMUP_S
        while time.perf_counter() < end_warmup:
            self.step()
        self.start()
        count, began = 0, time.perf_counter()
        while True:
            count += self.step()
            elapsed = time.perf_counter() - began
            if elapsed >= measure_s:
                self.stop()
                return count, elapsed


def action_batches(space: Any, n: int, seed: int, count: int = 16) -> list[Any]:
    """``count`` batches of ``n`` sampled actions: arrays where the space allows, else lists."""
    space.seed(seed)
    batches: list[Any] = []
    for _ in range(count):
        actions = [space.sample() for _ in range(n)]
        try:
            batches.append(np.stack([np.asarray(a) for a in actions]))
        except Exception:
            batches.append(actions)
    return batches


def in_process(factory: Callable[[int], Any], n: int, seed: int, measure_s: float) -> Measurement:
    """gymnasium's ``SyncVectorEnv`` of ``n`` envs in this process (what they leave is ended)."""
    import gymnasium

    cleanup = Cleanup()
    try:
        envs = gymnasium.vector.SyncVectorEnv([functools.partial(factory, i) for i in range(n)])
        try:
            envs.reset(seed=seed)
            cleanup.watch()
            space = envs.action_space
            space.seed(seed)
            batches = [space.sample() for _ in range(16)]
            turn = iter(range(1 << 62))
            delay = [0.0, 0.0]

            def step() -> int:
                envs.step(batches[next(turn) % len(batches)])
                return n

            def start() -> None:
                delay[0] = _run_delay()

            def stop() -> None:
                delay[1] = _run_delay()

            count, wall = _Window(step, start, stop).run(measure_s)
        finally:
            envs.close()
    finally:
        cleanup.finish()
    waited = min(delay[1] - delay[0], 0.9 * wall)
    return Measurement(count / wall, count / (wall - waited), "one core, the envs in turn")


def in_processes(factory: Callable[[int], Any], n: int, k: int, seed: int, measure_s: float, deadline_s: float,
                 startup_s: float, cores: int, double_buffer: bool = False) -> Measurement:
    """envmanager's batch level, ``k`` envs per process, stepped first-ready (each lane on its own
    when ``double_buffer``)."""
    with BatchEnvManager(factory, n, envs_per_worker=k, timeout=startup_s, double_buffer=double_buffer) as manager:
        manager.send_reset({slot: (seed + slot, None) for slot in range(n)})
        manager.receive_reset_batch(timeout=deadline_s)
        space = manager.action_space
        arrays = action_batches(space, n, seed)
        singles = [[space.sample() for _ in range(n)] for _ in range(len(arrays))]
        firsts = [int(s) for s in np.flatnonzero(np.r_[True, np.diff(manager.slot_process) != 0])]
        workers = [psutil.Process(manager.process_of(s).pid) for s in firsts]
        # one request per process, or per lane of it when double buffered
        request_of = [(p, lane) for p, lane in zip(manager.slot_process.tolist(), manager.slot_lanes, strict=True)]
        slots = np.arange(n)
        turn = iter(range(1 << 62))
        seen = {"turnaround": float("inf"), "env": 0.0, "requests": 0, "cpu": 0.0, "parent": 0.0, "delay": 0.0}

        def step() -> int:
            nonlocal slots
            i = next(turn) % len(arrays)
            if isinstance(arrays[i], np.ndarray):
                manager.send_batch(slots, arrays[i][slots])
            else:
                manager.send_batch(slots, [singles[i][s] for s in slots.tolist()], per_slot=True)
            slots = manager.receive_batch(timeout=deadline_s).slots
            per_request: dict[tuple[int, int], list[float]] = {}
            for slot in slots.tolist():
                env, _, round_trip = manager.timings(slot)
                entry = per_request.setdefault(request_of[slot], [0.0, round_trip])
                entry[0] += env
            for env, round_trip in per_request.values():
                seen["turnaround"] = min(seen["turnaround"], round_trip - env)
                seen["env"] += env
                seen["requests"] += 1
            return len(slots)

        def cpu() -> float:
            return sum(sum(w.cpu_times()[:2]) for w in workers)

        def delay() -> float:
            return sum(_run_delay(w.pid) for w in workers)

        def start() -> None:
            seen.update(env=0.0, requests=0, cpu=-cpu(), parent=-time.process_time(), delay=-delay())

        def stop() -> None:
            seen["cpu"] += cpu()
            seen["parent"] += time.process_time()
            seen["delay"] += delay()

        count, wall = _Window(step, start, stop).run(measure_s)
    requests = max(seen["requests"], 1)
    per_step_workers, per_step_parent = seen["cpu"] / count, max(seen["parent"] / count, 1e-9)
    env = max(seen["env"] - seen["delay"], 0.0) / requests  # the envs' time per request, less waiting for a CPU
    turnaround = max(seen["turnaround"], 0.0)
    if double_buffer:  # a request is a lane of k/2 envs; the worker steps its two lanes in turn
        cycle = max(2 * env, env + turnaround + per_step_parent * k / 2)
    else:
        cycle = env + turnaround + per_step_parent * k
    bounds = {
        f"the CPU of {cores} cores": cores / max(per_step_workers + per_step_parent, 1e-9),
        "the parent's CPU": 1 / per_step_parent,
        f"each process's cycle ({cycle * 1e6:,.0f} µs)": n / max(cycle, 1e-9),
    }
    bound = min(bounds, key=bounds.__getitem__)
    return Measurement(count / wall, bounds[bound], bound)


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
