"""Triton kernels on a CUDA GPU (run on the H200: ``pytest -m gpu tests/kernels/test_kernels_gpu.py``).

Correctness against the eager PyTorch path and an fp64 reference (precision envelope: kernel error <= 2x the eager
error at the same dtype + a small floor), a >= 2**31-element tensor, fp64 gradcheck, bitwise determinism of the
magnitude gradient, and torch.compile(fullgraph=True) without recompilation.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu  # without CUDA, tests/conftest.py skips the whole module

pytest.importorskip("triton")

from fastdora import config, dispatch  # noqa: E402
from fastdora.kernels import compose as kc  # noqa: E402
from fastdora.kernels import norm as kn  # noqa: E402
from fastdora.ops import compose as oc  # noqa: E402
from fastdora.ops import norm as on  # noqa: E402

from ..rounding import assert_one_rounding, ref_compose64  # noqa: E402

# the Triton implementation (the kernels where they cover a call, the exact eager functions where not)
TRITON = oc.triton_impl()

DEV = "cuda"
DTYPES = {
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16, torch.float16),
    "amp": (torch.bfloat16, torch.bfloat16, torch.float32),  # bf16 activations, fp32 magnitude
    "mixed": (torch.bfloat16, torch.float32, torch.float32),  # bf16 result + fp32 lora
}
SHAPES = [(1, 5), (7, 17), (33, 130), (257, 4099), (3, 11, 1000)]
SCALE = 0.73
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.fixture
def settings():
    """``settings(name=value, ...)``: internal settings (``fastdora.config.override``) changed until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(config.override(**changes))


def _eps(dt):
    return 1e-12 if dt == torch.float32 else 1e-6


def _rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# the norms are fp32 results of fp32-accumulated math: their envelope floor is a few fp32 rounding units, not FLOOR's
NORM_FLOOR = 1e-8


def _envelope(k, e, ref, dtype, what, floor=None):
    assert torch.isfinite(k).all(), what
    ek, ee = _rel(k, ref), _rel(e, ref)
    floor = FLOOR[dtype] if floor is None else floor
    assert ek <= 2 * ee + floor, f"{what}: kernel rel err {ek:.3g} vs eager {ee:.3g}"


