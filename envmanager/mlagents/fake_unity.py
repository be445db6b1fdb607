"""Old import path, kept working: this module is ``envmanager.testing.fake_unity``."""

import sys

import envmanager.testing.fake_unity

sys.modules[__name__] = envmanager.testing.fake_unity
