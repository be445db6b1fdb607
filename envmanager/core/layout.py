"""How to lay ``n_env`` envs over worker processes on this machine (``envs_per_worker="auto"``):
the candidate layouts, a small model of what each delivers, and the best of them.

A layout is ``processes`` worker processes of ``envs_per_worker`` envs (the last may have fewer),
each in one lane or two (double buffered: one half steps while the parent turns the other
around). The candidates, the model's costs and rates: docs/guide/performance.md ("auto uses
the machine"). The costs are measured where the layout is chosen (``envmanager.core.auto``); the
worker's overhead and the callers' own Python are constants, documented where they are defined.
``python -m benchmarks.scaling --check`` compares predictions with runs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Costs", "Caller", "Layout", "Prediction", "predict", "candidates", "best_layout", "DEFAULT_COSTS", "BATCH",
           "STEP_INFO", "VECTOR", "VECTOR_PARTIAL", "SB3", "NO_INFOS", "BOARD_INFOS", "NOTICE_INFOS"]


@dataclass(frozen=True)
class Costs:
    """Seconds of the model's costs (see the module doc). ``auto`` measures the first four on
    this machine; the defaults are this project's 2-core VM's (the performance guide), used only
    where a measurement is missing."""

    round_trip_s: float = 80e-6  # a ping between two processes asleep on their pipes (measured)
    pipe_s: float = 15e-6  # the parent's CPU per round trip on a pipe: a write and a read (measured, the ping's)
    parent_s: float = 6.5e-6  # the parent's CPU per step of a batch on the step board (measured) ...
    parent_process_s: float = 0.05e-6  # ... and per process asked (measured: a fit at 1 and 64 processes)
    #: The worker's overhead per request beyond its envs' steps, and per env in it: constants (not
    #: measured by ``auto``): 5-12 µs per request measured in process on the 2-core VM.
    worker_s: float = 8e-6
    worker_env_s: float = 1e-6
    #: The parent's CPU per answer that comes as a notice (infos the board cannot hold, or any answer
    #: on the pipes), filed one process at a time: a constant (10-13 µs measured on the 2-core VM).
    notice_s: float = 10e-6
    board: bool = True  # whether the step board works here (x86: ``envmanager.wire.mailbox``)


DEFAULT_COSTS = Costs()


@dataclass(frozen=True)
class Caller:
    """Who steps the envs, as the model needs it: its own Python per step on top of the board's
    (``step_s``), per env-step (``env_s``: a ``StepInfo`` costs more than a row of an array) and
    per step where the envs return infos (``info_s``), and whether it steps in lockstep.
    Constants: its ``step()`` against stand-ins answering at once, on the 2-core VM, less the
    board's own operations (``benchmarks.parent``)."""

    name: str
    step_s: float
    env_s: float
    info_s: float = 0.0
    lockstep: bool = False


BATCH = Caller("the batch level", 5.5e-6, 0.1e-6, 3e-6)
STEP_INFO = Caller("SubprocessEnvManager.step", 6e-6, 5e-6, 3e-6)
VECTOR = Caller("a vector env in lockstep", 9e-6, 0.1e-6, 17e-6, lockstep=True)
VECTOR_PARTIAL = Caller("a vector env in partial batches", 9e-6, 0.1e-6, 17e-6)
SB3 = Caller("SB3's VecEnv", 12e-6, 1e-6, 17e-6, lockstep=True)
#: What the envs' infos are, for the model: none, flat scalars the step board's info rows hold,
#: or anything else (pickled in a notice per answer).
NO_INFOS, BOARD_INFOS, NOTICE_INFOS = "none", "board", "notices"


