"""The worker process: its loop (``main``) and its envs (``envs``)."""

from __future__ import annotations

from typing import Any

from envmanager.worker.envs import DISABLED, NEXT_STEP, SAME_STEP, WorkerEnvs
from envmanager.worker.main import WorkerSpec, worker_main

__all__ = ["WorkerEnvs", "WorkerSpec", "worker_main", "NEXT_STEP", "SAME_STEP", "DISABLED"]


def __getattr__(name: str) -> Any:  # the parent's handle lived here before 0.2
    if name in ("WorkerProcess", "descendants"):
        from envmanager.core import process

        return getattr(process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
