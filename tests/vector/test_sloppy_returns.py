"""Envs as people write them (issue 38): whatever an env's ``reset()`` and ``step()`` return, the
drop-ins give what their references give, or refuse what they refuse.

Hypothesis generates, per env and per call, observations, rewards, flags and infos of every
Python and numpy type and shape the spaces allow or nearly allow (``sloppy_cases``); a
``ReplayEnv`` returns them; the same script runs through envmanager's drop-in and its
reference, and the results are compared exactly: types, dtypes, shapes, values, info keys.
Where the reference raises, ours raises too, with an error naming the env and the call, and
stays usable: the next example resets it and must match a fresh reference again, so nothing
desyncs. Each vector env under test serves many examples (scripts are loaded with a call).

The deliberate differences (the guide lists them): rewards and flags keep the shape of the
first step's (gymnasium follows each step: a next-step autoreset's plain zeros among ``(1,)``
rewards make its batch ragged, and it raises, or with numpy < 1.24 flattens it to ``(n,)``);
and the SB3 drop-in returns DummyVecEnv's dtypes.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import warnings
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv as GymAsyncVectorEnv
from gymnasium.vector import AutoresetMode
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sloppy_cases import (
    FLAG_FAMILIES,
    REWARD_FAMILIES,
    assert_names,
    assert_same,
    case,
    close_reference,
    named_in,
    refused_alone,
)
from sloppy_envs import OBS_KINDS, ReplayEnv

import envmanager
from envmanager.errors import EnvManagerError, WorkerError

pytestmark = pytest.mark.skipif(
    __import__("envs").REFERENCE, reason="compares envmanager with its references itself"
)

#: numpy >= 1.24 raises for a ragged list given a dtype (1.x before: a DeprecationWarning).
NUMPY_REFUSES_RAGGED = np.lib.NumpyVersion(np.__version__) >= "1.24.0"
N = 3  # with envs_per_worker=2: a process of two envs and a process of one
STEPS = 4
SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
                    phases=(Phase.explicit, Phase.generate),  # no shrinking: every example starts processes
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fns(obs_kind: str, n: int = N) -> list:
    return [functools.partial(ReplayEnv, slot=i, obs_kind=obs_kind) for i in range(n)]


def outcome(call, *args: Any) -> tuple[Any, BaseException | None]:
    """What ``call(*args)`` returned, or the exception it raised (gymnasium's logger quietened)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return call(*args), None
        except Exception as exc:  # the reference's or ours, compared by the caller
            return None, exc


class Reused:
    """One vector env under test per key, reused across examples (closed at the end)."""

    def __init__(self, make) -> None:
        self.make = make
        self.key: Any = None
        self.env: Any = None

    def get(self, key: Any) -> Any:
        if key != self.key:
            self.close()
            self.env, self.key = self.make(*key), key
        return self.env

    def drop(self) -> None:
        """Forget the env (a failed example): the next one builds afresh."""
        self.close()

    def close(self) -> None:
        env, self.env, self.key = self.env, None, None
        if env is not None:
            env.close()


# ------------------------------------------------------------------------------------------------
# gymnasium: envmanager.AsyncVectorEnv against gymnasium's AsyncVectorEnv


def gym_reference(obs_kind: str, shared_memory: bool) -> GymAsyncVectorEnv:
    return GymAsyncVectorEnv(fns(obs_kind), shared_memory=shared_memory, context="fork")


def autoreset_model(step_values: list[tuple], resetting: list[bool], reward_shape: tuple, flag_shape: tuple) -> tuple:
    """The rewards and flags of a next-step autoreset step whose rows the reference cannot batch
    (plain zeros among shaped values): each env's value as gymnasium converts it, the resetting
    rows zeros of the first step's shape."""
    rewards, terms, truncs = [], [], []
    for values, resetting_now in zip(step_values, resetting, strict=True):
        if resetting_now:
            rewards.append(np.zeros(reward_shape))
            terms.append(np.zeros(flag_shape, dtype=np.bool_))
            truncs.append(np.zeros(flag_shape, dtype=np.bool_))
        else:
            rewards.append(np.array(values[1], dtype=np.float64))
            terms.append(np.array(values[2], dtype=np.bool_))
            truncs.append(np.array(values[3], dtype=np.bool_))
    return np.array(rewards, dtype=np.float64), np.array(terms, dtype=np.bool_), np.array(truncs, dtype=np.bool_)


def run_gymnasium_case(ours: Any, ref: GymAsyncVectorEnv, table: list[dict], reward_shape: tuple, flag_shape: tuple) -> bool:
    """Run ``table`` through ours and the reference, comparing every call; ``False`` once the
    reference raised (ours raised too: checked)."""
    ours.call("load", table)
    ref.call("load", table)
    expected, ref_error = outcome(functools.partial(ref.reset, seed=7))
    got, our_error = outcome(functools.partial(ours.reset, seed=7))
    space, shared_memory = ref.single_observation_space, ref.shared_memory
    resets = Call("reset", [row["reset"] for row in table], space, shared_memory)
    if not check_outcome(got, our_error, expected, ref_error, resets):
        return False
    at = [0] * N  # each env's next step in its script
    resetting = [False] * N  # next-step autoreset: the next step resets these
    for t in range(STEPS):
        actions = np.zeros(N, dtype=np.int64)
        expected, ref_error = outcome(ref.step, actions)
        got, our_error = outcome(ours.step, actions)
        values = [table[i]["steps"][at[i] % len(table[i]["steps"])] for i in range(N)]
        shaped = reward_shape != () or flag_shape != ()
        if any(resetting) and shaped and (ref_error is None or "inhomogeneous" in str(ref_error)):
            # a deliberate difference: the first step's shapes, where gymnasium raises or follows the zeros
            assert our_error is None, f"step {t}: ours raised {our_error!r} on a next-step autoreset"
            rewards, terms, truncs = autoreset_model(values, resetting, reward_shape, flag_shape)
            assert_same(got[1], rewards, f"step {t} rewards")
            assert_same(got[2], terms, f"step {t} terminations")
            assert_same(got[3], truncs, f"step {t} truncations")
            assert_same(got[0], expected[0] if ref_error is None else ref.observations, f"step {t} observations")
            if ref_error is None:
                assert_same(got[4], expected[4], f"step {t} infos")
        elif not check_outcome(got, our_error, expected, ref_error, Call("step", values, space, shared_memory, t)):
            return False
        for i in range(N):
            if resetting[i]:
                resetting[i], at[i] = False, 0
            else:
                terminated, truncated = values[i][2], values[i][3]
                resetting[i] = bool(terminated or truncated)
                at[i] += 1
    return True


class Call:
    """One call of a case, for judging an error: what each env returned, and the rules in force."""

    def __init__(self, name: str, returned: list[tuple], space: Any, shared_memory: bool, t: int | None = None) -> None:
        self.name, self.returned, self.space, self.shared_memory, self.t = name, returned, space, shared_memory, t
        self.where = name if t is None else f"{name} {t}"

    def value(self, slot: int, what: str) -> Any:
        """What env ``slot`` returned as its ``what``."""
        fields = ("observation", "info") if self.name == "reset" else ("observation", "reward", "terminated", "truncated", "info")
        return self.returned[slot][fields.index(what)]


def check_outcome(got: Any, our_error: BaseException | None, expected: Any, ref_error: BaseException | None,
                  call: Call, sb3: bool = False) -> bool:
    """Ours returned what the reference returned, or both raised (``False``): ours an error of
    the reference's type naming the env and the call -- or, where several envs returned what
    cannot be taken and the reference tripped over another first, of the type gymnasium's own
    rule raises for the value ours names, on its own. The SB3 drop-in raises ``WorkerError``s
    (SB3's worker dies: ``EOFError``): there the type is that of its ``cause``, what the env
    returned refused as gymnasium's rule refuses it."""
    where = call.where
    if ref_error is not None:
        assert our_error is not None, f"{where}: the reference raised {ref_error!r}, ours returned {got!r}"
        slot, what = assert_names(our_error, call.name, N)
        if sb3:
            assert isinstance(our_error, WorkerError), f"{where}: ours raised {our_error!r}"
            our_error = our_error.cause or our_error
        if sb3 and what is None:  # an exception of the env's handling (unpacking, the truth of a flag)
            assert isinstance(our_error, type(ref_error)) or isinstance(ref_error, (EOFError, ConnectionError)), where
        elif sb3 or not isinstance(our_error, type(ref_error)):
            assert what is not None, f"{where}: the reference raised {ref_error!r}, ours {our_error!r}"
            value = call.value(slot, what)
            alone = refused_alone(what, value, call.space, call.shared_memory)
            shape_changed = what in ("reward", "terminated", "truncated") and "the shape the first step gave" in str(our_error)
            assert shape_changed or (alone is not None and isinstance(our_error, alone)), (
                f"{where}: the reference raised {ref_error!r}, ours {our_error!r}; gymnasium's rule on env {slot}'s "
                f"{what} alone raises {alone}")
        return False
    assert our_error is None, f"{where}: ours raised {our_error!r}, the reference returned {expected!r}"
    assert_same(got, expected, where)
    return True


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pickled"])
@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_gymnasium_sloppy_returns_as_reference(shared_memory: bool, envs_per_worker: int) -> None:
    """Observations, rewards, flags and infos of every type and shape through
    ``envmanager.AsyncVectorEnv`` and gymnasium's: the same results, or both raise."""
    ours = Reused(lambda kind, rf, ff: envmanager.AsyncVectorEnv(
        fns(kind), shared_memory=shared_memory, context="fork", envs_per_worker=envs_per_worker))

    @SETTINGS
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        obs_kind = data.draw(st.sampled_from(OBS_KINDS), "obs_kind")
        rf = data.draw(st.sampled_from(list(REWARD_FAMILIES)), "reward family")
        ff = data.draw(st.sampled_from(list(FLAG_FAMILIES)), "flag family")
        table = data.draw(case(N, obs_kind, STEPS, rf, ff), "table")
        env = ours.get((obs_kind, rf, ff))
        ref = gym_reference(obs_kind, shared_memory)
        try:
            run_gymnasium_case(env, ref, table, REWARD_FAMILIES[rf], FLAG_FAMILIES[ff])
        except BaseException:
            ours.drop()
            raise
        finally:
            close_reference(ref)

    try:
        check()
    finally:
        ours.close()


# ------------------------------------------------------------------------------------------------
# SB3: envmanager.sb3.SubprocVecEnv against SB3's SubprocVecEnv
#
# Rewards, dones, infos and reset infos are SB3's (rewards float32 and dones bool, as DummyVecEnv;
# ``TimeLimit.truncated`` a bool); observations take the space's dtype and shape by gymnasium's
# rules (its shared memory's, or with ``shared_memory=False`` its ``concatenate``), where
# SubprocVecEnv stacks them as the envs return them: the expected observations come from those rules.


def gymnasium_batch(space: Any, values: list[Any], shared_memory: bool) -> Any:
    """The batch gymnasium's own rules make of one observation per env."""
    from gymnasium.vector.utils import (
        concatenate,
        create_empty_array,
        create_shared_memory,
        read_from_shared_memory,
        write_to_shared_memory,
    )

    if not shared_memory:
        return concatenate(space, values, create_empty_array(space, n=len(values)))
    memory = create_shared_memory(space, n=len(values), ctx=multiprocessing.get_context("fork"))
    for i, value in enumerate(values):
        write_to_shared_memory(space, i, value, memory)
    return copy.deepcopy(read_from_shared_memory(space, memory, n=len(values)))


def sb3_reference(obs_kind: str) -> Any:
    from stable_baselines3.common.vec_env import SubprocVecEnv

    return SubprocVecEnv(fns(obs_kind), start_method="fork")


def close_sb3_reference(ref: Any) -> None:
    """Close SB3's vector env, even with a worker that died (SB3's close would wait on it)."""
    for remote in ref.remotes:
        try:
            remote.send(("close", None))
        except Exception:  # a worker that died: its pipe is broken
            pass
    for process in ref.processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)
        process.close()
    for remote in ref.remotes:
        remote.close()
    ref.closed = True


