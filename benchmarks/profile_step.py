"""Count the parent's function calls per env-step, ours against gymnasium's and SB3's, and
measure the parent's CPU time per env-step and per answer.

On cheap envs the parent's Python work per env-step is what limits throughput (see
docs/guide/performance.md), and a count of function calls measures that work without the noise of
timings: this script steps 8 CartPole-v1 envs (workers started with ``fork``) through

* ``envmanager.AsyncVectorEnv`` (``envs_per_worker`` 1 and 4) next to gymnasium's own
  ``gymnasium.vector.AsyncVectorEnv``,
* ``envmanager.sb3.SubprocVecEnv`` (``envs_per_worker`` 1 and 4) next to Stable-Baselines3's
  own ``SubprocVecEnv`` (rows skipped with the reason when SB3 is not installed),
* ``SubprocessEnvManager.step`` (``envs_per_worker`` 1 and 4), a dict of actions for the idle
  workers as in docs/guide/step-semantics.md's first loop, counting the env-steps it returns; it has no peer
  with the same API, so its ratio is to gymnasium's ``AsyncVectorEnv``, for scale only,
* the batch level, ``BatchEnvManager.send_batch`` / ``receive_batch`` first-ready, plain and
  double buffered (two lanes per process; for scale, as the StepInfo level),

resets and warms each up outside the profile, then counts with :mod:`cProfile` (Python and
built-in functions, as ``pstats.Stats.total_calls`` counts them) over ``--steps`` env-steps,
and prints a markdown table with the ratios and the targets: with ``envs_per_worker=4`` the
SB3 drop-in makes at most 0.5x the calls of its peer and the gymnasium drop-in at most 0.45x,
with ``envs_per_worker=1`` each at most as many (``TARGETS``).
Before the profile, an unprofiled pass of as many env-steps measures the parent's CPU time
(``time.process_time``: every thread of the parent, none of the workers) per env-step and,
for ours, per answer it took (``WorkerPool.answers``): on a many-core machine that is the one
serial part, capping the whole machine at ``1 / (CPU per env-step)`` env-steps per second.
Counts are per env-step of the parent process only; workers are not profiled. A profiled
parent is slower, so a first-ready ``step()`` finds more workers done per call than it would
unprofiled: its count is a little optimistic.

    python -m benchmarks.profile_step          # from the checkout: profiles its envmanager
    python -m benchmarks.profile_step --steps 4000 --top 15 --json calls.json
    python -m benchmarks.profile_step --configs envmanager.AsyncVectorEnv gymnasium.AsyncVectorEnv

(``python benchmarks/profile_step.py`` profiles whichever envmanager is installed; the report
says which.)
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import json
import multiprocessing
import os
import platform
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

N_ENV = 8
ENV_ID = "CartPole-v1"
CONTEXT = "fork"
ACTION_ROWS = 256  # distinct action rows, cycled

GYM_ASYNC = "gymnasium.AsyncVectorEnv"
SB3_SUBPROC = "sb3.SubprocVecEnv"
OURS_VECTOR = "envmanager.AsyncVectorEnv"
OURS_SB3 = "envmanager.sb3.SubprocVecEnv"
OURS_CORE = "SubprocessEnvManager.step"
OURS_BATCH = "BatchEnvManager"
OURS_BATCH_DB = "BatchEnvManager (double buffered)"

#: Target ratio of calls per env-step, ours / theirs, by ``envs_per_worker`` (a config's own
#: ``Config.targets`` where it has them).
TARGETS = {1: 1.0, 4: 0.5}

# A driver profiles one config: (envs_per_worker, actions, warm-up env-steps, env-steps)
# -> (env-steps profiled, stats, Clock of the unprofiled pass). It closes everything it
# started, whatever happens.
Driver = Callable[[int, np.ndarray, int, int], "tuple[int, pstats.Stats, Clock]"]


@dataclass
class Clock:
    """The unprofiled pass: env-steps, the parent's CPU seconds, answers taken (ours)."""

    env_steps: int = 0
    cpu_s: float = 0.0
    answers: int | None = None


