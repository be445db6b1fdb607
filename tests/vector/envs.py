"""Small deterministic test environments and pure helpers for the vector conformance suite.

Everything here is defined at module top level so worker processes can import it under every
multiprocessing start method (``fork``, ``forkserver``, ``spawn``): ``tests/conftest`` puts this
directory on ``sys.path`` and ``PYTHONPATH``.  Environment factories are ``functools.partial``
objects over these classes, so they pickle by reference.

All randomness comes from the env's seeded ``np_random``, so a ``SyncVectorEnv`` and the vector
env under test produce identical trajectories for identical seeds and actions.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

REFERENCE = os.environ.get("ENVMANAGER_CONFORMANCE_REFERENCE", "") not in ("", "0")

KINDS = ("box", "discrete", "multidiscrete", "multibinary", "dict", "tuple")
GATE_DEADLINE = 20.0  # a gated call never blocks longer than this, so nothing can hang forever


def make_space(kind: str, high: float = 10.0) -> spaces.Space:
    """The observation/action space used for each space kind."""
    if kind == "box":
        return spaces.Box(-high, high, (3,), np.float32)
    if kind == "discrete":
        return spaces.Discrete(7)
    if kind == "multidiscrete":
        return spaces.MultiDiscrete([4, 3, 5])
    if kind == "multibinary":
        return spaces.MultiBinary(4)
    if kind == "dict":
        return spaces.Dict(
            {
                "pos": spaces.Box(-high, high, (2,), np.float32),
                "flag": spaces.MultiBinary(3),
                "k": spaces.Discrete(5),
            }
        )
    if kind == "tuple":
        return spaces.Tuple(
            (spaces.Box(0.0, high, (2,), np.float64), spaces.Discrete(4), spaces.MultiDiscrete([3, 2]))
        )
    raise ValueError(kind)


def _obs_for(kind: str, rng: np.random.Generator, t: int, high: float) -> Any:
    """An in-space observation that depends on the step counter and the env's own RNG."""
    if kind == "box":
        return np.array([t % 10, rng.uniform(-1, 1), rng.uniform(-high, high)], dtype=np.float32)
    if kind == "discrete":
        return np.int64((t + rng.integers(0, 7)) % 7)
    if kind == "multidiscrete":
        return ((rng.integers(0, 5, 3) + t) % np.array([4, 3, 5])).astype(np.int64)
    if kind == "multibinary":
        return rng.integers(0, 2, 4).astype(np.int8)
    if kind == "dict":
        return {
            "pos": np.array([t % 10, rng.uniform(-1, 1)], dtype=np.float32),
            "flag": rng.integers(0, 2, 3).astype(np.int8),
            "k": np.int64((t + rng.integers(0, 5)) % 5),
        }
    if kind == "tuple":
        return (
            np.array([t % 10, rng.uniform(0, 1)], dtype=np.float64),
            np.int64((t * 3 + rng.integers(0, 4)) % 4),
            np.array([t % 3, rng.integers(0, 2)], dtype=np.int64),
        )
    raise ValueError(kind)


def action_value(action: Any) -> float:
    """A scalar that depends on every component of an action (of any of the space kinds)."""
    if isinstance(action, dict):
        return sum((i + 1) * action_value(action[k]) for i, k in enumerate(sorted(action)))
    if isinstance(action, tuple):
        return sum((i + 1) * action_value(a) for i, a in enumerate(action))
    arr = np.asarray(action, dtype=np.float64).reshape(-1)
    return float(np.sum(arr * np.arange(1, arr.size + 1)))


def wait_for_gate(path: str | None) -> None:
    """Block until the file ``path`` exists (a deterministic 'slow env'; no timing in tests)."""
    if path is None:
        return
    deadline = time.monotonic() + GATE_DEADLINE
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.002)


