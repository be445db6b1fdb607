"""The checks: the env through envmanager's workers under each start method, and in this
process; then what differs between them, what its outputs break, what it leaves behind.

Under each start method two worker processes each build env 0 (so whatever differs between
them comes from the process, not the worker id) and are reset with the same seed and given the
same actions, first through envmanager's own path (shared memory, deadlines: hangs and deaths
show here, step by step), then through :func:`probes.record`, which keeps what the env itself
returned. Under the first start method that builds the env, gymnasium's ``check_env`` and the
close-leak probe run in a worker too. The env runs in this process last, and only if it ran in
a worker without hanging, dying or leaking what cannot be taken back from a live process
(threads, file descriptors).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import gymnasium

from envmanager.check import fixes
from envmanager.check.conformance import first_difference, show, space_findings
from envmanager.check.probes import (
    CheckerResult,
    Cleanup,
    Leaks,
    Trajectory,
    close_leaks,
    dev_shm,
    gym_checker,
    record,
    record_fresh,
    remove_shared_memory,
    shm_in_use,
)
from envmanager.check.report import Report
from envmanager.check.target import AsEnvZero, TargetError
from envmanager.check.travel import describe
from envmanager.core import SubprocessEnvManager
from envmanager.errors import EnvManagerError, WorkerDiedError, WorkerError, WorkerTimeoutError

logger = logging.getLogger(__name__)

__all__ = ["Settings", "Budget", "WorkerRun", "check_travel", "run_in_workers", "run_here", "judge", "judge_probes"]


@dataclass
class Settings:
    """How the checks run: start methods, seed, number of actions, deadlines (seconds)."""

    start_methods: list[str]
    seed: int = 0
    steps: int = 64
    deadline_s: float = 5.0  # one reset or step
    startup_s: float = 30.0  # a worker started and its env built (spawn imports the env's modules)
    actions: list[Any] | None = None  # drawn from the action space the first worker reports


class Budget:
    """The time left of the whole check (``--time-limit``): every wait is capped by it, and the
    env's runs (through envmanager and fresh in each start method's workers, twice in this
    process) each stop once their share of it is spent."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def cap(self, seconds: float) -> float:
        """``seconds``, cut to what is left (but half a second at least: a wait needs some)."""
        return min(seconds, max(0.5, self.left()))

    def share(self, parts: int) -> float:
        """An even share of what is left among ``parts`` runs still to come."""
        return max(0.0, self.left()) / max(1, parts)

    def cut(self, report: Report, what: str) -> None:
        """Note that the time limit cut ``what`` short (the check is not ``complete``)."""
        report.complete = False
        report.notes.append(f"{what} (the time limit, {self.seconds:g} s)")


@dataclass
class WorkerRun:
    """What the workers of one start method gave."""

    method: str
    observation_space: Any = None
    raw: list[Trajectory] = field(default_factory=list)  # slots 0 and 1, as the env returned them
    delivery_error: tuple[int, WorkerError] | None = None  # the entry envmanager could not deliver
    stopped: str = ""  # why the run ended early: "not built", "hangs", "died", "time limit"
    checker: CheckerResult | None = None
    leaks: Leaks | None = None


def check_travel(factory: Any, label: str, report: Report) -> bytes | None:
    """The factory pickled as envmanager sends it, or ``None`` with the problem reported."""
    try:
        return cloudpickle.dumps(factory)
    except Exception as exc:
        fn = getattr(factory, "fn", factory)
        chain = describe(fn, label) or f"{label}: {type(exc).__name__}: {exc}"
        report.add("cannot-travel", [f"pickling the factory failed: {chain}",
                                     "envmanager pickles the factory for every worker (under fork too; the "
                                     "gymnasium drop-in's workers inherit it under fork), so nothing else "
                                     "could be checked"], fixes.CANNOT_TRAVEL)
        return None


def _entry(index: int) -> str:
    return "reset" if index == 0 else f"step {index}"


