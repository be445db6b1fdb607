"""``envmanager bench`` on real environments and against every peer: the sweep, atari, mujoco,
tianshou, TorchRL, PufferLib, EnvPool and ``envmanager-auto``; tiny step counts, never timing asserts.

Each scenario or peer needs an optional extra; its test skips when the extra is missing, and
a test checks that the bench itself then skips it with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import pytest

from envmanager import cli
from envmanager.bench import BACKENDS, SCENARIOS, Measurement, ScenarioResult, peers, run_scenario, targets
from envmanager.bench.report import format_sweep, format_table, sweep_fractions
from envmanager.bench.scenarios import GROUPS, SWEEP_COSTS, Scenario, actions_for, scenario_unavailable
from envmanager.testing.envs import ControlledEnv
from test_bench import PNG_MAGIC, check_measured, child_env, run_cli

OURS_FIXED = ["envmanager", "envmanager-k", "envmanager-auto"]
PUFFER = ["pufferlib.Multiprocessing", "pufferlib.Multiprocessing-sync"]


def has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def test_sweep_runs_every_step_cost_against_the_limit(tmp_path):
    backends = [*OURS_FIXED, "gym.SyncVectorEnv"]
    stdout, data, _ = run_cli(tmp_path, "--scenario", "sweep", "--steps", "48", "--no-warmup",
                              "--backends", *backends, timeout=180)
    assert GROUPS["sweep"] == [f"sweep-{s}" for s in ("5us", "20us", "50us", "200us", "1ms", "5ms")]
    for name in GROUPS["sweep"]:
        result = check_measured(data, name, backends)
        assert result["limit"]["steps_per_second"] > 0
        assert set(result["ratios"]["vs limit"]) == set(backends)
        assert set(result["ratios"]["vs best fixed"]) == {"envmanager-auto"}
        assert result["auto_envs_per_worker"] >= 1
    sweep = data["sweep"]
    assert sweep["step_costs"] == list(SWEEP_COSTS)
    assert set(sweep["fraction_of_limit"]) == set(backends)
    assert all(v > 0 for values in sweep["fraction_of_limit"].values() for v in values)
    assert "== sweep: fraction of the limit" in stdout
    assert "envmanager-auto: chose" in stdout
    # even CPU-bound steps, cheap or expensive, are packed (on more than one core)
    if data["meta"]["cores"] > 1:
        for name in ("sweep-5us", "sweep-5ms"):
            assert data["scenarios"][name]["auto_envs_per_worker"] > 1


def test_targets_only_with_the_flag(tmp_path):
    backends = ["envmanager-auto", "envmanager", "gym.SyncVectorEnv"]
    args = ("--scenario", "sweep-200us", "--steps", "32", "--no-warmup", "--backends", *backends)
    stdout, data, _ = run_cli(tmp_path, *args)
    assert "== targets" not in stdout and "MISSED" not in stdout and "(target >=" not in stdout
    assert data["targets"]  # the JSON keeps them
    stdout, data, _ = run_cli(tmp_path, *args, "--targets")
    assert "== targets (medians)" in stdout
    found = {(t["what"], t["backend"]) for t in data["targets"]}
    assert ("auto x best fixed layout", "envmanager-auto") in found
    assert ("x the 2-core limit" if data["meta"]["cores"] >= 2 else "x the 1-core limit", "envmanager-auto") in found


@pytest.mark.skipif(not has("ale_py"), reason="needs the atari extra (ale-py)")
def test_atari(tmp_path):
    backends = ["envmanager-auto", "envmanager-batch", "gym.SyncVectorEnv", "envpool"]
    _stdout, data, _ = run_cli(tmp_path, "--scenario", "atari", "--steps", "32", "--no-warmup",
                              "--backends", *backends, timeout=120)
    result = data["scenarios"]["atari"]
    measured = [b for b in backends if b not in result["skipped"]]
    check_measured(data, "atari", measured)
    assert set(backends) - set(measured) <= {"envpool"}  # envpool only when it runs here
    assert result["limit"]["steps_per_second"] > 0
    if "envpool" in measured:
        assert "vs envpool" in result["ratios"]


@pytest.mark.skipif(not has("mujoco"), reason="needs the mujoco extra (gymnasium[mujoco])")
def test_mujoco_continuous_actions_in_every_style(tmp_path):
    backends = ["envmanager", "envmanager-k", "envmanager-batch", "envmanager-vector", "gym.SyncVectorEnv"]
    _stdout, data, _ = run_cli(tmp_path, "--scenario", "mujoco", "--steps", "64", "--no-warmup",
                              "--backends", *backends, timeout=120)
    result = check_measured(data, "mujoco", backends)
    assert result["limit"]["steps_per_second"] > 0


def test_continuous_actions_are_the_same_for_every_backend():
    scenario = SCENARIOS["mujoco"]
    actions = actions_for(scenario, 64)
    assert actions.shape[1:] == (8, 6) and actions.dtype.kind == "f"
    assert (abs(actions) <= 1).all()
    assert (actions == actions_for(scenario, 64)).all()


@pytest.mark.parametrize("backend, module", [("tianshou.SubprocVectorEnv", "tianshou"),
                                             ("tianshou.ShmemVectorEnv", "tianshou"),
                                             ("torchrl.ParallelEnv", "torchrl")])
def test_python_peers(tmp_path, backend, module):
    if not has(module):
        pytest.skip(f"needs {module} (extra peers)")
    _stdout, data, _ = run_cli(tmp_path, "--scenario", "cartpole", "cpu", "--steps", "64", "--no-warmup",
                              "--backends", backend, "gym.SyncVectorEnv", timeout=180)
    for scenario in ("cartpole", "cpu"):
        result = check_measured(data, scenario, [backend, "gym.SyncVectorEnv"])
        column = peers_column(backend)
        assert result["ratios"][column][backend] == pytest.approx(1.0)


@pytest.mark.skipif(not has("pufferlib"), reason="needs PufferLib's vector module (extra peers: pufferlib-core)")
def test_pufferlib(tmp_path):
    """PufferLib's Multiprocessing in batches of half the envs and in full batches; pinned to one
    worker core, only in full batches (its batches are whole processes, one per core)."""
    backends = [*PUFFER, "gym.SyncVectorEnv"]
    stdout, data, _ = run_cli(tmp_path, "--scenario", "cartpole", "pinned-200us", "--steps", "64", "--no-warmup",
                              "--backends", *backends, timeout=180)
    one_core = data["meta"]["cores"] < 2
    cartpole = check_measured(data, "cartpole", backends[one_core:])
    assert cartpole["ratios"]["vs puffer-sync"]["pufferlib.Multiprocessing-sync"] == pytest.approx(1.0)
    if not one_core:
        assert "vs puffer" in cartpole["ratios"]
        assert "pufferlib.Multiprocessing: 2 processes x 4 envs, batches of 4" in stdout
    pinned = data["scenarios"]["pinned-200us"]
    if pinned["unavailable"] is None:
        if data["meta"]["cores"] == 2:  # one worker core: one process, one batch
            check_measured(data, "pinned-200us", backends[1:])
            assert pinned["skipped"]["pufferlib.Multiprocessing"].startswith("not applicable on 1 worker core")
            assert "pufferlib.Multiprocessing-sync: 1 process x 8 envs, batches of 8" in stdout
        else:
            check_measured(data, "pinned-200us", backends)


class ActionLogEnv(ControlledEnv):
    """Appends every action it is given to the file ``<folder>/<env_id>``."""

    def __init__(self, folder: str, env_id: int) -> None:
        super().__init__(env_id)
        self.path = os.path.join(folder, str(env_id))

    def step(self, action):
        with open(self.path, "a") as log:
            log.write(f"{int(action)}\n")
        return super().step(action)


def action_scenario(folder: str) -> Scenario:
    return Scenario("actions", "4 envs logging their actions", functools.partial(ActionLogEnv, folder), 4, 64, n_actions=3)


def log_actions(backend: str, folder: str) -> int:
    """Run ``backend`` on :func:`action_scenario` (in a child process of the test: PufferLib's
    shared arrays keep an fd of multiprocessing's heap open for the life of the process)."""
    scenario = action_scenario(folder)
    done, _ = BACKENDS[backend].run(scenario, 64, actions_for(scenario, 64), lambda n: None)
    return done


@pytest.mark.parametrize("backend", PUFFER)
def test_pufferlib_gives_each_env_its_own_actions(tmp_path, backend):
    """Env ``i``'s ``k``-th step gets ``actions[k, i]``, as in every other backend."""
    why = BACKENDS[backend].why_not(action_scenario(str(tmp_path)))
    if why:
        pytest.skip(why)
    code = "import sys; from test_bench_real import log_actions; print(log_actions(*sys.argv[1:]))"
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", code, backend, str(tmp_path)], env=child_env(tests), check=True,
                         timeout=120, capture_output=True, text=True).stdout
    done = int(out.split()[-1])
    actions = actions_for(action_scenario(str(tmp_path)), 64)
    stepped = 0
    for i in range(4):
        got = [int(a) for a in (tmp_path / str(i)).read_text().split()]
        assert got == actions[: len(got), i].tolist()
        stepped += len(got)
    assert stepped >= done >= 64  # the batch still in flight at the end may have stepped too


