"""fastdora under ``torch.compile``: no graph breaks (stock PEFT has them), the cached norm inside the compiled graph
(``fastdora::cached_norm``: computed once per optimizer step, not at all while nothing changes), no recompilation
beyond LoRA's under the same sequence of calls, and the same outputs and gradients as eager fastdora and stock PEFT.

CPU tests use the ``aot_eager`` backend (AOTAutograd's graphs, run without Inductor: fast) except one Inductor test;
the GPU tests run Inductor (default mode and ``mode="reduce-overhead"``) with the Triton kernels."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import fastdora
from fastdora import dispatch
from fastdora.stats import active_path_counter

from ..helpers import MLP, ConvModel, EmbModel, GPT2Style, make_pair, model_input

pytestmark = pytest.mark.skipif(not dispatch.HAS_NORM_OP, reason="this torch has no torch.library.custom_op")


class Counting:
    """A ``torch.compile`` backend that counts the graphs it compiles (``aot_eager`` or Inductor underneath)."""

    def __init__(self, inner="aot_eager"):
        self.inner, self.graphs = inner, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)


def _norms(counter=active_path_counter):
    return counter.get("norm:computed", 0) + counter.get("norm:computed_base_cached", 0)


def _llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _peft(base, dora=True, fast=True):
    torch.manual_seed(1)  # init_lora_weights=False draws the adapters: the same draws for every variant
    m = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, use_dora=dora, target_modules="all-linear",
                                                       init_lora_weights=False))
    if fast:
        assert fastdora.enable(m).total_converted > 0
    return m


def _dora_layers(model) -> int:
    """The number of DoRA (layer, adapter) pairs of ``model`` (one adapter, ``default``)."""
    return sum(1 for n, _ in model.named_modules() if n.endswith("lora_magnitude_vector.default"))


def _breaks(model, x) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(model)(x).graph_break_count


@pytest.mark.parametrize("kind", ["mlp", "gpt2_conv1d", "embedding", "conv2d", "llama"])
def test_no_graph_breaks(kind):
    """fastdora's layers trace without a graph break (stock PEFT's DoRA breaks the graph at its weight
    dequantization, ``transpose`` or parameter construction in several of these)."""
    if kind == "llama":
        base = _llama()
        ref, fast = _peft(base, fast=False), _peft(base)
        x = torch.randint(0, 64, (2, 8))
        peft_breaks = _breaks(ref.base_model.model, x)
    else:
        fn = {"mlp": MLP, "gpt2_conv1d": GPT2Style, "embedding": EmbModel, "conv2d": lambda: ConvModel(2)}[kind]
        ref, fast = make_pair(fn, fan_in_fan_out=kind == "gpt2_conv1d")
        x = model_input(ref.base_model.model, torch.float32)
        peft_breaks = _breaks(ref.base_model.model, x)
    fast_breaks = _breaks(fast.base_model.model, x)
    assert fast_breaks == 0, f"fastdora: {fast_breaks} graph breaks (stock PEFT: {peft_breaks})"


@pytest.mark.parametrize("kind", ["mlp", "gpt2_conv1d", "embedding"])
def test_fullgraph_matches_eager_and_stock_peft(kind):
    """``fullgraph=True`` compiles; outputs and every gradient equal eager fastdora's and stock PEFT's."""
    from ..helpers import assert_close, assert_same_grads, forward_backward

    fn = {"mlp": MLP, "gpt2_conv1d": GPT2Style, "embedding": EmbModel}[kind]
    ref, fast = make_pair(fn, fan_in_fan_out=kind == "gpt2_conv1d")
    x = model_input(ref.base_model.model, torch.float32)
    torch._dynamo.reset()
    active_path_counter.clear()
    compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
    out_c, g_c = forward_backward(compiled, x)
    g_c = {k.replace("_orig_mod.", ""): v for k, v in g_c.items()}
    assert active_path_counter["compiled:norm_op"] > 0  # the norm ran as fastdora's op inside the graph
    out_e, g_e = forward_backward(fast, x)
    out_r, g_r = forward_backward(ref, x)
    assert_close(out_c, out_e, torch.float32, "compiled vs eager")
    assert_close(out_c, out_r, torch.float32, "compiled vs stock PEFT")
    assert_same_grads(g_c, g_e, torch.float32, "compiled vs eager")
    assert_same_grads(g_c, g_r, torch.float32, "compiled vs stock PEFT")


def test_compiled_linear_layers_trace_the_lean_forward(monkeypatch):
    """Under ``torch.compile`` a converted Linear layer is traced through fastdora's lean forward, not PEFT's forward
    chain (whose extra attribute reads become guards checked at every call of the compiled region). Under CPU bf16
    autocast with a bf16 base and fp32 adapters (PEFT's AMP layout, where the lean forward leaves out the exact
    input-cast round trip before ``lora_A``), the compiled model's output and every gradient equal eager fastdora's
    and stock PEFT's."""
    from fastdora import layers

    from ..helpers import assert_close, assert_same_grads, forward_backward

    ref, fast = make_pair(MLP, dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for n, p in fast.named_parameters() if "lora_" in n)
    chain_calls = []
    real = layers.FastDoraLinearVariant.forward

    def spy(*args, **kwargs):
        chain_calls.append(1)
        return real(*args, **kwargs)

    x = model_input(ref.base_model.model, torch.bfloat16)
    forward_backward(fast, x)  # eager first call: installs the lean forward on each layer
    assert all(layers.is_fastdora_forward(m.__dict__.get("forward")) for m in fast.modules()
               if type(m).__name__ == "Linear" and hasattr(m, "lora_magnitude_vector"))
    monkeypatch.setattr(layers.FastDoraLinearVariant, "forward", staticmethod(spy))
    torch._dynamo.reset()
    compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_c, g_c = forward_backward(compiled, x)
        assert chain_calls == []  # traced without PEFT's chain
        monkeypatch.setattr(layers.FastDoraLinearVariant, "forward", staticmethod(real))
        out_e, g_e = forward_backward(fast, x)
        out_r, g_r = forward_backward(ref, x)
    g_c = {k.replace("_orig_mod.", ""): v for k, v in g_c.items()}
    assert out_c.dtype == out_r.dtype == torch.bfloat16
    assert_close(out_c, out_e, torch.bfloat16, "compiled vs eager")
    assert_close(out_c, out_r, torch.bfloat16, "compiled vs stock PEFT")
    assert_same_grads(g_c, g_e, torch.bfloat16, "compiled vs eager")
    assert_same_grads(g_c, g_r, torch.bfloat16, "compiled vs stock PEFT")


