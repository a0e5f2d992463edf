"""POET-X written the plain PyTorch way, for the benchmarks (``poetx_bench.py``: one layer's speed;
``poetx_convergence.py``: training curves step by step against fastdora's POET-X). No fastdora code: the
Cayley–Neumann blocks from batched matmuls of a dense skew matrix, ``x[..., perm]`` gathers, a batched matmul per
side, the inverse permutation as another gather, autograd for the backward; the merge ``W ← R·W·P`` as the layer's
own linear map applied to an identity matrix.

Same definitions as :mod:`fastdora.poetx` (so that the two can be compared step by step):

- ``y = rotate_out(rotate_in(x)·Wᵀ) + bias`` with ``rotate(t) = t·(Ψᵀ·diag(G₁ … G_k)·Ψ)ᵀ``, ``Ψ = I[perm]``: gather
  the features by ``perm``, multiply each group of ``b`` by its block's transpose, scatter back; the bias is added
  after the output-side rotation (a merge leaves it alone).
- ``G = I + 2(Q + … + Qᵗ) + Qᵗ⁺¹`` (``t = terms``, 3) of the skew ``Q`` whose strict upper triangle, row by row, is
  the parameter (``[n_blocks, b(b−1)/2]``, zeros at the start: ``G = I``).
- Permutations from a CPU ``torch.Generator`` seeded with a SplitMix64 hash of ``(seed, layer_index, merge_count)``,
  the input side drawn first: the permutations fastdora draws for the same three integers.
- :func:`convert` visits the model's modules in the order ``fastdora.poetx.convert`` does, so the ``layer_index`` of
  each layer, hence every permutation, is the same; ``normalize=True`` scales each weight row to unit L2 norm first
  (fastdora's ``from_scratch_normalize``).
- Precision (``promote=True``, the convergence benchmark): under autocast the input and ``W`` take the autocast dtype,
  the block products run in ``promote(activation dtype, Q's dtype)`` and round once to the activation dtype, the GEMM
  runs in the activation dtype, as fastdora computes; the permutations are ``index_select`` gathers whose backward
  is the gather by the inverse permutation (:class:`_Permute`: the exact result of autograd's ``index_add``, which
  under ``torch.use_deterministic_algorithms`` falls back to an accumulating ``index_put`` that sorts every index on
  CUDA). ``promote=False`` (the layer benchmark's "plain" variant, unchanged): the blocks are cast to the
  activation dtype and the products run there, the permutations are ``x[..., perm]`` (backward: an ``index_put``
  with accumulation, which sorts the indices of every element: on the H200 the layer's time grew with the tokens,
  7.6 to 27.7 ms from 2048 to 8192 tokens at 4096→4096, ``results/poetx_layer_h200_2026-12-04``), no autocast
  handling.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def permutation_seed(seed: int, layer_index: int, merge_count: int) -> int:
    """SplitMix64 of the three integers, chained, in ``[0, 2⁶³)``: the seed of a layer's permutation generator."""
    h = 0
    for value in (seed, layer_index, merge_count):
        h = _splitmix64(h ^ (value & _MASK64))
    return h >> 1


def skew_size(block_size: int) -> int:
    return block_size * (block_size - 1) // 2


