"""``concat_vec_envs(..., base_class="stable_baselines3")``: SuperSuit's ``SB3VecEnvWrapper``
around :class:`~envmanager.pettingzoo.supersuit.PettingZooVecEnv` (extra ``sb3``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from envmanager.errors import InvalidInputError
from envmanager.extras import requires_extra
from envmanager.pettingzoo.supersuit import PettingZooVecEnv

with requires_extra("sb3", __name__):
    from stable_baselines3.common.vec_env.base_vec_env import VecEnvIndices, VecEnvObs, VecEnvStepReturn, VecEnvWrapper

__all__ = ["SB3VecEnvWrapper"]


class SB3VecEnvWrapper(VecEnvWrapper):
    """An SB3 ``VecEnv`` of PettingZoo agents, one row per agent (SuperSuit's ``SB3VecEnvWrapper``).

    ``reset()`` returns the observations, the infos in ``reset_infos``; ``step_wait()``
    ``(observations, rewards, dones, infos)`` with ``dones = terminated | truncated`` and
    ``infos[row]["terminal_observation"]`` where an env was reset within the step (whose
    reset infos are also in ``reset_infos``). ``seed(s)`` applies at the next ``reset()``:
    env ``i`` gets ``s + i`` (SuperSuit's own ``seed`` raises). ``venv.active`` tells the
    rows whose agent is in the env (others are padding: zeros, reward 0, not done).
    """

    venv: PettingZooVecEnv  # type: ignore[assignment]

    def __init__(self, venv: PettingZooVecEnv) -> None:
        super().__init__(venv)  # type: ignore[arg-type]
        self.render_mode = venv.render_mode
        self._seed: int | None = None
        self._next_options: dict[str, Any] | None = None

    @property
    def active(self) -> np.ndarray:
        """Per row: its agent is in the env and acts next."""
        return self.venv.active

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> VecEnvObs:
        if seed is not None:
            self.seed(seed)
        seed, self._seed = self._seed, None
        options, self._next_options = options if options is not None else self._next_options, None
        observations, _ = self.venv.reset(seed=seed, options=options)
        return observations

    @property
    def reset_infos(self) -> list[dict[str, Any]]:
        """Per row, the infos of its env's latest reset (SB3's ``reset_infos``; SuperSuit's drops
        those of envs reset within a step)."""
        return self.venv.reset_infos

    @reset_infos.setter
    def reset_infos(self, value: list[dict[str, Any]]) -> None:  # SB3's VecEnv.__init__ sets it
        pass

    def seed(self, seed: int | None = None) -> Sequence[int | None]:
        """The seed of the next ``reset()``: env ``i`` gets ``seed + i`` (SB3's ``seed``, at env level)."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise InvalidInputError(f"seed must be an int or None, got {seed!r:.80}")
        self._seed = None if seed is None else int(seed)
        if seed is None:
            return [None] * self.num_envs
        return [int(seed) + row // self.venv.num_agents for row in range(self.num_envs)]

    def set_options(self, options: list[dict] | dict | None = None) -> None:
        """Options for the next ``reset()`` (one dict for every env: PettingZoo's ``reset`` takes one)."""
        if isinstance(options, list):
            if any(o != options[0] for o in options):
                raise InvalidInputError("set_options: one dict for every env (the rows of an env share its reset)")
            options = options[0] if options else None
        self._next_options = options

    def step_async(self, actions: np.ndarray) -> None:
        self.venv.step_async(actions)

    def step_wait(self) -> VecEnvStepReturn:
        observations, rewards, terminations, truncations, infos = self.venv.step_wait()
        return observations, rewards, np.logical_or(terminations, truncations), infos

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        return self.venv.env_is_wrapped(wrapper_class)

    def getattr_recursive(self, name: str) -> Any:
        raise AttributeError(name)

    def getattr_depth_check(self, name: str, already_found: bool) -> str | None:
        return None

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        if attr_name == "render_mode":
            values = [self.venv.render_mode] * self.num_envs
        else:
            values = self.venv.get_attr(attr_name)
        return [values[i] for i in self._get_indices(indices)]

    def render(self, mode: str | None = None) -> Any:
        return self.venv.render()

    def close(self) -> None:
        self.venv.close()
