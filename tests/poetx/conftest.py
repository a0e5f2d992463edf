"""Tests of fastdora.poetx: small tensors, run single-threaded (on a loaded 2-core host, OpenMP threads on tensors this
small cost up to 100x in time)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
