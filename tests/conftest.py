"""Collection rules for every test run:

- the ``gpu`` marker (declared with ``slow`` in pyproject.toml): on a machine without a CUDA device every test marked
  ``gpu`` is collected and reported as skipped. Mark GPU-only tests (or modules, with ``pytestmark = pytest.mark.gpu``)
  instead of skipping them by hand; ``-m gpu`` / ``-m "not gpu"`` select them.
- tests marked ``slow`` run first (their order otherwise kept), so that the workers of ``pytest -n`` start on them and
  finish together;
- ``FASTDORA_TEST_SHARD=i/n`` (set by ``tests/interpreter.py`` for an interpreter suite's child process) keeps every
  n-th test from the i-th.
"""

from __future__ import annotations

import os

import pytest
import torch

from .interpreter import SHARD_ENV


def _shard(config, items):
    raw = os.environ.get(SHARD_ENV)
    if not raw:
        return
    try:
        index, count = (int(v) for v in raw.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise pytest.UsageError(f"{SHARD_ENV} must be 'i/n' with 0 <= i < n, got {raw!r}")
    keep, drop = [], []
    for k, item in enumerate(items):
        (keep if k % count == index else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow ones first
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
