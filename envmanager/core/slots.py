"""The state of every env slot, and the parent's half of the STEP and RESET answers.

One status per slot (``worker_id`` is a slot; its transitions: docs/architecture.md, State).
What arrived and was not handed out yet waits here: slots (steps in arrival order, resets as a
set), their non-empty infos, which were interrupted by a restart, and the errors to raise; and
each slot's generation as its latest answer's stamp says (``generations``).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from envmanager.core.completion import refused_error, worker_error
from envmanager.core.results import InfoBlock, StepBatch
from envmanager.errors import EnvManagerError
from envmanager.wire import returns, shm
from envmanager.wire.info_columns import as_dicts
from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.wire.messages import Stepped

if TYPE_CHECKING:
    from envmanager.core.completion import Completion
    from envmanager.wire.mailbox import Mailboxes

__all__ = ["SlotStatus", "SlotState", "NEEDS_RESET", "IDLE", "IN_FLIGHT", "ARRIVED", "IDLE_BYTES"]


class SlotStatus(enum.IntEnum):
    NEEDS_RESET = 0  # never reset, or its env failed
    IDLE = 1  # its last result was handed out: it may be stepped
    IN_FLIGHT = 2  # a step or reset was sent, no answer yet
    ARRIVED = 3  # answered, not handed out yet


# Plain ints for numpy (an IntEnum member costs attribute look-ups in every array operation).
NEEDS_RESET, IDLE, IN_FLIGHT, ARRIVED = (int(s) for s in SlotStatus)
#: ``status`` bytes of that many IDLE slots: a batch's statuses are checked with one compare.
IDLE_BYTES = bytes([IDLE]) * 4096
_NONE: frozenset[int] = frozenset()


def _rows(slots: tuple[int, ...]) -> slice | list[int]:
    """Where a request's slots (ascending) are in a per-slot array: a slice (numpy's cheapest
    index) when contiguous, as a lane's are."""
    first, last = slots[0], slots[-1]
    return slice(first, last + 1) if last - first + 1 == len(slots) else list(slots)


