"""``WorkerPool``: the worker processes, their requests and answers, failures and restarts.

This is the transport half of the manager (tianshou's split: workers apart from vectorizing).
It knows nothing about actions or episodes: it sends requests, one in flight per worker, and
turns what comes back on the shared step queue — or a worker's death, or a missed deadline —
into :class:`Completion`s. A failed worker is restarted here, within the restart policy.
"""

from __future__ import annotations

import atexit
import logging
import math
import pickle
import select
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as wait_for_ready
from typing import Any

from envmanager.errors import EnvManagerError, RestartLimitError, WorkerDiedError, WorkerError, WorkerTimeoutError
from envmanager.protocol import EnvironmentCommand as Cmd, EnvironmentRequest, RemoteException, encode_payload
from envmanager.restart import RestartPolicy
from envmanager.transport import SharedBuffers, StepQueue
from envmanager.worker import WorkerProcess, WorkerSpec

logger = logging.getLogger(__name__)

__all__ = ["WorkerPool", "Completion"]


@dataclass
class Completion:
    """A finished request of one worker process.

    ``items`` is the worker's answer (per-env tuples for STEP/RESET). ``error`` is set when the
    request failed. ``interrupted`` marks the reset that ends a restart: it answers ``request``,
    the request the failure cut short.
    """

    worker: WorkerProcess
    request: EnvironmentRequest | None
    items: Any = None
    error: EnvManagerError | None = None
    posted_at: float = 0.0
    received_at: float = 0.0
    interrupted: bool = False

    @property
    def cmd(self) -> Cmd | None:
        return None if self.request is None else self.request.cmd