def _timed(drive: Callable[[int], int], steps: int, answers: Callable[[], int] | None) -> Clock:
    """Run ``drive(steps)`` unprofiled; the parent's CPU time and the answers it took."""
    a0 = answers() if answers else 0
    c0 = time.process_time()
    done = drive(steps)
    cpu = time.process_time() - c0
    return Clock(done, cpu, answers() - a0 if answers else None)


def _answers_of(env: Any) -> Callable[[], int] | None:
    manager = getattr(env, "_manager", None)
    return (lambda: manager.pool.answers) if manager is not None else None


@dataclass(frozen=True)
class Config:
    """One way of stepping the envs.

    ``reference``: the peer whose count this one's is divided by (``None`` for the peers);
    ``matching``: the reference has the same API, so the targets apply; ``per_worker``: takes
    ``envs_per_worker`` (else one env per process); ``requires``: modules that must import;
    ``targets``: its target ratios by ``envs_per_worker``, where they differ from ``TARGETS``.
    """

    name: str
    driver: Driver
    reference: str | None = None
    matching: bool = True
    per_worker: bool = False
    requires: tuple[str, ...] = ()
    targets: dict[int, float] = field(default_factory=lambda: dict(TARGETS), hash=False)


@dataclass
class Row:
    """The count of one config at one ``envs_per_worker``."""

    config: str
    envs_per_worker: int
    env_steps: int
    calls: int
    reference: str | None = None
    ratio: float | None = None
    top: list[dict[str, Any]] = field(default_factory=list)
    clock: Clock = field(default_factory=Clock)

    @property
    def calls_per_env_step(self) -> float:
        return self.calls / self.env_steps

    @property
    def cpu_us_per_env_step(self) -> float | None:
        return self.clock.cpu_s / self.clock.env_steps * 1e6 if self.clock.env_steps else None

    @property
    def cpu_us_per_answer(self) -> float | None:
        return self.clock.cpu_s / self.clock.answers * 1e6 if self.clock.answers else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "calls_per_env_step": self.calls_per_env_step,
                "parent_cpu_us_per_env_step": self.cpu_us_per_env_step, "parent_cpu_us_per_answer": self.cpu_us_per_answer}


# ---------------------------------------------------------------------------------------------
# Drivers


def _env_fns() -> list[Callable[[], gym.Env]]:
    return [functools.partial(gym.make, ENV_ID) for _ in range(N_ENV)]


