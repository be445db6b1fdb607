"""How long a waiter spins before it blocks: bounded, sized from the waits it sees, and backing
off when spins catch nothing.

A spin pays only where the spinner has a core of its own and the thing it waits for usually
comes within the spin: a blocked process wakes tens of microseconds after it is signalled —
far more on a loaded machine — and the one signalling it pays for the wake-up in its ``write``.

A **sized** spin (the mailbox's waiters) covers about twice the typical wait (a running average
of how long the messages took to come, ``waited``), and at least :data:`MIN_SIZED_S` (a wait
that is usually short still has its hiccups), at most ``spin_s``; where the typical wait is
longer than that cap, a wake-up costs little next to it and only the floor is spun. It does not
back off: one late message moves the average a little, and sleeping through the next ones would
cost a wake-up each. A **fixed** spin (``spin_s`` every time) backs off instead: after a spin
that caught nothing the next ``1, 2, 4, ...`` waits (up to :data:`MAX_SPIN_SKIP`) skip it; one
that catches ends the back-off.

The clock is injected, so the policy is tested against a fake clock rather than the machine's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["SpinPolicy", "MAX_SPIN_SKIP", "SPIN_FACTOR", "MIN_SIZED_S"]

#: The most waits that skip their spin after spins in a row caught nothing.
MAX_SPIN_SKIP = 64
#: A sized spin covers this many times the typical wait...
SPIN_FACTOR = 2.0
#: ...and at least this long.
MIN_SIZED_S = 100e-6
_AVERAGE = 1 / 8  # weight of each new wait in the running average


class SpinPolicy:
    """Up to ``spin_s`` seconds of spinning per wait, with back-off (see the module doc).

    ``spin(ready, limit)`` runs one wait's spin: calls ``ready()`` until it is true, the spin's
    budget is spent or ``limit`` seconds have passed; returns what ``ready()`` last said.
    ``floor_s``: the spin a wait never goes below, even backing off (the mailbox's margin).
    ``sized``: spin :data:`SPIN_FACTOR` times the typical wait (``waited``), capped at
    ``spin_s``; else always ``spin_s``.
    """

    def __init__(self, spin_s: float, floor_s: float = 0.0, clock: Callable[[], float] = time.perf_counter,
                 sized: bool = False) -> None:
        self.spin_s = spin_s
        self.floor_s = floor_s
        self.clock = clock
        self.sized = sized
        #: The running average of the waits (seconds), ``None`` before the first.
        self.typical: float | None = None
        self._skip = 0  # waits left that skip their spin
        self._backoff = 1  # how many the next spin that catches nothing makes skip

    def budget(self) -> tuple[float, bool]:
        """This wait's spin and whether it is a full one: ``spin_s`` (or the sized spin), or
        ``floor_s`` while backing off (which counts the wait)."""
        if self._skip > 0:
            self._skip -= 1
            return self.floor_s, False
        spin = self.spin_s
        if self.sized and self.typical is not None:
            wanted = max(SPIN_FACTOR * self.typical, MIN_SIZED_S)
            spin = wanted if wanted <= spin else 0.0  # waits this long: a wake-up costs little next to them
        return max(spin, self.floor_s), True

    def caught(self, caught: bool) -> None:
        """Record what a full spin found (a fixed spin backs off after one that found nothing)."""
        if caught:
            self._backoff = 1
        elif not self.sized:
            self._skip, self._backoff = self._backoff, min(2 * self._backoff, MAX_SPIN_SKIP)

    def waited(self, seconds: float) -> None:
        """Record how long a wait took until its message came (spinning or blocked)."""
        typical = self.typical
        self.typical = seconds if typical is None else typical + _AVERAGE * (seconds - typical)

    def spin(self, ready: Callable[[], bool], limit: float) -> bool:
        """One wait's spin (see the class doc). What is ready at once costs no spin and leaves
        the back-off as it was."""
        if ready():
            return True
        if limit <= 0:
            return False
        budget, full = self.budget()
        clock = self.clock
        until = clock() + min(budget, limit)
        found = False
        while clock() < until:
            if ready():
                found = True
                break
        if full:
            self.caught(found)
        return found
