"""A fake Unity player: speaks the real ML-Agents gRPC protocol (communication API 1.5.0).

``mlagents_envs.environment.UnityEnvironment(file_name=...)`` can launch it as if it were a
Unity build; it connects, as a gRPC *client*, to the server UnityEnvironment starts, and runs
the small learnable task of :mod:`envmanager.testing.fake_unity_task`.

Run as ``envmanager-fake-unity``, ``python -m envmanager.testing.fake_unity`` or
``python path/to/fake_unity.py`` (no ``envmanager`` import; :func:`write_launcher` does this)::

    envmanager-fake-unity --mlagents-port 5005 [--config cfg.json] [flags...]

Unity's own arguments (``-logFile PATH``, ``-nographics``, ``-batchmode``, anything unknown)
are accepted; ``-logFile`` receives the player log. Settings come from, in increasing
priority: defaults, the JSON file named by ``$ENVMANAGER_FAKE_UNITY_CONFIG``, ``--config``
(if both are given only ``--config`` is used), then the flags. Behaviour flags (``--agents``,
``--discrete``...) apply to every configured behaviour.

Protocol (mirrors Unity's RpcCommunicator): ``Exchange(init output + first rl_output)`` returns
the ``rl_initialization_input``; a second, empty ``Exchange`` returns the first real input; then
every reply is answered with the next output. Header status 400 (Python's ``close()``) and the
``QUIT`` command end the player with exit code 0, as does a failed RPC with the trainer gone
(UNAVAILABLE, CANCELLED, or UNKNOWN: mlagents' server raising on its closed pipe; other RPC
errors: exit 1); if the parent process disappears the player exits (code 3). It
never lingers. With ``--sessions N`` (0: any number) it outlives its trainer, as a game server a
trainer attaches to (``envmanager-learn --env-addresses``): after a session ends (status 400, or
the trainer gone) it connects again and waits up to ``--connect-timeout`` for the next trainer.
Crashes on purpose (``crash_after_steps``): ``exit`` -> ``os._exit(code)``,
``raise`` -> uncaught exception (exit 1), ``kill`` -> SIGKILL (-9), ``hang`` -> stop answering.

Stats sent back each step on the StatsSideChannel (key, aggregation):
``Fake/Reward`` (AVERAGE, mean reward of that step over all agents), ``Fake/EpisodeReturn``
(AVERAGE, one per finished episode), ``Fake/Step`` (MOST_RECENT, STEP commands so far),
``Fake/MaskViolations`` (SUM, only with masks); once, on the first output after the handshake:
``Fake/Pid``, ``Fake/Seed``, ``Fake/NumAreas``; on the output that follows their arrival:
``Fake/EnvParam/<key>`` (the float, or the sampled value for samplers) and ``Fake/Engine/<field>``
(width, height, quality_level, time_scale, target_frame_rate, capture_frame_rate).
Environment parameters ``episode_length``, ``step_latency`` and ``reward_scale`` also change the
simulation (from the next reset / step). A client without a StatsSideChannel logs a warning per
message ("Unknown side channel data"); pass one, or turn stats off (``--no-stats``).
"""
from __future__ import annotations

import errno
import json
import os
import random
import shlex
import signal
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

if __package__:
    from envmanager.testing import fake_unity_task as _task
    from envmanager.testing.fake_unity_args import CONFIG_ENV_VAR, build_parser, parse_args
else:  # run as a file (what write_launcher does): skip importing the envmanager package
    import fake_unity_task as _task  # type: ignore[no-redef,import-not-found]  # the files next to this one
    from fake_unity_args import CONFIG_ENV_VAR, build_parser, parse_args  # type: ignore[no-redef,import-not-found]

    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # our directory must not shadow anything imported later

