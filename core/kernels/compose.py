"""Triton kernels for the DoRA output composition (forward, backward, deterministic magnitude-gradient reduction).

Same math and signatures as ``fastdora.ops.compose`` (``compose_fwd_eager`` / ``compose_bwd_eager``); see that
module's docstring. Design:

- Activations are viewed as ``[M, N]`` rows (``N = d_out``, the last dim). A row stride is passed to the kernels, so
  any layout whose last dim is unit-stride runs without a copy; row offsets are computed in int64 (tensors of
  ``>= 2**31`` elements work).
- Forward: one pass reading ``result``, ``lora`` (``bias``, ``base_delta``), writing ``y`` and, only when the
  magnitude needs a gradient, ``inner``. All math in fp32 registers, one rounding per output.
  ``g = m / max(norm, eps)`` is computed per column in fp32 with a correctly rounded division, which equals
  ``magnitude_scale`` (PyTorch's CUDA division is correctly rounded too).
- Backward: one pass reading ``dy`` (and ``inner``), writing ``d_result``, ``d_lora`` (``d_base_delta``) and a
  per-row-block fp32 partial of ``sum_tokens(dy * inner)`` (and ``sum_tokens(dy)`` for the bias) into a
  ``[n_row_blocks, N]`` buffer; the last program of each column block to finish (an int32 counter per column block,
  kept per stream and reset by that program) sums the partials in a fixed order (no atomics on the values: bitwise
  deterministic for a given shape and GPU) and applies ``1 / max(norm, eps)``: one launch per backward. While a CUDA
  graph is being captured a second small kernel does that sum instead. With ``dm_from_y`` (the whole-layer node's
  bias-free layers) the saved tensor is the output ``y = g * inner`` and the last stage divides by ``m`` instead.
- Block sizes are picked from the shape (no autotuning: the row split of the reduction must not depend on timing
  runs, and there is no warm-up cost); the benchmark ``benchmarks/kernels_bench.py`` sweeps the alternatives.
- fp64 inputs and layouts the kernels do not cover (broadcast operands, feature dim not last) take the exact eager
  path.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..config import SETTINGS as _S
from .. import _launch

_cdiv = _launch.cdiv  # module global: one lookup less on the launch path

# where launches register their templates for the C++ node (``fastdora.kernels.native`` while its node is active,
# set by :func:`set_template_registrar`); None: no node, nothing to register
_registrar = None


def set_template_registrar(registrar) -> None:
    """``registrar.register_fwd(...)`` / ``register_bwd(...)`` receive every later launch (None: stop)."""
    global _registrar
    _registrar = registrar

try:  # pragma: no cover - exercised wherever triton is installed
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover
    triton = None
    tl = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "compose_fwd", "compose_bwd", "fwd_supported", "bwd_supported"]


# --------------------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------------------

if AVAILABLE:

    @triton.jit
    def _scale_g(mag_ptr, norm_ptr, cols, cmask, eps):
        # g = m / max(norm, eps) in fp32, correctly rounded (== magnitude_scale); NaN norms propagate like clamp_min
        m = tl.load(mag_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        n = tl.load(norm_ptr + cols, mask=cmask, other=1.0).to(tl.float32)
        n = tl.maximum(n, eps, propagate_nan=tl.PropagateNan.ALL)
        return tl.math.div_rn(m, n)

    @triton.jit
    def _cast_to(x, ptr, SOFT_BF16: tl.constexpr):
        # fp32 -> the element type of ``ptr``, rounding to nearest even. SOFT_BF16 (CPU tensors, i.e. the Triton
        # interpreter, whose fp32->bf16 cast truncates) does the bf16 rounding with integer ops, as the GPU does.
        if ptr.dtype.element_ty == tl.float32:
            return x
        elif SOFT_BF16 and ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(ptr.dtype.element_ty)

    @triton.jit
    def _dora_fwd_kernel(
        res_ptr, lora_ptr, bd_ptr, bias_ptr, mag_ptr, norm_ptr, y_ptr, inner_ptr,
        M, N,
        stride_res, stride_lora, stride_bd, stride_y, stride_inner,
        scale, eps,
        HAS_BIAS: tl.constexpr, DELTA: tl.constexpr, SAVE_INNER: tl.constexpr, SOFT_BF16: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        mask = (rows < M)[:, None] & cmask[None, :]
        g = _scale_g(mag_ptr, norm_ptr, cols, cmask, eps)[None, :]
        r2 = rows[:, None]
        c2 = cols[None, :]
        res = tl.load(res_ptr + r2 * stride_res + c2, mask=mask, other=0.0).to(tl.float32)
        lora = tl.load(lora_ptr + r2 * stride_lora + c2, mask=mask, other=0.0).to(tl.float32)
        if DELTA:
            d = tl.load(bd_ptr + r2 * stride_bd + c2, mask=mask, other=0.0).to(tl.float32)
            inner = d + scale * lora
            y = res + (g - 1.0) * d + (g * scale) * lora
        else:
            if HAS_BIAS:
                b = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
                res = res - b
            inner = res + scale * lora
            y = g * inner
            if HAS_BIAS:
                y = y + b
        tl.store(y_ptr + r2 * stride_y + c2, _cast_to(y, y_ptr, SOFT_BF16), mask=mask)
        if SAVE_INNER:
            tl.store(inner_ptr + r2 * stride_inner + c2, _cast_to(inner, inner_ptr, SOFT_BF16), mask=mask)

    @triton.jit
    def _bwd_tile(
        dy, inner, r2, c2, mask, g, gs, acc_dm, acc_db,
        dres_ptr, dlora_ptr, dbd_ptr, stride_dres, stride_dlora, stride_dbd,
        DELTA: tl.constexpr, WRITE_DRES: tl.constexpr, WRITE_DLORA: tl.constexpr,
        NEED_DM: tl.constexpr, NEED_DB: tl.constexpr, SOFT_BF16: tl.constexpr,
    ):
        if WRITE_DLORA:
            tl.store(dlora_ptr + r2 * stride_dlora + c2, _cast_to(gs * dy, dlora_ptr, SOFT_BF16), mask=mask)
        if DELTA:
            tl.store(dbd_ptr + r2 * stride_dbd + c2, _cast_to((g - 1.0) * dy, dbd_ptr, SOFT_BF16), mask=mask)
            if WRITE_DRES:
                tl.store(dres_ptr + r2 * stride_dres + c2, _cast_to(dy, dres_ptr, SOFT_BF16), mask=mask)
        else:
            if WRITE_DRES:
                tl.store(dres_ptr + r2 * stride_dres + c2, _cast_to(g * dy, dres_ptr, SOFT_BF16), mask=mask)
        if NEED_DM:
            acc_dm += dy * inner
        if NEED_DB:
            acc_db += dy
        return acc_dm, acc_db

    @triton.jit
    def _dora_bwd_kernel(
        dy_ptr, inner_ptr, mag_ptr, norm_ptr,
        dres_ptr, dlora_ptr, dbd_ptr, part_dm_ptr, part_db_ptr, dm_ptr, db_ptr, count_ptr,
        M, N, rows_per_prog,
        stride_dy, stride_inner, stride_dres, stride_dlora, stride_dbd,
        scale, eps,
        DELTA: tl.constexpr, WRITE_DRES: tl.constexpr, WRITE_DLORA: tl.constexpr,
        NEED_DM: tl.constexpr, NEED_DB: tl.constexpr, SOFT_BF16: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr,
        FUSE_RED: tl.constexpr, BLOCK_P: tl.constexpr, DM_FROM_Y: tl.constexpr,
    ):
        # program (pid_m, pid_n): rows [pid_m * rows_per_prog, +rows_per_prog) x one BLOCK_N column block, in
        # BLOCK_M-row tiles; writes the gradients and one fp32 partial row of the magnitude (and bias) reduction.
        # FUSE_RED: the column block's last program to finish (counted in count_ptr[pid_n]) also sums the partial
        # rows (the second stage, without a second launch)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        g = _scale_g(mag_ptr, norm_ptr, cols, cmask, eps)[None, :]
        gs = g * scale
        c2 = cols[None, :]
        # 2-D fp32 accumulators, reduced over rows once at the end (fixed order: deterministic)
        acc_dm = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        row0 = pid_m.to(tl.int64) * rows_per_prog
        row_end = tl.minimum(row0 + rows_per_prog, M)
        rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
        if PREFETCH:
            # software pipelining: the loads of tile i+1 are issued before tile i is computed and stored
            mask = (rows < row_end)[:, None] & cmask[None, :]
            dy_nx = tl.load(dy_ptr + rows[:, None] * stride_dy + c2, mask=mask, other=0.0, eviction_policy=EVICT)
            if NEED_DM:
                in_nx = tl.load(inner_ptr + rows[:, None] * stride_inner + c2, mask=mask, other=0.0,
                                    eviction_policy=EVICT)
            else:
                in_nx = dy_nx
            for i in range(0, rows_per_prog, BLOCK_M):
                dy = dy_nx.to(tl.float32)
                inner = in_nx.to(tl.float32)
                r2 = rows[:, None]
                cur = mask
                rows = rows + BLOCK_M
                mask = (rows < row_end)[:, None] & cmask[None, :]
                dy_nx = tl.load(dy_ptr + rows[:, None] * stride_dy + c2, mask=mask, other=0.0, eviction_policy=EVICT)
                if NEED_DM:
                    in_nx = tl.load(inner_ptr + rows[:, None] * stride_inner + c2, mask=mask, other=0.0,
                                    eviction_policy=EVICT)
                else:
                    in_nx = dy_nx
                acc_dm, acc_db = _bwd_tile(
                    dy, inner, r2, c2, cur, g, gs, acc_dm, acc_db,
                    dres_ptr, dlora_ptr, dbd_ptr, stride_dres, stride_dlora, stride_dbd,
                    DELTA, WRITE_DRES, WRITE_DLORA, NEED_DM, NEED_DB, SOFT_BF16,
                )
        else:
            for i in range(0, rows_per_prog, BLOCK_M):
                r2 = rows[:, None]
                mask = (rows < row_end)[:, None] & cmask[None, :]
                dy = tl.load(dy_ptr + r2 * stride_dy + c2, mask=mask, other=0.0, eviction_policy=EVICT)
                dy = dy.to(tl.float32)
                if NEED_DM:
                    inner = tl.load(inner_ptr + r2 * stride_inner + c2, mask=mask, other=0.0, eviction_policy=EVICT)
                    inner = inner.to(tl.float32)
                else:
                    inner = dy
                acc_dm, acc_db = _bwd_tile(
                    dy, inner, r2, c2, mask, g, gs, acc_dm, acc_db,
                    dres_ptr, dlora_ptr, dbd_ptr, stride_dres, stride_dlora, stride_dbd,
                    DELTA, WRITE_DRES, WRITE_DLORA, NEED_DM, NEED_DB, SOFT_BF16,
                )
                rows = rows + BLOCK_M
        out = pid_m.to(tl.int64) * N + cols
        if NEED_DM:
            tl.store(part_dm_ptr + out, tl.sum(acc_dm, axis=0), mask=cmask)
        if NEED_DB:
            tl.store(part_db_ptr + out, tl.sum(acc_db, axis=0), mask=cmask)
        if FUSE_RED:
            n_parts = tl.num_programs(0)
            # every thread's partial stores precede the count (barrier, then a release of the counter at GPU scope);
            # the program that counts last acquires them all, so it sees every partial row
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == n_parts - 1:
                _reduce_cols(part_dm_ptr, part_db_ptr, mag_ptr, norm_ptr, dm_ptr, db_ptr, cols, cmask, n_parts, N, eps,
                             NEED_DM, NEED_DB, SOFT_BF16, BLOCK_P, BLOCK_N, ".cg", DM_FROM_Y)
                # back to zero for the next launch on this stream (launches on one stream run one after another)
                tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _reduce_cols(
        part_dm_ptr, part_db_ptr, mag_ptr, norm_ptr, dm_ptr, db_ptr, cols, cmask, n_parts, N, eps,
        NEED_DM: tl.constexpr, NEED_DB: tl.constexpr, SOFT_BF16: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CACHE: tl.constexpr, DM_FROM_Y: tl.constexpr,
    ):
        # second stage: sum the [n_parts, N] partials of columns ``cols`` over parts in a fixed order (deterministic,
        # no atomics on the values); BLOCK_P partial rows per load keep many loads in flight. CACHE: the partials'
        # load cache modifier (".cg": from L2, for partials other programs of the same launch wrote). DM_FROM_Y: the
        # first stage summed dy * y (the bias-free output y = g * inner) instead of dy * inner, and
        # dm = sum(dy * y) / m (= sum(dy * inner) / max(norm, eps), as g = m / max(norm, eps))
        acc_dm = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        acc_db = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for p0 in range(0, n_parts, BLOCK_P):
            prow = p0 + tl.arange(0, BLOCK_P)
            m = (prow < n_parts)[:, None] & cmask[None, :]
            off = prow.to(tl.int64)[:, None] * N + cols[None, :]
            if NEED_DM:
                acc_dm += tl.load(part_dm_ptr + off, mask=m, other=0.0, cache_modifier=CACHE)
            if NEED_DB:
                acc_db += tl.load(part_db_ptr + off, mask=m, other=0.0, cache_modifier=CACHE)
        if NEED_DM:
            if DM_FROM_Y:
                m = tl.load(mag_ptr + cols, mask=cmask, other=1.0).to(tl.float32)
                dm = tl.math.div_rn(tl.sum(acc_dm, axis=0), m)
            else:
                n = tl.load(norm_ptr + cols, mask=cmask, other=1.0).to(tl.float32)
                inv = tl.math.div_rn(1.0, tl.maximum(n, eps, propagate_nan=tl.PropagateNan.ALL))
                dm = tl.sum(acc_dm, axis=0) * inv
            tl.store(dm_ptr + cols, _cast_to(dm, dm_ptr, SOFT_BF16), mask=cmask)
        if NEED_DB:
            g = _scale_g(mag_ptr, norm_ptr, cols, cmask, eps)
            tl.store(db_ptr + cols, (1.0 - g) * tl.sum(acc_db, axis=0), mask=cmask)

    @triton.jit
    def _dora_reduce_kernel(
        part_dm_ptr, part_db_ptr, mag_ptr, norm_ptr, dm_ptr, db_ptr,
        n_parts, N, eps,
        NEED_DM: tl.constexpr, NEED_DB: tl.constexpr, SOFT_BF16: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DM_FROM_Y: tl.constexpr,
    ):
        # the second stage as a kernel of its own (where the backward cannot count its programs: see _counters)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        _reduce_cols(part_dm_ptr, part_db_ptr, mag_ptr, norm_ptr, dm_ptr, db_ptr, cols, cols < N, n_parts, N, eps,
                     NEED_DM, NEED_DB, SOFT_BF16, BLOCK_P, BLOCK_N, "", DM_FROM_Y)

    _FWD = _launch.Launcher(_dora_fwd_kernel)
    _BWD = _launch.Launcher(_dora_bwd_kernel)
    _RED = _launch.Launcher(_dora_reduce_kernel)


# --------------------------------------------------------------------------------------------------------------------
# block-size heuristics
# --------------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton interpreter (CPU tensors): few, large programs run fastest


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _fwd_config(M: int, N: int, device: torch.device) -> tuple[int, int, int]:
    if "fwd" in _S.compose_config:
        return _S.compose_config["fwd"]
    return _fwd_config_cached(M, N)


@functools.lru_cache(maxsize=4096)
def _fwd_config_cached(M: int, N: int) -> tuple[int, int, int]:
    block_n = min(_next_pow2(N), 1024)
    block_m = max(1, min(_next_pow2(M), 8192 // block_n))
    warps = 8 if block_m * block_n >= 8192 else 4
    return block_m, block_n, warps


def _bwd_config(M: int, N: int, device: torch.device) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, warps, rows_per_prog, prefetch): depends only on the shape and the GPU model, so the
    magnitude-gradient summation order is fixed (bitwise deterministic)."""
    if "bwd" not in _S.compose_config:
        return _bwd_config_cached(M, N, device)
    return _bwd_config_uncached(M, N, device)


