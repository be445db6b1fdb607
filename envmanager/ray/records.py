"""The Ray driver's record of every global slot: what a restarted node resumes from.

A node's ``Sampler`` keeps the episode records of its slots (``envmanager.sampler.slots``); the
driver keeps one record per global slot of what reached it from there: the episodes the slot
started (``k``-th episode: id ``k * n + slot``), whether its first seed was used, and the
episode still running in rows handed out or buffered. Everything a node reports moves a record:
rows, the ids its sampler cut (an episode cut before its first row has no row, and its id must
not be given again), and each slot's count of episodes started (those that neither wrote a row
nor were cut too). So a node started again in place of a lost one never reuses an id or
replays a seeded episode. Each record holds the generation of the node it resumed (how often
the driver's supervisor restarted that node): an answer carries its node's generation, and one
of another generation (a replaced node's) is refused whole, rows and counts, as the local
samplers' records refuse an answer of another process generation. The records are changed only
through :class:`SlotRecords`' methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from envmanager.sampler.batches import TransitionBatch

__all__ = ["SlotRecord", "SlotRecords"]

_set = object.__setattr__  # the records' one writer is SlotRecords


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """One global slot as the driver knows it (read-only; see the module doc)."""

    slot: int
    seed: int | None = None  # the first reset's seed, until an episode of the slot is known to have started
    started: int = 0  # episodes the slot is known to have started: the next id is ``started * n + slot``
    running: int = -1  # the episode still running in rows handed out or buffered (-1: none)
    generation: int = 0  # of the node the slot runs on: only its answers are booked


class SlotRecords:
    """The driver's records of ``len(seeds)`` global slots and the episodes cut so far."""

    def __init__(self, seeds: Sequence[int | None]) -> None:
        self.n = len(seeds)
        self.slots = [SlotRecord(s, seed) for s, seed in enumerate(seeds)]
        #: Global ids of the episodes cut (inside a node, or with it), in the order seen.
        self.cut_episodes: list[int] = []

    def __getitem__(self, slot: int) -> SlotRecord:
        return self.slots[slot]

    def running(self) -> set[int]:
        return {r.running for r in self.slots if r.running >= 0}

    # ------------------------------------------------------------------------------------------
    # What nodes report

    def _started(self, slot: int, count: int) -> None:
        """Slot ``slot`` started at least ``count`` episodes (its first one used the seed)."""
        record = self.slots[slot]
        if count > record.started:
            _set(record, "started", count)
            _set(record, "seed", None)

    def booked(self, batch: TransitionBatch, started: Sequence[int] | None = None, offset: int = 0,
               runs_on: bool = True, generation: int | None = None) -> bool:
        """An answer's rows, and (if the node sent them) its slots' counts of episodes started,
        ``started[i]`` for global slot ``offset + i``. With ``runs_on`` (a fragment), each slot's
        last row's episode runs on unless it ended there; whole episodes do not. An answer of
        another node ``generation`` than its slots' records is refused: nothing of it is booked,
        and ``False`` says so (the caller drops it, counted)."""
        slots = set(np.unique(batch.worker_ids).tolist())
        if started is not None:
            slots |= set(range(offset, offset + len(started)))
        if generation is not None and any(self.slots[s].generation != generation for s in slots):
            return False  # (an answer that does not say is booked as before)
        if started is not None:
            for i, count in enumerate(started):
                self._started(offset + i, int(count))
        if not len(batch):
            return True
        ends = batch.dones
        for slot in np.unique(batch.worker_ids).tolist():
            rows = np.flatnonzero(batch.worker_ids == slot)
            self._started(slot, int(batch.episode_ids[rows].max()) // self.n + 1)
            if runs_on:
                last = rows[-1]
                _set(self.slots[slot], "running", -1 if ends[last] else int(batch.episode_ids[last]))
        return True

    def cut(self, episodes: Iterable[int]) -> list[int]:
        """``episodes`` were cut (inside a node, or with it): listed, known to have started (an
        episode cut before its first row too), no longer running. Returns them."""
        out = []
        for episode in episodes:
            slot = episode % self.n
            self.cut_episodes.append(episode)
            self._started(slot, episode // self.n + 1)
            if self.slots[slot].running == episode:
                _set(self.slots[slot], "running", -1)
            out.append(episode)
        return out

    def let_go(self, slots: Iterable[int]) -> int:
        """The running episodes of ``slots`` never continue in a fragment (an episode request
        made them run out unrecorded, or their node failed): how many there were."""
        count = 0
        for slot in slots:
            record = self.slots[slot]
            if record.running >= 0:
                _set(record, "running", -1)
                count += 1
        return count

    # ------------------------------------------------------------------------------------------
    # What a (re)started node is built with

    def resume(self, slots: Iterable[int], generation: int = 0) -> tuple[list[int | None], list[int]]:
        """Per slot: its seed only if no episode of it is known to have started (a restarted node
        must not replay a seeded episode), and the episodes started so far (ids go on). The
        slots now run on a node of ``generation``: only its answers are booked from now on."""
        records = [self.slots[s] for s in slots]
        for record in records:
            _set(record, "generation", generation)
        return [r.seed for r in records], [r.started for r in records]
