"""The worker side of the ML-Agents backend: one ``mlagents_envs`` ``BaseEnv`` as a plain env.

:class:`MLAgentsWorkerEnv` runs inside an envmanager worker process. It creates the three side
channels ML-Agents' trainer uses (environment parameters, engine configuration, stats), builds
the user's environment with ``env_factory(worker_id, side_channels)``, and answers the core's
``reset``/``step`` with ``behavior_name -> (DecisionSteps, TerminalSteps)`` as the observation
and ``{"environment_stats", "behavior_specs"}`` as the info. It never reports ``terminated``:
Unity resets its agents by itself.

If the player crashes, stops or stops answering, the wrapper shuts the ``UnityEnvironment`` down
(player killed and reaped) before the error travels to the parent, which restarts the worker.

The parameter and engine-config checks used by both sides (:func:`normalize_env_parameters`,
:func:`normalize_engine_config`) live here, so the parent can reject bad input before it sends.
"""

from __future__ import annotations

import atexit
import logging
import numbers
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from envmanager.errors import EnvManagerError, InvalidInputError

logger = logging.getLogger(__name__)

__all__ = [
    "MLAgentsWorkerEnv",
    "WorkerEnvFactory",
    "UnityEnvironmentFactory",
    "UnityPortInUseError",
    "normalize_env_parameters",
    "normalize_engine_config",
]

#: ``env_factory(worker_id, side_channels) -> BaseEnv``, as in ML-Agents' trainer.
EnvFactory = Callable[[int, List[Any]], Any]
#: ``(pid, start time)`` of a launched player, to recognise it later without mistaking a reused pid.
PlayerIdentity = Tuple[int, Optional[float]]

ENGINE_FIELDS = {
    "width": int,
    "height": int,
    "quality_level": int,
    "time_scale": float,
    "target_frame_rate": int,
    "capture_frame_rate": int,
}
SAMPLERS = {
    "uniform": ("min_value", "max_value"),
    "gaussian": ("mean", "st_dev"),
    "multirangeuniform": ("intervals",),
    "constant": ("value",),
}


class UnityPortInUseError(EnvManagerError):
    """The gRPC port a ``UnityEnvironment`` needs (``base_port + worker_id``) is taken."""

    def __init__(
        self, port: Optional[int], base_port: Optional[int] = None, worker_id: Optional[int] = None, detail: str = ""
    ) -> None:
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

    file_name: Optional[str]
    base_port: Optional[int] = None
    worker_id_offset: int = 0
    seed: int = 0
    no_graphics: bool = True
    timeout_wait: int = 60
    additional_args: Tuple[str, ...] = ()
    log_folder: Optional[str] = None
    num_areas: int = 1

    def __call__(self, worker_id: int, side_channels: List[Any]) -> Any:
        from mlagents_envs.environment import UnityEnvironment

        kwargs: Dict[str, Any] = dict(
            file_name=self.file_name,
            worker_id=worker_id + self.worker_id_offset,
            base_port=self.base_port,
            seed=self.seed + worker_id,
            no_graphics=self.no_graphics,
            timeout_wait=self.timeout_wait,
            additional_args=list(self.additional_args),
            side_channels=list(side_channels),
            log_folder=self.log_folder,
        )
        if self.num_areas != 1:
            kwargs["num_areas"] = self.num_areas
        return UnityEnvironment(**kwargs)


# ---------------------------------------------------------------------------------------------
# Checks shared by parent and worker


