"""Where the factored norm's time goes per Qwen3-8B shape at r=384 (H200), and how it depends on the K splits.

For AMP (bf16 W, fp32 A/B) and pure bf16, per shape: the whole norm (cached base row norms, as once per optimizer step
in training; kernels only, replayed as a CUDA graph) with G = A A^T from the upper-triangle tiles (``_G_SYM``) or all
tiles; the G pass alone; the U pass's K-split count swept (time and relative error vs fp64); the G pass's K-split count
and tile configuration swept (time and error of G vs fp64, ignoring the working-set cap); cuBLAS fp32 ``A @ A^T``
(TF32 off) for comparison; U-pass variants (U_VARIANTS). Prints one JSON line per case, writes all to ``--out``.

    python benchmarks/norm_breakdown.py --out norm_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from kernels_bench import DEV, QWEN_SHAPES, _DT, _free, _rel_to_dense, graph_ms
from fastdora.kernels import norm as kn

RANK = 384
U_SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 11, 12, 16)
G_SPLITS = (1, 2, 4, 8, 12, 16, 24, 32)
# U-pass variants per setup: (name, module attributes, {config key: (BLOCK_O, BLOCK_R, BLOCK_K, warps, stages, trans)},
# {config key: (K blocks per restart, chained)}). Call 1 (results/h200_2026-12-01_s16/call1) ran the pre-split mode at
# 128x128x64 s3 (default) / 128x128x32 s4 / the same restarted every 2 blocks (out of shared memory) / 128x128x32 s3
# restarted every 2 / 128x64x64 4 warps: the default was fastest at every shape. Call 2 (call2/norm_variants.json)
# also ran "cat": the lo and mid parts' products as one dot over a 2x longer K ([W | W] @ [lo; mid]) and hi's as
# another, two accumulators each chained (W's tile loaded 3 times): 0.178 / 0.402 ms vs 0.159 / 0.342 at 4096x4096 /
# 12288x4096 (K32 s3; K32 s4 and K64 s2 slower still), not kept.
_PS = kn._MODE_PRESPLIT
_NOLIM = {"_WORKSET_PLAN": 1e9}
# Call 3 (call3/norm_chained.json) ran with the pre-split and one-product U passes chained as the module default (its
# "(default)" rows chained, "presplit restarted" / "one T restarted" the defaults of today): "presplit chained max 8 /
# 12 chunks", "presplit chained no limit" (+ U splits), "in registers rows K64 chained / restarted"; 15 norm GPU tests
# failed their envelope with the chained defaults, which were reverted (kn._ACC_DEFAULT).
# Call 4 (call4/) ran the defaults only (--parts none). Call 5 (call5/) ran the U pass's quadratic term for an fp32 B
# (AMP) in 4 tensor-core products per rank chunk as "default" (G symmetric: diag(B G B^T) = rowsum(P (2B - B_hi)) +
# rowsum(Q (B_mid + 2 B_lo)), P = B_hi G to fp32 level in 3 products, Q = B_mid G_hi in 1) against today's 6 ("quad
# six products"): same error, but 4-6% SLOWER at every shape (4096x4096 0.167 vs 0.161 ms, 12288x4096 0.359 vs
# 0.341, 4096x12288 0.447 vs 0.428: a third accumulator live in the U pass's epilogue), not kept.
U_VARIANTS = {
    "amp": [("default", {}, {}, {}),
            ("presplit chained", {}, {}, {_PS: (1, True)}),
            ("presplit no limit", _NOLIM, {}, {})],
    "bf16": [("one (default)", {}, {}, {}),
             ("one rows chained", {}, {"one": (128, 128, 64, 8, 3, False)}, {"one": (1, True)})],
}
# G pass variants: (name, tile configuration, accumulation or None = default), each over G_SPLITS K ranges
G_VARIANTS = (("64 T restarted (default)", (64, 64, 32, 4, 3, True), None),
              ("64 rows restarted", (64, 64, 32, 4, 3, False), None),
              ("64 rows chained", (64, 64, 32, 4, 3, False), (1, True)),
              ("64x64x64 rows chained", (64, 64, 64, 4, 3, False), (1, True)),
              ("32 T restarted", (32, 32, 32, 4, 3, True), None),
              ("32 rows chained", (32, 32, 32, 4, 3, False), (1, True)))


def _g_pass(A, sg):
    """G = A A^T as factored_norm_triton computes it (partial G's over sg K ranges, fixed-order sum)."""
    r = A.shape[0]
    G = torch.empty((r, r), dtype=torch.float32, device=A.device)
    kn._gram_matrix(A, G, sg, False)
    return G


def _g_rel(G, ref):
    return ((G.double() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="sym,usplit,ucfg,gsplit", help="comma separated: sym, usplit, ucfg, gsplit")
    a = ap.parse_args()
    parts = a.parts.split(",")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for d_out, d_in in QWEN_SHAPES:
        for setup, ad in (("amp", "fp32"), ("bf16", "bf16")):
            r = RANK
            g = torch.Generator(device=DEV).manual_seed(r + d_out)
            W = (torch.randn(d_out, d_in, device=DEV, generator=g) / d_in ** 0.5).to(torch.bfloat16)
            A = (torch.randn(r, d_in, device=DEV, generator=g) / d_in ** 0.5).to(_DT[ad])
            B = (torch.randn(d_out, r, device=DEV, generator=g) * 0.05).to(_DT[ad])
            s = 2.0 / math.sqrt(r) * 8
            rel = _rel_to_dense(W, A, B, s)
            _, base = kn.factored_norm_triton(W, A, B, s)
            Gref = A.double() @ A.double().T
            row = {"shape": [d_out, d_in], "r": r, "setup": setup, "mode": kn._mode_of(W, A, False),
                   "default_u_split": kn._u_split(d_out, r, d_in, kn._gram_plan(W, A, False)[2], W.device),
                   "default_g_split": kn._g_split(r, d_in, d_out * r, W.device)}

            def norm():
                return kn.factored_norm_triton(W, A, B, s, base_sq=base)[0]

            for sym in ((True, False) if "sym" in parts else (True,)):
                kn._G_SYM = sym
                key = "sym" if sym else "full"
                row[f"norm_ms_{key}"] = graph_ms(norm)
                row[f"relerr_{key}"] = rel(norm())
                sg = kn._g_split(r, d_in, d_out * r, W.device)
                row[f"g_ms_{key}"] = graph_ms(lambda: _g_pass(A, sg))
                row[f"g_relerr_{key}"] = _g_rel(_g_pass(A, sg), Gref)
            kn._G_SYM = True
            row["u_splits"] = []
            for su in (U_SPLITS if "usplit" in parts else ()):
                kn._SPLIT_OVERRIDE["U"] = su
                try:
                    row["u_splits"].append({"su": su, "ms": graph_ms(norm), "relerr": rel(norm())})
                finally:
                    kn._SPLIT_OVERRIDE.clear()
            row["u_variants"] = []
            for name, attrs, cfgs, accs in (U_VARIANTS[setup] if "ucfg" in parts else ()):
                saved = {k: getattr(kn, k) for k in attrs}
                try:
                    for k, v in attrs.items():
                        setattr(kn, k, v)
                    kn._CONFIG_OVERRIDE.update(cfgs)
                    kn._ACC_OVERRIDE.update(accs)
                    v = {"name": name, "ms": graph_ms(norm), "relerr": rel(norm()),
                         "deterministic": bool(torch.equal(norm(), norm())), "u_splits": []}
                    if name == "presplit no limit" and "usplit" in parts:
                        for su in U_SPLITS:
                            kn._SPLIT_OVERRIDE["U"] = su
                            v["u_splits"].append({"su": su, "ms": graph_ms(norm), "relerr": rel(norm())})
                        kn._SPLIT_OVERRIDE.clear()
                    row["u_variants"].append(v)
                except Exception as e:  # out of resources
                    row["u_variants"].append({"name": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                finally:
                    for k, val in saved.items():
                        setattr(kn, k, val)
                    kn._CONFIG_OVERRIDE.clear()
                    kn._ACC_OVERRIDE.clear()
                    kn._SPLIT_OVERRIDE.clear()
            row["g_splits"] = []
            gkey = kn._config_key(*kn._mode_of(A, A, True), True)  # "G" (fp32 A) or "G1" (bf16 A)
            for gname, cfg, acc in (G_VARIANTS if "gsplit" in parts else ()):
                kn._CONFIG_OVERRIDE[gkey] = cfg
                if acc is not None:
                    kn._ACC_OVERRIDE[gkey] = acc
                try:
                    for sg in G_SPLITS:
                        Gk = _g_pass(A, sg)
                        row["g_splits"].append({"name": gname, "cfg": cfg, "sg": sg,
                                                "ms": graph_ms(lambda: _g_pass(A, sg)), "relerr": _g_rel(Gk, Gref),
                                                "deterministic": bool(torch.equal(Gk, _g_pass(A, sg)))})
                except Exception as e:  # out of resources
                    row["g_splits"].append({"name": gname, "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                finally:
                    kn._CONFIG_OVERRIDE.clear()
                    kn._ACC_OVERRIDE.clear()
            Af = A.float()
            row["cublas_g_ms"] = graph_ms(lambda: Af @ Af.T)
            row["cublas_g_relerr"] = _g_rel(Af @ Af.T, Gref)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _free()
    res = {"env": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
