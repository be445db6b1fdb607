"""The ``pettingzoo`` scenarios of ``envmanager bench``: agent-steps per second of PettingZoo envs
in ``envmanager.pettingzoo.ParallelVectorEnv`` against SuperSuit's vector envs and against the
envs stepped in this process, on 2 shared cores and pinned (``envmanager.bench.pinning``).

Every contender steps the same 8 envs with the same actions, drawn up front: agent ``a`` of env
``i`` takes ``table[k % rows, i, a]`` at its ``k``-th step, in every contender.

* ``ParallelVectorEnv-k``: ``step()`` in lockstep, ``n_env // worker cores`` envs per process
  (the layout of SuperSuit's ``num_cpus=2`` on 2 cores);
* ``ParallelVectorEnv-auto``: ``step()`` in lockstep, ``envs_per_worker="auto"``;
* ``ParallelVectorEnv-db``: first-ready ``send`` / ``recv(1)``, ``n_env // worker cores`` envs per
  process, double buffered (two lanes per process): each env is sent its next actions as soon
  as it is back;
* ``supersuit-proc``: ``concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(env), 8, num_cpus=2)``
  (SuperSuit's ``ProcConcatVec``: 2 processes of 4 envs, lockstep);
* ``supersuit-concat``: the same with ``num_cpus=0`` (``ConcatVecEnv``: all in this process);
* ``in-process``: the PettingZoo envs stepped one after another in this process, with dicts.

Throughput is agent-steps per second: an agent's action taken by its env (a step that resets an
env, next-step autoreset, counts none). The limit is ``min(worker cores, envs)`` x one env's
agent-steps per second stepped in this process (on a worker core when pinned). Its contenders
are its own (``--backends`` does not apply); targets show with ``--targets``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from envmanager.bench import pinning
from envmanager.bench.backends import AUTO_CHOICES  # what ``envs_per_worker="auto"`` chose, by scenario
from envmanager.bench.common import LAST_RUN, START_METHOD, Progress, Tick, worker_cores
from envmanager.bench.runner import Measurement, ScenarioResult, Target
from envmanager.bench.scenarios import Scenario

logger = logging.getLogger(__name__)

__all__ = ["CONTENDERS", "PettingZooResult", "actions_table", "run", "supersuit_unavailable"]

OURS_K, OURS_AUTO, OURS_DB = "ParallelVectorEnv-k", "ParallelVectorEnv-auto", "ParallelVectorEnv-db"
SS_PROC, SS_CONCAT, IN_PROCESS = "supersuit-proc", "supersuit-concat", "in-process"
OURS = (OURS_K, OURS_AUTO, OURS_DB)
#: Ratio columns: reference -> column name.
COLUMNS = {SS_PROC: "vs ss.proc", SS_CONCAT: "vs ss.concat", IN_PROCESS: "vs in-process"}
SS_PROC_TARGET = 1.5  # >= 1.5x SuperSuit's process backend on 2 shared cores
LIMIT_TARGET, LIMIT_FROM_S = 0.9, 200e-6  # >= 0.9 of the worker-core limit pinned, from 200 us per env step
SUPERSUIT_CPUS = 2



@dataclasses.dataclass
class PettingZooResult(ScenarioResult):
    """A ``ScenarioResult`` in agent-steps/s, with ratio columns, targets and notes of its own."""

    notes: list[str] = dataclasses.field(default_factory=list)
    num_agents: int = 0
    unit: str = "agent-steps"
    ours: tuple[str, ...] = OURS
    env_step_s: list[float] = dataclasses.field(default_factory=list)  # one env's step in process, seconds

    def ratios(self) -> dict[str, dict[str, float]]:
        m = self.measurements
        out = {column: {b: x.median / m[ref].median for b, x in m.items()} for ref, column in COLUMNS.items() if ref in m}
        if self.limit:
            out["vs limit"] = {b: x.median / self.limit for b, x in m.items()}
        return out

    def targets(self) -> list[Target]:
        """Best of ours (and ``ParallelVectorEnv-auto``): >= 1.5x ``supersuit-proc`` on shared
        cores; pinned, where one env step takes >= 200 us in process, >= 0.9 of the limit."""
        ours = [self.measurements[b] for b in OURS if b in self.measurements]
        if not ours:
            return []
        best = max(ours, key=lambda x: x.median).backend
        contenders = [b for b in dict.fromkeys([best, OURS_AUTO]) if b in self.measurements]
        ratios, out = self.ratios(), []
        for backend in contenders:
            if not self.scenario.pin and backend in ratios.get(COLUMNS[SS_PROC], {}):
                out.append(Target(self.name, f"x supersuit num_cpus={SUPERSUIT_CPUS}", backend,
                                  ratios[COLUMNS[SS_PROC]][backend], SS_PROC_TARGET))
            step_s = statistics.median(self.env_step_s) if self.env_step_s else 0.0
            if self.scenario.pin and step_s >= LIMIT_FROM_S and backend in ratios.get("vs limit", {}):
                out.append(Target(self.name, f"x the {worker_cores(self.scenario)}-worker-core limit", backend,
                                  ratios["vs limit"][backend], LIMIT_TARGET))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "unit": self.unit, "num_agents": self.num_agents,
                "env_step_us": [s * 1e6 for s in self.env_step_s], "notes": list(self.notes)}


def actions_table(scenario: Scenario, num_agents: int, steps: int, seed: int = 0) -> np.ndarray:
    """``(rows, n_env, num_agents)`` Discrete actions (``(..., action_dim)`` floats in [-1, 1]):
    enough rows for ``steps`` agent-steps in lockstep, read modulo ``rows`` by every contender."""
    rows = -(-steps // (scenario.n_env * num_agents)) + 16
    rng = np.random.default_rng(seed)
    shape = (rows, scenario.n_env, num_agents)
    if scenario.action_dim:
        return rng.uniform(-1, 1, size=(*shape, scenario.action_dim)).astype(np.float32)
    return rng.integers(0, scenario.n_actions, size=shape)


def _acted(batch: Any) -> int:
    """Agent-steps in a ``MultiAgentBatch``: the agents present in envs that stepped (not reset)."""
    present = batch.present.reshape(len(batch.env_ids), -1)
    return int(present[~batch.episode_start].sum())


def _fns(scenario: Scenario) -> list[Callable[[], Any]]:
    return [functools.partial(scenario.factory, i) for i in range(scenario.n_env)]


def _per_worker(scenario: Scenario) -> int:
    return max(1, scenario.n_env // worker_cores(scenario))


# ---------------------------------------------------------------------------------------------
# The contenders: each returns (agent-steps, seconds of the timed loop)


def run_lockstep(scenario: Scenario, steps: int, table: np.ndarray, tick: Tick,
                 envs_per_worker: int | str | None = None) -> tuple[int, float]:
    """``ParallelVectorEnv.step`` (every env, wait for all), ``n_env // worker cores`` envs per process."""
    from envmanager.pettingzoo import ParallelVectorEnv

    rows, n = len(table), scenario.n_env
    flat = table.reshape(rows, n * table.shape[2], *table.shape[3:])
    progress = Progress(tick, scenario, steps)
    epw = _per_worker(scenario) if envs_per_worker is None else envs_per_worker
    with ParallelVectorEnv(_fns(scenario), envs_per_worker=epw, context=START_METHOD) as vec:
        if epw == "auto":
            AUTO_CHOICES[scenario.name] = vec.manager.envs_per_worker
        progress.pool = lambda: vec.manager.pool
        batch = vec.reset(seed=0)
        step = vec.step
        k = 0
        progress.start()
        while progress.done < steps:
            batch = step(flat[k % rows])
            k += 1
            progress.add(_acted(batch))
        elapsed = progress.stop()
    progress.close()
    return progress.done, elapsed


