"""Triton factored DoRA row norm (same contract as ``fastdora.ops.norm.factored_norm_eager``).

    ||W + sBA||^2_row = ||W||^2_row + 2s * rowsum(B * U) + s^2 * rowsum((B @ G) * B),  U = W A^T, G = A A^T

Four launches per module (plus, for bf16 W with fp32 A, one parts split and one U launch per K chunk of the U pass),
no temporaries beyond the fp32 results:

1. ``_norm_gram_kernel`` over ``X = A`` (``SYM``): ``G = A A^T`` ``[r, r]`` fp32 from the tiles on and above the
   diagonal (21 of 36 at r=384). Its few output tiles each loop over all of ``d_in``, so the K range is split over
   programs: their partial tiles, packed (at most U's size), are summed in a fixed order and mirrored into ``G`` by
   ``_g_sum_kernel``.
2. ``_norm_gram_kernel`` over ``X = W`` with ``CROSS``: the tiles of ``U = W A^T`` are reduced at once to the cross
   term's partial sums ``rowsum(B * U_tile)`` per rank tile and K range (``[K ranges * rank tiles, d_out]``; U itself is
   never stored), and, unless a cached ``base_sq`` is given, ``||W||^2``'s partial sums. ``W`` is read in its storage
   dtype (any strides: transposed views work), as the transposed tile ``A W^T`` (A's parts are wgmma's register
   operand). The K range is split when the grid has few tiles (k/v projections). The same programs compute the
   tiles of ``B G`` (its rank chunks dealt out over the K ranges) and write the quadratic term's partial sums
   ``rowsum(B * (B G)_tile)`` too (``Settings.norm_quad_in_u``). For bf16 W with fp32 A on Hopper or newer, where TMA
   can address W (unit column stride, 16-byte aligned rows), the pre-split pass runs as ``_norm_u_tma_kernel`` instead
   (W and A's parts loaded by the tensor-memory accelerator; B G from G's bf16 parts, which ``_g_sum_kernel`` writes
   next to G). Run in K chunks (the parts buffer's size), every chunk adds its partial sums into the first chunk's rows.
3. ``_norm_combine_kernel``: sums the partials in a fixed order, ``norm = sqrt(max(base + 2s*cross + s^2*quad, 0))``
   (without ``Settings.norm_quad_in_u`` it computes ``quad = rowsum((B G)*B)`` itself, in d_out / 32..64 programs).

Precision (everything accumulates in fp32; every path is run-to-run bitwise deterministic):
- bf16 ``W`` with fp32 ``A``: ``A`` as ``hi + mid + lo`` (each bf16), three bf16 tensor-core products (``W`` is exact in
  bf16, so ``U`` keeps ~24 bits of ``A``'s mantissa). The parts are split once into a ``[3, r, d_in]`` bf16 copy
  (``_MODE_PRESPLIT``; per K chunk, so that the working set stays within the limit) or, where even 6 chunks would not
  fit (d_in well above d_out), by every U program in registers (``_MODE_SPLIT``).
- ``W`` and ``A`` in the same half dtype: one tensor-core product of the exact operands.
- everything else (fp32 / fp16 ``W`` with fp32 ``A``): fp32 operands with ``input_precision="tf32x3"``.
- The tensor cores' own accumulation is restarted every K block and the block results are added with fp32 adds: over
  long chains it measured less exact (one bf16 product chained over d_in: 5e-5 .. 3e-4 relative norm error, and not
  reproducible run to run, on the H200 with Triton 3.6; restarted: 3.7e-8 .. 4e-8, eager 3.8e-8 .. 4.6e-8). Chained
  on row tiles it is reproducible and 8-13% faster, but still loses precision with the chain's length (G chained over
  128 K blocks: 2.2e-5 relative error, over 4: 9.6e-7, restarted 1.0e-7 .. 1.6e-7; see ``_ACC_DEFAULT``).
- ``G`` (fp32 ``A``): both operands split into bf16 ``hi + mid + lo``, six tensor-core products (every product down
  to 2^-16 of the leading one), accumulation restarted every K block as above. ``B G`` (U pass) likewise: ``G`` as
  bf16 parts, ``B`` exact (bf16) or split, 3 or 6 products per rank chunk, restarted per chunk. Where the
  quadratic term dominates the norm, tf32x3 in G and B G measured 3.4x eager's error. All modes measured within 2x
  eager's relative error (tests/kernels/test_kernels_gpu.py). In the combine kernel (``Settings.norm_quad_in_u`` off)
  only a bf16 ``B`` uses the split by default (3 products, 8-28% faster than fp32 FMAs there); fp32 ``B`` uses fp32
  FMAs.
The working set is at most ``U``'s size (partial G's) + ``G`` + a few ``[d_out]`` vectors: no fp32 copy of ``W``, no
``[d_out, d_in]`` temporary.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..config import SETTINGS as _S
from .. import _launch

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
_MODE_SPLIT2 = 2  # fp32 X and A (G = A A^T), both split into bf16 hi + mid + lo, six products
_MODE_PRESPLIT = 3  # as _MODE_SPLIT, with A's parts split once beforehand (_split_parts_kernel) and loaded as bf16

if AVAILABLE:

    @triton.jit
    def _dot(p, q, acc, UPCAST: tl.constexpr):
        """acc + p @ q on the tensor cores; UPCAST (Triton interpreter, CPU tensors): an fp32 dot of the same operands
        (the interpreter's half-precision dot is unreliable; products of exact half-precision operands are exact in
        fp32, as on the tensor cores)."""
        if UPCAST:
            return tl.dot(p.to(tl.float32), q.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(p, q, acc)

    @triton.jit
    def _split3(v, dt: tl.constexpr):
        """v (any float dtype) as hi + mid + lo in dtype dt (bf16: ~24 mantissa bits of an fp32 v)."""
        v32 = v.to(tl.float32)
        hi = v32.to(dt)
        r1 = v32 - hi.to(tl.float32)
        mid = r1.to(dt)
        lo = (r1 - mid.to(tl.float32)).to(dt)
        return hi, mid, lo

    @triton.jit
    def _dot6(ph, pm, pl, qh, qm, ql, acc, UPCAST: tl.constexpr):
        """acc + (ph + pm + pl) @ (qh + qm + ql) to ~fp32 level: the six products down to 2^-16 of the leading one,
        smallest first (hi.lo, lo.hi, mid.mid, hi.mid, mid.hi, hi.hi)."""
        acc = _dot(ph, ql, acc, UPCAST)
        acc = _dot(pl, qh, acc, UPCAST)
        acc = _dot(pm, qm, acc, UPCAST)
        acc = _dot(ph, qm, acc, UPCAST)
        acc = _dot(pm, qh, acc, UPCAST)
        return _dot(ph, qh, acc, UPCAST)

    @triton.jit
    def _parts_dots(x, hi, mid, lo, acc, UPCAST: tl.constexpr, TRANS: tl.constexpr, NPARTS: tl.constexpr):
        """acc + X (hi + mid + lo)^T (the first NPARTS parts) or, TRANS, (hi + mid + lo) X^T: one tensor-core product
        per part, smallest first (the largest lands on the small ones' sum)."""
        if TRANS:  # the A parts as the left operand
            if NPARTS == 3:
                acc = _dot(lo, x, acc, UPCAST)
            if NPARTS >= 2:
                acc = _dot(mid, x, acc, UPCAST)
            acc = _dot(hi, x, acc, UPCAST)
        else:
            if NPARTS == 3:
                acc = _dot(x, lo, acc, UPCAST)
            if NPARTS >= 2:
                acc = _dot(x, mid, acc, UPCAST)
            acc = _dot(x, hi, acc, UPCAST)
        return acc

    @triton.jit
    def _tri_tile(pid, n):
        """(row tile, column tile) of the pid-th tile on or above the diagonal of an n x n tile grid, row by row."""
        t = pid
        i = pid * 0
        left = n
        while t >= left:
            t -= left
            i += 1
            left -= 1
        return i, i + t

    @triton.jit
    def _gram_dots(x, a, a_mid, a_lo, acc, MODE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                   TRANS: tl.constexpr, NPARTS: tl.constexpr):
        """acc + the products of one K block: X A^T ([BLOCK_O, BLOCK_R]) or, TRANS, A X^T ([BLOCK_R, BLOCK_O]).
        MODE 3: ``a``, ``a_mid``, ``a_lo`` are A's bf16 parts loaded from the pre-split copy (other modes ignore
        ``a_mid`` and ``a_lo``)."""
        if MODE == 3:
            acc = _parts_dots(x, a, a_mid, a_lo, acc, UPCAST, TRANS, NPARTS)
        elif MODE == 1:
            # A as NPARTS half-precision parts in X's dtype (hi + mid + lo: ~24 mantissa bits of an fp32 A), split in
            # registers; NPARTS == 1 with A already in X's dtype: A itself, exact, one product
            if NPARTS == 1:
                hi = a.to(x.dtype)
                acc = _parts_dots(x, hi, hi, hi, acc, UPCAST, TRANS, NPARTS)
            else:
                hi, mid, lo = _split3(a, x.dtype)
                acc = _parts_dots(x, hi, mid, lo, acc, UPCAST, TRANS, NPARTS)
        elif MODE == 2:
            # both operands split into bf16 hi + mid + lo (fp32 X and A: G = A A^T), six products (~fp32-level)
            if TRANS:
                ph, pm, pl = _split3(a, tl.bfloat16)
                qh, qm, ql = _split3(x, tl.bfloat16)
            else:
                ph, pm, pl = _split3(x, tl.bfloat16)
                qh, qm, ql = _split3(a, tl.bfloat16)
            acc = _dot6(ph, pm, pl, qh, qm, ql, acc, UPCAST)
        elif UPCAST:
            if TRANS:
                acc = tl.dot(a.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        elif TRANS:
            acc = tl.dot(a.to(tl.float32), x.to(tl.float32), acc, input_precision=PREC)
        else:
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision=PREC)
        return acc

    @triton.jit
    def _split_parts_kernel(a_ptr, out_ptr, K, stride_ar, stride_ak, stride_part, BLOCK: tl.constexpr):
        """out[p, row, :] = part p of A[row, :] as bf16 hi + mid + lo (out: contiguous [3, R, K]); grid (R, K
        blocks)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < K
        v = tl.load(a_ptr + row * stride_ar + offs * stride_ak, mask=mask, other=0.0)
        hi, mid, lo = _split3(v, tl.bfloat16)
        dst = out_ptr + row * K + offs
        tl.store(dst, hi, mask=mask)
        tl.store(dst + stride_part, mid, mask=mask)
        tl.store(dst + 2 * stride_part, lo, mask=mask)

    @triton.jit
    def _quad_parts_dots(b, gh, gm, gl, acc, B_PARTS: tl.constexpr, UPCAST: tl.constexpr):
        """acc + b @ (gh + gm + gl): one rank chunk of B G from G's bf16 parts ([chunk, BLOCK_R] each) and a
        [BLOCK_O, chunk] tile of B, exact in bf16 (B_PARTS 1: 3 products) or split too (6 products down to 2^-16 of
        the leading one)."""
        if B_PARTS == 1:
            bh = b.to(tl.bfloat16)
            acc = _dot(bh, gl, acc, UPCAST)
            acc = _dot(bh, gm, acc, UPCAST)
            acc = _dot(bh, gh, acc, UPCAST)
        else:
            bh, bm, bl = _split3(b, tl.bfloat16)
            acc = _dot6(bh, bm, bl, gh, gm, gl, acc, UPCAST)
        return acc

    @triton.jit
    def _quad_dots(b, g, acc, TRANS: tl.constexpr, B_PARTS: tl.constexpr, UPCAST: tl.constexpr):
        """acc + one rank chunk of B G to ~fp32 level on the tensor cores: G as bf16 hi + mid + lo against B exact in
        bf16 (B_PARTS 1: 3 products) or split too (6 products down to 2^-16 of the leading one). TRANS: ``g`` is the
        [BLOCK_R, chunk] tile of G^T and ``b`` the [chunk, BLOCK_O] tile of B^T, giving (B G)^T."""
        gh, gm, gl = _split3(g, tl.bfloat16)
        if not TRANS:
            acc = _quad_parts_dots(b, gh, gm, gl, acc, B_PARTS, UPCAST)
        elif B_PARTS == 1:
            bh = b.to(tl.bfloat16)
            acc = _dot(gl, bh, acc, UPCAST)
            acc = _dot(gm, bh, acc, UPCAST)
            acc = _dot(gh, bh, acc, UPCAST)
        else:
            bh, bm, bl = _split3(b, tl.bfloat16)
            acc = _dot6(gh, gm, gl, bh, bm, bl, acc, UPCAST)
        return acc

    @triton.jit
    def _norm_gram_kernel(
        x_ptr, a_ptr, out_ptr, base_ptr, b_ptr, g_ptr, q_ptr,
        ROWS, R, K, K_SPLIT,
        stride_xr, stride_xk, stride_ar, stride_ak, stride_out, stride_split, stride_bo, stride_br, stride_ap,
        zero,
        NEED_BASE: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
        TRANS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        ACCUM: tl.constexpr, NPARTS: tl.constexpr, GROUP: tl.constexpr, CHAIN: tl.constexpr, CROSS: tl.constexpr,
        QUAD: tl.constexpr, B_PARTS: tl.constexpr, QBLOCK: tl.constexpr, SYM: tl.constexpr, PACKED: tl.constexpr,
    ):
        # T = X[ROWS, K] @ A[R, K]^T (fp32) over the K range of split program_id(1) (K_SPLIT: a multiple of BLOCK_K).
        # CROSS: writes rowsum(B * T) of this rank tile, out[split * n_r + rank tile, ROWS] (the cross term's partial
        # sums: U = W A^T itself is never stored); else the tile itself, out + split * stride_split.
        # base[split, ROWS] = rowsum(X^2) over the K range when NEED_BASE.
        # ACCUM (CROSS; a later K chunk of the pre-split U pass): the cross term's and base's partial sums are added to
        # the values already in those rows (the earlier chunks' sums of the same K range index and rank tile).
        # TRANS computes the transposed tile A @ X^T: the A parts are the left operand, which Hopper's wgmma reads
        # from registers, so only X goes through shared memory.
        # Each loop iteration handles GROUP K blocks. CHAIN: one accumulator chained through every product of the K
        # range. Otherwise the products of one iteration go to a fresh accumulator (`zero` is a runtime 0.0, so the
        # compiler cannot fold the add back into the chain) that is added to the running sum in fp32 registers: the
        # tensor cores' own accumulation (less exact than fp32 adds over long chains, measured) spans GROUP blocks.
        # SYM (G = A A^T, square tiles): program_id(0) enumerates the tiles on and above the diagonal only, row by
        # row; each off-diagonal tile is also written mirrored (G is symmetric), so 21 instead of 36 tiles at r=384.
        # PACKED (with SYM): each tile written whole, row-major, as the program_id(0)-th BLOCK_O x BLOCK_R block of
        # this K range's slice of ``out`` (the partial G's in 21/36 of the space; _g_sum_kernel sums and unpacks)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        n_r = tl.cdiv(R, BLOCK_R)
        if SYM:
            pid_o, pid_r = _tri_tile(pid, n_r)
        else:
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
        fresh = acc + zero
        base = tl.zeros([BLOCK_O], dtype=tl.float32)
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        for k0 in range(k_lo, k_hi, BLOCK_K * GROUP):
            if CHAIN:
                part = acc
            else:
                part = fresh
            for kk in tl.static_range(GROUP):
                offs_k = k0 + kk * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
                kmask = offs_k < k_hi
                if TRANS:
                    x = tl.load(  # X^T tile [BLOCK_K, BLOCK_O]
                        x_ptr + offs_o[None, :] * stride_xr + offs_k[:, None] * stride_xk,
                        mask=omask[None, :] & kmask[:, None], other=0.0,
                    )
                    a_ptrs = a_ptr + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak  # [BLOCK_R, BLOCK_K]
                    amask = rmask[:, None] & kmask[None, :]
                else:
                    x = tl.load(  # [BLOCK_O, BLOCK_K]
                        x_ptr + offs_o[:, None] * stride_xr + offs_k[None, :] * stride_xk,
                        mask=omask[:, None] & kmask[None, :], other=0.0,
                    )
                    # A^T: [BLOCK_K, BLOCK_R]
                    a_ptrs = a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
                    amask = rmask[None, :] & kmask[:, None]
                a = tl.load(a_ptrs, mask=amask, other=0.0)
                a_mid = a
                a_lo = a
                if MODE == 3:  # A's pre-split bf16 parts, stride_ap apart
                    if NPARTS >= 2:
                        a_mid = tl.load(a_ptrs + stride_ap, mask=amask, other=0.0)
                    if NPARTS == 3:
                        a_lo = tl.load(a_ptrs + 2 * stride_ap, mask=amask, other=0.0)
                if NEED_BASE:
                    xf = x.to(tl.float32)
                    if TRANS:
                        base += tl.sum(xf * xf, axis=0)
                    else:
                        base += tl.sum(xf * xf, axis=1)
                part = _gram_dots(x, a, a_mid, a_lo, part, MODE, PREC, UPCAST, TRANS, NPARTS)
            if CHAIN:
                acc = part
            else:
                acc += part
        if QUAD:
            # the quadratic term's partial sums rowsum(B * (B G)) of this tile, written after the cross term's (rows
            # [n_splits * n_r + split * n_r + rank tile]): the combine sums each set in a fixed order and forms
            # base + 2s cross + s^2 quad exactly as with B G in the combine (one rounding of 2s and of s^2; folding
            # (s/2) B G into the cross term instead measured 2x the error: two more scalar roundings). The QBLOCK-deep
            # rank chunks of B G are dealt out over the K-range programs (chunk i to program i mod ranges, the others
            # write zeros); each chunk's products start from zero (restarted, as in the main loop) and are added in
            # fp32. (QBLOCK 64 measured 8.1e-8 relative norm error where the quadratic term dominates, QBLOCK 32 7.3e-8,
            # eager 3.2e-8, on the H200.)
            nsplit = tl.num_programs(1)
            qacc = fresh
            for q0 in range(split * QBLOCK, R, nsplit * QBLOCK):
                offs_q = q0 + tl.arange(0, QBLOCK).to(tl.int64)
                qmask = offs_q < R
                if TRANS:
                    gq = tl.load(g_ptr + offs_q[None, :] * R + offs_r[:, None],  # (G[q, r])^T: [BLOCK_R, BLOCK_K]
                                 mask=rmask[:, None] & qmask[None, :], other=0.0)
                    bq = tl.load(b_ptr + offs_o[None, :] * stride_bo + offs_q[:, None] * stride_br,  # [BK, BLOCK_O]
                                 mask=qmask[:, None] & omask[None, :], other=0.0)
                else:
                    gq = tl.load(g_ptr + offs_q[:, None] * R + offs_r[None, :],  # G[q, r]: [BLOCK_K, BLOCK_R]
                                 mask=qmask[:, None] & rmask[None, :], other=0.0)
                    bq = tl.load(b_ptr + offs_o[:, None] * stride_bo + offs_q[None, :] * stride_br,  # [BLOCK_O, BK]
                                 mask=omask[:, None] & qmask[None, :], other=0.0)
                qacc += _quad_dots(bq, gq, fresh, TRANS, B_PARTS, UPCAST)
        if CROSS:
            if TRANS:
                b = tl.load(b_ptr + offs_o[None, :] * stride_bo + offs_r[:, None] * stride_br,
                            mask=rmask[:, None] & omask[None, :], other=0.0).to(tl.float32)
                c = tl.sum(acc * b, axis=0)
            else:
                b = tl.load(b_ptr + offs_o[:, None] * stride_bo + offs_r[None, :] * stride_br,
                            mask=omask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
                c = tl.sum(acc * b, axis=1)
            crow = out_ptr + (split * n_r + pid_r).to(tl.int64) * ROWS + offs_o
            if ACCUM:
                c = tl.load(crow, mask=omask, other=0.0) + c
            tl.store(crow, c, mask=omask)
            if QUAD:
                if TRANS:
                    cq = tl.sum(qacc * b, axis=0)
                else:
                    cq = tl.sum(qacc * b, axis=1)
                tl.store(q_ptr + (split * n_r + pid_r).to(tl.int64) * ROWS + offs_o, cq, mask=omask)
        else:
            out_base = out_ptr + split.to(tl.int64) * stride_split
            if PACKED:
                tile = out_base + pid.to(tl.int64) * (BLOCK_O * BLOCK_R)
                ta = tl.arange(0, BLOCK_O)
                tc = tl.arange(0, BLOCK_R)
                if TRANS:
                    tl.store(tile + ta[None, :] * BLOCK_R + tc[:, None], acc)
                else:
                    tl.store(tile + ta[:, None] * BLOCK_R + tc[None, :], acc)
            elif TRANS:
                tl.store(out_base + offs_o[None, :] * stride_out + offs_r[:, None], acc,
                         mask=rmask[:, None] & omask[None, :])
            else:
                tl.store(out_base + offs_o[:, None] * stride_out + offs_r[None, :], acc,
                         mask=omask[:, None] & rmask[None, :])
            if SYM and not PACKED:
                if pid_o != pid_r:  # the mirrored tile (a diagonal tile is written once, as computed)
                    if TRANS:
                        tl.store(out_base + offs_r[:, None] * stride_out + offs_o[None, :], acc,
                                 mask=rmask[:, None] & omask[None, :])
                    else:
                        tl.store(out_base + offs_r[None, :] * stride_out + offs_o[:, None], acc,
                                 mask=omask[:, None] & rmask[None, :])
        if NEED_BASE:
            if pid_r == 0:
                brow = base_ptr + split.to(tl.int64) * ROWS + offs_o
                if ACCUM:
                    base = tl.load(brow, mask=omask, other=0.0) + base
                tl.store(brow, base, mask=omask)

    @triton.jit
    def _norm_u_tma_kernel(
        w_desc, p_desc, out_ptr, base_ptr, b_ptr, gp_ptr, q_ptr,
        ROWS, R, K_SPLIT, K, stride_bo, stride_br, stride_gp,
        zero,
        NEED_BASE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr, ACCUM: tl.constexpr, QUAD: tl.constexpr, B_PARTS: tl.constexpr, QBLOCK: tl.constexpr,
    ):
        # The pre-split U pass (_MODE_PRESPLIT, row tiles) with the tiles of W ([ROWS, K]) and of A's bf16 parts
        # ([3 R, K]: hi, mid, lo rows) loaded by the tensor-memory accelerator (Hopper+): the same products, sums and
        # outputs as _norm_gram_kernel with CROSS and MODE 3 (restarted every K block, three products smallest
        # first), except that the quadratic term's B G reads G's pre-split bf16 parts (gp: [3, R, R], stride_gp
        # apart) instead of splitting fp32 G tiles in every program. Out-of-range rows and columns load as zeros; a
        # rank tile past R reads the next part's rows, which only meet B's masked (zero) columns.
        pid = tl.program_id(0)
        split = tl.program_id(1)
        n_r = tl.cdiv(R, BLOCK_R)
        pid_o = pid // n_r
        pid_r = pid % n_r
        off_o = pid_o * BLOCK_O
        off_r = pid_r * BLOCK_R
        acc = tl.zeros([BLOCK_O, BLOCK_R], dtype=tl.float32)
        fresh = acc + zero
        base = tl.zeros([BLOCK_O], dtype=tl.float32)
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = w_desc.load([off_o, k0])
            lo = p_desc.load([2 * R + off_r, k0])
            mid = p_desc.load([R + off_r, k0])
            hi = p_desc.load([off_r, k0])
            if NEED_BASE:
                xf = x.to(tl.float32)
                base += tl.sum(xf * xf, axis=1)
            acc += _parts_dots(x, hi.T, mid.T, lo.T, fresh, UPCAST, False, 3)
        offs_o = off_o + tl.arange(0, BLOCK_O).to(tl.int64)
        offs_r = off_r + tl.arange(0, BLOCK_R).to(tl.int64)
        omask = offs_o < ROWS
        rmask = offs_r < R
        b = tl.load(b_ptr + offs_o[:, None] * stride_bo + offs_r[None, :] * stride_br,
                    mask=omask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        c = tl.sum(acc * b, axis=1)
        crow = out_ptr + (split * n_r + pid_r).to(tl.int64) * ROWS + offs_o
        if ACCUM:
            c = tl.load(crow, mask=omask, other=0.0) + c
        tl.store(crow, c, mask=omask)
        if QUAD:  # as in _norm_gram_kernel: rank chunks of B G dealt out over the K ranges, restarted per chunk
            nsplit = tl.num_programs(1)
            qacc = fresh
            for q0 in range(split * QBLOCK, R, nsplit * QBLOCK):
                offs_q = q0 + tl.arange(0, QBLOCK).to(tl.int64)
                qmask = offs_q < R
                bq = tl.load(b_ptr + offs_o[:, None] * stride_bo + offs_q[None, :] * stride_br,
                             mask=omask[:, None] & qmask[None, :], other=0.0)
                gmask = qmask[:, None] & rmask[None, :]
                gq = gp_ptr + offs_q[:, None] * R + offs_r[None, :]
                gh = tl.load(gq, mask=gmask, other=0.0)
                gm = tl.load(gq + stride_gp, mask=gmask, other=0.0)
                gl = tl.load(gq + 2 * stride_gp, mask=gmask, other=0.0)
                qacc += _quad_parts_dots(bq, gh, gm, gl, fresh, B_PARTS, UPCAST)
            cq = tl.sum(qacc * b, axis=1)
            tl.store(q_ptr + (split * n_r + pid_r).to(tl.int64) * ROWS + offs_o, cq, mask=omask)
        if NEED_BASE:
            if pid_r == 0:
                brow = base_ptr + split.to(tl.int64) * ROWS + offs_o
                if ACCUM:
                    base = tl.load(brow, mask=omask, other=0.0) + base
                tl.store(brow, base, mask=omask)

    @triton.jit
    def _norm_combine_kernel(
        cpart_ptr, bpart_ptr, g_ptr, b_ptr, base_out_ptr, norm_ptr,
        D, R, N_CROSS, N_BASE, N_QUAD,
        stride_bo, stride_br,
        two_s, s_sq, zero,
        WRITE_BASE: tl.constexpr, PREC: tl.constexpr, B_PARTS: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, QUAD: tl.constexpr,
    ):
        # norm = sqrt(max(base + 2s * cross + s^2 * rowsum((B G) * B), 0)): cross and base are the sums, in a fixed
        # order, of the N_CROSS / N_BASE partial rows [*, D] the U pass wrote (base: or the cached row norms, 1 row).
        # QUAD: B G computed here; otherwise the U pass wrote the quadratic term's N_QUAD partial rows after the cross
        # term's
        offs_o = tl.program_id(0).to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O).to(tl.int64)
        omask = offs_o < D
        cross = tl.zeros([BLOCK_O], dtype=tl.float32)
        for p in range(0, N_CROSS):
            cross += tl.load(cpart_ptr + p * D + offs_o, mask=omask, other=0.0)
        base = tl.zeros([BLOCK_O], dtype=tl.float32)
        for p in range(0, N_BASE):
            base += tl.load(bpart_ptr + p * D + offs_o, mask=omask, other=0.0)
        if WRITE_BASE:
            tl.store(base_out_ptr + offs_o, base, mask=omask)
        quad = tl.zeros([BLOCK_O], dtype=tl.float32)
        if not QUAD:
            for p in range(0, N_QUAD):
                quad += tl.load(cpart_ptr + (N_CROSS + p) * D + offs_o, mask=omask, other=0.0)
        else:
            for j0 in range(0, R, BLOCK_R):
                offs_j = j0 + tl.arange(0, BLOCK_R).to(tl.int64)
                jmask = offs_j < R
                m2 = omask[:, None] & jmask[None, :]
                bj = tl.load(b_ptr + offs_o[:, None] * stride_bo + offs_j[None, :] * stride_br, mask=m2, other=0.0)
                bj = bj.to(tl.float32)
                bg = tl.zeros([BLOCK_O, BLOCK_R], dtype=tl.float32)
                fresh = bg + zero
                for k0 in range(0, R, BLOCK_R):
                    offs_k = k0 + tl.arange(0, BLOCK_R).to(tl.int64)
                    kmask = offs_k < R
                    bk = tl.load(
                        b_ptr + offs_o[:, None] * stride_bo + offs_k[None, :] * stride_br,
                        mask=omask[:, None] & kmask[None, :], other=0.0,
                    )
                    gk = tl.load(g_ptr + offs_k[:, None] * R + offs_j[None, :], mask=kmask[:, None] & jmask[None, :],
                                 other=0.0)
                    if PREC == "split":
                        # tensor-core products of bf16 parts, restarted per rank chunk: G as hi + mid + lo; B exact in
                        # bf16 (B_PARTS 1: 3 products) or split too (6 products down to 2^-16 of the leading one)
                        bg += _quad_dots(bk, gk, fresh, False, B_PARTS, UPCAST)
                    else:
                        bg = tl.dot(bk.to(tl.float32), gk, bg, input_precision=PREC)
                quad += tl.sum(bg * bj, axis=1)
        sq = base + two_s * cross + s_sq * quad
        tl.store(norm_ptr + offs_o, tl.sqrt_rn(tl.maximum(sq, 0.0)), mask=omask)


if AVAILABLE:

    @triton.jit
    def _g_sum_kernel(part_ptr, g_ptr, gp_ptr, R, NSPLIT, stride_split, stride_gp, BLOCK: tl.constexpr,
                      PARTS: tl.constexpr):
        """G from its packed partial tiles (_norm_gram_kernel with PACKED): program p sums the p-th upper-triangle
        tile over the NSPLIT K ranges in order (fixed order: deterministic) and writes it and its mirror into G;
        PARTS: also G's bf16 parts hi, mid, lo into gp ([3, R, R], stride_gp apart), for _norm_u_tma_kernel."""
        pid = tl.program_id(0)
        i, j = _tri_tile(pid, tl.cdiv(R, BLOCK))
        ta = tl.arange(0, BLOCK)
        loc = ta[:, None] * BLOCK + ta[None, :]
        acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
        ptrs = part_ptr + pid.to(tl.int64) * (BLOCK * BLOCK) + loc  # 64-bit pointer arithmetic over the K ranges
        for _ in range(0, NSPLIT):
            acc += tl.load(ptrs)
            ptrs += stride_split
        rows = i.to(tl.int64) * BLOCK + ta
        cols = j.to(tl.int64) * BLOCK + ta
        m = (rows < R)[:, None] & (cols < R)[None, :]
        _store_sym(g_ptr, acc, rows, cols, m, R, i != j)
        if PARTS:
            hi, mid, lo = _split3(acc, tl.bfloat16)
            _store_sym(gp_ptr, hi, rows, cols, m, R, i != j)
            _store_sym(gp_ptr + stride_gp, mid, rows, cols, m, R, i != j)
            _store_sym(gp_ptr + 2 * stride_gp, lo, rows, cols, m, R, i != j)

    @triton.jit
    def _store_sym(ptr, v, rows, cols, m, R, mirror):
        """v into the [R, R] matrix at ptr at (rows, cols), and transposed at (cols, rows) when ``mirror``."""
        tl.store(ptr + rows[:, None] * R + cols[None, :], v, mask=m)
        if mirror:
            tl.store(ptr + cols[None, :] * R + rows[:, None], v, mask=m)


if AVAILABLE:
    _G_SUM = _launch.Launcher(_g_sum_kernel)
    _GRAM = _launch.Launcher(_norm_gram_kernel)
    _U_TMA = _launch.Launcher(_norm_u_tma_kernel)
    _COMBINE = _launch.Launcher(_norm_combine_kernel)
    _SPLIT_PARTS_LAUNCH = _launch.Launcher(_split_parts_kernel)


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


# Plan constants of the factored norm. The alternatives that config.Settings can select (norm_* fields) are
# documented there and in docs/ARCHITECTURE.md; all figures below were measured on the H200 (Triton 3.6, Qwen3-8B
# module shapes at r=384: 4096x4096 / 1024x4096 / 12288x4096 / 4096x12288; kernels_bench.py --sections norm).
#
# U = W A^T as the transposed tile A @ W^T (split A parts as wgmma's register operand), per dot mode: split mode
# 128x128x32 (8 warps, 4 stages) transposed 0.13 / 0.13 / 0.38 / 0.37 ms vs 0.23 / 0.23 / 0.46 / 0.68 ms in row
# tiles, same error (1.4e-7 .. 2.2e-7); fp32 mode gains < 7%: row tiles kept.
_TRANS = {_MODE_SPLIT: True, _MODE_FP32: False}
_HALF = (torch.bfloat16, torch.float16)
_TRANS_SPLIT_CFG = (128, 128, 32, 8, 4, True)
# Pre-split U pass (bf16 W, fp32 A; Settings.norm_presplit): A's parts take 6 r d_in bytes; where that would take the
# norm's working set over Settings.norm_workset_plan x the bytes of fp32 U and G, A is split and the U pass run in K
# chunks (_presplit_chunk), at most _PRESPLIT_MAX_CHUNKS; beyond that (k/v projections at r=384) the split stays in
# registers. Whole norm, kernels only: 4096x4096 0.195 -> 0.162 ms (2 chunks), 12288x4096 0.453 -> 0.346 ms, the
# down projection (6 chunks of 2048) 0.426 -> 0.395 ms with pointer loads, 0.377 on TMA; same error.
_PRESPLIT_CFG = (128, 128, 64, 8, 3, False)
_PRESPLIT_MAX_CHUNKS = 6
# working-set limit of the norm, in multiples of the bytes of fp32 U = W A^T and G = A A^T, and what the chunk
# sizing plans for: the caching allocator may hand out a cached block larger than a request (on the H200 a plan at
# 1.22x peaked at 1.37x in the GPU working-set test), so the plan keeps 0.25x slack
_WORKSET_LIMIT = 1.25
# rank-chunk depth of B G in the U pass (independent of the U tile's BLOCK_K): 64-deep chunks (six products each)
# measured 8.1e-8 relative norm error where the quadratic term dominates, over the 2x-eager envelope (eager 3.2e-8);
# 32-deep chunks 7.3e-8
_QUAD_BLOCK = 32
# W and A in the same half dtype (one product per K block): 64-deep K blocks, 3 stages: kernels-only ms of the whole
# bf16 norm 0.096 / 0.065 / 0.187 / 0.171 vs 0.104 / 0.066 / 0.209 / 0.191 with _TRANS_SPLIT_CFG, same error. Not
# for the split mode (fp32 A, AMP): 2-5% faster there, but its B G chunks would exceed the error envelope (above).
_ONE_CFG = (128, 128, 64, 8, 3, True)
# G = A A^T tiles (A's at r=384): 64x64x32 transposed tiles split ~16 ways over d_in: 0.035 ms (d_in 4096) / 0.072 ms
# (12288) vs 0.066 / 0.17 ms for 32x32x64 row tiles, same or lower error
_G_CFG = (64, 64, 32, 4, 3, True)
# Accumulation: (K blocks per loop iteration, chained). Chained: the tensor cores accumulate over the whole K range;
# not chained: each iteration's products start from zero and are added to the running sum with fp32 adds (see
# _norm_gram_kernel). Always restarted by default: chaining one bf16 product on transposed tiles gave 5.5e-5 .. 3e-4
# error and differed between runs (restarted: 5.1e-8 .. 5.4e-8, bitwise reproducible); chained row tiles were
# reproducible and 8-13% faster but lost precision with the chain's length (G over 128 K blocks: 2.2e-5 relative
# error, over 4: 9.6e-7; restarted 1.6e-7 / 1.0e-7). Settings.norm_acc overrides it per config key.
_ACC_DEFAULT = (1, False)


def _mode_of(x: torch.Tensor, a: torch.Tensor, gram_of_a: bool) -> tuple[int, int]:
    """(dot mode, products per K block) for X A^T."""
    if x.dtype == torch.bfloat16 and a.dtype == torch.float32 and not gram_of_a:
        return (_MODE_PRESPLIT if _S.norm_presplit else _MODE_SPLIT), _S.norm_split_parts
    if gram_of_a and a.dtype == torch.float32 and _S.norm_g_prec == "split":
        return _MODE_SPLIT2, 3
    if _S.norm_one_product_half and x.dtype == a.dtype and x.dtype in _HALF:
        # both operands exact in the same half dtype: one tensor-core product (A as the register operand)
        return _MODE_SPLIT, 1
    # fp32 operands (half-precision tiles upcast in registers) with tf32x3. Measured on the H200 (kernels_bench.py,
    # the GPU norm tests): a single bf16 or tf32 tensor-core product accumulated over d_in gave ~1e-5 relative norm
    # error even on exactly representable operands, tf32x3 and the bf16 hi/mid/lo split stay at fp32 level (~1e-7).
    # For bf16/fp16 W and A one half-precision product per K block is 6.6x faster (0.144 vs 0.95 ms at 8192x8192
    # r=384); its error (3e-5..7e-5 when the tensor cores' accumulation is chained over d_in, vs eager 4e-8..7e-8)
    # comes from the length of that chain (G's error fell 60x from 1 to 32 K splits), so it runs restarted every K
    # block (_ACC_DEFAULT).
    return _MODE_FP32, 3


def _fp32_prec(gram_of_a: bool) -> str:
    """input_precision of the fp32-operand dots (_MODE_FP32): tf32x3 for U = W A^T; _S.norm_g_prec for G ("split" runs
    _MODE_SPLIT2 for an fp32 A, so fp32 FMAs remain only for half-precision A's without _S.norm_one_product_half)."""
    if not gram_of_a:
        return "tf32x3"
    return "ieee" if _S.norm_g_prec == "split" else _S.norm_g_prec


def _config_key(mode: int, nparts: int, gram_of_a: bool):
    if mode == _MODE_SPLIT and nparts == 1:  # one product of exact half-precision operands
        return "G1" if gram_of_a else "one"
    return "G" if gram_of_a else mode


def _gram_config(rows: int, R: int, device: torch.device, mode: int, gram_of_a: bool, nparts: int = 3):
    """(BLOCK_O, BLOCK_R, BLOCK_K, warps, stages, trans), from kernels_bench.py's norm sweep on the H200 (8192x8192):
    large row tiles win as long as the grid still covers about half the SMs (split mode
    256x128x64: 0.45 ms vs 0.81 ms for 64x128x64; fp32 mode 128x128x32: 1.26 ms vs 1.35 ms)."""
    key = _config_key(mode, nparts, gram_of_a)
    if key in _S.norm_config:
        cfg = tuple(_S.norm_config[key])
        return cfg if len(cfg) == 6 else cfg + (False,)
    if gram_of_a:  # G = A A^T: r x r outputs only (and split over K, see _g_split)
        b = min(_G_CFG[0], max(16, _next_pow2(R)))
        return (b, b) + _G_CFG[2:]
    if mode == _MODE_SPLIT and nparts == 1:
        return _ONE_CFG  # for every shape (rows and rank tiles masked)
    if mode == _MODE_PRESPLIT:
        return _PRESPLIT_CFG
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
    """Programs over K for G = A A^T. G has only (r/64)^2 tiles (36 at r=384, 21 of them on or above the diagonal),
    each a long, latency-bound loop over d_in: split K so that about 2 programs per SM run, each at least 2 K blocks
    long, with the partial G's (packed upper-triangle tiles with ``Settings.norm_g_sym``) fitting in ``capacity`` fp32
    elements (the size of the U = W A^T the norm never stores: the working set stays below U + G). Measured on the
    H200 (the G pass alone at r=384, d_in 4096 / 12288, fp32 A): 12-16 ranges 0.031 / 0.057-0.059 ms, 24-32 ranges
    0.038-0.041 / 0.065-0.066 ms, 4 ranges 0.044 / 0.11 ms."""
    b, _, block_k = _gram_config(R, R, device, _MODE_FP32, True)[:3]
    tiles = _g_tiles(_launch.cdiv(R, b))
    per_split = tiles * b * b if _g_packed(R, b) else R * R  # one K range's partial G
    if "G" in _S.norm_split:
        return max(1, min(int(_S.norm_split["G"]), capacity // per_split))
    want = _launch.cdiv(2 * _num_sms(device), tiles)
    return max(1, min(want, K // (2 * block_k), capacity // per_split, 64))


def _g_packed(R: int, b: int) -> bool:
    """Partial G's as packed upper-triangle b x b tiles (``Settings.norm_g_sym``, where that takes less space than R x
    R)."""
    return _S.norm_g_sym and _g_tiles(_launch.cdiv(R, b)) * b * b < R * R


def _g_tiles(n: int) -> int:
    """Programs per K range of G = A A^T over ``n`` x ``n`` tiles: the upper triangle with ``Settings.norm_g_sym``."""
    return n * (n + 1) // 2 if _S.norm_g_sym else n * n


def _u_split(rows: int, R: int, K: int, cfg: tuple, device: torch.device) -> int:
    """Programs over K for the U = W A^T pass, whose partial results are only [rows] vectors (the cross term's
    partial sums): enough programs for ~6 per SM on shapes with few output tiles (Qwen3-8B's k/v projections have 24
    at 128x128), at most 8 ranges of at least 512 columns of W. Measured on the H200 (U split timings, partial U's +
    a sum: 1024x4096 0.131 -> 0.038 ms with 8 ranges, 4096x12288 0.385 -> 0.241, 4096x4096 0.132 -> 0.100). Grids of
    at most half as many tiles as SMs get one wave (SMs // tiles ranges): 1024x4096 at r=384 (24 tiles), 5 ranges,
    0.122 / 0.091 ms vs 0.134 / 0.102 ms with 8 (AMP). Fewer, longer ranges measured faster for the 96-tile grids of
    one-chunk passes (bf16 4096x4096: 0.086 ms at 4 ranges vs 0.100 at 8), but a rule that picked them took the fp32
    ||W||^2 partial sums of 2048x8192 (r=64) over 2x eager's error: longer K ranges are longer fp32 sums."""
    if "U" in _S.norm_split:
        return max(1, int(_S.norm_split["U"]))
    tiles = _launch.cdiv(rows, cfg[0]) * _launch.cdiv(R, cfg[1])
    sms = _num_sms(device)
    want = sms // tiles if 2 * tiles <= sms else _launch.cdiv(6 * sms, tiles)
    return max(1, min(8, want, K // 512))


def _u_ranges(rows: int, R: int, kc: int, cfg: tuple, device: torch.device) -> int:
    """K ranges of the U pass over chunks of ``kc`` columns: the first (largest) chunk's, which every chunk's launch
    is given (a shorter last chunk may use fewer); the chunk plan (_presplit_chunk) sizes the partial sums by it."""
    return _k_ranges(kc, _u_split(rows, R, kc, cfg, device), cfg[2])[1]


def _gram_plan(x: torch.Tensor, a: torch.Tensor, gram_of_a: bool) -> tuple:
    """``(mode, nparts, config)`` of ``x @ a^T``: the product mode (``_mode_of``) and its tile configuration
    (``_gram_config``), derived once per pass."""
    mode, nparts = _mode_of(x, a, gram_of_a)
    return mode, nparts, _gram_config(x.shape[0], a.shape[0], x.device, mode, gram_of_a, nparts)


def _k_ranges(K: int, split: int, block_k: int) -> tuple[int, int]:
    """(columns per K range, ranges) of a pass over K split into up to ``split`` ranges of whole BLOCK_K blocks."""
    k_split = _launch.cdiv(_launch.cdiv(K, split), block_k) * block_k
    return k_split, _launch.cdiv(K, k_split)


def _b_parts(b: torch.Tensor) -> int:
    """bf16 parts of B in the products of B G: 1 (exact bf16 B) or 3 (hi + mid + lo)."""
    return 1 if b.dtype == torch.bfloat16 else 3


def _gram(x: torch.Tensor, a: torch.Tensor, out: torch.Tensor, base: Optional[torch.Tensor], upcast: bool,
          gram_of_a: bool = False, split: int = 1, b: Optional[torch.Tensor] = None, plan: Optional[tuple] = None,
          g: Optional[torch.Tensor] = None, packed: bool = False, accum: bool = False,
          quad_out: Optional[torch.Tensor] = None, gparts: Optional[torch.Tensor] = None) -> int:
    """out = x @ a^T (fp32), and base = rowsum(x^2) when given. ``split > 1``: ``out`` is ``[split, rows, R]``
    contiguous and receives the partial products of up to ``split`` equal K ranges (``base``: ``[split, rows]``).
    With ``b`` (the cross term): ``out`` is ``[split * n_r, rows]`` and receives ``rowsum(b * (x @ a^T))`` per K range
    and rank tile (n_r = rank tiles of the configuration); the product itself is never stored. Returns the number of
    ranges used (K ranges are whole BLOCK_K multiples, so it can be smaller than ``split``). ``plan``: the caller's
    ``_gram_plan(x, a, gram_of_a)``, when it already derived it. With ``b`` and ``g`` (``G = A A^T``, fp32
    ``[R, R]``): ``out`` is ``[2 * split * n_r, rows]``, the quadratic term's partial sums ``rowsum(b * (b @ g))``
    (rank chunks dealt out over the K ranges) in rows ``[used ranges * n_r, 2 * used ranges * n_r)``, or in
    ``quad_out``'s first rows when given. ``accum`` (cross term): add the cross term's (and base's) partial sums to
    the values in those rows (a later K chunk of the pre-split U pass). ``packed`` (G = A A^T with
    ``Settings.norm_g_sym``): ``out`` is ``[split, tiles * b * b]`` and receives the upper-triangle tiles whole, for
    ``_g_sum_kernel``. ``_MODE_PRESPLIT`` with the cross term runs on the tensor-memory accelerator
    (``_norm_u_tma_kernel``) where :func:`_tma_ok` allows it; with ``g``, that kernel reads G's bf16 parts ``gparts``
    (``[3, R, R]``)."""
    rows, K = x.shape
    mode, nparts, cfg = plan if plan is not None else _gram_plan(x, a, gram_of_a)
    if (a.dim() == 3) != (mode == _MODE_PRESPLIT):
        raise ValueError("fastdora: _gram takes A's parts [parts, R, K] exactly in _MODE_PRESPLIT (pass its plan)")
    cross = b is not None
    if mode == _MODE_PRESPLIT and cross and nparts == 3 and not cfg[5] and _tma_ok(x, a):
        return _gram_tma(x, a, out, base, upcast, split, b, cfg, g, accum, quad_out, gparts)
    # _MODE_PRESPLIT: ``a`` holds A's parts, [parts, R, K]
    stride_ap, a = (a.stride(0), a[0]) if mode == _MODE_PRESPLIT else (0, a)
    R = a.shape[0]
    block_o, block_r, block_k, warps, stages, trans = cfg
    group, chain = _S.norm_acc.get(_config_key(mode, nparts, gram_of_a), _ACC_DEFAULT)
    k_split, split = _k_ranges(K, split, block_k)
    sym = gram_of_a and _S.norm_g_sym and not cross and block_o == block_r
    if packed and not sym:
        raise ValueError("fastdora: packed partial G's need _S.norm_g_sym and square G tiles")
    n_tiles = _g_tiles(_launch.cdiv(R, block_r)) if sym else _launch.cdiv(rows, block_o) * _launch.cdiv(R, block_r)
    grid = (n_tiles, split)
    quad = cross and g is not None
    stride_out = rows if cross else (out if out.dim() == 2 else out[0]).stride(0)
    bb = b if cross else out
    q = _quad_rows(out, quad_out, split, _launch.cdiv(R, block_r)) if quad else out
    _GRAM(
        grid,
        (x, a, out, base if base is not None else out, bb, g if quad else out, q),
        (rows, R, K, k_split, x.stride(0), x.stride(1), a.stride(0), a.stride(1), stride_out,
         n_tiles * block_o * block_r if packed else rows * R,
         bb.stride(0), bb.stride(-1), stride_ap),
        (0.0,),
        (base is not None, mode, _fp32_prec(gram_of_a), upcast, bool(trans), block_o, block_r, block_k,
         accum and cross, nparts, group, chain, cross, quad, _b_parts(bb), _QUAD_BLOCK, sym, packed),
        warps,
        stages,
    )
    return split


def _quad_rows(out: torch.Tensor, quad_out: Optional[torch.Tensor], used: int, n_r: int) -> torch.Tensor:
    """Where the U pass writes the quadratic term's partial sums: ``quad_out``, or ``out``'s rows after the cross
    term's ``used * n_r``."""
    return quad_out if quad_out is not None else out[used * n_r:]


# Pre-split U pass on the tensor-memory accelerator (_norm_u_tma_kernel; Settings.norm_tma): measured on the H200
# (Qwen3-8B shapes at r=384, bitwise the same cross-term partial sums as the pointer loads): U pass 4-7% faster at
# every shape and K split; whole AMP norm 4096x4096 0.161 -> 0.152 ms, 12288x4096 0.345 -> 0.313 (with G's parts
# split once); warp specialisation and persistent grids no faster.
try:  # pragma: no cover - depends on the installed Triton
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except Exception:  # pragma: no cover
    _TensorDescriptor = None


@functools.lru_cache(maxsize=None)
def _tma_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_2d(t: torch.Tensor) -> bool:
    """A 2-D view TMA can load: unit stride along the last dim, 16-byte aligned base and row stride."""
    es = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0 and t.shape[1] * es >= 16


def _tma_enabled(x: torch.Tensor) -> bool:
    """TMA loads for tensors on ``x``'s device: a Hopper or newer GPU (CPU: the interpreter, when tests ask)."""
    if not _S.norm_tma or _TensorDescriptor is None:
        return False
    return _tma_device(x.device) if x.is_cuda else _S.norm_tma_interpret


def _tma_ok(x: torch.Tensor, parts: torch.Tensor) -> bool:
    """The pre-split U pass of ``x`` ([rows, K] bf16) and A's parts ([3, R, K], contiguous) can run on TMA."""
    return parts.is_contiguous() and parts.data_ptr() % 16 == 0 and _tma_cols_ok(x, parts.shape[-1])


def _tma_cols_ok(x: torch.Tensor, k_cols: int) -> bool:
    """``x`` and a contiguous, 16-byte aligned bf16 parts buffer of ``k_cols`` columns (rows of ``2 k_cols`` bytes)
    can be loaded by TMA."""
    return _tma_enabled(x) and _tma_2d(x) and (2 * k_cols) % 16 == 0


def _gram_tma(x, parts, out, base, upcast, split, b, cfg, g, accum, quad_out, gparts) -> int:
    """``_gram``'s pre-split cross-term pass on ``_norm_u_tma_kernel`` (same arguments and outputs)."""
    rows, K = x.shape
    R = parts.shape[1]
    block_o, block_r, block_k, warps, stages, _ = cfg
    k_split, split = _k_ranges(K, split, block_k)
    n_r = _launch.cdiv(R, block_r)
    quad = g is not None
    if quad and gparts is None:
        gparts = _split_parts(g, 3)
    descs = (_TensorDescriptor.from_tensor(x, [block_o, block_k]),
             _TensorDescriptor.from_tensor(parts.reshape(-1, K), [block_r, block_k]))
    _U_TMA(
        (_launch.cdiv(rows, block_o) * n_r, split),
        (out, base if base is not None else out, b, gparts if quad else out,
         _quad_rows(out, quad_out, split, n_r) if quad else out),
        (rows, R, k_split, K, b.stride(0), b.stride(1), gparts.stride(0) if quad else 0),
        (0.0,),
        (base is not None, upcast, block_o, block_r, block_k, accum, quad, _b_parts(b), _QUAD_BLOCK),
        warps,
        stages,
        descs=descs,
    )
    return split


def _gram_matrix(A: torch.Tensor, G: torch.Tensor, sg: int, upcast: bool,
                 gparts: Optional[torch.Tensor] = None) -> None:
    """G = A A^T (fp32 ``[r, r]``) over ``sg`` K ranges: partial G's (at most U's size), summed in a fixed order
    (deterministic); as packed upper-triangle tiles (``_g_packed``) summed and unpacked by ``_g_sum_kernel``.
    ``gparts`` (contiguous ``[3, r, r]`` bf16): also receives G's bf16 parts hi, mid, lo."""
    r = A.shape[0]
    if sg > 1:
        b, b_r = _gram_plan(A, A, True)[2][:2]
        if b == b_r and _g_packed(r, b):
            tiles = _g_tiles(_launch.cdiv(r, b))
            parts = torch.empty((sg, tiles * b * b), dtype=torch.float32, device=A.device)
            sg = _gram(A, A, parts, None, upcast, gram_of_a=True, split=sg, packed=True)
            with_parts = gparts is not None
            _G_SUM((tiles,), (parts, G, gparts if with_parts else G),
                   (r, sg, parts.stride(0), gparts.stride(0) if with_parts else 0), (), (b, with_parts), 4)
            return
        parts = torch.empty((sg, r, r), dtype=torch.float32, device=A.device)
        sg = _gram(A, A, parts, None, upcast, gram_of_a=True, split=sg)
        torch.sum(parts[:sg], dim=0, out=G)
    else:
        _gram(A, A, G, None, upcast, gram_of_a=True)
    if gparts is not None:
        _split_parts(G, 3, gparts)


def _split_parts(A: torch.Tensor, nparts: int, parts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A's first ``nparts`` bf16 parts (hi, mid, lo: ~24 mantissa bits of an fp32 A) as ``[nparts, R, K]``, written
    into ``parts`` (contiguous ``[3, R, K]`` bf16) when given."""
    R, K = A.shape
    if parts is None:
        parts = torch.empty((3, R, K), dtype=torch.bfloat16, device=A.device)
    block = 1024
    _SPLIT_PARTS_LAUNCH((R, _launch.cdiv(K, block)), (A, parts), (K, A.stride(0), A.stride(1), R * K), (), (block,), 4)
    return parts[:nparts]


def _presplit_chunk(d_out: int, d_in: int, r: int, cfg: tuple, device: torch.device) -> int:
    """Columns of W per U launch in _MODE_PRESPLIT (a multiple of 512; ``d_in`` itself when everything fits): the
    parts buffer ``[3, r, chunk]`` bf16, the U pass's partial sums (every chunk adds into the first chunk's rows), G
    and its bf16 parts, the results and the base row norms stay within ``Settings.norm_workset_plan`` x the bytes of
    fp32 U and G (``_WORKSET_LIMIT`` less the allocator's slack). 0: more than ``_PRESPLIT_MAX_CHUNKS`` chunks would be
    needed (split A in registers instead)."""
    limit = _S.norm_workset_plan * 4 * (d_out * r + r * r)
    n_r = _launch.cdiv(r, cfg[1])
    for n in range(1, _PRESPLIT_MAX_CHUNKS + 1):
        kc = d_in if n == 1 else _launch.cdiv(_launch.cdiv(d_in, n), 512) * 512
        if n > 1 and _launch.cdiv(d_in, kc) < n:
            continue
        su = _u_ranges(d_out, r, kc, cfg, device)
        partial_rows = 2 * su * n_r + su  # cross and quad partial sums, base partial sums
        # parts buffer (3 parts), partial sums, G and its parts, results
        total = 6 * r * kc + 4 * d_out * partial_rows + 10 * r * r + 12 * d_out
        if total <= limit:
            return kc
    return 0


def factored_norm_triton(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    base_sq: Optional[torch.Tensor] = None,
    budget_bytes: int = 16 << 20,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(norm, base_sq)``, both fp32 ``[d_out]``, for tensors :func:`supports` accepts (the caller runs the
    eager norm otherwise). ``budget_bytes`` is accepted for interface parity with
    the eager path; the kernels never allocate more than ``U``'s size (partial G's; U itself is never stored), ``G``
    and a few ``[d_out]`` vectors (the cross term's and ``||W||^2``'s partial sums, the results). ``out``: a
    contiguous fp32 ``[d_out]`` tensor on the weight's device to write the norm into (CUDA-graph capture)."""
    if not supports(weight, lora_A, lora_B):
        raise ValueError("fastdora: the Triton norm does not support these tensors (check supports() first)")
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    dev = weight.device
    upcast = not weight.is_cuda  # CPU tensors run only under the Triton interpreter
    f32 = torch.float32
    with torch.no_grad(), _launch.device_ctx(weight):
        W, A, B = weight.detach(), lora_A.detach(), lora_B.detach()
        G = torch.empty((r, r), dtype=f32, device=dev)
        norm = torch.empty(d_out, dtype=f32, device=dev) if out is None else out
        need_base = base_sq is None
        plan = _gram_plan(W, A, False)
        mode, nparts, cfg = plan
        kc = d_in
        if mode == _MODE_PRESPLIT:
            kc = _presplit_chunk(d_out, d_in, r, cfg, dev)
            if kc == 0:  # the parts would not fit the working-set limit: split in registers
                mode, kc = _MODE_SPLIT, d_in
                plan = (mode, nparts, _gram_config(d_out, r, dev, mode, False, nparts))
                cfg = plan[2]
        quad_in_u = _S.norm_quad_in_u
        # G's bf16 parts for the quadratic term of the pre-split U pass on TMA (split once, by _g_sum_kernel)
        gparts = None
        k_last = d_in - (d_in - 1) // kc * kc  # the last chunk's columns: the chunk with the quadratic term
        if mode == _MODE_PRESPLIT and quad_in_u and not cfg[5] and _tma_cols_ok(W[:, d_in - k_last:], k_last):
            gparts = torch.empty((3, r, r), dtype=torch.bfloat16, device=dev)
        _gram_matrix(A, G, _g_split(r, d_in, d_out * r, dev), upcast, gparts)
        n_r = _launch.cdiv(r, cfg[1])
        # the U pass in K chunks of kc columns (one chunk except with the parts split per chunk), each chunk's K range
        # split into up to su ranges (the first chunk's: a shorter last chunk may use fewer); every chunk adds its
        # cross-term (and base) partial sums into the first chunk's rows of cpart (accumulated in chunk order), the
        # last chunk writes the quadratic term's partial sums after them
        su = _u_ranges(d_out, r, kc, cfg, dev)
        n_cross = su * n_r
        cpart = torch.empty((2 * n_cross if quad_in_u else n_cross, d_out), dtype=f32, device=dev)
        if need_base:
            n_base = su
            bpart = torch.empty((n_base, d_out), dtype=f32, device=dev)
            base = torch.empty(d_out, dtype=f32, device=dev)
        else:
            n_base = 1
            base = base_sq.detach().reshape(-1).to(device=dev, dtype=f32).contiguous()
            bpart = base
        s = float(scale)
        pbuf = torch.empty(3 * r * kc, dtype=torch.bfloat16, device=dev) if mode == _MODE_PRESPLIT else None
        n_quad = 0
        for k0 in range(0, d_in, kc):
            k1 = min(d_in, k0 + kc)
            last = k1 == d_in
            a_u, x = A, W
            if kc < d_in:
                a_u, x = A[:, k0:k1], W[:, k0:k1]
            if pbuf is not None:
                a_u = _split_parts(a_u, nparts, pbuf[: 3 * r * (k1 - k0)].view(3, r, k1 - k0))
            quad = quad_in_u and last
            used = _gram(x, a_u, cpart, bpart if need_base else None, upcast, split=su, b=B, plan=plan,
                         g=G if quad else None, accum=k0 > 0, quad_out=cpart[n_cross:] if quad else None,
                         gparts=gparts)
            assert used == su or k0 > 0
            if quad:
                n_quad = used * n_r
        del pbuf
        block_r = min(64, max(16, _next_pow2(r)))
        block_o = 64 if d_out >= 64 * _num_sms(dev) else 32
        prec = _S.norm_combine_prec if B.dtype == torch.bfloat16 else _S.norm_combine_prec_wide_b
        if upcast and prec != "split":  # the interpreter runs fp32 dots as "ieee"
            prec = "ieee"
        _COMBINE(
            (_launch.cdiv(d_out, block_o),),
            (cpart, bpart, G, B, base, norm),
            (d_out, r, n_cross, n_base, n_quad, B.stride(0), B.stride(1)),
            (2.0 * s, s * s, 0.0),
            (need_base, prec, _b_parts(B), upcast, block_o, block_r, not quad_in_u),
            4,
        )
    return norm, base