def time_limit(terminated: Any, truncated: Any) -> bool:
    """``TimeLimit.truncated`` of an env's flags, each judged by its elements, as numpy converts
    it (SB3 takes Python's truth: the same but for a list, true whatever it holds)."""
    return bool(np.asarray(truncated, dtype=np.bool_).any()) and not bool(np.asarray(terminated, dtype=np.bool_).any())


def assert_sb3_infos(got: list[dict], expected: Any, where: str, time_limits: list[bool] | None = None) -> None:
    """SB3's infos: the same keys in the same order and values; ``TimeLimit.truncated`` a bool,
    ``time_limits`` (SB3 hands on the env's own falsy value, and judges a list flag true)."""
    assert len(got) == len(expected), where
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert list(ours) == list(theirs), f"{where} info {i}: keys {list(ours)} != {list(theirs)}"
        for key in theirs:
            if key == "TimeLimit.truncated":
                assert time_limits is not None
                assert type(ours[key]) is bool and ours[key] == time_limits[i], \
                    f"{where} info {i}: TimeLimit.truncated {ours[key]!r} for {theirs[key]!r}"
            else:
                assert_same(ours[key], theirs[key], f"{where} info {i}[{key!r}]")


def sb3_stacking_only(table: list[dict], values: list[tuple], space: Any) -> tuple[Any, Any] | None:
    """Where SB3 raised stacking its observations (its workers all answered), the rewards and
    dones it would have stacked (``None`` where those fail too, or a worker raised)."""
    from stable_baselines3.common.vec_env.subproc_vec_env import _stack_obs

    try:
        dones = [v[2] or v[3] for v in values]
        rewards, stacked_dones = np.stack([v[1] for v in values]), np.stack(dones)
    except Exception:
        return None
    obs = [table[i]["reset"][0] if done else values[i][0] for i, done in enumerate(dones)]
    try:
        _stack_obs(obs, space)
    except Exception:
        return rewards, stacked_dones
    return None


