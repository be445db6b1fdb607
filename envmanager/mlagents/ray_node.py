"""What one Ray node runs for :class:`~envmanager.mlagents.ray_env_manager.RayMLAgentsEnvManager`:
its share of the players, through the core's ``SubprocessEnvManager`` (a worker process per
player, first-ready, deadlines, a killed player restarted alone on the node).

:class:`PlayerNode` is a plain class; the driver runs it as a Ray actor pinned to a node. It
speaks global worker ids (the trainer's ``worker_id``: port ``base_port + worker_id``, seed
``seed + worker_id``); its core counts its own slots from 0. It does not import ``ray``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from envmanager.core.manager import SubprocessEnvManager
from envmanager.core.results import StepInfo, StepResult
from envmanager.mlagents.player_process import PlayerProcesses
from envmanager.mlagents.worker_env import WorkerEnvFactory

logger = logging.getLogger(__name__)

__all__ = ["GlobalIds", "PlayerNode"]

ReplayCall = Tuple[str, tuple, dict]


class GlobalIds:
    """``factory(local slot)`` -> ``worker_factory(global worker id)``: picklable."""

    def __init__(self, worker_factory: WorkerEnvFactory, ids: Sequence[int]) -> None:
        self.worker_factory, self.ids = worker_factory, list(ids)

    def __call__(self, local: int) -> Any:
        return self.worker_factory(self.ids[local])


class PlayerNode:
    """The players of worker ids ``ids`` on this node, with their env parameters, engine settings
    and analytics (``replay_calls``, applied before the first reset and on every restart)."""

    def __init__(self, worker_factory: WorkerEnvFactory, ids: Sequence[int], options: Dict[str, Any],
                 replay_calls: Sequence[ReplayCall] = ()) -> None:
        self.ids = list(ids)
        self.local = {g: i for i, g in enumerate(self.ids)}
        # a Unity player holding gRPC state must not be forked: forkserver, as MLAgentsEnvManager
        self.core = SubprocessEnvManager(GlobalIds(worker_factory, self.ids), len(self.ids), shared_memory=False,
                                         **{"context": "forkserver", **options})
        self.players = PlayerProcesses(dict(zip(self.ids, self.core.get_attr("player"))))
        self.set_replay_calls(replay_calls)
        for name, args, kwargs in replay_calls:
            self.core.call_on(None, name, args, kwargs)

    def info(self) -> Dict[str, Any]:
        try:
            import ray

            node_id: Optional[str] = ray.get_runtime_context().get_node_id()
        except Exception:  # pragma: no cover - outside Ray
            node_id = None
        workers = [w.pid for w in self.core.workers]
        return {"ray_node_id": node_id, "pid": os.getpid(), "ids": self.ids, "worker_pids": workers,
                "player_pids": self.players.pids}

    def reset(self, ids: Optional[Sequence[int]] = None) -> List[StepInfo]:
        """Reset every player (steps in flight dropped), or the idle players ``ids``."""
        if ids is None:
            return self._out(self.core.reset())
        local = [self.local[g] for g in ids]
        self.core.send_reset({i: (None, None) for i in local})
        return self._out(self.core.receive_resets(local))

    def step(self, actions: Dict[int, Any], timeout: Optional[float] = None) -> List[StepInfo]:
        """Send ``actions`` (global id -> env actions, this node's idle players), then return the
        steps that finished: at least one, within ``timeout`` (the core's deadline by default)."""
        if actions:
            self.core.send_step({self.local[g]: a for g, a in actions.items()})
        return self._out(self.core.receive_steps(timeout))

    def call_on(self, ids: Optional[Sequence[int]], name: str, args: tuple = ()) -> List[Any]:
        return self.core.call_on(None if ids is None else [self.local[g] for g in ids], name, args)

    def set_replay_calls(self, calls: Sequence[ReplayCall]) -> None:
        self.core.set_replay_calls(list(calls))

    def restart_counts(self) -> Dict[int, int]:
        return {g: self.core.restart_count(i) for i, g in enumerate(self.ids)}

    def close(self) -> None:
        try:
            self.core.close()
        finally:
            self.players.kill_all()

    def _out(self, infos: List[StepInfo]) -> List[StepInfo]:
        """Global ids; the previous result and the actions left out (the driver has them); players
        noted here (a restarted worker's old player is killed on this node, where its pid means
        something)."""
        out = []
        for info in infos:
            gid = self.ids[info.worker_id]
            result_info = dict(info.current_result.info or {})
            player = result_info.pop("player_process", None)
            if player is not None:
                # A new player: the old one's worker was restarted (maybe unseen, in a reset's
                # drain); it is killed here, where its pid means something.
                self.players.note(gid, player)
                self.players.kill_stale()
            current = StepResult(info.current_result.observation, info.current_result.reward,
                                 info.current_result.terminated, info.current_result.truncated, result_info)
            out.append(info._replace(worker_id=gid, previous_result=None, action=None, current_result=current))
        return out
