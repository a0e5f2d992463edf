"""Triton factored DoRA row norm (same contract as ``fastdora.ops.norm.factored_norm_eager``).

    ||W + sBA||^2_row = ||W||^2_row + 2s * rowsum(B * U) + s^2 * rowsum((B @ G) * B),  U = W A^T, G = A A^T

Three launches per module (four when G is split), no temporaries beyond the fp32 results:

1. ``_norm_gram_kernel`` over ``X = A``: ``G = A A^T`` ``[r, r]`` fp32. Its few output tiles each loop over all of
   ``d_in``, so the K range is split over programs (partial G's in U's not yet written buffer, then one fixed-order
   sum: deterministic, no extra memory).
2. ``_norm_gram_kernel`` over ``X = W``: ``U = W A^T`` ``[d_out, r]`` fp32 and, unless a cached ``base_sq`` is given,
   ``||W||^2`` per row, reading ``W`` once per rank tile in its storage dtype (any strides: transposed views work).
   Optionally as the transposed tile ``A W^T`` (``_TRANS``), with the split ``A`` parts as the register operand.
3. ``_norm_combine_kernel``: ``norm = sqrt(max(base + 2s*rowsum(B*U) + s^2*rowsum((B G)*B), 0))``.

Precision (everything accumulates in fp32):
- bf16 ``W`` with fp32 ``A``: ``A`` is split in registers into ``hi + mid + lo`` (each bf16), three bf16 tensor-core
  products (``W`` is exact in bf16, so ``U`` keeps ~24 bits of ``A``'s mantissa: fp32-level, like the eager path).
- everything else (fp32 / fp16 ``W``, half-precision adapters, and ``G``): fp32 operands (half-precision tiles are
  upcast in registers, no copies) with ``input_precision="tf32x3"``: fp32-level accuracy on tensor cores. A single
  bf16 or tf32 tensor-core product accumulated over ``d_in`` measured ~1e-5 relative norm error on the H200 even
  for exactly representable (half-precision) operands, so it is not used.
The working set is ``U`` + ``G`` + two ``[d_out]`` vectors: no fp32 copy of ``W``, no ``[d_out, d_in]`` temporary.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import _launch

try:  # pragma: no cover
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover
    triton = None
    tl = None
    AVAILABLE = False

__all__ = ["supports", "factored_norm_triton"]

_W_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# dot modes of _norm_gram_kernel
_MODE_FP32 = 0  # both operands to fp32, PREC input precision
_MODE_SPLIT = 1  # half-precision X, fp32 A split into hi + mid + lo in X's dtype

if AVAILABLE:

    @triton.jit
    def _norm_gram_kernel(
        x_ptr, a_ptr, out_ptr, base_ptr,
        ROWS, R, K, K_SPLIT,
        stride_xr, stride_xk, stride_ar, stride_ak, stride_out, stride_split,
        NEED_BASE: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
        TRANS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        NPARTS: tl.constexpr,
    ):
        # out[ROWS, R] = X[ROWS, K] @ A[R, K]^T (fp32 accumulation) over the K range of split program_id(1)
        # (out + split * stride_split; K_SPLIT is a multiple of BLOCK_K); base[ROWS] = rowsum(X^2) when NEED_BASE.
        # TRANS computes the transposed tile A @ X^T: the split A parts are the left operand, which Hopper's wgmma
        # reads from registers, so only X goes through shared memory.
        pid = tl.program_id(0)
        split = tl.program_id(1)
        n_r = tl.cdiv(R, BLOCK_R)
        pid_o = pid // n_r
        pid_r = pid % n_r
        offs_o = pid_o.to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O).to(tl.int64)
        offs_r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        omask = offs_o < ROWS
        rmask = offs_r < R
        if TRANS:
            acc = tl.zeros([BLOCK_R, BLOCK_O], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_O, BLOCK_R], dtype=tl.float32)
        base = tl.zeros([BLOCK_O], dtype=tl.float32)
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
            kmask = offs_k < k_hi
            if TRANS:
                x = tl.load(  # X^T tile [BLOCK_K, BLOCK_O]
                    x_ptr + offs_o[None, :] * stride_xr + offs_k[:, None] * stride_xk,
                    mask=omask[None, :] & kmask[:, None], other=0.0,
                )
                a = tl.load(  # [BLOCK_R, BLOCK_K]
                    a_ptr + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                    mask=rmask[:, None] & kmask[None, :], other=0.0,
                )
            else:
                x = tl.load(  # [BLOCK_O, BLOCK_K]
                    x_ptr + offs_o[:, None] * stride_xr + offs_k[None, :] * stride_xk,
                    mask=omask[:, None] & kmask[None, :], other=0.0,
                )
                a = tl.load(  # A^T tile [BLOCK_K, BLOCK_R]
                    a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                    mask=rmask[None, :] & kmask[:, None], other=0.0,
                )
            if NEED_BASE:
                xf = x.to(tl.float32)
                if TRANS:
                    base += tl.sum(xf * xf, axis=0)
                else:
                    base += tl.sum(xf * xf, axis=1)
            if MODE == 1:
                # A as NPARTS half-precision parts in X's dtype (hi + mid + lo: ~24 mantissa bits of an fp32 A), one
                # tensor-core product each; NPARTS == 1 with A already in X's dtype: A itself, exact, one product
                if NPARTS == 1:
                    hi = a.to(x.dtype)
                else:
                    a32 = a.to(tl.float32)
                    hi = a32.to(x.dtype)
                    r1 = a32 - hi.to(tl.float32)
                    mid = r1.to(x.dtype)
                    if NPARTS == 3:
                        lo = (r1 - mid.to(tl.float32)).to(x.dtype)
                if UPCAST:
                    # Triton interpreter (CPU tensors): fp32 dots (its half-precision dot is unreliable); the
                    # products of the exact half-precision operands equal the tensor-core ones
                    xu = x.to(tl.float32)
                    if TRANS:
                        if NPARTS == 3:
                            acc = tl.dot(lo.to(tl.float32), xu, acc, input_precision="ieee")
                        if NPARTS >= 2:
                            acc = tl.dot(mid.to(tl.float32), xu, acc, input_precision="ieee")
                        acc = tl.dot(hi.to(tl.float32), xu, acc, input_precision="ieee")
                    else:
                        if NPARTS == 3:
                            acc = tl.dot(xu, lo.to(tl.float32), acc, input_precision="ieee")
                        if NPARTS >= 2:
                            acc = tl.dot(xu, mid.to(tl.float32), acc, input_precision="ieee")
                        acc = tl.dot(xu, hi.to(tl.float32), acc, input_precision="ieee")
                elif TRANS:
                    if NPARTS == 3:
                        acc = tl.dot(lo, x, acc)
                    if NPARTS >= 2:
                        acc = tl.dot(mid, x, acc)
                    acc = tl.dot(hi, x, acc)
                else:
                    if NPARTS == 3:
                        acc = tl.dot(x, lo, acc)
                    if NPARTS >= 2:
                        acc = tl.dot(x, mid, acc)
                    acc = tl.dot(x, hi, acc)
            elif UPCAST:
                if TRANS:
                    acc = tl.dot(a.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
            elif TRANS:
                acc = tl.dot(a.to(tl.float32), x.to(tl.float32), acc, input_precision=PREC)
            else:
                acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision=PREC)
        out_base = out_ptr + split.to(tl.int64) * stride_split
        if TRANS:
            tl.store(
                out_base + offs_o[None, :] * stride_out + offs_r[:, None], acc, mask=rmask[:, None] & omask[None, :]
            )
        else:
            tl.store(
                out_base + offs_o[:, None] * stride_out + offs_r[None, :], acc, mask=omask[:, None] & rmask[None, :]
            )
        if NEED_BASE:
            if pid_r == 0:
                tl.store(base_ptr + offs_o, base, mask=omask)

    @triton.jit
    def _norm_combine_kernel(
        u_ptr, g_ptr, b_ptr, base_ptr, norm_ptr,
        D, R,
        stride_bo, stride_br,
        two_s, s_sq,
        PREC: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        offs_o = tl.program_id(0).to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O).to(tl.int64)
        omask = offs_o < D
        cross = tl.zeros([BLOCK_O], dtype=tl.float32)
        quad = tl.zeros([BLOCK_O], dtype=tl.float32)
        for j0 in range(0, R, BLOCK_R):
            offs_j = j0 + tl.arange(0, BLOCK_R).to(tl.int64)
            jmask = offs_j < R
            m2 = omask[:, None] & jmask[None, :]
            bj = tl.load(b_ptr + offs_o[:, None] * stride_bo + offs_j[None, :] * stride_br, mask=m2, other=0.0)
            bj = bj.to(tl.float32)
            uj = tl.load(u_ptr + offs_o[:, None] * R + offs_j[None, :], mask=m2, other=0.0)
            cross += tl.sum(bj * uj, axis=1)
            bg = tl.zeros([BLOCK_O, BLOCK_R], dtype=tl.float32)
            for k0 in range(0, R, BLOCK_R):
                offs_k = k0 + tl.arange(0, BLOCK_R).to(tl.int64)
                kmask = offs_k < R
                bk = tl.load(
                    b_ptr + offs_o[:, None] * stride_bo + offs_k[None, :] * stride_br,
                    mask=omask[:, None] & kmask[None, :], other=0.0,
                ).to(tl.float32)
                gk = tl.load(g_ptr + offs_k[:, None] * R + offs_j[None, :], mask=kmask[:, None] & jmask[None, :],
                             other=0.0)
                bg = tl.dot(bk, gk, bg, input_precision=PREC)
            quad += tl.sum(bg * bj, axis=1)
        base = tl.load(base_ptr + offs_o, mask=omask, other=0.0)
        sq = base + two_s * cross + s_sq * quad
        tl.store(norm_ptr + offs_o, tl.sqrt_rn(tl.maximum(sq, 0.0)), mask=omask)


if AVAILABLE:
    _GRAM = _launch.Launcher(_norm_gram_kernel)
    _COMBINE = _launch.Launcher(_norm_combine_kernel)


def supports(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor) -> bool:
    """2-D CUDA operands of fp32/bf16/fp16 with matching shapes (fp64 and anything else: eager)."""
    if not AVAILABLE:
        return False
    if weight.dim() != 2 or lora_A.dim() != 2 or lora_B.dim() != 2:
        return False
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    if lora_A.shape[1] != d_in or tuple(lora_B.shape) != (d_out, r) or min(d_out, d_in, r) == 0:
        return False
    if any(t.dtype not in _W_DTYPES for t in (weight, lora_A, lora_B)):
        return False
    return weight.device == lora_A.device == lora_B.device


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# benchmarks/kernels_bench.py may set these to sweep configurations: {mode or "G": (BLOCK_O, BLOCK_R, BLOCK_K, warps,
# stages[, trans])}; {"G": split count of G = A A^T}
_CONFIG_OVERRIDE: dict = {}
_SPLIT_OVERRIDE: dict = {}
# U = W A^T as the transposed tile A @ W^T (split A parts as wgmma's register operand), per dot mode. Measured on
# the H200 (benchmarks/results/h200x2_2026-11-30_s10/norm_variants.json, Qwen3-8B shapes, r=384): split mode
# 128x128x32 (8 warps, 4 stages) transposed 0.13 / 0.13 / 0.38 / 0.37 ms vs 0.23 / 0.23 / 0.46 / 0.68 ms in row tiles
# for 4096x4096 / 1024x4096 / 12288x4096 / 4096x12288, same error (1.4e-7 .. 2.2e-7). Transposed tiles with
# BLOCK_K = 64 gave ~1e-3 relative errors on Triton 3.6 and are not used; fp32 mode gains < 7%: row tiles kept.
_TRANS = {_MODE_SPLIT: True, _MODE_FP32: False}
# Products per K block in the split mode (bf16 W, fp32 A): 3 = hi + mid + lo (fp32-level). Benchmarks may set 2.
_SPLIT_PARTS = 3
# W and A in the same half dtype: one tensor-core product (True) or fp32 operands with tf32x3 (False)
_ONE_PRODUCT_HALF = False
_HALF = (torch.bfloat16, torch.float16)
_TRANS_SPLIT_CFG = (128, 128, 32, 8, 4, True)


def _gram_config(rows: int, R: int, device: torch.device, mode: int, gram_of_a: bool, nparts: int = 3):
    """(BLOCK_O, BLOCK_R, BLOCK_K, warps, stages, trans), from the sweep in benchmarks/results/kernels_h200_run2.json
    ("norm_sweep", 8192x8192): large row tiles win as long as the grid still covers about half the SMs (split mode
    256x128x64: 0.45 ms vs 0.81 ms for 64x128x64; fp32 mode 128x128x32: 1.26 ms vs 1.35 ms)."""
    one = mode == _MODE_SPLIT and nparts == 1  # one product of exact half-precision operands
    key = ("G" if gram_of_a else mode) if not one else ("G1" if gram_of_a else "one")
    if key in _CONFIG_OVERRIDE:
        cfg = tuple(_CONFIG_OVERRIDE[key])
        return cfg if len(cfg) == 6 else cfg + (False,)
    if one:
        if gram_of_a:
            b = min(32, max(16, _next_pow2(R)))
            return b, b, 32, 4, 3, True
        return _TRANS_SPLIT_CFG
    if gram_of_a:  # G = A A^T: r x r outputs only, small tiles for parallelism (and split over K, see _g_split)
        b = min(32, max(16, _next_pow2(R)))
        return b, b, 64, 4, 3, False
    if mode == _MODE_SPLIT and _TRANS[mode]:
        return _TRANS_SPLIT_CFG  # the one measured configuration, for every shape (rows and rank tiles masked)
    block_r = min(128, max(16, _next_pow2(R)))
    n_r = _launch.cdiv(R, block_r)
    cands = (256, 128, 64, 32, 16) if mode == _MODE_SPLIT else (128, 64, 32, 16)
    block_o = 16
    for cand in cands:
        if _launch.cdiv(rows, cand) * n_r * 2 >= _num_sms(device):
            block_o = cand
            break
    block_o = max(16, min(block_o, _next_pow2(rows)))
    block_k = 64 if mode == _MODE_SPLIT else 32
    warps = 8 if block_o * block_r >= 128 * 128 else 4
    return block_o, block_r, block_k, warps, 3, _TRANS[mode]


def _g_split(R: int, K: int, capacity: int, device: torch.device) -> int:
    """Programs over K for G = A A^T. G has only (r/32)^2 tiles (144 at r=384), each a long, latency-bound loop over
    d_in: split K so that about 4 programs per SM run, each at least 2 K blocks long, with the partial G's fitting in
    ``capacity`` fp32 elements (U's buffer, unused until U is computed: no extra memory)."""
    if "G" in _SPLIT_OVERRIDE:
        return max(1, min(int(_SPLIT_OVERRIDE["G"]), capacity // (R * R)))
    b, _, block_k = _gram_config(R, R, device, _MODE_FP32, True)[:3]
    tiles = _launch.cdiv(R, b) ** 2
    want = _launch.cdiv(4 * _num_sms(device), tiles)
    return max(1, min(want, K // (2 * block_k), capacity // (R * R), 64))


def _gram(x: torch.Tensor, a: torch.Tensor, out: torch.Tensor, base: Optional[torch.Tensor], upcast: bool,
          gram_of_a: bool = False, split: int = 1) -> int:
    """out = x @ a^T (fp32), and base = rowsum(x^2) when given. ``split > 1`` (G only): ``out`` is
    ``[split, rows, R]`` contiguous and receives the partial products of up to ``split`` equal K ranges; returns the
    number of ranges used (K ranges are whole BLOCK_K multiples, so it can be smaller)."""
    rows, K = x.shape
    R = a.shape[0]
    nparts = 3
    if x.dtype == torch.bfloat16 and a.dtype == torch.float32 and not gram_of_a:
        mode, nparts = _MODE_SPLIT, _SPLIT_PARTS
    elif _ONE_PRODUCT_HALF and x.dtype == a.dtype and x.dtype in _HALF:
        # both operands exact in the same half dtype: one tensor-core product (A as the register operand)
        mode, nparts = _MODE_SPLIT, 1
    else:
        # fp32 operands (half-precision tiles upcast in registers) with tf32x3. Measured on the H200
        # (benchmarks/results/kernels_h200_run{1,2,3}.json, tests/test_kernels_gpu.py): a single bf16 or tf32
        # tensor-core product accumulated over d_in gave ~1e-5 relative norm error even on exactly representable
        # operands, tf32x3 and the bf16 hi/mid/lo split stay at fp32 level (~1e-7). Re-measured in session 10 for
        # bf16/fp16 W and A (benchmarks/results/h200x2_2026-11-30_s10/gpu_tests_half_direct.log): one half-precision
        # product per K block, chained through the accumulator or added to it per block (same time and error: the
        # add was probably folded back into the chain), is 6.6x faster (0.144 vs 0.95 ms at 8192x8192 r=384) but
        # had 3e-5..7e-5 relative norm error vs eager 4e-8..7e-8 in the GPU envelope tests: not used.
        mode = _MODE_FP32
    prec = "tf32x3"
    block_o, block_r, block_k, warps, stages, trans = _gram_config(rows, R, x.device, mode, gram_of_a, nparts)
    k_split = _launch.cdiv(_launch.cdiv(K, split), block_k) * block_k
    split = _launch.cdiv(K, k_split)
    out2 = out if out.dim() == 2 else out[0]
    grid = (_launch.cdiv(rows, block_o) * _launch.cdiv(R, block_r), split)
    _GRAM(
        grid,
        (x, a, out, base if base is not None else out),
        (rows, R, K, k_split, x.stride(0), x.stride(1), a.stride(0), a.stride(1), out2.stride(0), rows * R),
        (),
        (base is not None, mode, prec, upcast, bool(trans), block_o, block_r, block_k, nparts),
        warps,
        stages,
    )
    return split


def factored_norm_triton(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    base_sq: Optional[torch.Tensor] = None,
    budget_bytes: int = 16 << 20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(norm, base_sq)``, both fp32 ``[d_out]``. ``budget_bytes`` is accepted for interface parity with
    the eager path; the kernels never allocate more than ``U``, ``G`` and two ``[d_out]`` vectors."""
    if not supports(weight, lora_A, lora_B):
        from ..ops.norm import factored_norm_eager

        return factored_norm_eager(weight, lora_A, lora_B, scale, base_sq, budget_bytes)
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    dev = weight.device
    upcast = not weight.is_cuda  # CPU tensors run only under the Triton interpreter
    with torch.no_grad(), _launch.device_ctx(weight):
        W, A, B = weight.detach(), lora_A.detach(), lora_B.detach()
        U = torch.empty((d_out, r), dtype=torch.float32, device=dev)
        G = torch.empty((r, r), dtype=torch.float32, device=dev)
        norm = torch.empty(d_out, dtype=torch.float32, device=dev)
        need_base = base_sq is None
        if need_base:
            base = torch.empty(d_out, dtype=torch.float32, device=dev)
        else:
            base = base_sq.detach().reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
        split = _g_split(r, d_in, d_out * r, dev)
        if split > 1:  # partial G's in U's buffer (written by the U pass afterwards), summed in a fixed order
            parts = U.view(-1)[: split * r * r].view(split, r, r)
            split = _gram(A, A, parts, None, upcast, gram_of_a=True, split=split)
            torch.sum(parts[:split], dim=0, out=G)
        else:
            _gram(A, A, G, None, upcast, gram_of_a=True)
        _gram(W, A, U, base if need_base else None, upcast)
        block_r = min(64, max(16, _next_pow2(r)))
        block_o = 64 if d_out >= 64 * _num_sms(dev) else 32
        s = float(scale)
        _COMBINE(
            (_launch.cdiv(d_out, block_o),),
            (U, G, B, base, norm),
            (d_out, r, B.stride(0), B.stride(1)),
            (2.0 * s, s * s),
            ("tf32x3", block_o, block_r),
            4,
        )
    return norm, base
