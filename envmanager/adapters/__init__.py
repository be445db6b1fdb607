"""Adapters on the core's public API: gymnasium's ``AsyncVectorEnv`` (``gymnasium``), SB3's
``SubprocVecEnv`` (``sb3``, extra ``sb3``) and ML-Agents' trainer backend (``mlagents``, extra
``mlagents``). Optional dependencies are imported only inside their adapter."""
