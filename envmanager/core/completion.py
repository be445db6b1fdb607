"""``Completion``: a finished request of one worker process, as the pool hands it to the batch
level; and the pool's errors made from what a worker sent back (``worker_error``)."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any

from envmanager.errors import EnvManagerError, WorkerError
from envmanager.wire.messages import EnvironmentRequest, RemoteException

if TYPE_CHECKING:
    from envmanager.core.process import WorkerProcess

__all__ = ["Completion", "worker_error", "refused_error"]


class Completion:
    """A finished request of one worker process: its decoded ``answer``, or the ``error`` it failed
    with as a whole. ``interrupted`` marks the reset that ends a restart: it answers the requests
    the failure cut short (``request``: the first). ``slots``: those the answer is for (a
    restart's reset: all it reset). A plain class with slots: one per answer on the hot path."""

    __slots__ = ("answer", "error", "interrupted", "posted_at", "received_at", "request", "sent_at", "slots", "worker")

    def __init__(self, worker: WorkerProcess, request: EnvironmentRequest | None, answer: Any = None,
                 error: EnvManagerError | None = None, posted_at: float = 0.0, received_at: float = 0.0,
                 sent_at: float = 0.0, interrupted: bool = False, slots: tuple[int, ...] = ()) -> None:
        self.worker = worker
        self.request = request
        self.answer = answer
        self.error = error
        self.posted_at = posted_at
        self.received_at = received_at
        self.sent_at = sent_at
        self.interrupted = interrupted
        self.slots = slots

    def keep(self, answer: Any, slots: tuple[int, ...]) -> None:
        """Only ``slots`` delivered (the others' envs raised): ``answer`` is theirs."""
        self.answer, self.slots = answer, slots

    def answering(self, lost: tuple[EnvironmentRequest, ...], interrupted: bool = True) -> None:
        """This answer is a fresh reset answering ``lost`` (``request``: the first; see the class doc);
        ``interrupted`` unless it is a startup's answer."""
        self.request = lost[0] if lost else None
        self.interrupted = interrupted


def worker_error(remote: RemoteException, process: int | None = None) -> WorkerError:
    return WorkerError(remote.env_index, remote.exc_type, remote.message, remote.traceback, remote.exception, process)


def refused_error(slot: int, exc: BaseException) -> WorkerError:
    """What env ``slot`` returned, refused in the parent (``exc``: it does not fit the batch,
    ``envmanager.wire.returns``): reported as that env's failure, as if it had raised ``exc``."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return WorkerError(slot, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb, exc)
