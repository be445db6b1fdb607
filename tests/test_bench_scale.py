"""``envmanager bench --scenario scale`` and ``--scenario cycle`` (issue 40): the scenarios, their
contenders, the limit as the sum of processes stepping together, ``--num-envs``, and ``--targets``
listing every target with the machine it ran on. Tiny step counts; no timing is ever asserted.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess

import numpy as np
import psutil
import pytest

from envmanager import cli
from envmanager.bench import BACKENDS, DEFAULT_BACKENDS, SCENARIOS, Measurement, ScenarioResult, cores, targets
from envmanager.bench.backends import backends_for
from envmanager.bench.limit import ProcessRate, processes_rate, summed
from envmanager.bench.pinning import unavailable as pinning_unavailable
from envmanager.bench.report import describe_machine, format_targets, machine
from envmanager.bench.scale import regime
from envmanager.bench.scenarios import (
    CYCLE_CONTENDERS,
    CYCLE_LANES_CONTENDERS,
    GROUPS,
    SCALE_CONTENDERS,
    Scenario,
    actions_for,
    scale,
    scenario_unavailable,
)
from test_bench import REPO, check_measured, run_cli

SCALE_CASES = ["scale-200us", "scale-20us", "scale-cartpole", "scale-pong"]
CYCLE_CASES = ["cycle-200us", "cycle-63us", "cycle-2lanes-200us"]
OURS = ("envmanager-vector-default", "envmanager-batch", "envmanager-sb3")


def scale_whats(processes: int, case: str, peers: list[str]) -> set[str]:
    """The targets ``--targets`` lists for a ``scale`` case (``what`` column)."""
    limit = f"x the {processes}-process limit"
    out = {f"drop-in step() {limit}", "send/recv n/2 x drop-in step()", "SB3 drop-in x gym drop-in step()"}
    if case in ("scale-200us", "scale-pong"):
        out.add(f"send/recv n/2 {limit}")
    return out | {f"best of ours x {p}" for p in peers}


def test_the_scenarios_their_groups_and_contenders():
    assert GROUPS["scale"] == SCALE_CASES and GROUPS["cycle"] == CYCLE_CASES
    everything = cli.chosen_scenarios(["all"])
    assert set(SCALE_CASES + CYCLE_CASES) <= set(everything)
    assert cli.chosen_scenarios(["scale"]) == SCALE_CASES and cli.chosen_scenarios(["cycle"]) == CYCLE_CASES
    for name in SCALE_CASES:
        s = SCENARIOS[name]
        assert s.n_env == 4 * cores() and s.limit_processes and s.measure_limit and not s.pin
        assert s.backends == SCALE_CONTENDERS and set(OURS) <= set(s.backends)
        assert {"gym.AsyncVectorEnv", "gym.SyncVectorEnv", "sb3.SubprocVecEnv"} <= set(s.backends)
        assert set(s.backends) <= set(BACKENDS)
    assert SCENARIOS["scale-200us"].step_cost == 200e-6 and SCENARIOS["scale-20us"].step_cost == 20e-6
    assert SCENARIOS["scale-cartpole"].gym_id == "CartPole-v1" and SCENARIOS["scale-pong"].requires == ("ale_py",)
    for name, n_env, cost in (("cycle-200us", 1, 200e-6), ("cycle-63us", 1, 63e-6), ("cycle-2lanes-200us", 2, 200e-6)):
        s = SCENARIOS[name]
        assert (s.n_env, s.step_cost, s.pin, s.pin_workers, s.measure_limit, s.limit_processes) == (
            n_env, cost, True, 1, True, False)
        assert s.backends == (CYCLE_LANES_CONTENDERS if n_env == 2 else CYCLE_CONTENDERS)
    assert CYCLE_CONTENDERS == ("envmanager-vector", "envmanager-sb3", "envmanager-batchlevel", "gym.AsyncVectorEnv")
    assert CYCLE_LANES_CONTENDERS == ("envmanager-db", "envmanager-batch-db")
    # the drop-ins as users get them: new backends, no envs_per_worker or double_buffer argument
    assert BACKENDS["envmanager-vector-default"].ours and BACKENDS["envmanager-sb3"].ours
    assert {"envmanager-vector-default", "envmanager-sb3"} <= set(DEFAULT_BACKENDS)
    # the pinned scenarios say what they simulate
    for name in GROUPS["pinned"]:
        if name != "pinned-parent":
            assert "several envs packed per worker core" in SCENARIOS[name].description, name


def test_num_envs_makes_the_scale_scenario():
    s = scale("scale-20us", 5)
    assert (s.name, s.n_env, s.group, s.limit_processes) == ("scale-20us", 5, "scale", True)
    assert "--num-envs 5" in s.description and s.steps >= 20 * 5
    assert scale("scale-20us") == SCENARIOS["scale-20us"]
    args = cli.build_parser().parse_args(["bench", "--scenario", "scale", "cartpole", "--num-envs", "6"])
    made = {n: cli._scenario(n, args) for n in cli.chosen_scenarios(args.scenario)}
    assert {n: s.n_env for n, s in made.items()} == {"cartpole": 8, **dict.fromkeys(SCALE_CASES, 6)}


def test_num_envs_is_refused_without_a_scale_scenario(monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_benchmark", lambda *a, **k: pytest.fail("the benchmark ran"))
    assert cli.main(["bench", "--scenario", "cartpole", "cycle", "--num-envs", "4"]) == 2
    assert "--num-envs applies to the scale scenarios only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--scenario", "scale", "--num-envs", "0"])
    assert exc.value.code == 2


def test_a_scenario_runs_its_own_contenders_unless_backends_are_named():
    s = SCENARIOS["cycle-200us"]
    names, skipped = backends_for(s, None)
    assert names == list(CYCLE_CONTENDERS)
    assert set(skipped) == set(DEFAULT_BACKENDS) - set(CYCLE_CONTENDERS)
    assert all(why.startswith("not applicable: not one of cycle's contenders") for why in skipped.values())
    assert backends_for(s, ["envmanager-k"]) == (["envmanager-k"], {})
    assert backends_for(SCENARIOS["cartpole"], None) == (list(DEFAULT_BACKENDS), {})


def _broken_env(env_id: int):
    raise RuntimeError(f"env {env_id} cannot be built")


def test_the_limit_is_the_sum_of_processes_stepping_together():
    """Every process steps its own env in a process of its own, all in one window (the barrier);
    the limit is their rates summed; a process that fails is reported and none is left behind."""
    scenario = dataclasses.replace(SCENARIOS["scale-200us"], n_env=3)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    rates = processes_rate(scenario, 3, actions_for(scenario, 600), seconds=0.3)
    pids = [p.pid for p in rates]
    assert len(rates) == 3 and len(set(pids)) == 3 and os.getpid() not in pids
    assert all(p.steps > 0 and p.end > p.start for p in rates)
    assert max(p.start for p in rates) < min(p.end for p in rates)  # started together: the windows overlap
    assert summed(rates) == pytest.approx(sum(p.steps / (p.end - p.start) for p in rates))
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before  # every one reaped

    broken = dataclasses.replace(scenario, factory=_broken_env)
    with pytest.raises(RuntimeError, match=r"limit process 0 \(pid \d+\) failed: RuntimeError: env 0 cannot be built"):
        processes_rate(broken, 2, actions_for(broken, 100), seconds=0.1)
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before


def test_scale_limit_is_the_median_of_the_sums_never_one_env_times_cores():
    s = dataclasses.replace(SCENARIOS["scale-200us"], n_env=4)
    result = ScenarioResult(s, steps=8, repeats=3)
    result.single_env_rate = [1000.0, 1000.0, 1000.0]  # one env alone: not the limit
    assert result.limit is None
    result.process_rates = [[ProcessRate(1, 100, 0.0, 1.0), ProcessRate(2, 200, 0.0, 1.0)],
                            [ProcessRate(1, 500, 0.0, 1.0), ProcessRate(2, 100, 0.0, 0.5)],
                            [ProcessRate(1, 50, 0.0, 1.0), ProcessRate(2, 50, 0.0, 1.0)]]
    assert result.limit == pytest.approx(300.0)  # sums 300, 700, 100
    limit = result.to_dict()["limit"]
    assert limit["sum_per_repeat"] == pytest.approx([300.0, 700.0, 100.0])
    assert limit["processes"] == 2 and limit["steps_per_second"] == pytest.approx(300.0)
    assert limit["sum_vs_processes_x_one_env_alone"] == pytest.approx(300.0 / (2 * 1000.0))


def test_scale_runs_every_case_end_to_end(tmp_path):
    """``--scenario scale --num-envs 2``: every case, the limit of min(cores, 2) processes in the
    JSON and the table, each backend's fraction of it, and every target listed with the machine."""
    backends = ["envmanager-vector-default", "gym.SyncVectorEnv"]
    stdout, data, _ = run_cli(tmp_path, "--scenario", "scale", "--num-envs", "2", "--steps", "60", "--no-warmup",
                              "--backends", *backends, "--targets", timeout=180)
    processes = min(cores(), 2)
    measured = [c for c in SCALE_CASES if scenario_unavailable(SCENARIOS[c]) is None]
    assert "scale-200us" in measured and "scale-cartpole" in measured
    for case in measured:
        result = check_measured(data, case, backends)
        assert result["n_env"] == 2
        limit = result["limit"]
        assert limit["processes"] == processes and len(limit["process_steps_per_second"][0]) == processes
        assert limit["steps_per_second"] == pytest.approx(sum(limit["process_steps_per_second"][0]))
        assert limit["sum_vs_processes_x_one_env_alone"] > 0
        assert set(result["ratios"]["vs limit"]) == set(backends)
        assert f"= the sum of {processes} process" in stdout
    assert data["scale"]["cases"] == measured and set(data["scale"]["fraction_of_limit"]) == set(backends)
    assert "== scale: fraction of the limit" in stdout
    for case in set(SCALE_CASES) - set(measured):
        assert data["scenarios"][case]["unavailable"]
    found = [t for t in data["targets"] if t["scenario"].startswith("scale-")]
    for case in SCALE_CASES:
        whats = {t["what"] for t in found if t["scenario"] == case}
        expected = scale_whats(processes, case, ["gym.SyncVectorEnv"] if case in measured else [])
        if case not in measured:
            expected.add("best of ours x every peer")
        assert whats == expected, case
    by = {(t["scenario"], t["what"]): t for t in found}
    step = by["scale-200us", f"drop-in step() x the {processes}-process limit"]
    assert step["measured"] and step["threshold"] == 0.85
    assert step["value"] == pytest.approx(data["scenarios"]["scale-200us"]["ratios"]["vs limit"]["envmanager-vector-default"])
    send = by["scale-200us", f"send/recv n/2 x the {processes}-process limit"]
    assert not send["measured"] and not send["met"] and "envmanager-batch was not run" in send["why_not"]
    assert by["scale-cartpole", f"drop-in step() x the {processes}-process limit"]["threshold"] == 0.3
    assert by["scale-20us", f"drop-in step() x the {processes}-process limit"]["threshold"] == 0.5
    assert by["scale-200us", "best of ours x gym.SyncVectorEnv"]["backend"] == "envmanager-vector-default"
    # the machine, once at the top of the targets and in the JSON
    where = data["meta"]["machine"]
    assert where["usable_cores"] == cores() and where["python"] == platform.python_version() and where["cpu"]
    head = stdout.split("== targets (medians)\n", 1)[1].splitlines()
    assert head[0] == f"   machine: {describe_machine(where)}" and stdout.count("machine: ") == 1
    assert ("the shared regime" in stdout) == (regime() == "shared")


