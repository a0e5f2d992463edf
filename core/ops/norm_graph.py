"""CUDA-graph replay of a layer's norm recomputation.

With the frozen base norm cached, a layer's weight norm is recomputed once per optimizer step by a fixed sequence of
Triton launches on the same parameter storages (optimizers update ``A`` and ``B`` in place). That sequence costs ~12
launches and their Python per layer, at the start of the first micro-batch after each step, when the GPU queue is
empty (transformers' causal-mask construction synchronises once per forward): measured on the H200 as host time the
GPU waits for (measured on the H200). Captured once into a CUDA graph, each later recomputation is one
graph launch on the current stream, computing the same kernels on the same inputs into the same output tensor:
bitwise the same norm.

A graph is used only where replaying it is exactly the eager computation:

- inputs: ``W`` (a view of the layer's stored weight, no dequantisation), ``A``, ``B`` and the cached base norm at
  the same addresses with the same shapes, strides and dtypes as at capture, the same ``scale``; anything else
  recaptures;
- the Triton norm is the implementation the dispatch picks (CUDA, supported dtypes), outside ``torch.compile``,
  outside another capture, outside distributed engines (their parameters move between calls);
- replays run on the stream the graph was captured for: graphs of one (device, stream) share one memory pool
  (their temporaries never live at the same time: replays on one stream run one after another), so memory stays
  one layer's working set plus the norms.

The first recomputation computes ``||W||^2`` too and the first one with a cached base compiles that plan's kernels,
both eagerly (a capture never compiles); the next one is captured (after ``Settings.graph_capture_after`` eager
recomputations) and replayed, and every later one replays. A capture that fails leaves that layer eager
(``norm:graph_failed``) and the process as it was (see ``_after_failed_capture``).
"""

from __future__ import annotations

import gc
import warnings
from typing import Optional

import torch

from .. import _launch

__all__ = ["NormGraph", "signature", "capture"]

# (device index, raw stream) -> (graph memory pool, capture stream, keeper graph) shared by that stream's norm graphs:
# one capture stream per pool, because the caching allocator reuses a freed block only for allocations on the stream
# that used it (a fresh stream per capture would keep every layer's temporaries reserved: +0.7 GB at Qwen3-8B x 8
# layers). The keeper is an empty graph captured into the pool when it is created: PyTorch counts the live graphs of
# a pool and refuses a capture into a pool whose count fell to zero (an internal assert in the caching allocator's
# beginAllocateToPool) -- which happened once every graph of a pool had been freed (a model deleted,
# graphs replaced) and a later layer captured into the pool kept here.
_POOLS: dict = {}


def _tsig(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def signature(weight, weight_src, lora_A, lora_B, scale, base_sq, triton: bool) -> Optional[tuple]:
    """What a norm graph bakes in (None: not graphable here). ``weight`` is the effective weight the norm reads,
    ``weight_src`` the layer's stored parameter (``weight`` must be a view of its storage); ``triton``: the dispatch
    picked the Triton norm for these tensors."""
    if (
        base_sq is None
        or not (weight.is_cuda and lora_A.is_cuda and lora_B.is_cuda and base_sq.is_cuda)
        or base_sq.dtype != torch.float32
        or not base_sq.is_contiguous()
        or torch.compiler.is_compiling()
        or _launch.capturing()
        or weight.untyped_storage().data_ptr() != weight_src.untyped_storage().data_ptr()
        or not triton
    ):
        return None
    # storages by address and layout: a graph reads whatever lives at the captured addresses, so matching current
    # tensors at the same addresses with the same layouts is all a replay needs (a recomputed base or a swapped
    # factor elsewhere: another signature, a new capture)
    return (*_launch.current_stream(weight), _tsig(weight), _tsig(lora_A), _tsig(lora_B), _tsig(base_sq), float(scale))


class NormGraph:
    """A captured norm computation: ``replay()`` recomputes ``norm`` (the same tensor every time) in place."""

    __slots__ = ("sig", "graph", "norm")

    def __init__(self, sig, graph, norm):
        self.sig, self.graph, self.norm = sig, graph, norm

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.norm


def capture(sig, weight, lora_A, lora_B, scale, base_sq, budget_bytes):
    """Capture the Triton norm for these inputs (``sig`` from :func:`signature`); replay it to compute. Returns
    ``(NormGraph, None)``, or ``(None, reason)`` if the capture failed (the caller then computes eagerly).

    The norm is written into a tensor allocated outside the graph's pool, so the pool holds only temporaries, all
    freed inside each capture: graphs sharing the pool may reuse each other's temporaries, never each other's
    outputs (which stay cached between replays)."""
    from ..kernels import norm as kn

    dev_idx, stream_key = sig[0], sig[1]
    dev = torch.device("cuda", dev_idx)
    out = torch.empty(weight.shape[0], dtype=torch.float32, device=dev)
    entry = _POOLS.get((dev_idx, stream_key))
    if entry is None:  # captures run on a side stream (never the legacy default stream)
        entry = _new_pool(dev)
        if entry is None:
            return None, "could not create a graph pool"
        _POOLS[(dev_idx, stream_key)] = entry
    pool, side, _ = entry
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(dev)
    side.wait_stream(current)
    # no cyclic garbage collection inside the capture: a collection runs the finalizers of unreachable objects, and
    # a CUDA graph freed during a capture fails it (reproduced on the H200 with torch 2.11)
    gc_on = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(side), torch.no_grad(), torch.autocast("cuda", enabled=False):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                kn.factored_norm_triton(weight, lora_A, lora_B, scale, base_sq, budget_bytes, out=out)
            finally:
                graph.capture_end()
    except Exception as e:  # noqa: BLE001 - an uncapturable call: compute eagerly instead (never an error for the user)
        current.wait_stream(side)
        _after_failed_capture(dev, dev_idx, stream_key)
        return None, f"{type(e).__name__}: {e}"
    finally:
        if gc_on:
            gc.enable()
    current.wait_stream(side)
    return NormGraph(sig, graph, out), None


def _empty_capture(graph, stream, pool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty"
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            graph.capture_end()


def _new_pool(dev: torch.device):
    """``(pool, capture stream, keeper)``: a fresh graph pool that stays live (its keeper graph) as long as it is
    kept in ``_POOLS``; None if even the empty capture fails."""
    pool, side, keeper = torch.cuda.graph_pool_handle(), torch.cuda.Stream(dev), torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream(dev))
    try:
        _empty_capture(keeper, side, pool)
    except Exception:  # noqa: BLE001
        _after_failed_capture(dev, None, None)
        return None
    return pool, side, keeper


def _after_failed_capture(dev: torch.device, dev_idx: Optional[int], stream_key: Optional[int]) -> None:
    """Leave the process as if no capture had been tried. PyTorch ends a capture's bookkeeping only when
    ``cudaStreamEndCapture`` succeeds: after a failed one the device's default CUDA generator stays in capture mode
    (every later random op on the device raises "Offset increment outside graph capture encountered unexpectedly")
    and the pool stays registered for that capture. So the failed capture's pool and stream are dropped (the next
    capture of this stream gets fresh ones), and one empty capture on a fresh stream and pool runs the generator's
    capture prologue and epilogue again, which takes it out of capture mode."""
    if dev_idx is not None:
        _POOLS.pop((dev_idx, stream_key), None)
    try:
        _empty_capture(torch.cuda.CUDAGraph(), torch.cuda.Stream(dev), torch.cuda.graph_pool_handle())
    except Exception:  # noqa: BLE001 - nothing more can be done here; the caller computes eagerly
        pass
