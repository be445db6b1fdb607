"""The ``UnityEnvironment`` of an attached player (:mod:`envmanager.mlagents.attach`), in the worker.

``UnityEnvironment(file_name=None)`` launches nothing and waits for a player to connect, as it
waits for the Editor; its gRPC server listens on every interface. This one listens on the
player's address only (``host:port``), checks the port first (a gRPC server with
``SO_REUSEPORT``, as mlagents makes it, could otherwise share a port with another trainer), and
says which address a timeout is about: with no process of ours to watch, a player that is gone
is seen only as a message that does not come within ``timeout_wait``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from mlagents_envs.communicator_objects.unity_to_external_pb2_grpc import add_UnityToExternalProtoServicer_to_server
from mlagents_envs.environment import UnityEnvironment
from mlagents_envs.exception import UnityTimeOutException
from mlagents_envs.rpc_communicator import RpcCommunicator, UnityToExternalServicerImplementation

from envmanager.mlagents.attach import AddressInUseError, PlayerAddress, check_listenable

__all__ = ["AttachedUnityEnvironment", "AddressCommunicator"]


class AddressCommunicator(RpcCommunicator):
    """mlagents' ``RpcCommunicator`` (the gRPC server a player connects to), on one address."""

    def __init__(self, address: PlayerAddress, timeout_wait: int) -> None:
        self.address = address
        self.connected = False
        super().__init__(worker_id=0, base_port=address.port, timeout_wait=timeout_wait)

    def create_server(self) -> None:
        """As ``RpcCommunicator.create_server``, listening on ``address`` instead of ``[::]``."""
        check_listenable(self.address)
        self.server = grpc.server(ThreadPoolExecutor(max_workers=10), options=(("grpc.so_reuseport", 1),))
        self.unity_to_external = UnityToExternalServicerImplementation()
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
        """Wait up to ``timeout_wait`` for the player's next message (there is no process to poll)."""
        if self.unity_to_external.parent_conn.poll(self.timeout_wait):
            return
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
