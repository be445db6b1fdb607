"""``envmanager check``: each problem it names, caught on an env that has exactly that defect
(``check_envs``), a good env passing, and the advice on which layout is fastest.

Real worker processes under real start methods throughout. Problems that do not depend on
the start method are checked under fork only (fast); those that do, under all three. An env
with a defect that gymnasium's own checker also sees reports that too (``gymnasium-checker``):
that is the checker working, not a second defect.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import re
import sys
import threading
import time

import gymnasium as gym
import pytest

import check_envs
from envmanager.check import PROBLEMS, TargetError, available_start_methods, check
from envmanager.check.probes import Trajectory, record
from envmanager.check.report import Report
from envmanager.check.runner import WorkerRun, judge
from envmanager.check.travel import describe
from envmanager.errors import WorkerError

FORK = ["fork"]
ALL = available_start_methods()
needs_all = pytest.mark.skipif(set(ALL) != {"fork", "forkserver", "spawn"}, reason="needs fork, forkserver and spawn")


def run(target, methods=FORK, **options):
    options.setdefault("advice", False)
    options.setdefault("deadline", 1.0)
    return check(target, start_methods=methods, **options)


def problem(report: Report, problem_id: str):
    found = [p for p in report.problems if p.id == problem_id]
    assert found, f"{problem_id} not reported:\n{report.format()}"
    return found[0]


def evidence(report: Report, problem_id: str) -> str:
    return "\n".join(problem(report, problem_id).evidence)


# -- good envs ----------------------------------------------------------------------------------


@needs_all
@pytest.mark.parametrize("target", [check_envs.make_good, "CartPole-v1"], ids=["factory", "gym-id"])
def test_good_env_passes_under_every_start_method(target):
    report = run(target, ALL)
    assert report.ok, report.format()
    assert report.start_methods == ["fork", "spawn", "forkserver"]
    assert "No problems found." in report.format()
    assert not [n for n in report.notes if "nothing ran" in n or "skipped" in n], report.notes


@pytest.mark.parametrize("target", [check_envs.make_good_no_id, "check_envs:make_good", check_envs.GoodEnv])
def test_factory_forms(target):
    assert run(target).ok


def test_bad_targets_are_refused_before_anything_runs():
    with pytest.raises(TargetError, match="not a registered gymnasium id"):
        check("NoSuchEnv-v9")
    with pytest.raises(TargetError, match="cannot import 'no_such_module'"):
        check("no_such_module:make")
    with pytest.raises(TargetError, match="has no attribute 'nope'"):
        check("check_envs:nope")
    with pytest.raises(TargetError, match="a factory takes none or one"):
        check(lambda a, b: None)
    with pytest.raises(ValueError, match="unknown start method"):
        check(check_envs.make_good, start_methods=["teleport"])


@pytest.mark.parametrize("env, said", [(check_envs.NoActionSpaceEnv, "action_space is NoneType None, not a gymnasium space"),
                                       (check_envs.PerAgentSpacesEnv, "a PettingZoo env?")])
def test_an_env_without_a_gymnasium_action_space_is_refused_not_a_crash(env, said):
    """Nothing to sample actions from: a usage error (exit 2) with the reason, not an
    AssertionError or AttributeError traceback (exit 1) from the checker."""
    with pytest.raises(TargetError, match=re.escape(said)):
        run(env)


@pytest.mark.parametrize("methods", [FORK, ["spawn"]], ids=["fork", "spawn"])
def test_an_env_whose_package_is_not_installed_is_an_unusable_target(methods):
    """It was a not-built problem (exit 1) with advice about setting up spawn/forkserver
    workers; gymnasium's DependencyNotInstalled says what to install, as a usage error (exit 2)."""
    with pytest.raises(TargetError, match=re.escape('needs a package that is not installed here: NoSuchSim is not '
                                                    'installed, run `pip install "nosuchsim"`')):
        run(check_envs.make_needs_missing_package, methods)


# -- the factory or env cannot travel -----------------------------------------------------------


