"""Real PettingZoo envs for the PettingZoo tests, small and cheap, made in the workers (module
level functions: pickled by reference), a wrapper that makes a real env fail once, and a
seeded policy that gives actions as dicts (PettingZoo's) and as the vector's arrays."""

from __future__ import annotations

import os
import secrets
import signal
import time
from typing import Any

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame, in this process and the workers it starts

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv
from pettingzoo.utils.wrappers import BaseParallelWrapper, BaseWrapper

from schedule_envs import consume, episode_length


def pistonball() -> Any:
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.parallel_env(n_pistons=3, max_cycles=12)


def pistonball_aec() -> Any:
    from pettingzoo.butterfly import pistonball_v6

    return pistonball_v6.env(n_pistons=3, max_cycles=12)


def kaz() -> Any:
    """Zombies every other cycle: agents die mid-episode."""
    from pettingzoo.butterfly import knights_archers_zombies_v11

    return knights_archers_zombies_v11.parallel_env(spawn_delay=2, max_zombies=20, max_cycles=150)


def multiwalker() -> Any:
    from pettingzoo.sisl import multiwalker_v9

    return multiwalker_v9.parallel_env(n_walkers=2, max_cycles=25)


def adversary() -> Any:
    """Agents of two kinds with different observation spaces: two groups."""
    from mpe2 import simple_adversary_v3

    return simple_adversary_v3.parallel_env(max_cycles=8)


def spread() -> Any:
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env(N=3, max_cycles=40)


def short_episodes(env: Any) -> None:
    """An env update: the MPE env (reached through its wrappers) truncates after 3 cycles."""
    env.unwrapped.max_cycles = 3


def tictactoe() -> Any:
    from pettingzoo.classic import tictactoe_v3

    return tictactoe_v3.env()


class EveryStepReward(BaseWrapper):
    """A real turn-based game that rewards every agent at every step (a shaping bonus), so an
    agent is rewarded while it waits for its turn."""

    @property
    def rewards(self) -> dict:
        return {a: r + 0.25 for a, r in self.env.rewards.items()}


def tictactoe_shaped() -> Any:
    from pettingzoo.classic import tictactoe_v3

    return EveryStepReward(tictactoe_v3.env())


