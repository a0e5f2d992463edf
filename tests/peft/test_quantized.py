"""Quantized bases (bitsandbytes 4-bit / 8-bit, HQQ): fastdora goes through PEFT's dequantize path and matches stock
PEFT. (bitsandbytes >= 0.45 and hqq run these layers on CPU; each test is skipped where its package is missing.)"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import fastdora
from fastdora.stats import active_path_counter

from ..helpers import MLP, assert_close, assert_same_grads, forward_backward, model_input, perturb_

def _quantized_mlp(kind: str) -> nn.Module:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = MLP()
    for name in ("lin0", "lin1"):
        lin = getattr(model, name)
        if kind == "hqq":
            from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

            setattr(model, name, HQQLinear(lin, BaseQuantizeConfig(nbits=4, group_size=8), compute_dtype=torch.float32,
                                           device="cpu"))
            continue
        if kind == "4bit":
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=True, compute_dtype=torch.float32,
                                  quant_type="nf4")
        else:
            q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=True, has_fp16_weights=False)
        q.load_state_dict(lin.state_dict())
        setattr(model, name, q.to("cpu"))
    return model


@pytest.mark.parametrize("kind", ["4bit", "8bit", "hqq"])
def test_quantized_dora_parity(kind):
    pytest.importorskip("hqq" if kind == "hqq" else "bitsandbytes")
    try:
        base = _quantized_mlp(kind)
        base(torch.randn(2, 24))
    except Exception as e:  # pragma: no cover - depends on the bitsandbytes build
        pytest.skip(f"bitsandbytes {kind} does not run on this machine: {e}")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["lin0", "lin1"], use_dora=True, init_lora_weights=False)

    def build():  # built twice from the same seeds: bnb's Int8Params do not survive deepcopy
        torch.manual_seed(1)
        m = get_peft_model(_quantized_mlp(kind), copy.deepcopy(cfg))
        perturb_(m)
        return m

    ref, fast = build(), build()
    # (PEFT picks its bnb LoRA class only where bnb reports a GPU backend; either way the base is quantized and
    # both PEFT and fastdora read it through PEFT's dequantize_module_weight)
    assert type(ref.base_model.model.lin0.get_base_layer()).__module__.startswith(("bitsandbytes", "hqq"))
    report = fastdora.enable(fast, kernels="eager")
    assert report.converted == {"linear": 2}, str(report)
    x = model_input(ref.base_model.model, torch.float32)
    active_path_counter.clear()
    out_r, g_r = forward_backward(ref, x)
    out_f, g_f = forward_backward(fast, x)
    assert active_path_counter["linear:eager"] == 2
    assert_close(out_f, out_r, torch.float32, f"{kind} output")
    assert_same_grads(g_f, g_r, torch.float32, kind)
