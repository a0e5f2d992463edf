"""Non-reentrant gradient checkpointing drops what the first forward saves (the backward takes the recomputation's
tensors): the composition skips computing ``inner`` there and saves a placeholder of the same shape, dtype and
device instead. Outputs and every gradient stay bitwise those of the same model without checkpointing, and of the
composition that computes ``inner`` every time; any other saved-tensor hook keeps the real ``inner``."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fastdora
from fastdora.ops import compose as oc

from ..helpers import MLP, assert_close, assert_same_grads, make_pair, model_input, save_inner_flags

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@pytest.fixture
def save_flags(monkeypatch):
    """The ``save_inner`` argument of every eager composition forward, in call order."""
    return save_inner_flags(monkeypatch, oc.EAGER)


def _run(model, x, mode, seed=5):
    """Output and gradients (parameters and input) of one weighted-sum loss; ``mode``: None (plain call),
    ``"ckpt"`` (non-reentrant checkpoint), ``"reentrant"``, ``"cpu_hooks"`` (``save_on_cpu`` inside the checkpoint),
    ``"hooks"`` (an identity pack hook, no checkpoint)."""
    model.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)  # the dropout masks (checkpoint restores the RNG state for its recomputation)
    if mode is None:
        out = model(xx)
    elif mode == "ckpt":
        out = checkpoint(model, xx, use_reentrant=False)
    elif mode == "reentrant":
        out = checkpoint(model, xx, use_reentrant=True)
    elif mode == "cpu_hooks":
        def inner_fn(t):
            with torch.autograd.graph.save_on_cpu():
                return model(t)

        out = checkpoint(inner_fn, xx, use_reentrant=False)
    elif mode == "hooks":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = model(xx)
    else:  # pragma: no cover
        raise ValueError(mode)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["input"] = xx.grad.clone()
    return out.detach(), grads


def _bitwise(ga, gb, what):
    assert ga.keys() == gb.keys(), what
    for k in ga:
        assert torch.equal(ga[k], gb[k]), f"{what}: {k} differs (max {(ga[k].double() - gb[k].double()).abs().max()})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["bias", "nobias", "dropout", "chain"])
def test_checkpoint_first_forward_skips_inner(save_flags, dtype, variant):
    """``chain``: the lean forward off (the internal setting, read at every call: the enable and every forward and
    backward run inside the block), PEFT's forward -> fastdora variant -> magnitude layer."""
    kw = {"lora_dropout": 0.3} if variant == "dropout" else {}
    ref, fast = make_pair(lambda: MLP(bias=variant != "nobias"), dtype=dtype, enable=False, **kw)
    block = fastdora.config.override(lean_forward=False) if variant == "chain" else contextlib.nullcontext()
    with block:
        fastdora.enable(fast, kernels="eager")
        x = model_input(fast, dtype)
        n_layers = sum(1 for m in fast.modules() if hasattr(m, "lora_magnitude_vector"))

        save_flags.clear()
        out_p, g_p = _run(fast, x, None)
        assert save_flags == [True] * n_layers  # plain training forward: inner computed and saved
        save_flags.clear()
        out_c, g_c = _run(fast, x, "ckpt")
        # first forward: not computed (discarded anyway); the recomputation in the backward: computed
        assert save_flags == [False] * n_layers + [True] * n_layers
        assert torch.equal(out_c, out_p)
        _bitwise(g_c, g_p, "checkpointed vs plain")
        if variant == "chain":
            assert not any("forward" in m.__dict__ for m in fast.modules() if hasattr(m, "lora_magnitude_vector"))

    out_r, g_r = _run(ref, x, "ckpt")  # stock PEFT, checkpointed the same way
    assert_close(out_c, out_r, dtype, "output vs PEFT")
    assert_same_grads(g_c, g_r, dtype, "checkpointed vs PEFT")


@pytest.mark.parametrize("mode", ["cpu_hooks", "hooks", "reentrant"])
def test_other_saved_tensor_hooks_keep_inner(save_flags, mode):
    """``save_on_cpu`` inside the checkpoint and a plain hook pair keep what is saved: inner is computed; reentrant
    checkpointing runs its first forward without grad (no node, nothing saved)."""
    _, fast = make_pair(MLP, dtype=torch.float32)
    x = model_input(fast, torch.float32)
    out_p, g_p = _run(fast, x, None)
    n = sum(1 for m in fast.modules() if hasattr(m, "lora_magnitude_vector"))
    save_flags.clear()
    out_h, g_h = _run(fast, x, mode)
    if mode in ("cpu_hooks", "hooks"):  # saved through the hook on top (for save_on_cpu: nothing left to recompute)
        assert save_flags == [True] * n
    else:  # the no-grad first forward takes the inference path (no inner), then the recomputation saves
        assert save_flags == [False] * n + [True] * n
    assert torch.equal(out_h, out_p)
    _bitwise(g_h, g_p, mode)


