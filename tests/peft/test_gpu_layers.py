"""GPU: a whole PEFT DoRA model with fastdora's Triton path vs stock PEFT (AMP and pure bf16), several training
steps with gradient accumulation + checkpointing, and the norm cache. Run on a CUDA machine: pytest -m gpu."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import fastdora
from fastdora.stats import active_path_counter

from ..helpers import save_inner_flags

pytestmark = pytest.mark.gpu


def _llama(dtype, attn=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=1000, max_position_embeddings=1024,
    )
    if attn is not None:
        cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).to("cuda", dtype)


def _pair(adapter_dtype, r=64, attn=None, kernels="triton", **options):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=2 * r, use_dora=True, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    ref = get_peft_model(_llama(torch.bfloat16, attn), cfg, autocast_adapter_dtype=adapter_dtype == torch.float32)
    for n, p in ref.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(adapter_dtype)
            if "magnitude" in n:
                p.data.mul_(1 + 0.05 * torch.randn_like(p))
    fast = copy.deepcopy(ref)
    report = fastdora.enable(fast, kernels=kernels, **options)
    assert report.converted.get("linear") == 14, str(report)
    return ref, fast


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _parity_step(setup, kernels="triton", checkpointed=False, **options):
    """One forward + backward of stock PEFT DoRA and fastdora (``kernels``) on the same batch: logits and gradients
    track PEFT's (bf16 noise level); returns nothing, asserts. ``active_path_counter`` holds the run's paths."""
    ref, fast = _pair(torch.float32 if setup == "amp" else torch.bfloat16, kernels=kernels, **options)
    ids = torch.randint(0, 1000, (2, 256), device="cuda")
    active_path_counter.clear()
    outs, grads = [], []
    for m in (ref, fast):
        if checkpointed:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            m.enable_input_require_grads()
        m.train()
        m.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp"):
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append(out.logits.detach())
        grads.append({n: p.grad.detach() for n, p in m.named_parameters() if p.grad is not None})
    assert _rel(outs[1], outs[0]) < 2e-2
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert _rel(grads[1][n], grads[0][n]) < 5e-2, n


@pytest.mark.parametrize("setup", ["amp", "pure_bf16"])
def test_model_parity_triton_path(setup):
    _parity_step(setup)
    assert active_path_counter["linear:triton"] == 14, active_path_counter


@pytest.mark.parametrize("setup", ["amp", "pure_bf16"])
def test_model_parity_eager_path_checkpointed(setup, monkeypatch):
    """The exact PyTorch path on the GPU (``kernels="eager"``) under non-reentrant checkpointing: the per-row passes
    through batch norm's kernels (one magnitude-gradient reduction per layer); logits and gradients track stock
    PEFT."""
    from fastdora.ops import compose as oc

    calls = {"rows": 0}
    real_reduce = oc._rowsum_kernels
    monkeypatch.setattr(oc, "_rowsum_kernels",
                        lambda *a: calls.__setitem__("rows", calls["rows"] + 1) or real_reduce(*a))
    _parity_step(setup, kernels="eager", checkpointed=True)
    assert active_path_counter["linear:eager"] == 28, active_path_counter  # forward + recomputation
    assert calls == {"rows": 14}, calls


def test_training_steps_norm_cache_and_checkpointing():
    """AMP training with grad accumulation and non-reentrant checkpointing: one norm computation per module per
    step, losses track stock PEFT."""
    ref, fast = _pair(torch.float32, r=16)
    for m in (ref, fast):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.enable_input_require_grads()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (ref, fast)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, 1000, (1, 128), device="cuda", generator=gen) for _ in range(12)]
    losses = [[], []]
    active_path_counter.clear()
    for step in range(3):
        for i, (m, opt) in enumerate(zip((ref, fast), opts)):
            total = 0.0
            for micro in range(4):
                ids = batches[4 * step + micro]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = m(input_ids=ids, labels=ids).loss / 4
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses[i].append(total)
    computed = active_path_counter["norm:computed"] + active_path_counter["norm:computed_base_cached"]
    assert computed == 14 * 3, active_path_counter  # once per module per optimizer step
    for a, b in zip(*losses):
        assert abs(a - b) < 2e-2 * abs(b), losses


@pytest.mark.parametrize("setup", ["amp", "pure_bf16"])
def test_lean_forward_bitwise_chain_triton(setup):
    """The lean module forward vs PEFT's forward -> variant chain on the Triton path, with checkpointing: bitwise
    the same loss and logits, and the lean path taken (PEFT's Linear.forward not called). Gradients: bitwise in pure
    bf16 but the magnitudes' (the whole-layer node takes them from the saved outputs: y's rounding); in AMP the lean
    path skips PEFT's exact fp32 round trip of the input (a shorter autograd graph), so where
    several layers' input gradients meet (q/k/v, gate/up) autograd may sum them in another order: equal up to bf16
    summation order there."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    # eager attention: SDPA's backward kernels may accumulate with atomics (not bitwise repeatable)
    _, lean = _pair(torch.float32 if setup == "amp" else torch.bfloat16, attn="eager")
    chain = copy.deepcopy(lean)
    # the chain: the internal setting lean_forward off, for its enable and every call (read at each call)
    with fastdora.config.override(lean_forward=False):
        fastdora.enable(chain, kernels="triton")
    ids = torch.randint(0, 1000, (2, 256), device="cuda")
    calls = []
    orig = LoraLinear.forward

    def counting(self, x, *args, **kwargs):
        calls.append(1)
        return orig(self, x, *args, **kwargs)

    res = []
    for m, block in ((lean, contextlib.nullcontext), (chain, lambda: fastdora.config.override(lean_forward=False))):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.enable_input_require_grads()
        m.train()
        for it in range(2):  # two training calls, the second one counted
            m.zero_grad()
            if it == 1:
                calls.clear()
                LoraLinear.forward = counting
            try:
                with block():
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp"):
                        out = m(input_ids=ids, labels=ids)
                    out.loss.backward()
            finally:
                LoraLinear.forward = orig
        res.append((len(calls), out.loss.detach(), out.logits.detach(),
                    {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}))
    (n_lean, loss_l, logits_l, g_l), (n_chain, loss_c, logits_c, g_c) = res
    assert n_lean == 0 and n_chain == 2 * 14  # the chain: forward + checkpoint recomputation per module
    assert torch.equal(loss_l, loss_c) and torch.equal(logits_l, logits_c)
    assert g_l.keys() == g_c.keys()
    for n in g_l:
        if setup == "pure_bf16" and "lora_magnitude_vector" not in n:
            assert torch.equal(g_l[n], g_c[n]), n
        else:  # magnitudes: the whole-layer node's sum(dy * y) / m (option dm_from_output), y's rounding
            assert _rel(g_l[n], g_c[n]) < 1e-2, (n, _rel(g_l[n], g_c[n]))