def _train(model, step_fn, steps=3, ga=2, fused=False, scope=None):
    """``steps`` optimizer steps of ``ga`` micro-batches; each step inside ``scope(model)`` if given."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=fused)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        with scope(model) if scope is not None else contextlib.nullcontext():
            for _ in range(ga):
                x = torch.randint(0, 64, (2, 8), generator=g)
                loss = step_fn(x).loss
                (loss / ga).backward()
                losses.append(loss.item())
            opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _llama_variants(checkpointing: bool):
    """``(name, PEFT model, counting backend, compiled)`` for eager fastdora, LoRA to compile and fastdora to compile,
    on one tiny Llama, with non-reentrant gradient checkpointing if asked."""
    base = _llama()
    if checkpointing and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        # transformers' attention can set a context variable inside the checkpoint (the `kernels` package), which
        # otherwise sends the whole checkpointed layer to eager, LoRA included
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for name, dora, fast, compiled in [("eager", True, True, False), ("lora", False, False, True),
                                       ("fastdora", True, True, True)]:
        m = _peft(base, dora=dora, fast=fast)
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch._dynamo.reset()
        yield name, m, Counting(), compiled


@pytest.mark.slow
@pytest.mark.parametrize("fused,checkpointing", [(False, True), (True, False)],
                         ids=["foreach-checkpointed", "fused-plain"])
def test_norm_once_per_step_no_recompiles(fused, checkpointing):
    """Training with gradient accumulation (and non-reentrant checkpointing): the compiled model computes each norm
    once per optimizer step (fused optimizers too: they bump no version counter, the step hook's epoch catches them),
    its losses equal eager fastdora's, and it compiles exactly as many graphs as LoRA under the same calls
    (train, eval, train again, a cache invalidation)."""
    counts = {}
    losses = {}
    for name, m, backend, compiled in _llama_variants(checkpointing):
        f = torch.compile(m, backend=backend) if compiled else m
        active_path_counter.clear()
        losses[name] = _train(m, lambda x: f(input_ids=x, labels=x), fused=fused)
        layers = _dora_layers(m)
        if name == "fastdora":
            assert _norms() == layers * 3, dict(active_path_counter)  # 3 steps
            assert active_path_counter["compiled:norm_op"] == layers * 2 * 3 * (2 if checkpointing else 1)
            assert not any(k.startswith("linear:") for k in active_path_counter), dict(active_path_counter)
        m.eval()
        with torch.no_grad():
            f(input_ids=torch.randint(0, 64, (2, 8)))
        m.train()
        fastdora.invalidate_norm_cache()
        f(input_ids=torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
        counts[name] = backend.graphs
    assert counts["fastdora"] == counts["lora"], counts
    assert max(abs(a - b) for a, b in zip(losses["fastdora"], losses["eager"])) < 1e-5


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
def test_compiled_decoder_layers_read_norm_slots(checkpointing):
    """Each decoder layer compiled, the model itself eager (regional compilation): the compiled graphs read the norm
    slots that the model's pre-forward refresh keeps current (``fastdora.slots``) and never call the norm op; each
    norm is computed once per optimizer step; losses equal eager fastdora's; as many graphs as LoRA's."""
    losses, graphs = {}, {}
    for name, m, backend, compiled in _llama_variants(checkpointing):
        if compiled:
            for layer in m.get_base_model().model.layers:
                layer.compile(backend=backend)
        active_path_counter.clear()
        losses[name] = _train(m, lambda x: m(input_ids=x, labels=x))
        graphs[name] = backend.graphs
        if name == "fastdora":
            layers = _dora_layers(m)
            assert _norms() == layers * 3, dict(active_path_counter)  # 3 optimizer steps
            assert active_path_counter["norm:slot_refresh"] == layers * 3, dict(active_path_counter)
            assert "compiled:norm_op" not in active_path_counter, dict(active_path_counter)
            assert not any(k.startswith("linear:") for k in active_path_counter), dict(active_path_counter)
    assert graphs["fastdora"] == graphs["lora"], graphs
    assert max(abs(a - b) for a, b in zip(losses["fastdora"], losses["eager"])) < 1e-5


def test_step_scope_checks_slots_once_per_step_for_compiled_layers():
    """Decoder layers compiled, each optimizer step inside ``fastdora.step_scope`` (as the trainer callback opens
    them): the slots are checked when the scope opens and not again at each gradient-accumulation micro-batch; losses
    equal eager fastdora's. Inside a scope, ``load_state_dict`` of new adapter values is seen by the next forward."""
    models, losses = {}, {}
    for name, m, backend, compiled in _llama_variants(checkpointing=True):
        if name == "lora":
            continue
        if compiled:
            for layer in m.get_base_model().model.layers:
                layer.compile(backend=backend)
        active_path_counter.clear()
        losses[name] = _train(m, lambda x: m(input_ids=x, labels=x), steps=3, ga=3, scope=fastdora.step_scope)
        models[name] = m
        if name == "fastdora":
            layers = _dora_layers(m)
            assert active_path_counter["norm:slot_checks"] == 3, dict(active_path_counter)  # one per scope
            assert active_path_counter["norm:slot_refresh"] == layers * 3, dict(active_path_counter)
            assert "compiled:norm_op" not in active_path_counter, dict(active_path_counter)
    assert max(abs(a - b) for a, b in zip(losses["fastdora"], losses["eager"])) < 1e-5
    eager, fast = models["eager"], models["fastdora"]
    x = torch.randint(0, 64, (2, 8))
    g = torch.Generator().manual_seed(9)
    new = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in fast.state_dict().items() if "lora_B" in k}
    with fastdora.step_scope(fast):
        torch.testing.assert_close(fast(input_ids=x).logits, eager(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        active_path_counter.clear()
        for m in (fast, eager):
            m.load_state_dict(new, strict=False)
        torch.testing.assert_close(fast(input_ids=x).logits, eager(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        assert active_path_counter["norm:slot_checks"] == 1, dict(active_path_counter)
        assert active_path_counter["norm:slot_refresh"] == _dora_layers(fast), dict(active_path_counter)


@pytest.mark.slow
@pytest.mark.parametrize("fused,checkpointing", [(False, True), (True, False)],
                         ids=["foreach-checkpointed", "fused-plain"])
def test_whole_model_compiled_reads_slots_inside_step_scopes(fused, checkpointing):
    """The whole PEFT model compiled (its hooks are traced, so they cannot refresh): inside ``fastdora.step_scope``
    (one per optimizer step, as fastdora's trainer callback opens them) the graph reads the norm slots, refreshed when
    each scope opens (after a fused optimizer's step too, which bumps no version counter: the cache epoch does); no
    norm op runs in training; each norm is computed once per step; losses equal eager fastdora's; as many graphs as
    LoRA's under the same calls, an evaluation outside any scope (the op) included."""
    losses, graphs = {}, {}
    for name, m, backend, compiled in _llama_variants(checkpointing):
        f = torch.compile(m, backend=backend) if compiled else m
        active_path_counter.clear()
        losses[name] = _train(m, lambda x: f(input_ids=x, labels=x), fused=fused, scope=fastdora.step_scope)
        if name == "fastdora":
            layers = _dora_layers(m)
            assert "compiled:norm_op" not in active_path_counter, dict(active_path_counter)
            assert _norms() == layers * 3, dict(active_path_counter)  # each scope's refresh
        m.eval()
        with torch.no_grad():
            f(input_ids=torch.randint(0, 64, (2, 8)))
        m.train()
        graphs[name] = backend.graphs
    assert graphs["fastdora"] == graphs["lora"], graphs
    assert max(abs(a - b) for a, b in zip(losses["fastdora"], losses["eager"])) < 1e-5


class _Checkpointed(torch.nn.Module):
    """Two Linear layers, each run through ``torch.utils.checkpoint`` by the model's forward: a layer compiled on its
    own is called again by the checkpoint in the backward, outside the model's forward."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1 = torch.nn.Linear(16, 24), torch.nn.Linear(24, 16)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.l0, x, use_reentrant=False)
        return checkpoint(self.l1, torch.relu(h), use_reentrant=False)


def test_norm_slots_in_a_checkpoint_recompute_outside_the_compiled_layer():
    """Each LoRA layer compiled and checkpointed from the (eager) model: the recompute in the backward takes the same
    slot graph as the forward (the root is armed for that backward), so the checkpoint's saved tensors match, no norm
    op runs and no second graph is compiled; gradients equal eager fastdora's and the norm is computed once per
    optimizer step."""
    grads, graphs = {}, {}
    for name, dora, fast, compiled in [("eager", True, True, False), ("lora", False, False, True),
                                       ("fastdora", True, True, True)]:
        torch.manual_seed(0)
        m = get_peft_model(_Checkpointed(), LoraConfig(r=4, use_dora=dora, target_modules=["l0", "l1"],
                                                       init_lora_weights=False))
        if fast:
            assert fastdora.enable(m).total_converted == 2
        torch._dynamo.reset()
        backend = Counting()
        if compiled:
            for layer in (m.base_model.model.l0, m.base_model.model.l1):
                layer.compile(backend=backend)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        g = torch.Generator().manual_seed(2)
        active_path_counter.clear()
        for _ in range(2):
            for _ in range(2):
                m(torch.randn(5, 16, generator=g)).square().mean().backward()
            grads[name] = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
            opt.step()
            opt.zero_grad(set_to_none=True)
        graphs[name] = backend.graphs
        if name == "fastdora":
            assert "compiled:norm_op" not in active_path_counter, dict(active_path_counter)
            assert _norms() == 2 * 2, dict(active_path_counter)  # two layers, two optimizer steps
    assert graphs["fastdora"] == graphs["lora"], graphs
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["fastdora"][n], g, rtol=1e-5, atol=1e-6)


def test_norm_slots_only_inside_the_models_forward():
    """A compiled LoRA layer traced inside its model's forward reads its slot; called directly after an in-place
    edit of ``lora_B`` (no model forward, no refresh), it fails Dynamo's guard on the slots' root and runs a graph
    with the norm op: its output equals stock PEFT's on the edited weights. The next model forward refreshes the
    slot and equals stock PEFT's too. Disabling fastdora removes the hooks and the slots."""
    from fastdora import slots

    def build(fast):
        torch.manual_seed(0)
        seq = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 16))
        m = get_peft_model(seq, LoraConfig(r=4, use_dora=True, target_modules=["0", "1"], init_lora_weights=False))
        if fast:
            assert fastdora.enable(m).total_converted == 2
        return m

    m, ref = build(True), build(False)
    layer0 = m.base_model.model[0]
    torch._dynamo.reset()
    backend = Counting()
    layer0.compile(backend=backend)
    x = torch.randn(5, 16)
    with torch.no_grad():
        active_path_counter.clear()
        torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)
        assert "compiled:norm_op" not in active_path_counter and backend.graphs == 1
        b = layer0.lora_B["default"].weight
        b.mul_(3.0)
        ref.base_model.model[0].lora_B["default"].weight.mul_(3.0)
        active_path_counter.clear()
        torch.testing.assert_close(layer0(x), ref.base_model.model[0](x), rtol=1e-5, atol=1e-5)
        assert active_path_counter["compiled:norm_op"] == 1 and backend.graphs == 2
        active_path_counter.clear()
        torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)
        assert active_path_counter["norm:slot_refresh"] == 1 and "compiled:norm_op" not in active_path_counter
        assert backend.graphs == 2  # the slot graph again: no recompilation
    assert fastdora.disable(m) == 2
    assert not m._forward_pre_hooks and not m._forward_hooks
    assert not any(slots.SLOT_ATTRS & set(mod.__dict__) for mod in m.modules())


