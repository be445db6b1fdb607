"""Platform choices made in one place: the default start method and the answer transport (the
shared step queue, or each worker's own pipe where it cannot work: ``envmanager.wire.transport``).
``ENVMANAGER_TRANSPORT=portable`` forces the portable transport anywhere, so it is tested on Linux too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import sys

__all__ = ["default_start_method", "transport_name", "step_queue_available", "mailbox_enabled", "TRANSPORT_ENV",
           "TRANSPORTS", "MAILBOX_ENV"]

#: Environment variable that picks the transport: ``auto`` (default), ``step_queue``, ``portable``.
TRANSPORT_ENV = "ENVMANAGER_TRANSPORT"
TRANSPORTS = ("step_queue", "portable")
#: Environment variable for the mailbox: ``auto`` (default: where it helps), ``on``, ``off``.
MAILBOX_ENV = "ENVMANAGER_MAILBOX"


def default_start_method() -> str:
    """``fork`` on Linux (cheap, and what multiprocessing uses there); ``spawn`` on macOS, where
    forking a process with threads is unsafe, on Windows, where there is no fork, and anywhere
    else without fork. Code run by ``spawn`` workers must sit under ``if __name__ == "__main__":``."""
    return "fork" if sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods() else "spawn"


def step_queue_available() -> bool:
    """Whether the shared step queue can work here: a POSIX pipe read with ``select.poll``."""
    if sys.platform == "win32" or not hasattr(select, "poll"):
        return False
    try:
        import fcntl  # noqa: F401
    except ImportError:
        return False
    return True


def transport_name(choice: str | None = None) -> str:
    """The transport to use: ``choice``, else ``$ENVMANAGER_TRANSPORT``, else automatic
    (``step_queue`` where it works, ``portable`` otherwise). ``ValueError`` for unknown names;
    ``step_queue`` asked for where it cannot work falls back to ``portable``."""
    name = (choice or os.environ.get(TRANSPORT_ENV) or "auto").strip().lower().replace("-", "_")
    if name not in ("auto", *TRANSPORTS):
        raise ValueError(f"unknown transport {name!r}: expected 'auto', 'step_queue' or 'portable' ({TRANSPORT_ENV})")
    return "portable" if name == "portable" or not step_queue_available() else "step_queue"


def mailbox_enabled(spinning: bool) -> bool:
    """Whether to use the mailbox (``envmanager.wire.mailbox``, x86 only): by default where the
    processes spin (``spinning``); ``ENVMANAGER_MAILBOX=on`` everywhere (with its short spin: tests
    run the suite so), ``off`` nowhere (comparisons)."""
    choice = os.environ.get(MAILBOX_ENV, "auto").strip().lower()
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"unknown {MAILBOX_ENV} value {choice!r}: expected 'auto', 'on' or 'off'")
    return choice == "on" or (choice == "auto" and spinning)
