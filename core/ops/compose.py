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

This module holds the exact PyTorch ("eager") implementation and the autograd Function. The Triton
implementation in ``fastdora.kernels.compose`` provides ``compose_fwd`` / ``compose_bwd`` with the same signatures;
``fastdora.dispatch`` chooses between them.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .. import dispatch
from .. import distributed as _distributed
from ..stats import path_key, record

__all__ = [
    "dora_compose", "dora_compose_lora_b", "compose_fwd_eager", "compose_bwd_eager", "acc_dtype_for", "magnitude_scale"
]

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

    def scaled_rows(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(g * s)[:, None] * w`` in ``dtype`` (``w``: ``lora_B``'s ``[d_out, r]`` weight), formed from ``w`` on
        every call (not kept: one such copy per layer would add ~the adapters' size to peak memory)."""
        if w.dtype == dtype:
            return torch.mul(w.detach(), self.get("gs_col", dtype))
        return (self.get("gs_col") * w.detach().to(self.acc)).to(dtype)

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
        if name == "gs_col":  # [d_out, 1]: scales the rows of lora_B's weight gradient
            return self.get("gs").unsqueeze(1)
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
        key = (_distributed.epoch(), magnitude.data_ptr(), magnitude._version, norm._version, eps, scale, acc)
    except (RuntimeError, NotImplementedError):  # inference tensors (no version counter), tensor subclasses
        return _RowCoefs(None, magnitude, norm, eps, scale, acc)
    if coefs is not None and coefs.key == key and coefs.magnitude is magnitude:
        return coefs
    _distributed.ensure_step_hook()  # optimizer steps that bump no version counter (fused / ZeRO) bump the epoch
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
        dt in _HALF
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
    where a broadcast ``[C]`` operand sends ``mul`` / ``addcmul`` to the non-vectorized elementwise kernel (session
    30's probe on the H200, [4096, 4096-12288] bf16: 0.65x the time of ``addcmul``, and 0.92x for the column sum of
    a product, whose products become exact fp32 ones)."""
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
    half = dy.dtype in _HALF and result_dtype == lora_dtype == dy.dtype and base_delta_dtype in (None, dy.dtype)
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


def _checkpoint_pack_codes(hook_cls: str) -> frozenset:
    """Code objects of the pack hook that non-reentrant ``torch.utils.checkpoint``'s saved-tensor hook class
    ``hook_cls`` defines: ``_checkpoint_hook`` around the forward it will recompute (it keeps no reference to what is
    saved: a placeholder ``_Holder`` and, for its determinism check, the saved tensor's shape / dtype / device),
    ``_recomputation_hook`` around the recomputation. Empty where this torch has no such hook."""
    try:
        from torch.utils import checkpoint as _ckpt

        consts = getattr(_ckpt, hook_cls).__init__.__code__.co_consts
    except Exception:  # pragma: no cover - another torch layout: no hook is recognised
        return frozenset()
    return frozenset(c for c in consts if getattr(c, "co_name", None) == "pack_hook")


_DISCARD_PACK_CODES = _checkpoint_pack_codes("_checkpoint_hook")
RECOMPUTE_PACK_CODES = _checkpoint_pack_codes("_recomputation_hook")
_TOP_SAVED_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def top_pack_hook():
    """The pack hook on top of the saved-tensor hook stack, unwrapped (torch wraps the recomputation's hook to keep
    dynamo out of it); None without hooks (or on a torch without the query)."""
    hooks = _TOP_SAVED_HOOKS(False) if _TOP_SAVED_HOOKS is not None else None
    if hooks is None:
        return None
    fn = hooks[0]
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)


def saves_discarded() -> bool:
    """True while what an autograd node saves is dropped unread: the first forward of non-reentrant gradient
    checkpointing, whose saved tensors the backward takes from the recomputation instead. Only that exact pack hook
    on top of the saved-tensor hook stack counts (another hook above it, e.g. ``save_on_cpu``, keeps the tensors),
    and only without a Python dispatch mode: selective activation checkpointing's mode hands the recomputation the
    first forward's op outputs matched by op and order, so both must run the same ops."""
    if not _DISCARD_PACK_CODES or getattr(top_pack_hook(), "__code__", None) not in _DISCARD_PACK_CODES:
        return False
    return _DISPATCH_MODES is not None and _DISPATCH_MODES() == 0


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


def _forward_into_ctx(ctx, impl, result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, feature_dim,
                      lora_dtype=None, fwd=None):
    """The composition's forward for an autograd node, and what its backward needs on ``ctx``: ``(y, inner)``.
    ``inner`` is a placeholder (not computed) while saved tensors are discarded (:func:`saves_discarded`). ``fwd``
    (with ``lora=None`` and ``lora_dtype``): ``fwd(save_inner) -> (y, inner)`` computes the composition instead of
    ``impl.compose_fwd``."""
    need_dm = magnitude.requires_grad
    need_dbias = bias is not None and bias.requires_grad and base_delta is None
    discard = need_dm and not torch.compiler.is_compiling() and saves_discarded()
    save = need_dm and not discard
    if fwd is None:
        lora_dtype = lora.dtype
        y, inner = impl.compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save,
                                    feature_dim)
    else:
        y, inner = fwd(save)
    if discard:
        inner = _inner_placeholder(result, lora_dtype)
    ctx.magnitude = magnitude
    ctx.delta_form = base_delta is not None
    ctx.dtypes = (result.dtype, lora_dtype, None if base_delta is None else base_delta.dtype)
    ctx.need_dm, ctx.need_dbias = need_dm, need_dbias
    ctx.bias_dtype = None if bias is None else bias.dtype
    return y, inner


_C_FUNCTION_APPLY = torch._C._FunctionBase.__dict__.get("apply")
_UNWRAP_IF_DEAD = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)


def _direct_apply(fn_cls):
    """``fn_cls.apply`` for a Function with no ``setup_context``, minus the Python layer of ``Function.apply`` (the
    per-call signature and functorch checks around the C ``apply``): outside functorch transforms it does what that
    layer does -- unwrap dead functorch wrappers among the tensor arguments -- and calls the C ``apply`` directly.
    Under functorch transforms (or on a torch without these internals) it is ``fn_cls.apply`` itself."""
    if _C_FUNCTION_APPLY is None or _UNWRAP_IF_DEAD is None or _TRANSFORMS_ACTIVE is None:  # pragma: no cover
        return fn_cls.apply
    c_apply = _C_FUNCTION_APPLY.__get__(None, fn_cls)
    unwrap = _UNWRAP_IF_DEAD
    is_tensor = torch.Tensor

    def apply(*args):
        if _TRANSFORMS_ACTIVE():
            return fn_cls.apply(*args)
        return c_apply(*[unwrap(a) if isinstance(a, is_tensor) else a for a in args])

    return apply


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


class _DoraComposeLoraB(torch.autograd.Function):
    """Autograd node of ``lora_B``'s product and the composition together (Linear layers): ``lora = h @ B^T`` is
    computed here, and the backward never materialises ``d_lora = g * s * dy``: the gradients of ``h`` and ``B`` use
    the per-row ``g * s`` on ``B``'s rows instead (``d_h = dy @ (gs * B)``, ``d_B = gs * (dy^T h)``), saving one
    activation-sized write and read per layer, and the separate autograd node and module call of ``lora_B``."""

    @staticmethod
    def forward(ctx, result, h, lora_b, magnitude, bias, base_delta, cfg):
        norm, scale, eps, out_dtype, impl = cfg
        b_half = _addmm_weight(impl, result, h, lora_b, magnitude, bias, base_delta, out_dtype)
        if b_half is not None:  # inner = result + s * h @ B^T as one GEMM (the eager path on CUDA, half activations)

            def fwd(save_inner):
                return _compose_fwd_addmm(result, h, b_half, magnitude, norm, scale, eps, save_inner)

            y, inner = _forward_into_ctx(ctx, impl, result, None, magnitude, norm, scale, eps, bias, base_delta,
                                         result.dtype, -1, result.dtype, fwd)
        else:
            lora = torch.nn.functional.linear(h, lora_b)  # under autocast: in the autocast dtype, like lora_B(h)
            if out_dtype is None:  # what dora_compose(result, lora, ...) defaults to
                out_dtype = torch.promote_types(result.dtype, lora.dtype)
                if base_delta is not None:
                    out_dtype = torch.promote_types(out_dtype, base_delta.dtype)
            y, inner = _forward_into_ctx(ctx, impl, result, lora, magnitude, norm, scale, eps, bias, base_delta,
                                         out_dtype, -1)
        ctx.save_for_backward(h, lora_b, inner)
        ctx.cfg = cfg
        return y

    @staticmethod
    def backward(ctx, dy):
        h, lora_b, inner = ctx.saved_tensors
        if ctx.need_dm:
            inner = _saved_inner(inner)
        norm, scale, eps, _, impl = ctx.cfg
        result_dtype, lora_dtype, bd_dtype = ctx.dtypes
        nig = ctx.needs_input_grad
        dy = dy.contiguous()
        d_result, _, d_bd, dm, d_bias = impl.compose_bwd(
            dy, ctx.magnitude, norm, scale, eps, inner if ctx.need_dm else None, ctx.delta_form, result_dtype,
            lora_dtype, bd_dtype, ctx.need_dm and nig[3], ctx.need_dbias and nig[4], -1, need_dlora=False,
        )
        if d_bias is not None:
            d_bias = d_bias.to(ctx.bias_dtype)
        d_h = d_b = None
        if nig[1] or nig[2]:
            scaled_b, gs_col = lora_b_row_scales(ctx.magnitude, norm, eps, scale, acc_dtype_for(dy, ctx.magnitude),
                                                 lora_b, lora_dtype, nig[1], nig[2])
            dyl = dy if dy.dtype == lora_dtype else dy.to(lora_dtype)
            if nig[1]:  # d_h = (gs * dy) @ B = dy @ (gs * B), B in the product's dtype (as lora_B's backward)
                d_h = torch.matmul(dyl, scaled_b)
                if d_h.dtype != h.dtype:
                    d_h = d_h.to(h.dtype)
            if nig[2]:  # d_B = gs * (dy^T h): the product in the activations' dtype
                hl = h if h.dtype == lora_dtype else h.to(lora_dtype)
                # bf16 product x gs in B's dtype: fp32 B (AMP) gets an fp32 result, bf16 B one rounding of the scale
                d_b = torch.mul(torch.mm(dyl.reshape(-1, dy.shape[-1]).t(), hl.reshape(-1, h.shape[-1])), gs_col)
        return d_result, d_h, d_b, dm, d_bias, d_bd, None


def _addmm_weight(impl, result, h, lora_b, magnitude, bias, base_delta, out_dtype) -> Optional[torch.Tensor]:
    """``lora_B``'s weight in the activations' half dtype where the eager composition of ``_DoraComposeLoraB`` runs
    as ``inner = addmm(result, h, B^T, alpha=s)`` and ``y = g * inner`` through the row kernels: the eager path
    (``impl``), CUDA, ``result`` and ``h`` in one half dtype (the output's), plain form without bias, and either no
    autocast or autocast to that dtype (which casts ``B`` so, as ``F.linear(h, B)`` would). None otherwise."""
    dt = result.dtype
    if not (impl is EAGER and base_delta is None and bias is None and dt in _HALF and h.dtype == dt
            and out_dtype in (None, dt) and magnitude.dtype != torch.float64 and _rows_kernels(result, h)):
        return None
    if lora_b.dtype == dt:
        return lora_b
    dev = result.device.type
    if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == dt:
        return lora_b.to(dt)
    return None


def _compose_fwd_addmm(result, h, b_half, magnitude, norm, scale, eps, save_inner):
    """``(y, inner)``: ``inner = result + s * (h @ B^T)`` as one GEMM (fp32 accumulation, ``result`` added in the
    epilogue, one rounding), ``y = g * inner`` (one rounding, :func:`_scale_rows`). Reads ``result`` once and writes
    no separate ``lora``: one activation-sized write and a read+write pass less than ``F.linear`` + ``add``."""
    coefs = _row_coefs(magnitude, norm, eps, scale, torch.float32)
    d = result.shape[-1]
    inner = torch.addmm(result.reshape(-1, d), h.reshape(-1, h.shape[-1]), b_half.t(), alpha=scale)
    inner = inner.view(result.shape)
    return _scale_rows(inner, coefs.get("g")), (inner if save_inner else None)


def lora_b_row_scales(magnitude, norm, eps, scale, acc, lora_b, lora_dtype, need_dh, need_db):
    """The fused lora_B node's per-row factors (``_DoraComposeLoraB`` and the C++ node's ``compose_b`` both use
    these): ``(g*s * B in lora_dtype or None, the [d_out, 1] g*s in B's dtype or None)``, from the per-step cached
    row coefficients."""
    coefs = _row_coefs(magnitude, norm, eps, scale, acc)
    return (coefs.scaled_rows(lora_b, lora_dtype) if need_dh else None,
            coefs.get("gs_col", lora_b.dtype) if need_db else None)


_COMPOSE_APPLY = _direct_apply(_DoraCompose)
_COMPOSE_LORA_B_APPLY = _direct_apply(_DoraComposeLoraB)


def dora_compose_lora_b(
    result: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scale: float,
    eps: float,
    *,
    bias: Optional[torch.Tensor] = None,
    base_delta: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    kernels: str = "auto",
    kind: Optional[str] = None,
) -> torch.Tensor:
    """``dora_compose(result, F.linear(h, lora_b), ...)`` for a last feature dim, with ``lora_B``'s product inside
    the same autograd node (see :class:`_DoraComposeLoraB`). Same outputs and gradients (``h`` and ``lora_b`` get
    theirs from that node); without autograd (inference, no grad) it is ``dora_compose`` on the product, except on
    the eager path with half activations on CUDA, where it is the training node's forward (``inner`` by one
    ``addmm``: the product is not rounded on its own)."""
    if (not torch.is_grad_enabled()) or torch.compiler.is_compiling():
        impl = dispatch.compose_impl(result, h, magnitude, bias, base_delta, -1, kernels)
        b_half = _addmm_weight(impl, result, h, lora_b, magnitude, bias, base_delta, out_dtype)
        if b_half is not None:  # the eager path's one-GEMM inner (as the training node's forward), nothing saved
            if kind is not None:
                record(path_key(kind, impl.name))
            return _compose_fwd_addmm(result, h, b_half, magnitude, norm, scale, eps, False)[0]
        lora = torch.nn.functional.linear(h, lora_b)
        return dora_compose(result, lora, magnitude, norm, scale, eps, bias=bias, base_delta=base_delta,
                            out_dtype=out_dtype, kernels=kernels, kind=kind)
    if norm.requires_grad:
        raise ValueError("fastdora: the weight norm must be detached (DoRA treats it as a constant)")
    impl = dispatch.compose_impl(result, h, magnitude, bias, base_delta, -1, kernels)
    if kind is not None:
        record(path_key(kind, impl.name))
    fused = getattr(impl, "apply_lora_b", None)
    if fused is not None and base_delta is None:  # the C++ node (fastdora.kernels.native) where it is active
        y = fused(result, h, lora_b, magnitude, norm, bias, scale, eps, out_dtype)
        if y is not None:
            return y
    return _COMPOSE_LORA_B_APPLY(result, h, lora_b, magnitude, bias, base_delta, (norm, scale, eps, out_dtype, impl))


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


def dora_compose(
    result: torch.Tensor,
    lora: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scale: float,
    eps: float,
    *,
    bias: Optional[torch.Tensor] = None,
    base_delta: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    feature_dim: int = -1,
    kernels: str = "auto",
    kind: Optional[str] = None,
) -> torch.Tensor:
    """The final DoRA output (see module docstring). ``norm`` must be detached (fp32/fp64, shape ``[d_out]``).

    ``out_dtype`` defaults to the promoted dtype of ``result``, ``lora`` and ``base_delta`` (what PEFT's
    ``result + delta`` gives). ``kernels`` is ``"auto" | "triton" | "eager"``. ``kind`` (e.g. ``"linear"``) names the
    layer kind in ``fastdora.stats.active_path_counter``.
    """
    if norm.requires_grad:
        raise ValueError("fastdora: the weight norm must be detached (DoRA treats it as a constant)")
    if out_dtype is None:
        out_dtype = torch.promote_types(result.dtype, lora.dtype)
        if base_delta is not None:
            out_dtype = torch.promote_types(out_dtype, base_delta.dtype)
    impl = dispatch.compose_impl(result, lora, magnitude, bias, base_delta, feature_dim, kernels)
    if kind is not None:
        record(path_key(kind, impl.name))
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # inference path: no autograd node, nothing saved
        return impl.compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, False, feature_dim)[0]
    return impl.apply(result, lora, magnitude, norm, bias, base_delta, scale, eps, out_dtype, feature_dim)


def _apply_autograd(impl):
    def apply(result, lora, magnitude, norm, bias, base_delta, scale, eps, out_dtype, feature_dim):
        cfg = (norm, scale, eps, out_dtype, feature_dim, impl)
        return _COMPOSE_APPLY(result, lora, magnitude, bias, base_delta, cfg)

    return apply


EAGER.apply = _apply_autograd(EAGER)
