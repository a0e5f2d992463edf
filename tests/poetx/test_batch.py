"""One Cayley series per forward for a model's fast-mode layers (fastdora.poetx.batch): the same outputs and
gradients as every layer computing its own series, with checkpointing, gradient accumulation and the cases where a
layer must compute its own."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastdora import active_path_counter, poetx
from fastdora.poetx import PoetXLinear, batch

KEY = "poetx:batched_series"


@pytest.fixture(autouse=True)
def _batching_on(monkeypatch):
    """The batched series is off by default (measured slower): these tests turn it on."""
    monkeypatch.setattr(batch, "ENABLED", True)


class Block(nn.Module):
    def __init__(self, d=32, h=48):
        super().__init__()
        self.up, self.down, self.side = nn.Linear(d, h), nn.Linear(h, d, bias=False), nn.Linear(d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x))) + 0.5 * self.side(x)


class Stack(nn.Module):
    def __init__(self, checkpointing=None):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 8)
        self.checkpointing = checkpointing  # None, "reentrant" or "non_reentrant"

    def forward(self, x):
        for blk in self.blocks:
            if self.checkpointing is None:
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.checkpointing == "reentrant")
        return self.head(x)


def _pair(dtype=torch.float64, mode="fast", checkpointing=None, q_dtype=None):
    """(batched model, per-layer model), equal weights and non-zero Q (float32, convert's default, unless
    ``q_dtype`` is given: then the head's)."""
    torch.manual_seed(0)
    model = Stack(checkpointing).to(dtype)
    report = poetx.convert(model, block_size=8, mode=mode, exclude=())
    gen = torch.Generator().manual_seed(1)
    for layer in model.modules():
        if isinstance(layer, PoetXLinear):
            if q_dtype is not None and layer is model.head:
                layer.q_in.data, layer.q_out.data = layer.q_in.data.to(q_dtype), layer.q_out.data.to(q_dtype)
            with torch.no_grad():
                for q in (layer.q_in, layer.q_out):
                    q.copy_(0.05 * torch.randn(q.shape, generator=gen, dtype=torch.float64))
    reference = copy.deepcopy(model)
    batch.uninstall(reference)
    return model, reference, report


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, reference, x, rtol=1e-12, atol=1e-14):
    active_path_counter.clear()
    y = model(x)
    batched = active_path_counter[KEY]
    y.square().sum().backward()
    y_ref = reference(x)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    grads, grads_ref = _grads(model), _grads(reference)
    assert grads.keys() == grads_ref.keys() and any(".q_in" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=rtol, atol=atol, msg=name)
    return batched


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_batched_series_equals_per_layer_series(checkpointing):
    model, reference, report = _pair(checkpointing=checkpointing)
    assert len(report.converted) == 7
    x = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=checkpointing == "reentrant")
    batched = _assert_same(model, reference, x)
    # every layer call inside the forward (and the checkpoints' recomputations in the backward) took batched blocks
    assert batched == 7


def test_gradient_accumulation_and_interleaved_backwards():
    model, reference, _ = _pair()
    xs = [torch.randn(4, 32, dtype=torch.float64) for _ in range(3)]
    # forward, forward, backward, backward: each backward reads its own forward's blocks
    outs = [model(x) for x in xs[:2]]
    for y in reversed(outs):
        y.square().sum().backward()
    model(xs[2]).sum().backward()
    for x in xs[:2]:
        reference(x).square().sum().backward()
    reference(xs[2]).sum().backward()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(reference)[name], rtol=1e-12, atol=1e-14, msg=name)


def test_after_an_optimizer_step_the_next_forward_uses_the_new_q():
    model, reference, _ = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    x = torch.randn(6, 32, dtype=torch.float64)
    for _ in range(3):
        for m, opt in zip((model, reference), opts):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(model(x), reference(x), rtol=1e-12, atol=1e-14)


