"""Scaling on paper: env-steps/s predicted for 8-64 cores from a pinned bench run's figures.

On a machine with ``N`` cores the parent has one core and the workers the other ``N - 1``.
From ``envmanager bench --scenario pinned --json FILE`` (the parent pinned to a core of its
own, the workers to the rest) this takes, for each step cost and one backend (by default the
double-buffered batch level, ``envmanager-db``):

* ``r``: one env's in-process rate (the limit of one worker core),
* ``eta``: the fraction of the worker cores' limit the backend reached (the turnaround it did
  not hide),
* ``P``: the parent's CPU time per answer when it never waits -- the smallest measured in the
  run, where the parent is the bottleneck (at the cheapest step); where it has time to spare
  its CPU per answer also counts waking up, which a saturated parent does not do --, and
  ``e``: env-steps per answer (half a process's envs, double buffered),

and predicts ``min((N - 1) * eta * r, e / P)``: the workers' capacity, or the parent's, which
is the one serial part (it turns around at most ``1 / P`` answers per second whatever ``N``).
Where the parent caps it, the table says so and how many envs per answer would lift the cap
(``W * P``: more envs per process, ``envs_per_worker = 2 x`` that, double buffered), assuming
``P`` does not grow with the envs per answer (shared memory and infos in columns: it grows
little; ``docs/guide/performance.md`` has it measured at 4 and 16 envs per answer).

    python -m benchmarks.scaling pinned.json                 # markdown table
    python -m benchmarks.scaling pinned.json --backend envmanager-batch-db
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence

CORES = (8, 16, 32, 64)


def figures(data: dict, backend: str, parent_s: float | None = None) -> list[dict]:
    """Per pinned step cost: cost, r, eta, P (``parent_s``, else the run's smallest), e."""
    out = []
    for name, s in data["scenarios"].items():
        m = s["measurements"].get(backend)
        if not s.get("pinned") or not m or not s.get("limit") or not m.get("answers"):
            continue
        r = statistics.median(s["limit"]["single_env_steps_per_second"]) / 1.0
        cores = s["limit"]["cores"]
        eta = m["median"] / s["limit"]["steps_per_second"]
        per_answer = [c / a for c, a in zip(m["parent_cpu_s"], m["answers"], strict=True)]
        per_step = [a / n for a, n in zip(m["answers"], m["env_steps"], strict=True)]
        out.append({"scenario": name, "cost": s.get("step_cost"), "r": r, "eta": eta, "cores": cores,
                    "P": statistics.median(per_answer), "e": 1 / statistics.median(per_step)})
    saturated = parent_s or min((f["P"] for f in out), default=0.0)
    for f in out:
        f["P measured"], f["P"] = f["P"], saturated
    return sorted(out, key=lambda f: (f["cost"] is None, f["cost"] or 0))


def predict(f: dict, n: int) -> tuple[float, bool, float]:
    """(env-steps/s on ``n`` cores, whether the parent caps it, envs per answer to lift the cap)."""
    workers = (n - 1) * f["eta"] * f["r"]
    parent = f["e"] / f["P"]
    return min(workers, parent), parent < workers, workers * f["P"]


def table(rows: Sequence[dict]) -> str:
    head = "| step | one env in process | reached (pinned) | parent CPU per answer (measured) | env-steps per answer | " + \
        " | ".join(f"{n} cores" for n in CORES) + " | parent saturates at |"
    lines = [head, "|" + "---|" * (6 + len(CORES))]
    for f in rows:
        cells = []
        saturates = "-"
        for n in CORES:
            rate, capped, need = predict(f, n)
            cells.append(f"{rate:,.0f}" + (f" (parent; {need:.0f} envs/answer lift it)" if capped else ""))
        limit = f["e"] / f["P"] / (f["eta"] * f["r"]) + 1  # cores at which the workers outrun the parent
        saturates = f"{limit:.0f} cores"
        cost = f["cost"]
        label = f["scenario"] if cost is None else (f"{cost * 1e6:g} µs" if cost < 1e-3 else f"{cost * 1e3:g} ms")
        lines.append(f"| {label} | {f['r']:,.0f}/s | {f['eta']:.2f} | {f['P measured'] * 1e6:.0f} µs | {f['e']:.1f} | "
                     + " | ".join(cells) + f" | {saturates} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="the JSON of `envmanager bench --scenario pinned --json FILE`")
    parser.add_argument("--backend", default="envmanager-db", help="whose figures (default: envmanager-db)")
    parser.add_argument("--parent-us", type=float, default=None,
                        help="the saturated parent's CPU per answer, µs (default: the run's smallest)")
    args = parser.parse_args(argv)
    with open(args.json) as fh:
        rows = figures(json.load(fh), args.backend, None if args.parent_us is None else args.parent_us * 1e-6)
    if not rows:
        print(f"no pinned measurements of {args.backend} with answers counted in {args.json}", file=sys.stderr)
        return 1
    print(table(rows))
    print(f"\nThe parent's CPU per answer, saturated (the model's P): {rows[0]['P'] * 1e6:.0f} µs; it caps the machine at "
          f"{rows[0]['e'] / rows[0]['P']:,.0f} env-steps/s with {rows[0]['e']:.0f} env-steps per answer.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
