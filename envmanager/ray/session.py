"""The Ray session envmanager's Ray managers run in: one helper, reference-counted.

``RaySession.join`` gives a holder (a node pool, a player pool) its share of the running
session, or of one it starts; a session envmanager started is shut down when its last holder
leaves, one the user started never. A session is known by its name and the driver's job id.
Any driver-side Ray call without a session would start a new one, so a holder asks ``check``
first, and hands what a call raises to ``reraise`` (``RaySessionError`` for Ray's failures).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Mapping
from typing import Any, NoReturn

import psutil

from envmanager.core.supervisor import Supervisor
from envmanager.errors import EnvManagerError
from envmanager.extras import requires_extra

with requires_extra("ray", "envmanager.ray"):
    import ray
    from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayError, RayTaskError

logger = logging.getLogger(__name__)

__all__ = ["RAISED", "TIMED_OUT", "DIED", "LOST", "RaySession", "RaySessionError", "first_ready", "kill_actor",
           "node_failure"]

#: What an exception of ``ray.get`` says of the actor whose answer was asked (``node_failure``):
#: it answered with its own error; it did not answer in time; it, or the node holding its
#: answer, is gone; Ray lost the answer another way.
RAISED, TIMED_OUT, DIED, LOST = "raised", "timed out", "died", "lost"

#: Seconds the processes a failed local ``ray.init`` left behind get to end once killed.
KILL_TIMEOUT = 10.0
#: Seconds a cluster's address gets to accept a connection before ``ray.init`` is tried (Ray
#: itself retries an address where nothing listens for minutes).
CONNECT_TIMEOUT = 10.0


def node_failure(error: BaseException) -> str | None:
    """What ``error``, raised by ``ray.get`` of an actor's answer, says of that actor
    (:data:`RAISED`, :data:`TIMED_OUT`, :data:`DIED` or :data:`LOST`); ``None`` if it is not
    Ray's (``RaySession.reraise`` says what it is)."""
    if isinstance(error, RayTaskError):
        return RAISED
    if isinstance(error, GetTimeoutError):
        return TIMED_OUT
    if isinstance(error, (RayActorError, ObjectLostError)):
        return DIED
    if isinstance(error, RayError):
        return LOST
    return None


def first_ready(heads: Mapping[int, Any], refs: list[Any], supervisor: Supervisor,
                timeout: float) -> tuple[list[Any], list[int]]:
    """Wait until one of ``heads`` (each busy node's oldest request, by node index) is done or
    ``timeout`` passes; returns every ref of ``refs`` done by then, and the nodes past their
    deadline whose head is not done (hung). Ray's exceptions pass."""
    ready, _ = ray.wait(list(heads.values()), num_returns=1, timeout=timeout)
    if ready:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    done = set(ready)
    return ready, [i for i in supervisor.overdue(list(heads)) if heads[i] not in done]


def kill_actor(actor: Any, name: str) -> None:
    """Kill a node's actor for good (``ray.kill``, never restarted); one already gone is fine."""
    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # gone already
            logger.debug("killing %s: %r", name, exc)


