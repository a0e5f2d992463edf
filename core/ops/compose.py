"""DoRA output composition: forward, backward and the autograd op.

Math (see docs/ARCHITECTURE.md and dora-math.md)::

    g     = m / max(norm, eps)                       fp32 (fp64 for fp64 inputs), once per row
    plain form  (base_delta is None):
        inner = (result - bias) + s * lora
        y     = g * inner + bias
    delta form  (base_delta given: PEFT's dropout path, base branch re-run on dropped x):
        inner = base_delta + s * lora
        y     = result + (g - 1) * base_delta + g * s * lora

Backward (norm is detached)::

    plain: d_result = g * dy            delta: d_result = dy, d_base_delta = (g - 1) * dy
    d_lora = g * s * dy
    dm     = sum_tokens(dy * inner) / max(norm, eps)
    d_bias = (1 - g) * sum_tokens(dy)   (plain form only; the rest of the bias gradient flows through `result`)

This module holds the exact PyTorch ("eager") implementation, the autograd node, and the Triton implementation's
wiring (``TRITON``: the kernels of ``fastdora.kernels.compose`` where they cover a call, the eager functions where they
do not; the C++ node of ``fastdora.kernels.native``; torch.library custom ops under ``torch.compile``). Both
implementations have the same interface (``compose_fwd`` / ``compose_bwd`` / ``apply``); ``fastdora.dispatch``
chooses between them.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .. import cache as _cache
from .. import compat

__all__ = ["EAGER", "triton_impl", "compose_fwd_eager", "compose_bwd_eager", "acc_dtype_for", "magnitude_scale",
           "allow_row_coef_cache", "saves_discarded", "check_norm_detached"]

# tokens processed per chunk in the eager magnitude-gradient reduction (bounds fp32 temporaries)
_EAGER_ROWS_PER_CHUNK = 4096


def acc_dtype_for(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the precision every path computes g and the composition in."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def magnitude_scale(magnitude: torch.Tensor, norm: torch.Tensor, eps: float, acc: torch.dtype) -> torch.Tensor:
    """g = m / max(norm, eps), in ``acc`` precision. The single definition every path uses."""
    return magnitude.detach().reshape(-1).to(acc) / norm.detach().reshape(-1).to(acc).clamp_min(eps)


class _RowCoefs:
    """The per-row vectors the eager composition derives from ``(magnitude, norm)``: ``g``, ``g - 1``, ``g * s`` (in
    the accumulation or the activation dtype) and ``1 / max(norm, eps)``, each computed on first use.

    One instance lives on the ``norm`` tensor (``norm._fastdora_coefs``) while ``norm`` and ``magnitude`` are
    unchanged: the cached norm is the same tensor for every micro-batch and every recomputation of one optimizer step,
    so those calls launch none of the ~15 small per-row kernels (the values are the ones a fresh computation gives,
    bit for bit). Any change of ``magnitude`` (identity, storage, version counter, the optimizer-step epoch) or of
    ``norm`` (version counter), ``eps``, ``scale`` or the accumulation dtype starts a new instance.
    """

    __slots__ = ("key", "magnitude", "norm_ref", "eps", "scale", "acc", "vecs")

    def __init__(self, key, magnitude, norm, eps, scale, acc):
        # the norm only by weak reference: the instance lives on the norm tensor, and a cycle would keep both (and
        # the vectors) alive until Python's cyclic GC instead of freeing them with the norm
        self.key, self.magnitude, self.norm_ref = key, magnitude, weakref.ref(norm)
        self.eps, self.scale, self.acc = eps, scale, acc
        self.vecs = {}

    def get(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        dtype = dtype or self.acc
        v = self.vecs.get((name, dtype))
        if v is None:
            v = self.vecs[(name, dtype)] = self._make(name, dtype)
        return v

    def _make(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if dtype != self.acc:
            return self.get(name).to(dtype)
        norm = self.norm_ref()  # alive: every caller holds it
        if name == "g":
            return magnitude_scale(self.magnitude, norm, self.eps, self.acc)
        if name == "gm1":
            return self.get("g") - 1.0
        if name == "gs":
            return self.get("g") * self.scale
        if name == "inv":
            return 1.0 / norm.detach().reshape(-1).to(self.acc).clamp_min(self.eps)
        raise KeyError(name)


_NOT_CACHEABLE = object()


def allow_row_coef_cache(norm: torch.Tensor) -> None:
    """Mark ``norm`` as a norm-cache entry (fastdora's layers call this for the norms they cache): the eager
    composition may keep its per-row coefficients on it. Any other norm (a caller's tensor passed to
    ``dora_compose``) gets them computed on every call, so ``dora_compose`` stays a pure function of its arguments
    even when the caller changes ``magnitude`` in ways no key can see (writes through ``.data``, as ``gradcheck``
    does). Layer norms follow the norm cache's contract (``fastdora.invalidate_norm_cache()`` after such writes)."""
    try:
        norm._fastdora_coefs = None
    except (AttributeError, RuntimeError):  # pragma: no cover - tensors that take no attributes
        pass


def _row_coefs(magnitude: torch.Tensor, norm: torch.Tensor, eps: float, scale: float, acc: torch.dtype) -> _RowCoefs:
    """The cached :class:`_RowCoefs` of ``(magnitude, norm)`` (a fresh, uncached one where caching is not exact, and
    for norms not marked by :func:`allow_row_coef_cache`)."""
    coefs = getattr(norm, "_fastdora_coefs", _NOT_CACHEABLE)
    if coefs is _NOT_CACHEABLE or torch.compiler.is_compiling():
        return _RowCoefs(None, magnitude, norm, eps, scale, acc)
    try:
        key = (_cache.epoch(), magnitude.data_ptr(), magnitude._version, norm._version, eps, scale, acc)
    except (RuntimeError, NotImplementedError):  # inference tensors (no version counter), tensor subclasses
        return _RowCoefs(None, magnitude, norm, eps, scale, acc)
    if coefs is not None and coefs.key == key and coefs.magnitude is magnitude:
        return coefs
    _cache.ensure_step_hook()  # optimizer steps that bump no version counter (fused / ZeRO) bump the epoch
    coefs = _RowCoefs(key, magnitude, norm, eps, scale, acc)
    try:
        norm._fastdora_coefs = coefs
    except (AttributeError, RuntimeError):  # pragma: no cover - tensors that take no attributes
        pass
    return coefs


def _rows(v: torch.Tensor, vs: Optional[list]) -> torch.Tensor:
    """A per-row vector shaped to broadcast over the activations (1-D already does for a last feature dim)."""
    return v if vs is None else v.view(vs)


def _view_shape(t: torch.Tensor, feature_dim: int) -> Optional[list[int]]:
    """Shape that puts a per-row vector on ``feature_dim``; None when that is the last dim (1-D broadcasts)."""
    if feature_dim == -1 or feature_dim == t.dim() - 1:
        return None
    shape = [1] * t.dim()
    shape[feature_dim] = -1
    return shape


def compose_fwd_eager(
    result: torch.Tensor,
    lora: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scale: float,
    eps: float,
    bias: Optional[torch.Tensor],
    base_delta: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    save_inner: bool,
    feature_dim: int = -1,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns ``(y, inner)``; ``inner`` (in ``out_dtype``... see below) only when ``save_inner``.

    ``inner`` is kept in the promoted dtype of ``result`` and ``lora`` (the activation dtype): it is the one
    activation-sized tensor the magnitude gradient needs.
    """
    acc = acc_dtype_for(result, lora, magnitude)
    vs = _view_shape(result, feature_dim)
    if _half_path(result, lora, base_delta, out_dtype):
        return _compose_fwd_half(result, lora, magnitude, norm, scale, eps, bias, base_delta, save_inner, vs)
    coefs = _row_coefs(magnitude, norm, eps, scale, acc)
    lora_acc = lora.to(acc)
    if base_delta is None:
        p = result.to(acc)
        if bias is not None:
            b = _rows(bias.detach().to(acc), vs)
            p = p - b
        inner = p + scale * lora_acc
        y = _rows(coefs.get("g"), vs) * inner
        if bias is not None:
            y = y + b
    else:
        d = base_delta.to(acc)
        inner = d + scale * lora_acc
        # (g - 1) kept explicit: no cancellation when g is close to 1
        y = result.to(acc) + _rows(coefs.get("gm1"), vs) * d + _rows(coefs.get("gs"), vs) * lora_acc
    saved = inner.to(torch.promote_types(result.dtype, lora.dtype)) if save_inner else None
    return y.to(out_dtype), saved


_HALF = (torch.float16, torch.bfloat16)


def _half_path(result, lora, base_delta, out_dtype) -> bool:
    """All activations in one half dtype: compute in that dtype with fp32-derived per-row coefficients (g - 1) and
    g*s, keeping (g - 1) explicit so that nothing cancels (PyTorch has no fused fp32-register path; the Triton kernel
    is the one-rounding version). Saves the fp32 temporaries the general path needs."""
    dt = result.dtype
    return (
        not torch.compiler.is_compiling()  # (traced: fp32 math costs no memory once Inductor fuses the casts)
        and dt in _HALF
        and lora.dtype == dt
        and out_dtype == dt
        and (base_delta is None or base_delta.dtype == dt)
    )


_BN_ELEMT = getattr(torch, "batch_norm_elemt", None)
_BN_REDUCE = getattr(torch, "batch_norm_backward_reduce", None)
_BN_CONSTS: dict = {}


def _rows_kernels(*ts: Optional[torch.Tensor]) -> bool:
    """True where the per-row passes below may run through batch norm's CUDA kernels: CUDA tensors, contiguous,
    with the per-row (feature) dim last, outside compilation. For a 2-D ``[N, C]`` contiguous tensor PyTorch's
    ``batch_norm_elemt`` / ``batch_norm_backward_reduce`` take their channels-last kernels (vectorized, fp32 math),
    where a broadcast ``[C]`` operand sends ``mul`` / ``addcmul`` to the non-vectorized elementwise kernel (measured
    on the H200, [4096, 4096-12288] bf16: 0.65x the time of ``addcmul``, and 0.92x for the column sum of a product,
    whose products become exact fp32 ones)."""
    if _BN_ELEMT is None or _BN_REDUCE is None or torch.compiler.is_compiling():
        return False
    for t in ts:
        if t is not None and not (t.is_cuda and t.dim() >= 1 and t.numel() > 0 and t.is_contiguous()):
            return False
    return True


def _bn_consts(t: torch.Tensor):
    """fp32 zeros and ones ``[C]`` on ``t``'s device (``C = t.shape[-1]``): batch norm's mean and inverse std, so that
    its "normalisation" is the identity (exactly: ``(x - 0) * 1``)."""
    key = (t.shape[-1], t.device)
    c = _BN_CONSTS.get(key)
    if c is None:
        c = _BN_CONSTS[key] = (torch.zeros(t.shape[-1], device=t.device), torch.ones(t.shape[-1], device=t.device))
    return c


def _scale_rows(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``t * w`` over the feature (last) dim of a contiguous CUDA tensor (:func:`_rows_kernels`), in ``t``'s dtype:
    computed in fp32 from the fp32 ``[C]`` vector ``w``, rounded once."""
    zeros, ones = _bn_consts(t)
    c = t.shape[-1]
    return _BN_ELEMT(t.view(-1, c), w, None, zeros, ones, 0.0).view(t.shape)


def _rowsum_kernels(dy: torch.Tensor, x: torch.Tensor):
    """``(sum_tokens dy, sum_tokens dy * x)`` over the feature (last) dim, fp32 products and accumulation, one pass
    (:func:`_rows_kernels` tensors of one dtype)."""
    zeros, ones = _bn_consts(dy)
    c = dy.shape[-1]
    sum_dy, sum_dy_x, _, _ = _BN_REDUCE(dy.view(-1, c), x.view(-1, c), zeros, ones, None, True, False, False)
    return sum_dy, sum_dy_x


def _compose_fwd_half(result, lora, magnitude, norm, scale, eps, bias, base_delta, save_inner, vs):
    dt = result.dtype
    coefs = _row_coefs(magnitude, norm, eps, scale, torch.float32)
    if base_delta is None and bias is None:
        # the common case, two passes: inner = result + s*lora, y = g * inner (reads 3 and writes 2 activation-sized
        # tensors instead of 6 and 3); y = inner + (g - 1) * inner where the row kernels do not apply
        inner = torch.add(result, lora, alpha=scale)
        if vs is None and _rows_kernels(inner):
            y = _scale_rows(inner, coefs.get("g"))
        else:
            y = torch.addcmul(inner, inner, _rows(coefs.get("gm1", dt), vs))
        return y, (inner if save_inner else None)
    p = result if base_delta is None else base_delta
    y = torch.addcmul(result, p, _rows(coefs.get("gm1", dt), vs))  # result + (g - 1) * p
    # out of place (same values as in place): selective activation checkpointing may keep these ops' outputs
    y = torch.addcmul(y, lora, _rows(coefs.get("gs", dt), vs))  #  + g * s * lora
    inner = None
    if base_delta is None and bias is not None:  # p was result incl. bias: remove (g-1)*bias
        y = torch.sub(y, _rows((coefs.get("gm1") * bias.detach().float()).to(dt), vs))
    if save_inner:
        inner = torch.add(p, lora, alpha=scale)
        if base_delta is None and bias is not None:
            inner = torch.sub(inner, _rows(bias.detach().to(dt), vs))
    return y, inner


def compose_bwd_eager(
    dy: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scale: float,
    eps: float,
    inner: Optional[torch.Tensor],
    delta_form: bool,
    result_dtype: torch.dtype,
    lora_dtype: torch.dtype,
    base_delta_dtype: Optional[torch.dtype],
    need_dm: bool,
    need_dbias: bool,
    feature_dim: int = -1,
    need_dlora: bool = True,
    dm_from_y: bool = False,
):
    """Returns ``(d_result, d_lora, d_base_delta, dm, d_bias)`` (``None`` where not needed). ``dm_from_y``:
    ``inner`` holds the layer's bias-free output ``y = g * inner`` instead (the whole-layer node saves it where the
    model's next ops keep it anyway), and ``dm = sum(dy * y) / m``: the same value, as ``g = m / max(norm, eps)``;
    the caller guarantees a magnitude without zeros."""
    acc = acc_dtype_for(dy, magnitude)
    vs = _view_shape(dy, feature_dim)
    coefs = _row_coefs(magnitude, norm, eps, scale, acc)
    half = (dy.dtype in _HALF and result_dtype == lora_dtype == dy.dtype and base_delta_dtype in (None, dy.dtype)
            and not torch.compiler.is_compiling())
    fast = half and vs is None and _rows_kernels(dy, inner if need_dm else None)
    if fast:  # the row kernels: each product in fp32 from the fp32 per-row vector, rounded once
        d_lora = _scale_rows(dy, coefs.get("gs")) if need_dlora else None
        if delta_form:
            d_result, d_base_delta = dy, _scale_rows(dy, coefs.get("gm1"))
        else:
            d_result, d_base_delta = _scale_rows(dy, coefs.get("g")), None
        dy_acc = None
    elif half:  # same formulas in the activation dtype, (g - 1) explicit
        dt = dy.dtype
        d_lora = dy * _rows(coefs.get("gs", dt), vs) if need_dlora else None
        gm1 = _rows(coefs.get("gm1", dt), vs)
        if delta_form:
            d_result, d_base_delta = dy, dy * gm1
        else:
            d_result, d_base_delta = torch.addcmul(dy, dy, gm1), None
        dy_acc = None
    else:
        dy_acc = dy.to(acc)
        d_lora = (_rows(coefs.get("gs"), vs) * dy_acc).to(lora_dtype) if need_dlora else None
        if delta_form:
            d_result = dy.to(result_dtype)
            d_base_delta = (_rows(coefs.get("gm1"), vs) * dy_acc).to(base_delta_dtype)
        else:
            d_result = (_rows(coefs.get("g"), vs) * dy_acc).to(result_dtype)
            d_base_delta = None
    dm = sum_dy = None
    if need_dm:
        if fast:  # inner has dy's dtype there (result, lora and dy in one half dtype)
            sum_dy, dm = _rowsum_kernels(dy, inner)
        else:
            dm = _rowsum_product(dy, inner, feature_dim, acc)
        dm = dm / magnitude.reshape(-1).to(acc) if dm_from_y else dm * coefs.get("inv")
        dm = dm.to(magnitude.dtype).view(magnitude.shape)
    d_bias = None
    if need_dbias:
        if sum_dy is None:
            sum_dy = _sum_tokens(dy.to(acc) if dy_acc is None else dy_acc, feature_dim)
        d_bias = (1.0 - coefs.get("g")) * sum_dy
    return d_result, d_lora, d_base_delta, dm, d_bias


def _sum_tokens(t: torch.Tensor, feature_dim: int) -> torch.Tensor:
    dims = [d for d in range(t.dim()) if d != (feature_dim % t.dim())]
    return t.sum(dim=dims)


def _rowsum_product(a: torch.Tensor, b: torch.Tensor, feature_dim: int, acc: torch.dtype) -> torch.Tensor:
    """sum over every dim but ``feature_dim`` of a*b, accumulated in ``acc`` in bounded chunks."""
    fd = feature_dim % a.dim()
    if torch.compiler.is_compiling():  # one reduction; Inductor keeps the fp32 products in registers
        return (a.to(acc) * b.to(acc)).sum(dim=[d for d in range(a.dim()) if d != fd])
    a2 = a.movedim(fd, -1).reshape(-1, a.shape[fd])
    b2 = b.movedim(fd, -1).reshape(-1, b.shape[fd])
    same_half = a2.dtype == b2.dtype and a2.dtype in _HALF
    out = None
    for start in range(0, max(a2.shape[0], 1), _EAGER_ROWS_PER_CHUNK):
        stop = start + _EAGER_ROWS_PER_CHUNK
        if same_half:  # products in the activation dtype, accumulated in fp32
            part = (a2[start:stop] * b2[start:stop]).sum(0, dtype=acc)
        else:
            part = (a2[start:stop].to(acc) * b2[start:stop].to(acc)).sum(0)
        out = part if out is None else out.add_(part)
    return out


def saves_discarded() -> bool:
    """True while what an autograd node saves is dropped unread: the first forward of non-reentrant gradient
    checkpointing, whose saved tensors the backward takes from the recomputation instead. Only that exact pack hook
    on top of the saved-tensor hook stack counts (another hook above it, e.g. ``save_on_cpu``, keeps the tensors),
    and only without a Python dispatch mode: selective activation checkpointing's mode hands the recomputation the
    first forward's op outputs matched by op and order, so both must run the same ops."""
    if not _DISCARD_PACK_CODES or getattr(compat.top_pack_hook(), "__code__", None) not in _DISCARD_PACK_CODES:
        return False
    return compat.dispatch_modes() == 0


_DISCARD_PACK_CODES = compat.DISCARD_PACK_CODES


_PLACEHOLDERS: dict = {}


def _inner_placeholder(result: torch.Tensor, lora_dtype: torch.dtype) -> torch.Tensor:
    """Stands in for ``inner`` where the saved tensor is discarded (:func:`saves_discarded`): same shape, dtype and
    device (what checkpointing's determinism check compares), no storage of that size, never written -- one
    activation-sized write less per layer in the checkpointed forward. A zero-stride view, which the backward
    refuses to read (:func:`_saved_inner`)."""
    dtype = torch.promote_types(result.dtype, lora_dtype)
    key = (dtype, result.device)
    base = _PLACEHOLDERS.get(key)
    if base is None:
        base = _PLACEHOLDERS[key] = torch.empty((), dtype=dtype, device=result.device)  # never read
    return base.expand(result.shape)


def _saved_inner(t: torch.Tensor) -> torch.Tensor:
    if t.dim() and t.stride(-1) == 0 and t.numel() > 1:  # a placeholder reached a backward: never compute with it
        raise RuntimeError(
            "fastdora: the composition's saved activation was discarded by gradient checkpointing but its backward "
            "ran without the recomputed one; please report this (torch " + torch.__version__ + ")"
        )
    return t


def _forward_into_ctx(ctx, impl, result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, feature_dim):
    """The composition's forward for an autograd node, and what its backward needs on ``ctx``: ``(y, inner)``.
    ``inner`` is a placeholder (not computed) while saved tensors are discarded (:func:`saves_discarded`)."""
    need_dm = magnitude.requires_grad
    need_dbias = bias is not None and bias.requires_grad and base_delta is None
    discard = need_dm and not torch.compiler.is_compiling() and saves_discarded()
    y, inner = impl.compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype,
                                need_dm and not discard, feature_dim)
    if discard:
        inner = _inner_placeholder(result, lora.dtype)
    ctx.magnitude = magnitude
    ctx.delta_form = base_delta is not None
    ctx.dtypes = (result.dtype, lora.dtype, None if base_delta is None else base_delta.dtype)
    ctx.need_dm, ctx.need_dbias = need_dm, need_dbias
    ctx.bias_dtype = None if bias is None else bias.dtype
    return y, inner


class _DoraCompose(torch.autograd.Function):
    """Autograd node of the composition. Only the differentiable tensors are inputs of the node; the detached
    ``norm`` and the constants travel in one tuple (fewer arguments: less per-call overhead in ``apply``)."""

    @staticmethod
    def forward(ctx, result, lora, magnitude, bias, base_delta, cfg):
        norm, scale, eps, out_dtype, feature_dim, impl = cfg
        y, inner = _forward_into_ctx(ctx, impl, result, lora, magnitude, norm, scale, eps, bias, base_delta,
                                     out_dtype, feature_dim)
        # Only the activation-sized ``inner`` goes through save_for_backward (and so through gradient
        # checkpointing's pack/unpack hooks and recomputation). The [d_out] magnitude and norm vectors are plain
        # attributes: the backward reads their values only, and neither is an output of this node (no cycle).
        if ctx.need_dm:
            ctx.save_for_backward(inner)
        ctx.cfg = cfg
        return y

    @staticmethod
    def backward(ctx, dy):
        inner = _saved_inner(ctx.saved_tensors[0]) if ctx.need_dm else None
        norm, scale, eps, _, feature_dim, impl = ctx.cfg
        result_dtype, lora_dtype, bd_dtype = ctx.dtypes
        nig = ctx.needs_input_grad
        d_result, d_lora, d_bd, dm, d_bias = impl.compose_bwd(
            dy.contiguous() if feature_dim == -1 else dy,
            ctx.magnitude,
            norm,
            scale,
            eps,
            inner,
            ctx.delta_form,
            result_dtype,
            lora_dtype,
            bd_dtype,
            ctx.need_dm and nig[2],
            ctx.need_dbias and nig[3],
            feature_dim,
        )
        if d_bias is not None:
            d_bias = d_bias.to(ctx.bias_dtype)
        return d_result, d_lora, dm, d_bias, d_bd, None


_COMPOSE_APPLY = compat.direct_apply(_DoraCompose)


class _EagerImpl:
    name = "eager"

    @staticmethod
    def compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save_inner, feature_dim):
        return compose_fwd_eager(
            result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save_inner, feature_dim
        )

    @staticmethod
    def compose_bwd(dy, magnitude, norm, scale, eps, inner, delta_form, rd, ld, bd, need_dm, need_dbias, feature_dim,
                    need_dlora=True):
        return compose_bwd_eager(
            dy, magnitude, norm, scale, eps, inner, delta_form, rd, ld, bd, need_dm, need_dbias, feature_dim,
            need_dlora,
        )


