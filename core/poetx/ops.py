r"""The input-centric forward and backward of one POET-X layer, without ever forming ``R·W·P``.

A layer computes ``y = x·(R W P)ᵀ + bias`` with a frozen ``W`` (``[d_out, d_in]``) and two block-diagonal orthogonal
factors between random permutations,

    R = Ψᵀ·diag(G₁ … G_m)·Ψ      (output side, ``m = d_out / b``),
    P = Φᵀ·diag(H₁ … H_n)·Φ      (input side, ``n = d_in / b``),

where ``Ψ = I[perm_out]`` and ``Φ = I[perm_in]`` are the permutation matrices of index vectors (``(Ψ v)ᵢ =
v[perm_out[i]]``). For a row vector ``t`` and such an ``R``, ``t·Rᵀ`` is :func:`rotate`: gather ``t``'s features by
``perm``, multiply each group of ``b`` features by its block's transpose, scatter them back.

The layer holds ``W`` in the frame of its permutations, ``W' = Ψ·W·Φᵀ`` (:func:`to_frame`: ``W'[i, j] =
W[perm_out[i], perm_in[j]]``), so that ``R·W·P = Ψᵀ·diag(G)·W'·diag(H)·Φ`` and one gather of the input and one
scatter of the output are the only permutation passes of a forward:

    xp = x[..., perm_in]                      (gather)
    up = (xp·diag(H)ᵀ)·W'ᵀ                    (block products on contiguous blocks, the one dense GEMM)
    y = scatter(up·diag(G)ᵀ + bias[perm_out], perm_out)

and its backward, with ``gy = ∂L/∂y`` and ``gyp = gy[..., perm_out]``:

    ∂L/∂Gₖ = Σ_rows gypₖᵀ ⊗ upₖ               (needs up: saved in "fast" mode, recomputed in "mem" mode)
    gzp = (gyp·diag(G))·W'
    ∂L/∂Hₖ = Σ_rows gzpₖᵀ ⊗ xpₖ
    ∂L/∂x = scatter(gzp·diag(H), perm_in)
    ∂L/∂bias = Σ_rows gy

Two permutation passes per forward and two per backward (three in "mem" mode, which gathers the input again),
against four and five with the weight in the model's layout; the price is that a layer's ``weight`` (and its state
dict entry) is ``W'``, written at conversion and at each merge, and that the ``Q = 0`` layer computes ``nn.Linear``'s
function up to the GEMM's summation order. :meth:`~fastdora.poetx.layer.PoetXLinear.effective_weight` and
:meth:`~fastdora.poetx.layer.PoetXLinear.to_linear` give ``R·W·P`` in the model's layout.
The block products run in ``promote(activation dtype, block dtype)`` (float32 for bfloat16 activations with float32
blocks) and round once to the activation dtype; the GEMMs run in the activation dtype like ``nn.Linear``. The gradient
with respect to ``W`` is never computed: ``W`` changes only through merges.
With an 8-bit base (``weight_scales`` given, :mod:`fastdora.poetx.quant`) ``W'`` is int8 codes with group-wise scales
(groups along the stored frame's input features); the two GEMMs dequantise a bounded chunk of output rows at a time
into the activation dtype, so the full high-precision weight never exists, and the gradients are those of the same op
on the dequantised weight.

:func:`rotate` and :func:`block_outer` (the model's layout: for merges and tests) are a permutation pass
(``index_select``; a Triton gather where the kernels run), the block products on contiguous blocks and the inverse
pass. The block products run as Triton
kernels (:mod:`fastdora.poetx.kernels`, fp32 accumulation) for tensors the kernels take (CUDA, float16 / bfloat16 /
float32, Triton importable) when no autograd graph is being recorded through them; otherwise, and always with
``fastdora.poetx.kernels.ENABLED = False``, the PyTorch code below runs: the reference the kernels are tested against.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from . import cayley as _cayley
from . import kernels as _kernels
from . import quant as _quant
from . import replay as _replay

__all__ = ["MODES", "rotate", "block_outer", "to_frame", "poetx_linear", "poetx_layer"]

#: "fast" saves the GEMM output ``u`` for the backward; "mem" saves only ``x`` and recomputes ``u`` (one more GEMM)
MODES = ("fast", "mem")


def _use_kernels(*tensors: Optional[torch.Tensor]) -> bool:
    """The kernels take these tensors and no autograd graph is recorded through them."""
    if not _kernels.applies(*tensors):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


#: id(perm) -> (weak reference, version, inverse permutation): a layer's permutations change only at merges
_INVERSES: dict = {}


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """``argsort(perm)``, cached per permutation tensor and its version counter."""
    hit = _INVERSES.get(id(perm))
    if hit is not None and hit[0]() is perm and hit[1] == perm._version:
        return hit[2]
    inv = torch.empty_like(perm).index_copy_(0, perm, torch.arange(perm.numel(), device=perm.device))
    if len(_INVERSES) > 4096:
        _INVERSES.clear()
    _INVERSES[id(perm)] = (weakref.ref(perm), perm._version, inv)
    return inv


def _gather(t: torch.Tensor, perm: torch.Tensor, kern: Optional[bool] = None) -> torch.Tensor:
    """``t[..., perm]``: the features of each block side by side (where the kernels run: one Triton launch, a fraction
    of ``index_select``'s host time)."""
    if _use_kernels(t, perm) if kern is None else kern:
        return _kernels.gather(t, perm)
    return t.index_select(-1, perm)


def _scatter(t: torch.Tensor, perm: torch.Tensor, kern: Optional[bool] = None) -> torch.Tensor:
    """The inverse of :func:`_gather`: ``out[..., perm[i]] = t[..., i]`` (where the kernels run: a gather through the
    cached inverse permutation, measured 4x faster than ``index_copy_`` on the H200). ``kern``: whether the kernels
    run, decided once by the caller (default: for these tensors)."""
    if _use_kernels(t, perm) if kern is None else kern:
        return _kernels.gather(t, _inverse(perm))
    return torch.empty_like(t).index_copy_(t.dim() - 1, perm, t)


def _block_mm(
    tp: torch.Tensor,
    blocks: torch.Tensor,
    transpose: bool,
    bias_p: Optional[torch.Tensor],
    out_dtype: Optional[torch.dtype],
    kern: Optional[bool] = None,
) -> torch.Tensor:
    """Block ``k`` of the gathered rows ``tp`` times ``G_kᵀ`` (``transpose``: ``G_k``), plus the gathered bias, in
    ``promote(tp.dtype, blocks.dtype)``, rounded once to ``out_dtype`` (default ``tp``'s)."""
    if _use_kernels(tp, blocks, bias_p) if kern is None else kern:
        return _kernels.rotate(tp, None, blocks, transpose=transpose, bias=bias_p, out_dtype=out_dtype)
    n_blocks, b = blocks.shape[0], blocks.shape[-1]
    compute = torch.promote_types(tp.dtype, blocks.dtype)
    # t·Rᵀ: out_c = Σ_b G[c, b]·t_b ; t·R: out_c = Σ_b t_b·G[b, c]
    out = torch.einsum("nkb,kbc->nkc" if transpose else "nkb,kcb->nkc", tp.to(compute).unflatten(-1, (n_blocks, b)),
                       blocks.to(compute)).flatten(-2)
    if bias_p is not None:
        out = out + bias_p.to(compute)
    return out.to(out_dtype or tp.dtype)


def rotate(
    t: torch.Tensor,
    perm: Optional[torch.Tensor],
    blocks: torch.Tensor,
    *,
    transpose: bool = False,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``t·Rᵀ + bias`` (or ``t·R + bias`` with ``transpose=True``) for ``R = Ψᵀ·diag(blocks)·Ψ``, ``Ψ = I[perm]``.

    Args:
        t: ``[N, d]``, rows are the vectors.
        perm: ``[d]`` int64 permutation, or None: the identity (blocks of contiguous features).
        blocks: ``[d / b, b, b]``.
        bias: optional ``[d]``, added before the single rounding.
        out_dtype: result dtype (default ``t``'s). The products run in ``promote(t.dtype, blocks.dtype)``.
    """
    if perm is None:
        return _block_mm(t, blocks, transpose, bias, out_dtype)
    if _kernels.PERMUTE_FUSED and _use_kernels(t, blocks, bias, perm):
        return _kernels.rotate(t, perm, blocks, transpose=transpose, bias=bias, out_dtype=out_dtype)
    bias_p = None if bias is None else bias.index_select(0, perm)
    return _scatter(_block_mm(_gather(t, perm), blocks, transpose, bias_p, out_dtype), perm)


def _block_outer(ap: torch.Tensor, bp: torch.Tensor, blocks: torch.Tensor, out: Optional[torch.Tensor] = None,
                 kern: Optional[bool] = None) -> torch.Tensor:
    """``[k, c, j] = Σ_rows ap[row, k·b + c]·bp[row, k·b + j]`` for gathered rows, accumulated in at least float32,
    in ``blocks``' dtype (written into ``out`` when given)."""
    if _kernels.BLOCK_OUTER and (_use_kernels(ap, bp, blocks) if kern is None else kern):
        return _kernels.block_outer(ap, bp, None, blocks, out)
    n_blocks, size = blocks.shape[0], blocks.shape[-1]
    compute = functools.reduce(torch.promote_types, (ap.dtype, bp.dtype, blocks.dtype, torch.float32))
    ap = ap.to(compute).unflatten(-1, (n_blocks, size))
    bp = bp.to(compute).unflatten(-1, (n_blocks, size))
    result = torch.einsum("nkc,nkj->kcj", ap, bp).to(blocks.dtype)
    return result if out is None else out.copy_(result)


def block_outer(a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[k, c, j] = Σ_rows gather(a)[row, k·b + c]·gather(b)[row, k·b + j]``: the gradient of the blocks of a
    :func:`rotate` (``a`` its output gradient, ``b`` its input), accumulated in at least float32, in ``blocks``' dtype.
    """
    if _kernels.PERMUTE_FUSED and _kernels.BLOCK_OUTER and _use_kernels(a, b, blocks, perm):
        return _kernels.block_outer(a, b, perm, blocks)
    return _block_outer(_gather(a, perm), _gather(b, perm), blocks)


def to_frame(weight: torch.Tensor, perm_in: torch.Tensor, perm_out: torch.Tensor) -> torch.Tensor:
    """The stored frame of a weight: ``W'[i, j] = W[perm_out[i], perm_in[j]]`` (``Ψ·W·Φᵀ``), a new tensor."""
    return weight.index_select(0, perm_out).index_select(1, perm_in)



def _gemm(z, weight, scales, rows):
    """``z·W'ᵀ``: the dense GEMM, or chunk by chunk on the int8 codes (:func:`fastdora.poetx.quant.linear`)."""
    return F.linear(z, weight) if scales is None else _quant.linear(z, weight, scales, rows)


def _gemm_t(g, weight, scales, rows):
    """``g·W'``: the dense GEMM, or chunk by chunk on the int8 codes (:func:`fastdora.poetx.quant.matmul`)."""
    return g @ weight if scales is None else _quant.matmul(g, weight, scales, rows)


def _forward(x2, weight, scales, rows, bias_p, g_in, g_out, perm_in, perm_out, kern):
    """``(xp, up, y)``: the gathered input, the GEMM output in the stored frame and the layer output (2-D)."""
    xp = _gather(x2, perm_in, kern)
    up = _gemm(_block_mm(xp, g_in, False, None, None, kern), weight, scales, rows)
    return xp, up, _scatter(_block_mm(up, g_out, False, bias_p, None, kern), perm_out, kern)


def _backward(gy, x2, xp, up, weight, scales, rows, g_in, g_out, perm_in, perm_out, need_x, need_g_in, need_g_out,
              kern, grad_blocks=None):
    """``(∂L/∂x, ∂L/∂G_in, ∂L/∂G_out)`` (2-D ``∂L/∂x``; None where not needed) from ``gy = ∂L/∂y`` (2-D). ``xp`` and
    ``up`` are None where the forward did not keep them ("mem": recomputed here). ``grad_blocks``: a contiguous
    ``[n_in + n_out, b, b]`` tensor the two block gradients are written into (input side first)."""
    grad_x = grad_g_in = grad_g_out = None
    out_in = out_out = None
    if grad_blocks is not None:
        out_in, out_out = grad_blocks[:g_in.shape[0]], grad_blocks[g_in.shape[0]:]
    gyp = _gather(gy, perm_out, kern)
    if xp is None and (need_g_in or (need_g_out and up is None)):
        xp = _gather(x2, perm_in, kern)
    if need_g_out:
        if up is None:  # "mem": recompute the GEMM output
            up = _gemm(_block_mm(xp, g_in, False, None, None, kern), weight, scales, rows)
        grad_g_out = _block_outer(gyp, up, g_out, out_out, kern)
    if need_x or need_g_in:
        gzp = _gemm_t(_block_mm(gyp, g_out, True, None, None, kern), weight, scales, rows)
        if need_g_in:
            grad_g_in = _block_outer(gzp, xp, g_in, out_in, kern)
        if need_x:
            grad_x = _scatter(_block_mm(gzp, g_in, True, None, None, kern), perm_in, kern)
    return grad_x, grad_g_in, grad_g_out


def _backward_kernels(*tensors) -> bool:
    """Whether a node's backward runs the kernels: not while it records a graph (``create_graph=True``: the PyTorch
    code runs, differentiable)."""
    return _kernels.applies(*tensors) and not torch.is_grad_enabled()


def _grad_bias(gy, dtype):
    return gy.sum(0, dtype=torch.promote_types(gy.dtype, torch.float32)).to(dtype)


class _PoetXLinear(torch.autograd.Function):
    """The layer from its blocks (:func:`poetx_linear`). "fast" saves the gathered input and the GEMM output (what
    the block gradients read), "mem" the input alone."""

    @staticmethod
    def forward(ctx, x, weight, scales, bias, g_in, g_out, perm_in, perm_out, save_gemm_output, rows):
        with torch.autocast(x.device.type, enabled=False):  # the block products pick their own precision
            bias_p = None if bias is None else bias.index_select(0, perm_out)
            xp, up, y = _forward(x.reshape(-1, x.shape[-1]), weight, scales, rows, bias_p, g_in, g_out, perm_in,
                                 perm_out, _kernels.applies(x, g_in, g_out, bias))
        if save_gemm_output:
            ctx.save_for_backward(None, xp, up, weight, scales, g_in, g_out, perm_in, perm_out)
        else:
            ctx.save_for_backward(x, None, None, weight, scales, g_in, g_out, perm_in, perm_out)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.rows, ctx.x_shape = rows, x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, xp, up, weight, scales, g_in, g_out, perm_in, perm_out = ctx.saved_tensors
        need_x, _, _, need_bias, need_g_in, need_g_out = ctx.needs_input_grad[:6]
        with torch.autocast(grad_y.device.type, enabled=False):
            gy = grad_y.reshape(-1, weight.shape[0])
            grad_bias = _grad_bias(gy, ctx.bias_dtype) if need_bias else None
            x2 = None if x is None else x.reshape(-1, x.shape[-1])
            grad_x, grad_g_in, grad_g_out = _backward(gy, x2, xp, up, weight, scales, ctx.rows, g_in, g_out, perm_in,
                                                      perm_out, need_x, need_g_in, need_g_out,
                                                      _backward_kernels(gy, g_in, g_out))
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        return grad_x, None, None, grad_bias, grad_g_in, grad_g_out, None, None, None, None


class _PoetXLayer(torch.autograd.Function):
    """The layer from its packed skew parameters (:func:`poetx_layer`): the blocks of both sides from one series (one
    set of launches), computed inside the node, and their gradients written side by side so that one series backward
    gives both ``∂L/∂Q``. "fast" also saves the blocks; "mem" recomputes them in the backward."""

    @staticmethod
    def forward(ctx, x, weight, scales, bias, q_in, q_out, perm_in, perm_out, block_size, terms, save, rows, given):
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            bias_p = None if bias is None else bias.index_select(0, perm_out)
            if given is None and scales is None and _replay.applies(x2, weight, bias, q_in, q_out):
                # the same launches as below, replayed (fastdora.poetx.replay)
                xp, up, y, g = _replay.forward(x2, weight, bias_p, q_in, q_out, perm_in, _inverse(perm_out),
                                               block_size, terms)
            else:
                if given is None:
                    g = _cayley.series(q_in, block_size, terms, q_out)
                else:  # the blocks of both sides, computed by the caller (a batched series): their gradient is returned
                    g = given
                n_in = x.shape[-1] // block_size
                xp, up, y = _forward(x2, weight, scales, rows, bias_p, g[:n_in], g[n_in:], perm_in, perm_out,
                                     _kernels.applies(x, g, bias))
        if save:
            ctx.save_for_backward(None, xp, up, g, weight, scales, q_in, q_out, perm_in, perm_out)
        else:  # ("mem": the blocks are recomputed from Q, unless they were given)
            ctx.save_for_backward(x, None, None, given, weight, scales, q_in, q_out, perm_in, perm_out)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.rows, ctx.x_shape, ctx.block_size, ctx.terms = rows, x.shape, block_size, terms
        ctx.given = given is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, xp, up, g, weight, scales, q_in, q_out, perm_in, perm_out = ctx.saved_tensors
        need_x, _, _, need_bias, need_q_in, need_q_out = ctx.needs_input_grad[:6]
        if ctx.given:  # the gradient goes to the given blocks (both sides), not to the Q it was computed from
            need_q_in = need_q_out = ctx.needs_input_grad[12]
        grad_bias = None
        with torch.autocast(grad_y.device.type, enabled=False):
            gy = grad_y.reshape(-1, weight.shape[0])
            if need_bias:
                grad_bias = _grad_bias(gy, ctx.bias_dtype)
            x2 = None if x is None else x.reshape(-1, x.shape[-1])
            grad_x, grad_q_in, grad_q_out, grad_given = _layer_backward(
                gy, x2, xp, up, g, weight, scales, ctx.rows, q_in, q_out, perm_in, perm_out, None, ctx.block_size,
                ctx.terms, need_x, need_q_in, need_q_out, ctx.given)
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        return grad_x, None, None, grad_bias, grad_q_in, grad_q_out, None, None, None, None, None, None, grad_given


def _layer_backward(gy, x2, xp, up, g, weight, scales, rows, q_in, q_out, perm_in, perm_out, inv_in, block_size, terms,
                    need_x, need_q_in, need_q_out, given):
    """``(∂L/∂x, ∂L/∂q_in, ∂L/∂q_out, ∂L/∂blocks)`` of :class:`_PoetXLayer` (2-D ``∂L/∂x``) from the 2-D output
    gradient ``gy`` and what the forward saved, with autocast off: the replayed launches where they apply
    (:mod:`fastdora.poetx.replay`), else the op's own path. ``given``: the blocks were the node's input (their gradient
    is returned instead of the Q gradients). ``inv_in``: the inverse input permutation, or None (computed here)."""
    grad_x = grad_q_in = grad_q_out = grad_given = None
    if (need_q_in and need_q_out and not given and scales is None and not torch.is_grad_enabled()
            and (x2 is None or x2.is_contiguous()) and _replay.applies(gy, weight, q_in, q_out)):
        # the same launches as below, replayed (fastdora.poetx.replay)
        grad_x, grad_q_in, grad_q_out = _replay.backward(gy, x2, xp, up, g, weight, q_in, q_out, perm_in, perm_out,
                                                         _inverse(perm_in) if inv_in is None else inv_in, block_size,
                                                         terms, need_x)
    elif need_x or need_q_in or need_q_out:
        if g is not None and g.dim() == 4:  # the blocks' two half-precision parts (the replayed forward)
            g = None
        if g is None:
            g = _cayley.series(q_in, block_size, terms, q_out)
        n_in = weight.shape[1] // block_size
        grad_g = None
        if need_q_in or need_q_out:  # a side without a gradient keeps zeros
            grad_g = torch.empty_like(g) if need_q_in and need_q_out else torch.zeros_like(g)
        grad_x, _, _ = _backward(gy, x2, xp, up, weight, scales, rows, g[:n_in], g[n_in:], perm_in, perm_out,
                                 need_x, need_q_in, need_q_out, _backward_kernels(gy, g), grad_g)
        if grad_g is not None and given:
            grad_given = grad_g
        elif grad_g is not None:
            grad_q_in, grad_q_out = _cayley.series_backward(q_in, grad_g, block_size, terms, q_out)
            grad_q_in, grad_q_out = grad_q_in if need_q_in else None, grad_q_out if need_q_out else None
    return grad_x, grad_q_in, grad_q_out, grad_given


def _node_backward(gy, x2, xp, up, g, weight, q_in, q_out, perm_in, perm_out, inv_in, block_size, terms, need_x,
                   need_q_in, need_q_out):
    """The C++ layer node's backward where it has no backward plan (:func:`fastdora.poetx.replay.node`): that of
    :class:`_PoetXLayer` (dense weight, no bias, blocks from ``Q``)."""
    with torch.autocast(gy.device.type, enabled=False):
        return _layer_backward(gy, x2, xp, up, g, weight, None, None, q_in, q_out, perm_in, perm_out, inv_in,
                               block_size, terms, need_x, need_q_in, need_q_out, False)[:3]


def _check(x, weight, bias, g_in, g_out, perm_in, perm_out, mode, weight_scales, chunk_rows) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if weight.requires_grad:
        raise ValueError("the weight of a POET-X layer is frozen (it changes only by merges): it must not require grad")
    d_out, d_in = weight.shape
    if x.shape[-1] != d_in:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {d_in}")
    if weight_scales is None:
        if chunk_rows is not None:
            raise ValueError("chunk_rows applies to int8 weights only (pass weight_scales)")
        if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
            raise TypeError(
                f"input, weight and bias must share one dtype, got {x.dtype}, {weight.dtype}, "
                f"{None if bias is None else bias.dtype}"
            )
    else:
        if weight.dtype != torch.int8:
            raise TypeError(f"with weight_scales, the weight holds int8 codes, got {weight.dtype}")
        groups = weight_scales.shape[-1] if weight_scales.dim() == 2 else 0
        if (weight_scales.dim() != 2 or weight_scales.shape[0] != d_out or groups == 0 or d_in % groups
                or not weight_scales.is_floating_point()):
            raise ValueError(f"weight_scales must be floating point of shape ({d_out}, d_in / group_size) for "
                             f"codes of shape {tuple(weight.shape)}, got {weight_scales.dtype} "
                             f"{tuple(weight_scales.shape)}")
        if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                       or chunk_rows < 1):
            raise ValueError(f"chunk_rows must be an int >= 1 or None, got {chunk_rows!r}")
        if not x.is_floating_point() or (bias is not None and bias.dtype != x.dtype):
            raise TypeError(f"input and bias must share one floating-point dtype, got {x.dtype}, "
                            f"{None if bias is None else bias.dtype}")
    for side, blocks, perm, d in (("input", g_in, perm_in, d_in), ("output", g_out, perm_out, d_out)):
        if blocks.dim() != 3 or blocks.shape[1] != blocks.shape[2] or blocks.shape[0] * blocks.shape[1] != d:
            raise ValueError(f"{side}-side blocks of shape {tuple(blocks.shape)} do not tile {d} features")
        if perm.shape != (d,) or perm.dtype != torch.int64:
            raise ValueError(f"{side}-side permutation must be int64 of shape ({d},), got {perm.dtype} "
                             f"{tuple(perm.shape)}")


def poetx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    g_in: torch.Tensor,
    g_out: torch.Tensor,
    perm_in: torch.Tensor,
    perm_out: torch.Tensor,
    mode: str = "fast",
    *,
    weight_scales: Optional[torch.Tensor] = None,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """``y = x·(R W P)ᵀ + bias`` (see the module docstring) as one autograd node.

    Args:
        x: ``[..., d_in]`` activations, in ``weight``'s dtype (any floating dtype with an int8 weight).
        weight: ``[d_out, d_in]`` in the stored frame (:func:`to_frame`: ``Ψ·W·Φᵀ``), frozen (must not require grad);
            int8 codes (in that frame) when ``weight_scales`` is given.
        bias: ``[d_out]`` or None; may require grad.
        g_in: ``[d_in / b, b, b]`` input-side blocks ``H`` (from :func:`fastdora.poetx.cayley.cayley_neumann`).
        g_out: ``[d_out / b', b', b']`` output-side blocks ``G``.
        perm_in, perm_out: int64 permutations of ``d_in`` and ``d_out``.
        mode: "fast" (saves the gathered input and the GEMM output, ``N·(d_in + d_out)`` values) or "mem" (saves
            the input, ``N·d_in`` values, and recomputes the rest in the backward).
        weight_scales: ``[d_out, d_in / G]`` group scales of int8 codes (:mod:`fastdora.poetx.quant`). The GEMMs
            (forward, backward and "mem"'s recompute) then dequantise ``chunk_rows`` output rows at a time into
            ``x``'s dtype; the autograd graph holds the codes and scales, never a dequantised weight.
        chunk_rows: output rows per dequantised tile (default: a :data:`fastdora.poetx.quant.CHUNK_BYTES` tile).

    Returns:
        ``[..., d_out]`` in ``x``'s dtype; gradients flow to ``x``, ``bias``, ``g_in`` and ``g_out``.
    """
    _check(x, weight, bias, g_in, g_out, perm_in, perm_out, mode, weight_scales, chunk_rows)
    rows = None
    if weight_scales is not None:
        rows = chunk_rows or _quant.chunk_rows(weight.shape[1], x.dtype)
    return _PoetXLinear.apply(x, weight, weight_scales, bias, g_in, g_out, perm_in, perm_out, mode == "fast", rows)


def poetx_layer(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    q_in: torch.Tensor,
    q_out: torch.Tensor,
    perm_in: torch.Tensor,
    perm_out: torch.Tensor,
    block_size: int,
    terms: int,
    mode: str,
    weight_scales: Optional[torch.Tensor] = None,
    rows: Optional[int] = None,
    blocks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`poetx_linear` with the blocks ``G(q_in)``, ``G(q_out)`` (:func:`fastdora.poetx.cayley.cayley_neumann`)
    computed inside the same autograd node: what :class:`~fastdora.poetx.layer.PoetXLinear` runs. ``q_in`` and
    ``q_out`` (``[n, b(b−1)/2]`` packed skew parameters of one dtype, plain tensors) receive the gradients. No
    argument checks beyond those of the tensors' own operations: the layer builds consistent arguments; ``rows`` is
    the int8 GEMMs' chunk (required with ``weight_scales``).

    ``blocks``: the blocks of both sides already computed (``[d_in / b + d_out / b, b, b]``, input side first: those
    of ``q_in`` and ``q_out`` from a series over many layers, :mod:`fastdora.poetx.batch`); the node then takes them
    as its input instead of ``q_in`` and ``q_out`` (which may be None) and returns their gradient, one
    ``[d_in / b + d_out / b, b, b]`` tensor."""
    if blocks is not None:
        q_in = q_out = None
    elif weight_scales is None and bias is None and q_in.requires_grad and q_out.requires_grad \
            and torch.is_grad_enabled():
        # a problem whose forward has a layer plan: the layer's autograd node in C++ (fastdora.poetx.replay.node)
        y = _replay.node(x, weight, q_in, q_out, perm_in, perm_out, _inverse, block_size, terms, mode == "fast",
                         _node_backward)
        if y is not None:
            return y
    return _PoetXLayer.apply(x, weight, weight_scales, bias, q_in, q_out, perm_in, perm_out, block_size, terms,
                             mode == "fast", rows, blocks)
