"""The workloads of ``envmanager bench``: which environments, how many, how many steps.

Every factory here is a module-level callable (or a picklable object), so every backend can
ship it to its workers under any start method.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import gymnasium as gym
import numpy as np

from envmanager.bench.common import cores
from envmanager.testing.envs import ControlledEnv

__all__ = [
    "GROUPS",
    "Scenario",
    "SCENARIOS",
    "SWEEP_COSTS",
    "PINNED_COSTS",
    "SCALE_CONTENDERS",
    "SCALE_PER_CORE",
    "MANY_CORES",
    "pinned",
    "scale",
    "actions_for",
    "env_columns",
    "in_process_rate",
    "scenario_unavailable",
    "with_n_env",
]

CPU_TIME = 500e-6  # seconds of CPU each step of the ``cpu`` scenario burns
UNEVEN = (2e-3, 1.0)  # ``uneven``: lognormal step time (median seconds, sigma)
UNITY_LATENCY = (5e-3, 10e-3)  # ``unity``: each player sleeps latency + uniform [0, jitter] per step
SWEEP_COSTS = (5e-6, 20e-6, 50e-6, 200e-6, 1e-3, 5e-3)  # ``sweep``: CPU seconds each step burns
SWEEP_SECONDS = 2.0  # ``sweep``: default steps per repeat ~ this many seconds at the 2-core limit
PINNED_COSTS = (5e-6, 20e-6, 63e-6, 200e-6, 1e-3)  # ``pinned``: 63 us is HalfCheetah's step
ATARI_ID, MUJOCO_ID = "ALE/Pong-v5", "HalfCheetah-v5"
SCALE_PER_CORE = 4  # ``scale``: envs per usable core, unless ``--num-envs`` says otherwise
MANY_CORES = 8  # ``scale`` is the many-core figure from this many usable cores; below, the shared regime
#: ``scale``'s contenders when no ``--backends`` are named: the drop-ins as users get them (no
#: ``envs_per_worker`` or ``double_buffer`` arguments) and every peer that applies.
SCALE_CONTENDERS = ("envmanager-vector-default", "envmanager-batch", "envmanager-sb3", "gym.AsyncVectorEnv",
                    "gym.SyncVectorEnv", "sb3.SubprocVecEnv", "pufferlib.Multiprocessing", "pufferlib.Multiprocessing-sync",
                    "tianshou.SubprocVectorEnv", "tianshou.ShmemVectorEnv", "torchrl.ParallelEnv", "envpool")
#: ``cycle``'s contenders: one env (the drop-in's ``step()`` with one env per process, the SB3
#: drop-in, the core's batch level, gymnasium's AsyncVectorEnv), and two envs in two lanes.
CYCLE_CONTENDERS = ("envmanager-vector", "envmanager-sb3", "envmanager-batchlevel", "gym.AsyncVectorEnv")
CYCLE_LANES_CONTENDERS = ("envmanager-db", "envmanager-batch-db")
#: EnvPool's Pong set up to do what ``atari`` envs do: frameskip 4 (max-pooled), full RGB frames,
#: no sticky actions, no life-loss episodes, raw rewards.
ENVPOOL_PONG = (("img_height", 210), ("img_width", 160), ("gray_scale", False), ("stack_num", 1),
                ("episodic_life", False), ("reward_clip", False), ("repeat_action_probability", 0.0))


# ---------------------------------------------------------------------------------------------
# Environment factories (module level: picklable by reference)


def cartpole(env_id: int) -> gym.Env:
    return gym.make("CartPole-v1")


def cpu_env(env_id: int) -> gym.Env:
    return ControlledEnv(env_id, cpu_time=CPU_TIME)


def uneven_env(env_id: int) -> gym.Env:
    return ControlledEnv(env_id, lognormal=UNEVEN)


def burn_env(cpu_time: float, env_id: int) -> gym.Env:
    """``sweep``: an env whose every step burns ``cpu_time`` seconds of CPU."""
    return ControlledEnv(env_id, cpu_time=cpu_time)


def atari_env(env_id: int) -> gym.Env:
    """``atari``: ALE's Pong, 4 frames per step, no sticky actions (as EnvPool's published table)."""
    import ale_py

    gym.register_envs(ale_py)
    return gym.make(ATARI_ID, frameskip=4, repeat_action_probability=0.0)


def mujoco_env(env_id: int) -> gym.Env:
    return gym.make(MUJOCO_ID)


def unity_env(env_id: int) -> Any:  # pragma: no cover - depends on the ML-Agents adapter
    raise NotImplementedError("the unity scenario is run by its own backend")


def pettingzoo_env(name: str, env_id: int) -> Any:
    """``pettingzoo``: the PettingZoo env ``name`` of ``envmanager.bench.pettingzoo_envs`` (imported
    here, when called: PettingZoo is an optional dependency)."""
    from envmanager.bench import pettingzoo_envs

    return getattr(pettingzoo_envs, name)(env_id)


# ---------------------------------------------------------------------------------------------
# Scenarios


@dataclass(frozen=True)
class Scenario:
    """``n_env`` envs from ``factory(env_id)``, stepped ``steps`` env-steps per timed repeat.

    Attributes:
        n_actions: actions are drawn from ``range(n_actions)`` (a Discrete action space).
        gym_id: the registered gymnasium id, when the envs are plain ``gym.make(gym_id)``
            (lets EnvPool, which only knows registered ids, join in).
        measure_limit: also measure the machine's limit, ``min(cores, n_env)`` times one
            env's in-process step rate (for CPU-bound envs).
        reference_n_env: also measure every backend with this many envs of the same kind
            and report the ratio (how throughput holds up as envs are added).
        compare_lockstep: add a ratio column against ``envmanager-lockstep`` (uneven envs).
        kind: ``"gym"`` (gymnasium envs from ``factory``) or ``"unity"`` (fake Unity players,
            run by the backends' ML-Agents variants; ``factory`` unused), or a scenario measured by a
            module of its own, with its own contenders (``"sampler"``: ``envmanager.bench.sampler_bench``,
            ``"ray"``: ``envmanager.bench.ray_bench``, ``"pettingzoo"``: ``envmanager.bench.pettingzoo_bench``,
            whose ``steps`` are agent-steps; see ``runner.OWN_MODULES``; ``--backends``
            does not apply).
        requires: ``"module"`` or ``"module:attribute"`` that must import for the scenario to run.
        action_dim: continuous actions: vectors of this size, uniform in [-1, 1] (else Discrete).
        envpool_id, envpool_kwargs: EnvPool's own version of these envs, if it has one.
        group: the scenarios run together under this name (``sweep``).
        step_cost: CPU seconds each step burns (``sweep``: the x axis of its curve).
        pin: the parent on a core of its own, the workers on the others, during the timed loop
            (``envmanager.bench.pinning``); the limit is then the worker cores' (``pinned``, ``--pin``).
        pin_workers: pinned, the workers on only this many cores (``cycle``: the one worker
            process on one core); ``None``: on every core but the parent's.
        limit_processes: the limit is measured as ``min(cores, n_env)`` processes, started
            together, each stepping its own env in process (no IPC) for a fixed time, their rates
            summed (``scale``: ``envmanager.bench.limit``); ``measure_limit`` then adds one env's
            rate alone, to compare.
        backends: what runs when no ``--backends`` are named (``None``: every backend).
        in_all: ``--scenario all`` runs it (not a scenario whose setups another one runs).
    """

    name: str
    description: str
    factory: Callable[[int], Any]
    n_env: int
    steps: int
    n_actions: int = 2
    gym_id: str | None = None
    measure_limit: bool = False
    reference_n_env: int | None = None
    compare_lockstep: bool = False
    kind: str = "gym"
    requires: tuple[str, ...] = ()
    action_dim: int | None = None
    envpool_id: str | None = None
    envpool_kwargs: tuple[tuple[str, Any], ...] = ()
    group: str | None = None
    step_cost: float | None = None
    pin: bool = False
    pin_workers: int | None = None
    limit_processes: bool = False
    backends: tuple[str, ...] | None = None
    in_all: bool = True


def _cost_label(seconds: float) -> str:
    return f"{seconds * 1e3:g}ms" if seconds >= 1e-3 else f"{seconds * 1e6:g}us"


#: What the ``pinned`` scenarios simulate (and what they do not).
PACKED = ("; parent pinned to a core of its own, workers to the rest: several envs packed per worker core (on 2 cores "
          "all 8 on one), not the many-core regime of a worker with a core of its own (cycle, scale)")


def _pinned(cost: float) -> Scenario:
    return Scenario(
        f"pinned-{_cost_label(cost)}", f"8 envs burning {_cost_label(cost)} of CPU per step{PACKED}",
        functools.partial(burn_env, cost), 8, int(min(40_000, SWEEP_SECONDS / cost)),
        n_actions=3, measure_limit=True, group="pinned", step_cost=cost, pin=True,
    )


#: ``scale``'s cases: what the envs are, their factory, env-steps per usable core per repeat
#: (~0.5 s at the limit on the 16-core machine), and the scenario's other fields.
_SCALE_CASES: dict[str, tuple[str, Callable[[int], Any], int, dict[str, Any]]] = {
    "scale-200us": ("envs burning 200us of CPU per step", functools.partial(burn_env, 200e-6), 2_500,
                    {"n_actions": 3, "step_cost": 200e-6}),
    "scale-20us": ("envs burning 20us of CPU per step", functools.partial(burn_env, 20e-6), 20_000,
                   {"n_actions": 3, "step_cost": 20e-6}),
    "scale-cartpole": ("CartPole-v1 envs", cartpole, 40_000, {"gym_id": "CartPole-v1", "envpool_id": "CartPole-v1"}),
    "scale-pong": (f"{ATARI_ID} envs (ale-py), frameskip 4, RGB frames", atari_env, 1_000,
                   {"n_actions": 6, "requires": ("ale_py",), "envpool_id": "Pong-v5", "envpool_kwargs": ENVPOOL_PONG}),
}


def scale(case: str, n_env: int | None = None) -> Scenario:
    """The ``scale`` case ``case`` (``scale-200us``, ``scale-20us``, ``scale-cartpole``, ``scale-pong``)
    with ``n_env`` envs, by default ``SCALE_PER_CORE`` x the usable cores (``--num-envs``)."""
    what, factory, per_core, fields = _SCALE_CASES[case]
    usable = cores()
    how = f"--num-envs {n_env}" if n_env is not None else f"{SCALE_PER_CORE} x {usable} usable cores"
    n = n_env if n_env is not None else SCALE_PER_CORE * usable
    processes = min(usable, n)
    return Scenario(
        case, f"{n} {what} ({how}), the drop-ins as users get them; limit: {processes} processes, one env each, "
        "stepped together in process", factory, n, max(20 * n, per_core * usable), measure_limit=True,
        limit_processes=True, group="scale", backends=SCALE_CONTENDERS, **fields,
    )


def _cycle(cost: float, lanes: bool = False) -> Scenario:
    label = _cost_label(cost)
    what = (f"2 envs burning {label} of CPU per step in one worker process, two lanes (double buffered)" if lanes
            else f"1 env burning {label} of CPU per step in one worker process")
    return Scenario(
        f"cycle-2lanes-{label}" if lanes else f"cycle-{label}", f"{what}; the parent pinned to one core, the worker to "
        "another: the per-process cycle of a many-core machine, where each worker process has a core of its own",
        functools.partial(burn_env, cost), 2 if lanes else 1, int(min(40_000, SWEEP_SECONDS / cost)), n_actions=3,
        measure_limit=True, group="cycle", step_cost=cost, pin=True, pin_workers=1,
        backends=CYCLE_LANES_CONTENDERS if lanes else CYCLE_CONTENDERS,
    )


def pinned(scenario: Scenario) -> Scenario:
    """``scenario`` with the parent pinned to a core of its own (``--pin``)."""
    if scenario.pin:
        return scenario
    group = "pinned" if scenario.group == "sweep" else scenario.group  # its curve: the pinned one
    # a limit only for envs that burn CPU (CartPole's and the CPU-burning ones): sleeping envs have none
    limit = scenario.measure_limit or scenario.gym_id is not None
    return replace(scenario, name=f"{scenario.name}+pin", pin=True, measure_limit=limit, group=group)


def _pettingzoo() -> list[Scenario]:
    """``pettingzoo``: a cheap, a costly and a set-cost PettingZoo env (8 of each; ``steps`` are
    agent-steps), on 2 shared cores and pinned."""
    spread = "8 MPE simple_spread_v3 (3 agents, Discrete(5), mpe2)"
    piston = "8 pistonball_v6 (20 pistons, 457x120 RGB observations, Box actions)"
    burn = "8 PettingZoo envs of 4 agents burning 200us of CPU per step"
    pin = "; parent pinned to a core of its own, workers to the rest"
    made = functools.partial(pettingzoo_env, "spread"), functools.partial(pettingzoo_env, "pistonball")
    out = []
    for prefix, pinned_, where in (("", False, ""), ("pinned-", True, pin)):
        out += [
            Scenario(f"{prefix}pettingzoo-spread", spread + where, made[0], 8, 24_000, n_actions=5,
                     measure_limit=True, kind="pettingzoo", requires=("mpe2",), group="pettingzoo", pin=pinned_),
            Scenario(f"{prefix}pettingzoo-pistonball", piston + where, made[1], 8, 4_000, action_dim=1,
                     measure_limit=True, kind="pettingzoo", requires=("pettingzoo.butterfly.pistonball_v6",),
                     group="pettingzoo", pin=pinned_),
            Scenario(f"{prefix}pettingzoo-200us", burn + where, functools.partial(pettingzoo_env, "burn"), 8, 32_000,
                     n_actions=3, measure_limit=True, kind="pettingzoo", requires=("pettingzoo",), group="pettingzoo",
                     step_cost=200e-6, pin=pinned_),
        ]
    return out


def _sweep(cost: float) -> Scenario:
    return Scenario(
        f"sweep-{_cost_label(cost)}", f"8 envs burning {_cost_label(cost)} of CPU per step",
        functools.partial(burn_env, cost), 8, int(min(40_000, SWEEP_SECONDS * 2 / cost)),
        n_actions=3, measure_limit=True, group="sweep", step_cost=cost,
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("cartpole", "8 CartPole-v1 envs", cartpole, 8, 40_000, gym_id="CartPole-v1",
                 envpool_id="CartPole-v1"),
        Scenario(
            "many", "64 CartPole-v1 envs (compared with 8)", cartpole, 64, 40_000,
            gym_id="CartPole-v1", envpool_id="CartPole-v1", reference_n_env=8,
        ),
        Scenario(
            "cpu", f"8 envs burning {CPU_TIME * 1e6:.0f} us of CPU per step", cpu_env, 8, 8_000,
            n_actions=3, measure_limit=True,
        ),
        Scenario(
            "uneven", f"8 envs sleeping lognormal(median {UNEVEN[0] * 1e3:g} ms, sigma {UNEVEN[1]:g}) per step",
            uneven_env, 8, 3_000, n_actions=3, compare_lockstep=True,
        ),
        Scenario(
            "sampler", "the sampling layer: worker-side policy (8 CartPole, numpy MLP), parent-side policy on uneven "
            "envs, learner feed", cartpole, 8, 20_000, kind="sampler",
        ),
        *(_sweep(cost) for cost in SWEEP_COSTS),
        Scenario(
            "atari", f"8 {ATARI_ID} envs (ale-py), frameskip 4, RGB frames", atari_env, 8, 8_000,
            n_actions=6, measure_limit=True, requires=("ale_py",), envpool_id="Pong-v5", envpool_kwargs=ENVPOOL_PONG,
        ),
        Scenario(
            "mujoco", f"8 {MUJOCO_ID} envs (gymnasium[mujoco])", mujoco_env, 8, 16_000,
            action_dim=6, measure_limit=True, requires=("mujoco",), envpool_id=MUJOCO_ID,
        ),
        Scenario(
            "pinned-parent", "2 envs that burn nothing per step, one per lane of one process; parent pinned to a core of "
            "its own: the parent is the bound (its CPU per answer of one env-step)", functools.partial(burn_env, 0.0), 2,
            40_000, n_actions=3, group="pinned", pin=True,
        ),
        *(_pinned(cost) for cost in PINNED_COSTS),
        Scenario(
            "pinned-mujoco", f"8 {MUJOCO_ID} envs{PACKED}", mujoco_env,
            8, 16_000, action_dim=6, measure_limit=True, requires=("mujoco",), group="pinned", pin=True,
        ),
        Scenario(
            "pinned-atari", f"8 {ATARI_ID} envs (ale-py){PACKED}",
            atari_env, 8, 8_000, n_actions=6, measure_limit=True, requires=("ale_py",), group="pinned", pin=True,
        ),
        *(scale(case) for case in _SCALE_CASES),
        _cycle(200e-6),
        _cycle(63e-6),
        _cycle(200e-6, lanes=True),
        Scenario(
            "ray", "2 Ray nodes (actors here) x 4 CartPole-v1, fragments of 256 steps, policy on the nodes",
            cartpole, 8, 100_000, kind="ray", requires=("ray",),
        ),
        *_pettingzoo(),
        Scenario(
            "unity", "8 fake Unity players (gRPC), step latency {:g} ms + uniform [0, {:g} ms]".format(
                *(1e3 * t for t in UNITY_LATENCY)), unity_env, 8, 1_000,
            n_actions=3, compare_lockstep=True, kind="unity",
            requires=("mlagents_envs", "envmanager.mlagents:MLAgentsEnvManager"),
        ),
        Scenario(
            "unity-trainer", "ML-Agents' trainer (PPO): mlagents-learn against envmanager-learn batched and unbatched, "
            "fake players (4 agents, 2 ms), 1, 2, 4 envs and 4, 8, 16 of uneven speed", unity_env, 4, 6_000,
            kind="unity-trainer", requires=("mlagents.trainers.learn",),
        ),
        Scenario(
            "unity-trainer-scale", "ML-Agents' trainer (PPO): mlagents-learn against envmanager-learn batched and "
            "unbatched, fake players (4 agents, 2 ms), 4 envs and 8, 16 of uneven speed", unity_env, 16, 6_000,
            kind="unity-trainer", requires=("mlagents.trainers.learn",), in_all=False,  # unity-trainer's subset
        ),
    )
}


#: Names that stand for several scenarios on the command line.
GROUPS: dict[str, list[str]] = {}
for _s in SCENARIOS.values():
    if _s.group:
        GROUPS.setdefault(_s.group, []).append(_s.name)


def with_n_env(scenario: Scenario, n_env: int) -> Scenario:
    return replace(scenario, n_env=n_env, name=f"{scenario.name}@{n_env}")


def scenario_unavailable(scenario: Scenario) -> str | None:
    """Why ``scenario`` cannot run here, or ``None``."""
    for requirement in scenario.requires:
        module, _, attribute = requirement.partition(":")
        try:
            found = importlib.import_module(module)
            if attribute and not hasattr(found, attribute):
                return f"{module}.{attribute} does not exist (yet)"
        except Exception as exc:  # ImportError, or a broken optional dependency
            return f"{requirement} cannot be imported ({type(exc).__name__}: {exc})"
    return None


def actions_for(scenario: Scenario, steps: int, seed: int = 0) -> np.ndarray:
    """The action sequence every backend uses: row ``k`` holds each env's ``k``-th action.

    Backends that step envs at different rates (first-ready) read each env's column at their
    own pace, wrapping around; so every env sees the same actions in every backend.
    """
    rows = -(-steps // scenario.n_env) + 16
    rng = np.random.default_rng(seed)
    if scenario.action_dim:
        return rng.uniform(-1, 1, size=(rows, scenario.n_env, scenario.action_dim)).astype(np.float32)
    return rng.integers(0, scenario.n_actions, size=(rows, scenario.n_env))


def env_columns(actions: np.ndarray) -> list[list[Any]]:
    """Each env's actions in order: Python ints (Discrete), or arrays (continuous)."""
    if actions.ndim == 2:
        return actions.T.tolist()  # python ints: no numpy scalars on the hot path
    return [list(actions[:, i]) for i in range(actions.shape[1])]


def in_process_rate(scenario: Scenario, steps: int, actions: np.ndarray) -> float:
    """Steps per second of one env of ``scenario`` stepped in this process (no IPC at all)."""
    env = scenario.factory(0)
    try:
        env.reset(seed=0)
        column = env_columns(actions)[0]
        rows = len(column)
        step = env.step
        start = time.perf_counter()
        for k in range(steps):
            _, _, terminated, truncated, _ = step(column[k % rows])
            if terminated or truncated:
                env.reset()
        return steps / (time.perf_counter() - start)
    finally:
        env.close()