def test_norm_slots_refresh_sees_every_change_to_a_layer():
    """Decoder layers compiled, no-grad forwards of the (eager) model: a forward after no change recomputes no slot;
    after each change to one layer (an in-place edit of ``lora_A``, of ``lora_B`` or of the base weight, a storage
    swap through ``.data``, a new ``lora_B`` parameter object, a new scale) exactly that layer's slot is recomputed
    and the logits equal stock PEFT's on the same parameters."""
    base = _llama()
    m, ref = _peft(base), _peft(base, fast=False)
    for layer in m.get_base_model().model.layers:
        layer.compile(backend="aot_eager")
    torch._dynamo.reset()
    x = torch.randint(0, 64, (2, 8))
    q, k = m.get_base_model().model.layers[1].self_attn.q_proj, m.get_base_model().model.layers[0].mlp.up_proj
    q_ref = ref.get_base_model().model.layers[1].self_attn.q_proj
    k_ref = ref.get_base_model().model.layers[0].mlp.up_proj

    def new_b(layer):
        layer.lora_B["default"].weight = torch.nn.Parameter(layer.lora_B["default"].weight.detach() * 0.5)

    def scale(layer):
        layer.scaling["default"] *= 1.5

    changes = [
        ("A in place", lambda layer: layer.lora_A["default"].weight.mul_(1.1)),
        ("B in place", lambda layer: layer.lora_B["default"].weight.add_(0.01)),
        ("W in place", lambda layer: layer.base_layer.weight.mul_(0.9)),
        ("W storage", lambda layer: setattr(layer.base_layer.weight, "data", layer.base_layer.weight.data * 2.0)),
        ("B object", new_b),
        ("scale", scale),
    ]
    m.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        active_path_counter.clear()
        m(input_ids=x)
        assert "norm:slot_refresh" not in active_path_counter and active_path_counter["norm:slot_checks"] == 1
        for i, (name, change) in enumerate(changes):
            layer, layer_ref = (q, q_ref) if i % 2 == 0 else (k, k_ref)
            change(layer)
            change(layer_ref)
            active_path_counter.clear()
            got = m(input_ids=x).logits
            assert active_path_counter["norm:slot_refresh"] == 1, (name, dict(active_path_counter))
            torch.testing.assert_close(got, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5, msg=name)


