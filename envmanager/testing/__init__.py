"""Test doubles that users test with too: controllable envs (``envs``) and a fake Unity player
speaking the real ML-Agents protocol (``fake_unity``, extra ``mlagents``)."""

from envmanager.testing.envs import FAULTS, ControlledEnv, EnvFactory, burn_cpu

__all__ = ["ControlledEnv", "EnvFactory", "FAULTS", "burn_cpu"]
