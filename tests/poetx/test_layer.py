"""PoetXLinear: exact at conversion, merge preserves the function and rounds once, shared permutations, state dict,
to_linear, autocast."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fastdora.poetx import PoetXLinear
from fastdora.poetx.layer import permutation_seed

from . import oracle


def _linear(d_in=32, d_out=64, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(d_in, d_out, bias=bias).to(dtype)


def _randomize_q(layer, scale=0.05, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in (layer.q_in, layer.q_out):
            q.copy_(torch.randn(q.shape, generator=gen, dtype=torch.float64) * scale)


def _x(*shape, dtype=torch.float32, seed=2):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _oracle_forward(layer, x):
    return oracle.linear(x, oracle.natural_weight(layer), layer.bias, layer.q_in, layer.q_out, layer.perm_in,
                         layer.perm_out, layer.block_size, layer.terms)


def _forward_backward(module, x, grad):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(grad)
    return y, x.grad


def _assert_reordered_sum(got, want, dtype, terms):
    """``got`` is ``want``'s sums of ``terms`` products added in another order (then rounded to ``dtype``): within
    ``terms`` float32 units of the largest value, plus one unit in the last place of ``dtype``."""
    eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(dtype).eps
    scale = want.abs().max().item()
    bound = (terms * eps32 * scale if dtype != torch.float64 else terms * eps * scale) + (
        eps * want.abs().double() if dtype != torch.float64 else 0.0)
    assert ((got.double() - want.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_new_layer_without_bias_computes_what_the_linear_computed(dtype):
    """The layer stores ``W`` in its permutations' frame, so with identity blocks its GEMM adds the same products as
    nn.Linear's in another order: outputs and input gradients equal up to that order (and the one rounding to the
    output dtype)."""
    base = _linear(bias=False, dtype=dtype)
    ref = copy.deepcopy(base)
    x, grad = _x(3, 5, 32, dtype=dtype), _x(3, 5, 64, dtype=dtype, seed=3)
    got, want = _forward_backward(PoetXLinear(base, 16), x, grad), _forward_backward(ref, x, grad)
    _assert_reordered_sum(got[0], want[0], dtype, 32)
    _assert_reordered_sum(got[1], want[1], dtype, 64)


def test_the_weight_is_stored_in_the_frame_of_the_permutations():
    base = _linear()
    weight = base.weight.detach().clone()
    layer = PoetXLinear(base, 16)
    assert torch.equal(layer.weight, weight[layer.perm_out][:, layer.perm_in])
    assert torch.equal(oracle.natural_weight(layer), weight)
    assert torch.equal(layer.effective_weight(), weight)  # Q = 0: R·W·P = W


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_new_layer_with_bias_is_within_a_few_roundings_of_the_linear(dtype):
    """nn.Linear adds the bias inside the GEMM (addmm, where the backend picks where in the sum it goes); the layer
    adds it to the GEMM's rounded output in the output-side product and sums in its permutations' order: the results
    differ by the rounding of that addition, its place in the sum and the order, a few units in the last place."""
    base = _linear(dtype=dtype)
    ref = copy.deepcopy(base)
    layer = PoetXLinear(base, 16)
    x, grad = _x(3, 5, 32, dtype=dtype), _x(3, 5, 64, dtype=dtype, seed=3)
    (y, gx), (y_ref, gx_ref) = _forward_backward(layer, x, grad), _forward_backward(ref, x, grad)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, y_ref, rtol=0, atol=4 * eps * y_ref.abs().max().item())
    _assert_reordered_sum(gx, gx_ref, dtype, 64)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=4 * eps, atol=4 * eps)


def test_wrapping_reuses_the_parameters_and_freezes_only_the_weight():
    base = _linear()
    weight, bias = base.weight, base.bias
    layer = PoetXLinear(base, 16)
    assert layer.weight is weight and layer.bias is bias
    assert not weight.requires_grad and bias.requires_grad
    assert layer.q_in.shape == (2, 120) and layer.q_out.shape == (4, 120)
    assert layer.q_in.dtype == layer.q_out.dtype == torch.float32
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {"bias", "q_in", "q_out"}
    layer(_x(4, 32)).sum().backward()
    assert weight.grad is None and layer.q_in.grad is not None and layer.q_out.grad is not None


@pytest.mark.parametrize("mode", ["fast", "mem"])
def test_forward_matches_the_oracle(mode):
    layer = PoetXLinear(_linear(dtype=torch.float64), 8, mode=mode, q_dtype=torch.float64)
    _randomize_q(layer)
    x = _x(2, 3, 32, dtype=torch.float64)
    assert oracle.rel_err(layer(x), _oracle_forward(layer, x)) < 1e-12


@pytest.mark.parametrize("dtype, q_dtype, rel", [
    (torch.float64, torch.float64, 1e-13),
    (torch.float32, torch.float32, 1e-6),
])
def test_merge_preserves_the_function_and_keeps_the_bias(dtype, q_dtype, rel):
    layer = PoetXLinear(_linear(dtype=dtype), 16, q_dtype=q_dtype)
    _randomize_q(layer)
    bias_before = layer.bias.detach().clone()
    params = [layer.weight, layer.bias, layer.q_in, layer.q_out]
    perms = (layer.perm_in.clone(), layer.perm_out.clone())
    x = _x(9, 32, dtype=dtype)
    with torch.no_grad():
        before = _oracle_forward(layer, x)
        layer.merge()
        after = layer(x)
    assert oracle.rel_err(after, before) < rel
    assert torch.equal(layer.bias, bias_before)
    assert [layer.weight, layer.bias, layer.q_in, layer.q_out] == params  # same objects: optimizers keep them
    assert not layer.q_in.any() and not layer.q_out.any()
    assert int(layer.merge_count) == 1
    assert not torch.equal(layer.perm_in, perms[0]) and not torch.equal(layer.perm_out, perms[1])


def test_float32_merge_is_the_exact_product_to_float32_accuracy():
    layer = PoetXLinear(_linear(64, 64), 16)
    _randomize_q(layer, scale=0.02)
    exact = oracle.effective_weight(oracle.natural_weight(layer), layer.q_in, layer.q_out, layer.perm_in,
                                    layer.perm_out, 16)
    layer.merge()
    assert (oracle.natural_weight(layer).double() - exact).abs().max() <= 1e-6 * exact.abs().max()


def test_bf16_merge_rounds_the_exact_product_once():
    """Computed in float32 and rounded once: every entry is within half a bfloat16 unit in the last place of the
    exact float64 product (plus the float32 computation's error); rounding twice would break this bound."""
    layer = PoetXLinear(_linear(64, 64, dtype=torch.bfloat16), 16)
    _randomize_q(layer, scale=0.02)
    exact = oracle.effective_weight(oracle.natural_weight(layer), layer.q_in, layer.q_out, layer.perm_in,
                                    layer.perm_out, 16)
    layer.merge()
    merged = oracle.natural_weight(layer).double()
    half_ulp = 0.5 * torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(exact.abs()))
    assert ((merged - exact).abs() <= half_ulp + 1e-6 * exact.abs().max()).all()
    assert (merged == exact.to(torch.bfloat16).double()).float().mean() > 0.99


