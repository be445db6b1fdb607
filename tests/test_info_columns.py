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


# ----------------------------------------------------------------------------------------------
# Partial batches (send / recv): infos batched per key, as gymnasium's _add_info batches them


def add_info_reference(infos_by_row: dict[int, dict], num_envs: int) -> dict:
    """gymnasium's own batching: ``VectorEnv._add_info`` env by env, in row order."""
    ref = gym.vector.SyncVectorEnv([lambda: ControlledEnv(0)] * num_envs)
    try:
        out: dict = {}
        for k in sorted(infos_by_row):
            out = ref._add_info(out, infos_by_row[k], k)
        return out
    finally:
        ref.close()


def assert_same_infos(mine: dict, theirs: dict, where: str = "") -> None:
    """Same keys in the same order, same dtypes and shapes, same values of the same types."""
    assert list(mine) == list(theirs), where
    for key, value in theirs.items():
        got = mine[key]
        if isinstance(value, dict):
            assert_same_infos(got, value, f"{where}.{key}")
            continue
        assert type(got) is np.ndarray and got.dtype == value.dtype and got.shape == value.shape, (where, key)
        if value.dtype == object:
            for a, b in zip(got.tolist(), value.tolist(), strict=True):
                assert type(a) is type(b), (where, key)
                if isinstance(b, np.ndarray):
                    np.testing.assert_array_equal(a, b)
                else:
                    assert a == b or (a != a and b != b), (where, key)
        else:
            np.testing.assert_array_equal(got, value)


def test_partial_batch_infos_equal_add_info():
    """Random infos (per-env keys and types, empty ones, numpy scalars and arrays, objects,
    nested dicts, ``final_obs``, ``_``-keys, ints beyond int64) and columns: the same infos as
    gymnasium's ``_add_info``, or its own error, through the drop-in's fallback."""
    import random

    from envmanager.adapters.gymnasium_utils import block_dicts, partial_batch_infos
    from envmanager.core.results import InfoBlock

    n = 6
    values = [lambda r: r.randint(-5, 5), lambda r: r.random(), lambda r: r.random() < 0.5,
              lambda r: np.float32(r.random()), lambda r: np.int32(r.randint(0, 9)), lambda r: np.bool_(r.random() < 0.5),
              lambda r: f"s{r.randint(0, 3)}", lambda r: np.arange(3) * r.randint(0, 3), lambda r: None,
              lambda r: (1, 2), lambda r: {"a": r.randint(0, 3)}, lambda r: 2**70, lambda r: float("nan")]
    keys = ["t", "x", "y", "_x", "final_obs", "env_id", 3]
    columns = {"int": (np.int64, True), "float": (np.float64, True), "bool": (np.bool_, True),
               "f32": (np.float32, False), "i64": (np.int64, False)}
    rng = random.Random(0)
    fast = 0
    for trial in range(1500):
        simple = rng.random() < 0.6
        some_keys, some_values = (keys[:3], values[:6]) if simple else (keys, values)
        size = rng.randint(1, n)
        present = sorted(rng.sample(range(size), rng.randint(0, size)))
        by_row: dict[int, dict] = {}
        blocks = []
        if rng.random() < 0.4 and len(present) >= 2:  # some rows came as columns
            rows = rng.sample(present, rng.randint(1, len(present)))
            block_keys = tuple(rng.sample(["t", "x", "y"], rng.randint(1, 3)))
            cols, python = [], []
            for _ in block_keys:
                dtype, py = columns[rng.choice(list(columns))]
                cols.append(np.array([rng.randint(0, 9) for _ in rows]).astype(dtype))
                python.append(py)
            block = InfoBlock(np.array([100 + r for r in rows]), block_keys, cols, tuple(python))
            blocks.append((rows, block))
            by_row.update(zip(rows, block_dicts(block).values(), strict=True))
        found = []
        for k in present:
            if k not in by_row:
                by_row[k] = {key: rng.choice(some_values)(rng) for key in rng.sample(some_keys, rng.randint(1, len(some_keys)))}
                found.append((k, by_row[k]))
        try:
            expected, error = add_info_reference(by_row, n), None
        except Exception as exc:
            expected, error = None, exc
        try:
            mine = partial_batch_infos(list(range(n)), dict(found), blocks, n)
        except Exception:
            mine = None
        if mine is None:  # the drop-in's fallback: gymnasium's own, env by env
            if error is not None:
                with pytest.raises(type(error)):
                    add_info_reference(by_row, n)
            continue
        assert error is None, (trial, error)
        fast += 1
        assert_same_infos(mine, expected, f"trial {trial}")
    assert fast > 700  # most went the per-key way


