"""Runtime dispatch: which implementation runs a composition or a norm, and the two entry points that dispatch.

- Triton path (``fastdora.ops.compose.triton_impl()``, ``fastdora.kernels.norm``): CUDA tensors, Triton importable,
  ``kernels != "eager"``, a layout the kernels cover; in ``kernels="auto"`` mode from
  ``Settings.compose_crossover_numel`` output elements on (the fused path measured faster than eager at every size
  from 1K to 64M elements on the H200, so the threshold is the smallest size measured).
- Exact PyTorch fallback (``fastdora.ops.compose.EAGER``, ``fastdora.ops.norm.factored_norm_eager``): CPU, no
  Triton, ``kernels="eager"``, channel-first (conv) layouts, a trainable base bias, tiny problems.

Under ``torch.compile`` the composition is traced as the exact PyTorch ops (every product and sum in fp32, which
Inductor fuses with the neighbouring elementwise work and rounds once; ``Settings.compiled_compose_op`` makes it one
opaque Triton custom op per direction instead, measured slower) and the cached norm is the custom op
``fastdora::cached_norm`` (:func:`compiled_norm`): opaque to the compiler, it looks the norm up in the cache when the
compiled graph runs, so a compiled model computes each norm once per optimizer step, as in eager mode, and its guards
see nothing that changes between steps (no recompilation). It is tagged ``cudagraph_unsafe``: a CUDA
graph must not replay a cache lookup, so ``mode="reduce-overhead"`` captures the rest of the graph around it.
"""

from __future__ import annotations

import functools
import sys
from typing import Optional

import torch

from . import cache as _cache
from .config import SETTINGS as _S
from .ops import compose as _compose
from .ops.norm import factored_norm_eager
from .stats import path_key, record

__all__ = ["compose_impl", "norm_impl", "layer_node", "triton_available", "native_node", "dora_compose",
           "factored_norm", "cached_norm", "compiled_norm", "HAS_NORM_OP"]

_EAGER = _compose.EAGER


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        from .kernels import compose as kc

        return kc.AVAILABLE
    except Exception:  # pragma: no cover - import errors mean "no triton"
        return False


def _triton(kernels: str):
    """The Triton implementation, or None (an error where ``kernels="triton"`` asked for it and Triton is missing)."""
    impl = _compose.triton_impl() if triton_available() else None
    if impl is None:
        _no_triton(kernels)
    return impl


def _no_triton(kernels: str) -> None:
    """Triton is missing: an error where ``kernels="triton"`` asked for it, nothing otherwise (eager runs)."""
    if kernels == "triton":
        raise RuntimeError("fastdora: kernels='triton' was requested but Triton is not importable")


def native_node(required: Optional[bool] = None):
    """Build / load the C++ composition node now (``fastdora.kernels.native.node``, with the ops layer's fallbacks
    registered first); None where Triton is missing or the node is not used (``native.status()`` says why)."""
    if _compose.triton_impl() is None:
        if required:
            raise RuntimeError("fastdora: the C++ composition node needs Triton, which is not importable")
        return None
    from .kernels import native

    return native.node(required)


def compose_impl(result, lora, magnitude, bias, base_delta, feature_dim, kernels: str):
    """Called on every composition: the common case is a handful of attribute checks."""
    if (
        kernels == "eager"
        or (torch.compiler.is_compiling() and not _S.compiled_compose_op)
        or not (result.is_cuda and lora.is_cuda and magnitude.is_cuda)
        or (feature_dim != -1 and feature_dim != result.dim() - 1)
    ):
        return _EAGER
    impl = _triton(kernels)
    if impl is None:
        return _EAGER
    if kernels == "auto" and result.numel() < _S.compose_crossover_numel:
        return _EAGER
    if bias is not None and bias.requires_grad:
        return _EAGER
    return impl


