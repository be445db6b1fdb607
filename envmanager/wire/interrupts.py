"""Ctrl-C held back where it would lose an answer or half-send a batch.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Raised right
after answers were read off the step queue, they are lost (their slots stay in flight, and a
healthy worker is later called hung); raised in the middle of a batch's sends, slots are marked
in flight that no worker was asked to step; raised while a batch is handed out, it is handed to
nobody. Inside a section (``with DEFERRED:``, or ``try: begin() ... finally: end()`` on a step's
path, at half the cost) a Ctrl-C is noted, and raised where nothing is half-done: on entering
the next section, or in its blocking wait (``blocking``, which has taken nothing yet and stays
interruptible), or, once the call has returned, sent to the main thread again (``REDELIVER_S``
later): a program that does not call the manager for a while (a learner's update), or ends,
still gets it.

One Python handles just after a call's last section ended is held too: CPython looks for signals
right after a ``with``'s ``__exit__`` returns (3.10: after every call returns), before the call's
answer is its caller's. Held there: any handled within ``GRACE_S`` of the end (on 3.10 also of
this thread's CPU time since: its look in the caller's frame), and, within ``RETURNING_S``, one
handled in this package's code or a function it called (a process descheduled on its way back
from the call handles it late, in our frames). Held in our code at no risk: a section's entry
raises it. Held, wherever it comes, in a finalizer (``__del__``), where a raise is printed and
dropped. A Ctrl-C pressed again a second later inside a section is raised at once: the way out
of one that does not end.

Only where SIGINT has Python's default handler: the outermost section takes it over then (again
after a notebook put the default back for a cell), and a program with a handler of its own keeps
it. Outside sections the handler raises as Python's does; but ``asyncio.run`` and trio, which set
their own Ctrl-C handling only over Python's default, no longer find it once a manager was used.
"""

from __future__ import annotations

import _thread
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

__all__ = ["DEFERRED", "begin", "blocking", "deferred", "end"]

_T = TypeVar("_T")

#: A Ctrl-C held this long inside one section means it is stuck: the next press is raised at once.
STUCK_S = 1.0
#: A Ctrl-C Python handles this soon after a call's last section ended is held too.
GRACE_S = 0.01
#: ... and this soon in this package's code, where the call may still be on its way back to its caller.
RETURNING_S = 1.0
#: A Ctrl-C still held when a call's last section ended is sent to the main thread again this much later.
REDELIVER_S = 0.01

_main = threading.main_thread().ident  # the only thread Python raises KeyboardInterrupt in
_depth = 0  # sections the main thread is in
_ended_at = 0.0  # when the last outermost one ended (``time.perf_counter()``)
_pending = False  # a Ctrl-C is held
_held_since = 0.0  # since when (``time.monotonic()``)
_redelivery_due = False  # it is being sent to the main thread again (``_redeliver_later``)
# 3.10 looks for signals after every call returns, in the caller's frame too: there the grace after
# a section is counted in this thread's CPU time as well (a process descheduled on its way back from
# the call still holds it; 0.3 us a call, on 3.10 only).
_LOOKS_AFTER_EVERY_CALL = sys.version_info < (3, 11)
_ended_cpu = 0.0  # when the last outermost section ended in this thread's CPU time (3.10)

# signal.getsignal's C half: the Python one makes an enum of it, 2 us (100x) on every call.
_getsignal: Callable[[int], Any] = getattr(sys.modules.get("_signal"), "getsignal", signal.getsignal)
_SIGINT, _default = int(signal.SIGINT), signal.default_int_handler
_get_ident, _perf_counter = _thread.get_ident, time.perf_counter  # (module globals: the sections are on every call's path)


def _held(frame: FrameType | None) -> bool:
    """Whether a Ctrl-C handled in ``frame`` must wait now: inside a section, or just after one
    (``GRACE_S``; ``RETURNING_S`` in this package's code or a function it called, where a call may
    still be on its way back), or in a finalizer (``__del__``: Python prints what is raised there and goes on)."""
    if _depth:
        return True
    if frame is not None and frame.f_code.co_name == "__del__":
        return True
    since = time.perf_counter() - _ended_at
    if since < GRACE_S:
        return True
    if since >= RETURNING_S:
        return False
    if _LOOKS_AFTER_EVERY_CALL and time.thread_time() - _ended_cpu < GRACE_S:
        return True
    return frame is not None and (_ours(frame) or (frame.f_back is not None and _ours(frame.f_back)))


def _ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _pending, _held_since, _redelivery_due
    if _redelivery_due:  # ours, sent again (a press that came with it is the same Ctrl-C)
        _redelivery_due = False
        if not _pending:  # raised meanwhile, at a section's entry or in a wait
            return
        if _held(frame):  # still: sent once more (not left to the section's end: this may be our own timer's start)
            _redeliver_later()
            return
        _pending = False
        raise KeyboardInterrupt
    if _held(frame):
        if not _pending:
            _pending, _held_since = True, time.monotonic()
            if not _depth:  # after the call's last section: nothing else would raise it
                _redeliver_later()
            return
        # Pressed again: at once if a section held the first one this long (the way out of a stuck
        # one), but never in this module's own code, which would leave ``_depth`` wrong, nor in a finalizer.
        if time.monotonic() - _held_since < STUCK_S or (frame is not None and (
                frame.f_code in _OWN_CODE or frame.f_code.co_name == "__del__")):
            return
    _pending = False
    raise KeyboardInterrupt


