"""Ctrl-C held back where it would lose an answer or half-send a batch.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Raised right
after answers were read off the step queue, they are lost (their slots stay in flight, and a
healthy worker is later called hung); raised in the middle of a batch's sends, slots are marked
in flight that no worker was asked to step; raised while a batch is handed out, it is handed to
nobody. Inside ``DEFERRED`` (``with DEFERRED:``) a Ctrl-C is noted, and raised where nothing is
half-done: on entering the next section, or in its blocking wait (``blocking``, which has taken
nothing yet and stays interruptible). A Ctrl-C pressed again a second later inside the same section
is raised at once: the way out of one that does not end.

One still held when the outermost section ends is sent again to the main thread a moment later
(``REDELIVER_S``), once the section's caller has its answer: a program that does not call the
manager again for a while (a learner's update), or ever (it ends), still gets its
``KeyboardInterrupt`` then, not at its next call or never. So is one that Python handles right
at the end of the outermost ``with`` (the check it makes after ``__exit__`` returns, where the
section's answer is not handed out yet).

Only where SIGINT has Python's default handler: the outermost section takes it over then
(again after a notebook put the default back for a cell), and a program with a handler of its
own keeps it. Outside sections the handler raises as Python's does.
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

_main = threading.main_thread().ident  # the only thread Python raises KeyboardInterrupt in
_depth = 0  # sections the main thread is in
_pending = False  # a Ctrl-C came inside one
_held_since = 0.0  # when (``time.monotonic()``)
_exit_at: tuple[Any, int, int] | None = None  # the ``with`` that ended the outermost section: (code, frame id, f_lasti)
_redelivery_due = False  # a held Ctrl-C is being sent again to the main thread (``_redeliver_later``)

# signal.getsignal's C half: the Python one makes an enum of it, 2 us (100x) on every section.
_getsignal: Callable[[int], Any] = getattr(sys.modules.get("_signal"), "getsignal", signal.getsignal)
_SIGINT, _default = int(signal.SIGINT), signal.default_int_handler

#: A section that held a Ctrl-C back this long is stuck: the next one is raised at once.
STUCK_S = 1.0
#: A Ctrl-C still held when the outermost section ends is sent to the main thread again this much later.
REDELIVER_S = 0.001


def _at_exit(frame: FrameType | None) -> bool:
    """Whether Python handles a signal at the end of the ``with`` that just ended the outermost section
    (its check after ``__exit__`` returns), where the section's answer is not handed out yet."""
    at = _exit_at
    return at is not None and frame is not None and frame.f_code is at[0] and id(frame) == at[1] and frame.f_lasti == at[2]


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _pending, _held_since, _redelivery_due
    if _redelivery_due:  # our own signal (a press that came with it is the same Ctrl-C)
        _redelivery_due = False
        if not _pending:  # raised meanwhile, at a section's entry or in a wait
            return
        if _depth or _at_exit(frame):  # still held: sent again a moment later (or raised at a section's entry
            _redeliver_later()  # or wait before that); the section's end cannot be relied on to: this may be
            return  # ``_redeliver_later``'s own start, which is no section
        _pending = False
        raise KeyboardInterrupt
    if _depth or _at_exit(frame):
        if not _pending:
            _pending, _held_since = True, time.monotonic()
            if not _depth:  # held at the end of the outermost section: nothing else would raise it
                _redeliver_later()
            return
        if time.monotonic() - _held_since < STUCK_S:
            return
    _pending = False
    raise KeyboardInterrupt


def _redeliver_later() -> None:
    """SIGINT to the main thread again in ``REDELIVER_S``, from a timer thread (Python runs signal
    handlers in the main thread; a real signal ends a ``sleep`` there too)."""
    global _redelivery_due, _depth
    main = _main
    if _redelivery_due or main is None:
        return
    _redelivery_due = True

    def send() -> None:
        try:
            signal.pthread_kill(main, signal.SIGINT)
        except (OSError, ValueError, AttributeError):  # the main thread is gone (the interpreter is ending)
            pass

    timer = threading.Timer(REDELIVER_S, send)
    timer.daemon = True
    _depth += 1  # (``start`` waits for the thread: a Ctrl-C meanwhile is held, not raised here)
    try:
        timer.start()
    except RuntimeError:  # no new thread (the interpreter is ending): held to the next section, as before
        _redelivery_due = False
    finally:
        _depth -= 1


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
        global _depth, _pending, _exit_at
        if threading.get_ident() == _main:
            if not _depth:
                _exit_at = None
                if _pending:
                    _pending = False
                    raise KeyboardInterrupt
                if _getsignal(_SIGINT) is _default:  # (again after a notebook's cell put the default back)
                    _take_over()
            _depth += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _depth, _exit_at
        if _depth and threading.get_ident() == _main:
            if _depth == 1:
                if _pending:  # held to the end of the outermost section: sent again once it has ended
                    _redeliver_later()
                if kind is None:  # it hands out its answer: a Ctrl-C Python handles at the end of its
                    caller = sys._getframe(1)  # ``with`` is still held (``_at_exit``)
                    _exit_at = (caller.f_code, id(caller), caller.f_lasti)
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
    global _main, _depth, _pending, _exit_at, _redelivery_due
    _main, _depth, _pending, _exit_at, _redelivery_due = threading.get_ident(), 0, False, None, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