@pytest.mark.parametrize("setup", ["amp", "pure_bf16"])
def test_checkpointed_forward_skips_inner_triton(setup, monkeypatch):
    """Non-reentrant checkpointing on the Triton path: the first forward launches the composition without ``inner``
    (its saved tensors are discarded), the recomputation with it; loss, logits and every gradient bitwise those of
    the same model without checkpointing. The Python composition node (whose launcher calls are counted here); the
    C++ node's: tests/kernels/test_native_node.py::test_gpu_peft_model_checkpointed."""
    from fastdora.kernels import native
    from fastdora.ops.compose import triton_impl

    impl = triton_impl()  # built before the node is switched off (it registers the node's Python fallbacks)
    monkeypatch.setattr(native, "NODE", None)
    monkeypatch.setitem(native._state, "tried", True)  # no build / import of the node during this test
    _, fast = _pair(torch.float32 if setup == "amp" else torch.bfloat16, attn="eager")
    plain = copy.deepcopy(fast)
    fast.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fast.enable_input_require_grads()
    plain.enable_input_require_grads()
    flags = save_inner_flags(monkeypatch, impl)
    ids = torch.randint(0, 1000, (2, 256), device="cuda")
    res = []
    for m in (plain, fast):
        m.train()
        for _ in range(2):  # two training calls, the second one's flags kept
            m.zero_grad()
            flags.clear()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp"):
                out = m(input_ids=ids, labels=ids)
            out.loss.backward()
        res.append((list(flags), out.loss.detach(), out.logits.detach(),
                    {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}))
    (f_p, loss_p, logits_p, g_p), (f_c, loss_c, logits_c, g_c) = res
    assert f_p == [True] * 14
    assert f_c.count(False) == 14 and f_c.count(True) == 14 and f_c[:7] == [False] * 7
    assert torch.equal(loss_p, loss_c) and torch.equal(logits_p, logits_c)
    assert g_p.keys() == g_c.keys()
    for n in g_p:
        assert torch.equal(g_p[n], g_c[n]), n


