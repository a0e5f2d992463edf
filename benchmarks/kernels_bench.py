"""Microbenchmarks of the fastdora Triton kernels (H200). Prints a table and writes JSON (``--out``).

Sections (``--sections``, comma separated; default all):
  copy       device copy bandwidth (clone of a 4 GiB tensor: bytes read + written / median time)
  compose    forward / backward kernels: achieved bandwidth (bytes that must move / median time) as % of copy
             bandwidth, against the eager PyTorch path, at tokens 8192..16384, d 4096..12288, bf16 / AMP / mixed
  sweep      block-size alternatives of the forward and backward kernels at one large shape
  evict      (not in the default list) backward kernel, default L2 policy vs evict_first on its dy / inner loads
  bwd_sweep  (not in the default list) backward kernel configurations incl. an exact grid and pipelining stages
  mb_shapes  (not in the default list) forward / backward configurations at the model bench's activation shapes
             (4096 tokens x 1024 / 4096 / 12288, pure bf16) next to LoRA's own mul + add and backward mul there
  norm_variants  (not in the default list) G split over K vs not, U row vs transposed tiles over configurations,
             per Qwen3-8B shape at r=384 (AMP and bf16), with errors vs fp64
  norm_modes  (not in the default list) the whole norm per product mode (AMP: 3 vs 2 split products; bf16: tf32x3
             vs one bf16 product), accumulation (chained / restarted every 1-4 K blocks) and U split over K, with
             errors vs fp64; --old-pkg DIR times an earlier package's norm in the same run
  norm       factored-norm kernel: time and working set (max_memory_allocated delta) vs the eager factored norm
             and PEFT's dense formula; relative error vs a dense fp64 reference
  crossover  eager vs fused composition (autograd fwd+bwd and no-grad fwd) from 1K to 64M elements
  layer      single layer d=4096, 8192 tokens, r=384: PEFT LoRA vs PEFT DoRA vs DoRA composed with the kernels
             (norm cached), AMP and pure bf16, forward (no grad) and forward+backward medians

Usage: python benchmarks/kernels_bench.py --out benchmarks/results/kernels_h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
import traceback

import torch

from fastdora.kernels import compose as kc
from fastdora.kernels import norm as kn
from fastdora.ops import compose as oc
from fastdora.ops import norm as on

DEV = "cuda"
RESULTS: dict = {}


def bench(fn, warmup=25, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms


def _free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _save(path):
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


# ------------------------------------------------------------------------------------------------------------ copy


def sec_copy():
    x = torch.randn(1 << 31, device=DEV, dtype=torch.bfloat16)  # 4 GiB
    ms = bench(lambda: x.clone(), warmup=10, rep=50)
    bw = 2 * x.numel() * x.element_size() / (ms * 1e-3)
    del x
    _free()
    RESULTS["copy"] = {"bytes": 2 * (1 << 32), "ms": ms, "GBps": bw / 1e9}
    return bw


# --------------------------------------------------------------------------------------------------------- compose

MODES = {
    # result, lora, magnitude, out
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "amp": (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16),
    "mixed": (torch.bfloat16, torch.float32, torch.float32, torch.float32),
}


def _make(M, N, mode, seed=0):
    rdt, ldt, mdt, odt = MODES[mode]
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = dict(
        result=torch.randn(M, N, device=DEV, generator=g).to(rdt),
        lora=torch.randn(M, N, device=DEV, generator=g).to(ldt),
        magnitude=(torch.rand(N, device=DEV, generator=g) + 0.5).to(mdt),
        norm=torch.rand(N, device=DEV, generator=g) + 0.5,
        dy=torch.randn(M, N, device=DEV, generator=g).to(odt),
    )
    return t, odt


def _compose_case(M, N, mode, bw_copy, with_eager=True, only=None):
    t, odt = _make(M, N, mode)
    rdt, ldt, mdt, _ = MODES[mode]
    idt = torch.promote_types(rdt, ldt)
    es = lambda d: torch.empty((), dtype=d).element_size()  # noqa: E731
    nel = M * N
    eps = 1e-6
    out = {"tokens": M, "d": N, "mode": mode}
    fwd_train_bytes = nel * (es(rdt) + es(ldt) + es(odt) + es(idt))
    fwd_inf_bytes = nel * (es(rdt) + es(ldt) + es(odt))
    bwd_bytes = nel * (es(odt) + es(idt) + es(rdt) + es(ldt))
    args = (t["result"], t["lora"], t["magnitude"], t["norm"], 0.5, eps, None, None, odt)
    _, inner = kc.TRITON.compose_fwd(*args, True)
    bargs = (t["dy"], t["magnitude"], t["norm"], 0.5, eps, inner, False, rdt, ldt, None, True, False)
    for name, fn, nbytes in (
        ("fwd_train", lambda: kc.TRITON.compose_fwd(*args, True), fwd_train_bytes),
        ("fwd_infer", lambda: kc.TRITON.compose_fwd(*args, False), fwd_inf_bytes),
        ("bwd", lambda: kc.TRITON.compose_bwd(*bargs), bwd_bytes),
    ):
        if only is not None and name != only:
            continue
        ms = bench(fn, warmup=50, rep=COMPOSE_REP)
        bw = nbytes / (ms * 1e-3)
        out[name] = {"ms": ms, "bytes": nbytes, "GBps": bw / 1e9, "pct_copy": 100 * bw / bw_copy}
    if with_eager:
        out["eager_fwd_train_ms"] = bench(lambda: oc.compose_fwd_eager(*args, True), warmup=5, rep=20)
        out["eager_bwd_ms"] = bench(lambda: oc.compose_bwd_eager(*bargs), warmup=5, rep=20)
    del t, inner
    _free()
    return out


COMPOSE_REP = 100  # ms of do_bench repetitions per measurement
SWEEP_WHICH = "all"  # "all" | "bwd"
COMPOSE_TOKENS = (8192, 16384)
COMPOSE_DIMS = (4096, 12288)
SWEEP_SHAPE = (16384, 4096)
CROSSOVER_LOG2 = range(10, 27, 2)  # 1K .. 64M elements
LAYER_SHAPE = (4096, 8192, 384)  # d, tokens, r


def sec_compose(bw_copy):
    rows = []
    _compose_case(COMPOSE_TOKENS[0], COMPOSE_DIMS[0], "amp", bw_copy, with_eager=False)  # warm-up: clocks, JIT
    for M in COMPOSE_TOKENS:
        for N in COMPOSE_DIMS:
            for mode in ("bf16", "amp", "mixed"):
                rows.append(_compose_case(M, N, mode, bw_copy))
    RESULTS["compose"] = rows
    return rows


def sec_sweep(bw_copy):
    (M, N), mode = SWEEP_SHAPE, "amp"
    res = {"shape": [M, N], "mode": mode, "fwd": [], "bwd": []}
    fwd_cfgs = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (8, 1024, 8), (16, 1024, 8), (8, 512, 4), (16, 512, 8),
                (32, 256, 8), (4, 2048, 8), (2, 4096, 8)]
    # (BLOCK_M, BLOCK_N, warps, programs per SM, prefetch)
    bwd_cfgs = [(64, 128, 8, 8, False), (64, 128, 8, 8, True), (32, 128, 8, 8, False), (32, 128, 8, 8, True),
                (32, 256, 8, 8, True), (64, 128, 8, 4, True), (64, 128, 8, 16, True), (32, 128, 4, 8, True),
                (64, 64, 4, 8, True), (128, 64, 8, 8, True), (16, 256, 4, 8, True), (64, 128, 8, 4, False)]
    if SWEEP_WHICH == "bwd":
        fwd_cfgs = []
    try:
        for cfg in fwd_cfgs:
            kc._CONFIG_OVERRIDE.clear()
            kc._CONFIG_OVERRIDE["fwd"] = cfg
            r = _compose_case(M, N, mode, bw_copy, with_eager=False)
            res["fwd"].append({"cfg": cfg, "fwd_train_pct": r["fwd_train"]["pct_copy"],
                               "fwd_infer_pct": r["fwd_infer"]["pct_copy"]})
        for cfg in bwd_cfgs:
            kc._CONFIG_OVERRIDE.clear()
            kc._CONFIG_OVERRIDE["bwd"] = cfg
            r = _compose_case(M, N, mode, bw_copy, with_eager=False)
            res["bwd"].append({"cfg": cfg, "bwd_pct": r["bwd"]["pct_copy"]})
    finally:
        kc._CONFIG_OVERRIDE.clear()
    res["default_fwd"] = kc._fwd_config(M, N, torch.device(DEV))
    res["default_bwd"] = kc._bwd_config(M, N, torch.device(DEV))
    RESULTS["sweep"] = res
    return res


def sec_evict(bw_copy):
    """Backward kernel with the default L2 policy vs ``evict_first`` on its loads of dy and inner (their last use),
    interleaved, three rounds, at the compose section's large shapes (AMP and bf16)."""
    rows = []
    try:
        for rnd in range(3):
            for M, N in ((16384, 4096), (16384, 12288), (8192, 4096)):
                for mode in ("amp", "bf16"):
                    for policy in (("", "evict_first") if rnd % 2 == 0 else ("evict_first", "")):
                        kc._BWD_EVICT = policy
                        r = _compose_case(M, N, mode, bw_copy, with_eager=False)
                        rows.append({"round": rnd, "tokens": M, "d": N, "mode": mode, "policy": policy or "default",
                                     "bwd_pct": r["bwd"]["pct_copy"], "bwd_ms": r["bwd"]["ms"]})
                        print(rows[-1], flush=True)
    finally:
        kc._BWD_EVICT = ""
    RESULTS["evict"] = rows
    return rows