def run_auto(scenario: Scenario, steps: int, table: np.ndarray, tick: Tick) -> tuple[int, float]:
    return run_lockstep(scenario, steps, table, tick, envs_per_worker="auto")


def run_first_ready(scenario: Scenario, steps: int, table: np.ndarray, tick: Tick) -> tuple[int, float]:
    """``send`` / ``recv(1)``, double buffered: each env gets its next actions as soon as it is back."""
    from envmanager.pettingzoo import ParallelVectorEnv

    rows, n, agents = len(table), scenario.n_env, table.shape[2]
    shape = table.shape[3:]
    progress = Progress(tick, scenario, steps)
    with ParallelVectorEnv(_fns(scenario), envs_per_worker=_per_worker(scenario), context=START_METHOD,
                           double_buffer=True) as vec:
        progress.pool = lambda: vec.manager.pool
        vec.reset(seed=0)
        position = np.ones(n, dtype=np.int64)
        vec.send(table[0].reshape(n * agents, *shape))
        send, recv = vec.send, vec.recv
        progress.start()
        while progress.done < steps:
            batch = recv(1)
            ids = batch.env_ids
            p = position[ids]
            send(table[p % rows, ids].reshape(len(ids) * agents, *shape), ids)
            position[ids] = p + 1
            progress.add(_acted(batch))
        elapsed = progress.stop()
        vec.recv(n)  # what is still stepping, before closing
    progress.close()
    return progress.done, elapsed