EAGER = _EagerImpl()


def _apply_autograd(impl):
    def apply(result, lora, magnitude, norm, bias, base_delta, scale, eps, out_dtype, feature_dim):
        cfg = (norm, scale, eps, out_dtype, feature_dim, impl)
        return _COMPOSE_APPLY(result, lora, magnitude, bias, base_delta, cfg)

    return apply


EAGER.apply = _apply_autograd(EAGER)


def check_norm_detached(norm: torch.Tensor) -> None:
    if norm.requires_grad:
        raise ValueError("fastdora: the weight norm must be detached (DoRA treats it as a constant)")


# --------------------------------------------------------------------------------------------------------------------
# the Triton implementation: kernels where they cover a call, the eager functions where not; the C++ node; custom ops
# --------------------------------------------------------------------------------------------------------------------

_TRITON = None  # the implementation object once built (triton_impl), False where Triton is unavailable


def triton_impl():
    """The Triton implementation (same interface as :data:`EAGER`), built on first use (imports Triton); None where
    Triton is not available."""
    global _TRITON
    if _TRITON is None:
        from ..kernels import compose as kc

        _TRITON = _build_triton(kc) if kc.AVAILABLE else False
    return _TRITON or None


class _TritonImpl:
    """Same interface as :data:`EAGER`; its functions are set by :func:`_build_triton`."""

    name = "triton"


