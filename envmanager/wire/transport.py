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

import math
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_ready
from typing import Any, cast

from envmanager.wire.info_columns import to_columns
from envmanager.wire.interrupts import blocking
from envmanager.wire.mailbox import MARGIN_NS, WAKE, WorkerMailbox
from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.wire.messages import (
    EnvironmentResponse,
    Stepped,
    StepsAnswer,
    decode_notice,
    decode_request_header,
    encode_steps_answer,
)
from envmanager.wire.spin import SpinPolicy
from envmanager.wire.step_queue import FrameReader, StepQueue, write_frame

_new = tuple.__new__

__all__ = ["make_transport", "PortableAnswers", "WorkerLink", "QueueLink", "MailboxLink", "link_for", "StepQueue"]


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
        ready = blocking(wait_for_ready, [*self._open(), *self._sentinels], max(0.0, timeout))
        # Sentinels are ints (fds, or handles on Windows, where pipes are not ``Connection``s).
        self._ready = [cast(Connection, r) for r in ready if not isinstance(r, int)]  # not ints: our pipes
        return [r for r in ready if isinstance(r, int)]

    def take(self, everything: bool = False) -> list[EnvironmentResponse]:
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
    """Worker side of the portable transport: requests in and answers out on one pipe. With
    ``spin_s``, ``read`` polls its pipe that long before it blocks (backing off: ``SpinPolicy``)."""

    def __init__(self, conn: Connection, spin_s: float = 0.0) -> None:
        self.conn = conn
        self.spin = SpinPolicy(spin_s) if spin_s > 0 else None

    def read(self) -> bytes:
        """The next request; blocks until it comes. ``EOFError`` once the parent is gone."""
        if self.spin is not None:
            self.spin.spin(self.has_input, math.inf)
        return self._read()

    def _read(self) -> bytes:
        return self.conn.recv_bytes()

    def has_input(self) -> bool:
        return self.conn.poll()

    def post(self, header: bytes, payload: bytes) -> None:
        self.conn.send_bytes(header + payload)

    def farewell(self, notice: bytes) -> None:
        self.conn.send_bytes(notice)


class QueueLink(WorkerLink):
    """Worker side of the step queue: plain reads and writes on the pipes' descriptors."""

    def __init__(self, conn: Connection, queue_writer: Connection, spin_s: float = 0.0) -> None:
        import select

        super().__init__(conn, spin_s)
        self.queue_fd = queue_writer.fileno()
        self.requests = FrameReader(conn.fileno())
        self._incoming = select.poll()
        self._incoming.register(conn.fileno(), select.POLLIN)

    def _read(self) -> bytes:
        return self.requests.read()

    def has_input(self) -> bool:
        return bool(self.requests.buf) or bool(self._incoming.poll(0))

    def post(self, header: bytes, payload: bytes) -> None:
        StepQueue.post(self.queue_fd, self.conn, header, payload)

    def farewell(self, notice: bytes) -> None:
        write_frame(self.queue_fd, notice)


