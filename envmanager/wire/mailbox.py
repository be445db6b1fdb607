"""The mailbox: hot-path requests and answers through shared memory, with no syscall where the
reader has a core of its own.

Where every worker process and the parent have a core (``spin_s > 0``), each side spins a
little before it blocks, so a message usually finds its reader awake; through pipes it still
costs a ``write`` on one side and a ``poll`` and a ``read`` on the other (several µs, ~10 µs
when the write wakes a blocked reader). The mailbox is a small shared mapping holding, per
worker process, a ring of requests (parent → worker) and a ring of answers (worker → parent).
A message goes into its ring; the pipe is written only when the reader may be asleep (an empty
frame: a wake-up) or the message does not fit (it goes on the pipe as before, announced in the
ring, so the order is kept).

Each side says what it is doing in a word the other reads: ``BUSY`` (it looks at its ring
before it blocks), spinning until ``T`` (``time.monotonic_ns``), or ``SLEEPING`` (blocked on its
pipe). A writer publishes its entry first, then reads the reader's word: it skips the pipe when
the reader is ``BUSY`` or spins until well after now (:data:`MARGIN_NS`), else it writes a
wake-up. A reader never goes from ``BUSY`` to ``SLEEPING`` in less than the margin, and looks
at its ring once more after saying ``SLEEPING``. Between a writer's decision to skip the pipe
and the reader's last look there is then at least the margin, and a store reaches the other
core long before (a store buffer drains in well under a microsecond): no wake-up is lost. That
rests on x86's total store order, which also makes an entry's bytes visible before its
ordinal; elsewhere the mailbox is off and the pipes carry everything (``mailbox_supported``).

Layout: a line with the parent's word; every process's count of answers posted, side by side
(the parent checks them all with one compare of bytes); then per process a line with the
worker's word, its request ring and its answer ring. An entry is ``[ordinal][length][bytes]``,
the ordinal written last (it publishes the entry). A process has at most its two lanes' requests
and a CLOSE unanswered, so rings of four entries never overrun.
"""

from __future__ import annotations

import platform
import struct
import time
from dataclasses import dataclass

from envmanager.wire.messages import NOTICE_HEADER, EnvironmentCommand, EnvironmentResponse
from envmanager.wire.shm import SharedFile

__all__ = ["Mailboxes", "WorkerMailbox", "MailboxLayout", "mailbox_supported", "BUSY", "SLEEPING", "ON_PIPE",
           "MARGIN_NS", "WAKE"]

BUSY, SLEEPING = -1, 0
#: A request entry's length when the request itself is on the worker's pipe.
ON_PIPE = -1
#: The least a reader spins between ``BUSY`` and ``SLEEPING``, and the margin a writer keeps.
MARGIN_NS = 20_000
#: The frame that only wakes a reader (multiprocessing's framing of no bytes).
WAKE = b""
ENTRIES = 4
REQUEST_BYTES = 240  # a raw STEP of up to 115 envs fits
ANSWER_BYTES = 496  # a raw answer of up to 59 envs, or a small pickled one (a few envs' infos)
_LINE = 64
_REQUEST_ENTRY = 16 + REQUEST_BYTES
_ANSWER_ENTRY = 16 + ANSWER_BYTES
_REGION = _LINE + ENTRIES * (_REQUEST_ENTRY + _ANSWER_ENTRY)
_NOTICE, _NOTICE_SIZE = NOTICE_HEADER.unpack_from, NOTICE_HEADER.size
_COMMANDS = {int(cmd): cmd for cmd in EnvironmentCommand}
_new = tuple.__new__


