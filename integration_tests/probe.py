"""Test instrumentation (not part of fastdora): a TrainerCallback that, at the end of training, in the training
process, saves the trained model's logits on the probe text and what fastdora did in that process.

Files written into ``args.output_dir`` (main process only):
- ``probe_logits.pt``: logits of the trained model (eval mode, no grad) on ``_tiny.PROBE_TEXT``;
- ``probe_meta.json``: {"fastdora_imported", "path_counter_total", "converted_layers", "poetx_layers",
  "poetx_merge_counts", "pid", "world_size", "init_adapter_sha256", "init_adapter_tensors"} (``poetx_layers``: the
  trained model's POET-X layers, ``poetx_merge_counts``: their distinct merge counts, found by class name so that
  fastdora is not imported here; the last two: a checksum of the adapter's parameters at train begin, so that two runs
  can be shown to start from the same adapter; None where the parameters are sharded).

The tokenizer is loaded from the directory in the environment variable ``FASTDORA_PROBE_TOKENIZER``.
"""

from __future__ import annotations

import json
import os
import sys

from transformers import TrainerCallback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from _tiny import PROBE_TEXT  # noqa: E402


def _unwrap(model):
    while type(model).__name__ in ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine"):
        model = model.module
    return model


def fastdora_state(model=None) -> dict:
    imported = "fastdora" in sys.modules
    total = 0
    if imported:
        stats = sys.modules.get("fastdora.stats")
        counter = getattr(stats, "active_path_counter", None) or getattr(sys.modules["fastdora"], "active_path_counter",
                                                                        {})
        total = int(sum(counter.values()))
    converted, poetx, merges = 0, 0, set()
    if model is not None:
        for m in model.modules():
            for v in (getattr(m, "lora_variant", None) or {}).values():
                if type(v).__name__.startswith("FastDora"):
                    converted += 1
            if type(m).__name__ == "PoetXLinear":
                poetx += 1
                merges.add(int(m.merge_count))
    return {"fastdora_imported": imported, "path_counter_total": total, "converted_layers": converted,
            "poetx_layers": poetx, "poetx_merge_counts": sorted(merges)}


def adapter_checksum(model) -> tuple:
    """(sha256 of every ``lora_*`` parameter's bytes, in name order; their number), or (None, 0) when a parameter is
    not a plain local tensor (sharded engines)."""
    import hashlib

    import torch

    h, n = hashlib.sha256(), 0
    for name, p in sorted(model.named_parameters()):
        if "lora_" not in name:
            continue
        try:
            t = p.detach().to("cpu", copy=True)
        except Exception:  # a parameter on the meta device, or a wrapper that cannot be copied
            return None, 0
        if type(t) is not torch.Tensor:  # a DTensor (FSDP2): only a shard is local
            return None, 0
        h.update(name.encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        n += 1
    return h.hexdigest(), n


class ProbeCallback(TrainerCallback):
    def __init__(self, tokenizer_dir: str | None = None):
        self.tokenizer_dir = tokenizer_dir or os.environ["FASTDORA_PROBE_TOKENIZER"]
        self.init_checksum = (None, 0)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and getattr(args, "process_index", 0) == 0:
            self.init_checksum = adapter_checksum(_unwrap(model))
        return control

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # diagnostics: per-parameter gradient norms of the first step
        if state.global_step == 0 and model is not None and getattr(args, "process_index", 0) == 0:
            norms = {n: float(p.grad.norm()) for n, p in _unwrap(model).named_parameters() if p.grad is not None}
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "probe_grads_step1.json"), "w", encoding="utf-8") as f:
                json.dump(norms, f, indent=0, sort_keys=True)
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        import torch
        from transformers import AutoTokenizer

        if getattr(args, "process_index", 0) != 0 or model is None:
            return control
        model = _unwrap(model)
        meta = fastdora_state(model)  # before the probe forward
        tok = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        ids = tok(PROBE_TEXT, return_tensors="pt").input_ids.to(next(model.parameters()).device)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float().cpu()
        model.train(was_training)
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(logits, os.path.join(args.output_dir, "probe_logits.pt"))
        meta.update(pid=os.getpid(), world_size=int(getattr(args, "world_size", 1)),
                    init_adapter_sha256=self.init_checksum[0], init_adapter_tensors=self.init_checksum[1])
        with open(os.path.join(args.output_dir, "probe_meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f)
        return control
