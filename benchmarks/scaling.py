"""The layout model on paper, and checked: what ``envs_per_worker="auto"`` chooses for 64 envs on
2-64 cores and what it predicts (``envmanager.core.layout``), and its predictions against runs here.

The table takes the model's costs measured on this machine as ``auto`` measures them (a ping
between two sleeping processes and this process's CPU per ping, from ``auto``'s throwaway
process; the parent's turnaround on the step board, ``auto.board_costs``), or with
``--sixteen`` the 16-core machine's figures (``SIXTEEN``: its round trip; the board's and the
pipes' costs were not measured there, so they are this machine's: ``--slower`` multiplies the
parent's and the pipes' CPU to see how much the choice depends on them). Its rows are the ``scale``
scenario's envs with their step as the 16-core machine's limit gave it (``STEPS``).

``--check`` runs the drop-in's ``step()`` (``envmanager.AsyncVectorEnv``, lockstep) here, 4 envs
per core, in every layout ``auto`` considers, at a cheap and a costly step, and prints each run
next to the model's prediction with the costs measured in the same session, and which layout
``auto`` would choose.

    python -m benchmarks.scaling                        # 64 envs, costs measured here
    python -m benchmarks.scaling --sixteen              # ... with the 16-core machine's round trip
    python -m benchmarks.scaling --sixteen --slower 2   # ... and its parent twice as costly
    python -m benchmarks.scaling --check                # predictions against runs here (~30 s)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from envmanager.core.layout import (
    BOARD_INFOS,
    DEFAULT_COSTS,
    NO_INFOS,
    VECTOR,
    Caller,
    Costs,
    best_layout,
    candidates,
    predict,
)

CORES = (2, 8, 16, 32, 64)
N_ENV = 64
#: ``scale``'s envs: one env's step on the 16-core machine (its 16-process limit / 16:
#: ``shared/device/README.md``), and what its infos are (flat scalars ride on the board).
STEPS: dict[str, tuple[float, str]] = {
    "20 µs burn": (21e-6, BOARD_INFOS),  # {"t": n}
    "200 µs burn": (203e-6, BOARD_INFOS),
    "CartPole-v1": (10.5e-6, NO_INFOS),  # 1.38-1.66M / 16: 9.6-11.6 µs
    "ALE Pong-v5": (542e-6, BOARD_INFOS),  # lives, frame numbers
}
#: The 16-core machine: the round trip a worker waits for each request there (~85 µs of idle per
#: request, DESIGN.md's "Where users run it"). Its board and pipe costs were not measured: this
#: machine's defaults stand in for them.
SIXTEEN = replace(DEFAULT_COSTS, round_trip_s=85e-6)


def costs_measured_here() -> Costs:
    """The costs ``auto`` measures, measured now (a burn env of 20 µs measured in a throwaway process)."""
    from envmanager.bench.scenarios import burn_env
    from envmanager.core.auto import costs_here, measure_step_cost

    cost = measure_step_cost(functools.partial(burn_env, 20e-6))
    if isinstance(cost, str):
        raise RuntimeError(cost)
    return costs_here(cost)


def slower(costs: Costs, factor: float) -> Costs:
    """``costs`` with the parent's and the pipes' CPU ``factor`` times as costly."""
    return replace(costs, parent_s=costs.parent_s * factor, parent_process_s=costs.parent_process_s * factor,
                   pipe_s=costs.pipe_s * factor, notice_s=costs.notice_s * factor)


def table(costs: Costs, caller: Caller = VECTOR, n_env: int = N_ENV, cores: Sequence[int] = CORES) -> str:
    head = "| envs (step) | " + " | ".join(f"{n} cores" for n in cores) + " |"
    lines = [head, "|" + "---|" * (1 + len(cores))]
    for name, (step, infos) in STEPS.items():
        cells = []
        for n in cores:
            best, _ = best_layout(n_env, step, n, costs, caller, infos)
            lay = best.layout
            db = " db" if lay.double_buffer else ""
            share = "" if best.own_cores else ", shared"
            cells.append(f"{best.steps_per_s:,.0f} ({lay.processes}×{lay.envs_per_worker}{db}{share}; {best.bound})")
        lines.append(f"| {name} ({step * 1e6:,.1f} µs) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check(seconds: float = 2.0, steps: Sequence[float] = (20e-6, 200e-6)) -> str:
    """The drop-in's ``step()`` here in every layout ``auto`` considers, against the model."""
    import numpy as np

    import envmanager
    from envmanager.bench.scenarios import burn_env
    from envmanager.core.auto import board_costs, costs_here, describe, measure_step_cost, usable_cores

    cores = usable_cores()
    n = 4 * cores
    board = board_costs()
    rows = ["| step | layout | regime | predicted | measured | measured / predicted |", "|---|---|---|---:|---:|---:|"]
    for cost in steps:
        factory = functools.partial(burn_env, cost)
        measured_cost = measure_step_cost(factory)
        if isinstance(measured_cost, str):
            raise RuntimeError(measured_cost)
        costs = costs_here(measured_cost, board)
        step, infos = measured_cost.cpu_median_s, measured_cost.infos
        chosen, _ = best_layout(n, step, cores, costs, VECTOR, infos)
        for layout in candidates(n, cores, lockstep=True):
            prediction = predict(layout, n, step, cores, costs, VECTOR, infos)
            vec = envmanager.AsyncVectorEnv([functools.partial(factory, i) for i in range(n)],
                                            envs_per_worker=layout.envs_per_worker, double_buffer=False, context="fork")
            try:
                vec.reset(seed=0)
                actions = np.zeros(n, dtype=np.int64)
                done, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    vec.step(actions)
                    done += n
                rate = done / (time.perf_counter() - start)
            finally:
                vec.close()
            regime = "own cores" if prediction.own_cores else "shared cores"
            mark = " (auto)" if layout == chosen.layout else ""
            rows.append(f"| {cost * 1e6:g} µs | {layout.processes}×{layout.envs_per_worker}{mark} | {regime} | "
                        f"{prediction.steps_per_s:,.0f} | {rate:,.0f} | {rate / prediction.steps_per_s:.2f} |")
    return "\n".join(rows) + f"\n\n{n} envs on {cores} cores, the drop-in's step(). Costs measured here: {describe(costs)}."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sixteen", action="store_true", help="the 16-core machine's round trip (SIXTEEN)")
    parser.add_argument("--slower", type=float, default=1.0, help="the parent's and the pipes' CPU this many times costlier")
    parser.add_argument("--check", action="store_true", help="the model's predictions against runs on this machine")
    parser.add_argument("--seconds", type=float, default=2.0, help="--check: seconds per run (default 2)")
    args = parser.parse_args(argv)
    if args.check:
        print(check(args.seconds))
        return 0
    from envmanager.core.auto import describe

    costs = slower(SIXTEEN if args.sixteen else costs_measured_here(), args.slower)
    print(table(costs))
    print(f"\n{N_ENV} envs, the drop-in's step() (lockstep): the model's best layout per machine (processes × envs "
          f"per process; shared: the parent shares a core, everything on the pipes; what bounds it). Costs: "
          f"{describe(costs)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
