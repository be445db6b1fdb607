"""Old import path, kept working: this module is ``envmanager.testing.envs``."""

import sys

import envmanager.testing.envs

sys.modules[__name__] = envmanager.testing.envs
