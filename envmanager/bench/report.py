"""Presenting benchmark results: text tables, JSON, a PNG bar chart.

Returns strings and writes files; printing is the CLI's business.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from envmanager.bench.backends import AUTO_CHOICES, BACKENDS, NOT_APPLICABLE, envs_per_worker_for
from envmanager.bench.common import cores, worker_cores
from envmanager.bench.limit import LIMIT_SECONDS
from envmanager.bench.peers import pufferlib_layout
from envmanager.bench.runner import ScenarioResult, Target, targets
from envmanager.bench.scale import regime, regime_note
from envmanager.extras import install_command, requires_extra

__all__ = [
    "PLOT_EXTRA",
    "format_fractions",
    "format_sweep",
    "format_table",
    "format_targets",
    "load_average",
    "fractions",
    "machine",
    "describe_machine",
    "metadata",
    "plot_unavailable",
    "sweep_fractions",
    "to_json",
    "write_json",
    "write_plot",
]

#: What to install for ``write_plot`` (matplotlib is an optional dependency).
PLOT_EXTRA = install_command("bench")
PUFFERLIB = ("pufferlib.Multiprocessing", "pufferlib.Multiprocessing-sync")


def _rate(x: float) -> str:
    return f"{x:,.0f}"


def format_table(result: ScenarioResult, show_not_applicable: bool = True) -> str:
    """The steps/s table of one scenario, with its ratio columns and what was skipped.

    ``show_not_applicable=False`` leaves out backends that do not fit the scenario (those
    missing or broken on this machine are always listed).
    """
    s = result.scenario
    head = f"== {s.name}: {s.description}; {result.steps:,} steps x {result.repeats} repeats"
    if result.unavailable:
        return f"{head}\n   not available: {result.unavailable}"
    ratios = result.ratios()
    columns = list(ratios)
    names = list(result.measurements)
    width = max([22, *(len(n) + 2 for n in names)])
    widths = {c: max(11, len(c) + 2) for c in columns}
    lines = [head]
    header = (f"{'backend':<{width}}{'median/s':>12}{'min/s':>12}{'best/s':>12}{'cpu/step':>10}{'cpu/ans':>9}"
              f"{'work/ans':>10}") + "".join(
        f"{c:>{widths[c]}}" for c in columns
    )
    lines.append(header)
    for name, m in result.measurements.items():
        row = f"{name:<{width}}{_rate(m.median):>12}{_rate(m.worst):>12}{_rate(m.best):>12}"
        row += f"{_micro(m.cpu_per_env_step):>10}{_micro(m.cpu_per_answer):>9}{_micro(m.work_per_answer):>10}"
        for c in columns:
            value = ratios[c].get(name)
            row += f"{'-' if value is None else f'{value:.2f}x':>{widths[c]}}"
        lines.append(row)
    if result.limit is not None and s.limit_processes:
        lines.append(_processes_limit(result, width))
    elif result.limit is not None:
        rate = sorted(result.single_env_rate)[len(result.single_env_rate) // 2]
        where = f"{worker_cores(s)} worker cores (the parent pinned to a core of its own)" if s.pin else f"{cores()} cores"
        lines.append(
            f"{'limit':<{width}}{_rate(result.limit):>12}   = min({where}, {s.n_env} envs)"
            f" x {_rate(rate)} steps/s of one env in process"
        )
    if result.limit_failed:
        lines.append(f"   the limit FAILED: {result.limit_failed}")
    if result.references:
        n = s.reference_n_env
        refs = ", ".join(f"{b} {_rate(m.median)}" for b, m in result.references.items())
        lines.append(f"   at {n} envs (median steps/s): {refs}")
    packed = [b for b in ("envmanager-k", "envmanager-vector", "envmanager-batchlevel", "envmanager-db", "envmanager-batch-db")
              if b in result.measurements]
    if packed:
        lines.append(f"   {', '.join(packed)}: {envs_per_worker_for(s)} envs per worker ({worker_cores(s)} worker cores)")
    puffer = [(b, pufferlib_layout(s, batched=not BACKENDS[b].lockstep)) for b in PUFFERLIB if b in result.measurements]
    if puffer:
        lines.append("   " + "; ".join(f"{b}: {w} process{'es' * (w > 1)} x {s.n_env // w} envs, batches of {size}"
                                       for b, (w, size) in puffer))
    if "envmanager-auto" in result.measurements and s.name in AUTO_CHOICES:
        lines.append(f"   envmanager-auto: chose {AUTO_CHOICES[s.name]} envs per worker ({cores()} cores)")
    by_reason: dict[str, list[str]] = {}
    for name, why in result.skipped.items():
        if show_not_applicable or not why.startswith(NOT_APPLICABLE):
            by_reason.setdefault(why, []).append(name)
    for why, skipped in by_reason.items():
        lines.append(f"   skipped {', '.join(skipped)}: {why}")
    for name, why in result.failed.items():
        lines.append(f"   FAILED {name}: {why}")
    lines += [f"   {note}" for note in getattr(result, "notes", ())]  # scenarios with a module of their own
    if any(m.parent_cpu_s for m in result.measurements.values()):
        lines.append("   cpu/step, cpu/ans: the parent's CPU time (us) per env-step and per answer it took (ours); work/ans:")
        lines.append("   per answer without the time it spun waiting (a saturated parent's: the many-core machine's cap)")
    return "\n".join(lines)


def _processes_limit(result: ScenarioResult, width: int) -> str:
    """The limit line of ``limit_processes`` scenarios: how it was measured, and against one env alone."""
    assert result.limit is not None
    n = result.limit_cores
    line = (f"{'limit':<{width}}{_rate(result.limit):>12}   = the sum of {n} process{'es' * (n != 1)} stepping one env "
            f"each in process, started together, {LIMIT_SECONDS:g} s")
    if result.single_env_rate:
        alone = sorted(result.single_env_rate)[len(result.single_env_rate) // 2]
        line += f" ({result.limit / (n * alone):.2f}x {n} x {_rate(alone)} steps/s of one env alone)"
    return line


def _micro(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def sweep_fractions(results: Sequence[ScenarioResult], group: str = "sweep") -> tuple[list[float], dict[str, list[float | None]]]:
    """A sweep's curve (``sweep``, or ``pinned``): step costs (seconds), and per backend its
    fraction of the limit at each."""
    points = sorted((r for r in results if r.scenario.group == group and r.limit and r.scenario.step_cost),
                    key=lambda r: r.scenario.step_cost or 0.0)
    costs = [r.scenario.step_cost or 0.0 for r in points]
    names = list(dict.fromkeys(b for r in points for b in r.measurements))
    curves = {b: [r.measurements[b].median / r.limit if b in r.measurements and r.limit else None for r in points]
              for b in names}
    return costs, curves


def format_sweep(results: Sequence[ScenarioResult], group: str = "sweep") -> str:
    """One line per backend: its fraction of the machine's limit at each step cost of the sweep
    (``group="pinned"``: of the worker cores' limit, the parent on a core of its own)."""
    costs, curves = sweep_fractions(results, group)
    if not costs:
        return ""
    labels = [f"{c * 1e3:g} ms" if c >= 1e-3 else f"{c * 1e6:g} us" for c in costs]
    width = max([22, *(len(n) + 2 for n in curves)])
    what = ("(worker cores x one env's in-process rate; the parent pinned to a core of its own, several envs packed "
            "per worker core: not the many-core figure, see scale and cycle)" if group == "pinned"
            else "(min(cores, envs) x one env's in-process rate)")
    lines = [f"== {group}: fraction of the limit {what} by CPU time per step",
             f"{'backend':<{width}}" + "".join(f"{label:>9}" for label in labels)]
    for name, values in curves.items():
        lines.append(f"{name:<{width}}" + "".join(f"{'-' if v is None else f'{v:.2f}':>9}" for v in values))
    return "\n".join(lines)


def format_targets(found: Sequence[Target], where: dict[str, Any] | None = None, notes: Sequence[str] = ()) -> str:
    """The targets, met or missed (or not measured, with why); ``where``: the machine they ran on
    (``machine()``), said once at the top; ``notes``: lines after it (the regime)."""
    if not found:
        return ""
    lines = ["== targets (medians)"]
    if where is not None:
        lines.append(f"   machine: {describe_machine(where)}")
    lines += [f"   {note}" for note in notes]
    width = max(15, *(len(t.scenario) + 1 for t in found))
    wide = max(32, *(len(t.what) + 1 for t in found))
    backend = max(22, *(len(t.backend) + 1 for t in found))
    for t in found:
        value = "-" if t.value is None else f"{t.value:.2f}"
        if t.value is not None and not t.met and float(value) >= t.threshold:  # 0.4996 is no 0.50
            value = f"{t.value:.4f}"
        mark = "met" if t.met else "MISSED" if t.value is not None else f"NOT MEASURED: {t.why_not}"
        lines.append(f"{t.scenario:<{width}}{t.what:<{wide}}{t.backend:<{backend}}{value:>7}"
                     f"  (target >= {t.threshold:g})  {mark}")
    return "\n".join(lines)


def fractions(results: Sequence[ScenarioResult], group: str) -> tuple[list[str], dict[str, list[float | None]]]:
    """A group's cases (``scale``, ``cycle``) in order, and per backend its fraction of each
    case's limit (``None`` where it did not run)."""
    points = [r for r in results if r.scenario.group == group and r.limit]
    names = list(dict.fromkeys(b for r in points for b in r.measurements))
    return [r.name for r in points], {
        b: [r.measurements[b].median / r.limit if b in r.measurements and r.limit else None for r in points] for b in names}


def format_fractions(results: Sequence[ScenarioResult], group: str) -> str:
    """One line per backend: its fraction of the limit of each case of ``group``."""
    cases, curves = fractions(results, group)
    if not cases:
        return ""
    width = max([26, *(len(n) + 2 for n in curves)])
    columns = [max(9, len(c) + 2) for c in cases]
    what = ("the sum of cores processes stepping one env each in process" if group == "scale"
            else "one env's in-process rate on the worker's core")
    lines = [f"== {group}: fraction of the limit ({what})",
             f"{'backend':<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(cases, columns, strict=True))]
    for name, values in curves.items():
        lines.append(f"{name:<{width}}" + "".join(f"{'-' if v is None else f'{v:.2f}':>{w}}"
                                                  for v, w in zip(values, columns, strict=True)))
    note = regime_note(results) if group == "scale" else None
    return "\n".join(lines + ([f"   {note}"] if note else []))


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return getattr(mod, "__version__", "?")


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages (other work on the machine skews the numbers)."""
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _git(root: str, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _commit() -> dict[str, Any] | None:
    """The commit of the checkout envmanager runs from (``None``: not a git checkout), and
    whether tracked files differ from it."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../envmanager
    root = os.path.dirname(package)
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    sha = _git(root, "rev-parse", "HEAD")
    if not sha:
        return None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": sha, "modified": None if status is None else bool(status)}


def machine() -> dict[str, Any]:
    """The machine a run measured: CPU model, usable cores (this process's affinity) of how many,
    Python, and the git commit where envmanager runs from a checkout."""
    return {"cpu": _cpu_model(), "usable_cores": cores(), "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0], "platform": platform.platform(), "git": _commit(),
            "scale_regime": regime()}


def describe_machine(where: dict[str, Any]) -> str:
    """``machine()`` on one line."""
    git = where.get("git")
    commit = "not a git checkout" if not git else f"commit {git['commit'][:12]}" + (
        " with uncommitted changes" if git.get("modified") else "")
    return (f"{where['cpu']}; {where['usable_cores']} usable cores (of {where['cpu_count']}); "
            f"Python {where['python']}; {commit}")


def metadata(argv: Sequence[str] | None = None, load_at_start: list[float] | None = None) -> dict[str, Any]:
    """Where and when the numbers were taken (call it after the run: it lists versions used)."""
    return {
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": list(argv) if argv is not None else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cores": cores(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_average(),
        "versions": {
            m: _version(m)
            for m in ("envmanager", "gymnasium", "numpy", "stable_baselines3", "envpool", "tianshou", "torchrl",
                      "torch", "ale_py", "mujoco", "pettingzoo", "supersuit", "mpe2")
            if m in sys.modules or m in ("envmanager", "gymnasium", "numpy")
        },
    }


def to_json(results: Sequence[ScenarioResult], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "meta": meta or metadata(),
        "backends": {name: {"description": b.description, "ours": b.ours} for name, b in BACKENDS.items()},
        "scenarios": {r.name: {**r.to_dict(), "auto_envs_per_worker": AUTO_CHOICES.get(r.name)} for r in results},
        "sweep": dict(zip(("step_costs", "fraction_of_limit"), sweep_fractions(results), strict=True)),
        "pinned": dict(zip(("step_costs", "fraction_of_limit"), sweep_fractions(results, "pinned"), strict=True)),
        "scale": {"regime": regime(), "usable_cores": cores(),
                  **dict(zip(("cases", "fraction_of_limit"), fractions(results, "scale"), strict=True))},
        "cycle": dict(zip(("cases", "fraction_of_limit"), fractions(results, "cycle"), strict=True)),
        "targets": [t.to_dict() for t in targets(results)],
    }


def write_json(path: str, results: Sequence[ScenarioResult], meta: dict[str, Any] | None = None) -> None:
    with open(path, "w") as f:
        json.dump(to_json(results, meta), f, indent=2)
        f.write("\n")


def plot_unavailable() -> str | None:
    """Why :func:`write_plot` cannot work here, in a few words on one line, or ``None``.

    ``"not installed"``, or the error a broken install raises on import. The CLI checks this
    before a run, so a missing optional dependency costs no benchmark time.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "not installed"
    except Exception as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return None


def write_plot(path: str, results: Sequence[ScenarioResult]) -> None:
    """A PNG: the sweep as curves (fraction of the limit against CPU time per step, one line per
    backend), then one bar panel per other scenario (median steps/s, whiskers min to best)."""
    with requires_extra("bench", "envmanager.bench.report.write_plot"):
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt

    shown = [r for r in results if r.measurements and not (r.scenario.group in ("sweep", "pinned") and r.scenario.step_cost)]
    sweeps = [(group, *sweep_fractions(results, group)) for group in ("sweep", "pinned")]
    sweeps = [(group, costs, curves) for group, costs, curves in sweeps if costs]
    heights = [6] * len(sweeps) + [len(r.measurements) + 2 for r in shown]
    fig, axes = plt.subplots(max(1, len(heights)), 1, squeeze=False, figsize=(9, 0.6 + 0.45 * sum(heights)),
                             gridspec_kw={"height_ratios": heights or [1]})
    try:
        panels = list(axes[:, 0])
        if not heights:  # every scenario unavailable or every backend skipped: one empty panel says so
            empty = panels.pop(0)
            empty.text(0.5, 0.5, "nothing measured", ha="center", va="center")
            empty.set_axis_off()
        for group, costs, curves in sweeps:
            _plot_sweep(panels.pop(0), costs, curves, group)
        for ax, r in zip(panels, shown, strict=True):
            _plot_bars(ax, r)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def _plot_sweep(ax: Any, costs: list[float], curves: dict[str, list[float | None]], group: str = "sweep") -> None:
    micro = [c * 1e6 for c in costs]
    for name, values in curves.items():
        points = [(x, v) for x, v in zip(micro, values, strict=True) if v is not None]
        ours = BACKENDS[name].ours if name in BACKENDS else False
        ax.plot(*zip(*points, strict=True), marker="o", label=name, linestyle="-" if ours else "--", linewidth=2 if ours else 1)
    ax.axhline(1.0, color="tab:red", linewidth=0.8)  # the machine's limit
    ax.set_xscale("log")
    ax.set_xticks(micro, [f"{x / 1e3:g} ms" if x >= 1e3 else f"{x:g} µs" for x in micro])
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("CPU time per env step")
    ax.set_ylabel("fraction of the limit")
    if group == "pinned":
        ax.set_title(f"pinned: 8 envs packed on {max(1, cores() - 1)} worker core(s), parent on a core of its own; limit = "
                     "worker cores x one env's in-process rate", fontsize=10)
    else:
        ax.set_title(f"sweep: 8 envs; limit = min({cores()} cores, 8 envs) x one env's in-process rate", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="lower right")


def _plot_bars(ax: Any, r: ScenarioResult) -> None:
    import matplotlib.ticker

    names = list(r.measurements)
    medians = [r.measurements[n].median for n in names]
    low = [m - r.measurements[n].worst for n, m in zip(names, medians, strict=True)]
    high = [r.measurements[n].best - m for n, m in zip(names, medians, strict=True)]
    ours = getattr(r, "ours", None)  # scenarios with contenders of their own say which are ours
    colors = ["tab:blue" if (n in ours if ours is not None else n not in BACKENDS or BACKENDS[n].ours) else "tab:gray"
              for n in names]
    y = range(len(names))
    ax.barh(list(y), medians, xerr=[low, high], color=colors, capsize=3)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    for i, (m, h) in enumerate(zip(medians, high, strict=True)):
        ax.text(m + h, i, f"  {m:,.0f}", va="center", fontsize=8)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlim(0, max(max(m + h for m, h in zip(medians, high, strict=True)), r.limit or 0) * 1.18 or 1)
    if r.limit is not None:
        ax.axvline(r.limit, color="tab:red", linestyle="--", label=f"limit {r.limit:,.0f}/s")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{r.name}: {r.scenario.description}", fontsize=10)
    ax.set_xlabel(f"{getattr(r, 'unit', 'env-steps')} per second (median; whiskers: min to best)")