class SpaceEnv(gym.Env):
    """Short random-length episodes over any space kind, with per-step infos that vary.

    * episode length 1..``max_len`` and its end (terminated / truncated / both) are drawn from
      ``np_random`` at reset, so autoreset paths run often;
    * ``fixed_len`` forces every episode to that length, ending with ``terminated=True``;
    * ``max_len=None`` (and no ``fixed_len``) makes episodes never end;
    * infos carry keys present only on some steps (exercising the ``_key`` masks), a nested dict
      and an object-typed value; reset infos differ from step infos;
    * ``step_gate`` / ``reset_gate``: paths of files whose existence step / reset waits for;
    * ``fail_at_step``: raise ``ValueError`` when the env's total step count reaches it;
    * counters ``step_count`` / ``reset_count`` count calls inside the env (readable via
      ``get_attr``), ``tag`` is a free attribute for ``set_attr`` tests.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(
        self,
        obs_kind: str = "box",
        act_kind: str = "box",
        max_len: int | None = 5,
        fixed_len: int | None = None,
        render_mode: str | None = None,
        step_gate: str | None = None,
        reset_gate: str | None = None,
        fail_at_step: int | None = None,
        obs_high: float = 10.0,
    ):
        self.obs_kind, self.act_kind, self.obs_high = obs_kind, act_kind, obs_high
        self.observation_space = make_space(obs_kind, obs_high)
        self.action_space = make_space(act_kind)
        self.max_len, self.fixed_len = max_len, fixed_len
        self.render_mode = render_mode
        self.step_gate, self.reset_gate = step_gate, reset_gate
        self.fail_at_step = fail_at_step
        self.step_count = 0
        self.reset_count = 0
        self.tag = "untagged"
        self._t = 0
        self._offset = 0
        self._ep_len = 1
        self._end = 0
        self._total = 0.0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        wait_for_gate(self.reset_gate)
        self.reset_count += 1
        self._offset = int((options or {}).get("offset", 0))
        self._t = self._offset
        if self.fixed_len is not None:
            self._ep_len, self._end = self.fixed_len, 0
        elif self.max_len is None:
            self._ep_len, self._end = -1, 0
        else:
            self._ep_len = int(self.np_random.integers(1, self.max_len + 1))
            self._end = int(self.np_random.integers(0, 3))
        self._total = 0.0
        info: dict[str, Any] = {"reset_count": self.reset_count, "ep_len": self._ep_len}
        if options:
            info["offset"] = self._offset
        return _obs_for(self.obs_kind, self.np_random, self._t, self.obs_high), info

    def step(self, action):
        wait_for_gate(self.step_gate)
        self.step_count += 1
        if self.fail_at_step is not None and self.step_count >= self.fail_at_step:
            raise ValueError(f"boom at step {self.step_count}")
        self._t += 1
        # multiples of 1/8 below 2**10: exactly representable in float32 and float64
        reward = float(np.floor(abs(action_value(action)) * 8) % 8192) / 8 + self._t
        self._total += reward
        steps_in_episode = self._t - self._offset
        done = self._ep_len > 0 and steps_in_episode >= self._ep_len
        terminated = bool(done and self._end in (0, 2))
        truncated = bool(done and self._end in (1, 2))
        info: dict[str, Any] = {"t": self._t, "total": self._total, "even": self._t % 2 == 0}
        if self._t % 2:
            info["odd"] = np.array([self._t, 2 * self._t], dtype=np.int64)
        if self._t % 3 == 0:
            info["nested"] = {"third": self._t // 3, "u": float(self.np_random.uniform())}
        if self._t % 4 == 1:
            info["label"] = f"t{self._t}"
        obs = _obs_for(self.obs_kind, self.np_random, self._t, self.obs_high)
        return obs, reward, terminated, truncated, info

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        frame = np.zeros((4, 5, 3), dtype=np.uint8)
        frame[..., 0] = self._t % 256
        frame[..., 1] = self.reset_count % 256
        frame[0, 0, 2] = self.step_count % 256
        return frame

    # --- helpers reachable through ``call`` / ``env_method`` ---
    def add(self, x, y=0):
        return (x + y, self.step_count)

    def counts(self):
        return (self.reset_count, self.step_count)

    def wait_then(self, gate: str, value):
        wait_for_gate(gate)
        return value


class TokenSpace(gym.Space):
    """A custom (non-batchable, no shared memory) space of short strings."""

    def __init__(self, n: int = 5):
        super().__init__(shape=None, dtype=None)
        self.n = n

    def sample(self, mask=None, probability=None):
        return f"tok{int(self.np_random.integers(self.n))}"

    def contains(self, x) -> bool:
        return isinstance(x, str) and x.startswith("tok")

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenSpace) and other.n == self.n

    def __hash__(self):
        return hash(("TokenSpace", self.n))


class TokenEnv(gym.Env):
    """Observations from a custom :class:`TokenSpace`."""

    def __init__(self):
        self.observation_space = TokenSpace()
        self.action_space = spaces.Discrete(3)
        self._t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return f"tok{int(self.np_random.integers(5))}", {}

    def step(self, action):
        self._t += 1
        obs = f"tok{(int(action) + self._t + int(self.np_random.integers(5))) % 5}"
        return obs, float(action), self._t >= 3, False, {}


#: Spaces of no fixed shape (travel pickled), alone and inside Dict / Tuple.
DYNAMIC_KINDS = ("graph", "sequence", "sequence_stacked", "oneof", "dict_graph", "tuple_sequence", "dict_oneof")


def make_dynamic_space(kind: str) -> spaces.Space:
    if kind == "graph":
        return spaces.Graph(node_space=spaces.Box(-1, 1, (2,), np.float32), edge_space=spaces.Discrete(3))
    if kind == "sequence":
        return spaces.Sequence(spaces.Discrete(4))
    if kind == "sequence_stacked":
        return spaces.Sequence(spaces.Box(0, 1, (2,), np.float32), stack=True)
    if kind == "oneof":
        return spaces.OneOf([spaces.Discrete(3), spaces.Box(0, 1, (2,), np.float32)])
    if kind == "dict_graph":
        return spaces.Dict({"g": spaces.Graph(node_space=spaces.Discrete(4), edge_space=None),
                            "x": spaces.Box(-1, 1, (2,), np.float32)})
    if kind == "tuple_sequence":
        return spaces.Tuple((spaces.Sequence(spaces.Discrete(2)), spaces.Discrete(3)))
    if kind == "dict_oneof":
        return spaces.Dict({"o": spaces.OneOf([spaces.Discrete(2), spaces.MultiBinary(3)]), "k": spaces.Discrete(2)})
    raise ValueError(kind)


def has_dynamic_shape(kind: str) -> bool:
    """Whether gymnasium's shared memory refuses the space (Graph and Sequence, anywhere in it)."""
    return "graph" in kind or "sequence" in kind


