"""Runtime dispatch: which implementation runs a composition or a norm.

- Triton training / inference path: CUDA tensors, Triton importable, ``kernels != "eager"``, supported layout.
- Exact PyTorch fallback: CPU, no Triton, ``kernels="eager"``, channel-first (conv) layouts, or tiny problems
  where launch latency dominates (threshold measured on the H200: ``fastdora.kernels.compose.CROSSOVER_NUMEL``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["compose_impl", "layer_node", "norm_impl", "triton_available"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        from .kernels import compose as _k  # noqa: F401

        return _k.AVAILABLE
    except Exception:  # pragma: no cover - import errors mean "no triton"
        return False


def _wants_triton(kernels: str, *tensors: Optional[torch.Tensor]) -> bool:
    if kernels == "eager":
        return False
    ts = [t for t in tensors if t is not None]
    if not ts or not all(t.is_cuda for t in ts):
        return False
    if not triton_available():
        if kernels == "triton":
            raise RuntimeError("fastdora: kernels='triton' was requested but Triton is not importable")
        return False
    return True


_EAGER = None
_KERNELS = None  # fastdora.kernels.compose once imported with Triton available, else False


def _compose_kernels(kernels: str):
    """``fastdora.kernels.compose`` where Triton is available, else None (an error where ``kernels="triton"`` asked for
    it)."""
    global _KERNELS
    if _KERNELS is None:
        if triton_available():
            from .kernels import compose as k

            _KERNELS = k
        else:
            _KERNELS = False
    if not _KERNELS:
        if kernels == "triton":
            raise RuntimeError("fastdora: kernels='triton' was requested but Triton is not importable")
        return None
    return _KERNELS


def compose_impl(result, lora, magnitude, bias, base_delta, feature_dim, kernels: str):
    """Called on every composition: the common case is a handful of attribute checks."""
    global _EAGER
    if _EAGER is None:
        from .ops.compose import EAGER as _e

        _EAGER = _e
    if (
        kernels == "eager"
        or not (result.is_cuda and lora.is_cuda and magnitude.is_cuda)
        or (feature_dim != -1 and feature_dim != result.dim() - 1)
    ):
        return _EAGER
    k = _compose_kernels(kernels)
    if k is None:
        return _EAGER
    if kernels == "auto" and not k.worth_it(result):
        return _EAGER
    if bias is not None and bias.requires_grad:
        return _EAGER
    return k.TRITON


def layer_node(x, weight, magnitude, kernels: str):
    """The C++ node (``fastdora.kernels.native``) for a whole DoRA Linear layer call (``lean_linear_forward``), where
    the composition of this call would take the Triton path (``compose_impl``'s rule for the layer's result, which
    has ``x``'s rows and ``weight``'s output features) and the node is active; None otherwise (the separate nodes run).
    """
    if kernels == "eager" or not (x.is_cuda and weight.is_cuda and magnitude.is_cuda):
        return None
    k = _compose_kernels(kernels)
    if k is None:
        return None
    if kernels == "auto" and (x.numel() // max(x.shape[-1], 1)) * weight.shape[0] < k.CROSSOVER_NUMEL:
        return None
    return k.layer_node(x)


def norm_impl(weight, lora_A, lora_B, kernels: str):
    from .ops.norm import factored_norm_eager

    # under torch.compile the norm is traced as plain PyTorch ops (the Triton launcher is not a registered op)
    if torch.compiler.is_compiling() or not _wants_triton(kernels, weight, lora_A, lora_B):
        return factored_norm_eager
    from .kernels import norm as kn

    if not kn.supports(weight, lora_A, lora_B):
        return factored_norm_eager
    return kn.factored_norm_triton
