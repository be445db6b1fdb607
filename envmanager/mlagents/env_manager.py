"""Old import path, kept working: this module is ``envmanager.adapters.mlagents.env_manager``."""

import sys

import envmanager.adapters.mlagents.env_manager

sys.modules[__name__] = envmanager.adapters.mlagents.env_manager
