"""POET-X's Triton kernels on a CUDA GPU at Llama-8B sizes (``pytest -m gpu tests/poetx/test_kernels_gpu.py``).

Block sizes 256 / 512, 4096 and 14336 features, 2048..8192 tokens (odd counts too), bfloat16 activations with float32
blocks: every kernel output and every gradient of the layer against the PyTorch path (``kernels.ENABLED = False``)
and a float64 evaluation (kernel error <= 2x the PyTorch path's + a floor of a few output roundings).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu  # without CUDA, tests/conftest.py skips the whole module

pytest.importorskip("triton")

from fastdora.poetx import kernels as K  # noqa: E402
from fastdora.poetx import ops  # noqa: E402
from fastdora.poetx.cayley import cayley_neumann, orthogonality_error, series, skew_size  # noqa: E402
from fastdora.poetx.ops import poetx_layer, poetx_linear  # noqa: E402

DEV = "cuda"
K.BLOCK_OUTER = True  # the block-gradient kernel (its default; set here so that a changed default keeps it tested)
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


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


def _blocks(n_blocks, b, gen):
    # near-orthogonal float32 blocks: I + a random matrix of norm ~0.3
    g = torch.eye(b, dtype=F32, device=DEV) + 0.3 * torch.randn(n_blocks, b, b, generator=gen, device=DEV) / b ** 0.5
    return g


@pytest.fixture(autouse=True)
def _no_tf32():
    """The PyTorch path's float32 products in full float32 (the reference)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("d", [4096, 14336])
@pytest.mark.parametrize("n", [2048, 8191])
def test_gather_equals_index_select(n, d):
    gen = torch.Generator(DEV).manual_seed(n + d)
    t = torch.randn(n, d, generator=gen, device=DEV).to(BF16)
    perm = torch.randperm(d, generator=gen, device=DEV)
    assert torch.equal(K.gather(t, perm), t.index_select(-1, perm))


