"""GPU: a whole PEFT DoRA model with fastdora's Triton path vs stock PEFT (AMP and pure bf16), several training
steps with gradient accumulation + checkpointing, and the norm cache. Run on a CUDA machine: pytest -m gpu."""

from __future__ import annotations

import copy

import pytest
import torch

import fastdora
from fastdora.stats import active_path_counter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=1000, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg).to("cuda", dtype)


def _pair(adapter_dtype, r=64):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=2 * r, use_dora=True, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    ref = get_peft_model(_llama(torch.bfloat16), cfg, autocast_adapter_dtype=adapter_dtype == torch.float32)
    for n, p in ref.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(adapter_dtype)
            if "magnitude" in n:
                p.data.mul_(1 + 0.05 * torch.randn_like(p))
    fast = copy.deepcopy(ref)
    report = fastdora.enable(fast, kernels="triton")
    assert report.converted.get("linear") == 14, str(report)
    return ref, fast


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("setup", ["amp", "pure_bf16"])
def test_model_parity_triton_path(setup):
    adapter_dtype = torch.float32 if setup == "amp" else torch.bfloat16
    ref, fast = _pair(adapter_dtype)
    ids = torch.randint(0, 1000, (2, 256), device="cuda")
    active_path_counter.clear()
    outs, grads = [], []
    for m in (ref, fast):
        m.train()
        m.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp"):
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append(out.logits.detach())
        grads.append({n: p.grad.detach() for n, p in m.named_parameters() if p.grad is not None})
    assert active_path_counter["linear:triton"] == 14, active_path_counter
    assert _rel(outs[1], outs[0]) < 2e-2
    for n in grads[0]:
        assert _rel(grads[1][n], grads[0][n]) < 5e-2, n


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
