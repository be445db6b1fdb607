"""The Ray driver's record of every global slot: what a restarted node resumes from.

Per global slot: the episodes it started (``k``-th: id ``k * n + slot``), whether its first
seed was used, the episode running in rows handed out or buffered, and the generation of the
node it runs on. Rows, cut ids and each node's per-slot count of episodes started move them, so
a node started again never reuses an id or replays a seeded episode; an answer of another
generation (a replaced node's) is refused whole. See ``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envmanager.sampler.batches import TransitionBatch

__all__ = ["SlotRecord", "SlotRecords"]


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """One global slot as the driver knows it (read-only; see the module doc)."""

    slot: int
    seed: int | None = None  # the first reset's seed, until an episode of the slot is known to have started
    started: int = 0  # episodes the slot is known to have started: the next id is ``started * n + slot``
    running: int = -1  # the episode still running in rows handed out or buffered (-1: none)
    generation: int = 0  # of the node the slot runs on: only its answers are booked

    def _set(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def saw_started(self, count: int) -> None:
        """The slot started at least ``count`` episodes (its first one used the seed)."""
        if count > self.started:
            self._set(started=count, seed=None)

    def runs(self, episode: int) -> None:
        """``episode`` runs on in rows handed out or buffered (-1: none)."""
        self._set(running=episode)

    def cut(self, episode: int, started: int) -> None:
        """``episode`` (the slot's ``started``-th) was cut: started, no longer running."""
        self.saw_started(started)
        if self.running == episode:
            self._set(running=-1)

    def let_go(self) -> bool:
        """The running episode never continues in a fragment: whether there was one."""
        was_running = self.running >= 0
        self._set(running=-1)
        return was_running

    def resumed(self, generation: int) -> tuple[int | None, int]:
        """The slot now runs on a node of ``generation``: its seed and episodes started."""
        self._set(generation=generation)
        return self.seed, self.started


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

    def booked(self, batch: TransitionBatch, started: Sequence[int] | None = None, offset: int = 0,
               runs_on: bool = True, generation: int | None = None) -> bool:
        """An answer's rows, and its slots' counts of episodes started (``started[i]``: global
        slot ``offset + i``). With ``runs_on`` (a fragment), each slot's last row's episode runs
        on unless it ended there. An answer of another node ``generation`` is refused whole: ``False``."""
        with_rows = np.unique(batch.worker_ids).tolist()
        slots = set(with_rows)
        if started is not None:
            slots |= set(range(offset, offset + len(started)))
        if generation is not None and any(self.slots[s].generation != generation for s in slots):
            return False  # (an answer that does not say is booked as before)
        if started is not None:
            for i, count in enumerate(started):
                self.slots[offset + i].saw_started(int(count))
        ends = batch.dones
        for slot in with_rows:
            rows = np.flatnonzero(batch.worker_ids == slot)
            record = self.slots[slot]
            record.saw_started(int(batch.episode_ids[rows].max()) // self.n + 1)
            if runs_on:
                record.runs(-1 if ends[rows[-1]] else int(batch.episode_ids[rows[-1]]))
        return True

    def cut(self, episodes: Iterable[int]) -> list[int]:
        """``episodes`` were cut: listed, known to have started (one cut before its first row
        too), no longer running. Returns them."""
        out = list(episodes)
        self.cut_episodes += out
        for episode in out:
            self.slots[episode % self.n].cut(episode, episode // self.n + 1)
        return out

    def let_go(self, slots: Iterable[int]) -> int:
        """The running episodes of ``slots`` never continue in a fragment (an episode request
        ran them out unrecorded, or their node failed): how many there were."""
        return sum(self.slots[slot].let_go() for slot in slots)

    def resume(self, slots: Iterable[int], generation: int = 0) -> tuple[list[int | None], list[int]]:
        """Per slot: its seed only if no episode of it is known to have started, and the episodes
        started so far (ids go on). Only answers of ``generation`` are booked from now on."""
        resumed = [self.slots[s].resumed(generation) for s in slots]
        return [seed for seed, _ in resumed], [started for _, started in resumed]
