"""``gather_window``: after the first result, the manager waits (up to the window) until a share
of the players stepping have answered, so one policy call serves more of them; the steps handed
out are the same steps, each with the actions its player received."""
from __future__ import annotations

import pytest

pytest.importorskip("mlagents_envs")

from envmanager.errors import InvalidInputError
from envmanager.mlagents.gathering import GatherWindow
from player_policies import UniquePolicy
from test_recorded_actions import B, Checker, start


@pytest.mark.timeout(180)
def test_a_window_for_every_player_hands_out_every_player_each_call(fake_player, tmp_path):
    """Share 1 and a window longer than any step: each call waits for all four players."""
    manager = start(fake_player, tmp_path, 4, {}, gather_window=GatherWindow(60.0, 1.0))
    try:
        manager.set_policy(B, UniquePolicy())
        manager.reset()
        check = Checker()
        manager.get_steps()  # the first call hands out the reset
        for _ in range(6):
            steps = manager.get_steps()
            assert sorted(step.worker_id for step in steps) == [0, 1, 2, 3]
            check(steps)
        assert all(check.checked[w] == 6 for w in range(4))
    finally:
        manager.close()


@pytest.mark.timeout(180)
def test_a_window_that_ends_hands_out_what_came(fake_player, tmp_path):
    """A slow player past a short window: the calls return without it (or with it), and every
    step handed out, over calls, is its player's next one with the actions it received."""
    slow = ["--step-latency", "0.3"]
    manager = start(fake_player, tmp_path, 3, {2: slow}, gather_window=GatherWindow(0.02, 1.0))
    try:
        manager.set_policy(B, UniquePolicy())
        manager.reset()
        check = Checker()
        while check.checked.get(2, 0) < 3:
            check(manager.get_steps())
        assert check.checked[0] >= 3 and check.checked[1] >= 3
    finally:
        manager.close()


@pytest.mark.parametrize("seconds,share", [(-1.0, 0.5), (float("inf"), 0.5), (0.01, 0.0), (0.01, 1.5), ("1", 0.5)])
def test_a_window_out_of_range_is_refused(seconds, share):
    with pytest.raises(InvalidInputError):
        GatherWindow(seconds, share)
