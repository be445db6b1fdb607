"""``envmanager-learn``: ``mlagents-learn`` (ML-Agents' own CLI, every argument its own) with
envmanager's env manager; its own options: docs/guide/mlagents.md, "Train with ML-Agents".

Where ``run_training`` builds ``SubprocessEnvManager(env_factory, run_options, num_envs)``, it gets
:meth:`MLAgentsEnvManager.from_run_options <envmanager.mlagents.MLAgentsEnvManager.from_run_options>`
with the same arguments: ML-Agents has no plug-in point for the env manager (only stats writers
and trainer types), so that one name is swapped for the length of the run.

This module imports ``mlagents`` only when it runs, so the ``forkserver`` that starts the
workers (it imports ``__main__``, this console script) stays light.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envmanager.mlagents.gathering import GatherWindow

__all__ = ["main", "env_manager_factory", "using_env_manager"]

INSTALL_HINT = (
    'ML-Agents\' trainer is needed: pip install --ignore-requires-python "envmanager[mlagents-trainer]" '
    "(mlagents 1.1.0 declares Python <= 3.10.12 and wants a torch <= 2.8; see docs/guide/mlagents.md, \"Train with ML-Agents\")"
)

#: ``--batched-inference`` -> ``MLAgentsEnvManager(batched_inference=...)``
BATCHED_MODES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def _own_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="envmanager-learn", add_help=False, allow_abbrev=False,
        usage="envmanager-learn [mlagents-learn arguments] [--ray-address ADDRESS] [--env-addresses HOST:PORT,...] "
              "[--batched-inference {auto,on,off}]",
        description="envmanager-learn's own options (every other argument is mlagents-learn's):",
    )
    parser.add_argument("--ray-address", metavar="ADDRESS",
                        help="run the players on the nodes of this Ray cluster ('auto': the one this machine belongs "
                             "to); the trainer stays here")
    parser.add_argument("--env-addresses", metavar="HOST:PORT,...",
                        help="attach to players already running instead of launching --env: the trainer listens on "
                             "each address (one per --num-envs) for its player (--mlagents-port PORT); they are never "
                             "restarted nor killed")
    parser.add_argument("--batched-inference", choices=sorted(BATCHED_MODES), default="auto",
                        help="one policy call per behaviour for every ready player: auto (default: where the policy "
                             "supports it), on (or stop), off (one call per player, as mlagents-learn)")
    parser.add_argument("--gather-window-ms", type=float, default=0.0, metavar="MS",
                        help="after the first player's result, wait up to MS milliseconds for more (until "
                             "--gather-share of the players stepping have answered) so one policy call serves more "
                             "players: less trainer CPU with many cheap players, up to MS more latency per step "
                             "(default 0: off)")
    parser.add_argument("--gather-share", type=float, default=0.75, metavar="SHARE",
                        help="with --gather-window-ms: the share of the players stepping to wait for (default 0.75)")
    return parser


def split_arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], bool]:
    """envmanager-learn's own options, the rest for ML-Agents (``--env-args`` and what follows it
    go to the player untouched), and whether help was asked for (before ``--env-args``)."""
    argv = list(argv)
    cut = argv.index("--env-args") if "--env-args" in argv else len(argv)
    ours, rest = _own_parser().parse_known_args(argv[:cut])
    return ours, rest + argv[cut:], "-h" in rest or "--help" in rest


class FailedStartup:
    """What ``run_training`` gets when the env manager could not start (Ctrl-C, a player failing).
    ML-Agents' own manager starts its players in the background, so such a failure reaches its
    trainer at the first ``reset``, inside ``start_learning`` and ``run_training``'s ``finally``
    (exit code and files written as on any interruption): here too it is raised at that ``reset``."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error
        self.first_step_infos: list[Any] = []

    def reset(self, config: Any = None) -> int:
        error, self.error = self.error, None
        raise error if error is not None else RuntimeError("the env manager did not start")

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the env manager did not start ({name})")


