"""Players the trainer attaches to (``AttachedUnityFactory``, ``MLAgentsEnvManager.attached``):
fake players started by the test, before the manager, connecting to it over real gRPC with the
real ``mlagents_envs`` client; the manager must never kill or restart them."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("mlagents_envs")
psutil = pytest.importorskip("psutil")

from envmanager import InvalidInputError  # noqa: E402
from envmanager.mlagents import MLAgentsEnvManager, UnityPortInUseError  # noqa: E402
from envmanager.mlagents.attach import (  # noqa: E402
    AddressInUseError,
    AttachedUnityFactory,
    PlayerAddress,
    PlayerLostError,
    parse_addresses,
)
from envmanager.testing import fake_unity  # noqa: E402
from envmanager.testing.fake_unity import free_base_port  # noqa: E402

B = "FakeBehavior?team=0"
CRASH_CODE = 7


class Players:
    """Fake players the test starts (``--sessions 0``: each outlives its trainer and waits for
    the next), and kills at the end: the manager must not."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.procs: list[subprocess.Popen] = []

    def start(self, port: int, *args: str) -> subprocess.Popen:
        record = self.directory / f"player-{port}.jsonl"
        command = [sys.executable, fake_unity.__file__, "--mlagents-port", str(port), "--sessions", "0",
                   "--connect-timeout", "120", "--agents", "2", "--discrete", "3", "--step-latency", "0.005",
                   "--record", str(record), *args]
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        proc.record = record  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def players(tmp_path):
    made = Players(tmp_path)
    yield made
    made.close()


def inputs(proc: subprocess.Popen) -> list[dict]:
    path = proc.record  # type: ignore[attr-defined]
    events = [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).exists() else []
    return [e for e in events if e["event"] == "input"]


def session_ends(proc: subprocess.Popen) -> list[dict]:
    path = proc.record  # type: ignore[attr-defined]
    events = [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).exists() else []
    return [e for e in events if e["event"] == "session_end"]


def pids_seen(steps) -> dict[int, int]:
    """worker_id -> the pid its player reported (``Fake/Pid``, sent once per session)."""
    return {s.worker_id: int(v) for s in steps for v, _ in s.environment_stats.get("Fake/Pid", [])}


def run_steps(manager, n: int) -> list:
    got = list(manager.first_step_infos)
    for _ in range(n):
        got += manager.get_steps()
    return got


def children_now() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "forkserver" not in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())}


# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_attaches_to_running_players_and_leaves_them_running(players):
    base = free_base_port(2)
    procs = [players.start(base), players.start(base + 1)]
    addresses = [f"127.0.0.1:{base}", f"localhost:{base + 1}"]
    for _session in range(2):  # the second proves the players outlived the first manager's close()
        manager = MLAgentsEnvManager.attached(addresses, seed=10, timeout_wait=30, timeout=90)
        try:
            assert manager.player_addresses == {0: PlayerAddress("127.0.0.1", base), 1: PlayerAddress("localhost", base + 1)}
            assert manager.player_pids == {0: None, 1: None}  # not launched by us: nothing to kill
            assert set(manager.training_behaviors) == {B}
            manager.reset()
            steps = run_steps(manager, 10)
            assert pids_seen(steps) == {0: procs[0].pid, 1: procs[1].pid}  # attached to the test's players
            assert {s.worker_id for s in steps if len(s.current_all_step_result[B][0]) == 2} == {0, 1}
        finally:
            manager.close()
        assert [p.poll() for p in procs] == [None, None], "close() ended an attached player"
    for proc in procs:
        got = inputs(proc)
        assert sum(e["command"] == "RESET" for e in got) >= 2  # one session each time
        assert any(e["command"] == "STEP" for e in got)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_lost_player_is_an_error_naming_its_address_and_nothing_is_killed(players, mode):
    """A player that exits (its connection closes: seen at once) or hangs (silent for
    ``timeout_wait``) is an error naming it; it is not killed, nor any other player."""
    base = free_base_port(2)
    healthy = players.start(base)
    crashing = players.start(base + 1, "--crash-after-steps", "3", "--crash-mode", mode,
                             "--crash-exit-code", str(CRASH_CODE))
    manager = MLAgentsEnvManager.attached([f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"], timeout_wait=10, timeout=60)
    try:
        manager.reset()
        deadline = time.monotonic() + 120
        with pytest.raises(PlayerLostError) as caught:
            while time.monotonic() < deadline:
                manager.get_steps()
        err = caught.value
        assert (err.worker_id, err.address) == (1, PlayerAddress("127.0.0.1", base + 1))
        assert f"the player at 127.0.0.1:{base + 1} (worker 1) is lost" in str(err)
        assert "neither restarted nor killed" in str(err)
        account = {"exit": f"the player at 127.0.0.1:{base + 1} closed its connection: it stopped or crashed",
                   "hang": f"the player at 127.0.0.1:{base + 1} sent nothing for 10 s"}[mode]
        assert account in str(err)  # the worker's
        assert manager.restart_counts == [0, 0]  # never restarted
        assert healthy.poll() is None  # the error touched no other player
    finally:
        manager.close()
    if mode == "exit":
        assert crashing.wait(10) == CRASH_CODE  # it ended by itself (not killed: that is -9)
    else:
        assert crashing.poll() is None  # hung, and left so (the test kills it)
    assert healthy.poll() is None
    # the healthy one still serves a trainer
    with MLAgentsEnvManager.attached([f"127.0.0.1:{base}"], timeout_wait=30, timeout=90) as again:
        again.reset()
        assert pids_seen(run_steps(again, 3)) == {0: healthy.pid}
    assert healthy.poll() is None


@pytest.mark.timeout(120)
def test_a_player_outlives_a_trainer_that_went_away_mid_exchange(players):
    """A trainer that goes away while the player's Exchange waits in its server (mlagents'
    servicer then raises on its closed pipe: the player sees UNKNOWN, not UNAVAILABLE) ends only
    that session: the player waits for the next trainer. Seen in CI as a race at ``close()``
    (an Exchange that arrived as the trainer closed); made certain here with mlagents' own
    ``RpcCommunicator``, its pipe closed under a live session."""
    base = free_base_port(1)
    player = players.start(base)
    trainer = textwrap.dedent(f"""
        import json, time
        from pathlib import Path
        from mlagents_envs.communicator_objects.unity_input_pb2 import UnityInputProto
        from mlagents_envs.rpc_communicator import RpcCommunicator
        first = RpcCommunicator(worker_id=0, base_port={base}, timeout_wait=60)
        inputs = UnityInputProto()
        inputs.rl_initialization_input.seed = 3
        inputs.rl_initialization_input.communication_version = "1.5.0"
        first.initialize(inputs)  # handshake done; the player's next Exchange now waits in the servicer
        first.unity_to_external.parent_conn.close()  # the trainer's side goes, without Unity's close message
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "session_end" not in Path({str(player.record)!r}).read_text():
            time.sleep(0.1)
        first.server.stop(None).wait(10)
    """)
    subprocess.run([sys.executable, "-c", trainer], timeout=90, check=True)
    assert session_ends(player)[0]["reason"] == "connection_lost:UNKNOWN"  # the path taken
    assert all(e["reason"].startswith("connection_lost") for e in session_ends(player))
    with MLAgentsEnvManager.attached([f"127.0.0.1:{base}"], timeout_wait=30, timeout=90) as again:
        again.reset()
        assert pids_seen(run_steps(again, 3)) == {0: player.pid}
    assert player.poll() is None


@pytest.mark.timeout(120)
def test_a_player_that_never_connects_is_an_error_naming_its_address(players):
    base = free_base_port(2)
    there = players.start(base)
    with MLAgentsEnvManager.attached([f"127.0.0.1:{base}"], timeout_wait=60, timeout=90):
        pass  # it is up (and connects again at once: a short timeout_wait below is about the other)
    # the deadline is waited out for the absent player; the running one reconnects within its
    # gRPC backoff (at most 1 s)
    with pytest.raises(PlayerLostError) as caught:
        MLAgentsEnvManager.attached([f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"], timeout_wait=5, timeout=60)
    err = caught.value
    assert (err.worker_id, err.address) == (1, PlayerAddress("127.0.0.1", base + 1))
    assert f"no player connected to 127.0.0.1:{base + 1} within 5 s" in str(err)
    assert there.poll() is None


@pytest.mark.timeout(60)
def test_bad_input_is_rejected_before_anything_starts(tmp_path):
    before = children_now()
    for bad, why in [("localhost", "is not 'host:port'"), ("localhost:x", "must be a number"),
                     ("localhost:70000", "must be a number in 1..65535"), (":5005", "is not 'host:port'"),
                     ("::1:5005", "IPv6: '[::1]:5005'"), ("localhost:5005,localhost:5005", "given twice"),
                     ("", "is not 'host:port'")]:
        with pytest.raises(InvalidInputError, match=None) as caught:
            MLAgentsEnvManager.attached(bad, timeout_wait=10, timeout=30)
        assert why in str(caught.value), (bad, str(caught.value))
    assert parse_addresses("[::1]:5005, 127.0.0.1:5006") == (PlayerAddress("::1", 5005), PlayerAddress("127.0.0.1", 5006))
    assert str(PlayerAddress("::1", 5005)) == "[::1]:5005"
    base = free_base_port(3)
    with pytest.raises(InvalidInputError, match="2 player addresses for 3 envs"):
        MLAgentsEnvManager(AttachedUnityFactory(parse_addresses(f"127.0.0.1:{base},127.0.0.1:{base + 1}")), 3)
    for bad in (float("nan"), float("inf"), 0, "10"):  # NaN would never pass; inf is no deadline
        with pytest.raises(InvalidInputError, match="timeout_wait must be a positive, finite"):
            MLAgentsEnvManager.attached([f"127.0.0.1:{base}"], timeout_wait=bad, timeout=30)
    with pytest.raises(InvalidInputError, match=r"cannot listen there"):
        MLAgentsEnvManager.attached([f"192.0.2.1:{base}"], timeout_wait=10, timeout=30)  # TEST-NET-1: not ours
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        with pytest.raises(AddressInUseError) as caught:
            MLAgentsEnvManager.attached([f"127.0.0.1:{base}", f"127.0.0.1:{base + 2}"], timeout_wait=10, timeout=30)
    err = caught.value
    assert isinstance(err, UnityPortInUseError) and err.address == PlayerAddress("127.0.0.1", base + 2)
    assert f"cannot listen for the player at 127.0.0.1:{base + 2} (worker 1): port {base + 2} is in use" in str(err)
    assert children_now() == before  # no worker was started
