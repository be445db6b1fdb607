"""Old import path, kept working: this module is ``envmanager.core.pool``."""

import sys

import envmanager.core.pool

sys.modules[__name__] = envmanager.core.pool
