"""The ``envmanager`` command line: ``envmanager bench``, ``envmanager check``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence

from envmanager.bench import BACKENDS, SCENARIOS, cores, run_benchmark, targets
from envmanager.bench.report import (
    PLOT_EXTRA,
    format_fractions,
    format_sweep,
    format_table,
    format_targets,
    load_average,
    metadata,
    plot_unavailable,
    write_json,
    write_plot,
)
from envmanager.bench.scale import regime_note
from envmanager.bench.scenarios import GROUPS, SCALE_PER_CORE, Scenario, pinned, scale

NOTES = (
    "notes: steps/s = env-steps per second of the timed loop (start-up, reset and close not timed);\n"
    "ratios use medians; repeats are interleaved across backends. Every backend starts its workers\n"
    "with fork (sb3.SubprocVecEnv too, whose default is forkserver); sb3 autoresets within the step;\n"
    "envpool steps its own C++ envs in threads of this process. Other load on the machine\n"
    "(see the load average) widens the min-best spread: compare medians, rerun when in doubt.\n"
    "tianshou's vector envs do not autoreset: finished envs are reset in the timed loop.\n"
    "scale and cycle run their own contenders unless --backends names others (the drop-ins as users get\n"
    "them and every peer; the cycle's one-env and two-lane contenders).\n"
    "PufferLib's parent and workers busy-wait: on cores they share, the spinning takes CPU from the envs."
)


def _progress(enabled: bool):
    """A factory of tqdm bars when tqdm is installed and wanted, else ``None`` (silent)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety (extra ``bench``), not a requirement
        return None

    def make(total: int, desc: str):
        return tqdm(total=total, desc=desc, unit="step", unit_scale=True, leave=False,
                    file=sys.stderr, disable=None, mininterval=0.5)

    return make


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


_positive, _seed = _int_at_least(1), _int_at_least(0)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:  # NaN, 0, negative (inf: no limit)
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def output_problem(args: argparse.Namespace) -> str | None:
    """Why ``--json``/``--plot`` could not be written after the run, or ``None``.

    Checked before anything is measured: a missing extra or a mistyped directory should cost
    a second, not a whole benchmark run ending in a traceback.
    """
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                return f"{option} {path}: no such directory {folder}"
            if os.path.isdir(path) or path.endswith(os.sep):
                return f"{option} {path}: a directory; give a file name"
    if args.plot:
        why = plot_unavailable()
        if why:
            return f"--plot needs matplotlib ({why}): {PLOT_EXTRA}"
    return None


def chosen_scenarios(requested: list[str]) -> list[str]:
    """The scenarios ``--scenario`` names, groups and ``all`` expanded, in the canonical order."""
    wanted = {n for name in requested for n in GROUPS.get(name, [name])}
    return [n for n, s in SCENARIOS.items() if n in wanted or ("all" in requested and s.in_all)]


def _scenario(name: str, args: argparse.Namespace) -> Scenario:
    """``name``'s scenario as the options make it: ``--num-envs`` (scale), ``--pin``."""
    scenario = SCENARIOS[name]
    if args.num_envs is not None and scenario.group == "scale":
        scenario = scale(name, args.num_envs)
    # sampler, ray, unity-trainer: measured by modules of their own that do not pin (pettingzoo pins itself)
    return pinned(scenario) if args.pin and scenario.kind in ("gym", "unity", "pettingzoo") else scenario


def bench(args: argparse.Namespace) -> int:
    problem = output_problem(args)
    # In the canonical order whatever the order given: unity (gRPC in this process) comes last,
    # after every backend that forks this process.
    names = chosen_scenarios(args.scenario)
    if not problem and args.num_envs is not None and not any(SCENARIOS[n].group == "scale" for n in names):
        problem = "--num-envs applies to the scale scenarios only (--scenario scale, scale-200us, ...)"
    if problem:
        print(f"envmanager bench: {problem}", file=sys.stderr)
        return 2
    backends: list[str] | None
    if args.backends is None:
        backends = None  # each scenario's own contenders, or every backend
    elif "all" in args.backends:
        backends = list(BACKENDS)
    else:
        backends = list(dict.fromkeys(args.backends))
    load = load_average()
    print(
        f"envmanager bench: {', '.join(names)}; {args.repeats} repeats; {cores()} cores"
        + (f"; load average {load[0]:.2f}" if load else "")
    )
    results = run_benchmark(
        [_scenario(n, args) for n in names], backends,
        steps=args.steps or None, repeats=args.repeats,
        progress=_progress(not args.no_progress), seed=args.seed, warmup=not args.no_warmup,
    )
    meta = metadata(args.argv, load)
    for result in results:
        print()
        print(format_table(result, show_not_applicable=args.backends is not None))
    for group in ("sweep", "pinned"):
        sweep = format_sweep(results, group)
        if sweep:
            print()
            print(sweep)
    for group in ("scale", "cycle"):
        summary = format_fractions(results, group)
        if summary:
            print()
            print(summary)
    note = regime_note(results)
    summary = format_targets(targets(results), meta["machine"], [note] if note else []) if args.targets else ""
    if summary:
        print()
        print(summary)
    print()
    print(NOTES)
    if args.json:
        write_json(args.json, results, meta)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, results)
        print(f"wrote {args.plot}")
    return 0