def test_layers_share_one_compiled_graph():
    """One compiled function called on different DoRA layers of one shape compiles one graph, as for LoRA layers
    (regional compilation of a model's decoder layers relies on this). fastdora's lean forward is an instance
    attribute of each LoRA Linear; were dynamo to guard on its identity, each layer would compile its own graph, and
    past dynamo's recompile limit (8) the layers would run eagerly."""
    graphs = {}
    for name, dora, fast in (("lora", False, False), ("fastdora", True, True)):
        torch.manual_seed(0)
        base = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        model = get_peft_model(base, LoraConfig(r=4, use_dora=dora, target_modules=["0", "1", "2"],
                                                init_lora_weights=False))
        if fast:
            fastdora.enable(model)
        torch._dynamo.reset()
        backend = Counting()
        call = torch.compile(lambda mod, x: mod(x), backend=backend)
        x = torch.randn(4, 16)
        for layer in model.base_model.model:
            call(layer, x).sum().backward()
        graphs[name] = backend.graphs
    assert graphs["fastdora"] == graphs["lora"] == 1, graphs


def test_lean_forward_survives_pickle_and_deepcopy():
    """The lean forward (a method bound to its module) is rebuilt by pickle and by ``copy.deepcopy``, bound to the
    new module, with the same outputs."""
    import pickle

    from fastdora import layers

    base = _llama(layers=1)
    m = _peft(base)
    x = torch.randint(0, 64, (2, 8))
    want = m(input_ids=x).logits
    for clone in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        lin = [mod for mod in clone.modules() if layers.is_fastdora_forward(mod.__dict__.get("forward"))]
        assert lin and all(mod.__dict__["forward"].__self__ is mod for mod in lin)
        torch.testing.assert_close(clone(input_ids=x).logits, want, rtol=0, atol=0)


