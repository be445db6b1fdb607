"""One versioned log of env updates (:class:`UpdateLog`, once per layer), and :func:`apply`, which
runs them in a worker. An **env update** is a picklable ``fn(env)`` for every slot, or a list
with one per slot (``None``: nothing for that slot); a slot's env gets them when its next episode
starts, never mid-episode, and a fresh env starts at version 0 and gets every update again, in
order. The flow, and the Ray driver's slices (:class:`Pickled`): see docs/architecture.md.

Not in this log: the core's **replayed calls** (``set_replay_calls``: the ML-Agents managers' env
parameters, engine settings, analytics). They are *state*, not history: replaced as a whole,
applied to live envs at once, versionless (no episode is stamped with them), and replayed into a
restarted process *before* the reset that answers the requests it lost. A log of every change
would replay the whole curriculum into each restart and grow without end; a snapshot of
settings cannot express ``fn(env)`` updates, which do not commute.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import cloudpickle

from envmanager.errors import InvalidInputError

__all__ = ["Due", "Entry", "Pickled", "UpdateLog", "apply"]


class Pickled(NamedTuple):
    """An env update another log already checked and pickled, one payload per slot (``None``:
    nothing for that slot): recorded as it is (a Ray node gets its slice of the driver's)."""

    payloads: tuple[bytes | None, ...]


class Entry(NamedTuple):
    """One recorded env update: its version and one cloudpickled ``fn(env)`` per slot."""

    version: int
    payloads: tuple[bytes | None, ...]

    def sliced(self, start: int, stop: int) -> Pickled:
        """The payloads of slots ``start .. stop - 1``, to be recorded by another log."""
        return Pickled(self.payloads[start:stop])


class Due(NamedTuple):
    """What an env at some version still needs: the version it reaches (the log's newest) and
    the updates for its slot newer than what it has, in order (``(version, cloudpickled fn)``)."""

    version: int
    updates: tuple[tuple[int, bytes], ...]


class UpdateLog:
    """Every env update of ``n_slots`` slots so far, versioned 1, 2, ... (thread-safe: a learner
    thread may record while a collection reads what is due)."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = int(n_slots)
        self._entries: list[Entry] = []
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The newest version (0: nothing recorded)."""
        with self._lock:
            return len(self._entries)

    def prepare(self, update: Any) -> Pickled:
        """``update`` checked and pickled, not recorded: a ``fn(env)`` for every slot, a list of
        ``n_slots`` of them (``None`` to skip a slot), or a :class:`Pickled` of that length.
        ``InvalidInputError`` if it is none of these or does not pickle."""
        if isinstance(update, Pickled):
            if len(update.payloads) != self.n_slots or not all(p is None or isinstance(p, bytes) for p in update.payloads):
                raise InvalidInputError(f"a pickled env update needs {self.n_slots} payloads, got {len(update.payloads)}")
            return update
        per_slot = list(update) if isinstance(update, (list, tuple)) else [update] * self.n_slots
        if len(per_slot) != self.n_slots or not all(u is None or callable(u) for u in per_slot):
            raise InvalidInputError(f"env_update must be a callable fn(env) or a list of {self.n_slots} of them")
        try:
            return Pickled(tuple(None if u is None else cloudpickle.dumps(u) for u in per_slot))
        except Exception as exc:
            raise InvalidInputError(f"env_update cannot be pickled: {exc!r}") from exc

    def record(self, update: Any) -> int:
        """Check and pickle ``update`` (see ``prepare``), then record it; returns its version.
        Raises before anything is recorded, so the version moves only with an update."""
        return self.append(self.prepare(update))

    def append(self, prepared: Pickled) -> int:
        """Record an update ``prepare`` gave; returns its version."""
        with self._lock:
            self._entries.append(Entry(len(self._entries) + 1, prepared.payloads))
            return len(self._entries)

    def since(self, have: int) -> list[Entry]:
        """Every entry newer than version ``have``, in order (a restarted node's replay: 0)."""
        with self._lock:
            return self._entries[max(0, have):]

    def due(self, slot: int, have: int) -> Due:
        """What slot ``slot``'s env at version ``have`` needs to reach the newest version."""
        with self._lock:
            updates = tuple((e.version, p) for e in self._entries[max(0, have):] if (p := e.payloads[slot]) is not None)
            return Due(max(have, len(self._entries)), updates)


#: In a worker: how far an env got through updates when one of them raised, so the next ``apply``
#: on the same env object goes on from there (``fn(env)`` updates need not be idempotent; the
#: caller's version stays what it was). A rebuilt or restarted env is another object.
_REACHED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def apply(env: Any, due: Due | Sequence[Any], have: int) -> int:
    """Run in the worker: each update of ``due`` newer than ``have`` on ``env``, in order; returns
    the version the env then has. An update that raises propagates (the caller's failure path
    decides; the updates before it are not run again on this env object: ``_REACHED``)."""
    version, updates = due
    try:
        have = max(have, _REACHED.pop(env, 0))
    except TypeError:  # (an env that cannot be weakly referenced)
        pass
    for v, payload in updates:
        if v > have:
            try:
                cloudpickle.loads(payload)(env)
            except BaseException:
                try:
                    _REACHED[env] = v - 1
                except TypeError:
                    pass
                raise
    return max(have, version)
