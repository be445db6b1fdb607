"""How to lay ``n_env`` envs over worker processes on this machine: a small model of what each
layout delivers, and the best of its candidates (``envs_per_worker="auto"``).

A layout is ``processes`` worker processes of ``envs_per_worker`` envs, each process in one lane
or two (double buffered: one half steps while the parent turns the other around). An answer
carries ``e`` env-steps (a lane's envs). What one answer costs:

* the worker: ``e * step`` (one env's step, measured) plus its own overhead per request,
  ``worker_s + worker_env_s * e``;
* the parent: its CPU per answer when it never waits, ``parent_s + parent_env_s * e``: the one
  serial part of the machine. Its rate, ``e / (parent_s + parent_env_s * e)``, caps every layout
  however many cores the workers have: bigger answers lift the cap;
* where a process has no core of its own (more processes than cores but the parent's), each
  request also wakes a sleeping process on each side: ``wake_s``, taken from the envs' CPU.

Two regimes, as the performance guide measures them. **Own cores** (every worker process and the
parent have a core: the processes spin, answers go through the mailbox): a process with two
lanes steps one while the other is turned around, so it delivers ``e`` per ``worker time``; with
one lane it waits out the turnaround, ``e`` per ``worker time + parent time``; the parent caps
the sum. **Shared cores**: the cores' CPU is shared by the envs, the workers' overheads, the
parent and the wake-ups: ``cores * e / (worker + parent + wake)``, and a process never delivers
more than one core's worth. Lockstep callers (a vector env's ``step``) wait for every env each
step: two lanes only add the parent's second answer per process there, so they get one.

The costs are this machine's figures, measured by ``envmanager bench`` (the performance guide),
scaled by how fast this Python runs a reference loop (``speed``). The model ranks layouts; it
is checked against measured runs by ``python -m benchmarks.scaling --check``.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

__all__ = ["Costs", "Layout", "Prediction", "predict", "candidates", "best_layout", "speed"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Costs:
    """Seconds of the model's costs (see the module doc); the defaults are this project's
    reference machine's (``REFERENCE``), before scaling."""

    worker_s: float = 6e-6  # the worker's overhead per request, beyond its envs' steps
    worker_env_s: float = 1.5e-6  # ... and per env in the request
    parent_s: float = 11e-6  # the parent's CPU per answer, saturated
    parent_env_s: float = 1.0e-6  # ... and per env-step in the answer
    wake_s: float = 25e-6  # CPU of the wake-ups of one request where processes share cores

    def scaled(self, factor: float) -> Costs:
        """The costs on a machine whose Python is ``factor`` times as slow."""
        return Costs(*(v * factor for v in (self.worker_s, self.worker_env_s, self.parent_s, self.parent_env_s,
                                             self.wake_s)))


REFERENCE = Costs()


@dataclass(frozen=True)
class Layout:
    """``processes`` processes of ``envs_per_worker`` envs (the last may have fewer), in ``lanes``."""

    processes: int
    envs_per_worker: int
    lanes: int = 1

    @property
    def double_buffer(self) -> bool:
        return self.lanes == 2


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted env-steps/s and what bounds it: ``"workers"``, ``"parent"`` or ``"cpu"``
    (shared cores); ``own_cores``: whether every process and the parent have a core."""

    layout: Layout
    steps_per_s: float
    bound: str
    own_cores: bool

    def __str__(self) -> str:
        lay = self.layout
        lanes = ", double buffered" if lay.double_buffer else ""
        return (f"{lay.processes} process(es) of {lay.envs_per_worker} env(s){lanes}: {self.steps_per_s:,.0f} env-steps/s "
                f"predicted, bound by the {self.bound}")


def predict(layout: Layout, n_env: int, step_s: float, cores: int, costs: Costs = REFERENCE,
            lockstep: bool = False) -> Prediction:
    """What ``layout`` of ``n_env`` envs of ``step_s`` seconds per step delivers on ``cores`` cores."""
    processes = layout.processes
    e = layout.envs_per_worker / layout.lanes  # env-steps per answer
    worker = e * step_s + costs.worker_s + costs.worker_env_s * e
    parent = costs.parent_s + costs.parent_env_s * e
    parent_rate = e / parent  # the one serial part
    own = processes + 1 <= cores
    if own:
        per_process = e / worker if layout.lanes == 2 and not lockstep else e / (layout.lanes * worker + parent)
        workers = processes * per_process
        rate, bound = (workers, "workers") if workers <= parent_rate else (parent_rate, "parent")
    else:
        cpu = cores * e / (worker + parent + costs.wake_s)  # everything shares the cores
        one_each = processes * e / (layout.lanes * worker + costs.wake_s)  # a process is one core at most
        rate, bound = (cpu, "cpu") if cpu <= one_each else (one_each, "workers")
        if parent_rate < rate:
            rate, bound = parent_rate, "parent"
    return Prediction(layout, min(rate, n_env / step_s if step_s > 0 else rate), bound, own)


def candidates(n_env: int, cores: int, lockstep: bool = False) -> list[Layout]:
    """Every distinct way to split ``n_env`` envs over 1 ... ``n_env`` processes (as many envs per
    process as it takes), in one lane or two."""
    out: list[Layout] = []
    seen = set()
    for processes in range(1, n_env + 1):
        k = -(-n_env // processes)
        p = -(-n_env // k)
        if k in seen:
            continue
        seen.add(k)
        out.append(Layout(p, k, 1))
        if k >= 2 and not lockstep:
            out.append(Layout(p, k, 2))
    return out


def best_layout(n_env: int, step_s: float, cores: int, costs: Costs | None = None, lockstep: bool = False,
                envs_per_worker: int | None = None) -> tuple[Prediction, list[Prediction]]:
    """The best candidate (the fewest processes among those within 2% of the fastest: fewer
    processes cost less memory and start-up), and every candidate's prediction. With
    ``envs_per_worker`` given, only its lanes are chosen."""
    costs = costs or REFERENCE.scaled(speed())
    layouts = candidates(n_env, cores, lockstep)
    if envs_per_worker is not None:
        k = max(1, int(envs_per_worker))
        p = -(-n_env // k)
        layouts = [Layout(p, k, 1)] + ([Layout(p, k, 2)] if k >= 2 and not lockstep else [])
    predictions = [predict(lay, n_env, step_s, cores, costs, lockstep) for lay in layouts]
    fastest = max(p.steps_per_s for p in predictions)
    close = [p for p in predictions if p.steps_per_s >= 0.98 * fastest]
    return min(close, key=lambda p: (p.layout.processes, p.layout.lanes)), predictions


#: How long this project's reference machine runs ``_reference_loop`` (seconds), for ``speed``.
REFERENCE_LOOP_S = 1.0e-3


def _reference_loop() -> None:
    """Python work like the hot path's: attribute and list look-ups, small tuples, a call."""
    items = [(i, i * 2) for i in range(64)]
    total = 0
    for _ in range(40):
        for a, b in items:
            total += max(a, b) & 7
    if total < 0:  # never: keeps the loop from being optimised away
        raise AssertionError


@functools.lru_cache(maxsize=1)
def speed() -> float:
    """How many times slower than the reference machine this Python is (the best of a few tries
    of a ~1 ms loop; clamped to [0.25, 8])."""
    best = min(_timed(_reference_loop) for _ in range(5))
    factor = min(8.0, max(0.25, best / REFERENCE_LOOP_S))
    logger.debug("this Python runs the reference loop in %.2f ms: %.2fx the reference machine", best * 1e3, factor)
    return factor


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start