@dataclass(frozen=True)
class Layout:
    """``processes`` processes of ``envs_per_worker`` envs (the last may have fewer), in ``lanes``."""

    processes: int
    envs_per_worker: int
    lanes: int = 1

    @property
    def double_buffer(self) -> bool:
        return self.lanes == 2


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted env-steps/s and what bounds it: ``"workers"``, ``"parent"`` or ``"cpu"``
    (shared cores); ``own_cores``: whether every process and the parent have a core."""

    layout: Layout
    steps_per_s: float
    bound: str
    own_cores: bool

    def __str__(self) -> str:
        lay = self.layout
        lanes = ", double buffered" if lay.double_buffer else ""
        where = "the parent on a core of its own" if self.own_cores else "the parent sharing a core"
        return (f"{lay.processes} process(es) of {lay.envs_per_worker} env(s){lanes}, {where}: "
                f"{self.steps_per_s:,.0f} env-steps/s predicted, bound by the {self.bound}")


def predict(layout: Layout, n_env: int, step_s: float, cores: int, costs: Costs = DEFAULT_COSTS,
            caller: Caller = BATCH, infos: str = NO_INFOS) -> Prediction:
    """What ``layout`` of ``n_env`` envs of ``step_s`` seconds per step delivers on ``cores`` cores
    for ``caller``; ``infos``: what the envs' infos are (``NO_INFOS``, ``BOARD_INFOS``, ``NOTICE_INFOS``)."""
    processes, lanes = layout.processes, layout.lanes
    e = min(layout.envs_per_worker, n_env) / lanes  # env-steps per answer
    own = processes + 1 <= cores
    pipes = not (own and costs.board)  # nothing spins where processes share cores: the pipes carry it all
    trip = 0.0 if own else costs.round_trip_s
    noticed = pipes or infos == NOTICE_INFOS
    per_process = costs.parent_process_s + (costs.pipe_s if pipes else 0.0) + (costs.notice_s if noticed else 0.0)
    per_step = caller.step_s + costs.parent_s + (caller.info_s if infos != NO_INFOS else 0.0)

    def worker(envs: float) -> float:
        return envs * (step_s + costs.worker_env_s) + costs.worker_s + (costs.pipe_s if pipes else 0.0)

    def parent(asked: float, envs: float) -> float:
        return per_step + per_process * asked + caller.env_s * envs

    if caller.lockstep:  # every env each step: the parent asks and takes all, the fullest process steps
        turnaround, stepping = parent(processes * lanes, n_env), lanes * worker(e)
        rate = n_env / (turnaround + trip + stepping)
        bound = "workers" if stepping >= turnaround else "parent"
        cpu = n_env / (turnaround + processes * lanes * worker(e)) * cores  # the cores' share, where they are shared
    else:  # each answer turned around on its own; two lanes overlap it with the other half's step
        turnaround = parent(1, e)
        cycle = worker(e) + turnaround + trip
        rate = processes * lanes * e / (cycle if lanes == 1 else max(2 * worker(e), cycle))
        bound = "workers"
        if e / turnaround < rate:  # the parent answers one at a time: the one serial part
            rate, bound = e / turnaround, "parent"
        cpu = cores * e / (worker(e) + turnaround)
    if not own and cpu < rate:
        rate, bound = cpu, "cpu"
    return Prediction(layout, rate, bound, own)


def candidates(n_env: int, cores: int, lockstep: bool = False) -> list[Layout]:
    """The layouts that put every core to work (see the module doc): one env per process where
    there are fewer envs than cores; else the fewest envs per process for ``cores - 1``
    processes and for ``cores``, in one lane or (not in lockstep) two."""
    if n_env < cores:
        return [Layout(n_env, 1, 1)]
    out: list[Layout] = []
    for room in (cores - 1, cores):  # the parent on a core of its own, or sharing one
        if room < 1:
            continue
        k = -(-n_env // room)
        for lanes in (1, 2) if k >= 2 and not lockstep else (1,):
            layout = Layout(-(-n_env // k), k, lanes)
            if layout not in out:
                out.append(layout)
    return out


def best_layout(n_env: int, step_s: float, cores: int, costs: Costs = DEFAULT_COSTS, caller: Caller = BATCH,
                infos: str = NO_INFOS, envs_per_worker: int | None = None,
                lanes: int | None = None) -> tuple[Prediction, list[Prediction]]:
    """The best candidate (the fewest processes, then lanes, among those within 2% of the
    fastest), and every candidate's prediction. With ``envs_per_worker`` given, only its lanes
    are chosen; with ``lanes``, only layouts with that many (one where a process has a single env)."""
    layouts = candidates(n_env, cores, caller.lockstep)
    if envs_per_worker is not None:
        k = max(1, int(envs_per_worker))
        p = -(-n_env // k)
        layouts = [Layout(p, k, 1)] + ([Layout(p, k, 2)] if k >= 2 and not caller.lockstep else [])
    if lanes is not None:  # (a single env per process has one lane)
        layouts = list(dict.fromkeys(Layout(lay.processes, lay.envs_per_worker, lanes if lay.envs_per_worker >= 2 else 1)
                                     for lay in layouts))
    predictions = [predict(lay, n_env, step_s, cores, costs, caller, infos) for lay in layouts]
    fastest = max(p.steps_per_s for p in predictions)
    close = [p for p in predictions if p.steps_per_s >= 0.98 * fastest]
    return min(close, key=lambda p: (p.layout.processes, p.layout.lanes)), predictions
