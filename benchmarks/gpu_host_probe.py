#!/usr/bin/env python3
"""Host cost of one DoRA layer call on a GPU, at shapes where the GPU never waits for anything but the host.

The model bench's pure-bf16 tax is GPU idle behind the host (benchmarks/README.md, session 25): per DoRA module
fastdora's host work (forward, checkpoint recomputation, node backward) was ~100 us above LoRA's on the H200, while
the CPU probe (``layer_host_probe.py``, kernels stubbed) measures parity. This probe measures the host path with
the real GPU-side calls: a stack of ``L`` PEFT ``Linear`` layers at a tiny size (d=256, 16 tokens: every kernel
takes a few microseconds, so an iteration's wall time is the host's) on CUDA, all variants in ONE process,
interleaved round by round (median and minimum of per-round means):

- ``lora``:               stock PEFT LoRA (same rank)
- ``fastdora``:           fastdora DoRA (``kernels="triton"``: the kernels also at this size), the C++ node
                          launching its templates directly (cuLaunchKernel)
- ``fastdora_sep``:       fastdora with ``layer_node=False``: each Linear layer as separate autograd nodes (three
                          linears and the C++ composition node) instead of the C++ node's whole-layer node
- ``fastdora_pylaunch``:  the same node launching through Triton's Python launcher (``set_native_launch(False)``)
- ``fastdora_pynode``:    the Python autograd node (``fastdora.kernels.native.NODE = None``)
- ``fastdora_keep``:      the C++ node computing and saving ``inner`` also where checkpointing discards saved tensors
                          (``fastdora.ops.compose.saves_discarded`` patched to False: no placeholder)
- ``fastdora_old``:       with ``--old-pkg DIR``, the fastdora package in ``DIR/fastdora`` (another commit's core/)

Modes: ``train`` (forward + backward), ``ckpt`` (the whole stack under one non-reentrant
``torch.utils.checkpoint``, as a decoder layer in the model bench: the backward recomputes it), ``fwd`` (the forward
with autograd recording, no backward: the main thread's part). Setups: ``bf16`` (pure bf16 model and adapters),
``amp`` (fp32 model under bf16 autocast). Numbers: microseconds of wall time per layer per call. ``--cprofile N``:
also the top Python functions by own time over N calls per variant and mode (``--cprofile-modes``); from Python
3.12 cProfile sees every thread (sys.monitoring), so the backward's recomputation on the autograd thread counts.

  python benchmarks/gpu_host_probe.py --out DIR/gpu_host.json [--old-pkg OLD] [--setups bf16,amp]
  python benchmarks/gpu_host_probe.py --device cpu --rounds 2 --iters 5 --out /tmp/ghp.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_io import load_package_as  # noqa: E402

MODES = ("train", "ckpt", "fwd")


def build(a, pkgs, setup, device):
    """{variant: (model, before-call switch, after-call switch)} for one setup."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    dtype = torch.bfloat16 if setup == "bf16" else torch.float32
    native = sys.modules.get("fastdora.kernels.native")
    node = native.node() if device == "cuda" else None
    variants = {"lora": (None, None), "fastdora": ("fastdora", None)}
    if node is not None:
        variants["fastdora_sep"] = ("fastdora", "sep")
        variants["fastdora_pylaunch"] = ("fastdora", "pylaunch")
        variants["fastdora_pynode"] = ("fastdora", "pynode")
        variants["fastdora_keep"] = ("fastdora", "keep")
    if "old" in pkgs:
        variants["fastdora_old"] = ("old", None)
    models = {}
    for v, (label, switch) in variants.items():
        torch.manual_seed(0)
        base = nn.Sequential(*[nn.Linear(a.d, a.d, bias=False) for _ in range(a.layers)]).to(device, dtype)
        cfg = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=[str(i) for i in range(a.layers)],
                         use_dora=label is not None)
        pm = get_peft_model(base, cfg)
        if setup == "bf16":
            for prm in pm.parameters():
                prm.data = prm.data.to(torch.bfloat16)
        if label is not None:
            opts = {"layer_node": False} if switch == "sep" else {}
            pkgs[label].enable(pm, kernels="triton" if device == "cuda" else "eager", **opts)
        on = off = None
        if switch == "pylaunch":
            on, off = (lambda: node.set_native_launch(False)), (lambda: node.set_native_launch(True))
        elif switch == "keep":
            oc = sys.modules["fastdora.ops.compose"]

            def on(_oc=oc):
                _oc.saves_discarded = _never

            def off(_oc=oc, _real=oc.saves_discarded):
                _oc.saves_discarded = _real
        elif switch == "pynode":
            def on():
                native.NODE = None

            def off(_n=node):
                native.NODE = _n
        models[v] = (pm, on, off)
    return models


