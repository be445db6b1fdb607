"""Old import path, kept working: see ``envmanager.wire.step_queue`` and ``envmanager.wire.shm``."""

from envmanager.wire.shm import BufferLayout, SharedBuffers, array_layout
from envmanager.wire.step_queue import MAX_NOTICE_BYTES, StepQueue, read_message

__all__ = ["StepQueue", "SharedBuffers", "BufferLayout", "array_layout", "read_message", "MAX_NOTICE_BYTES"]
