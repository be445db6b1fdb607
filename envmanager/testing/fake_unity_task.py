"""Configuration, side-channel codec and the small learnable task of the fake Unity player.

Pure Python (no numpy, no protobuf) so the player starts fast; the wire protocol lives in
:mod:`envmanager.testing.fake_unity`.

The task, per agent: observation 0 starts with a one-hot *discrete target* (size of the first
discrete branch) followed by a *continuous target* in [-1, 1] (when the behaviour has continuous
actions); the rest of observation 0 is zero. Every other observation is filled with the agent's
step count in the current episode (with ``echo_actions``: its last action received, the first
discrete one, else the first continuous one; 0 at an episode's start). Reward per step:

* discrete part: ``1.0`` if ``discrete_action[0] == target`` else ``wrong_reward``;
* continuous part: ``1 - |clip(continuous_action[0], -1, 1) - target|`` (in [-1, 1]);
* hybrid: the mean of both parts; all multiplied by the ``reward_scale`` environment parameter.

Targets are redrawn after every decision, so the task is a contextual bandit: a policy that reads
the target from the observation gets reward 1 per step, a random one about ``1/branch_size``.
"""
from __future__ import annotations

import json
import math
import random
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

# Side channel ids, as in mlagents_envs.side_channel.*
ENV_PARAMS_CHANNEL = uuid.UUID("534c891e-810f-11ea-a9d0-822485860400")
ENGINE_CHANNEL = uuid.UUID("e951342c-4f7e-11ea-b238-784f4387d1f7")
STATS_CHANNEL = uuid.UUID("a1d8f7b7-cec8-50f9-b78b-d3e165a78520")

# StatsAggregationMethod values
AVERAGE, MOST_RECENT, SUM, HISTOGRAM = 0, 1, 2, 3

ENGINE_FIELDS = {1: "quality_level", 2: "time_scale", 3: "target_frame_rate", 4: "capture_frame_rate"}
CRASH_MODES = ("exit", "raise", "kill", "hang")


@dataclass
class BehaviorConfig:
    """One behaviour (an entry of ``behaviors`` in the JSON config)."""

    name: str = "FakeBehavior?team=0"
    agents: int = 1
    observation_shapes: list[list[int]] | None = None  # float32 observations; default [[task size]]
    continuous: int = 0  # number of continuous actions
    discrete: list[int] = field(default_factory=lambda: [3])  # discrete branch sizes ([] for none)
    action_masks: list[list[int]] | None = None  # masked indices, one list per branch
    episode_length: Any = 50  # int, or one int per agent; 0 = episodes never end
    episode_end: str = "terminate"  # or "interrupt" (max_step_reached=True)
    decision_period: int = 1  # agent i requests a decision when (step + i) % period == 0
    wrong_reward: float = 0.0  # discrete reward for a wrong action
    group_id: int = 0  # non-zero: agents share this group id; group_reward = mean step reward
    echo_actions: bool = False  # observations after the first hold the last action received

    def __post_init__(self) -> None:
        self.discrete = [int(b) for b in (self.discrete or [])]
        if self.agents < 1:
            raise ValueError(f"behavior {self.name!r}: agents must be >= 1")
        if self.continuous < 0 or any(b < 1 for b in self.discrete):
            raise ValueError(f"behavior {self.name!r}: bad action spec")
        if self.episode_end not in ("terminate", "interrupt"):
            raise ValueError(f"episode_end must be 'terminate' or 'interrupt', not {self.episode_end!r}")
        if self.decision_period < 1:
            raise ValueError("decision_period must be >= 1")
        if self.observation_shapes is None:
            self.observation_shapes = [[max(1, self.task_size)]]
        self.observation_shapes = [[int(d) for d in s] for s in self.observation_shapes]
        if not self.observation_shapes or any(not s or min(s) < 1 for s in self.observation_shapes):
            raise ValueError(f"behavior {self.name!r}: bad observation_shapes")
        if self.action_masks is not None and len(self.action_masks) != len(self.discrete):
            raise ValueError(f"behavior {self.name!r}: action_masks needs one list per discrete branch")
        lengths = self.episode_length if isinstance(self.episode_length, list) else [self.episode_length]
        if any(int(n) < 0 for n in lengths):
            raise ValueError("episode_length must be >= 0")

    @property
    def task_size(self) -> int:
        return (self.discrete[0] if self.discrete else 0) + (1 if self.continuous else 0)

    def mask_flat(self) -> list[bool] | None:
        """Flat mask over all branches, True = action not allowed (as DecisionSteps.action_mask)."""
        if self.action_masks is None:
            return None
        out: list[bool] = []
        for size, masked in zip(self.discrete, self.action_masks, strict=True):
            out.extend(i in set(masked) for i in range(size))
        return out