def test_layers_outside_the_models_forward_run_their_own_series():
    model, reference, _ = _pair()
    x = torch.randn(4, 32, dtype=torch.float64)
    model(x)  # a forward whose backward never runs
    active_path_counter.clear()
    y = model.blocks[0].up(x)  # the layer on its own: not inside model's forward
    y.sum().backward()
    reference.blocks[0].up(x).sum().backward()
    assert active_path_counter[KEY] == 0
    torch.testing.assert_close(model.blocks[0].up.q_in.grad, reference.blocks[0].up.q_in.grad)


def test_q_changed_in_place_before_the_backward_is_an_error():
    model, _, _ = _pair()
    y = model(torch.randn(4, 32, dtype=torch.float64))
    with torch.no_grad():
        model.head.q_in.add_(0.01)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_q_changed_between_forward_and_recomputation_falls_back_to_the_layer():
    # inside a forward, a layer whose Q changed since the forward started computes its own series (from the new Q)
    model, reference, _ = _pair()
    x = torch.randn(4, 32, dtype=torch.float64)
    calls = []

    def bump(module, args):
        with torch.no_grad():
            module.q_out.mul_(1.5)
        calls.append(1)

    for m in (model, reference):
        m.head.register_forward_pre_hook(bump)
    active_path_counter.clear()
    y = model(x)
    assert active_path_counter[KEY] == 6  # every layer but the head
    torch.testing.assert_close(y, reference(x), rtol=1e-12, atol=1e-14)


def test_mem_mode_frozen_q_and_no_grad_are_not_batched():
    model, reference, _ = _pair(mode="mem")
    x = torch.randn(4, 32, dtype=torch.float64)
    assert _assert_same(model, reference, x) == 0  # (mem mode: install() found no fast-mode layer)
    model, reference, _ = _pair()
    for m in (model, reference):
        for layer in m.modules():
            if isinstance(layer, PoetXLinear) and layer is not m.head:
                layer.q_in.requires_grad_(False)
    assert _assert_same(model, reference, x) == 0  # one eligible layer left: nothing to batch
    active_path_counter.clear()
    with torch.no_grad():
        model(x)
    assert active_path_counter[KEY] == 0


def test_q_of_another_dtype_forms_its_own_group():
    model, reference, _ = _pair(q_dtype=torch.float64)
    x = torch.randn(4, 32, dtype=torch.float64)
    # the head's float64 Q is alone in its group (the others hold convert's default float32): it runs its own
    # series; the six others are batched
    assert model.head.q_in.dtype == torch.float64 and model.blocks[0].up.q_in.dtype == torch.float32
    assert _assert_same(model, reference, x) == 6


def test_disabled_batching_and_export_remove_it():
    model, reference, _ = _pair()
    x = torch.randn(4, 32, dtype=torch.float64)
    batch.ENABLED = False
    try:
        assert _assert_same(model, reference, x) == 0
    finally:
        batch.ENABLED = True
    model.zero_grad()
    reference.zero_grad()
    poetx.export(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    poetx.export(reference)
    torch.testing.assert_close(model(x), reference(x))


def test_chunks_bound_each_series_and_keep_the_results(monkeypatch):
    # 8-feature blocks of float32, 256 bytes each; in module order the layers hold 10, 10, 8 (first block), 10, 10, 8
    # (second block) and 5 (head) blocks: with room for 20 blocks per series, 4 series nodes
    monkeypatch.setattr(batch, "CHUNK_BYTES", 20 * 8 * 8 * 4)
    model, reference, _ = _pair()
    state = model.__dict__["_poetx_series_hooks"][0]
    seen = []
    model.head.register_forward_hook(lambda m, a, o: seen.extend(e[0].grad_fn for e in state.current if e))
    assert _assert_same(model, reference, torch.randn(3, 32, dtype=torch.float64)) == 7
    assert len(seen) == 7 and len(set(seen)) == 4
    assert state.current is None  # nothing held once the backward is done
