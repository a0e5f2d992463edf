r"""``PoetXLinear``: a frozen ``nn.Linear`` weight between two trainable block-orthogonal factors.

    y = x·(R W P)ᵀ + bias,   R = Ψᵀ·diag(G(Q_out))·Ψ,   P = Φᵀ·diag(G(Q_in))·Φ

(:mod:`fastdora.poetx.ops` for the forward and backward, :mod:`fastdora.poetx.cayley` for ``G(Q)``). ``Q_in`` and
``Q_out`` start at zero, so a new layer computes what the wrapped ``nn.Linear`` computed. :meth:`PoetXLinear.merge`
folds the factors into the weight (``W ← R W P``, computed in float32 and rounded once to the weight's dtype), leaves
the bias alone (it is added after ``R``), resets ``Q`` to zero and draws new permutations; the layer's function is
unchanged up to that one rounding. The permutations come from a generator seeded with ``(seed, layer_index,
merge_count)``, so every process that holds the same model draws the same permutations without communicating.

Under FSDP2 (``fully_shard``) ``weight``, ``bias``, ``q_in`` and ``q_out`` are DTensors sharded by rows between
forwards (FSDP all-gathers them for the forward, so the forward sees plain tensors, and reduce-scatters the gradients
of ``Q``); the permutation and merge-count buffers are not sharded. A merge needs the whole layer: ``R`` mixes rows
that other ranks hold, so :meth:`PoetXLinear.merge` all-gathers ``W``, ``q_in`` and ``q_out``
(``DTensor.full_tensor``: one all-gather each, of that layer's shards), computes the same ``R·W·P`` on every rank
and writes back only its own rows; ``Q`` is zeroed shard by shard and the permutations are drawn locally from the
seed. Nothing is broadcast.

With ``weight_format="int8"`` the layer holds ``W`` as group-wise int8 codes and float32 scales
(:mod:`fastdora.poetx.quant`) instead of the floating-point Parameter: the GEMMs dequantise bounded chunks of rows,
and a merge rewrites the codes a chunk of output blocks at a time (dequantise, ``R·W·P`` in float32, quantise with
new scales). The int8 format is not combined with FSDP2 (its codes are buffers, which FSDP does not shard).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import quant
from .batch import blocks_for
from .cayley import cayley_neumann, series, skew_size
from .ops import MODES, poetx_layer, poetx_linear, rotate, to_frame

try:  # FSDP2 / tensor parallelism shard parameters as DTensors
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch built without torch.distributed
    DTensor = distribute_tensor = FSDPModule = None

__all__ = ["PoetXLinear", "permutation_seed", "WEIGHT_FORMATS"]

#: how a layer holds its frozen weight: "dense" (the wrapped floating-point Parameter) or "int8" (group-wise codes)
WEIGHT_FORMATS = ("dense", "int8")

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def permutation_seed(seed: int, layer_index: int, merge_count: int) -> int:
    """The seed of the generator that draws a layer's permutations: a SplitMix64 hash of the three integers (the same
    on every platform and process), in ``[0, 2⁶³)``."""
    h = 0
    for value in (seed, layer_index, merge_count):
        h = _splitmix64(h ^ (value & _MASK64))
    return h >> 1


def _autocast_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What autocast does to a floating-point operand of a matmul: float64 stays, other floats take ``dtype``."""
    return t if t.dtype == torch.float64 else t.to(dtype)


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with all of ``t``'s values: ``t`` itself, or a sharded DTensor all-gathered."""
    return t.full_tensor() if _is_dtensor(t) else t


