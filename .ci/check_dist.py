"""Check envmanager's built distributions against the source tree they were built from.

    python .ci/check_dist.py --source . dist/envmanager-0.2.0-py3-none-any.whl dist/envmanager-0.2.0.tar.gz

A wheel must hold every file of the ``envmanager`` package (modules and data files such as
``py.typed``), the pytest plugin's module, LICENSE (as the source's), metadata with the version
written in ``envmanager/__init__.py`` and the SPDX licence, exactly the entry points of
``ENTRY_POINTS``, each pointing at a module inside the wheel, and nothing else at its top level
(a stale ``build/`` would show as files the source does not have). An sdist must hold the same
package files, LICENSE, ``pyproject.toml``, ``README.md`` and the test suite. With
``trove-classifiers`` installed, every classifier must be one PyPI accepts.

Prints one line per problem (or ``ok``) per distribution; exits 1 on any problem, 2 on bad
usage. Standard library only, so it runs on every CI leg's Python; run by ``.ci/package`` and
``tests/test_packaging.py``.
"""

from __future__ import annotations

import argparse
import configparser
import email.parser
import os
import re
import sys
import tarfile
import zipfile
from collections.abc import Iterable

PACKAGE = "envmanager"
TOP_MODULES = ("_envmanager_pytest.py",)  # modules beside the package ([tool.setuptools] py-modules)
ENTRY_POINTS = {  # group -> name -> target: every one a user relies on
    "console_scripts": {
        "envmanager": "envmanager.cli:main",
        "envmanager-fake-unity": "envmanager.testing.fake_unity:main",
        "envmanager-learn": "envmanager.mlagents.learn:main",
    },
    "pytest11": {"envmanager": "_envmanager_pytest"},
}
LICENSE_EXPRESSION = "MIT"
SDIST_FILES = ("PKG-INFO", "pyproject.toml", "README.md", "LICENSE")  # besides the package and the tests
SDIST_TREES = (PACKAGE, "tests")


def source_files(source: str, top: str) -> list[str]:
    """Every file under ``source/top`` as a path relative to ``source`` (``/``-separated), caches left out."""
    found = []
    for folder, dirs, files in os.walk(os.path.join(source, top)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith((".pyc", ".pyo")):
                found.append(os.path.relpath(os.path.join(folder, name), source).replace(os.sep, "/"))
    return found


def source_version(source: str) -> str:
    with open(os.path.join(source, PACKAGE, "__init__.py"), encoding="utf-8") as f:
        found = re.search(r"^__version__ = [\"']([^\"']+)[\"']", f.read(), re.M)
    if not found:
        raise SystemExit(f"no __version__ = '...' line in {source}/{PACKAGE}/__init__.py")
    return found.group(1)


def check_metadata(text: str, version: str, what: str) -> list[str]:
    """Problems with a METADATA / PKG-INFO file."""
    meta = email.parser.Parser().parsestr(text)
    problems = []
    for field, want in (("Name", PACKAGE), ("Version", version), ("License-Expression", LICENSE_EXPRESSION)):
        if meta.get(field) != want:
            problems.append(f"{what}: {field} is {meta.get(field)!r}, not {want!r}")
    if "LICENSE" not in (meta.get_all("License-File") or []):
        problems.append(f"{what}: no License-File: LICENSE")
    try:
        import trove_classifiers  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return problems
    for classifier in meta.get_all("Classifier") or []:
        if classifier not in trove_classifiers.classifiers:
            problems.append(f"{what}: classifier PyPI does not accept: {classifier!r}")
    return problems


def check_entry_points(text: str | None, names: set[str]) -> list[str]:
    """Problems with ``entry_points.txt`` (``None``: missing) against ``ENTRY_POINTS``."""
    if text is None:
        return ["no entry_points.txt: no console script and no pytest plugin"]
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment, method-assign]  # names are case-sensitive
    parser.read_string(text)
    problems = []
    for group, wanted in ENTRY_POINTS.items():
        have = dict(parser.items(group)) if parser.has_section(group) else {}
        for name, target in wanted.items():
            if name not in have:
                problems.append(f"entry point missing: [{group}] {name} = {target}")
            elif have[name] != target:
                problems.append(f"entry point [{group}] {name} = {have[name]}, not {target}")
        for name in sorted(set(have) - set(wanted)):
            problems.append(f"entry point not in .ci/check_dist.py's ENTRY_POINTS: [{group}] {name} = {have[name]}")
        for name, target in have.items():
            module = target.split(":")[0].strip().replace(".", "/")
            if f"{module}.py" not in names and f"{module}/__init__.py" not in names:
                problems.append(f"entry point [{group}] {name} = {target}: its module is not in the wheel")
    for group in sorted(set(parser.sections()) - set(ENTRY_POINTS)):
        problems.append(f"entry point group not in .ci/check_dist.py's ENTRY_POINTS: [{group}]")
    return problems