def check(args: argparse.Namespace) -> int:
    """``envmanager check TARGET``: 0 when nothing is wrong, 1 when a problem was found, 2 when
    the target or an option is not usable."""
    from envmanager.check import TargetError
    from envmanager.check import check as run_check

    if os.getcwd() not in sys.path:  # MODULE:FACTORY from the current folder, as ``python -m`` finds it
        sys.path.insert(0, os.getcwd())
    bar = None
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety (extra ``bench``), not a requirement
        tqdm = None

    def progress(done: int, total: int, stage: str) -> None:
        nonlocal bar
        if tqdm is None or args.no_progress:
            return
        if bar is None:
            class Bar(tqdm):
                monitor_interval = 0  # no monitor thread: the check forks workers, which threads make unsafe

            bar = Bar(total=total, file=sys.stderr, leave=False, disable=None, unit="stage",
                      bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]")
        bar.set_description_str(stage)
        bar.update(done - bar.n)

    try:
        report = run_check(args.target, num_envs=args.num_envs, start_methods=args.start_method, seed=args.seed,
                           steps=args.steps, deadline=args.deadline, time_limit=args.time_limit,
                           advice=not args.no_advice, progress=progress)
    except (TargetError, ValueError) as exc:
        print(f"envmanager check: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(report.to_dict(), indent=2, default=str) if args.json else report.format(), end="\n" if args.json else "")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="envmanager", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="env-steps per second against gymnasium's vector envs (and SB3, tianshou, TorchRL, PufferLib, EnvPool)",
        description="Measure env-steps per second of envmanager and its peers on the same envs with the "
        "same actions, in the same run; report medians, min/best and ratios.",
    )
    b.add_argument(
        "--scenario", nargs="+", choices=[*SCENARIOS, *GROUPS, "all"], default=["cartpole"], metavar="SCENARIO",
        help=f"one or more of {', '.join([*SCENARIOS, *GROUPS])} (sweep = every sweep-*, pinned = every pinned-*, "
             "scale = every scale-*, cycle = every cycle-*), "
             "or all (every one but unity-trainer-scale, whose setups unity-trainer runs; default: cartpole)",
    )
    b.add_argument(
        "--backends", nargs="+", choices=[*BACKENDS, "all"], default=None, metavar="BACKEND",
        help=f"one or more of {', '.join(BACKENDS)}, or all (default: all, or a scenario's own contenders: "
        "scale, cycle; those unavailable or not applicable are skipped with the reason)",
    )
    b.add_argument("--steps", type=_positive, default=None, help="env-steps per repeat (default: per scenario)")
    b.add_argument("--num-envs", type=_positive, default=None, metavar="N",
                   help=f"envs of the scale scenarios (default: {SCALE_PER_CORE} x the usable cores, "
                   f"{SCALE_PER_CORE * cores()} here)")
    b.add_argument("--repeats", type=_positive, default=3, help="timed repeats per backend (default: 3)")
    b.add_argument("--seed", type=_seed, default=0, help="seed of the action sequences (default: 0)")
    b.add_argument("--json", metavar="PATH", help="write every measurement to this JSON file")
    b.add_argument("--plot", metavar="PATH", help=f"write a PNG bar chart (needs matplotlib: {PLOT_EXTRA})")
    b.add_argument("--pin", action="store_true",
                   help="pin the parent to a core of its own and the workers to the others while timing (as the "
                   "pinned scenarios do): the regime of a many-core machine; the limit is then the worker cores'")
    b.add_argument("--targets", action="store_true", help="also list the project's performance targets, met or missed")
    b.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each backend")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("-v", "--verbose", action="store_true", help="log what the benchmark does")
    b.set_defaults(func=bench)

    c = sub.add_parser(
        "check",
        help="will an env survive the process boundary, and should it cross it at all?",
        description="Run an env in this process and in envmanager's workers under every start method; report "
        "named problems (pickling, seeding, spaces and dtypes, leaks, hangs, gymnasium's checker) with evidence "
        "and fixes, then measure which layout is fastest here. Exit status 0: no problem; 1: a problem; 2: usage.",
    )
    c.add_argument("target", help="a gymnasium id (CartPole-v1) or MODULE:FACTORY, a factory () -> Env or (worker_id) -> Env")
    c.add_argument("--num-envs", type=_positive, default=8, help="how many envs the advice is for (default: 8)")
    c.add_argument("--start-method", nargs="+", choices=["fork", "forkserver", "spawn"], default=None,
                   help="start methods to check (default: every one available here)")
    c.add_argument("--seed", type=_seed, default=0, help="seed of reset and of the sampled actions (default: 0)")
    c.add_argument("--steps", type=_positive, default=64, help="sampled actions per run (default: 64)")
    c.add_argument("--deadline", type=_seconds, default=5.0, help="seconds a reset or step may take (default: 5)")
    c.add_argument("--time-limit", type=_seconds, default=50.0, help="seconds for the whole check (default: 50)")
    c.add_argument("--no-advice", action="store_true", help="report problems only; measure nothing")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("-v", "--verbose", action="store_true", help="log what the checker does")
    c.set_defaults(func=check)
    return parser


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (``envmanager bench | head``);
    ``True`` when that cannot be told (a ``BrokenPipeError`` is then taken to be stdout's)."""
    try:
        import select

        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no file descriptor
        return True


def main(argv: Sequence[str] | None = None) -> int:
    """The ``envmanager`` command (also ``python -m envmanager``): its exit status. A reader of
    stdout that went away (``| head``) ends it quietly with status 1, as Python's docs advise
    ("Note on SIGPIPE"); Ctrl-C with status 130 and one line, after what ran was closed."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone shows here, not as "Exception ignored ... BrokenPipeError" at exit
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # What is still buffered for stdout goes nowhere, so the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    except KeyboardInterrupt:  # what ran was closed on the way here (workers ended and reaped)
        print(f"envmanager {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
