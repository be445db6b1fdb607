"""Old import path, kept working: this module is ``envmanager.adapters.gymnasium_utils``."""

import sys

import envmanager.adapters.gymnasium_utils

sys.modules[__name__] = envmanager.adapters.gymnasium_utils
