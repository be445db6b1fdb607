"""Advice from measurement: which layout of ``num_envs`` envs is fastest on this machine.

One env's step cost comes from ``envmanager.core.auto``'s throwaway-process measurement (wall
and CPU time, their spread, the CPU share, and a ping's round trip). Then each candidate layout
runs briefly (``envmanager.check.measure``: env-steps/s now, and expected when the machine is
yours): the envs in this process (gymnasium's ``SyncVectorEnv``), envmanager with
``num_envs // cores`` envs per process, one env per process, one process per core but the
parent's, double buffered (``double_buffer=True``: two lanes per process, one steps while the
parent turns the other around; every process and the parent have a core, so requests and
answers go through the mailbox), and ``envs_per_worker="auto"``'s own choice (the layout model
of ``envmanager.core.layout``) where it is none of those. A layout whose one round would take too
long is estimated from the step cost instead, and marked so.

The choice, on the expected figures: among the process layouts, the model's choice (for even,
CPU-bound steps; one env per process for uneven or waiting ones) unless another measured 25%
faster (double buffering: 10%); then the in-process layout wins if it is at least as fast: below
~50 µs per step the cost of crossing the process boundary can be larger than what the other cores give.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from envmanager.check import measure
from envmanager.check.report import Advice, Layout
from envmanager.core.auto import (
    CPU_BOUND,
    UNEVEN_MIN_S,
    UNEVEN_RATIO,
    StepCost,
    measure_step_cost,
    model_choice,
    usable_cores,
)

__all__ = ["advise"]

WARMUP_S = measure.WARMUP_S
TIME_LIMIT_NOTE = "not measured: the time limit was reached"
OTHER_WINS = 1.25  # the process layout the rule did not pick must measure this much faster to be chosen
DOUBLE_WINS = 1.1


def _kind(cost: StepCost | str) -> str:
    if isinstance(cost, str):
        return "unmeasured"
    if cost.cpu_share < CPU_BOUND:
        return "waiting"
    if cost.cpu_p90_s > UNEVEN_RATIO * cost.cpu_median_s and cost.cpu_p90_s - cost.cpu_median_s > UNEVEN_MIN_S:
        return "cpu-bound, uneven"
    return "cpu-bound, even"


def stages(num_envs: int, cores: int | None = None) -> list[str]:
    """The stages :func:`advise` reports through ``tick``, in order."""
    return ["step cost", *[lay.description for lay in _layouts(num_envs, cores or usable_cores()) if lay.processes]]


def _layouts(num_envs: int, cores: int) -> list[Layout]:
    """The candidate layouts (see the module doc); one with no processes is not run."""
    k = max(1, num_envs // cores)
    layouts = [Layout("in-process", f"in this process: SyncVectorEnv of {num_envs}", num_envs, 1)]
    if k > 1:
        layouts.append(Layout("k-per-process", f"envmanager, {k} envs per process", k, -(-num_envs // k)))
    layouts.append(Layout("one-per-process", "envmanager, 1 env per process", 1, num_envs))
    # one process per core but the parent's (rounded up: never as many processes as cores); two lanes need two envs
    per_core = max(2, -(-num_envs // (cores - 1))) if cores >= 2 else 0
    if cores >= 2 and num_envs >= 2:
        layouts.append(Layout("double-buffered", f"envmanager, {per_core} envs per process, double-buffered", per_core,
                              -(-num_envs // per_core), double_buffer=True))
    elif cores >= 2:
        layouts.append(Layout("double-buffered", "envmanager, double-buffered", note=(
            "not measured: one env has nothing to split into two lanes")))
    else:
        layouts.append(Layout("double-buffered", "envmanager, double-buffered", note=(
            "not measured: on one core the parent has no core of its own")))
    return layouts


def advise(factory: Callable[[int], Any], num_envs: int, *, cores: int | None = None, seed: int = 0,
           measure_s: float = 1.0, deadline_s: float = 5.0, startup_s: float = 30.0, here: bool = True,
           tick: Callable[[str], None] = lambda stage: None, time_left: Callable[[], float] | None = None) -> Advice:
    """Measure and advise (see the module doc). ``here=False``: do not run the envs in this
    process (estimate that layout from the step cost). ``time_left()``: seconds left to measure
    in; a layout that no longer fits is not measured (``TIME_LIMIT_NOTE``), waits are capped by it."""

    def capped(seconds: float) -> float:
        return seconds if time_left is None else min(seconds, max(0.5, time_left()))

    cores = cores or usable_cores()
    tick("step cost")
    cost = measure_step_cost(factory, start_timeout=capped(startup_s))
    kind = _kind(cost)
    k = max(1, num_envs // cores)
    layouts = _layouts(num_envs, cores)
    model = _model_layout(num_envs, cores, cost, kind, layouts)
    if model is not None:
        layouts.append(model)
    # What one step costs when the machine is yours: its CPU time if it is CPU-bound (a loaded
    # machine stretches the wall time of every step), else its wall time (it waits).
    step_s = None if isinstance(cost, str) else (cost.cpu_median_s if kind.startswith("cpu-bound") else cost.median_s)
    for layout in layouts:
        if not layout.processes:
            continue
        per_round = num_envs if layout.id == "in-process" else layout.envs_per_process
        if step_s and step_s * per_round > measure_s / 4:  # too slow to measure briefly: estimate
            busy = 1 if layout.id == "in-process" else (layout.processes if kind == "waiting" else min(cores, layout.processes))
            layout.steps_per_s, layout.estimated = busy / step_s, True
            continue
        if layout.id == "in-process" and not here:
            layout.note = "not run: the env cannot safely run in this process (see the problems)"
            continue
        if time_left is not None and time_left() < measure_s + WARMUP_S + 1.0:
            layout.note = TIME_LIMIT_NOTE
            continue
        tick(layout.description)
        try:
            if layout.id == "in-process":
                found = measure.in_process(factory, num_envs, seed, measure_s)
            else:
                found = measure.in_processes(factory, num_envs, layout.envs_per_process, seed, measure_s,
                                             deadline_s, capped(startup_s), cores,
                                             double_buffer=layout.double_buffer)
        except Exception as exc:
            layout.note = f"failed: {type(exc).__name__}: {exc}"
            continue
        layout.steps_per_s, layout.now_per_s, layout.bound = found.expected, found.now, found.bound
    advice = _choose(num_envs, cores, cost, kind, k, layouts, _per_env(factory))
    advice.load_average = measure.load_average()
    return advice


def _model_layout(num_envs: int, cores: int, cost: StepCost | str, kind: str, layouts: list[Layout]) -> Layout | None:
    """``envs_per_worker="auto"``'s choice (``envmanager.core.auto.choose_layout``: the layout model
    with the costs measured here) as a layout to measure, unless a candidate already is it
    (then that candidate is marked as the model's)."""
    if kind != "cpu-bound, even" or isinstance(cost, str) or num_envs < cores:
        return None
    best, _ = model_choice(cost, num_envs, cores)
    k, db = best.layout.envs_per_worker, best.layout.double_buffer
    for layout in layouts:
        same = layout.envs_per_process == k and layout.double_buffer == db
        if same and layout.id != "in-process":
            layout.note = (layout.note + " " if layout.note else "") + f"the model's choice ({best})"
            return None
    lanes = ", double-buffered" if db else ""
    return Layout("model", f"envmanager, {k} envs per process{lanes} (envs_per_worker=\"auto\")", k, -(-num_envs // k),
                  note=f"the model's choice: {best}", double_buffer=db)


def _per_env(factory: Any) -> str:
    """The list of env factories ``SyncVectorEnv`` takes, as the user would write it for ``factory``
    (one taking the worker id, one taking nothing, or a gymnasium id); ``{n}``: the number of envs."""
    env_id = getattr(factory, "env_id", None)
    if env_id is not None:
        return f"[lambda: gymnasium.make({env_id!r})] * {{n}}"
    if getattr(factory, "takes_id", True):
        return "[functools.partial(make_env, i) for i in range({n})]"
    return "[make_env] * {n}"


def _choose(num_envs: int, cores: int, cost: StepCost | str, kind: str, k: int, layouts: list[Layout],
            per_env: str) -> Advice:
    by_id = {layout.id: layout for layout in layouts}
    rate = {i: (lay.steps_per_s or 0.0) for i, lay in by_id.items()}
    rule = "k-per-process" if kind == "cpu-bound, even" and k > 1 else "one-per-process"
    if "model" in by_id or any("the model's choice" in lay.note for lay in layouts):  # auto's own choice
        rule = next(lay.id for lay in layouts if lay.id == "model" or "the model's choice" in lay.note)
    other = "one-per-process" if rule == "k-per-process" else ("k-per-process" if k > 1 else rule)
    best = rule
    if rate[other] > OTHER_WINS * rate[rule]:
        best = other
    if rate.get("double-buffered", 0.0) > DOUBLE_WINS * rate[best]:
        best = "double-buffered"
    chosen = "in-process" if rate["in-process"] > 0 and rate["in-process"] >= rate[best] else best
    step = ({"unmeasured": cost} if isinstance(cost, str) else
            {"median_us": cost.median_s * 1e6, "p90_us": cost.p90_s * 1e6, "cpu_median_us": cost.cpu_median_s * 1e6,
             "cpu_p90_us": cost.cpu_p90_s * 1e6, "cpu_share": cost.cpu_share, "steps": cost.steps})
    why, how = _explain(chosen, best, by_id, kind, num_envs, cost, per_env)
    return Advice(num_envs, cores, step, kind, layouts, chosen, why, how)


def _rate(layout: Layout) -> str:
    return "unmeasured" if layout.steps_per_s is None else f"{layout.steps_per_s:,.0f} env-steps/s"


def _explain(chosen: str, best: str, by_id: dict[str, Layout], kind: str, n: int, cost: StepCost | str,
             per_env: str) -> tuple[str, str]:
    lay, proc = by_id[chosen], by_id[best]
    per_step = "" if isinstance(cost, str) else f"at {cost.median_s * 1e6:,.0f} µs per step, "
    if chosen == "in-process":
        ratio = (lay.steps_per_s or 0) / proc.steps_per_s if proc.steps_per_s else float("inf")
        why = (f"in this process, gymnasium.vector.SyncVectorEnv ({_rate(lay)}, {ratio:.1f}x envmanager's best here: "
               f"{proc.description}, {_rate(proc)}). {per_step.capitalize()}crossing the process boundary costs more "
               "than the other cores give. Choose processes anyway if the env may crash or hang: in a worker that "
               "is an exception, in your process it stops your trainer.")
        how = f"envs = gymnasium.vector.SyncVectorEnv({per_env.format(n=n)})"
        return why, how
    sync = by_id["in-process"]
    versus = f", {(lay.steps_per_s or 0) / sync.steps_per_s:.1f}x SyncVectorEnv" if sync.steps_per_s else ""
    reason = {
        "k-per-process": "even, CPU-bound steps: one message carries several steps and no more processes compete "
                         "for the cores than there are cores",
        "one-per-process": "uneven or waiting steps: first-ready stepping never waits for a slow neighbour, and "
                           "waits overlap" if kind != "cpu-bound, even" else "it measured fastest",
        "double-buffered": "the parent has a core of its own: one half of the envs steps while it turns the other around",
        "model": "what envs_per_worker=\"auto\" chooses here: the layout model's best for this step and this machine",
    }[chosen]
    why = f"{lay.description} ({_rate(lay)}{versus}): {reason}."
    if chosen == "double-buffered":  # the lockstep drop-ins wait for both lanes each step: no gain there
        how = f"SubprocessEnvManager(make_env, {n}, envs_per_worker={lay.envs_per_process}, double_buffer=True)"
        return why, how
    if chosen == "model":
        how = f'SubprocessEnvManager(make_env, {n}, envs_per_worker="auto", double_buffer="auto")'
        return why, how
    how = f"SubprocessEnvManager(make_env, {n}, envs_per_worker={lay.envs_per_process})"
    if chosen != "one-per-process":
        how += f"  # or envmanager.AsyncVectorEnv(env_fns, envs_per_worker={lay.envs_per_process})"
    return why, how
