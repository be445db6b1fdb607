"""``benchmarks/scaling.py``: the layout model's costs read from a pinned run, its table for
64 envs on 8-64 cores, and its check against runs here; ``benchmarks/parent.py``'s harness (they
run; no speed is asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import scaling
from envmanager.wire.mailbox import mailbox_supported


def pinned_run() -> dict:
    """A pinned run as ``envmanager bench --json`` writes it, with the figures the model reads."""

    def measurement(median: float, work_us: float | None, per_answer: int) -> dict:
        return {"median": median, "env_steps": [4000, 4000], "answers": [4000 // per_answer] * 2,
                "parent_work_per_answer_us": work_us}

    def scenario(cost: float | None, median: float, single: float, work_us: float | None, per_answer: int) -> dict:
        return {"pinned": True, "step_cost": cost, "measurements": {"envmanager-db": measurement(median, work_us, per_answer)},
                "limit": {"single_env_steps_per_second": [single], "steps_per_second": single}}

    return {"scenarios": {
        "pinned-parent": {"pinned": True, "step_cost": None,
                          "measurements": {"envmanager-db": measurement(60_000, 12.0, 1)}},
        "pinned-5us": scenario(5e-6, 90_000, 130_000, 24.0, 4),
        "pinned-20us": scenario(20e-6, 38_000, 44_000, 30.0, 4),
        "pinned-63us": scenario(63e-6, 14_400, 15_000, 40.0, 4),
        "pinned-200us": scenario(200e-6, 4_800, 4_900, 60.0, 4),
    }}


def test_costs_come_from_the_run():
    costs, steps = scaling.costs_from(pinned_run())
    assert costs.parent_s == pytest.approx(8e-6) and costs.parent_env_s == pytest.approx(4e-6)  # 12 at 1, 24 at 4
    assert 0 < costs.worker_s < 30e-6
    assert set(steps) == {"pinned-5us", "pinned-20us", "pinned-63us", "pinned-200us"}


def test_the_table_names_a_layout_and_its_bound_per_machine(tmp_path, capsys):
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps(pinned_run()))
    assert scaling.main([str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 5us", "| 200us"))]
    assert len(rows) == 2
    for row in rows:
        cells = row.split("|")[2:-1]
        assert len(cells) == len(scaling.CORES)
        assert all(("workers" in c or "parent" in c or "cpu" in c) and "×" in c for c in cells)
    assert scaling.main([str(path), "--before"]) == 0


def test_the_check_runs_both_regimes_here():
    out = scaling.check(seconds=0.2)
    rows = [line for line in out.splitlines()[2:] if line.startswith("|")]
    assert len(rows) == 4
    assert sum("own cores" in r for r in rows) == 2 and sum("shared cores" in r for r in rows) == 2
    for row in rows:
        predicted, measured = (float(c.replace(",", "")) for c in row.split("|")[4:6])
        assert predicted > 0 and measured > 0


@pytest.mark.skipif(not mailbox_supported(), reason="the mailbox is x86 only (its store order)")
def test_the_saturated_parent_harness_runs(monkeypatch):
    from benchmarks import parent

    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")  # the mailbox is the step queue's

    us, steps = parent.per_answer(2, 2, infos=True, rounds=200)
    assert steps == 2 and us > 0
    assert parent.per_step(2, infos=True, rounds=200) > 0