def _build_triton(kc):
    from ..kernels import native

    def compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save_inner,
                    feature_dim=-1):
        if kc.fwd_supported(result, lora, magnitude, norm, bias, base_delta, out_dtype, feature_dim):
            return kc.compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save_inner,
                                  feature_dim)
        return compose_fwd_eager(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save_inner,
                                 feature_dim)

    def compose_bwd(dy, magnitude, norm, scale, eps, inner, delta_form, result_dtype, lora_dtype, base_delta_dtype,
                    need_dm, need_dbias, feature_dim=-1, need_dresult=True, need_dlora=True, dm_from_y=False):
        if kc.bwd_supported(dy, magnitude, norm, inner, result_dtype, lora_dtype, base_delta_dtype, need_dm,
                            feature_dim):
            return kc.compose_bwd(dy, magnitude, norm, scale, eps, inner, delta_form, result_dtype, lora_dtype,
                                  base_delta_dtype, need_dm, need_dbias, feature_dim, need_dresult, need_dlora,
                                  dm_from_y)
        d_result, d_lora, d_bd, dm, d_bias = compose_bwd_eager(
            dy, magnitude, norm, scale, eps, inner, delta_form, result_dtype, lora_dtype, base_delta_dtype, need_dm,
            need_dbias, feature_dim, need_dlora, dm_from_y)
        return (d_result if need_dresult else None), d_lora, d_bd, dm, d_bias

    def slow_fwd(result, lora, magnitude, norm, bias, scale, eps, out_dtype, save_inner):
        return compose_fwd(result, lora, magnitude, norm, scale, eps, bias, None, out_dtype, save_inner)

    def slow_bwd(dy, magnitude, norm, scale, eps, inner, rd, ld, need_dm, need_dres, need_dlora, dm_from_y):
        d_result, d_lora, _, dm, _ = compose_bwd(dy, magnitude, norm, scale, eps, inner, False, rd, ld, None, need_dm,
                                                 False, -1, need_dresult=need_dres, need_dlora=need_dlora,
                                                 dm_from_y=dm_from_y)
        return d_result, d_lora, dm

    native.set_fallbacks(slow_fwd, slow_bwd)
    impl = _TritonImpl()
    impl.compose_fwd = compose_fwd
    impl.compose_bwd = compose_bwd
    apply_function = _apply_autograd(impl)
    has_custom_ops = _define_custom_ops(compose_fwd, compose_bwd)

    def apply(result, lora, magnitude, norm, bias, base_delta, scale, eps, out_dtype, feature_dim=-1):
        """Autograd-aware composition. Under ``torch.compile`` it is one custom op per direction (no graph break);
        in eager mode the C++ node where it is active, else the equivalent ``autograd.Function``."""
        if has_custom_ops and torch.compiler.is_compiling():
            save_inner = bool(magnitude.requires_grad and torch.is_grad_enabled())
            y, _ = torch.ops.fastdora.dora_compose_fwd(
                result, lora, magnitude, norm, bias, base_delta, float(scale), float(eps), out_dtype, save_inner
            )
            return y
        node = native.NODE if native.NODE is not None else native.first_node(result)
        if node is not None and base_delta is None and not compat.transforms_active():
            # bias: never trainable here (dispatch sends that eager); discard: a placeholder for inner (made in C++)
            discard = magnitude.requires_grad and saves_discarded()
            return node.compose(result, lora, magnitude, norm, bias, float(scale), float(eps), out_dtype, discard)
        return apply_function(result, lora, magnitude, norm, bias, base_delta, scale, eps, out_dtype, feature_dim)

    def layer_node(x):
        """The C++ node for a whole-layer call: active, no functorch transforms, no Python dispatch mode (selective
        activation checkpointing matches the separate nodes' ops), a contiguous input of at least two dims; None
        otherwise."""
        node = native.NODE if native.NODE is not None else native.first_node(x)
        if (node is None or compat.transforms_active() or compat.dispatch_modes() != 0 or x.dim() < 2
                or not x.is_contiguous()):
            return None
        return node

    impl.apply = apply
    impl.layer_node = layer_node
    return impl


