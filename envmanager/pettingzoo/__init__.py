"""PettingZoo envs in worker processes (extra ``pettingzoo``).

``ParallelVectorEnv`` runs PettingZoo ``ParallelEnv``s (and AEC envs, through PettingZoo's own
conversions) on the core: several envs per process, shared memory, first-ready results,
deadlines, restarts. Batches are flat by agent, with an active mask, per-agent flags, returns
and lengths, action masks, and one block per group of agents that share spaces::

    from envmanager.pettingzoo import ParallelVectorEnv
    from pettingzoo.butterfly import pistonball_v6

    envs = ParallelVectorEnv([lambda: pistonball_v6.parallel_env(n_pistons=4)] * 8, envs_per_worker=4)
    batch = envs.reset(seed=0)                       # 8 envs × 4 agent slots = 32 rows
    batch = envs.step(policy(batch.observation))     # rows of inactive agents are not read

Modules: ``layout`` (agent slots, groups, the facade's spaces), ``facade`` (the worker's half),
``actions`` (checks before sending), ``batch`` (what comes back), ``vector`` (the class),
``sampler`` (``MultiAgentSampler``: per-agent trajectories, one policy per group, on the
``Sampler``) and ``agents`` (env steps into per-agent rows),
``supersuit`` and ``supersuit_sb3`` (the drop-in for SuperSuit's vector wrappers).
"""

from envmanager.pettingzoo.batch import AgentStep, GroupBatch, MultiAgentBatch
from envmanager.pettingzoo.layout import AgentGroup, AgentLayout
from envmanager.pettingzoo.sampler import ActingAgents, AgentSample, MultiAgentSampler
from envmanager.pettingzoo.supersuit import (
    PettingZooVecEnv,
    UnsupportedEnvError,
    concat_vec_envs,
    concat_vec_envs_v1,
    pettingzoo_env_to_vec_env,
    pettingzoo_env_to_vec_env_v1,
)
from envmanager.pettingzoo.vector import ParallelVectorEnv

__all__ = ["ParallelVectorEnv", "MultiAgentSampler", "AgentSample", "ActingAgents",
           "MultiAgentBatch", "GroupBatch", "AgentStep", "AgentGroup", "AgentLayout",
           "PettingZooVecEnv", "UnsupportedEnvError", "concat_vec_envs", "concat_vec_envs_v1", "pettingzoo_env_to_vec_env",
           "pettingzoo_env_to_vec_env_v1"]
