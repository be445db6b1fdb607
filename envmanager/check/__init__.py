"""``envmanager check``: will an env survive the process boundary, and should it cross it at all?

:func:`check` runs an env through envmanager's worker processes under each start method and in
this process, and reports named problems with their evidence and fix (``runner``: what runs
where; ``probes``: what runs next to the env; ``conformance``: outputs against spaces, and
trajectories against each other; ``travel``: what holds what when pickling fails), then advises
the fastest layout for ``num_envs`` envs on this machine from brief measurements (``advice``).
The core never imports this package.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from typing import Any

from envmanager.check.report import PROBLEMS, Advice, Layout, Problem, Report
from envmanager.check.target import TargetError, resolve

__all__ = ["check", "Report", "Problem", "Advice", "Layout", "PROBLEMS", "TargetError", "available_start_methods"]

logger = logging.getLogger(__name__)

#: Problems after which the env is not run in this process (it would hang, crash or leak here).
UNSAFE_HERE = {"hangs", "worker-died", "leaks-threads", "leaks-fds"}
#: Problems after which nothing is measured.
UNSAFE_TO_MEASURE = {"cannot-travel", "not-built", "hangs", "worker-died", "env-raises", "delivery-fails"}


def available_start_methods() -> list[str]:
    """This platform's start methods, its default first (``fork`` on Linux)."""
    from envmanager.core.platforms import default_start_method

    default = default_start_method()
    return [default] + [m for m in mp.get_all_start_methods() if m != default]


def check(
    target: str | Callable[..., Any],
    *,
    num_envs: int = 8,
    start_methods: Sequence[str] | None = None,
    seed: int = 0,
    steps: int = 64,
    deadline: float = 5.0,
    startup_timeout: float = 30.0,
    time_limit: float = 50.0,
    advice: bool = True,
    measure_s: float = 1.0,
    cores: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> Report:
    """Check ``target`` -- a gymnasium id, ``"module:factory"``, or a factory ``() -> Env`` or
    ``(worker_id) -> Env`` -- and return a :class:`Report` (``report.ok``: no problem).

    Args:
        num_envs: the number of envs the advice is for.
        start_methods: those to run workers with (default: every one available here).
        seed, steps: ``reset(seed=seed)`` and this many sampled actions (the same everywhere).
        deadline: seconds one reset or step may take before it counts as hanging.
        startup_timeout: seconds a worker may take to start and build its env.
        time_limit: seconds for the whole check: waits are capped by what is left, each run of the
            env stops once its share of what is left is spent, and a stage that no longer fits is
            skipped, each with a note (``report.complete`` is then false).
        advice: measure and advise a layout (takes a few seconds; off: problems only).
        measure_s: seconds each layout is measured.
        cores: cores to advise for (default: those this process may use).
        progress: called as ``progress(stage_number, stages, stage_name)`` when a stage starts.

    Raises ``TargetError`` when ``target`` names nothing that makes an env, or its env needs a
    package that is not installed here (gymnasium's ``DependencyNotInstalled``: "MuJoCo is not
    installed, run `pip install ...`").
    """
    from envmanager.check import advice as advice_module
    from envmanager.check import runner

    started = time.monotonic()
    factory = resolve(target)
    methods = list(start_methods) if start_methods is not None else available_start_methods()
    unknown = [m for m in methods if m not in mp.get_all_start_methods()]
    if unknown or not methods:
        raise ValueError(f"unknown start method(s) {unknown}; available here: {mp.get_all_start_methods()}")
    report = Report(factory.label, methods)
    budget = runner.Budget(time_limit)
    settings = runner.Settings(methods, seed=seed, steps=steps, deadline_s=deadline, startup_s=startup_timeout)
    stages = ["pickling", *[f"{m} workers" for m in methods], "this process"]
    stages += advice_module.stages(num_envs, cores) if advice else []
    done = 0

    def tick(stage: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(min(done, len(stages)), len(stages), stage)

    try:
        tick("pickling")
        blob = runner.check_travel(factory, factory.label, report)
        if blob is None:
            return report
        runs: list[runner.WorkerRun] = []
        for n, method in enumerate(methods):
            tick(f"{method} workers")
            if budget.left() < 1.0:
                report.complete = False
                report.notes.append(f"{method} workers: skipped, the time limit ({time_limit:g} s) was reached")
                continue
            probe = not any(r.raw for r in runs)  # the first start method that runs the env
            # the env's runs still to come, each with its share of the time left: two in the workers
            # of this and each later start method, two in this process
            runs_left = 2 * (len(methods) - n) + 2
            run = runner.run_in_workers(factory, blob, method, settings, probe, budget, report, runs_left)
            runs.append(run)
            if run.stopped in ("hangs", "died"):
                report.notes.append(f"the remaining start methods were skipped: the env {run.stopped} in a {method} worker")
                break
        report.ran = bool(runs)  # (every start method skipped: nothing was checked)
        runner.judge_probes(runs, report)
        tick("this process")
        here: list[Any] = []
        blocked = UNSAFE_HERE & set(report.problem_ids)
        if not any(r.raw for r in runs):
            report.notes.append("nothing ran in this process: the env ran in no worker")
        elif blocked:
            report.notes.append(f"nothing ran in this process, because of {', '.join(sorted(blocked))} (above)")
        elif any(t.raised is not None and t.raised.type == "KeyboardInterrupt" for r in runs for t in r.raw):
            # here it would end the check (and could not be told from the user's Ctrl-C)
            report.notes.append("nothing ran in this process: the env raises KeyboardInterrupt (above)")
        elif budget.left() < runner.MIN_RUN_S:
            budget.cut(report, "this process: skipped, nothing ran here")
        else:
            here = runner.run_here(factory, settings, report, budget)
        runner.judge(runs, here, report)
        if not report.problems and not any(r.raw for r in runs):
            report.ran = False  # every worker run ended before the env gave a result: nothing was checked
        if advice:
            _advise(advice_module, factory, report, here, num_envs, seed, measure_s, deadline, startup_timeout,
                    cores, budget, tick)
    finally:
        order = list(PROBLEMS)
        report.problems.sort(key=lambda p: order.index(p.id))
        report.seconds = time.monotonic() - started
    return report


def _advise(module: Any, factory: Any, report: Report, here: list[Any], num_envs: int, seed: int, measure_s: float,
            deadline: float, startup_timeout: float, cores: int | None, budget: Any, tick: Callable[[str], None]) -> None:
    unsafe = UNSAFE_TO_MEASURE & set(report.problem_ids)
    if unsafe:
        report.notes.append(f"no advice: the env {', '.join(sorted(unsafe))}; fix that first")
        return
    needed = 4 * (measure_s + module.WARMUP_S) + 2.0
    if budget.left() < needed:
        report.notes.append(f"no advice: less than {needed:.0f} s of the time limit left")
        return
    report.advice = module.advise(factory, num_envs, cores=cores, seed=seed, measure_s=measure_s, deadline_s=deadline,
                                  startup_s=budget.cap(startup_timeout), here=bool(here), tick=tick,
                                  time_left=budget.left)
    unmeasured = [lay.description for lay in report.advice.layouts if lay.note == module.TIME_LIMIT_NOTE]
    if unmeasured:
        report.notes.append(f"advice: the time limit ({budget.seconds:g} s) was reached before measuring "
                            f"{'; '.join(unmeasured)}")