class SlotState:
    """Per-slot status and everything that arrived but was not handed out yet."""

    def __init__(self, n_env: int) -> None:
        self.status = np.zeros(n_env, dtype=np.uint8)
        #: Each slot's generation as its latest answer filed carried it (``StepBatch.generations``).
        self.generations = np.zeros(n_env, dtype=np.int64)
        self.generation_list = [0] * n_env  # the same, for per-slot Python (StepInfo): no numpy scalar per answer
        self.arrived: list[int] = []  # slots answered by a step, in arrival order
        self.arrived_resets: set[int] = set()
        #: Slots sent a reset whose answer is not taken yet, with their seeds and options (each send sets them).
        self.owed_resets: dict[int, tuple[Any, Any]] = {}
        self.infos: dict[int, dict] = {}
        # Infos that came as columns: blocks by id (their slots, the columns), each slot's block.
        self.info_blocks: dict[int, tuple[np.ndarray, Any]] = {}
        self.block_of = np.full(n_env, -1, dtype=np.int64)
        self._blocks = 0
        self.interrupted: set[int] = set()
        self.step_errors: list[EnvManagerError] = []
        self.reset_errors: list[EnvManagerError] = []
        #: Per slot, of its latest answer: seconds in the env, and when the request was sent,
        #: the answer posted and taken (``time.monotonic``), for ``timings``; for an answer of
        #: the step board (``on_board``) the first three are the board's (``board.timings``).
        self.env_time = np.zeros(n_env)
        self.sent_at = np.zeros(n_env)
        self.posted_at = np.zeros(n_env)
        self.received_at = np.zeros(n_env)
        self.on_board = np.zeros(n_env, dtype=np.bool_)
        #: The step board, if steps go on it: the infos of its answers are read from it when handed
        #: out (they stay there until their slots are sent again, as their results do).
        self.board: Mailboxes | None = None
        self.results: shm.SharedBuffers | None = None
        self.observation_list: list[Any] | None = None

    def attach(self, results: shm.SharedBuffers, observation_list: list[Any] | None, board: Mailboxes | None) -> None:
        """Where results that travel pickled are written (the parent's copy), and the step board."""
        self.results, self.observation_list = results, observation_list
        self.board = board

    def sent(self, slots: np.ndarray, reset: bool = False, asked: dict[int, tuple[Any, Any]] | None = None) -> None:
        """Steps (``reset``: resets, then owed, ``asked``: with these seeds and options) of
        ``slots`` were sent: IN_FLIGHT."""
        self.status[slots] = IN_FLIGHT
        if reset:
            asked = asked or {}
            self.owed_resets.update({s: asked.get(s, (None, None)) for s in slots.tolist()})

    def allow_steps(self, slots: list[int]) -> None:
        """``slots`` never reset (and not being reset) may be stepped: IDLE."""
        self.status[[s for s in slots if self.status[s] == NEEDS_RESET and s not in self.owed_resets]] = IDLE

    # ------------------------------------------------------------------------------------------
    # Filing answers

    def file(self, c: Completion) -> None:
        """File one completed STEP or RESET (or a restart's interrupted answer), or its error."""
        request = c.request
        is_reset = request is not None and request.cmd is Cmd.RESET
        if c.error is not None:
            cut = list(request.slots if request is not None and request.slots else c.worker.env_ids)
            if request is not None and request.cmd is Cmd.REBUILD:  # an env that raised in a reset: its reset failed
                is_reset = cut[0] in self.owed_resets
            self._fail(cut, [c.error], is_reset)
            return
        answer: Stepped = c.answer
        slots = c.slots  # a tuple, ascending (a request's slots)
        stamp = answer.generations
        if stamp is not None:
            known = self.generation_list
            if any(known[s] != g for s, g in zip(slots, stamp, strict=True)):  # rare: a restart's or rebuild's answer
                self.stamp(slots, stamp)
        if slots and len(answer.env_times) == len(slots):  # (a restart's reset answers every slot of its process)
            rows = _rows(slots)
            self.env_time[rows], self.posted_at[rows], self.received_at[rows] = answer.env_times, c.posted_at, c.received_at
            self.sent_at[rows], self.on_board[rows] = c.sent_at, False
        if answer.info_columns is not None:
            self._file_columns(answer.info_columns, slots)
        elif answer.infos or answer.failures or answer.observations is not None or answer.scalars is not None:
            failed = self._file_extras(answer, slots, "reset" if is_reset else "step")
            if answer.failures:
                failed.update({slots[n]: worker_error(f, c.worker.index) for n, f in answer.failures.items()})
            if failed:
                self._fail(list(failed), list(failed.values()), is_reset)
                slots = tuple(s for s in slots if s not in failed)
        if c.interrupted:  # a restart reset every env: those owed a reset come back as resets, the rest as steps
            self._file_interrupted(list(slots))
        elif slots:
            self.status[_rows(slots)] = ARRIVED
            if is_reset:
                self.arrived_resets.update(slots)
            else:
                self.arrived.extend(slots)

    def stamp(self, slots: tuple[int, ...], generations: tuple[int, ...]) -> None:
        """``slots`` are of ``generations`` (the worker's stamp on their answer)."""
        for slot, generation in zip(slots, generations, strict=True):
            self.generations[slot] = self.generation_list[slot] = generation

    def file_steps(self, slots: np.ndarray) -> None:
        """File the step board's answers of ``slots`` (results, infos and timings all in shared
        memory): a few numpy operations for the whole batch, whatever the number of processes."""
        self.status[slots] = ARRIVED
        self.arrived.extend(slots.tolist())
        self.on_board[slots] = True
        self.received_at[slots] = time.monotonic()

    def _file_interrupted(self, slots: list[int]) -> None:
        """A restart's fresh reset, for every slot of the process: each comes back once,
        ``interrupted`` — also a slot whose answer arrived but was not handed out (the other
        half of a double-buffered process): its result was overwritten by the reset."""
        owed, status = self.owed_resets, self.status
        waiting = {s for s in slots if status[s] == ARRIVED}  # already listed to be handed out
        status[slots] = ARRIVED
        self.interrupted.update(slots)
        self.arrived_resets.update(s for s in slots if s in owed)
        self.arrived.extend(s for s in slots if s not in owed and s not in waiting)

    def void(self, slots: tuple[int, ...]) -> tuple[list[int], list[tuple[int, Any, Any]]]:
        """A restart's fresh reset overwrites the rows of ``slots`` (its process's): what arrived
        for them and was not handed out is in flight again, to be answered by the reset. Returns
        the voided steps' slots and resets' ``(slot, seed, options)``, to join the restart."""
        status = self.status
        hit = [s for s in slots if status[s] == ARRIVED]
        if not hit:
            return [], []
        gone = set(hit)
        status[hit] = IN_FLIGHT
        self.arrived = [s for s in self.arrived if s not in gone]
        self.arrived_resets -= gone
        self._forget_infos(hit)
        owed = self.owed_resets
        return [s for s in hit if s not in owed], [(s, *owed[s]) for s in hit if s in owed]

    def _forget_infos(self, slots: list[int] | tuple[int, ...]) -> None:
        """Drop the infos of ``slots`` not handed out yet (a newer answer or a restart's reset replaces them)."""
        if self.infos:
            for slot in slots:
                self.infos.pop(slot, None)
        if self.info_blocks:
            blocks = set(self.block_of[list(slots)].tolist()) - {-1}
            self.block_of[list(slots)] = -1
            for block in blocks:  # one no slot refers to any more
                if not (self.block_of[self.info_blocks[block][0]] == block).any():
                    del self.info_blocks[block]

    def _fail(self, slots: list[int], errors: list[EnvManagerError], is_reset: bool) -> None:
        self.status[slots] = NEEDS_RESET
        target = self.reset_errors if is_reset else self.step_errors
        if is_reset:
            for slot in slots:
                self.owed_resets.pop(slot, None)
        for error in errors:  # one failure cutting two requests short is raised once
            if not any(error is e for e in target):
                target.append(error)

    def _file_columns(self, columns: Any, slots: tuple[int, ...] | np.ndarray) -> None:
        """Infos as columns: kept as one block for the answer's slots (ascending), no per-env Python."""
        self._blocks = block = self._blocks + 1
        rows = np.asarray(slots, dtype=np.int64)
        self.info_blocks[block] = (rows, columns)
        self.block_of[rows] = block
        if self.infos:  # a dict not handed out yet is replaced
            for slot in slots:
                self.infos.pop(slot, None)

    def _file_extras(self, answer: Stepped, slots: tuple[int, ...], call: str) -> dict[int, EnvManagerError]:
        """Infos, and results that travelled pickled: the slow path, per env (as gymnasium batches
        them: ``envmanager.wire.returns``). Returns the slots whose results did not fit, with
        their errors (naming the env, the ``call`` and the value)."""
        self._forget_infos(slots)  # (an empty info too replaces an older one)
        if answer.infos:  # by slot
            self.infos.update(answer.infos)
        failures = answer.failures or {}
        r = self.results
        assert r is not None
        bad: dict[int, EnvManagerError] = {}
        if answer.scalars is not None:
            for n, values in enumerate(answer.scalars):
                if n not in failures:
                    try:
                        r.scalars.put(slots[n], *values, call=call) if values is not None else r.scalars.clear(slots[n])
                    except Exception as exc:
                        bad[slots[n]] = refused_error(slots[n], exc)
        if answer.observations is not None:
            for n, obs in enumerate(answer.observations):
                if n in failures or slots[n] in bad:
                    continue
                if self.observation_list is not None:
                    self.observation_list[slots[n]] = obs
                    continue
                try:
                    returns.write_stacked(r.observation, slots[n], obs)
                except Exception as exc:
                    bad[slots[n]] = refused_error(slots[n], returns.refusal(exc, slots[n], call, "observation", obs))
        return bad

    # ------------------------------------------------------------------------------------------
    # Handing out

    def first_error(self, reset: bool = False) -> EnvManagerError:
        """The first failed step (``reset``: reset) not raised yet, taken off; the rest wait."""
        return (self.reset_errors if reset else self.step_errors).pop(0)

    def hand_out(self, columns: bool = False, resets: set[int] | None = None) -> StepBatch:
        """Hand out the steps that arrived (in arrival order), or with ``resets`` those resets
        (sorted; no longer owed): a batch with what only they carry; infos that came as columns
        stay columns with ``columns=True``, else become dicts."""
        if resets is None:
            slots_list, self.arrived = self.arrived, []
        else:
            for slot in resets:
                self.owed_resets.pop(slot, None)
            self.arrived_resets -= resets
            slots_list = sorted(resets)
        reset = resets is not None
        slots = np.array(slots_list, dtype=np.int64)
        self.status[slots] = IDLE
        infos, interrupted = self.infos, self.interrupted
        mine = {s: infos.pop(s) for s in slots_list if s in infos} if infos else {}
        blocks = self._hand_out_columns(slots, mine, columns) if self.info_blocks else ()
        if self.board is not None and self.board.infos_seen and not reset:
            on_board = slots[self.on_board[slots]]
            if on_board.size:
                blocks += self._hand_out_board(on_board, mine, columns)
        cut = frozenset(s for s in slots_list if s in interrupted) if interrupted else _NONE
        if cut:
            interrupted -= cut
        # (a NamedTuple made without its constructor's overhead: once per batch)
        return tuple.__new__(StepBatch, (slots, mine, cut, frozenset(slots_list) if reset else _NONE, blocks, self.generations))

    def _hand_out_columns(self, slots: np.ndarray, dicts: dict[int, dict], columns: bool) -> tuple[InfoBlock, ...]:
        """The column infos of ``slots``: as blocks (``columns``), or into ``dicts``."""
        ids = self.block_of[slots]
        used = sorted(set(ids.tolist()) - {-1})  # (a set: numpy's unique sorts, several µs)
        if not used:
            return ()
        self.block_of[slots] = -1
        out = []
        for block in used:
            rows, info = self.info_blocks[block]  # rows ascending (a request's slots are)
            mine = slots[ids == block] if len(used) > 1 or len(ids) != len(rows) else slots
            whole = len(mine) == len(rows)  # the usual case: the whole answer handed out at once
            positions = None if whole else np.searchsorted(rows, mine)
            if whole or not (self.block_of[rows] == block).any():  # nothing of it left to hand out
                del self.info_blocks[block]
            if columns:
                arrays = info.arrays()
                out.append(InfoBlock(rows if whole else mine, info.keys,
                                     arrays if whole else [a[positions] for a in arrays],
                                     tuple(d.startswith("py:") for d in info.dtypes)))
            else:
                dicts.update(zip(rows.tolist() if whole else mine.tolist(),
                                 info.dicts(None if positions is None else positions.tolist()), strict=True))
        return tuple(out)

    def _hand_out_board(self, slots: np.ndarray, dicts: dict[int, dict], columns: bool) -> tuple[InfoBlock, ...]:
        """The infos of the step board's answers of ``slots``: as blocks (``columns``), or into ``dicts``."""
        assert self.board is not None
        out = []
        for rows, keys, arrays, python in self.board.infos(slots):
            block = InfoBlock(rows, keys, arrays, python)
            if columns:
                out.append(block)
            else:
                lists = [a.tolist() if py else list(a) for a, py in zip(arrays, python, strict=True)]
                dicts.update(zip(rows.tolist(), as_dicts(keys, lists, len(rows)), strict=True))
        return tuple(out)

    def timings(self, slot: int) -> tuple[float, float, float]:
        """``(env, queued, round_trip)`` seconds of the slot's latest answer."""
        received = float(self.received_at[slot])
        if not received:
            return 0.0, 0.0, 0.0
        if self.on_board[slot] and self.board is not None:
            env, posted, sent = self.board.timings(slot)
        else:
            env, posted, sent = float(self.env_time[slot]), float(self.posted_at[slot]), float(self.sent_at[slot])
        return env, max(0.0, received - posted), max(0.0, received - sent)

    def drop(self) -> list[EnvManagerError]:
        """Forget everything not handed out (``drain``): those slots count as handed out.
        Returns the errors that were waiting to be raised."""
        dropped = self.step_errors + self.reset_errors
        self.status[self.status == ARRIVED] = IDLE
        self.arrived.clear()
        self.arrived_resets.clear()
        self.owed_resets.clear()
        self.infos.clear()
        self.info_blocks.clear()
        self.block_of[:] = -1
        self.interrupted.clear()
        self.step_errors.clear()
        self.reset_errors.clear()
        return dropped
