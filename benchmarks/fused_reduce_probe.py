#!/usr/bin/env python3
"""The composition backward's second stage fused into its kernel (``kernels.compose._FUSE_REDUCE``, session 18) vs
the two-kernel version: GPU time per call, host time per call, registers and spills of the backward kernel.
Variants: ``fused`` (the shipped register cap ``_BWD_MAXNREG``), ``fused_nocap`` (the compiler's register choice),
``two_kernels``.

- GPU time: ``--calls`` back-to-back ``compose_bwd`` calls between two CUDA events (each kernel takes longer than
  its launch, so the GPU never waits), medians over ``--rounds`` rounds, fused and two-kernel alternating.
- Host time: the same at a tiny shape (64 tokens), where the GPU finishes each call before the next is launched.
- Shapes: the Qwen3-8B projections at seq 4096 (M=4096 tokens x N = 4096 / 1024 / 12288), AMP dtypes (bf16
  activations, fp32 magnitude), magnitude gradient only (no bias), as in a training step.

  python benchmarks/fused_reduce_probe.py --out DIR/fused_reduce.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/fused_reduce.json")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    import torch

    from fastdora.kernels import compose as kc

    dev, bf = torch.device("cuda"), torch.bfloat16

    def args_for(M, N):
        g = torch.Generator(device=dev).manual_seed(0)
        dy = torch.randn(M, N, device=dev, generator=g).to(bf)
        inner = torch.randn(M, N, device=dev, generator=g).to(bf)
        mag, nrm = torch.rand(N, device=dev) + 0.5, torch.rand(N, device=dev) + 0.5
        return (dy, mag, nrm, 0.5, 1e-6, inner, False, bf, bf, None, True, False)

    variants = {"fused": (True, kc._BWD_MAXNREG), "fused_nocap": (True, None), "two_kernels": (False, None)}

    def use(v):
        kc._FUSE_REDUCE, kc._BWD_MAXNREG = variants[v]

    def gpu_ms(args, v):
        use(v)
        kc.compose_bwd(*args)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.calls):
            kc.compose_bwd(*args)
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / a.calls

    def host_us(args, v):
        use(v)
        kc.compose_bwd(*args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            kc.compose_bwd(*args)
        t = (time.perf_counter() - t0) / a.calls * 1e6
        torch.cuda.synchronize()
        return t

    res = {"gpu_ms": {}, "host_us": {}, "kernels": []}
    for M, N in ((4096, 4096), (4096, 1024), (4096, 12288), (8192, 4096)):
        args = args_for(M, N)
        per = {v: [] for v in variants}
        for r in range(a.rounds):
            for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                per[v].append(gpu_ms(args, v))
        med = {v: statistics.median(ts) for v, ts in per.items()}
        res["gpu_ms"][f"{M}x{N}"] = {"median": med, "rounds": per}
        print(f"GPU  {M}x{N}: " + "  ".join(f"{v} {t * 1e3:7.1f} us ({t / med['two_kernels']:.3f})"
                                         for v, t in med.items()), flush=True)
    args = args_for(64, 4096)
    per = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            per[v].append(host_us(args, v))
    med = {v: statistics.median(ts) for v, ts in per.items()}
    res["host_us"] = {"median": med, "rounds": per}
    print("host 64x4096 us per call: " + "  ".join(f"{v} {t:6.1f}" for v, t in med.items()), flush=True)
    for key, entry in kc._BWD.cache.items():
        ck = entry[0]
        row = {"consts": [str(c) for c in key[3]], "num_warps": key[4], "maxnreg": key[6],
               "n_regs": getattr(ck, "n_regs", None),
               "n_spills": getattr(ck, "n_spills", None), "shared": ck.metadata.shared}
        res["kernels"].append(row)
        print("bwd kernel", row, flush=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
