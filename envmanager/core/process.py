"""The parent's handle on one worker process: its pipe, its requests in flight, its life.

Requests in flight form a FIFO (``WorkerProcess.requests``: the worker serves its pipe in
order); steps on the step board are in flight per env, not in it, but ``busy``, ``clock`` and
``cut`` count them too. Their clocks, and the life cycle (``WorkerProcess.state``) the pool drives
through this class's methods: docs/architecture.md (State).
"""

from __future__ import annotations

import enum
import gc
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import Any

import psutil

from envmanager.core.supervisor import Supervisor
from envmanager.errors import EnvManagerError, WorkerDiedError, WorkerTimeoutError, who
from envmanager.wire.mailbox import Mailboxes
from envmanager.wire.marks import CallMarks
from envmanager.wire.messages import BOARD_SEQ, EnvironmentRequest, Reset, encode_request
from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.wire.shm import SharedFile
from envmanager.wire.step_queue import read_message, write_frame
from envmanager.worker.family import family, kill_family, tagged
from envmanager.worker.main import WorkerSpec, worker_main

__all__ = ["WorkerProcess", "ProcessState", "Boot"]


class ProcessState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    BOOTING = "booting"  # a replacement process, on its way back (see ``Boot``)
    REBUILDING = "rebuilding"  # remaking envs that raised (a REBUILD in flight; the other envs step on)
    FAILED = "failed"  # given up: killed, ``failure`` raised on every later use
    CLOSING = "closing"  # asked to stop (or being killed): its exit is expected
    CLOSED = "closed"  # reaped


@dataclass
class Boot:
    """How a replacement process comes back: ``plan`` (what of ``all_steps`` is still to send),
    then its last answer answers ``lost``, the requests the failure cut short. ``startup``: it
    replaces a process that failed during the pool's start (a startup answer, not ``interrupted``).
    ``resetting``: its fresh reset was sent — from then on it may overwrite its slots' rows."""

    all_steps: list[tuple[Cmd, Any]]
    lost: list[EnvironmentRequest]
    startup: bool
    plan: list[tuple[Cmd, Any]] = field(default_factory=list)
    resetting: bool = False

    def __post_init__(self) -> None:
        self.plan = list(self.all_steps)

    def join(self, cmd: Cmd, slots: tuple[int, ...], reset: Reset | None = None) -> None:
        """A step or reset of ``slots`` asked meanwhile: the fresh reset answers them, as ``lost``. A
        reset's seeds and options go into that reset (or a second one, if it was sent already) and
        into ``all_steps`` (should the process fail on its way up)."""
        if reset is not None and any(v is not None for v in (*reset.seeds, *reset.options)):
            final = self.all_steps[-1][1]
            assert isinstance(final, Reset)  # (the plan ends with the reset of every env)
            asked = {i: (seed, options) for m in (final, reset)
                     for i, seed, options in zip(m.locals, m.seeds, m.options, strict=True)}  # (the reset's win)
            merged = (Cmd.RESET, Reset(final.locals, tuple(asked[i][0] for i in final.locals),
                                       tuple(asked[i][1] for i in final.locals)))
            self.all_steps[-1] = merged
            self.plan[-1:] = [merged]  # in place of the reset not sent yet, else after it
        self.lost.append(EnvironmentRequest(cmd, -1, slots))

    def next(self) -> tuple[Cmd, Any] | None:
        """The plan's next request, taken off it; ``None`` once it is done."""
        if not self.plan:
            return None
        step = self.plan.pop(0)
        self.resetting |= step[0] is Cmd.RESET
        return step


