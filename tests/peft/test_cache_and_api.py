"""Norm cache exactness (never stale), the factored path (no dense temporaries), legacy embedding compose, API."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fastdora
from fastdora.ops.compose import allow_row_coef_cache
from fastdora.ops.norm import factored_norm_eager
from fastdora.stats import active_path_counter

from ..helpers import MLP, EmbModel, GPT2Style, assert_close, make_pair, model_input

F64 = torch.float64


def _outputs_equal_after(mutate, name="mutation", model_fn=MLP, **kw):
    """Apply the same mutation to both models after a first forward (which fills fastdora's cache)."""
    ref, fast = make_pair(model_fn, dtype=F64, **kw)
    x = model_input(ref.base_model.model, F64)
    with torch.no_grad():
        assert_close(fast(x), ref(x), F64, "before")
        mutate(ref)
        mutate(fast)
        assert_close(fast(x), ref(x), F64, f"after {name}")
    return ref, fast


def _lin(m):
    return m.base_model.model.lin0


def test_norm_recomputed_after_optimizer_step():
    def step(m):
        with torch.enable_grad():
            opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
            m(model_input(m.base_model.model, F64)).sum().backward()
            opt.step()

    _outputs_equal_after(step, "optimizer step")


def test_norm_recomputed_after_in_place_edits():
    _outputs_equal_after(lambda m: _lin(m).lora_B["default"].weight.mul_(3.0), "in-place B edit")
    _outputs_equal_after(lambda m: _lin(m).lora_A["default"].weight.add_(0.5), "in-place A edit")
    _outputs_equal_after(lambda m: _lin(m).base_layer.weight.mul_(0.5), "in-place W edit")


def test_norm_recomputed_after_load_state_dict():
    donor, _ = make_pair(MLP, dtype=F64, seed=42, enable=False)
    sd = donor.state_dict()
    _outputs_equal_after(lambda m: m.load_state_dict(sd), "load_state_dict")


def test_norm_recomputed_after_data_swap_and_scale_change():
    def swap(m):
        p = _lin(m).lora_B["default"].weight
        p.data = p.data * 2.0  # storage swap, no version bump on the old tensor

    _outputs_equal_after(swap, "parameter .data swap")

    def rescale(m):
        _lin(m).scaling["default"] = _lin(m).scaling["default"] * 1.7

    _outputs_equal_after(rescale, "scale change")


def test_norm_recomputed_after_dtype_move():
    ref, fast = make_pair(MLP, dtype=F64)
    x = model_input(ref.base_model.model, F64)
    with torch.no_grad():
        fast(x)
        ref32, fast32 = ref.float(), fast.float()
        assert_close(fast32(x.float()), ref32(x.float()), torch.float32, "after .float()")


def test_cached_norm_equals_fresh_norm_and_is_reused():
    ref, fast = make_pair(MLP, dtype=F64)
    x = model_input(ref.base_model.model, F64)
    active_path_counter.clear()
    with torch.no_grad():
        for _ in range(3):
            fast(x)
    assert active_path_counter["norm:computed"] == 2
    assert active_path_counter["norm:cached"] == 4
    lin = _lin(fast)
    cached = lin.lora_magnitude_vector["default"]._fastdora_norm["default"][1]
    w = lin.base_layer.weight
    delta = lin.scaling["default"] * lin.lora_B["default"].weight @ lin.lora_A["default"].weight
    dense = torch.linalg.norm(w + delta, dim=1)
    torch.testing.assert_close(cached, dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fan_in_fan_out", [False, True], ids=["linear", "fan_in_fan_out"])
@pytest.mark.parametrize("safe", [False, True])
def test_compiled_path_norm_after_merge_round_trip(safe, fan_in_fan_out):
    """The compiled path's norm (``fastdora::cached_norm``, held by B's storage) after a merge and after the unmerge,
    each with a norm cached before it: W holds the merged weight, then the round trip's rounding, which PEFT >= 0.22
    writes in place through ``.data.copy_`` (no version counter moves, the storage stays): the norm is that of the new
    W, not the cached one. A ``fan_in_fan_out`` layer (Conv1D) unmerges through fastdora's own transpose-aware
    unmerge."""
    from fastdora.dispatch import cached_norm

    if fan_in_fan_out:
        _, fast = make_pair(GPT2Style, dtype=torch.bfloat16, fan_in_fan_out=True)
        lin = fast.base_model.model.c_attn
    else:
        _, fast = make_pair(MLP, dtype=torch.bfloat16)
        lin = _lin(fast)

    def effective(w):  # the [d_out, d_in] weight the norm reads
        return w.t() if fan_in_fan_out else w

    w, s = lin.base_layer.weight, lin.scaling["default"]
    a, b = lin.lora_A["default"].weight, lin.lora_B["default"].weight
    before_w = w.detach().clone()
    first = cached_norm(effective(w), a, b, s, kernels="eager").clone()

    def check_fresh(stale):
        w = effective(lin.base_layer.weight)
        fresh, _ = factored_norm_eager(w, a, b, s)
        got = cached_norm(w, a, b, s, kernels="eager")
        assert torch.equal(got, fresh.to(got.dtype)) and not torch.equal(got, stale)
        return got.clone()

    lin.merge(safe_merge=safe)
    merged = check_fresh(first)
    lin.unmerge()
    assert not torch.equal(lin.base_layer.weight, before_w)  # the round trip moved W (else no stale norm could show)
    check_fresh(merged)


@pytest.mark.parametrize("d_out,d_in,r", [(37, 53, 5), (64, 300, 16), (5, 1000, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_factored_norm_matches_dense_fp64(d_out, d_in, r, dtype):
    g = torch.Generator().manual_seed(d_out)
    W = torch.randn(d_out, d_in, generator=g).to(dtype)
    A = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(dtype)
    B = torch.randn(d_out, r, generator=g).to(dtype)
    s = 1.7
    truth = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
    for budget in (1 << 10, 1 << 24):  # many chunks and one chunk
        norm, base = factored_norm_eager(W, A, B, s, None, budget)
        tol = 1e-12 if dtype == torch.float64 else 2e-6  # fp32 accumulation even for bf16 inputs
        torch.testing.assert_close(norm.double(), truth, rtol=tol, atol=tol)
        norm2, _ = factored_norm_eager(W, A, B, s, base, budget)  # with the cached base term
        torch.testing.assert_close(norm2, norm, rtol=tol, atol=tol)
    # transposed (fan_in_fan_out / embedding) view
    norm_t, _ = factored_norm_eager(W.t().contiguous().t(), A, B, s, None, 1 << 12)
    torch.testing.assert_close(norm_t.double(), truth, rtol=tol, atol=tol)


class _AllocRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func.overloadpacket))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            # count newly allocated storage only (views of the frozen weight are not temporaries)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.max_numel = max(self.max_numel, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_no_dense_temporary_and_no_eye(fan_in_fan_out):
    """A DoRA forward+backward of a large layer creates no tensor of d_out*d_in elements and calls no eye."""
    d_in, d_out, tokens = 2048, 1536, 8
    torch.manual_seed(0)
    if fan_in_fan_out:
        from transformers.pytorch_utils import Conv1D

        base = nn.Sequential(Conv1D(d_out, d_in))
    else:
        base = nn.Sequential(nn.Linear(d_in, d_out))
    pristine = copy.deepcopy(base)
    cfg = LoraConfig(r=8, target_modules=["0"], use_dora=True, init_lora_weights=False, fan_in_fan_out=fan_in_fan_out)
    model = get_peft_model(base, cfg)
    fastdora.enable(model, kernels="eager")
    x = torch.randn(tokens, d_in, requires_grad=True)
    rec = _AllocRecorder()
    with rec:
        model(x).sum().backward()
    assert "aten.eye" not in rec.ops
    # the largest tensor touched is the frozen weight itself; nothing new of that size is created
    assert rec.max_numel < d_out * d_in, rec.max_numel
    # and stock PEFT does create them (the test can fail)
    ref = get_peft_model(pristine, cfg)
    rec2 = _AllocRecorder()
    with rec2:
        ref(x).sum().backward()
    assert "aten.eye" in rec2.ops and rec2.max_numel >= d_out * d_in


# ------------------------------------------------------------------------------------------- legacy embedding


def _legacy_peft_017_forward(model, x):
    """The composition PEFT 0.13-0.17 used for DoRA embeddings: g * base + g * s * (embed(x, A) @ B), without
    embed_scale on the DoRA part (0.18 added it). Computed here from the parameters, independently of fastdora."""
    emb_layer = model.base_model.model.emb
    base = emb_layer.base_layer
    A = emb_layer.lora_embedding_A["default"]  # [r, num]
    B = emb_layer.lora_embedding_B["default"]  # [dim, r]
    s = emb_layer.scaling["default"]
    m = emb_layer.lora_magnitude_vector["default"].weight
    norm = torch.linalg.norm(base.weight.T + s * (B @ A), dim=1)  # per embedding dim
    g = m / norm
    base_out = base(x)
    lora = nn.functional.embedding(x, A.T) @ B.T
    h = g * base_out + g * lora * s
    return model.base_model.model.head(h)


def test_legacy_embedding_compose_reproduces_peft_017_outputs():
    ref, _ = make_pair(functools.partial(EmbModel, scaled=True), dtype=F64, enable=False)
    x = model_input(ref.base_model.model, F64)
    legacy = copy.deepcopy(ref)
    default = copy.deepcopy(ref)
    fastdora.enable(legacy, kernels="eager", legacy_embedding_compose=True)
    fastdora.enable(default, kernels="eager")
    with torch.no_grad():
        old = _legacy_peft_017_forward(ref, x)
        assert_close(legacy(x), old, F64, "legacy switch vs PEFT 0.17 composition")
        assert_close(default(x), ref(x), F64, "default vs installed PEFT")
        assert not torch.allclose(default(x), old)  # embed_scale != 1: the two compositions really differ


def test_legacy_switch_from_environment(monkeypatch):
    monkeypatch.setenv("FASTDORA_LEGACY_EMBEDDING", "1")
    assert fastdora.config.make_options().legacy_embedding_compose is True
    monkeypatch.setenv("FASTDORA_LEGACY_EMBEDDING", "maybe")
    with pytest.raises(ValueError, match="FASTDORA_LEGACY_EMBEDDING"):
        fastdora.config.make_options()


# ---------------------------------------------------------------------------------------------------- API


def test_options_are_validated():
    ref, fast = make_pair(MLP, enable=False)
    with pytest.raises(TypeError, match="kernel"):
        fastdora.enable(fast, kernel="eager")
    with pytest.raises(ValueError, match="kernels"):
        fastdora.enable(fast, kernels="cuda")
    with pytest.raises(ValueError, match="legacy_embedding_compose"):
        fastdora.enable(fast, legacy_embedding_compose="yes")
    with pytest.raises(ValueError, match="dm_from_output"):
        fastdora.enable(fast, dm_from_output="yes")
    # internal settings are not options: a TypeError naming the valid ones
    valid = r"valid options: \['kernels', 'legacy_embedding_compose', 'dm_from_output'\]"
    for name, value in (("cache_norm", False), ("lean_forward", False), ("layer_node", False),
                        ("graph_norm", False), ("norm_budget_mb", 4), ("graph_capture_after", 2)):
        with pytest.raises(TypeError, match=rf"\[{name!r}\].*{valid}"):
            fastdora.enable(fast, **{name: value})
    with pytest.raises(TypeError):
        fastdora.enable(fast, "eager")  # options are keyword-only
    with pytest.raises(TypeError, match="nn.Module"):
        fastdora.enable(object())


def test_enable_is_idempotent_and_disable_restores():
    from peft.tuners.lora.dora import DoraLinearLayer
    from peft.tuners.lora.variants import DoraLinearVariant

    ref, fast = make_pair(MLP, enable=False)
    r1 = fastdora.enable(fast)
    r2 = fastdora.enable(fast)
    assert r1.converted == {"linear": 2} and r2.total_converted == 0 and r2.already == 2
    assert "converted 2" in str(r1)
    x = model_input(ref.base_model.model, torch.float32)
    assert fastdora.disable(fast) == 2
    lin = _lin(fast)
    assert type(lin.lora_magnitude_vector["default"]) is DoraLinearLayer
    assert type(lin.lora_variant["default"]) is DoraLinearVariant
    assert not any(k.startswith("_fastdora") for k in vars(lin.lora_magnitude_vector["default"]))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), ref(x))


def test_report_lists_unsupported_layers():
    ref, fast = make_pair(MLP, enable=False)
    fast.base_model.model.lin1.lora_variant["default"] = object()  # some other variant: stays on PEFT
    report = fastdora.enable(fast)
    assert report.converted == {"linear": 1}
    assert len(report.skipped) == 1 and "lin1" in report.skipped[0][0]
    assert "left on stock PEFT" in str(report)


def test_model_without_dora_reports_nothing_converted():
    model = get_peft_model(MLP(), LoraConfig(target_modules=["lin0"], use_dora=False))
    report = fastdora.enable(model)
    assert report.total_converted == 0 and report.dora_layers_found == 0


def test_process_wide_mode_converts_new_layers_and_passes_peft_semantics():
    from peft.tuners.lora import variants

    try:
        report = fastdora.enable()
        assert report.process_wide and fastdora.process_wide_enabled()
        torch.manual_seed(0)
        model = get_peft_model(MLP(), LoraConfig(target_modules=["lin0", "lin1"], use_dora=True,
                                                 init_lora_weights=False))
        lin = _lin(model)
        assert type(lin.lora_magnitude_vector["default"]).__name__ == "FastDoraLinearLayer"
        assert type(lin.lora_variant["default"]).__name__ == "FastDoraLinearVariant"
    finally:
        fastdora.disable()
    assert variants.DoraLinearVariant.__name__ == "DoraLinearVariant"
    # the DoRA init (magnitude = norm at init) went through PEFT's own code: DoRA starts as identity
    torch.manual_seed(0)
    stock = get_peft_model(MLP(), LoraConfig(target_modules=["lin0", "lin1"], use_dora=True, init_lora_weights=False))
    torch.testing.assert_close(
        stock.base_model.model.lin0.lora_magnitude_vector["default"].weight, lin.lora_magnitude_vector["default"].weight
    )


def test_kill_switch_env():
    code = (
        "import torch, fastdora\n"
        "from peft import LoraConfig, get_peft_model\n"
        "m = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)),\n"
        "                   LoraConfig(target_modules=['0'], use_dora=True))\n"
        "r = fastdora.enable(m)\n"
        "print(r.total_converted, r)\n"
    )
    env = dict(os.environ, FASTDORA="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("0 ") and "FASTDORA=0" in out


def test_peft_style_direct_call_of_magnitude_module_matches_peft():
    """Code that calls the magnitude module directly (PEFT's signature) gets PEFT's delta."""
    ref, fast = make_pair(MLP, dtype=F64)
    lr, lf = _lin(ref), _lin(fast)
    x = torch.randn(3, 24, dtype=F64)
    import inspect

    from peft.tuners.lora.dora import DoraLinearLayer

    def kw(lin):
        d = dict(
            lora_A=lin.lora_A["default"], lora_B=lin.lora_B["default"], scaling=lin.scaling["default"],
            base_layer=lin.get_base_layer(), base_result=lin.get_base_layer()(x),
        )
        if "adapter_name" in inspect.signature(DoraLinearLayer.forward).parameters:  # peft >= 0.19
            d["adapter_name"] = "default"
        return d

    with torch.no_grad():
        assert_close(lf.lora_magnitude_vector["default"](x, **kw(lf)),
                     lr.lora_magnitude_vector["default"](x, **kw(lr)), F64)


@pytest.mark.parametrize("model_fn", [MLP, EmbModel], ids=["linear", "embedding"])
def test_peft_dora_caching_helper_semantics(model_fn):
    """PEFT's DoraCaching (peft >= 0.19): `_dora_cache` empty by default and in train mode, filled in eval mode
    while enabled, same outputs. (PEFT's own versions of these two tests need the hub; this is the local twin.)"""
    helpers = pytest.importorskip("peft.helpers")
    if not hasattr(helpers, "DoraCaching"):
        pytest.skip("peft < 0.19 has no DoraCaching")
    _, fast = make_pair(model_fn, dtype=F64)
    caches = [m._dora_cache for m in fast.modules() if hasattr(m, "_dora_cache")]
    x = model_input(fast.base_model.model, F64)
    with torch.no_grad():
        plain = fast(x)
        assert caches and not any(caches)
        fast.eval()
        with helpers.DoraCaching():
            cached = fast(x)
            assert all(caches)
        assert_close(cached, plain, F64)
        fast(x)
        assert not any(caches)
        fast.train()
        with helpers.DoraCaching():
            assert_close(fast(x), plain, F64)
            assert not any(caches)


@pytest.mark.parametrize("opt_kwargs", [dict(fused=True), dict(foreach=True), dict(foreach=False)], ids=str)
def test_norm_recomputed_after_fused_optimizer_step(opt_kwargs):
    """torch's fused AdamW updates parameters without bumping their version counters: the optimizer-step epoch
    must still invalidate the cached norm."""
    ref, fast = make_pair(MLP, dtype=torch.float32)
    x = model_input(ref.base_model.model, torch.float32)
    for m in (ref, fast):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.05, **opt_kwargs)
        for _ in range(3):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        assert_close(fast(x), ref(x), torch.float32, f"after AdamW({opt_kwargs}) steps")


@pytest.mark.parametrize("which", ["lora_B", "base_weight"])
def test_invalidate_norm_cache_after_data_write(which):
    """A write through `.data` outside any optimizer bumps no version: `fastdora.invalidate_norm_cache()` is the
    documented way to drop cached norms after it, the base norm ``||W||^2`` included."""
    ref, fast = make_pair(MLP, dtype=F64)
    x = model_input(ref.base_model.model, F64)
    with torch.no_grad():
        fast(x)
        for m in (ref, fast):
            lin = _lin(m)
            (lin.lora_B["default"].weight if which == "lora_B" else lin.base_layer.weight).data.mul_(2.0)
        fastdora.invalidate_norm_cache()
        assert_close(fast(x), ref(x), F64, "after .data write + invalidate")


@pytest.mark.parametrize("mag_grad", [True, False], ids=["magnitude_trained", "magnitude_frozen"])
def test_composition_saves_only_inner_for_backward(mag_grad):
    # Under gradient checkpointing every saved tensor goes through pack/unpack hooks and recomputation: the
    # composition node saves the activation-sized `inner` only when the magnitude trains, and never the [d_out]
    # magnitude / norm vectors (kept as plain attributes); gradients still match the fp64 reference.
    from fastdora.dispatch import dora_compose

    g = torch.Generator().manual_seed(3)
    res = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    lora = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    mag = (torch.rand(7, generator=g, dtype=torch.float64) + 0.5).requires_grad_(mag_grad)
    norm = torch.rand(7, generator=g, dtype=torch.float64) + 0.5
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = dora_compose(res, lora, mag, norm, 0.7, 1e-12, kernels="eager")
    assert packed == ([(5, 7)] if mag_grad else []), packed
    y.pow(2).sum().backward()
    gvec = mag.detach() / norm
    dy = 2 * y.detach()
    torch.testing.assert_close(res.grad, gvec * dy)
    torch.testing.assert_close(lora.grad, gvec * 0.7 * dy)
    if mag_grad:
        torch.testing.assert_close(mag.grad, (dy * (res.detach() + 0.7 * lora.detach())).sum(0) / norm)


def _compose_case(dtype, form, feature_dim, seed=5):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 6, 4) if feature_dim == 1 else (6, 5, 9)
    d = shape[feature_dim]

    def act():
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)

    res, lora = act(), act()
    mag_dtype = F64 if dtype == F64 else torch.float32
    mag = nn.Parameter(torch.rand(d, generator=g, dtype=torch.float64).add(0.5).to(mag_dtype))
    norm = torch.rand(d, generator=g, dtype=torch.float64).add(0.5).to(mag.dtype)
    allow_row_coef_cache(norm)  # as the layers' norm cache does (a caller's own norm is never cached on)
    kw = {"feature_dim": feature_dim, "kernels": "eager"}
    if form == "bias":
        kw["bias"] = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    if form == "delta":
        kw["base_delta"] = act()
    dy = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return res, lora, mag, norm, kw, dy


