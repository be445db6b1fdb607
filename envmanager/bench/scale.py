"""The targets of the ``scale`` and ``cycle`` scenarios (issue 40), every one listed, met or missed.

``scale`` is what users see at scale: ``4 x cores`` envs, the drop-ins as users get them, every
peer, against the limit of ``cores`` processes stepping one env each in process (``limit``). Its
targets are for a many-core machine (from ``MANY_CORES`` usable cores), where every worker process
has a core of its own; on fewer cores the parent and the workers share them (the shared regime)
and the figures say little about the many-core one. ``cycle`` is the two-core proxy of a worker
with a core of its own: one worker process on one core, the parent on another, against one env's
in-process rate on the worker's core.

A target that cannot be evaluated in a run (its scenario or backend was not available, not named
with ``--backends``, or failed) is listed with why, as missed: a list of every target, never only
of those that happened to run.
"""

from __future__ import annotations

from collections.abc import Iterable

from envmanager.bench.backends import BACKENDS, NOT_APPLICABLE
from envmanager.bench.common import cores
from envmanager.bench.runner import ScenarioResult, Target
from envmanager.bench.scenarios import CYCLE_LANES_CONTENDERS, MANY_CORES

__all__ = ["DROP_IN", "SEND_RECV", "SB3_DROP_IN", "CYCLE_STEP", "SCALE_THRESHOLDS", "CYCLE_THRESHOLDS",
           "LANES_THRESHOLD", "regime", "regime_note", "targets"]

#: ``scale``'s three of ours: the drop-ins as users get them.
DROP_IN, SEND_RECV, SB3_DROP_IN = "envmanager-vector-default", "envmanager-batch", "envmanager-sb3"
#: ``cycle``: the drop-in's ``step()`` with one env per process.
CYCLE_STEP = "envmanager-vector"
#: ``scale`` case -> the fraction of the limit the drop-in's ``step()`` must reach, and
#: ``send``/``recv``'s (``None``: no such target for that case).
SCALE_THRESHOLDS: dict[str, tuple[float, float | None]] = {
    "scale-200us": (0.85, 0.92), "scale-20us": (0.5, None), "scale-cartpole": (0.3, None), "scale-pong": (0.85, 0.92),
}
SEND_RECV_VS_STEP = 1.0  # ``send``/``recv`` at least as fast as ``step()``, every case
SB3_VS_DROP_IN = 0.95  # the SB3 drop-in within 5% of the gymnasium drop-in
OURS_VS_PEER = 1.0  # the best of ours ahead of every peer
#: ``cycle`` case -> the fraction of the limit the drop-in's ``step()`` must reach.
CYCLE_THRESHOLDS = {"cycle-200us": 0.93, "cycle-63us": 0.80}
LANES_CASE, LANES_THRESHOLD = "cycle-2lanes-200us", 0.97


def regime(n_cores: int | None = None) -> str:
    """``"many-core"`` from ``MANY_CORES`` usable cores, else ``"shared"``."""
    return "many-core" if (cores() if n_cores is None else n_cores) >= MANY_CORES else "shared"


def regime_note(results: Iterable[ScenarioResult]) -> str | None:
    """What to print beside ``scale``'s figures and targets where they are not the many-core figure."""
    if regime() != "shared" or not any(r.scenario.group == "scale" for r in results):
        return None
    return (f"scale ran on {cores()} usable core{'s' * (cores() != 1)}: the shared regime (the parent and every worker "
            f"process share them), not the many-core one its targets are for ({MANY_CORES}+ cores, each worker process "
            "on a core of its own); the cycle scenarios are the two-core proxy of that")


def _case(result: ScenarioResult) -> str:
    return result.name.split("+")[0]  # ``--pin`` adds "+pin"


def _missing(result: ScenarioResult, backend: str) -> str:
    """Why ``backend`` has no measurement in ``result``."""
    if result.unavailable:
        return f"the scenario was not available: {result.unavailable}"
    if backend in result.failed:
        return f"{backend} failed: {result.failed[backend]}"
    if backend in result.skipped:
        return f"{backend} was skipped: {result.skipped[backend]}"
    return f"{backend} was not run (not among --backends)"


