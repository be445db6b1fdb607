"""``envmanager check``'s advice: which layout of N envs is fastest on this machine.

The advice is the feature, so these tests assert which layout is recommended -- never a speed.
The two envs sit far from the crossover: an env that does next to nothing per step (~1 µs),
where an in-process ``SyncVectorEnv`` wins by several times (CartPole, ~6 µs a step, is at the
crossover on 2 cores since one process with the parent's core stepped through the mailbox
matches it), and a 1 ms CPU-bound env, where processes win by ~2x on 2 cores, so a loaded
machine does not flip the answer.
"""

from __future__ import annotations

import pytest

from check_envs import FreeEnv, MillisecondEnv, StepHangingEnv
from envmanager.check import check
from envmanager.core.auto import usable_cores

CORES = usable_cores()
needs_two_cores = pytest.mark.skipif(CORES < 2, reason="processes cannot beat one core with one core")


@needs_two_cores
def test_a_nearly_free_env_is_faster_in_process():
    report = check(FreeEnv, num_envs=8, start_methods=["fork"], measure_s=0.5)
    assert report.ok, report.format()
    advice = report.advice
    assert advice.recommended == "in-process", report.format()
    assert advice.kind == "cpu-bound, even"
    measured = {lay.id: lay.steps_per_s for lay in advice.layouts if lay.steps_per_s is not None}
    assert {"in-process", "k-per-process", "one-per-process", "double-buffered"} <= set(measured) <= {
        "in-process", "k-per-process", "one-per-process", "double-buffered", "model"}
    assert not any(lay.estimated for lay in advice.layouts)
    assert advice.how == "envs = gymnasium.vector.SyncVectorEnv([make_env] * 8)"  # (a factory of no argument)
    assert "Recommended: in this process, gymnasium.vector.SyncVectorEnv" in report.format()


def test_the_in_process_advice_builds_the_envs_as_the_factory_is_called():
    """``functools.partial(make_env, i)`` was advised for every factory: a gymnasium id has no
    ``make_env``, and a factory of no argument fails called with one."""
    from envmanager.check.advice import _per_env
    from envmanager.check.target import resolve

    def make_env(worker_id):
        return FreeEnv()

    assert _per_env(resolve("CartPole-v1")).format(n=8) == "[lambda: gymnasium.make('CartPole-v1')] * 8"
    assert _per_env(resolve(FreeEnv)).format(n=8) == "[make_env] * 8"
    assert _per_env(resolve(make_env)).format(n=8) == "[functools.partial(make_env, i) for i in range(8)]"


@needs_two_cores
def test_a_1ms_cpu_bound_env_goes_to_processes_packed_as_auto_packs_them():
    report = check(MillisecondEnv, num_envs=8, start_methods=["fork"], measure_s=0.5)
    assert report.ok, report.format()
    advice = report.advice
    assert advice.kind == "cpu-bound, even", report.format()
    assert advice.recommended in ("k-per-process", "model"), report.format()  # auto's choice: one of the two
    chosen = advice.layout(advice.recommended)
    assert chosen.envs_per_process > 1 and chosen.processes >= min(CORES, 8 // chosen.envs_per_process)
    assert "the model's choice" in chosen.note
    assert ("envs_per_worker=\"auto\"" if advice.recommended == "model" else f"envs_per_worker={8 // CORES}") in advice.how
    assert advice.step["cpu_median_us"] >= 900  # the measured cost is the env's


def test_double_buffering_is_measured_only_where_the_parent_has_a_core():
    report = check("CartPole-v1", num_envs=8, start_methods=["fork"], measure_s=0.2, cores=4)
    layout = report.advice.layout("double-buffered")
    assert layout.envs_per_process == 3 and layout.processes == 3 and layout.steps_per_s is not None  # fewer than the cores
    two = check("CartPole-v1", num_envs=8, start_methods=["fork"], measure_s=0.2, cores=2)
    layout = two.advice.layout("double-buffered")  # one process and the parent: each has a core
    assert layout.envs_per_process == 8 and layout.processes == 1 and layout.steps_per_s is not None
    one = check("CartPole-v1", num_envs=8, start_methods=["fork"], measure_s=0.2, cores=1)
    layout = one.advice.layout("double-buffered")
    assert layout.steps_per_s is None and "the parent has no core of its own" in layout.note


def test_no_advice_for_an_env_that_hangs():
    report = check(StepHangingEnv, start_methods=["fork"], deadline=1.0)
    assert report.advice is None and any(n.startswith("no advice: the env hangs") for n in report.notes)
