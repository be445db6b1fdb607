"""Running a benchmark: warm-up, interleaved repeats, reference measurements, targets.

Repeats are interleaved (repeat 1 of every backend, then repeat 2 of every backend...), so
a burst of load from elsewhere on the machine hits all backends alike rather than one.
"""

from __future__ import annotations

import functools
import importlib
import logging
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from envmanager.bench import pinning
from envmanager.bench.backends import BACKENDS, Backend, backends_for
from envmanager.bench.common import LAST_RUN, cores, worker_cores
from envmanager.bench.limit import LIMIT_SECONDS, ProcessRate, describe, processes_rate, summed
from envmanager.bench.scenarios import (
    Scenario,
    actions_for,
    in_process_rate,
    scenario_unavailable,
    with_n_env,
)

logger = logging.getLogger(__name__)

__all__ = ["Measurement", "ScenarioResult", "Progress", "run_scenario", "run_benchmark", "targets"]

ASYNC, SYNC, SEQUENTIAL = "gym.AsyncVectorEnv", "gym.SyncVectorEnv", "mlagents.sequential"
FIRST_READY, LOCKSTEP, VECTOR = "envmanager", "envmanager-lockstep", "envmanager-vector"
AUTO, PACKED, PARENT_CORE = "envmanager-auto", "envmanager-k", "envmanager-parentcore"
ENVPOOL = "envpool"
#: A ratio column against each peer measured in the run: backend -> column name.
PEER_COLUMNS = {
    ASYNC: "vs Async", SYNC: "vs Sync", SEQUENTIAL: "vs sequential", "sb3.SubprocVecEnv": "vs sb3",
    "tianshou.SubprocVectorEnv": "vs ts.Subproc", "tianshou.ShmemVectorEnv": "vs ts.Shmem",
    "torchrl.ParallelEnv": "vs torchrl", "pufferlib.Multiprocessing": "vs puffer",
    "pufferlib.Multiprocessing-sync": "vs puffer-sync", ENVPOOL: "vs envpool",
}
#: Scenarios measured by a module of their own (kind -> module with ``run(scenario, steps, repeats,
#: progress, seed) -> ScenarioResult``): not backends x envs, but peers of their own kind.
OWN_MODULES = {"sampler": "envmanager.bench.sampler_bench", "ray": "envmanager.bench.ray_bench",
               "unity-trainer": "envmanager.bench.unity_trainer", "pettingzoo": "envmanager.bench.pettingzoo_bench"}
#: Scenario groups whose targets a module of its own lists (group -> module with ``targets(result)``).
TARGET_MODULES = {"scale": "envmanager.bench.scale", "cycle": "envmanager.bench.scale"}
#: The fixed layouts ``envmanager-auto`` is compared with (1 env per process, n_env // cores, and
#: one process per core but the parent's, double buffered).
FIXED_CHOICES = (FIRST_READY, PACKED, PARENT_CORE)
#: Pinned, the parent's CPU per answer without its spins: at most this for one env-step, and
#: this much more per further env-step in the answer (where the parent is the bound: 5 us per step).
PARENT_PER_ANSWER_S, PARENT_PER_ENV_STEP_S = 12e-6, 3e-6


class Progress(Protocol):
    def update(self, n: int) -> Any: ...
    def set_description(self, desc: str) -> Any: ...
    def close(self) -> Any: ...


class _Silent:
    def update(self, n: int) -> None: ...
    def set_description(self, desc: str) -> None: ...
    def close(self) -> None: ...


ProgressFactory = Callable[[int, str], Progress]


