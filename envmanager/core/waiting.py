"""How the batch level waits on the pool: one clock per request, and "nothing can finish"
known at once rather than after a deadline."""

from __future__ import annotations

from collections.abc import Callable

from envmanager.core.completion import Completion
from envmanager.core.deadline import Deadline, caller_timeout
from envmanager.core.pool import WorkerPool
from envmanager.errors import InvalidInputError, WorkerTimeoutError
from envmanager.wire.interrupts import begin, end

__all__ = ["wait_for"]


def wait_for(pool: WorkerPool, take: Callable[[list[Completion]], None], process_of: list[int],
             done: Callable[[], bool], timeout: float | None, what: str, late: Callable[[], list[int]],
             enough: Callable[[], bool], can_finish: Callable[[], bool] | None = None) -> None:
    """Hand ``take`` what the pool delivers until ``done()``. ``late()`` names the slots whose
    processes may still make it done: when none of them has a request in flight, nothing can
    finish and this raises at once (such a process's failure, else ``InvalidInputError``), unless
    ``enough()`` says what arrived will do. ``can_finish()``, if given, is a cheaper first look.

    Without a caller's ``timeout`` only the pool's per-answer deadline bounds the wait. At its end a
    process past that deadline is hung all the same; for the others ``WorkerTimeoutError(hung=False)``
    is raised, their requests stay in flight and what arrived is kept."""
    timeout = caller_timeout(timeout)
    deadline = None if timeout is None else Deadline(timeout)
    while not done():  # (what has already come is taken by the first wait, which returns at once then)
        if can_finish is None or not can_finish():
            waiting = late()
            workers = pool.processes
            if not any(workers[process_of[s]].busy and workers[process_of[s]].watched for s in waiting):
                if enough():
                    return
                candidates = [workers[process_of[s]] for s in waiting] or workers
                failure = next((w.failure for w in candidates if w.failure is not None), None)
                if failure is not None:  # a failed process's own error
                    raise failure
                raise InvalidInputError(f"nothing in flight can deliver {what}: nothing can finish")
        if deadline is not None and deadline.passed():
            try:
                begin()  # (a Ctrl-C between taking answers and filing them would lose them)
                take(pool.wait(0.0))  # the pool's deadline first: a process past it is hung
            finally:
                end()
            if done():
                return
            still = late()
            raise WorkerTimeoutError(still, float(timeout), what, hung=False,  # type: ignore[arg-type]
                                     processes=sorted({process_of[s] for s in still}))
        try:
            begin()  # (its blocking wait stays interruptible: ``interrupts.blocking``)
            take(pool.wait(pool.timeout if deadline is None else deadline.left()))
        finally:
            end()
