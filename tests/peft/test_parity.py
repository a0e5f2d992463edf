"""fastdora vs stock PEFT: outputs and every gradient, on every path PEFT supports (CPU, eager implementation)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from peft import PeftModel

import fastdora
from fastdora.stats import active_path_counter

from ..helpers import (
    MLP,
    ConvModel,
    EmbModel,
    GPT2Style,
    assert_close,
    assert_same_grads,
    forward_backward,
    make_pair,
    model_input,
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16]
MODELS = {
    "linear_bias": functools.partial(MLP, bias=True),
    "linear_nobias": functools.partial(MLP, bias=False),
    "conv1d_gpt2_fan_in_fan_out": GPT2Style,
    "embedding": EmbModel,
    "embedding_scaled": functools.partial(EmbModel, scaled=True),
    "conv1d": functools.partial(ConvModel, dim=1),
    "conv2d": functools.partial(ConvModel, dim=2),
    "conv3d": functools.partial(ConvModel, dim=3),
    "conv2d_grouped": functools.partial(ConvModel, dim=2, groups=2),
}


def _kwargs(name):
    kw = {}
    if name.startswith("conv1d_gpt2"):
        kw["fan_in_fan_out"] = True
    if name == "conv2d_grouped":
        kw["r"] = 4  # divisible by groups, as PEFT requires
    return kw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_forward_backward_parity(name, dtype, mode):
    ref, fast = make_pair(MODELS[name], dtype=dtype, **_kwargs(name))
    getattr(ref, mode)()
    getattr(fast, mode)()
    x = model_input(ref.base_model.model, dtype)
    active_path_counter.clear()
    out_r, g_r = forward_backward(ref, x)
    out_f, g_f = forward_backward(fast, x)
    assert_close(out_f, out_r, dtype, f"{name} output")
    assert_same_grads(g_f, g_r, dtype, name)
    assert any(k.endswith(":eager") for k in active_path_counter), active_path_counter
    assert not any(k.endswith(":peft_style") for k in active_path_counter)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["linear_bias", "conv1d_gpt2_fan_in_fan_out", "conv2d"])
def test_dropout_same_rng(name, dtype):
    """dropout > 0 in train mode: PEFT re-runs the base branch on dropped x; same RNG draws, same result."""
    ref, fast = make_pair(MODELS[name], dtype=dtype, lora_dropout=0.3, **_kwargs(name))
    ref.train()
    fast.train()
    x = model_input(ref.base_model.model, dtype)
    out_r, g_r = forward_backward(ref, x, seed=5)
    out_f, g_f = forward_backward(fast, x, seed=5)
    assert_close(out_f, out_r, dtype, "dropout output")
    assert_same_grads(g_f, g_r, dtype, "dropout")


class _PaddedConv(torch.nn.Module):
    def __init__(self, padding_mode):
        super().__init__()
        self.conv0 = torch.nn.Conv2d(4, 6, 3, padding=1, padding_mode=padding_mode)
        self.conv1 = torch.nn.Conv2d(6, 6, 3, padding=1, padding_mode=padding_mode)

    def forward(self, x):
        return self.conv1(torch.relu(self.conv0(x)))


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
def test_dropout_conv_padding_modes(padding_mode):
    """dropout > 0 in train mode leaves no base result: the base convolution runs again on the dropped input, as the
    installed PEFT runs it (PEFT >= 0.22: the layer's own ``_conv_forward``, padding mode included; older: zero
    padding)."""
    dtype = torch.float64
    ref, fast = make_pair(functools.partial(_PaddedConv, padding_mode), dtype=dtype, lora_dropout=0.3,
                          target_modules=["conv0", "conv1"])
    ref.train()
    fast.train()
    x = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1), dtype=dtype)
    out_r, g_r = forward_backward(ref, x, seed=5)
    out_f, g_f = forward_backward(fast, x, seed=5)
    assert_close(out_f, out_r, dtype, "dropout output")
    assert_same_grads(g_f, g_r, dtype, "dropout")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_trainable_bias_gradient(dtype):
    ref, fast = make_pair(MODELS["linear_bias"], dtype=dtype, bias="all")
    x = model_input(ref.base_model.model, dtype)
    out_r, g_r = forward_backward(ref, x)
    out_f, g_f = forward_backward(fast, x)
    assert any("bias" in n for n in g_r)
    assert_close(out_f, out_r, dtype)
    assert_same_grads(g_f, g_r, dtype, "bias=all")


def _add_second_adapter(model, name="other", seed=3):
    from peft import LoraConfig

    cfg = copy.deepcopy(model.peft_config["default"])
    cfg.r = 3
    model.add_adapter(name, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if f".{name}." in n or n.endswith(f".{name}"):
                p.add_(0.05 * torch.randn_like(p))
    return LoraConfig


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["linear_bias", "embedding_scaled", "conv2d"])
def test_several_active_adapters(name, dtype):
    ref, _ = make_pair(MODELS[name], dtype=dtype, enable=False, **_kwargs(name))
    _add_second_adapter(ref)
    fast = copy.deepcopy(ref)
    fastdora.enable(fast, kernels="eager")
    for m in (ref, fast):
        m.base_model.set_adapter(["default", "other"])
        for n, p in m.named_parameters():  # set_adapter freezes inactive ones; make both trainable
            if "lora_" in n:
                p.requires_grad_(True)
    x = model_input(ref.base_model.model, dtype)
    out_r, g_r = forward_backward(ref, x)
    out_f, g_f = forward_backward(fast, x)
    assert_close(out_f, out_r, dtype, "two adapters")
    assert_same_grads(g_f, g_r, dtype, "two adapters")


@pytest.mark.parametrize("name", ["linear_bias", "conv1d_gpt2_fan_in_fan_out", "embedding", "conv2d"])
@pytest.mark.parametrize("safe", [False, True])
def test_merge_unmerge_and_unload(name, safe):
    dtype = torch.float64
    ref, fast = make_pair(MODELS[name], dtype=dtype, **_kwargs(name))
    x = model_input(ref.base_model.model, dtype)
    ref.eval(), fast.eval()
    with torch.no_grad():
        before = fast(x)
        for m in (ref, fast):
            m.merge_adapter(safe_merge=safe) if hasattr(m, "merge_adapter") else None
        merged_r, merged_f = ref(x), fast(x)
        assert_close(merged_f, merged_r, dtype, "merged")
        assert_close(merged_f, before, dtype, "merged vs unmerged")
        fast.unmerge_adapter()
        try:
            ref.unmerge_adapter()
        except RuntimeError:
            # released PEFT < 0.21 cannot unmerge fan_in_fan_out DoRA layers (shape error); fastdora can
            assert name == "conv1d_gpt2_fan_in_fan_out" and _peft_version() < (0, 21)
        else:
            assert_close(fast(x), ref(x), dtype, "unmerged")
        # after unmerge W changed storage/version: the norm must be recomputed, and equal the original
        assert_close(fast(x), before, dtype, "unmerged vs before")
        unloaded = copy.deepcopy(fast).merge_and_unload(safe_merge=safe)
        assert_close(unloaded(x), before, dtype, "merge_and_unload")


def _peft_version():
    import peft

    return tuple(int(p) for p in peft.__version__.split(".")[:2])


def test_training_steps_with_grad_accumulation():
    """Several optimizer steps with gradient accumulation: fastdora and PEFT parameters stay equal (fp64)."""
    dtype = torch.float64
    ref, fast = make_pair(MODELS["linear_bias"], dtype=dtype, lora_dropout=0.1)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ref, fast)]
    xs = [model_input(ref.base_model.model, dtype, seed=s) for s in range(12)]
    active_path_counter.clear()
    for step in range(4):
        for model, opt in zip((ref, fast), opts):
            model.train()
            for micro in range(3):
                torch.manual_seed(100 * step + micro)
                loss = model(xs[3 * step + micro]).pow(2).mean() / 3
                loss.backward()
            opt.step()
            opt.zero_grad()
    for (n, p_r), (_, p_f) in zip(ref.named_parameters(), fast.named_parameters()):
        assert_close(p_f, p_r, dtype, f"param {n} after training")
    # one norm computation per layer per step (2 layers x 4 steps), cached for the other micro-batches
    assert active_path_counter["norm:computed"] + active_path_counter["norm:computed_base_cached"] == 8
    assert active_path_counter["norm:cached"] == 2 * 4 * 2


@pytest.mark.parametrize("name", ["linear_bias", "embedding_scaled", "conv2d", "conv1d_gpt2_fan_in_fan_out"])
def test_save_load_both_ways(name, tmp_path):
    dtype = torch.float32
    ref, fast = make_pair(MODELS[name], dtype=dtype, **_kwargs(name))
    x = model_input(ref.base_model.model, dtype)
    ref.eval(), fast.eval()
    with torch.no_grad():
        expected = ref(x)
    fast.save_pretrained(tmp_path / "fast")
    ref.save_pretrained(tmp_path / "ref")
    sd_f = torch.load if False else None  # noqa: F841 (kept simple: compare the safetensors files below)
    from safetensors.torch import load_file

    a = load_file(tmp_path / "fast" / "adapter_model.safetensors")
    b = load_file(tmp_path / "ref" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    torch.manual_seed(0)
    base = MODELS[name]().to(dtype)
    base.load_state_dict(ref.base_model.model.state_dict(), strict=False)
    # saved by fastdora, loaded by stock PEFT
    stock = PeftModel.from_pretrained(copy.deepcopy(_strip(ref)), tmp_path / "fast").eval()
    # saved by stock PEFT, loaded then converted by fastdora
    conv = PeftModel.from_pretrained(copy.deepcopy(_strip(ref)), tmp_path / "ref").eval()
    fastdora.enable(conv, kernels="eager")
    with torch.no_grad():
        assert_close(stock(x), expected, dtype, "fastdora checkpoint in stock PEFT")
        assert_close(conv(x), expected, dtype, "stock checkpoint in fastdora")


def _strip(peft_model):
    """The base model without adapters (a fresh copy)."""
    m = copy.deepcopy(peft_model)
    return m.unload() if hasattr(m, "unload") else m.base_model.model


def test_state_dict_keys_params_and_dtypes_unchanged():
    ref, fast = make_pair(MODELS["linear_bias"], dtype=torch.float32, enable=False)
    params_before = {n: p for n, p in fast.named_parameters()}
    sd_before = {k: (v.dtype, v.shape) for k, v in fast.state_dict().items()}
    fastdora.enable(fast)
    assert {n: p for n, p in fast.named_parameters()} == params_before  # same Parameter objects
    assert {k: (v.dtype, v.shape) for k, v in fast.state_dict().items()} == sd_before
    from peft.tuners.lora.dora import DoraLinearLayer
    from peft.tuners.lora.variants import DoraLinearVariant

    layer = fast.base_model.model.lin0
    assert isinstance(layer.lora_magnitude_vector["default"], DoraLinearLayer)
    assert isinstance(layer.lora_variant["default"], DoraLinearVariant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autocast_amp_parity(dtype):
    """AMP: fp32 adapters, base in `dtype`, under bf16 autocast (what HF Trainer does with bf16=True)."""
    ref, fast = make_pair(MODELS["linear_bias"], dtype=dtype)
    x = model_input(ref.base_model.model, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_r, g_r = forward_backward(ref, x)
        out_f, g_f = forward_backward(fast, x)
    assert_close(out_f, out_r, torch.bfloat16, "amp output")
    assert_same_grads(g_f, g_r, torch.bfloat16, "amp")


def test_bf16_base_fp32_adapters_no_autocast():
    ref, fast = make_pair(MODELS["linear_bias"], dtype=torch.bfloat16)
    assert fast.base_model.model.lin0.lora_A["default"].weight.dtype == torch.float32
    x = model_input(ref.base_model.model, torch.bfloat16)
    out_r, g_r = forward_backward(ref, x)
    out_f, g_f = forward_backward(fast, x)
    assert out_f.dtype == out_r.dtype == torch.bfloat16
    assert_close(out_f, out_r, torch.bfloat16)
    assert_same_grads(g_f, g_r, torch.bfloat16, "bf16 base")


def test_pure_bf16_adapters():
    ref, fast = make_pair(MODELS["linear_bias"], dtype=torch.bfloat16, adapter_dtype=torch.bfloat16)
    assert fast.base_model.model.lin0.lora_A["default"].weight.dtype == torch.bfloat16
    x = model_input(ref.base_model.model, torch.bfloat16)
    out_r, g_r = forward_backward(ref, x)
    out_f, g_f = forward_backward(fast, x)
    assert_close(out_f, out_r, torch.bfloat16)
    assert_same_grads(g_f, g_r, torch.bfloat16, "pure bf16")


def test_bf16_closer_to_fp64_truth_than_peft():
    """In bf16 fastdora rounds once from fp32; its error vs the fp64 truth is no worse than PEFT's (+ slack)."""
    ref64, _ = make_pair(MODELS["linear_bias"], dtype=torch.float64, enable=False)
    ref, fast = make_pair(MODELS["linear_bias"], dtype=torch.bfloat16, adapter_dtype=torch.bfloat16)
    x = model_input(ref.base_model.model, torch.bfloat16)
    with torch.no_grad():
        truth = ref64(x.to(torch.float64))
        err_peft = (ref(x).double() - truth).abs().max()
        err_fast = (fast(x).double() - truth).abs().max()
    assert err_fast <= 1.5 * err_peft + 1e-3, (err_fast, err_peft)


