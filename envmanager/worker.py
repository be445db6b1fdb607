"""The worker process, and the parent's handle on it.

A worker hosts ``len(spec.env_ids)`` environments. It reads :class:`EnvironmentRequest`s
from its own pipe, runs them, and posts every answer on the shared step queue. It never
raises out of the loop: an exception in an environment becomes an ``ENV_EXITED`` answer
carrying the traceback, and the worker keeps serving. It closes its environments in
``finally`` and exits by itself if the parent process dies.

The parent's side of each command lives in :class:`WorkerProcess` (send, fetch a large
answer, stop); the manager decides what to send.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import cloudpickle

from envmanager.errors import WorkerDiedError
from envmanager.protocol import (
    EnvFunction,
    EnvironmentCommand as Cmd,
    EnvironmentRequest,
    RemoteException,
    decode_request_header,
    encode_notice,
    encode_payload,
    encode_request,
    request_payload,
)
from envmanager.transport import SharedBuffers, StepQueue, read_message

logger = logging.getLogger(__name__)

NEXT_STEP, SAME_STEP, DISABLED = "next_step", "same_step", "disabled"
PARENT_CHECK_INTERVAL = 0.5  # seconds between checks that the parent is still alive
EXIT_GRACE = 5.0  # seconds a worker whose parent died gets to close its envs


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start; picklable under every start method."""

    index: int
    env_ids: tuple[int, ...]
    factory: bytes  # cloudpickled ``env_factory(env_id) -> env``
    autoreset_mode: str
    parent_pid: int
    spin_s: float = 0.0  # seconds to spin for the next command before blocking on the pipe


# =============================================================================================
# Worker side


class WorkerEnvs:
    """The environments of one worker process, with gymnasium's autoreset rules."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.env_ids = spec.env_ids
        self.autoreset_mode = spec.autoreset_mode
        self.envs: list[Any] = []
        self.autoreset = [False] * len(spec.env_ids)
        self.buffers: SharedBuffers | None = None
        self.current = spec.env_ids[0]  # the env being worked on, so an exception can name it

    def build(self) -> None:
        """Make the envs with the user's factory (``close`` closes those already made)."""
        factory: Callable[[int], Any] = cloudpickle.loads(self.spec.factory)
        for env_id in self.env_ids:
            self.current = env_id
            self.envs.append(factory(env_id))

    def describe(self) -> dict[str, Any]:
        env = self.envs[0]
        return {
            "env_ids": self.env_ids,
            "observation_space": getattr(env, "observation_space", None),
            "action_space": getattr(env, "action_space", None),
            "observation_spaces": [getattr(e, "observation_space", None) for e in self.envs],
            "action_spaces": [getattr(e, "action_space", None) for e in self.envs],
            "metadata": getattr(env, "metadata", {}),
            "render_mode": getattr(env, "render_mode", None),
            "spec": getattr(env, "spec", None),
        }

    def handle(self, request: EnvironmentRequest) -> Any:
        cmd, payload = request.cmd, request.payload
        if cmd is Cmd.STEP:
            return self.step(*payload)
        if cmd is Cmd.RESET:
            return self.reset(payload)
        if cmd is Cmd.CALL:
            local, name, args, kwargs = payload
            return [self._call(i, name, args, kwargs) for i in local]
        if cmd is Cmd.GET_ATTR:
            local, name = payload
            return [self._call(i, name, None, None) for i in local]
        if cmd is Cmd.SET_ATTR:
            local, name, values = payload
            for i, value in zip(local, values):
                self.current = self.env_ids[i]
                env = self.envs[i]
                if hasattr(env, "set_wrapper_attr"):
                    env.set_wrapper_attr(name, value)
                else:
                    setattr(env, name, value)
            return [None] * len(local)
        if cmd is Cmd.ATTACH:
            if self.buffers is not None:
                self.buffers.close()
            self.buffers = SharedBuffers.attach(payload)
            return None
        raise ValueError(f"unknown command {cmd!r}")

    def _call(self, i: int, name: str | EnvFunction, args: Any, kwargs: Any) -> Any:
        self.current = self.env_ids[i]
        env = self.envs[i]
        if isinstance(name, EnvFunction):
            return cloudpickle.loads(name)(env, *args, **kwargs)
        attr = env.get_wrapper_attr(name) if hasattr(env, "get_wrapper_attr") else getattr(env, name)
        if args is None:  # GET_ATTR
            return attr
        return attr(*args, **kwargs) if callable(attr) else attr

    def reset(self, items: list[tuple[int, Any, Any]]) -> list[tuple]:
        """Reset the listed envs: ``items`` are ``(local index, seed, options)``."""
        out = []
        for i, seed, options in items:
            self.current = self.env_ids[i]
            start = time.perf_counter()
            obs, info = self.envs[i].reset(seed=seed, options=options)
            elapsed = time.perf_counter() - start
            self.autoreset[i] = False
            out.append(self._emit(i, obs, 0.0, False, False, info, elapsed))
        return out

    def step(self, indices: list[int], actions: list[Any] | None) -> list[tuple]:
        """Step the listed envs; ``actions`` is ``None`` when they wait in shared memory."""
        out = []
        buffers = self.buffers
        for n, i in enumerate(indices):
            env_id = self.env_ids[i]
            self.current = env_id
            action = actions[n] if actions is not None else SharedBuffers.read(buffers.action, env_id)
            env = self.envs[i]
            start = time.perf_counter()
            if self.autoreset[i] and self.autoreset_mode == NEXT_STEP:
                obs, info = env.reset()
                reward, terminated, truncated = 0.0, False, False
            else:
                obs, reward, terminated, truncated, info = env.step(action)
                if (terminated or truncated) and self.autoreset_mode == SAME_STEP:
                    final = {"final_obs": obs, "final_info": info}
                    obs, info = env.reset()
                    info = {**final, **info}
            elapsed = time.perf_counter() - start
            self.autoreset[i] = bool(terminated or truncated)
            out.append(self._emit(i, obs, reward, terminated, truncated, info, elapsed))
        return out

    def _emit(self, i, obs, reward, terminated, truncated, info, elapsed) -> tuple:
        """Put what fits into shared memory; return the rest as ``(local, obs, r, term, trunc, info, t)``."""
        b = self.buffers
        if b is None:
            return (i, obs, reward, terminated, truncated, info, elapsed)
        slot = self.env_ids[i]
        b.reward[slot], b.terminated[slot], b.truncated[slot] = reward, terminated, truncated
        if b.observation is not None:
            SharedBuffers.write(b.observation, slot, obs)
            obs = None
        return (i, obs, None, None, None, info, elapsed)

    def close(self) -> None:
        for env_id, env in zip(self.env_ids, self.envs):
            try:
                env.close()
            except Exception:  # closing must go on for the others
                logger.exception("closing env %d failed", env_id)
        if self.buffers is not None:
            self.buffers.close()


