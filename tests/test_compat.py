"""Each private torch internal that fastdora.compat reads, checked on the installed torch: it exists and means what
fastdora relies on. A failure here names the internal that a torch release changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fastdora import compat


def test_top_saved_tensors_hook_query():
    assert compat.top_pack_hook() is None

    def pack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert compat.top_pack_hook() is pack
    assert compat.top_pack_hook() is None


def test_checkpoint_pack_hooks_are_recognised():
    """Inside non-reentrant checkpointing's first forward the top hook is its discarding pack hook, inside the
    recomputation its recomputation hook; outside, neither."""
    assert compat.DISCARD_PACK_CODES and compat.RECOMPUTE_PACK_CODES
    seen = []

    def probe(x):
        hook = compat.top_pack_hook()
        code = getattr(hook, "__code__", None)
        seen.append("discard" if code in compat.DISCARD_PACK_CODES else
                    "recompute" if code in compat.RECOMPUTE_PACK_CODES else "other")
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    checkpoint(probe, x, use_reentrant=False).sum().backward()
    assert seen == ["discard", "recompute"]


def test_dispatch_mode_stack_length():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert compat.dispatch_modes() == 0
    with Mode():
        assert compat.dispatch_modes() == 1


def test_functorch_transforms_query_and_direct_apply():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    assert compat.transforms_active() is False
    apply = compat.direct_apply(Double)
    x = torch.randn(3, requires_grad=True)
    y = apply(x)
    y.sum().backward()
    assert torch.equal(y, 2 * x.detach()) and torch.equal(x.grad, torch.full((3,), 2.0))
    assert y.grad_fn is not None and type(y.grad_fn).__name__.startswith("DoubleBackward")

    seen = []

    def f(v):
        seen.append(compat.transforms_active())
        return v * 2

    torch.func.vmap(f)(torch.randn(2, 3))  # under a transform, direct_apply defers to Function.apply
    assert seen == [True]


def test_global_module_hooks_query():
    assert compat.global_module_hooks() is False
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    try:
        assert compat.global_module_hooks() is True
    finally:
        handle.remove()
    assert compat.global_module_hooks() is False


def test_jit_tracing_query():
    seen = []

    def f(x):
        seen.append(compat.tracing())
        return x + 1

    assert compat.tracing() is False
    torch.jit.trace(f, torch.randn(2), check_trace=False)
    assert seen == [True]
    f(torch.randn(2))
    assert seen == [True, False]


def test_cuda_queries_exist():
    # CPU builds have the bindings too (they are what a CUDA tensor's path calls); without a device they are not run
    assert callable(compat.current_device) and callable(compat.raw_stream) and callable(compat.stream_capturing)
    if torch.cuda.is_available():  # the bindings raise on a CPU-only build: fastdora calls them for CUDA tensors only
        assert compat.stream_capturing() is False
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            assert compat.stream_capturing() is True
        assert compat.current_device() == torch.cuda.current_device()
        assert compat.raw_stream(compat.current_device()) == torch.cuda.current_stream().cuda_stream


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_conv_without_bias_is_the_modules_convolution(dim, padding_mode):
    conv = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[dim](
        3, 4, 3, padding=1, padding_mode=padding_mode, dtype=torch.float64)
    assert callable(getattr(conv, "_conv_forward", None))  # the private path is the one that runs on this torch
    x = torch.randn(2, 3, *([6] * dim), dtype=torch.float64)
    bias = conv.bias.view(1, -1, *([1] * dim))
    torch.testing.assert_close(compat.conv_without_bias(conv, x) + bias, conv(x), rtol=1e-12, atol=1e-12)
