"""fastdora under sharding engines: PyTorch FSDP1, FSDP2 (``fully_shard``), DeepSpeed ZeRO-2/3 (and DDP).

What changes when parameters are sharded (all checked on torch 2.13 / deepspeed 0.19, see tests/test_distributed.py):

- **Cache key.** Outside an engine the norm cache is keyed on ``(data_ptr, _version, ...)`` of W, A, B. Under the
  engines that key is not exact: FSDP2's unsharded parameter keeps ``_version == 0`` across optimizer steps and its
  storage is freed and re-allocated at every all-gather (the allocator can hand back the same address); ZeRO-3 and
  ZeRO-2 write updated weights through ``.data`` (no version bump), and FSDP1's views are rebuilt at every unshard.
  So while ``torch.distributed`` is initialized the key is ``(epoch, _version, logical shape, dtype, device)`` per
  tensor, where ``epoch`` is a process-wide counter bumped after EVERY ``torch.optim.Optimizer.step`` (a global
  step post-hook: it fires for FSDP1/FSDP2 optimizers, for the torch optimizer inside DeepSpeed's ZeRO wrapper,
  and under accelerate/HF Trainer), after every ``load_state_dict`` of a model holding a fastdora layer, on
  merge/unmerge, and by :func:`invalidate`. Between two such events a parameter's VALUE cannot change (re-gathering
  and re-sharding move bytes, they do not change them), so a hit is exact; the key has no storage address, so
  re-gathers within one step (gradient accumulation, gradient-checkpoint recomputation) hit. The key is the same on
  every rank, so cache misses (which may run a collective, below) happen on all ranks together.
- **Where the full parameters are.** The norm is always computed from full (unsharded) tensors, never a shard:
  * the factors A, B: used directly when the tensor seen in the magnitude module's forward is the full parameter
    (DDP, ZeRO-2, FSDP2 per block, persistent ZeRO-3 params). When the factor module is its own sharding unit
    (FSDP1 with PEFT's ``fsdp_auto_wrap_policy``, a separately ``fully_shard``-ed factor, a partitioned ZeRO-3
    param) its weight is only complete inside its own ``__call__``: on a cache miss fastdora registers a one-shot
    forward pre-hook on the (inner) factor module and copies the factor (``r x d``, tiny) during the real
    ``lora_B(lora_A(x))`` call it makes anyway -- no extra collective, no extra forward.
  * the base weight W: inside an enclosing unit it is unsharded (FSDP1 decoder-layer unit, FSDP2 per block). Under
    ZeRO-3 it is released after ``base_layer``'s own forward: on a cache miss only (once per optimizer step per
    layer) it is gathered with ``deepspeed.zero.GatheredParameters``; a separately sharded FSDP2 base weight
    (a ``DTensor`` here) is gathered with ``full_tensor()`` likewise. Shape/storage are checked before use: a
    shard or a freed view raises instead of producing a wrong norm.
- **FSDP1 wrappers** around the magnitude module (PEFT's policy wraps it) are looked through (``unwrap``).

Limits: edits of sharded parameters that bypass both the optimizer and ``load_state_dict`` (e.g. writing into a
DeepSpeed partition by hand) must be followed by :func:`invalidate`. Call ``fastdora.enable(model)`` before the
engine wraps the model (or use process-wide mode); ``enable`` does not look inside FSDP1 wrappers.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

__all__ = [
    "active",
    "epoch",
    "ensure_step_hook",
    "invalidate",
    "unwrap",
    "tensor_key",
    "linear_norm_and_lora",
    "full_weight",
]

_EPOCH = 0  # bumped after every optimizer step / load_state_dict / invalidate()
_LOAD_EPOCH = 0  # bumped on load_state_dict / invalidate() only (base-weight cache of frozen W)
_STEP_HOOK = None


def epoch() -> int:
    return _EPOCH


def invalidate() -> None:
    """Drop every cached norm (process-wide). Needed only after editing sharded parameters outside an optimizer step
    and outside ``load_state_dict``."""
    global _EPOCH, _LOAD_EPOCH
    _EPOCH += 1
    _LOAD_EPOCH += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    global _EPOCH
    _EPOCH += 1


def _after_load_state_dict(module, incompatible_keys) -> None:
    invalidate()


def ensure_step_hook() -> None:
    """Register (once per process) the optimizer-step post-hook that bumps :func:`epoch`."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def _ensure_hooks(mag: nn.Module) -> None:
    if _STEP_HOOK is None:
        ensure_step_hook()
    if not mag.__dict__.get("_fastdora_load_hook"):
        mag.register_load_state_dict_post_hook(_after_load_state_dict)
        mag.__dict__["_fastdora_load_hook"] = True


_DIST_AVAILABLE = torch.distributed.is_available()