@pytest.mark.skipif(pinning_unavailable() is not None, reason=f"pinning: {pinning_unavailable()}")
def test_cycle_runs_its_contenders_pinned(tmp_path):
    """``--scenario cycle``: one worker process on one core, the parent on another, its own
    contenders, the limit one env's rate on the worker's core, and its three targets."""
    stdout, data, _ = run_cli(tmp_path, "--scenario", "cycle", "--steps", "60", "--no-warmup", "--targets",
                              timeout=180)
    for case in CYCLE_CASES:
        contenders = CYCLE_LANES_CONTENDERS if case == "cycle-2lanes-200us" else CYCLE_CONTENDERS
        unavailable = {b for b in contenders if BACKENDS[b].why_not(SCENARIOS[case])}
        result = check_measured(data, case, [b for b in contenders if b not in unavailable])
        assert result["pinned"] and result["limit"]["cores"] == 1
        assert result["limit"]["steps_per_second"] == pytest.approx(result["limit"]["single_env_steps_per_second"][0])
        assert set(result["skipped"]) >= set(DEFAULT_BACKENDS) - set(contenders)
    assert "envmanager-db, envmanager-batch-db: 2 envs per worker (1 worker cores)" in stdout
    found = {t["scenario"]: t for t in data["targets"] if t["scenario"].startswith("cycle-")}
    assert {c: (t["threshold"], t["measured"]) for c, t in found.items()} == {
        "cycle-200us": (0.93, True), "cycle-63us": (0.80, True), "cycle-2lanes-200us": (0.97, True)}
    assert found["cycle-200us"]["backend"] == "envmanager-vector"
    lanes = data["scenarios"]["cycle-2lanes-200us"]["ratios"]["vs limit"]
    assert found["cycle-2lanes-200us"]["value"] == pytest.approx(max(lanes.values()))
    assert "== cycle: fraction of the limit" in stdout and "machine: " in stdout