__all__ = ["CONFIG_ENV_VAR", "FakePlayer", "build_parser", "free_base_port", "main", "parse_args", "write_launcher"]

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no gRPC core chatter on the player's stderr
# The protocol comes with the mlagents extra. Without it this module still imports (--help,
# write_launcher, free_base_port work); a player refuses to start, naming the extra.
_PROTOCOL_MISSING: ImportError | None = None
try:
    import grpc
    from mlagents_envs.communicator_objects.agent_info_pb2 import AgentInfoProto
    from mlagents_envs.communicator_objects.brain_parameters_pb2 import BrainParametersProto
    from mlagents_envs.communicator_objects.capabilities_pb2 import UnityRLCapabilitiesProto
    from mlagents_envs.communicator_objects.command_pb2 import QUIT, RESET, STEP
    from mlagents_envs.communicator_objects.observation_pb2 import ObservationProto
    from mlagents_envs.communicator_objects.unity_message_pb2 import UnityMessageProto
    from mlagents_envs.communicator_objects.unity_output_pb2 import UnityOutputProto
    from mlagents_envs.communicator_objects.unity_to_external_pb2_grpc import UnityToExternalProtoStub

    COMMANDS = {STEP: "STEP", RESET: "RESET", QUIT: "QUIT"}
except ImportError as e:
    _PROTOCOL_MISSING = e

class PlayerExit(Exception):
    def __init__(self, reason: str, code: int = 0) -> None:
        super().__init__(reason)
        self.reason, self.code = reason, code


def _require_protocol() -> None:
    """Raises why no player can run here (gRPC or mlagents_envs missing), naming the extra."""
    if _PROTOCOL_MISSING is None:
        return
    if __package__:
        from envmanager.extras import missing_extra

        raise missing_extra(_PROTOCOL_MISSING, "mlagents", "the fake Unity player") from _PROTOCOL_MISSING
    raise _PROTOCOL_MISSING


