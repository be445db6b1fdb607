"""A player's address, and whether the trainer can listen there: what both halves of attaching
need — the parent's checks (:mod:`envmanager.mlagents.attach`) and the worker's listening
``UnityEnvironment`` (:mod:`envmanager.mlagents.attached_env`)."""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import Any

from envmanager.errors import EnvManagerError, InvalidInputError
from envmanager.mlagents.worker_env import UnityPortInUseError

__all__ = ["PlayerAddress", "AddressInUseError", "check_listenable"]


@dataclass(frozen=True)
class PlayerAddress:
    """Where the trainer listens for one player: ``host:port`` (``[::1]:5005`` for IPv6)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: Any) -> PlayerAddress:
        """``"host:port"`` -> a ``PlayerAddress``; anything else is an :class:`InvalidInputError`."""
        if isinstance(text, PlayerAddress):
            return text
        if not isinstance(text, str):
            raise InvalidInputError(f"a player address is 'host:port', got {text!r}")
        host, sep, port = text.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host:
            sep = ""  # an IPv6 host without brackets: its port cannot be told from its last group
        if not sep or not host or not port:
            raise InvalidInputError(f"player address {text!r} is not 'host:port' (IPv6: '[::1]:5005')")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInputError(f"player address {text!r}: the port must be a number in 1..65535")
        return cls(host, int(port))


class AddressInUseError(UnityPortInUseError):
    """The trainer cannot listen on a player's address: another program listens on that port."""

    def __init__(self, address: PlayerAddress, worker_id: int | None = None, detail: str = "") -> None:
        super().__init__(address.port, None, worker_id, detail)
        self.address = address
        which = "" if worker_id is None else f" (worker {worker_id})"
        EnvManagerError.__init__(
            self, f"cannot listen for the player at {address}{which}: port {address.port} is in use "
            "(another trainer or program listens there); stop it or give the player another port"
        )

    def __reduce__(self):
        return (type(self), (self.address, self.worker_id, self.detail))


def check_listenable(address: PlayerAddress, worker_id: int | None = None) -> None:
    """Raise unless the trainer can listen on ``address`` now: :class:`AddressInUseError` if its
    port is taken, :class:`InvalidInputError` if its host is unknown or not of this machine."""
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidInputError(f"player address {address}: unknown host {address.host!r} ({exc})") from None
    bound, problems = 0, []
    for family, kind, proto, _, sockaddr in infos:
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as mlagents: TIME_WAIT is no clash
            s.bind(sockaddr)
            s.listen(1)
            bound += 1
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUseError(address, worker_id, str(exc)) from None
            problems.append(exc)
        finally:
            s.close()
    if not bound:
        raise InvalidInputError(
            f"player address {address}: cannot listen there ({problems[0] if problems else 'no address'}); "
            "the host must be an address of this machine (the player connects to the trainer)"
        )
