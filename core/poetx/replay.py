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
when the segment is recorded); elsewhere each launch goes through its kernel's compiled Triton launcher. Where every
segment of a layer's forward (without a bias) or backward is a launch program, later calls run that forward or
backward as one *layer plan* of the extension: the call's allocations, launch programs and GEMMs (``at::linear``,
``at::matmul``, autocast off) in the Python path's order, built from the tensors of the call that recorded them, in
one call into C++; the Python below then runs on a problem's first call only, or where a plan cannot run (an
unaligned input, a Triton launch hook). A training call of such a problem (no bias, both ``Q`` trained) is then one
autograd node of the extension (:func:`node`): its forward runs the forward plan, its backward the problem's backward
plan (registered by id when :func:`backward` builds it), or the Python node's backward where there is none yet.
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

from .. import _native
from .._launch import Replay as _Replay
from .._launch import current_stream as _current_stream
from .._launch import hooks_active as _hooks_active
from .._launch import recording as _recording
from . import kernels as _kernels

__all__ = ["ENABLED", "SPLIT_BLOCKS", "PROGRAMS", "applies", "forward", "backward", "node", "clear"]

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
#: ("fwd", problem) / ("bwd", problem, recompute) -> (run_plan, plan): a layer plan of the C++ extension, or None
_PLANS: dict = {}
#: ("bwd", problem, recompute) -> the id under which the C++ layer node finds that backward's plans (never reused)
_NODE_IDS: dict = {}
_CONFIGURED: list = []
_empty = torch.empty
# a layer plan's step codes (compose_node.cpp)
_ALLOC, _PROGRAM, _LINEAR, _MATMUL = 0, 1, 2, 3


def clear() -> None:
    """Forget every recorded segment and layer plan (the next call of each problem records again)."""
    _REPLAYS.clear()
    _PLANS.clear()
    if _NODE_IDS:
        ext = _native.programs()
        if ext is not None:
            ext.poetx_clear()


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
            tuple(k.CAYLEY_CONFIG.items()), k.CAYLEY_PRECISION, k.SPLIT_OPERANDS, k.SPLIT_PARTS, SPLIT_BLOCKS)


def _segment(key: tuple, named: tuple, run: Callable[[], None], stream: int) -> None:
    """Run one segment: replay its launches on ``named`` if recorded and replayable, else run ``run`` (the launchers,
    writing into ``named``'s outputs), recording it on the problem's first call."""
    replay = _REPLAYS.get(key, _MISSING)
    if replay is _MISSING:
        with _recording() as recorded:
            run()
        if len(_REPLAYS) > 4096:
            clear()
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


# the tensors each segment's launches take, by name, in the order its replay names them
_FRONT = ("x2", "q_in", "q_out", "perm_in", "g", "work", "xp", "z")
_BACK = ("up", "g", "v", "inv_out", "y")
_GRAD_OUT = ("gy", "perm_out", "gyp", "up", "g", "grad_g", "t")
_GRAD_IN = ("gzp", "xp", "g", "grad_g", "q_in", "q_out", "work_b", "grad_q_in", "grad_q_out", "rows", "cols")
# a layer plan's inputs (fastdora._native's run_plan), in order
_FWD_INPUTS = ("x2", "weight", "q_in", "q_out", "perm_in", "inv_out")
_BWD_INPUTS = ("gy", "x2", "xp", "up", "g", "weight", "q_in", "q_out", "perm_in", "perm_out", "inv_in", "rows", "cols")


def _named(env: dict, names: tuple) -> tuple:
    return tuple([env[n] for n in names])


