"""Old import path of the ML-Agents adapter, kept working: see ``envmanager.adapters.mlagents``."""

from __future__ import annotations

from typing import Any

from envmanager.adapters import mlagents as _adapter

__all__ = list(_adapter.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_adapter, name)
