r"""A POET-X layer's kernel launches recorded once per problem and replayed: less host time per layer call.

On the GPU a POET-X layer's forward and backward are ~18 kernel launches and two GEMMs, and at a few thousand tokens
the layer is bound by its host time: each launch through its launcher (:mod:`fastdora.poetx.kernels`: tile choices,
argument checks, :class:`fastdora._launch.Launcher`'s specialisation key) costs 16-20 us of Python on the H200's host,
the GPU work of most of them a few microseconds. For one problem -- the shapes, dtypes, the mode, the flags and the
kernels' tile settings -- the launches are the same every call. So the layer's forward and backward here run in
*segments*, the launches between two GEMMs, each over tensors allocated in this module (inputs, outputs and
temporaries, *named* in a fixed order): the first call of a problem runs the launchers and records their launches
(:func:`fastdora._launch.recording`), later calls allocate the same tensors and replay the recorded launches on them
(:class:`fastdora._launch.Replay`): the same kernels, grids and scalars, straight through Triton's compiled launchers.
The results are those of :mod:`fastdora.poetx.ops`' path bit for bit (the same kernels with the same arguments; the
GPU tests compare them).

A segment whose launches cannot be replayed (a launch through Triton's JIT, a temporary the launchers allocated
themselves, an unaligned input) is recorded as such and runs its launchers every call. A replay runs only where
:meth:`fastdora._launch.Replay.applies` (every tensor 16-byte aligned, no Triton launch hook such as a profiler's).
Where the C++ extension runs launch programs (:func:`fastdora._native.programs`: a verified Triton version, the CUDA
driver; :data:`PROGRAMS`), a replayed segment is one call into C++ that launches all its kernels with
``cuLaunchKernel`` (the parameter bytes Triton's launcher would pass; checked bitwise against the launchers' results
when the segment is recorded); elsewhere each launch goes through its kernel's compiled Triton launcher.
With half-precision activations, float32 ``Q`` and the default series (``k = 3``) the series writes the blocks as the
two half-precision parts the block products multiply by (:func:`fastdora.poetx.kernels.cayley_forward`'s ``split``),
``[2, n, b, b]``, instead of float32 blocks that every block product would split again: the same products, and what
"fast" mode keeps for the backward (the same bytes as the float32 blocks).

Used by :func:`fastdora.poetx.ops.poetx_layer` for a dense weight, both ``Q`` receiving gradients (or none), the
blocks computed inside the layer (no batched series), on the current CUDA device; :data:`ENABLED` = False turns it off.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .._launch import Replay as _Replay
from .._launch import current_stream as _current_stream
from .._launch import recording as _recording
from . import kernels as _kernels

__all__ = ["ENABLED", "SPLIT_BLOCKS", "PROGRAMS", "applies", "forward", "backward", "clear"]

#: False: every call runs the kernels' launchers (the same launches, more host time)
ENABLED = True
#: False: the series writes float32 blocks that each block product splits again (the same results; to compare)
SPLIT_BLOCKS = True
#: False: replayed launches go one by one through each kernel's compiled Triton launcher instead of one C++ launch
#: program per segment (:class:`fastdora._launch.Replay`; the same launches and results, more host time; takes
#: effect for segments recorded after the change, see :func:`clear`)
PROGRAMS = True

_MISSING = object()
#: (segment, problem) -> Replay, or None where the segment's launches cannot be replayed
_REPLAYS: dict = {}
_empty = torch.empty


def clear() -> None:
    """Forget every recorded segment (the next call of each problem records again)."""
    _REPLAYS.clear()


def applies(x2: torch.Tensor, *tensors: Optional[torch.Tensor]) -> bool:
    """This module takes the layer call: on, the kernels take the tensors (with the block products on contiguous
    blocks and the block-gradient kernel), ``x2`` is a contiguous 2-D tensor with rows, on the current device if a
    CUDA tensor. (Under Triton's interpreter, CPU tensors in tests, nothing can be replayed: every segment runs its
    launchers.)"""
    return (ENABLED and not _kernels.PERMUTE_FUSED and _kernels.BLOCK_OUTER and _kernels.applies(x2, *tensors)
            and x2.is_contiguous() and x2.shape[0] > 0
            and (not x2.is_cuda or x2.get_device() == torch.cuda.current_device()))


def _stream(t: torch.Tensor) -> int:
    return _current_stream(t)[1] if t.is_cuda else 0


def _settings() -> tuple:
    """What the launchers' choices depend on besides the tensors: the kernels' tile and precision settings."""
    k = _kernels
    return (tuple(k.ROTATE_CONFIG.items()), tuple(k.OUTER_CONFIG.items()), tuple(k.GATHER_CONFIG.items()),
            tuple(k.CAYLEY_CONFIG.items()), k.CAYLEY_PRECISION, k.SPLIT_PARTS, SPLIT_BLOCKS)


def _segment(key: tuple, named: tuple, run: Callable[[], None], stream: int) -> None:
    """Run one segment: replay its launches on ``named`` if recorded and replayable, else run ``run`` (the launchers,
    writing into ``named``'s outputs), recording it on the problem's first call."""
    replay = _REPLAYS.get(key, _MISSING)
    if replay is _MISSING:
        with _recording() as recorded:
            run()
        if len(_REPLAYS) > 4096:
            _REPLAYS.clear()
        _REPLAYS[key] = _Replay.build(recorded, named, direct=PROGRAMS)
    elif replay is not None and replay.applies(named):
        replay(named, stream)
    else:
        run()


def _problem(x2, weight, bias_p, q_in, q_out, block_size, terms) -> tuple:
    return (tuple(x2.shape), tuple(weight.shape), x2.dtype, weight.dtype, q_in.dtype, tuple(q_in.shape),
            q_in.stride(), tuple(q_out.shape), q_out.stride(), bias_p is not None, block_size, terms, x2.get_device(),
            _settings())


def _split(x2: torch.Tensor, q_in: torch.Tensor, terms: int) -> bool:
    """The series writes the blocks as their two half-precision parts (see the module docstring)."""
    return (SPLIT_BLOCKS and terms == 3 and q_in.dtype == torch.float32
            and x2.dtype in (torch.bfloat16, torch.float16) and _kernels.SPLIT_PARTS == 2)


def _rotate(t, g, k0, k1, **kwargs):
    """:func:`fastdora.poetx.kernels.rotate` by the blocks ``k0:k1`` of ``g``: float32 blocks ``[n, b, b]`` or their
    two half-precision parts ``[2, n, b, b]``."""
    if g.dim() == 4:
        return _kernels.rotate(t, None, g[0, k0:k1], lo=g[1, k0:k1], **kwargs)
    return _kernels.rotate(t, None, g[k0:k1], **kwargs)


def _front(problem, x2, q_in, q_out, perm_in, block_size, terms, stream):
    """``(xp, z, g)``: the blocks of both sides ``g`` from one series (float32 ``[n, b, b]``, or their two parts in
    ``x2``'s half dtype, ``[2, n, b, b]``), the gathered input ``xp`` and ``z = xp`` times the input-side blocks."""
    b, n_in = block_size, x2.shape[1] // block_size
    n = n_in + q_out.shape[0]
    device = x2.device
    split = _split(x2, q_in, terms)
    if split:
        g = _empty((2, n, b, b), dtype=x2.dtype, device=device)
    else:
        g = _empty((n, b, b), dtype=q_in.dtype, device=device)
    work = _empty((_kernels.WORK_FORWARD, n, b, b), dtype=torch.float32, device=device)
    xp = _empty(x2.shape, dtype=x2.dtype, device=device)
    z = _empty(x2.shape, dtype=x2.dtype, device=device)

    def run():
        if split:
            _kernels.cayley_forward(q_in, b, terms, q_out, work=work, split=(g[0], g[1]))
        else:
            _kernels.cayley_forward(q_in, b, terms, q_out, out=g, work=work)
        _kernels.gather(x2, perm_in, out=xp)
        _rotate(xp, g, 0, n_in, out=z)

    _segment(("front", problem), (x2, q_in, q_out, perm_in, g, work, xp, z), run, stream)
    return xp, z, g


def forward(x2, weight, bias_p, q_in, q_out, perm_in, inv_out, block_size, terms):
    """``(xp, up, y, g)`` of :func:`fastdora.poetx.ops._forward` with the blocks ``g`` of both sides from one series
    (:func:`fastdora.poetx.kernels.cayley_forward`; float32, or their two half-precision parts, see :func:`_front`);
    ``inv_out``: the inverse output permutation (the scatter)."""
    problem = _problem(x2, weight, bias_p, q_in, q_out, block_size, terms)
    stream = _stream(x2)
    xp, z, g = _front(problem, x2, q_in, q_out, perm_in, block_size, terms, stream)
    up = F.linear(z, weight)
    n_in = x2.shape[1] // block_size
    v = _empty(up.shape, dtype=up.dtype, device=up.device)
    y = _empty(up.shape, dtype=up.dtype, device=up.device)

    def run():
        _rotate(up, g, n_in, None, bias=bias_p, out=v)
        _kernels.gather(v, inv_out, out=y)

    named = (up, g, v, inv_out, y) if bias_p is None else (up, g, v, inv_out, y, bias_p)
    _segment(("back", problem), named, run, stream)
    return xp, up, y, g


def backward(gy, x2, xp, up, g, weight, q_in, q_out, perm_in, perm_out, inv_in, block_size, terms, need_x):
    """``(∂L/∂x, ∂L/∂q_in, ∂L/∂q_out)`` (2-D ``∂L/∂x``, None unless ``need_x``) of the layer from ``gy`` (2-D,
    contiguous), as :func:`fastdora.poetx.ops._backward` followed by the series backward computes them. ``xp``, ``up``
    and ``g`` are None where the forward did not keep them ("mem": recomputed here from ``x2``)."""
    problem = _problem(x2 if x2 is not None else xp, weight, None, q_in, q_out, block_size, terms) + (need_x,)
    stream = _stream(gy)
    if g is None:  # "mem": the series, the gathered input and the GEMM output again
        xp, z, g = _front(problem[:-1], x2, q_in, q_out, perm_in, block_size, terms, stream)
        up = F.linear(z, weight)
    b, n_in, n = block_size, xp.shape[1] // block_size, g.shape[-3]
    device, n_rows = gy.device, gy.shape[0]
    gyp = _empty(gy.shape, dtype=gy.dtype, device=device)
    grad_g = _empty((n, b, b), dtype=q_in.dtype, device=device)
    t = _empty(gy.shape, dtype=gy.dtype, device=device)
    # the token split's fp32 partial sums of the output side's block gradient (only where it splits the tokens: a
    # function of the problem), as many as block_outer splits that side's blocks into
    splits = _kernels.outer_splits(n_rows, grad_g[n_in:])
    partial_out = _empty((splits, n - n_in, b, b), dtype=torch.float32, device=device) if splits > 1 else None

    def run_out():
        _kernels.gather(gy, perm_out, out=gyp)
        _kernels.block_outer(gyp, up, None, grad_g[n_in:], out=grad_g[n_in:], partial=partial_out)
        _rotate(gyp, g, n_in, None, transpose=True, out=t)

    named = (gy, perm_out, gyp, up, g, grad_g, t)
    if partial_out is not None:
        named += (partial_out,)
    _segment(("grad_out", problem), named, run_out, stream)
    gzp = t @ weight
    grad_x = s = None
    if need_x:
        s = _empty(xp.shape, dtype=xp.dtype, device=device)
        grad_x = _empty(xp.shape, dtype=xp.dtype, device=device)
    work = _empty((_kernels.WORK_BACKWARD, n, b, b), dtype=torch.float32, device=device)
    grad_q_in, grad_q_out = torch.empty_like(q_in), torch.empty_like(q_out)
    rows, cols = _kernels.triu_indices(b, device)
    splits_in = _kernels.outer_splits(n_rows, grad_g[:n_in])
    partial_in = _empty((splits_in, n_in, b, b), dtype=torch.float32, device=device) if splits_in > 1 else None

    def run_in():
        _kernels.block_outer(gzp, xp, None, grad_g[:n_in], out=grad_g[:n_in], partial=partial_in)
        if need_x:
            _rotate(gzp, g, 0, n_in, transpose=True, out=s)
            _kernels.gather(s, inv_in, out=grad_x)
        _kernels.cayley_backward(q_in, grad_g, b, terms, q_out, out=(grad_q_in, grad_q_out), work=work)

    named = (gzp, xp, g, grad_g, q_in, q_out, work, grad_q_in, grad_q_out, rows, cols)
    if partial_in is not None:
        named += (partial_in,)
    if need_x:
        named += (s, inv_in, grad_x)
    _segment(("grad_in", problem), named, run_in, stream)
    return grad_x, grad_q_in, grad_q_out
