"""How to lay ``n_env`` envs over worker processes on this machine: a small model of what each
layout delivers, and the best of its candidates (``envs_per_worker="auto"``).

A layout is ``processes`` worker processes of ``envs_per_worker`` envs, each process in one lane
or two (double buffered: one half steps while the parent turns the other around). An answer
carries ``e`` env-steps (a lane's envs). What one answer costs:

* the worker: ``e * step`` (one env's step, measured) plus its own overhead per request,
  ``worker_s + worker_env_s * e``;
* the parent: its CPU per answer when it never waits, ``parent_s + parent_env_s * e``: the one
  serial part of the machine. Its rate, ``e / (parent_s + parent_env_s * e)``, caps every layout
  however many cores the workers have: bigger answers lift the cap. ``parent_env_s`` is the
  caller's too: a ``StepInfo`` per env-step costs more than a row of an array.

Two regimes, as the performance guide measures them. **Own cores** (every worker process and the
parent have a core: they spin, requests and answers go through the mailbox, no process waits
to be woken): a process with two lanes steps one while the other is turned around, so it
delivers ``e`` per worker time; with one lane it also waits out the parent's turnaround; the
parent caps the sum. **Shared cores** (more processes than cores but the parent's): a request
round trip wakes a sleeping process on each side, which takes ``round_trip_s`` of latency
(measured: a pipe ping-pong between two blocked processes) and about a third of that in CPU; the
cores' CPU is shared by the envs, the overheads and the parent, and a process waits out its
round trips unless another lane or process fills them. Lockstep callers (a vector env's
``step``) wait for every env each step: two lanes only add the parent's second answer per
process there, so they get one.

The costs are this machine's kind of figures (the performance guide has them measured), scaled
by how fast this Python runs a reference loop (``speed``); the round trip is measured where the
layout is chosen. ``python -m benchmarks.scaling --check`` compares predictions with runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

__all__ = ["Costs", "Caller", "Layout", "Prediction", "predict", "candidates", "best_layout", "speed", "REFERENCE", "BATCH",
           "STEP_INFO", "VECTOR", "VECTOR_PARTIAL", "SB3"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Costs:
    """Seconds of the model's costs (see the module doc). The defaults are the reference
    machine's (this project's 2-core VM), before scaling."""

    worker_s: float = 10e-6  # the worker's overhead per request, beyond its envs' steps
    worker_env_s: float = 0.5e-6  # ... and per env in the request
    parent_s: float = 11e-6  # the parent's CPU per answer, saturated
    parent_env_s: float = 1.0e-6  # ... and per env-step in the answer (the batch level's rows)
    round_trip_s: float = 150e-6  # a request's round trip where processes sleep between requests

    def scaled(self, factor: float) -> Costs:
        """The CPU costs on a machine whose Python is ``factor`` times as slow (the round trip
        is the kernel's and the machine's: measured, not scaled)."""
        return replace(self, worker_s=self.worker_s * factor, worker_env_s=self.worker_env_s * factor,
                       parent_s=self.parent_s * factor, parent_env_s=self.parent_env_s * factor)


REFERENCE = Costs()


@dataclass(frozen=True)
class Caller:
    """Who steps the envs, as the model needs it: the parent's CPU per env-step on top of the
    batch level's (a ``StepInfo`` per env-step, a vector env's batched infos, SB3's list of
    dicts), and whether it steps in lockstep."""

    name: str
    parent_env_s: float
    lockstep: bool = False


BATCH = Caller("the batch level", 1.0e-6)
STEP_INFO = Caller("SubprocessEnvManager.step", 5.0e-6)
VECTOR = Caller("a vector env in lockstep", 2.0e-6, lockstep=True)
VECTOR_PARTIAL = Caller("a vector env in partial batches", 2.0e-6)
SB3 = Caller("SB3's VecEnv", 3.0e-6, lockstep=True)
#: The CPU a round trip between sleeping processes takes, as a share of its latency.
WAKE_CPU = 1 / 3
#: Where processes share cores, how much more their own work costs (context switches evict
#: caches): fitted on the reference machine's runs with 2-64 envs, 5 us-1 ms per step.
SHARED_OVERHEAD = 1.4


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
    processes, lanes = layout.processes, layout.lanes
    e = layout.envs_per_worker / lanes  # env-steps per answer
    own = processes + 1 <= cores
    busier = 1.0 if own else SHARED_OVERHEAD  # processes taking turns on a core evict each other's caches
    worker = e * step_s + busier * (costs.worker_s + costs.worker_env_s * e)
    parent = busier * (costs.parent_s + costs.parent_env_s * e)
    parent_rate = e / parent  # the one serial part
    trip = 0.0 if own else costs.round_trip_s
    if lockstep:  # every env each step: the slowest process, then the parent's answers, in turn
        step_time = lanes * worker + trip + processes * lanes * parent
        rate, bound = n_env / step_time, "workers"
    elif lanes == 2:  # one lane steps while the other is turned around
        rate, bound = processes * e / max(worker, (worker + parent + trip) / 2), "workers"
    else:
        rate, bound = processes * e / (worker + parent + trip), "workers"
    if not own:  # the envs, the overheads, the parent and the wake-ups share the cores
        cpu = cores * e / (worker + parent + WAKE_CPU * trip)
        if cpu < rate:
            rate, bound = cpu, "cpu"
    if parent_rate < rate:
        rate, bound = parent_rate, "parent"
    return Prediction(layout, rate, bound, own)


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
                envs_per_worker: int | None = None, lanes: int | None = None) -> tuple[Prediction, list[Prediction]]:
    """The best candidate (the fewest processes among those within 2% of the fastest: fewer
    processes cost less memory and start-up), and every candidate's prediction. With
    ``envs_per_worker`` given, only its lanes are chosen; with ``lanes``, only layouts with that
    many (one where a process has a single env)."""
    costs = costs or REFERENCE.scaled(speed())
    layouts = candidates(n_env, cores, lockstep)
    if envs_per_worker is not None:
        k = max(1, int(envs_per_worker))
        p = -(-n_env // k)
        layouts = [Layout(p, k, 1)] + ([Layout(p, k, 2)] if k >= 2 and not lockstep else [])
    if lanes is not None:
        layouts = [lay for lay in layouts if lay.lanes == lanes or (lay.envs_per_worker == 1 and lay.lanes == 1)]
    predictions = [predict(lay, n_env, step_s, cores, costs, lockstep) for lay in layouts]
    fastest = max(p.steps_per_s for p in predictions)
    close = [p for p in predictions if p.steps_per_s >= 0.98 * fastest]
    return min(close, key=lambda p: (p.layout.processes, p.layout.lanes)), predictions


#: How long this project's reference machine runs ``_reference_loop`` (seconds), for ``speed``.
REFERENCE_LOOP_S = 0.4e-3


def _reference_loop() -> None:
    """Python work like the hot path's: attribute and list look-ups, small tuples, a call."""
    items = [(i, i * 2) for i in range(64)]
    total = 0
    for _ in range(40):
        for a, b in items:
            total += max(a, b) & 7
    if total < 0:  # never: keeps the loop from being optimised away
        raise AssertionError


def speed() -> float:
    """How many times slower than the reference machine this Python is now (the best of a few
    tries of a ~0.4 ms loop; clamped to [0.25, 8])."""
    best = min(_timed(_reference_loop) for _ in range(5))
    factor = min(8.0, max(0.25, best / REFERENCE_LOOP_S))
    logger.debug("this Python runs the reference loop in %.2f ms: %.2fx the reference machine", best * 1e3, factor)
    return factor


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start