def test_mixed_batch_refusal_message_unchanged():
    ref, fast = make_pair(MODELS["linear_bias"], dtype=torch.float32)
    x = model_input(ref.base_model.model, torch.float32)
    msgs = []
    for m in (ref, fast):
        with pytest.raises(ValueError) as e:
            m(x, adapter_names=["default"] * x.shape[0])
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


def test_zero_norm_rows_use_eps():
    """A row with W = 0 and B = 0 has norm 0: PEFT divides by zero; fastdora uses eps and stays finite, and the
    other rows are unchanged."""
    ref, fast = make_pair(MODELS["linear_nobias"], dtype=torch.float32)
    for m in (ref, fast):
        lin = m.base_model.model.lin1
        with torch.no_grad():
            lin.base_layer.weight[0].zero_()
            lin.lora_B["default"].weight[0].zero_()
    x = model_input(ref.base_model.model, torch.float32)
    with torch.no_grad():
        out_r, out_f = ref(x), fast(x)
    assert torch.isfinite(out_f).all()
    assert not torch.isfinite(out_r[..., 0]).all() or torch.isnan(out_r[..., 0]).any()
    torch.testing.assert_close(out_f[..., 1:], out_r[..., 1:], rtol=2e-5, atol=2e-5)
    assert torch.equal(out_f[..., 0], torch.zeros_like(out_f[..., 0]))


