"""The cycle proxy with compiled loops: what the step board's cycle reaches once neither side runs
Python of its own per request (issue 40: the design that would beat the cycle's bound, tried).

``benchmarks/compiled/board_loop.c`` is the worker's serve loop and the parent's lockstep step on
one env's words in shared memory, as envmanager's step board has them; this builds it with the
machine's C compiler (no setuptools), forks one worker process onto core 1 with the parent on
core 0 (the ``cycle`` scenario's placement), and steps one burn env through it: the parent
raises the request word and spins on the answer word in C, then copies observation, reward and
flags out in numpy (what ``step()`` hands back); the worker spins in C, calls the env's
``step()`` and writes its results. Printed: the rate as a fraction of one env's rate on the
worker's core (the ``cycle`` scenario's limit), beside the Python loops' (``benchmarks.lean_cycle``
and ``envmanager bench --scenario cycle``).

    python -m benchmarks.compiled_cycle 200 63   # µs of CPU per env step

Needs Linux, a C compiler and CPython's headers; a prototype, not a product path.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from benchmarks.lean_cycle import one_env_rate
from envmanager.bench.scenarios import burn_env

STEPS = 4000
SOURCE = Path(__file__).with_name("compiled") / "board_loop.c"


def build() -> ModuleType:
    """``board_loop``, compiled into a temporary directory and imported."""
    out = Path(tempfile.mkdtemp(prefix="board-loop-")) / f"board_loop{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", str(out)], check=True)
    spec = importlib.util.spec_from_file_location("board_loop", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cycle(loop: ModuleType, cost: float) -> float:
    """Steps per second of the compiled cycle: one worker process on core 1, the parent on core 0."""
    env = burn_env(cost, 0)
    first, _ = env.reset(seed=0)
    first = np.asarray(first)
    shared = mmap.mmap(-1, 4096)  # anonymous, shared with the forked worker
    words = np.frombuffer(shared, np.int64, 8, 0)  # [0] request, [1] answer
    action = np.frombuffer(shared, np.int64, 1, 64)
    reward = np.frombuffer(shared, np.float64, 1, 128)
    flags = np.frombuffer(shared, np.uint8, 2, 192)
    observation = np.frombuffer(shared, first.dtype, first.size, 256).reshape(first.shape)
    warm = 300
    pid = os.fork()
    if pid == 0:  # the worker
        try:
            os.sched_setaffinity(0, {1})
            loop.serve(words, 0, 1, env, action, observation, reward, flags, warm + STEPS)
        finally:
            os._exit(0)
    try:
        os.sched_setaffinity(0, {0})
        for k in range(warm):
            action[0] = k % 3
            loop.step(words, 0, 1)
        start = time.perf_counter()
        for k in range(STEPS):
            action[0] = k % 3
            loop.step(words, 0, 1)
            handed = observation.copy(), reward.copy(), flags[0:1].copy(), flags[1:2].copy()  # what step() returns
        rate = STEPS / (time.perf_counter() - start)
        del handed
    finally:
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, set(range(os.cpu_count() or 2)))
    return rate


def main(costs_us: list[float]) -> int:
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "fork"):
        print("needs two cores and fork", file=sys.stderr)
        return 1
    loop = build()
    for cost_us in costs_us:
        cost = cost_us * 1e-6
        rate = cycle(loop, cost)
        limit = one_env_rate(cost, 1)
        print(f"{cost_us:g} us per step: compiled cycle {rate:,.0f} steps/s = {rate / limit:.3f} of one env's rate on the "
              f"worker's core ({limit:,.0f}/s); load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main([float(a) for a in sys.argv[1:]] or [200.0, 63.0]))