def _result(name: str, rates: dict[str, float], limit: float | None = 1000.0, **kw) -> ScenarioResult:
    s = SCENARIOS[name]
    result = ScenarioResult(s, steps=100, repeats=1, **kw)
    if limit is not None and s.limit_processes:
        result.process_rates = [[ProcessRate(1, int(limit), 0.0, 1.0)]]
    elif limit is not None:
        result.single_env_rate = [limit]
    for backend, rate in rates.items():
        result.measurements[backend] = Measurement(backend, name, s.n_env)
        result.measurements[backend].add(int(rate), 1.0)
    return result


def test_targets_list_every_one_met_missed_or_not_measured():
    """Each target's value, threshold and verdict from made-up medians; what could not be measured
    is listed with why; a peer that does not apply is no target; the machine heads the list."""
    peers = {"gym.AsyncVectorEnv": 500.0, "sb3.SubprocVecEnv": 870.0}
    results = [
        _result("scale-200us", {"envmanager-vector-default": 860.0, "envmanager-batch": 910.0, "envmanager-sb3": 820.0,
                                **peers}),
        _result("scale-20us", {"envmanager-vector-default": 490.0, "envmanager-sb3": 470.0, "gym.AsyncVectorEnv": 100.0},
                skipped={"envpool": "not applicable: EnvPool runs its own C++ envs",
                         "tianshou.SubprocVectorEnv": "tianshou cannot be imported (ImportError: no)"},
                failed={"torchrl.ParallelEnv": "RuntimeError: boom"}),
        _result("scale-cartpole", {"envmanager-vector-default": 300.0, "envmanager-batch": 200.0, "envmanager-sb3": 300.0}),
        _result("scale-pong", {}, limit=None, unavailable="ale_py cannot be imported"),
        _result("cycle-200us", {"envmanager-vector": 940.0}),
        _result("cycle-63us", {"envmanager-vector": 790.0}),
        _result("cycle-2lanes-200us", {"envmanager-db": 960.0, "envmanager-batch-db": 975.0}),
    ]
    found = targets(results)
    p = results[0].limit_cores
    got = {(t.scenario, t.what): (t.backend, None if t.value is None else round(t.value, 3), t.threshold, t.met)
           for t in found}
    lim = f"x the {p}-process limit"
    assert got == {
        ("scale-200us", f"drop-in step() {lim}"): ("envmanager-vector-default", 0.86, 0.85, True),
        ("scale-200us", f"send/recv n/2 {lim}"): ("envmanager-batch", 0.91, 0.92, False),
        ("scale-200us", "send/recv n/2 x drop-in step()"): ("envmanager-batch", round(910 / 860, 3), 1.0, True),
        ("scale-200us", "SB3 drop-in x gym drop-in step()"): ("envmanager-sb3", round(820 / 860, 3), 0.95, True),
        ("scale-200us", "best of ours x gym.AsyncVectorEnv"): ("envmanager-batch", round(910 / 500, 3), 1.0, True),
        ("scale-200us", "best of ours x sb3.SubprocVecEnv"): ("envmanager-batch", round(910 / 870, 3), 1.0, True),
        ("scale-20us", f"drop-in step() {lim}"): ("envmanager-vector-default", 0.49, 0.5, False),
        ("scale-20us", "send/recv n/2 x drop-in step()"): ("envmanager-batch", None, 1.0, False),
        ("scale-20us", "SB3 drop-in x gym drop-in step()"): ("envmanager-sb3", round(470 / 490, 3), 0.95, True),
        ("scale-20us", "best of ours x gym.AsyncVectorEnv"): ("envmanager-vector-default", 4.9, 1.0, True),
        ("scale-20us", "best of ours x tianshou.SubprocVectorEnv"): ("envmanager-vector-default", None, 1.0, False),
        ("scale-20us", "best of ours x torchrl.ParallelEnv"): ("envmanager-vector-default", None, 1.0, False),
        ("scale-cartpole", f"drop-in step() {lim}"): ("envmanager-vector-default", 0.3, 0.3, True),
        ("scale-cartpole", "send/recv n/2 x drop-in step()"): ("envmanager-batch", round(200 / 300, 3), 1.0, False),
        ("scale-cartpole", "SB3 drop-in x gym drop-in step()"): ("envmanager-sb3", 1.0, 0.95, True),
        ("scale-pong", f"drop-in step() {lim}"): ("envmanager-vector-default", None, 0.85, False),
        ("scale-pong", f"send/recv n/2 {lim}"): ("envmanager-batch", None, 0.92, False),
        ("scale-pong", "send/recv n/2 x drop-in step()"): ("envmanager-batch", None, 1.0, False),
        ("scale-pong", "SB3 drop-in x gym drop-in step()"): ("envmanager-sb3", None, 0.95, False),
        ("scale-pong", "best of ours x every peer"): ("best of ours", None, 1.0, False),
        ("cycle-200us", "drop-in step() x the 1-worker-core limit"): ("envmanager-vector", 0.94, 0.93, True),
        ("cycle-63us", "drop-in step() x the 1-worker-core limit"): ("envmanager-vector", 0.79, 0.8, False),
        ("cycle-2lanes-200us", "two lanes (best) x the 1-worker-core limit"): ("envmanager-batch-db", 0.975, 0.97, True),
    }
    why = {(t.scenario, t.what): t.why_not for t in found if t.value is None}
    assert "tianshou cannot be imported" in why["scale-20us", "best of ours x tianshou.SubprocVectorEnv"]
    assert "torchrl.ParallelEnv failed: RuntimeError: boom" in why["scale-20us", "best of ours x torchrl.ParallelEnv"]
    assert "envmanager-batch was not run" in why["scale-20us", "send/recv n/2 x drop-in step()"]
    assert "ale_py cannot be imported" in why["scale-pong", f"drop-in step() {lim}"]

    where = {"cpu": "Some CPU @ 3.0GHz", "usable_cores": 16, "cpu_count": 32, "python": "3.12.1",
             "git": {"commit": "0123456789abcdef" * 2 + "01234567", "modified": False}}
    text = format_targets(found, where, ["a note"]).splitlines()
    assert text[:3] == ["== targets (medians)", "   machine: Some CPU @ 3.0GHz; 16 usable cores (of 32); Python 3.12.1; "
                        "commit 0123456789ab", "   a note"]
    assert len(text) == 3 + len(found)
    assert sum("NOT MEASURED: " in line for line in text) == sum(t.value is None for t in found)
    assert sum(line.endswith("  met") for line in text) == sum(t.met for t in found)
    assert "not a git checkout" in describe_machine({**where, "git": None})
    from envmanager.bench.runner import Target

    close = format_targets([Target("scale-20us", "w", "b", 0.4996, 0.5)])  # never shown as 0.50 and missed
    assert "0.4996  (target >= 0.5)  MISSED" in close