def _mlp_pair(n_layers=3, d=(512, 768, 384, 640), r=32, dtype=torch.bfloat16, adapter_dtype=torch.float32):
    """A stack of bias-free Linear layers with DoRA on all of them: two fastdora copies, the second to be called
    without norm graphs (inside :func:`_no_graphs`)."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(d[i], d[i + 1], bias=False) for i in range(n_layers)]).to("cuda", dtype)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, use_dora=True, init_lora_weights=False,
                     target_modules=[str(i) for i in range(n_layers)])
    model = get_peft_model(base, cfg, autocast_adapter_dtype=adapter_dtype == torch.float32)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(adapter_dtype)
    eager = copy.deepcopy(model)
    fastdora.enable(model, kernels="triton")
    fastdora.enable(eager, kernels="triton")
    return model, eager, d[0]


def _no_graphs():
    """The block every call of a ``_mlp_pair`` model without norm graphs runs in (the internal setting graph_norm is
    read at every call)."""
    return fastdora.config.override(graph_norm=False)


def _graph_states(model):
    """Per layer: "NormGraph", or the count / failure reason of its graph entry (assertion messages)."""
    out = []
    for mag in _mags(model):
        e = mag.__dict__.get("_fastdora_graphs", {}).get("default")
        out.append(type(e).__name__ if not isinstance(e, tuple) else e[1:])
    return out


def _mags(model):
    return [m.lora_magnitude_vector["default"] for m in model.modules() if hasattr(m, "lora_magnitude_vector")
            and "default" in m.lora_magnitude_vector]


@pytest.mark.parametrize("setup", ["amp", "pure_bf16"])
def test_norm_graph_training_bitwise(setup):
    """Training steps with the norm captured into CUDA graphs vs eager launches: bitwise the same outputs,
    gradients and parameters; the graph is captured once per layer (third recomputation) and replayed after."""
    model, eager, d_in = _mlp_pair(adapter_dtype=torch.float32 if setup == "amp" else torch.bfloat16)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, eager)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(4, 64, d_in, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(6)]
    active_path_counter.clear()
    for step, x in enumerate(xs):
        outs = []
        for m, opt, block in zip((model, eager), opts, (contextlib.nullcontext, _no_graphs)):
            with block():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp"):
                    y = m(x)
                (y.float() ** 2).mean().backward()
            outs.append(y.detach())
            opt.step()
            opt.zero_grad()
        assert torch.equal(outs[0], outs[1]), f"step {step}"
    for (n, p), (n2, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert n == n2 and torch.equal(p, q), n
    n_layers = len(_mags(model))
    assert active_path_counter["norm:graph_capture"] == n_layers
    assert active_path_counter["norm:graph_replay"] == n_layers * (len(xs) - 3)


def test_norm_graph_recapture_streams_and_memory():
    """A storage swap of a factor recaptures (eager meanwhile), another stream computes eagerly, replays in another
    order than captured leave every cached norm exact, and replays do not grow memory."""
    from fastdora.dispatch import factored_norm

    model, _, d_in = _mlp_pair()
    mags = _mags(model)
    layers = [m for m in model.modules()
              if hasattr(m, "lora_magnitude_vector") and "default" in m.lora_magnitude_vector]
    x = torch.randn(2, 16, d_in, device="cuda", dtype=torch.bfloat16)

    def bump():  # an optimizer-like in-place update of every factor, then a new step
        with torch.no_grad():
            for m in layers:
                m.lora_A["default"].weight.mul_(1.01)
                m.lora_B["default"].weight.add_(1e-3)
        fastdora.invalidate_norm_cache()

    def check():  # every cached norm equals a fresh computation of the same kernels
        for m, mag in zip(layers, mags):
            cached = mag._fastdora_norm["default"][1]
            ref, _ = factored_norm(m.base_layer.weight, m.lora_A["default"].weight, m.lora_B["default"].weight,
                                   m.scaling["default"], mag._fastdora_base[1], kernels="triton")
            assert torch.equal(cached, ref)

    for _ in range(4):
        with torch.no_grad():
            model(x)
        check()
        bump()
    graphs = [mag._fastdora_graphs["default"] for mag in mags]
    assert all(type(g).__name__ == "NormGraph" for g in graphs)
    # replays in reverse layer order (the pool is shared by the stream's graphs): each norm stays exact
    for m in reversed(layers):
        with torch.no_grad():
            m(torch.randn(2, m.base_layer.in_features, device="cuda", dtype=torch.bfloat16))
    check()
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    for _ in range(3):
        bump()
        with torch.no_grad():
            model(x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= mem0
    check()
    # a storage swap of one factor: that layer's graph no longer matches -> eager, recaptured later; still exact
    w = layers[1].lora_A["default"].weight
    w.data = w.data.clone()
    active_path_counter.clear()
    for _ in range(3):
        bump()
        with torch.no_grad():
            model(x)
        check()
    assert active_path_counter["norm:graph_capture"] == 1
    # another stream: eager there, exact
    s = torch.cuda.Stream()
    bump()
    active_path_counter.clear()
    with torch.cuda.stream(s), torch.no_grad():
        model(x)
    torch.cuda.current_stream().wait_stream(s)
    assert active_path_counter["norm:graph_replay"] == 0
    check()
    # deepcopy drops the graphs (the copy recomputes)
    dup = copy.deepcopy(model)
    assert all(m._fastdora_graphs == {} for m in _mags(dup))


def test_norm_graphs_share_one_pool():
    """Every layer's norm graph on one stream shares one pool and one capture stream: memory reserved by the
    captures stays about one layer's working set, not one per layer."""
    from fastdora.ops import norm_graph

    torch.cuda.synchronize()
    model, eager, d_in = _mlp_pair(n_layers=6, d=(1024,) * 7, r=64)
    x = torch.randn(2, 16, d_in, device="cuda", dtype=torch.bfloat16)
    for m, block in ((model, contextlib.nullcontext), (eager, _no_graphs)):
        for _ in range(2):  # eager recomputations (base, then base cached): kernels compiled
            with torch.no_grad(), block():
                m(x)
            fastdora.invalidate_norm_cache()
    torch.cuda.synchronize()
    pools_before = dict(norm_graph._POOLS)
    r0 = torch.cuda.memory_reserved()
    with torch.no_grad():
        model(x)  # the six captures
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - r0
    assert active_path_counter["norm:graph_capture"] >= 6, _graph_states(model)
    assert len(norm_graph._POOLS) - len(pools_before) <= 1
    # one layer's norm working set (U-sized partials of 1024 x 64 fp32, G, parts) is well under 8 MB; six separate
    # per-layer reservations would be six times that at least (the caching allocator rounds segments up to 2 MB)
    assert grown <= 8 * 2**20, grown