@dataclass
class Measurement:
    """Throughput of one backend on one scenario: one entry per timed repeat."""

    backend: str
    scenario: str
    n_env: int
    steps_per_second: list[float] = field(default_factory=list)
    env_steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    parent_cpu_s: list[float] = field(default_factory=list)  # the parent's CPU seconds in the timed loop
    answers: list[int] = field(default_factory=list)  # answers the parent took (ours only)
    parent_spin_s: list[float] = field(default_factory=list)  # seconds of it the parent spun waiting (ours only)

    def add(self, env_steps: int, seconds: float) -> None:
        self.env_steps.append(env_steps)
        self.seconds.append(seconds)
        self.steps_per_second.append(env_steps / seconds if seconds > 0 else float("inf"))
        if LAST_RUN.seconds > 0:  # the runner's timed loop said what it cost the parent
            self.parent_cpu_s.append(LAST_RUN.cpu_s)
            if LAST_RUN.answers:
                self.answers.append(LAST_RUN.answers)
                self.parent_spin_s.append(LAST_RUN.spun_s or 0.0)

    @property
    def cpu_per_env_step(self) -> float | None:
        """The parent's CPU seconds per env-step (median over repeats)."""
        if not self.parent_cpu_s:
            return None
        return float(statistics.median(c / n for c, n in zip(self.parent_cpu_s, self.env_steps, strict=True)))

    @property
    def cpu_per_answer(self) -> float | None:
        """The parent's CPU seconds per answer it took (ours; median over repeats)."""
        if not self.answers or len(self.answers) != len(self.parent_cpu_s):
            return None
        return float(statistics.median(c / a for c, a in zip(self.parent_cpu_s, self.answers, strict=True)))

    @property
    def work_per_answer(self) -> float | None:
        """The parent's CPU seconds per answer without its spinning: what it costs a parent whose
        answers are always ready (saturated), the figure that caps a many-core machine. ``None``
        where a repeat's spin (wall time, preemption included) exceeds its CPU: a loaded machine
        preempted the spinner, and the difference would say nothing."""
        if not self.answers or len(self.parent_spin_s) != len(self.parent_cpu_s):
            return None
        if any(s > c for c, s in zip(self.parent_cpu_s, self.parent_spin_s, strict=True)):
            return None
        return float(statistics.median((c - s) / a for c, s, a in zip(self.parent_cpu_s, self.parent_spin_s, self.answers,
                                                                      strict=True)))

    @property
    def median(self) -> float:
        return float(statistics.median(self.steps_per_second))

    @property
    def best(self) -> float:
        return float(max(self.steps_per_second))

    @property
    def worst(self) -> float:
        return float(min(self.steps_per_second))

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "scenario": self.scenario,
            "n_env": self.n_env,
            "median": self.median,
            "min": self.worst,
            "best": self.best,
            "steps_per_second": self.steps_per_second,
            "env_steps": self.env_steps,
            "seconds": self.seconds,
            "parent_cpu_s": self.parent_cpu_s,
            "answers": self.answers,
            "parent_cpu_per_env_step_us": None if self.cpu_per_env_step is None else self.cpu_per_env_step * 1e6,
            "parent_cpu_per_answer_us": None if self.cpu_per_answer is None else self.cpu_per_answer * 1e6,
            "parent_spin_s": self.parent_spin_s,
            "parent_work_per_answer_us": None if self.work_per_answer is None else self.work_per_answer * 1e6,
        }