class FakePlayer:
    def __init__(self, cfg: _task.FakeConfig, facts: dict[str, Any]) -> None:
        _require_protocol()
        self.cfg, self.facts = cfg, facts
        self.port: int = facts["port"]
        self.rng = random.Random(cfg.seed or 0)
        self.jitter_rng = random.Random((cfg.seed or 0) + 1)
        self.sims: list[_task.BehaviorSim] = []
        first = 0
        for b in cfg.behaviors:
            self.sims.append(_task.BehaviorSim(b, first, self.rng))
            first += b.agents
        self.steps = 0
        self.inputs = 0
        self.env_params: dict[str, float] = {}
        self.engine: dict[str, float] = {}
        self.echo = {uuid.UUID(c) for c in cfg.echo_channels}
        self.pending_stats: list[tuple[str, float, int]] = []
        self.pending_echo: list[tuple[uuid.UUID, bytes]] = []
        self.log_stream: TextIO | None = None
        self.record_stream: TextIO | None = None
        self.channel: grpc.Channel | None = None
        self.seed = cfg.seed or 0
        self.num_areas = 1

    # ------------------------------------------------------------- plumbing
    def log(self, text: str) -> None:
        line = f"[fake-unity pid={os.getpid()} port={self.port}] {text}\n"
        for stream in (self.log_stream, sys.stderr if self.facts.get("verbose") else None):
            if stream is not None:
                stream.write(line)
                stream.flush()

    def record(self, event: str, **data: Any) -> None:
        if self.record_stream is not None:
            data = {"event": event, "pid": os.getpid(), "time": time.time(), **data}
            self.record_stream.write(json.dumps(data) + "\n")
            self.record_stream.flush()

    def _open_streams(self) -> None:
        log_file = self.facts.get("log_file")
        if log_file == "-":
            self.log_stream = sys.stdout
        elif log_file:
            os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
            self.log_stream = open(log_file, "a", encoding="utf-8")  # noqa: SIM115 (open for the player's life, closed at exit)
        if self.cfg.record:
            self.record_stream = open(self.cfg.record, "a", encoding="utf-8")  # noqa: SIM115 (as the log)

    def _start_watchdog(self) -> None:
        parent = os.getppid()

        def watch() -> None:
            while True:
                time.sleep(0.25)
                if os.getppid() != parent:
                    self.record("exit", reason="parent_died", code=3)
                    os._exit(3)

        threading.Thread(target=watch, name="fake-unity-watchdog", daemon=True).start()

    def exchange(self, stub: UnityToExternalProtoStub, msg: UnityMessageProto) -> UnityMessageProto:
        try:
            return stub.Exchange(msg, timeout=self.cfg.exchange_timeout)
        except grpc.RpcError as e:  # the trainer went away: a normal way to end
            # UNAVAILABLE / CANCELLED: its server stopped; UNKNOWN: mlagents' servicer raised
            # because the trainer had closed its pipe (an Exchange that arrived while it closed)
            code = e.code() if hasattr(e, "code") else None
            normal = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
            if not normal:  # e.g. RESOURCE_EXHAUSTED (message over gRPC's 4 MB) or DEADLINE_EXCEEDED
                self.log(f"Exchange failed: {e!r}")
            raise PlayerExit(f"connection_lost:{getattr(code, 'name', code)}", 0 if normal else 1) from None

    # ------------------------------------------------------------- messages
    def _info_proto(self, sim: _task.BehaviorSim, info: _task.Info) -> AgentInfoProto:
        proto = AgentInfoProto(reward=info.reward, done=info.done, max_step_reached=info.max_step_reached,
                               id=info.agent_id, group_id=info.group_id, group_reward=info.group_reward)
        for i, (shape, data) in enumerate(zip(sim.cfg.observation_shapes or [], info.observations, strict=True)):
            obs = ObservationProto(shape=shape, name=f"FakeObservation{i}")
            obs.float_data.data.extend(data)
            proto.observations.append(obs)
        if info.action_mask is not None:
            proto.action_mask.extend(info.action_mask)
        return proto

    def _output(self, infos: dict[str, list[_task.Info]], init: bool = False) -> UnityMessageProto:
        msg = UnityMessageProto()
        msg.header.status = 200
        out: UnityOutputProto = msg.unity_output
        if init:
            init_out = out.rl_initialization_output
            init_out.name = self.cfg.name
            init_out.communication_version = self.cfg.communication_version
            init_out.package_version = self.cfg.package_version
            init_out.log_path = self.facts.get("log_file") or ""
            init_out.capabilities.CopyFrom(UnityRLCapabilitiesProto(
                baseRLCapabilities=True, concatenatedPngObservations=True, compressedChannelMapping=True,
                hybridActions=True, trainingAnalytics=True, variableLengthObservation=True,
                multiAgentGroups=True))
            for sim in self.sims:
                bp = BrainParametersProto(brain_name=sim.cfg.name, is_training=True)
                bp.action_spec.num_continuous_actions = sim.cfg.continuous
                bp.action_spec.num_discrete_actions = len(sim.cfg.discrete)
                bp.action_spec.discrete_branch_sizes.extend(sim.cfg.discrete)
                init_out.brain_parameters.append(bp)
        for sim in self.sims:
            if sim.cfg.name in infos:
                out.rl_output.agentInfos[sim.cfg.name].value.extend(
                    self._info_proto(sim, info) for info in infos[sim.cfg.name])
        if not init:
            messages = [_task.stat_message(*s) for s in self.pending_stats] if self.cfg.stats else []
            out.rl_output.side_channel = _task.pack_side_channel(messages + self.pending_echo)
            self.pending_stats, self.pending_echo = [], []
        return msg

    def stat(self, key: str, value: float, aggregation: int = _task.MOST_RECENT) -> None:
        self.pending_stats.append((key, float(value), aggregation))

    # ------------------------------------------------------------- input handling
    def _side_channels(self, data: bytes) -> dict[str, Any]:
        seen: dict[str, Any] = {"env_params": {}, "engine": {}, "other": []}
        for cid, payload in _task.split_side_channel(data):
            try:
                if cid == _task.ENV_PARAMS_CHANNEL:
                    key, value, desc = _task.decode_env_param(payload, self.rng)
                    self.env_params[key] = value
                    seen["env_params"][key] = {**desc, "sampled": value}
                    self.stat(f"Fake/EnvParam/{key}", value)
                elif cid == _task.ENGINE_CHANNEL:
                    for key, value in _task.decode_engine(payload).items():
                        self.engine[key] = value
                        seen["engine"][key] = value
                        self.stat(f"Fake/Engine/{key}", value)
                else:
                    seen["other"].append({"channel": str(cid), "bytes": len(payload)})
                    if cid in self.echo:
                        self.pending_echo.append((cid, payload))
            except Exception as e:  # a malformed message must not kill the player
                self.log(f"bad side-channel message on {cid}: {e!r}")
        override = self.env_params.get("episode_length")
        for sim in self.sims:
            sim.episode_length_override = None if override is None else int(override)
        return seen

    def _actions(self, rl_in: Any) -> dict[str, list[tuple[list[float], list[int]]]]:
        out = {}
        for name, lst in rl_in.agent_actions.items():
            out[name] = [(list(a.continuous_actions), list(a.discrete_actions)) for a in lst.value]
        return out

    def _crash(self) -> None:
        mode, code = self.cfg.crash_mode, self.cfg.crash_exit_code
        self.log(f"crashing on purpose after {self.steps} steps (mode {mode})")
        self.record("exit", reason=f"crash:{mode}", code={"raise": 1, "kill": -9}.get(mode, code))
        if mode == "exit":
            os._exit(code)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise":
            raise RuntimeError(f"fake Unity player crashed on purpose after {self.steps} steps")
        while True:  # hang: stop answering; the watchdog still ends us if the parent goes
            time.sleep(0.5)

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def handle(self, msg: UnityMessageProto) -> UnityMessageProto:
        if msg.header.status != 200:
            raise PlayerExit(f"status_{msg.header.status}", 0)
        rl_in = msg.unity_input.rl_input
        self.inputs += 1
        command = COMMANDS.get(rl_in.command, str(rl_in.command))
        seen = self._side_channels(rl_in.side_channel)
        actions = self._actions(rl_in)
        self.record("input", n=self.inputs, command=command, side_channel_bytes=len(rl_in.side_channel),
                    actions={k: {"agents": len(v), "continuous": [c for c, _ in v],
                                 "discrete": [d for _, d in v]} for k, v in actions.items()}, **seen)
        if rl_in.command == QUIT:
            raise PlayerExit("quit", 0)
        if self.inputs == 1:
            self.stat("Fake/Pid", os.getpid())
            self.stat("Fake/Seed", self.seed)
            self.stat("Fake/NumAreas", self.num_areas)
        infos: dict[str, list[_task.Info]] = {}
        if rl_in.command == RESET:
            self._sleep(self.cfg.reset_latency)
            for sim in self.sims:
                infos[sim.cfg.name] = sim.reset()
            return self._output(infos)
        if self.cfg.crash_after_steps is not None and self.steps >= self.cfg.crash_after_steps:
            self._crash()
        self.steps += 1
        latency = self.env_params.get("step_latency", self.cfg.step_latency)
        self._sleep(latency + (self.jitter_rng.uniform(0, self.cfg.latency_jitter) if self.cfg.latency_jitter else 0))
        scale = self.env_params.get("reward_scale", 1.0)
        rewards, returns, violations = [], [], 0
        for sim in self.sims:
            infos[sim.cfg.name], st = sim.step(actions.get(sim.cfg.name, []), self.steps, scale)
            rewards += st["rewards"]
            returns += st["returns"]
            violations += st["mask_violations"]
        self.stat("Fake/Step", self.steps)
        if rewards:
            self.stat("Fake/Reward", sum(rewards) / len(rewards), _task.AVERAGE)
        for r in returns:
            self.stat("Fake/EpisodeReturn", r, _task.AVERAGE)
        if any(sim.mask is not None for sim in self.sims):
            self.stat("Fake/MaskViolations", violations, _task.SUM)
        return self._output(infos)

    # ------------------------------------------------------------- main loop
    def run(self) -> int:
        self._open_streams()
        self.record("start", port=self.port, argv=sys.argv, **{k: v for k, v in self.facts.items() if k != "port"})
        if self.cfg.crash_on_start:
            self.record("exit", reason="crash_on_start", code=self.cfg.crash_exit_code)
            return self.cfg.crash_exit_code
        if self.cfg.parent_watchdog:
            self._start_watchdog()
        sessions = self.facts.get("sessions", 1)
        done = 0
        while True:
            code, reason, handshake = self.session()
            done += handshake
            self.record("session_end", reason=reason, code=code, handshake=handshake)
            # a player that outlives its trainer (--sessions) waits for the next one after a normal
            # end, and tries again when it reached a trainer's server that was going away
            gone_early = not handshake and reason.startswith("connection_lost")
            if sessions == 1 or (code != 0 and not gone_early) or reason == "quit" or (sessions and done >= sessions):
                break
            self.log(f"session ended ({reason}); waiting for the next trainer")
        self.log(f"exiting: {reason}")
        self.record("exit", reason=reason, code=code)
        return code

    def _connect(self) -> grpc.Channel | None:
        """A channel to the trainer once it listens, or ``None`` after ``connect_timeout``.

        A fresh channel (with subchannels of its own) every second: one that saw the previous
        trainer's server go can stay stuck for longer than that, and gRPC's backoff grows to 2 min."""
        timeout = self.cfg.connect_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
        while True:
            channel = grpc.insecure_channel(f"localhost:{self.port}", options=options)
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                grpc.channel_ready_future(channel).result(timeout=wait)
                return channel
            except grpc.FutureTimeoutError:
                channel.close()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def session(self) -> tuple[int, str, bool]:
        """Connect, then play until the trainer ends it: ``(exit code, reason, handshake done)``."""
        channel = self._connect()
        if channel is None:
            self.log(f"could not connect to localhost:{self.port}")
            return 1, "connect_timeout", False
        self.channel = channel
        stub = UnityToExternalProtoStub(self.channel)
        self.inputs = 0
        handshake = False
        try:
            initial = {sim.cfg.name: sim.reset() for sim in self.sims}
            reply = self.exchange(stub, self._output(initial, init=True))
            if reply.header.status != 200:
                raise PlayerExit(f"status_{reply.header.status}", 0)
            handshake = True
            init_in = reply.unity_input.rl_initialization_input
            self.seed = self.cfg.seed if self.cfg.seed is not None else init_in.seed
            self.num_areas = init_in.num_areas
            self.rng.seed(self.seed)
            self.jitter_rng.seed(self.seed + 1)
            self.record("init_input", seed=init_in.seed, communication_version=init_in.communication_version,
                        package_version=init_in.package_version, num_areas=init_in.num_areas)
            self.log(f"connected; python package {init_in.package_version}, API {init_in.communication_version}")
            empty = UnityMessageProto()
            empty.header.status = 200
            msg = self.exchange(stub, empty)
            while True:
                msg = self.exchange(stub, self.handle(msg))
        except PlayerExit as e:
            return e.code, e.reason, handshake
        finally:
            self.channel.close()