def test_inference_reuses_norm_and_sees_every_change():
    """No-grad calls of a compiled model compute no norm while nothing changes; an in-place edit (version bump, no
    optimizer step), a ``.data`` write followed by ``invalidate_norm_cache()`` and an optimizer step each make the
    next call recompute, with outputs equal to stock PEFT's on the same parameters; never a recompilation."""
    base = _llama()
    m = _peft(base)
    backend = Counting()
    torch._dynamo.reset()
    f = torch.compile(m, backend=backend)
    x = torch.randint(0, 64, (2, 8))
    layers = _dora_layers(m)
    b_param = next(p for n, p in m.named_parameters() if "lora_B" in n)

    def check_against_stock():
        ref = _peft(base, fast=False)
        ref.load_state_dict(m.state_dict())
        torch.testing.assert_close(f(input_ids=x).logits, ref(input_ids=x).logits, rtol=2e-5, atol=2e-5)

    m.eval()
    with torch.no_grad():
        f(input_ids=x)
        active_path_counter.clear()
        for _ in range(3):
            f(input_ids=x)
        assert _norms() == 0 and active_path_counter["norm:cached"] == 3 * layers
        b_param.mul_(3.0)  # in place: one layer's key changes
        active_path_counter.clear()
        check_against_stock()
        assert _norms() == 1, dict(active_path_counter)
        b_param.data = b_param.data * 0.5  # a storage swap the key sees, plus the documented invalidation
        fastdora.invalidate_norm_cache()
        active_path_counter.clear()
        check_against_stock()
        assert _norms() == layers, dict(active_path_counter)
    m.train()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    f(input_ids=x, labels=x).loss.backward()
    opt.step()
    m.eval()
    with torch.no_grad():
        active_path_counter.clear()
        check_against_stock()
        assert _norms() == layers, dict(active_path_counter)
    assert backend.graphs == 2  # one no-grad graph, one training graph


