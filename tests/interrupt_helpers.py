"""What the Ctrl-C programs of ``test_interrupts.py`` share: started as from a terminal, a thread
pressing Ctrl-C at random moments, and an end that takes the presses still on their way."""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import threading
import time

from envmanager.wire.interrupts import DEFERRED


def as_from_a_terminal() -> None:
    """SIGINT delivered and raised as ``KeyboardInterrupt`` (the test runner's child may have it
    blocked); a program still running after 100 s shows where it is (stderr)."""
    faulthandler.dump_traceback_later(100)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)


class Presser:
    """A thread sending this process SIGINT every 0.1 ms to ``most_s`` (at random, from ``seed``)
    until ``stop``."""

    def __init__(self, seed: int, most_s: float = 0.002) -> None:
        self._most_s = most_s
        self._stop = threading.Event()
        self._rng = random.Random(seed)
        self._thread = threading.Thread(target=self._press, daemon=True)
        self._thread.start()

    def _press(self) -> None:
        while not self._stop.is_set():
            time.sleep(self._rng.uniform(0.0001, self._most_s))
            if not self._stop.is_set():
                os.kill(os.getpid(), signal.SIGINT)

    def stop(self) -> None:
        """Stop pressing; the presses still on their way, or held back by the library, are taken here."""
        self._stop.set()
        while self._thread.is_alive():  # (one held back to the end of the last call comes a moment after it)
            try:
                self._thread.join()
            except KeyboardInterrupt:
                pass
        for _ in range(3):
            try:
                time.sleep(0.05)
                with DEFERRED:
                    pass
            except KeyboardInterrupt:
                pass