def run_in_workers(factory: Callable[[int], Any], blob: bytes, method: str, settings: Settings, probe: bool,
                   budget: Budget, report: Report, runs_left: int = 2) -> WorkerRun:
    """Two workers of ``method``, each with env 0 (see the module doc). ``probe``: also run
    gymnasium's checker and the close-leak probe. ``runs_left``: the env's runs still to come in
    the check, these two included (each gets its share of the time left)."""
    run = WorkerRun(method)
    shm_before = dev_shm()
    try:
        manager = SubprocessEnvManager(AsEnvZero(factory), 2, context=method, timeout=budget.cap(settings.startup_s))
    except WorkerError as exc:
        if settings.actions is None and exc.exc_type.split(".")[-1] == "DependencyNotInstalled":
            # gymnasium's "MuJoCo is not installed, run `pip install ...`", before any worker built the
            # env: the target is unusable here (as ALE/Pong-v5 without ale-py), not a worker set-up problem
            raise TargetError(f"{getattr(factory, 'label', factory)}: the env needs a package that is not installed "
                              f"here: {exc.message} ({_name(exc.exc_type)}, building env 0 in a {method} worker)") from None
        run.stopped = "not built"
        travel = exc.exc_type.split(".")[-1] in ("ModuleNotFoundError", "ImportError", "UnpicklingError") or (
            "Can't get attribute" in exc.message)
        report.add("cannot-travel" if travel else "not-built",  # one evidence for the methods where it is the same
                   f"building env 0 in a worker: {_name(exc.exc_type)}: {exc.message}\n{_tail(exc.remote_traceback)}",
                   fixes.cannot_travel_in_worker(exc.exc_type) if travel else fixes.not_built(exc.exc_type), [method])
        return run
    except WorkerTimeoutError as exc:
        if _time_limit_ended(exc, settings, run, report, "building env 0"):
            return run
        run.stopped = "hangs"
        report.add("hangs", f"building env 0 in a {method} worker did not finish within {exc.timeout:g} s",
                   fixes.HANGS, [method])
        return run
    except WorkerDiedError as exc:
        run.stopped = "died"
        at_start = method != "fork" and exc.exitcode == 1  # what a script without the main guard does
        report.add("worker-died", f"building env 0 in a {method} worker: {exc}",
                   fixes.DIED_AT_START if at_start else fixes.DIED, [method])
        return run
    except EnvManagerError as exc:
        run.stopped = "not built"
        report.add("not-built", f"starting {method} workers: {exc}", fixes.not_built(type(exc).__name__), [method])
        return run
    try:
        run.observation_space = manager.observation_space
        if settings.actions is None:
            space = manager.action_space
            if not isinstance(space, gymnasium.spaces.Space):  # no action space to sample: not a gymnasium env
                raise TargetError(_no_action_space(space, factory))
            space.seed(settings.seed)
            settings.actions = [space.sample() for _ in range(settings.steps)]
        if not _through_envmanager(manager, run, settings, report, budget, budget.share(runs_left)):
            return run
        what = "building, running and closing a fresh env"  # what the worker was doing, if it hangs
        try:
            if budget.left() < MIN_RUN_S:
                budget.cut(report, f"{method} workers: the fresh env's runs were skipped")
                return run
            # the run's share of the time limit, but half the start-up deadline at most: the call
            # (building, running and closing a fresh env) is waited for under that deadline
            seconds = budget.share(runs_left - 1)
            bounded = seconds > settings.startup_s / 2
            seconds = min(seconds, settings.startup_s / 2)
            run.raw = _call(manager, [0, 1], record_fresh, (blob, settings.seed, settings.actions, seconds), budget,
                            settings)
            if any(t.cut for t in run.raw):
                steps = min(len(t) - 1 for t in run.raw if t.cut)
                cut = f"{method} workers: the fresh env's runs were cut short after {steps} of {settings.steps} steps"
                if bounded:  # not the time limit: a note, the check complete
                    report.notes.append(f"{cut} (half the start-up deadline, {seconds:g} s, bounds them)")
                else:
                    budget.cut(report, cut)
            if probe and budget.left() < MIN_RUN_S:
                budget.cut(report, f"{method} workers: gymnasium's checker and the close() probe were skipped")
            elif probe:
                what = "gymnasium's checker on a fresh env"
                run.checker = _call(manager, [0], gym_checker, (blob,), budget, settings)[0]
                what = "the close() probe (building, using and closing a fresh env twice)"
                run.leaks = _call(manager, [0], close_leaks, (blob, settings.seed, settings.actions), budget, settings)[0]
        except WorkerTimeoutError as exc:
            if _time_limit_ended(exc, settings, run, report, what):
                return run
            run.stopped = "hangs"
            report.add("hangs", f"a {method} worker did not finish {what} within {exc.timeout:g} s (close() may hang)",
                       fixes.HANGS, [method])
        except WorkerDiedError as exc:
            run.stopped = "died"
            report.add("worker-died", f"a {method} worker running the env: {exc}", fixes.DIED, [method])
        except WorkerError as exc:
            report.notes.append(f"{method} workers: a probe failed: {_name(exc.exc_type)}: {exc.message}")
    finally:
        _close(manager, run, shm_before, budget)
    return run