@dataclass
class ScenarioResult:
    """Everything measured for one scenario in one run."""

    scenario: Scenario
    steps: int
    repeats: int
    measurements: dict[str, Measurement] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why
    failed: dict[str, str] = field(default_factory=dict)  # backend -> error
    references: dict[str, Measurement] = field(default_factory=dict)  # backend -> at reference_n_env
    single_env_rate: list[float] = field(default_factory=list)  # in-process steps/s of one env
    #: ``limit_processes``: per repeat, what each of the limit's processes did (``envmanager.bench.limit``)
    process_rates: list[list[ProcessRate]] = field(default_factory=list)
    limit_failed: str | None = None  # why the limit could not be measured
    unavailable: str | None = None  # why the whole scenario could not run
    warmup: bool = True

    @property
    def name(self) -> str:
        return self.scenario.name

    @property
    def limit_cores(self) -> int:
        """How many cores the limit counts (and processes it starts, for ``limit_processes``):
        ``min(cores, n_env)``; pinned, of the worker cores."""
        return min(worker_cores(self.scenario), self.scenario.n_env)

    @property
    def limit(self) -> float | None:
        """``min(cores, n_env)`` x one env's in-process step rate (median), when measured; pinned,
        the worker cores'. ``limit_processes``: the median over repeats of the processes' summed
        rates (never one env's rate times anything)."""
        if self.scenario.limit_processes:
            return float(statistics.median(summed(r) for r in self.process_rates)) if self.process_rates else None
        if not self.single_env_rate:
            return None
        return self.limit_cores * statistics.median(self.single_env_rate)

    def ratios(self) -> dict[str, dict[str, float]]:
        """Ratio columns (name -> backend -> median ratio) that apply to this scenario."""
        out: dict[str, dict[str, float]] = {}
        m = self.measurements
        for ref, column in PEER_COLUMNS.items():
            if ref in m:
                out[column] = {b: x.median / m[ref].median for b, x in m.items()}
        if self.limit:
            out["vs limit"] = {b: x.median / self.limit for b, x in m.items()}
        fixed = [m[b].median for b in FIXED_CHOICES if b in m]
        if AUTO in m and fixed:
            out["vs best fixed"] = {AUTO: m[AUTO].median / max(fixed)}
        if LOCKSTEP in m and self.scenario.compare_lockstep:
            out["vs lockstep"] = {b: x.median / m[LOCKSTEP].median for b, x in m.items()}
        if self.references:
            n = self.scenario.reference_n_env
            out[f"vs {n} envs"] = {
                b: x.median / self.references[b].median for b, x in m.items() if b in self.references
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "scenario": s.name,
            "description": s.description,
            "n_env": s.n_env,
            "step_cost": s.step_cost,
            "steps": self.steps,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "unavailable": self.unavailable,
            "measurements": {b: m.to_dict() for b, m in self.measurements.items()},
            "skipped": dict(self.skipped),
            "failed": dict(self.failed),
            "ratios": self.ratios(),
            "references": {b: m.to_dict() for b, m in self.references.items()},
            "pinned": self.scenario.pin,
            "limit": None if self.limit is None else {
                "cores": worker_cores(self.scenario),
                "single_env_steps_per_second": self.single_env_rate,
                "steps_per_second": self.limit,
                **(describe(self.process_rates, self.single_env_rate) if self.scenario.limit_processes else
                   {"kind": f"min({worker_cores(self.scenario)} cores, {self.scenario.n_env} envs) x one env's rate"}),
            },
            "limit_failed": self.limit_failed,
        }


def _measure(
    backend: Backend, scenario: Scenario, steps: int, actions: Any, tick: Callable[[int], None]
) -> tuple[int, float]:
    LAST_RUN.__init__()  # type: ignore[misc]
    with pinning.pinned(pinning.plan(scenario.pin_workers) if scenario.pin else None):
        return backend.runner(scenario)(scenario, steps, actions, tick)


