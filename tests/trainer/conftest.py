"""The real ML-Agents trainer (``mlagents.trainers``) under ``envmanager-learn``.

The tests need ``mlagents`` (and so torch); where it is not installed they are skipped, except
when ``ENVMANAGER_REQUIRE_TRAINER=1`` (the trainer leg of CI, ``.ci/leg-trainer``): there a
missing trainer is an error, never a skip (see ``require_trainer`` in the test modules).
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
