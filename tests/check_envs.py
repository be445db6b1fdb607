"""Envs for the ``envmanager check`` tests: a good one, and variants that each have exactly one
defect. Module level, so spawn and forkserver workers import them by name."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envmanager.testing.envs import burn_cpu

#: Read by ``RuntimeSettingEnv`` at every step: a test changes it at run time, in this process only.
SETTINGS = {"gravity": 9.8}


class GoodEnv(gym.Env):
    """A point pushed left or right, seeded from reset's seed; episodes of 20 steps."""

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-10.0, 10.0, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.state = np.zeros(3)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.state = self.np_random.uniform(-1.0, 1.0, 3)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        self.state = np.clip(self.state + (0.1 if action else -0.1) + self._noise(), -5.0, 5.0)
        return self._obs(), float(self.state[0]), False, self.t >= 20, {"t": self.t}

    def _noise(self) -> np.ndarray:
        return self.np_random.normal(0.0, 0.05, 3)

    def _obs(self) -> np.ndarray:
        return self.state.astype(np.float32)


class MillisecondEnv(GoodEnv):
    """A good env whose every step computes for 1 ms of CPU time."""

    def step(self, action):
        burn_cpu(1e-3)
        return super().step(action)


class SlowStepEnv(GoodEnv):
    """A good env whose every step waits 50 ms: slow, far from any deadline."""

    def step(self, action):
        time.sleep(0.05)
        return super().step(action)


class SlowThirdStepEnv(GoodEnv):
    """A good env whose third step after a reset takes 3 s: under a short time limit the limit
    ends the wait for it, far from the per-step deadline."""

    def step(self, action):
        if self.t == 2:
            time.sleep(3.0)
        return super().step(action)


class SlowSecondBuildEnv(GoodEnv):
    """A good env that takes 3 s to build the second time in a process (a worker's fresh env,
    built after its slot's)."""

    built = 0

    def __init__(self) -> None:
        super().__init__()
        SlowSecondBuildEnv.built += 1
        if SlowSecondBuildEnv.built == 2:
            time.sleep(3.0)