class SampledEnv(gym.Env):
    """Observations sampled from its observation space (any space, or a :data:`DYNAMIC_KINDS`
    name), reseeded from ``np_random`` at every reset, so runs with the same seeds are equal.
    Episodes last ``episode_len`` steps; the action is not looked at."""

    def __init__(self, observation_space: spaces.Space | str, action_space: spaces.Space | str | None = None,
                 episode_len: int = 3):
        def space(s):
            return make_dynamic_space(s) if isinstance(s, str) else s

        self.observation_space = space(observation_space)
        self.action_space = space(action_space if action_space is not None else spaces.Discrete(2))
        self.episode_len = episode_len
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self._t = 0
        return self.observation_space.sample(), {"t": 0}

    def step(self, action):
        self._t += 1
        return self.observation_space.sample(), float(self._t), self._t >= self.episode_len, False, {"t": self._t}


def describe(action: Any) -> Any:
    """An exact account of an action as an env received it: type, dtype and repr of every
    part (dicts and tuples part by part)."""
    if isinstance(action, dict):
        return {key: describe(value) for key, value in action.items()}
    if type(action) is tuple:
        return tuple(describe(item) for item in action)
    return (f"{type(action).__module__}.{type(action).__qualname__}", str(getattr(action, "dtype", "")), repr(action))


RECORDING_SPACES = {
    "box0": lambda: spaces.Box(0.0, 1.0, (), np.float32),
    "box": lambda: spaces.Box(-1.0, 1.0, (3,), np.float32),
    "discrete": lambda: spaces.Discrete(3),
    "dict": lambda: spaces.Dict({"a": spaces.Discrete(3), "b": spaces.Box(-1.0, 1.0, (2,), np.float32)}),
    "tuple": lambda: spaces.Tuple((spaces.Discrete(3), spaces.Box(-1.0, 1.0, (2,), np.float64))),
}


class RecordingEnv(gym.Env):
    """Keeps an exact account (:func:`describe`) of every action it is given, in ``received``;
    with ``strict``, raises ``ValueError`` for an action outside its action space."""

    def __init__(self, act_kind: str = "box", strict: bool = False):
        self.action_space = RECORDING_SPACES[act_kind]()
        self.observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.strict = strict
        self.received: list[Any] = []

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.received.append(describe(action))
        if self.strict and not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is outside {self.action_space}")
        return np.full(1, len(self.received) % 2, np.float32), 1.0, False, False, {}