def run_supersuit(scenario: Scenario, steps: int, table: np.ndarray, tick: Tick, num_cpus: int) -> tuple[int, float]:
    """SuperSuit's ``concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(env), n_env, num_cpus)``: one
    row per agent; it resets a finished env within the same step."""
    import supersuit as ss

    rows, n, agents = len(table), scenario.n_env, table.shape[2]
    flat = table.reshape(rows, n * agents, *table.shape[3:])
    progress = Progress(tick, scenario, steps)
    vec = ss.concat_vec_envs_v1(ss.pettingzoo_env_to_vec_env_v1(scenario.factory(0)), n, num_cpus=num_cpus,
                                base_class="gymnasium")
    try:
        vec.reset(seed=0)
        step = vec.step
        k = 0
        progress.start()
        while progress.done < steps:
            step(flat[k % rows])
            k += 1
            progress.add(n * agents)  # every agent, every step: SuperSuit asserts they all are there
        elapsed = progress.stop()
    finally:
        vec.close()
    progress.close()
    return progress.done, elapsed


def run_in_process(scenario: Scenario, steps: int, table: np.ndarray, tick: Tick) -> tuple[int, float]:
    """The PettingZoo envs stepped one after another in this process, PettingZoo's dicts."""
    envs = [scenario.factory(i) for i in range(scenario.n_env)]
    progress = Progress(tick, scenario, steps)
    try:
        for i, env in enumerate(envs):
            env.reset(seed=i)
        slot = {a: j for j, a in enumerate(envs[0].possible_agents)}
        values = table.tolist() if table.ndim == 3 else list(table)  # Python ints, or arrays per agent
        rows, k = len(values), 0
        progress.start()
        while progress.done < steps:
            row = values[k % rows]
            k += 1
            done = 0
            for i, env in enumerate(envs):
                mine = row[i]
                actions = {a: mine[slot[a]] for a in env.agents}
                env.step(actions)
                done += len(actions)
                if not env.agents:
                    env.reset()
            progress.add(done)
        elapsed = progress.stop()
    finally:
        for env in envs:
            env.close()
    progress.close()
    return progress.done, elapsed


def single_env_rate(scenario: Scenario, table: np.ndarray, env_steps: int) -> tuple[float, float]:
    """One env stepped in this process: (agent-steps/s, seconds per env step)."""
    env = scenario.factory(0)
    try:
        env.reset(seed=0)
        slot = {a: j for j, a in enumerate(env.possible_agents)}
        column = [row[0] for row in (table.tolist() if table.ndim == 3 else list(table))]
        acted = 0
        start = time.perf_counter()
        for k in range(env_steps):
            mine = column[k % len(column)]
            actions = {a: mine[slot[a]] for a in env.agents}
            env.step(actions)
            acted += len(actions)
            if not env.agents:
                env.reset()
        elapsed = time.perf_counter() - start
        return acted / elapsed, elapsed / env_steps
    finally:
        env.close()