def test_a_limit_that_fails_is_reported_and_its_targets_not_measured():
    result = _result("scale-200us", {"envmanager-vector-default": 10.0}, limit=None)
    result.limit_failed = "RuntimeError: a limit process failed"
    found = {t.what: t for t in targets([result])}
    step = found[f"drop-in step() x the {result.limit_cores}-process limit"]
    assert step.value is None and "the limit failed: RuntimeError" in (step.why_not or "")


def test_machine_names_the_cpu_cores_python_and_commit():
    where = machine()
    assert where["usable_cores"] == len(os.sched_getaffinity(0)) and where["cpu_count"] == os.cpu_count()
    assert where["python"] == platform.python_version() and where["cpu"] not in ("", None)
    if os.path.exists(os.path.join(REPO, ".git")):
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        assert where["git"]["commit"] == head.stdout.strip()
    else:
        assert where["git"] is None
    with open("/proc/cpuinfo") as f:
        models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    if models:
        assert where["cpu"] == models[0]


def test_scale_description_names_its_envs_and_limit():
    s: Scenario = SCENARIOS["scale-cartpole"]
    assert s.description.startswith(f"{4 * cores()} CartPole-v1 envs")
    assert f"limit: {min(cores(), s.n_env)} processes" in s.description
    assert np.all(actions_for(s, 100) < s.n_actions)