def _profile_lockstep(
    make: Callable[[], Any], reset: Callable[[Any], Any], actions: np.ndarray, warmup: int, steps: int
) -> tuple[int, pstats.Stats, Clock]:
    """A vector env's ``step(actions_row)``: ``warmup`` env-steps unprofiled, ``steps`` timed
    (the parent's CPU), then ``steps`` profiled."""
    env = make()
    try:
        reset(env)
        step, rows = env.step, len(actions)
        for k in range(-(-warmup // N_ENV)):
            step(actions[k % rows])

        def drive(limit: int) -> int:
            for k in range(-(-limit // N_ENV)):
                step(actions[k % rows])
            return -(-limit // N_ENV) * N_ENV

        clock = _timed(drive, steps, _answers_of(env))
        rounds = -(-steps // N_ENV)
        profiler = cProfile.Profile()
        profiler.enable()
        for k in range(rounds):  # indexing a numpy array is no function call: only step() counts
            step(actions[k % rows])
        profiler.disable()
    finally:
        env.close()
    return rounds * N_ENV, pstats.Stats(profiler), clock


def _reset_seeded(env: Any) -> None:
    env.reset(seed=0)


def _reset_sb3(env: Any) -> None:
    env.seed(0)
    env.reset()


def gym_async(envs_per_worker: int, actions: np.ndarray, warmup: int, steps: int) -> tuple[int, pstats.Stats]:
    """gymnasium's own AsyncVectorEnv (shared memory, one env per process)."""
    return _profile_lockstep(lambda: gym.vector.AsyncVectorEnv(_env_fns(), context=CONTEXT), _reset_seeded,
                             actions, warmup, steps)


def ours_vector(envs_per_worker: int, actions: np.ndarray, warmup: int, steps: int) -> tuple[int, pstats.Stats]:
    """The drop-in ``envmanager.AsyncVectorEnv``, ``step(actions)`` as gymnasium's."""
    import envmanager

    return _profile_lockstep(
        lambda: envmanager.AsyncVectorEnv(_env_fns(), context=CONTEXT, envs_per_worker=envs_per_worker),
        _reset_seeded, actions, warmup, steps,
    )


def sb3_subproc(envs_per_worker: int, actions: np.ndarray, warmup: int, steps: int) -> tuple[int, pstats.Stats]:
    """Stable-Baselines3's own SubprocVecEnv (pipes, one env per process)."""
    from stable_baselines3.common.vec_env import SubprocVecEnv

    return _profile_lockstep(lambda: SubprocVecEnv(_env_fns(), start_method=CONTEXT), _reset_sb3,
                             actions, warmup, steps)


def ours_sb3(envs_per_worker: int, actions: np.ndarray, warmup: int, steps: int) -> tuple[int, pstats.Stats]:
    """The drop-in ``envmanager.sb3.SubprocVecEnv``."""
    from envmanager.sb3 import SubprocVecEnv

    return _profile_lockstep(
        lambda: SubprocVecEnv(_env_fns(), start_method=CONTEXT, envs_per_worker=envs_per_worker),
        _reset_sb3, actions, warmup, steps,
    )


def ours_core(envs_per_worker: int, actions: np.ndarray, warmup: int, steps: int) -> tuple[int, pstats.Stats]:
    """``SubprocessEnvManager.step`` with a dict of actions for the idle workers (the first
    loop of docs/guide/step-semantics.md), first-ready: counts the env-steps (StepInfos) it returns."""
    from envmanager import SubprocessEnvManager
    from envmanager.bench.scenarios import cartpole  # module level: picklable by reference

    table = actions.tolist()  # python ints, as a user's policy would hand them over
    rows = len(table)
    with SubprocessEnvManager(cartpole, N_ENV, envs_per_worker=envs_per_worker, context=CONTEXT) as manager:
        manager.reset(seed=0)
        step = manager.step

        def drive(limit: int) -> int:
            done = k = 0
            while done < limit:
                row = table[k % rows]
                done += len(step({w: row[w] for w in manager.idle_worker_ids}))
                k += 1
            return done

        drive(warmup)
        clock = _timed(drive, steps, lambda: manager.pool.answers)
        profiler = cProfile.Profile()
        profiler.enable()
        done = drive(steps)
        profiler.disable()
    return done, pstats.Stats(profiler), clock


def ours_batch(envs_per_worker: int, actions: np.ndarray, warmup: int, steps: int,
               double_buffer: bool = False) -> tuple[int, pstats.Stats, Clock]:
    """The batch level, first-ready: whatever came back is sent its next actions at once."""
    from envmanager.bench.scenarios import cartpole
    from envmanager.core.batch import BatchEnvManager

    rows = len(actions)
    with BatchEnvManager(cartpole, N_ENV, envs_per_worker=envs_per_worker, context=CONTEXT,
                         double_buffer=double_buffer, info_columns=True) as manager:
        manager.send_reset({i: (i, None) for i in range(N_ENV)})
        manager.receive_reset_batch()
        position = np.ones(N_ENV, dtype=np.int64)
        manager.send_batch(np.arange(N_ENV), actions[0])

        def drive(limit: int) -> int:
            done = 0
            while done < limit:
                slots = manager.receive_batch(1, info_columns=True).slots  # infos unread: no dicts made
                p = position[slots]
                manager.send_batch(slots, actions[p % rows, slots])
                position[slots] = p + 1
                done += len(slots)
            return done

        drive(warmup)
        clock = _timed(drive, steps, lambda: manager.pool.answers)
        profiler = cProfile.Profile()
        profiler.enable()
        done = drive(steps)
        profiler.disable()
        manager.drain()
    return done, pstats.Stats(profiler), clock


def ours_batch_db(envs_per_worker: int, actions: np.ndarray, warmup: int, steps: int) -> tuple[int, pstats.Stats, Clock]:
    """``ours_batch`` with two lanes per process (double buffering)."""
    return ours_batch(envs_per_worker, actions, warmup, steps, double_buffer=True)


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config(GYM_ASYNC, gym_async),
        Config(OURS_VECTOR, ours_vector, reference=GYM_ASYNC, per_worker=True, targets={**TARGETS, 4: 0.45}),
        Config(SB3_SUBPROC, sb3_subproc, requires=("stable_baselines3",)),
        Config(OURS_SB3, ours_sb3, reference=SB3_SUBPROC, per_worker=True, requires=("stable_baselines3",)),
        Config(OURS_CORE, ours_core, reference=GYM_ASYNC, matching=False, per_worker=True),
        Config(OURS_BATCH, ours_batch, reference=GYM_ASYNC, matching=False, per_worker=True),
        Config(OURS_BATCH_DB, ours_batch_db, reference=GYM_ASYNC, matching=False, per_worker=True),
    )
}


# ---------------------------------------------------------------------------------------------
# Running and reporting


def _unavailable(config: Config) -> str | None:
    for module in config.requires:
        try:
            importlib.import_module(module)
        except Exception as exc:
            return f"{module} cannot be imported ({type(exc).__name__}: {exc})"
    return None


def _top(stats: pstats.Stats, env_steps: int, n: int) -> list[dict[str, Any]]:
    """The ``n`` functions called most often, with their calls per env-step."""
    entries = sorted(stats.stats.items(), key=lambda item: item[1][1], reverse=True)[:n]  # type: ignore[attr-defined]
    return [{"function": pstats.func_std_string(func), "calls_per_env_step": value[1] / env_steps}
            for func, value in entries]


def measure(configs: Sequence[str], envs_per_worker: Sequence[int], steps: int, warmup: int, seed: int = 0,
            top: int = 0) -> tuple[list[Row], dict[str, str], dict[str, str]]:
    """Profile each config (ours at each ``envs_per_worker``); rows, skipped and failed configs.

    References are measured before the configs compared with them, whatever the order given.
    """
    actions = np.random.default_rng(seed).integers(0, 2, size=(ACTION_ROWS, N_ENV))
    chosen = [CONFIGS[name] for name in CONFIGS if name in configs]  # peers first
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for config in chosen:
        why = _unavailable(config)
        if why:
            skipped[config.name] = why
            continue
        for k in (envs_per_worker if config.per_worker else (1,)):
            label = f"{config.name} (envs_per_worker={k})"
            try:
                done, stats, clock = config.driver(k, actions, warmup, steps)
            except Exception as exc:  # one broken config does not cost the others
                failed[label] = f"{type(exc).__name__}: {exc}"
                continue
            rows.append(Row(config.name, k, done, stats.total_calls,  # type: ignore[attr-defined]
                            top=_top(stats, done, top) if top else [], clock=clock))
    counts = {row.config: row.calls_per_env_step for row in rows if not CONFIGS[row.config].reference}
    for row in rows:
        reference = CONFIGS[row.config].reference
        if reference in counts:
            row.reference, row.ratio = reference, row.calls_per_env_step / counts[reference]
    return rows, skipped, failed


@dataclass(frozen=True)
class Target:
    config: str
    envs_per_worker: int
    reference: str
    ratio: float
    threshold: float

    @property
    def met(self) -> bool:
        return self.ratio <= self.threshold

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


def targets(rows: Sequence[Row]) -> list[Target]:
    """Ours against the peer with the same API: <= 1x its calls at 1 env/worker; at 4, <= 0.5x
    (SB3's drop-in) or 0.45x (gymnasium's): each config's ``targets``."""
    return [
        Target(r.config, r.envs_per_worker, r.reference, r.ratio, CONFIGS[r.config].targets[r.envs_per_worker])
        for r in rows
        if r.ratio is not None and r.reference and CONFIGS[r.config].matching
        and r.envs_per_worker in CONFIGS[r.config].targets
    ]


def format_report(rows: Sequence[Row], skipped: dict[str, str], failed: dict[str, str], steps: int) -> str:
    """The markdown table, the targets and what was skipped or failed."""
    lines = [
        f"Parent-side function calls per env-step (cProfile total_calls / env-steps), {N_ENV} {ENV_ID} envs, "
        f"context {CONTEXT}, ~{steps:,} env-steps per row:",
        "",
        "| config | envs_per_worker | env-steps | calls per env-step | ratio to reference "
        "| parent CPU µs per env-step | per answer |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if r.ratio is not None:
            scale = "" if CONFIGS[r.config].matching else ", for scale: not the same API"
            ratio = f"{r.ratio:.2f}x {r.reference}{scale}"
        else:
            ratio = "reference" if not CONFIGS[r.config].reference else "- (reference not measured)"
        cpu = "-" if r.cpu_us_per_env_step is None else f"{r.cpu_us_per_env_step:.1f}"
        per_answer = "-" if r.cpu_us_per_answer is None else f"{r.cpu_us_per_answer:.1f}"
        lines.append(f"| {r.config} | {r.envs_per_worker} | {r.env_steps:,} | {r.calls_per_env_step:.1f} | {ratio} "
                     f"| {cpu} | {per_answer} |")
    found = targets(rows)
    if found:
        lines += ["", "Targets (calls per env-step, ours / theirs):", ""]
        for t in found:
            lines.append(f"- {t.config}, envs_per_worker={t.envs_per_worker}: {t.ratio:.2f}x {t.reference} "
                         f"(target <= {t.threshold:g}x): {'met' if t.met else 'MISSED'}")
    for name, why in skipped.items():
        lines.append(f"\nskipped {name}: {why}")
    for label, why in failed.items():
        lines.append(f"\nFAILED {label}: {why}")
    for r in rows:
        if r.top:
            lines += ["", f"Most called in {r.config} (envs_per_worker={r.envs_per_worker}), per env-step:"]
            lines += [f"  {t['calls_per_env_step']:8.2f}  {t['function']}" for t in r.top]
    return "\n".join(lines)


def _leftover_children() -> list[str]:
    """Child processes of this one still alive (every config must have reaped its workers)."""
    try:
        import psutil
    except ImportError:
        return [f"pid {p.pid}" for p in multiprocessing.active_children()]
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(child.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
        if "resource_tracker" not in command and "forkserver" not in command:  # multiprocessing's own helpers
            left.append(f"pid {child.pid} ({command[:60]})")
    return left


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Profile, print the table; 1 if a config failed or a process was left behind."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=_positive, default=2000, help="env-steps profiled per row (default: 2000)")
    parser.add_argument("--warmup", type=_positive, default=400, help="env-steps before profiling (default: 400)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="CONFIG",
                        help=f"some of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--envs-per-worker", nargs="+", type=_positive, default=[1, 4], metavar="K",
                        help="envs per worker process for ours (default: 1 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the actions (default: 0)")
    parser.add_argument("--top", type=int, default=0, metavar="N", help="also list the N most called functions")
    parser.add_argument("--json", metavar="PATH", help="write the rows, targets and versions to this JSON file")
    args = parser.parse_args(argv)

    import envmanager

    source = os.path.dirname(os.path.abspath(envmanager.__file__))
    rows, skipped, failed = measure(args.configs, args.envs_per_worker, args.steps, args.warmup, args.seed, args.top)
    print(f"envmanager {envmanager.__version__} from {source}; gymnasium {gym.__version__}; "
          f"Python {sys.version.split()[0]}\n")
    print(format_report(rows, skipped, failed, args.steps))
    leftover = _leftover_children()
    if leftover:
        print(f"\nLEFT BEHIND: {', '.join(leftover)}")
    if args.json:
        meta = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "n_env": N_ENV, "env_id": ENV_ID,
            "context": CONTEXT, "steps": args.steps, "warmup": args.warmup, "envmanager_source": source,
            "versions": {m: getattr(sys.modules[m], "__version__", "?")
                         for m in ("envmanager", "gymnasium", "numpy", "stable_baselines3") if m in sys.modules},
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [r.to_dict() for r in rows], "targets": [t.to_dict() for t in targets(rows)],
                       "skipped": skipped, "failed": failed, "left_behind": leftover}, f, indent=2)
            f.write("\n")
        print(f"\nwrote {args.json}")
    return 1 if failed or leftover else 0


if __name__ == "__main__":
    sys.exit(main())
