"""The eager composition's per-row passes through batch norm's CUDA kernels (``batch_norm_elemt`` for ``t * w``,
``batch_norm_backward_reduce`` for the magnitude gradient's column sum): half-precision activations on CUDA.

On the CPU (CI) the two ops do not exist; the wiring (which per-row vector scales which gradient, the magnitude and
bias reductions, ``dm_from_y``, ``need_dlora``) runs with fp64 emulations of the two ops and is checked against fp64
math. On a GPU (``-m gpu``) the real ops are checked against fp64 math: every scaled tensor one rounding away, the
reductions at fp32 accumulation error.
"""

from __future__ import annotations

import pytest
import torch

from fastdora.ops import compose as oc

from ..rounding import assert_one_rounding

SCALE = 0.73
SHAPES = [(1, 5), (7, 17), (257, 1031), (3, 11, 1000)]


def _emulated_elemt(x, w, b, mean, invstd, eps):
    assert b is None
    return ((x.double() - mean.double()) * invstd.double() * w.double()).to(x.dtype)


def _emulated_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    d = dy.double()
    return d.sum(0).float(), (d * (x.double() - mean.double())).sum(0).float(), None, None


def _contiguous_only(*ts):
    return all(t is None or (t.dim() >= 1 and t.numel() > 0 and t.is_contiguous()) for t in ts)


def _count_ops(monkeypatch, elemt, reduce):
    """Route the module's two batch norm ops through ``elemt`` / ``reduce``, counting calls: the returned dict."""
    calls = {"elemt": 0, "reduce": 0}

    def counted(name, fn):
        def call(*a):
            calls[name] += 1
            return fn(*a)
        return call

    monkeypatch.setattr(oc, "_BN_ELEMT", counted("elemt", elemt))
    monkeypatch.setattr(oc, "_BN_REDUCE", counted("reduce", reduce))
    return calls


@pytest.fixture
def emulated_ops(monkeypatch):
    """The row-kernel branch on CPU tensors, through fp64 emulations of the two batch norm ops."""
    calls = _count_ops(monkeypatch, _emulated_elemt, _emulated_reduce)
    monkeypatch.setattr(oc, "_rows_kernels", _contiguous_only)
    return calls