def _inputs(shape, rdt, ldt, mdt, delta, bias, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = shape[-1]

    def rnd(*s, dtype):
        return torch.randn(*s, generator=g, device=DEV).to(dtype)

    return dict(
        result=rnd(*shape, dtype=rdt),
        lora=rnd(*shape, dtype=ldt),
        magnitude=(torch.rand(n, generator=g, device=DEV) + 0.5).to(mdt),
        norm=torch.rand(n, generator=g, device=DEV) + 0.5,
        bias=rnd(n, dtype=rdt) if bias else None,
        base_delta=rnd(*shape, dtype=rdt) if delta else None,
    )


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("delta", [False, True], ids=["plain", "delta"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_compose_matches_eager_and_fp64(shape, dname, delta, bias):
    rdt, ldt, mdt = DTYPES[dname]
    t = _inputs(shape, rdt, ldt, mdt, delta, bias)
    out_dtype = torch.promote_types(rdt, ldt)
    eps = _eps(rdt)
    args = (t["result"], t["lora"], t["magnitude"], t["norm"], SCALE, eps, t["bias"], t["base_delta"], out_dtype)
    yk, ik = TRITON.compose_fwd(*args, True)
    ye, ie = oc.compose_fwd_eager(*args, True)
    t64 = {k: (v.double() if v is not None else None) for k, v in t.items()}
    yr, ir = oc.compose_fwd_eager(t64["result"], t64["lora"], t64["magnitude"], t64["norm"], SCALE, eps,
                                  t64["bias"], t64["base_delta"], torch.float64, True)
    assert yk.dtype == ye.dtype and ik.dtype == ie.dtype and yk.shape == ye.shape
    _envelope(yk, ye, yr, out_dtype, "y")
    _envelope(ik, ie, ir, ie.dtype, "inner")
    dy = torch.randn(shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)).to(out_dtype)
    bdt = rdt if delta else None
    gk = TRITON.compose_bwd(dy, t["magnitude"], t["norm"], SCALE, eps, ik, delta, rdt, ldt, bdt, True, bias)
    ge = oc.compose_bwd_eager(dy, t["magnitude"], t["norm"], SCALE, eps, ie, delta, rdt, ldt, bdt, True, bias)

    def ref64(inner):
        return oc.compose_bwd_eager(dy.double(), t64["magnitude"], t64["norm"], SCALE, eps, inner, delta,
                                    torch.float64, torch.float64, torch.float64 if delta else None, True, bias)

    gr = ref64(ir)
    for name, a, b, r in zip(("d_result", "d_lora", "d_base_delta", "dm", "d_bias"), gk, ge, gr):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "dm":
            # dm reduces the SAVED inner (its rounding is checked above, "inner"): each path against fp64 math on
            # its own saved inner measures the reduction itself (fp32 accumulation), not which of the two
            # low-precision inners happened to round closer on a few elements
            ek, ee = _rel(a, ref64(ik.double())[3]), _rel(b, ref64(ie.double())[3])
            assert ek <= 2 * ee + FLOOR[torch.float32], f"dm: kernel rel err {ek:.3g} vs eager {ee:.3g}"
            continue
        _envelope(a, b, r, a.dtype if a.dtype in FLOOR else torch.float32, name)


def test_strided_layouts():
    gen = torch.Generator(device=DEV).manual_seed(11)
    big = torch.randn(64, 40, 300, device=DEV, dtype=torch.bfloat16, generator=gen)
    result = big[:, :, 7:207]  # strided rows, unit last dim, 14-byte offset (not 16-byte aligned)
    lora = torch.randn(64, 200, 40, device=DEV, dtype=torch.bfloat16, generator=gen).transpose(1, 2)  # copied
    mag = torch.rand(200, device=DEV, generator=gen) + 0.5
    nrm = torch.rand(200, device=DEV, generator=gen) + 0.5
    yk, ik = TRITON.compose_fwd(result, lora, mag, nrm, SCALE, 1e-6, None, None, torch.bfloat16, True)
    y64, i64, ty, ti, g = ref_compose64(result, lora, mag, nrm, SCALE, 1e-6)
    assert_one_rounding(yk, y64, ty, "y")
    assert_one_rounding(ik, i64, ti, "inner")
    dy = torch.randn(64, 200, 40, device=DEV, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    gk = TRITON.compose_bwd(dy, mag, nrm, SCALE, 1e-6, ik, False, torch.bfloat16, torch.bfloat16, None, True,
                            False)
    d64 = dy.double()
    assert_one_rounding(gk[0], g * d64, (g * d64).abs(), "d_result")
    assert_one_rounding(gk[1], g * SCALE * d64, (g * SCALE * d64).abs(), "d_lora")
    dm_ref = (d64 * ik.double()).sum(dim=(0, 1)) / nrm.double()
    assert _rel(gk[3], dm_ref) < 1e-5


def test_more_than_2pow31_elements():
    N = 4096
    M = (1 << 31) // N + 3  # > 2**31 elements per tensor
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * (1 << 30):
        pytest.skip("needs ~40 GB free GPU memory")
    g = torch.Generator(device=DEV).manual_seed(0)
    result = torch.randn(M, N, device=DEV, generator=g, dtype=torch.bfloat16)
    lora = torch.randn(M, N, device=DEV, generator=g, dtype=torch.bfloat16)
    mag = torch.rand(N, device=DEV, generator=g) + 0.5
    nrm = torch.rand(N, device=DEV, generator=g) + 0.5
    y, inner = TRITON.compose_fwd(result, lora, mag, nrm, SCALE, 1e-6, None, None, torch.bfloat16, True)
    for sl in (slice(0, 64), slice(M - 64, M)):  # the tail lies past 2**31 elements
        y64, i64, ty, ti, _ = ref_compose64(result[sl], lora[sl], mag, nrm, SCALE, 1e-6)
        assert_one_rounding(y[sl], y64, ty, "y")
        assert_one_rounding(inner[sl], i64, ti, "inner")
    del result
    dy = lora  # reuse the memory: any values do
    d_res, d_lora, _, dm, _ = TRITON.compose_bwd(dy, mag, nrm, SCALE, 1e-6, inner, False, torch.bfloat16,
                                                 torch.bfloat16, None, True, False)
    gcol = mag.double() / nrm.double()
    for sl in (slice(0, 64), slice(M - 64, M)):
        d64 = dy[sl].double()
        assert_one_rounding(d_res[sl], gcol * d64, (gcol * d64).abs(), "d_result")
        assert_one_rounding(d_lora[sl], gcol * SCALE * d64, (gcol * SCALE * d64).abs(), "d_lora")
    del d_res, d_lora
    dm_ref = torch.zeros(N, device=DEV, dtype=torch.float64)
    for s0 in range(0, M, 65536):
        dm_ref += (dy[s0:s0 + 65536].double() * inner[s0:s0 + 65536].double()).sum(0)
    dm_ref /= nrm.double()
    assert _rel(dm, dm_ref) < 1e-5


def test_fp64_gradcheck_through_dispatch():
    # the kernels accumulate in fp32; fp64 inputs take the exact eager path inside the Triton implementation:
    # gradcheck that path
    nrm = torch.rand(6, device=DEV, dtype=torch.float64) + 0.5
    b = torch.randn(6, device=DEV, dtype=torch.float64)

    def mk(*shape):
        return torch.randn(*shape, device=DEV, dtype=torch.float64, requires_grad=True)

    m = (torch.rand(6, device=DEV, dtype=torch.float64) + 0.5).requires_grad_(True)

    def plain(r, lo, m):
        return dispatch.dora_compose(r, lo, m, nrm, SCALE, 1e-12, bias=b, kernels="triton")

    def delta(r, lo, m, bd):
        return dispatch.dora_compose(r, lo, m, nrm, SCALE, 1e-12, base_delta=bd, kernels="triton")

    assert torch.autograd.gradcheck(plain, (mk(3, 4, 6), mk(3, 4, 6), m))
    assert torch.autograd.gradcheck(delta, (mk(3, 4, 6), mk(3, 4, 6), m, mk(3, 4, 6)))


def test_gradcheck_fp32_kernel_against_fp64():
    # fp32 kernels: analytic gradients of the kernel path vs fp64 autograd of the reference formula
    t = _inputs((5, 9, 33), torch.float32, torch.float32, torch.float32, False, True, seed=11)
    r, lo = t["result"].requires_grad_(True), t["lora"].requires_grad_(True)
    m = t["magnitude"].clone().requires_grad_(True)
    y = TRITON.apply(r, lo, m, t["norm"], t["bias"], None, SCALE, 1e-12, torch.float32, -1)
    dy = torch.randn_like(y)
    y.backward(dy)
    r64 = t["result"].detach().double().requires_grad_(True)
    lo64 = t["lora"].detach().double().requires_grad_(True)
    m64 = t["magnitude"].detach().double().requires_grad_(True)
    g = m64 / t["norm"].double()
    b = t["bias"].double()
    y64 = g * (r64 - b + SCALE * lo64) + b
    y64.backward(dy.double())
    for a, ref in ((r.grad, r64.grad), (lo.grad, lo64.grad), (m.grad, m64.grad), (y, y64)):
        assert _rel(a, ref) < 1e-5


def test_dm_bitwise_deterministic():
    t = _inputs((8192, 4096), torch.bfloat16, torch.bfloat16, torch.float32, False, False, seed=2)
    _, inner = TRITON.compose_fwd(t["result"], t["lora"], t["magnitude"], t["norm"], SCALE, 1e-6, None, None,
                                  torch.bfloat16, True)
    dy = torch.randn(8192, 4096, device=DEV, dtype=torch.bfloat16)
    outs = [
        TRITON.compose_bwd(dy, t["magnitude"], t["norm"], SCALE, 1e-6, inner, False, torch.bfloat16,
                           torch.bfloat16, None, True, True)
        for _ in range(4)
    ]
    for o in outs[1:]:
        assert torch.equal(o[3], outs[0][3]) and torch.equal(o[4], outs[0][4])


def test_torch_compile_fullgraph_no_recompile():
    import torch._dynamo

    torch._dynamo.reset()
    N = 256
    mag = (torch.rand(N, device=DEV) + 0.5).requires_grad_(True)
    nrm = torch.rand(N, device=DEV) + 0.5
    W = torch.randn(N, N, device=DEV, dtype=torch.bfloat16)
    A = torch.nn.Parameter(torch.randn(16, N, device=DEV) * 0.05)
    B = torch.nn.Parameter(torch.randn(N, 16, device=DEV) * 0.05)

    def layer(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            result = x @ W.t()
            lora = (x @ A.t()) @ B.t()
            return dispatch.dora_compose(result, lora, mag, nrm, 0.5, 1e-6, kernels="triton")

    compiled = torch.compile(layer, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            x = torch.randn(4, 64, N, device=DEV, dtype=torch.bfloat16)
            y = compiled(x)
            y.float().square().mean().backward()
            ye = layer(x)
            torch.testing.assert_close(y, ye, rtol=2 ** -6, atol=2e-2)
    assert mag.grad is not None and A.grad is not None


def test_dispatch_picks_triton_on_cuda():
    t = _inputs((512, 1024), torch.bfloat16, torch.bfloat16, torch.float32, False, False)
    impl = dispatch.compose_impl(t["result"], t["lora"], t["magnitude"], None, None, -1, "auto")
    assert impl is TRITON
    assert dispatch.compose_impl(t["result"], t["lora"], t["magnitude"], None, None, -1, "eager") is oc.EAGER


# ------------------------------------------------------------------------------------------------------- norm

NORM_CASES = [(5, 7, 3), (130, 70, 8), (1000, 777, 20), (4096, 4096, 384), (2048, 8192, 64)]
NORM_DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16W_fp32AB": (torch.bfloat16, torch.float32),
    "fp16W_fp32AB": (torch.float16, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
}


@pytest.mark.parametrize("case", NORM_CASES, ids=str)
@pytest.mark.parametrize("dname", list(NORM_DTYPES))
@pytest.mark.parametrize("transposed", [False, True], ids=["W", "Wt"])
def test_factored_norm_gpu(case, dname, transposed):
    d_out, d_in, r = case
    wdt, adt = NORM_DTYPES[dname]
    g = torch.Generator(device=DEV).manual_seed(d_out + r)
    W = (torch.randn(d_out, d_in, generator=g, device=DEV) / d_in ** 0.5).to(wdt)
    if transposed:
        W = W.t().contiguous().t()
    A = (torch.randn(r, d_in, generator=g, device=DEV) / d_in ** 0.5).to(adt)
    B = (torch.randn(d_out, r, generator=g, device=DEV) * 0.3).to(adt)
    s = 1.3
    assert kn.supports(W, A, B)
    nk, bk = kn.factored_norm_triton(W, A, B, s)
    ne, be = on.factored_norm_eager(W, A, B, s)
    dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
    _envelope(nk, ne, dense, torch.float32, "norm", NORM_FLOOR)
    _envelope(bk, be, W.double().square().sum(1), torch.float32, "base_sq", NORM_FLOOR)
    nk2, _ = kn.factored_norm_triton(W, A, B, s, base_sq=be)
    _envelope(nk2, ne, dense, torch.float32, "norm cached base", NORM_FLOOR)
    assert torch.equal(kn.factored_norm_triton(W, A, B, s)[0], nk)  # run-to-run bitwise (chained U accumulation)


@pytest.mark.parametrize("r", [20, 190, 384])
@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
def test_gram_matrix_gpu(r, adt):
    """G = A A^T as the norm computes it, over 1..16 K ranges (packed upper-triangle partial tiles, summed and
    mirrored by _g_sum_kernel where that saves space): within 2x an fp32 matmul's error vs fp64, exactly symmetric,
    bitwise reproducible."""
    d_in = 4096
    g = torch.Generator(device=DEV).manual_seed(r)
    A = (torch.randn(r, d_in, generator=g, device=DEV) / d_in ** 0.5).to(adt)
    ref = A.double() @ A.double().T
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        e32 = ((A.float() @ A.float().T).double() - ref).norm() / ref.norm()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    for sg in (1, 2, 5, 16):
        G = torch.full((r, r), float("nan"), device=DEV)
        kn._gram_matrix(A, G, sg, False)
        err = (G.double() - ref).norm() / ref.norm()
        assert torch.isfinite(G).all() and err <= 2 * e32 + 1e-9, (sg, err.item(), e32.item())
        if r > 64:
            assert torch.equal(G[:64, 64:], G[64:, :64].T), sg
        G2 = torch.empty_like(G)
        kn._gram_matrix(A, G2, sg, False)
        assert torch.equal(G, G2), sg


def test_norm_dispatch_and_fp64():
    W = torch.randn(64, 48, device=DEV, dtype=torch.float64)
    A = torch.randn(4, 48, device=DEV, dtype=torch.float64)
    B = torch.randn(64, 4, device=DEV, dtype=torch.float64)
    assert dispatch.norm_impl(W, A, B, "auto") is on.factored_norm_eager
    assert dispatch.norm_impl(W.float(), A.float(), B.float(), "auto") is kn.factored_norm_triton


@pytest.mark.parametrize("wdt,adt", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                     (torch.float16, torch.float16), (torch.float32, torch.float32)], ids=str)
def test_factored_norm_realistic_scales(wdt, adt):
    # small B (the cross term matters): the regime where a half-precision tensor-core product lost ~1e-5
    d_out, d_in, r = 4096, 8192, 384
    g = torch.Generator(device=DEV).manual_seed(0)
    W = (torch.randn(d_out, d_in, generator=g, device=DEV) / d_in ** 0.5).to(wdt)
    A = (torch.randn(r, d_in, generator=g, device=DEV) / d_in ** 0.5).to(adt)
    B = (torch.randn(d_out, r, generator=g, device=DEV) * 0.05).to(adt)
    s = 16 / r ** 0.5
    nk, _ = kn.factored_norm_triton(W, A, B, s)
    ne, _ = on.factored_norm_eager(W, A, B, s)
    dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
    _envelope(nk, ne, dense, torch.float32, "norm", NORM_FLOOR)


@pytest.mark.parametrize("quad_in_u", [True, False], ids=["BG_in_U", "BG_in_combine"])
@pytest.mark.parametrize("wdt,adt", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float16), (torch.float32, torch.float32)], ids=str)
def test_norm_quadratic_dominant_gpu(settings, quad_in_u, wdt, adt):
    # tiny W, large s B A: the norm is (almost) all quadratic term s^2 rowsum((B G) * B). A k/v-projection shape, so
    # the U pass splits K and deals B G's rank chunks out over the K-range programs; bitwise reproducible
    settings(norm_quad_in_u=quad_in_u)
    d_out, d_in, r = 1024, 4096, 384
    g = torch.Generator(device=DEV).manual_seed(3)
    W = (torch.randn(d_out, d_in, generator=g, device=DEV) * 1e-3 / d_in ** 0.5).to(wdt)
    A = (torch.randn(r, d_in, generator=g, device=DEV) / d_in ** 0.5).to(adt)
    B = torch.randn(d_out, r, generator=g, device=DEV).to(adt)
    s = 3.0
    nk, _ = kn.factored_norm_triton(W, A, B, s)
    nk2, _ = kn.factored_norm_triton(W, A, B, s)
    ne, _ = on.factored_norm_eager(W, A, B, s)
    dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
    assert _rel(W.double().norm(dim=1), dense) > 0.99
    _envelope(nk, ne, dense, torch.float32, f"norm, quadratic term dominant, quad_in_u={quad_in_u}", NORM_FLOOR)
    assert torch.equal(nk, nk2)


@pytest.mark.parametrize("mode", ["presplit_tma", "presplit_pointers", "split_in_registers"])
@pytest.mark.parametrize("case", ["realistic", "quadratic_dominant", "odd_transposed"])
def test_norm_amp_split_modes_gpu(monkeypatch, settings, mode, case):
    # bf16 W with fp32 A and B (AMP): A's bf16 parts split once into a [3, r, d_in] copy (_MODE_PRESPLIT; realistic:
    # 4 K chunks adding into the same partial sums) loaded by TMA (default on Hopper) or by pointers, or split in
    # registers by every U program (_MODE_SPLIT): all within the envelope, bitwise reproducible, and close to each
    # other (the same products, summed in another order). TMA only where it can address W (not the transposed view)
    # and the parts fit (not the k/v shape of quadratic_dominant)
    d_out, d_in, r, wscale, bscale, s = {
        "realistic": (4096, 8192, 384, 1.0, 0.05, 16 / 384 ** 0.5),
        "quadratic_dominant": (1024, 4096, 384, 1e-3, 1.0, 3.0),
        "odd_transposed": (1000, 777, 20, 1.0, 0.3, 1.3),
    }[case]
    g = torch.Generator(device=DEV).manual_seed(d_out + r)
    W = (torch.randn(d_out, d_in, generator=g, device=DEV) * wscale / d_in ** 0.5).to(torch.bfloat16)
    if case == "odd_transposed":
        W = W.t().contiguous().t()
    A = torch.randn(r, d_in, generator=g, device=DEV) / d_in ** 0.5
    B = torch.randn(d_out, r, generator=g, device=DEV) * bscale
    presplit = mode != "split_in_registers"
    settings(norm_presplit=presplit, norm_tma=mode == "presplit_tma")
    assert kn._mode_of(W, A, False)[0] == (kn._MODE_PRESPLIT if presplit else kn._MODE_SPLIT)
    seen = []
    real = kn._U_TMA
    monkeypatch.setattr(kn, "_U_TMA", lambda grid, *a, **kw: (seen.append((grid, a[3])), real(grid, *a, **kw)))
    nk, bk = kn.factored_norm_triton(W, A, B, s)
    nk2, bk2 = kn.factored_norm_triton(W, A, B, s)
    if mode == "presplit_tma" and case == "realistic":  # 4 chunks of 2048 columns, twice; ACCUM after the first
        assert [cs[5] for _, cs in seen] == [False, True, True, True] * 2, seen
    else:
        assert not seen, seen
    ne, be = on.factored_norm_eager(W, A, B, s)
    dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
    _envelope(nk, ne, dense, torch.float32, f"norm AMP {case} {mode}", NORM_FLOOR)
    _envelope(bk, be, W.double().square().sum(1), torch.float32, "base_sq", NORM_FLOOR)
    assert torch.equal(nk, nk2) and torch.equal(bk, bk2)
    settings(norm_presplit=not presplit)
    other, _ = kn.factored_norm_triton(W, A, B, s)
    assert _rel(nk.double(), other.double()) < 1e-6


@pytest.mark.parametrize("case", [(4096, 4096, 384), (1024, 4096, 384), (12288, 4096, 384), (4096, 12288, 384),
                                  (8192, 8192, 512)], ids=str)
@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
def test_norm_working_set_gpu(case, adt):
    # everything the norm allocates (pre-split A parts in K chunks, partial sums, G, results) peaks within
    # kn._WORKSET_LIMIT (1.25) x the bytes of fp32 U = W A^T and G = A A^T
    d_out, d_in, r = case
    W = (torch.randn(d_out, d_in, device=DEV) / d_in ** 0.5).to(torch.bfloat16)
    A = (torch.randn(r, d_in, device=DEV) / d_in ** 0.5).to(adt)
    B = (torch.randn(d_out, r, device=DEV) * 0.05).to(adt)
    kn.factored_norm_triton(W, A, B, 1.0)  # compile outside the measured call
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = kn.factored_norm_triton(W, A, B, 1.0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    ug = 4 * (d_out * r + r * r)
    assert peak <= kn._WORKSET_LIMIT * ug, (peak, ug)


def _bwd_args(shape, delta, seed):
    """(compose_bwd arguments, inputs) of a bf16 plain / delta composition with bias and an fp32 magnitude."""
    t = _inputs(shape, torch.bfloat16, torch.bfloat16, torch.float32, delta, True, seed=seed)
    _, inner = TRITON.compose_fwd(t["result"], t["lora"], t["magnitude"], t["norm"], SCALE, 1e-6, t["bias"],
                                  t["base_delta"], torch.bfloat16, True)
    dy = torch.randn(shape, device=DEV).to(torch.bfloat16)
    bdt = torch.bfloat16 if delta else None
    args = (dy, t["magnitude"], t["norm"], SCALE, 1e-6, inner, delta, torch.float32, torch.bfloat16, bdt, True, True)
    return args, t


@pytest.mark.parametrize("cfg", [(64, 128, 8, 8, False), (64, 128, 8, 8, True), (32, 256, 8, 4, True),
                                 (64, 128, 8, 8, False, True)], ids=str)
@pytest.mark.parametrize("delta", [False, True], ids=["plain", "delta"])
def test_bwd_variants(settings, cfg, delta):
    # the backward kernel's loop variants (plain / software-prefetched) and row splits
    settings(compose_config={"bwd": cfg})
    args, t = _bwd_args((2049, 4099), delta, seed=9)
    dy, inner = args[0], args[5]
    gk = TRITON.compose_bwd(*args)
    ge = oc.compose_bwd_eager(*args)
    red = {"dm": (dy.double() * inner.double()).sum(0) / t["norm"].double(),
           "d_bias": (1 - t["magnitude"].double() / t["norm"].double()) * dy.double().sum(0)}
    for name, a, b in zip(("d_result", "d_lora", "d_base_delta", "dm", "d_bias"), gk, ge):
        if b is None:
            assert a is None
            continue
        if name in ("dm", "d_bias"):
            assert _rel(a, red[name]) < 1e-5, name
        else:
            torch.testing.assert_close(a, b, rtol=2 ** -6, atol=1e-5, msg=name)


@pytest.mark.parametrize("delta", [False, True], ids=["plain", "delta"])
def test_bwd_eviction_policy_changes_nothing(delta):
    # the backward's L2 policy on its dy / inner loads is a cache hint: every output bitwise identical
    args, _ = _bwd_args((4099, 2051), delta, seed=11)
    outs = {}
    for policy in ("", "evict_first"):
        with config.override(bwd_evict=policy):
            outs[policy] = TRITON.compose_bwd(*args)
    for a, b in zip(outs[""], outs["evict_first"]):
        assert (a is None and b is None) or torch.equal(a, b)


def _reduction_refs(args, t):
    n = args[0].shape[-1]
    dy, inner = args[0].reshape(-1, n).double(), args[5].reshape(-1, n).double()
    return {"dm": (dy * inner).sum(0) / t["norm"].double(),
            "d_bias": (1 - t["magnitude"].double() / t["norm"].double()) * dy.sum(0)}


@pytest.mark.parametrize("shape", [(8192, 4096), (4096, 12288), (16384, 1024), (3, 11, 1000), (5, 33)], ids=str)
def test_fused_second_stage_gpu(settings, shape):
    # the backward's second stage in its last program per column block (the default) vs as its own kernel: same
    # gradients within fp32 summation noise, bitwise repeatable, counters back at zero, fp64 reference
    args, t = _bwd_args(shape, False, seed=21)
    refs = _reduction_refs(args, t)
    fused = [TRITON.compose_bwd(*args) for _ in range(4)]
    torch.cuda.synchronize()
    for c in kc._COUNTERS.values():
        assert not c.any(), "counters not reset"
    settings(bwd_fuse_reduce=False)
    split = TRITON.compose_bwd(*args)
    for i, name in ((3, "dm"), (4, "d_bias")):
        for f in fused[1:]:
            assert torch.equal(fused[0][i], f[i]), f"{name}: not bitwise repeatable"
        assert _rel(fused[0][i], refs[name]) < 1e-5, name
        assert _rel(fused[0][i], split[i]) < 1e-6, name
    for i in (0, 1):
        assert torch.equal(fused[0][i], split[i])


def test_fused_second_stage_concurrent_streams():
    # launches on two streams at once use separate counters; every result equals the single-stream one
    cases = [_bwd_args((4096 + 512 * k, 4096), False, seed=30 + k) for k in range(2)]
    want = [TRITON.compose_bwd(*a) for a, _ in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    torch.cuda.synchronize()
    got = [[] for _ in cases]
    for _ in range(20):
        for k, (a, _) in enumerate(cases):
            with torch.cuda.stream(streams[k]):
                got[k].append(TRITON.compose_bwd(*a))
    torch.cuda.synchronize()
    keys = {(torch.cuda.current_device(), s.cuda_stream) for s in streams}
    assert keys <= set(kc._COUNTERS), "no counters of their own for the side streams"
    for k in range(len(cases)):
        for g in got[k]:
            assert torch.equal(g[3], want[k][3]) and torch.equal(g[4], want[k][4])


def test_fused_second_stage_cuda_graph():
    # captured in a CUDA graph, the backward takes the two-kernel reduction (no counters created or used while
    # capturing); replays give the eager launch's gradients
    args, t = _bwd_args((2048, 4096), False, seed=41)
    want = TRITON.compose_bwd(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream: its counters exist before capture
        TRITON.compose_bwd(*args)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in kc._COUNTERS.items()}
    graph = torch.cuda.CUDAGraph()
    calls = []
    real_red = kc._RED
    kc._RED = lambda *a, **k: (calls.append(1), real_red(*a, **k))
    try:
        with torch.cuda.graph(graph, stream=s):
            out = TRITON.compose_bwd(*args)
    finally:
        kc._RED = real_red
    assert calls == [1]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for i in (0, 1):
        assert torch.equal(out[i], want[i])
    for i in (3, 4):  # the two-kernel sum: another (fixed) order
        assert _rel(out[i], want[i]) < 1e-6
    for k, v in before.items():
        assert torch.equal(kc._COUNTERS[k], v)
