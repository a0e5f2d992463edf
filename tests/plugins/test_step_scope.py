"""FastDoraCallback holds one ``fastdora.step_scope`` per optimizer step: a model compiled whole reads the norm slots
inside it (no norm op), and the op again outside it."""

from __future__ import annotations

import types

import pytest
import torch

import fastdora
from fastdora import slots
from fastdora.plugins import _common

from ._support import tiny_dora_model

pytest.importorskip("transformers")


def test_callback_scope_per_step_whole_model_compiled(monkeypatch):
    from fastdora.plugins import FastDoraCallback

    monkeypatch.setattr(_common, "_ANNOUNCED", True)  # the one line is not what this tests
    model, ref = tiny_dora_model(), tiny_dora_model()
    args = types.SimpleNamespace(output_dir=None, process_index=0, world_size=1)
    cb = FastDoraCallback(kernels="eager", write_report=False)
    cb.on_init_end(args, None, None, model=model)
    assert cb.report is not None and cb.report.total_converted == 2
    root = slots._root_of(model)  # (the callback enabled fastdora on the PEFT model itself)
    assert root is not None
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    x = torch.randint(0, 32, (3, 5))
    for _ in range(2):
        fastdora.active_path_counter.clear()
        cb.on_step_begin(args, None, None, model=model)
        assert root.holds == 1 and root.active
        out = compiled(x)
        want = ref(x)  # stock PEFT DoRA on the same parameters
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        out.square().mean().backward()
        want.square().mean().backward()
        opt.step()
        ref_opt.step()
        assert not root.active  # the optimizer step made the slots stale
        cb.on_step_end(args, None, None, model=model)
        assert root.holds == 0
        counts = dict(fastdora.active_path_counter)
        assert "compiled:norm_op" not in counts and counts.get("norm:slot_refresh") == 2, counts
        opt.zero_grad()
        ref_opt.zero_grad()
    # outside a scope the compiled model calls the norm op, with the new parameters
    fastdora.active_path_counter.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)
    assert fastdora.active_path_counter["compiled:norm_op"] == 2
    # the scope also opens on the torch.compile wrapper
    with fastdora.step_scope(compiled) as held:
        assert held and root.active
    assert not root.active
    # a step that never ended is closed at the end of training
    cb.on_step_begin(args, None, None, model=model)
    cb.on_train_end(args, None, None, model=model)
    assert root.holds == 0 and not root.active
