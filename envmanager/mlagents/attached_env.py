"""The ``UnityEnvironment`` of an attached player (:mod:`envmanager.mlagents.attach`), in the worker.

Unlike ``UnityEnvironment(file_name=None)`` (which waits for the Editor on every interface), it
listens on the player's address only, checks the port first (a gRPC server with ``SO_REUSEPORT``,
as mlagents makes it, could otherwise share a port with another trainer), and names the address in
its failures. With no process of ours to watch, a player that is gone is seen by its TCP
connection (:class:`PeerWatch`: within about two seconds, on Linux) or after ``timeout_wait``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from mlagents_envs.communicator_objects.unity_to_external_pb2_grpc import add_UnityToExternalProtoServicer_to_server
from mlagents_envs.environment import UnityEnvironment
from mlagents_envs.exception import UnityCommunicationException, UnityTimeOutException
from mlagents_envs.rpc_communicator import RpcCommunicator, UnityToExternalServicerImplementation

from envmanager.mlagents.addresses import AddressInUseError, PlayerAddress, check_listenable

__all__ = ["AttachedUnityEnvironment", "AddressCommunicator", "PeerWatch", "connection_states"]

ESTABLISHED = "01"  # the TCP state in /proc/net/tcp


def connection_states(local_port: int, remote_port: int) -> list[str] | None:
    """The states of this network namespace's TCP connections from ``local_port`` to
    ``remote_port`` (Linux: ``/proc/net/tcp``, ``tcp6``); ``None`` where they cannot be read."""
    found: list[str] = []
    read = False
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            try:
                local, remote = int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)
            except (IndexError, ValueError):
                continue
            if local == local_port and remote == remote_port:
                found.append(fields[3])
    return found if read else None


class PeerWatch:
    """Whether the player's connection (the peer of its last ``Exchange``) closed: only one seen
    established, and missing from two looks in a row (where the table cannot be read or matched,
    nothing is ever reported: ``timeout_wait`` still applies)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.peer_port: int | None = None
        self.seen = False
        self.missing = 0

    def note(self, peer: str) -> None:
        """The peer of an ``Exchange`` (``ipv4:127.0.0.1:54321``, ``ipv6:[::1]:54321``)."""
        try:
            port = int(peer.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return
        if port != self.peer_port:  # a new connection (once per session): is it in the table?
            self.peer_port, self.missing = port, 0
            self.seen = ESTABLISHED in (connection_states(self.port, port) or [])

    def gone(self) -> bool:
        states = None if self.peer_port is None else connection_states(self.port, self.peer_port)
        if states is None or not (self.seen or ESTABLISHED in states):
            return False
        if ESTABLISHED in states:
            self.seen, self.missing = True, 0
            return False
        self.missing += 1
        return self.missing >= 2


class _WatchedServicer(UnityToExternalServicerImplementation):
    """mlagents' servicer, noting who calls."""

    def __init__(self, watch: PeerWatch) -> None:
        super().__init__()
        self.watch = watch

    def Exchange(self, request: Any, context: Any) -> Any:
        self.watch.note(context.peer())
        return super().Exchange(request, context)


class AddressCommunicator(RpcCommunicator):
    """mlagents' ``RpcCommunicator`` (the gRPC server a player connects to), on one address."""

    def __init__(self, address: PlayerAddress, timeout_wait: int) -> None:
        self.address = address
        self.connected = False
        self.watch = PeerWatch(address.port)
        super().__init__(worker_id=0, base_port=address.port, timeout_wait=timeout_wait)

    def create_server(self) -> None:
        """As ``RpcCommunicator.create_server``, listening on ``address`` instead of ``[::]``."""
        check_listenable(self.address)
        self.server = grpc.server(ThreadPoolExecutor(max_workers=10), options=(("grpc.so_reuseport", 1),))
        self.unity_to_external = _WatchedServicer(self.watch)
        add_UnityToExternalProtoServicer_to_server(self.unity_to_external, self.server)
        try:
            bound = self.server.add_insecure_port(str(self.address))
        except RuntimeError as exc:  # newer gRPC raises where older returns 0
            raise AddressInUseError(self.address, None, str(exc)) from None
        if not bound:
            raise AddressInUseError(self.address, None, "gRPC could not bind")
        self.server.start()
        self.is_open = True

    def poll_for_timeout(self, poll_callback: Any = None) -> None:
        """Wait up to ``timeout_wait`` for the player's next message (there is no process to
        poll), looking at its connection every second."""
        deadline = time.monotonic() + self.timeout_wait
        while (left := deadline - time.monotonic()) > 0:
            if self.unity_to_external.parent_conn.poll(min(1.0, left)):
                return
            if self.watch.gone():
                raise UnityCommunicationException(
                    f"the player at {self.address} closed its connection: it stopped or crashed")
        if not self.connected:
            raise UnityTimeOutException(
                f"no player connected to {self.address} within {self.timeout_wait} s: start it (or press Play "
                f"in the Editor) with --mlagents-port {self.address.port}, reaching this machine at {self.address}"
            )
        raise UnityTimeOutException(
            f"the player at {self.address} sent nothing for {self.timeout_wait} s: it stopped, crashed or hangs"
        )

    def initialize(self, inputs: Any, poll_callback: Any = None) -> Any:
        output = super().initialize(inputs, poll_callback)
        self.connected = True
        return output


class AttachedUnityEnvironment(UnityEnvironment):
    """A ``UnityEnvironment`` that launches nothing and waits for the player at ``address``."""

    def __init__(self, address: PlayerAddress, **kwargs: Any) -> None:
        self.address = address
        super().__init__(file_name=None, worker_id=0, base_port=address.port, **kwargs)

    def _get_communicator(self, worker_id: int, base_port: int, timeout_wait: int) -> AddressCommunicator:
        return AddressCommunicator(self.address, timeout_wait)