def test_factory_holding_a_lock_cannot_travel_and_the_chain_says_what_holds_it():
    lock = threading.Lock()
    report = run(lambda: check_envs.GoodEnv() if lock else None, ALL)
    assert report.problem_ids == ["cannot-travel"]
    text = evidence(report, "cannot-travel")
    assert "closure variable 'lock' (_thread.lock)" in text and "cannot pickle '_thread.lock'" in text


def test_factory_holding_a_built_env_names_the_path_to_the_part_that_fails():
    env = check_envs.GoodEnv()
    env.sim = {"handle": threading.Lock()}
    report = run(lambda worker_id: env, ALL)
    assert report.problem_ids == ["cannot-travel"]
    assert "closure variable 'env' -> attribute 'sim' -> ['handle'] (_thread.lock)" in evidence(report, "cannot-travel")


@needs_all
def test_factory_from_a_module_loaded_by_path_cannot_travel_to_spawn_and_forkserver(tmp_path):
    (tmp_path / "ghost_envs.py").write_text("import check_envs\n\ndef make_env(worker_id):\n    return check_envs.GoodEnv()\n")
    spec = importlib.util.spec_from_file_location("ghost_envs", tmp_path / "ghost_envs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ghost_envs"] = module
    try:
        spec.loader.exec_module(module)
        report = run(module.make_env, ALL)
    finally:
        del sys.modules["ghost_envs"]
    assert report.problem_ids == ["cannot-travel"], report.format()
    found = problem(report, "cannot-travel")
    assert found.start_methods == ["spawn", "forkserver"]  # fork workers copy this process: they have the module
    assert "ModuleNotFoundError: No module named 'ghost_envs'" in "\n".join(found.evidence)
    assert "register_pickle_by_value" in found.fix


@needs_all
def test_env_registered_at_run_time_is_not_built_in_spawn_and_forkserver_workers():
    gym.register("CheckRuntimeOnly-v0", entry_point=check_envs.GoodEnv)
    try:
        report = run("CheckRuntimeOnly-v0", ALL)
    finally:
        del gym.registry["CheckRuntimeOnly-v0"]
    assert report.problem_ids == ["not-built"], report.format()
    found = problem(report, "not-built")
    assert found.start_methods == ["spawn", "forkserver"]
    assert "NameNotFound" in "\n".join(found.evidence) and "at import time" in found.fix


# -- trajectories that differ ---------------------------------------------------------------------


def test_ignored_seed_is_not_reproducible_even_in_this_process():
    report = run(check_envs.UnseededEnv)
    assert set(report.problem_ids) == {"not-reproducible", "gymnasium-checker"}, report.format()
    assert "two runs in this process: first difference at step 1, observation" in evidence(report, "not-reproducible")


@needs_all
def test_state_set_at_run_time_differs_in_spawn_and_forkserver_workers(monkeypatch):
    monkeypatch.setitem(check_envs.SETTINGS, "gravity", 20.0)  # this process only: fresh workers import 9.8
    report = run(check_envs.RuntimeSettingEnv, ALL)
    assert report.problem_ids == ["differs-in-worker"], report.format()
    found = problem(report, "differs-in-worker")
    assert found.start_methods == ["spawn", "forkserver"]
    assert "this process and a spawn worker: first difference at step 1" in found.evidence[0]


@pytest.mark.skipif("PYTHONHASHSEED" in os.environ, reason="PYTHONHASHSEED set: spawn workers hash alike")
@pytest.mark.skipif("spawn" not in mp.get_all_start_methods(), reason="needs spawn")
def test_per_interpreter_hashing_differs_across_two_spawn_workers():
    report = run(check_envs.HashSeededEnv, ["fork", "spawn"])
    assert report.problem_ids == ["differs-across-workers"], report.format()
    found = problem(report, "differs-across-workers")
    assert found.start_methods == ["spawn"]
    assert "spawn workers 0 and 1 (both env 0): first difference at step 1" in found.evidence[0]


# -- outputs outside the declared spaces ----------------------------------------------------------


