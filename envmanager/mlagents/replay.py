"""Settings every restart replays (environment parameters, engine settings, analytics), on the
core's workers: what ``MLAgentsEnvManager`` does on this machine and each Ray node's
``PlayerNode`` does on its own.

* :func:`call_replayed`: a setting on the workers. A worker whose process dies or hangs during
  the call and is restarted gets it from its restart's replay: that is no error.
* :func:`reset_restarted`: a worker restarted before the setting whose fresh reset nobody has
  taken yet was reset with the old value (its restart replayed what was set when it began): it is
  reset again, so the first episode anyone sees of it runs with the new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envmanager.core.results import StepInfo
from envmanager.errors import RestartLimitError, WorkerDiedError, WorkerTimeoutError

__all__ = ["call_replayed", "reset_restarted", "replace_reset"]


def call_replayed(manager: Any, worker_ids: Sequence[int] | None, name: str, args: tuple) -> None:
    """``name(*args)`` on the envs of ``worker_ids`` (a core manager's); a worker restarted
    meanwhile (not given up) has it from its replay."""
    try:
        manager.call_on(worker_ids, name, args)
    except (WorkerDiedError, WorkerTimeoutError) as exc:
        slots = list(getattr(exc, "worker_ids", None) or [getattr(exc, "worker_id", -1)])
        if isinstance(exc, RestartLimitError) or not slots or any(
                not 0 <= w < manager.n_env or manager.failure_of(w) is not None for w in slots):
            raise


def reset_restarted(manager: Any, held: list[StepInfo], resend: bool = True) -> list[StepInfo]:
    """``held`` (results taken, not handed on yet) and what else came in, with every restarted
    worker's fresh reset among them made again (:func:`replace_reset`). What came in is added to
    the caller's ``held`` itself: if the reset raises, the caller still has it.

    A reset sent by a call a Ctrl-C cut short (its wait is interruptible) is still in flight: it
    is waited for, not sent again; with ``resend=False`` only those are (the next ``get_steps``:
    else their workers were never stepped again)."""
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