#: Seconds of the time limit a run of the env needs left to be started at all.
MIN_RUN_S = 0.5


def _call(manager: SubprocessEnvManager, slots: list[int], fn: Callable[..., Any], args: tuple, budget: Budget,
          settings: Settings) -> list[Any]:
    """``manager.call_on(slots, fn, args)`` under the start-up deadline capped to what is left."""
    return manager.receive_call(manager.send_call(fn, args, worker_ids=slots), timeout=budget.cap(settings.startup_s))


def _time_limit_ended(exc: WorkerTimeoutError, settings: Settings, run: WorkerRun, report: Report, what: str) -> bool:
    """Whether the wait ``exc`` ended was cut short by the time limit (the start-up deadline
    capped to what was left of it): no evidence of a hang, a note; else ``False``."""
    if exc.timeout >= settings.startup_s:
        return False
    run.stopped = "time limit"
    report.complete = False
    report.notes.append(f"{run.method} workers: the time limit ended {what} after {exc.timeout:.1f} s "
                        f"(a hang only past the start-up deadline, {settings.startup_s:g} s)")
    return True


def _no_action_space(space: Any, factory: Any) -> str:
    label = getattr(factory, "label", factory)
    if callable(space):  # PettingZoo's action_space(agent)
        return (f"{label}: env 0's action_space is a method (action_space(agent): a PettingZoo env?), not a gymnasium "
                "space; envmanager check takes gymnasium envs (PettingZoo envs run in workers through envmanager.pettingzoo)")
    return (f"{label}: env 0's action_space is {type(space).__name__} {space!r:.60}, not a gymnasium space "
            "(gymnasium.spaces.Space): envmanager check steps the env with actions sampled from it")


def _close(manager: SubprocessEnvManager, run: WorkerRun, shm_before: set[str], budget: Budget) -> None:
    """Close the workers (which kills what their envs started) and remove the shared memory
    their envs made and left (a worker that hangs or died is not asked)."""
    segments: set[str] = set()
    try:
        if not run.stopped:
            segments = set().union(*manager.receive_call(manager.send_call(shm_in_use, worker_ids=[0, 1]),
                                                         timeout=budget.cap(5.0)))
    except EnvManagerError:
        pass
    manager.close(timeout=budget.cap(5.0))
    remove_shared_memory(sorted(n for n in segments - shm_before if n in dev_shm()))


