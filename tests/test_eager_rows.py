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

from .rounding import assert_one_rounding

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
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if oc._BN_ELEMT is None or oc._BN_REDUCE is None:
        pytest.skip("this torch has no batch_norm_elemt / batch_norm_backward_reduce")
    calls = _count_ops(monkeypatch, oc._BN_ELEMT, oc._BN_REDUCE)
    t = _case(shape, dt, form == "delta", form == "bias", "cuda", seed=5)
    _check(t, dt, form == "delta", form == "bias")
    assert calls["elemt"] >= (2 if form == "plain" else 1) and calls["reduce"] == 1
    if form == "plain":
        _check(t, dt, False, False, dm_from_y=True, need_dlora=False)


# ---- the fused lora_B node on the eager path: inner = addmm(result, h, B^T, alpha=s), y = g * inner -----------------


def _fused_case(shape, r, dt, device, seed=7, b_dtype=None):
    g = torch.Generator(device=device).manual_seed(seed)
    n = shape[-1]

    def rnd(*s, dtype=dt, std=1.0):
        return (torch.randn(*s, generator=g, device=device) * std).to(dtype)

    return dict(result=rnd(*shape), h=rnd(*shape[:-1], r), b=rnd(n, r, dtype=b_dtype or dt, std=r ** -0.5),
                m=(torch.rand(n, generator=g, device=device) + 0.5).to(dt),
                norm=torch.rand(n, generator=g, device=device) + 0.5, dy=rnd(*shape))


def _fused_grads(t, checkpointed=False, autocast=None):
    """(y, d_result, d_h, d_B, dm) of dora_compose_lora_b on the eager path."""
    leaves = {k: t[k].detach().clone().requires_grad_(True) for k in ("result", "h", "b", "m")}

    def f(result, h, b, m):
        ctx = (torch.autocast(result.device.type, dtype=autocast) if autocast is not None
               else torch.autocast(result.device.type, enabled=False))
        with ctx:
            return oc.dora_compose_lora_b(result, h, b, m, t["norm"], SCALE, 1e-6, kernels="eager")

    args = [leaves[k] for k in ("result", "h", "b", "m")]
    if checkpointed:
        y = torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=False)
    else:
        y = f(*args)
    y.backward(t["dy"])
    return y.detach(), leaves["result"].grad, leaves["h"].grad, leaves["b"].grad, leaves["m"].grad


def _fused_ref64(t):
    """fp64 autograd of the formula, from the half inputs."""
    r, h, b, m = (t[k].detach().double().requires_grad_(True) for k in ("result", "h", "b", "m"))
    g = m / t["norm"].double().clamp_min(1e-6)
    y = g * (r + SCALE * (h @ b.t()))
    y.backward(t["dy"].double())
    return y.detach(), r.grad, h.grad, b.grad, m.grad, g.detach()


def _check_fused(t, out):
    y, dr, dh, db, dm = out
    y64, dr64, dh64, db64, dm64, g = _fused_ref64(t)
    t_inner = t["result"].double().abs() + SCALE * (t["h"].double().abs() @ t["b"].double().abs().t())
    # inner rounded once (GEMM in fp32, result added in its epilogue), then y = g * inner rounded once
    bound = (2.0 ** -7 + 1e-5) * g * t_inner + 2.0 ** -7 * y64.abs()
    assert ((y.double() - y64).abs() <= bound).all(), "y beyond two roundings"
    assert_one_rounding(dr, g * t["dy"].double(), (g * t["dy"].double()).abs(), "d_result")
    rel = {}
    for name, a, ref in (("d_h", dh, dh64), ("d_B", db, db64), ("dm", dm, dm64)):
        rel[name] = ((a.double() - ref).norm() / ref.norm()).item()
    # d_h: a half GEMM of dy with g*s*B rounded to the half dtype; d_B: a half GEMM rounded once (x fp32 g*s);
    # dm: fp32 products / sums of the rounded inner (what the saved inner is): activation-dtype level each
    tol = 2.0 ** -6 if t["dy"].dtype == torch.bfloat16 else 2.0 ** -9
    assert all(v < tol for v in rel.values()), rel
    assert dm.dtype == t["m"].dtype and db.dtype == t["b"].dtype


