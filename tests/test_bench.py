"""Smoke tests of ``envmanager bench``: it runs, writes what it says, rejects what it does not know.

The CLI runs in a child process (as users run it), with tiny ``--steps`` and ``--repeats 1``.
No timing is ever asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from envmanager import cli
from envmanager.bench import BACKENDS, SCENARIOS, Measurement, run_scenario

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MEASUREMENT_KEYS = {"backend", "scenario", "n_env", "median", "min", "best", "steps_per_second",
                    "env_steps", "seconds"}
SCENARIO_KEYS = {"scenario", "description", "n_env", "steps", "repeats", "warmup", "unavailable",
                 "measurements", "skipped", "failed", "ratios", "references", "limit"}


def run_cli(tmp_path, *args: str, plot: bool = False, timeout: float = 60) -> tuple[str, dict, bytes | None]:
    """Run ``envmanager bench ARGS --json [--plot]`` in a child process; its output, JSON and PNG.

    Only tests about the plot ask for one (and skip without matplotlib, an optional extra).
    """
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    outputs = ["--json", str(out_json), *(["--plot", str(out_png)] if plot else [])]
    proc = subprocess.Popen(
        [sys.executable, "-m", "envmanager.cli", "bench", *args, "--repeats", "1", "--no-progress", *outputs],
        cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr}"
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith(f"envmgr_{proc.pid}_")]
    assert not leftover, f"the benchmark left shared memory behind: {leftover}"
    return stdout, json.loads(out_json.read_text()), out_png.read_bytes() if plot else None


def child_env(*paths: str) -> dict[str, str]:
    """The environment of a child process that imports this checkout (and ``paths`` first)."""
    path = os.pathsep.join(filter(None, [*paths, REPO, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def test_a_reader_of_stdout_that_went_away_ends_the_benchmark_quietly():
    """`envmanager bench | head -3` ended in a BrokenPipeError traceback (exit 1). The reader is
    gone before the first line here, so the first write (flushed as the first worker forks) fails."""
    from process_helpers import left_in_session

    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "envmanager.cli", "bench", "--backends", "envmanager", "--steps", "100",
             "--repeats", "1", "--no-warmup", "--no-progress"],
            stdout=write, stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True)
    finally:
        os.close(write)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # (quietly: no traceback, nothing of the pipe; a worker slow to close may log that it was terminated)
    assert proc.returncode == 1 and "Traceback" not in stderr and "BrokenPipe" not in stderr, f"exit {proc.returncode}\n{stderr}"
    assert not left_in_session(proc.pid), "the benchmark left processes behind"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"envmgr_{proc.pid}_")]


def check_measured(data: dict, scenario: str, backends: list[str]) -> dict:
    assert set(data) >= {"meta", "backends", "scenarios", "targets"}
    assert data["meta"]["cores"] >= 1
    result = data["scenarios"][scenario]
    assert set(result) >= SCENARIO_KEYS
    assert result["failed"] == {}
    assert sorted(result["measurements"]) == sorted(backends)
    for name, m in result["measurements"].items():
        assert set(m) >= MEASUREMENT_KEYS
        assert m["backend"] == name and m["scenario"] == scenario
        assert len(m["steps_per_second"]) == 1 and m["steps_per_second"][0] > 0
        assert m["min"] <= m["median"] <= m["best"]
    return result


@pytest.mark.parametrize(
    "scenario, steps, backends, ratio_column",
    [
        ("cartpole", 160, ["envmanager", "envmanager-k", "envmanager-vector", "gym.SyncVectorEnv",
                           "gym.AsyncVectorEnv"], "vs Async"),
        ("many", 128, ["envmanager-k", "gym.SyncVectorEnv"], "vs 8 envs"),
        ("cpu", 32, ["envmanager", "gym.SyncVectorEnv"], "vs limit"),
        ("uneven", 32, ["envmanager", "envmanager-lockstep", "gym.SyncVectorEnv"], "vs lockstep"),
    ],
)
def test_scenario_runs_and_writes_json(tmp_path, scenario, steps, backends, ratio_column):
    stdout, data, _ = run_cli(tmp_path, "--scenario", scenario, "--steps", str(steps), "--targets", "--backends", *backends)
    result = check_measured(data, scenario, backends)
    assert result["steps"] == steps and result["repeats"] == 1
    assert set(result["ratios"]["vs Sync"]) == set(backends)
    assert ratio_column in result["ratios"]
    assert f"== {scenario}:" in stdout
    for name in backends:
        assert name in stdout
    if scenario == "cpu":
        assert result["limit"]["steps_per_second"] > 0 and result["limit"]["cores"] >= 1
        assert "limit" in stdout
    if scenario == "many":
        assert result["references"]["envmanager-k"]["n_env"] == 8
    if scenario == "cartpole":
        assert "envmanager-k, envmanager-vector: " in stdout  # with how many envs per worker
        drop_in = {t["what"]: t for t in data["targets"] if t["backend"] == "envmanager-vector"}
        assert {w: t["threshold"] for w, t in drop_in.items()} == {
            "drop-in x gym SyncVectorEnv": 1.0, "drop-in x gym AsyncVectorEnv": 5.0}
        assert drop_in["drop-in x gym AsyncVectorEnv"]["value"] == result["ratios"]["vs Async"]["envmanager-vector"]
        assert "drop-in x gym AsyncVectorEnv" in stdout


def test_more_backends_and_skips(tmp_path):
    """SB3 and EnvPool join in where they can; what cannot run is skipped with the reason."""
    backends = ["envmanager-lockstep", "envmanager-batch", "sb3.SubprocVecEnv", "envpool"]
    stdout, data, _ = run_cli(tmp_path, "--scenario", "cpu", "--steps", "16", "--no-warmup",
                              "--backends", *backends)
    result = data["scenarios"]["cpu"]
    assert "envpool" in result["skipped"] and "not applicable" in result["skipped"]["envpool"]
    assert set(result["measurements"]) | set(result["skipped"]) == set(backends)
    assert result["failed"] == {}
    assert "skipped" in stdout


def test_plot(tmp_path):
    """``--plot`` writes a PNG next to the JSON (matplotlib is the optional extra ``bench``)."""
    pytest.importorskip("matplotlib")
    backends = ["envmanager-vector", "gym.SyncVectorEnv"]
    stdout, data, png = run_cli(tmp_path, "--scenario", "cartpole", "--steps", "64", "--no-warmup",
                                "--backends", *backends, plot=True)
    check_measured(data, "cartpole", backends)
    assert png is not None and png.startswith(PNG_MAGIC)
    assert f"wrote {tmp_path / 'bench.png'}" in stdout


def test_plot_with_nothing_measured_says_so(tmp_path):
    """A run that measured nothing (its extra missing, every backend skipped) still gets its PNG,
    not a traceback after the run."""
    pytest.importorskip("matplotlib")
    stdout, data, png = run_cli(tmp_path, "--scenario", "cartpole", "--steps", "8", "--no-warmup",
                                "--backends", "mlagents.sequential", plot=True)  # unity's only: always skipped here
    assert data["scenarios"]["cartpole"]["measurements"] == {}
    assert png is not None and png.startswith(PNG_MAGIC)
    assert f"wrote {tmp_path / 'bench.png'}" in stdout


PLOT_REFUSED = 'envmanager bench: --plot needs matplotlib (not installed): pip install "envmanager[bench]"'


def test_plot_without_matplotlib_is_refused_before_running(tmp_path, monkeypatch, capsys):
    """One line naming the extra, a non-zero exit, and nothing measured: checked before the run."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` now fails
    monkeypatch.setattr(cli, "run_benchmark", lambda *a, **k: pytest.fail("the benchmark ran"))
    code = cli.main(["bench", "--scenario", "cartpole", "--steps", "8", "--repeats", "1",
                     "--plot", str(tmp_path / "bench.png")])
    out, err = capsys.readouterr()
    assert code != 0
    assert err.splitlines() == [PLOT_REFUSED] and out == ""
    assert not (tmp_path / "bench.png").exists()


