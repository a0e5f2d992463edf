"""The AMP norm's U pass (bf16 W, fp32 A pre-split into bf16 hi + mid + lo) on TMA tensor-descriptor loads.

``--parts u``: this script's TMA kernel (plain, persistent, Triton's warp specialisation; cross term only) against the
pointer-load kernel (``_norm_gram_kernel``), per Qwen3-8B shape at r=384 and K split: kernel time (CUDA graph,
median), relative error of the summed cross term vs fp64, whether the partial sums are bitwise the same (call 1).
``--parts norm``: the whole AMP norm, defaults (``_norm_u_tma_kernel``) against pointer loads and chunkings.

    cd benchmarks && python u_tma_probe.py --parts u --out u_tma.json
    cd benchmarks && python u_tma_probe.py --parts norm --out u_tma_norm.json
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels_bench import QWEN_SHAPES, graph_ms
from fastdora.kernels import norm as kn

RANK = 384


@triton.jit
def _u_tma_kernel(w_desc, p_desc, b_ptr, out_ptr, ROWS, R, K, K_SPLIT, N_TILES, TOTAL, stride_bo, stride_br, zero,
                  BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                  WS: tl.constexpr, PERSISTENT: tl.constexpr, NPROG: tl.constexpr, UPCAST: tl.constexpr):
    n_r = tl.cdiv(R, BLOCK_R)
    if PERSISTENT:
        start = tl.program_id(0)
        step = NPROG
        stop = TOTAL
    else:
        start = tl.program_id(1) * N_TILES + tl.program_id(0)
        step = 1
        stop = start + 1
    for t in tl.range(start, stop, step, warp_specialize=WS and PERSISTENT):
        split = t // N_TILES
        tile = t % N_TILES
        pid_o = tile // n_r
        pid_r = tile % n_r
        off_o = pid_o * BLOCK_O
        off_r = pid_r * BLOCK_R
        acc = tl.zeros([BLOCK_O, BLOCK_R], dtype=tl.float32)
        fresh = acc + zero
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES, warp_specialize=WS and not PERSISTENT):
            x = w_desc.load([off_o, k0])
            lo = p_desc.load([2 * R + off_r, k0])
            mid = p_desc.load([R + off_r, k0])
            hi = p_desc.load([off_r, k0])
            part = kn._dot(x, lo.T, fresh, UPCAST)
            part = kn._dot(x, mid.T, part, UPCAST)
            part = kn._dot(x, hi.T, part, UPCAST)
            acc += part
        offs_o = off_o + tl.arange(0, BLOCK_O)
        offs_r = off_r + tl.arange(0, BLOCK_R)
        omask = offs_o < ROWS
        rmask = offs_r < R
        b = tl.load(b_ptr + offs_o[:, None].to(tl.int64) * stride_bo + offs_r[None, :] * stride_br,
                    mask=omask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        c = tl.sum(acc * b, axis=1)
        tl.store(out_ptr + (split * n_r + pid_r).to(tl.int64) * ROWS + offs_o, c, mask=omask)


def u_tma(W, parts, B, su, cfg):
    """Cross-term partial sums [ranges * n_r, d_out] of the TMA kernel; cfg = (BO, BR, BK, warps, stages, ws, persistent)."""
    bo, br, bk, warps, stages, ws, persistent = cfg
    d_out, K = W.shape
    r = parts.shape[1]
    k_split, su = kn._k_ranges(K, su, bk)
    n_r = triton.cdiv(r, br)
    n_tiles = triton.cdiv(d_out, bo) * n_r
    out = torch.empty((su * n_r, d_out), dtype=torch.float32, device=W.device)
    w_desc = TensorDescriptor.from_tensor(W, [bo, bk])
    p_desc = TensorDescriptor.from_tensor(parts.reshape(3 * r, K), [br, bk])
    total = n_tiles * su
    nsm = kn._num_sms(W.device)
    nprog = min(nsm, total)
    grid = (nprog,) if persistent else (n_tiles, su)

    def run():
        _u_tma_kernel[grid](w_desc, p_desc, B, out, d_out, r, K, k_split, n_tiles, total, B.stride(0), B.stride(1),
                            0.0, BLOCK_O=bo, BLOCK_R=br, BLOCK_K=bk, STAGES=stages, WS=ws, PERSISTENT=persistent,
                            NPROG=nprog, UPCAST=not W.is_cuda, num_warps=warps)
    return run, out


def u_pointers(W, parts, B, su):
    plan = (kn._MODE_PRESPLIT, 3, kn._PRESPLIT_CFG)
    cfg = plan[2]
    d_out, K = W.shape
    r = parts.shape[1]
    _, su_used = kn._k_ranges(K, su, cfg[2])
    out = torch.empty((su_used * triton.cdiv(r, cfg[1]), d_out), dtype=torch.float32, device=W.device)

    def run():  # the pointer-load kernel (_norm_gram_kernel), not the shipped TMA one
        saved, kn._TMA = kn._TMA, False
        try:
            kn._gram(W, parts, out, None, not W.is_cuda, split=su, b=B, plan=plan)
        finally:
            kn._TMA = saved
    return run, out


# Whole-norm variants against the shipped defaults (pre-split U pass on TMA, K chunks adding into the same partial
# sums): (name, module attributes, forced pre-split chunk columns or None). Calls 2 and 3 (results/h200_2026-12-01_s17/
# call2, call3) ran an earlier version of this script, with the then-shipped pointer-load kernel as the default and
# this script's own TMA kernel patched in (the numbers in benchmarks/README.md, "session 17"); it is in git history.
NORM_VARIANTS = (("pointer loads", {"_TMA": False}, None),
                 ("one chunk (over the working-set limit)", {"_WORKSET_PLAN": 1e9}, None))
DOWN_VARIANTS = (("3 chunks of 4096 (over the limit)", {}, 4096), ("pointer loads, 3 chunks of 4096", {"_TMA": False},
                                                                    4096))
_ORIG_CHUNK = kn._presplit_chunk


def norm_rows(shapes, variants_of):
    rows = []
    for d_out, d_in in shapes:
        torch.manual_seed(0)
        W = (torch.randn(d_out, d_in, device="cuda") * 0.02).to(torch.bfloat16)
        A = torch.randn(RANK, d_in, device="cuda") / d_in ** 0.5
        B = torch.randn(d_out, RANK, device="cuda") * 0.05
        s = 2.0
        _, base_sq = kn.factored_norm_triton(W, A, B, s)
        ref = torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)

        def run():
            return kn.factored_norm_triton(W, A, B, s, base_sq)[0]
        n0 = run()
        row = {"shape": [d_out, d_in], "variant": "default norm", "ms": graph_ms(run),
               "relerr": ((n0.double() - ref).norm() / ref.norm()).item()}
        print(json.dumps(row), flush=True)
        rows.append(row)
        for name, attrs, chunk in variants_of(d_out, d_in):
            row = {"shape": [d_out, d_in], "variant": name + " norm"}
            saved = {k: getattr(kn, k) for k in attrs}
            try:
                for k, v in attrs.items():
                    setattr(kn, k, v)
                if chunk:
                    kn._presplit_chunk = lambda *a, _c=chunk: _c
                n1 = run()
                torch.cuda.synchronize()
                row["bitwise_equal_default"] = bool(torch.equal(n1, n0))
                row["relerr"] = ((n1.double() - ref).norm() / ref.norm()).item()
                row["ms"] = graph_ms(run)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(limit=2)
            finally:
                for k, v in saved.items():
                    setattr(kn, k, v)
                kn._presplit_chunk = _ORIG_CHUNK
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _variants(d_out, d_in):
    return NORM_VARIANTS + (DOWN_VARIANTS if d_in > d_out else ())


VARIANTS = [
    ("tma 128x128x64 s3", (128, 128, 64, 8, 3, False, False)),
    ("tma 128x128x64 s4", (128, 128, 64, 8, 4, False, False)),
    ("tma 128x128x32 s4", (128, 128, 32, 8, 4, False, False)),
    ("tma persistent s3", (128, 128, 64, 8, 3, False, True)),
    ("tma persistent s4 K32", (128, 128, 32, 8, 4, False, True)),
    ("tma ws s3", (128, 128, 64, 8, 3, True, False)),
    ("tma persistent ws s3", (128, 128, 64, 8, 3, True, True)),
    ("tma persistent ws s3 4w", (128, 128, 64, 4, 3, True, True)),
    ("tma 128x256x64 s3", (128, 256, 64, 8, 3, False, False)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="norm,u")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    rows = []
    if "norm" in a.parts:
        rows += norm_rows([sh for sh in QWEN_SHAPES if sh != (1024, 4096)], _variants)
    if "u" not in a.parts:
        QWEN_SHAPES.clear()
    for d_out, d_in in QWEN_SHAPES:
        W = (torch.randn(d_out, d_in, device="cuda") * 0.02).to(torch.bfloat16)
        A = torch.randn(RANK, d_in, device="cuda") / d_in ** 0.5
        B = torch.randn(d_out, RANK, device="cuda") * 0.01
        parts = kn._split_parts(A, 3)
        ref = (B.double() * (W.double() @ A.double().T)).sum(1)
        cfg = kn._PRESPLIT_CFG
        su_def = kn._u_split(d_out, RANK, d_in, cfg, W.device)
        for su in sorted({1, su_def, 2, 4}):
            run, out = u_pointers(W, parts, B, su)
            run()
            base_sum = out.view(-1, d_out).sum(0)
            ms = graph_ms(run)
            row = {"shape": [d_out, d_in], "su": su, "variant": "pointer loads", "ms": ms,
                   "relerr": ((base_sum.double() - ref).norm() / ref.norm()).item()}
            print(json.dumps(row), flush=True)
            rows.append(row)
            for name, vcfg in VARIANTS:
                row = {"shape": [d_out, d_in], "su": su, "variant": name, "cfg": vcfg}
                try:
                    run2, out2 = u_tma(W, parts, B, su, vcfg)
                    run2()
                    torch.cuda.synchronize()
                    s2 = out2.view(-1, d_out).sum(0)
                    row["relerr"] = ((s2.double() - ref).norm() / ref.norm()).item()
                    row["max_diff_vs_pointers"] = (s2 - base_sum).abs().max().item()
                    row["same_partials"] = bool(out2.shape == out.shape and torch.equal(out2, out))
                    row["ms"] = graph_ms(run2)
                    row["speedup"] = ms / row["ms"]
                except Exception as e:  # noqa: BLE001 - report and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc(limit=1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
