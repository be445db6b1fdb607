"""Settings every restart replays (environment parameters, engine settings, analytics), on the
core's workers: used by ``MLAgentsEnvManager`` on this machine and by each Ray node's ``PlayerNode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envmanager.core.results import StepInfo
from envmanager.errors import RestartLimitError, WorkerDiedError, WorkerTimeoutError, failed_slots

__all__ = ["call_replayed", "reset_restarted", "replace_reset"]


def call_replayed(manager: Any, worker_ids: Sequence[int] | None, name: str, args: tuple) -> None:
    """``name(*args)`` on the envs of ``worker_ids`` (a core manager's); a worker that dies or hangs
    meanwhile and is restarted (not given up) has it from its restart's replay: no error."""
    try:
        manager.call_on(worker_ids, name, args)
    except (WorkerDiedError, WorkerTimeoutError) as exc:
        slots = failed_slots(exc)
        if isinstance(exc, RestartLimitError) or not slots or any(
                not 0 <= w < manager.n_env or manager.failure_of(w) is not None for w in slots):
            raise


def reset_restarted(manager: Any, held: list[StepInfo], resend: bool = True) -> list[StepInfo]:
    """``held`` (results taken, not handed on yet) and what else came in (added to the caller's
    ``held`` itself, kept if the reset raises), with every restarted worker's fresh reset, made
    with the old settings, made again so the first episode anyone sees of it has the new ones.
    A reset a Ctrl-C cut short is still in flight: waited for, not sent again; with
    ``resend=False`` only those are (else their workers were never stepped again)."""
    held += manager.receive_steps(min_count=0)
    in_flight = set(manager.resets_in_flight)
    stale = sorted({info.worker_id for info in held if info.interrupted and (resend or info.worker_id in in_flight)})
    if not stale:
        return held
    manager.send_reset({w: (None, None) for w in stale if w not in in_flight})
    fresh = {info.worker_id: info for info in manager.receive_resets(stale)}
    return [replace_reset(info, fresh.pop(info.worker_id)) if info.interrupted and info.worker_id in fresh else info
            for info in held]


def replace_reset(stale: StepInfo, fresh: StepInfo) -> StepInfo:
    """A restarted worker's fresh reset in place of its first one (made with older settings):
    still interrupted, with what its player reported on both."""
    old = (stale.current_result.info or {}).get("environment_stats", {})
    info = dict(fresh.current_result.info or {})
    new = info.get("environment_stats", {})
    info["environment_stats"] = {key: [*old.get(key, []), *new.get(key, [])] for key in {**old, **new}}
    return fresh._replace(current_result=fresh.current_result._replace(info=info), interrupted=True)