def layer_node(x, weight, magnitude, kernels: str):
    """The C++ node (``fastdora.kernels.native``) for a whole DoRA Linear layer call (``lean_linear_forward``), where
    the composition of this call would take the Triton path (``compose_impl``'s rule for the layer's result, which
    has ``x``'s rows and ``weight``'s output features) and the node is active; None otherwise (the separate nodes run).
    """
    if kernels == "eager" or not (x.is_cuda and weight.is_cuda and magnitude.is_cuda):
        return None
    impl = _triton(kernels)
    if impl is None:
        return None
    if kernels == "auto" and (x.numel() // max(x.shape[-1], 1)) * weight.shape[0] < _S.compose_crossover_numel:
        return None
    return impl.layer_node(x)


def _wants_triton(kernels: str, *tensors: Optional[torch.Tensor]) -> bool:
    if kernels == "eager":
        return False
    ts = [t for t in tensors if t is not None]
    if not ts or not all(t.is_cuda for t in ts):
        return False
    if not triton_available():
        _no_triton(kernels)
        return False
    return True


def norm_impl(weight, lora_A, lora_B, kernels: str):
    """``fastdora.kernels.norm.factored_norm_triton`` where it covers these tensors, else the eager norm. Under
    ``torch.compile`` the norm is traced as plain PyTorch ops (the Triton launcher is not a registered op)."""
    if torch.compiler.is_compiling() or not _wants_triton(kernels, weight, lora_A, lora_B):
        return factored_norm_eager
    from .kernels import norm as kn

    if not kn.supports(weight, lora_A, lora_B):
        return factored_norm_eager
    return kn.factored_norm_triton


def factored_norm(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    base_sq: Optional[torch.Tensor] = None,
    budget_bytes: int = 16 << 20,
    kernels: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, base_sq)``: the detached fp32 row norm of ``weight + scale * lora_B @ lora_A`` and ``||W||^2`` per
    row, factored (see ``fastdora.ops.norm``), by the implementation :func:`norm_impl` picks."""
    impl = norm_impl(weight, lora_A, lora_B, kernels)
    with torch.autocast(weight.device.type, enabled=False):
        return impl(weight, lora_A, lora_B, scale, base_sq, budget_bytes)


def dora_compose(
    result: torch.Tensor,
    lora: torch.Tensor,
    magnitude: torch.Tensor,
    norm: torch.Tensor,
    scale: float,
    eps: float,
    *,
    bias: Optional[torch.Tensor] = None,
    base_delta: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    feature_dim: int = -1,
    kernels: str = "auto",
    kind: Optional[str] = None,
) -> torch.Tensor:
    """The final DoRA output (math: ``fastdora.ops.compose``). ``norm`` must be detached (fp32/fp64, ``[d_out]``).

    ``out_dtype`` defaults to the promoted dtype of ``result``, ``lora`` and ``base_delta`` (what PEFT's
    ``result + delta`` gives). ``kernels`` is ``"auto" | "triton" | "eager"``. ``kind`` (e.g. ``"linear"``) names the
    layer kind in ``fastdora.stats.active_path_counter``.
    """
    _compose.check_norm_detached(norm)
    if out_dtype is None:
        out_dtype = torch.promote_types(result.dtype, lora.dtype)
        if base_delta is not None:
            out_dtype = torch.promote_types(out_dtype, base_delta.dtype)
    impl = compose_impl(result, lora, magnitude, bias, base_delta, feature_dim, kernels)
    if kind is not None and not torch.compiler.is_compiling():  # (a traced dict update would guard the graph)
        record(path_key(kind, impl.name))
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # inference path: no autograd node, nothing saved
        return impl.compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, False,
                                feature_dim)[0]
    return impl.apply(result, lora, magnitude, norm, bias, base_delta, scale, eps, out_dtype, feature_dim)


# ------------------------------------------------------------------------------------------- under torch.compile


def _acc(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def cached_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float,
                kernels: str = "auto") -> torch.Tensor:
    """The detached row norm of ``weight + scale * lora_B @ lora_A`` through the norm cache, keyed on these tensors
    alone (``cache.local_key``; the entry is held by ``lora_B``'s storage): what ``fastdora::cached_norm`` runs. The
    returned tensor is the cached one (callers must not modify it)."""
    _cache.ensure_step_hook()
    key, wkey = _cache.local_key(weight, lora_A, lora_B, scale)
    hit, base_sq = _cache.anchored_get(lora_B, key, wkey)
    if hit is not None:
        return hit

    def compute():
        norm, base_sq_new = factored_norm(weight, lora_A, lora_B, scale, base_sq, _S.norm_budget_bytes, kernels)
        return norm.to(_acc(weight, lora_A, lora_B)), base_sq_new

    if weight.is_cuda and _graph_trees_exist():
        norm, base_sq_new = _outside_graph_pool(compute)
    else:
        with torch.no_grad():
            norm, base_sq_new = compute()
    _cache.anchored_put(lora_B, key, norm, wkey, base_sq_new, base_sq is not None)
    return norm


def _graph_trees_exist() -> bool:
    """Whether this process has CUDA graph trees (a model compiled with ``mode="reduce-overhead"``), whose warm-up
    would route the norm's allocation to a graph pool: only then does :func:`cached_norm` pay for the helper thread
    (measured on the H200 under default-mode compilation: 9 ms of a 0.22 s gradient iteration, Qwen3-8B shapes, 4
    layers). Unknown internals of another torch: True (the helper thread is always correct)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        return bool(trees.get_obj(trees.local, "tree_manager_containers"))
    except Exception:  # noqa: BLE001
        return True


@functools.lru_cache(maxsize=None)
def _pool_escape():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastdora-norm")


def _outside_graph_pool(compute):
    """``compute()`` on the caller's CUDA stream and device in a helper thread, so that what it allocates (the norm
    the cache keeps) comes from the ordinary allocator: CUDA graph trees (``mode="reduce-overhead"``) route the
    allocations of the thread that warms up a graph to their private pool, and refuse a pool tensor that outlives the
    graph without being one of its outputs. Grad mode and autocast are per thread: the helper has grad off and no
    autocast, which is what the norm (detached, its own precision) needs."""
    stream = torch.cuda.current_stream()

    def run():
        with torch.cuda.stream(stream), torch.no_grad():
            return compute()

    return _pool_escape().submit(run).result()


#: the ``torch.library.Library`` fragment holding ``fastdora::cached_norm`` (kept alive: dropping it unregisters the op)
_NORM_LIB = None


def _cached_norm_kernel(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float,
                        kernels: str) -> torch.Tensor:
    record("compiled:norm_op")  # (runs only inside compiled graphs: proof that one ran fastdora's norm)
    # a copy: the compiled graph owns its op outputs and may reuse their memory
    return cached_norm(weight, lora_A, lora_B, scale, kernels).clone()


def _define_norm_op() -> bool:
    """Register ``fastdora::cached_norm`` (tagged ``cudagraph_unsafe``, with a fake implementation); False where this
    torch lacks the tag or the registration API (then a compiled model traces the norm as plain PyTorch ops).

    A ``Library`` definition with one ``CompositeExplicitAutograd`` kernel rather than ``torch.library.custom_op``:
    a compiled gradient iteration calls the op for every DoRA layer in every forward and checkpoint recompute (224
    times at 4 Qwen3-8B layers, GA 4), mostly cache hits, and ``custom_op``'s Python dispatch took 30 us per call
    against 15 us here (CPU, same cache hit). No autograd kernel: :func:`compiled_norm` passes detached tensors and
    no gradient flows through the norm."""
    global _NORM_LIB
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None or not hasattr(torch.library, "register_fake"):
        return False
    try:
        if hasattr(torch.ops.fastdora, "cached_norm"):
            return True  # already registered (module imported under a second name)
    except Exception:  # pragma: no cover
        pass
    try:
        lib = torch.library.Library("fastdora", "FRAGMENT")
        lib.define("cached_norm(Tensor weight, Tensor lora_A, Tensor lora_B, float scale, str kernels) -> Tensor",
                   tags=(tag,))
        lib.impl("cached_norm", _cached_norm_kernel, "CompositeExplicitAutograd")

        @torch.library.register_fake("fastdora::cached_norm", lib=lib)
        def _(weight, lora_A, lora_B, scale, kernels):
            return weight.new_empty((weight.shape[0],), dtype=_acc(weight, lora_A, lora_B))
    except Exception:  # pragma: no cover
        return False
    _NORM_LIB = lib
    return True


HAS_NORM_OP = _define_norm_op()


def compiled_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float,
                  kernels: str) -> torch.Tensor:
    """:func:`cached_norm` as one opaque op while ``torch.compile`` traces (``weight`` must be the stored base weight
    or a view of it: the cache keys on its identity and version). No gradient flows through the norm."""
    return torch.ops.fastdora.cached_norm(weight.detach(), lora_A.detach(), lora_B.detach(), float(scale), kernels)
