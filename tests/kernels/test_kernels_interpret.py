"""The Triton kernels, run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``).

``TRITON_INTERPRET`` must be set before Triton is imported, and other test modules share the pytest process, so
this module re-runs itself in a subprocess with the variable set (``tests/interpreter.py``): in the parent process it
holds the shard tests of ``test_interpreter_suite``; in the child, the real tests below.

Odd shapes, fp32 / bf16 / fp16 / mixed (bf16 result + fp32 lora), plain and delta form, with and without bias; every
output and gradient is compared with the eager PyTorch reference (``fastdora.ops``) and an fp64 reference.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ..interpreter import INNER as _INNER
from ..interpreter import run_suite

if not _INNER:

    @pytest.mark.slow
    @pytest.mark.parametrize("shard", range(2))
    def test_interpreter_suite(shard):
        """The tests below under the interpreter, in two shards (~7 min on one core in all)."""
        pytest.importorskip("triton")
        run_suite(__file__, shard, 2, timeout=1200)

else:
    pytest.importorskip("triton")
    from fastdora import config
    from fastdora.kernels import compose as kc
    from fastdora.kernels import norm as kn
    from fastdora.ops import compose as oc
    from fastdora.ops import norm as on

    # the Triton implementation (the kernels where they cover a call, the exact eager functions where not)
    TRITON = oc.triton_impl()

    # (result dtype, lora dtype)
    DTYPES = {
        "fp32": (torch.float32, torch.float32),
        "bf16": (torch.bfloat16, torch.bfloat16),
        "fp16": (torch.float16, torch.float16),
        "mixed": (torch.bfloat16, torch.float32),
    }
    SHAPES = [(1, 5), (7, 17), (33, 130), (2, 3, 17)]
    SCALE = 0.73

    def _eps(dt):
        return 1e-12 if dt in (torch.float32, torch.float64) else 1e-6

    def _rel(a, ref):
        a, ref = a.double(), ref.double()
        return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    @contextlib.contextmanager
    def _launches(name):
        """Every launch through the norm kernels' launcher ``kn.<name>`` as ``(grid, constexprs)`` while it runs."""
        seen = []
        real = getattr(kn, name)

        def spy(grid, tensors, ints, floats, cs, *rest, **kw):
            seen.append((grid, cs))
            return real(grid, tensors, ints, floats, cs, *rest, **kw)

        setattr(kn, name, spy)
        try:
            yield seen
        finally:
            setattr(kn, name, real)

    @pytest.fixture
    def settings():
        """``settings(name=value, ...)``: internal settings (``fastdora.config.override``) changed until the test
        ends."""
        with contextlib.ExitStack() as stack:
            yield lambda **changes: stack.enter_context(config.override(**changes))

    def _custom_ops_registered() -> bool:
        """Whether building the Triton implementation registered ``torch.ops.fastdora.dora_compose_fwd``."""
        try:
            return hasattr(torch.ops.fastdora, "dora_compose_fwd")
        except Exception:  # pragma: no cover
            return False

    def _envelope(k, e, ref, dtype, what):
        """kernel error vs the fp64 reference <= 2x the eager error + a floor of a few output-dtype ulps"""
        floor = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float64: 1e-12}[dtype]
        assert torch.isfinite(k.double()).all(), what
        ek, ee = _rel(k, ref), _rel(e, ref)
        assert ek <= 2 * ee + floor, f"{what}: kernel rel err {ek:.3g} vs eager {ee:.3g}"

    def _close_to_eager(k, e, dtype, what):
        # one rounding of the output dtype apart at most (FMA contraction may flip a final rounding)
        tol = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float64: 1e-12}[dtype]
        # atol: fp32 arithmetic errors relative to the magnitude of the operands (cancellation near zero)
        atol = 4e-7 * e.double().abs().max().item() + 1e-30
        torch.testing.assert_close(k.double(), e.double(), rtol=tol, atol=atol, msg=what)

    def _close_reduction(k, e, what):
        # sums over tokens: a different (fixed) summation order; compare relative to the largest magnitude
        scale = e.double().abs().max().clamp_min(1e-30)
        err = (k.double() - e.double()).abs().max() / scale
        assert err <= 1e-5, f"{what}: {err:.3g}"

    def _inputs(shape, rdt, ldt, delta, bias, seed=0):
        gen = torch.Generator().manual_seed(seed)
        n = shape[-1]

        def rnd(*s, dtype=torch.float32):
            return torch.randn(*s, generator=gen).to(dtype)

        t = dict(
            result=rnd(*shape, dtype=rdt),
            lora=rnd(*shape, dtype=ldt),
            magnitude=(torch.rand(n, generator=gen) + 0.5),
            norm=(torch.rand(n, generator=gen) + 0.5),
            bias=rnd(n, dtype=rdt) if bias else None,
            base_delta=rnd(*shape, dtype=rdt) if delta else None,
        )
        return t

    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    @pytest.mark.parametrize("dname", list(DTYPES))
    @pytest.mark.parametrize("delta", [False, True], ids=["plain", "delta"])
    @pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
    def test_compose_fwd_bwd(shape, dname, delta, bias):
        rdt, ldt = DTYPES[dname]
        t = _inputs(shape, rdt, ldt, delta, bias)
        out_dtype = torch.promote_types(rdt, ldt)
        eps = _eps(rdt)
        args = (t["result"], t["lora"], t["magnitude"], t["norm"], SCALE, eps, t["bias"], t["base_delta"], out_dtype)
        yk, ik = TRITON.compose_fwd(*args, True)
        ye, ie = oc.compose_fwd_eager(*args, True)
        t64 = {k: (v.double() if v is not None else None) for k, v in t.items()}
        yr, ir = oc.compose_fwd_eager(
            t64["result"], t64["lora"], t64["magnitude"], t64["norm"], SCALE, eps, t64["bias"], t64["base_delta"],
            torch.float64, True,
        )
        assert yk.dtype == ye.dtype and yk.shape == ye.shape and ik.dtype == ie.dtype
        # fp32 math, one rounding: within one output-dtype rounding of the exact value (the eager half-precision
        # path rounds more often; it is compared through the envelope)
        _close_to_eager(yk, yr.to(out_dtype), out_dtype, "y")
        _close_to_eager(ik, ir.to(ie.dtype), ie.dtype, "inner")
        _envelope(yk, ye, yr, out_dtype, "y")
        _envelope(ik, ie, ir, ie.dtype, "inner")
        # no save_inner: inner is None and y is identical
        yk2, ik2 = TRITON.compose_fwd(*args, False)
        assert ik2 is None and torch.equal(yk2, yk)

        gen = torch.Generator().manual_seed(1)
        dy = torch.randn(*shape, generator=gen).to(out_dtype)
        bdt = rdt if delta else None
        bargs = (dy, t["magnitude"], t["norm"], SCALE, eps, ie, delta, rdt, ldt, bdt, True, bias)
        gk = TRITON.compose_bwd(*bargs)
        ge = oc.compose_bwd_eager(*bargs)
        # fp64 reference from the same saved inner (isolates the backward)
        gr = oc.compose_bwd_eager(
            dy.double(), t64["magnitude"], t64["norm"], SCALE, eps, ie.double(), delta, torch.float64,
            torch.float64, torch.float64 if delta else None, True, bias,
        )
        for name, a, b, r in zip(("d_result", "d_lora", "d_base_delta", "dm", "d_bias"), gk, ge, gr):
            if b is None:
                assert a is None, name
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, name
            if name in ("dm", "d_bias"):
                _close_reduction(a, r, name)
                _envelope(a, b, r, torch.float32, name)
            else:
                _close_to_eager(a, r.to(a.dtype), a.dtype, name)
                _envelope(a, b, r, a.dtype, name)

    @pytest.mark.parametrize("dname", ["fp32", "bf16", "mixed"])
    @pytest.mark.parametrize("delta", [False, True], ids=["plain", "delta"])
    def test_apply_autograd_matches_eager(dname, delta):
        rdt, ldt = DTYPES[dname]
        shape = (3, 5, 17)
        grads = {}
        for impl in ("triton", "eager", "fp64"):
            t = _inputs(shape, rdt, ldt, delta, True, seed=3)
            if impl == "fp64":
                t = {k: (v.double() if v is not None else None) for k, v in t.items()}
            for k in ("result", "lora", "base_delta"):
                if t[k] is not None:
                    t[k].requires_grad_(True)
            mag = t["magnitude"].clone().requires_grad_(True)
            fn = TRITON.apply if impl == "triton" else oc.EAGER.apply
            out_dtype = torch.float64 if impl == "fp64" else torch.promote_types(rdt, ldt)
            y = fn(t["result"], t["lora"], mag, t["norm"], t["bias"], t["base_delta"], SCALE, _eps(rdt), out_dtype,
                   -1)
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(torch.promote_types(rdt, ldt))
            y.backward(dy.to(y.dtype))
            grads[impl] = [y] + [t[k].grad for k in ("result", "lora")] + [mag.grad]
            if delta:
                grads[impl].append(t["base_delta"].grad)
        for i, (a, b, r) in enumerate(zip(grads["triton"], grads["eager"], grads["fp64"])):
            assert a.dtype == b.dtype and a.shape == b.shape
            _envelope(a, b, r, torch.float32 if i == 3 else a.dtype, f"apply output {i}")

    @pytest.mark.parametrize("dname", ["fp32", "bf16", "mixed"])
    @pytest.mark.parametrize("delta", [False, True], ids=["plain", "delta"])
    def test_apply_under_checkpoint_skips_inner(dname, delta, monkeypatch):
        """Non-reentrant checkpointing: the first forward launches the kernel without ``inner`` (discarded), the
        recomputation with it; outputs and gradients bitwise those of the plain call."""
        from torch.utils.checkpoint import checkpoint

        rdt, ldt = DTYPES[dname]
        t = _inputs((3, 5, 17), rdt, ldt, delta, True, seed=3)
        out_dtype = torch.promote_types(rdt, ldt)
        from ..helpers import save_inner_flags

        flags = save_inner_flags(monkeypatch, TRITON)

        def f(result, lora, mag, bd):
            return TRITON.apply(result, lora, mag, t["norm"], t["bias"], bd, SCALE, _eps(rdt), out_dtype, -1)

        dy = torch.randn((3, 5, 17), generator=torch.Generator().manual_seed(4)).to(out_dtype)
        runs = []
        for ckpt in (False, True):
            leaves = [t["result"].clone().requires_grad_(True), t["lora"].clone().requires_grad_(True),
                      t["magnitude"].clone().requires_grad_(True)]
            bd = t["base_delta"].clone().requires_grad_(True) if delta else None
            y = checkpoint(f, *leaves, bd, use_reentrant=False) if ckpt else f(*leaves, bd)
            y.backward(dy)
            runs.append([y.detach()] + [v.grad for v in leaves] + ([bd.grad] if delta else []))
        assert flags == [True, False, True]
        for i, (a, b) in enumerate(zip(*runs)):
            assert torch.equal(a, b), f"output/grad {i}"

    def test_noncontiguous_layouts():
        base = torch.randn(4, 9, 40)
        result = base[:, :, 3:20]  # row stride 40, unit last dim: strided rows, no copy
        lora = torch.randn(17, 36).t().reshape(4, 9, 17)  # last dim not unit stride: copied
        lora_nc = torch.randn(4, 17, 9).transpose(1, 2)
        mag, nrm = torch.rand(17) + 0.5, torch.rand(17) + 0.5
        for lo in (lora, lora_nc):
            yk, ik = TRITON.compose_fwd(result, lo, mag, nrm, SCALE, 1e-12, None, None, torch.float32, True)
            ye, ie = oc.compose_fwd_eager(result, lo, mag, nrm, SCALE, 1e-12, None, None, torch.float32, True)
            _close_to_eager(yk, ye, torch.float32, "y strided")
            dy = torch.randn(4, 17, 9).transpose(1, 2)
            gk = TRITON.compose_bwd(dy, mag, nrm, SCALE, 1e-12, ik, False, torch.float32, torch.float32, None,
                                    True, False)
            ge = oc.compose_bwd_eager(dy, mag, nrm, SCALE, 1e-12, ie, False, torch.float32, torch.float32, None,
                                      True, False)
            for a, b in zip(gk[:3], ge[:3]):
                if b is not None:
                    _close_to_eager(a, b, torch.float32, "grad strided")
            _close_reduction(gk[3], ge[3], "dm strided")

    @pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32], ids=str)
    def test_one_rounding_contract_strided(dt):
        # the kernels' precision contract against fp64 (tests/rounding.py), strided unaligned rows, cancellation-prone
        # data (|g| up to 3, terms of both signs), forward and backward
        from tests.rounding import assert_one_rounding, ref_compose64

        g = torch.Generator().manual_seed(5)
        big = (torch.randn(6, 11, 60, generator=g) * 4).to(dt)
        result = big[:, :, 7:40]  # 14-byte offset in bf16/fp16, row stride 60
        lora = (torch.randn(6, 33, 11, generator=g) * 4).to(dt).transpose(1, 2)
        mag, nrm = torch.rand(33, generator=g) * 1.5 + 0.5, torch.rand(33, generator=g) + 0.5
        eps = 1e-12 if dt == torch.float32 else 1e-6
        yk, ik = TRITON.compose_fwd(result, lora, mag, nrm, SCALE, eps, None, None, dt, True)
        y64, i64, ty, ti, gcol = ref_compose64(result, lora, mag, nrm, SCALE, eps)
        assert_one_rounding(yk, y64, ty, "y")
        assert_one_rounding(ik, i64, ti, "inner")
        dy = (torch.randn(6, 33, 11, generator=g) * 4).to(dt).transpose(1, 2)
        gk = TRITON.compose_bwd(dy, mag, nrm, SCALE, eps, ik, False, dt, dt, None, True, False)
        d64 = dy.double()
        assert_one_rounding(gk[0], gcol * d64, (gcol * d64).abs(), "d_result")
        assert_one_rounding(gk[1], gcol * SCALE * d64, (gcol * SCALE * d64).abs(), "d_lora")

    @pytest.mark.parametrize("prefetch", [False, True], ids=["plain_loop", "prefetch"])
    def test_multi_tile_reduction_and_determinism(settings, prefetch):
        # small tiles: several row tiles per program and several partials in the second stage
        settings(compose_config={"bwd": (2, 16, 1, 1, prefetch), "fwd": (4, 16, 1)})
        t = _inputs((37, 21), torch.float32, torch.float32, False, True, seed=7)
        args = (t["result"], t["lora"], t["magnitude"], t["norm"], SCALE, 1e-12, t["bias"], None, torch.float32)
        yk, ik = TRITON.compose_fwd(*args, True)
        ye, ie = oc.compose_fwd_eager(*args, True)
        _close_to_eager(yk, ye, torch.float32, "y")
        dy = torch.randn(37, 21)
        bargs = (dy, t["magnitude"], t["norm"], SCALE, 1e-12, ik, False, torch.float32, torch.float32, None, True,
                 True)
        g1, g2 = TRITON.compose_bwd(*bargs), TRITON.compose_bwd(*bargs)
        ge = oc.compose_bwd_eager(*bargs)
        assert torch.equal(g1[3], g2[3]) and torch.equal(g1[4], g2[4])
        _close_reduction(g1[3], ge[3], "dm")
        _close_reduction(g1[4], ge[4], "d_bias")

    @pytest.mark.parametrize("need", [(True, True), (True, False), (False, True), (False, False)],
                             ids=["dm_db", "dm", "db", "none"])
    def test_fused_second_stage(monkeypatch, settings, need):
        # the partial sums' second stage in the backward kernel's last program per column block (one launch) vs as a
        # kernel of its own: same magnitude and bias gradients (vs eager too), counters back at zero, no second launch;
        # 35 row blocks x 3 column blocks: the last program sums two BLOCK_P=32 chunks of partial rows
        need_dm, need_db = need
        settings(compose_config={"bwd": (2, 16, 1, 1, False)})
        t = _inputs((70, 37), torch.bfloat16, torch.bfloat16, False, True, seed=11)
        _, ik = TRITON.compose_fwd(t["result"], t["lora"], t["magnitude"], t["norm"], SCALE, 1e-6, t["bias"],
                                   None, torch.bfloat16, True)
        dy = torch.randn(70, 37, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        bargs = (dy, t["magnitude"], t["norm"], SCALE, 1e-6, ik, False, torch.bfloat16, torch.bfloat16, None, need_dm,
                 need_db)
        launches = []
        real_red = kc._RED
        monkeypatch.setattr(kc, "_RED", lambda *a, **k: (launches.append(a), real_red(*a, **k)))
        monkeypatch.setattr(kc, "_COUNTERS", {})
        fused = [TRITON.compose_bwd(*bargs) for _ in range(2)]
        assert launches == []
        counters = list(kc._COUNTERS.values())
        assert len(counters) == (1 if (need_dm or need_db) else 0)
        for c in counters:
            assert c.dtype == torch.int32 and c.numel() >= 3 and not c.any(), "counters not reset"
        settings(bwd_fuse_reduce=False)
        split = TRITON.compose_bwd(*bargs)
        assert len(launches) == (1 if (need_dm or need_db) else 0)
        # fp64 reference (the eager path's bf16 products are not exact; the kernel's fp32 products of bf16 are)
        nrm64 = t["norm"].double().clamp_min(1e-6)
        ref = {3: (dy.double() * ik.double()).sum(0) / nrm64,
               4: (1 - t["magnitude"].double() / nrm64) * dy.double().sum(0)}
        for i, what in ((3, "dm"), (4, "d_bias")):
            if not need[i - 3]:
                assert fused[0][i] is None and split[i] is None
                continue
            assert torch.equal(fused[0][i], fused[1][i]), f"{what}: fused not deterministic"
            _close_reduction(fused[0][i], split[i], f"{what} fused vs two kernels")
            _close_reduction(fused[0][i], ref[i], f"{what} fused vs fp64")
        for i in (0, 1):
            assert torch.equal(fused[0][i], split[i])

    @pytest.mark.parametrize("dname", ["fp32", "bf16"])
    @pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
    def test_dm_from_y(settings, dname, fused):
        """``dm_from_y``: the saved tensor is the bias-free output y = g * inner and dm = sum(dy * y) / m, in the
        kernel (fused second stage and its own kernel) and in the eager path: within a reduction's rounding of the
        fp64 value sum(dy * inner) / max(norm, eps); the other gradients are those of the inner form, bitwise."""
        rdt, ldt = DTYPES[dname]
        # 35 row blocks x 3 column blocks
        settings(compose_config={"bwd": (2, 16, 1, 1, False)}, bwd_fuse_reduce=fused)
        t = _inputs((70, 37), rdt, ldt, False, False, seed=12)
        eps = _eps(rdt)
        y, inner = TRITON.compose_fwd(t["result"], t["lora"], t["magnitude"], t["norm"], SCALE, eps, None, None,
                                      rdt, True)
        dy = torch.randn(70, 37, generator=torch.Generator().manual_seed(4)).to(rdt)
        common = (dy, t["magnitude"], t["norm"], SCALE, eps)
        tail = (False, rdt, ldt, None, True, False)
        ref_inner = TRITON.compose_bwd(*common, inner, *tail)
        got = TRITON.compose_bwd(*common, y, *tail, dm_from_y=True)
        eager = oc.compose_bwd_eager(*common, y, *tail, dm_from_y=True)
        exact = (dy.double() * inner.double()).sum(0) / t["norm"].double().clamp_min(eps)
        for i in (0, 1):
            assert torch.equal(got[i], ref_inner[i])
        assert got[3].dtype == t["magnitude"].dtype
        rel = 1e-5 if dname == "fp32" else 2e-2  # y's rounding instead of inner's (bf16: 2^-9 per element)
        for what, dm in (("kernel", got[3]), ("eager", eager[3]), ("inner form", ref_inner[3])):
            err = (dm.double() - exact).abs().max().item()
            assert err <= rel * exact.abs().max().item(), (what, err)
        if dname == "fp32":  # y's rounding is not inner's: the two forms differ (the flag reached the kernel)
            assert not torch.equal(got[3], ref_inner[3])

    def test_fp64_and_empty_go_through():
        t = _inputs((5, 7), torch.float64, torch.float64, False, True)
        y, inner = TRITON.compose_fwd(t["result"], t["lora"], t["magnitude"].double(), t["norm"].double(), SCALE,
                                      1e-12, t["bias"], None, torch.float64, True)
        ye, _ = oc.compose_fwd_eager(t["result"], t["lora"], t["magnitude"].double(), t["norm"].double(), SCALE,
                                     1e-12, t["bias"], None, torch.float64, True)
        assert torch.equal(y, ye)
        e = torch.empty(0, 7)
        y, inner = TRITON.compose_fwd(e, e, torch.ones(7), torch.ones(7), SCALE, 1e-12, None, None,
                                      torch.float32, True)
        assert y.shape == (0, 7)
        g = TRITON.compose_bwd(e, torch.ones(7), torch.ones(7), SCALE, 1e-12, inner, False, torch.float32,
                               torch.float32, None, True, True)
        assert torch.equal(g[3], torch.zeros(7))

    def test_custom_op_compiles_without_graph_break():
        if not _custom_ops_registered():
            pytest.skip("torch.library.custom_op unavailable")
        import torch._dynamo

        t = _inputs((6, 17), torch.float32, torch.float32, False, True, seed=5)
        mag = t["magnitude"].clone().requires_grad_(True)
        lora = t["lora"].clone().requires_grad_(True)

        def f(result, lora, mag):
            return TRITON.apply(result, lora, mag, t["norm"], t["bias"], None, SCALE, 1e-12, torch.float32, -1)

        torch._dynamo.reset()
        cf = torch.compile(f, backend="aot_eager", fullgraph=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                mag.grad = lora.grad = None
                y = cf(t["result"], lora, mag)
                y.sum().backward()
        mag2 = t["magnitude"].clone().requires_grad_(True)
        lora2 = t["lora"].clone().requires_grad_(True)
        ye = oc.EAGER.apply(t["result"], lora2, mag2, t["norm"], t["bias"], None, SCALE, 1e-12, torch.float32, -1)
        ye.sum().backward()
        _close_to_eager(y, ye, torch.float32, "compiled y")
        _close_reduction(mag.grad, mag2.grad, "compiled dm")
        _close_to_eager(lora.grad, lora2.grad, torch.float32, "compiled d_lora")

    def test_custom_op_opcheck():
        if not _custom_ops_registered():
            pytest.skip("torch.library.custom_op unavailable")
        t = _inputs((3, 17), torch.float32, torch.float32, True, False, seed=6)
        args = (t["result"], t["lora"], t["magnitude"].requires_grad_(True), t["norm"], None, t["base_delta"],
                SCALE, 1e-12, torch.float32, True)
        torch.library.opcheck(torch.ops.fastdora.dora_compose_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

    # ---------------------------------------------------------------- norm

    NORM_CASES = [(5, 7, 3), (17, 33, 8), (130, 70, 8), (33, 130, 20)]
    NORM_DTYPES = {
        "fp32": (torch.float32, torch.float32),
        "bf16W_fp32AB": (torch.bfloat16, torch.float32),
        "fp16W_fp32AB": (torch.float16, torch.float32),
        "bf16": (torch.bfloat16, torch.bfloat16),
        "fp16": (torch.float16, torch.float16),
    }

    @pytest.mark.parametrize("case", NORM_CASES, ids=str)
    @pytest.mark.parametrize("dname", list(NORM_DTYPES))
    def test_factored_norm(case, dname):
        d_out, d_in, r = case
        wdt, adt = NORM_DTYPES[dname]
        gen = torch.Generator().manual_seed(d_out * 7 + r)
        W = (torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5).to(wdt)
        A = (torch.randn(r, d_in, generator=gen) / d_in ** 0.5).to(adt)
        B = (torch.randn(d_out, r, generator=gen) * 0.3).to(adt)
        s = 1.7
        assert kn.supports(W, A, B)
        nk, bk = kn.factored_norm_triton(W, A, B, s)
        ne, be = on.factored_norm_eager(W, A, B, s)
        dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
        assert nk.dtype == torch.float32 and bk.dtype == torch.float32 and nk.shape == (d_out,)
        torch.testing.assert_close(bk, be, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(nk, ne, rtol=2e-5, atol=1e-6)
        _envelope(nk, ne, dense, torch.float32, "norm")
        # transposed view of W (fan_in_fan_out / embeddings), cached base, s = 0
        Wt = W.t().contiguous().t()
        nk2, _ = kn.factored_norm_triton(Wt, A, B, s, base_sq=be)
        torch.testing.assert_close(nk2, ne, rtol=2e-5, atol=1e-6)
        n0, _ = kn.factored_norm_triton(W, A, B, 0.0)
        torch.testing.assert_close(n0, be.sqrt(), rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize("trans", [False, True], ids=["rows", "trans"])
    @pytest.mark.parametrize("dname", ["fp32", "bf16W_fp32AB", "bf16"])
    def test_factored_norm_split_g_and_transposed_u(dname, trans):
        """G = A A^T split over K into U's buffer (3 partial products summed), and U computed as the transposed tile
        (A parts as the left operand): same norm and base as the eager path and within the fp64 envelope."""
        d_out, d_in, r = 40, 300, 12
        wdt, adt = NORM_DTYPES[dname]
        gen = torch.Generator().manual_seed(4)
        W = (torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5).to(wdt)
        A = (torch.randn(r, d_in, generator=gen) / d_in ** 0.5).to(adt)
        B = (torch.randn(d_out, r, generator=gen) * 0.3).to(adt)
        s = 1.3
        saved = dict(kn._TRANS)
        kn._TRANS.update({m: trans for m in kn._TRANS})
        try:
            with config.override(norm_split={"G": 3}):
                assert kn._g_split(r, d_in, d_out * r, W.device) == 3
                nk, bk = kn.factored_norm_triton(W, A, B, s)
                nk2, _ = kn.factored_norm_triton(W.t().contiguous().t(), A, B, s)
        finally:
            kn._TRANS.update(saved)
        ne, be = on.factored_norm_eager(W, A, B, s)
        dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
        torch.testing.assert_close(bk, be, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(nk, ne, rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(nk2, ne, rtol=2e-5, atol=1e-6)
        _envelope(nk, ne, dense, torch.float32, "norm")
        # working set: U = W A^T is never stored; the U pass writes [rank tiles * K ranges, d_out] cross-term partial
        # sums, and the partial G's fit in U's size
        outs = []
        real_gram = kn._gram

        def spy(x, a, out, *args, **kw):
            outs.append(out)
            return real_gram(x, a, out, *args, **kw)

        kn._gram = spy
        try:
            with config.override(norm_split={"G": 3}):
                kn.factored_norm_triton(W, A, B, s)
        finally:
            kn._gram = real_gram
        assert tuple(outs[0].shape) == (3, r, r) and outs[0].numel() <= d_out * r
        assert outs[1].dim() == 2 and outs[1].shape[1] == d_out and outs[1].numel() < d_out * r
        G = torch.empty(3, r, r)  # the partial products themselves sum to A A^T
        kn._gram(A, A, G, None, True, gram_of_a=True, split=3)
        torch.testing.assert_close(G.sum(0).double(), A.double() @ A.double().T, rtol=1e-5, atol=1e-6)
        assert not torch.equal(G[0], G[1])

    @pytest.mark.parametrize("acc", [(1, True), (1, False), (3, False), (2, True)], ids=str)
    @pytest.mark.parametrize("dname", ["fp32", "bf16W_fp32AB", "bf16", "bf16_one", "bf16W_fp32AB_presplit",
                                       "bf16W_fp32AB_presplitT"])
    def test_factored_norm_k_split_and_accumulation(dname, acc):
        """The U pass split over K (cross-term and ||W||^2 partial sums per K range and rank tile, summed in a fixed
        order by the combine kernel), with chained or per-iteration accumulation over 1..3 K blocks per iteration:
        same norm and base as the eager path, within the fp64 envelope, and bitwise the same on a second run."""
        d_out, d_in, r = 45, 333, 20
        wdt, adt = NORM_DTYPES[dname.replace("_one", "").replace("_presplitT", "").replace("_presplit", "")]
        gen = torch.Generator().manual_seed(5)
        W = (torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5).to(wdt)
        A = (torch.randn(r, d_in, generator=gen) / d_in ** 0.5).to(adt)
        B = (torch.randn(d_out, r, generator=gen) * 0.3).to(adt)
        s = 0.9
        mode, nparts = kn._MODE_FP32, 3
        if dname == "bf16W_fp32AB":
            mode = kn._MODE_SPLIT
        if dname == "bf16_one":
            mode, nparts = kn._MODE_SPLIT, 1
        if "presplit" in dname:  # A's parts split once, [3, r, d_in] bf16
            mode = kn._MODE_PRESPLIT
        key = kn._config_key(mode, nparts, False)
        trans = mode == kn._MODE_SPLIT or dname.endswith("presplitT")
        with config.override(
            norm_split={"U": 3},
            norm_acc={key: acc},
            norm_config={key: (16, 16, 32, 4, 2, trans)},  # 2 rank tiles, 3 row tiles
            norm_one_product_half=dname == "bf16_one",
            norm_presplit="presplit" in dname,
            norm_workset_plan=1e9,  # these tiny shapes: the parts always fit (the limit: test_presplit_chunks)
        ), _launches("_GRAM") as launches:
            nk, bk = kn.factored_norm_triton(W, A, B, s)
            nk2, bk2 = kn.factored_norm_triton(W, A, B, s)
            nk3, _ = kn.factored_norm_triton(W, A, B, s, base_sq=bk)
        grid, cs = launches[-1]  # the U pass of the cached-base call
        # (..., NPARTS, GROUP, CHAIN, CROSS, QUAD, B_PARTS, QBLOCK, SYM, PACKED)
        assert grid[1] == 3 and cs[-6:-4] == (True, True) and cs[-9:-6] == (nparts, acc[0], acc[1]), (grid, cs)
        assert cs[1] == mode and cs[-4] == (1 if adt == torch.bfloat16 else 3) and cs[-3] == kn._QUAD_BLOCK, cs
        assert cs[-2:] == (False, False), cs  # SYM, PACKED: G's pass only
        ne, be = on.factored_norm_eager(W, A, B, s)
        dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
        torch.testing.assert_close(bk, be, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(nk, ne, rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(nk3, ne, rtol=2e-5, atol=1e-6)
        _envelope(nk, ne, dense, torch.float32, "norm")
        assert torch.equal(nk, nk2) and torch.equal(bk, bk2)

    def test_norm_product_modes():
        """U = W A^T with bf16 W: an fp32 A split into 1, 2 or 3 bf16 parts (error vs fp64 shrinks ~256x per part,
        3 parts at fp32 level), and W and A in the same half dtype as one exact product
        (``Settings.norm_one_product_half``)."""
        d_out, d_in, r = 37, 200, 10
        gen = torch.Generator().manual_seed(11)
        W = (torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5).to(torch.bfloat16)
        A = torch.randn(r, d_in, generator=gen) / d_in ** 0.5
        ref = W.double() @ A.double().T
        # A's parts split once (_MODE_PRESPLIT): bf16 hi, mid, lo, each carrying the next ~8 bits of A (the
        # interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: bounds, not exact values), summing to A
        parts3 = kn._split_parts(A, 3)
        assert parts3.shape == (3, r, d_in) and parts3.dtype == torch.bfloat16
        p64, a64 = parts3.double(), A.double()
        assert ((a64 - p64[0]).abs() <= 2 ** -7 * a64.abs()).all()
        assert ((a64 - p64[0] - p64[1]).abs() <= 2 ** -15 * a64.abs()).all()
        assert _rel(p64.sum(0), a64) < 2 ** -22
        At = A.t().contiguous().t()  # strided A
        assert torch.equal(kn._split_parts(At, 3), parts3)
        for presplit in (False, True):
            errs = {}
            for parts in (1, 2, 3):
                with config.override(norm_presplit=presplit, norm_split_parts=parts):
                    U = torch.empty(d_out, r)
                    a = kn._split_parts(A, parts) if presplit else A
                    with _launches("_GRAM") as launches:
                        kn._gram(W, a, U, None, True, plan=kn._gram_plan(W, A, False))
                assert launches[0][1][1] == (kn._MODE_PRESPLIT if presplit else kn._MODE_SPLIT)
                errs[parts] = ((U.double() - ref).norm() / ref.norm()).item()
            assert errs[3] < 1e-6 and errs[2] < 1e-4 and errs[1] < 1e-2, (presplit, errs)
            assert errs[1] > 30 * errs[2] and errs[2] > 30 * errs[3], (presplit, errs)
        for hdt in (torch.bfloat16, torch.float16):
            Wh, Ah = W.to(hdt), A.to(hdt)
            B = (torch.randn(d_out, r, generator=gen) * 0.3).to(hdt)
            ne, _ = on.factored_norm_eager(Wh, Ah, B, 1.3)
            dense = torch.linalg.norm(Wh.double() + 1.3 * B.double() @ Ah.double(), dim=1)
            with config.override(norm_one_product_half=True), _launches("_GRAM") as launches:
                nk, _ = kn.factored_norm_triton(Wh, Ah, B, 1.3)
                U = torch.empty(d_out, r)
                kn._gram(Wh, Ah, U, None, True)
            consts = [cs for _, cs in launches]
            # (NEED_BASE, MODE, PREC, UPCAST, TRANS, BLOCK_O, BLOCK_R, BLOCK_K, ACCUM, NPARTS, ...): G and U, one
            # product
            assert [(c[1], c[9]) for c in consts] == [(kn._MODE_SPLIT, 1)] * 3, consts
            assert consts[-1][4:8] == kn._ONE_CFG[5:6] + kn._ONE_CFG[:3]
            torch.testing.assert_close(U.double(), Wh.double() @ Ah.double().T, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(nk, ne, rtol=2e-5, atol=1e-6)
            _envelope(nk, ne, dense, torch.float32, "norm one product")

    @pytest.mark.parametrize("bdt, tma, d_in", [(torch.float32, False, 1100), (torch.bfloat16, False, 1100),
                                                (torch.float32, True, 1104), (torch.bfloat16, True, 1104),
                                                (torch.float32, True, 1100)], ids=str)
    def test_presplit_chunks(bdt, tma, d_in, settings):
        """bf16 W with fp32 A: A's parts split once per K chunk (_MODE_PRESPLIT), the U pass run chunk by chunk
        (every chunk adds its cross-term partial sums into the first chunk's rows, the quadratic term's come from the
        last): the same norm as one chunk and as the split in registers, within the fp64 envelope; the chunk size
        keeps the working set within Settings.norm_workset_plan x (U + G) bytes, and where no chunking fits, the
        split stays in registers. ``tma``: the pre-split passes on _norm_u_tma_kernel (tensor-descriptor loads, G's
        parts split once by _g_sum_kernel) where TMA can address W's rows (2 d_in bytes, a multiple of 16), else the
        pointer loads."""
        settings(norm_tma_interpret=tma)
        d_out, r = 1400, 24  # parts of all d_in: over the limit; of 512 columns: within it
        gen = torch.Generator().manual_seed(41)
        W = (torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5).to(torch.bfloat16)
        A = torch.randn(r, d_in, generator=gen) / d_in ** 0.5
        B = (torch.randn(d_out, r, generator=gen) * 0.5).to(bdt)
        s = 2.1
        ne, be = on.factored_norm_eager(W, A, B, s)
        dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
        plan = config.SETTINGS.norm_workset_plan
        limit_bytes = plan * 4 * (d_out * r + r * r)
        cfg = kn._PRESPLIT_CFG
        results = {}
        saved_max = kn._PRESPLIT_MAX_CHUNKS
        try:
            for name, limit, max_chunks in [("whole", 1e9, 6), ("chunks", None, 6), ("registers", None, 1)]:
                kn._PRESPLIT_MAX_CHUNKS = max_chunks
                with config.override(norm_workset_plan=limit if limit is not None else plan):
                    kc = kn._presplit_chunk(d_out, d_in, r, cfg, W.device)
                    with _launches("_GRAM") as launches, _launches("_SPLIT_PARTS_LAUNCH") as splits, \
                            _launches("_U_TMA") as tmas, _launches("_G_SUM") as gsums:
                        nk, bk = kn.factored_norm_triton(W, A, B, s)
                        nk2, _ = kn.factored_norm_triton(W, A, B, s, base_sq=bk)
                results[name] = (kc, nk, bk, nk2, [cs for _, cs in launches], len(splits), [cs for _, cs in tmas],
                                 [cs for _, cs in gsums])
        finally:
            kn._PRESPLIT_MAX_CHUNKS = saved_max
        # whole: one U launch over d_in; chunks: 512-column chunks (the parts of all d_in would not fit); registers:
        # no chunking allowed, so the in-register split
        assert results["whole"][0] == d_in and results["chunks"][0] == 512 and results["registers"][0] == 0
        assert 6 * r * d_in > limit_bytes - 4 * r * r  # the whole parts buffer alone would break the limit
        for name, n_u, mode in [("whole", 1, kn._MODE_PRESPLIT), ("chunks", 3, kn._MODE_PRESPLIT),
                                ("registers", 1, kn._MODE_SPLIT)]:
            kc, nk, bk, nk2, consts, n_split, tma_consts, gsums = results[name]
            u = [c for c in consts if c[1] != kn._MODE_SPLIT2 and c[1] != kn._MODE_FP32]  # not the G pass
            if tma and d_in % 8 == 0 and mode == kn._MODE_PRESPLIT:
                # (NEED_BASE, UPCAST, BLOCK_O, BLOCK_R, BLOCK_K, ACCUM, QUAD, B_PARTS, QBLOCK) of the TMA passes:
                # every pre-split pass, ACCUM after the first chunk, QUAD in the last, base partial sums in the first
                # call only; G's bf16 parts (r = 24: G unsplit, so by one more parts split per call)
                assert not u and len(tma_consts) == 2 * n_u, (name, tma_consts, u)
                assert [c[5] for c in tma_consts] == ([False] + [True] * (n_u - 1)) * 2, tma_consts
                assert [c[6] for c in tma_consts] == ([False] * (n_u - 1) + [True]) * 2, tma_consts
                assert [c[0] for c in tma_consts] == [True] * n_u + [False] * n_u, tma_consts
                assert not gsums and n_split == 2 * n_u + 2, (gsums, n_split)
                n_split -= 2
            else:
                assert not tma_consts and all(c[-1] is False for c in gsums), (name, tma_consts, gsums)
                assert len(u) == 2 * n_u and {c[1] for c in u} == {mode}, (name, consts)
                assert [c[-5] for c in u] == ([False] * (n_u - 1) + [True]) * 2, (name, consts)  # QUAD: last chunk
                assert [c[-10] for c in u] == ([False] + [True] * (n_u - 1)) * 2, (name, consts)  # ACCUM: later chunks
            assert n_split == (2 * n_u if mode == kn._MODE_PRESPLIT else 0), (name, n_split)
            torch.testing.assert_close(bk, be, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(nk, ne, rtol=2e-5, atol=1e-6)
            torch.testing.assert_close(nk2, nk, rtol=1e-6, atol=1e-7)
            _envelope(nk, ne, dense, torch.float32, f"norm, {name}")
        torch.testing.assert_close(results["chunks"][1], results["whole"][1], rtol=1e-6, atol=1e-7)

    def test_k_split_plans(monkeypatch, settings):
        """K ranges of the U and G passes on a 132-SM GPU at Qwen3-8B's shapes, r=384 (128 x 128 U tiles): grids of
        at most half the SMs' worth of tiles get one wave (k/v: 24 tiles, 5 ranges), larger ones ~6 programs per SM
        (capped at 8 ranges of >= 512 columns); G about 2 programs per SM over its 21 upper-triangle 64 x 64 tiles,
        within U's size in packed partial tiles (k/v: 4)."""
        monkeypatch.setattr(kn, "_num_sms", lambda device: 132)
        dev = torch.device("cpu")
        cfg = (128, 128, 64, 8, 3, False)
        assert kn._u_split(1024, 384, 4096, cfg, dev) == 5  # 24 tiles: 132 // 24
        assert kn._u_split(4096, 384, 2048, cfg, dev) == 4  # 96 tiles: 9 wanted, 2048 // 512
        assert kn._u_split(4096, 384, 12288, cfg, dev) == 8
        assert kn._u_split(12288, 384, 4096, cfg, dev) == 3  # 288 tiles: cdiv(792, 288)
        assert kn._u_split(256, 128, 4096, cfg, dev) == 8  # 2 tiles: 66 wanted, capped
        assert kn._g_split(384, 4096, 4096 * 384, dev) == 13  # cdiv(264, 21)
        assert kn._g_split(384, 4096, 1024 * 384, dev) == 4  # 1024 * 384 // (21 * 64 * 64)
        settings(norm_g_sym=False)
        assert kn._g_split(384, 4096, 1024 * 384, dev) == 2  # unpacked partial G's: 1024 * 384 // 384^2

    @pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_gram_symmetric_tiles(adt):
        """G = A A^T from the tiles on and above the diagonal (``Settings.norm_g_sym``): one program per such tile
        (6 for 3 x 3 tiles), every element written (the mirrored tiles exactly the transposes), whole and split over
        K, within 2x an fp32 matmul's error vs fp64 and close to the all-tiles G."""
        r, d_in = 190, 90  # 3 x 3 tiles of 64 (the last one masked)
        gen = torch.Generator().manual_seed(5)
        A = (torch.randn(r, d_in, generator=gen) / d_in ** 0.5).to(adt)
        ref = A.double() @ A.double().T
        e32 = _rel(A.float() @ A.float().T, ref)
        out = {}
        for sym in (True, False):
            with config.override(norm_g_sym=sym), _launches("_GRAM") as launches:
                G = torch.full((r, r), float("nan"))
                kn._gram(A, A, G, None, True, gram_of_a=True)
                parts = torch.full((3, r, r), float("nan"))
                used = kn._gram(A, A, parts, None, True, gram_of_a=True, split=3)
            out[sym] = (G, parts[:used].sum(0), launches)
        G, Gs, launches = out[True]
        b = kn._gram_config(r, r, A.device, kn._MODE_FP32, True)[0]
        assert b == 64 and [g[0] for g, _ in launches] == [6, 6] and all(cs[-2] is True for _, cs in launches)
        assert [g[0] for g, _ in out[False][2]] == [9, 9] and all(cs[-2] is False for _, cs in out[False][2])
        for g in (G, Gs):
            assert torch.isfinite(g).all()
            assert torch.equal(g[:64, 64:], g[64:, :64].T) and torch.equal(g[64:128, 128:], g[128:, 64:128].T)
            assert _rel(g, ref) <= 2 * e32 + 1e-9, (_rel(g, ref), e32)
        torch.testing.assert_close(G, out[False][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(Gs, out[False][1], rtol=1e-6, atol=1e-7)
        # the norm's path: the K ranges' partial G's as packed upper-triangle tiles (6 of 64 x 64 here, 21/36 of the
        # space at r=384), summed in order and unpacked (mirrored) by _g_sum_kernel; the same sums as Gs
        with _launches("_GRAM") as glaunches, _launches("_G_SUM") as slaunches:
            Gp = torch.full((r, r), float("nan"))
            kn._gram_matrix(A, Gp, 3, True)
        assert [g[0] for g, _ in glaunches] == [6] and glaunches[0][1][-2:] == (True, True), glaunches
        assert [g[0] for g, _ in slaunches] == [6], slaunches
        assert torch.isfinite(Gp).all() and torch.equal(Gp[:64, 64:], Gp[64:, :64].T)
        torch.testing.assert_close(Gp, Gs, rtol=1e-6, atol=1e-7)
        assert _rel(Gp, ref) <= 2 * e32 + 1e-9
        assert kn._g_split(r, 4096, 6 * 64 * 64 * 2, A.device) == 2  # capacity counts packed tiles (2 K ranges)
        # with G's bf16 parts (for the TMA U pass): the same G, and parts exactly what the parts split (_split3, the
        # U pass's own) gives for it, mirrored tiles too, summing back to G; from _g_sum_kernel (PARTS) when packed,
        # else from one parts split of G
        for sg in (3, 1):
            with _launches("_G_SUM") as slaunches, _launches("_SPLIT_PARTS_LAUNCH") as splits:
                Gq = torch.full((r, r), float("nan"))
                gp = torch.full((3, r, r), float("nan"), dtype=torch.bfloat16)
                kn._gram_matrix(A, Gq, sg, True, gp)
            assert [cs for _, cs in slaunches] == ([(64, True)] if sg > 1 else []), slaunches
            assert len(splits) == (0 if sg > 1 else 1), splits
            assert torch.equal(gp, kn._split_parts(Gq, 3)), sg
            assert _rel(gp.double().sum(0), Gq.double()) < 1e-7, sg
            assert torch.equal(Gq, Gp if sg > 1 else G)

    @pytest.mark.parametrize("g_prec", ["split", "ieee"])
    def test_gram_of_fp32_a(g_prec):
        """G = A A^T of an fp32 A: both operands as bf16 hi + mid + lo, six tensor-core products (default,
        _MODE_SPLIT2), or fp32 FMAs: within 2x an fp32 matmul's error vs fp64 (A's bf16 leading parts alone are
        ~1e-3 off), split over K too; and the whole norm where the quadratic term dominates (large s B A) stays
        within the envelope."""
        r, d_in, d_out = 19, 260, 23
        gen = torch.Generator().manual_seed(21)
        A = torch.randn(r, d_in, generator=gen) / d_in ** 0.5
        ref = A.double() @ A.double().T
        e32 = _rel(A @ A.T, ref)
        assert _rel(A.bfloat16() @ A.bfloat16().T, ref) > 1000 * e32  # the test can tell one product from six
        with config.override(norm_g_prec=g_prec), _launches("_GRAM") as launches:
            G = torch.empty(r, r)
            kn._gram(A, A, G, None, True, gram_of_a=True)
            parts = torch.empty(3, r, r)
            kn._gram(A, A, parts, None, True, gram_of_a=True, split=3)
            W = (torch.randn(d_out, d_in, generator=gen) * 1e-3 / d_in ** 0.5).to(torch.bfloat16)
            B = torch.randn(d_out, r, generator=gen)
            nk, _ = kn.factored_norm_triton(W, A, B, 4.0)
        consts = [cs for _, cs in launches]
        mode = kn._MODE_SPLIT2 if g_prec == "split" else kn._MODE_FP32
        assert [c[1] for c in consts[:2]] == [mode, mode] and consts[0][2] == "ieee", consts
        assert _rel(G, ref) <= 2 * e32 + 1e-9, (_rel(G, ref), e32)
        assert _rel(parts.sum(0), ref) <= 2 * e32 + 1e-9
        ne, _ = on.factored_norm_eager(W, A, B, 4.0)
        dense = torch.linalg.norm(W.double() + 4.0 * B.double() @ A.double(), dim=1)
        assert _rel(ne, dense) > 0 and _rel(W.double().norm(dim=1), dense) > 0.9  # quadratic-dominated
        _envelope(nk, ne, dense, torch.float64, "norm, quadratic term dominant")

    @pytest.mark.parametrize("where", ["u_pass", "u_pass_ksplit", "u_pass_presplit", "combine_split", "combine_ieee"])
    @pytest.mark.parametrize("dname", ["bf16W_fp32AB", "bf16", "fp16", "fp32"])
    def test_norm_quadratic_term(dname, where):
        """B G where the quadratic term s^2 rowsum((B G) * B) dominates the norm (tiny W, large s B A), r spanning
        three rank chunks of the U pass (two of the combine's): in the U pass (default; also with its K range split
        in two, so the rank chunks are dealt out over two programs per tile) or in the combine kernel, G as bf16 hi +
        mid + lo against B exact in bf16 (3 products) or split (6), or (combine) fp32 FMAs: within 2x the eager fp32
        error vs fp64 (dropping one product fails it)."""
        d_out, d_in, r = 29, 150, 70
        wdt, adt = NORM_DTYPES[dname]
        gen = torch.Generator().manual_seed(31)
        W = (torch.randn(d_out, d_in, generator=gen) * 1e-3 / d_in ** 0.5).to(wdt)
        A = (torch.randn(r, d_in, generator=gen) / d_in ** 0.5).to(adt)
        B = torch.randn(d_out, r, generator=gen).to(adt)
        s = 3.0
        in_u = where.startswith("u_pass")
        bprec = where.split("_")[-1] if not in_u else config.SETTINGS.norm_combine_prec
        presplit = where == "u_pass_presplit"
        with config.override(
            norm_combine_prec=bprec,
            norm_combine_prec_wide_b=bprec,
            norm_quad_in_u=in_u,
            norm_presplit=presplit,
            norm_workset_plan=1e9 if presplit else config.SETTINGS.norm_workset_plan,
            norm_split={"U": 2} if where == "u_pass_ksplit" else {},
        ), _launches("_COMBINE") as launches, _launches("_GRAM") as glaunches:
            nk, _ = kn.factored_norm_triton(W, A, B, s)
        consts = [cs for _, cs in launches]
        bparts = 1 if adt == torch.bfloat16 else 3
        assert consts[0][-1] == (not in_u), consts  # the combine's QUAD (B G computed there)
        if not in_u:
            assert consts[0][1:3] == (bprec, bparts), consts
        ugrid, ucs = glaunches[-1]
        if adt == torch.float32 and wdt == torch.bfloat16:
            assert ucs[1] == (kn._MODE_PRESPLIT if where == "u_pass_presplit" else kn._MODE_SPLIT), ucs
        assert ucs[-6:-3] == (True, in_u, bparts), ucs  # CROSS, QUAD, B_PARTS of the U pass
        assert ugrid[1] == (2 if where == "u_pass_ksplit" else ugrid[1]) and ucs[7] < r, (ugrid, ucs)
        ne, _ = on.factored_norm_eager(W, A, B, s)
        dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
        assert _rel(W.double().norm(dim=1), dense) > 0.99  # the quadratic term is (almost) the whole norm
        _envelope(nk, ne, dense, torch.float64, f"norm, quadratic term, {dname}, B G {bprec}")

    @pytest.mark.parametrize("bdt", [torch.float32, torch.bfloat16], ids=str)
    def test_norm_quadratic_term_tma(bdt, settings):
        """The quadratic term in the pre-split U pass on TMA (_norm_u_tma_kernel: B G from G's bf16 parts, B split
        or exact), where it dominates the norm, K range split in two (rank chunks dealt out over two programs per
        tile), W's rows and a rank tile past r masked: within 2x the eager fp32 error vs fp64, and the same norm as
        the pointer-load kernel."""
        d_out, d_in, r = 29, 152, 70
        gen = torch.Generator().manual_seed(31)
        W = (torch.randn(d_out, d_in, generator=gen) * 1e-3 / d_in ** 0.5).to(torch.bfloat16)
        A = torch.randn(r, d_in, generator=gen) / d_in ** 0.5
        B = torch.randn(d_out, r, generator=gen).to(bdt)
        s = 3.0
        settings(norm_workset_plan=1e9, norm_split={"U": 2})
        out = {}
        for tma in (True, False):
            with config.override(norm_tma_interpret=tma), _launches("_U_TMA") as launches:
                out[tma] = kn.factored_norm_triton(W, A, B, s)[0]
            assert [(g[1], cs[5:8]) for g, cs in launches] == ([(2, (False, True, 1 if bdt == torch.bfloat16 else 3))]
                                                              if tma else []), launches
        ne, _ = on.factored_norm_eager(W, A, B, s)
        dense = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
        assert _rel(W.double().norm(dim=1), dense) > 0.99
        _envelope(out[True], ne, dense, torch.float64, "norm, quadratic term, TMA U pass")
        torch.testing.assert_close(out[True], out[False], rtol=1e-6, atol=1e-7)

    def test_norm_supports():
        W = torch.randn(8, 6)
        assert not kn.supports(W.double(), torch.randn(2, 6).double(), torch.randn(8, 2).double())
        assert not kn.supports(W, torch.randn(2, 5), torch.randn(8, 2))
        assert not kn.supports(W, torch.randn(2, 6), torch.randn(8, 3))
        with pytest.raises(ValueError, match="supports"):  # no silent fallback: the caller checks supports() first
            kn.factored_norm_triton(W.double(), torch.randn(2, 6).double(), torch.randn(8, 2).double(), 1.0)
