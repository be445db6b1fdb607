"""How the batch level waits on the pool: one clock per request, and "nothing can finish"
known at once rather than after a deadline."""

from __future__ import annotations

from collections.abc import Callable

from envmanager.core.completion import Completion
from envmanager.core.deadline import Deadline, caller_timeout
from envmanager.core.pool import WorkerPool
from envmanager.errors import EnvManagerError, InvalidInputError, WorkerTimeoutError
from envmanager.wire.interrupts import DEFERRED

__all__ = ["wait_for"]


def wait_for(pool: WorkerPool, take: Callable[[list[Completion]], None], process_of: list[int],
             done: Callable[[], bool], timeout: float | None, what: str, late: Callable[[], list[int]],
             enough: Callable[[], bool], can_finish: Callable[[], bool] | None = None) -> None:
    """Hand ``take`` what the pool delivers until ``done()``. ``late()`` names the slots whose
    processes may still make it done (``process_of[slot]`` is a slot's process): when none of
    them has a request in flight, nothing can finish and this raises at once (the failure of
    such a process, else ``InvalidInputError``), unless ``enough()`` says what arrived will do.

    One clock per request: with ``timeout=None`` the wait ends when the answers come or the
    pool's per-answer deadline judges a process hung (restarted, or its
    ``WorkerTimeoutError(hung=True)`` raised by the caller). A ``timeout`` of the caller's own
    bounds the wait too: at its end a process past the pool's deadline is hung all the same;
    for the others ``WorkerTimeoutError(hung=False)`` is raised, their requests stay in flight
    and what arrived meanwhile is kept (``inf``: as ``None``; NaN or no number: refused).
    ``can_finish()``, if given, says more cheaply than ``late()`` whether anything in flight can
    still make it done (asked on every turn)."""
    timeout = caller_timeout(timeout)
    deadline = None if timeout is None else Deadline(timeout)
    while not done():  # (what has already come is taken by the first wait, which returns at once then)
        if can_finish is None or not can_finish():
            waiting = late()
            workers = pool.processes
            if not any(workers[process_of[s]].busy and workers[process_of[s]].watched for s in waiting):
                if enough():
                    return
                raise nothing_can_finish(pool, process_of, waiting, what)
        if deadline is not None and deadline.passed():
            with DEFERRED:  # (a Ctrl-C between taking answers and filing them would lose them)
                take(pool.wait(0.0))  # the pool's deadline first: a process past it is hung
            if done():
                return
            still = late()
            raise WorkerTimeoutError(still, float(timeout), what, hung=False,  # type: ignore[arg-type]
                                     processes=sorted({process_of[s] for s in still}))
        with DEFERRED:  # (its blocking wait stays interruptible: ``interrupts.blocking``)
            take(pool.wait(pool.timeout if deadline is None else deadline.left()))


def nothing_can_finish(pool: WorkerPool, process_of: list[int], slots: list[int], what: str) -> EnvManagerError:
    """The error for a wait that nothing in flight can end: a failed process's own error."""
    workers = pool.processes
    candidates = [workers[process_of[s]] for s in slots] or workers
    failure = next((w.failure for w in candidates if w.failure is not None), None)
    if failure is not None:
        return failure
    return InvalidInputError(f"nothing in flight can deliver {what}: nothing can finish")
