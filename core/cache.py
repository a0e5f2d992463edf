"""The norm cache: its key, its epoch and its storage, for the single-device and the distributed paths alike.

A DoRA layer's row norm ``||W + s B A||`` depends only on ``W, A, B, s``; within one optimizer step (every
gradient-accumulation micro-batch, every checkpoint recomputation) none of them changes, so a cached norm is exact
as long as its key sees every change:

- **epoch**: a process-wide counter bumped after EVERY ``torch.optim.Optimizer.step`` (a global step post-hook: it
  fires for plain, fused and foreach optimizers, for the torch optimizer inside DeepSpeed's ZeRO wrapper, under
  accelerate / HF Trainer, and for FSDP1 / FSDP2 optimizers), after every ``load_state_dict`` of a module holding a
  fastdora magnitude, and by :func:`invalidate`. Fused optimizers and ZeRO write parameters without bumping their
  version counters; the epoch catches those updates. ``load_epoch`` moves only on loads and :func:`invalidate` (the
  frozen base norm ``||W||^2`` is keyed on it).
- **single device**: ``(epoch, (data_ptr, _version, shape, stride, dtype, device) of W, A, B, s)``: any in-place
  change (``merge``, edits under ``no_grad``) or storage swap (``.data =``, ``.to()``) changes it.
- **distributed** (``torch.distributed`` initialized): ``(epoch, (_version, logical shape, dtype, device) per tensor,
  s)``, no storage address: FSDP2 frees and re-allocates the unsharded storage at every all-gather (the allocator can
  hand back the same address) and keeps ``_version == 0`` across steps, ZeRO-2/3 write updated weights through
  ``.data``, FSDP1 rebuilds its views at every unshard. Between two epoch bumps a parameter's VALUE cannot change
  (re-gathering moves bytes, it does not change them), so a hit is exact; the key is the same on every rank, so
  misses (which may run a collective) happen on all ranks together.

Entries live in plain ``_fastdora_norm`` (adapter -> (key, norm)) and ``_fastdora_base`` ((key, ||W||^2)) attributes
of the magnitude module: never parameters or buffers (PEFT's checkpoints and dtype tests depend on that).

Under ``torch.compile`` the norm is computed inside an opaque op that sees tensors only (``fastdora.dispatch``'s
``fastdora::cached_norm``): its entries are held by the storage of the layer's ``lora_B`` factor (a weak key: an entry
goes with its factor) under the single-device key, so views and aliases of the same parameters share one entry.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from .stats import record

__all__ = ["epoch", "invalidate", "ensure_step_hook", "keys", "local_key", "local_key_holds", "tensor_key", "get",
           "base", "put", "clear", "drop_from_state", "ATTRS", "anchored_get", "anchored_put"]

_EPOCH = 0  # bumped after every optimizer step / load_state_dict / invalidate()
_LOAD_EPOCH = 0  # bumped on load_state_dict / invalidate() only (the frozen base weight's norm)
_STEP_HOOK = None

#: the magnitude module's attributes that hold cache state (dropped by pickling / deep copies and ``disable``)
#: the cache keys of a magnitude module's norm slots (``fastdora.slots``), cleared with the cache
SLOT_KEYS_ATTR = "_fastdora_slot_keys"
ATTRS = ("_fastdora_norm", "_fastdora_base", "_fastdora_graphs", SLOT_KEYS_ATTR)


def epoch() -> int:
    return _EPOCH


def invalidate() -> None:
    """Drop every cached norm (process-wide). Needed only after writing parameters through ``.data`` outside an
    optimizer step and outside ``load_state_dict`` (such writes bump no version counter)."""
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


# ---------------------------------------------------------------------------------------------------------- keys


def _tkey(t: torch.Tensor):
    """Identity + version of a tensor's contents: any in-place change or storage swap changes it."""
    try:
        version = t._version
    except RuntimeError:  # inference tensors have no version counter: never cache them
        return None
    return (t.data_ptr(), version, tuple(t.shape), t.stride(), t.dtype, t.device)


def local_key(weight_src: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float):
    """``(key, wkey)`` outside distributed engines (``key`` None: not cacheable): the epoch plus W, A, B identity and
    versions; ``wkey`` keys the base norm of ``W`` alone: the load epoch plus W's identity and version (a write through
    ``.data`` moves no version counter; :func:`invalidate` then moves the load epoch)."""
    tkey, akey, bkey = _tkey(weight_src), _tkey(lora_A), _tkey(lora_B)
    key = None if (akey is None or bkey is None) else (_EPOCH, tkey, akey, bkey, float(scale))
    return key, (None if tkey is None else (_LOAD_EPOCH, tkey))


