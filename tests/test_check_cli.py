"""``envmanager check`` on the command line, and the pytest plugin (fixture and marker)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import psutil
import pytest

from envmanager import cli

TESTS = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
BIN = Path(sys.executable).parent


def test_command_line_reports_a_good_env_as_json_and_exits_0():
    out = subprocess.run([str(BIN / "envmanager"), "check", "CartPole-v1", "--start-method", "fork", "--json",
                          "--no-progress", "--num-envs", "4"], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["problems"] == [] and report["start_methods"] == ["fork"]
    advice = report["advice"]
    assert advice["num_envs"] == 4 and advice["recommended"] in {lay["id"] for lay in advice["layouts"]}


def test_command_line_names_the_problem_and_exits_1(capsys, monkeypatch):
    monkeypatch.chdir(TESTS)  # MODULE:FACTORY from the current folder, as `python -m` would find it
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(TESTS))])
    monkeypatch.delitem(sys.modules, "check_envs", raising=False)  # found again through the current folder only
    code = cli.main(["check", "check_envs:SimErrorEnv", "--start-method", "fork", "--no-advice", "--deadline", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "Problem 1: env-raises [fork]" in out and "Problem 2: exception-not-picklable [fork]" in out
    assert "fix: An exception class whose __init__" in out


def test_command_line_refuses_a_bad_target_with_exit_2(capsys):
    assert cli.main(["check", "NoSuchEnv-v0", "--no-advice"]) == 2
    assert "envmanager check: NoSuchEnv-v0: not a registered gymnasium id" in capsys.readouterr().err


def test_an_env_whose_package_is_not_installed_exits_2_saying_what_to_install(capsys, monkeypatch):
    """It was not-built, exit 1, with advice about spawn/forkserver set-up (as ALE/Pong-v5
    without ale-py is a usage error, exit 2)."""
    monkeypatch.syspath_prepend(str(TESTS))
    assert cli.main(["check", "check_envs:make_needs_missing_package", "--no-advice", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("envmanager check: check_envs:make_needs_missing_package: the env needs a package "
                                   'that is not installed here: NoSuchSim is not installed, run `pip install "nosuchsim"`')


@pytest.mark.skipif(importlib.util.find_spec("mujoco") is not None, reason="mujoco is installed here")
def test_a_mujoco_env_without_mujoco_exits_2_saying_what_to_install(capsys):
    assert cli.main(["check", "HalfCheetah-v5", "--no-advice", "--no-progress", "--start-method", "fork"]) == 2
    assert 'pip install "gymnasium[mujoco]"' in capsys.readouterr().err


def test_the_plugin_is_registered_and_imports_nothing_heavy():
    assert "_envmanager_pytest" in {ep.value for ep in entry_points(group="pytest11")}
    out = subprocess.run([sys.executable, "-c", "import sys, _envmanager_pytest; "
                          "print(sorted(m for m in ('numpy', 'gymnasium', 'envmanager', 'psutil') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_fixture_and_the_marker_fail_a_test_with_the_report(tmp_path):
    (tmp_path / "test_envs.py").write_text(textwrap.dedent("""
        import pytest
        import check_envs

        def test_good(envmanager_check):
            report = envmanager_check(check_envs.make_good, start_methods=["fork"])
            assert report.ok and report.advice is None

        def test_float64(envmanager_check):
            envmanager_check(check_envs.Float64Env, start_methods=["fork"])

        @pytest.mark.envmanager_check("check_envs:make_good", start_methods=["fork"])
        def test_marked_good():
            pass

        @pytest.mark.envmanager_check(check_envs.RaisingEnv, start_methods=["fork"])
        def test_marked_raising():
            raise AssertionError("the body runs only if the check passes")

        def test_untouched():
            pass
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert "2 failed, 3 passed" in out.stdout, out.stdout + out.stderr
    assert "FAILED test_envs.py::test_float64" in out.stdout and "observation-dtype" in out.stdout
    assert "FAILED test_envs.py::test_marked_raising" in out.stdout and "env-raises" in out.stdout
    assert "the body runs only if" not in out.stdout


def test_a_target_whose_module_raises_on_import_and_bad_numbers_exit_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["check", "raises_on_import:make", "--no-advice"]) == 2
    err = capsys.readouterr().err
    assert "importing 'raises_on_import' raised RuntimeError: boom at import" in err
    for argv in (["--seed", "-1"], ["--deadline", "0"], ["--deadline", "nan"], ["--time-limit", "-5"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["check", "CartPole-v1", "--no-advice", *argv])
        assert exc.value.code == 2, argv


def test_a_check_the_time_limit_ended_before_any_worker_ran_is_not_ok(capsys):
    """It printed "No problems found." and exited 0 with every start method skipped."""
    assert cli.main(["check", "CartPole-v1", "--time-limit", "0.5", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "Nothing was checked" in out and "No problems found" not in out


def test_python_m_envmanager_runs_the_console_script_entry_point():
    """``python -m envmanager`` had no ``__main__``: "No module named envmanager.__main__"."""
    out = subprocess.run([sys.executable, "-m", "envmanager", "check", "NoSuchEnv-v0", "--no-advice"],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 2, out.stderr
    assert "envmanager check: NoSuchEnv-v0: not a registered gymnasium id" in out.stderr
    usage = subprocess.run([sys.executable, "-m", "envmanager", "--help"], capture_output=True, text=True,
                           timeout=120, env=ENV)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: envmanager "), usage.stderr
    assert "{bench,check}" in usage.stdout


CTRL_C_SCRIPT = """
import signal, sys
# As a program started from a terminal: Ctrl-C raises KeyboardInterrupt (the test runner may hand
# its children SIGINT blocked or ignored).
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
from envmanager.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_ends_a_check_with_exit_130_one_line_and_no_process_left():
    """A Ctrl-C printed a ~40-line KeyboardInterrupt traceback (exit status and clean-up were right)."""
    from process_helpers import left_in_session

    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, "check", "check_envs:SlowStepEnv", "--steps", "5000",
                             "--start-method", "fork", "--no-advice", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=TESTS,
                            start_new_session=True)
    try:
        parent = psutil.Process(proc.pid)
        for _ in range(600):  # until both fork workers step the slow env (at most a minute)
            if len(parent.children()) >= 2 or proc.poll() is not None:
                break
            psutil.wait_procs([parent], timeout=0.1)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out}\n{err}"
    # (a worker slow to close may add the library's warning that it was terminated: not a traceback)
    assert err.endswith("envmanager check: interrupted\n") and "Traceback" not in err, err
    assert not left_in_session(proc.pid), "the check left processes behind"