def test_inductor_matches_eager():
    """Inductor (CPU): outputs and gradients of the compiled fastdora model equal eager fastdora's."""
    from ..helpers import assert_close, assert_same_grads, forward_backward

    ref, fast = make_pair(MLP)
    x = model_input(ref.base_model.model, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(fast)
    out_c, g_c = forward_backward(compiled, x)
    g_c = {k.replace("_orig_mod.", ""): v for k, v in g_c.items()}
    out_e, g_e = forward_backward(fast, x)
    assert_close(out_c, out_e, torch.float32, "inductor vs eager")
    assert_same_grads(g_c, g_e, torch.float32, "inductor vs eager")


def test_quantized_or_distributed_weights_trace_plain_norm(monkeypatch):
    """A base weight that is not stored plainly (here: a tensor subclass standing for a quantized weight) is not
    keyed by the op (a dequantized copy is a new tensor at every call): the norm is traced as plain PyTorch ops."""
    from fastdora import layers

    assert layers._is_plain(torch.nn.Parameter(torch.zeros(2)))
    assert layers._is_plain(torch.zeros(2))

    class Sub(torch.Tensor):
        pass

    assert not layers._is_plain(torch.zeros(2).as_subclass(Sub))


# ------------------------------------------------------------------------------------------------------------- GPU


def _gpu_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=1000, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


_RO_REASON = (
    "known limitation of CUDA graph trees in training, not of fastdora's norm: 'accessing tensor output of CUDAGraphs "
    "that has been overwritten by a subsequent run' in the first backward, on the output of the LoRA branch that the "
    "backward saved, measured on the H200 (torch 2.11) with each decoder layer compiled, with and without "
    "cudagraph_mark_step_begin() before each forward, and with the whole model compiled; stock PEFT LoRA with each "
    "decoder layer compiled fails with the same error (benchmarks/compile_bench.py, mode reduce-overhead). The norm "
    "the cache "
    "keeps is computed outside the CUDA-graph pool, which an earlier failure was about")
_RO = pytest.mark.xfail(strict=True, raises=RuntimeError, reason=_RO_REASON)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,scope,mark", [
    ("default", "layers", False),
    ("default", "model", False),
    pytest.param("reduce-overhead", "layers", False, marks=_RO),
    pytest.param("reduce-overhead", "layers", True, marks=_RO),
    pytest.param("reduce-overhead", "model", False, marks=_RO),
], ids=["default-layers", "default-model", "reduce-overhead-layers", "reduce-overhead-layers-marked",
        "reduce-overhead-model"])
