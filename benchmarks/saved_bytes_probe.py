#!/usr/bin/env python3
"""Bytes saved for backward by one decoder layer's forward (no checkpointing: what a checkpointed layer holds
while its backward runs), stock PEFT LoRA vs fastdora DoRA, counted over unique storages with
``torch.autograd.graph.saved_tensors_hooks``; and which projection outputs their consumers save anyway.

Explains the model bench's pure-bf16 Mistral-Small-24B peak (fastdora 9.63 GB vs LoRA 8.99 GB, session 22): the
composition saves ``inner`` (tokens x d_out, the magnitude gradient's operand) per projection, which LoRA has no
use for. CPU, any machine; shapes are Mistral-Small-24B's / Qwen3-8B's divided by ``--div``.

  python benchmarks/saved_bytes_probe.py --out benchmarks/results/cpu_host/saved_bytes_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from model_bench import SHAPES, TARGETS  # noqa: E402


def layer_saves(shape: str, div: int, variant: str, setup: str, seq: int, rank: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    sh = dict(SHAPES[shape])
    arch = sh.pop("arch")
    sh.pop("full_layers")
    for k in ("hidden_size", "intermediate_size", "head_dim"):
        sh[k] //= div
    sh["vocab_size"] = 512
    cls = Qwen3Config if arch == "qwen3" else MistralConfig
    cfg = cls(**sh, num_hidden_layers=1, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, use_dora=variant != "lora",
                                             target_modules=TARGETS), autocast_adapter_dtype=(setup == "amp"))
    if setup == "bf16":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    if variant == "fastdora":
        import fastdora
        fastdora.enable(model)
    inner = model.base_model.model.model
    layer = inner.layers[0]
    outs, store = {}, {}
    for name, mod in layer.named_modules():
        short = name.split(".")[-1]
        if short in TARGETS:
            mod.register_forward_hook(lambda m, i, o, s=short: outs.__setitem__(s, o.untyped_storage().data_ptr()))

    def pack(t):
        s = t.untyped_storage()
        store[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, 512, (1, seq))
    h = inner.embed_tokens(ids).detach().requires_grad_(True)
    pe = inner.rotary_emb(h, torch.arange(seq)[None])
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if setup == "amp" else contextlib.nullcontext()
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(h, position_embeddings=pe, attention_mask=None)
    d_out = {"q_proj": cfg.num_attention_heads * cfg.head_dim, "k_proj": cfg.num_key_value_heads * cfg.head_dim,
             "v_proj": cfg.num_key_value_heads * cfg.head_dim, "o_proj": cfg.hidden_size,
             "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size}
    return dict(saved_bytes=sum(store.values()), outputs_saved_by_consumers=sorted(k for k, p in outs.items()
                                                                                   if p in store),
                d_out=d_out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="mistral-small-24b,qwen3-8b")
    p.add_argument("--div", type=int, default=16, help="hidden / intermediate / head_dim divided by this")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out")
    a = p.parse_args()
    rows = []
    for shape in a.shapes.split(","):
        for setup in ("bf16", "amp"):
            lo = layer_saves(shape, a.div, "lora", setup, a.seq, a.rank)
            fd = layer_saves(shape, a.div, "fastdora", setup, a.seq, a.rank)
            inner_bytes = a.seq * sum(lo["d_out"].values()) * 2  # bf16 inner, every projection
            shared = a.seq * sum(lo["d_out"][k] for k in lo["outputs_saved_by_consumers"]) * 2
            row = dict(shape=shape, div=a.div, setup=setup, seq=a.seq, rank=a.rank,
                       lora_saved_bytes=lo["saved_bytes"], fastdora_saved_bytes=fd["saved_bytes"],
                       extra_bytes=fd["saved_bytes"] - lo["saved_bytes"], inner_bytes=inner_bytes,
                       outputs_saved_by_consumers=lo["outputs_saved_by_consumers"],
                       inner_bytes_of_those=shared)
            rows.append(row)
            print(f"{shape}/{a.div} {setup}: LoRA {lo['saved_bytes'] / 1e6:.2f} MB, fastdora "
                  f"{fd['saved_bytes'] / 1e6:.2f} MB, extra {row['extra_bytes'] / 1e6:.2f} MB (inner of every "
                  f"projection: {inner_bytes / 1e6:.2f} MB); outputs their consumers save: "
                  f"{', '.join(row['outputs_saved_by_consumers'])} ({100 * shared / inner_bytes:.0f}% of inner)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(argv=sys.argv, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
