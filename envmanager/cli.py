"""The ``envmanager`` command line: ``envmanager bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from envmanager.bench import BACKENDS, SCENARIOS, Measurement, ratios, run_backend


def _progress(total: int, desc: str):
    """A tqdm progress bar when tqdm is installed, else a silent stand-in."""
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety (extra ``bench``), not a requirement
        class _Silent:
            def update(self, n: int) -> None: ...
            def close(self) -> None: ...

        return _Silent()
    return tqdm(total=total, desc=desc, unit="step", leave=False, file=sys.stderr)


def bench(args: argparse.Namespace) -> int:
    scenario = SCENARIOS[args.scenario]
    steps = args.steps or scenario.steps
    print(f"scenario {scenario.name}: {scenario.description}; {steps} steps x {args.repeats} repeats")
    results: list[Measurement] = []
    for backend in args.backends:
        bar = _progress(steps * args.repeats, backend)
        try:
            results.append(run_backend(backend, scenario, steps, args.repeats, bar.update))
        finally:
            bar.close()
    async_ratio = ratios(results, "gym.AsyncVectorEnv") if "gym.AsyncVectorEnv" in args.backends else {}
    sync_ratio = ratios(results, "gym.SyncVectorEnv") if "gym.SyncVectorEnv" in args.backends else {}
    print(f"{'backend':<22}{'median steps/s':>16}{'best':>12}{'vs Async':>10}{'vs Sync':>10}")
    for m in results:
        a = f"{async_ratio[m.backend]:.2f}x" if async_ratio else "-"
        s = f"{sync_ratio[m.backend]:.2f}x" if sync_ratio else "-"
        print(f"{m.backend:<22}{m.median:>16,.0f}{m.best:>12,.0f}{a:>10}{s:>10}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="envmanager", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="steps per second against gymnasium's vector envs")
    b.add_argument("--scenario", choices=sorted(SCENARIOS), default="cartpole")
    b.add_argument("--steps", type=int, default=0, help="env steps per repeat (default: per scenario)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument(
        "--backends", nargs="+", choices=sorted(BACKENDS),
        default=["envmanager", "gym.SyncVectorEnv", "gym.AsyncVectorEnv"],
    )
    b.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