@functools.cache
def supersuit_unavailable() -> str | None:
    """Why SuperSuit's contenders cannot run here, or ``None``."""
    try:
        import supersuit

        supersuit.concat_vec_envs_v1  # noqa: B018
    except Exception as exc:
        return f"supersuit cannot be imported ({type(exc).__name__}: {exc}): pip install 'supersuit==3.11.*'"
    return None


#: name -> (run, why it cannot run here or None)
CONTENDERS: dict[str, tuple[Callable[[Scenario, int, np.ndarray, Tick], tuple[int, float]], Callable[[], str | None]]] = {
    OURS_K: (run_lockstep, lambda: None),
    OURS_AUTO: (run_auto, lambda: None),
    OURS_DB: (run_first_ready, lambda: None),
    SS_PROC: (functools.partial(run_supersuit, num_cpus=SUPERSUIT_CPUS), supersuit_unavailable),
    SS_CONCAT: (functools.partial(run_supersuit, num_cpus=0), supersuit_unavailable),
    IN_PROCESS: (run_in_process, lambda: None),
}


# ---------------------------------------------------------------------------------------------


def run(scenario: Scenario, steps: int, repeats: int, progress: Any = None, seed: int = 0) -> PettingZooResult:
    """Measure every contender ``repeats`` times, interleaved, and the limit before each round."""
    result = PettingZooResult(scenario, steps, repeats)
    probe = scenario.factory(0)
    try:
        result.num_agents = agents = len(probe.possible_agents)
    finally:
        probe.close()
    table = actions_table(scenario, agents, steps, seed)
    chosen = []
    for name, (_, unavailable) in CONTENDERS.items():
        why = unavailable()
        if why:
            result.skipped[name] = why
        else:
            chosen.append(name)
    plan = pinning.plan() if scenario.pin else None
    bar = progress(steps * repeats * len(chosen), scenario.name) if progress else None
    try:
        for r in range(repeats):
            with pinning.on_worker_cores(plan):  # the limit's unit, where the workers run
                rate, step_s = single_env_rate(scenario, table, max(50, steps // (scenario.n_env * agents)))
            result.single_env_rate.append(rate)
            result.env_step_s.append(step_s)
            for name in chosen:
                if name in result.failed:
                    continue
                if bar is not None:
                    bar.set_description(f"{scenario.name}: {name} ({r + 1}/{repeats})")
                LAST_RUN.__init__()  # type: ignore[misc]
                try:
                    with pinning.pinned(plan):
                        got = CONTENDERS[name][0](scenario, steps, table, bar.update if bar is not None else _ignore)
                except Exception as exc:
                    logger.warning("%s: %s failed: %r", scenario.name, name, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
                    result.failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                result.measurements.setdefault(name, Measurement(name, scenario.name, scenario.n_env)).add(*got)
    finally:
        if bar is not None:
            bar.close()
    for name in result.failed:
        result.measurements.pop(name, None)
    _notes(result)
    return result


def _ignore(n: int) -> None:
    pass


def _notes(result: PettingZooResult) -> None:
    s = result.scenario
    step_us = statistics.median(result.env_step_s) * 1e6 if result.env_step_s else float("nan")
    result.notes.append(f"agent-steps/s ({result.num_agents} agents per env; one env step in process: {step_us:,.0f} us); "
                        "cpu/step: the parent's CPU per agent-step")
    auto = AUTO_CHOICES.get(result.name)
    result.notes.append(f"{OURS_K}, {OURS_DB}: {_per_worker(s)} envs per process ({worker_cores(s)} worker cores)"
                        + (f"; {OURS_AUTO} chose {auto}" if auto else "")
                        + f"; {SS_PROC}: {SUPERSUIT_CPUS} processes of {-(-s.n_env // SUPERSUIT_CPUS)} envs")
