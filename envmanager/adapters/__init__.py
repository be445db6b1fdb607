"""The gymnasium drop-in on the core's public API: ``AsyncVectorEnv`` (``gymnasium``) and the
pieces it shares with the other adapters (``envmanager.sb3``, ``envmanager.mlagents``), which
import their optional dependencies only inside their own module."""
