"""The mailbox: hot-path requests and answers through shared memory, with no syscall where the
reader has a core of its own.

Where every worker process and the parent have a core (``spin_s > 0``), each side spins a
little before it blocks, so a message usually finds its reader awake; through pipes it still
costs a ``write`` on one side and a ``poll`` and a ``read`` on the other (several µs, ~10 µs
when the write wakes a blocked reader). The mailbox is a small shared mapping with two parts:

* **the step board**: per env slot, a word the parent bumps to ask for a step whose actions
  are in shared memory (the request's ordinal), and a word the worker sets once the step's
  results are in shared memory (the ordinal it served; its negative when the answer also
  carries infos or failures, which follow as a notice). The parent asks for a whole batch with
  one numpy operation, finds every answer with one compare of bytes, and files them with a few
  numpy operations, however many processes there are: its work per batch does not grow with
  the processes (PufferLib's and Sample Factory's flag arrays). Each slot's ordinals only grow,
  for the pool's whole life, so an answer of a replaced process is never taken for a newer one.
* **the rings**: per worker process, a ring of requests (parent → worker) and a ring of answers
  (worker → parent), for every other message (resets, calls, answers with infos...). A message
  goes into its ring; the pipe is written only when the reader may be asleep (an empty frame: a
  wake-up) or the message does not fit (it goes on the pipe as before, announced in the ring,
  so the order is kept).

Each side says what it is doing in a word the other reads: ``BUSY`` (it looks at its ring and
board before it blocks), spinning until ``T`` (``time.monotonic_ns``), or ``SLEEPING`` (blocked
on its pipe). A writer publishes its entry first, then reads the reader's word: it skips the
pipe when the reader is ``BUSY`` or spins until well after now (:data:`MARGIN_NS`), else it
writes a wake-up. A reader never goes from ``BUSY`` to ``SLEEPING`` in less than the margin,
and looks at its ring and board once more after saying ``SLEEPING``. Between a writer's
decision to skip the pipe and the reader's last look there is then at least the margin, and a
store reaches the other core long before (a store buffer drains in well under a microsecond):
no wake-up is lost. That rests on x86's total store order, which also makes an entry's bytes
visible before its ordinal (and a step's results before its answer word); elsewhere the mailbox
is off and the pipes carry everything (``mailbox_supported``).

Spinning is a permission the parent gives (``allow_spin``: where each process has a core of its
own, judged from the cores each may run on, looked at again while they run). Without it nothing
spins, not even the margin, and every writer wakes its reader (the pipes' cost; nothing burnt on
shared cores). For :data:`GRACE_NS` after the permission changes, writers wake their readers and
the parent keeps the margin, so no side acts on the old rule while the other acts on the new one.

Layout: a line with the parent's word and whether the processes may spin (the parent decides,
from the cores each process may run on); every process's count of answers posted, side by side
(the parent checks them all with one compare of bytes); per process a line with the worker's
word, its request ring and its answer ring; then the step board: five blocks (request ordinals,
answer ordinals, env seconds, answer times, and info rows of :data:`INFO_WORDS` words per env),
each a run of whole lines per process, so no two processes write one line. A ring entry is
``[ordinal][length][bytes]``, the ordinal written last (it publishes the entry). A process has
at most one request per env in flight (their slots are distinct) or one call, and a CLOSE, so
rings of two entries more than it has envs (at least four) never overrun.

Why one module (over 600 lines): the board, the rings and the words are one mapping with one
layout and one wake-up rule; its writer's and reader's halves must be read side by side to see
that no wake-up is lost, so they are not split across files.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envmanager.wire.info_columns import column_dtype as _dtype
from envmanager.wire.messages import NOTICE_HEADER, EnvironmentCommand, EnvironmentResponse
from envmanager.wire.shm import SharedFile

__all__ = ["Mailboxes", "WorkerMailbox", "MailboxLayout", "mailbox_supported", "BUSY", "SLEEPING",
           "ON_PIPE", "MARGIN_NS", "GRACE_NS", "WAKE"]

BUSY, SLEEPING = -1, 0
#: A request entry's length when the request itself is on the worker's pipe.
ON_PIPE = -1
#: The least a reader spins between ``BUSY`` and ``SLEEPING``, and the margin a writer keeps.
MARGIN_NS = 20_000
#: After the spin permission changes: how long every writer wakes its reader and readers keep the margin.
GRACE_NS = 2_000_000
#: The frame that only wakes a reader (multiprocessing's framing of no bytes).
WAKE = b""
MIN_ENTRIES = 4
REQUEST_BYTES = 240  # a raw STEP of up to 115 envs fits
ANSWER_BYTES = 496  # a raw answer of up to 59 envs, or a small pickled one (a few envs' infos)
_LINE = 64
_WORDS_PER_LINE = _LINE // 8
_REQUEST_ENTRY = 16 + REQUEST_BYTES
_ANSWER_ENTRY = 16 + ANSWER_BYTES
#: The step board's blocks, in order: request ordinals (the parent's), answer ordinals, env
#: seconds and answer times (``time.monotonic``), and info rows (the workers').
REQUESTS, ANSWERS, ENV_TIMES, ANSWERED_AT, INFOS = range(5)
#: Words of an env's info row: its info's schema (0: no info) and up to this less one values.
INFO_WORDS = 16
#: The info values the board holds (flat infos of scalars, as gymnasium batches them): each
#: type's column dtype (``py:``: Python scalars, as ``info_columns``) and whether it is stored
#: as a float64 (else an int64).
INFO_KINDS: dict[type, tuple[str, bool]] = {
    int: ("py:<i8", False), float: ("py:<f8", True), bool: ("py:|b1", False),
    np.float64: ("<f8", True), np.float32: ("<f4", True), np.int64: ("<i8", False), np.int32: ("<i4", False),
    np.bool_: ("|b1", False),
}
_FLOAT_DTYPES = frozenset(d for d, is_float in INFO_KINDS.values() if is_float)
_FLOAT_KINDS = frozenset(kind for kind, (_, is_float) in INFO_KINDS.items() if is_float)
_KIND_OF = {dtype: kind for kind, (dtype, _) in INFO_KINDS.items()}
#: An info schema as announced: its id, its keys and its columns' dtypes.
Schema = tuple[int, tuple[str, ...], tuple[str, ...]]
LastSchema = tuple[tuple[Any, ...], tuple[type, ...], int]  # an env's last: keys, value types, id
_NOTICE, _NOTICE_SIZE = NOTICE_HEADER.unpack_from, NOTICE_HEADER.size
_COMMANDS = {int(cmd): cmd for cmd in EnvironmentCommand}
_new = tuple.__new__


def mailbox_supported() -> bool:
    """Whether the mailbox is sound here: x86's store order (see the module doc)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def _lines(words: int) -> int:
    return -(-words // _WORDS_PER_LINE)


@dataclass(frozen=True)
class MailboxLayout:
    """Where everything is, for ``n_procs`` processes hosting ``envs[p]`` envs each (one each
    if not given); picklable: workers get it in their spec."""

    n_procs: int
    envs: tuple[int, ...] = ()
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)  # each process's region, and the end

    def __post_init__(self) -> None:
        if not self.envs:
            object.__setattr__(self, "envs", (1,) * self.n_procs)
        if len(self.envs) != self.n_procs:
            raise ValueError(f"{len(self.envs)} env counts for {self.n_procs} processes")
        starts = [_LINE + _lines(self.n_procs) * _LINE]
        for p in range(self.n_procs):
            starts.append(starts[-1] + self.region_bytes(p))
        object.__setattr__(self, "_starts", tuple(starts))

    @property
    def posted(self) -> int:
        """Offset of the answer counts (one int64 per process)."""
        return _LINE

    def entries(self, p: int) -> int:
        """Entries in process ``p``'s rings: one per request that can be in flight (one per env,
        their slots being distinct, or one call), and one for CLOSE."""
        return max(MIN_ENTRIES, self.envs[p] + 2)

    def region_bytes(self, p: int) -> int:
        return _LINE + self.entries(p) * (_REQUEST_ENTRY + _ANSWER_ENTRY)

    def region(self, p: int) -> int:
        return self._starts[p]

    def request(self, p: int, ordinal: int) -> int:
        return self.region(p) + _LINE + (ordinal % self.entries(p)) * _REQUEST_ENTRY

    def answer(self, p: int, ordinal: int) -> int:
        entries = self.entries(p)
        return self.region(p) + _LINE + entries * _REQUEST_ENTRY + (ordinal % entries) * _ANSWER_ENTRY

    # -- the step board ----------------------------------------------------------------------
    @property
    def board_lines(self) -> int:
        """Lines per block of the board: whole lines per process."""
        return sum(_lines(k) for k in self.envs)

    def block(self, which: int) -> int:
        """Offset of one of the board's blocks (``REQUESTS``, ``ANSWERS``, ... ``INFOS``, whose
        rows are :data:`INFO_WORDS` words where the others' are one)."""
        return self.region(self.n_procs) + which * self.board_lines * _LINE

    def board_word(self, p: int, local: int) -> int:
        """Where env ``local`` of process ``p`` is, in words from the start of any block."""
        return sum(_lines(k) for k in self.envs[:p]) * _WORDS_PER_LINE + local

    @property
    def nbytes(self) -> int:
        return self.block(INFOS) + self.board_lines * _LINE * INFO_WORDS


