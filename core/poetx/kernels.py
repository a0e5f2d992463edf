r"""Triton kernels of POET-X: the Cayley–Neumann blocks and the block-diagonal products (contiguous or permuted).

Same math as the PyTorch functions they replace (:func:`fastdora.poetx.cayley.neumann_series` and its backward,
:func:`fastdora.poetx.ops.rotate`, :func:`fastdora.poetx.ops.block_outer`); the callers dispatch here for tensors
:func:`applies` accepts and keep the PyTorch functions as the exact reference everywhere else.

Block-diagonal products (``rotate``, ``block_outer``):

- Activations are ``[N, d]`` rows with a unit-stride feature dim (any row stride). ``perm=None`` (what the layer op
  uses, see :data:`PERMUTE_FUSED`): block ``k`` is features ``k·b … k·b + b − 1``, read and written with unit-stride
  loads and stores. With a permutation, a program loads its block's ``b`` features of a row tile through the index
  vector (``t[rows, perm[k·b + j]]``) and stores its results through the same index (``out[rows, perm[k·b + c]]``),
  so the gather and the inverse scatter of :func:`~fastdora.poetx.ops.rotate` are the kernel's own loads and stores.
- ``rotate``: program ``(block k, column tile, row tile)``, the block index varying fastest so that the programs
  reading one row tile run together and find it in L2. Products on the tensor cores with fp32 accumulation: half
  activations with float32 blocks multiply the exact half tile by the block split into half-precision parts
  (``g ≈ hi + lo``, 16 significant bits, :data:`SPLIT_PARTS`), half blocks of the activations' dtype in one product,
  anything else (float32 activations, mixed half dtypes) as float32 products (``input_precision="ieee"``). The bias
  is added before the single rounding to the output dtype.
- ``block_outer``: program ``(block k, tile of c, tile of j, token split)``, ``Σ_rows a[row, perm[k·b+c]] ·
  b[row, perm[k·b+j]]`` as a ``[b, N] × [N, b]`` product per block with fp32 accumulation (exact products for half
  operands, the tensor cores' accumulation restarted every chunk of tokens and the chunks added in fp32); when a
  shape has too few tiles to fill the GPU the tokens are split over programs and the fp32 partial sums added in a
  fixed order (deterministic).

Cayley–Neumann blocks (``cayley_forward``, ``cayley_backward``), batched over the blocks, every ``b×b·b×b`` product
with fp32 operands and fp32 accumulation (on the GPU each operand split into two bf16 parts and three bf16
tensor-core products in a training step, :data:`CAYLEY_PRECISION`; 3xTF32 for a merge, :data:`MERGE_PRECISION`; fp32
FMAs under the interpreter). The dense skew
``Q`` is unpacked once per call (one launch: ``Q[i, j] = θ``, ``Q[j, i] = −θ``) so that every product reads dense
tiles. The default ``k = 3`` runs from ``Q`` and ``S = Q²`` (one launch for ``S``):

- forward: ``G = I + 2Q + 2S + S·(S + 2Q)`` in one launch (the operand ``S + 2Q`` formed in the loads);
- backward: ``∂L/∂S = 2Γ + Γ·(S − 2Q) + S·Γ`` in one launch (two products), then ``D = 2Γ + 2·S·Γ − P·Q`` with ``P
  = ∂L/∂S + (∂L/∂S)ᵀ`` formed in the loads (two products), whose packing ``D_ij − D_ji`` is that of ``∂L/∂Q = 2Γ +
  2·S·Γ − (∂L/∂S)·Q − Q·(∂L/∂S)`` (``Sᵀ = S``, ``Qᵀ = −Q``; see :func:`_cayley3_backward`), then the packing
  launch: five launches and products per backward, three launches per forward.

In the backward with bf16x3 products (a training step on the GPU, :data:`SPLIT_OPERANDS`) the operands are split
into their two bf16 parts once, by the launch that produces them, and stored as parts: the unpack writes ``Q``'s
parts; the launch computing ``S`` writes, from each of its tiles, the parts of ``S``, ``S − 2Q`` and ``Γ``; the two
sums then load parts and run the three bf16 products per pair without converting (only ``P``, whose transpose is
another tile, is split in the loads): the conversions happen once per element instead of once per output tile
reading it (``b / 64`` times at the default tiles).

Other ``k``, one launch per matrix product:

- forward, Horner's scheme of ``G = I + 2(Q + … + Qᵏ) + Qᵏ⁺¹``: ``H = Q·Q + 2Q + 2I``, then ``H ← H·Q + 2I``, and
  ``G = H·Q + I`` (``k`` products, ``k`` launches; ``k = 1``: ``G = Q·Q + 2Q + I`` in one launch).
- backward, with ``Γ = ∂L/∂G`` and ``K = Qᵀ = −Q``: the vector-Jacobian product of ``Σ_m c_m Q^m`` is
  ``D = Σ_{i+j ≤ k} c_{i+j+1} Kⁱ Γ Kʲ``. The right powers ``R_j = Γ Kʲ`` (``R_j = −R_{j−1} Q``, ``k`` launches),
  then Horner on the left, ``W = R_0``, ``W ← V_i − Q·W`` for ``i = k−1 … 0`` with ``V_i = 2·Σ_{j<k−i} R_j +
  R_{k−i}`` added in the same launch (``k`` launches), and one launch that packs ``∂L/∂θ_ij = D_ij − D_ji``: ``2k``
  products against the ``3k − 1`` of the plain recurrence.

Launches: a layer's fwd+bwd is about eighteen launches of these kernels, most a few microseconds of GPU work each.
On a GPU with programmatic dependent launch (compute capability >= 9.0, :data:`fastdora._launch.PDL`) every kernel
here is launched as one: each starts by waiting for the kernel before it (``gdc_wait``), so its launch and
the scheduling of its programs overlap the end of that kernel instead of following it; the arithmetic is unchanged
(the GPU tests compare the results bit for bit). H100, full-depth Llama-8B step: 176.1 against 183.3 ms.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests): half-precision dots are run as fp32 dots of the
same (exactly representable) operands, and fp32 -> bf16 stores round to nearest even with integer ops (the
interpreter's cast truncates), so the interpreter computes what the GPU computes.

Room left for an 8-bit base: the dense GEMM with ``W`` stays outside these kernels (``torch.matmul``), so a
dequantising GEMM can replace it without touching the block products.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .._launch import Launcher as _Launcher
from .._launch import device_ctx as _device_ctx
from .._launch import gdc_wait as _gdc_wait

try:  # pragma: no cover - exercised wherever triton is installed
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover
    triton = None
    tl = None
    AVAILABLE = False

__all__ = [
    "AVAILABLE",
    "ENABLED",
    "BLOCK_OUTER",
    "DEVICE_TYPES",
    "SPLIT_PARTS",
    "CAYLEY_PRECISION",
    "MERGE_PRECISION",
    "SPLIT_OPERANDS",
    "applies",
    "gather",
    "rotate",
    "block_outer",
    "cayley_forward",
    "cayley_backward",
    "outer_splits",
    "triu_indices",
    "WORK_FORWARD",
    "WORK_BACKWARD",
]

#: False: every caller runs its PyTorch code (to compare against the kernels, or where Triton misbehaves)
ENABLED = True
#: the block-gradient kernel (``block_outer``) on contiguous blocks: measured 0.089 ms against PyTorch's 0.658 ms on the
#: H200 (4096 features, 8192 bf16 rows, b=256; with the permutation fused into its loads it took 1.34 ms); False:
#: PyTorch's einsum computes the block gradients
BLOCK_OUTER = True
#: True: ``rotate`` and ``block_outer`` gather and scatter through the permutation inside the block products' own
#: loads and stores. Measured on the H200 (4096 features, 8192 bf16 rows, b=256): 0.91 ms per fused ``rotate``, each
#: 2-byte element a memory transaction of its own, against ~0.1 ms for a permutation pass (``index_select``); so by
#: default each permutation is a pass of its own and the block products read and write contiguous blocks. (Staging
#: whole rows on chip with ``tl.gather`` took Triton 250 s to compile at 4096 features.)
PERMUTE_FUSED = False
#: device types whose tensors take the kernels (tests add "cpu" under Triton's interpreter)
DEVICE_TYPES: tuple = ("cuda",)
#: half-precision parts a float32 block is split into for products with half activations (2: 16 significant bits,
#: far below the half-precision output's rounding; 3: float32's 24 bits, 1.5x the tensor-core work)
SPLIT_PARTS = 2

#: input precision of the Cayley–Neumann kernels' fp32 products in a training step on the GPU: "bf16x3" (each operand
#: split into two bf16 parts, 16 significant bits, three bf16 tensor-core products: G within ~1e-6 relative of the
#: float64 series at realistic Q norms, the 16 bits that the block products keep of G, SPLIT_PARTS), "tf32x3" (three
#: TF32 products, float32-level) or "ieee" (fp32 FMAs). Measured on an H100, b=256, 72 blocks (a gate projection's
#: two sides): forward 0.091 / backward 0.241 ms with bf16x3 against 0.173 / 0.506 ms with tf32x3
CAYLEY_PRECISION = "bf16x3"
#: the series backward with bf16x3 products at ``k = 3``: each operand of its products split into its two bf16 parts
#: once, by the launch that produces it, and stored as the two parts (:func:`_cayley3_backward_parts`); False: the
#: products split every fp32 tile they load (each operand tile once per output tile reading it), as the forward does.
#: Measured on an H100 (b=256, 72 / 1024 blocks): backward 0.209 / 2.470 ms against 0.229 / 2.714 ms; the forward
#: (one product after the square), tried the same way, measured slower (0.101 / 1.156 against 0.095 / 1.095 ms: the
#: parts' extra stores cost more than the conversions they save) and splits in its loads
SPLIT_OPERANDS = True
#: the same for the series of a merge or an export (:func:`cayley_forward` with ``precision``), whose blocks are
#: multiplied into the weight: float32-level
MERGE_PRECISION = "tf32x3"

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF = (torch.float16, torch.bfloat16)


def applies(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether the kernels take these tensors: Triton is importable, :data:`ENABLED`, every floating-point tensor (None
    skipped) has a kernel dtype, all sit on one device of a type in :data:`DEVICE_TYPES`."""
    if not (AVAILABLE and ENABLED):
        return False
    device = None
    for t in tensors:
        if t is None:
            continue
        if t.device.type not in DEVICE_TYPES or (device is not None and t.device != device):
            return False
        if t.is_floating_point() and t.dtype not in _DTYPES:
            return False
        device = t.device
    return device is not None