def test_pufferlib_layout(monkeypatch):
    """One process per worker core, ``n_env`` divisible by it, batches of whole processes."""
    cases = {  # worker cores: (batched, full batch) (num_workers, batch_size) for 8 and 64 envs
        1: ((1, 8), (1, 64)), 2: ((2, 4), (2, 8), (2, 32), (2, 64)), 3: ((2, 4), (2, 8), (2, 32), (2, 64)),
        4: ((4, 4), (4, 8), (4, 32), (4, 64)), 16: ((8, 4), (8, 8), (16, 32), (16, 64)),
    }
    for cores_, expected in cases.items():
        monkeypatch.setattr(peers, "worker_cores", lambda scenario, n=cores_: n)
        layouts = [peers.pufferlib_layout(SCENARIOS[name], batched) for name in ("cartpole", "many")
                   for batched in (True, False) if cores_ > 1 or not batched]
        assert tuple(layouts) == expected, cores_
        if cores_ == 1:
            assert peers.pufferlib_batched_unavailable(SCENARIOS["cartpole"]).startswith("not applicable on 1 worker")


def peers_column(backend: str) -> str:
    from envmanager.bench.runner import PEER_COLUMNS

    return PEER_COLUMNS[backend]


def test_missing_extras_are_skipped_with_the_reason(monkeypatch):
    """With the extras gone, atari and mujoco are not available and the peers are skipped, saying why."""
    for module in ("ale_py", "mujoco", "tianshou", "tianshou.env", "torchrl", "torchrl.envs", "pufferlib",
                   "pufferlib.vector"):
        monkeypatch.setitem(sys.modules, module, None)  # ``import module`` now fails
    peers._import_problem.cache_clear()
    try:
        assert "ale_py cannot be imported" in scenario_unavailable(SCENARIOS["atari"])
        assert "mujoco cannot be imported" in scenario_unavailable(SCENARIOS["mujoco"])
        result = run_scenario(SCENARIOS["sweep-50us"], ["gym.SyncVectorEnv", "tianshou.ShmemVectorEnv",
                                                        "torchrl.ParallelEnv", "pufferlib.Multiprocessing-sync",
                                                        "envpool"], steps=16, repeats=1, warmup=False)
        assert "tianshou cannot be imported" in result.skipped["tianshou.ShmemVectorEnv"]
        assert "torchrl cannot be imported" in result.skipped["torchrl.ParallelEnv"]
        assert "pufferlib cannot be imported" in result.skipped["pufferlib.Multiprocessing-sync"]
        assert result.skipped["envpool"].startswith("not applicable")
        assert "skipped tianshou.ShmemVectorEnv: tianshou cannot be imported" in format_table(result)
    finally:
        peers._import_problem.cache_clear()


