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
