r"""One Cayley–Neumann series for all the fast-mode layers of a model, per forward.

Each :class:`~fastdora.poetx.PoetXLinear` needs the blocks ``G(q_in)``, ``G(q_out)`` of its own ``Q``. Computed layer
by layer (:func:`fastdora.poetx.ops.poetx_layer`), that is a few small launches per layer in its forward and a few
more in its backward: on the H200, at Llama-8B shapes with 1024 tokens, the series' launches are about a quarter of a
layer's host time, and a model's step is bound by its host time. :func:`install` (called by
:func:`fastdora.poetx.convert`) hooks the model's forward instead:

- before it, the blocks of every eligible layer come from a few series over all their ``Q`` (:class:`_Series`: the
  packed parameters of consecutive layers concatenated, up to :data:`CHUNK_BYTES` of blocks per series, one set of
  launches and one autograd node with one output per layer each);
- each layer called inside that forward takes its blocks from there (the node :func:`~fastdora.poetx.ops.poetx_layer`
  builds then returns the blocks' gradient instead of running the series backward itself);
- once the backward has gone through a chunk's layers, one series backward gives their ``∂L/∂Q`` (only for the
  layers that received a gradient, where a backward covers some of them, e.g. a reentrant checkpoint's).

A layer reads the batched blocks only between the model's forward pre-hook and the end of that forward, and again
during that forward's backward (a checkpointed layer runs its forward again there, :mod:`fastdora._backward_window`),
and only while its ``q_in`` and ``q_out`` have the versions the blocks were computed from; otherwise (called on its
own, after an in-place change of ``Q``, ...) it computes its own series as before. Eligible: "fast"-mode layers (a
"mem"-mode layer recomputes its blocks in the backward instead of holding them for the step) whose ``q_in`` and
``q_out`` require grad, share a dtype and are plain tensors (not FSDP2's sharded DTensors), with grad mode on and
outside ``torch.compile``; layers are batched by device, dtype, block size and number of terms. The blocks, outputs
and gradients are those of the per-layer series: every block's series is computed independently of the others.

Off by default (``ENABLED = False``: every layer computes its own series): at full depth on Llama-8B shapes (batch 1,
sequence 1024) the batched series made the step slower, not faster, though it takes the series' launches off every
layer (H200: 353.1 against 344.1 ms; H100: 399.2 against 329.3 ms; ``benchmarks/results/
poetx_batched_series_h200_2026-12-05``). ``ENABLED = True`` turns it on.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from .._backward_window import around_backward
from ..stats import record
from . import cayley as _cayley

__all__ = ["ENABLED", "install", "uninstall", "blocks_for"]

#: batch the series of a model's fast-mode layers (see the module docstring; off: measured slower)
ENABLED = False
#: dense float32 blocks per series node (256 MiB: 1024 blocks of 256, about three Llama-8B decoder layers)
CHUNK_BYTES = 256 << 20

_BATCH_ATTR = "_poetx_series_batch"  # on a layer: (its Batch, its index there)
_HOOKS_ATTR = "_poetx_series_hooks"  # on the hooked model


class _Series(torch.autograd.Function):
    """``(G_1, …, G_L)`` from ``(q_in_1, q_out_1, …, q_in_L, q_out_L)``: each ``G_l`` the blocks of both sides of one
    layer (``[n_in + n_out, b, b]``, input side first, views of one tensor), all from one series over the concatenated
    parameters.

    The parameters are kept on the context, not saved: a reentrant checkpoint runs one backward per checkpointed
    segment through this node, each with the gradients of that segment's layers only, so the node must survive several
    backwards; their versions are checked instead (as a saved tensor's would be)."""

    @staticmethod
    def forward(ctx, block_size, terms, *qs):
        ctx.block_size, ctx.terms, ctx.qs = block_size, terms, qs
        ctx.versions = [q._version for q in qs]
        g = _cayley.series(torch.cat(qs), block_size, terms)
        sizes = [qs[i].shape[0] + qs[i + 1].shape[0] for i in range(0, len(qs), 2)]
        return tuple(g.split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        qs = ctx.qs
        layers = [i for i, grad in enumerate(grads) if grad is not None]
        out = [None] * len(qs)
        if not layers:
            return (None, None, *out)
        for i in layers:
            for q, v in ((qs[2 * i], ctx.versions[2 * i]), (qs[2 * i + 1], ctx.versions[2 * i + 1])):
                if q._version != v:
                    raise RuntimeError(
                        "one of the POET-X Q parameters used by a batched Cayley series has been modified by an "
                        f"inplace operation: version {q._version}, expected {v} (the backward of a forward must run "
                        "before the optimizer step that follows it)")
        sel = [q for i in layers for q in (qs[2 * i], qs[2 * i + 1])]
        grad = grads[layers[0]] if len(layers) == 1 else torch.cat([grads[i] for i in layers])
        dq = _cayley.series_backward(torch.cat(sel), grad.contiguous(), ctx.block_size, ctx.terms)
        parts = dq.split([q.shape[0] for q in sel])
        for j, i in enumerate(layers):
            out[2 * i], out[2 * i + 1] = parts[2 * j], parts[2 * j + 1]
        return (None, None, *out)


class Batch:
    """The fast-mode layers of one hooked model and the blocks of its current forward."""

    def __init__(self, layers: list):
        self.layers = [weakref.ref(layer) for layer in layers]
        self.depth = 0  # nesting of the model's forwards
        # while a forward (or its backward) runs: per layer None or (blocks, q_in version, q_out version)
        self.current: Optional[list] = None

    def compute(self) -> Optional[list]:
        """The blocks of every eligible layer, batched; None when fewer than two layers are eligible."""
        groups: dict = {}
        for i, ref in enumerate(self.layers):
            layer = ref()
            if layer is None or layer.mode != "fast":
                continue
            q_in, q_out = layer.q_in, layer.q_out
            if not (q_in.requires_grad and q_out.requires_grad and layer._one_series()):
                continue
            groups.setdefault((q_in.device, q_in.dtype, layer.block_size, layer.terms), []).append((i, q_in, q_out))
        current: list = [None] * len(self.layers)
        batched = False
        for (_, _, block_size, terms), members in groups.items():
            if len(members) < 2:
                continue  # one layer gains nothing: it runs its own series
            batched = True
            for chunk in _chunks(members, block_size):
                blocks = _Series.apply(block_size, terms, *[q for _, q_in, q_out in chunk for q in (q_in, q_out)])
                for (i, q_in, q_out), g in zip(chunk, blocks):
                    current[i] = (g, q_in._version, q_out._version)
        return current if batched else None


def _chunks(members: list, block_size: int) -> list:
    """Consecutive layers (module order: about the order their backward runs in) with at most :data:`CHUNK_BYTES` of
    dense float32 blocks each (at least one layer): one series node per chunk, so that the series' temporaries and the
    blocks' gradients held for its backward stay bounded, and each chunk's backward runs once its own layers' are
    done."""
    per_block = block_size * block_size * 4
    out, cur, size = [], [], 0
    for m in members:
        n = (m[1].shape[0] + m[2].shape[0]) * per_block
        if cur and size + n > CHUNK_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(m)
        size += n
    if cur:
        out.append(cur)
    return out


def blocks_for(layer: nn.Module, q_in: torch.Tensor, q_out: torch.Tensor) -> Optional[torch.Tensor]:
    """The batched blocks of ``layer`` for this forward (both sides, input side first), or None: not inside its
    model's forward or that forward's backward, not batched, or ``Q`` changed since."""
    entry = layer.__dict__.get(_BATCH_ATTR)
    if entry is None:
        return None
    current = entry[0].current
    if current is None:
        return None
    slot = current[entry[1]]
    if slot is None or slot[1] != q_in._version or slot[2] != q_out._version:
        return None
    record("poetx:batched_series")
    return slot[0]


def _enter(model: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    batch: Batch = model.__dict__[_HOOKS_ATTR][0]
    batch.depth += 1
    if batch.depth == 1:
        batch.current = batch.compute() if ENABLED and torch.is_grad_enabled() else None


def _leave(model: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    batch: Batch = model.__dict__[_HOOKS_ATTR][0]
    batch.depth = max(batch.depth - 1, 0)
    if batch.depth > 0:
        return
    current, batch.current = batch.current, None
    if current is not None and torch.is_grad_enabled():

        def start() -> None:  # this forward's blocks, again, while its backward runs
            batch.current = current

        def end() -> None:
            if batch.current is current:
                batch.current = None

        around_backward(output, start, end)


def install(model: nn.Module, layers: list) -> int:
    """Batch the series of ``layers`` (POET-X layers of ``model``) in ``model``'s forwards; returns how many layers
    are batched (0: nothing installed, fewer than two fast-mode layers)."""
    uninstall(model)
    layers = [layer for layer in layers if layer.mode == "fast"]
    if len(layers) < 2:
        return 0
    batch = Batch(layers)
    for i, layer in enumerate(layers):
        layer.__dict__[_BATCH_ATTR] = (batch, i)
    model.__dict__[_HOOKS_ATTR] = (batch, model.register_forward_pre_hook(_enter),
                                   model.register_forward_hook(_leave, always_call=True))
    return len(layers)


def uninstall(model: nn.Module) -> None:
    """Remove :func:`install`'s hooks from ``model`` (its layers compute their own series again)."""
    entry = model.__dict__.pop(_HOOKS_ATTR, None)
    if entry is None:
        return
    batch, pre, post = entry
    pre.remove()
    post.remove()
    batch.current = None
    for ref in batch.layers:
        layer = ref()
        if layer is not None and layer.__dict__.get(_BATCH_ATTR, (None,))[0] is batch:
            del layer.__dict__[_BATCH_ATTR]
