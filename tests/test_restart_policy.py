"""The one restart policy: its limits and what a refusal says."""

from __future__ import annotations

from envmanager.core import restart
from envmanager.core.restart import RestartPolicy


def test_a_refusal_names_the_option_that_turns_restarts_on_and_the_limit_reached():
    assert RestartPolicy().refusal(0, 0) == "restarts are disabled (restart_workers=False)"
    assert RestartPolicy(switch="restart_nodes").refusal(3, 0) == "restarts are disabled (restart_nodes=False)"
    policy = RestartPolicy(True, max_lifetime_restarts=2, rate_limit_n=-1)
    for count in range(2):  # (the counts are the supervisor's)
        assert policy.refusal(1, count) is None
        policy.record(1)
    assert "max_lifetime_restarts" in (policy.refusal(1, 2) or "")
    assert policy.refusal(0, 0) is None  # counted per process (or node)
    rated = RestartPolicy(True, max_lifetime_restarts=-1, rate_limit_n=1, rate_limit_period_s=3600)
    rated.record(0)
    assert "restarts_rate_limit" in (rated.refusal(0, 1) or "")
    assert rated.refusal(1, 1) is None  # the window is per quota too


def test_every_manager_sampler_and_pool_takes_the_same_defaults():
    import importlib.util
    import inspect

    from envmanager.core.batch import BatchEnvManager
    from envmanager.core.manager import SubprocessEnvManager
    from envmanager.mlagents.env_manager import MLAgentsEnvManager

    defaults = {"max_lifetime_restarts": restart.MAX_LIFETIME_RESTARTS, "restarts_rate_limit_n": restart.RATE_LIMIT_N,
                "restarts_rate_limit_period_s": restart.RATE_LIMIT_PERIOD_S}
    classes: list[type] = [SubprocessEnvManager, BatchEnvManager, MLAgentsEnvManager]
    if importlib.util.find_spec("ray") is not None:
        from envmanager.mlagents.ray_env_manager import RayPlayerPool
        from envmanager.ray.sampler import RaySampler

        classes += [RaySampler, RayPlayerPool]
    for cls in classes:
        params = inspect.signature(cls).parameters
        assert {k: params[k].default for k in defaults} == defaults, cls
