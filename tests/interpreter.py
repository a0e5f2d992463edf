"""Runs a test module's interpreter suite: the module again, in a child pytest process with ``TRITON_INTERPRET=1``.

``TRITON_INTERPRET`` must be set before Triton is imported, and other test modules share the pytest process, so a
module with Triton kernel tests holds them in its child branch (``TRITON_INTERPRET == "1"``) and, in the parent, one
test per shard that calls :func:`run_suite`. A shard runs every ``shards``-th test of the child's collection
(``tests/conftest.py`` reads ``FASTDORA_TEST_SHARD``), so that ``pytest -n`` spreads a long suite over its workers.
"""

from __future__ import annotations

import os
import subprocess
import sys

INNER = os.environ.get("TRITON_INTERPRET") == "1"
SHARD_ENV = "FASTDORA_TEST_SHARD"


def run_suite(path: str, shard: int = 0, shards: int = 1, env: dict | None = None, timeout: float = 1200.0) -> str:
    """Run the tests of the module at ``path`` with ``TRITON_INTERPRET=1`` (shard ``shard`` of ``shards``) in a child
    process; fail with the end of its output unless every selected test passed. Returns the child's summary line.
    ``timeout`` guards against a hang only."""
    child_env = dict(os.environ if env is None else env, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
                     OMP_NUM_THREADS="1")
    child_env[SHARD_ENV] = f"{shard}/{shards}"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", os.path.abspath(path)],
        env=child_env, capture_output=True, text=True, timeout=timeout,
    )
    tail = proc.stdout[-8000:] + "\n" + proc.stderr[-4000:]
    assert proc.returncode == 0, f"interpreter suite {os.path.basename(path)} (shard {shard}/{shards}) failed:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert " passed" in summary and " failed" not in summary, tail
    return summary