def run_scenario(
    scenario: Scenario,
    backends: Sequence[str] | None,
    steps: int | None = None,
    repeats: int = 3,
    progress: ProgressFactory | None = None,
    seed: int = 0,
    earlier: Iterable[ScenarioResult] = (),
    warmup: bool = True,
) -> ScenarioResult:
    """Measure ``backends`` on ``scenario``: a warm-up each, then ``repeats`` interleaved rounds.

    A backend that is unavailable for the scenario is listed in ``skipped`` with the reason;
    one that raises is listed in ``failed`` (the others go on). ``earlier`` results of the same
    run are reused for reference measurements (``many`` compares with ``cartpole``).
    ``backends=None``: the scenario's own contenders, or every backend (``backends_for``).
    """
    steps = steps or scenario.steps
    result = ScenarioResult(scenario, steps, repeats, warmup=warmup)
    result.unavailable = scenario_unavailable(scenario) or (pinning.unavailable() if scenario.pin else None)
    if result.unavailable:
        logger.info("scenario %s not available: %s", scenario.name, result.unavailable)
        return result
    if scenario.kind in OWN_MODULES:
        return importlib.import_module(OWN_MODULES[scenario.kind]).run(scenario, steps, repeats, progress, seed)
    names, result.skipped = backends_for(scenario, backends)
    chosen: list[Backend] = []
    for name in names:
        backend = BACKENDS[name]
        why = backend.why_not(scenario)
        if why:
            result.skipped[name] = why
            logger.info("%s: skipping %s: %s", scenario.name, name, why)
        else:
            chosen.append(backend)
    actions = actions_for(scenario, steps, seed)

    reference = None
    if scenario.reference_n_env:
        reference = with_n_env(scenario, scenario.reference_n_env)
        reference_actions = actions_for(reference, steps, seed)
        for old in earlier:  # the same envs, counts and steps measured before in this run
            s = old.scenario
            if (s.factory is scenario.factory and s.n_env == reference.n_env and old.steps == steps
                    and s.n_actions == scenario.n_actions):
                for name, m in old.measurements.items():
                    if any(b.name == name for b in chosen):
                        result.references[name] = m
    to_reference = [b for b in chosen if reference is not None and b.name not in result.references]

    per_round = len(chosen) + len(to_reference)
    bar = (progress or (lambda total, desc: _Silent()))(steps * repeats * per_round, scenario.name)
    try:
        for backend in chosen if warmup else ():  # warm-up: imports, caches, first-time costs; not timed
            bar.set_description(f"{scenario.name}: warm-up {backend.name}")
            _try(result, backend, functools.partial(_measure, backend, scenario, max(scenario.n_env * 20, steps // 20),
                                                    actions, _ignore))
        for r in range(repeats):
            plan = pinning.plan(scenario.pin_workers) if scenario.pin else None
            if scenario.measure_limit:  # pinned: on the workers' cores
                with pinning.on_worker_cores(plan):
                    result.single_env_rate.append(in_process_rate(scenario, max(200, steps // scenario.n_env), actions))
            if scenario.limit_processes and result.limit_failed is None:
                bar.set_description(f"{scenario.name}: limit ({result.limit_cores} processes, {LIMIT_SECONDS:g} s)")
                with pinning.on_worker_cores(plan):  # the processes start with this process's affinity
                    try:
                        result.process_rates.append(processes_rate(scenario, result.limit_cores, actions))
                    except Exception as exc:
                        logger.warning("%s: the limit failed: %s", scenario.name, exc)
                        result.limit_failed = f"{type(exc).__name__}: {exc}"
            for backend in chosen:
                if backend.name in result.failed:
                    continue
                bar.set_description(f"{scenario.name}: {backend.name} ({r + 1}/{repeats})")
                got = _try(result, backend, functools.partial(_measure, backend, scenario, steps, actions, bar.update))
                if got is not None:
                    result.measurements.setdefault(
                        backend.name, Measurement(backend.name, scenario.name, scenario.n_env)
                    ).add(*got)
            for backend in to_reference:
                assert reference is not None
                bar.set_description(f"{reference.name}: {backend.name} ({r + 1}/{repeats})")
                got = _try(result, backend, functools.partial(_measure, backend, reference, steps, reference_actions, bar.update))
                if got is not None:
                    result.references.setdefault(
                        backend.name, Measurement(backend.name, reference.name, reference.n_env)
                    ).add(*got)
    finally:
        bar.close()
    for name in result.failed:
        result.measurements.pop(name, None)
        result.references.pop(name, None)
    return result


def _ignore(n: int) -> None:
    pass


def _try(result: ScenarioResult, backend: Backend, fn: Callable[[], tuple[int, float]]) -> tuple[int, float] | None:
    if backend.name in result.failed:
        return None
    try:
        return fn()
    except Exception as exc:
        logger.warning("%s: %s failed: %r", result.name, backend.name, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
        result.failed[backend.name] = f"{type(exc).__name__}: {exc}"
        return None


def run_benchmark(
    scenarios: Sequence[Scenario],
    backends: Sequence[str] | None,
    steps: int | None = None,
    repeats: int = 3,
    progress: ProgressFactory | None = None,
    seed: int = 0,
    warmup: bool = True,
) -> list[ScenarioResult]:
    """``run_scenario`` for each scenario in turn (``steps=None``: each scenario's own)."""
    results: list[ScenarioResult] = []
    for scenario in scenarios:
        results.append(run_scenario(scenario, backends, steps, repeats, progress, seed, results, warmup))
    return results


# ---------------------------------------------------------------------------------------------
# Targets (for the benchmark; never asserted in tests)


@dataclass(frozen=True)
class Target:
    """``value >= threshold``, or, where ``value`` is ``None``, a target that could not be
    evaluated in this run (``why_not`` says why: not measured, not installed, failed): missed."""

    scenario: str
    what: str
    backend: str
    value: float | None
    threshold: float
    why_not: str | None = None

    @property
    def met(self) -> bool:
        return self.value is not None and self.value >= self.threshold

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "what": self.what, "backend": self.backend,
                "value": self.value, "threshold": self.threshold, "met": self.met,
                "measured": self.value is not None, "why_not": self.why_not}


def _best_ours(result: ScenarioResult) -> Measurement | None:
    ours = [m for name, m in result.measurements.items() if BACKENDS[name].ours]
    return max(ours, key=lambda m: m.median, default=None)


def targets(results: Iterable[ScenarioResult]) -> list[Target]:
    """The project's performance targets, evaluated on the medians.

    ``cartpole``, ``many`` and ``cpu`` are evaluated for ``envmanager`` (the default
    configuration) and, if another of ours did better, for the best of ours too; ``uneven``
    compares ``envmanager`` with ``envmanager-lockstep``. The drop-in ``envmanager-vector``
    has its own ``cartpole`` targets instead, as users would swap it for gymnasium's classes:
    >= 1x ``SyncVectorEnv`` and >= 5x ``AsyncVectorEnv``.
    """
    out: list[Target] = []
    for result in results:
        if result.scenario.kind in OWN_MODULES:  # their own peers, their own targets
            out += result.targets() if hasattr(result, "targets") else []
            continue
        if result.scenario.group in TARGET_MODULES:  # every one of them listed, measured or not
            out += importlib.import_module(TARGET_MODULES[result.scenario.group]).targets(result)
            continue
        ratios = result.ratios()
        name = result.name
        best = _best_ours(result)
        contenders = [b for b in dict.fromkeys([FIRST_READY, AUTO, best.backend if best else FIRST_READY])
                      if b in result.measurements]
        for backend in contenders:
            if name == "cartpole" and backend == VECTOR:
                continue  # the drop-in has targets of its own, below
            if name == "cartpole":
                if backend in ratios.get("vs Async", {}):
                    out.append(Target(name, "x gym AsyncVectorEnv", backend, ratios["vs Async"][backend], 8.0))
                if backend in ratios.get("vs Sync", {}):
                    out.append(Target(name, "x gym SyncVectorEnv", backend, ratios["vs Sync"][backend], 1.5))
            elif name == "cpu" and backend in ratios.get("vs limit", {}):
                cores_used = min(cores(), result.scenario.n_env)
                out.append(Target(name, f"x the {cores_used}-core limit", backend, ratios["vs limit"][backend], 0.9))
            elif name == "many":
                n, ref = result.scenario.n_env, result.scenario.reference_n_env
                if backend in ratios.get(f"vs {ref} envs", {}):
                    out.append(Target(name, f"{n} envs x {ref} envs", backend, ratios[f"vs {ref} envs"][backend], 0.8))
        if name == "cartpole":
            for column, peer, threshold in (("vs Sync", "SyncVectorEnv", 1.0), ("vs Async", "AsyncVectorEnv", 5.0)):
                if VECTOR in ratios.get(column, {}):
                    out.append(Target(name, f"drop-in x gym {peer}", VECTOR, ratios[column][VECTOR], threshold))
        out += _real_targets(result, ratios, contenders)
        out += _pinned_targets(result, ratios, best)
        if name == "uneven" and FIRST_READY in ratios.get("vs lockstep", {}):
            out.append(Target(name, "first-ready x lockstep", FIRST_READY, ratios["vs lockstep"][FIRST_READY], 1.8))
    return out


def _real_targets(result: ScenarioResult, ratios: dict[str, dict[str, float]], contenders: list[str]) -> list[Target]:
    """Targets of ``atari``, ``mujoco`` and the ``sweep``; ``auto`` within 10% of the best fixed choice."""
    out: list[Target] = []
    s, name = result.scenario, result.name
    cores_used = min(cores(), s.n_env)
    limit = ratios.get("vs limit", {})
    for backend in contenders:
        if name in ("atari", "mujoco"):
            if backend in limit:
                out.append(Target(name, f"x the {cores_used}-core limit", backend, limit[backend], 0.85))
            for peer, column in PEER_COLUMNS.items():
                if backend in ratios.get(column, {}):
                    threshold = 0.8 if peer == ENVPOOL else 1.0
                    out.append(Target(name, f"x {peer}", backend, ratios[column][backend], threshold))
        elif s.group == "sweep" and s.step_cost is not None:
            if s.step_cost >= 200e-6 and backend in limit:
                out.append(Target(name, f"x the {cores_used}-core limit", backend, limit[backend], 0.9))
            if s.step_cost >= 20e-6 and backend in ratios.get("vs Sync", {}):
                out.append(Target(name, "x gym SyncVectorEnv", backend, ratios["vs Sync"][backend], 1.0))
    if AUTO in ratios.get("vs best fixed", {}):
        out.append(Target(name, "auto x best fixed layout", AUTO, ratios["vs best fixed"][AUTO], 0.95))
    return out


def _pinned_targets(result: ScenarioResult, ratios: dict[str, dict[str, float]], best: Measurement | None) -> list[Target]:
    """``pinned``: the best of ours, and the drop-in in partial batches, of the worker cores'
    limit: >= 0.90 at 20 us per step, >= 0.97 at 63 us, >= 0.95 from 200 us up and on the real
    envs; >= 2x gymnasium's AsyncVectorEnv pinned the same way up to 63 us (above, 2x would
    exceed the limit: gymnasium reaches more than half of it); at 5 us, where the parent is the
    bound, its CPU per answer (spins left out) at most 12 us plus 3 us per further env-step."""
    s, name = result.scenario, result.name
    if s.group != "pinned" or best is None:
        return []
    out: list[Target] = []
    limit = ratios.get("vs limit", {})
    n = min(worker_cores(s), s.n_env)
    cost = s.step_cost
    threshold = 0.95 if cost is None or cost >= 200e-6 else 0.97 if cost >= 63e-6 else 0.90 if cost >= 20e-6 else None
    for backend in dict.fromkeys([best.backend, "envmanager-batch-db"]):
        if threshold is not None and backend in limit:
            out.append(Target(name, f"x the {n}-worker-core limit", backend, limit[backend], threshold))
    if cost is not None and cost <= 63e-6 and best.backend in ratios.get("vs Async", {}):
        out.append(Target(name, "x gym AsyncVectorEnv pinned", best.backend, ratios["vs Async"][best.backend], 2.0))
    if name == "pinned-parent" or (cost is not None and cost <= 5e-6):
        for backend in ("envmanager-db", "envmanager-batch-db"):
            m = result.measurements.get(backend)
            if m is None or m.work_per_answer is None or not m.answers:
                continue
            per_answer = statistics.median(e / a for e, a in zip(m.env_steps, m.answers, strict=True))
            allowed = PARENT_PER_ANSWER_S + PARENT_PER_ENV_STEP_S * (per_answer - 1)
            # as a ratio, so that >= 1 is met: the allowed CPU over the CPU taken
            out.append(Target(name, f"parent CPU per answer of {per_answer:.0f} <= {allowed * 1e6:.0f} us (allowed/taken)",
                              backend, allowed / m.work_per_answer, 1.0))
    return out
