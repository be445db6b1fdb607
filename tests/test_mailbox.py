"""The mailbox (``envmanager.wire.mailbox``): requests and answers through shared memory, the
pipes written only to wake a sleeping reader or for what does not fit the ring.

First the protocol in one process (order, what fits, when a wake-up is owed), then real worker
processes with the mailbox on: results equal to stepping in process, answers too big for the
ring and requests on the pipe in order, and every fault while the other side spins: a worker
killed or hung while the parent waits, the parent killed while its workers spin.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envmanager import WorkerDiedError, WorkerTimeoutError
from envmanager.core.batch import BatchEnvManager
from envmanager.testing.envs import ControlledEnv, EnvFactory
from envmanager.wire.mailbox import (
    ANSWER_BYTES,
    BUSY,
    MARGIN_NS,
    ON_PIPE,
    REQUEST_BYTES,
    SLEEPING,
    WAKE,
    Mailboxes,
    WorkerMailbox,
    mailbox_supported,
)
from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.wire.messages import Stepped, decode_request_header, encode_answer, encode_raw_step, encode_request
from envmanager.wire.step_queue import write_frame
from envmanager.wire.transport import MailboxLink
from process_helpers import alive

pytestmark = pytest.mark.skipif(not mailbox_supported(), reason="the mailbox is x86 only (its store order)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _step_queue(monkeypatch):
    """The mailbox lives in the step-queue transport: the suite's portable run keeps it here."""
    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "step_queue")


@pytest.fixture
def boxes():
    made = Mailboxes.create(3)
    assert made is not None
    workers = [WorkerMailbox(made.file, made.layout, p) for p in range(3)]
    yield made, workers
    for w in workers:
        w.close()
    made.close()


# ---------------------------------------------------------------------------------------------
# The protocol, in one process


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 2 * REQUEST_BYTES)), min_size=1, max_size=40),
       st.randoms(use_true_random=False))
def test_requests_come_out_in_the_order_sent_inline_or_on_the_pipe(sends, rnd):
    """Whatever mix of small (inline) and big (on the pipe, announced) requests, each process
    takes its own in the order sent, never more than three ahead of it (its lanes and a CLOSE)."""
    made = Mailboxes.create(3)
    assert made is not None
    workers = [WorkerMailbox(made.file, made.layout, p) for p in range(3)]
    try:
        sent: list[list[bytes]] = [[], [], []]
        taken: list[list[bytes]] = [[], [], []]
        pipes: list[list[bytes]] = [[], [], []]  # what the parent put on each process's pipe

        def take_one(p: int) -> None:
            got = workers[p].take()
            assert got is not None
            if got == ON_PIPE:
                got = pipes[p].pop(0)
                while got == WAKE:  # wake-ups are skipped on the way to the announced request
                    got = pipes[p].pop(0)
            taken[p].append(bytes(got))

        for p, size in sends:
            if len(sent[p]) - len(taken[p]) == 3:  # as many unanswered as a process can have
                take_one(p)
            data = bytes([len(sent[p]) % 251]) * size
            sent[p].append(data)
            frame = made.send(p, data)
            if frame is not None:
                pipes[p].append(frame)
            assert (frame == data) == (size > REQUEST_BYTES)  # big ones go on the pipe, announced
            behind = [q for q in range(3) if len(taken[q]) < len(sent[q])]
            if behind and rnd.random() < 0.5:  # a worker takes one meanwhile
                take_one(rnd.choice(behind))
        for p in range(3):
            while len(taken[p]) < len(sent[p]):
                take_one(p)
            assert workers[p].take() is None  # nothing more
            assert taken[p] == sent[p]
    finally:
        for w in workers:
            w.close()
        made.close()