def _through_envmanager(manager: SubprocessEnvManager, run: WorkerRun, settings: Settings, report: Report,
                        budget: Budget, seconds: float) -> bool:
    """Reset both slots with the seed and step them with the actions, each answer within the
    deadline (capped to what is left of the time limit), no new step after ``seconds``; ``False``
    when the run cannot go on (a hang or a death, reported; a wait the time limit ended, noted)."""
    method, deadline = run.method, settings.deadline_s
    index, wait = 0, budget.cap(deadline)
    try:
        manager.reset(seed=[settings.seed, settings.seed], timeout=wait)
        stop = time.monotonic() + seconds  # (from the reset on: a slow reset is not the steps' time)
        for index, action in enumerate(settings.actions or [], 1):
            if time.monotonic() >= stop:
                budget.cut(report, f"{method} workers: the run through envmanager was cut short after {index - 1} of "
                           f"{settings.steps} steps")
                break
            wait = budget.cap(deadline)
            manager.send_step({0: action, 1: action})
            manager.receive_steps(timeout=wait, min_count=2)
    except WorkerTimeoutError:
        what = f"reset(seed={settings.seed})" if index == 0 else f"step {index}"
        if wait < deadline:  # the time limit ended the wait, not the deadline: no evidence of a hang
            run.stopped = "time limit"
            budget.cut(report, f"{method} workers: the time limit ended the wait for {what} after {wait:.1f} s "
                       f"(a hang only past --deadline, {deadline:g} s)")
            return False
        run.stopped = "hangs"
        report.add("hangs", f"{what} did not return within {deadline:g} s in a {method} worker", fixes.HANGS, [method])
        return False
    except WorkerDiedError as exc:
        run.stopped = "died"
        report.add("worker-died", f"{_entry(index)} in a {method} worker: {exc}", fixes.DIED, [method])
        return False
    except WorkerError as exc:  # the env raised, or its result could not be delivered: told apart later
        run.delivery_error = (index, exc)
    return True


def run_here(factory: Callable[[int], Any], settings: Settings, report: Report,
             budget: Budget | None = None) -> list[Trajectory]:
    """Two runs of env 0 in this process, each stopping once its share of what is left of the
    time limit is spent; what they leave (processes, shared memory) is ended."""
    cleanup = Cleanup()
    runs: list[Trajectory] = []
    try:
        for n in range(2):
            seconds = None if budget is None else budget.share(2 - n)
            env = factory(0)
            try:
                runs.append(record(env, settings.seed, settings.actions or [], seconds=seconds))
                cleanup.watch()
            finally:
                env.close()
        if budget is not None and any(t.cut for t in runs):
            budget.cut(report, f"this process: the runs were cut short after {min(len(t) - 1 for t in runs if t.cut)} of "
                       f"{settings.steps} steps")
    except Exception as exc:
        report.notes.append(f"the env could not run in this process: {type(exc).__name__}: {exc}")
    finally:
        processes, shm = cleanup.finish()
        if processes or shm:
            report.notes.append(f"this process: the checker ended what the env left ({', '.join(processes + shm)})")
    return runs if len(runs) == 2 else []


def judge(runs: list[WorkerRun], here: list[Trajectory], report: Report) -> None:
    """Turn the trajectories into problems (the runs reported hangs, deaths and failures to
    build already)."""
    complete = [r for r in runs if len(r.raw) == 2]
    reference = here[0] if here else (complete[0].raw[0] if complete else None)
    if reference is None:
        return
    space = next((r.observation_space for r in runs if r.observation_space is not None), None)
    _outputs(reference, space, runs, report, "this process" if here else f"a {complete[0].method} worker")
    _raised(here, runs, report)
    _differences(here, complete, report)


def judge_probes(runs: list[WorkerRun], report: Report) -> None:
    """gymnasium's checker and the close-leak probe, as problems: before anything runs in this
    process, which a leak of threads or file descriptors rules out."""
    for r in runs:
        if r.checker is not None:
            if r.checker.error:
                report.add("gymnasium-checker", f"check_env in a {r.method} worker: {r.checker.error}",
                           fixes.GYM_CHECKER, [r.method])
            report.notes += [f"gymnasium's env_checker warns: {w}" for w in r.checker.warnings]
        if r.leaks is not None:
            _leaks(r.leaks, r.method, report)