def run_sb3_case(ours: Any, ref: Any, table: list[dict], shared_memory: bool) -> bool:
    """Run ``table`` through ours and SB3's SubprocVecEnv (see above); ``False`` once the
    reference raised (ours raised too: checked), or stacked observations it could not."""
    ours.env_method("load", table)
    ref.env_method("load", table)
    space = ref.observation_space
    resets = [row["reset"] for row in table]
    expected_obs, rule_error = outcome(gymnasium_batch, space, [r[0] for r in resets], shared_memory)
    got, our_error = outcome(ours.reset)
    _, ref_error = outcome(ref.reset)
    if rule_error is not None:  # gymnasium's rule refuses an observation: ours does
        return check_outcome(got, our_error, None, rule_error, Call("reset", resets, space, shared_memory), sb3=True)
    assert our_error is None, f"reset: ours raised {our_error!r}, gymnasium's rule takes {resets!r}"
    assert_same(got, expected_obs, "reset obs")
    assert_sb3_infos(ours.reset_infos, [r[1] for r in resets], "reset")
    if ref_error is not None:  # SB3 stacks the observations as they come: ragged ones fail there only
        return False
    at = [0] * N
    for t in range(STEPS):
        actions = np.zeros(N, dtype=np.int64)
        values = [table[i]["steps"][at[i] % len(table[i]["steps"])] for i in range(N)]
        expected, ref_error = outcome(ref.step, actions)
        got, our_error = outcome(ours.step, actions)
        call = Call("step", values, space, shared_memory, t)
        stacked = sb3_stacking_only(table, values, space) if ref_error is not None else None
        if ref_error is not None and stacked is None:
            return check_outcome(got, our_error, None, ref_error, call, sb3=True)
        done = [bool(v[2] or v[3]) for v in values]
        obs_values = [table[i]["reset"][0] if done[i] else values[i][0] for i in range(N)]
        expected_obs, rule_error = outcome(gymnasium_batch, space, obs_values, shared_memory)
        if rule_error is not None:  # SB3 stacks what gymnasium's rule refuses to cast: ours refuses
            return check_outcome(got, our_error, None, rule_error, call, sb3=True)
        assert our_error is None, f"step {t}: ours raised {our_error!r}, SB3 returned {expected!r}"
        rewards, dones = stacked if stacked is not None else (expected[1], expected[2])
        if any(isinstance(v[2], list) or isinstance(v[3], list) for v in values):  # judged by their elements
            dones = np.array([np.asarray(v[2], dtype=np.bool_) | np.asarray(v[3], dtype=np.bool_) for v in values])
        assert_same(got[0], expected_obs, f"step {t} obs")
        with np.errstate(over="ignore"):  # a reward of 1e300 is inf in float32, as in ours
            assert_same(got[1], np.asarray(rewards).astype(np.float32), f"step {t} rewards")
        assert_same(got[2], np.asarray(dones).astype(np.bool_), f"step {t} dones")
        if stacked is not None:
            return False  # SB3 raised: no infos to compare
        assert_sb3_infos(got[3], expected[3], f"step {t}", [time_limit(v[2], v[3]) for v in values])
        assert_sb3_infos(ours.reset_infos, ref.reset_infos, f"step {t} reset_infos")
        at = [0 if done[i] else at[i] + 1 for i in range(N)]
    return True


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pickled"])
@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_sb3_sloppy_returns_as_reference(shared_memory: bool, envs_per_worker: int) -> None:
    """The same cases through ``envmanager.sb3.SubprocVecEnv`` and SB3's own ``SubprocVecEnv``."""
    pytest.importorskip("stable_baselines3")
    from envmanager.sb3 import SubprocVecEnv

    ours = Reused(lambda kind, rf, ff: SubprocVecEnv(fns(kind), start_method="fork", envs_per_worker=envs_per_worker,
                                                     shared_memory=shared_memory))

    @SETTINGS
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        obs_kind = data.draw(st.sampled_from(OBS_KINDS), "obs_kind")
        rf = data.draw(st.sampled_from(list(REWARD_FAMILIES)), "reward family")
        ff = data.draw(st.sampled_from(list(FLAG_FAMILIES)), "flag family")
        table = data.draw(case(N, obs_kind, STEPS, rf, ff), "table")
        env = ours.get((obs_kind, rf, ff))
        ref = sb3_reference(obs_kind)
        try:
            run_sb3_case(env, ref, table, shared_memory)
        except BaseException:
            ours.drop()
            raise
        finally:
            close_sb3_reference(ref)

    try:
        check()
    finally:
        ours.close()


