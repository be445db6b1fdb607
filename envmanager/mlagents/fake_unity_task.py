"""Old import path, kept working: this module is ``envmanager.testing.fake_unity_task``."""

import sys

import envmanager.testing.fake_unity_task

sys.modules[__name__] = envmanager.testing.fake_unity_task
