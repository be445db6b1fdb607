"""What runs next to an env: in a worker (through ``call_on``) or in this process.

* :func:`record`: ``reset(seed)`` and the given actions, every output kept as the env gave it
  (copies: an env may reuse its arrays), exceptions caught with whether they pickle;
* :func:`close_leaks`: build, use and close a fresh env twice, and see what is left after
  ``close()`` -- processes and shared memory after either round, threads and file descriptors
  after the second (the first may start what a library keeps for good: thread pools, caches);
  what it finds it also ends (processes) and removes (shared memory);
* :func:`gym_checker`: gymnasium's ``check_env`` on a fresh env;
* :class:`Cleanup`: the same bookkeeping around this process's own runs of the env.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import re
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import psutil

from envmanager.check.travel import describe, round_trip_error
from envmanager.worker.envs import ENV_RAISES, Stopped

__all__ = ["Raised", "Trajectory", "Leaks", "CheckerResult", "Cleanup", "record", "record_fresh", "close_leaks", "gym_checker",
           "shm_in_use", "dev_shm", "remove_shared_memory", "end_processes"]

MAX_BYTES = 16 << 20  # of observations kept per trajectory
SETTLE_S = 0.5  # after close(): how long threads and processes get to end
DEV_SHM = "/dev/shm"
#: What an env's call may raise that :func:`record` keeps as the env's error in this process: an
#: env's ``sys.exit()`` too, not ``KeyboardInterrupt`` (here that is the user's Ctrl-C). In a
#: worker the probes keep what the worker reports as the env's (``ENV_RAISES``: its
#: ``KeyboardInterrupt`` too), never the worker's own ``Stopped``.
HERE_RAISES = (Exception, SystemExit)


@dataclass
class Raised:
    """An exception from the env: where (``reset`` or ``step t``), and whether it pickles."""

    where: str
    index: int  # the trajectory entry it cut short (0: the reset)
    type: str
    message: str
    traceback: str
    pickle_error: str | None


@dataclass
class Trajectory:
    """Entry 0 is the reset, entry t the result of action t (``next_step`` autoreset: the entry
    after an episode's end is a reset). ``infos[t]`` is ``None`` for a dict that pickles, else
    ``(problem id, what is wrong)``."""

    observations: list[Any] = field(default_factory=list)
    rewards: list[Any] = field(default_factory=list)
    terminated: list[Any] = field(default_factory=list)
    truncated: list[Any] = field(default_factory=list)
    infos: list[tuple[str, str] | None] = field(default_factory=list)  # (problem id, what is wrong)
    raised: Raised | None = None
    pid: int = 0
    cut: bool = False  # the time limit stopped it before the last action


    def __len__(self) -> int:
        return len(self.observations)


@dataclass
class Leaks:
    """What a fresh env left after ``close()``, by kind, and what the probe ended or removed."""

    processes: list[str] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)
    fds: list[str] = field(default_factory=list)
    shared_memory: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class CheckerResult:
    error: str | None
    warnings: list[str]


def _keep(value: Any) -> Any:
    """A copy of ``value`` that can travel back (its repr if it cannot be pickled)."""
    try:
        pickle.dumps(value)
    except Exception:
        return Unpicklable(f"{type(value).__name__} {value!r:.80}")
    return copy.deepcopy(value)


@dataclass(frozen=True)
class Unpicklable:
    """Stands in for an output that could not be pickled back."""

    text: str


def _raised(where: str, index: int, exc: BaseException) -> Raised:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    return Raised(where, index, name, str(exc), tb, round_trip_error(exc))


def _info_problem(info: Any) -> tuple[str, str] | None:
    if not isinstance(info, dict):
        return "info-not-dict", f"a {type(info).__name__}, not a dict: {info!r:.80}"
    if round_trip_error(info) is None:
        return None
    return "info-not-picklable", describe(info, "info", round_trip_error) or "it does not pickle"


def _nbytes(value: Any) -> int:
    try:
        return len(pickle.dumps(value))
    except Exception:
        return 0


def record(env: Any, seed: int, actions: list[Any],
           catch: tuple[type[BaseException], ...] = HERE_RAISES, seconds: float | None = None) -> Trajectory:
    """``env.reset(seed=seed)``, then ``actions`` one by one (an episode's end is followed by a
    reset, as envmanager's ``next_step`` autoreset does); stops at the first exception of the
    kinds ``catch`` names (see ``HERE_RAISES``), and before the next action once ``seconds`` have
    passed since the first reset returned (``cut``; an env slow to build or reset is not cut for it)."""
    out = Trajectory(pid=os.getpid())
    size = 0

    def add(obs: Any, reward: Any, terminated: Any, truncated: Any, info: Any) -> None:
        nonlocal size
        out.observations.append(_keep(obs))
        out.rewards.append(_keep(reward))
        out.terminated.append(_keep(terminated))
        out.truncated.append(_keep(truncated))
        out.infos.append(_info_problem(info))
        size += _nbytes(obs)

    try:
        obs, info = env.reset(seed=seed)
    except Stopped:
        raise
    except catch as exc:
        out.raised = _raised(f"reset(seed={seed})", 0, exc)
        return out
    add(obs, None, False, False, info)
    done = False
    until = None if seconds is None else time.monotonic() + seconds
    for t, action in enumerate(actions, 1):
        if until is not None and time.monotonic() >= until:
            out.cut = True
            break
        where = f"reset after the episode ended at step {t - 1}" if done else f"step {t}"
        try:
            if done:
                obs, info = env.reset()
                reward, terminated, truncated = 0.0, False, False
            else:
                obs, reward, terminated, truncated, info = env.step(action)
        except Stopped:
            raise
        except catch as exc:
            out.raised = _raised(where, t, exc)
            break
        add(obs, reward, terminated, truncated, info)
        try:
            done = bool(terminated or truncated)
        except Exception:  # a flag with no truth value (an array): reported as such, not stepped on
            done = False
        if size > MAX_BYTES:
            break
    return out


# ---------------------------------------------------------------------------------------------
# What a process holds


def _infrastructure(proc: psutil.Process) -> bool:
    """multiprocessing's own long-lived helpers (resource tracker, forkserver)."""
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def _children() -> dict[int, str]:
    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or _infrastructure(proc):
                continue
            out[proc.pid] = " ".join(proc.cmdline())[:120] or proc.name()
        except psutil.Error:
            continue
    return out


def _threads() -> dict[int, str]:
    names = {t.native_id: f"{t.name!r} (Python thread{', daemon' if t.daemon else ''})" for t in threading.enumerate()}
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return {tid: names.get(tid, "a native thread") for tid in (t.id for t in psutil.Process().threads())}
    out = {}
    for tid in tids:
        if tid not in names:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names[tid] = f"{f.read().strip()!r} (native thread)"
            except OSError:
                continue
        out[tid] = names[tid]
    return out


def _fds() -> dict[int, str]:
    try:
        listed = os.listdir("/proc/self/fd")
    except OSError:
        return {f.fd: f.path for f in psutil.Process().open_files()}
    out = {}
    for fd in listed:
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed meanwhile
            continue
    return out


def _shm_in_use() -> set[str]:
    """Names of the ``/dev/shm`` files this process maps or has open."""
    paths = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(DEV_SHM + "/"):
                    paths.add(parts[5].strip())
    except OSError:
        return set()
    paths |= {target for target in _fds().values() if target.startswith(DEV_SHM + "/")}
    return {p[len(DEV_SHM) + 1:].removesuffix(" (deleted)") for p in paths if not p.endswith(" (deleted)")}


def dev_shm() -> set[str]:
    try:
        return set(os.listdir(DEV_SHM))
    except OSError:
        return set()


def end_processes(pids: list[int]) -> None:
    """Kill ``pids`` and reap those that are our children."""
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5.0)


def remove_shared_memory(names: list[str]) -> None:
    """Unlink ``/dev/shm`` segments (through ``SharedMemory`` where it can, which keeps
    multiprocessing's resource tracker in step)."""
    from multiprocessing import shared_memory

    for name in names:
        try:
            segment = shared_memory.SharedMemory(name=name)
        except Exception:
            try:
                os.unlink(os.path.join(DEV_SHM, name))
            except OSError:
                pass
            continue
        segment.close()
        try:
            segment.unlink()
        except OSError:
            pass


class Cleanup:
    """Around runs of an env in this process: what it started and left (processes, shared
    memory it mapped or opened) is ended and removed at :meth:`finish`, which returns it."""

    def __init__(self) -> None:
        self.children = _children()
        self.dev_shm = dev_shm()
        self.seen_shm: set[str] = set()

    def watch(self) -> None:
        """Note the shared memory in use now (call it while the env is alive)."""
        self.seen_shm |= _shm_in_use()

    def finish(self) -> tuple[list[str], list[str]]:
        """End what is left; ``(processes, shared memory)`` described."""
        gc.collect()
        self.watch()
        left = _settle(lambda: {p: c for p, c in _children().items() if p not in self.children})
        shm = sorted(n for n in self.seen_shm if n not in self.dev_shm and n in dev_shm())
        end_processes(list(left))
        remove_shared_memory(shm)
        return [f"pid {pid}: {cmd}" for pid, cmd in left.items()], shm


def _settle(left: Any) -> dict[int, str]:
    """``left()`` once it is empty, or after :data:`SETTLE_S`: what close() started to end
    (a thread told to stop, a child told to exit) gets the time to do so."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        found = left()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------
# Probes run in a worker through ``call_on(fn)``: ``fn(env, *args)``, the slot's env unused


def record_fresh(_env: Any, factory: bytes, seed: int, actions: list[Any], seconds: float | None = None) -> Trajectory:
    """:func:`record` on a fresh env 0, as this process records one (the slot's env has been
    used), no new action after ``seconds``; what it leaves is ended and removed."""
    cleanup = Cleanup()
    try:
        env = cloudpickle.loads(factory)(0)
        try:
            trajectory = record(env, seed, actions, ENV_RAISES, seconds)
            cleanup.watch()
        finally:
            env.close()
    finally:
        cleanup.finish()
    return trajectory


def close_leaks(_env: Any, factory: bytes, seed: int, actions: list[Any]) -> Leaks:
    """Build a fresh env twice, reset and step it a little, close it; what is left (see the
    module doc). Found processes are killed and found shared memory unlinked."""
    make = cloudpickle.loads(factory)
    leaks = Leaks()
    processes: dict[int, str] = {}
    segments: set[str] = set()
    for cycle in (1, 2):
        before_children, before_threads, before_fds, before_shm = _children(), _threads(), _fds(), dev_shm()
        try:
            env = make(0)
            try:
                _use(env, seed, actions[:5])
                in_use = _shm_in_use()
            finally:
                env.close()
            del env
        except Exception as exc:
            leaks.error = f"{type(exc).__name__}: {exc}"
            break
        gc.collect()
        in_use |= _shm_in_use()
        found = _settle(lambda before=before_children: {p: c for p, c in _children().items() if p not in before})
        processes.update(found)
        segments |= {n for n in in_use if n not in before_shm and n in dev_shm()}
        if cycle == 2:
            threads = _settle(lambda before=before_threads: {t: n for t, n in _threads().items() if t not in before})
            leaks.threads = [f"thread {tid}: {name}" for tid, name in threads.items()]
            fds = {fd: target for fd, target in _fds().items() if before_fds.get(fd) != target}
            leaks.fds = [f"fd {fd}: {target}" for fd, target in sorted(fds.items())]
    leaks.processes = [f"pid {pid}: {cmd}" for pid, cmd in processes.items()]
    leaks.shared_memory = [f"{DEV_SHM}/{name}" for name in sorted(segments)]
    end_processes(list(processes))
    remove_shared_memory(sorted(segments))
    return leaks


def shm_in_use(_env: Any) -> set[str]:
    """The ``/dev/shm`` names this worker maps or has open (its envs' segments, for removal
    once the worker is gone)."""
    return _shm_in_use()


def _use(env: Any, seed: int, actions: list[Any]) -> None:
    """Reset and step ``env`` a little; its exceptions are another check's business."""
    try:
        env.reset(seed=seed)
        for action in actions:
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
    except Stopped:
        raise
    except ENV_RAISES:
        pass


_NOISE = ("is different from the unwrapped version",)
_COLOR = re.compile(r"\x1b\[[0-9;]*m")


def gym_checker(_env: Any, factory: bytes) -> CheckerResult:
    """gymnasium's ``check_env`` (render checks skipped: they may open windows) on a fresh env;
    what it leaves is ended and removed."""
    from gymnasium.utils.env_checker import check_env

    cleanup = Cleanup()
    error = None
    try:
        env = cloudpickle.loads(factory)(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                check_env(env, skip_render_check=True)
            except Stopped:
                raise
            except ENV_RAISES as exc:
                error = f"{type(exc).__name__}: {exc}"
            finally:
                cleanup.watch()
                try:
                    env.close()
                except Exception:
                    pass
    finally:
        cleanup.finish()
    messages = list(dict.fromkeys(_COLOR.sub("", str(w.message)).removeprefix("WARN: ") for w in caught))
    return CheckerResult(error, [m for m in messages if not any(n in m for n in _NOISE)])
