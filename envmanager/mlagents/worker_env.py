"""The worker side of the ML-Agents backend: one ``mlagents_envs`` ``BaseEnv`` as a plain env.

:class:`MLAgentsWorkerEnv` builds the user's environment with the three side channels ML-Agents'
trainer uses and answers the core's ``reset``/``step`` with ``behavior_name -> (DecisionSteps,
TerminalSteps)`` and an info of ``environment_stats``, ``behavior_specs`` (on a reset and when a
behaviour appeared), ``player_process`` (reset) or ``timer_root`` (step); it never reports
``terminated`` (Unity resets its agents itself). A player that crashes, stops or stops answering
is shut down (killed and reaped) before the error travels to the parent, which restarts the worker.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from envmanager.errors import EnvManagerError
from envmanager.mlagents.player_process import PlayerIdentity, kill_orphan_players, player_identity, shutdown_env
from envmanager.mlagents.settings import apply_env_parameter, normalize_engine_config, normalize_env_parameters

__all__ = ["MLAgentsWorkerEnv", "WorkerEnvFactory", "UnityEnvironmentFactory", "UnityPortInUseError"]

#: ``env_factory(worker_id, side_channels) -> BaseEnv``, as in ML-Agents' trainer.
EnvFactory = Callable[[int, list[Any]], Any]


class UnityPortInUseError(EnvManagerError):
    """The gRPC port a ``UnityEnvironment`` needs (``base_port + worker_id``) is taken."""

    def __init__(self, port: int | None, base_port: int | None = None, worker_id: int | None = None, detail: str = "") -> None:
        self.port, self.base_port, self.worker_id, self.detail = port, base_port, worker_id, detail
        if port is None:
            where = f"the port of UnityEnvironment worker_id {worker_id}"
        elif base_port is None:
            where = f"port {port}"
        else:
            where = f"port {port} (base_port {base_port} + worker_id {worker_id})"
        super().__init__(
            f"{where} is in use; pass a different base_port or worker_id offset "
            "(e.g. UnityEnvironmentFactory(base_port=..., worker_id_offset=...)), "
            "or close the environment that holds it"
        )

    def __reduce__(self):
        return (type(self), (self.port, self.base_port, self.worker_id, self.detail))


@dataclass(frozen=True)
class UnityEnvironmentFactory:
    """``(worker_id, side_channels) -> UnityEnvironment``, like ML-Agents' ``create_environment_factory``.

    Worker ``w`` listens on ``base_port + worker_id_offset + w`` and gets seed ``seed + w``.
    ``base_port=None`` is UnityEnvironment's default (5005 with a build, 5004 for the Editor).
    """

    file_name: str | None
    base_port: int | None = None
    worker_id_offset: int = 0
    seed: int = 0
    no_graphics: bool = True
    timeout_wait: int = 60
    additional_args: tuple[str, ...] = ()
    log_folder: str | None = None
    num_areas: int = 1

    def __call__(self, worker_id: int, side_channels: list[Any]) -> Any:
        from mlagents_envs.environment import UnityEnvironment

        areas = {"num_areas": self.num_areas} if self.num_areas != 1 else {}
        port = self.player_port(worker_id)
        if port is not None:  # none left behind for its port by a worker killed while it launched it
            kill_orphan_players([port])
        return UnityEnvironment(
            file_name=self.file_name, worker_id=worker_id + self.worker_id_offset, base_port=self.base_port,
            seed=self.seed + worker_id, no_graphics=self.no_graphics, timeout_wait=self.timeout_wait,
            additional_args=list(self.additional_args), side_channels=list(side_channels),
            log_folder=self.log_folder, **areas,
        )

    def player_port(self, worker_id: int) -> int | None:
        """The port worker ``worker_id``'s player is launched for; ``None`` for the Editor."""
        if self.file_name is None:
            return None
        from mlagents_envs.environment import UnityEnvironment

        base_port = UnityEnvironment.BASE_ENVIRONMENT_PORT if self.base_port is None else self.base_port
        return base_port + self.worker_id_offset + worker_id


