"""Low-host-overhead launches of Triton kernels that are already compiled.

``JITFunction.__getitem__(grid)(...)`` re-derives the specialisation of every argument, rebuilds the option set and
looks the compiled kernel up on every call: tens of microseconds of Python per launch, which a DoRA training step
pays three or four times per layer per micro-batch (measured host-bound on the H200, benchmarks/README.md). A
``Launcher`` does the first launch of each specialisation through Triton's JIT (compiling it), keeps the
``CompiledKernel`` it returns, and launches later calls with the same specialisation through that object directly.

The cache key is a superset of what Triton specialises on (so a key hit means Triton would pick the same binary):
per tensor its dtype and 16-byte alignment, per int ``== 1``, divisibility by 16 and the 32-bit range, per float
nothing but its type, plus every constexpr value, ``num_warps`` and the device. The fast launch is used only where
the installed Triton passes all bound arguments to ``CompiledKernel.run`` (checked once from the JIT's own source,
Triton >= 3.3); otherwise, and under ``TRITON_INTERPRET=1``, every launch goes through the JIT.
"""

from __future__ import annotations

import inspect

import torch

try:  # pragma: no cover - exercised wherever triton is installed
    from triton.runtime.jit import JITFunction
except Exception:  # pragma: no cover
    JITFunction = None

__all__ = ["Launcher", "FAST_LAUNCH", "spec_key"]


def _fast_launch_supported() -> bool:
    if JITFunction is None:
        return False
    try:
        from triton.compiler.compiler import CompiledKernel

        src = inspect.getsource(JITFunction.run)
    except Exception:  # pragma: no cover - no source: use the JIT path
        return False
    return "*bound_args.values()" in src and "kernel.run(" in src and hasattr(CompiledKernel, "__getitem__")


FAST_LAUNCH = _fast_launch_supported()

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def spec_key(args) -> tuple:
    """Specialisation-relevant properties of the runtime arguments (see module docstring)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, (a.data_ptr() & 15) == 0))
        elif isinstance(a, bool):
            key.append(("b", a))
        elif isinstance(a, int):
            key.append((a == 1, (a & 15) == 0, _I32_MIN <= a <= _I32_MAX))
        elif isinstance(a, float):
            key.append("f")
        else:
            key.append(("v", a))
    return tuple(key)


class Launcher:
    """``Launcher(jit_fn)(grid, runtime_args, constexpr_values, num_warps)``: all parameters positional, the
    constexpr ones last (in declaration order)."""

    __slots__ = ("fn", "cache", "fast")

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}
        self.fast = FAST_LAUNCH and isinstance(fn, JITFunction)

    def __call__(self, grid, args: tuple, consts: tuple, num_warps: int):
        if len(grid) < 3:
            grid = tuple(grid) + (1,) * (3 - len(grid))
        if not self.fast:
            self.fn[grid](*args, *consts, num_warps=num_warps)
            return
        key = (spec_key(args), consts, num_warps, args[0].get_device())
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self.fn[grid](*args, *consts, num_warps=num_warps)
            if compiled is not None:
                self.cache[key] = compiled
            return
        compiled[grid](*args, *consts)