def test_saves_discarded_only_under_checkpoint_pack_hook():
    seen = []

    def probe(t):
        seen.append(oc.saves_discarded())
        return t * t  # saves t: the backward recomputes

    x = torch.randn(3, requires_grad=True)
    probe(x)
    checkpoint(probe, x, use_reentrant=False).sum().backward()  # original forward, then the recomputation
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        probe(x)
    assert seen == [False, True, False, False]


def test_placeholder_never_reaches_a_backward(monkeypatch):
    """If the detection ever misfired (a placeholder saved where the backward reads it), the backward raises
    instead of computing a magnitude gradient from it."""
    _, fast = make_pair(MLP, dtype=torch.float32)
    x = model_input(fast, torch.float32)
    monkeypatch.setattr(oc, "saves_discarded", lambda: True)
    out = fast(x)
    with pytest.raises(RuntimeError, match="discarded by gradient checkpointing"):
        out.sum().backward()


def test_placeholder_metadata_and_no_storage():
    r = torch.randn(4, 6, dtype=torch.bfloat16)
    lo = torch.randn(4, 6, dtype=torch.float32)
    p = oc._inner_placeholder(r, lo.dtype)
    assert p.shape == r.shape and p.dtype == torch.float32 and p.device == r.device
    assert p.untyped_storage().nbytes() == 4  # one element (never read), however large the activation
    assert oc._inner_placeholder(r, lo.dtype).untyped_storage().data_ptr() == p.untyped_storage().data_ptr()


def test_checkpointed_training_steps_match_plain():
    """Several optimizer steps with checkpointing: parameters bitwise those of the plain run."""
    _, a = make_pair(MLP, dtype=torch.float32)
    b = copy.deepcopy(a)
    x = model_input(a, torch.float32)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (a, b)]
    for _ in range(3):
        for m, opt, mode in ((a, opts[0], None), (b, opts[1], "ckpt")):
            opt.zero_grad()
            _run(m, x, mode)
            opt.step()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_hf_model_gradient_checkpointing(save_flags):
    """A transformers causal LM with its own gradient checkpointing (non-reentrant, per decoder layer): each DoRA
    layer's first forward skips ``inner``, its recomputation computes it; loss and every gradient bitwise those of
    the same model without checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    base = LlamaForCausalLM(cfg)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    plain = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False,
                                            target_modules=targets))
    ckpt = copy.deepcopy(plain)
    for m in (plain, ckpt):
        fastdora.enable(m, kernels="eager")
        m.train()
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    res = []
    for m in (plain, ckpt):
        for _ in range(2):  # two training calls, the second one's flags kept
            m.zero_grad(set_to_none=True)
            save_flags.clear()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
        res.append((list(save_flags), loss.detach(),
                    {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (f_p, loss_p, g_p), (f_c, loss_c, g_c) = res
    assert f_p == [True] * 14
    assert f_c == [False] * 14 + [True] * 14  # both layers' first forwards, then both recomputations
    assert torch.equal(loss_p, loss_c)
    _bitwise(g_c, g_p, "HF checkpointing")


@pytest.mark.parametrize("dtype,adapter_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                                 (torch.bfloat16, torch.bfloat16)], ids=["bf16", "fp32", "bf16_all"])
def test_selective_checkpointing_keeps_inner(save_flags, dtype, adapter_dtype):
    """Selective activation checkpointing hands the recomputation the first forward's outputs of the ops its policy
    saves, matched by op and order: the first forward must run the same ops as the recomputation (the Triton path
    allocates ``inner`` with ``empty_like``), so under any Python dispatch mode the composition computes ``inner``
    (no discard). Gradients bitwise those of the plain run."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def save_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    # bf16_all: the eager half-precision path with a bias (its ops must not mutate outputs SAC keeps)
    _, fast = make_pair(lambda: MLP(bias=True), dtype=dtype, adapter_dtype=adapter_dtype)
    x = model_input(fast, dtype)
    out_p, g_p = _run(fast, x, None)
    n = sum(1 for m in fast.modules() if hasattr(m, "lora_magnitude_vector"))
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, save_all)
    fast.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_(True)
    save_flags.clear()
    out = checkpoint(fast, xx, use_reentrant=False, context_fn=ctx_fn)
    assert save_flags == [True] * n  # first forward under SAC's dispatch mode: inner computed
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    (out * w).sum().backward()
    g_c = {k: p.grad.clone() for k, p in fast.named_parameters() if p.grad is not None}
    g_c["input"] = xx.grad.clone()
    assert torch.equal(out.detach(), out_p)
    _bitwise(g_c, g_p, "selective checkpointing")
