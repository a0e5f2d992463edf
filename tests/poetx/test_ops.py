"""The input-centric forward and explicit backward (fastdora.poetx.ops) against autograd on the dense float64 oracle
``y = x·(R W P)ᵀ + b`` with explicit permutation and block-diagonal matrices."""

from __future__ import annotations

import pytest
import torch

from fastdora.poetx.cayley import cayley_neumann, skew_size
from fastdora.poetx.ops import poetx_linear

from . import oracle

# (d_in, d_out, b, batch shape): square, rectangular both ways, one block per side, b = 2, several batch dims
SHAPES = [
    (32, 32, 8, (6,)),
    (32, 64, 16, (2, 3)),
    (48, 16, 8, (5,)),
    (16, 16, 16, (3,)),
    (8, 6, 2, (2, 2, 2)),
]
# relative Frobenius error bounds against the float64 oracle, for the output and every gradient
REL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}  # measured worst: -, 2.1e-7, 4.2e-3


def _case(d_in, d_out, b, batch, dtype, q_dtype, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    return dict(
        x=randn(*batch, d_in).to(dtype),
        weight=(randn(d_out, d_in) / d_in ** 0.5).to(dtype),
        bias=randn(d_out).to(dtype) if bias else None,
        q_in=randn(d_in // b, skew_size(b), scale=0.1).to(q_dtype),
        q_out=randn(d_out // b, skew_size(b), scale=0.1).to(q_dtype),
        perm_in=torch.randperm(d_in, generator=gen),
        perm_out=torch.randperm(d_out, generator=gen),
        grad_y=randn(*batch, d_out),
        b=b,
    )


def _stored(case):
    """The weight in the frame the op takes: ``W'[i, j] = W[perm_out[i], perm_in[j]]``."""
    return case["weight"][case["perm_out"]][:, case["perm_in"]]


def _run(case, mode, terms=3):
    """fastdora's output and gradients (x, bias, q_in, q_out)."""
    x = case["x"].clone().requires_grad_()
    bias = None if case["bias"] is None else case["bias"].clone().requires_grad_()
    q_in = case["q_in"].clone().requires_grad_()
    q_out = case["q_out"].clone().requires_grad_()
    b = case["b"]
    y = poetx_linear(x, _stored(case), bias, cayley_neumann(q_in, b, terms), cayley_neumann(q_out, b, terms),
                     case["perm_in"], case["perm_out"], mode)
    (y.double() * case["grad_y"]).sum().backward()
    return y, x.grad, None if bias is None else bias.grad, q_in.grad, q_out.grad


def _oracle(case, terms=3):
    leaves = [None if case[k] is None else case[k].detach().double().requires_grad_()
              for k in ("x", "bias", "q_in", "q_out")]
    x, bias, q_in, q_out = leaves
    y = oracle.linear(x, case["weight"], bias, q_in, q_out, case["perm_in"], case["perm_out"], case["b"], terms)
    (y * case["grad_y"]).sum().backward()
    return y, x.grad, None if bias is None else bias.grad, q_in.grad, q_out.grad


def _assert_matches(got, ref, rel):
    names = ("output", "grad x", "grad bias", "grad q_in", "grad q_out")
    for name, a, r in zip(names, got, ref):
        if r is None:
            assert a is None, name
            continue
        assert a.shape == r.shape, name
        err = oracle.rel_err(a, r)
        assert err <= rel, f"{name}: relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("mode", ["fast", "mem"])
@pytest.mark.parametrize("d_in, d_out, b, batch", SHAPES)
@pytest.mark.parametrize("dtype, q_dtype", [
    (torch.float64, torch.float64),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
])
def test_forward_and_gradients_match_the_oracle(d_in, d_out, b, batch, dtype, q_dtype, mode):
    case = _case(d_in, d_out, b, batch, dtype, q_dtype)
    got = _run(case, mode)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == dtype
    assert got[3].dtype == q_dtype and got[4].dtype == q_dtype
    _assert_matches(got, _oracle(case), REL[dtype])


@pytest.mark.parametrize("terms", [1, 2, 4])
def test_other_term_counts_match_the_oracle(terms):
    case = _case(32, 16, 8, (4,), torch.float64, torch.float64)
    _assert_matches(_run(case, "fast", terms), _oracle(case, terms), REL[torch.float64])


def test_without_bias():
    case = _case(16, 32, 8, (3,), torch.float64, torch.float64, bias=False)
    _assert_matches(_run(case, "mem"), _oracle(case), REL[torch.float64])


@pytest.mark.parametrize("dtype, q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_fast_and_mem_give_identical_results(dtype, q_dtype):
    case = _case(32, 64, 16, (2, 5), dtype, q_dtype)
    for a, b in zip(_run(case, "fast"), _run(case, "mem")):
        assert torch.equal(a, b)


def _saved_numel(case, mode):
    """Number of values the autograd graph of one forward keeps for the backward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run(case, mode)
    return sum(sizes)


def test_fast_mode_saves_the_gemm_output_and_mem_mode_does_not():
    """Both keep one input-sized tensor (fast: the gathered input, mem: the input)."""
    case = _case(32, 64, 16, (2, 5), torch.float32, torch.float32)
    rows, d_out = 10, 64
    assert _saved_numel(case, "fast") - _saved_numel(case, "mem") == rows * d_out


def test_only_requested_gradients_are_computed():
    case = _case(16, 16, 8, (4,), torch.float64, torch.float64)
    g_in = cayley_neumann(case["q_in"], 8)
    g_out = cayley_neumann(case["q_out"].requires_grad_(), 8)
    x = case["x"]  # no grad for x, bias or q_in
    y = poetx_linear(x, _stored(case), case["bias"], g_in, g_out, case["perm_in"], case["perm_out"])
    (y * case["grad_y"]).sum().backward()
    ref = case["q_out"].detach().clone().requires_grad_()
    y_ref = oracle.linear(x, case["weight"], case["bias"], case["q_in"], ref, case["perm_in"], case["perm_out"], 8)
    (y_ref * case["grad_y"]).sum().backward()
    assert oracle.rel_err(case["q_out"].grad, ref.grad) < 1e-12


def test_clear_errors():
    case = _case(16, 16, 8, (4,), torch.float32, torch.float32)
    g_in, g_out = cayley_neumann(case["q_in"], 8), cayley_neumann(case["q_out"], 8)
    args = (case["x"], case["weight"], case["bias"], g_in, g_out, case["perm_in"], case["perm_out"])
    with pytest.raises(ValueError, match="mode"):
        poetx_linear(*args, mode="slow")
    with pytest.raises(ValueError, match="frozen"):
        poetx_linear(args[0], case["weight"].clone().requires_grad_(), *args[2:])
    with pytest.raises(ValueError, match="features"):
        poetx_linear(case["x"][..., :8], *args[1:])
    with pytest.raises(TypeError, match="dtype"):
        poetx_linear(case["x"].double(), *args[1:])
    with pytest.raises(ValueError, match="tile"):
        poetx_linear(*args[:3], g_in[:1], *args[4:])
    with pytest.raises(ValueError, match="permutation"):
        poetx_linear(*args[:5], case["perm_in"].int(), case["perm_out"])
