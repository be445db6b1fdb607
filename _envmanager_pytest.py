"""envmanager's pytest plugin (entry point ``pytest11``): ``envmanager check`` in a test.

pytest loads it into every run in an environment where envmanager is installed, so it imports
nothing but pytest at load time (``envmanager.check`` is imported when a test asks for it; it
lives outside the ``envmanager`` package because importing that package imports gymnasium) and
changes nothing unless a test uses its fixture or marker:

* the fixture ``envmanager_check``: ``envmanager_check(factory, **options)`` runs the checks on
  ``factory`` (a gymnasium id, ``"module:factory"`` or a callable) under every start method
  and fails the test with the report if a problem is found; otherwise returns the report;
* the marker ``@pytest.mark.envmanager_check(factory, **options)``: the same, before the test
  body runs.

Options are ``envmanager.check.check``'s; ``advice`` is off unless asked for (it measures).
"""

from __future__ import annotations

from typing import Any

import pytest

MARKER = "envmanager_check"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(factory, **options): run envmanager's process-boundary checks on factory (a gymnasium id, "
        "'module:factory' or a callable) under every start method; fail the test with the report on a problem",
    )


def _run(factory: Any, options: dict[str, Any]) -> Any:
    from envmanager.check import check

    report = check(factory, **{"advice": False, **options})
    if not report.ok:
        pytest.fail(report.format(), pytrace=False)
    return report


@pytest.fixture
def envmanager_check() -> Any:
    """``envmanager_check(factory, **options) -> Report``: fails the test if a problem is found."""
    return lambda factory, **options: _run(factory, options)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return
    options = dict(marker.kwargs)
    if marker.args:
        factory = marker.args[0]
    elif "factory" in options:
        factory = options.pop("factory")
    else:
        pytest.fail(f"@pytest.mark.{MARKER} needs the factory to check (its first argument)", pytrace=False)
    _run(factory, options)
