"""The benchmark behind ``envmanager bench``: env-steps per second of envmanager and its peers.

Every backend in a run steps the same environments with the same (seeded) actions; results
are reported as ratios against gymnasium's vector envs measured in the same run.

* :mod:`~envmanager.bench.scenarios`: the workloads (``cartpole``, ``many``, ``cpu``,
  ``uneven``, the ``sweep`` of CPU costs, ``atari``, ``mujoco``, ``pinned``, ``scale``, ``cycle``,
  ``unity``);
* :mod:`~envmanager.bench.limit`: ``scale``'s limit, processes stepping one env each, together;
  :mod:`~envmanager.bench.scale`: the ``scale`` and ``cycle`` targets, every one listed;
* :mod:`~envmanager.bench.backends`: the contenders (ours in several stepping styles and
  ``envs_per_worker="auto"``, gymnasium, Stable-Baselines3, EnvPool), each skipped with a
  reason when unavailable; :mod:`~envmanager.bench.peers`: tianshou, TorchRL and PufferLib;
* :mod:`~envmanager.bench.runner`: warm-up, interleaved repeats, references, targets;
* :mod:`~envmanager.bench.sampler_bench`: the ``sampler`` scenario, measured by a module of its own
  (its own contenders, ratios and targets: ``runner.OWN_MODULES``);
* :mod:`~envmanager.bench.pettingzoo_bench`: the ``pettingzoo`` scenarios (agent-steps/s of
  ``ParallelVectorEnv`` against SuperSuit's vector envs and in-process stepping), the same way;
* :mod:`~envmanager.bench.report`: tables, JSON and a PNG chart.
"""

from envmanager.bench.backends import BACKENDS, DEFAULT_BACKENDS, Backend
from envmanager.bench.common import cores
from envmanager.bench.runner import (
    Measurement,
    ScenarioResult,
    Target,
    run_benchmark,
    run_scenario,
    targets,
)
from envmanager.bench.scenarios import SCENARIOS, Scenario

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKENDS",
    "Backend",
    "Measurement",
    "SCENARIOS",
    "Scenario",
    "ScenarioResult",
    "Target",
    "cores",
    "run_benchmark",
    "run_scenario",
    "targets",
]