def _front(problem, env, block_size, terms, stream):
    """Into ``env``: the blocks of both sides ``g`` from one series (float32 ``[n, b, b]``, or their two parts in
    ``x2``'s half dtype, ``[2, n, b, b]``), the gathered input ``xp`` and ``z = xp`` times the input-side blocks
    (and the series' workspace ``work``)."""
    x2, q_in, q_out = env["x2"], env["q_in"], env["q_out"]
    b, n_in = block_size, x2.shape[1] // block_size
    n = n_in + q_out.shape[0]
    device = x2.device
    split = _split(x2, q_in, terms)
    if split:
        g = env["g"] = _empty((2, n, b, b), dtype=x2.dtype, device=device)
    else:
        g = env["g"] = _empty((n, b, b), dtype=q_in.dtype, device=device)
    work = env["work"] = _empty((_kernels.WORK_FORWARD, n, b, b), dtype=torch.float32, device=device)
    xp = env["xp"] = _empty(x2.shape, dtype=x2.dtype, device=device)
    z = env["z"] = _empty(x2.shape, dtype=x2.dtype, device=device)

    def run():
        if split:
            _kernels.cayley_forward(q_in, b, terms, q_out, work=work, split=(g[0], g[1]))
        else:
            _kernels.cayley_forward(q_in, b, terms, q_out, out=g, work=work)
        _kernels.gather(x2, env["perm_in"], out=xp)
        _rotate(xp, g, 0, n_in, out=z)

    _segment(("front", problem), _named(env, _FRONT), run, stream)