# ------------------------------------------------------------------------------------------------
# Rewards and flags: shapes decided once, at the first step


def plain_table(n: int, rewards: list[list[Any]], terminated: list[list[Any]] | None = None, obs_kind: str = "box") -> list:
    """Scripts of clean observations with ``rewards[i]`` (and ``terminated[i]``) for env ``i``."""
    from sloppy_envs import obs_space

    space = obs_space(obs_kind)
    space.seed(0)
    table = []
    for i in range(n):
        flags = terminated[i] if terminated is not None else [False] * len(rewards[i])
        steps = [(space.sample(), r, f, False, {}) for r, f in zip(rewards[i], flags, strict=True)]
        table.append({"reset": (space.sample(), {}), "steps": steps})
    return table


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_a_reward_of_shape_one_gives_rewards_of_shape_n_1(closing, envs_per_worker: int) -> None:
    """The issue's env: ``step()`` returns ``np.array([1.0])``. gymnasium's AsyncVectorEnv gives
    rewards of shape (n, 1); ours too, with several envs in a process or one (before: a
    ValueError from the worker, or rewards flattened to (n,)); and a next-step autoreset's row
    is zeros of that shape, where gymnasium cannot batch it with the others' arrays."""
    table = plain_table(N, [[np.array([i + 1.0]), np.array([-1.5])] for i in range(N)],
                        [[False, False], [True, False], [False, False]])
    ours = closing(envmanager.AsyncVectorEnv(fns("box"), context="fork", envs_per_worker=envs_per_worker))
    ref = gym_reference("box", True)
    try:
        for env in (ours, ref):
            env.call("load", table)
            env.reset(seed=1)
        _, rewards, terminated, _, _ = ours.step(np.zeros(N, dtype=np.int64))
        _, expected, _, _, _ = ref.step(np.zeros(N, dtype=np.int64))
        assert_same(rewards, expected)
        assert rewards.shape == (N, 1) and rewards.tolist() == [[1.0], [2.0], [3.0]]
        assert terminated.tolist() == [False, True, False]
        # env 1 resets: its 0 among arrays. numpy >= 1.24 refuses the ragged batch; numpy 1.x
        # before warns and flattens the one-element arrays, so gymnasium's rewards are (n,).
        if NUMPY_REFUSES_RAGGED:
            with pytest.raises(ValueError, match="inhomogeneous"):
                ref.step(np.zeros(N, dtype=np.int64))
        else:
            with pytest.warns(DeprecationWarning, match="setting an array element with a sequence"):
                _, expected, _, _, _ = ref.step(np.zeros(N, dtype=np.int64))
            assert expected.shape == (N,) and expected.tolist() == [-1.5, 0.0, -1.5]
        _, rewards, _, _, _ = ours.step(np.zeros(N, dtype=np.int64))
        assert_same(rewards, np.array([[-1.5], [0.0], [-1.5]]))
    finally:
        close_reference(ref)


