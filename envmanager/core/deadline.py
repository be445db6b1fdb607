"""The one deadline helper: every wait in envmanager is bounded by one of these."""

from __future__ import annotations

import math
import time
from numbers import Real

from envmanager.errors import InvalidInputError


class Deadline:
    """A point in time ``seconds`` from now (``time.monotonic``)."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at


def caller_timeout(timeout: object) -> float | None:
    """A caller's ``timeout`` checked: ``None`` or ``inf`` (no bound of the caller's own: the
    pool's per-answer deadline still ends the wait), else its seconds (0 or less: look once).
    ``InvalidInputError`` for NaN and anything not a number."""
    if timeout is None:
        return None
    if not isinstance(timeout, Real) or isinstance(timeout, bool) or math.isnan(timeout):
        raise InvalidInputError(f"timeout must be a number of seconds or None, got {timeout!r}")
    return None if timeout == math.inf else float(timeout)


def positive_seconds(name: str, value: object) -> float:
    """A deadline argument checked: a positive, finite number of seconds (NaN would never pass,
    ``inf`` is no deadline), else ``InvalidInputError`` naming ``name``."""
    if not isinstance(value, Real) or isinstance(value, bool) or not 0 < float(value) < math.inf:
        raise InvalidInputError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)
