"""A sampler's versions and updates, written once for every sampler.

``Sampler``, ``WorkerPolicySampler`` and ``RaySampler`` each keep one :class:`Versions` (the env
update log and the newest agent); they differ in how an agent is made ready to travel (as it is,
pickled once, one ``ray.put``) and whether an update is sent on at once (the Ray nodes): the
``prepare`` and ``publish`` functions they pass in. ``update`` prepares everything that can fail
first and publishes before it records, so an update that raises leaves both versions as they
were and is never replayed into a restarted process or node. :class:`SamplerBase` gives the three
samplers the versions they report, their cut episodes and their lifetime, once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from envmanager.core.updates import Pickled, UpdateLog

if TYPE_CHECKING:
    from envmanager.sampler.slots import EpisodeSlots

__all__ = ["Versions", "Publish", "SamplerBase"]

_S = TypeVar("_S", bound="SamplerBase")

#: ``publish(agent_version, prepared agent, env update)``: sends an update on (``None`` where
#: the update has no such part); raising stops the update from being recorded.
Publish = Callable[[int | None, Any, Pickled | None], None]


class Versions:
    """The env update log of ``n_slots`` slots and the newest agent (thread-safe: a learner
    thread may call ``update`` while a collection runs)."""

    def __init__(self, n_slots: int, prepare: Callable[[Any], Any] | None = None, publish: Publish | None = None,
                 agent: Any = None) -> None:
        self.env_updates = UpdateLog(n_slots)
        self._prepare = prepare or (lambda agent: agent)
        self._publish = publish
        self._lock = threading.RLock()  # reentrant: a Ray replay holds it while it reads (``locked``)
        self._agent_version = 0
        self._agent: Any = agent  # the newest agent, prepared (version 0: the one the sampler began with)
        self._fresh = False  # an agent update not taken yet (``take_agent``)

    @property
    def agent_version(self) -> int:
        return self._agent_version

    @property
    def env_version(self) -> int:
        return self.env_updates.version

    def update(self, agent_update: Any = None, env_update: Any = None, version: int | None = None) -> tuple[int, int]:
        """A new agent (its version: ``version``, default one more) and/or env update (a
        picklable ``fn(env)``, or a list with one per slot); returns ``(agent_version,
        env_version)``. Raises before recording anything if either cannot be prepared or sent."""
        env = self.env_updates.prepare(env_update) if env_update is not None else None
        agent = self._prepare(agent_update) if agent_update is not None else None
        with self._lock:
            agent_version = None
            if agent_update is not None:
                agent_version = self._agent_version + 1 if version is None else int(version)
            if self._publish is not None and (agent_version is not None or env is not None):
                self._publish(agent_version, agent, env)
            if agent_version is not None:
                self._agent_version, self._agent, self._fresh = agent_version, agent, True
            if env is not None:
                self.env_updates.append(env)
            return self._agent_version, self.env_updates.version

    def locked(self) -> threading.RLock:
        """The lock ``update`` publishes and records under: held, no update is half done."""
        return self._lock

    def agent(self) -> tuple[int, Any]:
        """The newest agent's version and its prepared form (version 0: what the sampler was
        given, as it was given)."""
        with self._lock:
            return self._agent_version, self._agent

    def take_agent(self) -> tuple[int, Any] | None:
        """The newest agent if no one took it since it came (the parent-side policy applies
        it once); else ``None``."""
        with self._lock:
            if not self._fresh:
                return None
            self._fresh = False
            return self._agent_version, self._agent


class SamplerBase:
    """What every sampler shares: the versions it reports and its lifetime (``close``)."""

    versions: Versions
    episodes: EpisodeSlots

    @property
    def policy_version(self) -> int:
        """The newest policy version (see ``update`` for when it acts)."""
        return self.versions.agent_version

    @property
    def env_version(self) -> int:
        return self.versions.env_version

    @property
    def cut_episodes(self) -> list[int]:
        """Ids of the episodes a fault cut, in the order seen: their rows still held are flagged
        ``interrupted`` (rows a ``stream`` handed out already cannot be recalled)."""
        return self.episodes.cut_episodes

    def close(self) -> None:
        raise NotImplementedError

    def shutdown_worker(self) -> None:
        """garage's name for ``close``."""
        self.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
