"""POET-X's Triton kernels (fastdora.poetx.kernels) on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).

``TRITON_INTERPRET`` must be set before Triton is imported and other test modules share the pytest process, so this
module re-runs itself in a subprocess with the variable set (``tests/interpreter.py``): in the parent process it holds
the interpreter suite as four shard tests (plus the dispatch tests that need no kernel); in the child, the kernel
tests below.

Every kernel output and gradient is compared with the PyTorch path (``kernels.ENABLED = False``) and a float64
evaluation, at float32 / bfloat16 / float16 activations, float32 and half blocks, odd token counts and block sizes 4 to
32; the whole layer op (fast and mem modes) runs through the kernels against the PyTorch path and the dense fp64
oracle.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fastdora.poetx import kernels as K
from fastdora.poetx import ops
from fastdora.poetx.cayley import cayley_neumann, neumann_series, skew_from_packed, skew_size
from fastdora.poetx.ops import poetx_layer, poetx_linear

from ..interpreter import INNER as _INNER
from ..interpreter import run_suite
from . import oracle


F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
# one rounding of the output dtype (relative), for results the kernel and the PyTorch path both compute in fp32
ROUND = {F32: 2e-6, BF16: 2 ** -7, F16: 2 ** -10}
# error floor against float64 (a few output-dtype roundings, relative Frobenius)
FLOOR = {F32: 1e-6, BF16: 8e-3, F16: 1e-3}


def _rel(a, ref) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@contextlib.contextmanager
def _kernels_off():
    saved = K.ENABLED
    K.ENABLED = False
    try:
        yield
    finally:
        K.ENABLED = saved


@contextlib.contextmanager
def _counting(*names):
    """Count the calls of the kernel launchers ``K.<name>`` while the block runs: ``{name: calls}``."""
    counts = dict.fromkeys(names, 0)
    saved = {n: getattr(K, n) for n in names}

    def wrap(n):
        def spy(*args, **kwargs):
            counts[n] += 1
            return saved[n](*args, **kwargs)
        return spy

    for n in names:
        setattr(K, n, wrap(n))
    try:
        yield counts
    finally:
        for n, f in saved.items():
            setattr(K, n, f)


def _layer_case(d_in, d_out, b, n_tokens, dtype, q_dtype, seed=0, q_scale=0.2):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=F64) * scale

    return dict(
        x=randn(n_tokens, d_in).to(dtype),
        weight=(randn(d_out, d_in) / d_in ** 0.5).to(dtype),
        bias=randn(d_out).to(dtype),
        q_in=randn(d_in // b, skew_size(b), scale=q_scale).to(q_dtype),
        q_out=randn(d_out // b, skew_size(b), scale=q_scale).to(q_dtype),
        perm_in=torch.randperm(d_in, generator=gen),
        perm_out=torch.randperm(d_out, generator=gen),
        grad_y=randn(n_tokens, d_out),
        b=b,
    )


def _run_layer(case, mode, terms=3, entry="blocks"):
    """Output and gradients (x, bias, q_in, q_out) on the case of ``poetx_linear`` (``entry="blocks"``: the blocks
    from ``cayley_neumann``) or of ``poetx_layer`` (``"packed"``: the blocks built inside the node, as the layer
    runs)."""
    x = case["x"].clone().requires_grad_()
    bias = case["bias"].clone().requires_grad_()
    q_in = case["q_in"].clone().requires_grad_()
    q_out = case["q_out"].clone().requires_grad_()
    b = case["b"]
    stored = case["weight"][case["perm_out"]][:, case["perm_in"]]  # the weight in its permutations' frame
    if entry == "blocks":
        y = poetx_linear(x, stored, bias, cayley_neumann(q_in, b, terms), cayley_neumann(q_out, b, terms),
                         case["perm_in"], case["perm_out"], mode)
    else:
        y = poetx_layer(x, stored, bias, q_in, q_out, case["perm_in"], case["perm_out"], b, terms, mode)
    (y.double() * case["grad_y"]).sum().backward()
    return y, x.grad, bias.grad, q_in.grad, q_out.grad


def _oracle_layer(case, terms=3):
    x, bias, q_in, q_out = (case[k].detach().double().requires_grad_() for k in ("x", "bias", "q_in", "q_out"))
    y = oracle.linear(x, case["weight"], bias, q_in, q_out, case["perm_in"], case["perm_out"], case["b"], terms)
    (y * case["grad_y"]).sum().backward()
    return y, x.grad, bias.grad, q_in.grad, q_out.grad


# ------------------------------------------------------------------------------------------- parent process only

if not _INNER:

    @pytest.mark.slow
    @pytest.mark.parametrize("shard", range(4))
    def test_interpreter_suite(shard):
        """The kernel tests below under the interpreter, in four shards (~13 min on one core in all)."""
        pytest.importorskip("triton")
        run_suite(__file__, shard, 4, timeout=1200)

    def test_cpu_tensors_take_the_pytorch_path():
        """Without the interpreter's opt-in, CPU tensors never reach a kernel (a launch here would fail)."""
        assert K.DEVICE_TYPES == ("cuda",)
        case = _layer_case(16, 8, 4, 3, F32, F32)
        with _counting("gather", "rotate", "block_outer", "cayley_forward", "cayley_backward") as calls:
            _run_layer(case, "fast")
        assert calls == dict.fromkeys(calls, 0)

    def test_applies():
        cpu = torch.zeros(2)
        assert not K.applies(cpu)
        saved = K.DEVICE_TYPES
        K.DEVICE_TYPES = ("cpu",)
        try:
            assert K.applies(cpu, None, torch.zeros(2, dtype=BF16), torch.zeros(2, dtype=torch.int64)) == K.AVAILABLE
            assert not K.applies(cpu.double())  # float64: the PyTorch path
            assert not K.applies(None)
            with _kernels_off():
                assert not K.applies(cpu)
        finally:
            K.DEVICE_TYPES = saved

