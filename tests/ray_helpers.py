"""What the Ray test modules share: a policy that shows what it saw, envs with faults, and checks
that processes are gone (Ray's own processes live for a whole module, so the suite's per-test
leak check is replaced there by explicit checks of the env processes each test started)."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time

import numpy as np
import psutil
import pytest

from process_helpers import alive
from sampler_envs import KindEnv

#: A node's start-up deadline in the Ray tests (not a fault they test): a Ray worker, a forkserver and
#: env processes, which under CI's load (three pytest processes with a Ray session each, the legs'
#: installs alongside, on two cores) took over 60 s. A test that waits on it has a pytest timeout
#: above it (the module's ``pytestmark``, or its own).
NODE_START_S = 180.0

class IdPolicy:
    """Random actions; agent infos carry the slot ids the policy was given and its parameters."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.params = 0

    def get_actions(self, observations, worker_ids):
        n = len(worker_ids)
        return self.rng.integers(0, 2, n), {"ids": np.asarray(worker_ids), "params": np.full(n, self.params)}

    def set_param_values(self, params) -> None:
        self.params = params


class SeedEnv(KindEnv):
    """``KindEnv`` whose observation's last field is the seed its episode's reset got (-1: none)."""

    def reset(self, *, seed=None, options=None):
        _, info = super().reset(seed=seed, options=options)
        self.bonus = -1.0 if seed is None else float(seed)
        return self._obs(), info


def seed_env(worker_id: int) -> SeedEnv:
    return SeedEnv()


def pickle_by_value() -> None:
    """Ray workers need not import the tests directory: ship these modules' code by value."""
    import cloudpickle
    from ray import cloudpickle as ray_cloudpickle  # Ray pickles with its own copy

    for name in ("sampler_envs", "ray_helpers", "fault_envs"):
        module = importlib.import_module(name)
        cloudpickle.register_pickle_by_value(module)
        ray_cloudpickle.register_pickle_by_value(module)


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for a module (the user's session: samplers must leave it running);
    after its shutdown no process of it is left. A module takes it with ``autouse``."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local test session: no token written to ~/.ray
    pickle_by_value()
    temp_dir = tempfile.mkdtemp(prefix="rayt")  # short: Ray's socket paths live under it
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
        yield
    finally:  # a session that failed to start too: what it started must not outlive the module
        ray.shutdown()
        left = alive([p.pid for p in children()], timeout=15)
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"processes left after ray.shutdown(): {left}"


def node_trees(sampler) -> list[int]:
    """Every node actor's pid and every process under it now (env workers, restarted ones too,
    and the actor's forkserver)."""
    pids = []
    for info in sampler.node_info():
        if not info:  # a node whose last start failed
            continue
        try:
            below = psutil.Process(info["pid"]).children(recursive=True)
        except psutil.Error:
            below = []
        pids += [info["pid"], *(p.pid for p in below)]
    return pids


def node_pids(sampler) -> list[int]:
    """Every node actor's pid and its env worker pids."""
    return [pid for info in sampler.node_info() if info for pid in [info["pid"], *info["worker_pids"]]]


def _helper(p: psutil.Process) -> bool:
    """multiprocessing's own helpers (resource tracker, forkserver), or a process already gone."""
    try:
        cmdline = " ".join(p.cmdline())
    except psutil.Error:
        return True
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def children() -> list[psutil.Process]:
    """Processes under this one, less multiprocessing's own helpers (as the suite's leak check)."""
    return [p for p in psutil.Process().children(recursive=True) if not _helper(p)]


def no_contiguity_gaps(batch) -> None:
    """Within each episode, the env's step counter (observation 0 of next_observations) runs
    1, 2, 3, ... with nothing missing or repeated."""
    for episode in np.unique(batch.episode_ids):
        ts = batch.next_observations[batch.episode_ids == episode, 0]
        assert ts.tolist() == list(range(int(ts[0]), int(ts[0]) + len(ts))), f"episode {episode}: {ts.tolist()}"


class SlowEnv(KindEnv):
    """``KindEnv`` whose every step takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def step(self, action):
        time.sleep(self.delay)
        return super().step(action)


def slow_restart_factory(marker: str, start_delay: float, step_delay: float):
    """Slot 0 takes ``start_delay`` seconds to build once it was built before (a slow restart);
    slot 1 steps slowly (its fragments are under way while slot 0 restarts)."""
    def factory(worker_id: int):
        if worker_id != 0:
            return SlowEnv(step_delay)
        if os.path.exists(marker):
            time.sleep(start_delay)
        open(marker, "w").close()
        return KindEnv()
    return factory


class ClosedFileEnv(KindEnv):
    """``KindEnv`` that leaves a file ``closed-<slot>`` in ``directory`` when it is closed."""

    def __init__(self, directory: str, slot: int) -> None:
        super().__init__()
        self.directory, self.slot = directory, slot

    def close(self) -> None:
        open(os.path.join(self.directory, f"closed-{self.slot}"), "w").close()
        super().close()


def pid_file_factory(directory: str, fail_slot: int):
    """Each env leaves its process id in ``directory`` (``pid-<slot>``), and a file when closed;
    slot ``fail_slot``'s env cannot be built."""
    def factory(worker_id: int):
        with open(os.path.join(directory, f"pid-{worker_id}"), "w") as f:
            f.write(str(os.getpid()))
        if worker_id == fail_slot:
            raise ValueError(f"slot {worker_id} cannot be built")
        return ClosedFileEnv(directory, worker_id)
    return factory


def raising_factory(marker: str, slot: int, at: int):
    """Slot ``slot``'s env raises ``RuntimeError("env blew up")`` at its ``at``-th step, once."""
    def factory(worker_id: int):
        return KindEnv(marker, at, "raise") if worker_id == slot else KindEnv()
    return factory


def reset_raising_once_factory(marker: str, slot: int, episode_length: int = 5):
    """``ControlledEnv`` s of ``episode_length`` steps; slot ``slot``'s first env raises in its
    first reset, once (it leaves ``marker``; the env made again in its place does not)."""
    def factory(worker_id: int):
        from envmanager.testing.envs import ControlledEnv

        first = worker_id == slot and not os.path.exists(marker)
        if first:
            open(marker, "w").close()
        return ControlledEnv(worker_id, episode_length=episode_length, fault="raise_reset" if first else None)
    return factory
