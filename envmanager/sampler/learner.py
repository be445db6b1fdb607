"""``LearnerFeed``: a learner in a background thread, fed by the sampler (RLlib's
``LearnerThread``, framework-agnostic).

A bounded queue gives back-pressure; after each batch the policy version is bumped and
published through ``on_update`` (how new weights reach the sampler). An exception in
``learn_fn``, in ``on_update``, or a queue empty for ``starve_timeout`` is re-raised in the
caller (``put``, ``check``, ``stop``) with its traceback: never a silently dead thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import operator
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from envmanager.core.deadline import Deadline
from envmanager.errors import EnvManagerError, InvalidInputError
from envmanager.sampler.batches import TransitionBatch
from envmanager.sampler.stats import Stats

logger = logging.getLogger(__name__)

__all__ = ["LearnerFeed", "LearnerError", "LearnerStarvedError", "feed_fragments"]


class LearnerError(EnvManagerError):
    """The learner thread failed; ``__cause__`` is the original exception."""


class LearnerStarvedError(LearnerError, TimeoutError):
    """The learner's queue stayed empty for ``starve_timeout`` seconds."""


class LearnerFeed:
    """Run ``learn_fn(batch) -> dict of metrics`` in a thread over the batches ``put`` into it.

    Args:
        learn_fn: one update on a ``TransitionBatch``; returns metrics (a dict).
        queue_size: batches waiting at most; ``put`` blocks beyond that (back-pressure).
        num_passes: how often each batch is learned from (RLlib's ``num_sgd_iter``).
        num_minibatches: pieces each pass splits the batch into.
        buffer_size: batches replayed in turn (RLlib's minibatch buffer): each update is one pass
            over one buffered batch, round robin, which leaves after ``num_passes``; unlike
            RLlib's, it never blocks on an empty queue while it still has passes to make.
        starve_timeout: seconds the queue may stay empty before that is an error (``None`` or
            ``inf``: never).
        max_policy_lag: steps acted by a policy more than this many versions old are ``stale``.
        stale: ``"drop"`` them or ``"mask"`` them (``batch.valid`` false).
        on_update: ``on_update(version, metrics)`` after each batch, in the learner thread.
        put_timeout: the longest ``put`` / ``wait_below`` wait for room.
        start_version: the version counted from (a sampler's ``policy_version``, or a
            checkpoint's), so the versions published go on from there and lags stay true.
    """

    def __init__(self, learn_fn: Callable[[TransitionBatch], dict[str, Any]], queue_size: int = 2, num_passes: int = 1,
                 num_minibatches: int = 1, starve_timeout: float | None = 60.0, max_policy_lag: int | None = None,
                 stale: str = "drop", on_update: Callable[[int, dict[str, Any]], Any] | None = None,
                 put_timeout: float = 600.0, log_interval: float | None = None, buffer_size: int = 1,
                 start_version: int = 0) -> None:
        if queue_size < 1 or num_passes < 1 or num_minibatches < 1 or buffer_size < 1:
            raise InvalidInputError("queue_size, num_passes, num_minibatches and buffer_size must be at least 1")
        if stale not in ("drop", "mask"):
            raise InvalidInputError(f"stale must be 'drop' or 'mask', got {stale!r}")
        if starve_timeout is not None and not starve_timeout > 0:
            raise InvalidInputError(f"starve_timeout must be positive seconds, or None for never, got {starve_timeout!r}")
        if not 0 < put_timeout < math.inf:
            raise InvalidInputError(f"put_timeout must be positive seconds, got {put_timeout!r}")
        if max_policy_lag is not None and max_policy_lag < 0:
            raise InvalidInputError(f"max_policy_lag must be at least 0 (or None), got {max_policy_lag!r}")
        if isinstance(start_version, bool) or not hasattr(start_version, "__index__") or start_version < 0:
            raise InvalidInputError(f"start_version must be a whole number at least 0, got {start_version!r}")
        if starve_timeout == math.inf:
            starve_timeout = None
        self.learn_fn, self.on_update = learn_fn, on_update
        self.queue_size, self.num_passes, self.num_minibatches = queue_size, num_passes, num_minibatches
        self.starve_timeout, self.max_policy_lag, self.stale = starve_timeout, max_policy_lag, stale
        self.put_timeout = put_timeout
        self.buffer_size = buffer_size
        self.version = operator.index(start_version)
        self.stats = Stats("learner", log_interval)
        self._inbox = _Inbox()
        self._queue, self._cond = self._inbox.queue, self._inbox.cond
        self._results: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._put = self._finished = 0  # batches put / learned from (or dropped)
        self._buffer: list[list[Any]] = []  # the learner thread's: [batch, passes left], replayed in turn
        self._turn = 0  # the learner thread's: the buffered batch replayed next
        self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._inbox),
                                        name="envmanager-learner", daemon=True)
        weakref.finalize(self, self._inbox.stop)  # a feed dropped without stop() stops its thread
        self._thread.start()

    # ------------------------------------------------------------------------------------------
    # The caller's side

    def put(self, batch: TransitionBatch, timeout: float | None = None) -> None:
        """Queue a batch; blocks while ``queue_size`` batches wait (at most ``timeout``)."""
        self.wait_below(self.queue_size, timeout)
        with self._cond:
            self._queue.append(batch)
            self._put += 1
            self.stats.gauge("queue_size", len(self._queue))
            self._cond.notify_all()

    def wait_below(self, n: int, timeout: float | None = None) -> None:
        """Wait until fewer than ``n`` batches are waiting (raises the learner's error)."""
        self._wait(lambda: len(self._queue) < n, "take a batch", timeout, errors_first=True)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every batch put so far was learned from (raises the learner's error)."""
        self._wait(lambda: self._finished >= self._put, "finish its batches", timeout, errors_first=False)

    def _wait(self, done: Callable[[], bool], what: str, timeout: float | None, errors_first: bool) -> None:
        """Until ``done()``; the learner's error and a stop raise first (``errors_first``: even once done, as ``put`` must)."""
        limit = self.put_timeout if timeout is None else timeout
        deadline = Deadline(limit)
        with self._cond:
            while errors_first or not done():
                self._raise_error()
                if self._inbox.stopping:
                    raise LearnerError("the learner feed is stopped")
                if done():
                    return
                if deadline.passed():
                    raise TimeoutError(f"the learner did not {what} within {limit:g} s")
                self._cond.wait(deadline.left())

    def results(self) -> list[tuple[int, dict[str, Any]]]:
        """``(steps learned from, metrics)`` of every batch learned since the last call."""
        with self._cond:
            out = list(self._results)
            self._results.clear()
        return out

    def check(self) -> None:
        """Raise the learner thread's error, if it had one."""
        with self._cond:
            self._raise_error()

    def qsize(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self, timeout: float = 10.0, raise_error: bool = True) -> None:
        """Stop the thread and wait for it at most ``timeout`` (a ``learn_fn`` that hangs is left
        behind, logged); batches still queued are counted as unlearned. Then raise its error."""
        self._inbox.stop()
        self._thread.join(timeout)
        with self._cond:  # (the thread takes no batch once stopping)
            left = list(self._queue)
            self._queue.clear()
        if left:
            self.stats.count("unlearned_batches", len(left))
            self.stats.count("unlearned_steps", sum(len(b) for b in left))
        if self._thread.is_alive():
            logger.warning("learner thread still inside learn_fn after %.1f s; left behind (daemon)", timeout)
        if raise_error:
            self.check()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> LearnerFeed:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.stop(raise_error=exc_type is None)

    def _raise_error(self) -> None:
        error = self._inbox.error
        if error is None:
            return
        if isinstance(error, LearnerError):
            raise error
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        raise LearnerError(f"learner thread failed: {error!r}\n{trace}") from error

    # ------------------------------------------------------------------------------------------
    # The learner thread's side (``_serve`` drives these)

    def _wants_batch(self) -> bool:
        """Whether to take a batch next (rather than replay a buffered one)."""
        if self.buffer_size == 1:
            return True
        with self._cond:
            waiting = bool(self._queue)
        return len(self._buffer) < self.buffer_size and (waiting or not self._buffer)

    def _learn(self, batch: TransitionBatch) -> None:
        """Learn from a batch just taken (``num_passes`` passes, one new version), or buffer it."""
        admitted = self._admit(batch)
        if admitted is not None and self.buffer_size > 1:
            self._buffer.append([admitted, self.num_passes])
            return
        if admitted is not None:
            self._update(admitted, self.num_passes)
        self._finish()

    def _replay(self) -> None:
        """RLlib's minibatch buffer: one pass, one new version, over the next buffered batch in turn."""
        self._turn %= len(self._buffer)
        entry = self._buffer[self._turn]
        self._update(entry[0], 1)
        entry[1] -= 1
        if entry[1] == 0:
            self._buffer.pop(self._turn)
            self._finish()
        else:
            self._turn += 1

    def _finish(self) -> None:
        with self._cond:
            self._finished += 1
            self._cond.notify_all()

    def _admit(self, batch: TransitionBatch) -> TransitionBatch | None:
        """Record the batch's policy lag; drop or mask its stale steps (``None``: nothing left)."""
        lag = self.version - batch.policy_versions
        self.stats.lag(lag)
        if self.max_policy_lag is not None:
            stale = lag > self.max_policy_lag
            n_stale = int(stale.sum())
            if n_stale:
                self.stats.count("stale_steps", n_stale)
                if self.stale == "drop":
                    batch = batch.select(~stale)
                else:  # (a copy: the caller's batch, which a stream yielded, stays as it was)
                    batch = dataclasses.replace(batch, valid=batch.valid & ~stale)
        if len(batch) == 0:
            self.stats.count("dropped_batches")
            return None
        return batch

    def _update(self, batch: TransitionBatch, passes: int) -> None:
        """``passes`` passes over ``batch`` (in minibatches), then a new version, published."""
        metrics: dict[str, Any] = {}
        with self.stats.timer("learn"):
            for _ in range(passes):
                for minibatch in batch.split(self.num_minibatches) if self.num_minibatches > 1 else [batch]:
                    metrics = self.learn_fn(minibatch) or {}
        learned = int(batch.valid.sum())  # (not the steps masked as stale)
        self.stats.count("steps_learned", learned)
        self.stats.count("updates")
        with self._cond:
            self.version += 1
            self._results.append((learned, metrics))
        if self.on_update is not None:
            self.on_update(self.version, metrics)
        self.stats.maybe_log()


class _Inbox:
    """What the caller and the learner thread share. The thread waits here without holding its
    feed, so that a feed dropped without ``stop()`` is freed, and its finalizer stops the thread."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: collections.deque[TransitionBatch] = collections.deque()
        self.stopping = False
        self.error: BaseException | None = None

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def take(self, starve_timeout: float | None, stats: Stats) -> TransitionBatch | None:
        """The next batch (``None``: told to stop); raises after ``starve_timeout`` s of none."""
        with stats.timer("dequeue"), self.cond:
            deadline = None if starve_timeout is None else Deadline(starve_timeout)
            while not self.queue and not self.stopping:  # (told to stop, or a batch: notified)
                if deadline is not None and deadline.passed():
                    raise LearnerStarvedError(f"the learner's queue stayed empty for {starve_timeout:g} s")
                self.cond.wait(None if deadline is None else deadline.left())
            if self.stopping:
                return None
            batch = self.queue.popleft()
            stats.gauge("queue_size", len(self.queue))
            self.cond.notify_all()
            return batch


def _serve(feed_ref: weakref.ReferenceType[LearnerFeed], inbox: _Inbox) -> None:
    """The learner thread, holding the feed only while it learns. Its error is the inbox's, kept
    without the frames' variables (the feed among them: a feed that failed is freed too)."""
    try:
        while _serve_once(feed_ref, inbox):
            pass
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # (their file and line stay, for the message)
        with inbox.cond:
            inbox.error = exc
            inbox.cond.notify_all()
        logger.error("learner thread failed: %r", exc)


def _serve_once(feed_ref: weakref.ReferenceType[LearnerFeed], inbox: _Inbox) -> bool:
    """One batch taken and learned from, or one buffered batch replayed; ``False``: stop."""
    feed = feed_ref()
    if feed is None:
        return False
    if not feed._wants_batch():
        if inbox.stopping:
            return False
        feed._replay()
        return True
    starve_timeout, stats = feed.starve_timeout, feed.stats
    del feed  # (waits without it)
    batch = inbox.take(starve_timeout, stats)
    feed = feed_ref()
    if batch is None or feed is None:
        return False
    feed._learn(batch)
    return True


def feed_fragments(obtain: Callable[[], TransitionBatch], stats: Stats, feed: LearnerFeed | None,
                   max_batches_waiting: int, max_fragments: int | None) -> Iterator[TransitionBatch]:
    """Every sampler's ``stream``: wait while ``feed`` has ``max_batches_waiting`` batches waiting
    (back-pressure: policy lag stays bounded), then ``obtain`` a fragment, put it there, yield it."""
    if max_batches_waiting < 1:
        raise InvalidInputError(f"max_batches_waiting must be at least 1, got {max_batches_waiting!r}")
    if max_fragments is not None and (not isinstance(max_fragments, int) or max_fragments < 1):
        raise InvalidInputError(f"max_fragments must be an int at least 1 (or None: no end), got {max_fragments!r}")
    for _ in itertools.count() if max_fragments is None else range(max_fragments):
        if feed is not None:
            stats.gauge("learner_queue", feed.qsize())
            with stats.timer("back_pressure"):
                feed.wait_below(max_batches_waiting)
        batch = obtain()
        if feed is not None:
            feed.put(batch)
        yield batch