def _of_limit(result: ScenarioResult, what: str, backend: str, threshold: float) -> Target:
    """``backend``'s median as a fraction of the limit measured in the run."""
    name, m, limit = result.name, result.measurements.get(backend), result.limit
    if m is None:
        return Target(name, what, backend, None, threshold, _missing(result, backend))
    if not limit:
        why = f"the limit failed: {result.limit_failed}" if result.limit_failed else "the limit was not measured"
        return Target(name, what, backend, None, threshold, why)
    return Target(name, what, backend, m.median / limit, threshold)


def _versus(result: ScenarioResult, what: str, backend: str, other: str, threshold: float,
            label: str | None = None) -> Target:
    """``backend``'s median over ``other``'s (``label``: the target's backend column)."""
    name, m = result.name, result.measurements
    shown = label or backend
    for needed in (backend, other):
        if needed not in m:
            return Target(name, what, shown, None, threshold, _missing(result, needed))
    return Target(name, what, shown, m[backend].median / m[other].median, threshold)


def _peer_targets(result: ScenarioResult) -> list[Target]:
    """The best of ours against every peer measured, and every peer that should have been and
    was not (missing or failed; those that do not apply, such as EnvPool on Python envs, are no target)."""
    name, m = result.name, result.measurements
    what = "best of ours x {}"
    if result.unavailable:
        return [Target(name, what.format("every peer"), "best of ours", None, OURS_VS_PEER, _missing(result, "every peer"))]
    ours = [b for b in m if BACKENDS[b].ours]
    best = max(ours, key=lambda b: m[b].median, default=None)
    out = []
    peers = [b for b in m if not BACKENDS[b].ours]
    peers += [b for b, why in result.skipped.items() if not BACKENDS[b].ours and not why.startswith(NOT_APPLICABLE)]
    peers += [b for b in result.failed if not BACKENDS[b].ours]
    for peer in dict.fromkeys(peers):
        if best is None:
            out.append(Target(name, what.format(peer), "best of ours", None, OURS_VS_PEER, "none of ours was measured"))
        else:
            out.append(_versus(result, what.format(peer), best, peer, OURS_VS_PEER))
    return out


def _scale_targets(result: ScenarioResult) -> list[Target]:
    case = _case(result)
    step_threshold, send_threshold = SCALE_THRESHOLDS[case]
    limit = f"x the {result.limit_cores}-process limit"
    out = [_of_limit(result, f"drop-in step() {limit}", DROP_IN, step_threshold)]
    if send_threshold is not None:
        out.append(_of_limit(result, f"send/recv n/2 {limit}", SEND_RECV, send_threshold))
    out.append(_versus(result, "send/recv n/2 x drop-in step()", SEND_RECV, DROP_IN, SEND_RECV_VS_STEP))
    out.append(_versus(result, "SB3 drop-in x gym drop-in step()", SB3_DROP_IN, DROP_IN, SB3_VS_DROP_IN))
    return out + _peer_targets(result)


def _cycle_targets(result: ScenarioResult) -> list[Target]:
    case = _case(result)
    limit = f"x the {result.limit_cores}-worker-core limit"
    if case in CYCLE_THRESHOLDS:
        return [_of_limit(result, f"drop-in step() {limit}", CYCLE_STEP, CYCLE_THRESHOLDS[case])]
    m = result.measurements
    lanes = [b for b in CYCLE_LANES_CONTENDERS if b in m]
    if lanes:
        best = max(lanes, key=lambda b: m[b].median)
        return [_of_limit(result, f"two lanes (best) {limit}", best, LANES_THRESHOLD)]
    why = "; ".join(_missing(result, b) for b in CYCLE_LANES_CONTENDERS)
    return [Target(result.name, f"two lanes (best) {limit}", " or ".join(CYCLE_LANES_CONTENDERS), None, LANES_THRESHOLD,
                   why)]


def targets(result: ScenarioResult) -> list[Target]:
    """Every target of a ``scale`` or ``cycle`` result, met, missed or not measured."""
    if result.scenario.group == "scale" and _case(result) in SCALE_THRESHOLDS:
        return _scale_targets(result)
    if result.scenario.group == "cycle" and (_case(result) in CYCLE_THRESHOLDS or _case(result) == LANES_CASE):
        return _cycle_targets(result)
    return []
