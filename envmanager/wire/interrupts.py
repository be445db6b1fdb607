"""Ctrl-C held back where it would lose an answer or half-send a batch.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Raised right
after answers were read off the step queue, they are lost (their slots stay in flight, and a
healthy worker is later called hung); raised in the middle of a batch's sends, slots are marked
in flight that no worker was asked to step; raised while a batch is handed out, it is handed to
nobody. Inside ``DEFERRED`` (``with DEFERRED:``) a Ctrl-C is noted, and raised where nothing is
half-done: on entering the next section, or in its blocking wait (``blocking``, which has taken
nothing yet and stays interruptible). A Ctrl-C pressed again a second later inside the same section
is raised at once: the way out of one that does not end.

Only where SIGINT has Python's default handler: a section takes it over then (a notebook puts the
default back for each cell), and a program with a handler of its own keeps it. Outside sections
the handler raises as Python's does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, TypeVar

__all__ = ["DEFERRED", "blocking"]

_T = TypeVar("_T")

# signal.getsignal's C half: the Python one converts to an enum, 2 us (100x) on every section.
_getsignal: Callable[[int], Any] = getattr(sys.modules.get("_signal"), "getsignal", signal.getsignal)
_DEFAULT = signal.default_int_handler
_main = threading.main_thread().ident  # the only thread Python raises KeyboardInterrupt in
_depth = 0  # sections the main thread is in
_pending = False  # a Ctrl-C came inside one
_held_since = 0.0  # when (``time.monotonic()``)

#: A section that held a Ctrl-C back this long is stuck: the next one is raised at once.
STUCK_S = 1.0


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _pending, _held_since
    if _depth:
        if not _pending:
            _pending, _held_since = True, time.monotonic()
            return
        if time.monotonic() - _held_since < STUCK_S:
            return
    _pending = False
    raise KeyboardInterrupt


def _take_over() -> None:
    """Put ``_on_sigint`` in Python's default handler's place (which it acts as, outside sections)."""
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except (ValueError, OSError):  # no signals here (an embedded interpreter, say)
        pass


class _Deferred:
    """The section: ``with DEFERRED:``. Reentrant; a no-op outside the main thread. Entering
    the outermost one raises a Ctrl-C an earlier one held back."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _depth, _pending
        if threading.get_ident() == _main:
            if not _depth:
                if _pending:
                    _pending = False
                    raise KeyboardInterrupt
                if _getsignal(signal.SIGINT) is _DEFAULT:  # (again after a notebook cell put it back)
                    _take_over()
            _depth += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _depth
        if _depth and threading.get_ident() == _main:
            _depth -= 1


DEFERRED = _Deferred()


def blocking(wait: Callable[..., _T], *args: Any) -> _T:
    """``wait(*args)``: a blocking wait that has taken nothing yet, interruptible inside a section
    (and where a Ctrl-C held back is raised)."""
    global _depth, _pending
    if not _depth or threading.get_ident() != _main:
        return wait(*args)
    if _pending:
        _pending = False
        raise KeyboardInterrupt
    saved, _depth = _depth, 0
    try:
        return wait(*args)
    finally:
        _depth = saved


def _after_fork() -> None:
    """A forked child starts outside every section, its forking thread its main thread."""
    global _main, _depth, _pending
    _main, _depth, _pending = threading.get_ident(), 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
