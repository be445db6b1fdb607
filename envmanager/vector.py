"""Old import path, kept working: this module is ``envmanager.adapters.gymnasium``."""

import sys

import envmanager.adapters.gymnasium

sys.modules[__name__] = envmanager.adapters.gymnasium
