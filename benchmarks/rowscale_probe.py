#!/usr/bin/env python3
"""The eager fallback's per-row (feature-dim) passes in plain PyTorch, op by op (issue 5: the eager fallback's
pure-bf16 tax). Session 29's profile put ~7% of its step in ``addcmul`` with a broadcast ``[d_out]`` vector, which
PyTorch runs in its non-vectorized elementwise kernel (~1.45 TB/s), and its magnitude gradient in two passes (product,
then column sum). This probe times, on activation-shaped bf16 tensors ``[T, d]``, each PyTorch formulation of

- ``scale``:  ``y = x * g`` (``g``: fp32 ``[d]``, the DoRA row scale; ``y`` in the activation dtype)
- ``rowsum``: ``s = sum_t dy * x`` (fp32 ``[d]``; the magnitude gradient's reduction)

with CUDA events (median of ``--reps`` after warm-up, all candidates interleaved), its effective bandwidth (bytes
read + written / time) and its error against an fp64 reference (max |err| / max |ref|). Prints and writes JSON.

  python benchmarks/rowscale_probe.py --out rowscale.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def scale_candidates(x, g):
    gm1_h = (g - 1.0).to(x.dtype)
    g_h = g.to(x.dtype)
    d = x.shape[-1]
    zeros = torch.zeros(d, device=x.device, dtype=torch.float32)
    ones = torch.ones(d, device=x.device, dtype=torch.float32)
    x2 = x.reshape(-1, d)
    c = {
        "addcmul_gm1": lambda: torch.addcmul(x, x, gm1_h),          # what the eager path runs today
        "mul_half": lambda: torch.mul(x, g_h),
        "mul_fp32_vec": lambda: torch.mul(x, g).to(x.dtype),
        "batch_norm_eval": lambda: F.batch_norm(x2, zeros, ones, g, None, False, 0.0, 0.0),
    }
    if hasattr(torch, "batch_norm_elemt"):
        c["batch_norm_elemt"] = lambda: torch.batch_norm_elemt(x2, g, zeros, zeros, ones, 0.0)
    return c


def rowsum_candidates(dy, x):
    d = x.shape[-1]
    zeros = torch.zeros(d, device=x.device, dtype=torch.float32)
    ones = torch.ones(d, device=x.device, dtype=torch.float32)
    dy2, x2 = dy.reshape(-1, d), x.reshape(-1, d)
    c = {
        "mul_sum": lambda: (dy2 * x2).sum(0, dtype=torch.float32),  # what the eager path runs today
        "einsum": lambda: torch.einsum("td,td->d", dy2, x2).float(),
        "vecdot": lambda: torch.linalg.vecdot(dy2, x2, dim=0).float(),
    }
    if hasattr(torch, "batch_norm_backward_reduce"):
        c["bn_backward_reduce"] = lambda: torch.batch_norm_backward_reduce(
            dy2, x2, zeros, ones, None, True, False, False)[1]
    return c


def time_all(cands, reps, warmup):
    evs = {k: [] for k in cands}
    for _ in range(warmup):
        for fn in cands.values():
            fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        for k, fn in cands.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            evs[k].append((a, b))
    torch.cuda.synchronize()
    return {k: statistics.median(a.elapsed_time(b) for a, b in v) * 1e3 for k, v in evs.items()}  # us


def rel_err(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dims", default="1024,4096,12288")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="rowscale.json")
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for d in [int(v) for v in a.dims.split(",")]:
        x = torch.randn(a.tokens, d, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(a.tokens, d, device=dev, dtype=torch.bfloat16)
        g = 1.0 + 0.01 * torch.randn(d, device=dev, dtype=torch.float32)
        n = x.numel() * x.element_size()
        for kind, cands, ref, nbytes in (
            ("scale", scale_candidates(x, g), x.double() * g.double(), 2 * n),
            ("rowsum", rowsum_candidates(dy, x), (dy.double() * x.double()).sum(0), 2 * n),
        ):
            errs = {}
            for k, fn in list(cands.items()):
                try:
                    errs[k] = rel_err(fn(), ref)
                except Exception as e:  # noqa: BLE001 - an op this torch lacks for these dtypes: reported, dropped
                    print(f"{kind} d={d} {k}: {type(e).__name__}: {str(e)[:160]}")
                    cands.pop(k)
            us = time_all(cands, a.reps, a.warmup)
            base = us[next(iter(cands))]
            for k in cands:
                row = dict(kind=kind, tokens=a.tokens, d=d, candidate=k, us=us[k], vs_current=us[k] / base,
                           gbps=nbytes / (us[k] * 1e-6) / 1e9, rel_err=errs[k])
                rows.append(row)
                print(f"{kind:6s} T={a.tokens} d={d:5d} {k:20s} {us[k]:8.1f} us  {row['vs_current']:.3f}x  "
                      f"{row['gbps']:7.0f} GB/s  err {errs[k]:.2e}", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