class FreeEnv(gym.Env):
    """Next to nothing per step (~1 µs): in process it beats any layout of processes by far."""

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 1.0, (1,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(1, np.float32), 0.0, False, self.t >= 100, {}


def make_good(worker_id: int) -> gym.Env:
    return GoodEnv()


def make_good_no_id() -> gym.Env:
    return GoodEnv()


def make_needs_missing_package() -> gym.Env:
    """An env whose simulator is not installed: what ``gymnasium.make("HalfCheetah-v5")`` raises without mujoco."""
    raise gym.error.DependencyNotInstalled('NoSuchSim is not installed, run `pip install "nosuchsim"`')


# -- determinism --------------------------------------------------------------------------------


class UnseededEnv(GoodEnv):
    """Ignores reset's seed: its noise comes from an RNG seeded from the OS."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng()

    def _noise(self) -> np.ndarray:
        return self.rng.normal(0.0, 0.05, 3)


class RuntimeSettingEnv(GoodEnv):
    """Its dynamics read ``SETTINGS``, which a script may change at run time."""

    def _noise(self) -> np.ndarray:
        return super()._noise() + SETTINGS["gravity"] * 1e-3


class HashSeededEnv(GoodEnv):
    """Seeds its wind from a name's ``hash()``: randomized per interpreter (PYTHONHASHSEED)."""

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        out = super().reset(seed=seed)
        self.wind = np.random.default_rng((seed or 0) + hash("wind") % 2**32).normal(0.0, 0.1, 3)
        return out

    def _noise(self) -> np.ndarray:
        return super()._noise() + self.wind


# -- outputs ------------------------------------------------------------------------------------


class Float64Env(GoodEnv):
    """Declares float32 observations, returns float64."""

    def _obs(self) -> np.ndarray:
        return self.state.astype(np.float64)


class OutOfBoundsEnv(GoodEnv):
    """Declares observations in [-1, 1]; its state goes beyond."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)

    def _obs(self) -> np.ndarray:
        return (self.state * 0 + 3.0).astype(np.float32)


class WrongShapeEnv(GoodEnv):
    """Declares shape (4,), returns (3,)."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = spaces.Box(-10.0, 10.0, (4,), np.float32)


class ArrayRewardEnv(GoodEnv):
    """Returns its reward as a 1-element array."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, np.array([reward]), terminated, truncated, info


class LockInInfoEnv(GoodEnv):
    """Puts a lock in every step's info."""

    def step(self, action):
        obs, reward, terminated, truncated, _info = super().step(action)
        return obs, reward, terminated, truncated, {"guard": threading.Lock()}


class ReusedObservationEnv(GoodEnv):
    """Writes every observation into the same array (fine across processes, which copy it;
    gymnasium's checker says an env must return new data)."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = np.zeros(3, np.float32)

    def _obs(self) -> np.ndarray:
        self.buffer[:] = self.state
        return self.buffer


# -- faults -------------------------------------------------------------------------------------


class NoActionSpaceEnv:
    """Steps like a gymnasium env but declares no action space (an object with reset() and step())."""

    action_space = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, False, False, {}

    def close(self) -> None:
        pass


class PerAgentSpacesEnv(NoActionSpaceEnv):
    """Spaces per agent, as a PettingZoo env declares them: ``action_space(agent)``."""

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(2)


class SimError(Exception):
    """An exception whose __init__ takes a code and a message: it does not unpickle."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class RaisingEnv(GoodEnv):
    """Raises at the third step of every episode; ``exception`` says with what."""

    exception = "value"

    def step(self, action):
        if self.t == 2:
            if self.exception == "value":
                raise ValueError("the simulator lost its state")
            if self.exception == "exit":  # as a pygame env does when its window is closed
                sys.exit(4)
            if self.exception == "interrupt":
                raise KeyboardInterrupt
            raise SimError(7, "the simulator lost its state")
        return super().step(action)


class SimErrorEnv(RaisingEnv):
    exception = "sim"


class ExitingEnv(RaisingEnv):
    exception = "exit"


class InterruptingEnv(RaisingEnv):
    exception = "interrupt"


class HangingEnv(GoodEnv):
    """``where`` hangs: reset or the third step."""

    where = "reset"

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if self.where == "reset":
            time.sleep(3600)
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.where == "step" and self.t == 2:
            time.sleep(3600)
        return super().step(action)


class StepHangingEnv(HangingEnv):
    where = "step"


class CrashingEnv(GoodEnv):
    """Kills its own process at the third step (as a segfault in native code would)."""

    def step(self, action):
        if self.t == 2:
            os.kill(os.getpid(), 9)
        return super().step(action)


# -- close() leaks ------------------------------------------------------------------------------


class ProcessLeakEnv(GoodEnv):
    """Starts a helper process that close() leaves running."""

    def __init__(self) -> None:
        super().__init__()
        self.helper = subprocess.Popen(["sleep", "600"])


class ThreadLeakEnv(GoodEnv):
    """Starts a (daemon) thread that close() leaves running."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()
        threading.Thread(target=self.stop.wait, name="sim-poller", daemon=True).start()


_OPEN: list[int] = []


class FdLeakEnv(GoodEnv):
    """Opens a file that close() leaves open."""

    def __init__(self) -> None:
        super().__init__()
        _OPEN.append(os.open(os.devnull, os.O_RDONLY))


class SharedMemoryLeakEnv(GoodEnv):
    """Makes a shared-memory segment that close() unmaps but does not unlink."""

    def __init__(self) -> None:
        super().__init__()
        self.segment = shared_memory.SharedMemory(create=True, size=4096)

    def close(self) -> None:
        self.segment.close()