@pytest.mark.parametrize("setup", ["amp", "bf16"])
def test_gpu_compiled_training_and_stale_norm(mode, scope, mark, setup):
    """On CUDA with Inductor (Triton norm and composition inside the compiled graph): training losses equal eager
    fastdora's within bf16 rounding, the norm is computed once per layer per optimizer step, and after an in-place
    change of an adapter (no optimizer step) the compiled model -- CUDA graphs included -- uses the new norm.
    Scope ``layers``: each decoder layer compiled (regional compilation); ``model``: the whole PEFT model, as HF
    Trainer's ``torch_compile=True`` does. ``mark``: ``torch.compiler.cudagraph_mark_step_begin()`` before each
    forward, as torch documents for loops that CUDA graph trees cannot follow."""
    base = _gpu_llama()
    torch.manual_seed(1)
    cfg = LoraConfig(r=32, lora_alpha=64, use_dora=True, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    eager = get_peft_model(base, cfg, autocast_adapter_dtype=setup == "amp")
    if setup == "bf16":
        for p in eager.parameters():
            p.data = p.data.to(torch.bfloat16)
    comp = copy.deepcopy(eager)
    fastdora.enable(eager, kernels="triton")
    fastdora.enable(comp, kernels="triton")
    layers = _dora_layers(comp)
    torch._dynamo.reset()
    compile_mode = None if mode == "default" else mode
    run = {"eager": eager, "compiled": comp}
    if scope == "model":
        run["compiled"] = torch.compile(comp, mode=compile_mode)
    else:
        for layer in comp.get_base_model().model.layers:
            layer.compile(mode=compile_mode)
    step_mark = torch.compiler.cudagraph_mark_step_begin if mark else (lambda: None)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if setup == "amp" else contextlib.nullcontext
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 1000, (2, 128), generator=g).cuda() for _ in range(6)]
    losses = {}
    for name, m in (("eager", eager), ("compiled", comp)):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        active_path_counter.clear()
        out = []
        for step in range(3):
            for mb in range(2):
                ids = batches[2 * step + mb]
                step_mark()
                with ctx():
                    loss = run[name](input_ids=ids, labels=ids).loss
                (loss / 2).backward()
                out.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses[name] = out
        if name == "compiled":
            assert _norms() == layers * 3, dict(active_path_counter)
            # each layer compiled inside the eager model: the graphs read the norm slots; the whole model
            # compiled: the norm op, once per layer and forward (twice: checkpoint recompute)
            want_ops = 0 if scope == "layers" else layers * 6
            assert active_path_counter.get("compiled:norm_op", 0) == want_ops, dict(active_path_counter)
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["compiled"], losses["eager"]))
    assert diff < 2e-2, (losses, diff)
    # a change no optimizer step announces: the compiled (CUDA-graphed) model must not replay the old norm
    comp.eval()
    eager.eval()
    eager.load_state_dict(comp.state_dict())
    with torch.no_grad():
        ids = batches[0]
        for _ in range(3):  # warm the no-grad graph (CUDA graphs record on a later call)
            step_mark()
            with ctx():
                run["compiled"](input_ids=ids)
        for m in (comp, eager):
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        for _ in range(2):
            step_mark()
            with ctx():
                got = run["compiled"](input_ids=ids).logits.float()
        with ctx():
            want = eager(input_ids=ids).logits.float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 2e-2, err


def test_norm_helper_thread_only_with_cuda_graph_trees(monkeypatch):
    """The norm of a cache miss leaves the calling thread (to keep its memory out of CUDA-graph pools) only where CUDA
    graph trees exist in the process: no trees module, or no tree manager yet, computes it on the calling thread."""
    import sys
    import threading
    import types

    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees", raising=False)
    assert not dispatch._graph_trees_exist()
    containers: dict = {}
    fake = types.SimpleNamespace(local=threading.local(), get_obj=lambda local, name: containers)
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", fake)
    assert not dispatch._graph_trees_exist()
    containers[0] = object()  # a tree manager container for device 0
    assert dispatch._graph_trees_exist()
    # internals this code does not know: the helper thread (always correct)
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", types.SimpleNamespace())
    assert dispatch._graph_trees_exist()
