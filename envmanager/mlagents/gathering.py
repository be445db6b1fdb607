"""A moment's wait for more players before the policies act (``gather_window``, issue 32), so
that one batched inference serves more of them; it adds latency, so it is off by default (see
docs/guide/mlagents.md, "A moment for more players").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from envmanager.core.results import StepInfo
from envmanager.errors import InvalidInputError, WorkerTimeoutError

__all__ = ["GatherWindow", "NO_GATHER", "gather_more"]


@dataclasses.dataclass(frozen=True)
class GatherWindow:
    """Wait up to ``seconds`` after the first result until ``share`` of the busy players answered."""

    seconds: float = 0.0
    share: float = 0.75

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds, (int, float)) and 0 <= self.seconds < math.inf):
            raise InvalidInputError(f"gather window must be a number of seconds >= 0, got {self.seconds!r}")
        if not (isinstance(self.share, (int, float)) and 0 < self.share <= 1):
            raise InvalidInputError(f"gather share must be in (0, 1], got {self.share!r}")


#: The default: no wait (the policies act on what has come).
NO_GATHER = GatherWindow()


def gather_more(manager: Any, first: list[StepInfo], window: GatherWindow) -> list[StepInfo]:
    """``first`` and what else the core ``manager`` delivers within the window: until ``share``
    of the workers stepping when ``first`` came (``first`` included) have answered, or the window
    ends. A failure is raised as ``receive_steps`` raises it (the caller keeps ``first``)."""
    if window.seconds <= 0:
        return first
    busy = len(first) + len(manager.waiting_worker_ids)
    want = math.ceil(window.share * busy) - len(first)
    if want <= 0:
        return first
    try:
        return first + manager.receive_steps(timeout=window.seconds, min_count=want)
    except WorkerTimeoutError as exc:
        if exc.hung:
            raise
        return first + manager.receive_steps(min_count=0)  # the window ended: what came meanwhile
