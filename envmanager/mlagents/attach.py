"""Players the trainer attaches to: Unity players that envmanager does not start.

In ML-Agents' protocol the trainer is the gRPC server, so it listens on each player's address
(``host:port`` of this machine; worker ``w`` serves ``addresses[w]``) and waits up to
``timeout_wait`` for the player to connect. envmanager never kills or restarts these players: a
lost one is a :class:`PlayerLostError` naming its address (see docs/guide/mlagents.md, "Players
already running"). The ``UnityEnvironment`` listening on one address, imported in the worker, is
:mod:`envmanager.mlagents.attached_env`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from envmanager.core.deadline import positive_seconds
from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError, failed_slots
from envmanager.mlagents.addresses import AddressInUseError, PlayerAddress, check_listenable
from envmanager.mlagents.worker_env import UnityPortInUseError

__all__ = ["PlayerAddress", "AttachedUnityFactory", "PlayerLostError", "AddressInUseError", "parse_addresses",
           "check_attached", "check_listenable", "lost_players"]


def parse_addresses(addresses: str | Sequence[Any]) -> tuple[PlayerAddress, ...]:
    """``"host:port,host:port"`` or a sequence of addresses -> the checked addresses, in order."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    parsed = tuple(PlayerAddress.parse(a) for a in items)
    if not parsed:
        raise InvalidInputError("no player address given (expected 'host:port,host:port,...')")
    for i, address in enumerate(parsed):
        if address in parsed[:i]:
            raise InvalidInputError(f"player address {address} is given twice: one player per address")
    return parsed


@dataclass(frozen=True)
class AttachedUnityFactory:
    """``(worker_id, side_channels) -> UnityEnvironment`` attached to the player at ``addresses[worker_id]``.

    The trainer waits there up to ``timeout_wait`` seconds for the player to connect; the player
    gets seed ``seed + worker_id`` and ``num_areas`` with the handshake. Pass it to
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
        ids = [w for w in failed_slots(exc) if w in addresses]
        if not ids:
            raise
        raise PlayerLostError(ids[0], addresses[ids[0]], exc) from exc
