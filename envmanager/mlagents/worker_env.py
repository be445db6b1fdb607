"""Old import path, kept working: this module is ``envmanager.adapters.mlagents.worker_env``."""

import sys

import envmanager.adapters.mlagents.worker_env

sys.modules[__name__] = envmanager.adapters.mlagents.worker_env
