"""The packaging check (``.ci/check_dist.py``, run by ``.ci/package`` on the distributions CI
builds) passes a wheel and an sdist built from this tree and fails those missing a module, a
data file, LICENSE or an entry point.

The distributions are built offline with the setuptools installed here (setuptools' own build
hooks, no isolated environment: nothing is downloaded) from a copy of the tree, then doctored.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

import envmanager

REPO = Path(__file__).resolve().parent.parent
CHECKER = REPO / ".ci" / "check_dist.py"
COPIED = ("envmanager", "_envmanager_pytest.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in",
          "CHANGELOG.md", "mkdocs.yml", "tests", "examples", "docs", "benchmarks", ".ci")
INFO = f"envmanager-{envmanager.__version__}.dist-info"


def setuptools_major() -> int:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 0


def copy_tree(to: Path) -> Path:
    """The files a build reads (the sdist's, MANIFEST.in), without caches or CI venvs."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "venv-*")
    for name in COPIED:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, to / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, to / name)
    return to


def build(source: Path, out: Path, hooks: tuple[str, ...] = ("build_wheel", "build_sdist")) -> list[Path]:
    """The wheel (and the sdist) built from ``source`` by setuptools' PEP 517 hooks, as ``python -m build`` does."""
    code = "import sys, setuptools.build_meta as b\nout = sys.argv[1]\n" + "".join(f"b.{hook}(out)\n" for hook in hooks)
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [next(out.glob(pattern)) for pattern in ("*.whl", "*.tar.gz")[:len(hooks)]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(source, wheel, sdist) of this tree."""
    if setuptools_major() < 77:
        pytest.skip("building needs setuptools >= 77 (pyproject.toml's SPDX licence); .ci/package builds in isolation")
    source = copy_tree(tmp_path_factory.mktemp("source"))
    return (source, *build(source, tmp_path_factory.mktemp("dist")))


def check(source: Path, *dists: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECKER), "--source", str(source), *map(str, dists)],
                          capture_output=True, text=True, timeout=60)


def doctor_wheel(wheel: Path, to: Path, drop: str | None = None, edit: dict[str, Callable[[str], str]] | None = None,
                 add: str | None = None) -> Path:
    """A copy of ``wheel`` (same file name, in ``to``) without ``drop``, with files edited or one added."""
    to.mkdir(exist_ok=True)
    out = to / wheel.name
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w") as zout:
        for item in zin.infolist():
            if item.filename == drop:
                continue
            data = zin.read(item)
            if edit and item.filename in edit:
                data = edit[item.filename](data.decode()).encode()
            zout.writestr(item, data)
        if add:
            zout.writestr(add, "")
    return out


def without_line(part: str) -> Callable[[str], str]:
    return lambda text: "".join(line for line in text.splitlines(keepends=True) if part not in line)


def test_distributions_built_from_this_tree_pass(built):
    source, wheel, sdist = built
    done = check(source, wheel, sdist)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [f"{wheel.name}: ok", f"{sdist.name}: ok"]


@pytest.mark.parametrize("drop, problem", [
    ("envmanager/sb3.py", "missing envmanager/sb3.py (a file of the package)"),
    ("envmanager/testing/fake_unity_task.py", "missing envmanager/testing/fake_unity_task.py"),
    ("envmanager/py.typed", "missing envmanager/py.typed (a file of the package)"),
    ("_envmanager_pytest.py", "entry point [pytest11] envmanager = _envmanager_pytest: its module is not in the wheel"),
    (f"{INFO}/licenses/LICENSE", f"missing {INFO}/licenses/LICENSE (metadata)"),
    (f"{INFO}/entry_points.txt", "no entry_points.txt"),
])
def test_a_wheel_missing_a_file_fails(built, tmp_path, drop, problem):
    source, wheel, _ = built
    done = check(source, doctor_wheel(wheel, tmp_path, drop=drop))
    assert done.returncode == 1
    assert problem in done.stdout, done.stdout


@pytest.mark.parametrize("line, problem", [
    ("envmanager-fake-unity =",
     "entry point missing: [console_scripts] envmanager-fake-unity = envmanager.testing.fake_unity:main"),
    ("envmanager = envmanager.cli", "entry point missing: [console_scripts] envmanager = envmanager.cli:main"),
    ("_envmanager_pytest", "entry point missing: [pytest11] envmanager = _envmanager_pytest"),
])
def test_a_wheel_missing_an_entry_point_fails(built, tmp_path, line, problem):
    source, wheel, _ = built
    doctored = doctor_wheel(wheel, tmp_path, edit={f"{INFO}/entry_points.txt": without_line(line)})
    done = check(source, doctored)
    assert done.returncode == 1 and f"{wheel.name}: {problem}" in done.stdout.splitlines(), done.stdout


def test_a_wheel_with_a_file_the_source_lacks_fails(built, tmp_path):
    """What a stale ``build/lib`` puts in a wheel: a module deleted from the source."""
    source, wheel, _ = built
    done = check(source, doctor_wheel(wheel, tmp_path, add="envmanager/removed_long_ago.py"))
    assert done.returncode == 1 and "envmanager/removed_long_ago.py: in the wheel, not in the source" in done.stdout


def test_metadata_without_the_licence_or_of_another_version_fails(built, tmp_path):
    source, wheel, _ = built
    edit = {f"{INFO}/METADATA": lambda text: text.replace("License-Expression: MIT\n", "").replace(
        f"Version: {envmanager.__version__}\n", "Version: 0.0.1\n")}
    done = check(source, doctor_wheel(wheel, tmp_path, edit=edit))
    assert done.returncode == 1
    assert "METADATA: License-Expression is None, not 'MIT'" in done.stdout
    assert f"METADATA: Version is '0.0.1', not '{envmanager.__version__}'" in done.stdout


def test_an_sdist_missing_a_module_or_a_test_fails(built, tmp_path):
    source, _, sdist = built
    out = tmp_path / sdist.name
    root = sdist.name.removesuffix(".tar.gz")
    dropped = {f"{root}/envmanager/core/manager.py", f"{root}/tests/conftest.py", f"{root}/LICENSE"}
    with tarfile.open(sdist) as tin, tarfile.open(out, "w:gz") as tout:
        for member in tin.getmembers():
            if member.name not in dropped:
                tout.addfile(member, tin.extractfile(member) if member.isfile() else None)
    done = check(source, out)
    assert done.returncode == 1
    for problem in ("missing envmanager/core/manager.py", "missing tests/conftest.py", "missing LICENSE (sdist)"):
        assert problem in done.stdout, done.stdout


def test_a_wheel_built_without_a_script_and_the_plugin_module_fails(built, tmp_path):
    """A real build from a pyproject.toml that leaves out a console script and the module beside
    the package: the mistakes the check is there to catch before a release."""
    source = copy_tree(tmp_path / "source")
    pyproject = source / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    for line in ('envmanager-learn = "envmanager.mlagents.learn:main"\n', 'py-modules = ["_envmanager_pytest"]\n'):
        assert line in text
        text = text.replace(line, "")
    pyproject.write_text(text, encoding="utf-8")
    [wheel] = build(source, tmp_path / "dist", hooks=("build_wheel",))
    done = check(source, wheel)
    assert done.returncode == 1
    problems = done.stdout.splitlines()
    assert f"{wheel.name}: missing _envmanager_pytest.py (a module beside the package)" in problems
    assert f"{wheel.name}: entry point missing: [console_scripts] envmanager-learn = envmanager.mlagents.learn:main" in problems