# (BLOCK_M, BLOCK_N, warps, programs per SM, prefetch, exact rows per program, pipelining stages or None)
BWD_SWEEP = [(64, 128, 8, 8, False, False, None), (64, 128, 8, 8, False, True, None), (64, 128, 8, 8, False, False, 1),
             (64, 128, 8, 8, False, False, 2), (32, 128, 4, 16, False, False, None), (32, 128, 4, 16, False, True, None),
             (32, 256, 8, 8, False, False, None), (32, 256, 8, 8, False, True, None), (128, 64, 8, 8, False, True, None),
             (64, 128, 8, 4, False, True, None), (16, 256, 4, 16, False, True, None), (64, 256, 16, 4, False, True, None)]


BWD_ROUNDS = 1


def sec_bwd_sweep(bw_copy):
    """Backward kernel configurations (BWD_SWEEP: tiles, warps, programs per SM, rows per program rounded to whole
    tiles or exact so the grid is exactly programs-per-SM x SMs, loop pipelining stages), interleaved over 3 rounds
    (round-robin order rotated each round) at 16384x4096 AMP and bf16; then every configuration once at 16384x12288
    and 8192x4096 AMP. % of copy bandwidth, ms."""
    rows = []
    shapes = [((16384, 4096), "amp", 3), ((16384, 4096), "bf16", 3), ((16384, 12288), "amp", BWD_ROUNDS),
              ((8192, 4096), "amp", BWD_ROUNDS), ((16384, 12288), "bf16", BWD_ROUNDS - 1), ((8192, 12288), "amp", BWD_ROUNDS - 1)]
    try:
        for (M, N), mode, rounds in shapes:
            for rnd in range(rounds):
                order = BWD_SWEEP[rnd % len(BWD_SWEEP):] + BWD_SWEEP[:rnd % len(BWD_SWEEP)]
                for cfg in order:
                    kc._CONFIG_OVERRIDE["bwd"] = cfg[:6]
                    kc._BWD_STAGES = cfg[6]
                    try:
                        r = _compose_case(M, N, mode, bw_copy, with_eager=False, only="bwd")
                        row = {"tokens": M, "d": N, "mode": mode, "round": rnd, "cfg": list(cfg),
                               "bwd_pct": r["bwd"]["pct_copy"], "bwd_ms": r["bwd"]["ms"]}
                    except Exception as e:  # out of resources
                        row = {"tokens": M, "d": N, "mode": mode, "round": rnd, "cfg": list(cfg),
                               "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    rows.append(row)
                    print(row, flush=True)
    finally:
        kc._CONFIG_OVERRIDE.clear()
        kc._BWD_STAGES = None
    RESULTS["bwd_sweep"] = rows
    return rows


# the model bench's activation shapes (4096 tokens per micro-batch; Qwen3-8B's k/v, q/o/down and gate/up widths)
MB_SHAPES = ((4096, 1024), (4096, 4096), (4096, 12288))
# forward (BLOCK_M, BLOCK_N, warps); None: the shipped heuristic
MB_FWD = [None, (1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (4, 1024, 8), (16, 1024, 8), (8, 512, 4), (16, 512, 8),
          (16, 256, 4), (32, 256, 8), (4, 2048, 8), (2, 2048, 4)]
# backward (BLOCK_M, BLOCK_N, warps, programs per SM, prefetch, exact rows per program); None: the shipped heuristic
MB_BWD = [None, (32, 128, 4, 8, False, True), (32, 128, 4, 4, False, True), (32, 128, 4, 16, False, True),
          (64, 128, 8, 2, False, True), (64, 128, 8, 8, False, True), (64, 128, 8, 4, True, True),
          (32, 256, 8, 4, False, True), (16, 256, 4, 8, False, True), (64, 64, 4, 8, False, True),
          (128, 64, 8, 4, False, True), (16, 128, 4, 8, False, True), (16, 128, 2, 16, False, True)]


def sec_mb_shapes(bw_copy, rounds=2, mode="bf16"):
    """Forward (with / without the saved inner) and backward kernel configurations at the model bench's activation
    shapes (MB_SHAPES, pure bf16), interleaved over ``rounds`` rounds, next to what LoRA's composition costs there
    (PEFT's ``result + lora * s``: a mul and an add; its backward: ``dy * s``). Medians in microseconds."""
    rows = []
    try:
        for rnd in range(rounds):
            for M, N in MB_SHAPES:
                t, odt = _make(M, N, mode)
                lora_fwd = bench(lambda: torch.add(t["result"], t["lora"] * 0.5), warmup=25, rep=COMPOSE_REP)
                lora_bwd = bench(lambda: t["dy"] * 0.5, warmup=25, rep=COMPOSE_REP)
                rows.append({"round": rnd, "tokens": M, "d": N, "kind": "lora", "cfg": None,
                             "fwd_us": lora_fwd * 1e3, "bwd_us": lora_bwd * 1e3})
                del t
                _free()
                for kind, cfgs in (("fwd", MB_FWD), ("bwd", MB_BWD)):
                    order = cfgs[rnd % len(cfgs):] + cfgs[:rnd % len(cfgs)]
                    for cfg in order:
                        if kind == "fwd" and cfg is not None and cfg[1] > 2 * N:
                            continue
                        kc._CONFIG_OVERRIDE.clear()
                        if cfg is not None:
                            kc._CONFIG_OVERRIDE[kind] = cfg
                        row = {"round": rnd, "tokens": M, "d": N, "kind": kind, "cfg": cfg}
                        try:
                            if kind == "fwd":
                                r1 = _compose_case(M, N, mode, bw_copy, with_eager=False, only="fwd_train")
                                r2 = _compose_case(M, N, mode, bw_copy, with_eager=False, only="fwd_infer")
                                row.update(train_us=r1["fwd_train"]["ms"] * 1e3, train_pct=r1["fwd_train"]["pct_copy"],
                                           noinner_us=r2["fwd_infer"]["ms"] * 1e3,
                                           noinner_pct=r2["fwd_infer"]["pct_copy"])
                            else:
                                r = _compose_case(M, N, mode, bw_copy, with_eager=False, only="bwd")
                                row.update(bwd_us=r["bwd"]["ms"] * 1e3, bwd_pct=r["bwd"]["pct_copy"])
                        except Exception as e:  # noqa: BLE001 - out of resources
                            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        rows.append(row)
                        print(row, flush=True)
    finally:
        kc._CONFIG_OVERRIDE.clear()
    dev = torch.device(DEV)
    RESULTS["mb_shapes"] = {"rows": rows, "default": {f"{M}x{N}": {"fwd": kc._fwd_config(M, N, dev),
                                                                   "bwd": kc._bwd_config(M, N, dev)}
                                                      for M, N in MB_SHAPES}}
    return rows


# ------------------------------------------------------------------------------------------------------------ norm

NORM_CASES = [
    (8192, 8192, 512, "fp32", "fp32"),
    (4096, 4096, 384, "fp32", "fp32"),
    (8192, 28672, 384, "fp32", "fp32"),
    (8192, 8192, 384, "bf16", "bf16"),
    (8192, 8192, 384, "bf16", "fp32"),  # bf16 base, fp32 adapters (AMP)
    (12288, 4096, 384, "bf16", "fp32"),
    (4096, 4096, 16, "bf16", "fp32"),
]
_DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _peak_delta(fn):
    _free()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return out, peak


def _peft_dense_norm(W, A, B, s):
    # PEFT's DoraLinearLayer.get_weight_norm after lora_B(lora_A(eye)): eye, dense BA, W + s*BA, norm
    eye = torch.eye(A.shape[1], device=W.device, dtype=A.dtype)
    lora_weight = (eye @ A.t() @ B.t()).t()
    w = W + s * lora_weight
    return torch.linalg.norm(w, dim=1).to(w.dtype)


def _rel_to_dense(W, A, B, s):
    """``rel(norm)``: relative error of a row norm against the dense fp64 ``||W + s·B·A||`` (1024-row chunks)."""
    d_out = W.shape[0]
    ref = torch.empty(d_out, device=W.device, dtype=torch.float64)
    for o in range(0, d_out, 1024):
        ref[o:o + 1024] = torch.linalg.norm(W[o:o + 1024].double() + s * B[o:o + 1024].double() @ A.double(), dim=1)
    return lambda x: ((x.double() - ref).norm() / ref.norm()).item()


def sec_norm():
    rows = []
    for d_out, d_in, r, wd, ad in NORM_CASES:
        wdt, adt = _DT[wd], _DT[ad]
        g = torch.Generator(device=DEV).manual_seed(r)
        W = (torch.randn(d_out, d_in, device=DEV, generator=g) / d_in ** 0.5).to(wdt)
        A = (torch.randn(r, d_in, device=DEV, generator=g) / d_in ** 0.5).to(adt)
        B = (torch.randn(d_out, r, device=DEV, generator=g) * 0.05).to(adt)
        s = 2.0 / math.sqrt(r) * 8
        row = {"shape": [d_out, d_in], "r": r, "W": wd, "AB": ad, "UG_bytes": 4 * (d_out * r + r * r)}
        (nt, bt), row["triton_mem"] = _peak_delta(lambda: kn.factored_norm_triton(W, A, B, s))
        (ne, be), row["eager_mem"] = _peak_delta(lambda: on.factored_norm_eager(W, A, B, s))
        row["triton_ms"] = bench(lambda: kn.factored_norm_triton(W, A, B, s), warmup=5, rep=30)
        row["triton_cached_base_ms"] = bench(lambda: kn.factored_norm_triton(W, A, B, s, base_sq=bt), warmup=5,
                                             rep=30)
        row["eager_ms"] = bench(lambda: on.factored_norm_eager(W, A, B, s), warmup=3, rep=15)
        # breakdown: the G = A A^T launch and the U (+ base) launch alone
        G = torch.empty(r, r, device=DEV)
        U = torch.empty(d_out, r, device=DEV)
        base = torch.empty(d_out, device=DEV)
        row["triton_G_ms"] = bench(lambda: kn._gram(A, A, G, None, False, gram_of_a=True), warmup=5, rep=30)
        row["triton_U_ms"] = bench(lambda: kn._gram(W, A, U, base, False), warmup=5, rep=30)
        del G, U, base
        try:
            with torch.no_grad():
                _, row["peft_mem"] = _peak_delta(lambda: _peft_dense_norm(W, A, B, s))
                row["peft_ms"] = bench(lambda: _peft_dense_norm(W, A, B, s), warmup=3, rep=10)
        except torch.OutOfMemoryError:
            row["peft_mem"] = "OOM"
        # accuracy vs a dense fp64 reference (row chunks)
        rel = _rel_to_dense(W, A, B, s)
        row["triton_relerr"], row["eager_relerr"] = rel(nt), rel(ne)
        rows.append(row)
        del W, A, B, nt, bt, ne, be, rel
        _free()
    RESULTS["norm"] = rows
    return rows


def sec_norm_sweep():
    res = []
    cases = [(8192, 8192, 512, "fp32", "fp32", kn._MODE_FP32), (8192, 8192, 384, "bf16", "fp32", kn._MODE_SPLIT)]
    cfgs = {
        kn._MODE_FP32: [(128, 128, 32, 8, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (128, 128, 32, 8, 4),
                        (128, 256, 32, 8, 2), (256, 128, 32, 8, 2), (64, 64, 32, 4, 4), (128, 128, 16, 8, 4)],
        kn._MODE_SPLIT: [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 3),
                         (128, 64, 64, 4, 3), (128, 128, 32, 8, 4), (256, 128, 32, 8, 3), (256, 64, 64, 8, 3)],
    }
    try:
        for d_out, d_in, r, wd, ad, mode in cases:
            g = torch.Generator(device=DEV).manual_seed(r)
            W = (torch.randn(d_out, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[wd])
            A = (torch.randn(r, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[ad])
            U = torch.empty(d_out, r, device=DEV)
            base = torch.empty(d_out, device=DEV)
            for cfg in cfgs[mode]:
                kn._CONFIG_OVERRIDE.clear()
                kn._CONFIG_OVERRIDE[mode] = cfg
                try:
                    ms = bench(lambda: kn._gram(W, A, U, base, False), warmup=5, rep=30)
                except Exception as e:  # out of resources etc.
                    ms = f"{type(e).__name__}"
                res.append({"shape": [d_out, d_in], "r": r, "W": wd, "AB": ad, "mode": mode, "cfg": cfg,
                            "gram_ms": ms,
                            "tflops": (2 * d_out * d_in * r / (ms * 1e-3) / 1e12) if isinstance(ms, float) else None})
            kn._CONFIG_OVERRIDE.clear()
            res.append({"shape": [d_out, d_in], "r": r, "W": wd, "AB": ad, "mode": mode, "cfg": "default",
                        "default_cfg": kn._gram_config(d_out, r, W.device, mode, False),
                        "gram_ms": bench(lambda: kn._gram(W, A, U, base, False), warmup=5, rep=30)})
            del W, A, U, base
            _free()
    finally:
        kn._CONFIG_OVERRIDE.clear()
    RESULTS["norm_sweep"] = res
    return res


# Qwen3-8B projection shapes (d_out, d_in) at r=384: what one optimizer step's norm recompute runs per layer
QWEN_SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)]
_U_VARIANTS = {
    kn._MODE_SPLIT: [(256, 128, 64, 8, 3, False), (128, 128, 64, 8, 3, True), (256, 128, 64, 8, 3, True),
                     (128, 128, 64, 8, 4, True), (128, 128, 32, 8, 4, True), (128, 256, 64, 8, 3, True),
                     (128, 64, 64, 4, 3, True), (64, 128, 64, 4, 3, True)],
    kn._MODE_FP32: [(128, 128, 32, 8, 3, False), (128, 128, 32, 8, 3, True), (128, 64, 32, 4, 3, True),
                    (64, 128, 32, 4, 3, True)],
}


def sec_norm_variants():
    """G = A A^T unsplit vs split over K (the default), U = W A^T in row tiles vs transposed tiles (split A parts as
    wgmma's register operand) over block configurations, and the whole norm per Qwen3-8B shape at r=384 (AMP: bf16
    W, fp32 A/B; pure bf16), each with its relative error against a dense fp64 reference."""
    res = []
    saved_one = kn._ONE_PRODUCT_HALF
    cases = [(d_out, d_in, 384, "bf16", "fp32") for d_out, d_in in QWEN_SHAPES]
    cases += [(12288, 4096, 384, "bf16", "bf16"), (4096, 4096, 384, "bf16", "bf16"), (4096, 4096, 16, "bf16", "fp32")]
    try:
        for d_out, d_in, r, wd, ad in cases:
            g = torch.Generator(device=DEV).manual_seed(r)
            W = (torch.randn(d_out, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[wd])
            A = (torch.randn(r, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[ad])
            B = (torch.randn(d_out, r, device=DEV, generator=g) * 0.05).to(_DT[ad])
            s = 2.0 / math.sqrt(r) * 8
            rel = _rel_to_dense(W, A, B, s)
            row = {"shape": [d_out, d_in], "r": r, "W": wd, "AB": ad}
            mode = kn._MODE_SPLIT if (wd, ad) == ("bf16", "fp32") else kn._MODE_FP32
            # session 10's variants: bf16 W and A through the fp32 (tf32x3) mode, not today's one-product default
            kn._ONE_PRODUCT_HALF = False
            U = torch.empty(d_out, r, device=DEV)
            base = torch.empty(d_out, device=DEV)
            G = torch.empty(r, r, device=DEV)
            split = kn._g_split(r, d_in, d_out * r, W.device)
            parts = U.view(-1)[: split * r * r].view(split, r, r)
            row["G_split"] = split
            row["G_unsplit_ms"] = bench(lambda: kn._gram(A, A, G, None, False, gram_of_a=True), warmup=5, rep=30)

            def g_split():
                n = kn._gram(A, A, parts, None, False, gram_of_a=True, split=split)
                torch.sum(parts[:n], dim=0, out=G)

            row["G_split_ms"] = bench(g_split, warmup=5, rep=30)
            row["U"] = []
            for cfg in _U_VARIANTS[mode]:
                kn._CONFIG_OVERRIDE.clear()
                kn._CONFIG_OVERRIDE[mode] = cfg
                try:
                    ms = bench(lambda: kn._gram(W, A, U, base, False), warmup=5, rep=30)
                    nt, _ = kn.factored_norm_triton(W, A, B, s)
                    err = rel(nt)
                    full = bench(lambda: kn.factored_norm_triton(W, A, B, s, base_sq=base), warmup=5, rep=30)
                except Exception as e:  # out of resources etc.
                    ms, err, full = f"{type(e).__name__}: {str(e)[:200]}", None, None
                row["U"].append({"cfg": cfg, "U_ms": ms, "norm_cached_base_ms": full, "relerr": err,
                                 "tflops_1product": (2 * d_out * d_in * r / (ms * 1e-3) / 1e12)
                                 if isinstance(ms, float) else None})
            kn._CONFIG_OVERRIDE.clear()
            row["default_U_cfg"] = kn._gram_config(d_out, r, W.device, mode, False)
            ne, _ = on.factored_norm_eager(W, A, B, s)
            row["eager_relerr"] = rel(ne)
            res.append(row)
            print(json.dumps(row, default=str)[:1500], flush=True)
            del W, A, B, U, base, G, parts, rel
            _free()
    finally:
        kn._CONFIG_OVERRIDE.clear()
        kn._ONE_PRODUCT_HALF = saved_one
    RESULTS["norm_variants"] = res
    return res


# (name, module attributes, accumulation (K blocks per iteration, chained) or None = the module's defaults, U split
# over K or None = automatic); an accumulation given as {"U": ..., "G": ...} applies to the named passes only.
# Session 16: the pre-split U pass chained over the K range vs restarted every K block (default: chaining measured
# less exact, see kn._ACC_DEFAULT).
# Session 15 (results/h200_2026-12-01_s15/call1, call2) also ran presplit whole only / max 2 / max 4 chunks, no limit T,
# split3 in registers K64 / BG combine, presplit 128x128x32 s4 (N and T), 128x128x64 s3 w4 (2x slower), 128x128x64
# s4 / 128x256x64 / 128x128x32 fresh2 (out of shared memory) and 128x128x64 chained with G chained too (0.7e-3 ..
# 2.4e-3 error, not deterministic).
_PS = 3
_AMP_MODES = [("presplit (default)", {}, None, None),
              ("presplit chained", {}, {"U": (1, True)}, None),
              ("split3 in registers K32", {"_PRESPLIT": False}, None, None),
              ("presplit no limit", {"_WORKSET_PLAN": 1e9}, None, None),
              ("presplit QB16", {"_QUAD_BLOCK": 16}, None, None)]

# Session 14 call 2 also ran (U configurations, BLOCK_O x BLOCK_R x BLOCK_K, stages; results/h200_2026-11-30_s14/):
# 128x128x32 s3, 128x128x64 s3 (2-5% faster, but over the envelope where the quadratic term dominates: call 3),
# 256x128x32 s3 (2x slower: spills), the same chained, split3 chained (1e-3 error, not deterministic), 128x64x32
# 4 warps, 256x64x32 8 warps. Call 3 ran with the split mode at 128x128x64 s3 as default and "split3 U K32 s4" (today's
# default) as the variant.
_BF16_MODES = [("one (default)", {}, None, None),
               ("one rows chained", {"_CONFIG_OVERRIDE": {"one": (128, 128, 64, 8, 3, False)}}, {"U": (1, True)}, None)]
# Session 15 also ran "one fresh1 BG combine" and "one fresh1 U K32" ({"one": (128, 128, 32, 8, 4, True)}, session 13's)
# "BG combine": B G in the combine kernel (session 12's code path, _QUAD_IN_U off); the default adds it in the U pass.
# Session 12 call 1 (its norm_modes.json; G split or "ieee", B G in fp32 FMAs for every B) also ran "split3 fresh2",
# "split2 fresh2", "split3 fresh1 U 3 stages", "split3 fresh1 U K64" ({1: (128, 128, 64, 8, 3, True)}), "one fresh2",
# "one fresh1 tf32x3 BG". Call 7 (norm_modes_bg.json) ran with B G split for every B dtype as the default: its
# "split3 fresh1" is today's "split3 fresh1 BG split6", its "BG ieee" rows today's defaults. Session 13 and before
# also listed "split3 fresh1 BG split6" / "G,BG ieee" / "tf32x3 G,BG" (AMP) and "one fresh1 BG ieee" (bf16).
OLD_KN = None  # --old-pkg: an earlier fastdora's kernels.norm, timed side by side


def graph_ms(fn):
    """Median GPU time of ``fn`` replayed as a CUDA graph: the kernels alone, without the host's launch overhead."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(st)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = bench(graph.replay, warmup=5, rep=30)
    del graph
    return ms


def sec_norm_modes():
    """The whole factored norm per Qwen3-8B shape at r=384 under its product / accumulation modes, each with its
    relative error vs a dense fp64 reference: AMP (bf16 W, fp32 A/B) with the hi/mid/lo split (3 products) or
    hi/mid (2), pure bf16 with fp32 operands in tf32x3 or one bf16 product of the exact operands; the tensor cores'
    accumulation chained over the K range or restarted every 1/2/4 K blocks (fp32 adds in between); the U pass split
    over K automatically, or forced to 1 / 4 ranges. With --old-pkg, the earlier package's norm in the same run."""
    res = []
    for d_out, d_in in QWEN_SHAPES:
        for wd, ad in (("bf16", "fp32"), ("bf16", "bf16")):
            r = 384
            g = torch.Generator(device=DEV).manual_seed(r + d_out)
            W = (torch.randn(d_out, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[wd])
            A = (torch.randn(r, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[ad])
            B = (torch.randn(d_out, r, device=DEV, generator=g) * 0.05).to(_DT[ad])
            s = 2.0 / math.sqrt(r) * 8
            rel = _rel_to_dense(W, A, B, s)
            row = {"shape": [d_out, d_in], "r": r, "W": wd, "AB": ad, "variants": []}
            ne, base = on.factored_norm_eager(W, A, B, s)
            row["eager_relerr"] = rel(ne)
            quad = None
            if d_out == 1024:  # also where the quadratic term dominates (tests/test_kernels_gpu.py's case)
                gq = torch.Generator(device=DEV).manual_seed(3)
                Wq = (torch.randn(d_out, d_in, device=DEV, generator=gq) * 1e-3 / d_in ** 0.5).to(_DT[wd])
                Aq = (torch.randn(r, d_in, device=DEV, generator=gq) / d_in ** 0.5).to(_DT[ad])
                Bq = torch.randn(d_out, r, device=DEV, generator=gq).to(_DT[ad])
                quad = (Wq, Aq, Bq, _rel_to_dense(Wq, Aq, Bq, 3.0))
                row["eager_relerr_quad"] = quad[3](on.factored_norm_eager(Wq, Aq, Bq, 3.0)[0])
            if OLD_KN is not None:
                row["old_ms"] = bench(lambda: OLD_KN.factored_norm_triton(W, A, B, s, base_sq=base), warmup=5, rep=30)
                row["old_gpu_ms"] = graph_ms(lambda: OLD_KN.factored_norm_triton(W, A, B, s, base_sq=base))
                row["old_relerr"] = rel(OLD_KN.factored_norm_triton(W, A, B, s)[0])
            for name, attrs, acc, usplit in (_AMP_MODES if ad == "fp32" else _BF16_MODES):
                saved = {k: getattr(kn, k) for k in attrs}
                try:
                    for k, v in attrs.items():
                        setattr(kn, k, v)
                    m, nparts = kn._mode_of(W, A, False)
                    acc_u, acc_g = (acc.get("U"), acc.get("G")) if isinstance(acc, dict) else (acc, acc)
                    if acc_u is not None:
                        kn._ACC_OVERRIDE[kn._config_key(m, nparts, False)] = acc_u
                    if acc_g is not None:
                        kn._ACC_OVERRIDE[kn._config_key(*kn._mode_of(A, A, True), True)] = acc_g
                    if usplit is not None:
                        kn._SPLIT_OVERRIDE["U"] = usplit
                    ms = bench(lambda: kn.factored_norm_triton(W, A, B, s, base_sq=base), warmup=5, rep=30)
                    gpu_ms = graph_ms(lambda: kn.factored_norm_triton(W, A, B, s, base_sq=base))
                    ms_base = bench(lambda: kn.factored_norm_triton(W, A, B, s), warmup=5, rep=30)
                    nt, bt = kn.factored_norm_triton(W, A, B, s)
                    err = rel(nt)
                    nt2, _ = kn.factored_norm_triton(W, A, B, s)
                    _, mem = _peak_delta(lambda: kn.factored_norm_triton(W, A, B, s))
                    v = {"name": name, "ms": ms, "gpu_ms": gpu_ms, "ms_with_base": ms_base, "relerr": err,
                         "workset_bytes": mem, "UG_bytes": 4 * (d_out * r + r * r),
                         "deterministic": bool(torch.equal(nt, nt2)),
                         "relerr_quad": None if quad is None else quad[3](kn.factored_norm_triton(*quad[:3], 3.0)[0]),
                         "u_split": kn._u_split(d_out, r, d_in, kn._gram_config(d_out, r, W.device, m, False, nparts),
                                                W.device) if usplit is None else usplit}
                except Exception as e:  # out of resources etc.
                    v = {"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                finally:
                    for k, val in saved.items():
                        setattr(kn, k, val)
                    kn._ACC_OVERRIDE.clear()
                    kn._SPLIT_OVERRIDE.clear()
                row["variants"].append(v)
            res.append(row)
            print(json.dumps(row, default=str)[:3000], flush=True)
            del W, A, B, rel, ne, base, quad
            _free()
    RESULTS["norm_modes"] = res
    return res


# ------------------------------------------------------------------------------------------------------- crossover


def sec_crossover():
    rows = []
    for log2 in CROSSOVER_LOG2:
        nel = 1 << log2
        N = min(4096, nel)
        M = nel // N
        t, odt = _make(M, N, "amp")
        res = t["result"].requires_grad_(True)
        lora = t["lora"].requires_grad_(True)
        mag = t["magnitude"].float().requires_grad_(True)
        dy = t["dy"]
        row = {"numel": nel, "tokens": M, "d": N}
        for name, impl in (("eager", oc.EAGER), ("triton", kc.TRITON)):
            def fb(impl=impl):
                y = impl.apply(res, lora, mag, t["norm"], None, None, 0.5, 1e-6, odt, -1)
                y.backward(dy)

            def fw(impl=impl):
                with torch.no_grad():
                    if impl is oc.EAGER:
                        return oc.compose_fwd_eager(res, lora, mag, t["norm"], 0.5, 1e-6, None, None, odt, False)
                    return kc.TRITON.compose_fwd(res, lora, mag, t["norm"], 0.5, 1e-6, None, None, odt, False)

            row[f"{name}_fwdbwd_ms"] = bench(fb, warmup=10, rep=50)
            row[f"{name}_fwd_ms"] = bench(fw, warmup=10, rep=50)
            # wall clock per call (host overhead included: what small problems actually pay)
            for key, fn in (("fwdbwd", fb), ("fwd", fw)):
                fn()
                torch.cuda.synchronize()
                n_it = 200
                t0 = time.perf_counter()
                for _ in range(n_it):
                    fn()
                torch.cuda.synchronize()
                row[f"{name}_{key}_wall_ms"] = (time.perf_counter() - t0) / n_it * 1e3
        rows.append(row)
        del t, res, lora, mag, dy
        _free()
    RESULTS["crossover"] = rows
    cross = None
    for row in rows:
        if row["triton_fwdbwd_wall_ms"] <= row["eager_fwdbwd_wall_ms"] and \
                row["triton_fwd_wall_ms"] <= row["eager_fwd_wall_ms"]:
            cross = row["numel"] if cross is None else cross
        else:
            cross = None
    RESULTS["crossover_numel"] = cross
    return rows


# ----------------------------------------------------------------------------------------------------------- layer


def sec_layer():
    import peft
    from peft import LoraConfig, get_peft_model

    d, T, r = LAYER_SHAPE
    out = {"d": d, "tokens": T, "r": r, "peft": peft.__version__, "rows": []}

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(d, d, bias=False)

        def forward(self, x):
            return self.proj(x)

    def make(use_dora, adapters_bf16):
        torch.manual_seed(0)
        m = One().to(DEV, torch.bfloat16)
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"], use_dora=use_dora, use_rslora=True,
                         init_lora_weights=True)
        pm = get_peft_model(m, cfg)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        if adapters_bf16:
            pm = pm.to(torch.bfloat16)
        else:
            for n, p in pm.named_parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        pm.train()
        return pm

    def timings(fn_fwd, x, dy, autocast):
        def fwd():
            with torch.no_grad(), torch.autocast(DEV, torch.bfloat16, enabled=autocast):
                return fn_fwd(x)

        def fb():
            with torch.autocast(DEV, torch.bfloat16, enabled=autocast):
                y = fn_fwd(x)
            y.backward(dy)

        return bench(fwd, warmup=10, rep=50), bench(fb, warmup=10, rep=50)

    for setup, autocast, bf16 in (("amp", True, False), ("bf16", False, True)):
        x = torch.randn(T, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, d, device=DEV, dtype=torch.bfloat16)
        row = {"setup": setup}
        lora_m = make(False, bf16)
        row["peft_lora_fwd_ms"], row["peft_lora_fwdbwd_ms"] = timings(lora_m, x, dy, autocast)
        del lora_m
        dora_m = make(True, bf16)
        row["peft_dora_fwd_ms"], row["peft_dora_fwdbwd_ms"] = timings(dora_m, x, dy, autocast)

        # the same DoRA layer composed by hand with the fastdora kernels (norm cached, as within a step)
        lin = dora_m.base_model.model.proj
        W = lin.base_layer.weight
        A, B = lin.lora_A["default"].weight, lin.lora_B["default"].weight
        mag = lin.lora_magnitude_vector["default"].weight
        s = lin.scaling["default"]
        norm, _ = kn.factored_norm_triton(W, A, B, s)
        drop = lin.lora_dropout["default"]

        def composed(x):
            result = torch.nn.functional.linear(x, W)
            lora = lin.lora_B["default"](lin.lora_A["default"](drop(x)))
            return oc.dora_compose(result, lora, mag, norm, s, 1e-6, kernels="triton")

        row["fastdora_kernels_fwd_ms"], row["fastdora_kernels_fwdbwd_ms"] = timings(composed, x, dy, autocast)
        with torch.no_grad(), torch.autocast(DEV, torch.bfloat16, enabled=autocast):
            y_ref = dora_m(x)
            y_k = composed(x)
        row["max_abs_diff_vs_peft"] = (y_ref.float() - y_k.float()).abs().max().item()
        # through fastdora.enable (the lead's PEFT integration), when present
        try:
            import fastdora

            fastdora.enable(dora_m)
            row["fastdora_enable_fwd_ms"], row["fastdora_enable_fwdbwd_ms"] = timings(dora_m, x, dy, autocast)
            with torch.no_grad(), torch.autocast(DEV, torch.bfloat16, enabled=autocast):
                row["enable_max_abs_diff_vs_peft"] = (dora_m(x).float() - y_ref.float()).abs().max().item()
            row["active_paths"] = dict(getattr(fastdora, "active_path_counter", {}))
            fastdora.disable(dora_m)
        except Exception as e:  # the integration layer may not exist yet
            row["fastdora_enable_error"] = f"{type(e).__name__}: {e}"[:300]
        for k in ("fwd", "fwdbwd"):
            lo = row[f"peft_lora_{k}_ms"]
            row[f"dora_tax_peft_{k}"] = row[f"peft_dora_{k}_ms"] / lo
            row[f"dora_tax_kernels_{k}"] = row[f"fastdora_kernels_{k}_ms"] / lo
            if f"fastdora_enable_{k}_ms" in row:
                row[f"dora_tax_enable_{k}"] = row[f"fastdora_enable_{k}_ms"] / lo
        out["rows"].append(row)
        del dora_m, lin, W, A, B, mag, x, dy
        _free()
    RESULTS["layer"] = out
    return out


# ------------------------------------------------------------------------------------------------------------ main


def _load_old_norm(path: str):
    """``kernels.norm`` of the fastdora package in ``path/fastdora``, imported under another name."""
    import importlib

    from _bench_io import load_package_as

    load_package_as(path, "fastdora_old")
    return importlib.import_module("fastdora_old.kernels.norm")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sections", default="copy,compose,sweep,norm,norm_sweep,crossover,layer")
    ap.add_argument("--sweep", default="all", choices=["all", "bwd"], help="which kernels the sweep section tunes")
    ap.add_argument("--rep", type=float, default=100, help="do_bench repetition time (ms) of the compose section")
    ap.add_argument("--old-pkg", default=None, help="folder with an earlier fastdora package (norm_modes: timed too)")
    ap.add_argument("--bwd-cfgs", default=None, help="bwd_sweep: JSON list of configurations instead of BWD_SWEEP")
    ap.add_argument("--bwd-rounds", type=int, default=1, help="bwd_sweep: rounds at the shapes other than 16384x4096")
    a = ap.parse_args()
    global COMPOSE_REP, SWEEP_WHICH, OLD_KN, BWD_SWEEP, BWD_ROUNDS
    if a.bwd_cfgs:
        BWD_SWEEP = [tuple(c) for c in json.loads(a.bwd_cfgs)]
    BWD_ROUNDS = a.bwd_rounds
    if a.old_pkg:
        OLD_KN = _load_old_norm(a.old_pkg)
    COMPOSE_REP = a.rep
    SWEEP_WHICH = a.sweep
    import triton

    props = torch.cuda.get_device_properties(0)
    RESULTS["env"] = {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cmd": " ".join(sys.argv),
    }
    secs = a.sections.split(",")
    bw = None
    t0 = time.time()
    for sec in secs:
        ts = time.time()
        try:
            if sec == "copy":
                bw = sec_copy()
            elif sec in ("compose", "sweep", "evict", "bwd_sweep", "mb_shapes"):
                if bw is None:
                    bw = sec_copy()
                {"compose": sec_compose, "sweep": sec_sweep, "evict": sec_evict, "bwd_sweep": sec_bwd_sweep,
                 "mb_shapes": sec_mb_shapes}[sec](bw)
            elif sec == "norm":
                sec_norm()
            elif sec == "norm_sweep":
                sec_norm_sweep()
            elif sec == "norm_variants":
                sec_norm_variants()
            elif sec == "norm_modes":
                sec_norm_modes()
            elif sec == "crossover":
                sec_crossover()
            elif sec == "layer":
                sec_layer()
        except Exception:
            RESULTS.setdefault("errors", {})[sec] = traceback.format_exc()[-3000:]
            traceback.print_exc()
        RESULTS.setdefault("section_seconds", {})[sec] = time.time() - ts
        _save(a.out)
    RESULTS["total_seconds"] = time.time() - t0
    _save(a.out)
    print_table()


def print_table():
    r = RESULTS
    if "copy" in r:
        print(f"copy bandwidth: {r['copy']['GBps']:.0f} GB/s")
    for row in r.get("compose", []):
        print(
            f"compose {row['mode']:5s} T={row['tokens']:5d} d={row['d']:5d} | fwd_train {row['fwd_train']['ms']:.3f}ms "
            f"{row['fwd_train']['pct_copy']:.0f}% | fwd_infer {row['fwd_infer']['pct_copy']:.0f}% | "
            f"bwd {row['bwd']['ms']:.3f}ms {row['bwd']['pct_copy']:.0f}% | eager fwd {row.get('eager_fwd_train_ms', 0):.3f} "
            f"bwd {row.get('eager_bwd_ms', 0):.3f}"
        )
    sw = r.get("sweep")
    if sw:
        for f in sw["fwd"]:
            print(f"sweep fwd {f['cfg']}: train {f['fwd_train_pct']:.0f}% infer {f['fwd_infer_pct']:.0f}%")
        for b in sw["bwd"]:
            print(f"sweep bwd {b['cfg']}: {b['bwd_pct']:.0f}%")
        print(f"defaults fwd {sw['default_fwd']} bwd {sw['default_bwd']}")
    for row in r.get("norm", []):
        print(
            f"norm {row['shape']} r={row['r']} W={row['W']} AB={row['AB']} | triton {row['triton_ms']:.3f}ms "
            f"(cached base {row['triton_cached_base_ms']:.3f}; G {row.get('triton_G_ms', 0):.3f} U {row.get('triton_U_ms', 0):.3f})"
            f" {row['triton_mem'] / 2**20:.1f}MB err {row['triton_relerr']:.1e} | "
            f"eager {row['eager_ms']:.3f}ms {row['eager_mem'] / 2**20:.1f}MB err {row['eager_relerr']:.1e} | "
            f"peft {row.get('peft_ms', float('nan')):.3f}ms {row['peft_mem'] if isinstance(row['peft_mem'], str) else row['peft_mem'] / 2**20:.0f}MB"
            f" | U+G {row['UG_bytes'] / 2**20:.1f}MB"
        )
    for row in r.get("norm_sweep", []):
        print(f"norm sweep {row['shape']} r={row['r']} {row['W']}/{row['AB']} cfg={row['cfg']}: {row['gram_ms']}")
    for row in r.get("crossover", []):
        print(
            f"crossover {row['numel']:>9d}: fwd+bwd eager {row['eager_fwdbwd_ms']:.4f} triton {row['triton_fwdbwd_ms']:.4f}"
            f" | fwd eager {row['eager_fwd_ms']:.4f} triton {row['triton_fwd_ms']:.4f}"
            f" | wall fwd+bwd eager {row['eager_fwdbwd_wall_ms']:.4f} triton {row['triton_fwdbwd_wall_ms']:.4f}"
            f" fwd eager {row['eager_fwd_wall_ms']:.4f} triton {row['triton_fwd_wall_ms']:.4f}"
        )
    if "crossover_numel" in r:
        print(f"crossover numel: {r['crossover_numel']}")
    for row in r.get("layer", {}).get("rows", []):
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    for sec, err in r.get("errors", {}).items():
        print(f"ERROR in {sec}: {err[-600:]}")


if __name__ == "__main__":
    main()