def deferring_startup_errors(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory``, with an error while the manager starts handed over at its first ``reset``
    (``FailedStartup``); a player's failure as a Unity error, as the manager's later ones."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        try:
            return factory(*args, **kwargs)
        except (KeyboardInterrupt, Exception) as exc:
            from envmanager.errors import EnvManagerError, InvalidInputError
            from envmanager.mlagents.checks import as_unity_error

            if isinstance(exc, EnvManagerError) and not isinstance(exc, InvalidInputError):
                return FailedStartup(as_unity_error(exc))
            return FailedStartup(exc)

    return build


def env_manager_factory(ray_address: str | None = None, batched_inference: str = "auto",
                        env_addresses: str | None = None, gather: GatherWindow | None = None) -> Callable[..., Any]:
    """What ``run_training`` calls instead of ``SubprocessEnvManager(env_factory, run_options, n_env)``."""
    batched = BATCHED_MODES[batched_inference]
    local: dict[str, Any] = {"batched_inference": batched, **({"gather_window": gather} if gather is not None else {})}
    if env_addresses is not None:
        return functools.partial(attached_env_manager, env_addresses, **local)
    if ray_address is None:
        from envmanager.mlagents.env_manager import MLAgentsEnvManager

        return functools.partial(MLAgentsEnvManager.from_run_options, **local)
    from envmanager.mlagents.ray_env_manager import RayMLAgentsEnvManager

    return functools.partial(RayMLAgentsEnvManager.from_run_options, address=ray_address, batched_inference=batched)


def attached_env_manager(env_addresses: str, env_factory: Any, run_options: Any, n_env: int | None = None,
                         **overrides: Any) -> Any:
    """``MLAgentsEnvManager.from_run_options`` on the players at ``env_addresses`` (ML-Agents'
    ``env_factory``, which would launch ``--env``, is not used)."""
    from envmanager.mlagents.attach import AttachedUnityFactory
    from envmanager.mlagents.env_manager import MLAgentsEnvManager

    factory = AttachedUnityFactory.from_run_options(env_addresses, run_options)
    return MLAgentsEnvManager.from_run_options(factory, run_options, n_env, **overrides)


def take_num_envs(rest: list[str]) -> tuple[list[str], int | None]:
    """ML-Agents refuses ``--num-envs`` above 1 without ``--env``; with ``--env-addresses`` it
    is taken out (and returned) and ML-Agents parses ``--num-envs=1``: the count is set after."""
    cut = rest.index("--env-args") if "--env-args" in rest else len(rest)
    head, tail, given = [], rest[cut:], None
    i = 0
    while i < cut:
        arg = rest[i]
        value = arg.split("=", 1)[1] if arg.startswith("--num-envs=") else (
            rest[i + 1] if arg == "--num-envs" and i + 1 < cut else None)
        if value is not None and value.isdigit():
            given = int(value)
            i += 1 if "=" in arg else 2
            continue
        head.append(arg)
        i += 1
    return [*head, "--num-envs=1", *tail], given


def check_env_addresses(ours: argparse.Namespace, options: Any, num_envs: int | None) -> str | None:
    """Why ``--env-addresses`` cannot be used with these options (``None``: it can), found before
    anything starts; ``num_envs``: the ``--num-envs`` given, if any."""
    from envmanager.errors import EnvManagerError
    from envmanager.mlagents.attach import AttachedUnityFactory, check_attached, parse_addresses

    if ours.ray_address is not None:
        return "--env-addresses and --ray-address: attached players are served from this machine, not a Ray cluster"
    if options.env_settings.env_path is not None:
        return ("--env-addresses and --env: --env launches players, --env-addresses attaches to running ones; "
                "give one of them")
    try:
        addresses = parse_addresses(ours.env_addresses)
        if num_envs is not None and len(addresses) != num_envs:
            return (f"--env-addresses names {len(addresses)} player(s) and --num-envs is {num_envs}: "
                    f"give --num-envs={len(addresses)} (or leave it out)")
        check_attached(AttachedUnityFactory(addresses), len(addresses))
    except EnvManagerError as exc:
        return f"--env-addresses: {exc}"
    return None


@contextmanager
def using_env_manager(learn_module: Any, factory: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``learn_module.run_training`` builds its env manager with ``factory``."""
    name = "SubprocessEnvManager"
    if not hasattr(learn_module, name):
        raise RuntimeError(
            f"{learn_module.__name__} has no {name}: this ML-Agents version builds its env manager "
            "elsewhere, and envmanager-learn does not know where (tested with mlagents 1.1.0)"
        )
    original = getattr(learn_module, name)
    setattr(learn_module, name, factory)
    try:
        yield
    finally:
        setattr(learn_module, name, original)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script (its usage: ``envmanager-learn --help``); returns the exit status."""
    ours, rest, help_asked = split_arguments(sys.argv[1:] if argv is None else argv)
    try:
        from mlagents.trainers import learn
    except ImportError as exc:
        print(f"envmanager-learn: {INSTALL_HINT} ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if help_asked:
        learn.parser.prog = "envmanager-learn"
        learn.parser.print_help()
        print()
        print(_own_parser().format_help().rstrip())
        return 0
    num_envs = None
    if ours.env_addresses is not None:
        rest, num_envs = take_num_envs(rest)
    options = learn.parse_command_line(rest)
    if ours.env_addresses is not None:
        problem = check_env_addresses(ours, options, num_envs)
        if problem is not None:
            print(f"envmanager-learn: {problem}", file=sys.stderr)
            return 2
        options.env_settings.num_envs = len(ours.env_addresses.split(","))  # (checked: one player each)
        if options.env_settings.env_args:
            print("envmanager-learn: --env-args ignored: attached players are not launched", file=sys.stderr)
    from envmanager.errors import InvalidInputError
    from envmanager.mlagents.gathering import GatherWindow

    try:
        gather = GatherWindow(ours.gather_window_ms / 1000.0, ours.gather_share)
    except InvalidInputError as exc:
        print(f"envmanager-learn: {exc}", file=sys.stderr)
        return 2
    if gather.seconds > 0 and ours.ray_address is not None:
        print("envmanager-learn: --gather-window-ms is not available with --ray-address", file=sys.stderr)
        return 2
    factory = env_manager_factory(ours.ray_address, ours.batched_inference, ours.env_addresses,
                                  gather if gather.seconds > 0 else None)
    with using_env_manager(learn, deferring_startup_errors(factory)):
        learn.run_cli(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
