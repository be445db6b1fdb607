"""What ML-Agents' own trainer (``mlagents.trainers``) needs from an env manager, on envmanager:
its options, episodes cut per worker, statistics, timers, and the training-analytics messages
(made here in the trainer's process, so the workers never import ``mlagents.trainers`` and torch).
``mlagents`` is imported only inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from envmanager.mlagents.checks import call_if_present
from envmanager.mlagents.settings import ENGINE_FIELDS

__all__ = ["DEADLINE_MARGIN", "manager_options", "end_worker_episodes", "cut_stats", "inference_stats",
           "PLAYERS_PER_INFERENCE", "merge_worker_timers", "CUT_AGENT_EPISODES", "DROPPED_EXPERIENCES",
           "environment_initialized", "training_started"]

#: Seconds the deadline of a worker answer allows beyond the players' ``timeout_wait``: a player
#: that stops answering is reported by ``mlagents_envs`` (and its env shut down by the worker)
#: before the deadline would cut the worker off.
DEADLINE_MARGIN = 60.0
#: Trainer statistics of the episodes restarts cut (per behaviour, summed per summary period).
CUT_AGENT_EPISODES = "Env Manager/Cut Agent Episodes"
DROPPED_EXPERIENCES = "Env Manager/Dropped Experiences"
#: Trainer statistic: how many players each policy call acted for (averaged per summary period;
#: 1 without batched inference).
PLAYERS_PER_INFERENCE = "Env Manager/Players per Inference"


def manager_options(run_options: Any) -> dict[str, Any]:
    """``MLAgentsEnvManager`` keyword arguments from what ML-Agents' ``SubprocessEnvManager`` reads
    in a ``RunOptions``: engine settings and restart limits (``-1`` lifts one, as in ML-Agents);
    the deadline is ``timeout_wait`` plus :data:`DEADLINE_MARGIN`. Ports, seeds, areas, graphics
    and player arguments are the ``env_factory``'s (as in ML-Agents)."""
    env, engine = run_options.env_settings, run_options.engine_settings
    return {
        "engine_config": {name: getattr(engine, name) for name in ENGINE_FIELDS if hasattr(engine, name)},
        "timeout": float(env.timeout_wait) + DEADLINE_MARGIN,
        "restart_workers": True,
        "max_lifetime_restarts": int(env.max_lifetime_restarts),
        "restarts_rate_limit_n": int(env.restarts_rate_limit_n),
        "restarts_rate_limit_period_s": float(env.restarts_rate_limit_period_s),
    }


def end_worker_episodes(agent_manager: Any, worker_id: int) -> tuple[int, int]:
    """Drop what ``agent_manager`` holds of ``worker_id``'s unfinished episodes, the other workers'
    kept (ML-Agents' ``end_episode()`` drops every worker's: it resets every environment after a
    restart). Without ``AgentProcessor``'s internals: ``end_episode()``, and ``(-1, -1)``.

    Returns ``(agents, experiences)``: the agents whose episode was cut and their steps dropped.
    """
    clean = getattr(agent_manager, "_clean_agent_data", None)
    found = [getattr(agent_manager, name, None)
             for name in ("_experience_buffers", "_last_step_result", "_last_take_action_outputs")]
    tables = [table for table in found if isinstance(table, dict)]
    if not callable(clean) or len(tables) != len(found):
        call_if_present(agent_manager, "end_episode")
        return -1, -1
    prefix = _global_agent_id(worker_id, "")
    ids = sorted({gid for table in tables for gid in table if isinstance(gid, str) and gid.startswith(prefix)})
    dropped = sum(len(tables[0].get(gid) or ()) for gid in ids)
    clear_group = getattr(agent_manager, "_clear_group_status_and_obs", None)
    for gid in ids:
        clean(gid)
        if callable(clear_group):
            clear_group(gid)
    return len(ids), dropped


def cut_stats(agents: int, experiences: int) -> dict[str, list[tuple[float, Any]]]:
    """A cut as environment statistics (``AgentManager.record_environment_stats``), summed per
    summary period."""
    from mlagents_envs.side_channel.stats_side_channel import StatsAggregationMethod

    return {CUT_AGENT_EPISODES: [(float(agents), StatsAggregationMethod.SUM)],
            DROPPED_EXPERIENCES: [(float(experiences), StatsAggregationMethod.SUM)]}


def inference_stats(sizes: list[int]) -> dict[str, list[tuple[float, Any]]]:
    """The policy calls of one step as environment statistics: the players each one acted for."""
    from mlagents_envs.side_channel.stats_side_channel import StatsAggregationMethod

    return {PLAYERS_PER_INFERENCE: [(float(n), StatsAggregationMethod.AVERAGE) for n in sizes]}


def merge_worker_timers(roots: list[Any]) -> None:
    """Merge the timers the workers sent with their steps into this thread's, under ``workers``
    (their time overlaps: ``is_parallel``), as ML-Agents' ``SubprocessEnvManager`` does."""
    roots = [root for root in roots if root is not None]
    if not roots:
        return
    from mlagents_envs.timers import hierarchical_timer

    with hierarchical_timer("workers") as node:
        for root in roots:
            node.merge(root, root_name="worker_root", is_parallel=True)


def _global_agent_id(worker_id: int, agent_id: Any) -> str:
    try:
        from mlagents.trainers.behavior_id_utils import get_global_agent_id
    except ImportError:  # the trainer package is not installed: its format (1.x)
        return f"agent_{worker_id}-{agent_id}"
    return get_global_agent_id(worker_id, agent_id)


def environment_initialized(run_options: Any) -> list[bytes]:
    """The messages ML-Agents' worker 0 sends its player once its env exists."""
    return _analytics(lambda channel: channel.environment_initialized(run_options))


def training_started(run_options: Any, behavior_name: str, trainer_settings: Any) -> list[bytes]:
    """The message ML-Agents' worker 0 sends when training of ``behavior_name`` starts."""

    def send(channel: Any) -> None:
        channel.run_options = run_options  # which behaviours a curriculum names
        channel.training_started(behavior_name, trainer_settings)

    return _analytics(send)


def _analytics(send: Callable[[Any], Any]) -> list[bytes]:
    """The payloads ``send(channel)`` queues on a new ``TrainingAnalyticsSideChannel``
    (``queue_message_to_send``); ``[]`` if ``mlagents.trainers`` is not importable."""
    try:
        from mlagents.trainers.training_analytics_side_channel import TrainingAnalyticsSideChannel
    except ImportError:
        return []
    channel = TrainingAnalyticsSideChannel()
    send(channel)
    return [bytes(payload) for payload in getattr(channel, "message_queue", [])]