@pytest.mark.parametrize("shape", [(7, 17), (3, 11, 130)], ids=str)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_addmm_wiring_cpu(emulated_ops, monkeypatch, shape, dt):
    calls = []
    real = oc._compose_fwd_addmm
    monkeypatch.setattr(oc, "_compose_fwd_addmm", lambda *a: calls.append(1) or real(*a))
    t = _fused_case(shape, 5, dt, "cpu")
    out = _fused_grads(t)
    assert calls, "the addmm composition was not taken"
    _check_fused(t, out)
    # checkpointed: the first forward discards its saved inner, the recomputation's serves the backward
    n = len(calls)
    out_ck = _fused_grads(t, checkpointed=True)
    assert len(calls) == n + 2
    for a, b in zip(out, out_ck):
        assert torch.equal(a, b)
    # inference (no grad): the same one-GEMM composition, the same y
    with torch.no_grad():
        y = oc.dora_compose_lora_b(t["result"], t["h"], t["b"], t["m"], t["norm"], SCALE, 1e-6, kernels="eager")
    assert len(calls) == n + 3 and torch.equal(y, out[0])


def test_fused_addmm_not_taken_cpu_fp32_or_bias(emulated_ops, monkeypatch):
    """The addmm composition needs half activations in one dtype, no bias, no base_delta, the eager path."""
    t = _fused_case((4, 9), 3, torch.bfloat16, "cpu")
    eager = oc.EAGER
    f = oc._addmm_weight
    assert f(eager, t["result"], t["h"], t["b"], t["m"], None, None, None) is t["b"]
    assert f(eager, t["result"], t["h"], t["b"], t["m"], torch.zeros(9, dtype=torch.bfloat16), None, None) is None
    assert f(eager, t["result"], t["h"], t["b"], t["m"], None, t["result"], None) is None
    assert f(eager, t["result"].float(), t["h"].float(), t["b"].float(), t["m"], None, None, None) is None
    assert f(eager, t["result"], t["h"].float(), t["b"], t["m"], None, None, None) is None
    assert f(eager, t["result"], t["h"], t["b"], t["m"], None, None, torch.float32) is None
    assert f(object(), t["result"], t["h"], t["b"], t["m"], None, None, None) is None
    # fp32 B (PEFT's default adapters) only under autocast to the activations' dtype
    assert f(eager, t["result"], t["h"], t["b"].float(), t["m"], None, None, None) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = f(eager, t["result"], t["h"], t["b"].float(), t["m"], None, None, None)
    assert b is not None and b.dtype == torch.bfloat16
    monkeypatch.undo()
    assert f(eager, t["result"], t["h"], t["b"], t["m"], None, None, None) is None  # CPU tensors: never


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(7, 17), (3, 11, 130), (4096, 4096)], ids=str)
@pytest.mark.parametrize("setup", ["bf16", "fp16", "amp"])
def test_fused_addmm_gpu(shape, setup, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    calls = []
    real = oc._compose_fwd_addmm
    monkeypatch.setattr(oc, "_compose_fwd_addmm", lambda *a: calls.append(1) or real(*a))
    dt = torch.float16 if setup == "fp16" else torch.bfloat16
    t = _fused_case(shape, 48, dt, "cuda", b_dtype=torch.float32 if setup == "amp" else None)
    if setup == "amp":
        t["m"] = t["m"].float()
    out = _fused_grads(t, autocast=torch.bfloat16 if setup == "amp" else None)
    assert calls
    _check_fused(t, out)
    out_ck = _fused_grads(t, checkpointed=True, autocast=torch.bfloat16 if setup == "amp" else None)
    for a, b in zip(out, out_ck):
        assert torch.equal(a, b)
    n = len(calls)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp"):
        y = oc.dora_compose_lora_b(t["result"], t["h"], t["b"], t["m"], t["norm"], SCALE, 1e-6, kernels="eager")
    assert len(calls) == n + 1 and torch.equal(y, out[0])
