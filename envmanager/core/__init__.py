"""The core: env slots in worker processes (``manager``: StepInfo level; ``batch``: batch
level), the worker pool with its restarts (``pool``, ``process``, ``restart``), env calls,
action checks and the deadline helper."""

from envmanager.core.arguments import seeds_for
from envmanager.core.batch import BatchEnvManager, SlotStatus
from envmanager.core.manager import SubprocessEnvManager
from envmanager.core.results import StepBatch, StepInfo, StepResult, StepTimings

__all__ = [
    "SubprocessEnvManager", "BatchEnvManager", "SlotStatus", "StepBatch", "StepInfo", "StepResult", "StepTimings", "seeds_for",
]
