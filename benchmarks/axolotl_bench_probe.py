"""Benchmark instrumentation for ``benchmarks/axolotl_h200.sh`` (not part of fastdora): an Axolotl plugin whose
callback records, in the training process, every optimizer step's wall time (CUDA-synchronised at both ends), the
loss curve, the peak allocated memory and, for two early steps, which DoRA layers ran their forward and how many of
those forwards went through fastdora's Triton path.

YAML: ``plugins: [axolotl_bench_probe.BenchProbePlugin]`` with ``benchmarks/`` on ``PYTHONPATH``. Writes
``bench_probe.json`` into ``output_dir`` at the end of training. It never imports fastdora: it reads fastdora's path
counter only when the training process has imported fastdora (the run with the fastdora plugin).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

#: optimizer steps (1-based) whose forwards are attributed per DoRA layer (hooks on the LoRA modules, removed after)
HOOK_STEPS = (2, 3)
#: the first steps left out of the median step time (Triton compilation, allocator warm-up, the hooked steps)
WARMUP_STEPS = 5
TRITON_KEY = "linear:triton"


def _triton_count():
    stats = sys.modules.get("fastdora.stats")
    return None if stats is None else int(stats.active_path_counter.get(TRITON_KEY, 0))


def _dora_modules(model) -> dict:
    return {name: m for name, m in model.named_modules() if len(getattr(m, "lora_magnitude_vector", None) or {}) > 0}


def _instance_methods(model) -> dict:
    """{"Class.attr=function": count} of instance-level forwards and Axolotl's LoRA-kernel hooks (``apply_qkv``,
    ``apply_o``): which modules run something other than their class's code."""
    found: dict = {}
    for m in (model.modules() if model is not None else []):
        for attr in ("forward", "apply_qkv", "apply_o"):
            fn = m.__dict__.get(attr)
            if fn is not None:
                key = f"{type(m).__name__}.{attr}={getattr(getattr(fn, '__func__', fn), '__name__', '?')}"
                found[key] = found.get(key, 0) + 1
    return found


class BenchCallback(TrainerCallback):
    def __init__(self):
        self.step_times = []
        self.losses = []
        self.layers = {}
        self.handles = []
        self.t0 = None
        self.dora = {}
        self.attn = None

    @staticmethod
    def _sync():
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _hook(self):
        for name, mod in self.dora.items():
            rec = self.layers.setdefault(name, {"forwards": 0, "triton_forwards": 0})
            snap = {}

            def pre(m, args, rec=rec, snap=snap):
                snap["n"] = _triton_count()

            def post(m, args, out, rec=rec, snap=snap):
                rec["forwards"] += 1
                now = _triton_count()
                if now is not None and snap.get("n") is not None and now > snap["n"]:
                    rec["triton_forwards"] += 1

            self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def _unhook(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.dora = _dora_modules(model) if model is not None else {}
        cfg = getattr(model, "config", None)
        self.attn = getattr(cfg, "_attn_implementation", None)
        self.t_train = time.perf_counter()
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == HOOK_STEPS[0]:
            self._hook()
        self._sync()
        self.t0 = time.perf_counter()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.step_times.append(time.perf_counter() - self.t0)
        if state.global_step == HOOK_STEPS[-1]:
            self._unhook()
        if state.global_step == WARMUP_STEPS:
            import torch

            if torch.cuda.is_available():
                self.peak_warmup = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append([state.global_step, float(logs["loss"])])
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        import torch

        self._unhook()
        if getattr(args, "process_index", 0) != 0:
            return control
        timed = self.step_times[WARMUP_STEPS:] or self.step_times
        cuda = torch.cuda.is_available()
        peak_steady = torch.cuda.max_memory_allocated() if cuda else None
        peak_warmup = getattr(self, "peak_warmup", None)
        counter = None
        if "fastdora.stats" in sys.modules:
            counter = dict(sys.modules["fastdora.stats"].active_path_counter)
        patched = _instance_methods(model)
        payload = {
            "steps": len(self.step_times),
            "step_times_s": [round(t, 6) for t in self.step_times],
            "median_step_s": statistics.median(timed) if timed else None,
            "timed_steps": len(timed),
            "train_wall_s": time.perf_counter() - self.t_train,
            "peak_alloc_bytes": max(x for x in (peak_warmup, peak_steady) if x is not None) if cuda else None,
            "peak_alloc_steady_bytes": peak_steady,
            "losses": self.losses,
            "dora_layers": len(self.dora),
            "layer_forwards": self.layers,
            "hook_steps": list(HOOK_STEPS),
            "fastdora_imported": "fastdora" in sys.modules,
            "fastdora_counter": counter,
            "attn_implementation": self.attn,
            "instance_methods": patched,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "pid": os.getpid(),
        }
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "bench_probe.json"), "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
        return control


class BenchProbePlugin(BasePlugin):
    def add_callbacks_post_trainer(self, cfg, trainer):
        return [BenchCallback()]
