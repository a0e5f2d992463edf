"""Norm slots: the row norms that compiled graphs read, refreshed once per model forward outside the graphs.

Under ``torch.compile`` a DoRA layer's detached norm is otherwise one call of the opaque op ``fastdora::cached_norm``
per layer and forward (``fastdora.dispatch.compiled_norm``): its cache check is Python, called from the compiled
graph. Measured on the H200 (Qwen3-8B shapes, 4 decoder layers each compiled, GA 4, checkpointing, r=16 AMP): 224
calls per gradient iteration, and the step is bound by host time (the host issues an iteration in 0.93x its wall
time); reading the norm as a tensor instead took the iteration from 1.12x to 1.04x compiled LoRA's.

``fastdora.enable(model)`` therefore gives every converted Linear layer under ``model`` (plain ``nn.Linear`` base, not
``fan_in_fan_out``) a *slot*, one ``[d_out]`` tensor per adapter, and hooks ``model``'s forward:

- before it (outside any compiled graph where ``model`` itself is not compiled, e.g. its decoder layers are): the
  refresh checks each layer's cache key (base weight, ``lora_A``, ``lora_B``: identity and version; the scale; the
  cache epoch that optimizer steps and ``load_state_dict`` bump) and recomputes a stale norm into its slot in place,
  through the layer's own eager norm path (so the eager forward that follows finds it cached);
- the model's :class:`Root` is *active* from then to the end of that forward (exceptions included), and again during
  that forward's backward (a checkpoint may call a compiled layer again there).

Inside a step scope (below) whose refresh still holds (no optimizer step, ``load_state_dict`` or
:func:`fastdora.invalidate_norm_cache` since: the norm cache's epoch is unchanged), a forward skips the refresh: every
gradient-accumulation micro-batch after the first would repeat the scope's checks (~20 us per layer on a CPU core,
all before the GPU has work queued).

A model whose DoRA Linear layers all ran eagerly in its previous forward (or, at its first forward, that has no
compiled submodule) skips the refresh: eager layers keep their own cache, and the check costs ~6 us per layer on a
CPU core. The first forward after compiling such a model's layers traces the op; the next one refreshes and compiles
the slot graph.

A compiled layer reads its slot only while its root is active; the traced code branches on ``Root.active``, so
Dynamo guards on it: called outside its model's forward (directly, or through a wrapper that bypasses ``model``'s
hooks), the layer fails the guard and runs a graph compiled with the op instead. Where ``model``'s own forward is
traced (the whole model compiled, as HF Trainer's ``torch_compile=True`` does), the hooks do nothing while traced;
there a *step scope* (:func:`step_scope`, opened by fastdora's trainer callback for every optimizer step) refreshes
the slots when it opens and keeps the root active until the optimizer step. Outside a scope the graph keeps the op.
No checkpoint or parameter is touched: slots are plain attributes, not buffers.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
from torch import nn

from . import cache as _cache
from . import dispatch as _dispatch
from . import distributed as _distributed
from . import layers as _layers
from ._backward_window import around_backward
from .config import SETTINGS as _S
from .stats import active_path_counter, record

__all__ = ["Root", "install", "uninstall", "refresh", "hold", "release", "step_scope", "SLOT_ATTRS"]

_ROOT_ATTR = "_fastdora_slot_model_root"  # on the hooked model: its Root
_HOOKS_ATTR = "_fastdora_slot_hooks"
#: every attribute the slots put on a module
SLOT_ATTRS = frozenset({_ROOT_ATTR, _HOOKS_ATTR, _layers.SLOT_ATTR, _layers.SLOT_ROOT_ATTR, _cache.SLOT_KEYS_ATTR})


class Root:
    """The slot layers of one hooked model. ``active``: their slots hold the current norms (read by traced code)."""

    def __init__(self, entries: list):
        self.active = False
        self.depth = 0  # nesting of the model's eager forwards
        self.holds = 0  # nesting of step scopes (hold / release)
        self.refreshed_epoch = -1  # the norm cache's epoch at the last refresh
        self.entries = entries  # (LoRA layer, adapter, magnitude module)
        self.calls_at_enter = 0  # eager DoRA Linear calls recorded before the current forward
        # the last forward ran at least as many eager DoRA Linear calls as there are slots (None: before the first
        # forward, decided then from whether any submodule is compiled)
        self.ran_eager: Optional[bool] = None


def _has_compiled_modules(model: nn.Module) -> bool:
    """Whether a submodule of ``model`` is compiled (``module.compile()`` or a ``torch.compile`` wrapper)."""
    return any(m.__dict__.get("_compiled_call_impl") is not None or type(m).__name__ == "OptimizedModule"
               for m in model.modules())


def _usable() -> bool:
    # the traced layers read slots only with the norm cache on, and never under a distributed engine (its own path)
    return _S.cache_norm and not _distributed.active()


def _eager_linear_calls() -> int:
    # every eager DoRA Linear call records its path ("linear:<impl>"); compiled graphs record none
    return sum(v for k, v in active_path_counter.items() if k.startswith("linear:"))


def _entries(model: nn.Module) -> list:
    out = []
    for module in model.modules():
        mags = getattr(module, "lora_magnitude_vector", None)
        if not mags or getattr(module, "fan_in_fan_out", False):
            continue
        for adapter, mag in mags.items():
            if type(mag) is _layers.FastDoraLinearLayer and adapter in module.lora_A:
                out.append((module, adapter, mag))
    return out


def _fresh(module: nn.Module, adapter: str, mag: nn.Module) -> bool:
    """Whether the slot's last refresh still holds, checked by dict lookups instead of :func:`_refresh_one`'s module
    walk (~5x the host time, run only when this says no): the same ``W``, ``A``, ``B`` tensor objects held by the
    same modules, and their key holding (:func:`fastdora.cache.local_key_holds`)."""
    rec = mag.__dict__.get(_cache.SLOT_KEYS_ATTR, _NO_KEYS).get(adapter)
    if rec is None or adapter not in mag.__dict__.get(_layers.SLOT_ATTR, _NO_KEYS):
        return False
    key, base, weight, lora_A, lora_B = rec
    return (
        module._modules["lora_B"]._modules[adapter]._parameters.get("weight") is lora_B
        and module._modules["lora_A"]._modules[adapter]._parameters.get("weight") is lora_A
        and module._modules.get("base_layer") is base and base._parameters.get("weight") is weight
        and _cache.local_key_holds(key, weight, lora_A, lora_B, module.scaling[adapter])
    )


_NO_KEYS: dict = {}


def _refresh_one(module: nn.Module, adapter: str, mag: nn.Module) -> bool:
    base = _layers._base_layer(module)
    weight = _layers._stored_weight(base)
    if not isinstance(base, nn.Linear) or not _layers._is_plain(weight):
        mag.__dict__.pop(_layers.SLOT_ATTR, None)
        return True  # this layer traces the op
    lora_A, lora_B = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    scale = module.scaling[adapter]
    key = _cache.local_key(weight, lora_A, lora_B, scale)[0]
    if key is None:
        return False  # not keyable (inference tensors): no slot can be trusted
    # the slot tensors (read by traced code) and their keys (never traced: a key holds version counters)
    slots = mag.__dict__.setdefault(_layers.SLOT_ATTR, {})
    keys = mag.__dict__.setdefault(_cache.SLOT_KEYS_ATTR, {})
    slot = slots.get(adapter)
    rec = keys.get(adapter)
    if slot is not None and rec is not None and rec[0] == key:
        return True
    norm = mag._fd_linear_norm(base, module.lora_A[adapter], module.lora_B[adapter], scale, adapter)  # (the forward's)
    acc = _dispatch._acc(weight, lora_A, lora_B)  # the op's dtype: the same slot whichever path traced first
    if slot is None or slot.shape != norm.shape or slot.dtype != acc or slot.device != norm.device:
        slot = torch.empty(norm.shape, dtype=acc, device=norm.device)
        slots[adapter] = slot
    slot.copy_(norm)
    # the key and the objects :func:`_fresh` checks (the base layer: only a direct ``base_layer`` child)
    keys[adapter] = (key, module._modules.get("base_layer"), weight, lora_A, lora_B)
    record("norm:slot_refresh")
    return True


def refresh(root: Root) -> bool:
    """Bring every slot of ``root`` up to date; False where one layer's norm cannot be keyed (then none is read)."""
    ok = True
    with torch.no_grad():
        for module, adapter, mag in root.entries:
            if not _fresh(module, adapter, mag):
                ok = _refresh_one(module, adapter, mag) and ok
    root.refreshed_epoch = _cache.epoch()
    record("norm:slot_checks")
    return ok