def test_partial_batches_keep_the_shape_of_rewards(closing) -> None:
    """``send`` / ``recv`` hand out rows of the same (n, 1) rewards."""
    table = plain_table(N, [[np.array([i + 1.0])] * 3 for i in range(N)])
    ours = closing(envmanager.AsyncVectorEnv(fns("box"), context="fork", batch_size=2))
    ours.call("load", table)
    ours.reset(seed=1)
    ours.send(np.zeros(N, dtype=np.int64))
    for _ in range(3):
        _, rewards, terminated, _, infos = ours.recv()
        assert rewards.shape == (2, 1) and terminated.shape == (2,)
        assert rewards[:, 0].tolist() == [i + 1.0 for i in infos["env_id"].tolist()]
        ours.send(np.zeros(2, dtype=np.int64), infos["env_id"])


@pytest.mark.filterwarnings("ignore::UserWarning")  # gymnasium's log of the env that failed, as gymnasium's class logs it
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pickled"])
def test_shapes_are_decided_at_the_first_step(closing, shared_memory: bool) -> None:
    """A reward whose shape wanders after the first step is refused, naming the env, the call
    and the value (gymnasium follows each step's); the env can be reset and goes on."""
    table = plain_table(N, [[1.0, 2.0, 3.0]] * (N - 1) + [[1.0, np.array([2.0]), 3.0]])
    ours = closing(envmanager.AsyncVectorEnv(fns("box"), context="fork", envs_per_worker=2, shared_memory=shared_memory))
    ours.call("load", table)
    ours.reset(seed=1)
    assert ours.step(np.zeros(N, dtype=np.int64))[1].shape == (N,)
    with pytest.raises(ValueError) as refused:
        ours.step(np.zeros(N, dtype=np.int64))
    text = named_in(refused.value)
    assert "env 2's step() returned reward array([2.])" in text and "the shape the first step gave" in text, text
    ours.reset(seed=1)
    _, rewards, _, _, _ = ours.step(np.zeros(N, dtype=np.int64))
    assert_same(rewards, np.ones(N))


