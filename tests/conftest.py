"""The one place that handles the ``gpu`` marker (declared with ``slow`` in pyproject.toml): on a machine without a
CUDA device every test marked ``gpu`` is collected and reported as skipped. Mark GPU-only tests (or modules, with
``pytestmark = pytest.mark.gpu``) instead of skipping them by hand; ``-m gpu`` / ``-m "not gpu"`` select them."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