class WorkerProcess:
    """One worker process hosting the env slots ``spec.env_ids``."""

    def __init__(
        self, ctx: Any, spec: WorkerSpec, queue_writer: Connection | None, supervisor: Supervisor, daemon: bool = True,
        boot: Boot | None = None, file: SharedFile | None = None, mailboxes: Mailboxes | None = None,
        marks: CallMarks | None = None,
    ) -> None:
        """Start the process. ``queue_writer``: the step queue's write end (``None``: the portable
        transport, answers come on ``conn``). The rest are the pool's: ``supervisor`` (the deadline
        clock, the error once given up), ``file`` (shared memory, handed over at start),
        ``mailboxes`` (requests go through its ring) and ``marks`` (cleared for this process)."""
        self.spec = spec = replace(spec, nonce=secrets.token_hex(8))  # this start's own tag (``family.tag``)
        self.index = spec.index
        self.env_ids = spec.env_ids
        self.conn, child_conn = ctx.Pipe()
        self.mailboxes = mailboxes
        mailbox = None if mailboxes is None else (mailboxes.file, mailboxes.layout)
        self.marks = marks
        if marks is not None:
            marks.reset(spec.index)
        self.started_at = time.monotonic()  # no answer of this process is posted before this
        self.born = time.time()  # nothing it started is older (``tagged``)
        self.process = ctx.Process(target=worker_main,
                                   args=(spec, child_conn, queue_writer, file, mailbox, None if marks is None else marks.file),
                                   name=f"envmanager-worker-{spec.index}", daemon=daemon)
        #: The fork-unsafe library running threads here when it was forked, else "" (``hang_hint``).
        self.forked_from = forked_from() if ctx.get_start_method() == "fork" else ""
        start(self.process)
        child_conn.close()
        self.pid = self.process.pid
        self.fd = self.conn.fileno()
        self._write = self.conn.send_bytes if queue_writer is None else partial(write_frame, self.fd)
        self.state = ProcessState.STARTING if boot is None else ProcessState.BOOTING
        self.boot = boot
        now = time.monotonic()
        #: The requests in flight, oldest first, with their send times; first the READY (seq 0) it starts with.
        self.requests: list[tuple[EnvironmentRequest, float]] = [(EnvironmentRequest(Cmd.READY, 0, self.env_ids), now)]
        #: The supervisor's deadline clocks, written here and by the pool's hot path.
        self.supervisor, self._clocks = supervisor, supervisor.clocks
        self._clocks[self.index] = now
        #: ``(clock, count)``: the progress a call had made when its clock was last moved on for it.
        self.progress_mark = (0.0, 0)
        self.exitcode: int | None = None
        self.reaped = False
        #: The processes its envs started, pid -> start time (from READY, a rebuild, an interrupt):
        #: killed with it, even once it has died by itself.
        self.family: dict[int, float] = {}

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name} pid={self.pid} {self.state.value}>"

    @property
    def name(self) -> str:
        """How errors name it: its slots and its process index."""
        return who(self.env_ids[0], self.env_ids, self.index)

    @property
    def busy(self) -> bool:
        """Whether anything is in flight: a request, or a step on the board."""
        return self.requests != [] or (self.mailboxes is not None and self.mailboxes.busy(self.index))

    @property
    def request(self) -> EnvironmentRequest | None:
        """The oldest request in flight (the one the worker is on), or ``None``."""
        return self.requests[0][0] if self.requests else None

    @property
    def clock(self) -> float:
        """When the clock of its oldest request (or board step) in flight started."""
        box = self.mailboxes
        started = self._clocks[self.index]
        if box is None or not box.busy(self.index):
            return started
        board = box.clock(self.index)
        return min(started, board) if self.requests else board

    def answered(self, seq: int, now: float) -> tuple[EnvironmentRequest, float] | None:
        """Take request ``seq`` out of flight, with its send time (``None``: stale); the next one's clock starts now."""
        requests = self.requests
        for k, entry in enumerate(requests):
            if entry[0].seq == seq:
                del requests[k]
                if requests:
                    self._clocks[self.index] = now
                return entry
        return None

    def cut(self) -> list[EnvironmentRequest]:
        """Take every request out of flight, oldest first; the board's steps in flight as one STEP of their slots."""
        lost = [request for request, _ in self.requests]
        self.requests = []
        if self.mailboxes is not None:
            slots = self.mailboxes.cut_steps(self.index)
            if slots:
                lost.append(EnvironmentRequest(Cmd.STEP, BOARD_SEQ, tuple(sorted(slots))))
        return lost

    def running(self) -> None:
        """It answered its startup, or the last step of its boot plan (then done): RUNNING."""
        self.boot = None
        self.state = ProcessState.RUNNING

    def rebuild(self, request: EnvironmentRequest) -> None:
        """Send ``request``, a REBUILD of envs that raised: REBUILDING until ``rebuilt``."""
        self.state = ProcessState.REBUILDING
        self.send(request)

    def rebuilt(self) -> None:
        """A rebuild's answer came: RUNNING again once no rebuild is in flight."""
        if not any(r.cmd is Cmd.REBUILD for r, _ in self.requests):
            self.state = ProcessState.RUNNING

    def progressed(self, done: int, now: float) -> None:
        """If the call's progress count ``done`` (0 when sent) grew since its clock was last
        moved on for it, its clock starts ``now``."""
        seen = self.progress_mark[1] if self.progress_mark[0] == self.clock else 0
        if done != seen:
            self.supervisor.start_clock(self.index, now)
            self.progress_mark = (now, done)

    @property
    def watched(self) -> bool:
        """Its death or silence is a failure (not once it was asked to stop or given up)."""
        return self.state in (ProcessState.STARTING, ProcessState.RUNNING, ProcessState.BOOTING, ProcessState.REBUILDING)

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def send(self, request: EnvironmentRequest, now: float | None = None) -> None:
        """Send one encoded request; its lanes must be free. A broken pipe is not raised: the
        request counts as in flight and the death is noticed through the sentinel, like any other."""
        now = time.monotonic() if now is None else now
        if not self.requests:
            self._clocks[self.index] = now
        self.requests.append((request, now))
        try:
            if self.mailboxes is None:
                self._write(request.data)
            else:  # the pipe only for a wake-up or what does not fit the ring
                frame = self.mailboxes.send(self.index, request.data)
                if frame is not None:
                    write_frame(self.fd, frame)
        except OSError:  # BrokenPipeError, ConnectionResetError, ...
            pass

    def read_large_answer(self, timeout: float) -> bytes:
        """An answer's payload sent on this process's own pipe; ``EOFError`` if it dies meanwhile."""
        return read_message(self.conn, time.monotonic() + timeout, self.process.sentinel)

    def inside(self) -> tuple[int, str] | None:
        """The env slot and call this process is in, read without asking it (it may be hung or dead), or ``None``."""
        return None if self.marks is None else self.marks.read(self.index)

    def died(self, detail: str = "") -> WorkerDiedError:
        if self.reaped:
            exitcode = self.exitcode
        else:  # ending: its exit code (a core dump can delay it a little)
            self.process.join(2.0)
            exitcode = self.process.exitcode
        slot, call = self.inside() or (None, None)  # ended: its record is final
        return WorkerDiedError(self.env_ids[0] if slot is None else slot, exitcode, detail, slots=self.env_ids,
                               process=self.index, call=call)

    def hung(self, timeout: float, what: str) -> WorkerTimeoutError:
        """The error of a process that missed its deadline, naming the env and call it is in."""
        slot, call = self.inside() or (None, None)
        return WorkerTimeoutError(list(self.env_ids), timeout, what, processes=[self.index], slot=slot, call=call,
                                  hint=self.hang_hint())

    def hang_hint(self) -> str:
        """A likely cause of a hang: forked while this process ran a fork-unsafe library's threads."""
        if not self.forked_from:
            return ""
        return (f"It was forked from a process running threads, with {self.forked_from} loaded: an env calling a "
                "library whose thread pool had started there can hang in a forked worker; context='forkserver' or "
                "'spawn' starts workers without them")

    def alive(self) -> bool:
        return not self.reaped and self.process.is_alive()

    @property
    def failure(self) -> EnvManagerError | None:
        """The error raised on every use of a process given up (kept by the supervisor), else ``None``."""
        return self.supervisor.failure(self.index) if self.state is ProcessState.FAILED else None

    def fail(self) -> None:
        """Give up on this process (its error is the supervisor's): kill it; no boot goes on."""
        self.state = ProcessState.FAILED
        self.boot = None
        self.cut()
        self.kill()
        if self.mailboxes is not None:
            self.mailboxes.retire(self.index)

    def request_close(self) -> None:
        """Ask the worker to close its envs and exit; from now on its exit is expected."""
        if self.watched:
            self.state = ProcessState.CLOSING
        if self.alive():
            try:
                self.conn.send_bytes(encode_request(Cmd.CLOSE, -1))
            except OSError:  # already gone
                pass

    def stop(self) -> None:
        """Ask the worker to close; if it has not exited, SIGTERM it (it still closes its envs),
        wait 0.1 s and kill what it started that outlived it; then ``kill``."""
        self.request_close()
        if self.alive():
            self.interrupt()
            self.process.join(0.1)
            kill_family(self.family)
        self.kill()

    def interrupt(self) -> None:
        """SIGTERM now, noting first the processes it started: once it has ended, those in a
        session of their own cannot be found, and ``kill`` must still reach them."""
        if self.alive():
            self.look_for_family()
            self.process.terminate()

    def look_for_family(self) -> None:
        """Note the processes its envs started that run now (a rebuild's new simulator, say)."""
        if self.pid is not None:
            self.family.update(family(self.pid))

    def kill(self) -> None:
        """SIGKILL the worker and every process it started (even in another session, as mlagents
        starts Unity players); reap it. Safe to call twice."""
        if self.reaped:
            return
        if self.watched:
            self.state = ProcessState.CLOSING
        pid = self.pid
        if self.process.is_alive():
            self.look_for_family()
            self.process.kill()
        self.process.join(5.0)
        self.exitcode = self.process.exitcode
        if pid is not None and self.exitcode != 0:
            # Not closed by itself: what its envs started is no longer below it once it is gone (nor
            # ever was, if a launcher daemonized it; nor, dying by itself, when looked at above), but carries its tag.
            self.family.update(tagged(self.spec.parent_pid, pid, self.spec.nonce, self.born))
        kill_family(self.family)
        if pid is not None:
            kill_group(pid)
        try:
            self.conn.close()
        except OSError:
            pass
        if self.exitcode is not None:
            self.reaped = True  # first: a Ctrl-C in close() must not leave a closed process looked at
            self.process.close()  # releases the sentinel fd now, not at garbage collection
            if self.state is ProcessState.CLOSING:
                self.state = ProcessState.CLOSED


