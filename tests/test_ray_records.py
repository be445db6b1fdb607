"""The Ray driver's records over global slots (#30 item 3): a node started again in place of a
lost one resumes from them, so no episode id is given twice — also that of an episode cut
before its first row, which reaches the driver only in the node's list of cut episodes.
A real local Ray session, real env processes."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the Ray backend needs the extra: pip install 'envmanager[ray]'")

from envmanager.ray import RaySampler  # noqa: E402
from ray_helpers import NODE_START_S, IdPolicy, alive, node_pids, ray_session, reset_raising_once_factory  # noqa: E402,F401

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):  # noqa: F811
    yield


@pytest.fixture(autouse=True)
def no_leaks():
    """Ray's processes live for the module: the test checks its nodes' processes are gone."""
    yield


def test_an_episode_cut_before_its_first_row_on_a_lost_node_never_has_its_id_again(tmp_path):
    # Slot 3's first env raises in its first reset: the node's sampler rebuilds it and cuts that
    # episode (id 3) before its first row. One step per fragment, in rounds: slot 2 takes them,
    # so no row of slot 3 reaches the driver before node 1 is lost.
    sampler = RaySampler(reset_raising_once_factory(str(tmp_path / "raised"), 3), IdPolicy(), nodes=2, envs_per_node=2,
                         fragment_steps=1, first_ready=False, seed=1, timeout=60.0, start_timeout=NODE_START_S,
                         restart_workers=True)
    try:
        first = sampler.obtain_steps(2)  # one round: a fragment from each node
        assert 3 in sampler.cut_episodes and 3 not in first.worker_ids.tolist()
        assert sampler.records[3].started == 1 and sampler.records[3].seed is None
        pid = sampler.node_info()[1]["pid"]
        sampler.kill_node(1)
        # Gone before the next call (ray.kill returns before it is; a method called at once may
        # still be served by the actor, as CI once saw).
        assert not alive([pid], timeout=60)
        batch = sampler.obtain_exact_episodes([0, 0, 1, 1])  # asked of node 1's replacement
        assert sampler.restart_count(1) == 1
        pids = node_pids(sampler)
    finally:
        sampler.close()
    assert not alive(pids)
    ids = set(batch.episode_ids.tolist())
    assert not ids & set(sampler.cut_episodes), f"a cut episode's id was given again: {sorted(ids)}"
    slot_3 = set(batch.episode_ids[batch.worker_ids == 3].tolist())
    assert slot_3 and min(slot_3) > 3 and all(e % 4 == 3 for e in slot_3)
    assert not batch.interrupted.any()  # whole episodes of the new node, none of them cut


def test_an_answer_of_a_replaced_node_is_refused_by_the_records(tmp_path):
    # #30 item 4: every answer carries its node's generation (the supervisor's restart count);
    # the records book only the generation their slots resumed. An answer node 1 gave before it
    # was replaced, booked after its replacement started, would hand out rows of episodes the
    # replacement may number again: it is dropped whole, counted.
    sampler = RaySampler(reset_raising_once_factory(str(tmp_path / "raised"), 99), IdPolicy(), nodes=2,
                         envs_per_node=2, fragment_steps=4, first_ready=False, seed=1, timeout=60.0,
                         start_timeout=NODE_START_S)
    try:
        node = sampler._pool.nodes[1]
        request = sampler._pool.submit(node, "steps", 4)
        stale = sampler._pool.wait()  # node 1's answer, generation 0, not booked yet
        assert [r for r, _ in stale] == [request] and stale[0][1][1]["generation"] == 0
        pid = sampler.node_info()[1]["pid"]
        sampler.kill_node(1)
        assert not alive([pid], timeout=60)  # gone (ray.kill returns before it is)
        sampler.obtain_steps(8)
        while 3 not in sampler.obtain_steps(8).worker_ids:  # node 1's replacement delivers
            pass
        assert sampler.restart_count(1) == 1 and sampler.node_info()[1]["generation"] == 1
        assert [sampler.records[s].generation for s in range(4)] == [0, 0, 1, 1]
        held, records = sampler.buffered_steps, list(sampler.records.slots)
        assert sampler._book(stale) == []
        assert sampler.buffered_steps == held, "rows of a replaced node's generation were booked"
        assert sampler.records.slots == records, "a replaced node's answer moved the records"
        assert sampler.stats.counters["stale_answers"] == 1 and sampler.stats.counters["dropped_steps"] >= 4
        assert 3 in sampler.obtain_steps(16).worker_ids  # the current generation's answers are booked
        pids = node_pids(sampler)
    finally:
        sampler.close()
    assert not alive(pids)


class Rows:
    """What the records read of a batch: worker ids, episode ids, dones."""

    def __init__(self, slots: list[int], episodes: list[int]) -> None:
        import numpy as np

        self.worker_ids, self.episode_ids = np.array(slots), np.array(episodes)
        self.dones = np.zeros(len(slots), dtype=bool)

    def __len__(self) -> int:
        return len(self.worker_ids)


def test_records_refuse_rows_of_another_node_generation():
    from envmanager.ray.records import SlotRecords

    records = SlotRecords([None] * 4)
    assert records.resume([2, 3], generation=1) == ([None, None], [0, 0])
    assert not records.booked(Rows([2, 3], [2, 3]), [1, 1], offset=2, generation=0)  # type: ignore[arg-type]
    assert [r.started for r in records.slots] == [0, 0, 0, 0] and records.running() == set()
    assert records.booked(Rows([2, 3], [2, 3]), [1, 1], offset=2, generation=1)  # type: ignore[arg-type]
    assert [r.started for r in records.slots] == [0, 0, 1, 1] and records.running() == {2, 3}