def test_the_first_step_is_decided_while_a_process_still_steps(closing) -> None:
    """The parent decides the shapes from the first answer it files; a process that started its
    step before must still hand over every env's values (found by the generated cases: a Dict
    observation, so the step goes env by env, and the second env's reward came back 0). The
    core's, so shown with the gymnasium drop-in (the SB3 one runs on the same core)."""
    table = plain_table(4, [[np.float64(i + 1.0)] * 2 for i in range(4)], obs_kind="dict")
    for row in table[:3]:  # process 0 (slots 0-2) takes its time over env 0's first step; process 1 answers at once
        row["delay"] = 0.0
    table[0]["delay"] = 0.5
    ours = closing(envmanager.AsyncVectorEnv(fns("dict", 4), context="fork", envs_per_worker=3))
    ours.call("load", table)
    ours.reset(seed=1)
    _, rewards, _, _, _ = ours.step(np.zeros(4, dtype=np.int64))
    assert rewards.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_restarted_process_keeps_the_shapes(closing) -> None:
    """A process started again holds the shapes the parent decided at the first step (it does
    not decide again): rewards stay (n, 1), and its fresh env's plain float is refused. On the
    core's batch level with restarts on, as the SB3 drop-in runs it (the drop-in's own handling
    of a restart: test_sb3_subproc)."""
    import os
    import signal

    from envmanager.core.batch import BatchEnvManager

    actions = np.zeros(2, dtype=np.int64)
    m = closing(BatchEnvManager(functools.partial(ReplayEnv, obs_kind="box"), 2, context="fork",
                                autoreset_mode="same_step", restart_workers=True, timeout=30))
    m.call("load", plain_table(2, [[np.array([1.0]), np.array([2.0])]] * 2))
    m.send_reset({0: (None, None), 1: (None, None)})
    m.receive_reset_batch()
    m.send_batch([0, 1], actions)
    assert sorted(m.receive_batch(2).slots.tolist()) == [0, 1]
    assert m.results.reward.tolist() == [[1.0], [1.0]]  # the first step: rewards (n, 1)
    slow = plain_table(2, [[np.array([1.0]), np.array([2.0])]] * 2)
    slow[1]["delay"] = 30.0  # env 1's next step outlasts the test: its process is killed in it
    m.call("load", slow)
    m.send_batch([0, 1], actions)
    assert m.receive_batch(1).slots.tolist() == [0]
    os.kill(m.processes[1].pid, signal.SIGKILL)
    cut = m.receive_batch(1)  # the restart's fresh reset
    assert cut.slots.tolist() == [1] and cut.interrupted == {1} and m.restart_count(1) == 1
    m.call_on([1], "load", (plain_table(2, [[np.array([5.0])]] * 2),))
    m.send_batch([0, 1], actions)
    assert sorted(m.receive_batch(2).slots.tolist()) == [0, 1]
    assert m.results.reward.tolist() == [[2.0], [5.0]]  # the fresh process writes (1,) rows too
    m.call_on([1], "load", (plain_table(2, [[3.0, 3.0]] * 2),))
    m.send_batch([0, 1], actions)
    with pytest.raises(EnvManagerError, match=r"env 1's step\(\) returned reward 3.0 .*the shape the first step gave"):
        m.receive_batch(2)