def _outputs(reference: Trajectory, space: Any, runs: list[WorkerRun], report: Report, where: str) -> None:
    """Outputs against the declared spaces; a result envmanager could not deliver is told
    apart from the env raising (its own problem) and joins the finding that explains it."""
    findings = space_findings(reference, space)
    problems = {}
    for finding in findings:
        seen = f"{finding.count} of {len(reference)} results, in {where}" if finding.count > 1 else f"in {where}"
        problems[finding.index] = report.add(finding.problem, f"{finding.where} at {finding.text} ({seen})",
                                             fixes.OUTPUTS[finding.problem])
    for r in runs:
        if r.delivery_error is None:
            continue
        index, exc = r.delivery_error
        raised = r.raw[0].raised if r.raw else reference.raised
        if raised is not None and raised.index == index:
            continue  # the env's own exception
        text = f"{_entry(index)} through envmanager in a {r.method} worker failed: {_name(exc.exc_type)}: {exc.message}"
        if index in problems:
            if text not in problems[index].evidence:
                problems[index].evidence.append(text)
        else:
            report.add("delivery-fails", f"{text}\n{_tail(exc.remote_traceback)}", fixes.DELIVERY, [r.method])


def _raised(here: list[Trajectory], runs: list[WorkerRun], report: Report) -> None:
    seen = [(None, t) for t in here[:1]] + [(r.method, r.raw[0]) for r in runs if r.raw]
    for method, trajectory in seen:
        raised = trajectory.raised
        if raised is None:
            continue
        methods = [method] if method else []
        report.add("env-raises", f"{raised.where} raised {raised.type}: {raised.message}\n{_tail(raised.traceback)}",
                   fixes.RAISES, methods)
        if raised.pickle_error:
            lost = [f"through envmanager ({r.method}): WorkerError with the worker's traceback, but its cause is None"
                    for r in runs if r.delivery_error is not None and r.delivery_error[1].cause is None]
            report.add("exception-not-picklable",
                       [f"{raised.type} raised by {raised.where} cannot cross a process boundary: "
                        f"{raised.pickle_error}", *lost[:1]], fixes.EXCEPTION_PICKLE, methods)


def _differences(here: list[Trajectory], complete: list[WorkerRun], report: Report) -> None:
    if here:
        diff = first_difference(here[0], here[1])
        if diff is not None:
            report.add("not-reproducible", f"two runs in this process: {_describe(diff, 'first run', 'second run')}",
                       fixes.NOT_REPRODUCIBLE)
            return
    for r in complete:
        across = first_difference(r.raw[0], r.raw[1])
        if across is not None:
            report.add("differs-across-workers", f"{r.method} workers 0 and 1 (both env 0): "
                       f"{_describe(across, 'worker 0', 'worker 1')}", fixes.DIFFERS_ACROSS, [r.method])
            continue
        reference, name = (here[0], "this process") if here else (complete[0].raw[0], f"a {complete[0].method} worker")
        if reference is r.raw[0]:
            continue
        diff = first_difference(reference, r.raw[0])
        if diff is not None:
            worker = f"a {r.method} worker"
            report.add("differs-in-worker", f"{name} and {worker}: {_describe(diff, name, worker)}",
                       fixes.differs_in_worker(r.method), [r.method])


def _describe(diff: tuple[int, str, Any, Any], a: str, b: str) -> str:
    index, name, x, y = diff
    what = "the reset" if index == 0 else f"step {index}"
    return f"first difference at {what}, {name}:\n{a}: {show(x)}\n{b}: {show(y)}"


def _leaks(leaks: Leaks, method: str, report: Report) -> None:
    if leaks.error:
        report.notes.append(f"the close() probe in a {method} worker failed: {leaks.error}")
    for problem, found, after in (("leaks-processes", leaks.processes, "ended by the checker"),
                                  ("leaks-threads", leaks.threads, "gone with the worker"),
                                  ("leaks-fds", leaks.fds, "gone with the worker"),
                                  ("leaks-shared-memory", leaks.shared_memory, "removed by the checker")):
        if found:
            shown = found[:5] + ([f"... {len(found) - 5} more"] if len(found) > 5 else [])
            report.add(problem, [f"after close() in a {method} worker ({after}): " + "; ".join(shown)],
                       fixes.LEAKS[problem], [method])


def _name(exc_type: str) -> str:
    return exc_type.removeprefix("builtins.")


def _tail(text: str, lines: int = 6) -> str:
    """The end of a traceback: where it was raised."""
    return "\n".join(text.rstrip().splitlines()[-lines:])
