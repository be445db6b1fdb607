"""Old import path, kept working: this module is ``envmanager.adapters.sb3``."""

import sys

import envmanager.adapters.sb3

sys.modules[__name__] = envmanager.adapters.sb3