@torch.no_grad()
def _write(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``param`` in place (the Parameter object stays); for a DTensor, only this rank's shard of
    ``full`` (split locally, ``src_data_rank=None``: no communication)."""
    if _is_dtensor(param):
        mine = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(mine.to_local())
    else:
        param.copy_(full)


class PoetXLinear(nn.Module):
    """A POET-X layer around the weight (and bias) of ``base``.

    Args:
        base: the ``nn.Linear`` to wrap. Its weight Parameter is reused (not copied) and frozen
            (``requires_grad=False``); its bias Parameter is reused as it is (trainable if it was).
        block_size: ``b``, the size of the orthogonal blocks; must divide ``in_features`` and ``out_features``.
        mode: "fast" (saves the GEMM output for the backward) or "mem" (recomputes it).
        terms: ``k``, the Neumann powers of the Cayley series (:func:`fastdora.poetx.cayley.cayley_neumann`).
        seed, layer_index: seed the permutations, with the merge count (:func:`permutation_seed`).
        q_dtype: dtype of ``q_in`` / ``q_out`` (float32 by default, whatever the weight's dtype).
        weight_format: "dense" (default: the weight Parameter as it is) or "int8": the weight is quantised
            (:func:`fastdora.poetx.quant.quantize`) into buffers ``weight_codes`` (int8 ``[out, in]``) and
            ``weight_scales`` (float32 ``[out, in / group_size]``), ``self.weight`` is None and the layer keeps no
            reference to the floating-point weight; ``weight_dtype`` records its dtype (that of :meth:`to_linear`).
        group_size: ``G`` of the int8 format (default 128), an int dividing ``in_features``; only with "int8".

    Parameters ``q_in`` (``[in_features / b, b(b−1)/2]``) and ``q_out`` (``[out_features / b, b(b−1)/2]``) hold the
    strict upper triangles of the skew generators; buffers ``perm_in``, ``perm_out`` and ``merge_count`` are saved
    in the state dict, so a checkpoint resumes with the same permutations.

    The dense weight Parameter holds ``W`` in the frame of the current permutations, ``W'[i, j] = W[perm_out[i],
    perm_in[j]]`` (:func:`fastdora.poetx.ops.to_frame`): written in place at conversion (the wrapped ``nn.Linear``'s
    Parameter object, whose values are then permuted) and at each merge, so that a forward makes two permutation
    passes instead of four (:mod:`fastdora.poetx.ops`). The state dict holds ``W'`` with the permutations it belongs
    to (a checkpoint resumes exactly); :meth:`effective_weight` and :meth:`to_linear` give ``R·W·P`` in the model's
    layout. int8 codes are stored in the frame too (their groups of ``group_size`` run along its input features).

    Precision: with a float32 weight, merges keep ``W`` within about 1e-6 (relative) of the exact product over
    hundreds of merges. With a bfloat16 weight each merge rounds ``R W P`` to bfloat16 and the roundings add up as a
    random walk, about ``2⁻⁸·√merges`` of the weight (3e-2 after 300 merges); for long runs keep the weight in
    float32 and let autocast run the GEMM in bfloat16.

    int8 weights: the forward computes in the activation dtype (the dequantised tiles take ``x``'s dtype; a bias must
    share it), under autocast in the autocast dtype. Each merge quantises ``R W P`` (computed in float32 from the
    dequantised weight) afresh: a new rounding of at most ``scale/2`` per element, about ``scale/√12`` RMS, which with
    ``G = 128`` is 0.4% (uniform rows) to 0.7% (Gaussian-like rows) of the weight's RMS. The roundings add up as a
    random walk: on a 64×256 layer (``G = 128``, Q entries of scale 0.02 before each merge), the dequantised weight's
    relative Frobenius distance from the exact float64 product of all the rotations was 0.45% after one merge and
    4.3% after 50 (``tests/poetx/test_quant.py``, bound 7%), against 1e-6 for a float32 weight. A merge with ``Q = 0``
    quantises the same weight in the new permutations' frame (new groups): within half a new scale of it (tested).
    ``module.to(dtype)`` casts the scales like any floating buffer: keep them float32.
    """

    def __init__(
        self,
        base: nn.Linear,
        block_size: int = 256,
        *,
        mode: str = "fast",
        terms: int = 3,
        seed: int = 0,
        layer_index: int = 0,
        q_dtype: torch.dtype = torch.float32,
        weight_format: str = "dense",
        group_size: int = quant.GROUP_SIZE,
    ):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"PoetXLinear wraps an nn.Linear, got {type(base).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {block_size!r}")
        if base.in_features % block_size or base.out_features % block_size:
            raise ValueError(
                f"block_size {block_size} must divide in_features {base.in_features} and out_features "
                f"{base.out_features}"
            )
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(terms, bool) or not isinstance(terms, int) or terms < 1:
            raise ValueError(f"terms must be an int >= 1, got {terms!r}")
        if not base.weight.is_floating_point():
            raise TypeError(f"the weight must be floating point, got {base.weight.dtype}")
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        if weight_format == "int8":
            quant.check_group_size(group_size, base.in_features)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.block_size, self.mode, self.terms = block_size, mode, terms
        self.seed, self.layer_index = seed, layer_index

        self.weight_format, self.group_size = weight_format, group_size
        self.weight_dtype = base.weight.dtype

        device = base.weight.device
        self.register_buffer("merge_count", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("perm_in", torch.empty(self.in_features, dtype=torch.int64, device=device))
        self.register_buffer("perm_out", torch.empty(self.out_features, dtype=torch.int64, device=device))
        perm_in, perm_out = self._permutations(0)
        self.perm_in.copy_(perm_in)
        self.perm_out.copy_(perm_out)
        with torch.no_grad():
            if weight_format == "int8":
                codes, scales = quant.quantize(to_frame(_full(base.weight.detach()), perm_in, perm_out), group_size)
                self.weight: Optional[nn.Parameter] = None
                self.register_buffer("weight_codes", codes)
                self.register_buffer("weight_scales", scales)
            else:
                self.weight = base.weight.requires_grad_(False)
                _write(self.weight, to_frame(_full(self.weight), perm_in, perm_out))
        self.bias: Optional[nn.Parameter] = base.bias
        n = skew_size(block_size)
        self.q_in = nn.Parameter(torch.zeros(self.in_features // block_size, n, dtype=q_dtype, device=device))
        self.q_out = nn.Parameter(torch.zeros(self.out_features // block_size, n, dtype=q_dtype, device=device))

    def _permutations(self, merge_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(perm_in, perm_out)`` of the interval after ``merge_count`` merges, on the layer's device."""
        gen = torch.Generator().manual_seed(permutation_seed(self.seed, self.layer_index, merge_count))
        perm_in = torch.randperm(self.in_features, generator=gen)
        perm_out = torch.randperm(self.out_features, generator=gen)
        return perm_in.to(self.perm_in.device), perm_out.to(self.perm_out.device)

    def _one_series(self) -> bool:
        """Both sides' ``Q`` go through one series (:func:`~fastdora.poetx.ops.poetx_layer`, the batched series): one
        dtype, plain tensors (FSDP2's sharded DTensors take :meth:`blocks`, one series per side)."""
        q_in, q_out = self.q_in, self.q_out
        return q_in.dtype == q_out.dtype and not (_is_dtensor(q_in) or _is_dtensor(q_out))

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The orthogonal blocks ``(G(Q_in), G(Q_out))``, differentiable with respect to ``q_in`` and ``q_out``: one
        series over both sides' blocks (half the kernel launches of two; a GPU layer's step is bound by its host time
        at 2048 tokens)."""
        q_in, q_out = self.q_in, self.q_out
        if not self._one_series():
            return (cayley_neumann(q_in, self.block_size, self.terms),
                    cayley_neumann(q_out, self.block_size, self.terms))
        both = cayley_neumann(torch.cat([q_in, q_out]), self.block_size, self.terms)
        return both[:q_in.shape[0]], both[q_in.shape[0]:]

    @torch.no_grad()
    def _full_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`blocks` from the whole ``Q`` (all-gathered when it is sharded), as plain tensors, the series'
        products at float32-level accuracy (what a merge or an export multiplies into the weight)."""
        return (series(_full(self.q_in), self.block_size, self.terms, precise=True),
                series(_full(self.q_out), self.block_size, self.terms, precise=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer expects {self.in_features}")
        weight, bias, scales, rows = self.weight, self.bias, None, None
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if weight is None:  # int8 codes: the dequantised tiles take x's dtype (under autocast the autocast dtype)
            weight, scales = self.weight_codes, self.weight_scales
            if autocast:
                dtype = torch.get_autocast_dtype(device_type)
                x = _autocast_to(x, dtype)
                bias = None if bias is None else _autocast_to(bias, dtype)
            rows = quant.chunk_rows(self.in_features, x.dtype)
        elif autocast:  # as nn.Linear under autocast: the GEMM in the autocast dtype
            dtype = torch.get_autocast_dtype(device_type)
            x, weight = _autocast_to(x, dtype), _autocast_to(weight, dtype)
            bias = None if bias is None else _autocast_to(bias, dtype)
        if (scales is None and x.dtype != weight.dtype) or (bias is not None and bias.dtype != x.dtype):
            raise TypeError(f"input, weight and bias must share one dtype, got {x.dtype}, "
                            f"{self.weight_dtype if scales is not None else weight.dtype}, "
                            f"{None if bias is None else bias.dtype}")
        q_in, q_out = self.q_in, self.q_out
        if not self._one_series():
            g_in, g_out = self.blocks()
            return poetx_linear(x, weight, bias, g_in, g_out, self.perm_in, self.perm_out, self.mode,
                                weight_scales=scales, chunk_rows=rows)
        return poetx_layer(x, weight, bias, q_in, q_out, self.perm_in, self.perm_out, self.block_size, self.terms,
                           self.mode, scales, rows, blocks_for(self, q_in, q_out))

    def _compute_dtype(self) -> torch.dtype:
        weight_dtype = self.weight_dtype if self.weight is None else self.weight.dtype
        return torch.promote_types(torch.promote_types(weight_dtype, self.q_in.dtype), torch.float32)

    def _stored_product(self):
        """Chunks ``(r0, r1, M[r0:r1])`` of ``M = diag(G)·W'·diag(H)`` in the stored frame (``R·W·P = Ψᵀ·M·Φ``), in
        :meth:`_compute_dtype`, whole output blocks per chunk: the dense weight in one chunk; int8 codes dequantised
        chunk by chunk, each tile at most :data:`fastdora.poetx.quant.CHUNK_BYTES` (at least one block)."""
        compute, b = self._compute_dtype(), self.block_size
        g_in, g_out = self._full_blocks()
        n_blocks = self.out_features // b
        dense = None if self.weight is None else _full(self.weight)
        step = n_blocks if dense is not None else max(1, quant.chunk_rows(self.in_features, compute) // b)
        for k0 in range(0, n_blocks, step):
            k1 = min(k0 + step, n_blocks)
            r0, r1 = k0 * b, k1 * b
            if dense is not None:
                w = dense[r0:r1].to(compute)
            else:
                w = quant.dequantize(self.weight_codes, self.weight_scales, compute, r0, r1)
            a = rotate(w, None, g_in, transpose=True)  # W'·diag(H)
            yield r0, r1, rotate(a.mT, None, g_out[k0:k1]).mT  # diag(G)·(W'·diag(H))

    @torch.no_grad()
    def effective_weight(self) -> torch.Tensor:
        """``R·W·P`` in the model's layout, not rounded: in float32 (float64 if the weight or ``Q`` is float64), with
        the blocks the forward uses (computed in ``Q``'s dtype; on the GPU with the series' products at float32-level
        accuracy, :data:`fastdora.poetx.kernels.MERGE_PRECISION`). A plain tensor, the whole matrix on every rank when
        the parameters are sharded (FSDP2): ``W``, ``q_in`` and ``q_out`` are then all-gathered. With an int8 weight,
        ``W`` is the dequantised weight, assembled from chunks of rows (the result itself is full: it is for
        :meth:`to_linear` and inspection)."""
        out = None
        inv_in = torch.argsort(self.perm_in)
        for r0, r1, m in self._stored_product():
            if out is None:
                out = m.new_empty(self.out_features, self.in_features)
            out.index_copy_(0, self.perm_out[r0:r1], m.index_select(1, inv_in))
        return out

    @torch.no_grad()
    def merge(self) -> None:
        """``W ← R·W·P`` (rounded once to the weight's dtype, in place: the Parameter objects stay), ``Q_in = Q_out
        = 0``, ``merge_count += 1`` and new permutations, with the weight rewritten in their frame. The bias is
        unchanged. The optimizer's state for ``q_in`` and ``q_out`` describes the old factors: the caller resets it.

        With sharded parameters (FSDP2) every rank must call it (it all-gathers ``W``, ``q_in`` and ``q_out``: three
        all-gathers, see the module docstring); each rank writes its own shard of the same product. A layer that is
        itself an FSDP module is resharded first; for layers inside one, use :func:`fastdora.poetx.merge` on the
        model, which reshards every FSDP module first (after a forward FSDP may hold unsharded copies, and a merge
        written into those would be lost).

        int8 weights: chunk by chunk of output blocks, ``R·W·P`` of the dequantised rows in float32, quantised with new
        scales (groups along the new frame's input features) into a new set of codes that then replaces the old in
        place (one int8 copy of the codes while the chunks are written); no full float32 weight is formed."""
        if FSDPModule is not None and isinstance(self, FSDPModule):
            self.reshard()
        new_in, new_out = self._permutations(int(self.merge_count) + 1)
        # stored row i' (column j') of the new frame is natural row new_out[i'] (column new_in[j']), which M holds at
        # row inv_out[new_out[i']] (column inv_in[new_in[j']]); old row i goes to new row inv_new_out[perm_out[i]]
        columns = torch.argsort(self.perm_in)[new_in]
        if self.weight is None:
            destination = torch.argsort(new_out)[self.perm_out]
            codes, scales = torch.empty_like(self.weight_codes), torch.empty_like(self.weight_scales)
            for r0, r1, m in self._stored_product():
                chunk_codes, chunk_scales = quant.quantize(m.index_select(1, columns), self.group_size,
                                                           rows=m.shape[0])
                codes.index_copy_(0, destination[r0:r1], chunk_codes)
                scales.index_copy_(0, destination[r0:r1], chunk_scales.to(scales.dtype))
            self.weight_codes.copy_(codes)
            self.weight_scales.copy_(scales)
        else:
            ((_, _, m),) = self._stored_product()
            _write(self.weight, m.index_select(0, torch.argsort(self.perm_out)[new_out]).index_select(1, columns))
        for q in (self.q_in, self.q_out):
            (q.to_local() if _is_dtensor(q) else q).zero_()
        self.merge_count += 1
        self.perm_in.copy_(new_in)
        self.perm_out.copy_(new_out)

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing this layer's function: weight ``R·W·P`` rounded once to the weight's dtype
        (for int8, ``weight_dtype``, and ``W`` is the dequantised weight), a copy of the bias. The layer itself is not
        modified."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        dtype = self.weight_dtype if self.weight is None else self.weight.dtype
        linear.weight = nn.Parameter(self.effective_weight().to(dtype))
        if self.bias is not None:
            linear.bias = nn.Parameter(_full(self.bias.detach()).clone(), requires_grad=self.bias.requires_grad)
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block_size={self.block_size}, mode={self.mode!r}, terms={self.terms}"
                + (f", weight_format='int8', group_size={self.group_size}" if self.weight is None else ""))
