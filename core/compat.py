"""Every private torch internal fastdora reads, in one place (tests/test_compat.py checks each one on the installed
torch). Each has a fallback that keeps results exact: a missing internal only costs speed (the general path runs).

- saved-tensor hook introspection (``torch._C._autograd._top_saved_tensors_default_hooks`` and the pack hooks of
  ``torch.utils.checkpoint``'s non-reentrant hook classes): lets the composition skip writing an activation that
  checkpointing's first forward discards, and lets a layer's first call know whether it runs inside a checkpoint;
- the Python dispatch-mode stack (``torch._C._len_torch_dispatch_stack``): selective activation checkpointing's mode;
- functorch (``torch._C._FunctionBase.apply``, ``torch._C._functorch.unwrap_if_dead``,
  ``torch._C._are_functorch_transforms_active``): an autograd Function's C ``apply`` without its Python layer;
- global module hooks (``torch.nn.modules.module._global_*hooks``) and the JIT tracing state
  (``torch._C._get_tracing_state``): whether calling a module's ``forward`` directly equals calling the module;
- CUDA queries without their Python layers (``torch._C._cuda_getDevice``, ``_cuda_getCurrentRawStream``,
  ``_cuda_isCurrentStreamCapturing``);
- a convolution module's own convolution without its bias (``nn.modules.conv._ConvNd._conv_forward``): what PEFT >= 0.22
  runs for a Conv DoRA layer's base branch under dropout, padding mode included (here the fallback is the functional
  convolution with zero padding, exact for the default padding mode only).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = [
    "checkpoint_pack_codes",
    "DISCARD_PACK_CODES",
    "RECOMPUTE_PACK_CODES",
    "top_pack_hook",
    "dispatch_modes",
    "transforms_active",
    "direct_apply",
    "global_module_hooks",
    "tracing",
    "current_device",
    "raw_stream",
    "stream_capturing",
    "conv_without_bias",
]


# ------------------------------------------------------------------------------------ saved-tensor hooks, checkpoint


def checkpoint_pack_codes(hook_cls: str) -> frozenset:
    """Code objects of the pack hook that non-reentrant ``torch.utils.checkpoint``'s saved-tensor hook class
    ``hook_cls`` defines: ``_checkpoint_hook`` around the forward it will recompute (it keeps no reference to what is
    saved: a placeholder and, for its determinism check, the saved tensor's shape / dtype / device),
    ``_recomputation_hook`` around the recomputation. Empty where this torch has no such hook."""
    try:
        from torch.utils import checkpoint as _ckpt

        consts = getattr(_ckpt, hook_cls).__init__.__code__.co_consts
    except Exception:  # pragma: no cover - another torch layout: no hook is recognised
        return frozenset()
    return frozenset(c for c in consts if getattr(c, "co_name", None) == "pack_hook")


DISCARD_PACK_CODES = checkpoint_pack_codes("_checkpoint_hook")
RECOMPUTE_PACK_CODES = checkpoint_pack_codes("_recomputation_hook")
_TOP_SAVED_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def top_pack_hook() -> Optional[Callable]:
    """The pack hook on top of the saved-tensor hook stack, unwrapped (torch wraps the recomputation's hook to keep
    dynamo out of it); None without hooks (or on a torch without the query)."""
    hooks = _TOP_SAVED_HOOKS(False) if _TOP_SAVED_HOOKS is not None else None
    if hooks is None:
        return None
    fn = hooks[0]
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


_DISPATCH_STACK = getattr(torch._C, "_len_torch_dispatch_stack", None)


def dispatch_modes() -> Optional[int]:
    """Python dispatch modes on the stack (selective activation checkpointing runs under one); None: unknown."""
    return _DISPATCH_STACK() if _DISPATCH_STACK is not None else None


# --------------------------------------------------------------------------------------------------------- functorch

_C_FUNCTION_APPLY = torch._C._FunctionBase.__dict__.get("apply")
_UNWRAP_IF_DEAD = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)


def transforms_active() -> bool:
    """functorch transforms (vmap, grad, ...) are active; True where this torch cannot tell (the safe answer)."""
    return True if _TRANSFORMS_ACTIVE is None else bool(_TRANSFORMS_ACTIVE())


def direct_apply(fn_cls) -> Callable:
    """``fn_cls.apply`` for a Function with no ``setup_context``, minus the Python layer of ``Function.apply`` (the
    per-call signature and functorch checks around the C ``apply``): outside functorch transforms it does what that
    layer does -- unwrap dead functorch wrappers among the tensor arguments -- and calls the C ``apply`` directly.
    Under functorch transforms, while ``torch.compile`` traces (dynamo cannot trace the C ``apply``; it traces
    ``Function.apply``'s forward and backward into the graph) or on a torch without these internals it is
    ``fn_cls.apply`` itself."""
    if _C_FUNCTION_APPLY is None or _UNWRAP_IF_DEAD is None or _TRANSFORMS_ACTIVE is None:  # pragma: no cover
        return fn_cls.apply
    c_apply = _C_FUNCTION_APPLY.__get__(None, fn_cls)
    unwrap = _UNWRAP_IF_DEAD
    is_tensor = torch.Tensor
    active = _TRANSFORMS_ACTIVE

    compiling = torch.compiler.is_compiling

    def apply(*args):
        if active() or compiling():
            return fn_cls.apply(*args)
        return c_apply(*[unwrap(a) if isinstance(a, is_tensor) else a for a in args])

    return apply


# ------------------------------------------------------------------------------------------ module hooks, tracing

_NN_MODULE = torch.nn.modules.module
_GLOBAL_HOOK_DICTS = tuple(
    getattr(_NN_MODULE, name, None)
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
)
_GLOBAL_HOOKS_KNOWN = all(d is not None for d in _GLOBAL_HOOK_DICTS)


def global_module_hooks() -> bool:
    """Global module hooks are set (ZeRO-3 style gathering, FSDP2 unsharding, profilers); True where this torch keeps
    them elsewhere (the safe answer: callers then call modules, not their ``forward``)."""
    if not _GLOBAL_HOOKS_KNOWN:  # pragma: no cover
        return True
    a, b, c, d = _GLOBAL_HOOK_DICTS
    return bool(a or b or c or d)


_TRACING_STATE = getattr(torch._C, "_get_tracing_state", None)


def tracing() -> bool:
    """``torch.jit.trace`` is recording."""
    return _TRACING_STATE is not None and _TRACING_STATE() is not None


# ------------------------------------------------------------------------------------------------------------ CUDA

current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
"""The current CUDA device as an int (CUDA is initialised wherever a CUDA tensor exists)."""

raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda idx: torch.cuda.current_stream(idx).cuda_stream
)
"""The raw handle of a device's current CUDA stream (by device index): what Triton's own driver uses."""

_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def stream_capturing() -> bool:
    """The current CUDA stream is capturing a graph (call only where CUDA is initialised: a CPU-only build's binding
    raises)."""
    return _IS_CAPTURING is not None and bool(_IS_CAPTURING())


# ----------------------------------------------------------------------------------------------------- convolutions


def conv_without_bias(conv: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv``'s convolution of ``x`` with its weight and no bias, padding mode included (``_conv_forward``, what PEFT
    >= 0.22 calls). Without it: the functional convolution, zero padding (an error for another padding mode)."""
    conv_forward = getattr(conv, "_conv_forward", None)
    if conv_forward is not None:
        return conv_forward(x, conv.weight, None)
    if conv.padding_mode != "zeros":  # pragma: no cover
        raise NotImplementedError(f"this torch's {type(conv).__name__} has no _conv_forward: padding_mode "
                                  f"{conv.padding_mode!r} is not supported by fastdora's Conv DoRA path")
    F = torch.nn.functional
    fn = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[conv.weight.dim()]
    return fn(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