def test_plot_without_matplotlib_from_the_command_line(tmp_path):
    """The same as users see it: a child process whose ``sitecustomize`` hides matplotlib."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    proc = subprocess.run(
        [sys.executable, "-m", "envmanager.cli", "bench", "--scenario", "cartpole", "--steps", "8",
         "--repeats", "1", "--no-progress", "--json", "bench.json", "--plot", "bench.png"],
        cwd=tmp_path, env=child_env(str(tmp_path)), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc
    assert proc.stderr.splitlines() == [PLOT_REFUSED] and proc.stdout == ""
    assert not (tmp_path / "bench.json").exists()


def test_missing_output_directory_is_refused_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_benchmark", lambda *a, **k: pytest.fail("the benchmark ran"))
    missing = tmp_path / "no" / "such"
    assert cli.main(["bench", "--json", str(missing / "bench.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("envmanager bench: --json ") and f"no such directory {missing}" in err
    assert len(err.splitlines()) == 1


def _unity_available() -> bool:
    if importlib.util.find_spec("mlagents_envs") is None:
        return False
    try:
        import envmanager.mlagents as ml

        return hasattr(ml, "MLAgentsEnvManager")
    except Exception:
        return False


def test_unity_scenario(tmp_path):
    stdout, data, _ = run_cli(tmp_path, "--scenario", "unity", "--steps", "16", "--no-warmup",
                              "--backends", "envmanager", "envmanager-vector", "gym.AsyncVectorEnv")
    result = data["scenarios"]["unity"]
    if not _unity_available():
        assert result["unavailable"] and "not available" in stdout
        return
    assert result["unavailable"] is None
    check_measured(data, "unity", ["envmanager"])
    assert "gym.AsyncVectorEnv" in result["skipped"] and "envmanager-vector" in result["skipped"]


def test_scenario_with_a_missing_dependency_says_not_available():
    from dataclasses import replace

    from envmanager.bench.report import format_table

    scenario = replace(SCENARIOS["unity"], requires=("envmanager_no_such_module",))
    result = run_scenario(scenario, ["envmanager"], steps=8, repeats=1)
    assert "envmanager_no_such_module cannot be imported" in result.unavailable
    assert result.measurements == {}
    assert "not available: envmanager_no_such_module" in format_table(result)


def test_drop_in_targets():
    """``envmanager-vector`` is a default backend with its own cartpole targets (1x Sync, 5x Async)."""
    from envmanager.bench import DEFAULT_BACKENDS, Measurement, ScenarioResult, targets

    assert "envmanager-vector" in DEFAULT_BACKENDS and BACKENDS["envmanager-vector"].ours
    result = ScenarioResult(SCENARIOS["cartpole"], steps=80, repeats=1)
    for name, rate in (("envmanager-vector", 600.0), ("gym.SyncVectorEnv", 500.0), ("gym.AsyncVectorEnv", 100.0)):
        result.measurements[name] = Measurement(name, "cartpole", 8)
        result.measurements[name].add(80, 80 / rate)
    found = {(t.what, t.backend): t for t in targets([result])}
    sync = found["drop-in x gym SyncVectorEnv", "envmanager-vector"]
    assert sync.value == pytest.approx(1.2) and sync.threshold == 1.0 and sync.met
    async_ = found["drop-in x gym AsyncVectorEnv", "envmanager-vector"]
    assert async_.value == pytest.approx(6.0) and async_.threshold == 5.0 and async_.met
    # even as the best of ours it faces only its own cartpole targets, not the general ones (8x, 1.5x)
    assert {what for what, backend in found if backend == "envmanager-vector"} == {
        "drop-in x gym SyncVectorEnv", "drop-in x gym AsyncVectorEnv"}


def test_defaults_parse_to_the_cartpole_run():
    args = cli.build_parser().parse_args(["bench"])
    assert args.scenario == ["cartpole"] and args.backends is None and args.repeats == 3
    assert args.steps is None and args.json is None and args.plot is None


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--scenario", "nosuch"],
        ["bench", "--scenario", "cartpole", "nosuch"],
        ["bench", "--backends", "nosuch"],
        ["bench", "--backends", "envmanager", "gym.NoSuchVectorEnv"],
        ["bench", "--repeats", "0"],
        ["bench", "--steps", "-5"],
    ],
)
def test_unknown_choices_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err or "must be at least 1" in err


def test_all_runs_each_setup_once_and_groups_expand():
    everything = cli.chosen_scenarios(["all"])
    assert "unity-trainer" in everything and "unity-trainer-scale" not in everything  # a subset of it
    assert set(everything) == {n for n, s in SCENARIOS.items() if n != "unity-trainer-scale"}
    assert cli.chosen_scenarios(["unity-trainer-scale"]) == ["unity-trainer-scale"]
    sweep = cli.chosen_scenarios(["sweep", "cartpole"])
    assert sweep[0] == "cartpole" and len(sweep) > 2 and all(n.startswith("sweep") for n in sweep[1:])


def test_all_scenarios_and_backends_are_choices():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--scenario", "all", "--backends", "all"])
    assert args.scenario == ["all"] and args.backends == ["all"]
    for name in SCENARIOS:
        parser.parse_args(["bench", "--scenario", name])
    for name in BACKENDS:
        parser.parse_args(["bench", "--backends", name])


def test_library_logs_never_prints(capsys):
    """In process, with the one backend that starts no process: results come back, nothing printed."""
    result = run_scenario(SCENARIOS["cpu"], ["gym.SyncVectorEnv", "envpool"], steps=16, repeats=1)
    assert capsys.readouterr() == ("", "")
    assert result.measurements["gym.SyncVectorEnv"].median > 0
    assert "envpool" in result.skipped
    assert result.limit is not None and "vs limit" in result.ratios()


def test_progress_bar_is_optional(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # ``import tqdm`` now fails
    assert cli._progress(True) is None
    assert cli._progress(False) is None


def test_sampler_scenario(tmp_path):
    """The sampling layer's figures come from one run of its own contenders (tiny budget)."""
    from envmanager.bench.sampler_bench import TARGETS

    stdout, data, _ = run_cli(tmp_path, "--scenario", "sampler", "--steps", "160", "--targets", timeout=120)
    contenders = sorted({c for _, c, r, _, _ in TARGETS} | {r for _, c, r, _, _ in TARGETS})
    result = check_measured(data, "sampler", contenders)
    assert set(result["ratios"]) == {column for _, _, _, column, _ in TARGETS}
    ours = [t for t in data["targets"] if t["scenario"] == "sampler"]
    assert sorted(t["what"] for t in ours) == sorted(what for what, *_ in TARGETS)
    assert all(t["value"] > 0 for t in ours)
    assert "policy_lag" in result["extra"] and min(result["extra"]["learn_fn_seconds"]) > 0
    assert "== sampler" in stdout and "policy lag" in stdout and "learner overlap x in turn" in stdout


