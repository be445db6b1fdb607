"""Every answer carries its slot's generation (#30 item 4): ``StepInfo.generation`` and
``StepBatch.generations`` say which generation of the slot's env answered — as it was when the
answer came, not as the pool is when it is read. Real worker processes, real gymnasium envs."""

from __future__ import annotations

import time
from pathlib import Path

from envmanager import SubprocessEnvManager, WorkerError
from envmanager.core.batch import BatchEnvManager
from envmanager.testing.envs import ControlledEnv, EnvFactory

DEADLINE_S = 30.0  # loops give up after this long (a loaded machine, not a timing claim)


class HeldRestart:
    """``ControlledEnv`` s; an env made again (in a restarted process) waits until the test
    writes ``go`` (bounded), so the restart's fresh reset cannot come back before the test
    has read what the old process answered."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def __call__(self, slot: int) -> ControlledEnv:
        made = self.directory / f"made-{slot}"
        if made.exists():
            deadline = time.monotonic() + DEADLINE_S
            while not (self.directory / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        made.touch()
        return ControlledEnv(slot)


def test_an_answer_taken_before_a_restart_carries_the_generation_that_answered(tmp_path):
    error = WorkerError(0, "builtins.RuntimeError", "found by the caller", "traceback", None, 0)
    with BatchEnvManager(HeldRestart(str(tmp_path)), 2, autoreset_mode="disabled", restart_workers=True, timeout=30) as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        reset = m.receive_reset_batch()
        assert reset.generations is not None and reset.generations[[0, 1]].tolist() == [0, 0]
        m.send_batch([0], [1])
        m.wait_idle([0])  # slot 0's answer is in, not handed out
        assert m.report_failure(0, error) is None  # its process is restarted: the pool is one generation on
        assert m.generation(0) == 1
        batch = m.receive_batch(1)  # the old process's answer: its generation, not the pool's now
        assert batch.slots.tolist() == [0] and not batch.interrupted
        assert int(batch.generations[0]) == 0
        (tmp_path / "go").touch()
        batch = m.receive_batch(1)  # the fresh reset of the new process
        assert batch.slots.tolist() == [0] and batch.interrupted == {0}
        assert int(batch.generations[0]) == 1 and int(batch.generations[1]) == 0
        m.send_batch([0, 1], [1, 1])
        batch = m.receive_batch(2)
        assert batch.generations[[0, 1]].tolist() == [1, 0]


def test_step_infos_carry_the_generation_a_rebuild_gave_only_its_slot():
    with SubprocessEnvManager(EnvFactory(per_env={1: {"fault": "raise", "fault_at": 3}}), 2, envs_per_worker=2,
                              timeout=30, restart_workers=True) as m:
        infos = m.reset(seed=[10, 11])
        assert [i.generation for i in infos] == [0, 0]
        seen: list = []

        def rebuilt_steps() -> int:  # the rebuilt env 1 raises again in its third step: two are taken
            cuts = [n for n, i in enumerate(seen) if i.interrupted]
            return sum(i.worker_id == 1 for i in seen[cuts[0] + 1:]) if cuts else 0

        deadline = time.monotonic() + DEADLINE_S
        while rebuilt_steps() < 2:
            assert time.monotonic() < deadline
            seen += m.step(dict.fromkeys(m.idle_worker_ids, 1))
        at = next(n for n, i in enumerate(seen) if i.interrupted)
        assert seen[at].worker_id == 1 and seen[at].generation == 1
        assert {i.generation for i in seen[at + 1:] if i.worker_id == 1} == {1}  # the rebuilt env's answers
        assert {i.generation for i in seen[:at] if i.worker_id == 1} == {0}
        assert {i.generation for i in seen if i.worker_id == 0} == {0}  # its neighbour's env was never replaced


def test_a_process_restart_raises_the_generation_of_every_slot_it_hosts():
    with BatchEnvManager(EnvFactory(per_env={0: {"fault": "exit", "fault_at": 2}}), 3, envs_per_worker=2,
                         autoreset_mode="disabled", restart_workers=True, timeout=30) as m:
        m.send_reset({s: (s, None) for s in range(3)})
        m.receive_reset_batch()
        got: dict[int, list[tuple[int, bool]]] = {0: [], 1: [], 2: []}
        deadline = time.monotonic() + DEADLINE_S
        while not ((1, True) in got[0] and (1, True) in got[1]) or len(got[2]) < 3:
            assert time.monotonic() < deadline
            cut = (1, True) in got[0]  # then slots 0 and 1 are left alone (the fresh env 0 would exit again)
            idle = [s for s in m.idle_worker_ids if s == 2 or not cut]
            if idle:
                m.send_batch(idle, [1] * len(idle))
            batch = m.receive_batch(1)
            for slot in batch.slots.tolist():
                got[slot].append((int(batch.generations[slot]), slot in batch.interrupted))
        assert (1, True) in got[0] and (1, True) in got[1]  # both slots of the restarted process
        assert {g for g, _ in got[2]} == {0}  # the other process was never replaced
        assert m.generation(0) == m.generation(1) == 1