def test_permutations_are_the_same_in_every_process_and_change_with_each_merge():
    a = PoetXLinear(_linear(), 16, seed=7, layer_index=3)
    b = PoetXLinear(_linear(seed=5), 16, seed=7, layer_index=3)
    other = PoetXLinear(_linear(), 16, seed=7, layer_index=4)
    for perm, d in ((a.perm_in, 32), (a.perm_out, 64)):
        assert torch.equal(perm.sort().values, torch.arange(d))
    assert torch.equal(a.perm_in, b.perm_in) and torch.equal(a.perm_out, b.perm_out)
    assert not torch.equal(a.perm_in, other.perm_in)
    seen = {tuple(a.perm_in.tolist())}
    for _ in range(3):
        a.merge()
        b.merge()
        assert torch.equal(a.perm_in, b.perm_in) and torch.equal(a.perm_out, b.perm_out)
        seen.add(tuple(a.perm_in.tolist()))
    assert len(seen) == 4
    # the seed hash is part of the checkpoint format: a changed hash would draw other permutations on resume
    assert permutation_seed(0, 0, 0) == 0x11C13ADE1C7E5F48
    assert permutation_seed(7, 3, 2) == 0x04A39D349E239D3C


def test_state_dict_resumes_the_same_permutations_and_merge_count():
    a = PoetXLinear(_linear(), 16, seed=1)
    _randomize_q(a)
    a.merge()
    a.merge()
    _randomize_q(a, seed=4)
    b = PoetXLinear(_linear(seed=9), 16, seed=1)
    assert set(a.state_dict()) == {"weight", "bias", "q_in", "q_out", "merge_count", "perm_in", "perm_out"}
    b.load_state_dict(a.state_dict())
    x = _x(5, 32)
    assert torch.equal(a(x), b(x))
    a.merge()
    b.merge()
    assert int(b.merge_count) == 3
    assert torch.equal(a.perm_in, b.perm_in) and torch.equal(a.perm_out, b.perm_out)
    assert torch.equal(a.weight, b.weight)


@pytest.mark.parametrize("bias", [True, False])
def test_to_linear_is_a_plain_linear_with_the_same_function(bias):
    layer = PoetXLinear(_linear(bias=bias), 16)
    _randomize_q(layer)
    weight_before = layer.weight.detach().clone()
    linear = layer.to_linear()
    assert type(linear) is nn.Linear and linear.weight.requires_grad
    assert linear.weight.dtype == layer.weight.dtype
    x = _x(6, 32)
    assert oracle.rel_err(linear(x), layer(x)) < 1e-6
    assert torch.equal(layer.weight, weight_before) and layer.q_in.any()  # the layer is untouched
    if bias:
        assert torch.equal(linear.bias, layer.bias) and linear.bias.data_ptr() != layer.bias.data_ptr()
    else:
        assert linear.bias is None


def test_autocast_runs_the_gemm_in_the_autocast_dtype():
    base = _linear()
    ref = copy.deepcopy(base)
    layer = PoetXLinear(base, 16)
    x = _x(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = layer(x), ref(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert oracle.rel_err(y, y_ref) < 2 ** -8
    _randomize_q(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    assert layer.q_in.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    expected = oracle.linear(x.bfloat16(), oracle.natural_weight(layer).bfloat16(), layer.bias.bfloat16(), layer.q_in,
                             layer.q_out, layer.perm_in, layer.perm_out, 16)
    assert oracle.rel_err(y, expected) < 1e-2


def test_invalid_layer_arguments():
    with pytest.raises(TypeError, match="nn.Linear"):
        PoetXLinear(nn.Conv1d(4, 4, 1), 2)
    with pytest.raises(ValueError, match="divide"):
        PoetXLinear(_linear(32, 24), 16)
    for bad in (1, 2.0, True):
        with pytest.raises(ValueError, match="block_size"):
            PoetXLinear(_linear(), bad)
    with pytest.raises(ValueError, match="mode"):
        PoetXLinear(_linear(), 16, mode="slow")
    with pytest.raises(ValueError, match="terms"):
        PoetXLinear(_linear(), 16, terms=0)
