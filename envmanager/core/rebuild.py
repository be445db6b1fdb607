"""The parent's half of the REBUILD command (the worker's: ``WorkerEnvs.rebuild`` in
``envmanager.worker.envs``; the message: ``envmanager.wire.messages.Rebuild``).

An env that raised in a step or reset of a process that answered is made again inside it (when
and why: docs/architecture.md, State). This module builds the request and splits the answer that
reported the failure into what the other envs delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.wire.messages import EnvironmentRequest, Rebuild, Stepped

__all__ = ["rebuild_request", "delivered"]


def rebuild_request(prepare: Callable[..., EnvironmentRequest], env_ids: tuple[int, ...], failed: EnvironmentRequest,
                    positions: list[int], replay_calls: Sequence[tuple[str, tuple, dict]],
                    generations: tuple[int, ...]) -> EnvironmentRequest:
    """The REBUILD of the envs at ``positions`` of ``failed`` (a STEP or RESET of the process
    hosting ``env_ids``): each made again, ``replay_calls`` called on it (as a restart does), reset
    (with the seed and options of a reset it raised in), and of ``generations`` from now on."""
    slots = tuple(failed.slots[n] for n in positions)
    if failed.cmd is Cmd.RESET:
        _, seeds, options = failed.message
        asked: tuple[tuple[Any, ...], tuple[Any, ...]] = (tuple(seeds[n] for n in positions),
                                                          tuple(options[n] for n in positions))
    else:
        asked = ((None,) * len(slots), (None,) * len(slots))
    replays = tuple((name, tuple(args), dict(kwargs)) for name, args, kwargs in replay_calls)
    message = Rebuild(tuple(env_ids.index(s) for s in slots), *asked, replays, generations)
    return prepare(Cmd.REBUILD, message, slots)


def delivered(answer: Stepped, kept: list[int], slots: tuple[int, ...]) -> Stepped:
    """``answer`` (to a request on ``slots``) for the envs at positions ``kept`` only: those that did not raise."""
    keep = {slots[n] for n in kept}
    infos = {s: i for s, i in answer.infos.items() if s in keep} if answer.infos else None
    return Stepped([answer.env_times[n] for n in kept], infos or None, None,
                   None if answer.observations is None else [answer.observations[n] for n in kept],
                   None if answer.scalars is None else [answer.scalars[n] for n in kept], None,
                   None if answer.generations is None else tuple(answer.generations[n] for n in kept))