def _case(shape, dt, delta, bias, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    n = shape[-1]

    def rnd(*s):
        return torch.randn(*s, generator=g, device=device).to(dt)

    return dict(
        result=rnd(*shape), lora=rnd(*shape), dy=rnd(*shape),
        magnitude=torch.rand(n, generator=g, device=device) + 0.5,
        norm=torch.rand(n, generator=g, device=device) + 0.5,
        bias=rnd(n) if bias else None,
        base_delta=rnd(*shape) if delta else None,
    )


def _check(t, dt, delta, bias, dm_from_y=False, need_dlora=True):
    """Forward and backward through the eager path against fp64 math; returns nothing, asserts."""
    eps = 1e-6
    y, inner = oc.compose_fwd_eager(t["result"], t["lora"], t["magnitude"], t["norm"], SCALE, eps, t["bias"],
                                    t["base_delta"], dt, True)
    g = t["magnitude"].double() / t["norm"].double().clamp_min(eps)
    r, lo, dy = t["result"].double(), t["lora"].double(), t["dy"].double()
    if delta:
        bd = t["base_delta"].double()
        y64, ty = r + (g - 1) * bd + g * SCALE * lo, r.abs() + (g - 1).abs() * bd.abs() + g * SCALE * lo.abs()
        i64 = bd + SCALE * lo
    else:
        b = t["bias"].double() if bias else torch.zeros_like(g)
        i64 = r - b + SCALE * lo
        y64, ty = g * i64 + b, g * (r.abs() + b.abs() + SCALE * lo.abs()) + b.abs()
    if not bias and not delta:  # the common case: inner rounded once, y = g * inner rounded once
        assert_one_rounding(y, g * inner.double(), (g * inner.double()).abs(), "y")
    else:
        err = ((y.double() - y64).abs() / ty.clamp_min(1e-30)).max().item()
        assert err < 4 * 2.0 ** -8, f"y: {err:.3g}"  # a few roundings of the activation dtype
    saved = y if dm_from_y else inner
    grads = oc.compose_bwd_eager(t["dy"], t["magnitude"], t["norm"], SCALE, eps, saved, delta, dt, dt,
                                 dt if delta else None, True, bias and not delta, need_dlora=need_dlora,
                                 dm_from_y=dm_from_y)
    d_result, d_lora, d_bd, dm, d_bias = grads
    if delta:
        assert torch.equal(d_result, t["dy"])
        # (g - 1) from the fp32 g: the fp32 evaluation error scales with |g|, not |g - 1|
        assert_one_rounding(d_bd, (g - 1) * dy, (g * dy).abs(), "d_base_delta")
    else:
        assert d_bd is None
        assert_one_rounding(d_result, g * dy, (g * dy).abs(), "d_result")
    if need_dlora:
        assert_one_rounding(d_lora, g * SCALE * dy, (g * SCALE * dy).abs(), "d_lora")
    else:
        assert d_lora is None
    dims = tuple(range(dy.dim() - 1))
    if dm_from_y:
        dm64 = (dy * y.double()).sum(dims) / t["magnitude"].double()
    else:
        dm64 = (dy * inner.double()).sum(dims) / t["norm"].double().clamp_min(eps)
    scale64 = (dy.abs() * saved.double().abs()).sum(dims) / (t["magnitude"] if dm_from_y else t["norm"]).double()
    assert dm.dtype == t["magnitude"].dtype and dm.shape == t["magnitude"].shape
    assert ((dm.double() - dm64).abs() <= 1e-5 * scale64 + 1e-30).all(), "dm beyond fp32 accumulation error"
    if bias and not delta:
        db64 = (1 - g) * dy.sum(dims)
        # fp32 sums, and (1 - g) from the fp32 g: an absolute error of ~1 fp32 ulp of g
        bound = (1e-5 * (1 - g).abs() + 2.0 ** -22 * g.abs()) * dy.abs().sum(dims)
        assert ((d_bias.double() - db64).abs() <= bound).all(), "d_bias beyond fp32 error"
    else:
        assert d_bias is None


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", ["plain", "bias", "delta"])
def test_row_kernel_wiring_cpu(emulated_ops, shape, dt, form):
    t = _case(shape, dt, form == "delta", form == "bias", "cpu")
    _check(t, dt, form == "delta", form == "bias")
    assert emulated_ops["elemt"] >= (2 if form == "plain" else 1) and emulated_ops["reduce"] == 1


@pytest.mark.parametrize("dm_from_y", [False, True])
def test_row_kernel_wiring_options_cpu(emulated_ops, dm_from_y):
    t = _case((33, 130), torch.bfloat16, False, False, "cpu", seed=3)
    _check(t, torch.bfloat16, False, False, dm_from_y=dm_from_y, need_dlora=False)


def test_row_kernels_not_taken_cpu_or_strided(emulated_ops, monkeypatch):
    """The real gate: no CPU tensor, no strided tensor, nothing while compiling, nothing without the ops."""
    monkeypatch.undo()
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert not oc._rows_kernels(x)
    if torch.cuda.is_available():
        xc = x.cuda()
        assert oc._rows_kernels(xc) == (oc._BN_ELEMT is not None and oc._BN_REDUCE is not None)
        assert not oc._rows_kernels(xc.t())
        monkeypatch.setattr(oc, "_BN_REDUCE", None)
        assert not oc._rows_kernels(xc)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(4096, 4096)], ids=str)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", ["plain", "bias", "delta"])
def test_row_kernels_gpu(shape, dt, form, monkeypatch):
    if oc._BN_ELEMT is None or oc._BN_REDUCE is None:
        pytest.skip("this torch has no batch_norm_elemt / batch_norm_backward_reduce")
    calls = _count_ops(monkeypatch, oc._BN_ELEMT, oc._BN_REDUCE)
    t = _case(shape, dt, form == "delta", form == "bias", "cuda", seed=5)
    _check(t, dt, form == "delta", form == "bias")
    assert calls["elemt"] >= (2 if form == "plain" else 1) and calls["reduce"] == 1
    if form == "plain":
        _check(t, dt, False, False, dm_from_y=True, need_dlora=False)
