"""Low-host-overhead launches of Triton kernels that are already compiled.

``JITFunction.__getitem__(grid)(...)`` re-derives the specialisation of every argument, rebuilds the option set and
looks the compiled kernel up on every call: tens of microseconds of Python per launch, which a DoRA training step
pays three or four times per layer per micro-batch (a host-bound step on the H200). A
``Launcher`` does the first launch of each specialisation through Triton's JIT (compiling it), keeps the
``CompiledKernel`` it returns, and launches later calls with the same specialisation through that object directly.

The cache key is a superset of what Triton specialises on (so a key hit means Triton would pick the same binary):
per tensor its dtype and 16-byte alignment, per int ``== 1``, divisibility by 16 and the 32-bit range, per float
nothing but its type, plus every constexpr value, ``num_warps`` and the device. The fast launch is used only where
the installed Triton passes all bound arguments to ``CompiledKernel.run`` (checked once from the JIT's own source,
Triton >= 3.4); otherwise, and under ``TRITON_INTERPRET=1``, every launch goes through the JIT.

Programmatic dependent launch (Hopper and later, :data:`PDL`): a kernel that declares a trailing ``PDL`` constexpr and
is given a ``Launcher(fn, pdl=True)`` is launched with ``launch_pdl=True`` on such a GPU and ``PDL`` set, and waits
for the kernel before it (``gdc_wait``) before it touches memory: its launch and the scheduling of its programs then
overlap the end of the kernel before it instead of following it. Everywhere else ``PDL`` is False: the same kernel
without the wait, launched plainly.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from typing import Optional

import torch

from . import compat

try:  # pragma: no cover - exercised wherever triton is installed
    from triton.runtime.jit import JITFunction
except Exception:  # pragma: no cover
    JITFunction = None
try:  # pragma: no cover - Triton's grid dependency control (the device side of programmatic dependent launch)
    from triton.language.extra.cuda import gdc_wait
except Exception:  # pragma: no cover - no Triton, or one without it: no programmatic dependent launch
    gdc_wait = None

__all__ = ["Launcher", "FAST_LAUNCH", "PDL", "pdl_applies", "gdc_wait", "device_ctx", "cdiv", "current_stream",
           "capturing", "hooks_active", "recording", "Replay"]

#: launch the kernels that take it (``Launcher(fn, pdl=True)``) with programmatic dependent launch where the GPU has
#: it (compute capability >= 9.0). False: plain launches (the same results; to compare). A change applies to launches
#: made after it: launches recorded for replay keep theirs until they are recorded again
#: (:func:`fastdora.poetx.replay.clear`)
PDL = True

_NULL = contextlib.nullcontext()
# the launches of the innermost active :func:`recording` (None: nothing records)
_RECORDING: Optional[list] = None


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids and tilings (``triton.cdiv`` is a JIT-aware wrapper: ~5 us per call from Python)."""
    return -(-a // b)


_current_device = compat.current_device
_raw_stream = compat.raw_stream


def device_ctx(t: torch.Tensor):
    """Switch the current CUDA device only when ``t`` is on another one (the common case needs no switch)."""
    if t.is_cuda and t.get_device() != _current_device():
        return torch.cuda.device(t.device)
    return _NULL


def current_stream(t: torch.Tensor) -> tuple:
    """``(device index, raw stream)`` of CUDA tensor ``t``'s device's current stream (a cheap identity of it)."""
    idx = t.get_device()
    return idx, _raw_stream(idx)


capturing = compat.stream_capturing


@functools.lru_cache(maxsize=None)
def _has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_applies(t: torch.Tensor) -> bool:
    """A kernel with a ``PDL`` constexpr launched on ``t``'s device gets programmatic dependent launch: :data:`PDL`,
    a Triton with grid dependency control (:data:`gdc_wait`), a CUDA tensor, a GPU of compute capability >= 9.0."""
    return PDL and gdc_wait is not None and t.is_cuda and _has_pdl(t.get_device())


def _fast_launch_supported() -> bool:
    if JITFunction is None:
        return False
    try:
        from triton import knobs  # noqa: F401  (Triton >= 3.4)
        from triton.compiler.compiler import CompiledKernel

        src = inspect.getsource(JITFunction.run)
    except Exception:  # pragma: no cover - no source / older Triton: use the JIT path
        return False
    return (
        "*bound_args.values()" in src
        and "kernel.run(" in src
        and hasattr(CompiledKernel, "launch_metadata")
    )


FAST_LAUNCH = _fast_launch_supported()
if FAST_LAUNCH:  # pragma: no cover - needs Triton >= 3.4
    from triton import knobs as _knobs
else:
    _knobs = None

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_data_ptr = torch.Tensor.data_ptr
_dtype_of = operator.attrgetter("dtype")
_reduce, _or = functools.reduce, operator.or_


def _hook_set(hook) -> bool:
    """A launch hook that does something: not None and, for Triton's hook chains (3.5+), not empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


def hooks_active() -> bool:
    """Triton launch hooks are set (a profiler): launches must go through a path that calls them."""
    if _knobs is None:
        return False
    rt = _knobs.runtime
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


def _desc_key(d) -> tuple:
    """What a TMA tensor descriptor contributes to a launch's specialisation (superset): the element type, block
    shape, and per shape and stride entry its divisibility by 16."""
    return (d.base.dtype, tuple(d.block_shape), tuple([v % 16 == 0 for v in d.shape]),
            tuple([v % 16 == 0 for v in d.strides]))


class Launcher:
    """``Launcher(jit_fn)(grid, tensors, ints, floats, consts, num_warps[, num_stages][, descs=...][, maxnreg=...])``
    for a kernel whose parameters are, in order, TMA tensor descriptors (``descs``: Triton's host-side
    ``TensorDescriptor``s, passed as they are), pointer arguments, int arguments, float arguments, constexprs
    (``consts``, in declaration order); ``maxnreg``: Triton's register cap per thread (None: the compiler's choice).
    ``pdl``: the kernel's last constexpr is ``PDL`` (not in ``consts``): the launcher passes :func:`pdl_applies` of
    the first tensor and launches with programmatic dependent launch where it is True."""

    __slots__ = ("fn", "cache", "fast", "interpreted", "pdl")

    def __init__(self, fn, pdl: bool = False):
        self.fn = fn
        self.pdl = pdl
        self.cache: dict = {}
        self.fast = FAST_LAUNCH and isinstance(fn, JITFunction)
        # Triton's interpreter (TRITON_INTERPRET=1): the kernel is no JITFunction (CPU tensors, tests)
        self.interpreted = JITFunction is not None and not isinstance(fn, JITFunction)

    def __call__(self, grid, tensors: tuple, ints: tuple, floats: tuple, consts: tuple, num_warps: int,
                 num_stages: Optional[int] = None, descs: tuple = (), maxnreg: Optional[int] = None):
        """Launch; returns the ``(CompiledKernel, function, packed metadata)`` entry it launched through on the fast
        path (None through the JIT: interpreter, old Triton, a compile that returned no kernel)."""
        if len(grid) < 3:
            grid = tuple(grid) + (1,) * (3 - len(grid))
        if self.pdl:
            consts = (*consts, pdl_applies(tensors[0]))
        if not self.fast:
            self._jit(grid, tensors, ints, floats, consts, num_warps, num_stages, descs, maxnreg)
            if _RECORDING is not None:
                _RECORDING.append(None)  # no compiled entry to replay
            return None
        ptrs = list(map(_data_ptr, tensors))
        key = (
            tuple(map(_dtype_of, tensors)),
            # per pointer: 16-byte aligned; per int: == 1, multiple of 16, in int32 range. The common cases (all
            # pointers aligned; all ints multiples of 16 in (1, 2**31)) in one flag each, the rest spelled out
            True if not (_reduce(_or, ptrs) & 15) else tuple([(p & 15) == 0 for p in ptrs]),
            True if (ints and not (_reduce(_or, ints) & 15) and min(ints) > 1 and max(ints) <= _I32_MAX)
            else tuple([(i == 1, (i & 15) == 0, _I32_MIN <= i <= _I32_MAX) for i in ints]),
            consts,
            num_warps,
            num_stages,
            maxnreg,
            tensors[0].get_device(),
            tuple(map(_desc_key, descs)) if descs else None,
        )
        entry = self.cache.get(key)
        if entry is None:
            compiled = self._jit(grid, tensors, ints, floats, consts, num_warps, num_stages, descs, maxnreg)
            if compiled is None:
                if _RECORDING is not None:
                    _RECORDING.append(None)
                return None
            entry = self.cache[key] = (compiled, compiled.function, compiled.packed_metadata)  # later calls: direct
            if _RECORDING is not None:
                _RECORDING.append(None if descs else (entry, grid, ptrs, ints, floats, consts))
            return entry
        if _RECORDING is not None:
            _RECORDING.append(None if descs else (entry, grid, ptrs, ints, floats, consts))
        compiled, function, packed = entry
        # exactly what ``CompiledKernel.__getitem__(grid)(*args)`` does, minus the closure and driver look-ups; the
        # pointers go as integers (Triton's launcher then skips a ``data_ptr()`` call and a driver pointer query
        # per tensor: every tensor here is a CUDA tensor the caller holds for the launch)
        stream = _raw_stream(key[-2])
        rt = _knobs.runtime
        enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
        if not (_hook_set(enter) or _hook_set(exit_)):
            # no launch hooks: no launch metadata and no hook calls (Triton >= 3.5 keeps empty hook chains here,
            # which its own launch would call and build a metadata dict for on every launch)
            compiled.run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None,
                         *descs, *ptrs, *ints, *floats, *consts)
            return entry
        args = (*descs, *tensors, *ints, *floats, *consts)  # a launch hook (profiler) sees the tensors, as from the JIT
        compiled.run(grid[0], grid[1], grid[2], stream, function, packed, compiled.launch_metadata(grid, stream, *args),
                     enter, exit_, *args)
        return entry

    def _jit(self, grid, tensors, ints, floats, consts, num_warps, num_stages, descs=(), maxnreg=None):
        opts = {"num_warps": num_warps}
        if num_stages is not None:
            opts["num_stages"] = num_stages
        if maxnreg is not None:
            opts["maxnreg"] = maxnreg
        if self.pdl and consts[-1]:
            opts["launch_pdl"] = True
        return self.fn[grid](*descs, *tensors, *ints, *floats, *consts, **opts)


@contextlib.contextmanager
def recording():
    """Record the :class:`Launcher` launches made inside the block (a list, for :meth:`Replay.build`): each launch's
    compiled entry, grid, pointers and scalars, or None for one that cannot be replayed (through Triton's JIT only:
    the interpreter, a Triton without the fast launch, a kernel with tensor descriptors)."""
    global _RECORDING
    outer, _RECORDING = _RECORDING, []
    try:
        yield _RECORDING
    finally:
        _RECORDING = outer


class Replay:
    """A recorded sequence of launches (:func:`recording`) replayed on other tensors of the same shapes.

    :meth:`build` maps every pointer a recorded launch took to one of a list of *named* tensors (the sequence's
    inputs, outputs and temporaries, each allocated by the caller) and its byte offset there; a replay launches the
    same compiled kernels with the same grids and scalars, and pointers at the same offsets of the tensors named in
    the same order: the same kernels and arguments, so the same results bit for bit. The caller keys a replay by
    everything its launchers' choices depend on (shapes, dtypes, flags, tile settings, device) and runs it only where
    :meth:`applies`.

    Where the C++ extension's launch programs run (:func:`fastdora._native.programs`: a verified Triton, the CUDA
    driver), ``build(..., direct=True)`` also makes the sequence a launch program: one call into C++ per replay that
    launches every kernel with ``cuLaunchKernel`` and the parameter bytes Triton's launcher would pass. It is kept
    only if, on the recording's own tensors, it reproduces the recorded launches' results bit for bit (checked once
    per build; a mismatch turns programs off for the process with a warning). Otherwise each launch goes through its
    ``CompiledKernel``'s launcher, still without the launchers' Python.
    """

    __slots__ = ("steps", "program")

    def __init__(self, steps: tuple, program=None):
        self.steps = steps
        self.program = program  # (run_program, capsule) or None

    @classmethod
    def build(cls, recorded: list, named: tuple, direct: bool = False) -> Optional["Replay"]:
        """The replay of ``recorded`` over ``named`` (the tensors it was recorded on, holding its results), or None
        if it cannot be replayed: a launch without a compiled entry, a pointer inside none of the named tensors, an
        unaligned pointer (the kernels were specialised for 16-byte alignment), or no launch at all. ``direct``: also
        a launch program where they run (see the class docstring)."""
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in named]
        steps = []
        for rec in recorded:
            if rec is None:
                return None
            (compiled, function, packed), grid, ptrs, ints, floats, consts = rec
            slots = []
            for p in ptrs:
                if p & 15:
                    return None
                index = next((i for i, (lo, hi) in enumerate(spans) if lo <= p < hi), None)
                if index is None:
                    return None
                slots.append((index, p - spans[index][0]))
            steps.append((compiled.run, function, packed, grid[0], grid[1], grid[2], tuple(slots),
                          (*ints, *floats, *consts)))
        if not steps:
            return None
        replay = cls(tuple(steps))
        if direct and not hooks_active() and not (named[0].is_cuda and capturing()):
            replay.program = _program(recorded, replay, named)
        return replay

    @staticmethod
    def applies(named: tuple) -> bool:
        """A replay may run on these tensors: every base pointer 16-byte aligned and no launch hook set."""
        return not (_reduce(_or, map(_data_ptr, named)) & 15) and not hooks_active()

    def __call__(self, named: tuple, stream: int) -> None:
        program = self.program
        if program is not None and program[0](program[1], named, stream):
            return
        base = list(map(_data_ptr, named))
        for run, function, packed, g0, g1, g2, slots, tail in self.steps:
            run(g0, g1, g2, stream, function, packed, None, None, None, *[base[i] + off for i, off in slots], *tail)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included: temporaries may hold bytes no kernel wrote)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _program(recorded: list, replay: Replay, named: tuple) -> Optional[tuple]:
    """``(run_program, capsule)``: ``replay``'s launches as a launch program of the C++ extension, verified on
    ``named`` (holding the recorded launches' results) -- or None where programs do not run here or a launch's
    parameter layout cannot be derived."""
    from . import _native

    mod = _native.programs()
    if mod is None:
        return None
    steps = []
    for rec, step in zip(recorded, replay.steps):
        (compiled, _, _), grid, ptrs, ints, floats, consts = rec
        slots = step[6]
        values = (0,) * len(ptrs) + tuple(ints) + tuple(floats) + tuple(consts)
        roles = tuple(range(len(ptrs))) + (_native.COPY,) * (len(ints) + len(floats) + len(consts))
        layout = _native.native_layout(compiled, step[3:6], values, roles, pdl_ok=True)
        if layout is None:
            return None
        function, grid3, block, shared, p_roles, p_types, p_consts = layout
        slot_of = tuple(slots[r][0] if t == ord("p") and r != _native.COPY else -1 for r, t in zip(p_roles, p_types))
        value_of = tuple(slots[r][1] if t == ord("p") and r != _native.COPY else c
                         for r, t, c in zip(p_roles, p_types, p_consts))
        pdl = bool(getattr(compiled.metadata, "launch_pdl", False))
        steps.append((function, grid3, block, shared, slot_of, value_of, pdl))
    program = (mod.run_program, _native.program(len(named), tuple(steps)))
    # the check: the recorded launches' results (in named now) again, from the program, bit for bit
    before = [t.clone() for t in named]
    if not program[0](program[1], named, _raw_stream(named[0].get_device()) if named[0].is_cuda else 0):
        return None
    if not all(map(_same_bits, before, named)):
        import warnings

        for t, b in zip(named, before):  # the caller's results are the launchers'
            t.copy_(b)
        why = "a launch program's results differed from Triton's launcher's on the same tensors"
        _native.disable_programs(why)
        warnings.warn(f"fastdora: {why}; Triton's launchers run instead (same results, more host time per launch)",
                      RuntimeWarning, stacklevel=3)
        return None
    return program
