"""``WorkerPool``: the worker processes, their requests and answers, failures and restarts.

The transport half of the manager (tianshou's split): it knows nothing of actions or episodes,
it sends requests and turns what comes back through the answer transport
(``envmanager.wire.transport``), a process's death or a missed deadline into
:class:`Completion`\\ s. Every fault goes to the pool's
:class:`~envmanager.core.supervisor.Supervisor`; the pool carries out its decision (restart with
a boot plan, rebuild in place, give up): see "One fault path, every pool" in docs/architecture.md.

Why one module: the transport and the failure path share the processes and what is in
flight on them: any answer may be a failure, a boot's next step or a rebuild's end (split off,
each reached into the other's fields and methods).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as wait_for_ready
from threading import get_ident
from time import monotonic
from typing import Any

import numpy as np

from envmanager.core.completion import Completion, worker_error
from envmanager.core.cores import CoreUse, affinity, machine_cores, own_cores
from envmanager.core.deadline import Deadline
from envmanager.core.platforms import default_start_method, transport_name
from envmanager.core.process import Boot, ProcessState, WorkerProcess
from envmanager.core.rebuild import delivered, rebuild_request
from envmanager.core.restart import RestartPolicy
from envmanager.core.supervisor import Decision, Fault, GiveUp, Rebuild, Restart, Supervisor
from envmanager.errors import (
    ConcurrentCallError,
    EnvManagerError,
    InvalidInputError,
    ManagerClosedError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
    thread_name,
)
from envmanager.wire.mailbox import WAKE, Mailboxes
from envmanager.wire.marks import CallMarks
from envmanager.wire.messages import (
    BOARD_SEQ,
    ON_PIPE,
    RAW,
    REQUEST_HEADER,
    Attach,
    Call,
    EnvironmentRequest,
    Reset,
    Stepped,
    decode_answer,
    decode_steps_rest,
    encode_request,
    open_steps_answer,
)
from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.wire.shm import SharedBuffers, SharedFile
from envmanager.wire.step_queue import write_frame
from envmanager.wire.transport import PortableAnswers, StepQueue, make_transport
from envmanager.worker.main import WorkerSpec

logger = logging.getLogger(__name__)
_RAW_STEP = REQUEST_HEADER.pack
#: Seconds between two looks at where the processes may run (``_check_cores``).
CORE_CHECK_S = 0.5
#: Cores' worth of other programs' CPU tolerated on our spare cores (half that to give spinning back: no flapping).
OTHERS_TOLERATED = 0.5
_RESETS = (Cmd.RESET, Cmd.REBUILD)  # requests that carry a seed and options per env
_ANSWERED_BY_RESET = (Cmd.STEP, Cmd.RESET, Cmd.REBUILD)  # by a restart's fresh reset, ``interrupted``

__all__ = ["WorkerPool", "make_specs", "get_context"]


class WorkerPool:
    """Worker processes hosting ``specs``' envs, and everything to talk to them (see the module doc)."""

    def __init__(
        self, specs: list[WorkerSpec], ctx: Any, timeout: float, restart_policy: RestartPolicy, daemon: bool = True,
        shared_memory: bool = False, mailbox: bool = False, parent_spin_s: float = 0.0, generations: list[int] | None = None,
    ) -> None:
        self.ctx = ctx
        self.supervisor = Supervisor(restart_policy, timeout, [spec.env_ids for spec in specs], "process",
                                     generations=generations)
        self.daemon = daemon
        self.processes: list[WorkerProcess] = []
        self.buffers: SharedBuffers | None = None
        #: ``(method name, args, kwargs)`` called on a restarted process's envs before its reset.
        self.replay_calls: list[tuple[str, tuple, dict]] = []
        self._seq = 0
        self._version = 0  # bumped whenever the set of watched processes may change
        self._poll_version = -1
        self._by_sentinel: dict[int, WorkerProcess] = {}
        self._next_deadline_check = 0.0
        self._next_core_check = 0.0
        self._core_use = CoreUse()
        self._crowded = False  # other programs kept too many of our cores busy at the last look
        self._owner = os.getpid()  # a process forked from this one (os.fork) must not end our workers
        _POOLS.add(self)
        self._closing = False
        self._unreaped: list[WorkerProcess] = []  # a close's workers, until every one is reaped
        #: ``{0: thread id}`` of the one thread inside ``wait``, claimed with ``setdefault``: another's wait is refused.
        self._waiting: dict[int, int] = {}
        self._close_lock = threading.RLock()  # one close() at a time
        #: Answers taken so far (restarts' interrupted ones too): the bench divides the parent's CPU time by it.
        self.answers = 0
        #: Optional ``progress(slots) -> int``: see ``BatchEnvManager.watch_progress``.
        self.progress: Callable[[list[int]], int] | None = None
        #: Shared memory with no name, each worker given it as it starts (``None``: none, or named segments instead).
        self.file: SharedFile | None = SharedFile.create() if shared_memory else None
        if shared_memory and self.file is None and os.name == "posix":
            # One resource tracker for parent and workers: it unlinks the named segment should the parent be killed.
            resource_tracker.ensure_running()
        self.transport = transport_name()  # (``ENVMANAGER_TRANSPORT`` may choose it)
        self.queue: StepQueue | PortableAnswers | None = make_transport(self.transport, ctx)
        #: Where asked for on the step queue: steps whose actions are in shared memory go on their step board.
        self.mailboxes = (Mailboxes.create(len(specs), [spec.env_ids for spec in specs])
                          if mailbox and isinstance(self.queue, StepQueue) else None)
        self._steps_answered: list[np.ndarray] = []  # the board's answered slots, until ``take_steps``
        if isinstance(self.queue, StepQueue):
            self.queue.mailboxes = self.mailboxes
            self.queue.set_spin(parent_spin_s)  # (a mailbox makes it spin at least its margin)
        #: Which env of each process is in which call: its hang or death names the env.
        self.marks = CallMarks.create(len(specs))
        self._atexit: Callable[[], None] | None = _close_at_exit(self)
        try:
            for spec in specs:
                self.processes.append(self._start(replace(spec, generations=self.supervisor.generations(spec.index))))
        except BaseException:  # out of processes or fds, say: end those already started
            self.close(0.0)
            raise

    def _start(self, spec: WorkerSpec, boot: Boot | None = None) -> WorkerProcess:
        assert self.queue is not None
        if self.mailboxes is not None:
            self.mailboxes.reset(spec.index)  # empty rings for the new process
        return WorkerProcess(self.ctx, spec, self.queue.writer, self.supervisor, daemon=self.daemon, boot=boot,
                             file=self.file, mailboxes=self.mailboxes, marks=self.marks)

    @property
    def timeout(self) -> float:
        """Seconds a process's oldest request may take before it counts as hung."""
        return self.supervisor.timeout

    # ------------------------------------------------------------------------------------------
    # Sending

    def prepare(self, cmd: Cmd, message: Any, slots: tuple[int, ...] = ()) -> EnvironmentRequest:
        """Number and encode a request (raises before anything is sent if it cannot be encoded).
        Sequence numbers are unique across restarts: a replaced process's answer never passes for a newer one."""
        self._seq += 1
        return EnvironmentRequest(cmd, self._seq, slots, encode_request(cmd, self._seq, message), message)

    def prepare_raw_step(self, body: bytes, slots: tuple[int, ...]) -> EnvironmentRequest:
        """``prepare`` for the hot path: a STEP whose actions are in shared memory."""
        self._seq = seq = self._seq + 1
        # (a NamedTuple made without its constructor's overhead: the hot path)
        return tuple.__new__(EnvironmentRequest, (Cmd.STEP, seq, slots, _RAW_STEP(Cmd.STEP, seq, RAW) + body, None))

    def post_steps(self, slots: np.ndarray, processes: np.ndarray, now: float) -> None:
        """Ask for a step of ``slots`` (hosted by ``processes``, actions in shared memory, checked) on
        the step board: one numpy operation, a wake-up only to a process that may be asleep."""
        box = self.mailboxes
        assert box is not None
        for p in box.post_steps(box.slot_word[slots], processes, now).tolist():
            try:
                write_frame(self.processes[p].fd, WAKE)
            except OSError:  # gone: its sentinel tells
                pass

    def take_steps(self) -> list[np.ndarray]:
        """The slots whose board steps the waits took since the last call, results in shared memory
        (their infos and timings stay in the board: ``mailboxes.infos``, ``mailboxes.timings``)."""
        answered, self._steps_answered = self._steps_answered, []
        return answered

    def share_buffers(self, n_envs: int, observation_space: Any, action_space: Any) -> SharedBuffers:
        """Shared arrays for ``n_envs`` slots (in ``file``, or a named segment), mapped by
        every worker before this returns; a restarted worker maps them again (its ``Boot``)."""
        self.buffers = buffers = SharedBuffers.create(n_envs, observation_space, action_space, self.file)
        for w in self.processes:
            w.send(self.prepare(Cmd.ATTACH, Attach(buffers.layout)))
        self.gather(self.processes, "shared memory")
        return buffers

    @property
    def owned(self) -> bool:
        """Whether this process made the pool (not a copy of it in a child forked with ``os.fork``)."""
        return os.getpid() == self._owner

    @property
    def closed(self) -> bool:
        """Whether ``close()`` began (one cut short, by a second Ctrl-C say, is finished by the next)."""
        return self._closing or self.queue is None

    # ------------------------------------------------------------------------------------------
    # Receiving

    def wait(self, timeout: float) -> list[Completion]:
        """Wait up to ``timeout`` for answers, deaths or missed deadlines; return what finished or
        failed. ``ManagerClosedError`` if another thread closes the pool meanwhile."""
        # One thread waits at a time: another thread's wait is refused before it takes anything. Said
        # before the look at ``_closing``: a ``close`` of another thread sees us waiting, or we see it closing.
        me = get_ident()
        if self._waiting.setdefault(0, me) != me:
            raise ConcurrentCallError(thread_name(self._waiting.get(0)), threading.current_thread().name)
        try:
            queue = self.queue
            if queue is None or self._closing:  # (``closed``, inline)
                raise ManagerClosedError("the SubprocessEnvManager was closed")
            now = monotonic()
            if now >= self._next_core_check:
                self._check_cores(now)
            if now >= self._next_deadline_check:
                # What has come is taken first: an answer the caller looks for late (a long
                # learner step between send and receive) is not the worker's delay.
                answered = len(self._steps_answered)
                completions: list[Completion] = []
                self._drain(completions, everything=True)
                completions += self._check_deadlines(now)
                if completions or len(self._steps_answered) > answered:
                    return completions
            # Wake up in time to notice the first process to miss its deadline.
            timeout = min(timeout, self._next_deadline_check - now)
            if self._poll_version != self._version:
                self._rebuild_poller()
            ended = queue.wait(timeout)
            if self._closing:  # closed by another thread meanwhile: its workers' ends woke us
                raise ManagerClosedError("the SubprocessEnvManager was closed while waiting for its workers")
            completions = []
            self._drain(completions)
            for fd in ended:
                w = self._by_sentinel.get(fd)
                if w is not None and self.processes[w.index] is w and w.watched:
                    self._drain(completions, everything=True)  # a worker's last words come before its death
                    self._on_failure(w, w.died(), completions)
            return completions
        finally:  # (a Ctrl-C before the ``try`` leaves the claim to the main thread: its next wait is its own)
            del self._waiting[0]

    def spun_s(self) -> float:
        """Seconds this parent spent spinning in its waits (its CPU taken by waiting)."""
        return getattr(self.queue, "spun_ns", 0) * 1e-9

    def _rebuild_poller(self) -> None:
        """Tell the transport to wait on every watched process's pipe and sentinel (redone on each ``_version``)."""
        assert self.queue is not None
        watched = [w for w in self.processes if w.watched]
        self._by_sentinel = {w.sentinel: w for w in watched}
        self.queue.watch([w.conn for w in watched], list(self._by_sentinel))
        self._poll_version = self._version

    def _drain(self, completions: list[Completion], everything: bool = False) -> None:
        """Take every answer that has arrived; the step board first (a notice goes out before the answer words it completes)."""
        assert self.queue is not None
        box = self.mailboxes
        if box is not None:
            answered = box.steps_answered()
            if answered is not None:
                self._steps_answered.append(answered)
                self.answers += answered.size
        notices = self.queue.take(everything)
        if not notices:
            return
        received = monotonic()
        workers, clocks = self.processes, self.supervisor.clocks
        for cmd, process, seq, posted_at, form, data in notices:
            w = workers[process]
            requests = w.requests
            if seq == BOARD_SEQ and cmd is Cmd.STEP:  # board steps answered with more than shared memory holds
                self._board_notice(w, form, data, posted_at, received, completions)
                continue
            if requests and requests[0][0].seq == seq and cmd is not Cmd.CLOSED:
                request, sent_at = requests[0]  # the usual case: answers come in the order sent
                del requests[0]  # (``w.answered`` inline: this runs once per answer)
                if requests:  # the next request's clock starts now
                    clocks[process] = received
            else:
                found = None if cmd is Cmd.CLOSED else w.answered(seq, received)
                if found is None:
                    continue  # a farewell, or the last words of a process already replaced
                request, sent_at = found
            if form == ON_PIPE:
                try:
                    data = w.read_large_answer(self.timeout)
                except (EOFError, OSError, TimeoutError) as exc:
                    self._on_failure(w, w.died(f" while sending its answer: {exc!r}"), completions, request)
                    continue
            self.answers += 1
            try:
                answer = decode_answer(form, data)
            except Exception as exc:  # e.g. a class the parent cannot import
                completions.append(Completion(w, request, None, _unpicklable(w.env_ids[0], request.cmd, exc, w.index)))
                continue
            if cmd is Cmd.ENV_FAILED:
                error = worker_error(answer, w.index)
                if request.cmd not in (Cmd.CALL, Cmd.GET_ATTR, Cmd.SET_ATTR):
                    self._on_failure(w, error, completions, request)
                elif w.state is ProcessState.BOOTING:  # a call its restart replays raised: the restart failed
                    self._on_failure(w, error, completions)
                else:  # the envs are fine: the caller gets the error
                    completions.append(Completion(w, request, None, error))
                continue
            if request.cmd is Cmd.READY:  # the processes its envs started: killed with it, even once it died by itself
                w.family.update(answer.family)
            completion = Completion(w, request, answer, None, posted_at, received, sent_at, False, request.slots)
            if type(answer) is Stepped and answer.failures and self._env_failed(w, request, answer, completion, completions):
                continue  # an env raised: rebuilt, its process restarted or given up (the supervisor's decision)
            state = w.state
            if state is ProcessState.RUNNING:
                completions.append(completion)
            elif state is ProcessState.BOOTING:
                self._advance_boot(w, completion, completions)
            elif state is ProcessState.REBUILDING:
                self._rebuilt(w, completion, completions)
            else:
                w.running()
                completions.append(completion)

    def _board_notice(self, w: WorkerProcess, form: int, data: Any, posted_at: float, received: float,
                      completions: list[Completion]) -> None:
        """A notice answering board steps of ``w``, filed as the answer to a STEP of its slots; stale
        ones (of a replaced process, or steps taken out of flight) are dropped."""
        box = self.mailboxes
        assert box is not None
        if posted_at < w.started_at:  # posted by the process this one replaced: stale (its payload is on the old pipe)
            return
        try:
            if form == ON_PIPE:
                data = w.read_large_answer(self.timeout)
            locals_, ordinals, rest = open_steps_answer(data)
        except Exception as exc:  # it died sending it, or a notice that is not one: which steps it answers is unknown
            self._on_failure(w, w.died(f" while sending its answer: {exc!r}"), completions)
            return
        slots = tuple(w.env_ids[i] for i in locals_)
        error: WorkerError | None = None
        try:
            answer, schemas = decode_steps_rest(rest)
        except Exception as exc:  # e.g. an info of a class the parent cannot import: the steps fail, as a request's
            error = _unpicklable(slots[0], Cmd.STEP, exc, w.index)
            schemas = ()
        if not w.watched or not box.take_notice(w.index, box.slot_word[list(slots)].tolist(), list(ordinals), received,
                                                schemas):
            return
        self.answers += len(slots)
        request = EnvironmentRequest(Cmd.STEP, BOARD_SEQ, slots)
        if error is not None:
            completions.append(Completion(w, request, None, error))
            return
        sent = float(box.asked_at(list(slots)).min())
        completion = Completion(w, request, answer, None, posted_at, received, sent, False, slots)
        if not (answer.failures and self._env_failed(w, request, answer, completion, completions)):
            completions.append(completion)

    def _check_cores(self, now: float) -> None:
        """Allow spinning while the parent and every worker each have a core of their own (``envmanager.core.cores``)."""
        self._next_core_check = now + CORE_CHECK_S
        if self.mailboxes is None:
            return
        pids = [os.getpid()] + [w.pid for w in self.processes if w.pid is not None and w.watched]
        placed = [affinity(pid) for pid in pids]
        every = frozenset(range(os.cpu_count() or 1))
        cores = frozenset().union(*(every if a is None else a for a in placed))
        others = self._core_use.others(pids, cores)
        if others is not None:  # cores no process of ours needs may carry other work; a little more is noise
            spare = min(len(cores), machine_cores()) - len(placed)
            crowded = others > spare + OTHERS_TOLERATED / (2 if self._crowded else 1)
            if crowded != self._crowded:
                logger.debug("other programs keep %.2f cores busy of the %d ours may run on (%d spare): spinning %s",
                             others, len(cores), spare, "off" if crowded else "allowed again")
            self._crowded = crowded
        self.mailboxes.allow_spin(own_cores(placed) and not self._crowded)

    def _check_deadlines(self, now: float) -> list[Completion]:
        """Fail every process whose oldest request's clock is past the deadline, and note when the
        next can be due. A call whose ``progress`` count grew has its clock moved on; while one is
        in flight the looks come every quarter deadline, so it is hung at most a quarter late."""
        completions: list[Completion] = []
        counted = False
        for w in list(self.processes):
            if not (w.busy and w.watched):
                continue
            cmd = w.request.cmd if w.request is not None else Cmd.STEP  # (board steps)
            if cmd is Cmd.CALL and self.progress is not None:
                counted = True
                w.progressed(self.progress(list(w.env_ids)), now)  # working, not hung: its clock from now
            if self.supervisor.late(w.clock, now):
                what = "its startup" if cmd is Cmd.READY else f"an answer to {cmd.name}"
                self._on_failure(w, w.hung(self.timeout, what), completions)
        oldest = min((w.clock for w in self.processes if w.busy and w.watched), default=now)
        self._next_deadline_check = oldest + self.timeout
        if counted:
            self._next_deadline_check = min(self._next_deadline_check, now + self.timeout / 4)
        return completions

    def gather(self, workers: Iterable[WorkerProcess], what: str) -> list[Completion]:
        """Wait until each of ``workers`` answered its request (start-up: nothing else in flight);
        raises their errors (all the late ones in one ``WorkerTimeoutError``), or one past the deadline."""
        indices = {w.index for w in workers}
        got: dict[int, Completion] = {}
        deadline = Deadline(self.timeout)
        while not indices <= got.keys():
            if deadline.passed():  # name every late process, those already timed out too
                late = sorted((indices - got.keys()) | {i for i, c in got.items() if isinstance(c.error, WorkerTimeoutError)})
                raise WorkerTimeoutError([s for i in late for s in self.processes[i].env_ids], self.timeout, what, processes=late,
                                         hint=self.processes[late[0]].hang_hint())
            for c in self.wait(deadline.left()):
                got.setdefault(c.worker.index, c)
        ordered = [got[i] for i in sorted(indices)]
        timeouts = [c for c in ordered if isinstance(c.error, WorkerTimeoutError)]
        if len(timeouts) > 1:
            slots = [s for c in timeouts for s in c.error.worker_ids]  # type: ignore[union-attr]
            raise WorkerTimeoutError(slots, self.timeout, timeouts[0].error.what, processes=[c.worker.index for c in timeouts],  # type: ignore[union-attr]
                                     hint=timeouts[0].worker.hang_hint())
        for c in ordered:
            if c.error is not None:
                raise c.error
        return ordered

    # ------------------------------------------------------------------------------------------
    # Failures: restarts, rebuilds, give-ups (the supervisor's decisions, carried out)

    def fault(self, index: int, error: EnvManagerError, envs: tuple[int, ...] = (), seen: dict[int, int] | None = None
              ) -> Decision:
        """A failure of process ``index`` its caller found in an answer of the generations ``seen``
        (a call that raised; a worker-side rollout's ``envs``, rebuilt by its next call): the
        supervisor's decision, carried out — or the one taken already, if those envs were replaced since."""
        w = self.processes[index]
        if w.failure is not None:
            return GiveUp(w.failure, True)
        decided = self.supervisor.already(index, seen or {})
        if decided is not None:
            return decided
        if w.busy:
            raise InvalidInputError(f"{w.name} has a request in flight; report a failure once it answered")
        decision = self._decide(w, error, None, envs)
        return decision if isinstance(decision, Rebuild) else self._carry_out(w, decision, error, [], [])

    def join_boot(self, index: int, cmd: Cmd, slots: tuple[int, ...], reset: Reset | None = None) -> None:
        """A step or reset of idle ``slots`` asked while process ``index`` boots: its boot's fresh
        reset answers them (``Boot.join``); sent now, the worker would take it ahead of its plan."""
        boot = self.processes[index].boot
        assert boot is not None and not boot.startup, "only a running pool's restart is joined"
        boot.join(cmd, slots, reset)

    def _on_failure(self, w: WorkerProcess, error: EnvManagerError, completions: list[Completion],
                    request: EnvironmentRequest | None = None) -> None:
        """``w`` failed (``request``, already out of flight, with it): restarted or given up."""
        self._carry_out(w, self._decide(w, error, request), error, [request] if request is not None else [], completions)

    def _decide(self, w: WorkerProcess, error: EnvManagerError, request: EnvironmentRequest | None = None,
                envs: tuple[int, ...] = ()) -> Decision:
        """The supervisor's decision on ``w``'s failure; ``envs`` (which raised) are rebuilt in place
        if it serves on (answering, not booting nor rebuilding) and is alive. An env's error sent
        before the process died is that env's; the death is the process's own failure, taken next."""
        if self.queue is None:  # closed meanwhile by another thread: nothing is restarted
            raise ManagerClosedError("the SubprocessEnvManager was closed")
        self._version += 1
        rebuilding = request is not None and request.cmd is Cmd.REBUILD  # (an env it could not rebuild is gone)
        serves = not (isinstance(error, (WorkerDiedError, WorkerTimeoutError)) or w.boot is not None or rebuilding)
        envs = envs if serves and w.alive() else ()
        what = f"rebuilding env {', '.join(map(str, envs))} of" if envs else "restarting"
        return self.supervisor.on_fault(w.index, Fault(error, f"{what} {w.name} after: {error}", serves, envs))

    def _carry_out(self, w: WorkerProcess, decision: Decision, error: EnvManagerError, lost: list[EnvironmentRequest],
                   completions: list[Completion]) -> Decision:
        """A restart or give-up of ``w``: every request in flight (``lost``: already out of flight) is
        cut short and answered by the restart or the decision's error; one that serves on answers ``lost`` alone."""
        if not (isinstance(decision, GiveUp) and not decision.given_up):  # it does not serve on
            lost += w.cut()
            if w.boot is not None:  # a restart failed on its way up: what it was answering is what failed
                lost = list(w.boot.lost)
            if isinstance(decision, Restart):
                self._restart(w, lost, error, decision.generations, completions)
                return decision
            w.fail()
        assert isinstance(decision, GiveUp)
        requests: list[EnvironmentRequest | None] = [*lost] or [None]  # the same error for each (the slots file it once)
        completions += [Completion(w, r, None, decision.error) for r in requests]
        return decision

    def _restart(self, w: WorkerProcess, lost: list[EnvironmentRequest], error: EnvManagerError,
                 generations: tuple[int, ...], completions: list[Completion]) -> None:
        """Replace ``w`` by a new process told its envs' ``generations``, with its ``Boot`` plan (the supervisor recorded it)."""
        w.kill()
        attach = [(Cmd.ATTACH, Attach(self.buffers.layout))] if self.buffers else []
        startup = [r for r in lost if r.cmd in (Cmd.READY, Cmd.ATTACH)]
        if w.boot is not None:  # it failed again while coming back: the same way up, from the start
            boot = Boot(w.boot.all_steps, w.boot.lost, w.boot.startup)
        elif startup:
            # Failed while the pool was starting: the new process answers the startup instead.
            boot = Boot(attach if startup[0].cmd is Cmd.ATTACH else [], startup, True)
        else:
            everyone = tuple(range(len(w.env_ids)))
            replays = [(Cmd.CALL, Call(everyone, n, a, k)) for n, a, k in self.replay_calls]
            # Every env is reset; those being reset keep their seeds and options.
            asked = {i: (seed, options) for r in lost if r.cmd in _RESETS
                     for i, seed, options in zip(r.message.locals, r.message.seeds, r.message.options, strict=True)}
            reset = Reset(everyone, tuple(asked.get(i, (None, None))[0] for i in everyone),
                          tuple(asked.get(i, (None, None))[1] for i in everyone))
            # Steps, resets and rebuilds are answered by the fresh reset (``interrupted``); a call is not.
            answered = [r for r in lost if r.cmd in _ANSWERED_BY_RESET]
            completions += [Completion(w, r, None, error) for r in lost if r.cmd not in _ANSWERED_BY_RESET]
            boot = Boot([*attach, *replays, (Cmd.RESET, reset)], answered, False)
        try:
            self.processes[w.index] = self._start(replace(w.spec, generations=generations), boot)
        except OSError as exc:  # no process to be had (fork: out of memory or processes): given up
            given_up = self.supervisor.give_up(w.index, w.died(f"; its restart could not start a process: {exc!r}"))
            w.fail()
            cut: list[EnvironmentRequest | None] = [*boot.lost] or [None]
            completions += [Completion(w, r, None, given_up) for r in cut]

    def _env_failed(self, w: WorkerProcess, request: EnvironmentRequest, answer: Stepped, completion: Completion,
                    completions: list[Completion]) -> bool:
        """Envs raised in ``request``: rebuilt in their process (the other envs' results stand),
        or it is restarted or given up; ``False``: it serves on and ``completion`` is filed as it
        is (restarts off: the failures are those envs' errors)."""
        failures = answer.failures
        assert failures is not None
        error = worker_error(failures[min(failures)], w.index)
        slots = request.slots
        decision = self._decide(w, error, request,
                                tuple(slots[n] for n in sorted(failures)) if request.cmd in (Cmd.STEP, Cmd.RESET) else ())
        if isinstance(decision, GiveUp) and not decision.given_up:
            return False
        if not isinstance(decision, Rebuild):
            self._carry_out(w, decision, error, [request], completions)
            return True
        kept = [n for n in range(len(slots)) if n not in failures]
        if kept:  # the envs that delivered: their results, as if the others were not asked
            completion.keep(delivered(answer, kept, slots), tuple(slots[n] for n in kept))
            completions.append(completion)
        w.rebuild(rebuild_request(self.prepare, w.env_ids, request, sorted(failures), self.replay_calls,
                                  decision.generations))
        return True

    def _rebuilt(self, w: WorkerProcess, completion: Completion, completions: list[Completion]) -> None:
        """An answer of a process rebuilding envs: a REBUILD's is its slots' fresh reset, ``interrupted``."""
        request = completion.request
        if request is not None and request.cmd is Cmd.REBUILD:
            completion.answering((request,))
            w.look_for_family()  # the rebuilt envs' own processes (a new simulator)
        w.rebuilt()
        completions.append(completion)

    def _advance_boot(self, w: WorkerProcess, completion: Completion, completions: list[Completion]) -> None:
        """Take a replacement process through its plan (attach → replayed calls → reset)."""
        boot = w.boot
        assert boot is not None
        step = boot.next()
        if step is not None:
            cmd, message = step
            locals_ = getattr(message, "locals", None)
            slots = w.env_ids if locals_ is None else tuple(w.env_ids[i] for i in locals_)
            w.send(self.prepare(cmd, message, slots))
            return
        completion.answering(tuple(boot.lost), not boot.startup)
        w.running()
        completions.append(completion)

    # ------------------------------------------------------------------------------------------
    # Lifetime

    def close(self, timeout: float = 10.0) -> None:
        """End every worker (politely, then by force) and free shared memory. Idempotent. Idle workers
        get ``timeout`` seconds to close their envs; a busy one is interrupted at once (SIGTERM: it still
        closes its envs); stragglers are killed with everything they started. Another thread's wait
        raises ``ManagerClosedError``; its ``close()`` waits for this one (two at once raced for the pipes)."""
        if not self.owned:  # a copy in a process forked from ours: its workers are not this one's
            self.processes, self._unreaped, self._closing = [], [], True
            return
        with self._close_lock:  # (re-entrant: a signal handler's close() in this thread goes on as before)
            self._close(timeout)

    def _close(self, timeout: float) -> None:
        self._closing = True
        self._leave_waiters()
        # Workers not yet reaped stay listed in ``_unreaped`` until they are: a close cut short (a
        # second Ctrl-C while the envs close) is finished by the next close(), at exit or by ``__del__``.
        asked = [w for w in self._unreaped if not w.reaped]  # asked by a close cut short: given no more time
        workers = self._unreaped = asked + self.processes
        self.processes = []
        self._version += 1
        try:
            for w in workers:
                busy = w.busy
                w.request_close()
                if busy:  # it would read CLOSE only after its step: interrupt it (it still closes its envs)
                    w.interrupt()
            deadline = Deadline(timeout)
            if self.queue is not None:  # from now on: the closing workers' farewells
                self.queue.watch([w.conn for w in workers], [])
            fresh = workers[len(asked):]
            while any(w.alive() for w in fresh) and not deadline.passed():
                if self.queue is not None:  # keep the queue flowing so no worker blocks on it
                    while self.queue.take(everything=True) and not deadline.passed():
                        pass
                wait_for_ready([w.sentinel for w in fresh if w.alive()], min(0.05, deadline.left()))
            late = [w.name + _in(w.inside()) for w in fresh if w.alive()]
            if late and timeout > 0:
                logger.warning("%s did not close within %.1f s; terminating", ", ".join(late), timeout)
        finally:
            for w in workers:
                w.stop()  # (a dead one: only killed, its family with it)
            self._unreaped = []
            for name in ("buffers", "file", "queue", "mailboxes", "marks"):  # shared memory, pipes, mappings
                resource = getattr(self, name)
                if resource is not None:
                    resource.close()
                    setattr(self, name, None)
            if self._atexit is not None:
                atexit.unregister(self._atexit)
                self._atexit = None

    def _leave_waiters(self) -> None:
        """Closing while another thread waits on the workers: SIGTERM them (they still close their envs),
        which wakes that thread; it raises ``ManagerClosedError`` and leaves before anything is freed."""
        waiter = self._waiting.get(0)
        if waiter is None or waiter == threading.get_ident():
            return
        for w in self.processes:
            w.interrupt()
        deadline = Deadline(10.0)
        while self._waiting.get(0) == waiter and not deadline.passed():
            time.sleep(0.005)


