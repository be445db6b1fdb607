"""Failures of ``envmanager.AsyncVectorEnv`` in gymnasium's terms: a wait past the caller's
timeout is ``multiprocessing.TimeoutError``; an env that raised surfaces as its own exception
(chained to the worker's account of it), after gymnasium's log of every env that raised."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import NoReturn

from gymnasium import logger as gym_logger

from envmanager.errors import EnvManagerError, WorkerError, WorkerTimeoutError

__all__ = ["raise_as_gymnasium", "reraise"]


def raise_as_gymnasium(what: str, timeout: float | None, exc: EnvManagerError,
                       abandon: Callable[[], list[EnvManagerError]]) -> NoReturn:
    """Raise ``exc``, a failure while waiting (in ``what``), in gymnasium's terms.

    Called from the waiting method's ``except EnvManagerError`` block (a ``try`` costs nothing
    on the way through, where a context manager costs calls on every step). Past the caller's
    ``timeout``: ``multiprocessing.TimeoutError``, and the call stays pending (waiting again
    picks up its results). Any other failure: ``abandon()`` drops what is in flight, so
    nothing stale surfaces later, and returns the errors of the other envs that failed
    meanwhile; then the env's own exception is re-raised.
    """
    if isinstance(exc, WorkerTimeoutError):
        if exc.hung or timeout is None:  # a worker missed its own deadline: nothing more comes
            abandon()
            raise exc
        raise multiprocessing.TimeoutError(f"The call to `{what}` has timed out after {timeout} second(s).") from exc
    errors = [exc, *abandon()]
    failed = [e for e in errors if isinstance(e, WorkerError)]
    if not failed:
        raise exc
    for error in failed:  # gymnasium's report of every env that raised, then the last raised
        gym_logger.error(f"Received the following error from Worker-{error.worker_id} - Shutting it down")
        gym_logger.error(f"{error.remote_traceback}")
    gym_logger.error("Raising the last exception back to the main process.")
    reraise(failed[-1])


def reraise(exc: EnvManagerError) -> NoReturn:
    """Raise an env's own exception (as gymnasium does), chained to the worker's account of it."""
    if isinstance(exc, WorkerError) and exc.cause is not None:
        raise exc.cause from exc
    raise exc
