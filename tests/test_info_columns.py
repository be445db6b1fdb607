"""Infos in columns: same-shaped flat infos travel as one array per key; everyone who asks for
dicts gets the envs' own, and the gymnasium drop-in batches them exactly as gymnasium does."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import envmanager
from envmanager.core.batch import BatchEnvManager
from envmanager.testing.envs import ControlledEnv
from envmanager.wire.info_columns import to_columns


class FlatInfoEnv(ControlledEnv):
    """Flat scalar infos every step (as MuJoCo's envs), of several types; on every 5th step
    of env 1 a different set of keys, so an answer's infos sometimes do not fit columns."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        info = {"t": self.t, "x": float(self.t) / 2, "ok": self.t % 2 == 0, "f32": np.float32(self.env_id)}
        if self.env_id == 1 and self.t % 5 == 0:
            info = {"other": self.t}
        return obs, reward, terminated, truncated, info


def flat_env(env_id):
    return FlatInfoEnv(env_id, episode_length=7)


def test_to_columns_keeps_types_and_refuses_what_does_not_fit():
    infos = [{"a": 1, "b": 0.5, "c": True, "d": np.float32(2)}, {"a": 2, "b": 1.5, "c": False, "d": np.float32(3)}]
    columns = to_columns(infos)
    assert columns is not None and columns.keys == ("a", "b", "c", "d")
    back = columns.dicts()
    assert back == infos
    assert [type(v) for v in back[0].values()] == [int, float, bool, np.float32]
    assert to_columns([{"a": 1}] * 4) is None  # too few values to pay (MIN_VALUES)
    for unfit in (
        [{"a": 1, "z": 0}, {"b": 1, "z": 0}],  # different keys
        [{"a": 1, "b": 2}, {"b": 2, "a": 1}],  # different order
        [{"a": 1}, {"a": 1.0}],  # different types
        [{"a": {"n": 1}}, {"a": {"n": 2}}],  # nested
        [{"a": np.zeros(2)}, {"a": np.zeros(2)}],  # arrays
        [{"a": np.bool_(True)}, {"a": np.bool_(False)}],  # gymnasium keeps numpy bools as objects
        [{"a": 2**70}, {"a": 1}],  # beyond int64
        [{"a": "text"}, {"a": "more"}],
    ):
        assert to_columns(unfit * 4) is None, unfit


def test_batch_level_hands_out_the_envs_own_dicts_or_columns():
    with BatchEnvManager(flat_env, 4, envs_per_worker=4, info_columns=True) as m:
        m.send_reset({s: (s, None) for s in range(4)})
        m.receive_reset_batch()
        ones = np.ones(4, dtype=np.int64)
        seen = 0
        for t in range(1, 15):
            m.send_batch(np.arange(4), ones)
            batch = m.receive_batch(4, info_columns=t % 2 == 0)
            infos = dict(batch.infos)
            seen += len(batch.info_columns)
            assert t % 2 == 0 or not batch.info_columns  # asked for dicts: dicts only
            for block in batch.info_columns:
                assert set(block.keys) == {"t", "x", "ok", "f32"}
                for i, slot in enumerate(block.slots.tolist()):
                    infos[slot] = {k: (c[i].item() if py else c[i])
                                   for k, c, py in zip(block.keys, block.columns, block.python, strict=True)}
            for slot in range(4):
                steps = m.results.observation[slot, 0]
                if steps == 0:  # next_step autoreset: the reset's info
                    assert infos[slot] == {"env_id": slot, "seed": None}
                elif slot == 1 and steps % 5 == 0:
                    assert infos[slot] == {"other": int(steps)}
                else:
                    assert infos[slot] == {"t": int(steps), "x": steps / 2, "ok": steps % 2 == 0, "f32": np.float32(slot)}
                    assert type(infos[slot]["t"]) is int and type(infos[slot]["f32"]) is np.float32
        assert seen > 0


def compare_with_sync(fns, steps, actions):
    ours = envmanager.AsyncVectorEnv(fns, envs_per_worker=len(fns) // 2)
    sync = gym.vector.SyncVectorEnv(fns)
    try:
        ours.reset(seed=5)
        sync.reset(seed=5)
        for t in range(steps):
            a = actions(t)
            mine, theirs = ours.step(a), sync.step(a)
            for x, y in zip(mine[:4], theirs[:4], strict=True):
                np.testing.assert_array_equal(x, y)
            assert list(mine[4]) == list(theirs[4])  # same keys, same order
            for key, value in theirs[4].items():
                assert mine[4][key].dtype == value.dtype, key
                np.testing.assert_array_equal(mine[4][key], value)
    finally:
        ours.close()
        sync.close()


def test_gymnasium_drop_in_batches_column_infos_as_gymnasium_does():
    fns = [lambda i=i: flat_env(i) for i in range(4)]
    compare_with_sync(fns, 30, lambda t: np.full(4, t % 3))


def test_gymnasium_drop_in_on_halfcheetah_infos():
    pytest.importorskip("mujoco")
    fns = [lambda: gym.make("HalfCheetah-v5", max_episode_steps=20) for _ in range(4)]
    rng = np.random.default_rng(0)
    compare_with_sync(fns, 45, lambda t: rng.uniform(-1, 1, (4, 6)).astype(np.float32))


def test_columns_only_when_the_caller_batches_infos():
    """Making a dict per env from columns costs more than unpickling the dicts: a manager whose
    caller did not ask for columns gets dicts from its workers, as before."""
    with BatchEnvManager(flat_env, 4, envs_per_worker=4) as m:
        m.send_reset({s: (s, None) for s in range(4)})
        m.receive_reset_batch()
        m.send_batch(np.arange(4), np.ones(4, dtype=np.int64))
        batch = m.receive_batch(4, info_columns=True)
        assert batch.info_columns == () and batch.infos[0] == {"t": 1, "x": 0.5, "ok": False, "f32": np.float32(0)}


def test_sb3_gets_dicts():
    pytest.importorskip("stable_baselines3")
    from envmanager.sb3 import SubprocVecEnv

    vec = SubprocVecEnv([lambda i=i: flat_env(i) for i in range(4)], start_method="fork", envs_per_worker=4)
    try:
        vec.reset()
        _, _, _, infos = vec.step(np.ones(4, dtype=np.int64))
        assert infos[0] == {"t": 1, "x": 0.5, "ok": False, "f32": np.float32(0), "TimeLimit.truncated": False}
        assert type(infos[2]["t"]) is int
    finally:
        vec.close()
