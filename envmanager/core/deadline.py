"""The one deadline helper: every wait in envmanager is bounded by one of these."""

from __future__ import annotations

import time


class Deadline:
    """A point in time ``seconds`` from now (``time.monotonic``)."""

    __slots__ = ("at", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at