@pytest.mark.parametrize("b", [256, 512])
@pytest.mark.parametrize("n", [2048, 8191])
def test_rotate(b, n):
    gen = torch.Generator(DEV).manual_seed(b + n)
    d = 4096
    t = torch.randn(n, d, generator=gen, device=DEV).to(BF16)
    perm = torch.randperm(d, generator=gen, device=DEV)
    g = _blocks(d // b, b, gen)
    bias = torch.randn(d, generator=gen, device=DEV).to(BF16)
    for transpose in (False, True):
        for bias_ in (None, bias):
            yk = ops.rotate(t, perm, g, transpose=transpose, bias=bias_)
            with _kernels_off():
                ye = ops.rotate(t, perm, g, transpose=transpose, bias=bias_)
            y64 = ops.rotate(t.double(), perm, g.double(), transpose=transpose,
                             bias=None if bias_ is None else bias_.double())
            what = f"transpose={transpose} bias={bias_ is not None}"
            assert _rel(yk, y64) <= 2 * _rel(ye, y64) + 8e-3, what
            # one bf16 rounding apart (the blocks' two bf16 parts: 2^-17 relative before the rounding)
            torch.testing.assert_close(yk.double(), ye.double(), rtol=2 ** -7,
                                       atol=2 ** -15 * ye.double().abs().max().item(), msg=what)


@pytest.mark.parametrize("b", [256, 512])
@pytest.mark.parametrize("n", [2048, 8191])
def test_block_outer(b, n):
    gen = torch.Generator(DEV).manual_seed(b * n)
    d = 4096
    a = torch.randn(n, d, generator=gen, device=DEV).to(BF16)
    c = torch.randn(n, d, generator=gen, device=DEV).to(BF16)
    perm = torch.randperm(d, generator=gen, device=DEV)
    g = _blocks(d // b, b, gen)
    ok = ops.block_outer(a, c, perm, g)
    with _kernels_off():
        oe = ops.block_outer(a, c, perm, g)
    o64 = ops.block_outer(a.double(), c.double(), perm, g.double())
    assert ok.dtype == F32
    assert ((ok.double() - oe.double()).abs().max() / oe.double().abs().max()).item() <= 1e-5
    assert _rel(ok, o64) <= 2 * _rel(oe, o64) + 1e-6


@pytest.mark.parametrize("b", [256, 512])
@pytest.mark.parametrize("terms", [3, 2])
def test_cayley(b, terms):
    gen = torch.Generator(DEV).manual_seed(b + terms)
    n_blocks = 4096 // b
    packed = torch.randn(n_blocks, skew_size(b), generator=gen, device=DEV) * (0.3 / b ** 0.5)
    grad_g = torch.randn(n_blocks, b, b, generator=gen, device=DEV)

    def run(p_dtype):
        p = packed.to(p_dtype).clone().requires_grad_()
        g = cayley_neumann(p, b, terms)
        g.backward(grad_g.to(p_dtype))
        return g, p.grad

    gk, dk = run(F32)
    with _kernels_off():
        ge, de = run(F32)
        g64, d64 = run(F64)
    # a training step's products (CAYLEY_PRECISION): bf16x3 operands carry 16 significant bits (2^-17 relative each),
    # TF32's 11 would miss this bound by ~30x; tf32x3 / ieee: float32-level
    floor = 2 ** -16 if K.CAYLEY_PRECISION == "bf16x3" else 1e-6
    for name, k, e, r in (("G", gk, ge, g64), ("grad", dk, de, d64)):
        ek, ee = _rel(k, r), _rel(e, r)
        assert ek <= 2 * ee + floor, f"{name}: kernel {ek:.3g} vs PyTorch {ee:.3g}"
    # what the series of a merge computes (MERGE_PRECISION): float32-level
    gp = series(packed, b, terms, precise=True)
    assert _rel(gp, g64) <= 2 * _rel(ge, g64) + 1e-6
    # orthogonality: the products' rounding moves ‖GᵀG − I‖ by far less than the truncated series' own error
    orth64 = orthogonality_error(g64).item()
    assert abs(orthogonality_error(gk).item() - orth64) <= 1e-4 * max(orth64, 1e-3)


@pytest.mark.parametrize("qdt", [F32, BF16], ids=str)
@pytest.mark.parametrize("b, n1, n2", [(256, 16, 56), (512, 8, 0), (100, 3, 2)], ids=str)
def test_cayley_split_operands(b, n1, n2, qdt, monkeypatch):
    """A training step's bf16x3 series whose backward reads each operand split once by the launch that produces it
    (``SPLIT_OPERANDS``) against the products that split every operand tile in their loads and against the float64
    series: the same parts multiplied, so the two kernel paths agree to float32 roundings, and both hold the 2^-16
    bound; a pair of packed tensors (the two sides of a layer), ``work=`` and the forward's ``split=`` output; b=100
    takes the masked tiles."""
    monkeypatch.setattr(K, "CAYLEY_PRECISION", "bf16x3")
    gen = torch.Generator(DEV).manual_seed(b + n1)
    first = (torch.randn(n1, skew_size(b), generator=gen, device=DEV) * (0.3 / b ** 0.5)).to(qdt)
    second = (torch.randn(n2, skew_size(b), generator=gen, device=DEV) * (0.3 / b ** 0.5)).to(qdt) if n2 else None
    n = n1 + n2
    grad_g = torch.randn(n, b, b, generator=gen, device=DEV)
    both = first if second is None else torch.cat([first, second])
    p64 = both.double().requires_grad_()  # float64: the PyTorch series (the kernels take no float64)
    g64 = cayley_neumann(p64, b, 3)
    g64.backward(grad_g.double())
    g64, d64 = g64.detach(), p64.grad

    def run(split_operands, work):
        monkeypatch.setattr(K, "SPLIT_OPERANDS", split_operands)
        wf = torch.full((K.WORK_FORWARD, n, b, b), float("nan"), device=DEV) if work else None
        wb = torch.full((K.WORK_BACKWARD, n, b, b), float("nan"), device=DEV) if work else None
        g = K.cayley_forward(first, b, 3, second, work=wf)
        d = K.cayley_backward(first, grad_g.to(qdt), b, 3, second, work=wb)
        return g, (d if second is None else torch.cat(d))

    g0, d0 = run(False, False)
    for work in (False, True):
        g1, d1 = run(True, work)
        assert g1.dtype == d1.dtype == qdt
        if qdt == F32:
            assert _rel(g1, g0) <= 1e-6 and _rel(d1, d0) <= 1e-6, (_rel(g1, g0), _rel(d1, d0))
            assert _rel(g1, g64) <= 2 ** -16 and _rel(d1, d64) <= 2 ** -16
        else:  # one bf16 rounding of the result
            assert _rel(g1, g64) <= 2 ** -8 and _rel(d1, d64) <= 2 ** -8
    if qdt == F32:
        hi, lo = (torch.empty(n, b, b, dtype=BF16, device=DEV) for _ in range(2))
        K.cayley_forward(first, b, 3, second, split=(hi, lo))
        assert _rel(hi.double() + lo.double(), g64) <= 2 ** -15


@pytest.mark.parametrize("entry", ["blocks", "packed"])
@pytest.mark.parametrize("mode", ["fast", "mem"])
@pytest.mark.parametrize("d_in, d_out, b, n", [(4096, 4096, 256, 2048), (4096, 14336, 512, 2048),
                                               (14336, 4096, 256, 4095)], ids=str)
def test_layer(d_in, d_out, b, n, mode, entry):
    """``entry="blocks"``: ``poetx_linear`` with the blocks from ``cayley_neumann``; ``"packed"``: ``poetx_layer``,
    the blocks built inside the node (what ``PoetXLinear`` runs)."""
    gen = torch.Generator(DEV).manual_seed(d_in + d_out + b)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=DEV) * scale

    x = randn(n, d_in)
    weight = randn(d_out, d_in, scale=d_in ** -0.5)
    bias = randn(d_out)
    q_in = randn(d_in // b, skew_size(b), scale=0.3 / b ** 0.5)
    q_out = randn(d_out // b, skew_size(b), scale=0.3 / b ** 0.5)
    perm_in = torch.randperm(d_in, generator=gen, device=DEV)
    perm_out = torch.randperm(d_out, generator=gen, device=DEV)
    grad_y = randn(n, d_out)

    def run(dtype, q_dtype):
        xs, bs, qi, qo = (t.to(dt).clone().requires_grad_() for t, dt in
                          ((x, dtype), (bias, dtype), (q_in, q_dtype), (q_out, q_dtype)))
        if entry == "blocks":
            y = poetx_linear(xs, weight.to(dtype), bs, cayley_neumann(qi, b), cayley_neumann(qo, b), perm_in, perm_out,
                             mode)
        else:
            y = poetx_layer(xs, weight.to(dtype), bs, qi, qo, perm_in, perm_out, b, 3, mode)
        y.backward(grad_y.to(dtype))
        return y, xs.grad, bs.grad, qi.grad, qo.grad

    got = run(BF16, F32)
    with _kernels_off():
        ref = run(BF16, F32)
        exact = run(F64, F64)
    for name, k, e, r in zip(("output", "grad x", "grad bias", "grad q_in", "grad q_out"), got, ref, exact):
        assert k.dtype == e.dtype and k.shape == e.shape, name
        ek, ee = _rel(k, r), _rel(e, r)
        assert ek <= 2 * ee + 8e-3, f"{name}: kernel rel err {ek:.3g} vs PyTorch {ee:.3g}"


def test_batched_series_equals_each_layers_own_series(monkeypatch):
    """A model's fast-mode layers with one series per forward (``fastdora.poetx.batch``) against each layer's own
    series, through the kernels (bf16 activations, float32 Q): the series of every block is computed independently of
    the others, so outputs and gradients are bitwise equal."""
    import copy

    from torch import nn

    from fastdora import active_path_counter, poetx
    from fastdora.poetx import batch

    monkeypatch.setattr(batch, "ENABLED", True)  # off by default

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 1024), nn.GELU(), nn.Linear(1024, 4096), nn.Linear(4096, 512)).to(DEV, BF16)
    poetx.convert(model, block_size=256, exclude=())
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == F32:
                p.normal_(0, 0.3 / 16)
    reference = copy.deepcopy(model)
    batch.uninstall(reference)
    x = torch.randn(2, 1000, 4096, device=DEV, dtype=BF16)
    out = []
    for m in (model, reference):
        active_path_counter.clear()
        y = m(x)
        y.float().square().sum().backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
        out.append((y, active_path_counter["poetx:batched_series"], grads))
    assert out[0][1] == 3 and out[1][1] == 0
    assert torch.equal(out[0][0], out[1][0])
    for name, grad in out[0][2].items():
        assert torch.equal(grad, out[1][2][name]), name


def _replayed_layer(monkeypatch, direct: bool, seed: int, mode: str, bias: bool, x_grad: bool = True):
    """``run()``: one fwd+bwd of ``poetx_layer`` (4096 -> 1536 features, b=256, 3000 bf16 tokens: block gradients
    split over programs; float32 Q) returning the output and the gradients; ``direct`` False: no launch programs
    (skipped where they are not verified on the installed Triton)."""
    from fastdora import _native

    if direct and _native.direct_launch_refusal(_native.triton_version(), True, True) is not None:
        pytest.skip(f"launch programs are not verified on Triton {_native.triton_version()}")
    if not direct:
        monkeypatch.setattr(_native, "programs", lambda: None)
    d_in, d_out, b, n = 4096, 1536, 256, 3000
    gen = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen, device=DEV).to(BF16)
    weight = (torch.randn(d_out, d_in, generator=gen, device=DEV) * d_in ** -0.5).to(BF16)
    bias_t = torch.randn(d_out, generator=gen, device=DEV).to(BF16) if bias else None
    q_in = torch.randn(d_in // b, skew_size(b), generator=gen, device=DEV) * 0.3 / b ** 0.5
    q_out = torch.randn(d_out // b, skew_size(b), generator=gen, device=DEV) * 0.3 / b ** 0.5
    perm_in = torch.randperm(d_in, generator=gen, device=DEV)
    perm_out = torch.randperm(d_out, generator=gen, device=DEV)
    grad_y = torch.randn(n, d_out, generator=gen, device=DEV).to(BF16)
    assert K.outer_splits(n, torch.empty(d_out // b, b, b, device=DEV)) > 1

    def run():
        xs = x.clone().requires_grad_(x_grad)
        qi, qo = q_in.clone().requires_grad_(), q_out.clone().requires_grad_()
        y = poetx_layer(xs, weight, bias_t, qi, qo, perm_in, perm_out, b, 3, mode)
        y.backward(grad_y)
        return y, xs.grad, qi.grad, qo.grad

    return run


@pytest.mark.parametrize("direct", [True, False], ids=["programs", "launchers"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "no-x-grad"])
@pytest.mark.parametrize("mode", ["fast", "mem"])
def test_layer_replay_equals_the_op_path(mode, x_grad, bias, direct, monkeypatch):
    """``poetx_layer`` with its launches recorded on the first call and replayed on later ones
    (:mod:`fastdora.poetx.replay`): every segment replayable, no launcher runs on the second call, outputs and
    gradients bitwise those of the op's own path (``replay.ENABLED = False``), at 3000 tokens (block gradients split
    over programs) in bfloat16 with float32 Q. ``direct``: every segment a launch program of the C++ extension (on the
    verified Triton versions), which alone launches the replayed calls -- without a bias the layer's autograd node in
    C++ running the layer plans; else each launch through Triton's launcher."""
    from fastdora import _native
    from fastdora.poetx import replay

    run = _replayed_layer(monkeypatch, direct, 11, mode, bias, x_grad)

    replay.clear()
    first = run()
    assert {k[0] for k in replay._REPLAYS} == {"front", "back", "grad_out", "grad_in"}
    assert all(r is not None for r in replay._REPLAYS.values()), "a segment could not be replayed"

    assert all((r.program is not None) == direct for r in replay._REPLAYS.values()), _native.programs_status()
    # the layer plans: the forward's (no bias) and the backward's where every segment is a program
    plans = {k[0]: v for k, v in replay._PLANS.items()}
    assert set(plans) == ({"bwd"} if bias else {"fwd", "bwd"}) and all((v is not None) == direct
                                                                       for v in plans.values())

    def no_launcher(*args, **kwargs):
        raise AssertionError("a launcher ran on a replayed call")

    with monkeypatch.context() as m:
        for name in ("gather", "rotate", "block_outer", "cayley_forward", "cayley_backward"):
            m.setattr(K, name, no_launcher)
        if direct:  # the programs alone: no launch steps for Triton's launchers to fall back on
            for r in replay._REPLAYS.values():
                m.setattr(r, "steps", ())
        if direct and not bias:  # the layer plans alone: no segment runs from Python
            m.setattr(replay, "_segment", no_launcher)
        before = _native.programs().poetx_stats() if direct else None
        again = run()
    if direct:  # the layer's autograd node in C++ (no bias), its backward from the backward plan
        after = _native.programs().poetx_stats()
        assert after["calls"] - before["calls"] == (0 if bias else 1)
        assert after["planned_backward"] - before["planned_backward"] == (0 if bias else 1)
    monkeypatch.setattr(replay, "ENABLED", False)
    ref = run()
    assert (ref[1] is None) == (not x_grad)
    for name, f, a, r in zip(("output", "grad x", "grad q_in", "grad q_out"), first, again, ref):
        assert (r is None and f is None and a is None) or (torch.equal(f, r) and torch.equal(a, r)), name


@pytest.mark.parametrize("direct", [True, False], ids=["programs", "launchers"])
@pytest.mark.parametrize("mode", ["fast", "mem"])
def test_programmatic_dependent_launch_changes_no_result(mode, direct, monkeypatch):
    """The POET-X kernels launched as programmatic dependent launches (:data:`fastdora._launch.PDL`, on a GPU of
    compute capability >= 9.0) give a layer's output and every gradient bit for bit as plain launches do, on the call
    that records the launches and on the calls that replay them (through the C++ launch programs, which then launch
    with ``cuLaunchKernelEx``, or through Triton's launchers); on such a GPU every replayed launch is one."""
    from fastdora import _launch
    from fastdora.poetx import replay

    run = _replayed_layer(monkeypatch, direct, 12, mode, bias=False)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    results = {}
    try:
        for pdl in (True, False):
            monkeypatch.setattr(_launch, "PDL", pdl)
            replay.clear()
            results[pdl] = [run() for _ in range(3)]  # recorded, then replayed twice
            torch.cuda.synchronize()
            steps = [s for r in replay._REPLAYS.values() if r is not None for s in r.steps]
            assert steps and all(getattr(s[0], "launch_pdl", pdl and hopper) == (pdl and hopper) for s in steps)
            assert all((r.program is not None) == direct for r in replay._REPLAYS.values())
    finally:
        replay.clear()  # the tests after this one record their launches with the default
    ref = results[False][0]
    for calls in results.values():
        for got in calls:
            for name, g, r in zip(("output", "grad x", "grad q_in", "grad q_out"), got, ref):
                assert torch.equal(g, r), name


def test_programmatic_dependent_launches_in_a_cuda_graph():
    """A chain of the kernels (permutation passes and block products, each reading the one before's output) captured
    in a CUDA graph -- as programmatic dependent launches on compute capability >= 9.0 -- and replayed gives the
    eager chain's results bit for bit."""
    gen = torch.Generator(DEV).manual_seed(5)
    d, b, n = 4096, 256, 2048
    t = torch.randn(n, d, generator=gen, device=DEV).to(BF16)
    perm = torch.randperm(d, generator=gen, device=DEV)
    g = _blocks(d // b, b, gen)

    def chain(x):
        return ops.rotate(ops.rotate(x, perm, g), perm, g, transpose=True)

    ref = chain(t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(t)  # warm-up on a side stream, as torch.cuda.graph expects
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(t)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
