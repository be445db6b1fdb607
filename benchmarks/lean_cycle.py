"""The floor of the cycle proxy (issue 40): a parent with nothing but the step board's words.

``envmanager bench --scenario cycle`` measures the drop-in's whole ``step()`` against one env in
one worker process, each pinned to a core of its own. This measures how far a lean lockstep
parent could go against the same real worker: it writes the action, raises the env's request
word, wakes the worker only if it sleeps, spins on the answer word, and copies the results out —
no checks, no layers. What it reports:

* the env's own step time, and how long after its request the worker answered (the worker's
  Python per request is the difference), medians;
* how long after the answer word was set the parent saw it;
* the cycle's rate as a fraction of one env's rate on the worker's core.

    python -m benchmarks.lean_cycle 200     # µs of CPU per env step (default 200)

Needs Linux on x86 (the mailbox) and two cores; the result is a bound, not a product path.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import numpy as np
import psutil

import envmanager
from envmanager.bench.scenarios import burn_env
from envmanager.wire.mailbox import ANSWERS, INFO_WORDS, INFOS, MARGIN_NS, REQUESTS
from envmanager.wire.step_queue import write_frame

STEPS = 4000


def pin_workers(parent: psutil.Process, cores: set[int]) -> None:
    """Every thread of every child of ``parent`` onto ``cores``."""
    for child in parent.children(recursive=True):
        for thread in os.listdir(f"/proc/{child.pid}/task"):
            try:
                os.sched_setaffinity(int(thread), cores)
            except OSError:
                pass


def one_env_rate(cost: float, core: int, steps: int = 3000) -> float:
    """Steps per second of one env stepped in this process on ``core``: the cycle's limit."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    env = burn_env(cost, 0)
    env.reset(seed=0)
    start = time.perf_counter()
    for k in range(steps):
        env.step(k % 3)
    rate = steps / (time.perf_counter() - start)
    os.sched_setaffinity(0, before)
    return rate


def main(cost_us: float) -> int:
    cost = cost_us * 1e-6
    vec = envmanager.AsyncVectorEnv([functools.partial(burn_env, cost, 0)], context="fork", envs_per_worker=1)
    try:
        vec.reset(seed=0)
        action = np.zeros(1, dtype=np.int64)
        for _ in range(5):  # the info schema's notice comes and goes
            vec.step(action)
        manager = vec._manager
        assert manager is not None
        box = manager.pool.mailboxes
        if box is None:
            print("no mailbox here (x86 Linux with the step queue; ENVMANAGER_MAILBOX=on)", file=sys.stderr)
            return 1
        pin_workers(psutil.Process(), {1})
        os.sched_setaffinity(0, {0})
        for _ in range(300):  # the worker settles on its core, its spin sized
            vec.step(action)

        word = int(box.slot_word[0])
        words = memoryview(box._map).cast("q")
        request, answer = box.layout.block(REQUESTS) // 8 + word, box.layout.block(ANSWERS) // 8 + word
        info = box.layout.block(INFOS) // 8 + word * INFO_WORDS
        worker_state = box.layout.region(0) // 8
        wake_fd = manager.pool.processes[0].fd
        r = manager.results
        assert r.action is not None and r.observation is not None  # (shared memory: a Box env's)
        ordinal = words[request]
        times, wakes = [], 0
        start = time.perf_counter()
        for _ in range(STEPS):
            r.action[0] = 0
            ordinal += 1
            posted = time.monotonic()
            words[request] = ordinal
            state = words[worker_state]
            if 0 <= state <= time.monotonic_ns() + MARGIN_NS:  # asleep (0), or its spin about to end
                write_frame(wake_fd, b"")
                wakes += 1
            while words[answer] != ordinal:
                pass
            seen = time.monotonic()
            env_s, answered, _ = box.timings(0)
            times.append((env_s, answered - posted, seen - answered))
            handed = (r.observation.copy(), r.reward.copy(), r.terminated.copy(), r.truncated.copy(),
                      {"t": np.array([words[info + 1]]), "_t": np.ones(1, dtype=np.bool_)})  # what step() returns
        elapsed = time.perf_counter() - start
        del handed
        os.sched_setaffinity(0, {0, 1})
        limit = one_env_rate(cost, 1)
    finally:
        vec.close(terminate=True)

    def median_us(k: int) -> float:
        return statistics.median(t[k] for t in times) * 1e6

    print(f"{cost_us:g} us per step, {STEPS} steps, load average {os.getloadavg()[0]:.2f}:")
    print(f"  the env's step {median_us(0):.1f} us; the worker answered {median_us(1):.1f} us after the request "
          f"({median_us(1) - median_us(0):.1f} us of its own); the parent saw it {median_us(2):.1f} us later; {wakes} wake-ups")
    print(f"  lean lockstep cycle: {STEPS / elapsed:,.0f} steps/s = {STEPS / elapsed / limit:.3f} of one env's rate "
          f"on the worker's core ({limit:,.0f}/s); cycle {elapsed / STEPS * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("ENVMANAGER_MAILBOX", "on")
    sys.exit(main(float(sys.argv[1]) if len(sys.argv) > 1 else 200.0))
