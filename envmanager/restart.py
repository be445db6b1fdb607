"""Old import path, kept working: this module is ``envmanager.core.restart``."""

import sys

import envmanager.core.restart

sys.modules[__name__] = envmanager.core.restart