def player_ports(env_factory: Any, worker_ids: Iterable[int]) -> tuple[int, ...]:
    """The ports ``env_factory`` launches players for (none unless a :class:`UnityEnvironmentFactory`)."""
    if not isinstance(env_factory, UnityEnvironmentFactory):
        return ()
    return tuple(p for w in worker_ids if (p := env_factory.player_port(w)) is not None)


@dataclass(frozen=True)
class WorkerEnvFactory:
    """The picklable ``factory(worker_id)`` handed to the core: builds a :class:`MLAgentsWorkerEnv`."""

    env_factory: EnvFactory
    engine_config: dict[str, Any] | None = None
    close_timeout: float = 5.0
    training_analytics: bool = False
    log_level: int | None = None  # mlagents_envs' log level in the worker (as ML-Agents' workers set it)

    def __call__(self, worker_id: int) -> MLAgentsWorkerEnv:
        if self.log_level is not None:
            from mlagents_envs import logging_util

            logging_util.set_log_level(self.log_level)
        return MLAgentsWorkerEnv(self.env_factory, worker_id, self.engine_config, self.close_timeout,
                                 self.training_analytics)


class MLAgentsWorkerEnv:
    """A ``BaseEnv`` behind the core's gymnasium-style ``reset``/``step``/``close``.

    ``step(actions)`` takes ``behavior_name -> ActionTuple`` (or anything with ``env_action``) for
    the agents that requested a decision; behaviours left out get ``action_spec.empty_action(n)``.
    """

    observation_space = None  # observations and actions are pickled, not put in shared memory
    action_space = None
    metadata: dict[str, Any] = {}
    render_mode = None
    spec = None

    def __init__(
        self,
        env_factory: EnvFactory,
        worker_id: int,
        engine_config: Mapping[str, Any] | None = None,
        close_timeout: float = 5.0,
        training_analytics: bool = False,
    ) -> None:
        from mlagents_envs.exception import UnityWorkerInUseException
        from mlagents_envs.side_channel import DefaultTrainingAnalyticsSideChannel
        from mlagents_envs.side_channel.engine_configuration_channel import EngineConfigurationChannel
        from mlagents_envs.side_channel.environment_parameters_channel import EnvironmentParametersChannel
        from mlagents_envs.side_channel.raw_bytes_channel import RawBytesChannel
        from mlagents_envs.side_channel.stats_side_channel import StatsSideChannel

        self.worker_id = worker_id
        self.close_timeout = close_timeout
        self.env: Any = None
        self.closed = False
        self.env_parameters_channel = EnvironmentParametersChannel()
        self.engine_configuration_channel = EngineConfigurationChannel()
        self.stats_channel = StatsSideChannel()
        if engine_config:
            self.set_engine_config(dict(engine_config))
        side_channels = [self.env_parameters_channel, self.engine_configuration_channel, self.stats_channel]
        # ML-Agents' trainer talks training analytics to worker 0's player (send_analytics); the
        # others keep the default channel UnityEnvironment adds.
        self.analytics_channel: Any | None = None
        if training_analytics and worker_id == 0:
            self.analytics_channel = RawBytesChannel(DefaultTrainingAnalyticsSideChannel.CHANNEL_ID)
            side_channels.append(self.analytics_channel)
        try:
            self.env = env_factory(worker_id, side_channels)
        except UnityWorkerInUseException as exc:
            raise _port_in_use_error(exc, worker_id) from None
        self.player: PlayerIdentity | None = player_identity(self.env)
        self._last: dict[str, tuple[Any, Any]] = {}
        self._specs_sent: tuple[str, ...] = ()  # the behaviours the parent was last told about

    # -- the core's interface ----------------------------------------------------------------
    def reset(self, seed: Any = None, options: Any = None) -> tuple[dict[str, tuple[Any, Any]], dict[str, Any]]:
        self._check_open()
        with self._closing_on_failure():
            self.env.reset()
            results = self._results()
        return results, {**self._info(reset=True), "player_process": self.player}

    def step(self, actions: Mapping[str, Any] | None) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self._check_open()
        actions = dict(actions or {})
        with self._closing_on_failure():
            specs = self.env.behavior_specs
            for name, action in actions.items():
                action = getattr(action, "env_action", action)
                if action is not None:
                    self.env.set_actions(name, action)
            for name, (decision_steps, _) in self._last.items():
                if name not in actions and len(decision_steps) > 0 and name in specs:
                    self.env.set_actions(name, specs[name].action_spec.empty_action(len(decision_steps)))
            self.env.step()
            results = self._results()
        reward = float(sum(float(d.reward.sum()) + float(t.reward.sum()) for d, t in results.values()))
        return results, reward, False, False, {**self._info(), "timer_root": _take_timers()}

    def close(self) -> None:
        self.closed = True  # (a second close finds no env)
        env, self.env = self.env, None
        if env is not None:
            shutdown_env(env, self.close_timeout)

    # -- reached through the core's call() ---------------------------------------------------
    def behavior_specs(self) -> dict[str, Any]:
        self._check_open()
        return dict(self.env.behavior_specs)

    def set_env_parameters(self, config: Mapping[str, Any] | None = None) -> None:
        """Queue environment parameters; they reach the player with the next reset or step."""
        for key, value in normalize_env_parameters(config).items():
            apply_env_parameter(self.env_parameters_channel, key, value)

    def set_engine_config(self, config: Any = None, **fields: Any) -> None:
        """Queue engine settings (an ``EngineConfig``, a dict or fields); sent with the next message."""
        values = normalize_engine_config(config, **fields)
        if values:
            self.engine_configuration_channel.set_configuration_parameters(**values)

    def send_analytics(self, payloads: list[bytes]) -> bool:
        """Queue training-analytics messages (made in the trainer) for the player, as ML-Agents'
        worker 0 does: only with ``training_analytics`` and if the player reports the capability.
        Returns whether they were queued."""
        self._check_open()
        capabilities = getattr(self.env, "academy_capabilities", None)
        if self.analytics_channel is None or not capabilities or not capabilities.trainingAnalytics:
            return False
        for payload in payloads:
            self.analytics_channel.send_raw_data(bytearray(payload))
        return True

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed or self.env is None:
            raise RuntimeError(f"the environment of worker {self.worker_id} was closed after a failure")

    def _results(self) -> dict[str, tuple[Any, Any]]:
        self._last = {name: self.env.get_steps(name) for name in self.env.behavior_specs}
        return self._last

    def _info(self, reset: bool = False) -> dict[str, Any]:
        """The stats the player sent; the behaviour specs with a reset and when a behaviour
        appeared (a BehaviorSpec never changes under its name: they need not travel every step)."""
        stats = self.stats_channel.get_and_reset_stats()
        info: dict[str, Any] = {"environment_stats": {key: list(values) for key, values in stats.items()}}
        specs = dict(self.env.behavior_specs) if self.env is not None else {}
        if reset or tuple(specs) != self._specs_sent:
            info["behavior_specs"] = specs
            self._specs_sent = tuple(specs)
        return info

    @contextmanager
    def _closing_on_failure(self) -> Iterator[None]:
        """A player that crashed, stopped or timed out leaves the env unusable: shut it down
        (player killed and reaped) before the error goes to the parent."""
        from mlagents_envs import exception as mx

        fatal = (mx.UnityCommunicationException, mx.UnityTimeOutException, mx.UnityEnvironmentException,
                 mx.UnityCommunicatorStoppedException)
        try:
            yield
        except fatal:
            self.close()
            raise


def _take_timers() -> Any:
    """This process's ``mlagents_envs`` timers since the last call, as ML-Agents' workers send them
    with each step for the trainer's ``timers.json``."""
    from mlagents_envs.timers import get_timer_root, reset_timers

    root = get_timer_root()
    reset_timers()
    return root


def _port_in_use_error(exc: BaseException, worker_id: int) -> UnityPortInUseError:
    """Find the port from the frames mlagents raised in (``RpcCommunicator(worker_id, base_port)``)."""
    frames = [frame.f_locals for frame, _ in traceback.walk_tb(exc.__traceback__)]
    found = [(f["base_port"], f["worker_id"]) for f in frames
             if isinstance(f.get("base_port"), int) and isinstance(f.get("worker_id"), int)]
    if not found:
        return UnityPortInUseError(None, None, worker_id, str(exc))
    base_port, unity_worker_id = found[-1]  # the innermost frame's
    return UnityPortInUseError(base_port + unity_worker_id, base_port, unity_worker_id, str(exc))