def test_flags_of_shape_one_with_autoreset_disabled(closing) -> None:
    """Flags of shape (1,) make terminations of shape (n, 1), as gymnasium's; stepping an env
    that ended without autoreset is refused naming it, as SyncVectorEnv does (with flags of
    one value per env, gymnasium's async class raises nothing: a defect ours does not have)."""
    table = plain_table(N, [[1.0, 2.0]] * N, [[np.array([False]), np.array([False])], [np.array([True]), np.array([False])],
                                              [np.array([False]), np.array([False])]])
    ours = closing(envmanager.AsyncVectorEnv(fns("box"), context="fork", envs_per_worker=2,
                                             autoreset_mode=AutoresetMode.DISABLED))
    ours.call("load", table)
    ours.reset(seed=1)
    _, _, terminated, truncated, _ = ours.step(np.zeros(N, dtype=np.int64))
    assert terminated.tolist() == [[False], [True], [False]] and truncated.shape == (N,)  # (a plain False each)
    with pytest.raises(AssertionError, match=r"env\(s\) \[1\] finished their episode"):
        ours.step(np.zeros(N, dtype=np.int64))
    ours.reset(options={"reset_mask": np.array([False, True, False])})
    _, rewards, terminated, _, _ = ours.step(np.zeros(N, dtype=np.int64))
    assert rewards.tolist() == [2.0, 1.0, 2.0] and terminated.tolist() == [[False], [True], [False]]


class _AnyActions:
    """A policy for the Sampler: action 0 for every env."""

    def get_actions(self, observations: np.ndarray, worker_ids: list[int]) -> tuple[np.ndarray, dict]:
        return np.zeros(len(worker_ids), dtype=np.int64), {}


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_the_sampler_takes_one_element_rewards_as_its_scalars(envs_per_worker: int) -> None:
    """The Sampler's transitions hold one reward per step: a reward of shape (1,) is that
    reward (with one env per process it was before, flattened by the worker; now the core keeps
    the (n, 1) shape and the Sampler reads its one element)."""
    from sloppy_envs import OneElementRewards

    from envmanager.sampler import Sampler

    with Sampler(OneElementRewards, 2, _AnyActions(), seed=0, envs_per_worker=envs_per_worker, context="fork") as sampler:
        batch = sampler.obtain_episodes(2)
    assert batch.rewards.dtype == np.float64 and batch.rewards.tolist() == [1.0, 2.0, 3.0] * 2
