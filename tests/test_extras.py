"""Each optional module without its extra: an ImportError naming the extra and the pip command.

Each case runs in a fresh interpreter where the optional dependency cannot be imported (its name
is ``None`` in ``sys.modules``, as if it were not installed), so nothing imported by other tests
hides it. The built wheel is checked the same way in a venv without extras (``.ci/package``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from envmanager.extras import install_command, missing_extra, requires_extra

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_without(blocked: tuple[str, ...], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter in which importing any of ``blocked`` fails."""
    prelude = f"import sys\nsys.modules.update(dict.fromkeys({list(blocked)!r}))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)


IMPORTS = {  # what the user types -> the dependency missing, the extra that brings it
    "import envmanager.sb3": ("stable_baselines3", "sb3"),
    "from envmanager.sb3 import SubprocVecEnv": ("stable_baselines3", "sb3"),
    "import envmanager.ray": ("ray", "ray"),
    "from envmanager.ray import RaySampler": ("ray", "ray"),
    "from envmanager.mlagents import MLAgentsEnvManager": ("mlagents_envs", "mlagents"),
    "from envmanager.mlagents import UnityEnvironmentFactory": ("mlagents_envs", "mlagents"),
    "import envmanager.mlagents.ray_env_manager": ("ray", "ray"),
    "from envmanager.pettingzoo import concat_vec_envs_v1": ("pettingzoo", "pettingzoo"),
    "from envmanager.pettingzoo.supersuit_sb3 import SB3VecEnvWrapper": ("stable_baselines3", "sb3"),
    "from envmanager.bench.report import write_plot; write_plot('x.png', [])": ("matplotlib", "bench"),
}


#: Statements whose module needs another extra present to get as far as the missing one.
NEEDS = {"from envmanager.pettingzoo.supersuit_sb3 import SB3VecEnvWrapper": "pettingzoo"}


@pytest.mark.parametrize("statement", list(IMPORTS))
def test_import_without_its_extra_names_the_extra(statement):
    dependency, extra = IMPORTS[statement]
    if statement in NEEDS:
        pytest.importorskip(NEEDS[statement], minversion="1.24")
    done = run_without((dependency,), f"""
        try:
            {statement}
        except ModuleNotFoundError as e:
            print(type(e).__name__, e.name, "|", e)
        else:
            print("imported")
    """)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip()
    assert out.startswith(f"ModuleNotFoundError {dependency}"), out  # the name of what is missing, kept
    assert f'needs the extra "{extra}"' in out and f'pip install "envmanager[{extra}]"' in out, out


def test_mlagents_package_imports_without_its_extra():
    """Its names are lazy: the package itself stays importable (``envmanager-learn`` lives in it)."""
    done = run_without(("mlagents_envs",), "import envmanager.mlagents, envmanager.mlagents.learn; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_fake_unity_without_its_extra_helps_and_refuses_to_run():
    main = "from envmanager.testing.fake_unity import main, write_launcher, free_base_port; sys.exit(main(sys.argv[1:]))"
    helped = run_without(("grpc",), main, "--help")
    assert helped.returncode == 0, helped.stderr
    assert "usage: envmanager-fake-unity" in helped.stdout and "--mlagents-port" in helped.stdout
    ran = run_without(("grpc",), main, "--mlagents-port", "1")
    assert ran.returncode == 2, ran.stderr
    assert "Traceback" not in ran.stderr
    assert ran.stderr.startswith('envmanager-fake-unity: the fake Unity player needs the extra "mlagents"'), ran.stderr
    assert 'pip install "envmanager[mlagents]"' in ran.stderr


def test_missing_extra_keeps_the_class_and_the_name():
    error = missing_extra(ModuleNotFoundError("No module named 'ray'", name="ray"), "ray", "envmanager.ray")
    assert type(error) is ModuleNotFoundError and error.name == "ray"
    assert str(error) == 'envmanager.ray needs the extra "ray" (No module named \'ray\'): pip install "envmanager[ray]"'
    broken = missing_extra(ImportError("cannot import name 'x' from 'ray'", name="ray"), "ray", "envmanager.ray")
    assert type(broken) is ImportError  # installed but broken: not restated as missing
    assert install_command("sb3") == 'pip install "envmanager[sb3]"'


def test_requires_extra_chains_the_original_error():
    with pytest.raises(ModuleNotFoundError, match=r'needs the extra "bench"') as caught, requires_extra("bench", "plots"):
        import envmanager_no_such_module  # type: ignore[import-not-found]  # noqa: F401
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)
    assert caught.value.__cause__.name == "envmanager_no_such_module"
