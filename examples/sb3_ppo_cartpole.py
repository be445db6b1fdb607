"""Stable-Baselines3 PPO on CartPole-v1 with envmanager's SubprocVecEnv.

The only change from a stock SB3 script is the import:

    # from stable_baselines3.common.vec_env import SubprocVecEnv
    from envmanager.sb3 import SubprocVecEnv

Run:  python examples/sb3_ppo_cartpole.py [--timesteps 20000] [--n-envs 4]
(install with ``pip install -e ".[sb3]"``; torch first, see the README). Trains for a short
while and prints the mean episode reward before and after; with the default seed it rises from
~10 to 500 (the maximum) in about 10 s of training.
"""

from __future__ import annotations

import argparse
import time

import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy

# from stable_baselines3.common.vec_env import SubprocVecEnv
from envmanager.sb3 import SubprocVecEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timesteps", type=int, default=20_000)
    parser.add_argument("--n-envs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    # A small MLP trains fastest on one thread; the cores are better spent on the env workers
    # (on a busy 2-core machine, torch's default thread pool is ~100x slower here).
    torch.set_num_threads(1)

    # make_vec_env wraps each env in SB3's Monitor and seeds them; vec_env_cls picks ours.
    vec_env = make_vec_env("CartPole-v1", n_envs=args.n_envs, seed=args.seed, vec_env_cls=SubprocVecEnv)
    eval_env = make_vec_env("CartPole-v1", n_envs=args.n_envs, seed=args.seed + 1000, vec_env_cls=SubprocVecEnv)
    try:
        # rl-zoo's CartPole hyperparameters (short rollouts, many updates): learns in ~20k steps
        model = PPO(
            "MlpPolicy", vec_env, n_steps=32, batch_size=128, gae_lambda=0.8, gamma=0.98,
            n_epochs=20, ent_coef=0.0, learning_rate=1e-3, clip_range=0.2, seed=args.seed, device="cpu",
        )
        before, _ = evaluate_policy(model, eval_env, n_eval_episodes=20)
        print(f"mean episode reward before training: {before:6.1f}")
        start = time.perf_counter()
        model.learn(total_timesteps=args.timesteps)
        elapsed = time.perf_counter() - start
        after, std = evaluate_policy(model, eval_env, n_eval_episodes=20)
        print(f"mean episode reward after {args.timesteps} steps ({elapsed:.1f} s): {after:6.1f} +/- {std:.1f}")
    finally:
        vec_env.close()
        eval_env.close()


if __name__ == "__main__":
    main()
