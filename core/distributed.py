"""fastdora under sharding engines: PyTorch FSDP1, FSDP2 (``fully_shard``), DeepSpeed ZeRO-2/3 (and DDP).

What changes when parameters are sharded (checked on torch 2.13 / deepspeed 0.19, see tests/peft/test_distributed.py):

- **Cache key.** While ``torch.distributed`` is initialized the norm cache uses its engine-safe key (no storage
  address; ``fastdora.cache``), so re-gathers within one step (gradient accumulation, gradient-checkpoint
  recomputation) hit, and misses happen on all ranks together.
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
DeepSpeed partition by hand) must be followed by ``fastdora.invalidate_norm_cache()``. Call
``fastdora.enable(model)`` before the engine wraps the model (or use process-wide mode); ``enable`` does not look inside
FSDP1 wrappers.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from . import cache as _cache
from .stats import record

__all__ = ["active", "unwrap", "linear_norm_and_lora", "full_weight", "base_delta"]


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


def linear_norm_and_lora(mag, x, base_layer, lora_A, lora_B, scale, adapter_name):
    """Distributed path of ``FastDoraLinearLayer.forward``: returns ``(norm, lora)`` with
    ``lora = lora_B(lora_A(x))`` and the detached fp32 row norm of ``W + s*B@A`` from full parameters."""
    from peft.utils.integrations import dequantize_module_weight
    from peft.utils.other import transpose

    from .config import SETTINGS
    from .dispatch import factored_norm
    from .ops.compose import allow_row_coef_cache

    opts = mag._fd_options()
    inner_A, inner_B = unwrap(lora_A), unwrap(lora_B)
    A_t, B_t, W_t = inner_A.weight, inner_B.weight, base_layer.weight
    use_cache = SETTINGS.cache_norm and not torch.compiler.is_compiling()
    key = bkey = None
    if use_cache:
        key, bkey = _cache.keys(mag, W_t, A_t, B_t, scale, distributed=True)
        if key is not None and (_needs_call(lora_A) or _needs_call(lora_B)):
            # FSDP1 unit: outside its call the attribute is a view whose dtype/version depend on the unit's state
            # (sharded fp32 vs unsharded low-precision); its values only change at an epoch bump.
            unit_keys = (key[2][0], ("fsdp1-unit", inner_A.out_features, inner_A.in_features),
                         ("fsdp1-unit", inner_B.out_features, inner_B.in_features))  # fmt: skip
            key = (key[0], key[1], unit_keys, key[3])
    hit = _cache.get(mag, adapter_name, key)
    if hit is not None:
        return hit, lora_B(lora_A(x))

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

    base_sq = _cache.base(mag, bkey)
    base_was_cached = base_sq is not None
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
        norm, base_sq = factored_norm(w_eff, A, B, scale, base_sq, SETTINGS.norm_budget_bytes, opts.kernels)
    if key is not None:
        allow_row_coef_cache(norm)
    _cache.put(mag, adapter_name, key, norm, bkey, base_sq, base_was_cached)
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