def test_a_wake_up_is_owed_only_when_the_reader_may_be_asleep(boxes):
    made, workers = boxes
    w = workers[1]
    now = time.monotonic_ns()
    w.busy()
    assert made.send(1, b"a") is None  # busy: it looks at its ring before it blocks
    w.spinning(now + 10 * MARGIN_NS)
    assert made.send(1, b"b") is None  # spinning well past now
    w.spinning(now + MARGIN_NS // 2)
    assert made.send(1, b"c") == WAKE  # its spin may end before it sees the entry
    w.sleeping()
    assert made.send(1, b"d") == WAKE
    assert [bytes(w.take()) for _ in range(4)] == [b"a", b"b", b"c", b"d"]  # type: ignore[arg-type]
    # the same rule for answers, on the parent's word
    notice = b"".join(encode_answer(Cmd.STEP, 1, 5, 0.0, Stepped((1e-6,))))
    made.parent_busy()
    assert w.post(notice) is False
    made.parent_spinning(time.monotonic_ns() + 10 * MARGIN_NS)
    assert w.post(notice) is False
    made.parent_spinning(time.monotonic_ns())
    assert w.post(notice) is True
    made.parent_sleeping()
    assert w.post(notice) is True
    assert w.post(b"x" * (ANSWER_BYTES + 1)) is None  # too big: the step queue takes it
    assert made.waiting()
    out: list = []
    made.take(out)
    assert [(n.cmd, n.process, n.seq) for n in out] == [(Cmd.STEP, 1, 5)] * 4
    assert not made.waiting()


def test_answers_of_several_processes_and_a_reset_ring(boxes):
    made, workers = boxes
    made.parent_busy()
    for seq in range(1, 4):
        for p in (2, 0):
            assert workers[p].post(b"".join(encode_answer(Cmd.STEP, p, 10 * p + seq, 0.0, Stepped((seq,))))) is False
    out: list = []
    made.take(out)
    assert [(n.process, n.seq) for n in out] == [(0, 1), (0, 2), (0, 3), (2, 21), (2, 22), (2, 23)]
    made.reset(2)  # a new process 2: its rings start over, the others' go on
    fresh = WorkerMailbox(made.file, made.layout, 2)
    try:
        assert made.send(2, b"first") is None  # the new worker counts as busy until it says otherwise
        assert bytes(fresh.take()) == b"first"  # type: ignore[arg-type]
        fresh.post(b"".join(encode_answer(Cmd.STEP, 2, 99, 0.0, Stepped((0.0,)))))
        workers[0].post(b"".join(encode_answer(Cmd.STEP, 0, 4, 0.0, Stepped((0.0,)))))
        out.clear()
        made.take(out)
        assert [(n.process, n.seq) for n in out] == [(0, 4), (2, 99)]
    finally:
        fresh.close()


def test_a_sleeping_worker_link_is_woken_and_takes_requests_in_order():
    """A worker thread blocked on its pipe: inline requests wake it with an empty frame,
    requests too big for the ring come on the pipe, a CLOSE ends it; all in the order sent."""
    made = Mailboxes.create(1)
    assert made is not None
    made.reset(0)  # as for a new process: it counts as busy until it says otherwise
    box = WorkerMailbox(made.file, made.layout, 0)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    queue_reader, queue_writer = ctx.Pipe(duplex=False)
    link = MailboxLink(child, queue_writer, 0.0, box)  # no spin beyond the margin: it sleeps soon
    got: list[bytes] = []

    def worker() -> None:
        while True:
            data = link.read()
            got.append(bytes(data))
            if decode_request_header(data)[0] is Cmd.CLOSE:
                return

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    sent = []
    try:
        for k in range(30):
            big = k % 7 == 3
            data = encode_raw_step(k + 1, bytes(2 * (REQUEST_BYTES if big else 2)))
            deadline = time.monotonic() + 10
            while len(got) < len(sent) or made._words[made.layout.region(0) // 8] != SLEEPING:  # taken, and asleep
                assert time.monotonic() < deadline
                time.sleep(0.0005)
            frame = made.send(0, data)
            if frame is not None:
                write_frame(parent.fileno(), frame)
            sent.append(data)
        close = encode_request(Cmd.CLOSE, -1)
        parent.send_bytes(close)  # CLOSE goes on the pipe only
        sent.append(close)
        thread.join(10)
        assert not thread.is_alive()
        assert got == sent
    finally:
        for end in (parent, child, queue_reader, queue_writer):
            end.close()
        box.close()
        made.close()


# ---------------------------------------------------------------------------------------------
# Real worker processes with the mailbox on (spin_s > 0: as where every process has a core)


def _manager(n: int, epw: int, **kwargs) -> BatchEnvManager:
    m = BatchEnvManager(kwargs.pop("factory", EnvFactory()), n, envs_per_worker=epw, context="fork", spin_s=100e-6,
                        double_buffer=epw > 1, **kwargs)
    assert m.pool.mailboxes is not None
    return m


class BigInfoEnv(ControlledEnv):
    """Every third step returns an info too big for the mailbox's ring (the step queue takes it)."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.t % 3 == 0:
            info = {**info, "blob": "x" * (2 * ANSWER_BYTES)}
        return obs, reward, terminated, truncated, info


def big_info_env(env_id: int) -> ControlledEnv:
    return BigInfoEnv(env_id, episode_length=1000)


@pytest.mark.parametrize(("n", "epw"), [(2, 2), (4, 2), (3, 1)])
def test_steps_through_the_mailbox_match_the_envs_stepped_in_process(n, epw):
    """Every answer once, in order, with the action the env got and the infos it returned, big
    ones (over the step queue) among small ones; calls and resets with big options (requests on
    the pipe, announced in the ring) between steps."""
    rng = np.random.default_rng(0)
    local = [BigInfoEnv(i, episode_length=1000) for i in range(n)]
    with _manager(n, epw, factory=big_info_env) as m:
        pending: dict[int, int] = {}
        steps = [0] * n

        def check(batch) -> None:
            for slot in batch.slots.tolist():
                obs, reward, _, _, info = local[slot].step(pending.pop(slot))
                steps[slot] += 1
                np.testing.assert_array_equal(m.results.observation[slot], obs)
                assert m.results.reward[slot] == reward
                assert batch.infos[slot] == info

        for round_ in range(6):
            seeds = {i: (10 * round_ + i, {"note": "x" * (2 * REQUEST_BYTES)}) for i in range(n)}
            m.send_reset(seeds)  # big options: on the pipe
            m.receive_reset_batch()
            for i, env in enumerate(local):
                env.reset(seed=10 * round_ + i)
            for _ in range(60):
                idle = [s for s in m.idle_worker_ids if s not in pending]
                if idle:
                    actions = rng.integers(0, 3, len(idle))
                    m.send_batch(np.array(idle), actions)
                    pending.update(zip(idle, actions.tolist(), strict=True))
                check(m.receive_batch(1))
            while pending:
                check(m.receive_batch(1))
            assert m.get_attr("episode_length") == [1000] * n  # a small request, inline
        assert min(steps) > 50


def test_a_worker_killed_while_the_parent_spins_is_a_death_naming_its_slot():
    with _manager(2, 2, factory=EnvFactory(step_time=2.0)) as m:  # (long: the kill lands mid-step on a loaded machine too)
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        m.send_batch(np.array([0, 1]), np.array([1, 1]))
        pid = m.processes[0].pid
        threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(WorkerDiedError) as info:
            while True:
                m.receive_batch(2, timeout=30)
        assert info.value.worker_id in (0, 1) and "SIGKILL" in str(info.value)


def test_a_worker_killed_while_the_parent_spins_is_restarted_and_its_rings_start_over():
    with _manager(2, 2, restart_workers=True, max_lifetime_restarts=3) as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        for k in range(200):
            if k == 50:
                os.kill(m.processes[0].pid, signal.SIGKILL)
            idle = m.idle_worker_ids
            if idle:
                m.send_batch(np.array(idle), np.ones(len(idle), dtype=np.int64))
            m.receive_batch(1, timeout=30)
        assert m.restart_count(0) == 1 and m.generation(0) == 1
        m.wait_idle()
        m.drain()
        before = m.results.observation[:, 0].copy()  # each env's step count in its episode
        m.send_batch(np.array([0, 1]), np.array([1, 1]))
        got = m.receive_batch(2, timeout=30)
        assert sorted(got.slots.tolist()) == [0, 1]
        np.testing.assert_array_equal(m.results.observation[:, 0], before + 1)


def test_a_worker_hung_while_the_parent_spins_misses_its_deadline():
    factory = EnvFactory(per_env={1: {"fault": "hang", "fault_at": 3}})
    with _manager(2, 2, factory=factory, timeout=1.0) as m:
        m.send_reset({0: (0, None), 1: (1, None)})
        m.receive_reset_batch()
        with pytest.raises(WorkerTimeoutError) as info:
            for _ in range(20):
                idle = m.idle_worker_ids
                if idle:
                    m.send_batch(np.array(idle), np.ones(len(idle), dtype=np.int64))
                m.receive_batch(1)
        assert info.value.hung and 1 in info.value.worker_ids


def test_idle_workers_and_parent_end_up_blocked_not_spinning():
    """Nothing in flight: every worker says SLEEPING (blocked on its pipe) and the parent BUSY
    (not in a wait): no CPU is spent while nothing is in flight."""
    with _manager(4, 2) as m:
        m.send_reset({i: (i, None) for i in range(4)})
        m.receive_reset_batch()
        for _ in range(20):
            m.send_batch(np.array(m.idle_worker_ids), np.ones(len(m.idle_worker_ids), dtype=np.int64))
            m.wait_idle()
            m.receive_batch(0)
        box = m.pool.mailboxes
        assert box is not None
        words = [box.layout.region(p) // 8 for p in range(len(m.processes))]
        deadline = time.monotonic() + 10
        while any(box._words[w] != SLEEPING for w in words) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [box._words[w] for w in words] == [SLEEPING] * len(words)
        assert box._words[0] == BUSY


PARENT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    import numpy as np
    from envmanager.core.batch import BatchEnvManager
    from envmanager.testing.envs import EnvFactory
    m = BatchEnvManager(EnvFactory(), 2, envs_per_worker=2, double_buffer=True, spin_s=1e-3, context="fork")
    assert m.pool.mailboxes is not None
    m.send_reset({{0: (0, None), 1: (1, None)}})
    m.receive_reset_batch()
    print(" ".join(str(w.pid) for w in m.processes), flush=True)
    while True:
        m.send_batch(np.array(m.idle_worker_ids), np.ones(len(m.idle_worker_ids), dtype=np.int64))
        m.receive_batch(1)
    """
)


def test_workers_spinning_on_their_ring_exit_when_the_parent_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", PARENT.format(repo=REPO)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
    assert pids, proc.stderr.read()  # type: ignore[union-attr]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    left = alive(pids)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers outlived their parent: {left}"


def test_the_mailbox_is_used_only_where_the_processes_spin(monkeypatch):
    monkeypatch.delenv("ENVMANAGER_MAILBOX", raising=False)
    with BatchEnvManager(EnvFactory(), 2, spin_s=0.0, context="fork") as m:
        assert m.pool.mailboxes is None
    monkeypatch.setenv("ENVMANAGER_MAILBOX", "off")
    with BatchEnvManager(EnvFactory(), 2, spin_s=1e-4, context="fork") as m:
        assert m.pool.mailboxes is None
    monkeypatch.setenv("ENVMANAGER_MAILBOX", "on")
    with BatchEnvManager(EnvFactory(), 2, spin_s=0.0, context="fork") as m:
        assert m.pool.mailboxes is not None
    monkeypatch.setenv("ENVMANAGER_TRANSPORT", "portable")
    with BatchEnvManager(EnvFactory(), 2, spin_s=1e-4, context="fork") as m:
        assert m.pool.mailboxes is None  # the portable transport has none
