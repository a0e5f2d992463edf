"""Where a training step's time goes at model level: host time against GPU kernel time, and the kernels by GPU time.

A Llama-8B-shaped model (``poetx_model_bench.build_model``, random weights) with a few decoder layers, batch 1,
sequence 1024, bf16 weights under bf16 autocast, fused AdamW, each config set up as ``poetx_model_bench.py`` sets it up
(``setup_method``). Per config: 3 warm-up steps, then the median over 6 steps of the wall time (synchronised) and of the
host time (the step's Python returns before the GPU is done: the time to issue the step), then one step under
``torch.profiler``: the sum of the GPU kernels' time and the largest kernels. Host time close to the wall time with GPU
kernel time below it: the step is bound by the host.

Usage (CUDA):
  python benchmarks/poetx_step_profile.py --out poetx_step_profile.json            # AdamW, POET-X fast / mem, 8 layers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CONFIGS = {"adamw": dict(method="adamw"), "poetx-fast": dict(method="poetx", mode="fast"),
           "poetx-mem": dict(method="poetx", mode="mem")}


def profile(name: str, layers: int, block: int, seq: int, top: int) -> dict:
    import torch

    import poetx_model_bench as pmb

    dev = torch.device("cuda")
    model = pmb.build_model("llama3-8b", layers, torch.bfloat16, dev)
    c = dict(CONFIGS[name], block=block, weight_format="dense", layers=layers)
    model, groups, _ = pmb.setup_method(model, c, types.SimpleNamespace(lr=1e-5, shape="llama3-8b"), dev)
    model.train()
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ids = torch.randint(0, pmb.SHAPES["llama3-8b"]["vocab_size"], (1, seq), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    walls, hosts = [], []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or 0
        if us and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] = (us / 1e3, e.count)
    rec = dict(config=name, layers=layers, block=block, seq=seq, wall_ms=statistics.median(walls) * 1e3,
               host_ms=statistics.median(hosts) * 1e3, gpu_kernel_ms=sum(v[0] for v in kernels.values()),
               kernels=[[k[:100], ms, n] for k, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]])
    print(f"{name} L={layers}: wall {rec['wall_ms']:.1f} ms, host (no sync) {rec['host_ms']:.1f} ms, GPU kernels "
          f"{rec['gpu_kernel_ms']:.1f} ms", flush=True)
    for k, ms, n in rec["kernels"]:
        print(f"    {ms:8.2f} ms x{n:<5} {k}", flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma separated subset of {list(CONFIGS)}")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    names = [n for n in a.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configs {unknown}")
    rows = []
    for n in names:
        rows.append(profile(n, a.layers, a.block, a.seq, a.top))
        torch.cuda.empty_cache()  # the config's model and optimizer went with its frame
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
