r"""The 8-bit base of a POET-X layer: a group-wise int8 copy of the frozen weight, and the layer's two GEMMs on it
without a full high-precision weight.

Format: for a weight ``W`` of shape ``[d_out, d_in]`` and a group size ``G`` dividing ``d_in``, each output row is cut
into groups of ``G`` consecutive input features; a group's scale is ``s = max|w| / 127`` (symmetric absmax) and its
codes are ``c = round(w / s)`` clamped to ``[−127, 127]``:

    codes   int8     ``[d_out, d_in]``
    scales  float32  ``[d_out, d_in / G]``   (float32 whatever the weight's dtype; an all-zero group has scale 0)

The dequantised weight is ``W̃[i, j] = c[i, j]·s[i, j // G]``, formed in float32 (float64 for float64 activations)
and rounded once to the activation dtype; ``|W − W̃| ≤ s/2`` elementwise (plus that float32 product's rounding).
Every function here works on bounded slices of rows: :func:`dequantize` returns the rows it is asked for, and
:func:`linear` / :func:`matmul` run ``z·W̃ᵀ`` and ``g·W̃`` one chunk of output rows at a time, each chunk's
dequantised tile at most :data:`CHUNK_BYTES` (or ``chunk_rows`` rows) and dropped after its GEMM, so the full
high-precision weight never exists. The row-local format is also what lets a merge rewrite a few rows at a time.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["GROUP_SIZE", "CHUNK_BYTES", "QMAX", "check_group_size", "quantize", "dequantize", "chunk_rows",
           "linear", "matmul"]

#: default group size ``G``: consecutive input features of one output row sharing a scale
GROUP_SIZE = 128
#: the largest dequantised tile (in the activation dtype) the chunked GEMMs and merges form at once; a float16 /
#: bfloat16 tile passes through a float32 product twice its size
CHUNK_BYTES = 4 * 2 ** 20
#: the largest code magnitude (symmetric: −128 is never used)
QMAX = 127


def check_group_size(group_size, in_features: int) -> None:
    """Raise ``ValueError`` unless ``group_size`` is a positive int dividing ``in_features``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {in_features} (int8 weights are "
                         f"quantised in groups of group_size consecutive input features)")


def chunk_rows(d_in: int, dtype: torch.dtype, budget: Optional[int] = None) -> int:
    """Output rows per chunk so that a dequantised ``[rows, d_in]`` tile of ``dtype`` fits ``budget`` bytes
    (default :data:`CHUNK_BYTES`, read at call time); at least 1."""
    budget = CHUNK_BYTES if budget is None else budget
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, budget // (d_in * itemsize))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _quantize_rows(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and float32 scales of the rows ``w`` (any float dtype), computed in float32 (float64 for float64)."""
    rows, d_in = w.shape
    groups = w.to(_compute_dtype(w.dtype)).reshape(rows, d_in // group_size, group_size)
    scales = (groups.abs().amax(-1) / QMAX).to(torch.float32)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).to(groups.dtype)
    codes = torch.round(groups / safe.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes.reshape(rows, d_in), scales


@torch.no_grad()
def quantize(weight: torch.Tensor, group_size: int = GROUP_SIZE, *, rows: Optional[int] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of a ``[d_out, d_in]`` floating-point weight (see the module docstring).

    Works ``rows`` output rows at a time (default: a :data:`CHUNK_BYTES` float32 tile), so quantising never holds a
    float32 copy of the whole weight.

    Raises:
        ValueError: ``weight`` not 2-D or ``group_size`` not dividing ``d_in``.
        TypeError: ``weight`` not floating point.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"quantize takes a floating-point weight, got {weight.dtype}")
    d_out, d_in = weight.shape
    check_group_size(group_size, d_in)
    step = rows or chunk_rows(d_in, torch.float32)
    codes = torch.empty(d_out, d_in, dtype=torch.int8, device=weight.device)
    scales = torch.empty(d_out, d_in // group_size, dtype=torch.float32, device=weight.device)
    for r0 in range(0, d_out, step):
        codes[r0:r0 + step], scales[r0:r0 + step] = _quantize_rows(weight[r0:r0 + step], group_size)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
    """Rows ``start:stop`` (default all) of the dequantised weight, ``codes·scale`` in float32 (float64 for float64)
    rounded once to ``dtype``."""
    c, s = codes[start:stop], scales[start:stop]
    compute = _compute_dtype(dtype)
    group_size = codes.shape[1] // scales.shape[1]
    w = c.to(compute).unflatten(1, (s.shape[1], group_size)) * s.to(compute).unsqueeze(-1)
    return w.flatten(1).to(dtype)


def linear(z: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """``z·W̃ᵀ`` for ``z`` ``[N, d_in]``: each chunk of ``rows`` output rows is dequantised to ``z``'s dtype and
    multiplied into its columns of the output. Every output element is one dot product over ``d_in``, as in
    ``F.linear(z, dequantize(codes, scales, z.dtype))``."""
    d_out = codes.shape[0]
    if rows >= d_out:
        return F.linear(z, dequantize(codes, scales, z.dtype))
    out = torch.empty(z.shape[0], d_out, dtype=z.dtype, device=z.device)
    for r0 in range(0, d_out, rows):
        out[:, r0:r0 + rows] = F.linear(z, dequantize(codes, scales, z.dtype, r0, r0 + rows))
    return out


def matmul(g: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """``g·W̃`` for ``g`` ``[N, d_out]``: a sum over chunks of ``rows`` output rows of ``g[:, chunk]·W̃[chunk]``.

    float32 / float64 accumulate in place in their own dtype (one rounding per chunk, float32 rounding); float16 /
    bfloat16 run each chunk's GEMM in their own dtype (as ``nn.Linear`` would) and sum the chunks in float32,
    rounding once at the end: one extra half-precision rounding per chunk compared with the single GEMM."""
    d_out = codes.shape[0]
    if rows >= d_out:
        return g @ dequantize(codes, scales, g.dtype)
    acc_dtype = torch.promote_types(g.dtype, torch.float32)
    acc = torch.zeros(g.shape[0], codes.shape[1], dtype=acc_dtype, device=g.device)
    for r0 in range(0, d_out, rows):
        part_g, part_w = g[:, r0:r0 + rows], dequantize(codes, scales, g.dtype, r0, r0 + rows)
        if acc_dtype == g.dtype:
            acc.addmm_(part_g, part_w)
        else:
            acc += part_g @ part_w
    return acc.to(g.dtype)