def test_ray_scenario_checks_and_ratios_without_ray():
    """The ray scenario's stream check finds lost, duplicated and unreported cut steps (it can
    fail), and its own ratio columns and targets; no Ray needed."""
    import numpy as np

    from envmanager.bench import Measurement
    from envmanager.bench.ray_bench import ALL, FIRST, LOCAL, ONE_STEP, RAY, RayResult, check_stream
    from envmanager.bench.runner import targets
    from envmanager.sampler.batches import Step, TransitionBatch

    def steps(episode, ts, done_at=None):
        return [Step(np.array([t], float), 0, 1.0, t + 1 == done_at, False, np.array([t + 1], float), 0, episode, 0, 0, {}, {})
                for t in ts]

    clean = TransitionBatch.from_steps(steps(0, range(5), done_at=5) + steps(1, range(3)) + steps(2, range(2)))
    assert check_stream(clean, 10, reported={1}, open_at_end={2}) == {
        "lost": 0, "duplicated": 0, "cut": 1, "cut_unreported": 0, "flagged_steps": 0}
    broken = TransitionBatch.from_steps(steps(0, [0, 1, 1, 3], done_at=4) + steps(1, range(3)))
    found = check_stream(broken, 9, reported=set(), open_at_end=set())
    assert found["duplicated"] == 1 and found["lost"] == 2 + 2 and found["cut_unreported"] == 1

    result = RayResult(SCENARIOS["ray"], steps=100, repeats=1)
    for name, rate in ((LOCAL, 100.0), (RAY, 90.0), (ONE_STEP, 3.0), (f"uneven {FIRST}", 40.0), (f"uneven {ALL}", 20.0)):
        result.measurements[name] = Measurement(name, "ray", 8)
        result.measurements[name].add(int(rate), 1.0)
    result.faults = {"lost": 0, "duplicated": 0, "cut_unreported": 0}
    ratios = result.ratios()
    assert ratios["vs local"][RAY] == pytest.approx(0.9) and ratios["vs 1-step"][RAY] == pytest.approx(30.0)
    assert ratios["vs wait-all"][f"uneven {FIRST}"] == pytest.approx(2.0)
    found_targets = {t.what: t.met for t in targets([result])}
    assert found_targets == {"x local Sampler": True, "x 1 step per call": True, "first-ready x wait-all": True,
                             "0 lost/dup, cuts reported": True}


