"""Old import path, kept working: this module is ``envmanager.core.manager``."""

import sys

import envmanager.core.manager

sys.modules[__name__] = envmanager.core.manager
