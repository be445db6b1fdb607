"""Small environments whose cost and failures are under control, for the benchmark and tests.

* :class:`ControlledEnv`: a counter env with a chosen step time (sleep, CPU burn or a gate
  file), episode length, and an optional fault at a chosen step (raise, segfault, exit, hang).
* :func:`make_env`: a picklable factory for named benchmark scenarios.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["ControlledEnv", "burn_cpu", "FAULTS"]

FAULTS = ("raise", "raise_reset", "segfault", "exit", "sigkill", "hang", "grandchild", "grandchild_session")


def burn_cpu(seconds: float) -> None:
    """Compute for ``seconds`` of this thread's CPU time (a stand-in for a simulator step).

    CPU time, not wall time: a process preempted mid-step (more workers than cores) still has
    to do all its work, as a real simulator would.
    """
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class ControlledEnv(gym.Env):
    """Observation ``[steps in episode, env_id, last action, episode]``; reward = action.

    Args:
        env_id: stored in the observation, so results can be traced to their env.
        step_time: seconds each step sleeps (or a sequence, cycled).
        cpu_time: seconds of CPU time each step burns (a list: cycled through, step by step).
        lognormal: ``(median, sigma)``: sleep a heavy-tailed time each step.
        gate: path of a file; each step waits (up to 60 s) until it exists.
        episode_length: steps until ``terminated`` (``truncated`` if ``truncate`` is set).
        fault, fault_at: do ``fault`` (one of :data:`FAULTS`) at that step of the env's life.
    """

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(
        self,
        env_id: int = 0,
        step_time: float | list[float] = 0.0,
        cpu_time: float | list[float] = 0.0,
        lognormal: tuple[float, float] | None = None,
        gate: str | None = None,
        episode_length: int = 1_000_000,
        truncate: bool = False,
        fault: str | None = None,
        fault_at: int = 1,
        render_mode: str | None = None,
    ) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; pick one of {FAULTS}")
        self.env_id = env_id
        self.step_times = step_time if isinstance(step_time, (list, tuple)) else [step_time]
        self.cpu_times = cpu_time if isinstance(cpu_time, (list, tuple)) else [cpu_time]
        self.lognormal = lognormal
        self.gate = gate
        self.episode_length = episode_length
        self.truncate = truncate
        self.fault = fault
        self.fault_at = fault_at
        self.render_mode = render_mode
        self.observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float64)
        self.action_space = spaces.Discrete(3)
        self.total_steps = 0  # steps over the env's life: lets tests count what was executed
        self.resets = 0
        self.episode = 0
        self.t = 0
        self.pid = os.getpid()
        self.children: list[subprocess.Popen] = []
        self._rng = np.random.default_rng(env_id)

    def _obs(self, action: float = -1.0) -> np.ndarray:
        return np.array([self.t, self.env_id, action, self.episode], dtype=np.float64)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        if self.fault == "raise_reset" and self.resets + 1 >= self.fault_at:
            raise RuntimeError(f"env {self.env_id} failed to reset on purpose")
        self.resets += 1
        self.episode += 1
        self.t = 0
        return self._obs(), {"env_id": self.env_id, "seed": seed}

    def step(self, action: Any):
        self.total_steps += 1
        if self.fault is not None and self.total_steps >= self.fault_at:
            self._fail()
        self._wait()
        self.t += 1
        done = self.t >= self.episode_length
        terminated, truncated = (False, done) if self.truncate else (done, False)
        return self._obs(float(action)), float(action), terminated, truncated, {"t": self.t}

    def _wait(self) -> None:
        delay = self.step_times[(self.total_steps - 1) % len(self.step_times)]
        if self.lognormal is not None:
            median, sigma = self.lognormal
            delay += float(median * np.exp(sigma * self._rng.standard_normal()))
        if delay > 0:
            time.sleep(delay)
        burn = self.cpu_times[(self.total_steps - 1) % len(self.cpu_times)]
        if burn > 0:
            burn_cpu(burn)
        if self.gate is not None:
            deadline = time.monotonic() + 60.0
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.002)

    def _fail(self) -> None:
        fault = self.fault
        if fault == "raise":
            raise ValueError(f"env {self.env_id} failed on purpose at step {self.total_steps}")
        if fault == "segfault":
            ctypes.string_at(0)
        if fault == "exit":
            os._exit(3)
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            time.sleep(3600)
        if fault in ("grandchild", "grandchild_session") and not self.children:
            # grandchild_session: in a session of its own, as mlagents starts Unity players.
            self.children.append(subprocess.Popen(["sleep", "3600"], start_new_session=fault == "grandchild_session"))

    def render(self):
        return np.full((2, 2, 3), self.t % 256, dtype=np.uint8)

    def close(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()
        self.children.clear()


class EnvFactory:
    """A picklable ``factory(env_id) -> ControlledEnv`` with fixed keyword arguments.

    ``per_env`` maps an env id to keyword arguments that override the common ones.
    """

    def __init__(self, per_env: dict[int, dict[str, Any]] | None = None, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.per_env = per_env or {}

    def __call__(self, env_id: int) -> ControlledEnv:
        return ControlledEnv(env_id, **{**self.kwargs, **self.per_env.get(env_id, {})})