class MailboxLink(QueueLink):
    """Worker side of the step queue with a mailbox (``envmanager.wire.mailbox``): requests
    taken from the ring in the order sent (those on the pipe where the ring says so), steps
    from the step board, answers posted to the ring or the board, the pipes written only to wake
    a sleeping parent or for what does not fit. ``read`` spins on the ring and the board (at
    least the mailbox's margin; beyond it only while the parent allows, as long as the
    parent's turnarounds typically take: ``SpinPolicy``, sized, at most ``spin_s``), then blocks
    on the pipe."""

    def __init__(self, conn: Connection, queue_writer: Connection, spin_s: float, box: WorkerMailbox) -> None:
        super().__init__(conn, queue_writer)
        self.box = box
        self.ring_spin = SpinPolicy(spin_s, MARGIN_NS * 1e-9, sized=True)
        self._stash: bytes | None = None  # a request read off the pipe before the ring named it
        self._answered_ns = 0  # when the last answer went out (0: a request came since)

    def read(self) -> bytes | None:  # type: ignore[override]
        """The next request, or ``None`` when the step board asks for steps (``steps``)."""
        box = self.box
        while True:
            got = box.take()
            if got is None and not box.asked():
                closing = self._wait()
                if closing is not None:
                    return closing
                continue
            if self._answered_ns:  # the parent's turnaround, as this worker saw it: sizes the spin
                self.ring_spin.waited((time.monotonic_ns() - self._answered_ns) * 1e-9)
                self._answered_ns = 0
            if got is None:
                return None
            if type(got) is int:  # ON_PIPE: the request itself is the next frame on the pipe
                frame, self._stash = self._stash, None
                return frame if frame is not None else self._next_frame()
            return got  # type: ignore[return-value]

    def _wait(self) -> bytes | None:
        """Spin on the ring and the board, then sleep on the pipe; ``None`` once there may be a
        request (look again), or a CLOSE read off the pipe."""
        box, spin = self.box, self.ring_spin
        clock = time.monotonic_ns
        found = False
        if box.spin_allowed:  # (else nothing spins: the parent always wakes this worker)
            budget, full = spin.budget()
            until = clock() + max(int(budget * 1e9), MARGIN_NS)
            box.spinning(until)
            while clock() < until:
                if box.ready():
                    found = True
                    break
            if full:
                spin.caught(found)
        if not found:
            box.sleeping()
            if not box.ready():  # the last look after saying SLEEPING: then block
                frame = self.requests.read()
                box.busy()
                if frame and decode_request_header(frame)[0] is Cmd.CLOSE:
                    return frame
                if frame:  # a request on the pipe: the ring names it next (or after what precedes it)
                    self._stash = frame
                return None
        box.busy()
        return None

    def _next_frame(self) -> bytes:
        """The next request frame on the pipe, past wake-ups."""
        while True:
            frame = self.requests.read()
            if frame:
                return frame

    def post(self, header: bytes, payload: bytes) -> None:
        notice = header + payload
        wake = self.box.post(notice)
        self._answered_ns = time.monotonic_ns()
        if wake is None:  # too big for the ring
            StepQueue.post(self.queue_fd, self.conn, header, payload)
        elif wake:
            write_frame(self.queue_fd, WAKE)

    def answer_steps(self, locals_: list[int], ordinals: list[int], stepped: Stepped, slots: list[int], columns: bool,
                     index: int) -> None:
        """Answer the board's steps of ``locals_`` (slots ``slots``, asked at ``ordinals``), their
        results written to shared memory: on the board alone when that is all, flat infos in its
        info rows; else after a notice carrying the rest (a :class:`StepsAnswer`: failures, infos
        that do not fit, as columns where they fit and the parent batches infos (``columns``),
        and the info schemas used for the first time)."""
        infos = stepped[1]
        raw = not stepped[2] and stepped[3] is None and stepped[4] is None and stepped[5] is None
        schemas: tuple = ()
        if raw:
            written = self.box.write_infos(locals_, [infos.get(s) for s in slots] if infos else None)
            if written:  # a schema's first use: this answer announces it
                raw, schemas = False, tuple(written)
            elif written is None:
                raw = False
                if columns and infos and len(infos) == len(slots) > 1:
                    packed = to_columns([infos[s] for s in slots])
                    if packed is not None:
                        stepped = _new(Stepped, (stepped[0], None, None, None, None, packed, stepped[6]))
        if not raw:
            answer = StepsAnswer(tuple(locals_), tuple(ordinals), stepped, schemas)
            header, payload = encode_steps_answer(index, time.monotonic(), answer)
            notice = header + payload
            if self.box.post(notice) is None:  # too big for the ring (the board's word below wakes the parent)
                StepQueue.post(self.queue_fd, self.conn, header, payload)
        wake = self.box.answer_steps(locals_, ordinals, stepped.env_times, raw)
        self._answered_ns = time.monotonic_ns()
        if wake:
            write_frame(self.queue_fd, WAKE)


def link_for(conn: Connection, queue_writer: Connection | None, spin_s: float = 0.0,
             box: WorkerMailbox | None = None) -> WorkerLink:
    """The worker's link: the step queue if it was given one (with its mailbox if it has one),
    else the portable pipe."""
    if queue_writer is None:
        return WorkerLink(conn, spin_s)
    if box is not None:
        return MailboxLink(conn, queue_writer, spin_s, box)
    return QueueLink(conn, queue_writer, spin_s)