def normalize_env_parameters(config: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Check environment parameters; return them as floats, sampler dicts or ML-Agents settings.

    A value is a number (``set_float_parameter``), an object with ``apply(key, channel)`` (ML-Agents'
    ``ParameterRandomizationSettings``), or a sampler dict in ML-Agents' YAML shape:
    ``{"sampler_type": "uniform", "sampler_parameters": {"min_value": 1, "max_value": 2, "seed": 0}}``
    (``gaussian``: ``mean``, ``st_dev``; ``multirangeuniform``: ``intervals``; ``constant``:
    ``value``; the parameters may also sit next to ``sampler_type``).
    """
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise InvalidInputError(f"environment parameters must be a mapping, got {type(config).__name__}")
    out: Dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not key:
            raise InvalidInputError(f"environment parameter names must be non-empty strings, got {key!r}")
        out[key] = _normalize_value(key, value)
    return out


def _normalize_value(key: str, value: Any) -> Any:
    if isinstance(value, numbers.Real):
        return float(value)
    if callable(getattr(value, "apply", None)):
        return value
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            f"environment parameter {key!r}: expected a number, a sampler dict or a settings object "
            f"with apply(key, channel), got {value!r}"
        )
    kind = str(value.get("sampler_type", "")).lower().replace("_", "").replace("-", "")
    if kind not in SAMPLERS:
        raise InvalidInputError(f"environment parameter {key!r}: unknown sampler_type {value.get('sampler_type')!r}; "
                                f"known: {sorted(SAMPLERS)}")
    params = dict(value.get("sampler_parameters") or {})
    params.update({k: v for k, v in value.items() if k not in ("sampler_type", "sampler_parameters")})
    missing = [name for name in SAMPLERS[kind] if name not in params]
    if missing:
        raise InvalidInputError(f"environment parameter {key!r}: the {kind} sampler needs {missing}")
    try:
        if kind == "constant":
            return float(params["value"])
        seed = int(params.get("seed", 0))
        if kind == "multirangeuniform":
            intervals = [(float(lo), float(hi)) for lo, hi in params["intervals"]]
            return {"sampler_type": kind, "intervals": intervals, "seed": seed}
        a, b = SAMPLERS[kind]
        return {"sampler_type": kind, a: float(params[a]), b: float(params[b]), "seed": seed}
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"environment parameter {key!r}: bad sampler parameters ({exc})") from None


def apply_env_parameter(channel: Any, key: str, value: Any) -> None:
    """Queue one normalized parameter on an ``EnvironmentParametersChannel``."""
    if isinstance(value, float):
        channel.set_float_parameter(key, value)
    elif isinstance(value, dict):
        kind, seed = value["sampler_type"], value["seed"]
        if kind == "uniform":
            channel.set_uniform_sampler_parameters(key, value["min_value"], value["max_value"], seed)
        elif kind == "gaussian":
            channel.set_gaussian_sampler_parameters(key, value["mean"], value["st_dev"], seed)
        else:
            channel.set_multirangeuniform_sampler_parameters(key, value["intervals"], seed)
    else:
        value.apply(key, channel)


def normalize_engine_config(config: Any = None, **fields: Any) -> Dict[str, Any]:
    """Check an engine configuration (an ``EngineConfig``, a dict and/or keyword fields).

    Returns the fields that are set, with their types fixed; ``width`` and ``height`` go together.
    """
    values: Dict[str, Any] = {}
    if config is not None:
        if hasattr(config, "_asdict"):
            values.update(config._asdict())
        elif isinstance(config, Mapping):
            values.update(config)
        else:
            raise InvalidInputError(f"engine config must be an EngineConfig or a dict, got {config!r}")
    values.update(fields)
    unknown = sorted(set(values) - set(ENGINE_FIELDS))
    if unknown:
        raise InvalidInputError(f"unknown engine config fields {unknown}; known: {list(ENGINE_FIELDS)}")
    out: Dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        try:
            out[name] = ENGINE_FIELDS[name](value)
        except (TypeError, ValueError):
            raise InvalidInputError(f"engine config {name}={value!r} is not a {ENGINE_FIELDS[name].__name__}") from None
    if ("width" in out) != ("height" in out):
        raise InvalidInputError("engine config: width and height must be set together")
    return out


# ---------------------------------------------------------------------------------------------
# The wrapper


@dataclass(frozen=True)
class WorkerEnvFactory:
    """The picklable ``factory(worker_id)`` handed to the core: builds a :class:`MLAgentsWorkerEnv`."""

    env_factory: EnvFactory
    engine_config: Optional[Dict[str, Any]] = None
    close_timeout: float = 5.0
    training_analytics: bool = False

    def __call__(self, worker_id: int) -> "MLAgentsWorkerEnv":
        return MLAgentsWorkerEnv(self.env_factory, worker_id, self.engine_config, self.close_timeout,
                                 self.training_analytics)


class MLAgentsWorkerEnv:
    """A ``BaseEnv`` behind the core's gymnasium-style ``reset``/``step``/``close``.

    ``step(actions)`` takes ``behavior_name -> ActionTuple`` (or anything with ``env_action``) for
    the agents that requested a decision; behaviours left out get ``action_spec.empty_action(n)``.
    """

    observation_space = None  # observations and actions are pickled, not put in shared memory
    action_space = None
    metadata: Dict[str, Any] = {}
    render_mode = None
    spec = None

    def __init__(
        self,
        env_factory: EnvFactory,
        worker_id: int,
        engine_config: Optional[Mapping[str, Any]] = None,
        close_timeout: float = 5.0,
        training_analytics: bool = False,
    ) -> None:
        from mlagents_envs.exception import UnityWorkerInUseException
        from mlagents_envs.side_channel import DefaultTrainingAnalyticsSideChannel
        from mlagents_envs.side_channel.raw_bytes_channel import RawBytesChannel
        from mlagents_envs.side_channel.engine_configuration_channel import EngineConfigurationChannel
        from mlagents_envs.side_channel.environment_parameters_channel import EnvironmentParametersChannel
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
        self.analytics_channel: Optional[Any] = None
        if training_analytics and worker_id == 0:
            self.analytics_channel = RawBytesChannel(DefaultTrainingAnalyticsSideChannel.CHANNEL_ID)
            side_channels.append(self.analytics_channel)
        try:
            self.env = env_factory(worker_id, side_channels)
        except UnityWorkerInUseException as exc:
            raise _port_in_use_error(exc, worker_id) from None
        self.player: Optional[PlayerIdentity] = player_identity(self.env)
        self._last: Dict[str, Tuple[Any, Any]] = {}

    # -- the core's interface ----------------------------------------------------------------
    def reset(self, seed: Any = None, options: Any = None) -> Tuple[Dict[str, Tuple[Any, Any]], Dict[str, Any]]:
        self._check_open()
        with self._closing_on_failure():
            self.env.reset()
            results = self._results()
        info = self._info()
        info["player_process"] = self.player
        return results, info

    def step(self, actions: Optional[Mapping[str, Any]]) -> Tuple[Any, float, bool, bool, Dict[str, Any]]:
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
        return results, reward, False, False, self._info()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        env, self.env = self.env, None
        if env is not None:
            shutdown_env(env, self.close_timeout)

    # -- reached through the core's call() ---------------------------------------------------
    def behavior_specs(self) -> Dict[str, Any]:
        self._check_open()
        return dict(self.env.behavior_specs)

    def set_env_parameters(self, config: Optional[Mapping[str, Any]] = None) -> None:
        """Queue environment parameters; they reach the player with the next reset or step."""
        for key, value in normalize_env_parameters(config).items():
            apply_env_parameter(self.env_parameters_channel, key, value)

    def set_engine_config(self, config: Any = None, **fields: Any) -> None:
        """Queue engine settings (an ``EngineConfig``, a dict or fields); sent with the next message."""
        values = normalize_engine_config(config, **fields)
        if values:
            self.engine_configuration_channel.set_configuration_parameters(**values)

    def send_analytics(self, payloads: List[bytes]) -> bool:
        """Queue training-analytics messages (made by ML-Agents' ``TrainingAnalyticsSideChannel``
        in the trainer) for the player, as ML-Agents' worker 0 does: only on the env built with
        ``training_analytics`` and only if the player reports the capability. Returns whether
        they were queued."""
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

    def _results(self) -> Dict[str, Tuple[Any, Any]]:
        env = self.env
        self._last = {name: env.get_steps(name) for name in env.behavior_specs}
        return self._last

    def _info(self) -> Dict[str, Any]:
        stats = self.stats_channel.get_and_reset_stats()
        return {
            "environment_stats": {key: list(values) for key, values in stats.items()},
            "behavior_specs": dict(self.env.behavior_specs) if self.env is not None else {},
        }

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


# ---------------------------------------------------------------------------------------------
# Player processes


def shutdown_env(env: Any, timeout: float = 5.0) -> None:
    """Close ``env``; for a ``UnityEnvironment`` also reap its player and release gRPC and pipes.

    ``UnityEnvironment.close()`` kills a player that does not quit within ``timeout_wait`` but
    never reaps it, leaves one end of its communicator's pipe open and does not wait for the gRPC
    server to stop; this does all three, with ``timeout`` in place of ``timeout_wait``.
    """
    try:
        from mlagents_envs.environment import UnityEnvironment
    except ImportError:  # pragma: no cover - the subpackage needs mlagents_envs anyway
        UnityEnvironment = None
    if UnityEnvironment is None or not isinstance(env, UnityEnvironment):
        env.close()
        return
    proc: Optional[subprocess.Popen] = getattr(env, "_process", None)
    comm = getattr(env, "_communicator", None)
    try:
        env._close(timeout=timeout)  # status 400 to the player, wait, kill
    except Exception:
        logger.warning("closing the UnityEnvironment failed", exc_info=True)
    finally:
        try:
            atexit.unregister(env._close)
        except Exception:
            pass
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                logger.warning("player process %d did not exit after SIGKILL", proc.pid)
        _release_communicator(comm)


def _release_communicator(comm: Any) -> None:
    server = getattr(comm, "server", None)
    if server is not None:
        try:
            server.stop(None).wait(5.0)
        except Exception:
            pass
    servicer = getattr(comm, "unity_to_external", None)
    for name in ("parent_conn", "child_conn"):
        conn = getattr(servicer, name, None)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass


def process_start_time(pid: int) -> Optional[float]:
    """When process ``pid`` started (an opaque number), or ``None`` if it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return float(fields[19])  # field 22, starttime in clock ticks
    except (OSError, IndexError, ValueError):
        pass
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:
        return None


def player_identity(env: Any) -> Optional[PlayerIdentity]:
    proc = getattr(env, "_process", None)
    pid = getattr(proc, "pid", None)
    if not isinstance(pid, int):
        return None
    return (pid, process_start_time(pid))


def kill_stale_player(identity: Optional[PlayerIdentity]) -> bool:
    """SIGKILL a player left behind by a killed worker, if it still runs (same pid *and* start)."""
    if not identity or identity[1] is None:
        return False
    pid, started = identity
    if process_start_time(pid) != started:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _port_in_use_error(exc: BaseException, worker_id: int) -> UnityPortInUseError:
    """Find the port from the frames mlagents raised in (``RpcCommunicator(worker_id, base_port)``)."""
    tb = exc.__traceback__
    found: Optional[Tuple[int, int]] = None
    while tb is not None:
        local = tb.tb_frame.f_locals
        if isinstance(local.get("base_port"), int) and isinstance(local.get("worker_id"), int):
            found = (local["base_port"], local["worker_id"])
        tb = tb.tb_next
    if found is None:
        return UnityPortInUseError(None, None, worker_id, str(exc))
    base_port, unity_worker_id = found
    return UnityPortInUseError(base_port + unity_worker_id, base_port, unity_worker_id, str(exc))