def mailbox_supported() -> bool:
    """Whether the mailbox is sound here: x86's store order (see the module doc)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


@dataclass(frozen=True)
class MailboxLayout:
    """Where everything is, for ``n_procs`` processes (picklable: workers get it in their spec)."""

    n_procs: int

    @property
    def posted(self) -> int:
        """Offset of the answer counts (one int64 per process)."""
        return _LINE

    def region(self, p: int) -> int:
        return _LINE + -(-8 * self.n_procs // _LINE) * _LINE + p * _REGION

    def request(self, p: int, ordinal: int) -> int:
        return self.region(p) + _LINE + (ordinal % ENTRIES) * _REQUEST_ENTRY

    def answer(self, p: int, ordinal: int) -> int:
        return self.region(p) + _LINE + ENTRIES * _REQUEST_ENTRY + (ordinal % ENTRIES) * _ANSWER_ENTRY

    @property
    def nbytes(self) -> int:
        return self.region(self.n_procs)


class Mailboxes:
    """The parent's side: every process's rings, in a :class:`SharedFile` made before any worker
    starts (each gets it as it starts, as it gets its pipe)."""

    def __init__(self, file: SharedFile, n_procs: int) -> None:
        self.file = file
        self.layout = layout = MailboxLayout(n_procs)
        file.resize(layout.nbytes)
        self._map = file.map(layout.nbytes)
        self._words = memoryview(self._map).cast("q")
        self._sent = [0] * n_procs  # ordinal of the last request sent, per process
        self._seen = [0] * n_procs  # ordinal of the last answer taken, per process
        self._seen_bytes = bytes(8 * n_procs)  # ``_seen`` as the counts' bytes, for one compare
        self._posted = slice(layout.posted, layout.posted + 8 * n_procs)
        self._counts = struct.Struct(f"<{n_procs}q").unpack
        # Offsets, worked out once: each process's word (in words), request and answer entries.
        self._worker_word = [layout.region(p) // 8 for p in range(n_procs)]
        self._requests = [[layout.request(p, k) for k in range(ENTRIES)] for p in range(n_procs)]
        self._answers = [[layout.answer(p, k) for k in range(ENTRIES)] for p in range(n_procs)]
        self._words[0] = BUSY

    @classmethod
    def create(cls, n_procs: int) -> Mailboxes | None:
        """Mailboxes for ``n_procs`` processes, or ``None`` where there is no such file or
        the mailbox is not sound (see ``mailbox_supported``)."""
        if not mailbox_supported():
            return None
        file = SharedFile.create()
        return None if file is None else cls(file, n_procs)

    def reset(self, p: int) -> None:
        """Empty process ``p``'s rings for a new process (the old one is gone)."""
        start = self.layout.region(p)
        self._map[start : start + _REGION] = bytes(_REGION)
        self._words[start // 8] = BUSY  # the new worker looks at its ring before it ever blocks
        self._words[self.layout.posted // 8 + p] = 0
        self._sent[p] = self._seen[p] = 0
        self._seen_bytes = struct.pack(f"<{len(self._seen)}q", *self._seen)

    # -- requests ------------------------------------------------------------------------------
    def send(self, p: int, data: bytes) -> bytes | None:
        """Publish request ``data`` for process ``p``; what must also go on its pipe: nothing,
        a wake-up (:data:`WAKE`), or ``data`` itself when it does not fit (announced first)."""
        n = self._sent[p] = self._sent[p] + 1
        at = self._requests[p][n % ENTRIES]
        words = self._words
        size = len(data)
        if size > REQUEST_BYTES:
            words[at // 8 + 1] = ON_PIPE
            words[at // 8] = n
            return data
        self._map[at + 16 : at + 16 + size] = data
        words[at // 8 + 1] = size
        words[at // 8] = n  # published
        word = words[self._worker_word[p]]
        if word == BUSY or (word != SLEEPING and time.monotonic_ns() < word - MARGIN_NS):
            return None
        return WAKE

    # -- answers -------------------------------------------------------------------------------
    def waiting(self) -> bool:
        """Whether any process posted an answer not taken yet (one compare of bytes)."""
        return self._map[self._posted] != self._seen_bytes

    def take(self, out: list[EnvironmentResponse]) -> None:
        """Append every answer posted and not taken yet, oldest first per process."""
        posted_bytes = self._map[self._posted]
        if posted_bytes == self._seen_bytes:
            return
        seen, m, words, answers = self._seen, self._map, self._words, self._answers
        for p, posted in enumerate(self._counts(posted_bytes)):
            n = seen[p]
            if n == posted:
                continue
            entries = answers[p]
            while n < posted:
                n += 1
                at = entries[n % ENTRIES]
                body = at + 16 + _NOTICE_SIZE
                cmd, process, seq, posted_at, form = _NOTICE(m, at + 16)  # decode_notice, inline
                out.append(_new(EnvironmentResponse, (_COMMANDS[cmd], process, seq, posted_at, form,
                                                      m[body : at + 16 + words[at // 8 + 1]])))
            seen[p] = n
        self._seen_bytes = posted_bytes

    # -- the parent's word ---------------------------------------------------------------------
    def parent_busy(self) -> None:
        self._words[0] = BUSY

    def parent_spinning(self, until_ns: int) -> None:
        self._words[0] = until_ns

    def parent_sleeping(self) -> None:
        self._words[0] = SLEEPING

    def close(self) -> None:
        """Unmap and close (the workers' mappings keep it alive until they end)."""
        self._words.release()
        try:
            self._map.close()
        except BufferError:  # a view still alive somewhere; the mapping goes with it
            pass
        self.file.close()


class WorkerMailbox:
    """A worker's side: its own request and answer rings, and the parent's word."""

    def __init__(self, file: SharedFile, layout: MailboxLayout, p: int) -> None:
        self.layout, self.p = layout, p
        self._map = file.map(layout.nbytes)
        self._words = memoryview(self._map).cast("q")
        self._word = layout.region(p) // 8
        self._posted_at = layout.posted // 8 + p
        self._requests = [layout.request(p, k) for k in range(ENTRIES)]
        self._answers = [layout.answer(p, k) for k in range(ENTRIES)]
        self._taken = 0  # ordinal of the last request taken
        self._posted = 0  # ordinal of the last answer posted

    def ready(self) -> bool:
        """Whether the next request is published."""
        n = self._taken + 1
        return self._words[self._requests[n % ENTRIES] // 8] == n

    def take(self) -> bytes | int | None:
        """The next request's bytes, :data:`ON_PIPE` when it is on the pipe, or ``None``."""
        n = self._taken + 1
        at = self._requests[n % ENTRIES]
        words = self._words
        if words[at // 8] != n:
            return None
        self._taken = n
        size = words[at // 8 + 1]
        return ON_PIPE if size == ON_PIPE else self._map[at + 16 : at + 16 + size]

    def post(self, notice: bytes) -> bool | None:
        """Publish an answer notice; ``None`` when it does not fit (the step queue takes it),
        else whether the parent may be asleep (then a wake-up must follow on the queue)."""
        size = len(notice)
        if size > ANSWER_BYTES:
            return None
        n = self._posted = self._posted + 1
        at = self._answers[n % ENTRIES]
        words = self._words
        self._map[at + 16 : at + 16 + size] = notice
        words[at // 8 + 1] = size
        words[at // 8] = n
        words[self._posted_at] = n  # published
        word = words[0]
        return word != BUSY and (word == SLEEPING or time.monotonic_ns() >= word - MARGIN_NS)

    # -- the worker's word ---------------------------------------------------------------------
    def busy(self) -> None:
        self._words[self._word] = BUSY

    def spinning(self, until_ns: int) -> None:
        self._words[self._word] = until_ns

    def sleeping(self) -> None:
        self._words[self._word] = SLEEPING

    def close(self) -> None:
        self._words.release()
        try:
            self._map.close()
        except BufferError:
            pass