def test_norm_graph_failed_capture_leaves_no_trace(monkeypatch):
    """A capture that fails (here: a synchronising call inside it) computes that norm eagerly, records
    ``norm:graph_failed`` with the reason, and leaves the process as it was: CUDA random numbers work (PyTorch leaves
    the generator in capture mode after a failed capture unless fastdora restores it), the outputs equal the eager
    model's, and a later capture of the same stream succeeds."""
    from fastdora.kernels import norm as kn

    model, eager, d_in = _mlp_pair()
    x = torch.randn(2, 16, d_in, device="cuda", dtype=torch.bfloat16)
    real = kn._gram_matrix

    def syncing(*args, **kw):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while capturing: the capture fails
        return real(*args, **kw)

    n = len(_mags(model))
    active_path_counter.clear()
    for step in range(5):
        if step == 2:
            monkeypatch.setattr(kn, "_gram_matrix", syncing)
        if step == 3:
            monkeypatch.undo()
        with torch.no_grad():
            out = model(x)
            with _no_graphs():
                ref = eager(x)
        assert torch.equal(out, ref), step
        if step == 2:
            assert active_path_counter["norm:graph_failed"] == n, _graph_states(model)
            states = _graph_states(model)
            assert all("capturing" in str(s[-1]).lower() or "capture" in str(s[-1]).lower() for s in states), states
            torch.randn(8, device="cuda")  # the generator is out of capture mode
            torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
        fastdora.invalidate_norm_cache()
    # a failed layer stays eager (its reason kept); the process keeps capturing other layers' graphs normally
    torch.cuda.synchronize()
    assert active_path_counter["norm:graph_capture"] == 0
    other, other_eager, _ = _mlp_pair()
    active_path_counter.clear()
    for _ in range(4):
        with torch.no_grad():
            out = other(x)
            with _no_graphs():
                assert torch.equal(out, other_eager(x))
        fastdora.invalidate_norm_cache()
    assert active_path_counter["norm:graph_capture"] == n, _graph_states(other)
    assert active_path_counter["norm:graph_replay"] == n
    torch.randn(8, device="cuda")