@functools.lru_cache(maxsize=4096)
def _p2(n: int, lo: int = 16, hi: int = 1 << 30) -> int:
    """The power of two >= n, clamped to [lo, hi] (tl.dot needs tile sides >= 16)."""
    return max(lo, min(hi, 1 << max(0, int(n) - 1).bit_length()))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[N, d]`` with a unit-stride last dim (a copy only when the layout needs one)."""
    if t.dim() == 2 and t.stride(1) == 1:  # the layer op's tensors: no reshape call
        return t
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


# --------------------------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------------------------

if AVAILABLE:

    @triton.jit
    def _dot(p, q, acc, UPCAST: tl.constexpr):
        """acc + p @ q with fp32 accumulation; UPCAST (the interpreter, CPU tensors): an fp32 dot of the same operands
        (products of half-precision operands are exact in fp32, as on the tensor cores)."""
        if UPCAST:
            return tl.dot(p.to(tl.float32), q.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(p, q, acc)

    @triton.jit
    def _split2(x, dtype: tl.constexpr):
        """``(hi, lo)``: an fp32 tile as two parts of the half ``dtype``, ``hi`` = x rounded and ``lo`` = the remainder
        rounded (``x ≈ hi + lo``, 16 significant bits for bf16). The one split of every kernel here (the block
        products' split of float32 blocks, the series' bf16x3 products, the series' split output), so the parts the
        series stores are bit for bit those a block product would form from its float32 result."""
        hi = x.to(dtype)
        return hi, (x - hi.to(tl.float32)).to(dtype)

    @triton.jit
    def _mma(a, g, acc, PARTS: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ g. PARTS 0: float32 products of both operands; 1: one product in a's dtype (g has it); 2 / 3: g
        split into that many parts of a's half dtype (hi + lo [+ lo2]), one exact product each."""
        if PARTS == 0:
            return tl.dot(a.to(tl.float32), g.to(tl.float32), acc, input_precision="ieee")
        g32 = g.to(tl.float32)
        if PARTS == 1:
            return _dot(a, g32.to(a.dtype), acc, UPCAST)
        hi, mid = _split2(g32, a.dtype)
        acc = _dot(a, hi, acc, UPCAST)
        acc = _dot(a, mid, acc, UPCAST)
        if PARTS >= 3:
            acc = _dot(a, (g32 - hi.to(tl.float32) - mid.to(tl.float32)).to(a.dtype), acc, UPCAST)
        return acc

    @triton.jit
    def _cast_to(x, ptr, SOFT_BF16: tl.constexpr):
        """fp32 -> the element type of ``ptr``, rounding to nearest even (SOFT_BF16: bf16 rounding with integer ops,
        for the interpreter whose cast truncates)."""
        if ptr.dtype.element_ty == tl.float32:
            return x
        elif SOFT_BF16 and ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(ptr.dtype.element_ty)

    # Every kernel below starts with ``if PDL: _gdc_wait()``. Launched as a programmatic dependent launch
    # (:func:`fastdora._launch.pdl_applies`) it waits there until the kernel before it has finished and its writes are
    # visible, before any load or store. Written out in each kernel, not as a helper: Triton's interpreter (the CPU
    # tests) runs a helper call once per program, ~0.3 ms each. No kernel here lets the next one be scheduled early
    # (``gdc_launch_dependents``): that lets the next kernel's programs take SM resources while they wait, and it made
    # an 8-layer Llama-8B step slower on an H100 (wall 60.5 against 58.7 ms without PDL); with the implicit signal at
    # each kernel's end the step is faster (57.2 ms; ``benchmarks/results/
    # poetx_programmatic_dependent_launch_h100_2026-12-07``).

    @triton.jit
    def _rotate_kernel(
        t_ptr, perm_ptr, g_ptr, glo_ptr, bias_ptr, out_ptr,
        N, stride_t, stride_out, n_ctiles, blocks_per_prog,
        B: tl.constexpr, TRANSPOSE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTS: tl.constexpr, UPCAST: tl.constexpr,
        SOFT_BF16: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
        BLOCK_K: tl.constexpr, PRESPLIT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            _gdc_wait()
        # out[r, perm[k·B + c]] = Σ_j t[r, perm[k·B + j]] · G[k, c, j]   (TRANSPOSE: · G[k, j, c]) + bias[perm[k·B + c]]
        # program (group of blocks_per_prog blocks, column tile; row tile): the group index varies fastest, so the
        # programs gathering from one row tile run together (L2); a group of several blocks gathers its rows'
        # features from the program's own L1. GATHER False: the blocks are contiguous (perm is the identity, not read).
        # EVEN (the tiles divide the block): no feature masks, only the row mask
        EVEN: tl.constexpr = B % BLOCK_C == 0 and B % BLOCK_K == 0
        pid = tl.program_id(0)
        pid_m = tl.program_id(1)
        group = pid // n_ctiles
        ct = pid % n_ctiles
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        rmask = rows < N
        cols = ct * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < B
        for i in range(0, blocks_per_prog):
            base = (group * blocks_per_prog + i).to(tl.int64) * B
            if GATHER:
                f_out = tl.load(perm_ptr + base + cols, mask=cmask, other=0)
            else:
                f_out = base + cols
            g_blk = g_ptr + base * B
            acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
            for j0 in range(0, B, BLOCK_K):
                js = j0 + tl.arange(0, BLOCK_K)
                jmask = js < B
                if GATHER:
                    f_in = tl.load(perm_ptr + base + js, mask=jmask, other=0)
                else:
                    f_in = base + js
                if TRANSPOSE:
                    g_offs = js[:, None] * B + cols[None, :]
                else:
                    g_offs = cols[None, :] * B + js[:, None]
                if EVEN:
                    a = tl.load(t_ptr + rows[:, None] * stride_t + f_in[None, :], mask=rmask[:, None], other=0.0)
                    g = tl.load(g_blk + g_offs)
                else:
                    a = tl.load(t_ptr + rows[:, None] * stride_t + f_in[None, :],
                                mask=rmask[:, None] & jmask[None, :], other=0.0)
                    g = tl.load(g_blk + g_offs, mask=jmask[:, None] & cmask[None, :], other=0.0)
                if PRESPLIT:  # g is the high half-precision part of the blocks, glo the low part (g_blk's layout)
                    acc = _dot(a, g, acc, UPCAST)
                    if EVEN:
                        lo = tl.load(glo_ptr + base * B + g_offs)
                    else:
                        lo = tl.load(glo_ptr + base * B + g_offs, mask=jmask[:, None] & cmask[None, :], other=0.0)
                    acc = _dot(a, lo, acc, UPCAST)
                else:
                    acc = _mma(a, g, acc, PARTS, UPCAST)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + f_out, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if EVEN:
                tl.store(out_ptr + rows[:, None] * stride_out + f_out[None, :], _cast_to(acc, out_ptr, SOFT_BF16),
                         mask=rmask[:, None])
            else:
                tl.store(out_ptr + rows[:, None] * stride_out + f_out[None, :], _cast_to(acc, out_ptr, SOFT_BF16),
                         mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _outer_kernel(
        a_ptr, b_ptr, perm_ptr, out_ptr,
        N, B, stride_a, stride_b, n_ctiles, n_jtiles, rows_per_prog, stride_split, zero,
        HALF: tl.constexpr, UPCAST: tl.constexpr, SOFT_BF16: tl.constexpr, GATHER: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            _gdc_wait()
        # out[s, k, c, j] = Σ_{rows of split s} a[r, perm[k·B + c]] · b[r, perm[k·B + j]] (GATHER False: perm is the
        # identity, not read)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        per_blk = n_ctiles * n_jtiles
        blk = pid // per_blk
        ct = (pid % per_blk) // n_jtiles
        jt = pid % n_jtiles
        cs = ct * BLOCK_C + tl.arange(0, BLOCK_C)
        js = jt * BLOCK_J + tl.arange(0, BLOCK_J)
        cmask = cs < B
        jmask = js < B
        base = blk.to(tl.int64) * B
        if GATHER:
            f_c = tl.load(perm_ptr + base + cs, mask=cmask, other=0)
            f_j = tl.load(perm_ptr + base + js, mask=jmask, other=0)
        else:
            f_c = base + cs
            f_j = base + js
        row0 = split.to(tl.int64) * rows_per_prog
        row_end = tl.minimum(row0 + rows_per_prog, N)
        acc = tl.zeros([BLOCK_C, BLOCK_J], dtype=tl.float32)
        fresh = acc + zero  # a runtime 0.0: the compiler cannot fold ``acc += dot(.., fresh)`` into a chained dot
        for r0 in range(0, rows_per_prog, BLOCK_N):
            rows = row0 + r0 + tl.arange(0, BLOCK_N).to(tl.int64)
            rmask = rows < row_end
            a = tl.load(a_ptr + rows[:, None] * stride_a + f_c[None, :], mask=rmask[:, None] & cmask[None, :],
                        other=0.0)
            b = tl.load(b_ptr + rows[:, None] * stride_b + f_j[None, :], mask=rmask[:, None] & jmask[None, :],
                        other=0.0)
            # each chunk's product from a zero accumulator, added to the running fp32 sum (the tensor cores' chained
            # accumulation over thousands of tokens loses precision)
            if HALF:
                acc += _dot(tl.trans(a), b, fresh, UPCAST)
            else:
                acc += tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), fresh, input_precision="ieee")
        out = out_ptr + split.to(tl.int64) * stride_split + base * B
        tl.store(out + cs[:, None] * B + js[None, :], _cast_to(acc, out_ptr, SOFT_BF16),
                 mask=cmask[:, None] & jmask[None, :])

    @triton.jit
    def _gather_kernel(t_ptr, idx_ptr, out_ptr, N, D, stride_t, stride_o,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            _gdc_wait()
        # out[r, c] = t[r, idx[c]]: program (column tile, row tile), the column tiles of one row tile running together
        # so that its rows are read from L2 after the first touch
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        rows = (tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cmask = cols < D
        mask = (rows < N)[:, None] & cmask[None, :]
        src = tl.load(idx_ptr + cols, mask=cmask, other=0)
        v = tl.load(t_ptr + rows[:, None] * stride_t + src[None, :], mask=mask)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], v, mask=mask)

    @triton.jit
    def _skew_tile(q_ptr, r, c, B):
        """Q[r, c] of the block whose packed strict upper triangle starts at q_ptr (r: [X, 1], c: [1, Y] indices):
        θ at the row-major triangle index of (min, max), negated below the diagonal, 0 on it and outside the block."""
        lo = tl.minimum(r, c)
        hi = tl.maximum(r, c)
        idx = lo * (2 * B - lo - 1) // 2 + hi - lo - 1
        v = tl.load(q_ptr + idx, mask=(r < B) & (c < B) & (r != c), other=0.0).to(tl.float32)
        return tl.where(r < c, v, -v)

    @triton.jit
    def _packed_block(q_ptr, q2_ptr, blk, NPK, N1):
        """The packed triangle of block ``blk``: in q for blocks < N1, in q2 after them (two parameter tensors read
        side by side without concatenating them)."""
        if blk < N1:
            return q_ptr + blk.to(tl.int64) * NPK
        return q2_ptr + (blk - N1).to(tl.int64) * NPK

    @triton.jit
    def _unpack_kernel(q_ptr, q2_ptr, out_ptr, B, NPK, n_tiles, N1, NBB, PARTS: tl.constexpr, BLOCK_T: tl.constexpr,
                       PDL: tl.constexpr):
        if PDL:
            _gdc_wait()
        # out[k] = the dense skew Q of block k, one tile per program (blocks k >= N1 from q2): fp32, or (PARTS) its
        # two bf16 parts, the low part NBB elements after the high one
        pid = tl.program_id(0)
        per_blk = n_tiles * n_tiles
        blk = pid // per_blk
        ri = ((pid % per_blk) // n_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
        cj = (pid % n_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
        q = _skew_tile(_packed_block(q_ptr, q2_ptr, blk, NPK, N1), ri[:, None], cj[None, :], B)
        offs = blk.to(tl.int64) * B * B + ri[:, None] * B + cj[None, :]
        mask = (ri < B)[:, None] & (cj < B)[None, :]
        if PARTS:
            _store_parts(out_ptr, offs, NBB, q, mask, False)
        else:
            tl.store(out_ptr + offs, q, mask=mask)

    @triton.jit
    def _cn_load(ptr, offs, mask, EVEN: tl.constexpr):
        if EVEN:
            return tl.load(ptr + offs)
        return tl.load(ptr + offs, mask=mask, other=0.0)

    @triton.jit
    def _cn_store(ptr, offs, x, mask, EVEN: tl.constexpr):
        if EVEN:
            tl.store(ptr + offs, x)
        else:
            tl.store(ptr + offs, x, mask=mask)

    @triton.jit
    def _store_parts(ptr, offs, NBB, x, mask, EVEN: tl.constexpr):
        """An fp32 tile as its two bf16 parts (:func:`_split2`): ``hi`` at ``ptr``, ``lo`` ``NBB`` elements later."""
        hi, lo = _split2(x, tl.bfloat16)
        _cn_store(ptr, offs, hi, mask, EVEN)
        _cn_store(ptr + NBB, offs, lo, mask, EVEN)

    @triton.jit
    def _cn_tile(pid, B: tl.constexpr, BLOCK_T: tl.constexpr):
        """(block offset, rows, columns) of program ``pid``: blocks of ``B×B`` in ``BLOCK_T`` tiles, the tiles of one
        block in consecutive programs."""
        n_tiles: tl.constexpr = (B + BLOCK_T - 1) // BLOCK_T
        per_blk: tl.constexpr = n_tiles * n_tiles
        blk = pid // per_blk
        ri = ((pid % per_blk) // n_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
        cj = (pid % n_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
        return blk.to(tl.int64) * B * B, ri, cj

    @triton.jit
    def _cn_kstep(dense, ri, cj, k0, B: tl.constexpr, BLOCK_K: tl.constexpr):
        """The reduction step at ``k0`` of output tile ``(ri, cj)``: ``(ks, offsets and mask of the A tile [ri, ks],
        offsets and mask of the B tile [ks, cj])`` in the dense blocks."""
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < B
        return (ks, dense + ri[:, None] * B + ks[None, :], (ri < B)[:, None] & kmask[None, :],
                dense + ks[:, None] * B + cj[None, :], kmask[:, None] & (cj < B)[None, :])

    @triton.jit
    def _cn_out(dense, ri, cj, B: tl.constexpr):
        """``(offsets, mask)`` of output tile ``(ri, cj)`` in the dense blocks."""
        return dense + ri[:, None] * B + cj[None, :], (ri < B)[:, None] & (cj < B)[None, :]

    @triton.jit
    def _cn_dot3(a_hi, a_lo, b_hi, b_lo, acc, UPCAST: tl.constexpr):
        """acc + (a_hi + a_lo) @ (b_hi + b_lo) less ``lo·lo`` (below the parts' own rounding): the three bf16
        tensor-core products ``lo·hi + hi·lo + hi·hi`` with fp32 accumulation."""
        acc = _dot(a_lo, b_hi, acc, UPCAST)
        acc = _dot(a_hi, b_lo, acc, UPCAST)
        return _dot(a_hi, b_hi, acc, UPCAST)

    @triton.jit
    def _cn_dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b for fp32 tiles. PREC "bf16x3": each operand split into two bf16 parts (``x ≈ hi + lo``, 16
        significant bits) and :func:`_cn_dot3`; otherwise Triton's ``input_precision`` ("ieee", "tf32", "tf32x3")."""
        if PREC == "bf16x3":
            a_hi, a_lo = _split2(a, tl.bfloat16)
            b_hi, b_lo = _split2(b, tl.bfloat16)
            return _cn_dot3(a_hi, a_lo, b_hi, b_lo, acc, UPCAST)
        return tl.dot(a, b, acc, input_precision=PREC)

    @triton.jit
    def _cn_step_kernel(
        a_ptr, b_ptr, q_ptr, v_ptr, out_ptr,
        nv, stride_v, sign, beta, gamma,
        B: tl.constexpr, ADD_Q: tl.constexpr, PREC: tl.constexpr, SOFT_BF16: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            _gdc_wait()
        # out[k] = sign·(A[k] @ B[k]) + beta·Q[k] + gamma·I + Σ_{v<nv} c_v·V[v, k],  c_v = 2 (v < nv-1), 1 (v = nv-1)
        # A, B, Q, V: dense fp32 [n, B, B] blocks
        EVEN: tl.constexpr = B % BLOCK_T == 0 and B % BLOCK_K == 0
        dense, ri, cj = _cn_tile(tl.program_id(0), B, BLOCK_T)
        acc = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, B, BLOCK_K):
            ks, a_offs, a_mask, b_offs, b_mask = _cn_kstep(dense, ri, cj, k0, B, BLOCK_K)
            a = _cn_load(a_ptr, a_offs, a_mask, EVEN)
            acc = _cn_dot(a, _cn_load(b_ptr, b_offs, b_mask, EVEN), acc, PREC, SOFT_BF16)
        acc = acc * sign
        offs, mask = _cn_out(dense, ri, cj, B)
        if ADD_Q:
            acc += beta * _cn_load(q_ptr, offs, mask, EVEN)
        acc += tl.where(ri[:, None] == cj[None, :], gamma, 0.0)
        for v in range(0, nv):
            coef = tl.where(v == nv - 1, 1.0, 2.0)
            acc += coef * _cn_load(v_ptr + v * stride_v, offs, mask, EVEN)
        _cn_store(out_ptr, offs, _cast_to(acc, out_ptr, SOFT_BF16), mask, EVEN)

    @triton.jit
    def _cn_sum_kernel(
        a1_ptr, b1_ptr, x1_ptr, a2_ptr, b2_ptr, a3_ptr, b3_ptr, z1_ptr, z2_ptr, out_ptr, lo_ptr,
        s1, c1, s2, s3, cz1, cz2, gamma,
        B: tl.constexpr, NPROD: tl.constexpr, HAS_X1: tl.constexpr, HAS_Z2: tl.constexpr, SYM_A2: tl.constexpr,
        PREC: tl.constexpr, SOFT_BF16: tl.constexpr, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            _gdc_wait()
        # out[k] = s1·A1[k]·(B1[k] + c1·X1[k]) + s2·A2[k]·B2[k] + s3·A3[k]·B3[k] + cz1·Z1[k] + cz2·Z2[k] + gamma·I
        # (the first NPROD products; X1 and Z2 only when flagged; SYM_A2: A2[k] + A2[k]ᵀ in place of A2[k], the
        # transpose read in the loads); all dense fp32 [n, B, B] blocks. SPLIT: the fp32
        # result is stored as two parts of out's half dtype instead, out = the result converted and lo = the
        # remainder converted (the parts _mma forms from fp32 blocks in the block product). One accumulator
        # per product: the products are independent and overlap on the tensor cores (one shared accumulator, each A
        # tile scaled by its s, measured 25% slower: 19.9 against 15.9 ms per 8-layer step)
        EVEN: tl.constexpr = B % BLOCK_T == 0 and B % BLOCK_K == 0
        dense, ri, cj = _cn_tile(tl.program_id(0), B, BLOCK_T)
        acc1 = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, B, BLOCK_K):
            ks, a_offs, a_mask, b_offs, b_mask = _cn_kstep(dense, ri, cj, k0, B, BLOCK_K)
            bt = _cn_load(b1_ptr, b_offs, b_mask, EVEN)
            if HAS_X1:
                bt += c1 * _cn_load(x1_ptr, b_offs, b_mask, EVEN)
            acc1 = _cn_dot(_cn_load(a1_ptr, a_offs, a_mask, EVEN), bt, acc1, PREC, SOFT_BF16)
            if NPROD >= 2:
                a2 = _cn_load(a2_ptr, a_offs, a_mask, EVEN)
                if SYM_A2:
                    a2 += _cn_load(a2_ptr, dense + ks[None, :] * B + ri[:, None], a_mask, EVEN)
                acc2 = _cn_dot(a2, _cn_load(b2_ptr, b_offs, b_mask, EVEN), acc2, PREC, SOFT_BF16)
            if NPROD >= 3:
                acc3 = _cn_dot(_cn_load(a3_ptr, a_offs, a_mask, EVEN), _cn_load(b3_ptr, b_offs, b_mask, EVEN), acc3,
                               PREC, SOFT_BF16)
        acc = s1 * acc1
        if NPROD >= 2:
            acc += s2 * acc2
        if NPROD >= 3:
            acc += s3 * acc3
        offs, mask = _cn_out(dense, ri, cj, B)
        acc += cz1 * _cn_load(z1_ptr, offs, mask, EVEN)
        if HAS_Z2:
            acc += cz2 * _cn_load(z2_ptr, offs, mask, EVEN)
        acc += tl.where(ri[:, None] == cj[None, :], gamma, 0.0)
        if SPLIT:
            hi, lo = _split2(acc, out_ptr.dtype.element_ty)
            _cn_store(out_ptr, offs, hi, mask, EVEN)
            _cn_store(lo_ptr, offs, lo, mask, EVEN)
        else:
            _cn_store(out_ptr, offs, _cast_to(acc, out_ptr, SOFT_BF16), mask, EVEN)

    @triton.jit
    def _cn_parts(ptr, offs, NBB, mask, EVEN: tl.constexpr):
        """``(hi, lo)``: the tile of an operand stored as its two bf16 parts (see :func:`_store_parts`)."""
        return _cn_load(ptr, offs, mask, EVEN), _cn_load(ptr + NBB, offs, mask, EVEN)

    @triton.jit
    def _cn_square_kernel(
        qs_ptr, q_ptr, q2_ptr, g_ptr, s_ptr, m_ptr, gs_ptr,
        NPK, N1, NBB, c,
        B: tl.constexpr, SOFT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            _gdc_wait()
        # S = Q·Q from Q's two bf16 parts (qs), three bf16 products (fp32 accumulation); the tile's epilogue, with Q's
        # fp32 tile read from the packed triangles (blocks >= N1 from q2), writes the operands of the next products as
        # two bf16 parts each (so they are split once, not once per tile that reads them): S -> s, S + c·Q -> m and
        # Γ (g, fp32) -> gs
        EVEN: tl.constexpr = B % BLOCK_T == 0 and B % BLOCK_K == 0
        n_tiles: tl.constexpr = (B + BLOCK_T - 1) // BLOCK_T
        blk = tl.program_id(0) // (n_tiles * n_tiles)
        dense, ri, cj = _cn_tile(tl.program_id(0), B, BLOCK_T)
        acc = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, B, BLOCK_K):
            ks, a_offs, a_mask, b_offs, b_mask = _cn_kstep(dense, ri, cj, k0, B, BLOCK_K)
            a_hi, a_lo = _cn_parts(qs_ptr, a_offs, NBB, a_mask, EVEN)
            b_hi, b_lo = _cn_parts(qs_ptr, b_offs, NBB, b_mask, EVEN)
            acc = _cn_dot3(a_hi, a_lo, b_hi, b_lo, acc, SOFT_BF16)
        offs, mask = _cn_out(dense, ri, cj, B)
        q = _skew_tile(_packed_block(q_ptr, q2_ptr, blk, NPK, N1), ri[:, None], cj[None, :], B)
        _store_parts(s_ptr, offs, NBB, acc, mask, EVEN)
        _store_parts(m_ptr, offs, NBB, acc + c * q, mask, EVEN)
        _store_parts(gs_ptr, offs, NBB, _cn_load(g_ptr, offs, mask, EVEN), mask, EVEN)

    @triton.jit
    def _cn_psum_kernel(
        a1_ptr, b1_ptr, a2_ptr, b2_ptr, z1_ptr, out_ptr,
        NBB, s1, s2, cz1,
        B: tl.constexpr, SYM_A2: tl.constexpr, SOFT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            _gdc_wait()
        # out[k] = s1·A1[k]·B1[k] + s2·A2[k]·B2[k] + cz1·Z1[k] with A1, B1, B2 and A2 stored as two bf16 parts each
        # (:func:`_store_parts`), three bf16 products per pair (fp32 accumulation, one accumulator per product);
        # SYM_A2: A2 dense fp32 and A2 + A2ᵀ in its place, formed and split in the loads. Z1 and out dense fp32
        EVEN: tl.constexpr = B % BLOCK_T == 0 and B % BLOCK_K == 0
        dense, ri, cj = _cn_tile(tl.program_id(0), B, BLOCK_T)
        acc1 = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, B, BLOCK_K):
            ks, a_offs, a_mask, b_offs, b_mask = _cn_kstep(dense, ri, cj, k0, B, BLOCK_K)
            a_hi, a_lo = _cn_parts(a1_ptr, a_offs, NBB, a_mask, EVEN)
            b_hi, b_lo = _cn_parts(b1_ptr, b_offs, NBB, b_mask, EVEN)
            acc1 = _cn_dot3(a_hi, a_lo, b_hi, b_lo, acc1, SOFT_BF16)
            if SYM_A2:
                a2 = _cn_load(a2_ptr, a_offs, a_mask, EVEN)
                a2 += _cn_load(a2_ptr, dense + ks[None, :] * B + ri[:, None], a_mask, EVEN)
                a2_hi, a2_lo = _split2(a2, tl.bfloat16)
            else:
                a2_hi, a2_lo = _cn_parts(a2_ptr, a_offs, NBB, a_mask, EVEN)
            b2_hi, b2_lo = _cn_parts(b2_ptr, b_offs, NBB, b_mask, EVEN)
            acc2 = _cn_dot3(a2_hi, a2_lo, b2_hi, b2_lo, acc2, SOFT_BF16)
        offs, mask = _cn_out(dense, ri, cj, B)
        acc = s1 * acc1 + s2 * acc2 + cz1 * _cn_load(z1_ptr, offs, mask, EVEN)
        _cn_store(out_ptr, offs, acc, mask, EVEN)

    @triton.jit
    def _sum_splits_kernel(p_ptr, out_ptr, M, n_split, SOFT_BF16: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
        if PDL:
            _gdc_wait()
        # out[i] = Σ_s p[s, i], the splits added in order (fp32), one rounding to out's dtype
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M
        acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
        for s in range(1, n_split):
            acc += tl.load(p_ptr + s * M + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, _cast_to(acc, out_ptr, SOFT_BF16), mask=mask)

    @triton.jit
    def _pack_kernel(d_ptr, rows_ptr, cols_ptr, out_ptr, out2_ptr, B, NPK, N1, SOFT_BF16: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            _gdc_wait()
        # out[k, m] = D[k, rows[m], cols[m]] - D[k, cols[m], rows[m]]: the gradient of the stored θ of a skew Q;
        # blocks k >= N1 go to out2
        blk = tl.program_id(1)
        ms = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = ms < NPK
        r = tl.load(rows_ptr + ms, mask=mask, other=0)
        c = tl.load(cols_ptr + ms, mask=mask, other=0)
        d = d_ptr + blk.to(tl.int64) * B * B
        val = tl.load(d + r * B + c, mask=mask, other=0.0) - tl.load(d + c * B + r, mask=mask, other=0.0)
        if blk < N1:
            dst = out_ptr + blk.to(tl.int64) * NPK
        else:
            dst = out2_ptr + (blk - N1).to(tl.int64) * NPK
        tl.store(dst + ms, _cast_to(val, out_ptr, SOFT_BF16), mask=mask)


# --------------------------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------------------------

# each kernel's later launches with a seen specialisation skip Triton's JIT dispatch (:class:`fastdora._launch.
# Launcher`: a few microseconds instead of tens; a layer's fwd+bwd launches fourteen of them)
if AVAILABLE:
    _GATHER = _Launcher(_gather_kernel, pdl=True)
    _ROTATE = _Launcher(_rotate_kernel, pdl=True)
    _OUTER = _Launcher(_outer_kernel, pdl=True)
    _UNPACK = _Launcher(_unpack_kernel, pdl=True)
    _CN_STEP = _Launcher(_cn_step_kernel, pdl=True)
    _CN_SUM = _Launcher(_cn_sum_kernel, pdl=True)
    _CN_SQUARE = _Launcher(_cn_square_kernel, pdl=True)
    _CN_PSUM = _Launcher(_cn_psum_kernel, pdl=True)
    _PACK = _Launcher(_pack_kernel, pdl=True)
    _SUM_SPLITS = _Launcher(_sum_splits_kernel, pdl=True)


def _parts(t_dtype: torch.dtype, g_dtype: torch.dtype) -> int:
    """How ``rotate`` multiplies activations of ``t_dtype`` by blocks of ``g_dtype`` (see :func:`_mma`)."""
    if t_dtype in _HALF and g_dtype == t_dtype:
        return 1
    if t_dtype in _HALF and g_dtype == torch.float32:
        return SPLIT_PARTS
    return 0  # float32 activations, or half blocks of the other half dtype: float32 products


#: tile configurations (benchmark sweeps): ``{"block_m", "block_c", "block_k", "warps", "blocks_per_prog", "stages"}``
#: of ``rotate`` (``blocks_per_prog``: blocks one program handles in turn, "all" for every block; ``stages``:
#: Triton's software pipelining) and ``{"block_n", "block_c", "warps", "split_rows"}`` of ``block_outer``
#: (``split_rows``: the fewest tokens per program where the tokens are split over programs), each capped by the block
#: size; empty: the defaults
ROTATE_CONFIG: dict = {}
OUTER_CONFIG: dict = {}
#: ``{"block_r", "block_c", "warps"}`` of ``gather`` (block_c capped by the width)
GATHER_CONFIG: dict = {}
#: ``{"block_t", "block_k", "warps"}`` of the Cayley–Neumann products (output tile side, reduction step), each capped
#: by the block size
CAYLEY_CONFIG: dict = {}


def gather(t: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t[..., index]`` for a ``[d]`` int64 ``index`` (a permutation pass), one launch: the same values as
    ``index_select``, with a fraction of its host time. One row per program, up to 4096 features per tile: on the H200
    (bf16, 4096 features) 0.072 ms at 8192 rows and 0.022 ms at 2048, against ``index_select``'s 0.102 / 0.032 ms
    (8 rows of 512 features per program: 0.200 / 0.055 ms; ``poetx_bench.py --sections ops --sweep``). On an H100 at
    1024 rows of 4096 features, 0.0146 ms against a plain copy's 0.0103 ms (``--sections permute``); whole rows staged
    on chip and permuted with ``tl.gather`` measured 3-12x slower at 1024 features and took minutes to compile at 4096.
    ``out``: a contiguous ``[N, d]`` tensor of ``t``'s dtype to write into (for 2-D ``t``)."""
    t2 = _rows(t)
    n_rows, d = t2.shape[0], index.numel()
    if out is None:
        out = torch.empty((n_rows, d), dtype=t.dtype, device=t.device)
    if n_rows and d:
        cfg = GATHER_CONFIG
        block_r, block_c = cfg.get("block_r", 1), _p2(d, hi=cfg.get("block_c", 4096))
        with _device_ctx(t):
            _GATHER((_cdiv(d, block_c), _cdiv(n_rows, block_r)), (t2, index, out), (n_rows, d, t2.stride(0), d), (),
                    (block_r, block_c), cfg.get("warps", 8))
    return out if t.dim() == 2 else out.reshape(*t.shape[:-1], d)


def _rotate_config(n_rows: int, b: int) -> tuple:
    cfg = ROTATE_CONFIG
    block_c = _p2(b, hi=cfg.get("block_c", 128))
    block_m = _p2(min(n_rows, cfg.get("block_m", 128)), hi=cfg.get("block_m", 128))
    block_k = _p2(b, hi=cfg.get("block_k", 32))
    return block_m, block_c, block_k, cfg.get("warps", 8), cfg.get("blocks_per_prog", 1), cfg.get("stages")


def split_blocks(blocks: torch.Tensor, dtype: torch.dtype) -> tuple:
    """``(hi, lo)``: float32 ``blocks`` as two parts of the half ``dtype`` (``hi`` = the blocks rounded, ``lo`` = the
    remainder rounded), what :func:`rotate` multiplies by in its products with activations of that dtype
    (``SPLIT_PARTS = 2``): given to :func:`rotate` as ``blocks=hi, lo=lo``, the products read them instead of
    splitting the float32 blocks in every program."""
    hi = blocks.to(dtype)
    return hi, (blocks - hi.to(blocks.dtype)).to(dtype)


def rotate(
    t: torch.Tensor,
    perm: Optional[torch.Tensor],
    blocks: torch.Tensor,
    *,
    transpose: bool = False,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    lo: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`fastdora.poetx.ops.rotate` (same arguments and result) in one launch, the permutation fused into the
    loads and stores; ``perm=None``: the identity (blocks of contiguous features, unit-stride loads and stores).
    ``lo``: ``blocks`` is then the high part of the blocks in ``t``'s half dtype and ``lo`` the low part
    (:func:`split_blocks` of float32 blocks, or :func:`cayley_forward`'s ``split``): the same products as with the
    float32 blocks, read instead of formed in each program. ``out``: a contiguous ``[N, d]`` tensor of the result
    dtype to write into (for 2-D ``t``)."""
    n_blocks, b = blocks.shape[0], blocks.shape[-1]
    t2 = _rows(t)
    n_rows, d = t2.shape
    if out is None:
        out = torch.empty((n_rows, d), dtype=out_dtype or t.dtype, device=t.device)
    if n_rows == 0 or d == 0:
        return out.reshape(*t.shape[:-1], d)
    g = blocks.contiguous()
    gather = perm is not None
    perm = perm.contiguous() if gather else g
    bias_t = bias.contiguous() if bias is not None else g
    block_m, block_c, block_k, warps, per_prog, stages = _rotate_config(n_rows, b)
    per_prog = n_blocks if per_prog == "all" or n_blocks % per_prog else per_prog
    n_ctiles = _cdiv(b, block_c)
    grid = (n_blocks // per_prog * n_ctiles, _cdiv(n_rows, block_m))
    with _device_ctx(t):
        presplit = lo is not None
        if presplit and not (t.dtype in _HALF and g.dtype == lo.dtype == t.dtype and lo.shape == g.shape):
            raise ValueError("rotate: with lo, blocks and lo are the two parts in the activations' half dtype")
        lo = lo.contiguous() if presplit else g
        _ROTATE(grid, (t2, perm, g, lo, bias_t, out), (n_rows, t2.stride(0), out.stride(0), n_ctiles, per_prog), (),
                # B, TRANSPOSE, HAS_BIAS, PARTS, UPCAST, SOFT_BF16, GATHER, BLOCK_M, BLOCK_C, BLOCK_K, PRESPLIT
                (b, bool(transpose), bias is not None, _parts(t.dtype, g.dtype), not t.is_cuda, not t.is_cuda, gather,
                 block_m, block_c, block_k, presplit), warps, stages)
    return out if t.dim() == 2 else out.reshape(*t.shape[:-1], d)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _sm_count_cuda(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _outer_tiling(n_rows: int, n_blocks: int, size: int, device: torch.device) -> tuple:
    """``(block_n, block_c, n_ctiles, n_split, rows_per_prog)`` of :func:`block_outer`."""
    cfg = OUTER_CONFIG
    block_c = _p2(size, hi=cfg.get("block_c", 128))
    block_n = _p2(min(n_rows, cfg.get("block_n", 64)), hi=cfg.get("block_n", 64))
    n_ctiles = _cdiv(size, block_c)
    tiles = n_blocks * n_ctiles * n_ctiles
    # split the tokens over programs while the tiles alone leave the GPU's multiprocessors idle
    target = 2 * _sm_count(device)
    n_split = max(1, min(_cdiv(target, tiles), n_rows // cfg.get("split_rows", 1024)))
    rows_per_prog = _cdiv(_cdiv(n_rows, n_split), block_n) * block_n
    return block_n, block_c, n_ctiles, _cdiv(n_rows, rows_per_prog), rows_per_prog


def outer_splits(n_rows: int, blocks: torch.Tensor) -> int:
    """Over how many programs :func:`block_outer` splits ``n_rows`` tokens for ``blocks`` (its ``partial`` holds that
    many float32 copies of ``blocks`` when more than one)."""
    return _outer_tiling(n_rows, blocks.shape[0], blocks.shape[-1], blocks.device)[3]


def block_outer(a: torch.Tensor, b: torch.Tensor, perm: Optional[torch.Tensor], blocks: torch.Tensor,
                out: Optional[torch.Tensor] = None, partial: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`fastdora.poetx.ops.block_outer` (same arguments and result): per block ``Σ_rows gather(a)ᵀ ⊗
    gather(b)``, fp32 accumulation, the permutation fused into the loads (``perm=None``: the identity). ``out``: a
    contiguous tensor of ``blocks``' shape and dtype to write the result into (returned). Where the tokens are split
    over programs (:func:`outer_splits`), the float32 partial sums go to ``partial`` (contiguous ``[splits,
    *blocks.shape]``; allocated when not given) and one more launch adds them in order."""
    n_blocks, size = blocks.shape[0], blocks.shape[-1]
    a2, b2 = _rows(a), _rows(b)
    n_rows = a2.shape[0]
    if n_rows == 0:
        return blocks.new_zeros(blocks.shape) if out is None else out.zero_()
    gather = perm is not None
    perm = perm.contiguous() if gather else blocks
    block_n, block_c, n_ctiles, n_split, rows_per_prog = _outer_tiling(n_rows, n_blocks, size, a.device)
    tiles = n_blocks * n_ctiles * n_ctiles
    half = a2.dtype == b2.dtype and a2.dtype in _HALF
    result = out
    if result is None:
        result = torch.empty(blocks.shape, dtype=blocks.dtype, device=blocks.device)
    if n_split > 1 and partial is None:
        partial = torch.empty((n_split, *blocks.shape), dtype=torch.float32, device=blocks.device)
    elif n_split > 1 and (partial.shape != (n_split, *blocks.shape) or partial.dtype != torch.float32
                          or not partial.is_contiguous()):
        raise ValueError(f"block_outer splits {n_rows} tokens {n_split} ways for blocks of shape "
                         f"{tuple(blocks.shape)}: partial must be a contiguous float32 tensor of shape "
                         f"{(n_split, *blocks.shape)}, got {partial.dtype} {tuple(partial.shape)}")
    dest = result if n_split == 1 else partial
    with _device_ctx(a):
        _OUTER((tiles, n_split), (a2, b2, perm, dest),
               (n_rows, size, a2.stride(0), b2.stride(0), n_ctiles, n_ctiles, rows_per_prog, blocks.numel()), (0.0,),
               # HALF, UPCAST, SOFT_BF16, GATHER, BLOCK_N, BLOCK_C, BLOCK_J
               (half, not a.is_cuda, not a.is_cuda, gather, block_n, block_c, block_c), OUTER_CONFIG.get("warps", 8))
        if n_split > 1:
            m = blocks.numel()
            _SUM_SPLITS((_cdiv(m, 1024),), (partial, result), (m, n_split), (), (not a.is_cuda, 1024), 4)
    return result


def _cn_tiles(size: int) -> tuple:
    """``(BLOCK_T, BLOCK_K, tiles per side, warps, stages)`` of the Cayley–Neumann products for blocks of ``size``."""
    cfg = CAYLEY_CONFIG
    block_t = _p2(size, hi=cfg.get("block_t", 64))
    return (block_t, _p2(size, hi=cfg.get("block_k", 32)), _cdiv(size, block_t), cfg.get("warps", 4),
            cfg.get("stages"))


def _cn_precision(t: torch.Tensor, precision: Optional[str] = None) -> str:
    """The products' precision: ``precision`` or :data:`CAYLEY_PRECISION` on the GPU; on the CPU (the interpreter)
    fp32 FMAs unless "bf16x3" is asked for explicitly (tests: its bf16 products run as fp32 dots of the parts)."""
    if t.is_cuda:
        return precision or CAYLEY_PRECISION
    return "bf16x3" if precision == "bf16x3" else "ieee"


def _cn_step(a, b, q, v, out, size, *, sign=1.0, beta=0.0, gamma=0.0, nv=0, prec=None):
    """One launch of :func:`_cn_step_kernel` over all blocks (see its comment); a, b, q, v dense fp32; ``prec``: the
    products' precision (default :data:`CAYLEY_PRECISION`)."""
    n_blocks = q.shape[0]
    block_t, block_k, n_tiles, warps, stages = _cn_tiles(size)
    _CN_STEP((n_blocks * n_tiles * n_tiles,), (a, b, q, out if v is None else v, out),
             (nv, 0 if v is None or nv == 0 else v[0].numel()), (float(sign), float(beta), float(gamma)),
             # B, ADD_Q, PREC, SOFT_BF16, BLOCK_T, BLOCK_K
             (size, beta != 0.0, _cn_precision(q, prec), not q.is_cuda, block_t, block_k), warps, stages)
    return out


def _cn_sum(out, size, prods, *, z1, cz1=1.0, z2=None, cz2=0.0, gamma=0.0, prec=None, lo=None, sym_a2=False):
    """One launch of :func:`_cn_sum_kernel`: ``prods`` is a list of up to three ``(scale, A, B)`` (the first may be
    ``(scale, A, B, X, c)`` for ``A·(B + c·X)``; ``sym_a2``: the second is ``(A + Aᵀ)·B``); every tensor dense fp32
    ``[n, b, b]``, except with ``lo``: then ``out`` and ``lo`` (half, one dtype) receive the result's two parts."""
    n_blocks = out.shape[0]
    block_t, block_k, n_tiles, warps, stages = _cn_tiles(size)
    first = prods[0]
    x1, c1 = (first[3], first[4]) if len(first) == 5 else (first[2], 0.0)
    pad = [(0.0, first[1], first[2])] * (3 - len(prods))
    (s1, a1, b1), (s2, a2, b2), (s3, a3, b3) = [p[:3] for p in prods] + pad
    _CN_SUM((n_blocks * n_tiles * n_tiles,),
            (a1, b1, x1, a2, b2, a3, b3, z1, z1 if z2 is None else z2, out, out if lo is None else lo), (),
            (float(s1), float(c1), float(s2), float(s3), float(cz1), float(cz2), float(gamma)),
            # B, NPROD, HAS_X1, HAS_Z2, SYM_A2, PREC, SOFT_BF16, SPLIT, BLOCK_T, BLOCK_K
            (size, len(prods), len(first) == 5, z2 is not None, sym_a2, _cn_precision(z1, prec), not out.is_cuda,
             lo is not None, block_t, block_k), warps, stages)
    return out


def _dense_skew(packed: torch.Tensor, size: int, second: Optional[torch.Tensor] = None,
                q: Optional[torch.Tensor] = None, parts: bool = False) -> torch.Tensor:
    """The dense fp32 skew blocks ``Q`` (``[n, b, b]``) of the packed triangles (and of ``second``'s after them), one
    launch (into ``q`` when given); ``parts``: their two bf16 parts instead (:func:`_parts_of` of ``q``)."""
    n1 = packed.shape[0]
    n_blocks = n1 + (0 if second is None else second.shape[0])
    block_t, _, n_tiles, _, _ = _cn_tiles(size)
    if q is None:
        q = torch.empty((n_blocks, size, size), dtype=torch.float32, device=packed.device)
    out = _parts_of(q) if parts else q
    _UNPACK((n_blocks * n_tiles * n_tiles,), (packed, packed if second is None else second, out),
            (size, packed.shape[1], n_tiles, n1, q.numel()), (), (parts, block_t), 4)
    return q


def _parts_of(slot: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 ``[n, b, b]`` slot as the storage of an operand's two bf16 parts: flat, ``2·n·b·b``
    bfloat16, the high parts first (the kernels read the low part ``n·b·b`` elements after the high one)."""
    return slot.view(-1).view(torch.bfloat16)


def _packed_pair(packed: torch.Tensor, second: Optional[torch.Tensor]) -> tuple:
    packed = packed.contiguous()
    if second is not None:
        second = second.contiguous()
        if second.dtype != packed.dtype or second.shape[1:] != packed.shape[1:]:
            raise ValueError("the two packed tensors must share their dtype and block size")
    return packed, second, packed.shape[0] + (0 if second is None else second.shape[0])


#: dense float32 ``[n_blocks, b, b]`` temporaries of :func:`cayley_forward` / :func:`cayley_backward` at ``k = 3``
#: (their ``work`` argument; in the backward's split-operand path the parts of an operand take one)
WORK_FORWARD, WORK_BACKWARD = 2, 5


def cayley_forward(packed: torch.Tensor, block_size: int, terms: int,
                   second: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   work: Optional[torch.Tensor] = None, precision: Optional[str] = None,
                   split: Optional[tuple] = None):
    """``G = I + 2(Q + … + Qᵏ) + Qᵏ⁺¹`` (``[n_blocks, b, b]`` in ``packed``'s dtype) from the packed skew ``Q``; fp32
    products, one rounding to ``packed``'s dtype. ``second``: more packed blocks of the same dtype, whose ``G`` follow
    (the two sides of a layer in one set of launches, without concatenating them). ``out``: a contiguous tensor of
    the result's shape and dtype to write into; ``work``: at ``k = 3``, a contiguous float32 ``[WORK_FORWARD, n_blocks,
    b, b]`` tensor for the temporaries (``Q``, ``Q²``); ``precision``: the products' on the GPU (default
    :data:`CAYLEY_PRECISION`; a merge passes :data:`MERGE_PRECISION`). ``split``: at ``k = 3`` with float32
    ``packed``, a pair ``(hi, lo)`` of contiguous ``[n_blocks, b, b]`` tensors of one half dtype that receive ``G``
    as the two parts :func:`rotate` multiplies by (:func:`split_blocks`) instead of ``G`` itself (returned; ``out``
    unused)."""
    packed, second, n_blocks = _packed_pair(packed, second)
    b = block_size
    if split is not None:
        if terms != 3 or packed.dtype != torch.float32:
            raise ValueError("cayley_forward writes split blocks for float32 packed values at terms=3 only")
        out, lo = split
    if out is None:
        out = torch.empty((n_blocks, b, b), dtype=packed.dtype, device=packed.device)
    if n_blocks == 0:
        return out
    work = work if terms == 3 else None
    p = _cn_precision(packed, precision)
    with _device_ctx(packed):
        q = _dense_skew(packed, b, second, None if work is None else work[0])
        if terms == 3:  # from Q and S = Q²: G = I + 2Q + 2S + S·(S + 2Q), two launches after the unpack
            sq = _cn_step(q, q, q, None, torch.empty_like(q) if work is None else work[1], b, prec=p)
            _cn_sum(out, b, [(1.0, sq, sq, q, 2.0)], z1=sq, cz1=2.0, z2=q, cz2=2.0, gamma=1.0, prec=p,
                    lo=None if split is None else lo)
            return out if split is None else split
        if terms == 1:
            return _cn_step(q, q, q, None, out, b, beta=2.0, gamma=1.0, prec=p)  # G = Q·Q + 2Q + I
        h = _cn_step(q, q, q, None, torch.empty_like(q), b, beta=2.0, gamma=2.0, prec=p)  # H = Q·Q + 2Q + 2I
        for _ in range(terms - 2):
            h = _cn_step(h, q, q, None, torch.empty_like(h), b, gamma=2.0, prec=p)  # H·Q + 2I
        return _cn_step(h, q, q, None, out, b, gamma=1.0, prec=p)  # G = H·Q + I


def cayley_backward(packed: torch.Tensor, grad_g: torch.Tensor, block_size: int, terms: int,
                    second: Optional[torch.Tensor] = None, out: Optional[tuple] = None,
                    work: Optional[torch.Tensor] = None, precision: Optional[str] = None):
    """``∂L/∂θ`` (``[n_blocks, b(b−1)/2]``, ``packed``'s dtype) from ``Γ = ∂L/∂G``; fp32 products. With ``second``
    (see :func:`cayley_forward`; ``grad_g`` covers both): the pair ``(∂L/∂packed, ∂L/∂second)``. ``out``: the
    contiguous tensor to write the gradient into (with ``second``: the pair of them); ``work``: at ``k = 3``, a
    contiguous float32 ``[WORK_BACKWARD, n_blocks, b, b]`` tensor for the temporaries; ``precision``: the products'
    (default :data:`CAYLEY_PRECISION` on the GPU)."""
    packed, second, n_blocks = _packed_pair(packed, second)
    b, k = block_size, terms
    if out is None:
        out = torch.empty_like(packed)
        out2 = out if second is None else torch.empty_like(second)
    elif second is None:
        out2 = out
    else:
        out, out2 = out
    if n_blocks == 0:
        return out if second is None else (out, out2)
    work = work if k == 3 else None
    p = _cn_precision(packed, precision)
    with _device_ctx(packed):
        if k == 3:
            grad32 = grad_g.to(torch.float32).contiguous()
            if p == "bf16x3" and SPLIT_OPERANDS:
                w = _cayley3_backward_parts(packed, second, grad32, b, work)
            else:
                w = _cayley3_backward(_dense_skew(packed, b, second, None if work is None else work[0]), grad32, b,
                                      work, p)
        else:
            q = _dense_skew(packed, b, second)
            w = _horner_backward(q, grad_g, b, k)
        rows, cols = triu_indices(b, packed.device)
        npk = rows.numel()
        block = min(1024, _p2(npk))
        _PACK((_cdiv(npk, block), n_blocks), (w, rows, cols, out, out2), (b, npk, packed.shape[0]), (),
              (not packed.is_cuda, block), 4)
    return out if second is None else (out, out2)


def _cn_square(packed, second, qs, grad, size, c, *, s, m, gs):
    """One launch of :func:`_cn_square_kernel`: ``S = Q·Q`` from ``Q``'s parts ``qs``, its parts into ``s``, those
    of ``S + c·Q`` into ``m`` and those of ``Γ`` (``grad``) into ``gs``. Every ``[n, b, b]`` operand is a float32 slot
    (:func:`_parts_of` for the split ones)."""
    n_blocks = qs.shape[0]
    block_t, block_k, n_tiles, warps, stages = _cn_tiles(size)
    _CN_SQUARE((n_blocks * n_tiles * n_tiles,),
               (_parts_of(qs), packed, packed if second is None else second, grad, _parts_of(s), _parts_of(m),
                _parts_of(gs)),
               (packed.shape[1], packed.shape[0], qs.numel()), (float(c),),
               # B, SOFT_BF16, BLOCK_T, BLOCK_K
               (size, not qs.is_cuda, block_t, block_k), warps, stages)


def _cn_psum(out, size, p1, p2, *, z1, cz1, sym_a2=False):
    """One launch of :func:`_cn_psum_kernel`: ``p1`` / ``p2`` are ``(scale, A, B)`` of float32 slots holding split
    operands (``sym_a2``: ``p2``'s A dense float32, ``A + Aᵀ`` used); ``out`` and ``z1`` dense float32."""
    n_blocks = z1.shape[0]
    block_t, block_k, n_tiles, warps, stages = _cn_tiles(size)
    (s1, a1, b1), (s2, a2, b2) = p1, p2
    _CN_PSUM((n_blocks * n_tiles * n_tiles,),
             (_parts_of(a1), _parts_of(b1), a2 if sym_a2 else _parts_of(a2), _parts_of(b2), z1, out),
             (z1.numel(),), (float(s1), float(s2), float(cz1)),
             # B, SYM_A2, SOFT_BF16, BLOCK_T, BLOCK_K
             (size, sym_a2, not z1.is_cuda, block_t, block_k), warps, stages)
    return out


def _cayley3_backward_parts(packed, second, grad, b, work):
    """:func:`_cayley3_backward`'s ``D`` with bf16x3 products whose operands are split once by their producers
    (``Q`` by the unpack; ``S``, ``S − 2Q`` and ``Γ`` by the launch that computes ``S``); ``P = ∂L/∂S + (∂L/∂S)ᵀ``
    is split in the loads of the last launch. Four launches, five products."""
    if work is None:
        work = torch.empty((WORK_BACKWARD,) + tuple(grad.shape), dtype=torch.float32, device=grad.device)
    qs, sq, ms, gs, d_s = work[0], work[1], work[2], work[3], work[4]
    _dense_skew(packed, b, second, qs, parts=True)
    _cn_square(packed, second, qs, grad, b, -2.0, s=sq, m=ms, gs=gs)
    _cn_psum(d_s, b, (1.0, gs, ms), (1.0, sq, gs), z1=grad, cz1=2.0)
    # D into the slot of S − 2Q (read only by the launch before)
    return _cn_psum(ms, b, (2.0, sq, gs), (-1.0, d_s, qs), z1=grad, cz1=2.0, sym_a2=True)


def _cayley3_backward(q: torch.Tensor, grad: torch.Tensor, b: int, work: Optional[torch.Tensor] = None,
                      prec: Optional[str] = None) -> torch.Tensor:
    """A dense ``D`` whose packing ``D_ij − D_ji`` is ``∂L/∂θ`` for ``G = I + 2Q + 2S + S·M`` (``S = Q²``, ``M = 2Q +
    S``) from ``Γ`` (dense fp32): with ``Sᵀ = S`` and ``Qᵀ = −Q``, ``∂L/∂S = 2Γ + Γ·(S − 2Q) + S·Γ`` and ``∂L/∂Q = 2Γ +
    2·S·Γ − (∂L/∂S)·Q − Q·(∂L/∂S)``. Only ``∂L/∂Q``'s skew part reaches ``θ``: the skew part of ``∂L/∂S`` adds a
    symmetric term, and with ``P = ∂L/∂S + (∂L/∂S)ᵀ``, ``P·Q + Q·P = X − Xᵀ`` (``X = P·Q``) packs as ``2X``; so ``D =
    2Γ + 2·S·Γ − P·Q``: three launches, five products (one fewer than the Horner recurrence's six). ``work``: see
    :func:`cayley_backward` (``work[0]`` is ``q``)."""
    sq, d_s, w = (torch.empty_like(q) for _ in range(3)) if work is None else (work[1], work[2], work[3])
    sq = _cn_step(q, q, q, None, sq, b, prec=prec)
    d_s = _cn_sum(d_s, b, [(1.0, grad, sq, q, -2.0), (1.0, sq, grad)], z1=grad, cz1=2.0, prec=prec)
    return _cn_sum(w, b, [(2.0, sq, grad), (-1.0, d_s, q)], z1=grad, cz1=2.0, sym_a2=True, prec=prec)


def _horner_backward(q: torch.Tensor, grad_g: torch.Tensor, b: int, k: int) -> torch.Tensor:
    """The dense ``∂L/∂Q`` of the ``k``-term series by Horner's scheme (see the module docstring)."""
    n_blocks = q.shape[0]
    # R_j = Γ·Kʲ (K = Qᵀ = −Q), j = 0..k, stacked
    r = torch.empty((k + 1, n_blocks, b, b), dtype=torch.float32, device=q.device)
    r[0].copy_(grad_g)
    for j in range(1, k + 1):
        _cn_step(r[j - 1], q, q, None, r[j], b, sign=-1.0)
    # Horner on the left: W = R_0 (= c_{k+1}·Γ), W ← V_i − Q·W with V_i = 2·Σ_{j<k−i} R_j + R_{k−i}
    w = r[0].clone()
    w_next = torch.empty_like(w)
    for i in range(k - 1, -1, -1):
        _cn_step(q, w, q, r, w_next, b, sign=-1.0, nv=k - i + 1)
        w, w_next = w_next, w
    return w


@functools.lru_cache(maxsize=None)
def triu_indices(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = torch.triu_indices(block_size, block_size, offset=1, device=device)
    return rows.to(torch.int32), cols.to(torch.int32)