@dataclass
class FakeConfig:
    """The JSON config (``--config``): these keys, ``behaviors`` being a list of BehaviorConfig dicts."""

    behaviors: list[BehaviorConfig] = field(default_factory=lambda: [BehaviorConfig()])
    step_latency: float = 0.0  # seconds slept per STEP (env parameter "step_latency" overrides)
    latency_jitter: float = 0.0  # plus uniform [0, jitter] seconds per STEP
    reset_latency: float = 0.0  # seconds slept per RESET
    crash_after_steps: int | None = None  # answer N STEP commands, crash on the next one
    crash_mode: str = "exit"  # exit | raise | kill | hang
    crash_exit_code: int = 1  # for "exit" and crash_on_start
    crash_on_start: bool = False  # exit before connecting
    stats: bool = True  # send Fake/* stats on the StatsSideChannel
    record: str | None = None  # JSON-lines file of what the player receives
    seed: int | None = None  # task seed; default: the seed UnityEnvironment sends
    connect_timeout: float = 30.0  # give up (exit 1) if the server is not there by then
    exchange_timeout: float | None = None  # deadline per Exchange RPC; None = wait for Python
    parent_watchdog: bool = True  # exit (code 3) when the parent process goes away
    echo_channels: list[str] = field(default_factory=list)  # side-channel uuids echoed back
    name: str = "FakeUnity"
    communication_version: str = "1.5.0"
    package_version: str = "2.2.1-exp.1"  # com.unity.ml-agents version paired with mlagents-envs 0.28

    def __post_init__(self) -> None:
        self.behaviors = [b if isinstance(b, BehaviorConfig) else make_behavior(b) for b in self.behaviors]
        names = [b.name for b in self.behaviors]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"need at least one behavior and unique names, got {names}")
        if self.crash_mode not in CRASH_MODES:
            raise ValueError(f"crash_mode must be one of {CRASH_MODES}")


