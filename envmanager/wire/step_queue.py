"""The step queue: the one pipe every worker posts its answers on, read by the parent.

A plain pipe whose write end all workers share. Each notice is written with a single
``write`` of at most ``PIPE_BUF`` bytes, which POSIX makes atomic, so no lock is needed and a
worker killed mid-write can neither corrupt nor block the queue for the others. An answer
too big for one notice goes over the worker's own pipe, announced by a notice. Needs
``fcntl`` and ``select.poll`` only once a queue is made, so the module imports everywhere;
where they are missing the portable transport (``envmanager.wire.transport``) is used.
"""

from __future__ import annotations

import math
import os
import select
import struct
import time
from multiprocessing.connection import Connection
from typing import Any

from envmanager.wire.interrupts import blocking
from envmanager.wire.mailbox import MARGIN_NS, Mailboxes
from envmanager.wire.messages import EnvironmentResponse, decode_notice, on_pipe_notice
from envmanager.wire.spin import SpinPolicy

__all__ = ["StepQueue", "FrameReader", "read_message", "write_frame", "MAX_NOTICE_BYTES"]

# Largest notice that still goes out in one atomic write (4-byte length header included).
MAX_NOTICE_BYTES = getattr(select, "PIPE_BUF", 512) - 4  # POSIX guarantees at least 512
#: With answers in the mailbox, how often the parent still polls its pipe (ended processes, big
#: answers) when it finds answers at once; while it spins for them, five times as often.
POLL_INTERVAL_NS = 500_000
_F_SETPIPE_SZ = 1031  # Linux fcntl: grow the pipe so many workers can post without waiting


