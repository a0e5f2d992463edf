"""State that a model's forward sets up and that its backward must see again: callbacks at the start and the end of
the backward of one forward's outputs (a checkpointed module runs its forward again inside that backward)."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["grad_outputs", "around_backward"]


def grad_outputs(output) -> list:
    """The tensors of a module's output (a tensor, a dict or ``ModelOutput``, a list or tuple, nested) that require
    grad."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):  # (transformers' ModelOutput too)
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in grad_outputs(o)]
    return []


def around_backward(output, start: Callable[[], None], end: Callable[[], None]) -> bool:
    """Call ``start()`` when the first gradient reaches one of ``output``'s tensors that require grad (before the
    backward of any module that produced them) and ``end()`` when that backward finishes. Returns False, registering
    nothing, when no tensor of ``output`` requires grad."""
    tensors = grad_outputs(output)
    if not tensors:
        return False

    def arm(_grads) -> None:
        start()
        torch.autograd.Variable._execution_engine.queue_callback(end)

    torch.autograd.graph.register_multi_grad_hook(tensors, arm, mode="any")
    return True