class _Permute(torch.autograd.Function):
    """``t[..., perm]`` whose gradient is ``g[..., inv]`` (``inv = argsort(perm)``): each value moves once, so the
    gather by the inverse is exactly the ``index_add`` autograd would run for ``index_select``."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv)
        return t.index_select(-1, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inv,) = ctx.saved_tensors
        return grad.index_select(-1, inv), None, None


class PlainPoetX(nn.Module):
    """POET-X as plain PyTorch around a frozen ``weight`` (``[d_out, d_in]``, copied), with an optional ``bias``
    (kept as given: a Parameter stays the same Parameter)."""

    def __init__(self, weight: torch.Tensor, block_size: int, terms: int = 3, *, bias: Optional[torch.Tensor] = None,
                 seed: int = 0, layer_index: int = 0, q_dtype: torch.dtype = torch.float32, promote: bool = False):
        super().__init__()
        d_out, d_in = weight.shape
        if d_in % block_size or d_out % block_size:
            raise ValueError(f"block_size {block_size} must divide {d_in} and {d_out}")
        self.in_features, self.out_features = d_in, d_out
        self.b, self.terms, self.promote = block_size, terms, promote
        self.seed, self.layer_index, self.merge_count = seed, layer_index, 0
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = bias
        self.q_in = nn.Parameter(torch.zeros(d_in // block_size, skew_size(block_size), device=weight.device,
                                             dtype=q_dtype))
        self.q_out = nn.Parameter(torch.zeros(d_out // block_size, skew_size(block_size), device=weight.device,
                                              dtype=q_dtype))
        for name, d in (("perm_in", d_in), ("perm_out", d_out)):
            self.register_buffer(name, torch.empty(d, dtype=torch.int64, device=weight.device))
            self.register_buffer(name + "_inv", torch.empty(d, dtype=torch.int64, device=weight.device))
        self._draw_permutations()
        rows, cols = torch.triu_indices(block_size, block_size, 1, device=weight.device)
        self.register_buffer("rows", rows)
        self.register_buffer("cols", cols)

    @torch.no_grad()
    def _draw_permutations(self) -> None:
        gen = torch.Generator().manual_seed(permutation_seed(self.seed, self.layer_index, self.merge_count))
        for name, d in (("perm_in", self.in_features), ("perm_out", self.out_features)):
            perm = torch.randperm(d, generator=gen)
            getattr(self, name).copy_(perm)
            getattr(self, name + "_inv").copy_(torch.argsort(perm))

    def _blocks(self, packed: torch.Tensor) -> torch.Tensor:
        upper = packed.new_zeros(packed.shape[0], self.b, self.b)
        upper[:, self.rows, self.cols] = packed
        q = upper - upper.mT
        power, acc = q, 2 * q
        for _ in range(self.terms - 1):
            power = power @ q
            acc = acc + 2 * power
        return acc + power @ q + torch.eye(self.b, device=q.device, dtype=q.dtype)

    def _rotate(self, t: torch.Tensor, perm, inv, blocks, bias=None) -> torch.Tensor:
        n_blocks = blocks.shape[0]
        if self.promote:
            compute = torch.promote_types(t.dtype, blocks.dtype)

            def gather(v, idx, idx_inv):
                return _Permute.apply(v, idx, idx_inv)
        else:
            compute = t.dtype

            def gather(v, idx, idx_inv):  # backward: index_put with accumulation (sorts every index)
                return v[..., idx]
        tp = gather(t, perm, inv).to(compute).reshape(-1, n_blocks, self.b).transpose(0, 1)  # [k, N, b]
        out = gather(torch.bmm(tp, blocks.mT.to(compute)).transpose(0, 1).reshape(*t.shape), inv, perm)
        if bias is not None:  # added before the one rounding
            out = out + bias.to(compute)
        return out.to(t.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if not self.promote:
            z = self._rotate(x, self.perm_in, self.perm_in_inv, self._blocks(self.q_in))
            return self._rotate(z @ weight.T, self.perm_out, self.perm_out_inv, self._blocks(self.q_out), bias)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # as nn.Linear under autocast: everything in the autocast dtype
            dtype = torch.get_autocast_dtype(dev)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with torch.autocast(dev, enabled=False):
            z = self._rotate(x, self.perm_in, self.perm_in_inv, self._blocks(self.q_in))
            u = torch.nn.functional.linear(z, weight)
            return self._rotate(u, self.perm_out, self.perm_out_inv, self._blocks(self.q_out), bias)

    @torch.no_grad()
    def effective_weight(self) -> torch.Tensor:
        """``R·W·P`` in float32 (float64 for a float64 weight): the layer's bias-free map applied to the identity."""
        compute = torch.promote_types(torch.promote_types(self.weight.dtype, self.q_in.dtype), torch.float32)
        eye = torch.eye(self.in_features, dtype=compute, device=self.weight.device)
        g_in, g_out = self._blocks(self.q_in.to(compute)), self._blocks(self.q_out.to(compute))
        promote, self.promote = self.promote, True
        try:
            z = self._rotate(eye, self.perm_in, self.perm_in_inv, g_in)
            mt = self._rotate(z @ self.weight.to(compute).T, self.perm_out, self.perm_out_inv, g_out)  # (R W P)ᵀ
        finally:
            self.promote = promote
        return mt.T

    @torch.no_grad()
    def merge(self) -> None:
        """``W ← R·W·P`` (rounded once to ``W``'s dtype), ``Q = 0``, new permutations; the caller resets the optimizer's
        state of ``q_in`` / ``q_out``."""
        self.weight.copy_(self.effective_weight())
        self.q_in.zero_()
        self.q_out.zero_()
        self.merge_count += 1
        self._draw_permutations()


def convert(model: nn.Module, block_size: int, *, exclude: Iterable[str] = ("lm_head",), seed: int = 0,
            normalize: bool = False, promote: bool = True, terms: int = 3) -> list:
    """Replace, in place, every plain ``nn.Linear`` of ``model`` whose features ``block_size`` divides and whose name
    no ``exclude`` entry matches (a whole dotted component path) by a :class:`PlainPoetX` (the same weight values,
    the same bias Parameter); returns the converted names in order (their ``layer_index``)."""
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    converted: list = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            name = f"{prefix}{child_name}"
            if type(child) is nn.Linear:
                padded = f".{name}."
                if (any(f".{e}." in padded for e in exclude) or child.in_features % block_size
                        or child.out_features % block_size):
                    continue
                weight = child.weight.detach()
                if normalize:
                    weight = weight.float() / torch.linalg.vector_norm(weight.float(), dim=1, keepdim=True)
                    weight = weight.to(child.weight.dtype)
                layer = PlainPoetX(weight, block_size, terms, bias=child.bias, seed=seed,
                                   layer_index=len(converted), promote=promote)
                setattr(parent, child_name, layer)
                converted.append(name)
            else:
                visit(child, f"{name}.")

    visit(model, "")
    return converted


def layers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, PlainPoetX)]


def q_parameters(model: nn.Module) -> list:
    return [p for m in layers(model) for p in (m.q_in, m.q_out)]


def merge(model: nn.Module) -> int:
    """:meth:`PlainPoetX.merge` every layer; returns how many."""
    found = layers(model)
    for m in found:
        m.merge()
    return len(found)
