"""What ``envmanager check`` found: named problems with their evidence and fix, notes, and the
layout advice; as text for people and as a dict (JSON) for tools."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Problem", "Layout", "Advice", "Report", "PROBLEMS"]

#: Every problem the checker names, by id, with its one-line title.
PROBLEMS = {
    "cannot-travel": "the factory cannot travel to a worker process",
    "not-built": "the env cannot be built in a worker process",
    "not-reproducible": "reset(seed=s) and the same actions give different trajectories in this process",
    "differs-in-worker": "a worker's trajectory differs from this process's",
    "differs-across-workers": "two workers' trajectories differ from each other",
    "observation-dtype": "observations do not have the dtype the observation space declares",
    "observation-shape": "observations do not have the shape the observation space declares",
    "observation-out-of-bounds": "observations fall outside the observation space's bounds",
    "observation-not-in-space": "observations are not in the observation space",
    "reward-not-scalar": "rewards are not real scalars",
    "flags-not-bool": "terminated / truncated are not booleans",
    "info-not-dict": "infos are not dicts",
    "info-not-picklable": "infos hold something that cannot be pickled",
    "delivery-fails": "the env steps, but its result cannot reach the parent",
    "env-raises": "reset or step raises",
    "exception-not-picklable": "an exception the env raises cannot be pickled",
    "hangs": "reset, step or close does not return within its deadline",
    "worker-died": "the worker process died while the env ran",
    "leaks-processes": "close() leaves processes running",
    "leaks-threads": "close() leaves threads running",
    "leaks-fds": "close() leaves file descriptors open",
    "leaks-shared-memory": "close() leaves shared memory behind",
    "gymnasium-checker": "gymnasium's env_checker fails (run in a worker)",
}


@dataclass
class Problem:
    """One problem: ``id`` (a key of :data:`PROBLEMS`), the evidence seen, how to fix it, and
    the start methods under which it was seen (empty: not specific to one)."""

    id: str
    evidence: list[str]
    fix: str
    start_methods: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return PROBLEMS[self.id]


@dataclass
class Layout:
    """One way to run ``num_envs`` envs and its env-steps per second on this machine
    (``None``: not measured, ``note`` says why; ``estimated``: from the step cost, not run)."""

    id: str  # "in-process", "k-per-process", "one-per-process", "double-buffered", "model" (auto's choice)
    description: str
    envs_per_process: int = 0
    processes: int = 0
    steps_per_s: float | None = None  # expected when the machine is yours (``envmanager.check.measure``)
    now_per_s: float | None = None  # measured now, with whatever else runs here
    bound: str = ""  # what bounds ``steps_per_s``
    estimated: bool = False
    note: str = ""
    double_buffer: bool = False  # two lanes per process


@dataclass
class Advice:
    """The measured step cost and the layout expected to be fastest here."""

    num_envs: int
    cores: int
    step: dict[str, Any]  # median_us, p90_us, cpu_median_us, cpu_p90_us, cpu_share, steps; or {"unmeasured": why}
    kind: str  # "cpu-bound, even", "cpu-bound, uneven", "waiting", "unmeasured"
    layouts: list[Layout]
    recommended: str  # a Layout id
    why: str
    how: str  # the code to use
    load_average: float | None = None  # of the machine, as the layouts were measured

    def layout(self, layout_id: str) -> Layout | None:
        return next((lay for lay in self.layouts if lay.id == layout_id), None)


@dataclass
class Report:
    """What ``envmanager.check.check`` found. ``ok``: no problem, and the env ran in a worker
    (``ran``: false when the check found no problem but the env gave no result in any worker: the
    time limit ended the check before any start method ran it, or every run failed).
    ``complete``: false when the time limit cut a run of the env short or skipped one, or a probe
    (the notes say which): what ran was checked, the rest was not."""

    target: str
    start_methods: list[str]
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    advice: Advice | None = None
    seconds: float = 0.0
    ran: bool = True
    complete: bool = True

    @property
    def ok(self) -> bool:
        return self.ran and not self.problems

    @property
    def problem_ids(self) -> list[str]:
        return [p.id for p in self.problems]

    def add(self, problem_id: str, evidence: list[str] | str, fix: str, start_methods: list[str] | None = None) -> Problem:
        """Add a problem, or, when one with this id is there, its new evidence and start methods."""
        evidence = [evidence] if isinstance(evidence, str) else list(evidence)
        for problem in self.problems:
            if problem.id == problem_id:
                problem.evidence += [e for e in evidence if e not in problem.evidence]
                problem.start_methods += [m for m in start_methods or [] if m not in problem.start_methods]
                return problem
        problem = Problem(problem_id, evidence, fix, list(start_methods or []))
        self.problems.append(problem)
        return problem

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``: problems with their titles, notes, advice."""
        out = asdict(self)
        out["ok"] = self.ok
        for problem, data in zip(self.problems, out["problems"], strict=True):
            data["title"] = problem.title
        return out

    def format(self) -> str:
        """The report as text for a terminal or a failing test."""
        lines = [f"envmanager check {self.target} (start methods: {', '.join(self.start_methods) or 'none'}; "
                 f"{self.seconds:.1f} s)", ""]
        if self.ok and not self.complete:
            lines.append("No problems found in what was checked; the time limit cut the check short (see the notes).")
        elif self.ok:
            lines.append("No problems found.")
        elif not self.ran and not self.problems:
            lines.append("Nothing was checked: no worker gave a result of the env (see the notes).")
        for n, problem in enumerate(self.problems, 1):
            where = f" [{', '.join(problem.start_methods)}]" if problem.start_methods else ""
            lines.append(f"Problem {n}: {problem.id}{where}: {problem.title}")
            lines += [_indent(e, "  - ") for e in problem.evidence]
            lines.append(_wrap(problem.fix, "  fix: "))
            lines.append("")
        if self.notes:
            lines.append("Notes:")
            lines += [_wrap(note, "  - ") for note in self.notes]
            lines.append("")
        if self.advice is not None:
            lines += _format_advice(self.advice)
        return "\n".join(lines).rstrip() + "\n"


