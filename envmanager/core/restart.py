"""When a failed unit may be restarted: a lifetime count and a rate, per quota (ML-Agents' rule);
the counts are the supervisor's, the rate's window of recent restarts the policy's."""

from __future__ import annotations

import time
from collections import defaultdict, deque

#: The one restart policy's defaults (ML-Agents'), the same for every manager, sampler and node
#: pool: at most 10 restarts of a process (or node) in its lifetime, and 1 within any 60 s.
MAX_LIFETIME_RESTARTS = 10
RATE_LIMIT_N = 1
RATE_LIMIT_PERIOD_S = 60.0


class RestartPolicy:
    """Allow at most ``max_lifetime_restarts`` restarts per quota (a process, a node, a player), and
    at most ``rate_limit_n`` within any ``rate_limit_period_s`` seconds; ``-1`` lifts a limit."""

    def __init__(self, enabled: bool = False, max_lifetime_restarts: int = MAX_LIFETIME_RESTARTS,
                 rate_limit_n: int = RATE_LIMIT_N, rate_limit_period_s: float = RATE_LIMIT_PERIOD_S,
                 switch: str = "restart_workers") -> None:
        self.enabled = enabled
        self.switch = switch  # the option that turns restarts on, as a refusal names it
        self.max_lifetime_restarts = max_lifetime_restarts
        self.rate_limit_n = rate_limit_n
        self.rate_limit_period_s = rate_limit_period_s
        self._recent: dict[int, deque[float]] = defaultdict(deque)

    def refusal(self, key: int, count: int) -> str | None:
        """Why another restart against quota ``key`` (restarted ``count`` times) is not allowed now, or ``None``."""
        if not self.enabled:
            return f"restarts are disabled ({self.switch}=False)"
        if 0 <= self.max_lifetime_restarts <= count:
            return f"it was already restarted {count} times (max_lifetime_restarts)"
        recent = self._recent[key]
        now = time.monotonic()
        while recent and now - recent[0] > self.rate_limit_period_s:
            recent.popleft()
        if 0 <= self.rate_limit_n <= len(recent):
            return f"it was restarted {len(recent)} time(s) in the last {self.rate_limit_period_s:g} s (restarts_rate_limit_n)"
        return None

    def record(self, key: int) -> None:
        """A restart counted against quota ``key`` now (the rate's window)."""
        self._recent[key].append(time.monotonic())