def forward(x2, weight, bias_p, q_in, q_out, perm_in, inv_out, block_size, terms):
    """``(xp, up, y, g)`` of :func:`fastdora.poetx.ops._forward` with the blocks ``g`` of both sides from one series
    (:func:`fastdora.poetx.kernels.cayley_forward`; float32, or their two half-precision parts, see :func:`_front`);
    ``inv_out``: the inverse output permutation (the scatter)."""
    problem = _problem(x2, weight, bias_p, q_in, q_out, block_size, terms)
    stream = _stream(x2)
    key = ("fwd", problem)
    plan = _PLANS.get(key)
    if plan is not None:
        out = _run_plan(plan, (x2, weight, q_in, q_out, perm_in, inv_out), stream)
        if out is not None:
            return out
    env = {"x2": x2, "weight": weight, "q_in": q_in, "q_out": q_out, "perm_in": perm_in, "inv_out": inv_out}
    _front(problem, env, block_size, terms, stream)
    up = env["up"] = F.linear(env["z"], weight)
    v = env["v"] = _empty(up.shape, dtype=up.dtype, device=up.device)
    y = env["y"] = _empty(up.shape, dtype=up.dtype, device=up.device)
    g = env["g"]

    def run():
        _rotate(up, g, x2.shape[1] // block_size, None, bias=bias_p, out=v)
        _kernels.gather(v, inv_out, out=y)

    if bias_p is None:
        _segment(("back", problem), _named(env, _BACK), run, stream)
        if key not in _PLANS:
            _PLANS[key] = _forward_plan(problem, env)
    else:
        _segment(("back", problem), _named(env, _BACK) + (bias_p,), run, stream)
    return env["xp"], up, y, g


def backward(gy, x2, xp, up, g, weight, q_in, q_out, perm_in, perm_out, inv_in, block_size, terms, need_x):
    """``(∂L/∂x, ∂L/∂q_in, ∂L/∂q_out)`` (2-D ``∂L/∂x``, None unless ``need_x``) of the layer from ``gy`` (2-D,
    contiguous), as :func:`fastdora.poetx.ops._backward` followed by the series backward computes them. ``xp``, ``up``
    and ``g`` are None where the forward did not keep them ("mem": recomputed here from ``x2``)."""
    problem = _problem(x2 if x2 is not None else xp, weight, None, q_in, q_out, block_size, terms) + (need_x,)
    stream = _stream(gy)
    rows, cols = _kernels.triu_indices(block_size, gy.device)
    key = ("bwd", problem, g is None)
    plan = _PLANS.get(key)
    if plan is not None:
        out = _run_plan(plan, (gy, x2, xp, up, g, weight, q_in, q_out, perm_in, perm_out, inv_in, rows, cols), stream)
        if out is not None:
            return out
    env = {"gy": gy, "x2": x2, "xp": xp, "up": up, "g": g, "weight": weight, "q_in": q_in, "q_out": q_out,
           "perm_in": perm_in, "perm_out": perm_out, "inv_in": inv_in, "rows": rows, "cols": cols}
    mem = g is None
    if mem:  # "mem": the series, the gathered input and the GEMM output again
        _front(problem[:-1], env, block_size, terms, stream)
        xp, g = env["xp"], env["g"]
        up = env["up"] = F.linear(env["z"], weight)
    b, n_in, n = block_size, xp.shape[1] // block_size, g.shape[-3]
    device, n_rows = gy.device, gy.shape[0]
    gyp = env["gyp"] = _empty(gy.shape, dtype=gy.dtype, device=device)
    grad_g = env["grad_g"] = _empty((n, b, b), dtype=q_in.dtype, device=device)
    t = env["t"] = _empty(gy.shape, dtype=gy.dtype, device=device)
    # the token split's fp32 partial sums of the output side's block gradient (only where it splits the tokens: a
    # function of the problem), as many as block_outer splits that side's blocks into
    splits = _kernels.outer_splits(n_rows, grad_g[n_in:])
    partial_out = None
    grad_out_names = _GRAD_OUT
    if splits > 1:
        partial_out = env["partial_out"] = _empty((splits, n - n_in, b, b), dtype=torch.float32, device=device)
        grad_out_names += ("partial_out",)

    def run_out():
        _kernels.gather(gy, perm_out, out=gyp)
        _kernels.block_outer(gyp, up, None, grad_g[n_in:], out=grad_g[n_in:], partial=partial_out)
        _rotate(gyp, g, n_in, None, transpose=True, out=t)

    _segment(("grad_out", problem), _named(env, grad_out_names), run_out, stream)
    gzp = env["gzp"] = t @ weight
    grad_x = s = None
    grad_in_names = _GRAD_IN
    work = env["work_b"] = _empty((_kernels.WORK_BACKWARD, n, b, b), dtype=torch.float32, device=device)
    grad_q_in = env["grad_q_in"] = torch.empty_like(q_in)
    grad_q_out = env["grad_q_out"] = torch.empty_like(q_out)
    splits_in = _kernels.outer_splits(n_rows, grad_g[:n_in])
    partial_in = None
    if splits_in > 1:
        partial_in = env["partial_in"] = _empty((splits_in, n_in, b, b), dtype=torch.float32, device=device)
        grad_in_names += ("partial_in",)
    if need_x:
        s = env["s"] = _empty(xp.shape, dtype=xp.dtype, device=device)
        grad_x = env["grad_x"] = _empty(xp.shape, dtype=xp.dtype, device=device)
        grad_in_names += ("s", "inv_in", "grad_x")

    def run_in():
        _kernels.block_outer(gzp, xp, None, grad_g[:n_in], out=grad_g[:n_in], partial=partial_in)
        if need_x:
            _rotate(gzp, g, 0, n_in, transpose=True, out=s)
            _kernels.gather(s, inv_in, out=grad_x)
        _kernels.cayley_backward(q_in, grad_g, b, terms, q_out, out=(grad_q_in, grad_q_out), work=work)

    _segment(("grad_in", problem), _named(env, grad_in_names), run_in, stream)
    if key not in _PLANS:
        plan = _PLANS[key] = _backward_plan(problem, env, mem, grad_out_names, grad_in_names)
        if plan is not None:  # the C++ layer node's backward finds it by id
            _native.programs().poetx_set_plan(_node_id(problem[:-1], mem), need_x, plan[1])
    return grad_x, grad_q_in, grad_q_out


def _node_id(problem: tuple, mem: bool) -> int:
    return _NODE_IDS.setdefault(("bwd", problem, mem), len(_NODE_IDS))


def node(x, weight, q_in, q_out, perm_in, perm_out, inverse, block_size, terms, save, backward):
    """``y`` of the layer (no bias, dense weight, both ``Q`` requiring gradients, grad mode on) from the C++ layer
    node where this problem's forward has a layer plan (its second call on), else None (the Python node runs). The
    node's backward runs the backward plan of the problem where one exists, else ``backward`` (the Python node's
    backward, which records the backward and registers its plan); ``inverse``: the cached inverse permutation."""
    x2 = x.reshape(-1, x.shape[-1])
    # no launch programs (a Triton version they are not verified on, PROGRAMS off): no plans, so no problem key to
    # compute here on every call before the Python node computes it again
    if not (PROGRAMS and applies(x2, weight, q_in, q_out)) or _native.programs() is None:
        return None
    problem = _problem(x2, weight, None, q_in, q_out, block_size, terms)
    plan = _PLANS.get(("fwd", problem))
    if plan is None:
        return None
    inv_out = inverse(perm_out)
    if not _Replay.applies((x2, weight, q_in, q_out, perm_in, inv_out)):
        return None
    ext = _native.programs()
    if not _CONFIGURED:
        ext.poetx_configure(backward, _hooks_active)
        _CONFIGURED.append(True)
    rows, cols = _kernels.triu_indices(block_size, x.device)
    return ext.poetx_layer(x, q_in, q_out, weight, perm_in, perm_out, inverse(perm_in), inv_out, rows, cols, plan[1],
                           _node_id(problem, not save), block_size, terms, save)


# --------------------------------------------------------------------------------------------------------------------
# layer plans: a whole forward or backward in one call into the C++ extension
# --------------------------------------------------------------------------------------------------------------------

def _run_plan(plan, inputs: tuple, stream: int):
    """The plan's outputs, or None where it cannot run on these tensors (an unaligned input, a Triton launch hook,
    no CUDA context on this thread): the caller then runs its segments."""
    if not _Replay.applies(tuple([t for t in inputs if t is not None])):
        return None
    return plan[0](plan[1], inputs, stream)


class _Plan:
    """Builds a layer plan (``fastdora._native``'s ``plan``): slots named as the segments name their tensors."""

    def __init__(self, inputs: tuple, env: dict):
        self.slot = {name: i for i, name in enumerate(inputs)}
        self.n_inputs = self.n_slots = len(inputs)
        self.env, self.steps = env, []

    def _new(self, name: str) -> int:
        """A new slot for ``name`` (an input of that name that the call leaves empty, "mem"'s g, xp and up, keeps
        its own slot)."""
        self.slot[name] = self.n_slots
        self.n_slots += 1
        return self.slot[name]

    def alloc(self, *names: str) -> None:
        for name in names:
            t = self.env[name]
            self.steps.append((_ALLOC, self._new(name), tuple(t.shape), t.dtype))

    def program(self, kind: str, problem: tuple, names: tuple) -> bool:
        replay = _REPLAYS.get((kind, problem))
        if replay is None or replay.program is None:
            return False
        self.steps.append((_PROGRAM, replay.program[1], tuple(self.slot[n] for n in names)))
        return True

    def gemm(self, code: int, out: str, a: str, w: str) -> None:
        a, w = self.slot[a], self.slot[w]
        self.steps.append((code, self._new(out), a, w))

    def build(self, outputs: tuple):
        ext = _native.programs()
        if ext is None:
            return None
        outs = tuple(self.slot[n] if n is not None else -1 for n in outputs)
        return ext.run_plan, ext.plan(self.n_inputs, self.n_slots, tuple(self.steps), outs)


def _forward_plan(problem: tuple, env: dict):
    """The plan of :func:`forward` (no bias) from a call whose segments were recorded (``env``: its tensors), or None
    where a segment is no launch program."""
    p = _Plan(_FWD_INPUTS, env)
    p.alloc("g", "work", "xp", "z")
    if not p.program("front", problem, _FRONT):
        return None
    p.gemm(_LINEAR, "up", "z", "weight")
    p.alloc("v", "y")
    if not p.program("back", problem, _BACK):
        return None
    return p.build(("xp", "up", "y", "g"))


def _backward_plan(problem: tuple, env: dict, mem: bool, grad_out_names: tuple, grad_in_names: tuple):
    """The plan of :func:`backward` from a call whose segments were recorded, or None (see :func:`_forward_plan`)."""
    p = _Plan(_BWD_INPUTS, env)
    if mem:
        p.alloc("g", "work", "xp", "z")
        if not p.program("front", problem[:-1], _FRONT):
            return None
        p.gemm(_LINEAR, "up", "z", "weight")
    p.alloc("gyp", "grad_g", "t", *(("partial_out",) if "partial_out" in grad_out_names else ()))
    if not p.program("grad_out", problem, grad_out_names):
        return None
    p.gemm(_MATMUL, "gzp", "t", "weight")
    p.alloc("work_b", "grad_q_in", "grad_q_out", *[n for n in ("partial_in", "s", "grad_x") if n in grad_in_names])
    if not p.program("grad_in", problem, grad_in_names):
        return None
    return p.build(("grad_x" if "grad_x" in grad_in_names else None, "grad_q_in", "grad_q_out"))
