"""``python -m lightning_bamboo.replay``: the trace replay's command under the name the issues and the paper
use (the package is :mod:`lightning_bamboo.simulate`; same arguments, same output)."""

from __future__ import annotations

import sys

from lightning_bamboo.simulate.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
