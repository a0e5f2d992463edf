"""Dense float64 reference of POET-X, written from the definitions (explicit matrices, no fastdora code): the skew
generator from its strict upper triangle, the truncated Cayley–Neumann series as a sum of matrix powers, the
block-diagonal factors ``R = Ψᵀ·blockdiag(G)·Ψ`` with permutation matrices ``Ψ = I[perm]``, and ``y = x·(R W P)ᵀ + b``.
Every function is differentiable with torch autograd."""

from __future__ import annotations

import functools

import torch

F64 = torch.float64


@functools.lru_cache(maxsize=None)
def skew_basis(b: int) -> torch.Tensor:
    """``[b(b−1)/2, b·b]``: row ``m`` is the flattened ``E_ij − E_ji`` of the ``m``-th pair ``i < j`` in row order."""
    pairs = [(i, j) for i in range(b) for j in range(i + 1, b)]
    basis = torch.zeros(len(pairs), b * b, dtype=F64)
    for m, (i, j) in enumerate(pairs):
        basis[m, i * b + j] = 1.0
        basis[m, j * b + i] = -1.0
    return basis


def skew(packed: torch.Tensor, b: int) -> torch.Tensor:
    return (packed.to(F64) @ skew_basis(b)).reshape(-1, b, b)


def series(q: torch.Tensor, terms: int) -> torch.Tensor:
    """``(I + Q)·(I + Q + … + Q^terms)``, expanded with ``torch.linalg.matrix_power``."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype).expand_as(q)
    neumann = sum(torch.linalg.matrix_power(q, j) for j in range(terms + 1))
    return (eye + q) @ neumann


def cayley(q: torch.Tensor) -> torch.Tensor:
    """The exact Cayley transform ``(I + Q)(I − Q)⁻¹``."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype).expand_as(q)
    return torch.linalg.solve(eye - q, eye + q, left=False)


def perm_matrix(perm: torch.Tensor) -> torch.Tensor:
    return torch.eye(perm.numel(), dtype=F64)[perm]


def factor(blocks: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``Ψᵀ·blockdiag(blocks)·Ψ`` as a dense matrix."""
    psi = perm_matrix(perm)
    return psi.T @ torch.block_diag(*blocks.to(F64)) @ psi


def effective_weight(weight, q_in, q_out, perm_in, perm_out, b, terms=3):
    r = factor(series(skew(q_out, b), terms), perm_out)
    p = factor(series(skew(q_in, b), terms), perm_in)
    return r @ weight.to(F64) @ p


def linear(x, weight, bias, q_in, q_out, perm_in, perm_out, b, terms=3):
    y = x.to(F64) @ effective_weight(weight, q_in, q_out, perm_in, perm_out, b, terms).T
    return y if bias is None else y + bias.to(F64)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖a − ref‖_F / ‖ref‖_F`` in float64."""
    a, ref = a.detach().to(F64), ref.detach().to(F64)
    return ((a - ref).norm() / ref.norm()).item()


def natural_weight(layer) -> torch.Tensor:
    """A layer's frozen weight in the model's layout: the layer stores ``W'[i, j] = W[perm_out[i], perm_in[j]]``."""
    stored = layer.weight.detach()
    return stored[torch.argsort(layer.perm_out)][:, torch.argsort(layer.perm_in)]
