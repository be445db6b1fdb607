"""Old import path, kept working: this module is ``envmanager.adapters.env_functions``."""

import sys

import envmanager.adapters.env_functions

sys.modules[__name__] = envmanager.adapters.env_functions
