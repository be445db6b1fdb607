"""Reaching into the envs: ``call``, ``get_attr``, ``set_attr`` — the parent's half of the
CALL, GET_ATTR and SET_ATTR commands: ``EnvCalls``, a component of the batch manager (its
public methods for them hand their requests to it), with the answers it keeps."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle

from envmanager.core.completion import Completion
from envmanager.errors import InvalidInputError, ManagerClosedError
from envmanager.wire.interrupts import DEFERRED
from envmanager.wire.messages import Call, EnvFunction, SetAttr
from envmanager.wire.messages import EnvironmentCommand as Cmd

if TYPE_CHECKING:
    from envmanager.core.batch import BatchEnvManager

__all__ = ["EnvCalls", "CallRequest"]


class CallRequest:
    """A call sent with ``EnvCalls.send``: which processes answer for which slots."""

    def __init__(self, cmd: Cmd, slots: list[int], by_process: dict[int, list[int]]) -> None:
        self.cmd = cmd
        self.slots = slots
        self.by_process = by_process


class EnvCalls:
    """Sends a request to the processes hosting chosen slots; collects one answer per slot."""

    def __init__(self, manager: BatchEnvManager) -> None:
        self._manager = weakref.ref(manager)  # (a strong one made a cycle: a dropped manager waited for the gc)
        self._answers: dict[int, Completion] = {}  # by process index

    @property
    def manager(self) -> BatchEnvManager:
        manager = self._manager()
        if manager is None:  # (the manager holds this object; only the gc, freeing a cycle, clears it first)
            raise ManagerClosedError("the manager is closed (freed by the garbage collector)")
        return manager

    def file(self, completion: Completion) -> None:
        self._answers[completion.worker.index] = completion

    def clear(self) -> None:
        self._answers.clear()

    def send_call(self, worker_ids: Sequence[int] | None, name: str | EnvFunction | Callable[..., Any],
                  args: tuple = (), kwargs: dict | None = None) -> CallRequest:
        """Send a call of the env method ``name``, or of a function run in the worker as
        ``name(env, *args, **kwargs)``."""
        target = name if isinstance(name, (str, EnvFunction)) else EnvFunction(cloudpickle.dumps(name))
        return self.send(Cmd.CALL, worker_ids, lambda local, own: Call(local, target, tuple(args), kwargs or {}))

    def set_attr(self, name: str, values: Any, worker_ids: Sequence[int] | None = None) -> None:
        slots = self.manager.slots(worker_ids)
        if not isinstance(values, (list, tuple)):
            values = [values] * len(slots)
        if len(values) != len(slots):
            raise InvalidInputError(f"expected {len(slots)} values (one per worker), got {len(values)}")
        by_slot = dict(zip(slots, values, strict=True))
        self.receive(self.send(Cmd.SET_ATTR, slots, lambda local, own: SetAttr(local, name, tuple(by_slot[s] for s in own))))

    def send(self, cmd: Cmd, worker_ids: Sequence[int] | None,
             message: Callable[[tuple[int, ...], list[int]], Any]) -> CallRequest:
        """Send ``cmd`` to the processes hosting ``worker_ids``; ``message(locals, slots)``
        builds each process's request. Steps in flight on those processes are waited out
        first and kept for ``receive_batch``."""
        m = self.manager
        try:
            slots = m.slots(worker_ids)
            pool = m.pool
            by_process: dict[int, list[int]] = {}
            for slot in dict.fromkeys(slots):
                by_process.setdefault(int(m.slot_process[slot]), []).append(slot)
            for index in by_process:
                if pool.processes[index].failure is not None:
                    raise pool.processes[index].failure  # type: ignore[misc]
            try:  # encode everything before the first send: nothing half-sent
                outgoing = [
                    (index, pool.prepare(cmd, message(tuple(m.slot_local[own].tolist()), own), tuple(own)))
                    for index, own in by_process.items()
                ]
            except Exception as exc:
                raise InvalidInputError(f"the {cmd.name.lower()} request cannot be sent: {exc!r}") from exc
            m.wait_idle(slots)
            for index, _ in outgoing:  # a restart that failed meanwhile gave the process up
                if pool.processes[index].failure is not None:
                    raise pool.processes[index].failure  # type: ignore[misc]
            with DEFERRED:  # a Ctrl-C waits for every request to be sent
                for index, request in outgoing:
                    self._answers.pop(index, None)
                    pool.processes[index].send(request)  # the process may have been replaced meanwhile
            return CallRequest(cmd, slots, by_process)
        except Exception as exc:
            m.closed_meanwhile(exc)  # (another thread's close() took what the call reached for)
            raise

    def ready(self, request: CallRequest) -> bool:
        """Whether every answer to ``request`` is in (then ``receive`` does not wait)."""
        return self._answers.keys() >= request.by_process.keys()

    def receive(self, request: CallRequest, timeout: float | None = None) -> list[Any]:
        """The answers to ``send``, in the order of its worker ids. Answers that arrive before
        a timeout are kept: calling again picks up where this call stopped."""
        m = self.manager
        with DEFERRED:  # a Ctrl-C between taking the answers and returning them waits
            wanted = set(request.by_process)
            m.wait_for(lambda: wanted <= self._answers.keys(), timeout, f"{request.cmd.name.lower()} results",
                       lambda: [s for i in sorted(wanted - self._answers.keys()) for s in request.by_process[i]])
            completions = [self._answers.pop(i) for i in sorted(wanted)]
            for c in completions:
                if c.error is not None:
                    raise c.error
            answers = {s: value for c in completions
                       for s, value in zip(request.by_process[c.worker.index], c.answer.values, strict=True)}
            return [answers.get(s) for s in request.slots]

