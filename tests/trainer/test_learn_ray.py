"""``envmanager-learn --ray-address``: the trainer here, its players on the nodes of a Ray
cluster (``ray.cluster_utils.Cluster``: two raylets on this machine), one node removed mid-run."""
from __future__ import annotations

import os
import re
import shutil
import tempfile

import psutil
import pytest

from process_helpers import alive

if os.environ.get("ENVMANAGER_REQUIRE_TRAINER") == "1":
    import mlagents.trainers.learn  # noqa: F401  (the trainer leg: an ImportError fails the run)
    import ray
else:
    pytest.importorskip("mlagents.trainers.learn", reason="ML-Agents' trainer (mlagents) is not installed")
    ray = pytest.importorskip("ray", reason="the Ray variant needs the extra: pip install 'envmanager[ray]'")

from ray.cluster_utils import Cluster
from trainer_run import AGENTS, TrainerRun, check_accounting, trainer_config

pytestmark = pytest.mark.timeout(600)

#: Notice a lost raylet in about a second (Ray's default takes tens of seconds).
FAST_HEALTH_CHECK = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200, "health_check_failure_threshold": 3}


@pytest.fixture(autouse=True)
def no_leaks():
    """Replaces the suite's per-test check (Ray's processes are this process's children); the
    test checks the run's processes, the fixture everything after the cluster's shutdown."""
    yield


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="rayc")  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": FAST_HEALTH_CHECK})
        yield c
    finally:
        if c is not None:
            c.shutdown()
        left = alive([p.pid for p in psutil.Process().children(recursive=True) if not _infrastructure(p)], timeout=15)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes left after the cluster's shutdown: {left}"


def _infrastructure(p: psutil.Process) -> bool:
    try:
        return any(s in " ".join(p.cmdline()) for s in ("resource_tracker", "forkserver"))
    except psutil.Error:
        return True


def test_players_on_ray_nodes_a_lost_node_is_replaced(cluster, tmp_path):
    worker_node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    run = TrainerRun(tmp_path, trainer_config(4000), num_envs=4,
                     extra_args=[f"--ray-address={cluster.address}", "--time-scale=3"])
    run.killed = set()
    try:
        run.start()
        # worker ids 0, 1 on the head's node, 2, 3 on the other: once 2 and 3 are well under way,
        # their node goes (raylet killed: its actor, workers and players die with it)
        assert run.watch(lambda r: sum(len(p.steps) for p in r.players() if p.worker_id in (2, 3)) >= 150), \
            run.log_text()[-3000:]
        lost = [p.pid for p in run.players() if p.worker_id in (2, 3)]
        run.killed.update(lost)
        cluster.remove_node(worker_node, allow_graceful=False)
        assert run.wait() == 0, run.log_text()[-4000:]
    finally:
        run.kill()
    log = run.log_text()
    replaced = r"Ray node 1 \(worker ids \[2, 3\]\) lost: restarting its players on Ray node "
    assert re.search(replaced + cluster.head_node.node_id, log), log[-4000:]
    players = run.players_by_worker()
    assert [len(players[w]) for w in range(4)] == [1, 1, 2, 2], players  # only the lost node's were started again
    for w in (2, 3):
        old, new = players[w]
        assert old.pid in lost and new.exit is not None and len(new.steps) > 0
        assert new.inputs[0]["command"] == "RESET" and new.inputs[0]["engine"]["time_scale"] == 3.0  # settings replayed
    dropped = 0
    for w in (2, 3):
        found = re.search(rf"worker {w} restarted: (\d+) agents' unfinished episodes cut, (\d+) of their steps dropped", log)
        assert found and int(found.group(1)) == AGENTS, log[-3000:]
        dropped += int(found.group(2))
    assert run.final_steps() >= 4000
    assert sorted(run.behavior_dir().glob("FakeBehavior-*.onnx"))
    assert not run.left_running(), run.left_running(0)
    check_accounting(run, dropped=dropped)
