"""Reaching into the envs: ``call``, ``get_attr``, ``set_attr``, and the request level beneath.

The part of :class:`~envmanager.SubprocessEnvManager` that sends a request to chosen envs and
collects one answer per env (split from ``manager`` to keep each module short). It relies on
the manager's pool, slot tables and answer bookkeeping (``_answers``, ``_absorb``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np

from envmanager.errors import InvalidInputError, WorkerTimeoutError
from envmanager.protocol import EnvFunction, EnvironmentCommand as Cmd, encode_payload

if TYPE_CHECKING:
    from envmanager.pool import Completion, WorkerPool

__all__ = ["EnvCalls", "Request"]


@dataclass(frozen=True)
class Request:
    """A request sent with ``send_request``: what to collect with ``receive_request``."""

    cmd: Cmd
    slots: list[int]
    by_worker: dict[int, list[int]]



class EnvCalls:
    """``call``/``get_attr``/``set_attr`` for :class:`~envmanager.SubprocessEnvManager`."""

    n_env: int
    timeout: float
    pool: WorkerPool
    _slot_worker: list[int]
    _slot_local: list[int]
    _answers: dict[int, Completion]
    _absorb: Callable[[list[Completion]], None]

    def call(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``env.<name>(*args, **kwargs)`` (or read it, if not callable) on every slot."""
        return self.call_on(None, name, args, kwargs)

    def call_on(
        self,
        worker_ids: Sequence[int] | None,
        name: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list[Any]:
        """``call`` on the given slots only (``None``: all); results in the order given.

        ``name`` may also be a function: the worker then runs ``name(env, *args, **kwargs)``
        (it is cloudpickled, so a lambda or a closure works).
        """
        target = name if isinstance(name, str) else EnvFunction(cloudpickle.dumps(name))
        return self._request(Cmd.CALL, worker_ids, lambda local, own: (local, target, args, kwargs or {}))

    def get_attr(self, name: str, worker_ids: Sequence[int] | None = None) -> list[Any]:
        """Read ``env.<name>`` (through wrappers) on the given slots (``None``: all)."""
        return self._request(Cmd.GET_ATTR, worker_ids, lambda local, own: (local, name))

    def set_attr(self, name: str, values: Any, worker_ids: Sequence[int] | None = None) -> None:
        """Set ``env.<name>``: one value for all given slots, or a list with one per slot."""
        slots = self._slots(worker_ids)
        if not isinstance(values, (list, tuple)):
            values = [values] * len(slots)
        if len(values) != len(slots):
            raise InvalidInputError(f"expected {len(slots)} values (one per worker), got {len(values)}")
        by_slot = dict(zip(slots, values))
        self._request(Cmd.SET_ATTR, slots, lambda local, own: (local, name, [by_slot[s] for s in own]))

    def _slots(self, worker_ids: Sequence[int] | int | None) -> list[int]:
        if worker_ids is None:
            return list(range(self.n_env))
        slots = [worker_ids] if isinstance(worker_ids, (int, np.integer)) else list(worker_ids)
        for slot in slots:
            if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_env:
                raise InvalidInputError(f"unknown worker id {slot!r} (n_env={self.n_env})")
        return [int(s) for s in slots]

    def _request(self, cmd: Cmd, worker_ids: Sequence[int] | None, payload: Callable) -> list[Any]:
        return self.receive_request(self.send_request(cmd, worker_ids, payload))

    def send_request(self, cmd: Cmd, worker_ids: Sequence[int] | None, payload: Callable) -> Request:
        """Send ``cmd`` (CALL, GET_ATTR, SET_ATTR) to the processes hosting ``worker_ids``.

        ``payload(local_indices, worker_ids_of_that_process)`` builds each process's payload.
        Steps in flight on those processes are waited out first and kept for ``receive_steps``.
        """
        slots = self._slots(worker_ids)
        pool = self.pool
        by_worker: dict[int, list[int]] = {}
        for slot in dict.fromkeys(slots):
            by_worker.setdefault(self._slot_worker[slot], []).append(slot)
        workers = [pool.workers[i] for i in by_worker]
        for w in workers:
            if w.failure is not None:
                raise w.failure
        try:  # everything that can fail happens before the first send: nothing half-sent
            outgoing = [
                (w, encode_payload(payload([self._slot_local[s] for s in by_worker[w.index]], by_worker[w.index])))
                for w in workers
            ]
        except Exception as exc:
            raise InvalidInputError(f"the {cmd.name.lower()} request cannot be sent: {exc!r}") from exc
        busy = [w for w in workers if w.busy]
        if busy:
            pool.gather_quietly(busy, "the in-flight requests", sink=self._absorb)
        for w, data in outgoing:
            w = pool.workers[w.index]  # the process may have been replaced meanwhile
            self._answers.pop(w.index, None)
            pool.send(w, cmd, data)
        return Request(cmd, slots, by_worker)

    def receive_request(self, request: Request, timeout: float | None = None) -> list[Any]:
        """The answers to ``send_request``, in the order of its worker ids. Answers that
        arrive before a timeout are kept: calling again picks up where this call stopped."""
        completions = self._await_answers(set(request.by_worker), timeout, f"{request.cmd.name.lower()} results")
        for c in completions:
            if c.error is not None:
                raise c.error
        answers = {s: item for c in completions for s, item in zip(request.by_worker[c.worker.index], c.items or [])}
        return [answers.get(s) for s in request.slots]

    def _await_answers(self, indices: set[int], timeout: float | None, what: str) -> list[Completion]:
        pool = self.pool
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        self._absorb(pool.poll(0.0))
        while not indices <= self._answers.keys():
            now = time.monotonic()
            if now >= deadline:
                late = [s for i in sorted(indices - self._answers.keys()) for s in pool.workers[i].env_ids]
                raise WorkerTimeoutError(late, limit, what, hung=False)
            self._absorb(pool.poll(deadline - now))
        return [self._answers.pop(i) for i in sorted(indices)]
