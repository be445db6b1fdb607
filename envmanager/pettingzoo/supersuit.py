"""A drop-in for SuperSuit's vector wrappers, on :class:`ParallelVectorEnv`.

PettingZoo's SB3 tutorials and CleanRL's multi-agent PPO turn a PettingZoo ``ParallelEnv`` into
a vector env with one row per agent::

    # import supersuit as ss; ss.pettingzoo_env_to_vec_env_v1, ss.concat_vec_envs_v1
    from envmanager.pettingzoo import concat_vec_envs_v1, pettingzoo_env_to_vec_env_v1

    env = pettingzoo_env_to_vec_env_v1(pistonball_v6.parallel_env())
    env = concat_vec_envs_v1(env, 8, num_cpus=2, base_class="stable_baselines3")

Same signatures and results as SuperSuit 3.11 (``MarkovVectorEnv`` + ``ConcatVecEnv`` /
``ProcConcatVec`` + ``SB3VecEnvWrapper``): rows env-major, each env's agents contiguous in
``possible_agents`` order; an env whose agents are all done is reset within the step, its
agents' last observations in ``info["terminal_observation"]`` and the reset's infos merged into
the step's; ``reset(seed)`` seeds env ``i`` with ``seed + i``; ``observation_space`` /
``action_space`` are one agent's. What differs (``docs/guide/pettingzoo.md``): the envs always
run in worker processes (``num_cpus`` processes, at least one), agents that die need no
``black_death`` (their rows are zeros, ``active`` says which rows are real), reset infos are
kept (``reset_infos`` on the SB3 side), ``seed()`` works, and errors name the env.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import gymnasium
import numpy as np

from envmanager.core.arguments import is_count, positive_count
from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError, remote_attribute_errors
from envmanager.extras import requires_extra
from envmanager.pettingzoo.batch import MultiAgentBatch
from envmanager.pettingzoo.layout import MASK_KEY
from envmanager.pettingzoo.vector import ParallelVectorEnv
from envmanager.wire.interrupts import DEFERRED, begin, end

with requires_extra("pettingzoo", __name__):
    from pettingzoo.utils.env import ParallelEnv

logger = logging.getLogger(__name__)

__all__ = ["PettingZooVecEnv", "UnsupportedEnvError", "concat_vec_envs", "concat_vec_envs_v1",
           "pettingzoo_env_to_vec_env", "pettingzoo_env_to_vec_env_v1"]

BASE_CLASSES = ("gymnasium", "stable_baselines3")


class UnsupportedEnvError(InvalidInputError, AssertionError):
    """An env that SuperSuit's wrappers refuse with an ``assert`` (not a ``ParallelEnv``, no
    ``possible_agents``, agents with different spaces): an :class:`~envmanager.InvalidInputError`
    and an ``AssertionError``, so code written against SuperSuit still catches it."""


class _EnvCopy:
    """A fresh copy of a PettingZoo env, as SuperSuit makes one per vector env (cloudpickled)."""

    def __init__(self, env: Any) -> None:
        self.pickled = cloudpickle.dumps(env)

    def __call__(self) -> Any:
        return cloudpickle.loads(self.pickled)


class PettingZooVecEnv(gymnasium.vector.VectorEnv):
    """SuperSuit's ``ConcatVecEnv`` / ``ProcConcatVec`` (``base_class="gymnasium"``): copies of
    one PettingZoo ``ParallelEnv`` in worker processes, one row per agent slot.

    ``reset(seed, options)`` returns ``(observations, infos)``, ``infos`` a list with one dict
    per row; ``step(actions)`` ``(observations, rewards, terminations, truncations, infos)``
    (``float32`` rewards, ``bool`` flags). An env whose agents are all done is reset in the same
    step: its present agents' last observations are in ``infos[row]["terminal_observation"]``,
    the observations are the reset's, and the reset's infos are merged in. Rows of agents that
    are not in the env (dead, not yet there) are zeros, reward 0, not done: ``active`` (one bool
    per row) tells the rows whose agent is in the env and acts next; actions of the others are
    not read; ``reset_infos`` keeps each row's latest reset infos. Made by
    :func:`concat_vec_envs` (or :func:`pettingzoo_env_to_vec_env`: one env, started at its
    first ``reset``).

    With ``restart_workers=True`` an env whose process was restarted comes back as a reset, its
    rows ``truncated`` (the episode was cut short; it has no terminal observation).

    A step cut short by a Ctrl-C the program catches stays pending (as SB3's ``step_async`` /
    ``step_wait`` leave it): ``step_wait()`` returns its results, none lost; ``step()`` or
    ``step_async()`` meanwhile raises ``InvalidInputError``, and ``reset()`` drops it.
    """

    def __init__(self, env: Any, num_vec_envs: int, num_cpus: int = 0, **kwargs: Any) -> None:
        self._vector: ParallelVectorEnv | None = None
        self.par_env = env
        positive_count("num_vec_envs", num_vec_envs)
        if not is_count(num_cpus):
            raise InvalidInputError(f"num_cpus must be an int >= 0, got {num_cpus!r}")
        if "envs_per_worker" in kwargs:
            raise InvalidInputError("envs_per_worker is num_cpus's split here, as in SuperSuit: pass num_cpus")
        agents = list(env.possible_agents)
        self.possible_agents = tuple(agents)
        self.observation_space = env.observation_space(agents[0])
        self.action_space = env.action_space(agents[0])
        for agent in agents:
            if env.observation_space(agent) != self.observation_space or env.action_space(agent) != self.action_space:
                raise UnsupportedEnvError(
                    f"agent {agent!r} has other spaces than {agents[0]!r} ({env.observation_space(agent)}, "
                    f"{env.action_space(agent)} against {self.observation_space}, {self.action_space}): one row per "
                    "agent needs one space for all (pad them, as SuperSuit's pad_observations_v0 / "
                    "pad_action_space_v0 do, or use ParallelVectorEnv, which groups agents by space)")
        # An action mask of Discrete actions the env puts in its observations (``MASK_KEY``): the
        # rows carry it too (the workers hand it out apart from the rest of the observation).
        spaces: dict[str, Any] = getattr(self.observation_space, "spaces", None) or {}
        masked = isinstance(spaces, dict) and isinstance(self.action_space, gymnasium.spaces.Discrete)
        self._mask_space = spaces.get(MASK_KEY) if masked else None
        self._observation_keys = tuple(spaces) if self._mask_space is not None else ()  # (in the space's order)
        self.metadata = dict(getattr(env, "metadata", None) or {})
        self.render_mode = getattr(env.unwrapped, "render_mode", None)
        self.num_agents = len(agents)
        self.num_vec_envs = int(num_vec_envs)
        self.num_envs = self.num_vec_envs * self.num_agents
        cpus = max(1, min(int(num_cpus), self.num_vec_envs))
        #: Envs per process: SuperSuit's split (``ceil(num_vec_envs / num_cpus)``, the last process the rest).
        self.envs_per_worker = math.ceil(self.num_vec_envs / cpus)
        self._kwargs = kwargs
        self._copy = _EnvCopy(env)
        #: Per row: its agent is in the env and acts next (False: a padded row, its action not read).
        self.active = np.zeros(self.num_envs, np.bool_)
        #: Per row: the infos of its env's latest reset (by ``reset()`` or within a step).
        self.reset_infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        self._actions: Any = None
        self._pending: _Step | None = None  # a step a Ctrl-C cut short, where it was
        self._closed = False

    # ------------------------------------------------------------------------------------------

    @property
    def vector(self) -> ParallelVectorEnv:
        """The :class:`ParallelVectorEnv` underneath (its processes started on first use)."""
        if self._closed:
            raise ManagerClosedError("the vector env is closed")
        if self._vector is None:
            self._vector = ParallelVectorEnv([self._copy] * self.num_vec_envs, envs_per_worker=self.envs_per_worker,
                                             agent_groups={"agents": list(self.possible_agents)}, **self._kwargs)
        return self._vector

    def reset(  # type: ignore[override]  # SuperSuit's: infos are a list, one dict per row
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, list[dict]]:
        """Reset every env (env ``i`` with ``seed + i``); returns the observations and one info per row."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise InvalidInputError(f"seed must be an int or None, got {seed!r:.80}")
        vector = self.vector
        with DEFERRED:  # a Ctrl-C waits until what this keeps agrees with the vector (``interrupts``)
            self._pending = None  # (dropped with what is in flight)
            batch = vector.reset(seed=seed, options=options)
            self.active = batch.active.copy()
            self.reset_infos = self._row_infos(batch)
            return self._observations(batch), [dict(info) for info in self.reset_infos]

    def step_async(self, actions: Any) -> None:
        self._refuse_pending("step_async")
        self._actions = actions

    def step_wait(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict]]:
        if self._pending is not None:  # the step a Ctrl-C cut short
            return self._go_on(self.vector)
        actions, self._actions = self._actions, None
        if actions is None:
            raise InvalidInputError("step_wait() without step_async(actions)")
        return self.step(actions)

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict]]:  # type: ignore[override]
        vector = self.vector
        self._refuse_pending("step")
        actions = np.asarray(actions)
        if actions.shape[:1] != (self.num_envs,):
            raise InvalidInputError(f"actions must have one row per agent row ({self.num_envs}: {self.num_vec_envs} "
                                    f"envs x {self.num_agents} agents), got shape {actions.shape}")
        try:
            begin()  # sent and noted together (a Ctrl-C waits, ``interrupts``)
            self._guarded(vector, vector.send, actions)
            self._pending = _Step(actions)
        finally:
            end()
        return self._go_on(vector)

    def _refuse_pending(self, call: str) -> None:
        if self._pending is not None:  # a Ctrl-C cut a step short: its results would be dropped unseen
            raise InvalidInputError(f"{call}() while a step is pending: call step_wait() for its results "
                                    "(or reset() to drop it)")

    def _guarded(self, vector: ParallelVectorEnv, call: Any, *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``; after a failure nothing of the step stays in flight (nor
        pending): SuperSuit's vector env has no recv."""
        try:
            return call(*args, **kwargs)
        except EnvManagerError:
            self._pending = None
            try:
                for error in vector.drop_in_flight():
                    logger.warning("a step dropped after a failure failed too: %s", error)
            except EnvManagerError:
                logger.warning("could not drop the steps in flight after a failure", exc_info=True)
            raise

    def _go_on(self, vector: ParallelVectorEnv) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict]]:
        """The pending step, from where it was: every env's result, then the resets of those whose
        episode ended (sent as the results came). A Ctrl-C in a wait leaves it pending there; elsewhere
        it waits until what this keeps agrees with the vector (``interrupts``)."""
        step = self._pending
        assert step is not None
        try:
            begin()
            if step.results is None:
                self._stepped(vector, step, self._guarded(vector, vector.recv, self.num_vec_envs, sort=True))
            if step.ended.size:
                self._reset_within(step, self._guarded(vector, vector.recv, len(step.ended), sort=True))
            self._pending = None
            assert step.results is not None
            return step.results
        finally:
            end()

    def _stepped(self, vector: ParallelVectorEnv, step: _Step, batch: MultiAgentBatch) -> None:
        """Every env's result of ``step``: SuperSuit's, less the resets of the envs whose episode
        ended, which are sent (SuperSuit resets them within the step)."""
        observations = self._observations(batch)
        infos = self._row_infos(batch)
        rewards = batch.reward.astype(np.float32)
        terminations, truncations = batch.terminated.copy(), batch.truncated.copy()
        self.active = batch.active.copy()
        n = self.num_agents
        cut = np.flatnonzero(batch.restarted)  # its process was restarted: the episode is gone, this is a reset
        if cut.size:
            truncations[(cut[:, None] * n + np.arange(n)).reshape(-1)] = True
        ended = np.flatnonzero(batch.episode_end)
        if ended.size:  # SuperSuit resets a finished env within the step
            rows = (ended[:, None] * n + np.arange(n)).reshape(-1)
            for row in rows[batch.present[rows]]:
                infos[row]["terminal_observation"] = _row(observations, row)
            # read by no one: the env's next step is its reset
            self._guarded(vector, vector.send, np.zeros_like(step.actions[rows]), env_ids=ended)
        step.batch, step.ended = batch, ended
        step.results = observations, rewards, terminations, truncations, infos

    def _reset_within(self, step: _Step, reset: MultiAgentBatch) -> None:
        """The resets of the envs whose episode ended in ``step``, into its results."""
        assert step.results is not None and step.batch is not None
        observations, _, _, truncations, infos = step.results
        n, batch = self.num_agents, step.batch
        # (a restart meanwhile resets the other envs of that process too: they come back here, their
        # episodes cut short after this step, whose observations are their last)
        rows = (reset.env_ids[:, None] * n + np.arange(n)).reshape(-1)
        cut = rows[~np.isin(rows // n, step.ended)]
        if cut.size:
            truncations[cut] = True
            for row in cut[batch.present[cut]]:
                infos[row]["terminal_observation"] = _row(observations, row)
        _put_rows(observations, rows, self._observations(reset))
        self.active[rows] = reset.active
        # A new list: one kept from reset() is left as it was (as SuperSuit's; SB3's SubprocVecEnv binds a new one)
        reset_infos = self.reset_infos = list(self.reset_infos)
        for row, info in zip(rows.tolist(), self._row_infos(reset), strict=True):
            infos[row].update(info)
            reset_infos[row] = info
        step.ended = step.ended[:0]

    def _observations(self, batch: MultiAgentBatch) -> Any:
        """The batch's observations (a copy) as the env's space has them: with its action mask
        where the env puts one in (the mask of a row whose agent is not there: zeros, as the
        rest of the row)."""
        observations = _copy(batch.observation)
        if self._mask_space is None:
            return observations
        assert batch.action_mask is not None  # (Discrete actions: the batch has masks)
        mask = np.where(batch.present[:, None], batch.action_mask, False).astype(self._mask_space.dtype)
        rest = observations if isinstance(observations, dict) else {"observation": observations}
        return {key: mask if key == MASK_KEY else rest[key] for key in self._observation_keys}

    def _row_infos(self, batch: MultiAgentBatch) -> list[dict]:
        return [dict(infos.get(agent, {})) for infos in batch.infos for agent in self.possible_agents]

    # ------------------------------------------------------------------------------------------

    def render(self) -> Any:
        """The first env's ``render()`` (as SuperSuit)."""
        return self.vector.call("render", env_ids=[0])[0]

    def get_attr(self, name: str) -> list[Any]:
        """Each row's env's attribute (an env's value repeated for each of its agents); one the
        env lacks raises :class:`~envmanager.errors.RemoteAttributeError`, an ``AttributeError``
        (as SuperSuit's and SB3's own vector envs raise)."""
        vector = self.vector
        with remote_attribute_errors():
            values = vector.call(name)
        return [value for value in values for _ in range(self.num_agents)]

    def env_is_wrapped(self, wrapper_class: type, indices: Any = None) -> list[bool]:
        """``[False] * num_envs``: PettingZoo envs are not gymnasium wrappers (as SuperSuit)."""
        return [False] * self.num_envs

    def close(self, **kwargs: Any) -> None:
        """End every worker and free shared memory; every later call raises (as SuperSuit's). Idempotent."""
        self._closed = True
        vector = self._vector
        if vector is not None:
            vector.close()
            self._vector = None  # only once closed: a close cut short (Ctrl-C) is finished by the next close()

    @property
    def closed(self) -> bool:  # type: ignore[override]
        return self._closed

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


@dataclass
class _Step:
    """A step under way: its actions (sent), then every env's result (``results``, SuperSuit's
    five, and the ``batch`` they came from) and the envs whose episode ended there (``ended``:
    their resets sent and not yet taken)."""

    actions: np.ndarray
    results: tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict]] | None = None
    batch: MultiAgentBatch | None = None
    ended: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_copy(v) for v in tree)
    return np.array(tree, copy=True)


