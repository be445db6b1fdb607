"""Old import path, kept working: this module is ``envmanager.core.calls``."""

import sys

import envmanager.core.calls

sys.modules[__name__] = envmanager.core.calls