class StepQueue:
    """The shared step queue: many writers (workers), one reader (the parent); with a mailbox
    (``mailboxes``), answers that fit come through shared memory instead and the pipe carries
    the rest, the wake-ups of a sleeping parent and the ends of processes."""

    def __init__(self, ctx: Any) -> None:
        import fcntl

        self.reader, self.writer = ctx.Pipe(duplex=False)
        try:
            fcntl.fcntl(self.writer.fileno(), _F_SETPIPE_SZ, 1 << 20)
        except OSError:  # not Linux, or above pipe-max-size: the default size still works
            pass
        self._fd = self.reader.fileno()
        os.set_blocking(self._fd, False)  # the parent reads what is there, never waits in read
        self._rest = b""  # the start of a notice cut by the end of a read
        self._poller: Any = None
        self._readable = False  # the last poll saw the queue readable: ``take`` reads it
        self._next_poll = 0  # with answers in the mailbox, the pipe is polled only from then on (ns)
        #: The clock of spins and polls (``time.monotonic_ns``; tests give a fake one).
        self.clock = time.monotonic_ns
        #: Nanoseconds ``wait`` spent spinning, caught or not: CPU the parent burnt waiting, which
        #: a parent with answers always ready would not (the bench takes it out of its CPU per answer).
        self.spun_ns = 0
        #: How ``wait`` spins before it blocks (``None``: it does not): set only where the
        #: parent has a core of its own (a blocked parent wakes tens of microseconds after the notice).
        self.spin: SpinPolicy | None = None
        #: The parent's side of the mailbox, if the workers have one.
        self.mailboxes: Mailboxes | None = None

    def set_spin(self, spin_s: float) -> None:
        """Spin up to ``spin_s`` seconds per wait before blocking (0: never), about twice as long
        as answers typically take to come (``SpinPolicy``, sized)."""
        floor = MARGIN_NS * 1e-9 if self.mailboxes is not None else 0.0
        self.spin = SpinPolicy(spin_s, floor, sized=True) if spin_s > 0 or floor > 0 else None

    # -- waiting (parent side) --------------------------------------------------------------
    def watch(self, conns: list[Connection], sentinels: list[int]) -> None:
        """Wait from now on for the queue and the end of ``sentinels``' processes (answers do
        not come on the workers' own pipes, ``conns``, here)."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        for fd in sentinels:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        self._poller = poller

    def wait(self, timeout: float) -> list[int]:
        """Block up to ``timeout`` s until answers have come or a process ended; the ended
        sentinels. Spins first (``spin``) unless answers are already there; with answers in the
        mailbox it polls the pipe only every :data:`POLL_INTERVAL_S` (for ended processes and
        the answers too big for the mailbox)."""
        box = self.mailboxes
        if box is not None:
            if timeout > 0 and not box.waiting():  # the spin looks at the pipe first thing
                return self._spin_then_block(timeout)
            now = self.clock()
            if now < self._next_poll:
                return []
            self._next_poll = now + POLL_INTERVAL_NS
            return self._ended(self._poller.poll(0))
        events = self._poller.poll(0)
        if events or timeout <= 0:
            return self._ended(events)
        if self.spin is None:
            return self._ended(blocking(self._poller.poll, _ms(timeout)))
        return self._spin_then_block(timeout)

    def _spin_then_block(self, timeout: float) -> list[int]:
        spin, box, poll = self.spin, self.mailboxes, self._poller.poll
        assert spin is not None
        budget, full = spin.budget()
        clock = self.clock
        start = clock()
        if box is not None and not box.parent_may_spin(start):  # nothing spins: every worker wakes the parent
            budget, full = 0.0, False
        until = start + int(min(budget, timeout) * 1e9)
        if box is not None:
            box.parent_spinning(until)
        events: list = []
        found = False
        next_poll = start  # with a mailbox the pipe is looked at only now and then (big answers, ended processes)
        every = POLL_INTERVAL_NS // 5 if box is not None else 0
        while True:
            now = clock()
            if now >= until:
                break
            if box is not None and box.waiting():
                found = True
                break
            if now >= next_poll:
                next_poll = now + every
                events = poll(0)
                if events:
                    found = True
                    break
        if full:
            spin.caught(found)
        spun = clock() - start
        self.spun_ns += spun
        left = timeout - spun * 1e-9
        if not found and left > 0:  # (a spin cut by the timeout ends the wait: it never says SLEEPING)
            if box is not None:
                box.parent_sleeping()
            if box is None or not box.waiting():  # the last look after saying SLEEPING: then block
                events = blocking(poll, _ms(left))
            found = bool(events) or (box is not None and box.waiting())
        if box is not None:
            box.parent_busy()
        # How long answers take to come sizes the next spins (a wait that ended with nothing says
        # at least as long).
        spin.waited((clock() - start) * 1e-9)
        return self._ended(events)

    def _ended(self, events: list) -> list[int]:
        """The ended sentinels among ``events``; notes whether the queue itself is readable."""
        fd = self._fd
        ended = [f for f, _ in events if f != fd]
        self._readable = len(ended) < len(events)
        return ended

    # -- worker side ------------------------------------------------------------------------
    @staticmethod
    def post(writer_fd: int, own_pipe: Connection, header: bytes, payload: bytes) -> None:
        """Post an answer (``encode_answer``'s header and payload); a payload too big for one
        atomic notice goes over the worker's own pipe."""
        if len(header) + len(payload) <= MAX_NOTICE_BYTES:
            write_frame(writer_fd, header + payload)  # one write: atomic
            return
        # The notice first: the parent reads the payload only once it knows it is coming, and a
        # payload larger than the pipe's buffer can only be written while the parent reads it.
        write_frame(writer_fd, on_pipe_notice(header))
        own_pipe.send_bytes(payload)

    # -- parent side ------------------------------------------------------------------------
    def take(self, everything: bool = False) -> list[EnvironmentResponse]:
        """The answers that have come (payloads still encoded), never waiting: every whole notice
        on the pipe when the last ``wait`` saw it readable (or ``everything``), with one read;
        then the mailbox's."""
        out: list[EnvironmentResponse] = []
        if self._readable or everything:
            self._readable = False
            self._read(out)
        if self.mailboxes is not None:
            self.mailboxes.take(out)
        return out

    def _read(self, out: list[EnvironmentResponse]) -> None:
        try:
            chunk = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        data = self._rest + chunk if self._rest else chunk
        off, end = 0, len(data)
        while end - off >= 4:
            (size,) = _FRAME.unpack_from(data, off)
            if off + 4 + size > end:
                break  # the rest of an atomic write is in the pipe: the next read gets it
            if size:  # an empty frame only woke the parent
                out.append(decode_notice(data, off + 4, off + 4 + size))
            off += 4 + size
        self._rest = data[off:]

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


def _ms(seconds: float) -> int:
    """``poll``'s timeout: whole milliseconds, rounded up."""
    return max(0, math.ceil(seconds * 1000))


_FRAME = struct.Struct("!i")  # multiprocessing.Connection's length prefix


def write_frame(fd: int, data: bytes) -> None:
    """Write ``data`` framed as ``Connection.send_bytes`` does (the reader may be a Connection),
    with one ``write`` when the pipe takes it whole."""
    frame = _FRAME.pack(len(data)) + data
    written = os.write(fd, frame)
    if written < len(frame):  # a big message on a full pipe: the rest as the reader takes it
        view = memoryview(frame)[written:]
        while view:
            view = view[os.write(fd, view) :]


class FrameReader:
    """Reads ``Connection.send_bytes`` frames from a blocking fd with plain ``os.read``s: the
    worker's side of its own pipe, without ``Connection``'s per-call overhead."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def read(self) -> bytes:
        """The next frame; blocks until it is whole. ``EOFError`` when the writer is gone."""
        buf = self.buf
        while True:
            if len(buf) >= 4:
                (size,) = _FRAME.unpack_from(buf)
                if size < 0:
                    raise ValueError("frames over 2 GiB are not supported")
                if len(buf) >= 4 + size:
                    self.buf = buf[4 + size :]
                    return buf[4 : 4 + size]
                want = 4 + size - len(buf)
            else:
                want = 4 - len(buf)
            chunk = os.read(self.fd, max(want, 1 << 16))
            if not chunk:
                raise EOFError("the parent's end of the pipe is closed")
            buf = buf + chunk if buf else chunk


def read_message(conn: Connection, deadline: float, sentinel: int) -> bytes:
    """One ``send_bytes`` message from ``conn``, read before ``deadline`` (``time.monotonic``).

    ``Connection.recv_bytes`` would block with no bound once a message has begun; this raises
    ``TimeoutError`` past the deadline and ``EOFError`` once the writer is gone (``sentinel``,
    its process, has ended and nothing more is buffered).
    """
    fd = conn.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(sentinel, select.POLLIN)

    def read_exact(n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("a message from the worker did not arrive in time")
            events = dict(poller.poll(max(1, math.ceil(left * 1000))))
            if fd in events:
                chunk = os.read(fd, min(n - got, 1 << 20))
                if not chunk:
                    raise EOFError("the worker's pipe closed mid-message")
                chunks.append(chunk)
                got += len(chunk)
            elif sentinel in events:
                raise EOFError("the worker ended mid-message")
        return b"".join(chunks)

    (size,) = struct.unpack("!i", read_exact(4))
    if size == -1:  # multiprocessing's header for messages over 2 GiB
        (size,) = struct.unpack("!Q", read_exact(8))
    return read_exact(size)