def _enter(model: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return  # traced with the model: the layers keep the op (see the module docstring)
    root: Root = model.__dict__[_ROOT_ATTR]
    root.depth += 1
    if root.depth == 1:
        if root.ran_eager is None:
            root.ran_eager = not _has_compiled_modules(model)
        # inside a step scope whose refresh still holds (a later micro-batch), the slots stand as they are; a model
        # whose DoRA layers all ran eagerly in its last forward reads no slot: no refresh (the eager layers keep their
        # own cache); once compiled layers run, the next forward refreshes again
        if not (root.holds and root.active and root.refreshed_epoch == _cache.epoch()):
            root.active = (not root.ran_eager) and _usable() and refresh(root)
        root.calls_at_enter = _eager_linear_calls()


def _leave(model: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    root: Root = model.__dict__[_ROOT_ATTR]
    root.depth = max(root.depth - 1, 0)
    if root.depth == 0:
        root.ran_eager = _eager_linear_calls() - root.calls_at_enter >= len(root.entries)
        if root.holds == 0:
            if root.active and torch.is_grad_enabled():
                _arm_backward(root, output)
            root.active = False


def _arm_backward(root: Root, output) -> None:
    """Make ``root`` active again while the backward of this forward runs: a checkpointed layer called (compiled)
    inside the forward runs its forward again there, and must take the same graph (same slots, same saved tensors;
    ``torch.utils.checkpoint`` checks them). Active from the first gradient reaching the model's outputs (before any
    layer of the model) to the end of that backward."""

    def arm() -> None:
        root.active = True

    def disarm() -> None:
        root.active = root.active and (root.depth > 0 or root.holds > 0)

    around_backward(output, arm, disarm)


def install(model: nn.Module) -> int:
    """Give ``model``'s converted Linear layers slots and hook ``model``'s forward (again after a new ``enable``:
    the layer list is rebuilt). Returns the number of slot layers."""
    uninstall(model)
    entries = _entries(model)
    if not entries:
        return 0
    root = Root(entries)
    model.__dict__[_ROOT_ATTR] = root
    for _, _, mag in entries:
        mag.__dict__[_layers.SLOT_ROOT_ATTR] = root
    model.__dict__[_HOOKS_ATTR] = (model.register_forward_pre_hook(_enter),
                                   model.register_forward_hook(_leave, always_call=True))
    return len(entries)


def uninstall(model: nn.Module) -> Optional[Root]:
    root = model.__dict__.pop(_ROOT_ATTR, None)
    for h in model.__dict__.pop(_HOOKS_ATTR, ()):
        h.remove()
    if root is not None:
        root.active = False
        for _, _, mag in root.entries:
            if mag.__dict__.get(_layers.SLOT_ROOT_ATTR) is root:
                mag.__dict__.pop(_layers.SLOT_ROOT_ATTR, None)
            mag.__dict__.pop(_layers.SLOT_ATTR, None)
            mag.__dict__.pop(_cache.SLOT_KEYS_ATTR, None)
    return root


# ------------------------------------------------------------------------------------------- step scopes

_HELD: "weakref.WeakSet[Root]" = weakref.WeakSet()  # roots inside a step scope
_STEP_HOOK = None


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    # the step changed the adapters: a scope's slots are stale from here to the next scope's refresh (a forward in
    # between, e.g. a scope spanning several steps, fails the graphs' guard and runs the op)
    for root in list(_HELD):
        root.active = False


def _root_of(model: nn.Module) -> Optional[Root]:
    # ``model`` or what a ``torch.compile`` wrapper holds
    return model.__dict__.get(_ROOT_ATTR) or getattr(model, "_orig_mod", model).__dict__.get(_ROOT_ATTR)


def hold(model: nn.Module) -> bool:
    """Open a step scope on ``model`` (nested scopes count): its slots are refreshed now, and its compiled graphs
    read them until the next optimizer step or :func:`release` -- also where ``model``'s own forward is compiled and
    its hooks cannot run. False (nothing held) for a model without slots, a model whose last
    forward ran every DoRA layer eagerly, or under a distributed engine."""
    global _STEP_HOOK
    root = _root_of(model)
    if root is None:
        return False
    root.holds += 1
    if root.holds > 1:
        return root.active
    if root.ran_eager or not _usable():
        return False
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)
    _HELD.add(root)
    root.active = refresh(root)
    return root.active


def release(model: nn.Module) -> None:
    """Close a step scope opened by :func:`hold`."""
    root = _root_of(model)
    if root is None or root.holds == 0:
        return
    root.holds -= 1
    if root.holds == 0:
        _HELD.discard(root)
        if root.depth == 0:
            root.active = False


@contextlib.contextmanager
def step_scope(model: nn.Module):
    """``with fastdora.step_scope(model):`` around one training step (its forwards, backwards and optimizer step) of
    a model compiled whole (``torch.compile(model)``): until the optimizer step, the compiled graph reads each
    layer's norm slot (refreshed when the scope opens) instead of calling fastdora's norm op per layer and forward.
    Open one scope per optimizer step (forwards after the step inside the same scope run the op: correct, one more
    graph). Between the scope's start and its optimizer step, do not change the adapters or base weights any other
    way (an in-place edit under ``torch.no_grad()``, ``load_state_dict``): a model compiled whole would not see it
    before the next scope, nor would the next forward of a model whose layers are compiled unless the change bumped
    the norm cache's epoch (``load_state_dict`` of the model, :func:`fastdora.invalidate_norm_cache`). fastdora's
    trainer callback opens one per optimizer step."""
    held = hold(model)
    try:
        yield held
    finally:
        release(model)