def remote_exception(env_id: int, exc: BaseException) -> RemoteException:
    """Package ``exc`` so it always crosses the pipe, keeping the object when it pickles."""
    try:
        pickle.loads(pickle.dumps(exc))
        obj: BaseException | None = exc
    except Exception:
        obj = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return RemoteException(env_id, name, str(exc), tb, obj)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _watch_parent(parent_pid: int, ppid_at_start: int) -> None:
    """Exit when the parent is gone: first gracefully (SIGTERM), then hard."""
    while True:
        time.sleep(PARENT_CHECK_INTERVAL)
        if os.getppid() != ppid_at_start or not _pid_alive(parent_pid):
            break
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_GRACE)
    _kill_own_group()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_own_group() -> None:
    try:
        if os.getpgid(0) == os.getpid():  # we lead our group: take our children with us
            os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(1)


def worker_main(spec: WorkerSpec, conn: Connection, queue_writer: Connection) -> None:
    """Entry point of a worker process."""
    try:  # own process group: Ctrl-C at the terminal goes to the parent, which closes us
        os.setpgid(0, 0)
    except OSError:
        pass
    signal.signal(signal.SIGTERM, _raise_system_exit)
    threading.Thread(
        target=_watch_parent, args=(spec.parent_pid, os.getppid()), daemon=True
    ).start()

    def post(cmd: Cmd, seq: int, payload: bytes) -> None:
        notice = encode_notice(cmd, spec.index, seq, time.monotonic(), False)
        StepQueue.post(queue_writer, conn, notice, payload)

    envs: WorkerEnvs | None = None
    try:
        envs = WorkerEnvs(spec)
        try:
            envs.build()
            description = encode_payload(envs.describe())
        except Exception as exc:
            post(Cmd.ENV_EXITED, 0, encode_payload(remote_exception(envs.current, exc)))
            return
        post(Cmd.READY, 0, description)
        incoming = select.poll()
        incoming.register(conn.fileno(), select.POLLIN)
        spin = spec.spin_s
        while True:
            if spin > 0:  # a short spin: the next command often comes within microseconds
                until = time.perf_counter() + spin
                while not incoming.poll(0) and time.perf_counter() < until:
                    pass
            data = conn.recv_bytes()
            cmd, seq = decode_request_header(data)
            if cmd is Cmd.CLOSE:
                break
            # Everything that can fail on a request's account — unpickling it, running it,
            # pickling the answer — becomes an ENV_EXITED answer, never the worker's death.
            try:
                answer = envs.handle(EnvironmentRequest(cmd, seq, request_payload(data)))
                reply, payload = cmd, encode_payload(answer)
            except Exception as exc:
                reply, payload = Cmd.ENV_EXITED, encode_payload(remote_exception(envs.current, exc))
            post(reply, seq, payload)
    except (KeyboardInterrupt, SystemExit, EOFError, BrokenPipeError):
        pass  # parent gone or asked us to stop: fall through to cleanup
    finally:
        if envs is not None:
            envs.close()
        try:
            post(Cmd.CLOSED, -1, b"")
        except Exception:
            pass