def test_float64_observations_of_a_float32_space():
    report = run(check_envs.Float64Env)
    assert set(report.problem_ids) == {"observation-dtype", "gymnasium-checker"}, report.format()
    text = evidence(report, "observation-dtype")
    assert "float64, the space declares float32; shared memory stores it as float32, rounded" in text


def test_observations_out_of_bounds():
    report = run(check_envs.OutOfBoundsEnv)
    assert set(report.problem_ids) == {"observation-out-of-bounds", "gymnasium-checker"}, report.format()
    text = evidence(report, "observation-out-of-bounds")
    assert "3.0" in text and "outside [-1.0, 1.0]" in text and "stores it unchanged" in text


def test_observations_of_the_wrong_shape_fail_in_shared_memory():
    report = run(check_envs.WrongShapeEnv)
    assert set(report.problem_ids) == {"observation-shape", "gymnasium-checker"}, report.format()
    text = evidence(report, "observation-shape")
    assert "shape (3,), the space declares (4,); shared memory cannot hold it" in text
    # (both workers run env 0; the first slot to answer names itself)
    assert re.search(r"reset through envmanager in a fork worker failed: ValueError: env [01]'s reset\(\) returned observation",
                     text), text
    assert "could not broadcast input array from shape (3,) into shape (4,)" in text


def test_array_rewards():
    report = run(check_envs.ArrayRewardEnv)
    assert report.problem_ids == ["reward-not-scalar"], report.format()
    assert "shape (1,)" in evidence(report, "reward-not-scalar")


def test_info_holding_a_lock_cannot_cross_and_the_failed_delivery_is_evidence():
    report = run(check_envs.LockInInfoEnv)
    assert set(report.problem_ids) == {"info-not-picklable", "gymnasium-checker"}, report.format()
    text = evidence(report, "info-not-picklable")
    assert "info -> ['guard'] (_thread.lock)" in text
    assert "step 1 through envmanager in a fork worker failed" in text


def test_a_result_that_cannot_be_delivered_for_no_reason_seen_is_reported_on_its_own():
    clean = Trajectory(observations=[0, 1], rewards=[None, 0.0], terminated=[False, False],
                       truncated=[False, False], infos=[None, None])
    failed = WorkerRun("fork", gym.spaces.Discrete(2), [clean, clean],
                       delivery_error=(1, WorkerError(0, "builtins.OSError", "pipe burst", "Traceback ...")))
    report = Report("synthetic", FORK)
    judge([failed], [clean, clean], report)
    assert report.problem_ids == ["delivery-fails"]
    assert "step 1 through envmanager in a fork worker failed: OSError: pipe burst" in evidence(report, "delivery-fails")


# -- faults ---------------------------------------------------------------------------------------


def test_an_env_that_raises():
    report = run(check_envs.RaisingEnv)
    assert report.problem_ids == ["env-raises"], report.format()
    assert "step 3 raised ValueError: the simulator lost its state" in evidence(report, "env-raises")


@pytest.mark.parametrize("env, raised", [(check_envs.ExitingEnv, "SystemExit: 4"),
                                         (check_envs.InterruptingEnv, "KeyboardInterrupt")])
def test_an_env_that_exits_or_interrupts_raises_and_is_no_pass(env, raised):
    """An env's ``sys.exit()`` or ``KeyboardInterrupt`` is its error, as envmanager's workers report
    it: not "No problems found" with nothing run (the probes caught only ``Exception``)."""
    report = run(env)
    assert report.problem_ids == ["env-raises"], report.format()
    assert f"step 3 raised {raised}" in evidence(report, "env-raises")
    assert not report.ok
    if env is check_envs.InterruptingEnv:  # here it would end the check, like the user's Ctrl-C
        assert any("nothing ran in this process: the env raises KeyboardInterrupt" in n for n in report.notes)


def _probe_breaks(*args):
    raise RuntimeError("the probe broke")


