"""The fake Unity player's command line and settings (see :mod:`envmanager.testing.fake_unity`):
Unity's own single-dash flags taken out, then flags over ``--config`` over
``$ENVMANAGER_FAKE_UNITY_CONFIG`` over the defaults. Imports nothing of ``envmanager`` when the
player runs as a file."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

if __package__:
    from envmanager.testing import fake_unity_task as _task
else:  # imported by fake_unity.py run as a file
    import fake_unity_task as _task  # type: ignore[no-redef,import-not-found]  # the file next to this one

__all__ = ["CONFIG_ENV_VAR", "build_parser", "parse_args"]

CONFIG_ENV_VAR = "ENVMANAGER_FAKE_UNITY_CONFIG"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="envmanager-fake-unity", allow_abbrev=False,
                                description="Fake Unity ML-Agents player (gRPC client, API 1.5.0; needs the extra "
                                            "mlagents).")
    a = p.add_argument
    a("--mlagents-port", type=int, default=5005, help="port of the Python gRPC server")
    a("--config", help="JSON config file (see envmanager.testing.fake_unity_task.FakeConfig)")
    a("--record", help="append JSON lines of what the player receives to this file")
    a("--seed", type=int, help="task seed (default: the seed UnityEnvironment sends)")
    a("--step-latency", type=float, help="seconds to sleep per STEP")
    a("--latency-jitter", type=float, help="extra uniform [0, jitter] seconds per STEP")
    a("--reset-latency", type=float, help="seconds to sleep per RESET")
    a("--crash-after-steps", type=int, help="answer N STEP commands, crash on the next one")
    a("--crash-mode", choices=["exit", "raise", "kill", "hang"])
    a("--crash-exit-code", type=int)
    a("--crash-on-start", action="store_true", default=None, help="exit(crash code) before connecting")
    a("--no-stats", dest="stats", action="store_false", default=None, help="send no StatsSideChannel data")
    a("--connect-timeout", type=float)
    a("--exchange-timeout", type=float, help="deadline of each Exchange RPC (default: none)")
    a("--echo-channel", dest="echo_channels", action="append", help="uuid of a side channel to echo back")
    a("--verbose", action="store_true", help="log to stderr too")
    a("--sessions", type=int, default=1,
      help="trainers to serve one after the other (0: any number): a player that outlives its trainer, "
           "as a game server a trainer attaches to; after a trainer closes it waits --connect-timeout "
           "for the next one")
    b = p.add_argument_group("behaviour (applied to every behaviour)")
    b.add_argument("--behavior", dest="name", help='behaviour name, e.g. "Ball?team=0" (single behaviour only)')
    b.add_argument("--agents", type=int)
    b.add_argument("--obs-shape", dest="observation_shapes", type=_int_list, action="append",
                   help="observation shape like 8 or 3,4 (repeat for several observations)")
    b.add_argument("--continuous", type=int, help="number of continuous actions")
    b.add_argument("--discrete", type=_int_list, help="discrete branch sizes like 3,2 ('' for none)")
    b.add_argument("--action-mask", dest="action_masks", type=_int_list, action="append",
                   help="masked indices of one branch, like 1,2 (repeat once per branch)")
    b.add_argument("--episode-length", type=int, help="steps per episode (0 = never ends)")
    b.add_argument("--interrupt", dest="episode_end", action="store_const", const="interrupt",
                   help="episodes end interrupted (max_step_reached) instead of terminated")
    b.add_argument("--decision-period", type=int)
    b.add_argument("--wrong-reward", type=float)
    b.add_argument("--echo-actions", action="store_true", default=None,
                   help="observations after the first hold the agent's last action received")
    return p


TOP_FLAGS = ("record", "seed", "step_latency", "latency_jitter", "reset_latency", "crash_after_steps",
             "crash_mode", "crash_exit_code", "crash_on_start", "stats", "connect_timeout",
             "exchange_timeout", "echo_channels")
BEHAVIOR_FLAGS = ("name", "agents", "observation_shapes", "continuous", "discrete", "action_masks",
                  "episode_length", "episode_end", "decision_period", "wrong_reward", "echo_actions")


def parse_args(argv: Sequence[str] | None = None) -> tuple[_task.FakeConfig, dict[str, Any]]:
    """Returns the config and the launch facts (port, log file, Unity flags, ignored args)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    log_file, unity_flags, rest = None, [], []
    i = 0
    while i < len(argv):  # Unity-style single-dash flags, taken out before argparse sees them
        arg = argv[i]
        if arg.lower() == "-logfile" and i + 1 < len(argv):
            log_file, i = argv[i + 1], i + 2
            continue
        if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2 and arg[1].isalpha():
            unity_flags.append(arg)
        else:
            rest.append(arg)
        i += 1
    ns, ignored = build_parser().parse_known_args(rest)
    path = ns.config or os.environ.get(CONFIG_ENV_VAR)
    data: dict[str, Any] = _task.load_config(path) if path else {}
    for key in TOP_FLAGS:
        if getattr(ns, key) is not None:
            data[key] = getattr(ns, key)
    behaviors = [dict(b) for b in data.get("behaviors", [{}])]
    for key in BEHAVIOR_FLAGS:
        if getattr(ns, key) is not None:
            for b in behaviors:
                b[key] = getattr(ns, key)
    data["behaviors"] = behaviors
    facts = {"port": ns.mlagents_port, "log_file": log_file, "unity_flags": unity_flags,
             "ignored_args": ignored, "config_path": path, "verbose": ns.verbose,
             "sessions": ns.sessions}
    return _task.make_config(data), facts
