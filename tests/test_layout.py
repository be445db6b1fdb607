"""The layout model (``envmanager.core.layout``): what each way of laying envs over processes
should deliver, and the choice among them. Properties over random machines and envs, no timing."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from envmanager.core.layout import REFERENCE, Layout, best_layout, candidates, predict

n_envs = st.integers(1, 128)
cores = st.integers(2, 64)
step_costs = st.sampled_from([2e-6, 5e-6, 20e-6, 63e-6, 200e-6, 1e-3, 5e-3])


@settings(max_examples=200, deadline=None)
@given(n_envs, cores, st.booleans())
def test_candidates_cover_every_env_once_and_are_distinct(n, c, lockstep):
    layouts = candidates(n, c, lockstep)
    assert len({(lay.envs_per_worker, lay.lanes) for lay in layouts}) == len(layouts)
    for lay in layouts:
        assert (lay.processes - 1) * lay.envs_per_worker < n <= lay.processes * lay.envs_per_worker
        assert lay.lanes == 1 or (lay.envs_per_worker >= 2 and not lockstep)
    assert Layout(n, 1, 1) in layouts and Layout(1, n, 1) in layouts


@settings(max_examples=200, deadline=None)
@given(n_envs, cores, step_costs, st.booleans())
def test_no_layout_beats_the_machine_or_the_parent(n, c, step, lockstep):
    for lay in candidates(n, c, lockstep):
        p = predict(lay, n, step, c, REFERENCE, lockstep)
        e = lay.envs_per_worker / lay.lanes
        assert 0 < p.steps_per_s <= c / step  # not faster than every core stepping envs
        assert p.steps_per_s <= e / (REFERENCE.parent_s + REFERENCE.parent_env_s * e) * 1.000001  # the parent's cap
        assert p.own_cores == (lay.processes + 1 <= c)


@settings(max_examples=200, deadline=None)
@given(n_envs, cores, step_costs, st.booleans())
def test_the_choice_is_the_fastest_within_two_percent_with_the_fewest_processes(n, c, step, lockstep):
    best, every = best_layout(n, step, c, REFERENCE, lockstep)
    fastest = max(p.steps_per_s for p in every)
    assert best.steps_per_s >= 0.98 * fastest
    assert all(p.layout.processes >= best.layout.processes for p in every if p.steps_per_s >= 0.98 * fastest)
    assert not (lockstep and best.layout.double_buffer)


@settings(max_examples=100, deadline=None)
@given(cores, step_costs, st.floats(1.01, 4.0))
def test_a_slower_parent_never_makes_answers_smaller(c, step, slower):
    """Bigger answers lift the parent's cap: a costlier parent never picks smaller answers."""
    fast = best_layout(64, step, c, REFERENCE)[0].layout
    slow_costs = replace(REFERENCE, parent_s=REFERENCE.parent_s * slower)
    slow = best_layout(64, step, c, slow_costs)[0].layout
    assert slow.envs_per_worker / slow.lanes >= fast.envs_per_worker / fast.lanes or slow.processes <= fast.processes


def test_where_the_workers_could_go_faster_the_parent_is_not_the_bound_if_a_layout_avoids_it():
    """The issue's goal for the model: 64 envs, the parent not the bound up to 8 cores at 20 us
    and up to 32 cores at 200 us (it picks answers big enough)."""
    for c, step in [(4, 20e-6), (8, 20e-6), (8, 200e-6), (16, 200e-6), (32, 200e-6)]:
        best, _ = best_layout(64, step, c, REFERENCE)
        assert best.bound != "parent", (c, step, best)


def test_with_envs_per_worker_given_only_the_lanes_are_chosen():
    best, every = best_layout(8, 20e-6, 4, REFERENCE, envs_per_worker=4)
    assert {p.layout for p in every} == {Layout(2, 4, 1), Layout(2, 4, 2)}
    assert best.layout.envs_per_worker == 4
    best, every = best_layout(8, 20e-6, 4, REFERENCE, lockstep=True, envs_per_worker=4)
    assert [p.layout for p in every] == [Layout(2, 4, 1)]
