"""Shared builders for the parity tests: tiny models, PEFT DoRA pairs (stock reference vs fastdora), comparisons."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import fastdora

BF16_REL = 2e-2
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    # PEFT composes bf16 in several rounded steps; fastdora rounds once: compare with a bf16-sized tolerance
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


class ScaledEmbedding(nn.Embedding):
    """An embedding that multiplies by ``embed_scale`` in forward (like Gemma's scaled word embedding)."""

    def __init__(self, num, dim, scale=3.0):
        super().__init__(num, dim)
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.embed_scale.to(self.weight.dtype)


class MLP(nn.Module):
    def __init__(self, bias=True, d_in=24, d_hidden=40, d_out=12):
        super().__init__()
        self.lin0 = nn.Linear(d_in, d_hidden, bias=bias)
        self.lin1 = nn.Linear(d_hidden, d_out, bias=bias)

    def forward(self, x):
        return self.lin1(torch.tanh(self.lin0(x)))


class GPT2Style(nn.Module):
    """transformers' Conv1D (fan_in_fan_out=True)."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_attn = Conv1D(36, 20)  # nf=36 out, nx=20 in
        self.c_proj = Conv1D(20, 36)

    def forward(self, x):
        return self.c_proj(torch.relu(self.c_attn(x)))


class EmbModel(nn.Module):
    def __init__(self, scaled=False):
        super().__init__()
        self.emb = ScaledEmbedding(50, 16) if scaled else nn.Embedding(50, 16)
        self.head = nn.Linear(16, 7)

    def forward(self, x):
        return self.head(self.emb(x))


class ConvModel(nn.Module):
    def __init__(self, dim=2, groups=1):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        self.conv0 = conv(4, 6, 3, padding=1, groups=groups)
        self.conv1 = conv(6, 6, 3, padding=1, groups=groups)
        self.dim = dim

    def forward(self, x):
        return self.conv1(torch.relu(self.conv0(x)))


def model_input(model: nn.Module, dtype: torch.dtype, batch: int = 3, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, EmbModel):
        return torch.randint(0, 50, (batch, 5), generator=g)
    if isinstance(model, GPT2Style):
        return torch.randn(batch, 5, 20, generator=g).to(dtype)
    if isinstance(model, ConvModel):
        spatial = (7,) * model.dim
        return torch.randn(batch, 4, *spatial, generator=g).to(dtype)
    return torch.randn(batch, 5, 24, generator=g).to(dtype)


def default_targets(model: nn.Module) -> list[str]:
    if isinstance(model, EmbModel):
        return ["emb", "head"]
    if isinstance(model, GPT2Style):
        return ["c_attn", "c_proj"]
    if isinstance(model, ConvModel):
        return ["conv0", "conv1"]
    return ["lin0", "lin1"]


def perturb_(peft_model: nn.Module, seed: int = 0, scale: float = 0.1) -> None:
    """Move magnitude away from its init (so g != 1) and give B non-trivial values, deterministically."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + scale * torch.randn(p.shape, generator=g).to(p.dtype))
            elif "lora_B" in name or "lora_embedding_B" in name:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


def make_pair(model_fn, dtype=torch.float32, seed=0, enable=True, adapter_dtype=None, **lora_kwargs):
    """(stock PEFT model, fastdora model) with identical parameters."""
    torch.manual_seed(seed)
    base = model_fn()
    targets = lora_kwargs.pop("target_modules", None) or default_targets(base)
    cfg = LoraConfig(
        r=lora_kwargs.pop("r", 4),
        lora_alpha=lora_kwargs.pop("lora_alpha", 8),
        target_modules=targets,
        use_dora=True,
        init_lora_weights=False,
        **lora_kwargs,
    )
    base = base.to(dtype)
    ref = get_peft_model(base, cfg, autocast_adapter_dtype=adapter_dtype is None)
    if adapter_dtype is not None:
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(adapter_dtype)
    perturb_(ref, seed)
    fast = copy.deepcopy(ref)
    if enable:
        report = fastdora.enable(fast, kernels="eager")
        assert report.total_converted > 0, str(report)
    return ref, fast


def out_tensor(out):
    return out.logits if hasattr(out, "logits") else out


def forward_backward(model, x, seed=123, loss_weights=None):
    """Output and gradients (params + input when floating) of a scalar loss."""
    model.zero_grad(set_to_none=True)
    if x.is_floating_point():
        x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = out_tensor(model(x))
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=g).to(out.dtype) if loss_weights is None else loss_weights
    (out * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if x.is_floating_point():
        grads["<input>"] = x.grad.detach().clone()
    return out.detach(), grads


def assert_close(a, b, dtype, what=""):
    a, b = a.to(torch.float64), b.to(torch.float64)
    if dtype == torch.bfloat16:
        # bf16: both sides round differently (PEFT several times, fastdora once); compare ||a-b|| / ||b||
        assert torch.isfinite(a).all() == torch.isfinite(b).all(), what
        rel = (a - b).norm() / b.norm().clamp_min(1e-12)
        assert rel <= BF16_REL, f"{what}: relative error {rel:.3e} > {BF16_REL}"
        return
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **TOL[dtype])


def assert_same_grads(ga: dict, gb: dict, dtype, what=""):
    assert ga.keys() == gb.keys(), f"{what}: different parameters got gradients: {ga.keys() ^ gb.keys()}"
    for n in ga:
        assert_close(ga[n], gb[n], dtype, f"{what} grad {n}")


def save_inner_flags(monkeypatch, impl) -> list:
    """The ``save_inner`` argument of every ``impl.compose_fwd`` call (``fastdora.ops.compose.EAGER`` or
    ``fastdora.ops.compose.triton_impl()``), in call order, while ``monkeypatch`` is active."""
    flags = []
    real = impl.compose_fwd

    def spy(*args):
        flags.append(args[9])
        return real(*args)

    monkeypatch.setattr(impl, "compose_fwd", spy)
    return flags
