"""The errors of the ML-Agents Ray player pool (``envmanager.mlagents.ray_env_manager``); no Ray here."""

from __future__ import annotations

from envmanager.errors import NodeError, NodeRestartLimitError

__all__ = ["RayPlayerError", "RayPlayerRestartLimitError", "NodeLost"]

#: A node's players could not go on: its actor was lost past the restart limits, or could not
#: start (``cause``: what its players raised then, naming the trainer's worker ids), or raised;
#: ``node``: the node's index, ``worker_ids``: the trainer's worker ids it hosts (the core's node error).
RayPlayerError = NodeError
#: A node's players were lost past the restart limits: a ``RestartLimitError`` and a
#: ``RayPlayerError`` (the core's, built by the pool's supervisor).
RayPlayerRestartLimitError = NodeRestartLimitError


class NodeLost(Exception):
    """A node's actor died or missed its deadline (never leaves :class:`RayPlayerPool`)."""
