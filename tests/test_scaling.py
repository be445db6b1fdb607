"""``benchmarks/scaling.py``: the layout model's table for 64 envs on 2-64 cores (costs measured
here or the 16-core machine's) and its check against runs here; ``benchmarks/parent.py``'s
harness (they run; no speed is asserted)."""

from __future__ import annotations

import re

import pytest

from benchmarks import scaling
from envmanager.core.auto import usable_cores
from envmanager.core.layout import DEFAULT_COSTS, candidates
from envmanager.wire.mailbox import mailbox_supported


def test_the_table_names_a_layout_within_the_cores_and_its_bound_per_machine():
    out = scaling.table(DEFAULT_COSTS)
    rows = [line for line in out.splitlines()[2:] if line.startswith("|")]
    assert len(rows) == len(scaling.STEPS)
    for row in rows:
        cells = row.split("|")[2:-1]
        assert len(cells) == len(scaling.CORES)
        for cores, cell in zip(scaling.CORES, cells, strict=True):
            match = re.search(r"\((\d+)×(\d+)", cell)
            assert match and int(match[1]) <= cores, (cores, cell)  # never more processes than cores
            assert ("workers" in cell or "parent" in cell or "cpu" in cell)
            assert ("shared" in cell) == (int(match[1]) + 1 > cores)


def test_the_sixteen_core_machines_table_and_a_slower_parent(capsys):
    assert scaling.main(["--sixteen"]) == 0
    plain = capsys.readouterr().out
    assert "round trip 85 us" in plain and "16 cores" in plain
    assert scaling.main(["--sixteen", "--slower", "2"]) == 0
    slower = capsys.readouterr().out
    assert f"{DEFAULT_COSTS.parent_s * 2e6:.1f} us per step" in slower and slower != plain


def test_the_check_runs_every_layout_auto_considers_here():
    out = scaling.check(seconds=0.2)
    rows = [line for line in out.splitlines()[2:] if line.startswith("|")]
    cores = usable_cores()
    per_step = len(candidates(4 * cores, cores, lockstep=True))
    assert len(rows) == 2 * per_step
    assert sum("(auto)" in r for r in rows) == 2  # auto's choice marked, once per step cost
    for row in rows:
        predicted, measured = (float(c.replace(",", "")) for c in row.split("|")[4:6])
        assert predicted > 0 and measured > 0
    assert "Costs measured here: round trip" in out


@pytest.mark.skipif(not mailbox_supported(), reason="the mailbox is x86 only (its store order)")
def test_the_saturated_parent_harness_runs(monkeypatch):
    from benchmarks import parent

    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")  # the mailbox is the step queue's
    monkeypatch.setenv("ENVMANAGER_MAILBOX", "on")  # (2 processes and the parent: more than 2 cores have)

    us, steps = parent.per_answer(2, 2, infos=True, rounds=200)
    assert steps == 2 and us > 0
    assert parent.per_step(4, infos=True, rounds=200) > 0  # 4 stopped workers, their stand-ins never asleep