def _row(tree: Any, row: int) -> Any:
    if isinstance(tree, dict):
        return {k: _row(v, row) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_row(v, row) for v in tree)
    return tree[row].copy()


def _put_rows(tree: Any, rows: np.ndarray, values: Any) -> None:
    if isinstance(tree, dict):
        for k in tree:
            _put_rows(tree[k], rows, values[k])
    elif isinstance(tree, tuple):
        for t, v in zip(tree, values, strict=True):
            _put_rows(t, rows, v)
    else:
        tree[rows] = values


def _parallel_env(vec_env: Any) -> Any:
    """The PettingZoo env behind what ``pettingzoo_env_to_vec_env`` returned (ours or SuperSuit's)."""
    env = getattr(vec_env, "par_env", None)
    if env is None:
        kind = "a PettingZoo ParallelEnv: pass it through pettingzoo_env_to_vec_env first" if isinstance(
            vec_env, ParallelEnv) else f"{type(vec_env).__name__}"
        raise InvalidInputError(f"concat_vec_envs takes what pettingzoo_env_to_vec_env returns, got {kind}")
    return env


def pettingzoo_env_to_vec_env(parallel_env: Any) -> PettingZooVecEnv:
    """SuperSuit's ``pettingzoo_env_to_vec_env_v1``: one PettingZoo ``ParallelEnv`` as a vector
    env of its agents (one row per agent of ``possible_agents``), for :func:`concat_vec_envs`.
    Used alone it runs the env in one worker process, started at its first ``reset``. Agents may
    die (no ``black_death`` needed); all agents must share one observation and action space."""
    if not isinstance(parallel_env, ParallelEnv):
        raise UnsupportedEnvError(
            f"pettingzoo_env_to_vec_env takes a PettingZoo ParallelEnv, got {type(parallel_env).__name__} (an AEC env "
            "converts with pettingzoo.utils.conversions.aec_to_parallel, or run it with ParallelVectorEnv)")
    if not getattr(parallel_env, "possible_agents", None):
        raise UnsupportedEnvError("the env passed to pettingzoo_env_to_vec_env must have possible_agents")
    return PettingZooVecEnv(parallel_env, 1)


