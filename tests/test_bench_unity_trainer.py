"""The ``unity-trainer`` scenarios' setups, contenders and ratios, without running a trainer
(the real runs are in ``tests/trainer/test_bench_trainer*.py``). No timing is asserted: the
ratios are computed from made-up measurements."""

from __future__ import annotations

import sys
import time

from envmanager import cli
from envmanager.bench import SCENARIOS, Measurement
from envmanager.bench import unity_trainer as ut


def test_scenarios_parse_and_have_8_and_16_players_and_the_switch():
    for name in ("unity-trainer", "unity-trainer-scale"):
        args = cli.build_parser().parse_args(["bench", "--scenario", name, "--steps", "500"])
        assert args.scenario == [name]
    full = ut.setups_for(SCENARIOS["unity-trainer"])
    scale = ut.setups_for(SCENARIOS["unity-trainer-scale"])
    assert {s.n_env for s in full} == {1, 2, 4, 8, 16} and {(s.n_env, s.uneven) for s in scale} == {
        (4, False), (8, True), (16, True)}
    contenders = {c.name: c for c in ut.contenders_for(scale)}
    assert contenders["mlagents-learn 16 envs uneven"] == ("mlagents-learn 16 envs uneven", ut.THEIRS,
                                                           ut.Setup(16, True), None)
    assert contenders["envmanager-learn 16 envs uneven"].batched == "on"
    assert contenders["envmanager-learn unbatched 16 envs uneven"].batched == "off"
    assert "envmanager-learn unbatched 1 env" not in ut.CONTENDERS  # one player: nothing to batch
    assert [s.steps(1000) for s in scale] == [1000, 2000, 4000]


def test_ratios_and_targets_from_rows():
    """Each row's speed and trainer CPU against mlagents-learn's and batched against unbatched;
    issue 32's targets on the 16- and 4-player rows."""
    scenario = SCENARIOS["unity-trainer-scale"]
    result = ut.TrainerResult(scenario, 1000, 1)
    rows = {"": (1000.0, 0.6), " unbatched": (1500.0, 0.5), "-ours": (2500.0, 0.25)}
    for s in ut.setups_for(scenario):
        for suffix, (rate, cpu) in rows.items():
            name = {"": ut.THEIRS, " unbatched": ut.UNBATCHED, "-ours": ut.OURS}[suffix] + s.label
            m = result.measurements.setdefault(name, Measurement(name, scenario.name, s.n_env))
            m.add(int(rate), 1.0)
            result.cpu[name] = [cpu]
    ratios = result.ratios()
    assert ratios["vs mlagents-learn"]["envmanager-learn 16 envs uneven"] == 2.5
    assert ratios["vs mlagents-learn"]["envmanager-learn unbatched 16 envs uneven"] == 1.5
    assert abs(ratios["CPU saved x"]["envmanager-learn 16 envs uneven"] - 2.4) < 1e-9
    assert abs(ratios["vs unbatched"]["envmanager-learn 4 envs"] - 2500 / 1500) < 1e-9
    targets = {(t.what, t.backend): t for t in result.targets()}
    assert targets[("16 players: steps/s x mlagents", "envmanager-learn 16 envs uneven")].threshold == 2.0
    assert targets[("16 players: trainer CPU saved x", "envmanager-learn 16 envs uneven")].met
    assert targets[("4 players: steps/s x unbatched", "envmanager-learn 4 envs")].met
    assert not any("unbatched" in backend for _, backend in targets)  # targets are the batched default's
    assert set(result.to_dict()["cpu_seconds_per_1000_steps"]) == set(result.measurements)


FAKE_TRAINER = '''\
import subprocess, sys, threading, time

PLAYER = "import sys, time\\nsys.stdin.readline()\\nend = time.process_time() + 0.6\\n" \\
         "while time.process_time() < end: pass\\nprint(flush=True)\\nsys.stdin.readline()"

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

# A trainer busy in two threads (as torch's) around its first summary, idle at its last; a player
# that uses its CPU after the first summary, is seen idle at the second and exits before the last.
player = subprocess.Popen([sys.executable, "-c", PLAYER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
for step in range(1, 7):
    if step == 2:
        time.sleep(1.0)  # (the first summary is read meanwhile)
        player.stdin.write("go\\n"); player.stdin.flush()
        player.stdout.readline()  # its CPU used
    if step == 3:
        time.sleep(1.5)  # (the second summary is read meanwhile)
        player.stdin.close(); player.wait()
    threads = [threading.Thread(target=burn, args=(0.8 if step == 1 else 0.0,)) for _ in range(2)]
    for t in threads:
        t.start()
    print(f"Step: {step * 500}. Time Elapsed: 1.0 s.", flush=True)  # (read while these threads burn)
    for t in threads:
        t.join()
'''


def test_a_trainers_cpu_and_its_trees_are_read_together(tmp_path, monkeypatch):
    """The trainer's own CPU and its tree's are read in one pass: between two summaries the tree's
    is the trainer's and its players', a player that exited before the last summary included. (A
    CI run read them apart, a slow walk of the tree between: a trainer busy at its first summary
    and idle at its last had a tree that used less CPU than itself.)"""
    import psutil

    walk = psutil.Process.children

    def slow_walk(self, *args, **kwargs):  # as on a loaded machine, where it took this long
        time.sleep(0.3)
        return walk(self, *args, **kwargs)

    monkeypatch.setattr(psutil.Process, "children", slow_walk)
    tool = tmp_path / "fake-trainer"
    tool.write_text(f"#!{sys.executable}\n{FAKE_TRAINER}")
    tool.chmod(0o755)
    run = ut.measure_run(tool, tmp_path / "trainer.yaml", "player", 1, tmp_path, 0)
    assert run.steps == 2500 and run.cpu > 0, run
    assert run.tree_cpu >= run.cpu + 0.4, run  # the player's 0.6 s, gone before the last summary