def test_step_queue_benchmark_runs():
    """``benchmarks/step_queue.py`` (docs/guide/performance.md: why one shared queue) still runs on today's wire API."""
    script = os.path.join(REPO, "benchmarks", "step_queue.py")
    proc = subprocess.run([sys.executable, script, "--writers", "1", "--rounds", "200"], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()[1:]
    assert len(rows) == 1 and rows[0].split()[0] == "1" and len(rows[0].split()) == 4, proc.stdout


def test_unity_trainer_scenario_without_mlagents_says_why(tmp_path):
    """``unity-trainer`` needs ML-Agents' trainer; where it is missing the scenario is reported
    as not available, with the reason, and the run goes on (exit 0)."""
    from envmanager.bench.scenarios import scenario_unavailable

    if scenario_unavailable(SCENARIOS["unity-trainer"]) is None:
        pytest.skip("mlagents is installed here: the scenario runs (tests/trainer/test_bench_trainer.py)")
    stdout, data, _ = run_cli(tmp_path, "--scenario", "unity-trainer", "--steps", "1000", "--no-warmup")
    result = data["scenarios"]["unity-trainer"]
    assert "mlagents.trainers.learn cannot be imported" in result["unavailable"]
    assert result["measurements"] == {}
    assert "not available" in stdout


@pytest.mark.timeout(60)
def test_unity_trainer_run_deadline_stops_a_silent_trainer(tmp_path, monkeypatch):
    """A trainer run that hangs without printing is stopped at the run's deadline: its process
    group is killed (the trainer and what it started) and the measurement fails with why."""
    import psutil

    from envmanager.bench import unity_trainer
    from process_helpers import alive

    tool = tmp_path / "silent-trainer"
    tool.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pids\nsleep 600 &\necho $! >> {tmp_path}/pids\nwait\n")
    tool.chmod(0o755)
    monkeypatch.setattr(unity_trainer, "RUN_DEADLINE", 1.0)
    with pytest.raises(TimeoutError, match="did not finish in 1 s"):
        unity_trainer.measure(tool, tmp_path / "trainer.yaml", "player", 1, tmp_path, 0)
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2 and not alive(pids, timeout=5)
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid in pids]


