"""Factored DoRA row norm: ``||W + s*B*A||`` per output row without the dense product.

    ||W + sBA||^2_row = ||W||^2_row + 2s * rowsum(B * U) + s^2 * rowsum((B @ G) * B)
    U = W @ A^T  [d_out, r]      G = A @ A^T  [r, r]

``W`` here is the *effective* weight ``[d_out, d_in]`` (a view: transposed for ``fan_in_fan_out``/embeddings, flattened
for convolutions). Everything accumulates in fp32 (fp64 when an input is fp64), over column chunks of ``W`` so the
working set stays ``O(d_out*r + r^2)`` plus one bounded chunk; no ``[d_out, d_in]`` temporary, no ``eye``.

The Triton implementation (``fastdora.kernels.norm``) has the same contract; ``fastdora.dispatch.factored_norm``
chooses between them.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["factored_norm_eager", "combine_norm"]


def _acc(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _chunk_cols(d_out: int, d_in: int, budget_bytes: int) -> int:
    # one fp32 chunk of W (d_out x c) within the budget; at least 1, at most d_in
    return max(1, min(d_in, budget_bytes // max(1, 4 * d_out)))


def combine_norm(base_sq: torch.Tensor, U: torch.Tensor, G: torch.Tensor, B: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """sqrt(max(base_sq + 2s*rowsum(B*U) + s^2*rowsum((B@G)*B), 0)) in the precision of ``U``."""
    acc = U.dtype
    Bf = B.to(acc)
    cross = (Bf * U).sum(1)
    quad = ((Bf @ G) * Bf).sum(1)
    sq = base_sq.to(acc) + (2.0 * scale) * cross + (scale * scale) * quad
    return sq.clamp_min(0).sqrt()


def factored_norm_eager(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    base_sq: Optional[torch.Tensor] = None,
    budget_bytes: int = 16 << 20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(norm, base_sq)``: the detached row norm ``[d_out]`` and ``||W||^2`` per row, both fp32 (fp64 for
    fp64 inputs). Pass a cached ``base_sq`` to skip the base term."""
    acc = _acc(weight, lora_A, lora_B)
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    if lora_A.shape[1] != d_in or lora_B.shape != (d_out, r):
        raise ValueError(
            f"fastdora: shape mismatch for the factored norm: W {tuple(weight.shape)}, A {tuple(lora_A.shape)}, "
            f"B {tuple(lora_B.shape)}"
        )
    with torch.no_grad():
        U = torch.zeros(d_out, r, dtype=acc, device=weight.device)
        G = torch.zeros(r, r, dtype=acc, device=weight.device)
        need_base = base_sq is None
        if need_base:
            base_sq = torch.zeros(d_out, dtype=acc, device=weight.device)
        step = _chunk_cols(d_out, d_in, budget_bytes)
        for c0 in range(0, d_in, step):
            wc = weight[:, c0 : c0 + step].to(acc)
            ac = lora_A[:, c0 : c0 + step].to(acc)
            U.addmm_(wc, ac.t())
            G.addmm_(ac, ac.t())
            if need_base:
                base_sq += torch.linalg.vector_norm(wc, dim=1).square()
        norm = combine_norm(base_sq, U, G, lora_B, float(scale))
    return norm, base_sq
