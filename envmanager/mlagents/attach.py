"""Players the trainer attaches to: Unity players that envmanager does not start.

A game server, an Editor session or a build started by another tool is told (its
``--mlagents-port``, the Editor's Play button) where the trainer is. In ML-Agents' protocol the
trainer's side is the gRPC *server* and the player the client: so the trainer listens on each
player's address (``host:port``, ``host`` an address of this machine) and waits up to
``timeout_wait`` for that player to connect, as ``UnityEnvironment(file_name=None)`` waits for
the Editor. Worker ``w`` serves ``addresses[w]``.

envmanager did not start these players, so it never kills or restarts them: a lost player
(gone, or silent for ``timeout_wait``) is a :class:`PlayerLostError` naming its address, and
``close()`` only ends the session (Unity's close message, as ``mlagents-learn`` sends it).

Here: the addresses (:func:`parse_addresses`), the checks made before anything starts
(:func:`check_attached`), the factory (:class:`AttachedUnityFactory`) and the errors. The
``UnityEnvironment`` that listens on one address is :mod:`envmanager.mlagents.attached_env`
(imported in the worker).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from envmanager.core.deadline import positive_seconds
from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError
from envmanager.mlagents.addresses import AddressInUseError, PlayerAddress, check_listenable
from envmanager.mlagents.worker_env import UnityPortInUseError

__all__ = [
    "PlayerAddress",
    "AttachedUnityFactory",
    "PlayerLostError",
    "AddressInUseError",
    "parse_addresses",
    "check_attached",
    "check_listenable",
    "lost_players",
]


def parse_addresses(addresses: str | Sequence[Any]) -> tuple[PlayerAddress, ...]:
    """``"host:port,host:port"`` or a sequence of addresses -> the checked addresses, in order."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    parsed = tuple(PlayerAddress.parse(a) for a in items)
    if not parsed:
        raise InvalidInputError("no player address given (expected 'host:port,host:port,...')")
    seen: set[PlayerAddress] = set()
    for address in parsed:
        if address in seen:
            raise InvalidInputError(f"player address {address} is given twice: one player per address")
        seen.add(address)
    return parsed


@dataclass(frozen=True)
class AttachedUnityFactory:
    """``(worker_id, side_channels) -> UnityEnvironment`` attached to the player at ``addresses[worker_id]``.

    The trainer listens there and waits up to ``timeout_wait`` seconds for the player to connect;
    the player gets seed ``seed + worker_id`` and ``num_areas`` with the handshake (as
    :class:`~envmanager.mlagents.UnityEnvironmentFactory`). Pass it to
    :class:`~envmanager.mlagents.MLAgentsEnvManager` with ``n_env=len(addresses)``.
    """

    addresses: tuple[PlayerAddress, ...]
    seed: int = 0
    timeout_wait: int = 60
    num_areas: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "addresses", parse_addresses(self.addresses))
        positive_seconds("timeout_wait", self.timeout_wait)

    @classmethod
    def from_run_options(cls, addresses: str | Sequence[Any], run_options: Any) -> AttachedUnityFactory:
        """The factory ``envmanager-learn --env-addresses`` uses: seed (``--seed``; -1 picks one,
        as ML-Agents does), ``--timeout-wait`` and ``--num-areas`` from ML-Agents' ``RunOptions``."""
        env = run_options.env_settings
        seed = int(env.seed) if int(env.seed) != -1 else random.randrange(10000)
        return cls(parse_addresses(addresses), seed=seed, timeout_wait=int(env.timeout_wait),
                   num_areas=int(getattr(env, "num_areas", 1)))

    def __call__(self, worker_id: int, side_channels: list[Any]) -> Any:
        from envmanager.mlagents.attached_env import AttachedUnityEnvironment

        return AttachedUnityEnvironment(
            self.addresses[worker_id], seed=self.seed + worker_id, timeout_wait=self.timeout_wait,
            side_channels=list(side_channels), num_areas=self.num_areas,
        )


class PlayerLostError(EnvManagerError):
    """An attached player was lost (or never connected): it is not restarted, since envmanager
    did not start it. ``failure`` is the worker's error (with its traceback)."""

    def __init__(self, worker_id: int, address: PlayerAddress, failure: BaseException | None = None) -> None:
        self.worker_id = worker_id
        self.worker_ids = [worker_id]
        self.address = address
        self.failure = failure
        super().__init__(
            f"the player at {address} (worker {worker_id}) is lost: it did not connect, stopped or "
            "stopped answering. It is an attached player (envmanager did not start it), so it is "
            f"neither restarted nor killed. The failure: {failure}"
        )

    def __reduce__(self):
        return (type(self), (self.worker_id, self.address, self.failure))


def check_attached(factory: AttachedUnityFactory, n_env: int) -> None:
    """Before anything starts: one address per env, and every address free to listen on."""
    if n_env != len(factory.addresses):
        raise InvalidInputError(
            f"{len(factory.addresses)} player addresses for {n_env} envs: give one address per env "
            f"(n_env / --num-envs = {len(factory.addresses)})"
        )
    for worker_id, address in enumerate(factory.addresses):
        check_listenable(address, worker_id)


@contextmanager
def lost_players(addresses: Mapping[int, PlayerAddress]) -> Iterator[None]:
    """A worker's failure, when it serves an attached player, as a :class:`PlayerLostError`
    naming the player's address (the error is its ``failure`` and ``__cause__``)."""
    try:
        yield
    except EnvManagerError as exc:
        if not addresses or isinstance(exc, (InvalidInputError, ManagerClosedError, UnityPortInUseError)):
            raise
        ids = [w for w in getattr(exc, "worker_ids", None) or [getattr(exc, "worker_id", None)] if w in addresses]
        if not ids:
            raise
        raise PlayerLostError(ids[0], addresses[ids[0]], exc) from exc
