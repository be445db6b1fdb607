"""A forked worker dies by its own signal, whatever handlers the parent's libraries installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {repo!r})
    os.environ["SDL_VIDEODRIVER"] = "dummy"
    import pygame
    pygame.init()  # installs pygame's "parachute": a segfault becomes an abort
    from envmanager import SubprocessEnvManager
    from envmanager.errors import WorkerDiedError
    from envmanager.testing.envs import EnvFactory
    with SubprocessEnvManager(EnvFactory(fault="segfault", fault_at=1), 1, context="fork", timeout=30) as m:
        m.reset()
        try:
            m.step([0])
            m.step([0])
        except WorkerDiedError as exc:
            print(exc)
    """
)


def test_a_segfault_is_named_even_where_the_parent_installed_pygames_parachute():
    pytest.importorskip("pygame")
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=repo)], capture_output=True, text=True, timeout=120)
    assert "SIGSEGV" in done.stdout, (done.stdout, done.stderr[-2000:])


def _starting_child(conn) -> None:
    """A process as ours start: it reports whether SIGINT came blocked, waits while the parent
    sends it one (a Ctrl-C at the terminal, before the child has left the parent's group), leaves
    the group, then checks that a later SIGINT still interrupts it."""
    import os
    import signal
    import time

    from envmanager.worker.main import own_process_group

    conn.send(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    conn.recv()  # (the parent's SIGINT came meanwhile)
    own_process_group()
    conn.send(os.getpgid(0) == os.getpid())
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a test runner's workers may ignore it)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        conn.send("not interrupted")
    except KeyboardInterrupt:
        conn.send("interrupted")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_ctrl_c_while_a_worker_starts_is_the_parents_not_the_workers_traceback(method):
    """A Ctrl-C reaches the terminal's whole process group: a worker still starting, not yet in a
    group of its own, printed a KeyboardInterrupt traceback from multiprocessing's start-up (seen
    on a loaded machine by ``envmanager check``'s Ctrl-C test). It now starts with SIGINT blocked,
    discards what came before it left the group, and takes later ones as before."""
    import multiprocessing as mp
    import os
    import signal

    from envmanager.core.process import start

    ctx = mp.get_context(method)
    parent_conn, child_conn = ctx.Pipe()
    mask_before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    process = ctx.Process(target=_starting_child, args=(child_conn,))
    start(process)
    child_conn.close()
    try:
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask_before  # (ours as it was)
        assert parent_conn.poll(60) and parent_conn.recv() is True  # blocked from its start
        os.kill(process.pid, signal.SIGINT)
        parent_conn.send("go")
        assert parent_conn.poll(60) and parent_conn.recv() is True  # a group of its own
        assert parent_conn.poll(60) and parent_conn.recv() == "interrupted"
        process.join(60)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join()
        process.close()
        parent_conn.close()


SPAWN_SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp
    import signal
    import sys

    sys.path.insert(0, {repo!r})


    def child(conn):
        conn.send(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))


    if __name__ == "__main__":
        from envmanager.core.process import start

        ctx = mp.get_context("spawn")
        for _ in range(2):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=child, args=(theirs,))
            start(process)
            theirs.close()
            print(ours.recv() if ours.poll(60) else "no answer")
            process.join(60)
        print("parent", signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    """
)


def test_the_first_spawned_worker_of_a_program_starts_with_sigint_blocked_too(tmp_path):
    """multiprocessing starts its resource tracker with a spawn's first process, and unblocks
    SIGINT in the starting thread as it does: the first worker of a program started with it
    unblocked (the suite's own tracker, started before every test, hid it). A fresh program."""
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "spawn_twice.py"
    script.write_text(SPAWN_SCRIPT.format(repo=repo))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.stdout.split("\n") == ["True", "True", "parent False", ""], (done.stdout, done.stderr[-2000:])