def missing(want: Iterable[str], have: set[str], where: str) -> list[str]:
    return [f"missing {name} ({where})" for name in want if name not in have]


def check_name(path: str, version: str, suffix: str) -> list[str]:
    expected = f"{PACKAGE}-{version}{suffix}"
    name = os.path.basename(path)
    return [] if name == expected else [f"not named {expected} (the version in {PACKAGE}/__init__.py is {version})"]


def check_wheel(path: str, source: str) -> list[str]:
    version = source_version(source)
    problems = check_name(path, version, "-py3-none-any.whl")
    with zipfile.ZipFile(path) as wheel:
        names = {n for n in wheel.namelist() if not n.endswith("/")}
        infos = sorted({n.split("/")[0] + "/" for n in names if n.split("/")[0].endswith(".dist-info")})
        if len(infos) != 1:
            return [*problems, f"{len(infos)} .dist-info directories, not one: {infos}"]
        info = infos[0]  # its version is the METADATA's, checked below
        package = source_files(source, PACKAGE)
        problems += missing(package, names, "a file of the package")
        problems += missing(TOP_MODULES, names, "a module beside the package")
        problems += missing([info + n for n in ("METADATA", "WHEEL", "RECORD", "licenses/LICENSE")], names, "metadata")
        allowed = set(package) | set(TOP_MODULES)
        for name in sorted(names - allowed):
            if not name.startswith(info):
                problems.append(f"{name}: in the wheel, not in the source (a stale build/ directory?)")
        if info + "METADATA" in names:
            problems += check_metadata(wheel.read(info + "METADATA").decode(), version, "METADATA")
        if info + "licenses/LICENSE" in names:
            with open(os.path.join(source, "LICENSE"), "rb") as f:
                if wheel.read(info + "licenses/LICENSE") != f.read():
                    problems.append("licenses/LICENSE differs from the source's LICENSE")
        entry_points = wheel.read(info + "entry_points.txt").decode() if info + "entry_points.txt" in names else None
        problems += check_entry_points(entry_points, names)
    return problems


def check_sdist(path: str, source: str) -> list[str]:
    version = source_version(source)
    problems = check_name(path, version, ".tar.gz")
    with tarfile.open(path) as sdist:
        files = [m.name for m in sdist.getmembers() if m.isfile()]
        roots = sorted({name.split("/")[0] + "/" for name in files})
        if len(roots) != 1:
            return [*problems, f"{len(roots)} top-level directories, not one: {roots}"]
        root = roots[0]
        names = {name[len(root):] for name in files}
        problems += missing(SDIST_FILES + TOP_MODULES, names, "sdist")
        for tree in SDIST_TREES:
            problems += missing(source_files(source, tree), names, f"a file under {tree}/")
        if "PKG-INFO" in names:
            member = sdist.extractfile(root + "PKG-INFO")
            assert member is not None
            problems += check_metadata(member.read().decode(), version, "PKG-INFO")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="the source tree the distributions were built from")
    parser.add_argument("dists", nargs="+", help="wheels (.whl) and sdists (.tar.gz)")
    args = parser.parse_args(argv)
    failed = False
    for path in args.dists:
        if path.endswith(".whl"):
            problems = check_wheel(path, args.source)
        elif path.endswith(".tar.gz"):
            problems = check_sdist(path, args.source)
        else:
            parser.error(f"{path}: neither a .whl nor a .tar.gz")
        for problem in problems:
            print(f"{os.path.basename(path)}: {problem}")
        if not problems:
            print(f"{os.path.basename(path)}: ok")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
