"""The worker process: its start-up arguments, its loop and its handler table.

A worker builds its envs, answers READY, then reads requests from its own pipe and posts
every answer through the transport (the shared step queue, or its own pipe: see
``envmanager.wire.transport``). It never raises out of the loop: anything that fails
on a request's account (decoding it, running it, encoding the answer) becomes an
ENV_FAILED answer carrying the traceback, and the worker keeps serving. It closes its envs in
``finally`` and exits by itself if the parent process dies.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import psutil

from envmanager.wire.mailbox import MailboxLayout, WorkerMailbox
from envmanager.wire.marks import WorkerMarks
from envmanager.wire.messages import (
    EnvironmentCommand as Cmd,
)
from envmanager.wire.messages import (
    Step,
    Stepped,
    decode_request,
    decode_request_header,
    encode_answer,
    lanes_of,
)
from envmanager.wire.shm import SharedFile
from envmanager.wire.transport import MailboxLink, link_for
from envmanager.worker.envs import ENV_RAISES, Stopped, WorkerEnvs, remote_exception
from envmanager.worker.family import family, kill_family, left_behind, tag

__all__ = ["WorkerSpec", "worker_main", "HANDLERS"]

PARENT_CHECK_INTERVAL = 0.5  # seconds between checks that the parent is still alive
EXIT_GRACE = 5.0  # seconds a worker whose parent died gets to close its envs
_new = tuple.__new__  # a NamedTuple made without its constructor's overhead (once per request)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start; picklable under every start method.

    ``index`` is the process index; ``env_ids`` the env slots (public ``worker_id``s) it hosts;
    ``generations``: each env's generation, as the parent's supervisor counts it (answers carry it).
    """

    index: int
    env_ids: tuple[int, ...]
    factory: bytes  # cloudpickled ``env_factory(worker_id) -> env``
    autoreset_mode: str
    parent_pid: int
    spin_s: float = 0.0  # at most this many seconds spun for the next command before blocking on the pipe
    info_columns: bool = False  # the parent batches infos: send them as columns where they fit
    double_buffer: bool = False  # its envs form two lanes, answered one after the other
    generations: tuple[int, ...] = ()  # (empty: all 0)
    options_if_given: bool = False  # reset(seed=) without options= when they are None (SB3's workers)
    reset_info_apart: bool = False  # a same-step autoreset's reset info under RESET_INFO, not merged (SB3's workers)
    nonce: str = ""  # this start's own (``WorkerProcess``): its tag is no other process's, a later one given its pid


#: The worker's half of every command: request message -> answer message.
HANDLERS: dict[Cmd, Callable[[WorkerEnvs, Any], Any]] = {
    Cmd.STEP: WorkerEnvs.step,
    Cmd.RESET: WorkerEnvs.reset,
    Cmd.CALL: WorkerEnvs.call,
    Cmd.GET_ATTR: WorkerEnvs.get_attr,
    Cmd.SET_ATTR: WorkerEnvs.set_attr,
    Cmd.ATTACH: WorkerEnvs.attach,
    Cmd.REBUILD: WorkerEnvs.rebuild,
}


def worker_main(spec: WorkerSpec, conn: Connection, queue_writer: Connection | None, file: SharedFile | None = None,
                mailbox: tuple[SharedFile, MailboxLayout] | None = None, marks: SharedFile | None = None) -> None:
    """Entry point of a worker process; ``queue_writer`` is ``None`` on the portable transport,
    ``file`` the pool's shared memory, if it has one, ``mailbox`` the pool's mailboxes (their
    file and layout), if it has them, ``marks`` the file of the records saying which env is in
    which call (``envmanager.wire.marks``), if it has one."""
    own_process_group()
    tag(spec.parent_pid, spec.nonce)  # what the envs start carries it: found once this process is gone (``family``)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    _default_fatal_signals()
    threading.Thread(target=watch_parent, args=(spec.parent_pid, os.getppid()), daemon=True).start()

    box = WorkerMailbox(mailbox[0], mailbox[1], spec.index) if mailbox is not None else None
    if mailbox is not None:
        mailbox[0].close()  # the mapping keeps it
    link = link_for(conn, queue_writer, spec.spin_s, box)
    record = WorkerMarks(marks, spec.index)
    if marks is not None:
        marks.close()  # the mapping keeps it
    words, at = record.words, record.at

    def post(cmd: Cmd, seq: int, answer: Any) -> None:
        try:
            header, payload = encode_answer(cmd, spec.index, seq, time.monotonic(), answer)
        except Exception as exc:  # an answer that does not pickle fails its request only
            failure = remote_exception(envs.current, exc)
            header, payload = encode_answer(Cmd.ENV_FAILED, spec.index, seq, time.monotonic(), failure)
        link.post(header, payload)

    envs = WorkerEnvs(spec.env_ids, spec.factory, spec.autoreset_mode, file, spec.info_columns, record, spec.generations,
                      spec.options_if_given, spec.reset_info_apart)
    try:
        try:
            ready = envs.build()
        except Stopped:
            raise
        except ENV_RAISES as exc:
            post(Cmd.ENV_FAILED, 0, remote_exception(envs.current, exc))
            return
        finally:
            envs.unmark()
        post(Cmd.READY, 0, ready._replace(family=tuple(family().items())))
        lanes = lanes_of([len(spec.env_ids)], spec.double_buffer)
        while True:
            data = link.read()  # spins first where the worker has a core of its own (spec.spin_s)
            if data is None:  # the step board asks for steps (the mailbox's link only)
                serve_steps(envs, link, lanes, spec.index)
                continue
            cmd, seq, form = decode_request_header(data)
            if cmd is Cmd.CLOSE:
                break
            try:
                answer = HANDLERS[cmd](envs, decode_request(cmd, form, data))
            except Stopped:
                raise
            except ENV_RAISES as exc:  # an env's sys.exit() or KeyboardInterrupt too: its error, not our exit
                cmd, answer = Cmd.ENV_FAILED, remote_exception(envs.current, exc)
            words[at] = 0  # in no env's call (``envs.unmark``, inline: once per request)
            post(cmd, seq, answer)
    except (Stopped, EOFError, BrokenPipeError):
        pass  # parent gone or asked us to stop: fall through to cleanup
    finally:
        # Closing now: a SIGTERM (the parent interrupting a step it saw as busy, which may have
        # asked CLOSE at the same time) must not cut the envs' close short, as a SystemExit in the
        # middle of it would (a Unity player killed instead of told to quit, a gRPC server left
        # half stopped). The parent still kills us if the close outlasts its grace. A SIGTERM that
        # lands before SIGTERM is ignored raises its SystemExit here: caught, and ignore again.
        while True:
            try:
                _ignore_sigterm()
                break
            except Stopped:
                pass
        envs.close()
        _end_left_behind()
        try:
            header, payload = encode_answer(Cmd.CLOSED, spec.index, -1, time.monotonic(), None)
            link.farewell(header + payload)
        except Exception:
            pass