def make_behavior(d: dict[str, Any]) -> BehaviorConfig:
    known = {f.name for f in fields(BehaviorConfig)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown behavior keys {sorted(unknown)}; known: {sorted(known)}")
    return BehaviorConfig(**d)


def make_config(d: dict[str, Any]) -> FakeConfig:
    known = {f.name for f in fields(FakeConfig)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(known)}")
    return FakeConfig(**d)


def load_config(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a JSON object")
    return data


# ---------------------------------------------------------------- side-channel codec


def split_side_channel(data: bytes) -> list[tuple[uuid.UUID, bytes]]:
    """``[uuid bytes_le (16)][int32 LE length][payload]``, repeated."""
    out, offset = [], 0
    while offset + 20 <= len(data):
        cid = uuid.UUID(bytes_le=bytes(data[offset:offset + 16]))
        (n,) = struct.unpack_from("<i", data, offset + 16)
        offset += 20
        out.append((cid, bytes(data[offset:offset + n])))
        offset += n
    return out


def pack_side_channel(messages: Sequence[tuple[uuid.UUID, bytes]]) -> bytes:
    return b"".join(cid.bytes_le + struct.pack("<i", len(p)) + p for cid, p in messages)


class Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.off = buf, 0

    def _take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return v

    def i32(self) -> int:
        return self._take("<i")

    def f32(self) -> float:
        return self._take("<f")

    def string(self) -> str:
        n = self.i32()
        s = self.buf[self.off:self.off + n].decode("ascii")
        self.off += n
        return s


def stat_message(key: str, value: float, aggregation: int = MOST_RECENT) -> tuple[uuid.UUID, bytes]:
    k = key.encode("ascii")
    return STATS_CHANNEL, struct.pack("<i", len(k)) + k + struct.pack("<fi", value, aggregation)


def decode_env_param(payload: bytes, rng: random.Random) -> tuple[str, float, dict[str, Any]]:
    """Returns (key, value, description). Samplers are sampled once with their own seed."""
    r = Reader(payload)
    key, kind = r.string(), r.i32()
    if kind == 0:
        value = r.f32()
        return key, value, {"type": "float", "value": value}
    seed, sampler = r.i32(), r.i32()
    srng = random.Random(seed)
    if sampler == 0:
        lo, hi = r.f32(), r.f32()
        return key, srng.uniform(lo, hi), {"type": "uniform", "min": lo, "max": hi, "seed": seed}
    if sampler == 1:
        mean, std = r.f32(), r.f32()
        return key, srng.gauss(mean, std), {"type": "gaussian", "mean": mean, "std": std, "seed": seed}
    n = r.i32()
    flat = [r.f32() for _ in range(n)]
    intervals = list(zip(flat[0::2], flat[1::2], strict=False))  # pairs; an odd last value has none
    lo, hi = srng.choice(intervals) if intervals else (0.0, 0.0)
    return key, srng.uniform(lo, hi), {"type": "multirange_uniform", "intervals": intervals, "seed": seed}


def decode_engine(payload: bytes) -> dict[str, float]:
    r = Reader(payload)
    kind = r.i32()
    if kind == 0:
        return {"width": r.i32(), "height": r.i32()}
    if kind == 2:
        return {"time_scale": r.f32()}
    if kind in ENGINE_FIELDS:
        return {ENGINE_FIELDS[kind]: r.i32()}
    return {}


# ---------------------------------------------------------------- the simulation


@dataclass
class Info:
    """One AgentInfoProto to send."""

    agent_id: int
    reward: float
    done: bool
    max_step_reached: bool
    observations: list[list[float]]  # flat float data per observation
    action_mask: list[bool] | None
    group_id: int
    group_reward: float


class _Agent:
    def __init__(self, agent_id: int, index: int, episode_length: int) -> None:
        self.id, self.index, self.episode_length = agent_id, index, episode_length
        self.step = 0
        self.pending = 0.0
        self.ret = 0.0
        self.target_d = 0
        self.target_c = 0.0
        self.last_d: list[int] = []
        self.last_c: list[float] = []


class BehaviorSim:
    """All agents of one behaviour. ``decision_ids`` is the order the client sends actions in."""

    def __init__(self, cfg: BehaviorConfig, first_id: int, rng: random.Random) -> None:
        self.cfg, self.rng = cfg, rng
        lengths = cfg.episode_length if isinstance(cfg.episode_length, list) else [cfg.episode_length] * cfg.agents
        if len(lengths) != cfg.agents:
            raise ValueError(f"behavior {cfg.name!r}: episode_length list needs one entry per agent")
        self.agents = [_Agent(first_id + i, i, int(lengths[i])) for i in range(cfg.agents)]
        self.mask = cfg.mask_flat()
        self.allowed = list(range(cfg.discrete[0])) if cfg.discrete else []
        if cfg.action_masks is not None and cfg.discrete:
            self.allowed = [i for i in self.allowed if i not in set(cfg.action_masks[0])] or [0]
        self.decision_ids: list[int] = []
        self.episode_length_override: int | None = None

    def _new_episode(self, a: _Agent) -> None:
        a.step, a.pending, a.ret = 0, 0.0, 0.0
        a.last_d = [0] * len(self.cfg.discrete)
        a.last_c = [0.0] * self.cfg.continuous
        self._new_target(a)

    def _new_target(self, a: _Agent) -> None:
        if self.allowed:
            a.target_d = self.rng.choice(self.allowed)
        if self.cfg.continuous:
            a.target_c = round(self.rng.uniform(-1.0, 1.0), 3)

    def _obs(self, a: _Agent) -> list[list[float]]:
        out = []
        for i, shape in enumerate(self.cfg.observation_shapes or []):  # set by __post_init__
            size = math.prod(shape)
            if i == 0:
                task = [0.0] * (self.cfg.discrete[0] if self.cfg.discrete else 0)
                if task:
                    task[a.target_d] = 1.0
                if self.cfg.continuous:
                    task.append(a.target_c)
                out.append((task + [0.0] * size)[:size])
            else:
                out.append([self._echo(a) if self.cfg.echo_actions else float(a.step)] * size)
        return out

    def _echo(self, a: _Agent) -> float:
        """The agent's last action received: its first discrete one, else its first continuous one."""
        if a.last_d:
            return float(a.last_d[0])
        return float(a.last_c[0]) if a.last_c else 0.0

    def _info(self, a: _Agent, done: bool, group_reward: float) -> Info:
        interrupted = done and self.cfg.episode_end == "interrupt"
        info = Info(a.id, a.pending, done, interrupted, self._obs(a), None if done else self.mask,
                    self.cfg.group_id, group_reward if self.cfg.group_id else 0.0)
        a.pending = 0.0
        return info

    def _length(self, a: _Agent) -> int:
        return a.episode_length if self.episode_length_override is None else self.episode_length_override

    def reset(self) -> list[Info]:
        for a in self.agents:
            self._new_episode(a)
        self.decision_ids = [a.id for a in self.agents]
        return [self._info(a, False, 0.0) for a in self.agents]

    def reward(self, a: _Agent, disc: Sequence[int], cont: Sequence[float]) -> float:
        parts = []
        if self.cfg.discrete:
            parts.append(1.0 if disc and int(disc[0]) == a.target_d else self.cfg.wrong_reward)
        if self.cfg.continuous:
            x = max(-1.0, min(1.0, float(cont[0]))) if cont else 0.0
            parts.append(1.0 - abs(x - a.target_c))
        return sum(parts) / len(parts) if parts else 0.0

    def step(self, actions: list[tuple[list[float], list[int]]], global_step: int,
             reward_scale: float) -> tuple[list[Info], dict[str, Any]]:
        """Apply the actions (in ``decision_ids`` order), advance one step, return the output."""
        by_id = dict(zip(self.decision_ids, actions, strict=False))  # none sent: agents keep their last
        rewards, returns, violations = [], [], 0
        for a in self.agents:
            decided = a.id in by_id
            if decided:
                cont, disc = by_id[a.id]
                a.last_c = list(cont) or a.last_c
                a.last_d = [int(x) for x in disc] or a.last_d
            if self.mask is not None and a.last_d:
                offset = 0
                for b, size in enumerate(self.cfg.discrete):
                    if 0 <= a.last_d[b] < size and self.mask[offset + a.last_d[b]]:
                        violations += 1
                    offset += size
            r = self.reward(a, a.last_d, a.last_c) * reward_scale
            a.pending += r
            a.ret += r
            a.step += 1
            rewards.append(r)
            if decided:
                self._new_target(a)
        group_reward = sum(rewards) / len(rewards)
        infos: list[Info] = []
        self.decision_ids = []
        for a in self.agents:
            length = self._length(a)
            restarted = False
            if length > 0 and a.step >= length:
                returns.append(a.ret)
                infos.append(self._info(a, True, group_reward))
                self._new_episode(a)
                restarted = True
            if restarted or (global_step + a.index) % self.cfg.decision_period == 0:
                infos.append(self._info(a, False, group_reward))
                self.decision_ids.append(a.id)
        return infos, {"rewards": rewards, "returns": returns, "mask_violations": violations}
