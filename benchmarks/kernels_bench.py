"""Microbenchmarks of the fastdora Triton kernels (H200). Prints a table and writes JSON (``--out``).

Sections (``--sections``, comma separated; default all):
  copy       device copy bandwidth (clone of a 4 GiB tensor: bytes read + written / median time): the ceiling
  compose    forward / backward kernels: achieved bandwidth (bytes that must move / median time) as % of copy
             bandwidth, against the eager PyTorch path, at tokens 8192..16384, d 4096..12288, bf16 / AMP / mixed
  sweep      block-size alternatives of the forward and backward kernels at one large shape (16384 x 4096, AMP),
             each run under ``fastdora.config.override(compose_config=...)``
  norm       factored-norm kernel: time and working set (max_memory_allocated delta) vs the eager factored norm
             and PEFT's dense formula; relative error vs a dense fp64 reference
  norm_sweep U = W A^T tile configurations of the norm kernel at 8192 x 8192 (fp32, and bf16 W with fp32 A in the
             in-register split mode), each under ``fastdora.config.override(norm_config=...)``
  crossover  eager vs fused composition (autograd fwd+bwd and no-grad fwd) from 1K to 64M elements, incl. host time
  layer      one Linear layer d=4096, 8192 tokens, r=384: PEFT LoRA vs PEFT DoRA vs PEFT DoRA + fastdora.enable,
             AMP and pure bf16, forward (no grad) and forward+backward medians

Usage:
  python benchmarks/kernels_bench.py --out DIR/kernels.json [--sections copy,compose,...]
  python benchmarks/kernels_bench.py --report DIR/kernels.json      # the tables of a saved run, no GPU needed
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

from fastdora import config
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
    x = None  # free the 4 GiB
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
    _, inner = kc.compose_fwd(*args, True, -1)
    # dy, magnitude, norm, scale, eps, inner, delta_form, result / lora / base_delta dtypes, need_dm, need_dbias,
    # feature_dim
    bargs = (t["dy"], t["magnitude"], t["norm"], 0.5, eps, inner, False, rdt, ldt, None, True, False, -1)
    for name, fn, nbytes in (
        ("fwd_train", lambda: kc.compose_fwd(*args, True, -1), fwd_train_bytes),
        ("fwd_infer", lambda: kc.compose_fwd(*args, False, -1), fwd_inf_bytes),
        ("bwd", lambda: kc.compose_bwd(*bargs), bwd_bytes),
    ):
        if only is not None and name != only:
            continue
        ms = bench(fn, warmup=50, rep=COMPOSE_REP)
        bw = nbytes / (ms * 1e-3)
        out[name] = {"ms": ms, "bytes": nbytes, "GBps": bw / 1e9, "pct_copy": 100 * bw / bw_copy}
    if with_eager:
        out["eager_fwd_train_ms"] = bench(lambda: oc.compose_fwd_eager(*args, True, -1), warmup=5, rep=20)
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
DEFAULT_SECTIONS = "copy,compose,sweep,norm,norm_sweep,crossover,layer"


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
    for cfg in fwd_cfgs:
        with config.override(compose_config={"fwd": cfg}):
            r = _compose_case(M, N, mode, bw_copy, with_eager=False)
        res["fwd"].append({"cfg": cfg, "fwd_train_pct": r["fwd_train"]["pct_copy"],
                           "fwd_infer_pct": r["fwd_infer"]["pct_copy"]})
    for cfg in bwd_cfgs:
        with config.override(compose_config={"bwd": cfg}):
            r = _compose_case(M, N, mode, bw_copy, with_eager=False)
        res["bwd"].append({"cfg": cfg, "bwd_pct": r["bwd"]["pct_copy"]})
    res["default_fwd"] = kc._fwd_config(M, N, torch.device(DEV))
    res["default_bwd"] = kc._bwd_config(M, N, torch.device(DEV))
    RESULTS["sweep"] = res
    return res


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
        (ne, _), row["eager_mem"] = _peak_delta(lambda: on.factored_norm_eager(W, A, B, s))
        row["triton_ms"] = bench(lambda: kn.factored_norm_triton(W, A, B, s), warmup=5, rep=30)
        row["triton_cached_base_ms"] = bench(lambda: kn.factored_norm_triton(W, A, B, s, base_sq=bt), warmup=5,
                                             rep=30)
        row["eager_ms"] = bench(lambda: on.factored_norm_eager(W, A, B, s), warmup=3, rep=15)
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
        W = A = B = nt = bt = ne = rel = None  # freed before the next case
        _free()
    RESULTS["norm"] = rows
    return rows


def sec_norm_sweep():
    """The U = W A^T pass alone (``kn._gram``: U stored, ||W||^2 per row) over tile configurations
    (BLOCK_O, BLOCK_R, BLOCK_K, warps, stages[, transposed]) at 8192 x 8192: fp32 W and A (tf32x3), and bf16 W with
    fp32 A in the split mode with A split in registers (``norm_presplit=False``: the mode the norm runs where A's
    pre-split parts would not fit its working set). Each under ``config.override(norm_config={mode: cfg})``; then the
    shipped configuration."""
    res = []
    cases = [(8192, 8192, 512, "fp32", "fp32", kn._MODE_FP32), (8192, 8192, 384, "bf16", "fp32", kn._MODE_SPLIT)]
    cfgs = {
        kn._MODE_FP32: [(128, 128, 32, 8, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (128, 128, 32, 8, 4),
                        (128, 256, 32, 8, 2), (256, 128, 32, 8, 2), (64, 64, 32, 4, 4), (128, 128, 16, 8, 4)],
        kn._MODE_SPLIT: [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
                         (128, 128, 32, 8, 4), (256, 128, 32, 8, 3), (256, 64, 64, 8, 3), (128, 128, 32, 8, 4, True),
                         (128, 128, 64, 8, 3, True)],
    }
    for d_out, d_in, r, wd, ad, mode in cases:
        g = torch.Generator(device=DEV).manual_seed(r)
        W = (torch.randn(d_out, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[wd])
        A = (torch.randn(r, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[ad])
        U = torch.empty(d_out, r, device=DEV)
        base = torch.empty(d_out, device=DEV)
        row = {"shape": [d_out, d_in], "r": r, "W": wd, "AB": ad, "mode": mode}
        for cfg in cfgs[mode] + ["default"]:
            settings = {"norm_presplit": False}
            if cfg != "default":
                settings["norm_config"] = {mode: cfg}
            with config.override(**settings):
                try:
                    ms = bench(lambda: kn._gram(W, A, U, base, False), warmup=5, rep=30)
                except Exception as e:  # noqa: BLE001 - out of resources etc.
                    ms = f"{type(e).__name__}"
                extra = {"default_cfg": kn._gram_config(d_out, r, W.device, mode, False)} if cfg == "default" else {}
            res.append(dict(row, cfg=cfg, gram_ms=ms, **extra,
                            tflops=(2 * d_out * d_in * r / (ms * 1e-3) / 1e12) if isinstance(ms, float) else None))
        W = A = U = base = None
        _free()
    RESULTS["norm_sweep"] = res
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
        for name, impl in (("eager", oc.EAGER), ("triton", oc.triton_impl())):
            def fb(impl=impl):  # the autograd composition (the Triton one: through the C++ node where active)
                y = impl.apply(res, lora, mag, t["norm"], None, None, 0.5, 1e-6, odt, -1)
                y.backward(dy)

            def fw(impl=impl):
                with torch.no_grad():
                    return impl.compose_fwd(res, lora, mag, t["norm"], 0.5, 1e-6, None, None, odt, False, -1)

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
        t = res = lora = mag = dy = None
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

    import fastdora
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

        with torch.no_grad(), torch.autocast(DEV, torch.bfloat16, enabled=autocast):
            y_ref = dora_m(x)
        # the same model through fastdora.enable (the composition kernels, the cached norm, the C++ node)
        fastdora.enable(dora_m)
        row["fastdora_enable_fwd_ms"], row["fastdora_enable_fwdbwd_ms"] = timings(dora_m, x, dy, autocast)
        with torch.no_grad(), torch.autocast(DEV, torch.bfloat16, enabled=autocast):
            row["enable_max_abs_diff_vs_peft"] = (dora_m(x).float() - y_ref.float()).abs().max().item()
        row["active_paths"] = dict(fastdora.active_path_counter)
        fastdora.disable(dora_m)
        for k in ("fwd", "fwdbwd"):
            lo = row[f"peft_lora_{k}_ms"]
            row[f"dora_tax_peft_{k}"] = row[f"peft_dora_{k}_ms"] / lo
            row[f"dora_tax_enable_{k}"] = row[f"fastdora_enable_{k}_ms"] / lo
        out["rows"].append(row)
        del dora_m, x, dy, y_ref
        _free()
    RESULTS["layer"] = out
    return out


# ------------------------------------------------------------------------------------------------------------ main


SECTIONS = {"copy": None, "compose": sec_compose, "sweep": sec_sweep, "norm": sec_norm, "norm_sweep": sec_norm_sweep,
            "crossover": sec_crossover, "layer": sec_layer}
NEEDS_COPY = ("compose", "sweep")  # their bandwidth is a % of the copy bandwidth


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON written after every section")
    ap.add_argument("--sections", default=DEFAULT_SECTIONS, help=f"comma-separated, of {list(SECTIONS)}")
    ap.add_argument("--sweep", default="all", choices=["all", "bwd"], help="which kernels the sweep section tunes")
    ap.add_argument("--rep", type=float, default=100, help="do_bench repetition time (ms) of the compose section")
    ap.add_argument("--report", help="print the tables of a saved kernels JSON and exit")
    a = ap.parse_args()
    if a.report:
        with open(a.report) as f:
            RESULTS.update(json.load(f))
        print_table()
        return
    secs = a.sections.split(",")
    unknown = sorted(set(secs) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown} (known: {list(SECTIONS)})")
    global COMPOSE_REP, SWEEP_WHICH
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
    bw = None
    t0 = time.time()
    for sec in secs:
        ts = time.time()
        try:
            if sec == "copy" or (sec in NEEDS_COPY and bw is None):
                bw = sec_copy()
            if sec in NEEDS_COPY:
                SECTIONS[sec](bw)
            elif sec != "copy":
                SECTIONS[sec]()
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
            f"bwd {row['bwd']['ms']:.3f}ms {row['bwd']['pct_copy']:.0f}% | "
            f"eager fwd {row.get('eager_fwd_train_ms', 0):.3f} bwd {row.get('eager_bwd_ms', 0):.3f}"
        )
    sw = r.get("sweep")
    if sw:
        for f in sw["fwd"]:
            print(f"sweep fwd {f['cfg']}: train {f['fwd_train_pct']:.0f}% infer {f['fwd_infer_pct']:.0f}%")
        for b in sw["bwd"]:
            print(f"sweep bwd {b['cfg']}: {b['bwd_pct']:.0f}%")
        print(f"defaults fwd {sw['default_fwd']} bwd {sw['default_bwd']}")
    for row in r.get("norm", []):
        peft_mb = row["peft_mem"] if isinstance(row["peft_mem"], str) else f"{row['peft_mem'] / 2**20:.0f}"
        print(
            f"norm {row['shape']} r={row['r']} W={row['W']} AB={row['AB']} | triton {row['triton_ms']:.3f}ms "
            f"(cached base {row['triton_cached_base_ms']:.3f}) {row['triton_mem'] / 2**20:.1f}MB "
            f"err {row['triton_relerr']:.1e} | "
            f"eager {row['eager_ms']:.3f}ms {row['eager_mem'] / 2**20:.1f}MB err {row['eager_relerr']:.1e} | "
            f"peft {row.get('peft_ms', float('nan')):.3f}ms {peft_mb}MB"
            f" | U+G {row['UG_bytes'] / 2**20:.1f}MB"
        )
    for row in r.get("norm_sweep", []):
        print(f"norm sweep {row['shape']} r={row['r']} {row['W']}/{row['AB']} cfg={row['cfg']}: {row['gram_ms']}")
    for row in r.get("crossover", []):
        print(
            f"crossover {row['numel']:>9d}: fwd+bwd eager {row['eager_fwdbwd_ms']:.4f} "
            f"triton {row['triton_fwdbwd_ms']:.4f}"
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