def _never() -> bool:
    return False


def make_call(a, setup, device, mode, pm, on, off):
    import torch
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(1, a.tokens, a.d, device=device, dtype=torch.bfloat16 if setup == "bf16" else torch.float32,
                    requires_grad=True)
    layers = list(pm.base_model.model)
    amp = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if setup == "amp" else contextlib.nullcontext

    def stack(h):
        for layer in layers:
            h = layer(h)
        return h

    def forward():
        return checkpoint(stack, x, use_reentrant=False) if mode == "ckpt" else stack(x)

    def call():
        if on is not None:
            on()
        try:
            with amp():
                y = forward()
            if mode != "fwd":
                y.float().sum().backward()
        finally:
            if off is not None:
                off()

    return call


def sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def measure(a, setup, device, mode, models):
    calls = {v: make_call(a, setup, device, mode, *m) for v, m in models.items()}
    for v, c in calls.items():  # warm-up: kernels compiled, templates registered, norms cached
        for _ in range(a.warmup):
            c()
    sync(device)
    names = list(calls)
    per = {v: [] for v in names}
    for rnd in range(a.rounds):  # interleaved, alternating order
        for v in (names if rnd % 2 == 0 else names[::-1]):
            c = calls[v]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(a.iters):
                c()
            sync(device)
            per[v].append((time.perf_counter() - t0) / a.iters / a.layers * 1e6)
    res = {"us_per_layer": {v: statistics.median(ts) for v, ts in per.items()},
           "us_per_layer_min": {v: min(ts) for v, ts in per.items()}, "rounds": per}
    if a.cprofile and mode in a.cprofile_modes.split(","):
        res["cprofile"] = {}
        for v, c in calls.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.cprofile):
                c()
            prof.disable()
            sync(device)
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            rows = []
            for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
                rows.append((tt, ct, nc, f"{os.path.basename(file)}:{line}({fn})"))
            rows.sort(reverse=True)
            n_calls = a.cprofile * a.layers
            res["cprofile"][v] = [{"fn": r[3], "tottime_us_per_layer": r[0] / n_calls * 1e6,
                                   "cumtime_us_per_layer": r[1] / n_calls * 1e6, "calls_per_layer": r[2] / n_calls}
                                  for r in rows[:a.top]]
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/gpu_host_probe.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--setups", default="bf16,amp")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--old-pkg", default=None, help="variant fastdora_old: the fastdora package in DIR/fastdora")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="cProfile N forward calls per variant")
    p.add_argument("--cprofile-modes", default="fwd,ckpt")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    import torch

    import fastdora
    import fastdora.kernels.native  # noqa: F401  (build() switches its node per variant)

    pkgs = {"fastdora": fastdora}
    if a.old_pkg:
        pkgs["old"] = load_package_as(os.path.abspath(a.old_pkg), "fastdora_old")
    out = {"meta": {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                    "torch": torch.__version__, "args": vars(a)}, "results": {}}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def save():  # after every setup / mode: a run cut off by its time limit keeps what it measured
        native = sys.modules.get("fastdora.kernels.native")
        if native is not None and native.NODE is not None:
            out["meta"]["native"] = {"status": native.status(), "launch": native.launch_status(),
                                     **native.NODE.stats()}
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)

    for setup in a.setups.split(","):
        models = build(a, pkgs, setup, a.device)
        for mode in a.modes.split(","):
            res = measure(a, setup, a.device, mode, models)
            out["results"][f"{setup}/{mode}"] = res
            lora = res["us_per_layer"]["lora"]
            line = "  ".join(f"{v} {u:7.1f} ({u / lora:4.2f}x)" for v, u in res["us_per_layer"].items())
            print(f"{setup:4s} {mode:5s} median us/layer: {line}", flush=True)
            for v, rows in res.get("cprofile", {}).items():
                print(f"   cProfile {v}: " + "; ".join(f"{r['fn']} {r['tottime_us_per_layer']:.1f}" for r in rows[:12]))
            save()
    if "native" in out["meta"]:
        print("C++ node:", out["meta"]["native"])


if __name__ == "__main__":
    main()