def fake_result(name: str, rates: dict[str, float], single_env_rate: float | None = None) -> ScenarioResult:
    result = ScenarioResult(SCENARIOS[name], steps=100, repeats=1)
    for backend, rate in rates.items():
        result.measurements[backend] = Measurement(backend, name, 8)
        result.measurements[backend].add(100, 100 / rate)
    if single_env_rate:
        result.single_env_rate.append(single_env_rate)
    return result


def fake_sweep() -> list[ScenarioResult]:
    """Made-up results of every sweep point (one env: 1000 steps/s in process) and of cartpole."""
    results = [fake_result(n, {"envmanager": 500.0, "envmanager-k": 800.0, "envmanager-auto": 760.0,
                               "gym.SyncVectorEnv": 400.0}, 1000.0) for n in GROUPS["sweep"]]
    results.append(fake_result("cartpole", {"envmanager-auto": 300.0, "tianshou.SubprocVectorEnv": 100.0}))
    return results


def test_sweep_summary_plot_and_auto_ratio(tmp_path):
    """Without any process: the sweep's fractions, its table and curve, auto against the best fixed choice."""
    pytest.importorskip("matplotlib")
    from envmanager.bench.backends import cores

    results = fake_sweep()
    costs, curves = sweep_fractions(results)
    assert costs == list(SWEEP_COSTS)
    assert curves["envmanager-k"] == [pytest.approx(800 / (1000 * min(cores(), 8)))] * len(SWEEP_COSTS)
    assert results[0].ratios()["vs best fixed"] == {"envmanager-auto": pytest.approx(0.95)}
    assert results[-1].ratios()["vs ts.Subproc"]["envmanager-auto"] == pytest.approx(3.0)
    text = format_sweep(results)
    assert "5 us" in text and "5 ms" in text and "envmanager-auto" in text
    auto = [t for t in targets(results) if t.what == "auto x best fixed layout"]
    assert len(auto) == len(SWEEP_COSTS) and all(t.met for t in auto)  # 0.95 >= 0.95
    # the plot in a child process: matplotlib keeps font files open for the life of a process
    path = tmp_path / "sweep.png"
    code = ("import sys; from test_bench_real import fake_sweep; from envmanager.bench.report import write_plot; "
            "write_plot(sys.argv[1], fake_sweep())")
    tests = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, "-c", code, str(path)], env=child_env(tests), check=True, timeout=60)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_new_choices_parse():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--scenario", "sweep", "atari", "mujoco", "--targets",
                              "--backends", "envmanager-auto", "tianshou.ShmemVectorEnv", "torchrl.ParallelEnv"])
    assert args.targets and args.scenario == ["sweep", "atari", "mujoco"]
    assert not parser.parse_args(["bench"]).targets
    assert BACKENDS["envmanager-auto"].ours and not BACKENDS["torchrl.ParallelEnv"].ours
