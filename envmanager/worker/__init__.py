"""The worker process: its loop (``main``) and its envs (``envs``)."""

from __future__ import annotations

from envmanager.worker.envs import DISABLED, NEXT_STEP, SAME_STEP, WorkerEnvs
from envmanager.worker.main import WorkerSpec, worker_main

__all__ = ["WorkerEnvs", "WorkerSpec", "worker_main", "NEXT_STEP", "SAME_STEP", "DISABLED"]

