"""The Unity player processes of the ML-Agents backend: shutting a ``UnityEnvironment`` down for
good, and killing a player a killed worker left behind (:class:`PlayerProcesses`; and
:func:`kill_orphan_players` for one its worker never reported, which would otherwise connect to
the next worker on its port beside that worker's own player, their answers mixed)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PlayerIdentity", "PlayerProcesses", "shutdown_env", "player_identity", "kill_stale_player",
           "kill_orphan_players", "process_start_time"]

#: The command-line flag that tells a Unity player its trainer's port (``UnityEnvironment``'s).
PORT_FLAG = "--mlagents-port"

#: ``(pid, start time)`` of a launched player, to recognise it later without mistaking a reused pid.
PlayerIdentity = tuple[int, float | None]


class PlayerProcesses:
    """Each worker's current player; a player its worker replaced (the worker was restarted:
    nobody will ever talk to it again) is killed."""

    def __init__(self, ports: Sequence[int] = ()) -> None:
        self.current: dict[int, PlayerIdentity | None] = {}
        #: The ports its workers launch players for: ``kill_all`` sweeps them (``kill_orphan_players``).
        self.ports = tuple(ports)

    def started(self, players: dict[int, PlayerIdentity | None]) -> None:
        """The workers started and reported their players."""
        self.current = dict(players)

    def note(self, worker_id: int, player: PlayerIdentity | None) -> None:
        """Worker ``worker_id`` reported ``player`` (with a reset): a new one means its worker was
        restarted (maybe unseen, in a reset's drain): the old one is killed."""
        old = self.current.get(worker_id)
        self.current[worker_id] = player
        if old and old != player and kill_stale_player(old):
            logger.warning("killed player process %d left behind by a restarted worker", old[0])

    def kill_all(self) -> None:
        """After the workers were closed: kill any player still running (its worker was killed),
        those no worker reported too (killed while it launched them: found by their port)."""
        for identity in self.current.values():
            if identity and kill_stale_player(identity):
                logger.warning("killed player process %d left behind by its worker", identity[0])
        self.current = {}
        if self.ports:
            kill_orphan_players(self.ports)

    @property
    def pids(self) -> dict[int, int | None]:
        """``worker_id -> pid`` of each worker's current player (``None``: not launched by it)."""
        return {w: (identity[0] if identity else None) for w, identity in sorted(self.current.items())}


def shutdown_env(env: Any, timeout: float = 5.0) -> None:
    """Close ``env``; for a ``UnityEnvironment`` also reap its player and release gRPC and pipes,
    which its ``close()`` does not (it kills a player that does not quit but never reaps it, leaves
    a pipe end open and does not wait for the gRPC server to stop). ``timeout``: for the player."""
    from mlagents_envs.environment import UnityEnvironment  # (the subpackage needs mlagents_envs)

    if not isinstance(env, UnityEnvironment):
        env.close()
        return
    proc: subprocess.Popen | None = getattr(env, "_process", None)
    comm = getattr(env, "_communicator", None)
    try:
        env._close(timeout=timeout)  # status 400 to the player, wait, kill
    except Exception:
        logger.warning("closing the UnityEnvironment failed", exc_info=True)
    finally:
        with contextlib.suppress(Exception):
            atexit.unregister(env._close)
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                logger.warning("player process %d did not exit after SIGKILL", proc.pid)
        _release_communicator(comm)


def _release_communicator(comm: Any) -> None:
    server = getattr(comm, "server", None)
    if server is not None:
        with contextlib.suppress(Exception):
            server.stop(None).wait(5.0)
    servicer = getattr(comm, "unity_to_external", None)
    for name in ("parent_conn", "child_conn"):
        conn = getattr(servicer, name, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (an opaque number), or ``None`` if it is gone or unknown."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return float(fields[19])  # field 22, starttime in clock ticks
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:
        return None


def player_identity(env: Any) -> PlayerIdentity | None:
    pid = getattr(getattr(env, "_process", None), "pid", None)
    return (pid, process_start_time(pid)) if isinstance(pid, int) else None


def kill_orphan_players(ports: Iterable[int], wait_s: float = 5.0) -> list[int]:
    """Kill the players killed workers left behind for ``ports`` (their command lines name
    ``--mlagents-port <port>``); their pids. Only on a port nothing listens on: a live trainer's
    player is never touched (its trainer holds the port)."""
    import psutil

    free = {str(port) for port in ports if _port_free(port)}
    if not free:
        return []
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.info["pid"] != os.getpid() and any(
                arg == PORT_FLAG and cmdline[i + 1 : i + 2] and cmdline[i + 1] in free for i, arg in enumerate(cmdline)):
            try:
                process.kill()
                found.append(process)
            except psutil.Error:  # gone meanwhile, or not ours
                continue
    if found:
        psutil.wait_procs(found, timeout=wait_s)
        logger.warning("killed player process(es) %s left behind for port(s) %s by workers killed while they "
                       "launched them", [p.pid for p in found], ", ".join(sorted(free)))
    return [p.pid for p in found]


def _port_free(port: int) -> bool:
    """Whether ``port`` can be bound on localhost, as ``mlagents_envs``' ``check_port`` binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if sys.platform.startswith("linux"):  # a port closed lately stays in TIME_WAIT without it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("localhost", port))
        except OSError:
            return False
    return True


def kill_stale_player(identity: PlayerIdentity | None) -> bool:
    """SIGKILL a player left behind by a killed worker, if it still runs (same pid *and* start)."""
    if not identity or identity[1] is None:
        return False
    pid, started = identity
    if process_start_time(pid) != started:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True