def start(process: Any) -> None:
    """Start ``process`` with SIGINT blocked in this thread, so the child starts with it blocked (a
    Ctrl-C reaches the whole group, the child too until it left it, and printed a traceback from its
    start-up; not under forkserver, whose server others share). Forked with objects frozen
    (``gc.freeze``, unless the program froze some itself): a finalizer in the child may call into a
    library whose lock another thread held at the fork (gRPC's, Ray's), and hang."""
    method = getattr(process, "_start_method", None)
    masks = hasattr(signal, "pthread_sigmask") and method != "forkserver"  # (not the shared forkserver's mask)
    if masks and method != "fork":
        resource_tracker.ensure_running()  # (its first start unblocks SIGINT in this thread: before, not during)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, []) if masks else None  # (reads it)
    freeze = method == "fork" and not gc.get_freeze_count()
    try:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # (a Ctrl-C raised here: restored below)
        if freeze:
            gc.freeze()
        process.start()
    finally:
        try:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # first: a Ctrl-C now is raised once it is restored
        finally:
            if freeze:
                gc.unfreeze()


#: Libraries whose threads, once started, can hang a forked child that uses them (torch's
#: OpenMP pool, gRPC's); numpy's OpenBLAS pool, always there, is fork-safe.
FORK_UNSAFE = ("torch", "grpc", "tensorflow", "jax")


def forked_from() -> str:
    """The fork-unsafe libraries (``FORK_UNSAFE``) this process has loaded, if it runs threads."""
    loaded = [name for name in FORK_UNSAFE if name in sys.modules]
    return " and ".join(loaded) if loaded and psutil.Process().num_threads() >= 2 else ""


def kill_group(pid: int) -> None:
    """SIGKILL anything left in process ``pid``'s process group (POSIX)."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
