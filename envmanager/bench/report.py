"""Presenting benchmark results: text tables, JSON, a PNG bar chart.

Returns strings and writes files; printing is the CLI's business.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

from envmanager.bench.backends import BACKENDS, NOT_APPLICABLE, cores, envs_per_worker_for
from envmanager.bench.runner import ScenarioResult, Target, targets

__all__ = [
    "PLOT_EXTRA",
    "format_table",
    "format_targets",
    "load_average",
    "metadata",
    "plot_unavailable",
    "to_json",
    "write_json",
    "write_plot",
]

#: What to install for ``write_plot`` (matplotlib is an optional dependency).
PLOT_EXTRA = 'pip install "envmanager[bench]"'


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
    header = f"{'backend':<{width}}{'median/s':>12}{'min/s':>12}{'best/s':>12}" + "".join(
        f"{c:>{widths[c]}}" for c in columns
    )
    lines.append(header)
    for name, m in result.measurements.items():
        row = f"{name:<{width}}{_rate(m.median):>12}{_rate(m.worst):>12}{_rate(m.best):>12}"
        for c in columns:
            value = ratios[c].get(name)
            row += f"{'-' if value is None else f'{value:.2f}x':>{widths[c]}}"
        lines.append(row)
    if result.limit is not None:
        rate = sorted(result.single_env_rate)[len(result.single_env_rate) // 2]
        lines.append(
            f"{'limit':<{width}}{_rate(result.limit):>12}   = min({cores()} cores, {s.n_env} envs)"
            f" x {_rate(rate)} steps/s of one env in process"
        )
    if result.references:
        n = s.reference_n_env
        refs = ", ".join(f"{b} {_rate(m.median)}" for b, m in result.references.items())
        lines.append(f"   at {n} envs (median steps/s): {refs}")
    packed = [b for b in ("envmanager-k", "envmanager-vector") if b in result.measurements]
    if packed:
        lines.append(f"   {', '.join(packed)}: {envs_per_worker_for(s)} envs per worker ({cores()} cores)")
    by_reason: dict[str, list[str]] = {}
    for name, why in result.skipped.items():
        if show_not_applicable or not why.startswith(NOT_APPLICABLE):
            by_reason.setdefault(why, []).append(name)
    for why, skipped in by_reason.items():
        lines.append(f"   skipped {', '.join(skipped)}: {why}")
    for name, why in result.failed.items():
        lines.append(f"   FAILED {name}: {why}")
    return "\n".join(lines)


def format_targets(found: Sequence[Target]) -> str:
    if not found:
        return ""
    lines = ["== targets (medians)"]
    for t in found:
        mark = "met" if t.met else "MISSED"
        lines.append(
            f"{t.scenario:<10}{t.what:<30}{t.backend:<22}{t.value:>7.2f}  (target >= {t.threshold:g})  {mark}"
        )
    return "\n".join(lines)


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


def metadata(argv: Sequence[str] | None = None, load_at_start: list[float] | None = None) -> dict[str, Any]:
    """Where and when the numbers were taken (call it after the run: it lists versions used)."""
    return {
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
            for m in ("envmanager", "gymnasium", "numpy", "stable_baselines3", "envpool")
            if m in sys.modules or m in ("envmanager", "gymnasium", "numpy")
        },
    }


def to_json(results: Sequence[ScenarioResult], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "meta": meta or metadata(),
        "backends": {name: {"description": b.description, "ours": b.ours} for name, b in BACKENDS.items()},
        "scenarios": {r.name: r.to_dict() for r in results},
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
    """A PNG: one panel per scenario, median steps/s per backend, whiskers from min to best."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shown = [r for r in results if r.measurements]
    fig, axes = plt.subplots(max(1, len(shown)), 1, figsize=(9, 0.5 + 0.45 * sum(
        len(r.measurements) + 1 for r in shown) + 0.6 * len(shown)), squeeze=False,
        gridspec_kw={"height_ratios": [len(r.measurements) + 2 for r in shown] or [1]})
    try:
        if not shown:
            axes[0][0].text(0.5, 0.5, "nothing measured", ha="center", va="center")
            axes[0][0].set_axis_off()
        for ax, r in zip(axes[:, 0], shown):
            names = list(r.measurements)
            medians = [r.measurements[n].median for n in names]
            low = [m - r.measurements[n].worst for n, m in zip(names, medians)]
            high = [r.measurements[n].best - m for n, m in zip(names, medians)]
            colors = ["tab:blue" if BACKENDS[n].ours else "tab:gray" for n in names]
            y = range(len(names))
            ax.barh(list(y), medians, xerr=[low, high], color=colors, capsize=3)
            ax.set_yticks(list(y), names)
            ax.invert_yaxis()
            for i, (m, h) in enumerate(zip(medians, high)):
                ax.text(m + h, i, f"  {m:,.0f}", va="center", fontsize=8)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
            ax.set_xlim(0, max(m + h for m, h in zip(medians, high)) * 1.18 or 1)
            if r.limit is not None:
                ax.axvline(r.limit, color="tab:red", linestyle="--", label=f"limit {r.limit:,.0f}/s")
                ax.legend(loc="lower right", fontsize=8)
            ax.set_title(f"{r.name}: {r.scenario.description}", fontsize=10)
            ax.set_xlabel("env-steps per second (median; whiskers: min to best)")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