def local_key_holds(key, weight_src: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> bool:
    """Whether ``key``, built by :func:`local_key` from these same tensor objects, still holds: the same epoch and
    scale, each tensor at the same storage and version. A fraction of the host time of building the key again (the
    per-layer check that runs before every compiled forward, ``fastdora.slots``)."""
    k_epoch, wkey, akey, bkey, k_scale = key
    return (
        k_epoch == _EPOCH
        and lora_B._version == bkey[1] and lora_A._version == akey[1] and weight_src._version == wkey[1]
        and lora_B.data_ptr() == bkey[0] and lora_A.data_ptr() == akey[0] and weight_src.data_ptr() == wkey[0]
        and scale == k_scale
    )


def _logical_shape(t: torch.Tensor) -> tuple:
    ds_shape = getattr(t, "ds_shape", None)  # ZeRO-3: the placeholder's .shape is (0,) while partitioned
    return tuple(ds_shape) if ds_shape is not None else tuple(t.shape)


def tensor_key(t: torch.Tensor):
    """Engine-safe per-tensor key: no storage address (gathers move storage), the logical shape (ZeRO-3)."""
    try:
        version = t._version
    except RuntimeError:  # inference tensors: never cache
        return None
    return (version, _logical_shape(t), t.dtype, t.device.type)


def _dist_keys(weight_src: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float):
    tkeys = (tensor_key(weight_src), tensor_key(lora_A), tensor_key(lora_B))
    key = None if any(k is None for k in tkeys) else ("dist", _EPOCH, tkeys, float(scale))
    # a frozen base weight only changes by load_state_dict / invalidate(); a trainable one at every step too
    wkey = None if tkeys[0] is None else ("dist-base", _LOAD_EPOCH, _EPOCH if weight_src.requires_grad else None,
                                          tkeys[0])
    return key, wkey


def keys(mag: nn.Module, weight_src: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float,
         distributed: bool):
    """``(key, wkey)`` of ``mag``'s cache for these tensors (see the module docstring); either may be None (not
    cacheable). Registers the epoch's hooks on first use."""
    _ensure_hooks(mag)
    if distributed:
        return _dist_keys(weight_src, lora_A, lora_B, scale)
    return local_key(weight_src, lora_A, lora_B, scale)


# -------------------------------------------------------------------------------------------------------- storage


def get(mag: nn.Module, adapter: Optional[str], key) -> Optional[torch.Tensor]:
    """The cached norm of ``adapter`` under ``key``, or None; a hit is counted as ``norm:cached``."""
    if key is None:
        return None
    cache = mag.__dict__.get("_fastdora_norm")
    hit = cache.get(adapter) if cache else None
    if hit is not None and hit[0] == key:
        record("norm:cached")
        return hit[1]
    return None


def base(mag: nn.Module, wkey) -> Optional[torch.Tensor]:
    """The cached ``||W||^2`` per row under ``wkey``, or None."""
    entry = mag.__dict__.get("_fastdora_base")
    return entry[1] if (wkey is not None and entry is not None and entry[0] == wkey) else None


def put(mag: nn.Module, adapter: Optional[str], key, norm: torch.Tensor, wkey, base_sq: torch.Tensor,
        base_was_cached: bool) -> None:
    """Store a computed norm (and the base norm it used); counts ``norm:computed`` or ``norm:computed_base_cached``."""
    record("norm:computed_base_cached" if base_was_cached else "norm:computed")
    if key is None:
        return
    mag.__dict__["_fastdora_base"] = (wkey, base_sq)
    mag.__dict__.setdefault("_fastdora_norm", {})[adapter] = (key, norm)


def clear(mag: nn.Module) -> None:
    """Forget ``mag``'s cached norms (merge / unmerge / ``enable`` again)."""
    mag.__dict__["_fastdora_norm"] = {}
    mag.__dict__["_fastdora_base"] = None
    mag.__dict__["_fastdora_graphs"] = {}
    mag.__dict__[SLOT_KEYS_ATTR] = {}  # (fastdora.slots: the next refresh recomputes every slot)


def drop_from_state(state: dict) -> dict:
    """``state`` (a module ``__dict__`` for pickling / deep copies) without cache entries: the copy recomputes them."""
    state = dict(state)
    for name, empty in zip(ATTRS, ({}, None, {}, {})):
        if name in state:
            state[name] = empty
    return state


# ----------------------------------------------------------------------------- entries held by a factor's storage

_ANCHORED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # storage -> (key, norm, wkey, base_sq)


def anchored_get(anchor: torch.Tensor, key, wkey) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(norm, base_sq)`` cached on ``anchor``'s storage: the norm under ``key`` (a hit is counted as
    ``norm:cached``), else None and the base norm under ``wkey`` (or None)."""
    entry = _ANCHORED.get(anchor.untyped_storage()) if key is not None else None
    if entry is None:
        return None, None
    if entry[0] == key:
        record("norm:cached")
        return entry[1], None
    return None, (entry[3] if (wkey is not None and entry[2] == wkey) else None)


def anchored_put(anchor: torch.Tensor, key, norm: torch.Tensor, wkey, base_sq: torch.Tensor,
                 base_was_cached: bool) -> None:
    """Store a computed norm on ``anchor``'s storage; counts ``norm:computed`` or ``norm:computed_base_cached``."""
    record("norm:computed_base_cached" if base_was_cached else "norm:computed")
    if key is not None and wkey is not None:
        _ANCHORED[anchor.untyped_storage()] = (key, norm, wkey, base_sq)