def test_no_result_from_any_worker_is_no_pass(monkeypatch):
    """Every worker run ended without a result of the env, and no problem explains it: nothing
    was checked, which is not "No problems found" (exit 0)."""
    from envmanager.check import runner

    monkeypatch.setattr(runner, "record_fresh", _probe_breaks)  # under fork the workers have it
    report = run(check_envs.make_good)
    assert not report.problems and not report.ran and not report.ok, report.format()
    assert "Nothing was checked" in report.format() and "No problems found" not in report.format()


def test_an_exception_that_does_not_pickle():
    report = run(check_envs.SimErrorEnv)
    assert set(report.problem_ids) == {"env-raises", "exception-not-picklable"}, report.format()
    text = evidence(report, "exception-not-picklable")
    assert "check_envs.SimError raised by step 3 cannot cross a process boundary" in text
    assert "missing 1 required positional argument" in text
    assert "WorkerError with the worker's traceback, but its cause is None" in text  # what envmanager really gave


@pytest.mark.parametrize("env, what", [(check_envs.HangingEnv, "reset(seed=0)"), (check_envs.StepHangingEnv, "step 3")])
def test_a_hang_is_caught_at_its_deadline_and_nothing_runs_here(env, what):
    started = time.monotonic()
    report = run(env, ALL)
    assert time.monotonic() - started < 30  # a deadline bound, not a speed
    assert report.problem_ids == ["hangs"], report.format()
    assert f"{what} did not return within 1 s in a fork worker" in evidence(report, "hangs")
    assert any("nothing ran in this process" in n for n in report.notes)


def test_a_worker_that_dies():
    report = run(check_envs.CrashingEnv)
    assert report.problem_ids == ["worker-died"], report.format()
    assert re.search(r"step 3 in a fork worker: worker [01] died \(killed by SIGKILL\)", evidence(report, "worker-died"))
    assert any("nothing ran in this process" in n for n in report.notes)  # it would have killed pytest


# -- close() leaves things behind -----------------------------------------------------------------


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("env, problem_id, seen", [
    (check_envs.ProcessLeakEnv, "leaks-processes", "sleep 600"),
    (check_envs.ThreadLeakEnv, "leaks-threads", "'sim-poller' (Python thread, daemon)"),
    (check_envs.FdLeakEnv, "leaks-fds", os.devnull),
    (check_envs.SharedMemoryLeakEnv, "leaks-shared-memory", "/dev/shm/psm_"),
])
def test_close_leaks_and_the_checker_cleans_up(env, problem_id, seen):
    before = _segments()
    report = run(env)
    assert report.problem_ids == [problem_id], report.format()
    assert seen in evidence(report, problem_id)
    # the suite's no-leak fixture checks processes and fds; shared memory in /dev/shm outlives them
    assert not _segments() - before, "the checker left the env's shared memory behind"


def test_gymnasium_checker_alone():
    report = run(check_envs.ReusedObservationEnv)
    assert report.problem_ids == ["gymnasium-checker"], report.format()
    assert "share an object" in evidence(report, "gymnasium-checker")


def test_every_problem_has_a_title_and_the_report_serializes():
    report = run(check_envs.SimErrorEnv)
    data = report.to_dict()
    assert data["ok"] is False and {p["id"] for p in data["problems"]} == {"env-raises", "exception-not-picklable"}
    assert all(p["title"] == PROBLEMS[p["id"]] and p["fix"] for p in data["problems"])


# -- bounds and progress --------------------------------------------------------------------------


def test_the_time_limit_skips_what_no_longer_fits():
    report = run(check_envs.make_good, ALL, time_limit=0.0)
    assert len([n for n in report.notes if "the time limit (0 s) was reached" in n]) == len(ALL)
    assert not report.problems and not report.ran and not report.ok  # nothing was checked: not a pass


