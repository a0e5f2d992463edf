"""Where the benchmark scripts live, and importing them as modules in tests (they import each other as scripts do:
their folder on ``sys.path``)."""

from __future__ import annotations

import contextlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")


@contextlib.contextmanager
def on_path():
    """``benchmarks/`` first on ``sys.path`` for the duration (imports inside see the scripts' own modules)."""
    sys.path.insert(0, BENCH)
    try:
        yield
    finally:
        sys.path.remove(BENCH)
