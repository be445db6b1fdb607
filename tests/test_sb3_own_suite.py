"""SB3's own ``tests/test_vec_envs.py`` (and its other SubprocVecEnv cases that add to it),
run against ``envmanager.sb3.SubprocVecEnv``.

Drop-in means SB3's own suite is the standard. The installed SB3 version's sdist is downloaded
with pip (cached under ``.sb3-sdist/`` in the repo, gitignored), its vec-env test module is
extracted and run by pytest in a subprocess whose conftest rebinds SB3's ``SubprocVecEnv`` to
ours before the module imports it (the cases parametrized with DummyVecEnv are left out:
they test SB3, not us). Skips only when SB3 is missing or the sdist cannot be had.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sb3 = pytest.importorskip("stable_baselines3")

import envmanager  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".sb3-sdist"
SUITE = "test_vec_envs.py"
#: SB3's other tests that build a SubprocVecEnv, those that add what SUITE does not check (real
#: training with Dict observations and their terminal observations, HER's env_method calls,
#: make_vec_env's options); the rest of them repeat these paths.
MORE = [
    "test_dict_env.py::test_multiprocessing[A2C]",
    "test_dict_env.py::test_multiprocessing[SAC]",
    "test_her.py::test_multiprocessing[False-DQN]",
    "test_utils.py::test_custom_vec_env",
    "test_utils.py::test_make_vec_env[RecordEpisodeStatistics-SubprocVecEnv-2-<lambda>]",
]

CONFTEST = '''
import stable_baselines3.common.vec_env as vec_env
import stable_baselines3.common.vec_env.subproc_vec_env as subproc_vec_env

from envmanager.sb3 import SubprocVecEnv

vec_env.SubprocVecEnv = SubprocVecEnv
subproc_vec_env.SubprocVecEnv = SubprocVecEnv


def pytest_collection_finish(session):
    # Every collected test must see ours, or the run proves nothing.
    modules = {item.module for item in session.items}
    assert modules and all(m.SubprocVecEnv is SubprocVecEnv for m in modules), "SubprocVecEnv not rebound"
    print("\\nENVMANAGER-REBOUND", len(session.items))
'''


def _sdist(version: str) -> Path:
    """The sdist of SB3 ``version``, downloaded once into the cache."""
    CACHE.mkdir(exist_ok=True)
    found = sorted(CACHE.glob(f"stable_baselines3-{version}.tar.gz"))
    if found:
        return found[0]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         f"stable-baselines3=={version}", "-d", str(CACHE)],
        capture_output=True, text=True, timeout=180,
    )
    found = sorted(CACHE.glob(f"stable_baselines3-{version}.tar.gz"))
    if done.returncode != 0 or not found:
        pytest.skip(f"cannot download the stable-baselines3 {version} sdist: {done.stderr.strip()[-500:]}")
    return found[0]


def _extract_tests(sdist: Path, into: Path) -> Path:
    """SB3's tests/ folder (its modules and any helpers they import) into ``into``."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if re.match(r"[^/]+/tests/[^/]+\.py$", m.name) and m.isfile()]
        for member in members:
            target = into / "tests" / Path(member.name).name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    suite = into / "tests" / SUITE
    assert suite.exists(), f"{SUITE} not in {sdist.name}"
    return suite


@pytest.mark.timeout(700)  # a whole pytest run of SB3's suite inside; the subprocess has its own 600 s
def test_sb3_own_vec_env_suite_passes_with_our_subproc_vec_env(tmp_path: Path) -> None:
    suite = _extract_tests(_sdist(sb3.__version__), tmp_path)
    (suite.parent / "conftest.py").write_text(CONFTEST)
    ours = str(Path(envmanager.__file__).resolve().parent.parent)
    paths = [ours, os.environ.get("PYTHONPATH")]
    if importlib.util.find_spec("ale_py") is None:  # test_utils imports it (the worker re-imports test_utils)
        (tmp_path / "stubs" / "ale_py").mkdir(parents=True)
        (tmp_path / "stubs" / "ale_py" / "__init__.py").write_text("")
        paths.append(str(tmp_path / "stubs"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "-W", "ignore::DeprecationWarning", "-k", "not DummyVecEnv", str(suite),
         *(str(suite.parent / more) for more in MORE)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    out = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    summary = lines[-1] if lines else ""
    print(summary)
    assert done.returncode == 0, out[-6000:]
    assert "ENVMANAGER-REBOUND" in out, out[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, summary
    assert not re.search(r"\d+ (failed|error)", summary), summary