def serve_steps(envs: WorkerEnvs, link: MailboxLink, lanes: list[int], index: int) -> None:
    """The worker's half of the step board's steps (the parent's: ``WorkerPool.post_steps``):
    step every env it asks for, their actions in shared memory, one lane at a time, and answer
    each lane as soon as its results are in shared memory (double buffered, the parent turns
    one lane around while the other steps)."""
    locals_, ordinals = link.box.steps()
    first = lanes[locals_[0]]
    groups = [(locals_, ordinals)]
    if lanes[locals_[-1]] != first:  # both lanes asked: the first one's answer goes first
        cut = next(n for n, i in enumerate(locals_) if lanes[i] != first)
        groups = [(locals_[:cut], ordinals[:cut]), (locals_[cut:], ordinals[cut:])]
    for own, asked in groups:
        try:  # infos as dicts: the board's info rows take them, or a notice (as columns if they fit)
            stepped = envs.step(_new(Step, (tuple(own), None)), columns=False)
        except Stopped:
            raise
        except ENV_RAISES as exc:  # (envs.step reports an env's own error per env; this is anything else)
            stepped = _failed(envs, own, exc)
        envs.unmark()
        slots = [envs.env_ids[i] for i in own]
        try:
            link.answer_steps(own, asked, stepped, slots, envs.info_columns, index)
        except Exception as exc:  # a notice that does not pickle (an info holding a lock): its steps fail, as post()'s
            link.answer_steps(own, asked, _failed(envs, own, exc), slots, envs.info_columns, index)


def _failed(envs: WorkerEnvs, own: list[int], exc: BaseException) -> Stepped:
    """The answer of board steps ``own`` that failed together with ``exc`` (and its traceback)."""
    failure = remote_exception(envs.current, exc)
    return Stepped([0.0] * len(own), None, dict.fromkeys(range(len(own)), failure), generations=envs.stamp(own))


def _default_fatal_signals() -> None:
    """A forked worker inherits the parent's handlers of fatal signals, which some libraries
    replace (pygame's "parachute" turns a segfault into an abort): restore the defaults, so a
    crash ends the worker with its own signal and the error names it. Python's faulthandler, if
    the parent enabled it, is enabled again on top (it dumps the traceback, then re-raises)."""
    dumping = faulthandler.is_enabled()
    if dumping:
        faulthandler.disable()
    for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL"):
        number = getattr(signal, name, None)
        if number is not None:
            try:
                signal.signal(number, signal.SIG_DFL)
            except (OSError, ValueError):  # not settable here
                pass
    if dumping:
        try:
            faulthandler.enable()
        except Exception:  # sys.stderr replaced by an object without a file descriptor
            try:
                faulthandler.enable(file=2)  # the process's stderr
            except Exception:
                pass


def _end_left_behind() -> None:
    """Kill what the envs started and their ``close()`` left running: a simulator in a session of
    its own is out of the parent's reach once this process is gone."""
    kill_family(left_behind())


def own_process_group() -> None:
    """Leave the parent's process group: a Ctrl-C at the terminal goes to the parent, which closes
    us, and killing our group reaches what the envs start. The parent started us with SIGINT
    blocked (``envmanager.core.process.start``), so a Ctrl-C that came while we were still in its
    group, before this, was its own: discarded here, where it would have been our traceback."""
    try:
        os.setpgid(0, 0)
    except (OSError, AttributeError):  # AttributeError: no process groups (Windows)
        pass
    if hasattr(signal, "pthread_sigmask"):
        if signal.SIGINT in signal.sigpending():
            signal.sigwait({signal.SIGINT})  # (taken: not delivered)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _ignore_sigterm() -> None:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (ValueError, OSError):  # not the main thread, or no such signal
        pass


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise Stopped(128 + signum)


def watch_parent(parent_pid: int, ppid_at_start: int) -> None:
    """Exit when the parent is gone: first gracefully (SIGTERM), then hard."""
    while True:
        time.sleep(PARENT_CHECK_INTERVAL)
        if os.getppid() != ppid_at_start or not _pid_alive(parent_pid):
            break
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_GRACE)
    _kill_own_group()


def _pid_alive(pid: int) -> bool:
    # Not ``os.kill(pid, 0)``: on Windows that sends CTRL_C_EVENT (0) instead of probing.
    return psutil.pid_exists(pid)


def _kill_own_group() -> None:
    try:
        if os.getpgid(0) == os.getpid():  # we lead our group: take our children with us
            os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(1)