def test_bad_outputs_seeds_and_pins_are_refused_or_left_out_before_running(tmp_path, monkeypatch, capsys):
    """A folder given as --json/--plot, or a negative seed, used to fail only after the whole run
    (or in the middle of it); --pin pins only what it can, and gives a limit only to CPU-bound envs."""
    monkeypatch.setattr(cli, "run_benchmark", lambda *a, **k: pytest.fail("the benchmark ran"))
    for path in (str(tmp_path), str(tmp_path) + os.sep):
        assert cli.main(["bench", "--json", path]) == 2
        assert "a directory; give a file name" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--seed", "-1"])
    assert exc.value.code == 2 and "must be at least 0" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "--pin"])
    uneven, cartpole, sampler = (cli._scenario(name, args) for name in ("uneven", "cartpole", "sampler"))
    assert uneven.pin and not uneven.measure_limit  # sleeping envs: one core's rate is no limit
    assert cartpole.pin and cartpole.measure_limit
    assert not sampler.pin and sampler.name == "sampler"  # its module never pins: not labelled so


def test_work_per_answer_is_not_read_when_a_preempted_spin_exceeds_the_cpu():
    m = Measurement("envmanager-db", "cartpole", 8)
    m.answers, m.parent_cpu_s, m.parent_spin_s = [1000, 1000], [0.2, 0.2], [0.1, 0.05]
    assert m.work_per_answer == pytest.approx(0.125e-3)
    m.parent_spin_s = [0.1, 0.285]  # wall time of a spin the machine preempted
    assert m.work_per_answer is None