def concat_vec_envs(vec_env: Any, num_vec_envs: int, num_cpus: int = 0, base_class: str = "gymnasium",
                    **kwargs: Any) -> Any:
    """SuperSuit's ``concat_vec_envs_v1``: ``num_vec_envs`` copies of the env that
    ``vec_env`` (from :func:`pettingzoo_env_to_vec_env`, ours or SuperSuit's) wraps, in
    ``num_cpus`` worker processes (0 and 1: one), rows env by env.

    :param base_class: ``"gymnasium"``: a :class:`PettingZooVecEnv` (SuperSuit's gymnasium
        vector env); ``"stable_baselines3"``: an SB3 ``VecEnv`` around it (extra ``sb3``).
    :param kwargs: :class:`ParallelVectorEnv` options (``timeout``, ``restart_workers``,
        ``context``...).
    """
    if base_class not in BASE_CLASSES:
        raise InvalidInputError(f"base_class must be one of {BASE_CLASSES}, got {base_class!r}")
    env = _parallel_env(vec_env)
    venv = PettingZooVecEnv(env, num_vec_envs, num_cpus, **kwargs)
    try:
        venv.vector  # noqa: B018 (starts the processes now: errors show here, as SuperSuit's)
        if base_class == "stable_baselines3":
            from envmanager.pettingzoo.supersuit_sb3 import SB3VecEnvWrapper

            return SB3VecEnvWrapper(venv)
    except BaseException:
        venv.close()
        raise
    return venv


#: SuperSuit's versioned names, so that changing the import is the whole change.
concat_vec_envs_v1 = concat_vec_envs
pettingzoo_env_to_vec_env_v1 = pettingzoo_env_to_vec_env
