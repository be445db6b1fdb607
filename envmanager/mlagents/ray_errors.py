"""The errors of the ML-Agents Ray player pool (``envmanager.mlagents.ray_env_manager``); no Ray here."""

from __future__ import annotations

from collections.abc import Sequence

from envmanager.errors import EnvManagerError, RestartLimitError

__all__ = ["RayPlayerError", "RayPlayerRestartLimitError", "NodeLost"]


class RayPlayerError(EnvManagerError):
    """A node's players could not go on: its actor was lost past the restart limits, or could not
    start (``cause``: what its players raised then, naming the trainer's worker ids), or raised.
    ``node``: the node's index; ``worker_ids``: the trainer's worker ids it hosts."""

    def __init__(self, node: int, worker_ids: Sequence[int], message: str, cause: BaseException | None = None) -> None:
        self.node, self.worker_ids, self.cause = node, list(worker_ids), cause
        super().__init__(message)


class RayPlayerRestartLimitError(RayPlayerError, RestartLimitError):
    """A node's players were lost past the restart limits: the ``RestartLimitError`` a process
    past them raises (``reason``, ``failure``: the loss), as a ``RayPlayerError`` (``node``)."""

    def __init__(self, node: int, worker_ids: Sequence[int], reason: str, failure: RayPlayerError, message: str) -> None:
        self.node, self.worker_ids, self.worker_id, self.process = node, list(worker_ids), worker_ids[0], None
        self.reason, self.failure, self.message = reason, failure, message
        self.cause, self.remote_traceback = failure.cause, None
        self.exitcode = self.call = self.slot = None
        EnvManagerError.__init__(self, message)

    def __reduce__(self):
        return (type(self), (self.node, self.worker_ids, self.reason, self.failure, self.message))


class NodeLost(Exception):
    """A node's actor died or missed its deadline (never leaves :class:`RayPlayerPool`)."""