def test_norm_graph_capture_holds_off_gc(monkeypatch):
    """Python's cyclic GC is off while a norm graph is captured (a collection there runs unrelated CUDA objects'
    finalizers inside the capture, which fails it) and back on afterwards."""
    import gc

    from fastdora.kernels import norm as kn

    model, _, d_in = _mlp_pair()
    x = torch.randn(2, 16, d_in, device="cuda", dtype=torch.bfloat16)
    real = kn._gram_matrix
    seen = []

    def probe(*args, **kw):
        if torch.cuda.is_current_stream_capturing():
            seen.append(gc.isenabled())
        return real(*args, **kw)

    monkeypatch.setattr(kn, "_gram_matrix", probe)
    assert gc.isenabled()
    active_path_counter.clear()
    for _ in range(4):
        with torch.no_grad():
            model(x)
        fastdora.invalidate_norm_cache()
    assert active_path_counter["norm:graph_capture"] == len(_mags(model))
    assert seen == [False] * len(_mags(model))
    assert gc.isenabled()


def test_norm_graph_pool_outlives_its_graphs():
    """Every graph of a stream's shared pool freed (their model deleted), then another model captures into that pool:
    PyTorch asserts against a capture into a pool with no live graph, so each pool holds an empty keeper graph;
    every capture succeeds, into the same pool, and CUDA random numbers keep working."""
    import gc

    from fastdora.ops import norm_graph

    def run(model, x):
        for _ in range(4):  # base, base cached (eager), capture, replay
            with torch.no_grad():
                model(x)
            fastdora.invalidate_norm_cache()

    first, _, d_in = _mlp_pair()
    x = torch.randn(2, 16, d_in, device="cuda", dtype=torch.bfloat16)
    n = len(_mags(first))
    active_path_counter.clear()
    run(first, x)
    assert active_path_counter["norm:graph_capture"] == n, _graph_states(first)
    pools = {k: v[0] for k, v in norm_graph._POOLS.items()}
    del first
    gc.collect()
    torch.cuda.synchronize()
    second, _, _ = _mlp_pair()
    active_path_counter.clear()
    run(second, x)
    assert active_path_counter["norm:graph_capture"] == n, _graph_states(second)
    assert active_path_counter["norm:graph_failed"] == 0
    assert {k: v[0] for k, v in norm_graph._POOLS.items()} == pools  # the same pool, kept live
    torch.randn(8, device="cuda")
