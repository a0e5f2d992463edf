"""The main example's timing lines (the CPU caveat next to the CPU timing, the line starts scripts/test.sh greps)
and no development-process wording in the plugins, the integration tests and the examples."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest

from ._support import REPO

GREPPED = re.compile(r"^(device|stock PEFT|fastdora|loss curves|outputs|check)")  # scripts/test.sh


@pytest.fixture(scope="module")
def train():
    pytest.importorskip("datasets")
    path = os.path.join(REPO, "examples", "hf_trainer", "train.py")
    spec = importlib.util.spec_from_file_location("fastdora_example_hf_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_timing_carries_the_caveat(train):
    stock, fast = train.timing_lines("CPU", "peak process RSS", 0.0123, 700.0, 0.0041, 690.0)
    assert GREPPED.match(stock) and stock.startswith("stock PEFT :")
    assert GREPPED.match(fast) and fast.startswith("fastdora   :")
    assert "(x3.00 speed; timings on CPU are indicative only; fastdora's speed claims are measured on GPU " \
           "(benchmarks/README.md))" in fast


def test_gpu_timing_has_no_caveat(train):
    stock, fast = train.timing_lines("NVIDIA H200", "peak CUDA memory", 0.02, 900.0, 0.01, 800.0)
    assert fast.endswith("(x2.00 speed)") and "CPU" not in fast and GREPPED.match(stock)


def test_the_example_prints_through_timing_lines(train):
    with open(train.__file__, encoding="utf-8") as f:
        src = f.read()
    assert "timing_lines(device," in src


DEV_WORDS = re.compile(r"\bsessions? ?[0-9]|\bcall ?[0-9]|\bissue ?#?[0-9]|run_s[0-9]", re.I)


def test_no_development_process_words():
    files = glob.glob(os.path.join(REPO, "plugins", "*.py"))
    files += glob.glob(os.path.join(REPO, "integration_tests", "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(REPO, "integration_tests", "*.sh"))
    for ext in ("py", "yaml", "sh"):
        files += glob.glob(os.path.join(REPO, "examples", "**", f"*.{ext}"), recursive=True)
    assert files
    hits = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if DEV_WORDS.search(line):
                    hits.append(f"{os.path.relpath(path, REPO)}:{no}: {line.strip()}")
    assert not hits, hits