# ------------------------------------------------------------------------------------------- the interpreter suite

else:
    pytest.importorskip("triton")
    K.DEVICE_TYPES = ("cuda", "cpu")  # CPU tensors run the kernels through the interpreter
    K.BLOCK_OUTER = True  # the block-gradient kernel (its default; set here so that a changed default keeps it tested)

    def _blocks(n_blocks, b, dtype, gen):
        # near-orthogonal blocks of the size a trained layer has: I + a random matrix of norm ~0.3
        g = torch.eye(b, dtype=F64) + 0.3 * torch.randn(n_blocks, b, b, generator=gen, dtype=F64) / b ** 0.5
        return g.to(dtype)

    @pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=lambda v: str(v).replace("torch.", ""))
    @pytest.mark.parametrize("shape, d", [((5, 12), 12), ((3, 7, 24), 24), ((1, 1030), 1030), ((9, 3), 3)], ids=str)
    def test_gather_equals_index_select(shape, d, dtype):
        """The permutation pass: bitwise ``index_select`` (odd sizes, several batch dims, more than one column tile,
        a row stride that is not the width)."""
        gen = torch.Generator().manual_seed(d)
        t = torch.randn(*shape[:-1], 2 * d, generator=gen).to(dtype)[..., d // 2:d // 2 + d]  # strided rows
        perm = torch.randperm(d, generator=gen)
        assert torch.equal(K.gather(t, perm), t.index_select(-1, perm))
        assert K.gather(t[:0], perm).shape == t[:0].shape

    # (activation dtype, block dtype): split products, one half product, float32 products, mixed half dtypes
    ROTATE_DTYPES = [(F32, F32), (BF16, F32), (F16, F32), (BF16, BF16), (F16, BF16)]

    @pytest.mark.parametrize("act, gdt", ROTATE_DTYPES, ids=lambda v: str(v).replace("torch.", ""))
    @pytest.mark.parametrize("b, d, n", [(4, 12, 5), (8, 24, 7), (16, 32, 33), (32, 64, 65)], ids=str)
    def test_rotate(act, gdt, b, d, n):
        gen = torch.Generator().manual_seed(b * 1000 + d)
        t = torch.randn(n, d, generator=gen).to(act)
        perm = torch.randperm(d, generator=gen)
        g = _blocks(d // b, b, gdt, gen)
        bias = torch.randn(d, generator=gen).to(act)
        compute = torch.promote_types(act, gdt)
        for transpose in (False, True):
            for bias_ in (None, bias):
                with _counting("rotate") as calls:
                    yk = ops.rotate(t, perm, g, transpose=transpose, bias=bias_)
                assert calls["rotate"] == 1
                with _kernels_off():
                    ye = ops.rotate(t, perm, g, transpose=transpose, bias=bias_)
                y64 = ops.rotate(t.double(), perm, g.double(), transpose=transpose,
                                 bias=None if bias_ is None else bias_.double())
                what = f"transpose={transpose} bias={bias_ is not None}"
                assert yk.dtype == ye.dtype == act and yk.shape == ye.shape, what
                assert torch.isfinite(yk.double()).all(), what
                # kernel error vs float64: at most 2x the PyTorch path's, plus a few output roundings
                assert _rel(yk, y64) <= 2 * _rel(ye, y64) + FLOOR[act], what
                if compute == F32:  # both in fp32, one rounding: at most one output rounding apart
                    # atol: cancellation near zero; half activations multiply blocks split into two half parts
                    # (16 significant bits, 2^-16 relative with the interpreter's truncating cast)
                    atol = (2 ** -15 if act in (BF16, F16) and gdt == F32 else 4e-7) * ye.double().abs().max().item()
                    torch.testing.assert_close(yk.double(), ye.double(), rtol=ROUND[act], atol=atol, msg=what)

    def test_rotate_out_dtype_and_strided_rows():
        """A float32 result from bfloat16 activations (the backward's use) and rows with a stride of their own."""
        gen = torch.Generator().manual_seed(7)
        base = torch.randn(9, 40, generator=gen).to(BF16)
        t = base[:, 4:36]  # row stride 40, 32 features
        perm = torch.randperm(32, generator=gen)
        g = _blocks(4, 8, F32, gen)
        yk = ops.rotate(t, perm, g, out_dtype=F32)
        with _kernels_off():
            ye = ops.rotate(t, perm, g, out_dtype=F32)
        assert yk.dtype == F32
        # fp32 result: the split products' 16-bit blocks differ from fp32 blocks by ~2^-16 relative
        assert _rel(yk, ye) <= 3e-5

    @pytest.mark.parametrize("config", [dict(blocks_per_prog="all"), dict(blocks_per_prog=2, block_c=16, block_k=16),
                                        dict(block_m=16, block_c=32, block_k=16, warps=8)], ids=str)
    def test_rotate_tile_configurations(config):
        """Other tilings (several blocks per program, narrower tiles) compute the same values."""
        gen = torch.Generator().manual_seed(5)
        t = torch.randn(37, 96, generator=gen).to(BF16)
        perm = torch.randperm(96, generator=gen)
        g = _blocks(3, 32, F32, gen)
        bias = torch.randn(96, generator=gen).to(BF16)
        for transpose in (False, True):
            ref = ops.rotate(t, perm, g, transpose=transpose, bias=bias)
            saved, K.ROTATE_CONFIG = K.ROTATE_CONFIG, config
            try:
                got = ops.rotate(t, perm, g, transpose=transpose, bias=bias)
            finally:
                K.ROTATE_CONFIG = saved
            # the same products; the K split may change the fp32 summation order: one bf16 rounding apart
            torch.testing.assert_close(got.double(), ref.double(), rtol=2 ** -7, atol=1e-5)

    @pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=lambda v: str(v).replace("torch.", ""))
    def test_gather_and_scatter(dtype):
        """The permutation passes: ``_gather(t, perm) == t[..., perm]`` and ``_scatter`` (a gather through the cached
        inverse where the kernels run) inverts it, exactly, on rows with a stride of their own."""
        gen = torch.Generator().manual_seed(2)
        t = (torch.randn(2, 7, 27, generator=gen) * 100).to(dtype)[..., 2:26]
        perm = torch.randperm(24, generator=gen)
        got = ops._gather(t, perm)
        assert torch.equal(got, t[..., perm])
        assert torch.equal(ops._scatter(got, perm), t)
        with _kernels_off():
            assert torch.equal(ops._scatter(got, perm), t)

    def test_inverse_permutation_follows_in_place_changes():
        """A layer's permutations are redrawn in place at a merge: the cached inverse follows the version counter."""
        perm = torch.randperm(16)
        assert torch.equal(ops._inverse(perm), torch.argsort(perm))
        perm.copy_(torch.randperm(16))
        assert torch.equal(ops._inverse(perm), torch.argsort(perm))

    @pytest.mark.parametrize("act", [F32, BF16], ids=lambda v: str(v).replace("torch.", ""))
    def test_fused_permutation_kernels(act):
        """PERMUTE_FUSED: the permutation read and written inside the block products' loads and stores gives what the
        separate permutation passes give (same products and summation order)."""
        gen = torch.Generator().manual_seed(4)
        n, d, b = 37, 96, 32
        t = torch.randn(n, d, generator=gen).to(act)
        c = torch.randn(n, d, generator=gen).to(act)
        perm = torch.randperm(d, generator=gen)
        g = _blocks(d // b, b, F32, gen)
        bias = torch.randn(d, generator=gen).to(act)
        ref = [ops.rotate(t, perm, g, transpose=tr, bias=bias) for tr in (False, True)] + [
            ops.block_outer(t, c, perm, g)]
        saved, K.PERMUTE_FUSED = K.PERMUTE_FUSED, True
        try:
            with _counting("rotate", "block_outer") as calls:
                got = [ops.rotate(t, perm, g, transpose=tr, bias=bias) for tr in (False, True)] + [
                    ops.block_outer(t, c, perm, g)]
        finally:
            K.PERMUTE_FUSED = saved
        assert calls == {"rotate": 2, "block_outer": 1}
        for r, o in zip(ref, got):
            torch.testing.assert_close(o, r, rtol=0, atol=0)

    OUTER_DTYPES = [F32, BF16, F16]

    @pytest.mark.parametrize("act", OUTER_DTYPES, ids=lambda v: str(v).replace("torch.", ""))
    @pytest.mark.parametrize("b, d, n", [(4, 12, 5), (8, 16, 31), (16, 48, 17), (32, 32, 1100)], ids=str)
    def test_block_outer(act, b, d, n):
        gen = torch.Generator().manual_seed(b * 100 + n)
        a = torch.randn(n, d, generator=gen).to(act)
        c = torch.randn(n, d, generator=gen).to(act)
        perm = torch.randperm(d, generator=gen)
        g = _blocks(d // b, b, F32, gen)
        with _counting("block_outer") as calls:
            ok = ops.block_outer(a, c, perm, g)
        assert calls["block_outer"] == 1
        with _kernels_off():
            oe = ops.block_outer(a, c, perm, g)
        o64 = ops.block_outer(a.double(), c.double(), perm, g.double())
        assert ok.dtype == oe.dtype == F32 and ok.shape == oe.shape
        # sums over tokens in another (fixed) order: relative to the largest magnitude
        scale = oe.double().abs().max()
        assert ((ok.double() - oe.double()).abs().max() / scale).item() <= 1e-5
        assert _rel(ok, o64) <= 2 * _rel(oe, o64) + 1e-6

    def test_block_outer_token_split_and_half_blocks():
        """Many tokens on few tiles: the tokens split over programs (fp32 partial sums); bfloat16 blocks: one
        rounding of the fp32 sum."""
        gen = torch.Generator().manual_seed(3)
        n, d, b = 2500, 32, 16
        a = torch.randn(n, d, generator=gen).to(BF16)
        c = torch.randn(n, d, generator=gen).to(BF16)
        perm = torch.randperm(d, generator=gen)
        for gdt in (F32, BF16):
            g = _blocks(d // b, b, gdt, gen)
            launches = []
            real = K._OUTER

            def _spy(grid, *args, **kwargs):
                launches.append(grid)
                return real(grid, *args, **kwargs)

            K._OUTER = _spy
            try:
                ok = ops.block_outer(a, c, perm, g)
            finally:
                K._OUTER = real
            assert launches and launches[0][1] > 1, launches  # the token split ran
            exact = ops.block_outer(a.double(), c.double(), perm, g.double())
            assert ok.dtype == gdt
            if gdt == F32:
                assert _rel(ok, exact) <= 1e-6
            else:
                torch.testing.assert_close(ok.double(), exact.to(BF16).double(), rtol=2 ** -7, atol=0)

    @pytest.mark.parametrize("qdt", [F32, BF16, F16], ids=lambda v: str(v).replace("torch.", ""))
    @pytest.mark.parametrize("b, n_blocks, terms", [(4, 3, 3), (8, 2, 1), (16, 2, 2), (32, 2, 3), (8, 3, 4),
                                                    (5, 2, 3)], ids=str)
    def test_cayley_forward_backward(qdt, b, n_blocks, terms):
        gen = torch.Generator().manual_seed(b + terms)
        packed = (torch.randn(n_blocks, skew_size(b), generator=gen, dtype=F64) * 0.3 / b ** 0.5).to(qdt)
        grad_g = torch.randn(n_blocks, b, b, generator=gen, dtype=F64).to(qdt)

        def run():
            p = packed.clone().requires_grad_()
            g = cayley_neumann(p, b, terms)
            g.backward(grad_g)
            return g, p.grad

        with _counting("cayley_forward", "cayley_backward") as calls:
            gk, dk = run()
        assert calls == {"cayley_forward": 1, "cayley_backward": 1}
        with _kernels_off():
            ge, de = run()
        p64 = packed.double().requires_grad_()
        g64 = oracle.series(oracle.skew(p64, b), terms)
        g64.backward(grad_g.double())
        assert gk.dtype == dk.dtype == qdt and gk.shape == ge.shape and dk.shape == de.shape
        # fp32 products, one rounding: against float64 within a few roundings of qdt, and never worse than 2x the
        # PyTorch path (which, for half Q, computes in the half dtype)
        floor = {F32: 1e-6, BF16: 8e-3, F16: 1e-3}[qdt]
        for name, k, e, r in (("G", gk, ge, g64), ("grad", dk, de, p64.grad)):
            ek, ee = _rel(k, r), _rel(e, r)
            assert ek <= 2 * ee + floor, f"{name}: kernel {ek:.3g} vs PyTorch {ee:.3g}"
            if qdt == F32:
                assert ek <= 1e-6, f"{name}: {ek:.3g}"

    @pytest.mark.parametrize("qdt", [F32, BF16], ids=lambda v: str(v).replace("torch.", ""))
    @pytest.mark.parametrize("b, n1, n2", [(16, 2, 3), (5, 1, 2), (32, 2, 0)], ids=str)
    def test_cayley_bf16x3_split_operands(qdt, b, n1, n2):
        """A training step's series (``precision="bf16x3"``, the GPU default): the forward's products split their
        operand tiles in the loads, the backward's read operands split once into two bf16 parts by the launches that
        produce them. G and the gradient within ~16 significant bits of the float64 oracle (the bf16x3 products keep 16
        bits of each operand), for one packed tensor and for a pair, with and without ``work=`` and with ``split=``
        output; odd block sizes take the masked loads."""
        gen = torch.Generator().manual_seed(b + n1 + n2)
        first = (torch.randn(n1, skew_size(b), generator=gen, dtype=F64) * 0.3 / b ** 0.5).to(qdt)
        second = (torch.randn(n2, skew_size(b), generator=gen, dtype=F64) * 0.3 / b ** 0.5).to(qdt) if n2 else None
        n = n1 + n2
        grad_g = torch.randn(n, b, b, generator=gen, dtype=F64)
        both = first if second is None else torch.cat([first, second])
        p64 = both.double().requires_grad_()
        g64 = oracle.series(oracle.skew(p64, b), 3)
        g64.backward(grad_g)
        work_f = torch.full((K.WORK_FORWARD, n, b, b), float("nan"))
        work_b = torch.full((K.WORK_BACKWARD, n, b, b), float("nan"))
        for work in (None, (work_f, work_b)):
            g = K.cayley_forward(first, b, 3, second, precision="bf16x3", work=None if work is None else work[0])
            grad = K.cayley_backward(first, grad_g.to(qdt), b, 3, second, precision="bf16x3",
                                     work=None if work is None else work[1])
            grad = grad if second is None else torch.cat(grad)
            assert g.dtype == grad.dtype == qdt
            # 16 bits per operand; the interpreter's casts truncate where the GPU's round (one bit more error; the
            # GPU test holds the series to 2^-16)
            tol = 2 ** -15 if qdt == F32 else 2 ** -8
            assert _rel(g, g64) <= tol and _rel(grad, p64.grad) <= tol, (_rel(g, g64), _rel(grad, p64.grad))
            assert _rel(g, g64) > 0  # the bf16x3 path ran (fp32 FMAs would be within ~1e-7)
        if qdt == F32:
            hi, lo = torch.empty(n, b, b, dtype=BF16), torch.empty(n, b, b, dtype=BF16)
            K.cayley_forward(first, b, 3, second, precision="bf16x3", split=(hi, lo))
            assert _rel(hi.double() + lo.double(), g64) <= 2 ** -14

    def test_cayley_backward_is_the_adjoint():
        """⟨Γ, dG(δθ)⟩ = ⟨∂L/∂θ, δθ⟩ for a directional derivative of the float64 series."""
        gen = torch.Generator().manual_seed(11)
        b, nb, terms = 8, 2, 3
        packed = torch.randn(nb, skew_size(b), generator=gen) * 0.2
        direction = torch.randn(nb, skew_size(b), generator=gen, dtype=F64)
        grad_g = torch.randn(nb, b, b, generator=gen)
        grad = K.cayley_backward(packed, grad_g, b, terms).double()
        p64 = packed.double()
        _, tangent = torch.func.jvp(lambda p: neumann_series(skew_from_packed(p, b), terms), (p64,), (direction,))
        lhs = (grad_g.double() * tangent).sum()
        rhs = (grad * direction).sum()
        assert abs((lhs - rhs) / lhs).item() <= 1e-6

    @pytest.mark.parametrize("terms", [3, 2])
    def test_cayley_writes_into_out(terms):
        """``out=`` (and ``work=`` at three terms) receive the results of the allocating calls, for one packed tensor
        and for a pair."""
        gen = torch.Generator().manual_seed(5 + terms)
        b = 8
        first, second = (torch.randn(n, skew_size(b), generator=gen) * 0.2 for n in (2, 3))
        grad_g = torch.randn(5, b, b, generator=gen)
        work_f = torch.empty((K.WORK_FORWARD, 5, b, b)) if terms == 3 else None
        work_b = torch.empty((K.WORK_BACKWARD, 5, b, b)) if terms == 3 else None
        g = torch.full((5, b, b), float("nan"))
        assert K.cayley_forward(first, b, terms, second, out=g, work=work_f) is g
        torch.testing.assert_close(g, K.cayley_forward(first, b, terms, second), rtol=0, atol=0)
        one = torch.full_like(first, float("nan"))
        assert K.cayley_backward(first, grad_g[:2], b, terms, out=one) is one
        torch.testing.assert_close(one, K.cayley_backward(first, grad_g[:2], b, terms), rtol=0, atol=0)
        pair = (torch.full_like(first, float("nan")), torch.full_like(second, float("nan")))
        got = K.cayley_backward(first, grad_g, b, terms, second, out=pair, work=work_b)
        assert got[0] is pair[0] and got[1] is pair[1]
        for k, e in zip(pair, K.cayley_backward(first, grad_g, b, terms, second)):
            torch.testing.assert_close(k, e, rtol=0, atol=0)

    @pytest.mark.parametrize("half", [BF16, F16], ids=lambda v: str(v).replace("torch.", ""))
    def test_series_writes_the_blocks_two_parts(half):
        """``cayley_forward(split=...)`` writes the float32 blocks' two half-precision parts (``hi + lo`` within 16
        significant bits of them), and :func:`rotate` by them (``lo=``) equals the product by the float32 blocks, bit
        for bit (the parts are formed as the block product forms them: the interpreter's cast truncates where the GPU's
        rounds, so they are compared through the products)."""
        gen = torch.Generator().manual_seed(3)
        b = 8
        first, second = (torch.randn(n, skew_size(b), generator=gen) * 0.2 for n in (2, 3))
        g = K.cayley_forward(first, b, 3, second)
        hi, lo = torch.empty(5, b, b, dtype=half), torch.empty(5, b, b, dtype=half)
        assert K.cayley_forward(first, b, 3, second, split=(hi, lo)) == (hi, lo)
        # (+ float16's smallest subnormal step: the low part of a small block entry)
        assert ((hi.double() + lo.double() - g.double()).abs() <= 2 ** -15 * g.double().abs() + 2 ** -24).all()
        t = torch.randn(7, 5 * b, generator=gen).to(half)
        for transpose in (False, True):
            torch.testing.assert_close(K.rotate(t, None, hi, lo=lo, transpose=transpose),
                                       K.rotate(t, None, g, transpose=transpose), rtol=0, atol=0)
        with pytest.raises(ValueError, match="terms=3"):
            K.cayley_forward(first, b, 2, split=(hi[:2], lo[:2]))
        with pytest.raises(ValueError, match="two parts"):
            K.rotate(t.float(), None, hi, lo=lo)

    LAYER_DTYPES = [(F32, F32), (BF16, F32), (F16, F32)]
    REL_ORACLE = {F32: 1e-6, BF16: 1e-2, F16: 2e-3}

    @pytest.mark.parametrize("entry", ["blocks", "packed"])
    @pytest.mark.parametrize("mode", ["fast", "mem"])
    @pytest.mark.parametrize("dtype, qdt", LAYER_DTYPES, ids=lambda v: str(v).replace("torch.", ""))
    @pytest.mark.parametrize("d_in, d_out, b, n", [(32, 16, 8, 13), (16, 48, 16, 7), (12, 8, 4, 9)], ids=str)
    def test_layer_through_the_kernels(d_in, d_out, b, n, dtype, qdt, mode, entry):
        case = _layer_case(d_in, d_out, b, n, dtype, qdt)
        with _counting("gather", "rotate", "block_outer", "cayley_forward", "cayley_backward") as calls:
            got = _run_layer(case, mode, entry=entry)
        # forward: 2 permutation passes, 2 rotations, the blocks (one series per side, or one for both inside the
        # node); backward: 2 permutation passes (mem: 1 more, the input gathered again), 2 rotations (mem: 1 more, the
        # recomputed GEMM input), 2 block gradients, the series backward (per side, or once for both; mem: the node
        # builds its blocks again)
        series = {"blocks": 2, "packed": 1}[entry]
        expected = {"gather": 4 + (mode == "mem"), "rotate": 4 + (mode == "mem"), "block_outer": 2,
                    "cayley_forward": series + (entry == "packed" and mode == "mem"), "cayley_backward": series}
        assert calls == expected, calls
        with _kernels_off():
            ref = _run_layer(case, mode, entry=entry)
        exact = _oracle_layer(case)
        names = ("output", "grad x", "grad bias", "grad q_in", "grad q_out")
        for name, k, e, r in zip(names, got, ref, exact):
            assert k.dtype == e.dtype and k.shape == e.shape, name
            ek, ee = _rel(k, r), _rel(e, r)
            assert ek <= REL_ORACLE[dtype], f"{name}: kernel rel err {ek:.3g} vs the oracle"
            assert ek <= 2 * ee + FLOOR[dtype], f"{name}: kernel {ek:.3g} vs PyTorch {ee:.3g}"

    def test_layer_terms_and_modes_agree():
        """Other term counts through the kernels against the oracle; fast and mem modes give identical results."""
        case = _layer_case(16, 16, 8, 5, F32, F32, seed=4)
        for entry in ("blocks", "packed"):
            for terms in (1, 2, 4):
                got, exact = _run_layer(case, "fast", terms, entry), _oracle_layer(case, terms)
                for k, r in zip(got, exact):
                    assert _rel(k, r) <= 1e-6
            for a, c in zip(_run_layer(case, "fast", entry=entry), _run_layer(case, "mem", entry=entry)):
                assert torch.equal(a, c)

    @pytest.mark.parametrize("mode", ["fast", "mem"])
    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "no-x-grad"])
    def test_layer_segments_equal_the_op_path(mode, dtype, x_grad, monkeypatch):
        """``poetx_layer`` through :mod:`fastdora.poetx.replay`'s segments (the launchers into its own tensors;
        under the interpreter nothing is replayed) and through the op's own path (``replay.ENABLED = False``):
        bitwise equal outputs and gradients, with 2500 tokens (the block gradients split over programs and summed by
        a kernel) and without a gradient for x. With bfloat16 activations the segments' block products read the
        blocks' two parts written by the series (float32 activations: the float32 blocks)."""
        from fastdora.poetx import replay

        case = _layer_case(16, 24, 8, 2500, dtype, F32, seed=7)
        b, stored = case["b"], case["weight"][case["perm_out"]][:, case["perm_in"]]
        assert K.outer_splits(2500, torch.empty(2, b, b)) > 1

        def run():
            x = case["x"].clone().requires_grad_(x_grad)
            q_in, q_out = case["q_in"].clone().requires_grad_(), case["q_out"].clone().requires_grad_()
            y = poetx_layer(x, stored, case["bias"], q_in, q_out, case["perm_in"], case["perm_out"], b, 3, mode)
            (y.double() * case["grad_y"]).sum().backward()
            return y, x.grad, q_in.grad, q_out.grad

        replay.clear()
        parts = []
        rotate = K.rotate

        def recording_rotate(*args, **kwargs):
            parts.append(kwargs.get("lo") is not None)
            return rotate(*args, **kwargs)

        monkeypatch.setattr(K, "rotate", recording_rotate)
        with _counting("_SUM_SPLITS") as calls:
            got = run()
        monkeypatch.setattr(K, "rotate", rotate)
        # forward: 2; backward: 1, +1 for x's gradient, +1 in "mem" (the input side's product again)
        assert parts == [dtype == BF16] * (3 + x_grad + (mode == "mem"))
        assert calls["_SUM_SPLITS"] == 2  # both sides' block gradients
        assert set(replay._REPLAYS) and all(v is None for v in replay._REPLAYS.values())  # nothing to replay here
        assert {k[0] for k in replay._REPLAYS} == {"front", "back", "grad_out", "grad_in"}
        monkeypatch.setattr(replay, "ENABLED", False)
        ref = run()
        assert (got[1] is None) == (not x_grad)
        for name, g, r in zip(("output", "grad x", "grad q_in", "grad q_out"), got, ref):
            assert (g is None and r is None) or torch.equal(g, r), name

    def test_layer_segments_split_each_side_as_its_blocks_need():
        """The output side's block gradient splits its tokens over more programs than both sides' blocks together
        would (fewer blocks, the same tokens): the segment sizes its partial sums by that side's own split, and the
        layer equals the op path bit for bit. A partial-sum buffer of another size is refused, never overrun."""
        from fastdora.poetx import replay

        case = _layer_case(32, 16, 8, 4100, BF16, F32, seed=9)
        b, stored = case["b"], case["weight"][case["perm_out"]][:, case["perm_in"]]
        both, out_side = K.outer_splits(4100, torch.empty(6, b, b)), K.outer_splits(4100, torch.empty(2, b, b))
        assert 1 < both < out_side

        def run():
            x = case["x"].clone().requires_grad_()
            q_in, q_out = case["q_in"].clone().requires_grad_(), case["q_out"].clone().requires_grad_()
            y = poetx_layer(x, stored, case["bias"], q_in, q_out, case["perm_in"], case["perm_out"], b, 3, "fast")
            (y.double() * case["grad_y"]).sum().backward()
            return y, x.grad, q_in.grad, q_out.grad

        replay.clear()
        got = run()
        replay.ENABLED = False
        try:
            ref = run()
        finally:
            replay.ENABLED = True
        for name, g, r in zip(("output", "grad x", "grad q_in", "grad q_out"), got, ref):
            assert torch.equal(g, r), name
        a = case["x"][:, :16].contiguous()
        with pytest.raises(ValueError, match="partial must be"):
            K.block_outer(a, a, None, torch.empty(2, b, b), partial=torch.empty(both, 2, b, b))

    def test_batched_series_through_the_kernels(monkeypatch):
        """A converted model's batched series (fastdora.poetx.batch) through the kernels, bfloat16 activations with
        float32 Q: outputs and gradients bitwise those of each layer's own series; the series kernels run once per
        chunk instead of once per layer."""
        import copy

        from torch import nn

        from fastdora import poetx
        from fastdora.poetx import batch

        monkeypatch.setattr(batch, "ENABLED", True)  # off by default

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 16), nn.Linear(16, 8)).to(BF16)
        poetx.convert(model, block_size=8, exclude=())
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype == F32:
                    p.normal_(0, 0.1)
        reference = copy.deepcopy(model)
        batch.uninstall(reference)
        x = torch.randn(2, 5, 16, dtype=BF16)
        out = []
        for m in (model, reference):
            with _counting("_UNPACK", "_PACK") as calls:
                y = m(x)
                y.float().square().sum().backward()
            out.append((y, calls, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
        assert out[0][1] == {"_UNPACK": 2, "_PACK": 1}  # one forward and one backward series for the three layers
        assert out[1][1] == {"_UNPACK": 6, "_PACK": 3}
        assert torch.equal(out[0][0], out[1][0])
        for name, grad in out[0][2].items():
            assert torch.equal(grad, out[1][2][name]), name