class RaySessionError(EnvManagerError):
    """Ray's session could not be started or joined (``address``: where; ``None``: local), is
    gone (``ray.shutdown()``, its head lost), or Ray failed under a driver-side call; ``cause``:
    Ray's exception (also chained)."""

    def __init__(self, message: str, address: str | None = None, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.address, self.cause = address, cause


@dataclasses.dataclass
class _Started:
    """A session envmanager started: how many holders it has, and the temp dir made for it."""

    holders: int
    temp_dir: str | None


_lock = threading.Lock()
_started: dict[tuple[str, str], _Started] = {}  # by (session name, job id)


def _current() -> tuple[str, str]:
    """The running session's key (call only while ``ray.is_initialized()``: else Ray starts one)."""
    context = ray.get_runtime_context()
    return context.get_session_name(), context.get_job_id()


class RaySession:
    """One holder's share of the Ray session it runs in; ``leave`` gives it back (idempotent).
    ``owned``: envmanager started that session (it is shut down when its last holder leaves)."""

    def __init__(self, key: tuple[str, str], owned: bool) -> None:
        self.key, self.owned = key, owned
        self._left = False

    @classmethod
    def join(cls, address: str | None = None, init_options: Mapping[str, Any] | None = None) -> RaySession:
        """A share of the running session (``address`` and ``init_options`` then ignored), or of
        one started now (``ray.init``; a local one gets a temp dir of its own). A failed start
        leaves nothing behind and raises ``RaySessionError`` naming ``address``."""
        with _lock:
            if ray.is_initialized():
                key = _current()
                started = _started.get(key)
                if started is None:
                    return cls(key, owned=False)
                started.holders += 1
                return cls(key, owned=True)
            key, temp_dir = _start(address, {"include_dashboard": False, **(init_options or {})})
            _started[key] = _Started(1, temp_dir)
            logger.info("started a Ray session (%s, job %s)%s", key[0], key[1], f" at {address}" if address else "")
            return cls(key, owned=True)

    def alive(self) -> bool:
        """Whether the session is still this process's (never starts one)."""
        return ray.is_initialized() and _current() == self.key

    def check(self) -> None:
        """``RaySessionError`` if the session is gone: no Ray call may follow (it would start a new one)."""
        if not self.alive():
            raise RaySessionError("the Ray session this manager ran in is gone (ray.shutdown() was called, or its "
                                  "head node was lost): close the manager and make a new one")

    def reraise(self, error: Exception, doing: str) -> NoReturn:
        """Raise what ``error`` from a driver-side Ray call means: the session gone or Ray's own
        failure as ``RaySessionError`` (cause chained); envmanager's and the caller's own
        errors (a value that cannot be pickled, say) as they are."""
        if isinstance(error, EnvManagerError):
            raise error
        if not self.alive():
            raise RaySessionError(f"the Ray session this manager ran in is gone ({doing}: {type(error).__name__}: "
                                  f"{error}): close the manager and make a new one", cause=error) from error
        if isinstance(error, (RayError, ConnectionError)):
            raise RaySessionError(f"Ray failed {doing}: {type(error).__name__}: {error}", cause=error) from error
        raise error

    def leave(self) -> None:
        """Give the share back: the last holder of a session envmanager started shuts it down
        and removes its temp dir. Idempotent."""
        with _lock:
            if self._left:
                return
            self._left = True
            started = _started.get(self.key) if self.owned else None
            if started is None:
                return
            started.holders -= 1
            if started.holders > 0:
                return
            del _started[self.key]
            if self.alive():
                ray.shutdown()
                logger.info("shut down the Ray session %s", self.key[0])
            if started.temp_dir is not None:
                shutil.rmtree(started.temp_dir, ignore_errors=True)


def _start(address: str | None, options: dict[str, Any]) -> tuple[tuple[str, str], str | None]:
    """``ray.init``: the new session's key and the temp dir made for it; on failure nothing is
    left (a failed local start can leave its head's processes running: they are killed)."""
    _check_reachable(address)
    temp_dir = None
    if address is None and "_temp_dir" not in options:  # a local session: its files go when it does
        temp_dir = options["_temp_dir"] = tempfile.mkdtemp(prefix="envmgr-ray-")
    try:
        ray.init(address=address, **options)
        return _current(), temp_dir
    except BaseException as exc:
        ray.shutdown()
        if temp_dir is not None:  # only a dir of our own names nothing but that session's processes
            _kill_left_behind(temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        where = "a local Ray session" if address is None else f"the Ray cluster at {address!r}"
        raise RaySessionError(f"could not start {where}: {type(exc).__name__}: {exc}", address, exc) from exc


def _check_reachable(address: str | None) -> None:
    """``RaySessionError`` at once if ``address`` is ``[ray://]host:port`` and nothing accepts a
    connection there within ``CONNECT_TIMEOUT``; other forms are left to Ray."""
    if address is None:
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise RaySessionError(f"could not start the Ray cluster at {address!r}: nothing accepts a connection there "
                              f"({type(exc).__name__}: {exc})", address, exc) from exc


def _kill_left_behind(temp_dir: str) -> None:
    """Kill and reap this process's descendants that a failed local ``ray.init`` started (their
    command lines name its temp dir: Ray's ``shutdown`` does not know them)."""
    left = []
    for process in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if temp_dir in " ".join(process.cmdline()):
                process.kill()
                left.append(process)
        except psutil.Error:  # gone meanwhile
            continue
    if left:
        _, alive = psutil.wait_procs(left, timeout=KILL_TIMEOUT)
        logger.warning("a failed ray.init left %d processes running; killed them%s", len(left),
                       f" ({len(alive)} still there: {[p.pid for p in alive]})" if alive else "")