def active() -> bool:
    """True while torch.distributed is initialized: every engine (and DDP) initializes it first."""
    return _DIST_AVAILABLE and torch.distributed.is_initialized()


# ------------------------------------------------------------------------------------------------ engine helpers


def _fsdp1_cls():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    except Exception:  # pragma: no cover
        return None


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside an FSDP1 wrapper (PEFT's policy wraps lora_A, lora_B and the magnitude module)."""
    inner = module
    while True:
        nxt = getattr(inner, "_fsdp_wrapped_module", None) if isinstance(inner, nn.Module) else None
        if nxt is None:
            return inner
        inner = nxt


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _zero3_unavailable(t) -> bool:
    if not hasattr(t, "ds_id"):
        return False
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return t.ds_status == ZeroParamStatus.NOT_AVAILABLE


def _logical_shape(t: torch.Tensor) -> tuple:
    ds_shape = getattr(t, "ds_shape", None)  # ZeRO-3: the placeholder's .shape is (0,) while partitioned
    return tuple(ds_shape) if ds_shape is not None else tuple(t.shape)


def tensor_key(t: torch.Tensor):
    """Engine-safe per-tensor cache key: no storage address (gathers move storage), logical shape (ZeRO-3)."""
    try:
        version = t._version
    except RuntimeError:  # inference tensors: never cache
        return None
    return (version, _logical_shape(t), t.dtype, t.device.type)


def _is_complete(t: Optional[torch.Tensor], shape: tuple) -> bool:
    """``t`` is the full parameter right now: the expected logical shape, storage present (FSDP1 frees the unsharded
    storage but keeps the views' shapes), not a DTensor shard, not a released ZeRO-3 placeholder."""
    if t is None or _is_dtensor(t) or _zero3_unavailable(t):
        return False
    if tuple(t.shape) != tuple(shape):
        return False
    need = (t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    return t.untyped_storage().nbytes() >= need


def _needs_call(module: nn.Module) -> bool:
    fsdp1 = _fsdp1_cls()
    return fsdp1 is not None and isinstance(module, fsdp1)


@contextlib.contextmanager
def full_weight(base_layer: nn.Module):
    """Makes ``base_layer.weight`` the full tensor inside the block, gathering only if it is not (ZeRO-3 released /
    FSDP2 DTensor). Yields the full weight (the parameter itself when it is already complete)."""
    from .stats import record

    w = base_layer.weight
    if _zero3_unavailable(w):
        import deepspeed

        record("norm:base_gathered")
        with deepspeed.zero.GatheredParameters([w], modifier_rank=None):
            yield base_layer.weight
        return
    if _is_dtensor(w):
        record("norm:base_gathered")
        yield w.full_tensor()
        return
    yield w


def _capture_factors(lora_A: nn.Module, lora_B: nn.Module, x: torch.Tensor, need_A: bool, need_B: bool):
    """Runs ``lora_B(lora_A(x))`` (the forward fastdora makes anyway) with one-shot forward pre-hooks on the inner
    factor modules that copy their weights while the engine has them unsharded (FSDP1 unit / FSDP2 unit / ZeRO-3
    fetch all run before a pre-hook registered later)."""
    box: dict = {}
    handles = []

    def grab(name):
        def hook(mod, args):
            with torch.no_grad():
                box[name] = mod.weight.detach().clone()

        return hook

    if need_A:
        handles.append(unwrap(lora_A).register_forward_pre_hook(grab("A")))
    if need_B:
        handles.append(unwrap(lora_B).register_forward_pre_hook(grab("B")))
    try:
        lora = lora_B(lora_A(x))
    finally:
        for h in handles:
            h.remove()
    return lora, box.get("A"), box.get("B")


# --------------------------------------------------------------------------------------------------- norm + lora


def cache_key(mag, tensors, scale: float):
    """Key for the magnitude module's cache while distributed (see the module docstring)."""
    _ensure_hooks(mag)
    keys = tuple(tensor_key(t) for t in tensors)
    if any(k is None for k in keys):
        return None
    return ("dist", _EPOCH, keys, float(scale))


def base_key(weight: torch.Tensor):
    k = tensor_key(weight)
    if k is None:
        return None
    # a frozen base weight only changes by load_state_dict / invalidate(); a trainable one at every step too
    return ("dist-base", _LOAD_EPOCH, _EPOCH if weight.requires_grad else None, k)


def linear_norm_and_lora(mag, x, base_layer, lora_A, lora_B, scale, adapter_name):
    """Distributed path of ``FastDoraLinearLayer.forward``: returns ``(norm, lora)`` with
    ``lora = lora_B(lora_A(x))`` and the detached fp32 row norm of ``W + s*B@A`` from full parameters."""
    from peft.utils.integrations import dequantize_module_weight
    from peft.utils.other import transpose

    from .ops.compose import allow_row_coef_cache
    from .ops.norm import factored_norm
    from .stats import record

    opts = mag._fd_options()
    inner_A, inner_B = unwrap(lora_A), unwrap(lora_B)
    A_t, B_t, W_t = inner_A.weight, inner_B.weight, base_layer.weight
    use_cache = opts.cache_norm and not torch.compiler.is_compiling()
    key = None
    if use_cache:
        key = cache_key(mag, (W_t, A_t, B_t), scale)
        if key is not None and (_needs_call(lora_A) or _needs_call(lora_B)):
            # FSDP1 unit: outside its call the attribute is a view whose dtype/version depend on the unit's state
            # (sharded fp32 vs unsharded low-precision); its values only change at an epoch bump.
            unit_keys = (key[2][0], ("fsdp1-unit", inner_A.out_features, inner_A.in_features),
                         ("fsdp1-unit", inner_B.out_features, inner_B.in_features))  # fmt: skip
            key = (key[0], key[1], unit_keys, key[3])
    cache = mag.__dict__.setdefault("_fastdora_norm", {})
    hit = cache.get(adapter_name) if key is not None else None
    if hit is not None and hit[0] == key:
        record("norm:cached")
        return hit[1], lora_B(lora_A(x))

    # miss: get full factors. Either both are complete right now (use them BEFORE the lora call: ZeRO-3 releases a
    # prefetched factor after its own forward), or copy both inside their own calls.
    r, d_in = inner_A.out_features, inner_A.in_features
    d_out = inner_B.out_features
    direct = not (_needs_call(lora_A) or _needs_call(lora_B)) and _is_complete(A_t, (r, d_in)) and _is_complete(
        B_t, (d_out, r)
    )
    lora = None
    if direct:
        A, B = A_t, B_t
    else:
        lora, A, B = _capture_factors(lora_A, lora_B, x, True, True)
        record("norm:factors_captured")
    if A is None or B is None or tuple(A.shape) != (r, d_in) or tuple(B.shape) != (d_out, r):
        raise RuntimeError(
            "fastdora: could not obtain the full LoRA factors under the distributed engine "
            f"(A {None if A is None else tuple(A.shape)}, B {None if B is None else tuple(B.shape)})"
        )

    bkey = base_key(W_t) if use_cache else None
    base = mag.__dict__.get("_fastdora_base")
    base_sq = base[1] if (bkey is not None and base is not None and base[0] == bkey) else None
    with full_weight(base_layer) as w_full:
        if w_full is base_layer.weight:
            w_eff = transpose(dequantize_module_weight(base_layer), mag.fan_in_fan_out)
        else:  # DTensor gathered by full_tensor()
            w_eff = transpose(w_full, mag.fan_in_fan_out)
        if not _is_complete(w_eff, (d_out, d_in)):
            raise RuntimeError(
                "fastdora: the base weight is not complete inside the DoRA layer's forward "
                f"(shape {tuple(w_eff.shape)}, expected {(d_out, d_in)}); wrap the base layer in an enclosing "
                "FSDP unit (PEFT's fsdp_auto_wrap_policy does) rather than as its own unit"
            )
        norm, base_sq = factored_norm(w_eff, A, B, scale, base_sq, opts.norm_budget_bytes, opts.kernels)
    record("norm:computed" if base is None or bkey is None or base[0] != bkey else "norm:computed_base_cached")
    if key is not None:
        mag.__dict__["_fastdora_base"] = (bkey, base_sq)
        allow_row_coef_cache(norm)
        cache[adapter_name] = (key, norm)
    if lora is None:
        lora = lora_B(lora_A(x))
    return norm, lora


def base_delta(base_layer: nn.Module, x: torch.Tensor, fan_in_fan_out: bool) -> Optional[torch.Tensor]:
    """``x @ W^T`` without bias for PEFT's dropout path when W is NOT complete here (ZeRO-3 released it): computed
    through ``base_layer``'s own call (the engine gathers W there and again for backward) minus the bias.
    Returns None when W is complete (the caller uses ``F.linear`` exactly like PEFT)."""
    w = base_layer.weight
    if not (_zero3_unavailable(w) or _is_dtensor(w)):
        return None
    out = base_layer(x)
    bias = getattr(base_layer, "bias", None)
    if bias is not None:
        with full_weight_param(base_layer, "bias") as b:
            out = out - b.to(out.dtype)
    return out


@contextlib.contextmanager
def full_weight_param(module: nn.Module, name: str):
    p = getattr(module, name)
    if _zero3_unavailable(p):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            yield getattr(module, name).detach().clone()
        return
    if _is_dtensor(p):
        yield p.full_tensor()
        return
    yield p
