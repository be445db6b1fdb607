"""What one Ray node runs for :class:`~envmanager.mlagents.ray_env_manager.RayMLAgentsEnvManager`:
its share of the players, through the core's ``SubprocessEnvManager``. :class:`PlayerNode` is a
plain class (no ``ray`` import) that the driver runs as a Ray actor; it speaks the trainer's global
worker ids (consecutive on a node), its core counts from 0.

Every call answers ``(value, error)``: ``error`` is what the players raised that no restart on the
node absorbed (at start too, answered by :meth:`PlayerNode.info`), naming global ids; an exception
(or a dead or silent actor) is the node's own failure: the driver replaces the node. A
replacement on the same host first kills what the lost one left there, so its players get the ports.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from envmanager.core.deadline import Deadline
from envmanager.core.manager import SubprocessEnvManager
from envmanager.core.results import StepInfo
from envmanager.errors import EnvManagerError, failed_slots, with_slot_offset
from envmanager.mlagents.player_process import PlayerIdentity, PlayerProcesses, kill_stale_player, process_start_time
from envmanager.mlagents.replay import call_replayed, reset_restarted
from envmanager.mlagents.worker_env import WorkerEnvFactory, player_ports

logger = logging.getLogger(__name__)

__all__ = ["GlobalIdsFactory", "PlayerNode", "Answer"]

ReplayCall = tuple[str, tuple, dict]
T = TypeVar("T")
#: What every call of a node answers: its value, or what its players raised (global ids).
Answer = tuple[T | None, BaseException | None]


class GlobalIdsFactory:
    """``factory(local slot)`` -> ``worker_factory(global worker id)``: picklable."""

    def __init__(self, worker_factory: WorkerEnvFactory, ids: Sequence[int]) -> None:
        self.worker_factory, self.ids = worker_factory, list(ids)

    def __call__(self, local: int) -> Any:
        return self.worker_factory(self.ids[local])


class PlayerNode:
    """The players of worker ids ``ids`` on this node, with their settings (``replay_calls``,
    applied before the first reset and on every restart)."""

    def __init__(self, worker_factory: WorkerEnvFactory, ids: Sequence[int], options: dict[str, Any],
                 replay_calls: Sequence[ReplayCall] = (),
                 left_behind: tuple[str, list[PlayerIdentity]] | None = None) -> None:
        self.ids = list(ids)
        if self.ids != list(range(self.ids[0], self.ids[0] + len(self.ids))):
            raise ValueError(f"a node hosts consecutive worker ids, not {self.ids}")
        self.offset = self.ids[0]
        self.local = {g: i for i, g in enumerate(self.ids)}
        self.held: list[StepInfo] = []  # results taken from the core, not handed to the driver yet
        self.core: Any = None
        self.players = PlayerProcesses(player_ports(worker_factory.env_factory, self.ids))
        self.start_error: BaseException | None = None  # what the players raised when starting
        if left_behind is not None and left_behind[0] == socket.gethostname():
            _kill_left_behind(left_behind[1])
        try:
            # a Unity player holding gRPC state must not be forked: forkserver, as MLAgentsEnvManager
            self.core = SubprocessEnvManager(GlobalIdsFactory(worker_factory, self.ids), len(self.ids), shared_memory=False,
                                             **{"context": "forkserver", **options})
            self.players.started(dict(zip(self.ids, self.core.get_attr("player"), strict=True)))
            self.core.set_replay_calls(list(replay_calls))
            for name, args, kwargs in replay_calls:
                self.core.call_on(None, name, args, kwargs)
        except Exception as exc:
            self.close()
            self.core = None
            if not isinstance(exc, EnvManagerError):
                raise with_slot_offset(exc, self.offset) from None
            self.start_error = with_slot_offset(exc, self.offset)  # the players': answered by info()

    def info(self) -> Answer[dict[str, Any]]:
        """Where the node runs and its processes' identities (for a replacement on this host to
        kill), or what its players raised when starting."""
        if self.start_error is not None:
            return None, self.start_error
        import ray  # (runs in a Ray actor: this module itself imports no Ray)

        workers = [w.pid for w in self.core.processes]
        processes = [(pid, process_start_time(pid)) for pid in workers]
        processes += [p for p in self.players.current.values() if p]
        return {"ray_node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(), "pid": os.getpid(),
                "ids": self.ids, "worker_pids": workers, "player_pids": self.players.pids, "processes": processes}, None

    # -- the calls (each answers ``(value, error)``) --------------------------------------------

    def reset(self, ids: Sequence[int] | None = None) -> Answer[list[StepInfo]]:
        """Reset every player (steps in flight dropped), or the players ``ids`` (idle ones)."""
        def run() -> list[StepInfo]:
            if ids is None:
                self.held = []
                return self._out(self.core.reset())
            local = [self.local[g] for g in ids]
            self.core.send_reset(dict.fromkeys(local, (None, None)))
            return self._out(self.core.receive_resets(local))

        return self._answer(run)

    def step(self, actions: dict[int, Any], timeout: float | None = None) -> Answer[list[StepInfo]]:
        """Send ``actions`` (to players the driver saw idle), then at least one finished step,
        within ``timeout``. Results the node took meanwhile come first; their players, and
        those still restarting, are not sent the actions (chosen for what the driver saw)."""
        def run() -> list[StepInfo]:
            failed: EnvManagerError | None = None
            try:
                self.held += self.core.receive_steps(min_count=0)  # what came meanwhile (a restart's fresh reset)
            except EnvManagerError as exc:  # raised below, once the other players have their actions
                failed = exc
            named = set(failed_slots(failed)) if failed is not None else set()
            ready = set(self.core.idle_worker_ids) - {info.worker_id for info in self.held} - named
            local = {self.local[g]: action for g, action in actions.items()}
            send = {i: action for i, action in local.items() if i in ready and self.core.failure_of(i) is None}
            if send:
                self.core.send_step(send)
            if failed is not None:  # what came stays held: the driver's next request takes it
                raise failed
            out, self.held = self.held, []
            return self._out(out or self.core.receive_steps(timeout))

        return self._answer(run)

    def call_on(self, ids: Sequence[int] | None, name: str, args: tuple = (), replayed: bool = False) -> Answer[list[Any]]:
        """``name(*args)`` on the players ``ids`` (all: ``None``); ``replayed``: a setting every
        restart replays (:mod:`envmanager.mlagents.replay`)."""
        def run() -> list[Any] | None:
            local = None if ids is None else [self.local[g] for g in ids]
            if not replayed:
                return self.core.call_on(local, name, args)
            call_replayed(self.core, local, name, args)
            self.held = reset_restarted(self.core, self.held)
            return None

        return self._answer(run)

    def set_replay_calls(self, calls: Sequence[ReplayCall]) -> Answer[None]:
        return self._answer(lambda: self.core.set_replay_calls(list(calls)))

    def close(self) -> None:
        try:
            if self.core is not None:
                self.core.close()
        finally:
            self.players.kill_all()

    # -- internals -----------------------------------------------------------------------------

    def _answer(self, run: Callable[[], T]) -> Answer[T]:
        try:
            return run(), None
        except EnvManagerError as exc:  # the players' failure, as the cluster names them
            return None, with_slot_offset(exc, self.offset)

    def _out(self, infos: list[StepInfo]) -> list[StepInfo]:
        """Global ids, no previous result or actions (the driver has them); players noted here."""
        out = []
        for info in infos:
            gid = self.ids[info.worker_id]
            result_info = dict(info.current_result.info or {})
            player = result_info.pop("player_process", None)
            if player is not None:  # killed here, where its pid means something, if it replaced one
                self.players.note(gid, player)
            current = info.current_result._replace(info=result_info)
            out.append(info._replace(worker_id=gid, previous_result=None, action=None, current_result=current))
        return out


def _kill_left_behind(identities: Sequence[PlayerIdentity], wait_s: float = 5.0) -> None:
    """SIGKILL these processes (same pid and start) and wait until they are gone or zombies
    (whose ports are free)."""
    import psutil

    killed = []
    for identity in identities:
        if kill_stale_player(identity):
            logger.warning("killed process %d, left behind by the node this one replaces", identity[0])
            killed.append(identity[0])
    deadline = Deadline(wait_s)
    for pid in killed:
        while not deadline.passed():
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
