"""Where a training step's time goes at model level: host time against GPU kernel time, and the kernels by GPU time.

A Llama-8B-shaped model (``poetx_model_bench.build_model``, random weights) with a few decoder layers, batch 1,
sequence 1024, bf16 weights under bf16 autocast, fused AdamW, each config set up as ``poetx_model_bench.py`` sets it up
(``setup_method``). Per config: 3 warm-up steps, then the median over 6 steps of the wall time (synchronised) and of the
host time (the step's Python returns before the GPU is done: the time to issue the step), then one step under
``torch.profiler``: the sum of the GPU kernels' time and the largest kernels. Host time close to the wall time with GPU
kernel time below it: the step is bound by the host.

Usage:
  python benchmarks/poetx_step_profile.py --out poetx_step_profile.json  # AdamW, POET-X fast (batched and per-layer
                                                                         # series) / mem, 8 layers
  python benchmarks/poetx_step_profile.py --configs poetx-fast --host-top 40  # and where the host time goes
  python benchmarks/poetx_step_profile.py --tiny --device cpu            # checks the script (CPU op times)
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
           "poetx-fast-batched": dict(method="poetx", mode="fast", series="batched"),
           "poetx-fast-launchers": dict(method="poetx", mode="fast", launch="launchers"),
           "poetx-fast-py-replay": dict(method="poetx", mode="fast", launch="py-replay"),
           "poetx-fast-tf32x3": dict(method="poetx", mode="fast", series_precision="tf32x3"),
           "poetx-fast-load-split": dict(method="poetx", mode="fast", split_operands=False),
           "poetx-fast-no-pdl": dict(method="poetx", mode="fast", pdl=False),
           "poetx-mem": dict(method="poetx", mode="mem")}


def _host_functions(step, steps: int, top: int) -> list:
    """``[name, own ms, cumulative ms, calls]`` per step of the Python functions with the largest own time over
    ``steps`` steps under ``cProfile`` (which slows every Python call: the shares, not the totals, are the result)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(([f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}({fn[2]})", st[2] / steps * 1e3, st[3] / steps * 1e3,
                    st[1] / steps] for fn, st in stats.items()), key=lambda r: -r[1])
    return rows[:top]


def profile(name: str, shape: str, layers: int, block: int, seq: int, top: int, device: str,
            host_top: int = 0) -> dict:
    import torch

    import poetx_model_bench as pmb

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = pmb.build_model(shape, layers, torch.bfloat16, dev)
    c = dict(CONFIGS[name], block=block, weight_format="dense", layers=layers)
    model, groups, _ = pmb.setup_method(model, c, types.SimpleNamespace(lr=1e-5, shape=shape), dev)
    model.train()
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, **(dict(fused=True) if cuda else {}))
    ids = torch.randint(0, pmb.SHAPES[shape]["vocab_size"], (1, seq), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    walls, hosts = [], []
    for _ in range(6):
        sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    # on the CPU (a check of the script) the "kernels" are the operators' own CPU times
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        step()
        sync()
    kernels = {}
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total) or 0
        if us and e.device_type == (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU):
            kernels[e.key] = (us / 1e3, e.count)
    rec = dict(config=name, shape=shape, layers=layers, block=block, seq=seq, wall_ms=statistics.median(walls) * 1e3,
               host_ms=statistics.median(hosts) * 1e3, gpu_kernel_ms=sum(v[0] for v in kernels.values()),
               kernels=[[k[:100], ms, n] for k, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]])
    print(f"{name} L={layers}: wall {rec['wall_ms']:.1f} ms, host (no sync) {rec['host_ms']:.1f} ms, "
          f"{'GPU kernels' if cuda else 'CPU operators'} {rec['gpu_kernel_ms']:.1f} ms", flush=True)
    for k, ms, n in rec["kernels"]:
        print(f"    {ms:8.2f} ms x{n:<5} {k}", flush=True)
    if host_top:
        rec["host_functions"] = _host_functions(step, 3, host_top)
        sync()
        print(f"  {name}: Python functions by own time per step under cProfile (ms own, ms cumulative, calls):")
        for fn, own, cum, calls in rec["host_functions"]:
            print(f"    {own:8.3f} {cum:8.3f} {calls:7.1f}  {fn}", flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma separated subset of {list(CONFIGS)}")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--host-top", type=int, default=0, help="also list this many Python functions by own host "
                    "time per step (cProfile)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (checks the script, measures nothing useful)")
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device (use --tiny --device cpu to check the script)")
    shape = "tiny" if a.tiny else "llama3-8b"
    if a.tiny:
        a.layers, a.block, a.seq = 1, 16, 32
    names = [n for n in a.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configs {unknown}")
    rows = []
    for n in names:
        rows.append(profile(n, shape, a.layers, a.block, a.seq, a.top, a.device, a.host_top))
        if a.device == "cuda":
            torch.cuda.empty_cache()  # the config's model and optimizer went with its frame
    if a.out:
        device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        with open(a.out, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, tiny=a.tiny, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