def _run_compose(res, lora, mag, norm, kw, dy):
    from fastdora.dispatch import dora_compose

    for t in (res, lora, mag, kw.get("base_delta")):
        if t is not None:
            t.grad = None
    y = dora_compose(res, lora, mag, norm, 0.75, 1e-6 if res.dtype in (torch.bfloat16, torch.float16) else 1e-12, **kw)
    y.backward(dy)
    grads = [t.grad.clone() for t in (res, lora, mag, kw.get("base_delta")) if t is not None]
    return [y.detach().clone()] + grads


def _aten_ops(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


@pytest.mark.parametrize("feature_dim", [-1, 1], ids=["last_dim", "channel_dim"])
@pytest.mark.parametrize("form", ["plain", "bias", "delta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64], ids=str)
def test_eager_row_coefficients_cached_and_exact(dtype, form, feature_dim):
    """The eager composition derives g, g - 1, g*s and 1/norm from (magnitude, norm) once and reuses them while both
    are unchanged (every micro-batch and recomputation of a step): the reused values give bit-identical outputs and
    gradients to a fresh computation, and the repeated call launches none of the per-row division kernels."""
    res, lora, mag, norm, kw, dy = _compose_case(dtype, form, feature_dim)
    first = _run_compose(res, lora, mag, norm, kw, dy)
    ops = _aten_ops(lambda: _run_compose(res, lora, mag, norm, kw, dy))
    second = _run_compose(res, lora, mag, norm, kw, dy)
    fresh = _run_compose(res, lora, mag, norm.clone(), kw, dy)  # a new norm tensor: nothing cached on it yet
    for a, b, c in zip(first, second, fresh):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert "aten::div" not in ops and "aten::clamp_min" not in ops and "aten::reciprocal" not in ops, sorted(set(ops))
    assert "aten::div" in _aten_ops(lambda: _run_compose(res, lora, mag, norm.clone(), kw, dy))


def test_eager_row_coefficients_follow_magnitude_and_norm_changes():
    """Every way the magnitude or the norm can change drops the cached coefficients: results always equal a fresh
    computation (a norm tensor that carries no cache)."""
    res, lora, mag, norm, kw, dy = _compose_case(torch.float32, "plain", -1)

    def check(what):
        got = _run_compose(res, lora, mag, norm, kw, dy)
        want = _run_compose(res, lora, mag, norm.clone(), kw, dy)
        for a, b in zip(got, want):
            assert torch.equal(a, b), what

    check("first call")
    with torch.no_grad():
        mag.mul_(1.5)  # in-place edit: version bump
    check("in-place magnitude edit")
    mag.data = mag.data * 0.5  # new storage
    check("magnitude .data swap")
    mag.data.add_(0.25)  # no version bump, same storage: the documented invalidate call
    fastdora.invalidate_norm_cache()
    check("magnitude .data write + invalidate_norm_cache()")

    class DataWriteSGD(torch.optim.SGD):  # an optimizer that bumps no version counter (like fused / ZeRO updates)
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.data.sub_(group["lr"] * p.grad)

    opt = DataWriteSGD([mag], lr=0.1)
    _run_compose(res, lora, mag, norm, kw, dy)
    v = mag._version
    opt.step()
    assert mag._version == v  # the update is invisible to the version counter
    check("optimizer step through .data (epoch)")
    with torch.no_grad():
        norm.mul_(1.1)
    check("in-place norm edit")
    with torch.inference_mode():  # inference tensors have no version counter: computed, never cached
        ri, li, mi, ni = (t.detach().clone() for t in (res, lora, mag, norm))
        from fastdora.dispatch import dora_compose

        yi = dora_compose(ri, li, mi, ni, 0.75, 1e-12, kernels="eager")
    torch.testing.assert_close(yi, (mag.detach() / norm) * (res.detach() + 0.75 * lora.detach()), rtol=1e-6, atol=1e-6)


def test_dora_compose_with_a_callers_norm_is_a_pure_function():
    """``dora_compose`` on a norm the caller owns caches nothing: writes to the magnitude that no key can see (through
    ``.data``, as gradcheck's numerical Jacobian does) are always seen. fp64 gradcheck of the eager path, plain and
    delta forms, with the norm held constant across calls (the GPU suite runs the same check through dispatch)."""
    from fastdora.dispatch import dora_compose

    g = torch.Generator().manual_seed(3)
    nrm = torch.rand(6, generator=g, dtype=F64) + 0.5
    b = torch.randn(6, generator=g, dtype=F64)

    def mk(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(True)

    m = (torch.rand(6, generator=g, dtype=F64) + 0.5).requires_grad_(True)

    def plain(r, lo, m):
        return dora_compose(r, lo, m, nrm, 0.7, 1e-12, bias=b, kernels="eager")

    def delta(r, lo, m, bd):
        return dora_compose(r, lo, m, nrm, 0.7, 1e-12, base_delta=bd, kernels="eager")

    assert torch.autograd.gradcheck(plain, (mk(3, 4, 6), mk(3, 4, 6), m))
    assert torch.autograd.gradcheck(delta, (mk(3, 4, 6), mk(3, 4, 6), m, mk(3, 4, 6)))
    r, lo = mk(2, 6), mk(2, 6)
    y0 = plain(r, lo, m).detach()
    m.data.mul_(2.0)  # no version bump
    torch.testing.assert_close(plain(r, lo, m).detach() - b, 2.0 * (y0 - b), rtol=1e-12, atol=1e-12)
    assert not hasattr(nrm, "_fastdora_coefs")


def test_layer_norm_cache_entries_carry_row_coefficients():
    """The eager layer path does use the coefficient cache: the norm cached by the layer carries the coefficients
    after a training forward+backward (so the micro-batches and recomputations of a step reuse them)."""
    _, fast = make_pair(MLP, dtype=torch.float32)
    x = model_input(fast.base_model.model, torch.float32)
    fast(x).sum().backward()
    entries = [
        hit[1]
        for mod in fast.modules()
        for hit in mod.__dict__.get("_fastdora_norm", {}).values()
    ]
    assert entries and all(getattr(n, "_fastdora_coefs", None) is not None for n in entries)


def test_magnitude_only_edit_after_cached_forward_matches_peft():
    _outputs_equal_after(lambda m: _lin(m).lora_magnitude_vector["default"].weight.mul_(1.5), "in-place magnitude edit")


def test_cached_coefficients_are_freed_with_their_norm():
    """The coefficients live on the norm tensor without a reference cycle: a recomputed norm (every optimizer step)
    and its vectors are freed by reference counting, not at some later cyclic garbage collection."""
    import gc
    import weakref

    res, lora, mag, norm, kw, dy = _compose_case(torch.float32, "plain", -1)
    _run_compose(res, lora, mag, norm, kw, dy)
    assert getattr(norm, "_fastdora_coefs", None) is not None
    vec = weakref.ref(norm._fastdora_coefs.get("g"))
    ref = weakref.ref(norm)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del norm
        assert ref() is None and vec() is None
    finally:
        if enabled:
            gc.enable()


def test_magnitude_module_hooks_still_run():
    """The variant calls the magnitude module's forward directly only when ``__call__`` would add nothing: a hook on
    it (FSDP2 / ZeRO-3 style parameter gathering, profilers) is still called, and the output is unchanged."""
    ref, fast = make_pair(MLP, dtype=F64)
    x = model_input(ref.base_model.model, F64)
    mag = _lin(fast).lora_magnitude_vector["default"]
    calls = []
    with torch.no_grad():
        plain = fast(x)
        handle = mag.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs["adapter_name"]),
                                               with_kwargs=True)
        try:
            hooked = fast(x)
        finally:
            handle.remove()
        global_handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
        try:
            fast(x)
        finally:
            global_handle.remove()
        assert_close(hooked, ref(x), F64, "hooked")
    assert torch.equal(plain, hooked)
    assert calls[0] == "default" and "FastDoraLinearLayer" in calls[1:]


def test_direct_autograd_apply_matches_function_apply():
    """``dora_compose``'s node is created through the C ``apply`` (skipping ``Function.apply``'s Python layer): same
    outputs and gradients as the public ``Function.apply``; under a functorch transform it defers to the latter."""
    from fastdora import compat
    from fastdora.ops import compose as oc

    torch.manual_seed(0)
    res = torch.randn(5, 7, dtype=F64, requires_grad=True)
    lora = torch.randn(5, 7, dtype=F64, requires_grad=True)
    mag = torch.rand(7, dtype=F64).add_(0.5).requires_grad_()
    norm = torch.rand(7, dtype=F64).add_(0.5)
    dy = torch.randn(5, 7, dtype=F64)
    cfg = (norm, 0.7, 1e-12, F64, -1, oc.EAGER)
    outs = []
    for apply in (oc._COMPOSE_APPLY, oc._DoraCompose.apply):
        y = apply(res, lora, mag, None, None, cfg)
        outs.append((y.detach(),) + torch.autograd.grad(y, (res, lora, mag), dy))
        assert type(y.grad_fn).__name__ == "_DoraComposeBackward"
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    calls = []
    real = oc._DoraCompose.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oc._DoraCompose, "apply", lambda *a: calls.append(1) or real(*a))
        mp.setattr(compat, "_TRANSFORMS_ACTIVE", lambda: True)
        compat.direct_apply(oc._DoraCompose)(res, lora, mag, None, None, cfg)
    assert calls == [1]