@functools.lru_cache(maxsize=4096)
def _bwd_config_cached(M: int, N: int, device: torch.device) -> tuple[int, int, int, int, bool]:
    return _bwd_config_uncached(M, N, device)


def _bwd_config_uncached(M: int, N: int, device: torch.device) -> tuple[int, int, int, int, bool]:
    exact = False
    override = _S.compose_config.get("bwd")
    if override is not None:
        # (BLOCK_M, BLOCK_N, warps, programs per SM, prefetch[, exact]): exact = rows per program not rounded up to
        # whole BLOCK_M tiles, so the grid is exactly programs-per-SM x SMs
        block_m, block_n, warps, target, prefetch = override[:5]
        exact = len(override) > 5 and bool(override[5])
    else:
        # measured on the H200 (kernels_bench.py sweeps, 16384x4096 AMP): 64x128 tiles, 8 warps, no software
        # prefetch (the prefetching loop reached 81% of the copy bandwidth); a row loop sized for ~4 programs per
        # SM, rows per program not rounded to whole tiles (medians of 3 interleaved rounds, % of copy bandwidth,
        # AMP / bf16: 16384x4096 85.3 / 85.4 vs 84.7 / 84.7 with ~8 programs per SM; 8192x4096 77.5 vs 76.6;
        # 8192x12288 87.9 vs 87.8; 16384x12288 90.4 / 90.5 either way)
        block_n = min(_next_pow2(N), 128)
        block_m = max(1, min(_next_pow2(M), 8192 // block_n))
        warps = 8 if block_m * block_n >= 4096 else 4
        target = 4  # programs per SM
        prefetch = False
        exact = True
    n_col = _cdiv(N, block_n)
    tiles = _cdiv(M, block_m)
    row_blocks = max(1, min(tiles, (target * _num_sms(device)) // n_col))
    if exact:
        return block_m, block_n, warps, _cdiv(M, row_blocks), prefetch
    tiles_per_prog = _cdiv(tiles, row_blocks)
    return block_m, block_n, warps, tiles_per_prog * block_m, prefetch


# --------------------------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF_IO = (torch.bfloat16, torch.float16)
_CONTIG = torch.contiguous_format


def _rows(t: torch.Tensor, N: int) -> tuple[torch.Tensor, int]:
    """``(u, row_stride)``: ``u``'s data pointer starts an ``[M, N]`` matrix with unit column stride and the given row
    stride (the launchers pass only pointers and strides). A contiguous ``t`` is used as it is (no view: this runs
    several times per layer call); otherwise a view, or a copy only where no such view exists."""
    if t.is_contiguous():
        return t, N
    if t.stride(-1) != 1:
        return t.contiguous(), N
    t2 = t.reshape(-1, N)
    if t2.stride(-1) != 1:  # pragma: no cover - reshape of a unit-stride last dim keeps it
        t2 = t2.contiguous()
    return t2, t2.stride(0)


def _vec(t: torch.Tensor) -> torch.Tensor:
    # the launcher only reads the data pointer: no detach needed (saves host time on the hot path)
    return t if (t.dim() == 1 and t.is_contiguous()) else t.reshape(-1).contiguous()


def _kernel_ok(*tensors: Optional[torch.Tensor]) -> bool:
    for t in tensors:  # a plain loop: a generator expression costs several microseconds per call here
        if t is not None and t.dtype not in _KERNEL_DTYPES:
            return False
    return True


_COUNTERS: dict = {}  # (device index, stream) -> int32 program counters, all zero between launches


def _counters(t: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """Zeroed int32 counters (at least ``n``) for the fused second stage of a backward launched on ``t``'s device
    and current stream; each launch leaves them at zero (its last program per column block resets its counter), and
    launches on one stream run one after another, so one set per stream serves every launch. None while a CUDA graph
    is being captured (a graph replayed later may run beside eager launches): the two-kernel reduction then."""
    if t.is_cuda:
        if _launch.capturing():
            return None
        key = _launch.current_stream(t)
    else:
        key = (-1, 0)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = _COUNTERS[key] = torch.zeros(max(n, 256), dtype=torch.int32, device=t.device)
    return c


def fwd_supported(result, lora, magnitude, norm, bias, base_delta, out_dtype, feature_dim=-1) -> bool:
    """Whether :func:`compose_fwd` covers this composition (shapes, feature dim last, kernel dtypes); the caller
    runs the exact eager forward otherwise."""
    N = result.shape[-1] if result.dim() else 1
    return not (
        result.dim() == 0
        or feature_dim not in (-1, result.dim() - 1)
        or lora.shape != result.shape
        or (base_delta is not None and base_delta.shape != result.shape)
        or (bias is not None and bias.numel() != N)
        or magnitude.numel() != N
        or norm.numel() != N
        or not _kernel_ok(result, lora, base_delta, bias, magnitude, norm)
        or out_dtype not in _KERNEL_DTYPES
    )


def compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save_inner, feature_dim=-1):
    """Triton forward for a composition :func:`fwd_supported` covers; the contract of
    ``fastdora.ops.compose.compose_fwd_eager``."""
    N = result.shape[-1]
    inner_dtype = torch.promote_types(result.dtype, lora.dtype)
    y = torch.empty_like(result, dtype=out_dtype, memory_format=_CONTIG)
    inner = torch.empty_like(result, dtype=inner_dtype, memory_format=_CONTIG) if save_inner else None
    M = result.numel() // N if N else 0
    if M == 0 or N == 0:
        return y, inner
    (r2, rs), (l2, ls) = _rows(result, N), _rows(lora, N)
    d2, ds = _rows(base_delta, N) if base_delta is not None else (r2, rs)
    i2 = inner if inner is not None else y  # y and inner: fresh contiguous tensors, row stride N
    mag, nrm = _vec(magnitude), _vec(norm)
    b = _vec(bias) if bias is not None else mag
    block_m, block_n, warps = _fwd_config(M, N, result.device)
    grid = (_cdiv(M, block_m), _cdiv(N, block_n))
    tensors = (r2, l2, d2, b, mag, nrm, y, i2)
    ints, consts = (M, N, rs, ls, ds, N, N), (bias is not None, base_delta is not None, bool(save_inner),
                                               not result.is_cuda, block_m, block_n)
    with _launch.device_ctx(result):
        entry = _FWD(grid, tensors, ints, (float(scale), float(eps)), consts, warps)
    if _registrar is not None and base_delta is None:  # a launch template for the C++ node
        _registrar.register_fwd(
            _FWD, entry, grid, tensors, ints, (float(scale), float(eps)), consts, warps,
            (result, lora, bias, magnitude, norm, y, inner),
            (result.dtype, lora.dtype, out_dtype, magnitude.dtype, norm.dtype, None if bias is None else bias.dtype),
            save_inner, M, N,
        )
    return y, inner


def bwd_supported(dy, magnitude, norm, inner, result_dtype, lora_dtype, base_delta_dtype, need_dm,
                  feature_dim=-1) -> bool:
    """Whether :func:`compose_bwd` covers this backward; the caller runs the exact eager backward otherwise."""
    N = dy.shape[-1] if dy.dim() else 1
    return not (
        dy.dim() == 0
        or feature_dim not in (-1, dy.dim() - 1)
        or magnitude.numel() != N
        or norm.numel() != N
        or (need_dm and (inner is None or inner.shape != dy.shape))
        or not _kernel_ok(dy, magnitude, norm, inner)
        or result_dtype not in _KERNEL_DTYPES
        or lora_dtype not in _KERNEL_DTYPES
        or (base_delta_dtype is not None and base_delta_dtype not in _KERNEL_DTYPES)
    )


def compose_bwd(
    dy, magnitude, norm, scale, eps, inner, delta_form, result_dtype, lora_dtype, base_delta_dtype,
    need_dm, need_dbias, feature_dim=-1, need_dresult=True, need_dlora=True, dm_from_y=False,
):
    """Triton backward for a backward :func:`bwd_supported` covers; the contract of
    ``fastdora.ops.compose.compose_bwd_eager``. ``need_dresult`` / ``need_dlora`` let callers skip outputs nobody
    asked for (returned as ``None``). ``dm_from_y``: ``inner`` holds the bias-free output ``y = g * inner``."""
    N = dy.shape[-1]
    need_dbias = bool(need_dbias)
    dm_from_y = bool(dm_from_y) and bool(need_dm)
    dev = dy.device
    M = dy.numel() // N if N else 0
    d_lora = torch.empty_like(dy, dtype=lora_dtype, memory_format=_CONTIG) if need_dlora else None
    d_bd = torch.empty_like(dy, dtype=base_delta_dtype, memory_format=_CONTIG) if delta_form else None
    if delta_form:
        # d_result = dy: no kernel work when the dtype already matches (same as ``dy.to(result_dtype)``)
        write_dres = need_dresult and dy.dtype != result_dtype
        d_result = (dy if dy.dtype == result_dtype else None) if need_dresult else None
    else:
        write_dres = need_dresult
        d_result = None
    if write_dres:
        d_result = torch.empty_like(dy, dtype=result_dtype, memory_format=_CONTIG)
    dm = torch.empty_like(magnitude, memory_format=_CONTIG) if need_dm else None
    d_bias = torch.empty(N, dtype=torch.float32, device=dev) if need_dbias else None
    if M == 0 or N == 0:
        if dm is not None:
            dm.zero_()
        if d_bias is not None:
            d_bias.zero_()
        return d_result, d_lora, d_bd, dm, d_bias
    dy2, dys = _rows(dy, N)
    in2, ins = _rows(inner, N) if need_dm else (dy2, dys)
    # outputs: fresh contiguous tensors (row stride N); an output not written gets dy's pointer (never stored to)
    dres2, dres_s = (d_result, N) if write_dres else (dy2, dys)
    dl2, dl_s = (d_lora, N) if d_lora is not None else (dy2, dys)
    dbd2, dbd_s = (d_bd, N) if d_bd is not None else (dy2, dys)
    mag, nrm = _vec(magnitude), _vec(norm)
    block_m, block_n, warps, rows_per_prog, prefetch = _bwd_config(M, N, dev)
    n_parts = _cdiv(M, rows_per_prog)
    part_dm = torch.empty((n_parts, N), dtype=torch.float32, device=dev) if need_dm else mag
    part_db = torch.empty((n_parts, N), dtype=torch.float32, device=dev) if need_dbias else mag
    n_col = _cdiv(N, block_n)
    grid = (n_parts, n_col)
    soft = not dy.is_cuda
    reduce = need_dm or need_dbias
    rp = min(32, _next_pow2(n_parts))  # partial rows per load of the second stage
    counts = _counters(dy, n_col) if (reduce and _S.bwd_fuse_reduce) else None
    dm_out = dm if dm is not None else mag
    db_out = d_bias if d_bias is not None else mag
    tensors = (dy2, in2, mag, nrm, dres2, dl2, dbd2, part_dm, part_db, dm_out, db_out,
               counts if counts is not None else mag)
    ints = (M, N, rows_per_prog, dys, ins, dres_s, dl_s, dbd_s)
    consts = (bool(delta_form), write_dres, d_lora is not None, bool(need_dm), need_dbias, soft, prefetch,
              block_m, block_n, _S.bwd_evict, counts is not None, rp if counts is not None else 1, dm_from_y)
    # the register cap keeps two 8-warp programs per SM for the fused epilogue where every tensor is half precision;
    # with an fp32 d_lora / dy (bf16 result, fp32 adapters without autocast) the cap cost 2.2x (37-42% of the copy
    # bandwidth vs 81-91% uncapped, kernels_bench.py on the H200), so it applies to the all-half case only
    half_io = dy.dtype in _HALF_IO and result_dtype in _HALF_IO and lora_dtype in _HALF_IO
    maxnreg = _S.bwd_maxnreg if (counts is not None and half_io) else None
    stages = _S.bwd_stages
    with _launch.device_ctx(dy):
        entry = _BWD(grid, tensors, ints, (float(scale), float(eps)), consts, warps, stages, maxnreg=maxnreg)
        if reduce and counts is None:
            rb = min(64, _next_pow2(N))
            _RED(
                (_cdiv(N, rb),),
                (part_dm, part_db, mag, nrm, dm_out, db_out),
                (n_parts, N),
                (float(eps),),
                (bool(need_dm), need_dbias, soft, rp, rb, dm_from_y),
                4,
            )
    if _registrar is not None and not (reduce and counts is None) and not delta_form and not need_dbias:
        _registrar.register_bwd(  # a launch template for the C++ node
            _BWD, entry, grid, tensors, ints, (float(scale), float(eps)), consts, warps, stages, maxnreg,
            (dy2, in2 if need_dm else None, mag, nrm, d_result if write_dres else None, d_lora,
             part_dm if need_dm else None, dm, counts),
            (dy.dtype, inner.dtype if need_dm else None, result_dtype, lora_dtype, magnitude.dtype, norm.dtype),
            int(write_dres) | int(d_lora is not None) << 1 | int(bool(need_dm)) << 2 | int(dm_from_y) << 3,
            M, N, n_parts,
            n_col if counts is not None else 0,
        )
    return d_result, d_lora, d_bd, dm, d_bias