class WorkerPool:
    """Worker processes hosting ``specs``' environments, and everything needed to talk to them."""

    def __init__(
        self,
        specs: list[WorkerSpec],
        ctx: Any,
        timeout: float,
        restart_policy: RestartPolicy,
        daemon: bool = True,
    ) -> None:
        self.ctx = ctx
        self.timeout = timeout
        self.restart_policy = restart_policy
        self.daemon = daemon
        self.workers: list[WorkerProcess] = []
        self.buffers: SharedBuffers | None = None
        #: ``(method name, args, kwargs)`` called on a restarted worker's envs before its reset.
        self.replay_calls: list[tuple[str, tuple, dict]] = []
        self._seq = 0
        self._watched: tuple[WorkerProcess, ...] = ()
        self._poll: tuple[Any, dict[int, WorkerProcess]] = (None, {})
        # One resource tracker for parent and workers: attaching workers then share it, and it
        # unlinks the shared memory should the parent be killed.
        resource_tracker.ensure_running()
        self.queue: StepQueue | None = StepQueue(ctx)
        self._atexit = _close_at_exit(self)
        try:
            for spec in specs:
                self.workers.append(self._start(spec))
        except BaseException:  # out of processes or fds, say: end those already started
            self.close(0.0)
            raise

    def _start(self, spec: WorkerSpec) -> WorkerProcess:
        assert self.queue is not None
        return WorkerProcess(self.ctx, spec, self.queue.writer, daemon=self.daemon)

    # ------------------------------------------------------------------------------------------
    # Sending

    def send(self, w: WorkerProcess, cmd: Cmd, payload: bytes) -> None:
        """Send one request (``payload`` pickled by ``encode_payload``) to an idle worker."""
        self._seq += 1
        try:
            w.send(cmd, self._seq, payload)
        except WorkerDiedError:
            # Noticed through its sentinel on the next pump; the request counts as in flight.
            w.pending = EnvironmentRequest(cmd, self._seq, payload)

    def attach_buffers(self, buffers: SharedBuffers) -> None:
        self.buffers = buffers
        for w in self.workers:
            self.send(w, Cmd.ATTACH, encode_payload(buffers.layout))
        self.gather(self.workers, "shared memory")

    # ------------------------------------------------------------------------------------------
    # Receiving

    def pump(self, timeout: float) -> list[Completion]:
        """Wait up to ``timeout`` for answers or worker deaths; return finished requests.

        Restarts, stale answers and large payloads are handled here; never blocks past ``timeout``.
        """
        if self.queue is None:
            return []
        poller, by_fd = self._poller()
        events = poller.poll(max(0, math.ceil(timeout * 1000)))
        completions: list[Completion] = []
        self._drain(completions)
        dead = [by_fd[fd] for fd, _ in events if fd in by_fd]
        if dead:
            self._drain(completions)  # a worker's last words come before its death
            for w in dead:
                if self.workers[w.index] is w and not w.closing:
                    self._on_failure(w, WorkerDiedError(w.env_ids[0], w.wait_exitcode()), completions)
        return completions

    def _poller(self) -> tuple[Any, dict[int, WorkerProcess]]:
        """A poll object on the step queue and every live worker's sentinel, kept between calls."""
        watched = tuple(w for w in self.workers if not w.closing)
        if watched != self._watched:
            assert self.queue is not None
            poller = select.poll()
            poller.register(self.queue.reader.fileno(), select.POLLIN)
            by_fd = {w.sentinel: w for w in watched}
            for fd in by_fd:
                poller.register(fd, select.POLLIN | select.POLLHUP)
            self._watched, self._poll = watched, (poller, by_fd)
        return self._poll

    def _drain(self, completions: list[Completion]) -> None:
        assert self.queue is not None
        while (got := self.queue.get_nowait()) is not None:
            response, on_pipe = got
            received = time.monotonic()
            w = self.workers[response.worker_index]
            if response.cmd is Cmd.CLOSED or w.pending is None or response.seq != w.pending.seq:
                continue  # a farewell, or the last words of a process already replaced
            data = response.payload
            if on_pipe:
                try:
                    data = w.fetch_large_payload(self.timeout)
                except (EOFError, OSError, TimeoutError) as exc:
                    error = WorkerDiedError(w.env_ids[0], w.wait_exitcode(), f" while sending its answer: {exc!r}")
                    self._on_failure(w, error, completions)
                    continue
            request, w.pending = w.pending, None
            try:
                payload = pickle.loads(data)
            except Exception as exc:  # e.g. a class the parent cannot import
                what = f"its answer to {request.cmd.name} could not be unpickled here: {exc!r}"
                error = WorkerError(w.env_ids[0], f"{type(exc).__module__}.{type(exc).__qualname__}", what, "", exc)
                completions.append(Completion(w, request, None, error))
                continue
            if response.cmd is Cmd.ENV_EXITED:
                if request.cmd in (Cmd.CALL, Cmd.GET_ATTR, Cmd.SET_ATTR):  # the env is fine
                    completions.append(Completion(w, request, None, _worker_error(payload)))
                else:
                    self._on_failure(w, _worker_error(payload), completions, request)
                continue
            completion = Completion(w, request, payload, None, response.sent_at, received)
            if w.booting:
                self._advance_boot(w, completion, completions)
            else:
                completions.append(completion)

    def check_deadlines(self) -> list[Completion]:
        """Fail every worker whose request is older than the deadline (restart or error)."""
        completions: list[Completion] = []
        now = time.monotonic()
        for w in list(self.workers):
            if w.busy and not w.closing and now - w.sent_at > self.timeout:
                cmd = w.pending.cmd  # type: ignore[union-attr]
                what = "its startup" if cmd is Cmd.READY else f"an answer to {cmd.name}"
                self._on_failure(w, WorkerTimeoutError(list(w.env_ids), self.timeout, what), completions)
        return completions

    def poll(self, timeout: float) -> list[Completion]:
        """``pump``, then deadlines: everything that finished or failed within ``timeout``."""
        busy = [w.sent_at for w in self.workers if w.busy and not w.closing]
        if busy:  # wake up in time to notice the first worker to miss its deadline
            timeout = min(timeout, max(0.0, min(busy) + self.timeout - time.monotonic() + 1e-3))
        completions = self.pump(timeout)
        completions += self.check_deadlines()
        return completions

    def gather(self, workers: Iterable[WorkerProcess], what: str, timeout: float | None = None) -> list[Completion]:
        """Wait until each of ``workers`` finished its request (startup: nothing else is in
        flight); return those completions. Raises the first error among them, or
        ``WorkerTimeoutError`` past ``timeout`` (default: the pool's deadline)."""
        indices = {w.index for w in workers}
        got: dict[int, Completion] = {}
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not indices <= got.keys():
            now = time.monotonic()
            if now >= deadline:
                late = [s for i in sorted(indices - got.keys()) for s in self.workers[i].env_ids]
                raise WorkerTimeoutError(late, limit, what)
            for c in self.poll(deadline - now):
                got.setdefault(c.worker.index, c)
        ordered = [got[i] for i in sorted(indices)]
        for c in ordered:
            if c.error is not None:
                raise c.error
        return ordered

    def gather_quietly(
        self, workers: Iterable[WorkerProcess], what: str, timeout: float | None = None,
        sink: Callable[[list[Completion]], None] = lambda completions: None,
    ) -> None:
        """Wait until ``workers`` have nothing in flight, handing every completion to ``sink``
        as it comes (errors included, not raised), so none is lost to a timeout. Past
        ``timeout``: ``WorkerTimeoutError``."""
        indices = {w.index for w in workers}
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        sink(self.poll(0.0))
        while any(self.workers[i].busy for i in indices):
            now = time.monotonic()
            if now >= deadline:
                late = [s for i in sorted(indices) if self.workers[i].busy for s in self.workers[i].env_ids]
                raise WorkerTimeoutError(late, limit, what, hung=False)
            sink(self.poll(deadline - now))

    # ------------------------------------------------------------------------------------------
    # Failures and restarts

    def _on_failure(
        self, w: WorkerProcess, error: EnvManagerError, completions: list[Completion],
        request: EnvironmentRequest | None = None,
    ) -> None:
        """Restart ``w`` if the policy allows; otherwise report ``error`` for its request."""
        request = request or w.pending
        w.pending = None
        if w.booting:  # a restart failed on its way up: what it was answering is what failed
            request = w.lost_request
        refusal = self.restart_policy.refusal(w.index)
        if refusal is None and self.queue is not None:
            self._restart(w, request, error, completions)
            return
        if self.restart_policy.enabled and refusal is not None:
            error = RestartLimitError(w.env_ids[0], refusal, error)
        if isinstance(error, (WorkerDiedError, WorkerTimeoutError)) or not w.alive() or w.booting:
            w.failure = error  # the process is gone or stuck for good
            w.kill()
        completions.append(Completion(w, request, None, error))

    def _restart(
        self, w: WorkerProcess, request: EnvironmentRequest | None, error: EnvManagerError,
        completions: list[Completion],
    ) -> None:
        """Replace ``w`` by a new process and plan how it comes back (see ``_advance_boot``)."""
        logger.warning("restarting worker %d after: %s", w.index, error)
        self.restart_policy.record(w.index)
        w.kill()
        new = self._start(w.spec)
        self.workers[w.index] = new
        attach = [(Cmd.ATTACH, encode_payload(self.buffers.layout))] if self.buffers else []
        if w.booting:  # it failed again while coming back: the same way up, from the start
            plan, lost, resumes = w.boot_plan, w.lost_request, w.resumes_startup
        elif request is not None and request.cmd in (Cmd.READY, Cmd.ATTACH):
            # Failed while the pool was starting: the new process answers the startup instead.
            plan, lost, resumes = (attach if request.cmd is Cmd.ATTACH else []), request, True
        else:
            everyone = list(range(len(w.env_ids)))
            replays = [(Cmd.CALL, encode_payload((everyone, n, a, k))) for n, a, k in self.replay_calls]
            if request is not None and request.cmd is Cmd.RESET:  # keep the seeds and options asked for
                reset = request.payload
            else:
                reset = encode_payload([(i, None, None) for i in everyone])
            plan, resumes = [*attach, *replays, (Cmd.RESET, reset)], False
            # A step or reset is answered by the fresh reset (``interrupted``); a call is not.
            lost = request if request is not None and request.cmd in (Cmd.STEP, Cmd.RESET) else None
            if request is not None and lost is None:
                completions.append(Completion(w, request, None, error))  # its caller must know
        new.boot_plan, new.boot = plan, list(plan)
        new.lost_request, new.resumes_startup = lost, resumes

    def _advance_boot(self, w: WorkerProcess, completion: Completion, completions: list[Completion]) -> None:
        """Take a restarted worker through attach → replayed calls → reset (or startup)."""
        if w.boot:
            cmd, payload = w.boot.pop(0)
            self.send(w, cmd, payload)
            return
        completion.interrupted = not w.resumes_startup
        completion.request = w.lost_request
        w.lost_request, w.boot = None, None
        completions.append(completion)

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def close(self, timeout: float = 10.0) -> None:
        """End every worker (politely, then by force) and free shared memory. Idempotent.

        Idle workers are asked to close their envs and get ``timeout`` seconds for it; a worker
        still busy with a step is interrupted at once (SIGTERM, it still closes its envs).
        Stragglers are killed with every process they started, and all are reaped.
        """
        workers, self.workers = self.workers, []
        try:
            for w in workers:
                busy = w.busy
                w.request_close()
                if busy and w.alive():  # it would read CLOSE only after its step
                    w.process.terminate()
            deadline = time.monotonic() + timeout
            while any(w.alive() for w in workers) and time.monotonic() < deadline:
                if self.queue is not None:  # keep the queue flowing so no worker blocks on it
                    while self.queue.get_nowait() is not None:
                        pass
                wait_for_ready([w.sentinel for w in workers if w.alive()], 0.05)
            late = [w.index for w in workers if w.alive()]
            if late and timeout > 0:
                logger.warning("worker(s) %s did not close within %.1f s; terminating them", late, timeout)
        finally:
            for w in workers:
                w.stop(0.0) if w.alive() else w.kill()
            if self.buffers is not None:
                self.buffers.close()
                self.buffers = None
            if self.queue is not None:
                self.queue.close()
                self.queue = None
            if self._atexit is not None:
                atexit.unregister(self._atexit)
                self._atexit = None


def _close_at_exit(pool: WorkerPool) -> Callable[[], None]:
    """Close the pool at interpreter exit if nobody did (held weakly)."""
    ref = weakref.ref(pool)

    def close_if_alive() -> None:
        p = ref()
        if p is not None:
            p.close()

    atexit.register(close_if_alive)
    return close_if_alive


def make_specs(
    factory: bytes, n_env: int, envs_per_worker: int, autoreset_mode: str, spin_s: float = 0.0
) -> list[WorkerSpec]:
    """Split ``n_env`` slots over processes, ``envs_per_worker`` each (the last may have fewer)."""
    return [
        WorkerSpec(i, tuple(range(start, min(start + envs_per_worker, n_env))), factory, autoreset_mode, os.getpid(), spin_s)
        for i, start in enumerate(range(0, n_env, envs_per_worker))
    ]


def _worker_error(remote: RemoteException) -> WorkerError:
    return WorkerError(remote.env_index, remote.exc_type, remote.message, remote.traceback, remote.exception)


def get_context(context: str | None) -> Any:
    return mp.get_context(context)  # ValueError for unknown methods, as multiprocessing