def order_enforced_env(reset: bool = False, **kwargs) -> gym.Env:
    """A :class:`SpaceEnv` in gymnasium's ``OrderEnforcing`` wrapper (as ``gymnasium.make`` adds
    it), reset by the factory itself if ``reset``."""
    env = gym.wrappers.OrderEnforcing(SpaceEnv(**kwargs))
    if reset:
        env.reset(seed=0)
    return env


def env_fn(**kwargs):
    """A picklable factory for :class:`SpaceEnv`."""
    return functools.partial(SpaceEnv, **kwargs)


def env_fns(n: int = 3, **kwargs):
    return [env_fn(**kwargs) for _ in range(n)]


def time_limited(max_episode_steps: int, **kwargs) -> gym.Env:
    """A :class:`SpaceEnv` inside gymnasium's ``TimeLimit`` (for ``env_is_wrapped`` / truncation)."""
    return gym.wrappers.TimeLimit(SpaceEnv(**kwargs), max_episode_steps)


def _infrastructure_pids() -> set[int]:
    """The forkserver and resource-tracker processes multiprocessing keeps for the whole session."""
    pids = set()
    try:
        from multiprocessing import forkserver

        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if pid:
            pids.add(pid)
    except Exception:
        pass
    try:
        from multiprocessing import resource_tracker

        pid = getattr(resource_tracker._resource_tracker, "_pid", None)
        if pid:
            pids.add(pid)
    except Exception:
        pass
    return pids


def worker_children(grace: float = 10.0) -> list:
    """Descendant processes other than multiprocessing infrastructure, after a short grace period
    for reaping (no timing is asserted: the grace only bounds how long we wait)."""
    import psutil  # imported lazily: worker processes never need it

    deadline = time.monotonic() + grace
    while True:
        infra = _infrastructure_pids()
        alive = []
        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.pid not in infra and proc.is_running():
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def assert_tree_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Exact, type-aware equality over nested dicts / tuples / lists / numpy arrays (incl. object arrays)."""
    where = path or "<root>"
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected dict, got {type(actual).__name__}"
        assert set(actual) == set(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_tree_equal(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)), f"{where}: expected sequence, got {type(actual).__name__}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_tree_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{where}: expected ndarray, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        if expected.dtype == object:
            for idx in np.ndindex(expected.shape):
                assert_tree_equal(actual[idx], expected[idx], f"{path}[{idx}]")
        else:
            assert np.array_equal(actual, expected), f"{where}: {actual!r} != {expected!r}"
    elif expected is None:
        assert actual is None, f"{where}: expected None, got {actual!r}"
    else:
        assert type(actual) is type(expected) or (
            isinstance(actual, np.generic) and isinstance(expected, np.generic)
        ), f"{where}: type {type(actual).__name__} != {type(expected).__name__}"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def run_lockstep(vec, ref, mode=AutoresetMode.NEXT_STEP, steps=60, seed=123, action_seed=None, min_done=0):
    """Step ``vec`` (under test) and ``ref`` (a ``SyncVectorEnv``) with identical seeds and random
    actions, asserting identical results; first reset both with ``seed`` unless it is ``None``.
    In DISABLED mode, finished envs are reset with ``options={"reset_mask": mask}``."""
    if seed is not None:
        assert_tree_equal(vec.reset(seed=seed), ref.reset(seed=seed), "reset")
    action_space = batch_space(ref.single_action_space, ref.num_envs)
    action_space.seed(seed if action_seed is None else action_seed)
    finished = 0
    for t in range(steps):
        actions = action_space.sample()
        expected = ref.step(actions)
        assert_tree_equal(vec.step(actions), expected, f"step {t}")
        done = expected[2] | expected[3]
        finished += int(done.sum())
        if mode == AutoresetMode.DISABLED and done.any():
            assert_tree_equal(
                vec.reset(options={"reset_mask": done.copy()}),
                ref.reset(options={"reset_mask": done.copy()}),
                f"masked reset after step {t}",
            )
    assert finished >= min_done, "the trajectories did not exercise episode ends"
