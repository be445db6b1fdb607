"""The answer transport: how workers' answers reach the parent, behind one small interface.

Two kinds, picked by ``envmanager.core.platforms.transport_name``:

* ``StepQueue`` (``step_queue``): one shared POSIX pipe of atomic notices; the default where
  it works (Linux, macOS).
* ``PortableAnswers`` (``portable``): each worker answers on its own pipe (the
  ``multiprocessing`` ``Connection`` it reads requests from), and the parent waits on all
  of them and the process sentinels together with ``multiprocessing.connection.wait``, which
  works on Windows named pipes and POSIX alike. One whole answer per message, so large
  answers need no second channel.

Both carry the same notices (``encode_answer``'s header and payload), so the shared-memory
data path, sequence numbers and error answers are the same. The parent side has ``watch``
(what to wait on), ``wait`` (until something is ready; returns the ended sentinels),
``take`` (every answer that has arrived) and ``close``; the worker side is a ``WorkerLink``.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_ready
from typing import Any, cast

from envmanager.wire.messages import EnvironmentResponse, decode_notice
from envmanager.wire.step_queue import FrameReader, StepQueue, write_frame

__all__ = ["make_transport", "PortableAnswers", "WorkerLink", "link_for", "StepQueue"]


def make_transport(name: str, ctx: Any) -> StepQueue | PortableAnswers:
    """The parent side of transport ``name`` (see ``platforms.transport_name``)."""
    return PortableAnswers() if name == "portable" else StepQueue(ctx)


class PortableAnswers:
    """Parent side of the portable transport: answers on each worker's own pipe."""

    #: What workers get as their queue: nothing, they answer on their own pipe.
    writer = None

    def __init__(self) -> None:
        self._conns: list[Connection] = []
        self._sentinels: list[int] = []
        self._ready: list[Connection] | None = None  # pipes ``wait`` found readable, for ``take``
        self._ended: set[Connection] = set()  # pipes at end of file: their process is ending

    def watch(self, conns: list[Connection], sentinels: list[int]) -> None:
        """Wait from now on for answers on ``conns`` and the end of ``sentinels``' processes."""
        self._conns = [c for c in conns if not c.closed]
        self._sentinels = list(sentinels)
        self._ready = None
        self._ended &= set(self._conns)

    def wait(self, timeout: float) -> list[int]:
        """Block up to ``timeout`` s until an answer or a process end; the ended sentinels."""
        ready = wait_for_ready([*self._open(), *self._sentinels], max(0.0, timeout))
        # Sentinels are ints (fds, or handles on Windows, where pipes are not ``Connection``s).
        self._ready = [cast(Connection, r) for r in ready if not isinstance(r, int)]  # not ints: our pipes
        return [r for r in ready if isinstance(r, int)]

    def take(self) -> list[EnvironmentResponse]:
        """Every whole answer waiting now; never waits for one that has not begun."""
        ready, self._ready = self._ready, None
        if ready is None:
            conns = self._open()
            ready = cast(list[Connection], wait_for_ready(conns, 0)) if conns else []  # it returns what it got
        out = []
        for conn in ready:
            try:
                while True:
                    data = conn.recv_bytes()
                    out.append(decode_notice(data, 0, len(data)))
                    if not conn.poll():
                        break
            except (EOFError, OSError):  # the worker is gone: its sentinel tells the pool
                self._ended.add(conn)
        return out

    def _open(self) -> list[Connection]:
        return [c for c in self._conns if not c.closed and c not in self._ended]

    def close(self) -> None:
        self._conns, self._sentinels, self._ready, self._ended = [], [], None, set()


class WorkerLink:
    """Worker side of the portable transport: requests in and answers out on one pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def read(self) -> bytes:
        return self.conn.recv_bytes()

    def has_input(self) -> bool:
        return self.conn.poll()

    def post(self, header: bytes, payload: bytes) -> None:
        self.conn.send_bytes(header + payload)

    def farewell(self, notice: bytes) -> None:
        self.conn.send_bytes(notice)


class QueueLink(WorkerLink):
    """Worker side of the step queue: plain reads and writes on the pipes' descriptors."""

    def __init__(self, conn: Connection, queue_writer: Connection) -> None:
        import select

        super().__init__(conn)
        self.queue_fd = queue_writer.fileno()
        self.requests = FrameReader(conn.fileno())
        self._incoming = select.poll()
        self._incoming.register(conn.fileno(), select.POLLIN)

    def read(self) -> bytes:
        return self.requests.read()

    def has_input(self) -> bool:
        return bool(self.requests.buf) or bool(self._incoming.poll(0))

    def post(self, header: bytes, payload: bytes) -> None:
        StepQueue.post(self.queue_fd, self.conn, header, payload)

    def farewell(self, notice: bytes) -> None:
        write_frame(self.queue_fd, notice)


def link_for(conn: Connection, queue_writer: Connection | None) -> WorkerLink:
    """The worker's link: the step queue if it was given one, else the portable pipe."""
    return WorkerLink(conn) if queue_writer is None else QueueLink(conn, queue_writer)