def _redeliver_later() -> None:
    """SIGINT to the main thread again in ``REDELIVER_S``, from a timer thread (a real signal ends
    a blocking wait there too)."""
    global _redelivery_due, _depth
    if _redelivery_due:
        return
    _redelivery_due = True
    _depth += 1  # (threading's Python code; ``start`` waits for the thread to run: a Ctrl-C meanwhile is held)
    try:
        timer = threading.Timer(REDELIVER_S, _send_again, (_main,))
        timer.daemon = True
        timer.start()
    except RuntimeError:  # no new thread (the interpreter is ending): held to the next section
        _redelivery_due = False
    finally:
        _depth -= 1


def _send_again(main: int | None) -> None:
    """The timer's half of ``_redeliver_later``. Where SIGINT is no longer ours (a notebook between
    cells, a handler of the program's own), the press goes to whoever has it now."""
    global _pending, _redelivery_due
    if not _pending:  # raised meanwhile
        _redelivery_due = False
        return
    if _getsignal(_SIGINT) is not _on_sigint:
        _pending = _redelivery_due = False
    try:
        if main is not None and hasattr(signal, "pthread_kill"):
            signal.pthread_kill(main, signal.SIGINT)
        else:  # Windows: Python's handler runs all the same (a wait is not cut short)
            _thread.interrupt_main()
    except (OSError, ValueError, RuntimeError):  # the main thread is gone (the interpreter is ending)
        pass


def _take_over() -> None:
    """Put ``_on_sigint`` in Python's default handler's place (which it acts as, outside sections)."""
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except (ValueError, OSError):  # no signals here (an embedded interpreter, say)
        pass


def begin() -> None:
    """Enter a section, written ``try: begin() ... finally: end()``: ``with DEFERRED:`` at half its
    cost, for the calls made on every step (CPython calls a ``with``'s ``__enter__`` and ``__exit__``
    from C, a plain call inline). ``begin()`` goes inside the ``try``: a Ctrl-C raised before it
    counted leaves ``end()`` nothing to close (3.10 looks for signals as the call returns). Entering
    the outermost section raises a Ctrl-C an earlier one held back; a no-op outside the main thread."""
    global _depth, _pending
    if _get_ident() != _main:
        return
    if _depth:  # (nested: the hot path's usual case, kept short)
        _depth += 1
        return
    if _pending:
        _pending = False
        raise KeyboardInterrupt
    if _getsignal(_SIGINT) is _default:  # (again after a notebook's cell put the default back)
        _take_over()
    _depth = 1


def end(*_exc_info: object) -> None:
    """Leave the section ``begin()`` entered (its ``finally:``)."""
    global _depth, _ended_at, _ended_cpu
    if not _depth or _get_ident() != _main:
        return
    if _depth > 1:
        _depth -= 1
        return
    _ended_at = _perf_counter()  # (first: from here on a Ctrl-C is held by the grace)
    if _LOOKS_AFTER_EVERY_CALL:
        _ended_cpu = time.thread_time()
    _depth = 0
    if _pending:  # held to the end of the call: sent again once it has returned
        _redeliver_later()


class _Deferred:
    """The section as a ``with`` block: ``with DEFERRED:`` (``begin`` and ``end``). Reentrant."""

    __slots__ = ()
    __enter__ = staticmethod(begin)
    __exit__ = staticmethod(end)


DEFERRED = _Deferred()
#: This package's files (as its code objects name them): a Ctrl-C handled there may be a call on its way back.
_PACKAGE = os.path.dirname(os.path.dirname(_held.__code__.co_filename)) + os.sep
_OWN_CODE = frozenset({begin.__code__, end.__code__, _redeliver_later.__code__})


def deferred(call: Callable[..., _T]) -> Callable[..., _T]:
    """``call`` made one section: a Ctrl-C is raised in its blocking waits or once it returned."""

    @functools.wraps(call)
    def in_section(*args: Any, **kwargs: Any) -> _T:
        try:
            begin()
            return call(*args, **kwargs)
        finally:
            end()

    return in_section


def blocking(wait: Callable[..., _T], *args: Any) -> _T:
    """``wait(*args)``: a blocking wait that has taken nothing yet, interruptible inside a section
    (and where a Ctrl-C held back is raised)."""
    global _depth, _pending
    if not _depth or _get_ident() != _main:
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
    global _main, _depth, _ended_at, _pending, _redelivery_due
    _main, _depth, _ended_at, _pending, _redelivery_due = _get_ident(), 0, 0.0, False, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