def _empty_like0(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return t.new_empty((0,), dtype=dtype or t.dtype)


def _define_custom_ops(compose_fwd, compose_bwd) -> bool:
    """Register ``fastdora::dora_compose_fwd`` / ``_bwd`` (torch.library custom ops with fake implementations and an
    autograd formula, so that ``torch.compile`` sees one opaque op per direction); False where this torch has no
    ``custom_op`` or the registration fails (the autograd.Function still works)."""
    if not hasattr(torch.library, "custom_op") or not hasattr(torch.library, "register_fake"):
        return False
    try:
        if hasattr(torch.ops, "fastdora") and hasattr(torch.ops.fastdora, "dora_compose_fwd"):
            return True  # already registered (module imported under a second name)
    except Exception:  # pragma: no cover
        pass
    try:
        _register_custom_ops(compose_fwd, compose_bwd)
    except Exception:  # pragma: no cover
        return False
    return True


def _register_custom_ops(compose_fwd, compose_bwd) -> None:
    @torch.library.custom_op("fastdora::dora_compose_fwd", mutates_args=())
    def _fwd_op(
        result: torch.Tensor,
        lora: torch.Tensor,
        magnitude: torch.Tensor,
        norm: torch.Tensor,
        bias: Optional[torch.Tensor],
        base_delta: Optional[torch.Tensor],
        scale: float,
        eps: float,
        out_dtype: torch.dtype,
        save_inner: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, inner = compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save_inner)
        return y, (inner if inner is not None else _empty_like0(result, torch.promote_types(result.dtype, lora.dtype)))

    @_fwd_op.register_fake
    def _(result, lora, magnitude, norm, bias, base_delta, scale, eps, out_dtype, save_inner):
        inner_dtype = torch.promote_types(result.dtype, lora.dtype)
        y = result.new_empty(result.shape, dtype=out_dtype)
        inner = result.new_empty(result.shape, dtype=inner_dtype) if save_inner else _empty_like0(result, inner_dtype)
        return y, inner

    @torch.library.custom_op("fastdora::dora_compose_bwd", mutates_args=())
    def _bwd_op(
        dy: torch.Tensor,
        magnitude: torch.Tensor,
        norm: torch.Tensor,
        inner: torch.Tensor,
        scale: float,
        eps: float,
        delta_form: bool,
        result_dtype: torch.dtype,
        lora_dtype: torch.dtype,
        base_delta_dtype: torch.dtype,
        need_dresult: bool,
        need_dlora: bool,
        need_dm: bool,
        need_dbias: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # delta form: d_result (= dy cast) is produced outside the op (an op output must not alias an input)
        d_result, d_lora, d_bd, dm, d_bias = compose_bwd(
            dy, magnitude, norm, scale, eps, inner if need_dm else None, delta_form, result_dtype, lora_dtype,
            base_delta_dtype if delta_form else None, need_dm, need_dbias,
            need_dresult=need_dresult and not delta_form, need_dlora=need_dlora,
        )
        if delta_form:
            d_result = None
        acc = torch.float64 if torch.float64 in (dy.dtype, magnitude.dtype) else torch.float32
        # unneeded outputs: distinct empty tensors (custom-op outputs must not alias each other)
        return tuple(t if t is not None else _empty_like0(dy, acc) for t in (d_result, d_lora, d_bd, dm, d_bias))

    @_bwd_op.register_fake
    def _(dy, magnitude, norm, inner, scale, eps, delta_form, result_dtype, lora_dtype, base_delta_dtype,
          need_dresult, need_dlora, need_dm, need_dbias):
        acc = torch.float64 if torch.float64 in (dy.dtype, magnitude.dtype) else torch.float32
        n = dy.shape[-1]
        return (
            dy.new_empty(dy.shape, dtype=result_dtype) if need_dresult and not delta_form else _empty_like0(dy, acc),
            dy.new_empty(dy.shape, dtype=lora_dtype) if need_dlora else _empty_like0(dy, acc),
            dy.new_empty(dy.shape, dtype=base_delta_dtype) if delta_form else _empty_like0(dy, acc),
            magnitude.new_empty(magnitude.shape) if need_dm else _empty_like0(dy, acc),
            dy.new_empty((n,), dtype=acc) if need_dbias else _empty_like0(dy, acc),
        )

    def _setup_context(ctx, inputs, output):
        result, lora, magnitude, norm, bias, base_delta, scale, eps, out_dtype, save_inner = inputs
        _, inner = output
        ctx.save_for_backward(magnitude, norm, inner)
        ctx.scale, ctx.eps, ctx.save_inner = scale, eps, save_inner
        ctx.delta_form = base_delta is not None
        ctx.dtypes = (result.dtype, lora.dtype, base_delta.dtype if base_delta is not None else result.dtype)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None

    def _backward(ctx, dy, _d_inner):
        magnitude, norm, inner = ctx.saved_tensors
        rd, ld, bdd = ctx.dtypes
        nig = ctx.needs_input_grad
        need_dm = bool(nig[2]) and ctx.save_inner
        need_dbias = bool(nig[4]) and ctx.has_bias and not ctx.delta_form
        d_result, d_lora, d_bd, dm, d_bias = torch.ops.fastdora.dora_compose_bwd(
            dy, magnitude, norm, inner, ctx.scale, ctx.eps, ctx.delta_form, rd, ld, bdd,
            bool(nig[0]), bool(nig[1]), need_dm, need_dbias,
        )
        if ctx.delta_form:
            d_result = dy.to(rd) if nig[0] else None
        elif not nig[0]:
            d_result = None
        return (
            d_result,
            d_lora if nig[1] else None,
            dm if need_dm else None,
            None,
            d_bias.to(ctx.bias_dtype) if need_dbias else None,
            d_bd if (ctx.delta_form and nig[5]) else None,
            None, None, None, None,
        )

    torch.library.register_autograd("fastdora::dora_compose_fwd", _backward, setup_context=_setup_context)