def _unpicklable(slot: int, cmd: Cmd, exc: Exception, process: int) -> WorkerError:
    """The error of an answer to ``cmd`` that could not be unpickled here (``exc``)."""
    what = f"its answer to {cmd.name} could not be unpickled here: {exc!r}"
    return WorkerError(slot, f"{type(exc).__module__}.{type(exc).__qualname__}", what, "", exc, process)


def _in(inside: tuple[int, str] | None) -> str:
    """`` (worker 3 in close())``: where a process is, for a log line."""
    return "" if inside is None else f" (worker {inside[0]} in {inside[1]}())"


#: Every pool alive in this process, for ``_forget_after_fork``.
_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _forget_after_fork() -> None:
    """In a child forked with ``os.fork``: multiprocessing's exit handler would SIGTERM every daemonic
    process it inherited the records of, our workers among them. They are the parent's: forget them."""
    children = getattr(mp.process, "_children", None)
    if children is None:
        return
    for pool in list(_POOLS):
        for w in pool.processes + pool._unreaped:
            children.discard(w.process)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _close_at_exit(pool: WorkerPool) -> Callable[[], None]:
    """Close the pool at interpreter exit if nobody did (held weakly)."""
    ref = weakref.ref(pool)

    def close_if_alive() -> None:
        p = ref()
        if p is not None:
            p.close()

    atexit.register(close_if_alive)
    return close_if_alive


def make_specs(factory: bytes, n_env: int, envs_per_worker: int, autoreset_mode: str, spin_s: float = 0.0,
               info_columns: bool = False, double_buffer: bool = False, options_if_given: bool = False,
               reset_info_apart: bool = False) -> list[WorkerSpec]:
    """Split ``n_env`` slots over processes, ``envs_per_worker`` each (the last may have fewer)."""
    return [
        WorkerSpec(i, tuple(range(start, min(start + envs_per_worker, n_env))), factory, autoreset_mode, os.getpid(), spin_s,
                   info_columns, double_buffer, options_if_given=options_if_given, reset_info_apart=reset_info_apart)
        for i, start in enumerate(range(0, n_env, envs_per_worker))
    ]


def get_context(context: str | None) -> Any:
    """The multiprocessing context for ``context``, by default ``platforms.default_start_method``."""
    return mp.get_context(context or default_start_method())  # ValueError for unknown methods
