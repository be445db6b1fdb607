"""Which env a worker process is in, and which call: a record per process in shared memory that
the worker writes and the parent reads without asking it (it may be hung, or dead).

Before each call of one of its envs (``reset``, ``step``, ``render``, ``get_attr`` ...) a worker
writes one word: the env's slot and a call code (:data:`STEP`, ...). It clears the word when
the request is done (the main loop, once per request), so between requests it reads
:data:`NOTHING`. Within a request the word names the env whose call runs, and stays on it
after the call returns until the next env's call starts or the request ends (in between, the worker
runs only its own bookkeeping, no env code). A call by name (``env.render()``, an env function)
also writes its name, before the request's first env (calls are not on the hot path).

So a hang, a segfault or a kill names the env and the call: the pool reads the record when
it judges a process hung or finds it dead (``WorkerProcess.inside``). The hot path pays one
8-byte store per env call (a ``memoryview`` item, ~25 ns), no syscall, no allocation.

Layout: one 64-byte line per process (no two workers write to one cache line): the word
``slot << 8 | code`` (0: nothing), the name's length, then up to :data:`NAME_BYTES` of its
UTF-8. The record lives in a :class:`SharedFile` the pool makes before any worker starts (each
gets it as it starts); where there is no such file there is no record, and errors name no env.
"""

from __future__ import annotations

import mmap

from envmanager.wire.shm import SharedFile

__all__ = ["CallMarks", "WorkerMarks", "NOTHING", "FACTORY", "RESET", "STEP", "CALL", "GET_ATTR", "SET_ATTR",
           "CLOSE", "CALL_NAMES", "mark"]

NOTHING, FACTORY, RESET, STEP, CALL, GET_ATTR, SET_ATTR, CLOSE = range(8)
#: How an error names each call code (``CALL`` is named by what was called).
CALL_NAMES = {FACTORY: "env_factory", RESET: "reset", STEP: "step", CALL: "call", GET_ATTR: "get_attr",
              SET_ATTR: "set_attr", CLOSE: "close"}
_LINE = 64
_WORDS = _LINE // 8
NAME_BYTES = _LINE - 16


class CallMarks:
    """The parent's side: every process's record, in a :class:`SharedFile` made before any
    worker starts (each gets ``file`` as it starts, as it gets its pipe)."""

    def __init__(self, file: SharedFile, n_procs: int) -> None:
        self.file = file
        self.n_procs = n_procs
        file.resize(max(1, n_procs) * _LINE)
        self._map: mmap.mmap | None = file.map(max(1, n_procs) * _LINE)
        self._words = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, n_procs: int) -> CallMarks | None:
        """The records of ``n_procs`` processes, or ``None`` where there is no such file."""
        file = SharedFile.create()
        return None if file is None else cls(file, n_procs)

    def reset(self, p: int) -> None:
        """Clear process ``p``'s record for a new process (the old one is gone)."""
        self._words[p * _WORDS] = NOTHING
        self._words[p * _WORDS + 1] = 0

    def read(self, p: int) -> tuple[int, str] | None:
        """The env slot and the call process ``p`` is in, or ``None`` between calls."""
        if self._map is None:
            return None
        word = self._words[p * _WORDS]
        code = word & 0xFF
        if code == NOTHING or code not in CALL_NAMES:
            return None
        name = CALL_NAMES[code]
        if code == CALL:
            size = min(max(self._words[p * _WORDS + 1], 0), NAME_BYTES)
            start = p * _LINE + 16
            name = self._map[start : start + size].decode("utf-8", "replace") or name
        return word >> 8, name

    def close(self) -> None:
        """Unmap and close (the workers' mappings keep it alive until they end). Safe twice."""
        mapping, self._map = self._map, None
        if mapping is None:
            return
        self._words.release()
        try:
            mapping.close()
        except BufferError:  # a view still alive somewhere; the mapping goes with it
            pass
        self.file.close()


class WorkerMarks:
    """A worker's side: ``words[at]`` is its record's word (a ``memoryview``, or a list when
    there is no record: the same store, to nowhere). The hot path writes ``words[at]`` itself."""

    def __init__(self, file: SharedFile | None, p: int) -> None:
        self.at = p * _WORDS
        self._map: mmap.mmap | None = None
        if file is None:
            self.words: memoryview | list[int] = [0] * (self.at + _WORDS)
            return
        self._map = file.map((p + 1) * _LINE)  # the parent sized it for every process
        self.words = memoryview(self._map).cast("q")

    def name(self, name: str) -> None:
        """Record the name of the call about to run (before its ``CALL`` marks)."""
        if self._map is None:
            return
        data = name.encode("utf-8", "replace")[:NAME_BYTES]
        start = self.at * 8 + 16
        self._map[start : start + len(data)] = data
        self.words[self.at + 1] = len(data)


def mark(slot: int, code: int) -> int:
    """The word that says env ``slot`` is in call ``code``."""
    return slot << 8 | code