class Mailboxes:
    """The parent's side: every process's rings and the step board, in a :class:`SharedFile`
    made before any worker starts (each gets it as it starts, as it gets its pipe).
    ``slots[p]``: the env slots process ``p`` hosts (one slot each, ``p``, if not given)."""

    def __init__(self, file: SharedFile, n_procs: int, slots: list[tuple[int, ...]] | None = None) -> None:
        slots = slots if slots is not None else [(p,) for p in range(n_procs)]
        self.file = file
        self.layout = layout = MailboxLayout(n_procs, tuple(len(s) for s in slots))
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
        self._requests = [[layout.request(p, k) for k in range(layout.entries(p))] for p in range(n_procs)]
        self._answers = [[layout.answer(p, k) for k in range(layout.entries(p))] for p in range(n_procs)]
        self._words[0] = BUSY
        self._words[1] = 1  # the workers may spin (``allow_spin``)
        #: Whether the processes may spin (``allow_spin``), and when that last changed (ns).
        self.spin_allowed = True
        self._permission_changed = 0
        self._board_init(slots)

    @classmethod
    def create(cls, n_procs: int, slots: list[tuple[int, ...]] | None = None) -> Mailboxes | None:
        """Mailboxes for ``n_procs`` processes (hosting ``slots``), or ``None`` where there is no
        such file or the mailbox is not sound (see ``mailbox_supported``)."""
        if not mailbox_supported():
            return None
        file = SharedFile.create()
        return None if file is None else cls(file, n_procs, slots)

    def reset(self, p: int) -> None:
        """Empty process ``p``'s rings for a new process (the old one is gone, its board steps
        cut: ``cut_steps``); its board words carry on from the ordinals reached."""
        start = self.layout.region(p)
        size = self.layout.region_bytes(p)
        self._map[start : start + size] = bytes(size)
        self._words[start // 8] = BUSY  # the new worker looks at its ring before it ever blocks
        self._words[self.layout.posted // 8 + p] = 0
        self._sent[p] = self._seen[p] = 0
        self._seen_bytes = struct.pack(f"<{len(self._seen)}q", *self._seen)
        words = self._board_words[p]
        answers = np.frombuffer(self._map, np.int64, len(self._board_seen), self.layout.block(ANSWERS))
        answers[words] = self._board_seen[words] = self._board_taken[words] = self._requested[words]
        del answers
        self._board_seen_bytes, self._board_taken_bytes = self._board_seen.tobytes(), self._board_taken.tobytes()

    def retire(self, p: int) -> None:
        """Process ``p`` was given up and is dead: its answer words as the parent took them, so no
        word it left behind looks like an answer waiting (``waiting``)."""
        words = self._board_words[p]
        answers = np.frombuffer(self._map, np.int64, len(self._board_seen), self.layout.block(ANSWERS))
        answers[words] = self._board_seen[words]
        del answers

    def allow_spin(self, allowed: bool) -> None:
        """Whether the parent and the workers may spin waiting for each other (see the module
        doc): where each has a core of its own."""
        if allowed != self.spin_allowed:
            self.spin_allowed = allowed
            self._permission_changed = time.monotonic_ns()
            self._words[1] = int(allowed)

    def wake_always(self, now_ns: int) -> bool:
        """Whether a writer must wake its reader whatever the reader's word says (no spinning,
        or the permission changed lately)."""
        return not self.spin_allowed or now_ns < self._permission_changed + GRACE_NS

    def parent_may_spin(self, now_ns: int) -> bool:
        """Whether the parent keeps the margin before it sleeps (spinning allowed, or it was
        until lately: a worker may still skip waking it)."""
        return self.spin_allowed or now_ns < self._permission_changed + GRACE_NS

    # -- requests ------------------------------------------------------------------------------
    def send(self, p: int, data: bytes) -> bytes | None:
        """Publish request ``data`` for process ``p``; what must also go on its pipe: nothing,
        a wake-up (:data:`WAKE`), or ``data`` itself when it does not fit (announced first)."""
        n = self._sent[p] = self._sent[p] + 1
        entries = self._requests[p]
        at = entries[n % len(entries)]
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
        now = time.monotonic_ns()
        if (word == BUSY or (word != SLEEPING and now < word - MARGIN_NS)) and not self.wake_always(now):
            return None
        return WAKE

    # -- answers -------------------------------------------------------------------------------
    def waiting(self) -> bool:
        """Whether any process posted an answer or a step not taken yet (two compares of bytes)."""
        m = self._map
        return m[self._posted] != self._seen_bytes or m[self._answer_span] != self._board_seen_bytes

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
                at = entries[n % len(entries)]
                body = at + 16 + _NOTICE_SIZE
                cmd, process, seq, posted_at, form = _NOTICE(m, at + 16)  # decode_notice, inline
                out.append(_new(EnvironmentResponse, (_COMMANDS[cmd], process, seq, posted_at, form,
                                                      m[body : at + 16 + words[at // 8 + 1]])))
            seen[p] = n
        self._seen_bytes = posted_bytes

    # -- the step board: steps whose actions are in shared memory --------------------------------
    def _board_init(self, slots: list[tuple[int, ...]]) -> None:
        layout = self.layout
        n_words = layout.board_lines * _WORDS_PER_LINE
        n_slots = max((s for own in slots for s in own), default=-1) + 1

        def block(which: int, dtype: Any) -> np.ndarray:
            return np.frombuffer(self._map, dtype, n_words, layout.block(which))

        self._requested = block(REQUESTS, np.int64)  # the parent's: the ordinal last asked of each env
        self._env_times, self._answered_at = block(ENV_TIMES, np.float64), block(ANSWERED_AT, np.float64)
        start = layout.block(ANSWERS)
        self._answer_span = slice(start, start + n_words * 8)
        start = layout.block(REQUESTS)
        self._request_span = slice(start, start + n_words * 8)
        #: The answer words as the parent took them (an ordinal served; negated when it came with a
        #: notice, ``take_notice``), and the same ordinals unsigned: a step is in flight while its
        #: ``taken`` word differs from its request (compared as bytes, a process's or all at once).
        self._board_seen = np.zeros(n_words, np.int64)
        self._board_taken = np.zeros(n_words, np.int64)
        self._board_seen_bytes = self._board_taken_bytes = self._board_seen.tobytes()
        self._asked_at = np.zeros(n_words)  # when each step in flight was asked (time.monotonic)
        #: Per process: when it last answered a board step (its deadline counts from the later of
        #: that and its oldest step in flight).
        self._last_answer = np.zeros(len(slots))
        #: Each slot's word, each word's slot (-1: padding) and process, each process's words and span.
        self.slot_word = np.zeros(n_slots, np.int64)
        self._word_slot = np.full(n_words, -1, np.int64)
        self._word_process = np.zeros(n_words, np.int64)
        self._board_words: list[np.ndarray] = []
        self._spans: list[tuple[slice, slice]] = []  # (in the mapping, in ``_board_taken_bytes``)
        for p, own in enumerate(slots):
            words = [layout.board_word(p, local) for local in range(len(own))]
            self.slot_word[list(own)] = words
            self._word_slot[words] = own
            self._word_process[words] = p
            self._board_words.append(np.array(words, np.int64))
            first = 8 * words[0] if words else 0
            self._spans.append((slice(start + first, start + first + 8 * len(own)), slice(first, first + 8 * len(own))))
        self._slot_words = self.slot_word.tolist()  # (Python ints: a numpy index costs more for one)
        self._worker_words = np.array([layout.region(p) // 8 for p in range(len(slots))], np.int64)
        self._worker_states = np.frombuffer(self._map, np.uint64)
        #: Each env's info row (by word), and the schemas the workers announced: id -> (keys, dtypes).
        self._info_rows = np.frombuffer(self._map, np.int64, n_words * INFO_WORDS, layout.block(INFOS)).reshape(n_words,
                                                                                                                 INFO_WORDS)
        self._info_ids = self._info_rows[:, 0]  # each env's info schema (0: none)
        self._schemas: dict[int, _SchemaReader] = {}
        self._no_infos = bytes(8 * n_words)
        #: Whether an answer taken from the board had an info (until then ``infos`` has nothing to read).
        self.infos_seen = False

    def post_steps(self, words: np.ndarray, processes: np.ndarray, now: float) -> np.ndarray:
        """Ask for a step of the envs at board ``words`` (``slot_word`` of their slots; their
        actions already in shared memory), hosted by ``processes`` (distinct); returns those
        owed a wake-up on their pipe (asleep, or spinning too briefly to see it)."""
        self._requested[words] += 1  # published (the worker takes the words it sees in one copy)
        self._asked_at[words] = now
        now_ns = time.monotonic_ns()
        if self.wake_always(now_ns):
            return processes
        if processes.size == 1:  # one process (a lane, say): its word alone, no array
            word = self._words[self._worker_word[int(processes[0])]]
            return processes if word != BUSY and word <= now_ns + MARGIN_NS else processes[:0]
        state = self._worker_states[self._worker_words[processes]]  # unsigned: BUSY (-1) is the largest
        sleepy = (state <= np.uint64(now_ns + MARGIN_NS)).nonzero()[0]
        return processes[sleepy] if sleepy.size else sleepy

    def steps_answered(self) -> np.ndarray | None:
        """The slots whose board steps were answered since the last look with all their results
        in shared memory (raw), now taken; ``None`` if there are none. Their infos (``infos``)
        and timings (``timings``) stay in the board until they are asked again. Answers with a
        notice wait for it (``take_notice``), and so does an answer whose info schema's notice
        was not taken yet. Look here before taking notices: a notice is written before the
        answer words after it."""
        snapshot = self._map[self._answer_span]
        if snapshot == self._board_seen_bytes:  # the usual look: one compare of bytes
            return None
        if snapshot == self._map[self._request_span]:  # every step asked is answered, raw (lockstep's case)
            words = (self._board_taken != self._requested).nonzero()[0]
            if self._announced(words) is None:
                self._board_seen[:] = self._requested
                self._board_taken[:] = self._requested
                self._board_seen_bytes = self._board_taken_bytes = snapshot
                self._last_answer[self._word_process[words]] = time.monotonic()
                return self._word_slot[words]
        # Raw answers to the latest asks, not taken yet (an answer with a notice is negated).
        requested = self._requested
        fresh = np.frombuffer(snapshot, np.int64) == requested
        fresh &= self._board_taken != requested
        words = fresh.nonzero()[0]
        if not words.size:
            return None
        unknown = self._announced(words)
        if unknown is not None:  # their info schema's notice is still on its way: they wait for it
            words = words[~unknown]
            if not words.size:
                return None
        self._board_seen[words] = self._board_taken[words] = requested[words]
        self._board_seen_bytes, self._board_taken_bytes = self._board_seen.tobytes(), self._board_taken.tobytes()
        self._last_answer[self._word_process[words]] = time.monotonic()
        return self._word_slot[words]

    def _announced(self, words: np.ndarray) -> np.ndarray | None:
        """Which answers at ``words`` use an info schema not announced yet (a mask), or ``None``
        if every one is announced (or none has an info)."""
        ids = self._info_ids[words]
        if ids.tobytes() == self._no_infos[: 8 * ids.size]:
            return None
        self.infos_seen = True
        first = int(ids[0])
        if (first == 0 or first in self._schemas) and ids.tobytes() == ids[:1].tobytes() * ids.size:
            return None  # one schema, known (the usual case)
        unknown = [schema for schema in set(ids.tolist()) if schema and schema not in self._schemas]
        return np.isin(ids, unknown) if unknown else None

    def infos(self, slots: np.ndarray) -> list[tuple[np.ndarray, tuple[str, ...], list[np.ndarray], tuple[bool, ...]]]:
        """The infos of ``slots`` (their board steps answered and not asked again), read from their
        info rows: per schema, its slots, keys, one array per key and whether the envs returned
        Python scalars for it; nothing for the slots whose env returned no info."""
        if not self.infos_seen or self._info_ids.tobytes() == self._no_infos:  # no env on the board has an info (the usual case)
            return []
        if slots.size > 1:
            slots = np.sort(slots)  # (blocks ascend, as answers' do)
        words = self.slot_word[slots]
        ids = self._info_ids[words]
        raw = ids.tobytes()
        if raw == self._no_infos[: len(raw)]:
            return []
        if raw == raw[:8] * ids.size:  # one schema (the usual case)
            return [self._schemas[int(ids[0])].read(self._info_rows, slots, words)]
        return [self._schemas[schema].read(self._info_rows, slots[ids == schema], words[ids == schema])
                for schema in sorted(set(ids.tolist())) if schema]

    def take_notice(self, p: int, words: list[int], ordinals: list[int], now: float,
                    schemas: tuple[tuple[int, tuple[str, ...], tuple[str, ...]], ...] = ()) -> bool:
        """A notice of process ``p`` answering the board steps of ``words`` (its envs') at
        ``ordinals`` (infos or failures came with it, and the info ``schemas`` it uses from now
        on: ``(id, keys, dtypes)``): take those steps; ``False`` if it is stale (an older
        step's, or of a replaced process)."""
        requested, taken = self._requested, self._board_taken
        for w, ordinal in zip(words, ordinals, strict=True):
            if requested[w] != ordinal or taken[w] == ordinal:
                return False
        for schema, keys, dtypes in schemas:
            self._schemas[schema] = _SchemaReader(keys, dtypes)
        self._board_seen[words] = [-o for o in ordinals]
        taken[words] = ordinals
        self._board_seen_bytes, self._board_taken_bytes = self._board_seen.tobytes(), taken.tobytes()
        self._last_answer[p] = now
        return True

    def timings(self, slot: int) -> tuple[float, float, float]:
        """``(seconds in the env, answer posted at, step asked at)`` of ``slot``'s latest board
        step (``time.monotonic``): valid from its answer until it is asked again."""
        w = self._slot_words[slot]
        return float(self._env_times[w]), float(self._answered_at[w]), float(self._asked_at[w])

    def asked_at(self, slots: list[int]) -> np.ndarray:
        """When the steps of ``slots`` were last asked (``time.monotonic``)."""
        return self._asked_at[self.slot_word[slots]]

    def busy(self, p: int) -> bool:
        """Whether process ``p`` has a board step in flight (one compare of bytes)."""
        in_mapping, in_taken = self._spans[p]
        return self._map[in_mapping] != self._board_taken_bytes[in_taken]

    def clock(self, p: int) -> float:
        """When process ``p``'s deadline clock started: the later of its last board answer and
        the ask of its oldest board step in flight (``time.monotonic``; only asked while ``busy``)."""
        words = self._board_words[p]
        flying = words[self._board_taken[words] != self._requested[words]]
        oldest = float(self._asked_at[flying].min()) if flying.size else 0.0
        return max(oldest, float(self._last_answer[p]))

    def steps_in_flight(self, p: int) -> list[int]:
        """The slots of process ``p`` with a board step in flight."""
        words = self._board_words[p]
        return self._word_slot[words[self._board_taken[words] != self._requested[words]]].tolist()

    def cut_steps(self, p: int) -> list[int]:
        """Take process ``p``'s board steps out of flight (it failed); their slots. Answers
        that come for them later are stale."""
        words = self._board_words[p]
        flying = words[self._board_taken[words] != self._requested[words]]
        self._board_seen[flying] = self._board_taken[flying] = self._requested[flying]
        self._board_seen_bytes, self._board_taken_bytes = self._board_seen.tobytes(), self._board_taken.tobytes()
        return self._word_slot[flying].tolist()

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
        for name in ("_requested", "_env_times", "_answered_at", "_worker_states", "_info_rows", "_info_ids"):  # views
            setattr(self, name, None)
        try:
            self._map.close()
        except BufferError:  # a view still alive somewhere; the mapping goes with it
            pass
        self.file.close()


class WorkerMailbox:
    """A worker's side: its own request and answer rings, its envs' words on the step board,
    and the parent's word."""

    def __init__(self, file: SharedFile, layout: MailboxLayout, p: int) -> None:
        self.layout, self.p = layout, p
        self._map = file.map(layout.nbytes)
        self._words = memoryview(self._map).cast("q")
        self._floats = memoryview(self._map).cast("d")
        self._word = layout.region(p) // 8
        self._posted_at = layout.posted // 8 + p
        self._requests = [layout.request(p, k) for k in range(layout.entries(p))]
        self._answers = [layout.answer(p, k) for k in range(layout.entries(p))]
        self._entries = layout.entries(p)
        self._taken = 0  # ordinal of the last request taken
        self._posted = 0  # ordinal of the last answer posted
        # The board: this process's words in each block (in words from the mapping's start).
        k = layout.envs[p]
        first = layout.board_word(p, 0)
        self._asked = [layout.block(REQUESTS) // 8 + first + i for i in range(k)]
        self._ans = [layout.block(ANSWERS) // 8 + first + i for i in range(k)]
        self._times = [layout.block(ENV_TIMES) // 8 + first + i for i in range(k)]
        self._at = [layout.block(ANSWERED_AT) // 8 + first + i for i in range(k)]
        self._asked_span = slice(self._asked[0] * 8, self._asked[0] * 8 + 8 * k)
        self._info_rows = [layout.block(INFOS) // 8 + (first + i) * INFO_WORDS for i in range(k)]
        #: The info schemas this process announced: (keys, value types) -> id (``schema_id``),
        #: and each env's last one (keys, value types, id).
        self._schemas: dict[tuple[tuple[Any, ...], tuple[type, ...]], int] = {}
        self._last_schema: list[LastSchema | None] = [None] * k
        #: The ordinals this process served (a replaced process's successor starts from what
        #: its board holds: the parent took the old steps out of flight).
        self._served = [self._words[w] for w in self._asked]
        self._served_bytes = self._map[self._asked_span]

    def ready(self) -> bool:
        """Whether the next request is published (in the ring or on the board)."""
        n = self._taken + 1
        return self._words[self._requests[n % self._entries] // 8] == n or self._map[self._asked_span] != self._served_bytes

    def take(self) -> bytes | int | None:
        """The next request's bytes, :data:`ON_PIPE` when it is on the pipe, or ``None``."""
        n = self._taken + 1
        at = self._requests[n % self._entries]
        words = self._words
        if words[at // 8] != n:
            return None
        self._taken = n
        size = words[at // 8 + 1]
        return ON_PIPE if size == ON_PIPE else self._map[at + 16 : at + 16 + size]

    def asked(self) -> bool:
        """Whether the board asks for steps (one compare of bytes)."""
        return self._map[self._asked_span] != self._served_bytes

    def steps(self) -> tuple[list[int], list[int]]:
        """The envs (local indices, ascending) the board asks to step, and their ordinals."""
        snapshot = self._map[self._asked_span]  # one copy: what the parent posted at once is taken at once
        if snapshot == self._served_bytes:
            return [], []
        served = self._served
        locals_, ordinals = [], []
        for i, ordinal in enumerate(_unpacker(len(served))(snapshot)):
            if ordinal != served[i]:
                locals_.append(i)
                ordinals.append(ordinal)
        return locals_, ordinals

    def answer_steps(self, locals_: list[int], ordinals: list[int], env_times: Sequence[float], raw: bool) -> bool:
        """Publish the answers of the board steps ``locals_`` (their results already written to
        shared memory; with ``raw=False`` a notice carrying the rest was posted just before);
        returns whether the parent may be asleep (a wake-up must follow on the queue)."""
        floats, served = self._floats, self._served
        now = time.monotonic()
        for i, ordinal, seconds in zip(locals_, ordinals, env_times, strict=True):
            floats[self._times[i]] = seconds
            floats[self._at[i]] = now
            served[i] = ordinal
        answers = ordinals if raw else [-o for o in ordinals]
        first, n = locals_[0], len(locals_)
        if locals_[-1] - first == n - 1:  # a lane, or every env: its answers published in one write
            at = self._ans[first] * 8  # (a spinning parent sees them all or none, and takes them in one answer)
            self._map[at : at + 8 * n] = _packed(answers)
        else:
            words = self._words
            for i, answer in zip(locals_, answers, strict=True):
                words[self._ans[i]] = answer  # published
        self._served_bytes = _packed(served)  # (not the board's bytes: the parent may ask again already)
        return self._parent_may_sleep()

    def _parent_may_sleep(self) -> bool:
        """After publishing: whether the parent must be woken (it may be asleep, or nothing spins)."""
        words = self._words
        word = words[0]
        return words[1] == 0 or (word != BUSY and (word == SLEEPING or time.monotonic_ns() >= word - MARGIN_NS))

    def write_infos(self, locals_: list[int], infos: list[dict | None] | None) -> list[Schema] | None:
        """Write the infos of the envs ``locals_`` into their info rows (an empty one, or all
        when ``infos`` is ``None``, as none); ``None`` if one does not fit (a value other than
        a scalar of ``INFO_KINDS``, a key other than a string, too many keys): then they travel
        in a notice. Returns the schemas first used here, ``(id, keys, dtypes)``, which a notice
        must announce before an answer of the board alone may use them (they count as known
        once returned)."""
        words, rows = self._words, self._info_rows
        if infos is None:
            for i in locals_:
                words[rows[i]] = 0
            return []
        fresh: list[Schema] = []
        for i, info in zip(locals_, infos, strict=True):
            row = rows[i]
            if not info:
                words[row] = 0
                continue
            keys = tuple(info)
            last = self._last_schema[i]  # an env's info has the same keys step after step, usually
            if last is None or last[0] != keys:
                last = self._last_schema[i] = self._schema_of(keys, tuple(map(type, info.values())), fresh)
                if last is None:
                    return None
            try:
                if not self._write_row(row, info, last[1]):  # the same keys, other types: another schema
                    last = self._last_schema[i] = self._schema_of(keys, tuple(map(type, info.values())), fresh)
                    if last is None:
                        return None
                    self._write_row(row, info, last[1])
            except (OverflowError, TypeError, ValueError):  # an int beyond 64 bits, say
                return None
            words[row] = last[2]
        for schema, keys, dtypes in fresh:
            self._schemas[(keys, tuple(_KIND_OF[d] for d in dtypes))] = schema
        return fresh

    def _write_row(self, row: int, info: dict, kinds: tuple[Any, ...]) -> bool:
        """Write ``info``'s values after its schema word at ``row``, as ``kinds``; ``False`` (the
        row half written, its schema word not) where a value is of another type."""
        words, floats = self._words, self._floats
        for j, value, kind in zip(range(row + 1, row + 1 + len(kinds)), info.values(), kinds, strict=True):
            if type(value) is not kind:
                return False
            if kind is float or kind in _FLOAT_KINDS:
                floats[j] = float(value)
            else:
                words[j] = int(value)
        return True

    def _schema_of(self, keys: tuple[Any, ...], kinds: tuple[type, ...], fresh: list[Schema]) -> LastSchema | None:
        """``(keys, kinds, schema id)`` of an info with these keys and value types, noted in
        ``fresh`` if this process has not used it yet; ``None`` if the info rows cannot hold it."""
        schema = self._schemas.get((keys, kinds))
        if schema is None:
            if len(keys) >= INFO_WORDS or not all(type(k) is str for k in keys) or not all(k in INFO_KINDS for k in kinds):
                return None
            dtypes = tuple(INFO_KINDS[k][0] for k in kinds)
            schema = schema_id(keys, dtypes)
            if all(s != schema for s, _, _ in fresh):
                fresh.append((schema, keys, dtypes))
        return keys, kinds, schema

    def post(self, notice: bytes) -> bool | None:
        """Publish an answer notice; ``None`` when it does not fit (the step queue takes it),
        else whether the parent may be asleep (then a wake-up must follow on the queue)."""
        size = len(notice)
        if size > ANSWER_BYTES:
            return None
        n = self._posted = self._posted + 1
        at = self._answers[n % self._entries]
        words = self._words
        self._map[at + 16 : at + 16 + size] = notice
        words[at // 8 + 1] = size
        words[at // 8] = n
        words[self._posted_at] = n  # published
        return self._parent_may_sleep()

    @property
    def spin_allowed(self) -> bool:
        """Whether the parent lets the workers spin (else they sleep at once, and are always woken)."""
        return self._words[1] != 0

    # -- the worker's word ---------------------------------------------------------------------
    def busy(self) -> None:
        self._words[self._word] = BUSY

    def spinning(self, until_ns: int) -> None:
        self._words[self._word] = until_ns

    def sleeping(self) -> None:
        self._words[self._word] = SLEEPING

    def close(self) -> None:
        self._words.release()
        self._floats.release()
        try:
            self._map.close()
        except BufferError:
            pass


class _SchemaReader:
    """How the parent reads one announced info schema's values off the info rows: its keys, each
    value's word (a float64 or an int64) and column dtype, and which came as Python scalars."""

    def __init__(self, keys: tuple[str, ...], dtypes: tuple[str, ...]) -> None:
        self.keys = keys
        self.columns = [(1 + j, dtype in _FLOAT_DTYPES, np.dtype(_dtype(dtype))) for j, dtype in enumerate(dtypes)]
        self.python = tuple(d.startswith("py:") for d in dtypes)

    def read(self, rows: np.ndarray, slots: np.ndarray,
             words: np.ndarray) -> tuple[np.ndarray, tuple[str, ...], list[np.ndarray], tuple[bool, ...]]:
        """``slots``' values (their info rows at ``words``), one column per key."""
        values = rows[words]
        columns = [(values[:, j].view(np.float64) if is_float else values[:, j]).astype(dtype)
                   for j, is_float, dtype in self.columns]
        return slots, self.keys, columns, self.python


def schema_id(keys: tuple[str, ...], dtypes: tuple[str, ...]) -> int:
    """An info schema's id: the same in every process (the parent batches the infos of every
    process with that schema as one block), never 0 (no info)."""
    digest = hashlib.blake2b(repr((keys, dtypes)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2 or 1


def _packed(values: list[int]) -> bytes:
    return _struct_of(len(values)).pack(*values)


def _unpacker(n: int) -> Callable[[bytes], tuple[int, ...]]:
    return _struct_of(n).unpack


@functools.cache
def _struct_of(n: int) -> struct.Struct:
    """``n`` words, as the board holds them."""
    return struct.Struct(f"<{n}q")