# =============================================================================================
# Parent side


class WorkerProcess:
    """The parent's handle on one worker process: its pipe, its state, its lifetime."""

    def __init__(self, ctx: Any, spec: WorkerSpec, queue_writer: Connection, daemon: bool = True) -> None:
        self.spec = spec
        self.index = spec.index
        self.env_ids = spec.env_ids
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=worker_main,
            args=(spec, child_conn, queue_writer),
            name=f"envmanager-worker-{spec.index}",
            daemon=daemon,
        )
        self.process.start()
        child_conn.close()
        # The first answer is READY (seq 0), so the worker starts out busy with it.
        self.pending: EnvironmentRequest | None = EnvironmentRequest(Cmd.READY, 0)
        self.sent_at = time.monotonic()
        self.closing = False  # set once we asked it to stop: its exit is then expected
        self.failure: Exception | None = None  # set when it died or hung for good
        self.boot: list[tuple[Cmd, bytes]] | None = None  # requests left to bring a restart up
        self.boot_plan: list[tuple[Cmd, bytes]] = []  # all of them, should it fail on the way
        self.lost_request: EnvironmentRequest | None = None  # what a restart interrupted
        self.resumes_startup = False  # a restart during startup: answer the startup request
        self.reaped = False  # process joined and its handle released
        self.pid = self.process.pid
        self.exitcode: int | None = None

    @property
    def booting(self) -> bool:
        return self.boot is not None

    @property
    def busy(self) -> bool:
        return self.pending is not None

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def send(self, cmd: Cmd, seq: int, payload: bytes) -> None:
        """Send one request (``payload`` already pickled); the worker must be idle.

        ``seq`` comes from the pool's counter, unique across restarts, so an answer from a
        replaced process can never be taken for an answer to a newer request.
        """
        assert self.pending is None, f"worker {self.index} already has a request in flight"
        request = EnvironmentRequest(cmd, seq, payload)
        self.sent_at = time.monotonic()
        try:
            self.conn.send_bytes(encode_request(cmd, seq, payload))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise WorkerDiedError(self.index, self.process.exitcode, f": {exc!r}") from None
        self.pending = request

    def fetch_large_payload(self, timeout: float) -> bytes:
        """Read an answer's payload that came over this worker's own pipe (announced on the
        queue), within ``timeout``; ``EOFError`` if the worker dies meanwhile."""
        return read_message(self.conn, time.monotonic() + timeout, self.process.sentinel)

    def wait_exitcode(self, timeout: float = 2.0) -> int | None:
        """The exit code of a process that is ending (a core dump can delay it a little)."""
        if self.reaped:
            return self.exitcode
        self.process.join(timeout)
        return self.process.exitcode

    def alive(self) -> bool:
        return not self.reaped and self.process.is_alive()

    def request_close(self) -> None:
        """Ask the worker to close its envs and exit; from now on its exit is expected."""
        self.closing = True
        if self.alive():
            try:
                self.conn.send_bytes(encode_request(Cmd.CLOSE, -1, b""))
            except OSError:  # already gone
                pass

    def stop(self, timeout: float) -> None:
        """Ask the worker to close, then escalate to SIGTERM and SIGKILL (with its children)."""
        self.request_close()
        deadline = time.monotonic() + timeout
        if self.alive():
            self.process.join(max(0.0, deadline - time.monotonic()))
        if self.alive():
            log = logger.warning if timeout > 0 else logger.debug
            log("worker %d did not close in %.1f s; terminating it", self.index, timeout)
            self.process.terminate()  # SIGTERM: the worker still closes its envs on the way out
            self.process.join(min(1.0, max(0.1, deadline - time.monotonic())))
        self.kill()

    def kill(self) -> None:
        """SIGKILL the worker and every process it started (even in another session, as
        mlagents starts Unity players); reap it."""
        self.closing = True
        if self.reaped:
            return
        pid = self.pid
        family = descendants(pid) if pid is not None and self.process.is_alive() else []
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.exitcode = self.process.exitcode
        for child in family:
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)  # anything left in its process group
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.conn.close()
        except OSError:
            pass
        if self.exitcode is not None:
            self.process.close()  # releases the sentinel fd now, not at garbage collection
            self.reaped = True


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), from ``/proc`` (Linux);
    ``[]`` where there is no ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # fields after "(comm)": state, ppid
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found
