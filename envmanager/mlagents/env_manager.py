"""``MLAgentsEnvManager``: ML-Agents' trainer ``EnvManager`` contract on envmanager's core.

It mirrors ``mlagents.trainers.subprocess_env_manager.SubprocessEnvManager`` (names and
semantics) on the core's :class:`~envmanager.SubprocessEnvManager`: deadlines, clean shutdown, a
failed player restarted alone with its environment parameters replayed, and past the restart
limits :class:`~envmanager.RestartLimitError` (see docs/guide/mlagents.md).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from envmanager.core.manager import SubprocessEnvManager
from envmanager.core.restart import MAX_LIFETIME_RESTARTS, RATE_LIMIT_N, RATE_LIMIT_PERIOD_S
from envmanager.core.results import StepInfo
from envmanager.errors import InvalidInputError, ManagerClosedError
from envmanager.mlagents.acting import InferenceCounts, choose_actions
from envmanager.mlagents.attach import AttachedUnityFactory, PlayerAddress, check_attached, lost_players, parse_addresses
from envmanager.mlagents.batched import BatchedCall, batched_call
from envmanager.mlagents.checks import call_if_present, port_errors
from envmanager.mlagents.gathering import NO_GATHER, GatherWindow, gather_more
from envmanager.mlagents.player_process import PlayerProcesses
from envmanager.mlagents.replay import call_replayed, reset_restarted
from envmanager.mlagents.settings import normalize_engine_config, normalize_env_parameters
from envmanager.mlagents.steps import ActionInfo, EnvironmentStep, SentActions
from envmanager.mlagents.trainer import (
    cut_stats,
    end_worker_episodes,
    environment_initialized,
    inference_stats,
    manager_options,
    merge_worker_timers,
    training_started,
)
from envmanager.mlagents.worker_env import EnvFactory, WorkerEnvFactory, player_ports
from envmanager.wire.interrupts import deferred

logger = logging.getLogger(__name__)

__all__ = ["MLAgentsEnvManager"]


def _mlagents_log_level() -> int | None:
    """The log level ML-Agents' trainer set (``--debug``: DEBUG, else INFO), which ML-Agents'
    ``SubprocessEnvManager`` hands its workers: ``None`` if it set none."""
    try:
        from mlagents_envs import logging_util
    except ImportError:
        return None
    level = getattr(logging_util, "_log_level", logging.NOTSET)
    return None if level == logging.NOTSET else int(level)


class MLAgentsEnvManager:
    """Run ``n_env`` ML-Agents environments in worker processes, ML-Agents trainer style.

    Args:
        env_factory: ``env_factory(worker_id, side_channels) -> BaseEnv``, run in the worker
            (cloudpickled), e.g. :class:`~envmanager.mlagents.UnityEnvironmentFactory`. It must
            pass ``side_channels`` (environment parameters, engine configuration, stats) on.
        n_env: number of environments (``worker_id`` 0 .. n_env-1), one process each.
        engine_config: ``EngineConfig`` or dict of its fields, set before each env is created.
        timeout: deadline in seconds for any one worker answer, startup included. Keep it above
            the players' ``timeout_wait``, so mlagents reports a hung player (and its worker shuts
            it down) before the deadline cuts it off.
        restart_workers, max_lifetime_restarts, restarts_rate_limit_n, restarts_rate_limit_period_s:
            restart a failed worker alone, within these limits (ML-Agents' defaults).
        context: multiprocessing start method; default ``forkserver`` (else ``spawn``): gRPC
            state must not be forked.
        training_analytics: give worker 0's env a training-analytics channel, as ML-Agents'
            trainer does (set by :meth:`from_run_options`).
        batched_inference: ``None`` (default): one policy call per behaviour for every idle
            worker where the policy has a batched call (:mod:`envmanager.mlagents.batched`), else
            one ``get_action`` per worker; ``True``: batched, a policy that cannot be is refused
            (:class:`~envmanager.mlagents.batched.BatchedInferenceError`); ``False``: as ML-Agents.
        gather_window: after the first result, wait a moment for more players so that one
            policy call serves more of them (:class:`~envmanager.mlagents.gathering.GatherWindow`;
            off by default: it adds latency).

    With an :class:`~envmanager.mlagents.attach.AttachedUnityFactory` the workers attach to
    players already running (one address per env, checked before anything starts), never
    restarted nor killed: a lost one is a :class:`~envmanager.mlagents.attach.PlayerLostError`.
    """

    def __init__(
        self,
        env_factory: EnvFactory,
        n_env: int = 1,
        *,
        engine_config: Any = None,
        timeout: float = 120.0,
        restart_workers: bool = True,
        max_lifetime_restarts: int = MAX_LIFETIME_RESTARTS,
        restarts_rate_limit_n: int = RATE_LIMIT_N,
        restarts_rate_limit_period_s: float = RATE_LIMIT_PERIOD_S,
        context: str | None = None,
        training_analytics: bool = False,
        batched_inference: bool | None = None,
        gather_window: GatherWindow = NO_GATHER,
        log_level: int | None = None,
    ) -> None:
        self.batched_inference = batched_inference
        self.gather_window = gather_window
        self._batched: dict[str, BatchedCall] = {}  # behavior_name -> its policy's batched call
        self.inference_counts = InferenceCounts()  # policy calls and the worker requests they served
        self.run_options: Any = None
        self.cut_agent_episodes = 0  # agents whose unfinished episode a restart cut
        self.dropped_experiences = 0  # their steps not yet in a trajectory, dropped
        self._analytics: list[bytes] = []
        self._manager: Any = None  # the core's SubprocessEnvManager (or the Ray variant's pool); None: closed
        self.policies: dict[str, Any] = {}
        self.agent_managers: dict[str, Any] = {}
        self.first_step_infos: list[EnvironmentStep] = []
        self.env_parameters: dict[str, Any] = {}
        self.engine_config: dict[str, Any] = normalize_engine_config(engine_config)
        self.training_started: dict[str, Any] = {}  # behavior_name -> trainer_settings
        self._engine_overrides: dict[str, Any] = {}
        self._specs: dict[int, dict[str, Any]] = {}
        self._last: dict[int, StepInfo] = {}  # each worker's latest result handed to the trainer
        self._held: list[StepInfo] = []  # results taken from the workers, not handed out yet
        local = type(self)._start_core is MLAgentsEnvManager._start_core  # (not the Ray variant: players elsewhere)
        self._players = PlayerProcesses(player_ports(env_factory, range(n_env)) if local else ())  # swept at close
        self.player_addresses: dict[int, PlayerAddress] = {}  # worker_id -> its attached player's address
        if gather_window.seconds > 0 and not local:
            raise InvalidInputError(f"{type(self).__name__} has no gather_window (MLAgentsEnvManager's own workers only)")
        if isinstance(env_factory, AttachedUnityFactory):
            if not local:
                raise InvalidInputError(f"{type(self).__name__} runs its players elsewhere: attached players "
                                        "(AttachedUnityFactory) are served from this process; use MLAgentsEnvManager")
            check_attached(env_factory, n_env)
            self.player_addresses = dict(enumerate(env_factory.addresses))
            restart_workers = False  # not ours to restart: a lost one is an error naming its address
        core_options: dict[str, Any] = {
            # forkserver (else spawn): never fork a parent that may hold gRPC state
            "context": context or ("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"),
            "timeout": timeout,
            "restart_workers": restart_workers,
            "max_lifetime_restarts": max_lifetime_restarts,
            "restarts_rate_limit_n": restarts_rate_limit_n,
            "restarts_rate_limit_period_s": restarts_rate_limit_period_s,
        }
        worker_factory = WorkerEnvFactory(env_factory, self.engine_config or None,
                                          training_analytics=training_analytics, log_level=log_level)
        try:
            with self._errors():
                self._manager = self._start_core(worker_factory, n_env, core_options)
                self._specs = dict(enumerate(self._manager.call("behavior_specs")))
                self._players.started(dict(enumerate(self._manager.get_attr("player"))))
        except BaseException:
            self.close()  # kills the players too: one a worker killed while it launched it left behind
            raise

    @classmethod
    def from_run_options(
        cls, env_factory: EnvFactory, run_options: Any, n_env: int | None = None, **overrides: Any
    ) -> MLAgentsEnvManager:
        """A manager set up as ML-Agents' trainer sets up its own, from the same arguments as its
        ``SubprocessEnvManager(env_factory, run_options, n_env)``: engine settings, restart limits
        and ``timeout_wait`` from the ``RunOptions`` (:func:`~envmanager.mlagents.trainer.manager_options`),
        ``n_env`` by default its ``env_settings.num_envs``, training analytics for worker 0's player.
        ``overrides`` replace any constructor argument (``timeout=...``)."""
        options: dict[str, Any] = {**manager_options(run_options), "training_analytics": True,
                                   "log_level": _mlagents_log_level(), **overrides}
        manager = cls(env_factory, run_options.env_settings.num_envs if n_env is None else n_env, **options)
        try:
            manager.run_options = run_options
            if options["training_analytics"]:
                manager._analytics = environment_initialized(run_options)
                manager._update_replay_calls()
                manager._send_analytics(manager._analytics)
        except BaseException:
            manager.close()
            raise
        return manager

    @classmethod
    def attached(cls, addresses: str | list[str], *, seed: int = 0, timeout_wait: int = 60, num_areas: int = 1,
                 **options: Any) -> MLAgentsEnvManager:
        """A manager on players already running, one env each, the trainer listening for them on
        ``addresses`` (``"host:port,..."`` or a list): ``cls(AttachedUnityFactory(...), len(addresses))``."""
        factory = AttachedUnityFactory(parse_addresses(addresses), seed=seed, timeout_wait=timeout_wait,
                                       num_areas=num_areas)
        return cls(factory, len(factory.addresses), **options)

    def _start_core(self, worker_factory: WorkerEnvFactory, n_env: int, options: dict[str, Any]) -> Any:
        """The core's manager (the Ray variant's runs the workers on a cluster); DecisionSteps are
        pickled, not in shared memory."""
        return SubprocessEnvManager(worker_factory, n_env, shared_memory=False, **options)

    # -- ML-Agents' EnvManager interface -----------------------------------------------------------

    @property
    def n_env(self) -> int:
        return self.manager.n_env

    @property
    def manager(self) -> SubprocessEnvManager:
        """The core manager underneath."""
        self._check_open()
        return self._manager

    def set_policy(self, behavior_name: str, policy: Any) -> None:
        """Act for ``behavior_name`` with ``policy.get_action(decision_steps, worker_id) -> ActionInfo``
        (or one batched call for every idle worker: ``batched_inference``). Behaviours without a
        policy get empty actions (zeros), as in ML-Agents."""
        if policy is not self.policies.get(behavior_name):  # (a behaviour without a policy has no batched call)
            call = None
            if self.batched_inference is not False and policy is not None:
                call = batched_call(policy, behavior_name, required=self.batched_inference is True)
            self._batched.pop(behavior_name, None)
            if call is not None:
                self._batched[behavior_name] = call
        self.policies[behavior_name] = policy
        if behavior_name in self.agent_managers:
            self.agent_managers[behavior_name].policy = policy

    def set_agent_manager(self, behavior_name: str, agent_manager: Any) -> None:
        """Feed ``behavior_name``'s steps to an ML-Agents ``AgentManager`` in :meth:`process_steps`."""
        self.agent_managers[behavior_name] = agent_manager

    def on_training_started(self, behavior_name: str, trainer_settings: Any) -> None:
        """Training of a behaviour started (recorded in ``training_started``; worker 0's player
        is told, as ML-Agents does, when the manager came from :meth:`from_run_options`)."""
        self.training_started[behavior_name] = trainer_settings
        if self._analytics and self.run_options is not None:
            self._send_analytics(training_started(self.run_options, behavior_name, trainer_settings))

    @property
    def training_behaviors(self) -> dict[str, Any]:
        """The ``BehaviorSpec`` of every behaviour seen by any worker."""
        return {name: spec for w in sorted(self._specs) for name, spec in self._specs[w].items()}

    @deferred  # (as get_steps)
    def reset(self, config: Mapping[str, Any] | None = None) -> int:
        """Apply ``config`` (environment parameters), reset every env; returns their number. The
        results (their ``environment_stats``: what the players sent on reset) wait in
        ``first_step_infos``, for the agent managers at the next :meth:`get_steps`."""
        self._check_open()
        for agent_manager in self.agent_managers.values():
            call_if_present(agent_manager, "end_episode")
        if config is not None:
            self.set_env_parameters(config)
        self._held = []  # dropped with the steps in flight
        with self._errors():
            infos = self.manager.reset()
        self.first_step_infos = [self._environment_step(info) for info in infos]
        return len(self.first_step_infos)

    @deferred  # (as get_steps)
    def set_env_parameters(self, config: Mapping[str, Any] | None = None) -> None:
        """Send environment parameters (:func:`~envmanager.mlagents.settings.normalize_env_parameters`,
        checked before sending) to every worker, for its player's next message; a restarted
        worker gets all set so far before its reset."""
        self._check_open()
        self._set_everywhere("set_env_parameters", normalize_env_parameters(config), self.env_parameters)

    @deferred  # (as get_steps)
    def set_engine_config(self, config: Any = None, **fields: Any) -> None:
        """Change engine settings (``EngineConfig``, dict or fields such as ``time_scale=20``) on
        every worker; replayed on restarted workers."""
        self._check_open()
        self._set_everywhere("set_engine_config", normalize_engine_config(config, **fields), self._engine_overrides)

    @deferred  # a Ctrl-C waits for a wait of the core's, or for the steps returned (``wire.interrupts``)
    def get_steps(self) -> list[EnvironmentStep]:
        """Step every idle worker with the policies' actions; the steps of at least one finished
        worker (a restarted one's fresh reset with ``interrupted=True``). As in ML-Agents, the
        policies act only on results the trainer was handed: results that came in meanwhile are
        returned first, their workers stepped by the next call."""
        self._check_open()
        if self.first_step_infos:
            self.process_steps(self.first_step_infos)
            self.first_step_infos = []
        self._pull_policies()
        m = self.manager
        with self._errors():
            if any(info.interrupted for info in self._held):  # a settings change's re-reset a Ctrl-C cut short
                self._held = reset_restarted(m, self._held, resend=False)
            self._held += m.receive_steps(min_count=0)  # no wait: what came in already
            waiting = {info.worker_id for info in self._held}
            actions = self._actions_for([w for w in m.idle_worker_ids
                                         if w not in waiting and m.failure_of(w) is None])  # all checked first
            if actions:
                m.send_step(actions)
            if not self._held:
                self._held = m.receive_steps()
                self._held = gather_more(m, self._held, self.gather_window)  # (kept if it raises)
            infos, self._held = self._held, []
        merge_worker_timers([(info.current_result.info or {}).pop("timer_root", None) for info in infos])
        return [self._environment_step(info) for info in infos]

    @deferred  # (each step to every agent manager, or none)
    def process_steps(self, new_step_infos: list[EnvironmentStep]) -> int:
        """Hand steps to the agent managers (``add_experiences``, ``record_environment_stats``)."""
        for step in new_step_infos:
            if step.interrupted and self.agent_managers:
                self._cut_episodes(step.worker_id)
            for name in step.name_behavior_ids:
                agent_manager = self.agent_managers.get(name)
                if agent_manager is None:
                    if self.agent_managers:
                        logger.warning("Agent manager was not created for behavior id %s.", name)
                    continue
                decision_steps, terminal_steps = step.current_all_step_result[name]
                agent_manager.add_experiences(decision_steps, terminal_steps, step.worker_id,
                                              step.brain_name_to_action_info.get(name, ActionInfo.empty()))
                call_if_present(agent_manager, "record_environment_stats", step.environment_stats, step.worker_id)
        return len(new_step_infos)

    @deferred  # (no Ctrl-C between the two)
    def advance(self) -> int:
        """``process_steps(get_steps())`` (ML-Agents' older single call)."""
        return self.process_steps(self.get_steps())

    def close(self) -> None:
        """Close every worker and its player; kill players a killed worker left behind."""
        manager = self._manager
        try:
            if manager is not None:
                manager.close()
                self._manager = None  # only once closed: a close cut short (Ctrl-C) is finished by the next close()
        finally:
            self._players.kill_all()

    # -- extras ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._manager is None

    @property
    def player_pids(self) -> dict[int, int | None]:
        """``worker_id -> pid`` of each worker's current player (``None``: not launched by it)."""
        return self._players.pids

    @property
    def restart_counts(self) -> list[int]:
        """How often each worker was restarted."""
        m = self.manager
        return [m.restart_count(w) for w in m.worker_ids]

    def __enter__(self) -> MLAgentsEnvManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The core's errors as the user knows them: a lost attached player by its address, a taken
        port as :class:`UnityPortInUseError`, and for ML-Agents' trainer (:meth:`from_run_options`)
        a ``UnityEnvironmentException`` too, so they end its run as a player's failure does."""
        with port_errors(self.run_options is not None), lost_players(self.player_addresses):
            yield

    def _check_open(self) -> None:
        if self._manager is None:
            raise ManagerClosedError("the MLAgentsEnvManager is closed")

    def _update_replay_calls(self) -> None:
        calls: list[tuple[str, tuple, dict]] = []
        if self._engine_overrides:
            calls.append(("set_engine_config", (dict(self._engine_overrides),), {}))
        if self.env_parameters:
            calls.append(("set_env_parameters", (dict(self.env_parameters),), {}))
        if self._analytics:  # a restarted worker 0 announces itself again, as ML-Agents' does
            calls.append(("send_analytics", (list(self._analytics),), {}))
        self.manager.set_replay_calls(calls)

    def _set_everywhere(self, method: str, values: dict[str, Any], kept: dict[str, Any]) -> None:
        """``method(values)`` (unless empty; added to ``kept``) on every worker's env, and on every
        restarted one from now on (:mod:`envmanager.mlagents.replay`: a worker restarted before,
        whose fresh reset the trainer has not seen yet, is reset again, so that the first episode
        the trainer sees of it has the new values)."""
        if not values:
            return
        kept.update(values)
        self._update_replay_calls()
        m = self.manager
        with self._errors():
            call_replayed(m, [w for w in m.worker_ids if m.failure_of(w) is None], method, (values,))
            self._held = reset_restarted(m, self._held)

    def _send_analytics(self, payloads: list[bytes]) -> None:
        if payloads and self.manager.failure_of(0) is None:
            with self._errors():  # replayed too: worker 0 announces itself again
                call_replayed(self.manager, [0], "send_analytics", (payloads,))

    # -- the hand-off to ML-Agents' trainer: actions out to the workers, steps in to the agent managers --

    def _pull_policies(self) -> None:
        """Take the newest policy an agent manager published (ML-Agents' ``policy_queue``)."""
        for name, agent_manager in self.agent_managers.items():
            queue = getattr(agent_manager, "policy_queue", None)
            latest = None
            while queue is not None and not queue.empty():
                latest = queue.get_nowait()
            if latest is not None:
                self.set_policy(name, latest)

    def _actions_for(self, worker_ids: list[int]) -> dict[int, SentActions]:
        """Each idle worker's actions from its latest result the trainer was handed
        (:mod:`envmanager.mlagents.acting`; the calls' statistics to the agent managers). Runs
        before anything is sent: a wrong action raises InvalidInputError with no worker stepped."""
        for w in worker_ids:
            if w not in self._last:
                raise InvalidInputError(f"worker {w} must be reset before it is stepped")
        results = {w: self._last[w].current_result.observation for w in worker_ids}
        specs = {w: self._specs.get(w) or self.training_behaviors for w in worker_ids}
        sent, served = choose_actions(results, self.policies, self._batched, specs)
        for name, sizes in served.items():
            for n in sizes:
                self.inference_counts.add(name, n)
            agent_manager = self.agent_managers.get(name)
            if agent_manager is not None:
                call_if_present(agent_manager, "record_environment_stats", inference_stats(sizes), 0)
        return sent

    def _environment_step(self, info: StepInfo) -> EnvironmentStep:
        worker_id = info.worker_id
        result_info = info.current_result.info or {}
        if "behavior_specs" in result_info:
            self._specs[worker_id] = result_info["behavior_specs"]
        if "player_process" in result_info:
            self._players.note(worker_id, result_info["player_process"])  # a reset: the player it reports
        self._last[worker_id] = info
        sent = getattr(info.action, "infos", None) or {}  # the ActionInfos of the request it answers
        action_infos = {} if info.interrupted or info.previous_result is None else sent
        return EnvironmentStep(info.current_result.observation, worker_id, action_infos,
                               result_info.get("environment_stats", {}), info.interrupted)

    def _cut_episodes(self, worker_id: int) -> None:
        """Worker ``worker_id`` was restarted: its agents' unfinished episodes are dropped (the other
        workers' go on), counted here, in the log and in each behaviour's trainer statistics."""
        agents = dropped = 0
        for agent_manager in self.agent_managers.values():
            cut, lost = end_worker_episodes(agent_manager, worker_id)
            if cut < 0:
                logger.warning("worker %d restarted: every unfinished episode dropped (end_episode)", worker_id)
                continue
            call_if_present(agent_manager, "record_environment_stats", cut_stats(cut, lost), worker_id)
            agents, dropped = agents + cut, dropped + lost
        self.cut_agent_episodes += agents
        self.dropped_experiences += dropped
        logger.warning("worker %d restarted: %d agents' unfinished episodes cut, %d of their steps dropped",
                       worker_id, agents, dropped)