def test_gradient_checkpointing_recompute_uses_cached_norm():
    from torch.utils.checkpoint import checkpoint

    ref, fast = make_pair(MODELS["linear_bias"], dtype=torch.float64)
    x = model_input(ref.base_model.model, torch.float64)
    grads = []
    active_path_counter.clear()
    for m in (ref, fast):
        m.zero_grad()
        out = checkpoint(m, x, use_reentrant=False)
        out.pow(2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert_same_grads(grads[1], grads[0], torch.float64, "checkpointing")
    assert active_path_counter["norm:cached"] == 2  # the recomputation reused the norm of both layers


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hooked", [False, True], ids=["plain_lora_B", "hooked_lora_B"])
def test_lora_b_called_outside_the_composition_node(dtype, hooked):
    """``lora_B``'s product is computed outside the composition's autograd node: a hooked ``lora_B`` (ZeRO-3 style
    gathering, a profiler) is called as a module, its hooks firing, and the composition node takes its output.
    Outputs and every gradient match stock PEFT either way."""
    ref, fast = make_pair(MODELS["linear_nobias"], dtype=dtype)
    calls = []
    if hooked:
        for mod in fast.modules():
            if hasattr(mod, "lora_B"):
                mod.lora_B["default"].register_forward_pre_hook(lambda m, args: calls.append(m))
    x = model_input(ref.base_model.model, dtype)
    nodes = set()
    out_f = fast(x)
    stack = [out_f.grad_fn]
    while stack:  # every autograd node class reachable from the output
        fn = stack.pop()
        if fn is None or type(fn).__name__ in nodes:
            continue
        nodes.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    assert any("DoraCompose" in n for n in nodes), nodes
    assert (len(calls) > 0) == hooked
    out_r, g_r = forward_backward(ref, x)
    out_f, g_f = forward_backward(fast, x)
    assert_close(out_f, out_r, dtype, "output")
    assert_same_grads(g_f, g_r, dtype, "hooked lora_B" if hooked else "plain lora_B")