@pytest.mark.parametrize("env, ended", [
    (check_envs.SlowThirdStepEnv, "the wait for step 3"),
    (check_envs.SlowSecondBuildEnv, "building, running and closing a fresh env"),
])
def test_a_wait_the_time_limit_ends_is_not_a_hang(env, ended):
    """A wait capped to the little left of the time limit (a 3 s step under a 5 s deadline, or
    a fresh env that takes 3 s to build under the start-up deadline, with 2.5 s for the whole
    check): a note and the check cut short, not a "hangs" problem."""
    report = run(env, steps=5, deadline=5.0, time_limit=2.5)
    assert "hangs" not in report.problem_ids, report.format()
    assert any(n.startswith(f"fork workers: the time limit ended {ended}") for n in report.notes), report.format()
    assert not report.complete and not report.problems


def test_the_time_limit_cuts_the_runs_of_a_slow_env_short_and_says_so():
    """The runs ignored the time limit: the steps through envmanager, the fresh env's and this
    process's ran every action (an env of 100 ms a step took 26 s at --time-limit 10). Each run
    now stops once its share of the time left is spent (400 steps of 50 ms would take 20 s each),
    with a note, and the report says the check was cut short."""
    report = run(check_envs.SlowStepEnv, steps=400, time_limit=8.0)
    assert not report.problems, report.format()
    cuts = dict(re.findall(r"^(.*) (?:was|were) cut short after (\d+) of 400 steps", "\n".join(report.notes), re.M))
    assert "fork workers: the run through envmanager" in cuts, report.format()
    # the later runs: cut short too, or skipped once a loaded machine left too little of the limit
    assert "fork workers: the fresh env's runs" in cuts or any("skipped" in n or "time limit ended" in n
                                                              for n in report.notes), report.format()
    assert "this process: the runs" in cuts or any(n.startswith("this process: skipped") for n in report.notes), \
        report.format()
    assert all(int(steps) < 400 for steps in cuts.values()), cuts
    assert report.ran and not report.complete and report.ok  # what ran was checked (as a skipped stage always was)
    assert "No problems found in what was checked; the time limit cut the check short" in report.format()
    assert "No problems found." not in report.format()


def test_a_fresh_env_run_longer_than_the_start_up_deadline_is_not_a_hang():
    """The fresh env's run, waited for under the start-up deadline, stopped only at its share of
    the time limit: with a time limit that gave it more, a slow env (60 steps of 50 ms, 3 s) was
    reported as hanging at the 2 s start-up deadline. The run is now bounded by half that deadline
    too, and a cut it makes is a note, not the time limit's."""
    report = run(check_envs.SlowStepEnv, steps=60, startup_timeout=2.0, time_limit=120.0)
    assert not report.problems and report.ok and report.ran and report.complete, report.format()
    assert any(re.match(r"fork workers: the fresh env's runs were cut short after \d+ of 60 steps \(half the start-up "
                        r"deadline, 1 s, bounds them\)", n) for n in report.notes), report.format()


def test_progress_reports_every_stage():
    calls = []
    run(check_envs.make_good, progress=lambda done, total, stage: calls.append((done, total, stage)))
    assert [c[2] for c in calls] == ["pickling", "fork workers", "this process"]
    assert [c[0] for c in calls] == [1, 2, 3] and {c[1] for c in calls} == {3}


# -- travel, on its own ---------------------------------------------------------------------------


def test_travel_names_partials_bound_methods_and_defaults():
    import functools

    lock = threading.Lock()

    def make(worker_id, guard=None):
        return None

    def guarded(worker_id, guard=lock):
        return None

    assert "factory -> partial argument 'guard' (_thread.lock)" in describe(functools.partial(make, guard=lock), "factory")
    assert "factory -> default #0 (_thread.lock)" in describe(guarded, "factory")
    holder = check_envs.GoodEnv()
    holder.lock = lock
    assert "bound object -> attribute 'lock' (_thread.lock)" in describe(holder.reset, "factory")
    assert describe(check_envs.make_good, "factory") is None


def test_record_copies_observations_an_env_reuses():
    env = check_envs.ReusedObservationEnv()
    trajectory = record(env, 0, [1, 1, 1])
    assert len(trajectory) == 4 and len({o.tobytes() for o in trajectory.observations}) == 4