# ---------------------------------------------------------------- helpers for launching it

_STRIPPED = (".app", ".exe", ".x86_64", ".x86")  # UnityEnvironment strips these anywhere in file_name


def write_launcher(directory: os.PathLike[str] | str, config: dict[str, Any] | None = None,
                   name: str = "fakeplayer", extra_args: Sequence[str] = (),
                   python: str | None = None) -> str:
    """Write an executable ``directory/name`` that UnityEnvironment(file_name=...) can launch.

    It ``exec``s ``python <this file> [--config name.json] extra_args "$@"`` (running the file
    does not import the ``envmanager`` package; ``exec`` keeps the launched pid = the player's).
    The config, if given, is written next to it as ``name.json``. Returns the script path.
    """
    script = os.path.join(os.path.abspath(os.fspath(directory)), name)
    if any(s in script for s in _STRIPPED):
        raise ValueError(f"{script}: UnityEnvironment would strip {_STRIPPED} from this path")
    os.makedirs(os.path.dirname(script), exist_ok=True)
    args: list[str] = []
    if config is not None:
        with open(script + ".json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)
        args += ["--config", script + ".json"]
    command = [python or sys.executable, os.path.abspath(__file__), *args, *extra_args]
    with open(script, "w", encoding="utf-8") as f:
        f.write("#!/bin/sh\nexec " + " ".join(shlex.quote(c) for c in command) + ' "$@"\n')
    os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def _port_free(port: int) -> bool:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6
            continue
        try:
            s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue
            return False
        finally:
            s.close()
    return True


def free_base_port(n: int = 1, low: int = 20000, high: int = 30000) -> int:
    """A random base port whose ``n`` consecutive ports are free now (below the ephemeral range).

    Pass it as ``base_port``; UnityEnvironment listens on ``base_port + worker_id``. Racy by
    nature: retry on ``UnityWorkerInUseException``.
    """
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(low, high - n)
        if all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} free consecutive ports in [{low}, {high})")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg, facts = parse_args(argv)
    except (ValueError, OSError) as e:
        print(f"envmanager-fake-unity: bad configuration: {e}", file=sys.stderr)
        return 2
    try:
        player = FakePlayer(cfg, facts)
    except ImportError as e:
        print(f"envmanager-fake-unity: {e}", file=sys.stderr)
        return 2
    try:
        return player.run()
    finally:
        for stream in (player.log_stream, player.record_stream):
            if stream is not None and stream is not sys.stdout:
                stream.close()


if __name__ == "__main__":
    sys.exit(main())