class MixedInfoEnv(ControlledEnv):
    """Step infos that differ per env: some travel as columns (a lane of envs 0-1 or 4-5 with the
    same flat keys), the others as dicts: empty ones, arrays, strings, another type for ``t``."""

    def step(self, action):
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, mixed_info(self.env_id, self.t)


def mixed_info(env_id: int, t: int) -> dict:
    if env_id in (0, 1) and not (env_id == 1 and t % 5 == 0):
        return {"t": t, "x": t / 2, "ok": t % 2 == 0, "f32": np.float32(env_id)}
    if env_id in (4, 5):
        return {"x": t / 4, "t": np.int32(t), "ok": t % 3 == 0, "f32": np.float32(t)}
    if env_id == 1:
        return {"other": t}
    if env_id == 2:
        return {} if t % 3 == 0 else {"t": t, "arr": np.arange(2) * t}
    if env_id == 3:
        return {"t": float(t), "name": f"n{t}"}
    return {"t": t} if env_id == 6 else {}


@pytest.mark.parametrize("batch_size", [2, 3])
def test_gymnasium_partial_batches_batch_infos_as_gymnasium_does(batch_size):
    """recv's infos are gymnasium's _add_info of the batch's envs' own infos, row k = env
    ``env_id[k]`` (batches of 3 out of answers of 2 split an answer's columns across batches)."""
    n = 8
    fns = [lambda i=i: MixedInfoEnv(i, episode_length=6) for i in range(n)]
    vec = envmanager.AsyncVectorEnv(fns, batch_size=batch_size, envs_per_worker=4, double_buffer=True)
    try:
        vec.reset(seed=0)
        vec.send(np.ones(n, dtype=np.int64))
        columns = 0
        original = vec._manager._receive_batch  # (the drop-in calls the unsectioned half in its own section)

        def counting(*args, **kwargs):
            nonlocal columns
            batch = original(*args, **kwargs)
            columns += len(batch.info_columns)
            return batch

        vec._manager._receive_batch = counting
        env_by_env = []  # gymnasium's _add_info is the fallback only: none of these infos needs it
        vec._add_info = lambda infos, info, k: env_by_env.append(k)
        lanes = [(0, 1), (2, 3), (4, 5), (6, 7)]  # 4 envs per process, two lanes each
        back: set[int] = set()
        for _ in range(60):
            obs, *_, infos = vec.recv()
            ids = infos["env_id"]
            assert ids.dtype == np.int64 and len(ids) == batch_size
            by_row = {}
            for k, (i, t) in enumerate(zip(ids.tolist(), obs[:, 0].astype(int).tolist(), strict=True)):
                info = {"env_id": i, "seed": None} if t == 0 else mixed_info(i, t)  # t == 0: next-step autoreset
                if info:
                    by_row[k] = info
            expected = add_info_reference(by_row, n)
            expected["env_id"] = ids
            assert_same_infos(infos, expected)
            back.update(ids.tolist())
            ready = [i for lane in lanes if back.issuperset(lane) for i in lane]  # a lane goes out whole
            if ready:
                vec.send(np.ones(len(ready), dtype=np.int64), np.array(ready))
                back.difference_update(ready)
        assert columns > 0 and not env_by_env
    finally:
        vec.close()