def _indent(text: str, first: str) -> str:
    rest = " " * len(first)
    return "\n".join((first if i == 0 else rest) + line for i, line in enumerate(text.splitlines() or [""]))


def _wrap(text: str, first: str, width: int = 100) -> str:
    """Prose wrapped to ``width``, hanging under ``first``."""
    return textwrap.fill(text, width, initial_indent=first, subsequent_indent=" " * len(first),
                         break_long_words=False, break_on_hyphens=False)


def _format_advice(advice: Advice) -> list[str]:
    step = advice.step
    if "unmeasured" in step:
        cost = f"step cost not measured: {step['unmeasured']}"
    else:
        cost = (f"step: median {_us(step['median_us'])} (p90 {_us(step['p90_us'])}), CPU median "
                f"{_us(step['cpu_median_us'])} (p90 {_us(step['cpu_p90_us'])}), {step['cpu_share']:.0%} on the CPU: "
                f"{advice.kind}")
    load = f", load average {advice.load_average:.2f}" if advice.load_average is not None else ""
    width = max([44, *(len(layout.description) for layout in advice.layouts)])
    lines = [f"Advice for {advice.num_envs} envs on {advice.cores} cores{load}", _wrap(cost, "  "), "",
             f"  {'layout':<{width}} {'expected':>10} {'now':>10}   env-steps/s"]
    for layout in advice.layouts:
        expected = "-" if layout.steps_per_s is None else f"{layout.steps_per_s:,.0f}" + ("*" if layout.estimated else "")
        now = "-" if layout.now_per_s is None else f"{layout.now_per_s:,.0f}"
        mark = "  <- recommended" if layout.id == advice.recommended else ""
        lines.append(f"  {layout.description:<{width}} {expected:>10} {now:>10}{mark}")
        if layout.note:
            lines.append(_wrap(layout.note, "      "))
    lines.append(_wrap("expected: what the layout gives when the machine is yours (CPU times and the fastest "
                       "turnaround seen, which other programs do not stretch); now: measured in this run, with "
                       "whatever else runs here" + ("; * estimated from the step cost, not run" if any(
                           layout.estimated for layout in advice.layouts) else ""), "  "))
    lines += ["", _wrap(f"Recommended: {advice.why}", "  "), _indent(advice.how, "    "), ""]
    return lines


def _us(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.2f} ms"
    return f"{value:.0f} µs" if value >= 10 else f"{value:.1f} µs"
