"""Scaling on paper, and checked: env-steps/s predicted for 64 envs on 8-64 cores by the layout
model (``envmanager.core.layout``, what ``envs_per_worker="auto"`` chooses with), its costs
taken from a pinned bench run; and the model's predictions against runs on this machine.

From ``envmanager bench --scenario pinned --json FILE`` (the parent pinned to a core of its
own, the workers to the rest) this takes:

* the parent's CPU per answer without its spins (``work/ans``): at ``pinned-parent`` (answers of
  one env-step: ``parent_s``) and ``pinned-5us`` (answers of four: the slope, ``parent_env_s``);
* the worker's overhead per request: what the double-buffered batch level lost to the worker
  core's limit at 20 and 63 µs per step (``cycle - e * step``, per answer of ``e`` env-steps);
* one env's step at each cost (the limit's unit).

Then for each step cost (5, 20 and 63 µs, 200 µs, 1 ms and the real envs measured) and each
core count it prints the model's best layout of 64 envs, its rate and what bounds it (the
workers, the parent, or the shared cores' CPU). ``--before`` prints the same table with the
costs the performance guide had before the mailbox (74 µs per answer of 4 env-steps).

``--check`` runs the model's own test on this machine: the batch level, double buffered, with
one worker process (pinned: the parent and the worker each have a core, the own-cores regime)
and with two (shared cores), at a cheap and a costly step, and prints each run's env-steps/s
next to the model's prediction for that layout, with the costs measured in the same session.

    python -m benchmarks.scaling pinned.json            # the table, from a pinned run
    python -m benchmarks.scaling pinned.json --before   # with the costs before this round
    python -m benchmarks.scaling --check                # predictions against runs here (~1 min)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from envmanager.core.layout import REFERENCE, Costs, Layout, best_layout, predict

CORES = (8, 16, 32, 64)
N_ENV = 64
#: The costs the performance guide's scaling table had before the mailbox (2026-11-25): 74 µs of
#: parent CPU per answer of 4 env-steps, the worker's ~15 µs per request.
BEFORE = Costs(worker_s=13e-6, worker_env_s=0.5e-6, parent_s=62e-6, parent_env_s=3e-6)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def costs_from(data: dict, backend: str = "envmanager-db") -> tuple[Costs, dict[str, float]]:
    """The model's costs measured in a pinned run, and each pinned scenario's step (seconds)."""
    scenarios = data["scenarios"]
    steps: dict[str, float] = {}
    work: dict[float, float] = {}  # env-steps per answer -> parent CPU per answer
    worker: list[float] = []
    for name, s in scenarios.items():
        m = s["measurements"].get(backend)
        if not s.get("pinned") or m is None:
            continue
        per_answer = _median([n / a for n, a in zip(m["env_steps"], m["answers"], strict=True)]) if m["answers"] else 0
        if m.get("parent_work_per_answer_us") and (name == "pinned-parent" or name == "pinned-5us"):
            work[per_answer] = m["parent_work_per_answer_us"] * 1e-6
        if s.get("limit"):
            step = 1 / _median(s["limit"]["single_env_steps_per_second"])
            steps[name] = step
            cost = s.get("step_cost")
            if cost is not None and 20e-6 <= cost <= 63e-6 and per_answer:
                reached = m["median"] / s["limit"]["steps_per_second"]
                worker.append(per_answer * step * (1 / reached - 1))  # the cycle beyond the envs' own steps
    costs = REFERENCE
    if len(work) >= 2:
        (e1, p1), (e2, p2) = sorted(work.items())[:2]
        slope = max(0.0, (p2 - p1) / (e2 - e1))
        costs = replace(costs, parent_s=p1 - slope * e1, parent_env_s=slope)
    if worker:
        costs = replace(costs, worker_s=max(0.0, _median(worker) - costs.worker_env_s * 4))
    return costs, steps


def table(costs: Costs, steps: dict[str, float]) -> str:
    head = "| step | " + " | ".join(f"{n} cores" for n in CORES) + " |"
    lines = [head, "|" + "---|" * (1 + len(CORES))]
    for name, step in sorted(steps.items(), key=lambda kv: kv[1]):
        cells = []
        for n in CORES:
            best, _ = best_layout(N_ENV, step, n, costs)
            lay = best.layout
            db = " db" if lay.double_buffer else ""
            cells.append(f"{best.steps_per_s:,.0f} ({lay.processes}×{lay.envs_per_worker}{db}; {best.bound})")
        label = name.removeprefix("pinned-")
        lines.append(f"| {label} ({step * 1e6:,.0f} µs) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check(seconds: float = 2.0) -> str:
    """Runs on this machine against the model's predictions for the same layouts."""
    import numpy as np

    from envmanager.bench.pinning import pin_for_timing, pinned, plan
    from envmanager.bench.scenarios import burn_env
    from envmanager.core.auto import LOADED_ROUND_TRIP, measure_step_cost, usable_cores
    from envmanager.core.batch import BatchEnvManager

    cores = usable_cores()
    rows = ["| step | layout | regime | predicted | measured | measured / predicted |", "|---|---|---|---:|---:|---:|"]
    for cost in (5e-6, 200e-6):
        factory = functools.partial(burn_env, cost)
        measured_cost = measure_step_cost(factory)
        if isinstance(measured_cost, str):
            raise RuntimeError(measured_cost)
        costs = replace(REFERENCE.scaled(measured_cost.speed),
                        round_trip_s=LOADED_ROUND_TRIP * (measured_cost.round_trip_s or REFERENCE.round_trip_s))
        for processes, pin in ((1, True), (2, False)):
            n = 8
            k = n // processes
            step = measured_cost.cpu_median_s
            layout = Layout(processes, k, 2 if pin else 1)
            # pinned, the model sees the machine as the parent's core plus one per worker process
            prediction = predict(layout, n, step, processes + 1 if pin else cores, costs)
            m = BatchEnvManager(factory, n, envs_per_worker=k, double_buffer=layout.double_buffer, context="fork",
                                spin_s=None)
            try:
                m.send_reset({i: (i, None) for i in range(n)})
                m.receive_reset_batch()
                with pinned(plan() if pin else None):
                    pin_for_timing()
                    m.send_batch(np.arange(n), np.zeros(n, dtype=np.int64))
                    done, start = 0, time.perf_counter()
                    while time.perf_counter() - start < seconds:
                        slots = m.receive_batch(1).slots
                        m.send_batch(slots, np.zeros(len(slots), dtype=np.int64))
                        done += len(slots)
                    rate = done / (time.perf_counter() - start)
                m.drain()
            finally:
                m.close()
            regime = "own cores (pinned)" if pin else "shared cores"
            rows.append(f"| {cost * 1e6:g} µs | {processes}×{k}{' db' if layout.double_buffer else ''} | {regime} | "
                        f"{prediction.steps_per_s:,.0f} | {rate:,.0f} | {rate / prediction.steps_per_s:.2f} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="?", help="the JSON of `envmanager bench --scenario pinned --json FILE`")
    parser.add_argument("--backend", default="envmanager-db", help="whose figures (default: envmanager-db)")
    parser.add_argument("--before", action="store_true", help="the costs before this round (the guide's old table)")
    parser.add_argument("--check", action="store_true", help="the model's predictions against runs on this machine")
    args = parser.parse_args(argv)
    if args.check:
        print(check())
        return 0
    if not args.json:
        parser.error("give a pinned run's JSON, or --check")
    with open(args.json) as fh:
        costs, steps = costs_from(json.load(fh), args.backend)
    if args.before:
        costs = BEFORE
    if not steps:
        print(f"no pinned measurements of {args.backend} with a limit in {args.json}", file=sys.stderr)
        return 1
    print(table(costs, steps))
    print(f"\n{N_ENV} envs, the model's best layout per machine (processes × envs per process, db: double buffered; "
          f"what bounds it). Costs: the parent {costs.parent_s * 1e6:.1f} µs per answer + {costs.parent_env_s * 1e6:.1f} µs "
          f"per env-step in it, the worker {costs.worker_s * 1e6:.1f} µs per request + {costs.worker_env_s * 1e6:.1f} µs "
          f"per env in it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
