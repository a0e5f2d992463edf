"""What a user sees at default verbosity: ONE line per process saying fastdora is on (``[rank N]`` first in a job of
several processes), on stderr through the ``fastdora`` logger unless the application configured logging."""

from __future__ import annotations

import logging
import textwrap

import pytest

import fastdora
from fastdora.patching import EnableReport
from fastdora.plugins import _common

from ._support import REPO, collect, fresh_announce, run_python


def _report(**kw):
    kw.setdefault("converted", {"linear": 28})
    kw.setdefault("options", fastdora.Options())
    kw.setdefault("native_node", "active")
    return EnableReport(**kw)


@pytest.mark.parametrize(
    "kw, line",
    [
        ({}, "fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, C++ node active"),
        ({"native_node": "not used (no CUDA device)", "converted": {"linear": 27, "embedding": 1}},
         "fastdora: on, converted 28 DoRA layer(s) (1 embedding, 27 linear); eager PyTorch path (no CUDA device)"),
        ({"options": fastdora.Options(kernels="eager"), "native_node": "not used (kernels='eager')"},
         "fastdora: on, converted 28 DoRA layer(s) (28 linear); eager PyTorch path (kernels='eager')"),
        ({"native_node": "no C++ compiler (c++)"},
         "fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, C++ node: no C++ compiler (c++)"),
        ({"options": fastdora.Options(dm_from_output=False)},
         "fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, C++ node active; "
         "dm_from_output=False"),
        ({"converted": {}, "already": 4}, "fastdora: on, converted 0 DoRA layer(s), 4 already converted; "
         "Triton kernels, C++ node active"),
        ({"native_launch": "direct"},
         "fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, C++ node active"),
        ({"native_launch": "Triton's launcher (Triton 3.9.0 is not among the versions the direct launch was "
                           "verified on (3.6.x))"},
         "fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, C++ node active, kernel launch "
         "through Triton's launcher (Triton 3.9.0 is not among the versions the direct launch was verified on "
         "(3.6.x))"),
        ({"skipped": [("m.q", "default", "lora_B has a bias (lora_bias=True)")]},
         "fastdora: on, converted 28 DoRA layer(s) (28 linear); 1 left on stock PEFT (see fastdora_report.json); "
         "Triton kernels, C++ node active"),
    ],
)
def test_summary_line(kw, line):
    assert _common.summary_line(_report(**kw)) == line


def test_summary_line_of_a_real_cpu_conversion():
    from ._support import tiny_dora_model

    report = fastdora.enable(tiny_dora_model(embedding=True))
    assert _common.summary_line(report).startswith("fastdora: on, converted 3 DoRA layer(s) (1 embedding, 2 linear)")


def test_once_per_process(monkeypatch):
    fresh_announce(monkeypatch)
    recs = collect(monkeypatch, "fastdora")
    assert _common.announce(_report()) is True
    assert _common.announce(_report(converted={"linear": 3})) is False
    assert recs.messages() == ["fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, C++ node active"]
    assert recs.records[0].levelno == logging.INFO


def test_nothing_converted_is_a_warning(monkeypatch):
    fresh_announce(monkeypatch)
    recs = collect(monkeypatch, "fastdora")
    _common.announce(_report(converted={}, skipped=[("m.q", "default", "why")]))
    assert recs.records[0].levelno == logging.WARNING and recs.messages()[0].startswith("fastdora: no layer converted")


def test_kill_switch_report_is_not_announced(monkeypatch):
    fresh_announce(monkeypatch)
    recs = collect(monkeypatch, "fastdora")
    assert _common.announce(EnableReport(disabled_reason="kill switch FASTDORA=0 is set")) is False
    assert recs.records == []


def test_rank_prefix_from_the_launcher_environment(monkeypatch):
    fresh_announce(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    recs = collect(monkeypatch, "fastdora")
    _common.announce(_report())
    assert recs.messages() == ["[rank 1] fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, "
                               "C++ node active"]


def test_rank_prefix_from_torch_distributed(monkeypatch):
    import torch.distributed as dist

    fresh_announce(monkeypatch)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    recs = collect(monkeypatch, "fastdora")
    _common.announce(_report())
    assert recs.messages()[0].startswith("[rank 3] fastdora: on, converted 28")


def test_no_prefix_for_a_single_process(monkeypatch):
    fresh_announce(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    recs = collect(monkeypatch, "fastdora")
    _common.announce(_report())
    assert recs.messages()[0].startswith("fastdora: on")


# -------------------------------------------------------------------- fresh processes, default logging state
def _ours(text: str) -> list:
    """The lines that mention fastdora (other libraries imported on the way, e.g. bitsandbytes through PEFT, may log
    their own warnings at import)."""
    return [line for line in text.splitlines() if "fastdora" in line]


def test_line_reaches_stderr_with_default_logging(tmp_path):
    code = textwrap.dedent("""
        import fastdora
        from fastdora.patching import EnableReport
        from fastdora.plugins._common import announce
        r = EnableReport(converted={"linear": 28}, options=fastdora.Options(), native_node="active")
        announce(r)
        announce(r)
    """)
    proc = run_python([], code, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert _ours(proc.stderr) == [
        "fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, C++ node active"
    ]


def test_line_goes_through_the_applications_logging_when_configured(tmp_path):
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(format="APP %(name)s %(message)s", stream=sys.stdout)
        import fastdora
        from fastdora.patching import EnableReport
        from fastdora.plugins._common import announce
        announce(EnableReport(converted={"linear": 2}, options=fastdora.Options(), native_node="active"))
    """)
    proc = run_python([], code, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert _ours(proc.stdout) == [
        "APP fastdora fastdora: on, converted 2 DoRA layer(s) (2 linear); Triton kernels, C++ node active"
    ]
    assert "fastdora: on" not in proc.stderr


def test_hf_callback_line_at_default_transformers_verbosity(tmp_path):
    """HF Trainer / TRL: the transformers logger stays at WARNING, yet the one line shows (once, though the callback
    converts at on_init_end and re-checks at on_train_begin)."""
    code = textwrap.dedent(f"""
        import sys, types
        sys.path.insert(0, {REPO!r})
        from tests.plugins._support import tiny_dora_model
        from fastdora.plugins import FastDoraCallback
        model = tiny_dora_model()
        cb = FastDoraCallback(kernels="eager")
        args = types.SimpleNamespace(output_dir=None, process_index=0, world_size=1)
        cb.on_init_end(args, None, None, model=model)
        cb.on_train_begin(args, None, None, model=model)
        cb.on_train_end(args, None, None, model=model)
    """)
    proc = run_python([], code, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    on = [ln for ln in proc.stderr.splitlines() if "fastdora" in ln and "DoRA layer" in ln]
    assert on == ["fastdora: on, converted 2 DoRA layer(s) (2 linear); eager PyTorch path (kernels='eager')"]