def strike(marker: str) -> bool:
    """True the first time only, across processes (a restarted env does not fail again)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


class FailingOnce(BaseParallelWrapper):
    """A real env that, at its ``at``-th step, raises, hangs or kills its process, once."""

    def __init__(self, env: Any, how: str, at: int, marker: str) -> None:
        super().__init__(env)
        self.how, self.at, self.marker, self.steps = how, at, marker, 0

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self.steps = 0
        return self.env.reset(seed=seed, options=options)

    def step(self, actions: dict) -> Any:
        self.steps += 1
        if self.steps == self.at and strike(self.marker):
            if self.how == "raise":
                raise RuntimeError("the env blew up mid-episode")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":
                time.sleep(60)
        return self.env.step(actions)


class FailingSecondReset(BaseParallelWrapper):
    """A real env whose second reset raises, once (in the SuperSuit drop-in: the reset within
    the step that ended its first episode)."""

    def __init__(self, env: Any, marker: str) -> None:
        super().__init__(env)
        self.marker, self.resets = marker, 0

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self.resets += 1
        if self.resets == 2 and strike(self.marker):
            raise RuntimeError("the reset blew up")
        return self.env.reset(seed=seed, options=options)


class Failing:
    """``env_fns[i]``: ``make()``, wrapped in :class:`FailingOnce`."""

    def __init__(self, make: Any, how: str, at: int, marker: str) -> None:
        self.make, self.how, self.at, self.marker = make, how, at, marker

    def __call__(self) -> Any:
        return FailingOnce(self.make(), self.how, self.at, self.marker)


def sample(space: spaces.Space, rng: np.random.Generator, mask: np.ndarray | None = None) -> Any:
    """One action: a legal one where a mask is given."""
    if isinstance(space, spaces.Discrete):
        legal = np.flatnonzero(mask) if mask is not None and mask.any() else np.arange(space.n)
        return int(space.start + rng.choice(legal))
    assert isinstance(space, spaces.Box)
    return rng.uniform(space.low, space.high).astype(space.dtype)


def policy(vec: Any, batch: Any, rng: np.random.Generator, garbage: bool = True) -> tuple[list[dict], Any]:
    """Actions for every active agent of ``batch``: per env a dict, and the same as the vector's
    arrays (one group: an array; several: a dict), with garbage (NaN, -1) in inactive rows."""
    names, n = vec.possible_agents, vec.num_agents
    dicts: list[dict] = []
    for i in range(batch.num_envs):
        acts = {}
        for a in range(n):
            if batch.active[i * n + a]:
                g = next(g for g in batch.groups.values() if names[a] in g.group.agents)
                row = i * g.group.size + g.group.agents.index(names[a])
                mask = g.action_mask[row] if g.action_mask is not None else None
                acts[names[a]] = sample(g.group.action_space, rng, mask)
        dicts.append(acts)
    arrays = {}
    for name, g in batch.groups.items():
        space = g.group.action_space
        dtype = np.dtype(space.dtype if isinstance(space, spaces.Box) else np.int64)
        block = np.full((batch.num_envs * g.group.size, *space.shape), np.nan if garbage and dtype.kind == "f" else 0,
                        dtype)
        if garbage and dtype.kind != "f":
            block[:] = -1
        for i, acts in enumerate(dicts):
            for j, agent in enumerate(g.group.agents):
                if agent in acts:
                    block[i * g.group.size + j] = acts[agent]
        arrays[name] = block
    return dicts, (next(iter(arrays.values())) if len(arrays) == 1 else arrays)


class KeepsAgentsListed(BaseParallelWrapper):
    """A real env that leaves done agents in ``agents`` (some third-party envs do)."""

    @property
    def agents(self) -> list:
        return list(self.env.possible_agents)


def spread_keeping_agents() -> Any:
    from mpe2 import simple_spread_v3

    return KeepsAgentsListed(simple_spread_v3.parallel_env(N=3, max_cycles=3))


class MaskInInfo(BaseParallelWrapper):
    """A real env that gives action masks in its infos (``info["action_mask"]``), and a note."""

    MASK = np.array([1, 0, 1, 0, 1], np.int8)

    def _with_masks(self, infos: dict) -> dict:
        return {a: {**infos.get(a, {}), "action_mask": self.MASK, "note": a} for a in self.env.agents}

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        obs, infos = self.env.reset(seed=seed, options=options)
        return obs, self._with_masks(infos)

    def step(self, actions: dict) -> Any:
        obs, rew, term, trunc, infos = self.env.step(actions)
        return obs, rew, term, trunc, self._with_masks(infos)


def spread_mask_in_info() -> Any:
    from mpe2 import simple_spread_v3

    return MaskInInfo(simple_spread_v3.parallel_env(N=3, max_cycles=5))


class MaskInObservation(BaseParallelWrapper):
    """A real env whose observations are as PettingZoo's classic games have them:
    ``{"observation": ..., "action_mask": ...}``, the mask changing with the step."""

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self.t = 0
        self._spaces = {a: spaces.Dict({"observation": env.observation_space(a),
                                        "action_mask": spaces.Box(0, 1, (int(env.action_space(a).n),), np.int8)})
                        for a in env.possible_agents}

    def observation_space(self, agent: str) -> spaces.Space:
        return self._spaces[agent]

    def _with_masks(self, obs: dict) -> dict:
        out = {}
        for agent, o in obs.items():
            mask = np.ones(self._spaces[agent]["action_mask"].shape, np.int8)
            mask[self.t % mask.size] = 0
            out[agent] = {"observation": o, "action_mask": mask}
        return out

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self.t = 0
        obs, infos = self.env.reset(seed=seed, options=options)
        return self._with_masks(obs), infos

    def step(self, actions: dict) -> Any:
        self.t += 1
        obs, rew, term, trunc, infos = self.env.step(actions)
        return self._with_masks(obs), rew, term, trunc, infos


def spread_mask_in_observation() -> Any:
    from mpe2 import simple_spread_v3

    return MaskInObservation(simple_spread_v3.parallel_env(N=3, max_cycles=4))


class MaskWithMultiDiscrete(ParallelEnv):
    """Observations ``{"observation", "action_mask"}`` but ``MultiDiscrete`` actions (a mask per
    sub-action's choices): the mask is an ordinary part of the observation here."""

    metadata = {"name": "mask_with_multidiscrete"}
    possible_agents = ["a_0", "a_1"]
    render_mode = None
    _obs_space = spaces.Dict({"observation": spaces.Box(-10, 10, (3,), np.float32),
                              "action_mask": spaces.Box(0, 1, (5,), np.int8)})
    _act_space = spaces.MultiDiscrete([3, 2])

    def observation_space(self, agent: str) -> spaces.Space:
        return self._obs_space

    def action_space(self, agent: str) -> spaces.Space:
        return self._act_space

    def _obs(self, k: int, action: Any = (0, 0)) -> dict:
        mask = np.ones(5, np.int8)
        mask[self.t % 5] = 0
        return {"observation": np.array([self.t, k, int(np.sum(action))], np.float32), "action_mask": mask}

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self.t = 0
        self.agents = list(self.possible_agents)
        return {a: self._obs(k) for k, a in enumerate(self.agents)}, {a: {} for a in self.agents}

    def step(self, actions: dict) -> Any:
        self.t += 1
        over = self.t >= 3
        out = ({a: self._obs(k, actions[a]) for k, a in enumerate(self.agents)},
               {a: float(np.sum(actions[a])) for a in self.agents}, dict.fromkeys(self.agents, False),
               dict.fromkeys(self.agents, over), {a: {} for a in self.agents})
        if over:
            self.agents = []
        return out


class Joiner(ParallelEnv):
    """``late`` appears at the first step with a bonus of 10 before it has acted, then both earn
    their action + 1 a step; the episode is truncated after three steps."""

    metadata = {"name": "joiner"}
    possible_agents = ["early", "late"]
    render_mode = None

    def observation_space(self, agent: str) -> spaces.Space:
        return spaces.Box(-1, 10, (1,), np.float32)

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(2)

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self.t = 0
        self.agents = ["early"]
        return {"early": np.zeros(1, np.float32)}, {"early": {}}

    def step(self, actions: dict) -> Any:
        assert set(actions) == set(self.agents), (actions, self.agents)
        self.t += 1
        rew = {a: float(actions[a]) + 1.0 for a in self.agents}
        if self.t == 1:
            self.agents = ["early", "late"]
            rew["late"] = 10.0  # paid as it appears
        over = self.t >= 3
        out = ({a: np.full(1, self.t, np.float32) for a in self.agents}, rew, dict.fromkeys(self.agents, False),
               dict.fromkeys(self.agents, over), {a: {} for a in self.agents})
        if over:
            self.agents = []
        return out


class DiesInTurn(ParallelEnv):
    """Four agents as hand-written envs have them: ``d<k>`` terminates after ``k + 2`` steps
    (``d3`` never does), every agent left is truncated at step 6. Each observes ``[t, k, the
    action it received]``; rewarded its action. Reset infos: the episode's number."""

    metadata = {"name": "dies_in_turn"}
    possible_agents = ["d0", "d1", "d2", "d3"]
    render_mode = None

    def observation_space(self, agent: str) -> spaces.Space:
        return spaces.Box(-10, 10, (3,), np.float32)

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(4)

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self.t, self.episode = 0, getattr(self, "episode", 0) + 1
        self.agents = list(self.possible_agents)
        obs = {a: np.array([0, k, -1], np.float32) for k, a in enumerate(self.agents)}
        return obs, {a: {"episode": self.episode} for a in self.agents}

    def step(self, actions: dict) -> Any:
        self.t += 1
        k = {a: self.possible_agents.index(a) for a in self.agents}
        obs = {a: np.array([self.t, k[a], actions[a]], np.float32) for a in self.agents}
        terms = {a: a != "d3" and self.t >= k[a] + 2 for a in self.agents}
        truncs = dict.fromkeys(self.agents, self.t >= 6)
        out = obs, {a: float(actions[a]) for a in self.agents}, terms, truncs, {a: {"t": self.t} for a in self.agents}
        self.agents = [a for a in self.agents if not (terms[a] or truncs[a])]
        return out


class Respawner(ParallelEnv):
    """``a`` terminates at the second step and comes back under the same name at the third (a
    new life, as a unit respawns in some games), which PettingZoo does not allow; ``b`` acts
    throughout. Each observes ``[its life, steps in this life]``; truncated after five steps."""

    metadata = {"name": "respawner", "is_parallelizable": True}
    possible_agents = ["a", "b"]
    render_mode = None
    OBSERVATION, ACTION = spaces.Box(0, 10, (2,), np.float32), spaces.Discrete(2)

    def observation_space(self, agent: str) -> spaces.Space:
        return self.OBSERVATION

    def action_space(self, agent: str) -> spaces.Space:
        return self.ACTION

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self.t, self.life, self.age = 0, {"a": 0, "b": 0}, {"a": 0, "b": 0}
        self.agents = list(self.possible_agents)
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def _obs(self, agent: str) -> np.ndarray:
        return np.array([self.life[agent], self.age[agent]], np.float32)

    def step(self, actions: dict) -> Any:
        assert set(actions) == set(self.agents), (actions, self.agents)
        self.t += 1
        for a in self.agents:
            self.age[a] += 1
        out = ({a: self._obs(a) for a in self.agents}, dict.fromkeys(self.agents, 1.0),
               {a: a == "a" and self.t == 2 for a in self.agents}, dict.fromkeys(self.agents, self.t >= 5),
               {a: {} for a in self.agents})
        self.agents = [a for a in self.agents if not (out[2][a] or out[3][a])]
        if self.t == 3:  # back, a new life under the same name
            self.life["a"], self.age["a"] = 1, 0
            self.agents.insert(0, "a")
            for k, v in zip(out, (self._obs("a"), 0.0, False, False, {}), strict=True):
                k["a"] = v
        return out


def respawner_aec() -> Any:
    """:class:`Respawner` as an AEC env (PettingZoo's conversion): its agents take turns."""
    from pettingzoo.utils.conversions import parallel_to_aec

    return parallel_to_aec(Respawner())


class ScheduleParallelEnv(ParallelEnv):
    """A ``ParallelEnv`` for the randomized fault schedules (``tests/test_fault_schedules_pettingzoo.py``):
    two agents, each observing ``[slot, agent, episode, t, last action it received, nonce]``
    (``schedule_envs``' layout with the agent's index in place of the env version), the first
    terminating at ``episode_length(slot, episode)`` steps, the second one step later: agents die
    at different times. Faults on command, as ``schedule_envs.ScheduleEnv``'s."""

    metadata = {"name": "schedule_v0", "is_parallelizable": True}
    possible_agents = ["a0", "a1"]

    def __init__(self, slot: int, commands: str) -> None:
        self.slot, self.commands = slot, commands
        self.nonce = float(secrets.randbits(40))  # exact in a float64
        self.episode, self.t = 0, 0
        self.last = [-1.0, -1.0]
        self.agents: list[str] = []

    OBSERVATION = spaces.Box(-np.inf, np.inf, (6,), np.float64)
    ACTION = spaces.Discrete(4)

    def observation_space(self, agent: str) -> spaces.Space:
        return self.OBSERVATION

    def action_space(self, agent: str) -> spaces.Space:
        return self.ACTION

    def length(self, agent: int) -> int:
        return episode_length(self.slot, self.episode) + agent

    def _obs(self, agent: int) -> np.ndarray:
        return np.array([self.slot, agent, self.episode, self.t, self.last[agent], self.nonce], dtype=np.float64)

    def _fault(self, fault: str) -> None:
        if consume(self.commands, self.slot, fault):
            if fault.endswith("raise"):
                raise RuntimeError(f"slot {self.slot}: {fault} on command")
            time.sleep(600)  # hung: the manager's deadline kills the process

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        self._fault("reset_raise")
        self.episode += 1
        self.t, self.last = 0, [-1.0, -1.0]
        self.agents = list(self.possible_agents)
        return {a: self._obs(i) for i, a in enumerate(self.agents)}, {a: {} for a in self.agents}

    def step(self, actions: dict) -> Any:
        for fault in ("step_raise", "step_hang"):
            self._fault(fault)
        self.t += 1
        acting = list(self.agents)
        obs, rewards, terminated, truncated, infos = {}, {}, {}, {}, {}
        for a in acting:
            i = self.possible_agents.index(a)
            self.last[i] = float(actions[a])  # exactly what it received
            obs[a], rewards[a] = self._obs(i), float(i)
            terminated[a], truncated[a], infos[a] = self.t >= self.length(i), False, {}
        self.agents = [a for a in acting if not terminated[a]]
        return obs, rewards, terminated, truncated, infos

    def close(self) -> None:
        pass


class SeededScheduleParallelEnv(ScheduleParallelEnv):
    """:class:`ScheduleParallelEnv` for the SuperSuit drop-in, whose envs are copies of one env: a seeded reset
    makes it slot ``seed`` (``reset(seed=0)`` gives env ``i`` seed ``i``), with a nonce of its own."""

    def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
        if seed is not None:
            self.slot, self.nonce = int(seed), float(secrets.randbits(40))
        return super().reset(seed=seed, options=options)


class ScheduleParallelFn:
    """An ``env_fns`` entry of :class:`ScheduleParallelEnv` (a callable without arguments)."""

    def __init__(self, slot: int, commands: str) -> None:
        self.slot, self.commands = slot, commands

    def __call__(self) -> ScheduleParallelEnv:
        return ScheduleParallelEnv(self.slot, self.commands)
