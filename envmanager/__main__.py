"""``python -m envmanager``: the ``envmanager`` command line (``envmanager.cli:main``, the console script)."""

from __future__ import annotations

import sys

from envmanager.cli import main

if __name__ == "__main__":
    sys.exit(main())
