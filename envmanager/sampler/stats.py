"""Sampler and learner statistics: windowed throughput, timers, windowed queue sizes, policy
lag, counters; one ``stats()`` dict and a one-line summary logged periodically."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["Stats", "WINDOWS"]

logger = logging.getLogger(__name__)

WINDOWS = (10.0, 60.0, 300.0)


class Stats:
    """Thread-safe counters, rates, timers and gauges of one component (sampler or learner)."""

    def __init__(self, name: str, log_interval: float | None = None, clock: Any = time.monotonic) -> None:
        self.name = name
        self.log_interval = log_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._last_log = self._started
        self.counters: collections.Counter[str] = collections.Counter()
        self._events: dict[str, collections.deque[tuple[float, int]]] = {}
        self._timers: dict[str, list[float]] = {}  # name -> [total s, count, last s]
        self._gauges: dict[str, collections.deque[tuple[float, float]]] = {}
        self._lags: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=100)
        self._totals: dict[str, int] = {}  # name -> a running total kept elsewhere, as last seen (``count_total``)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to a counter, and to its throughput windows."""
        now = self._clock()
        with self._lock:
            self.counters[name] += n
            events = self._events.setdefault(name, collections.deque())
            events.append((now, n))
            while events and events[0][0] < now - WINDOWS[-1]:
                events.popleft()

    def count_total(self, name: str, total: int) -> None:
        """Count what a running total kept elsewhere (the supervisor's restarts) grew by since
        the last call; the first call only notes it."""
        with self._lock:  # (the counters are thread-safe: so is what they are counted from)
            grew = total - self._totals.setdefault(name, total)
            if grew > 0:
                self._totals[name] = total
        if grew > 0:
            self.count(name, grew)

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Time the block; reported as total, mean and last milliseconds."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(name, time.perf_counter() - start)

    def add_time(self, name: str, seconds: float) -> None:
        with self._lock:
            t = self._timers.setdefault(name, [0.0, 0, 0.0])
            t[0] += seconds
            t[1] += 1
            t[2] = seconds

    def gauge(self, name: str, value: float) -> None:
        """Record a sample of a level (a queue size, say); reported as its windowed mean and max."""
        now = self._clock()
        with self._lock:
            samples = self._gauges.setdefault(name, collections.deque())
            samples.append((now, float(value)))
            while samples and samples[0][0] < now - WINDOWS[0]:
                samples.popleft()

    def lag(self, lags: np.ndarray) -> None:
        """Record the policy lag of one batch's steps (learner version minus acting version)."""
        if lags.size:
            with self._lock:
                self._lags.append((float(lags.min()), float(lags.mean()), float(lags.max())))

    def rate(self, name: str, window: float) -> float:
        """Events per second of ``name`` over the last ``window`` seconds (or since start)."""
        now = self._clock()
        with self._lock:
            total = sum(n for t, n in self._events.get(name, ()) if t >= now - window)
        return total / max(min(window, now - self._started), 1e-9)

    def stats(self) -> dict[str, Any]:
        """Everything, as one flat dict of numbers."""
        out: dict[str, Any] = {}
        with self._lock:
            names = list(self._events)
            out.update(self.counters)
            for name, (total, n, last) in self._timers.items():
                out[f"{name}_ms_total"] = total * 1e3
                out[f"{name}_ms_mean"] = total * 1e3 / n if n else 0.0
                out[f"{name}_ms_last"] = last * 1e3
            for name, samples in self._gauges.items():
                values = [v for _, v in samples]
                out[f"{name}_mean"] = float(np.mean(values)) if values else 0.0
                out[f"{name}_max"] = max(values) if values else 0.0
            if self._lags:
                lags = np.array(self._lags)
                out["policy_lag_min"] = float(lags[:, 0].min())
                out["policy_lag_mean"] = float(lags[:, 1].mean())
                out["policy_lag_max"] = float(lags[:, 2].max())
        for name in names:
            for window in WINDOWS:
                out[f"{name}_per_s_{int(window)}s"] = self.rate(name, window)
        return out

    def summary(self) -> str:
        """One line: the 10 s rates, policy lag and the non-zero counters."""
        s = self.stats()
        parts = [f"{k[: -len('_per_s_10s')]}/s={s[k]:.1f}" for k in sorted(s) if k.endswith("_per_s_10s")]
        if "policy_lag_mean" in s:
            parts.append(f"lag={s['policy_lag_min']:.0f}/{s['policy_lag_mean']:.1f}/{s['policy_lag_max']:.0f}")
        parts += [f"{k}={v}" for k, v in sorted(self.counters.items()) if v]
        return f"{self.name}: " + " ".join(parts)

    def maybe_log(self) -> None:
        """Log ``summary()`` at INFO if ``log_interval`` seconds passed since the last time."""
        if self.log_interval is None:
            return
        now = self._clock()
        if now - self._last_log >= self.log_interval:
            self._last_log = now
            logger.info("%s", self.summary())
