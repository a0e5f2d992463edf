"""PEFT integration: fastdora's subclasses of PEFT's DoRA magnitude layers and DoRA variants.

A converted LoRA layer keeps PEFT's class. Its ``lora_variant[a]`` becomes a ``FastDora*Variant`` (subclass of
PEFT's ``Dora*Variant``) and each ``lora_magnitude_vector[a]`` module has its class swapped to ``FastDora*Layer``
(subclass of PEFT's ``Dora*Layer``): the same object and ``nn.Parameter``, the same state-dict keys and dtypes.

The variant calls the magnitude module (``__call__``: FSDP1 unshards it there) with ``fastdora_result=result``; the
module then returns the final layer output, composed in one expression with the cached factored norm. Called the
PEFT way (without ``fastdora_result``) the module returns exactly what PEFT's returns.
"""

from __future__ import annotations

import types
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from peft.tuners.lora import dora as peft_dora
from peft.tuners.lora import variants as peft_variants
from peft.utils.integrations import dequantize_module_weight
from peft.utils.other import transpose
from torch import nn

from . import cache as _cache
from . import compat
from . import config as _config
from . import dispatch as _dispatch
from . import distributed as _distributed
from .config import SETTINGS as _S
from .dispatch import dora_compose, factored_norm
from .ops import norm_graph as _norm_graph
from .ops.compose import acc_dtype_for, allow_row_coef_cache, saves_discarded
from .stats import active_path_counter, path_key, record

__all__ = [
    "FastDoraLinearLayer",
    "FastDoraEmbeddingLayer",
    "FastDoraConv1dLayer",
    "FastDoraConv2dLayer",
    "FastDoraConv3dLayer",
    "FastDoraLinearVariant",
    "FastDoraEmbeddingVariant",
    "FastDoraConv1dVariant",
    "FastDoraConv2dVariant",
    "FastDoraConv3dVariant",
    "active_path_counter",
    "eps_for",
    "is_fastdora_forward",
    "PEFT_CLASSES",
]

# PEFT's own classes, captured at import (before any process-wide patching of PEFT's module globals).
PEFT_CLASSES = {
    name: getattr(peft_variants, name)
    for name in (
        "DoraLinearLayer",
        "DoraEmbeddingLayer",
        "DoraConv1dLayer",
        "DoraConv2dLayer",
        "DoraConv3dLayer",
        "DoraLinearVariant",
        "DoraEmbeddingVariant",
        "DoraConv1dVariant",
        "DoraConv2dVariant",
        "DoraConv3dVariant",
    )
}

_DEFAULT_OPTIONS: Optional[_config.Options] = None


def default_options() -> _config.Options:
    """Options for layers converted without explicit options (process-wide mode sets them)."""
    global _DEFAULT_OPTIONS
    if _DEFAULT_OPTIONS is None:
        _DEFAULT_OPTIONS = _config.make_options()
    return _DEFAULT_OPTIONS


def set_default_options(options: Optional[_config.Options]) -> None:
    global _DEFAULT_OPTIONS
    _DEFAULT_OPTIONS = options


_HALF = (torch.float16, torch.bfloat16)


def eps_for(dtype: torch.dtype) -> float:
    """eps of ``max(norm, eps)``: 1e-6 for half precision compute, 1e-12 otherwise (dora-math.md)."""
    return 1e-6 if dtype in _HALF else 1e-12


#: a magnitude module's norm slots (adapter -> tensor) and the ``fastdora.slots.Root`` that refreshes them
SLOT_ATTR, SLOT_ROOT_ATTR = "_fastdora_slots", "_fastdora_slot_root"


def _stored_weight(base_layer: nn.Module) -> torch.Tensor:
    """The tensor that holds the base weight as stored (the cache key source): ``weight`` for plain and bitsandbytes
    layers, ``W_q`` for HQQ."""
    w = getattr(base_layer, "weight", None)
    if w is None:
        w = getattr(base_layer, "W_q", None)
    if w is None:
        raise TypeError(f"fastdora: cannot find the stored weight of {type(base_layer).__name__}")
    return w


def _base_layer(module: nn.Module) -> nn.Module:
    """``module.get_base_layer()`` without its attribute walk in the common (not nested) case."""
    base = module._modules.get("base_layer")
    if base is None or "base_layer" in base._modules:
        return module.get_base_layer()
    return base


_PLAIN_PARAM = (nn.Parameter, torch.Tensor)


def _is_plain(weight: torch.Tensor) -> bool:
    """A weight stored as itself: a plain parameter or tensor (not quantized, not a tensor subclass)."""
    return type(weight) in _PLAIN_PARAM


def _transpose(weight: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """PEFT's ``transpose`` without its re-wrapping in a new ``nn.Parameter`` (same values; traceable)."""
    return weight.T if fan_in_fan_out else weight


def _effective_weight(base_layer: nn.Module) -> torch.Tensor:
    """PEFT's ``dequantize_module_weight``: the base weight itself where it is stored plainly (without the checks
    that ``torch.compile`` cannot trace), else PEFT's dequantization."""
    w = base_layer.__dict__.get("_parameters", {}).get("weight")
    if w is not None and _is_plain(w) and not hasattr(base_layer, "W_q"):
        return w
    return dequantize_module_weight(base_layer)
_global_hooks = compat.global_module_hooks


def _own_hooks(m: nn.Module) -> bool:
    """``m`` has call hooks of its own or a ``module.compile()``-d call."""
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks
                or m.__dict__.get("_compiled_call_impl") is not None)


def _no_call_hooks(m: nn.Module) -> bool:
    """Calling ``m.forward`` directly is exactly what ``m(...)`` does: no hooks of its own or global ones and no
    ``module.compile()``-d call."""
    return not (_own_hooks(m) or _global_hooks())


def _bare_linear(m: nn.Module) -> bool:
    """``F.linear(x, weight, bias)`` on ``m``'s parameters is exactly ``m(x)`` (global hooks aside, which callers
    check once): a plain ``nn.Linear`` with plain parameters and no hooks of its own."""
    if type(m) is not nn.Linear or _own_hooks(m):
        return False
    p = m._parameters
    b = p["bias"]
    return type(p["weight"]) in _PLAIN_PARAM and (b is None or type(b) in _PLAIN_PARAM)


def _peft_caching_enabled() -> bool:
    return bool(getattr(peft_dora, "ENABLE_DORA_CACHING", False))


class _FastDoraMixin:
    """Norm caching shared by every fastdora magnitude layer (state lives in plain ``_fastdora_*`` attributes)."""

    _fastdora_kind = "linear"

    def _fd_options(self) -> _config.Options:
        opts = self.__dict__.get("_fastdora_options")
        return opts if opts is not None else default_options()

    def _fd_invalidate(self) -> None:
        _cache.clear(self)

    def _fd_graph_norm(self, adapter_name, weight, weight_src, lora_A, lora_B, scale, base_sq, budget, kernels):
        """The norm from this adapter's CUDA graph (``fastdora.ops.norm_graph``), capturing it after
        ``Settings.graph_capture_after`` eager recomputations with the same inputs; None: compute eagerly this time."""
        triton = _dispatch.norm_impl(weight, lora_A, lora_B, kernels) is not _dispatch.factored_norm_eager
        sig = _norm_graph.signature(weight, weight_src, lora_A, lora_B, scale, base_sq, triton)
        if sig is None:
            return None
        graphs = self.__dict__.setdefault("_fastdora_graphs", {})
        entry = graphs.get(adapter_name)
        if type(entry) is _norm_graph.NormGraph:
            if entry.sig == sig:
                record("norm:graph_replay")
                return entry.replay()
            entry = None  # inputs moved (storage swap, new base, other stream): drop the graph
        same = entry is not None and entry[0] == sig
        count = entry[1] if same else 0
        if count < _S.graph_capture_after:
            graphs[adapter_name] = (sig, count + 1) + (tuple(entry[2:]) if same else ())
            return None
        g, why = _norm_graph.capture(sig, weight, lora_A, lora_B, scale, base_sq, budget)
        if g is None:  # not capturable here: eager from now on for these inputs (the reason kept for diagnosis)
            graphs[adapter_name] = (sig, float("-inf"), why)
            record("norm:graph_failed")
            return None
        graphs[adapter_name] = g
        record("norm:graph_capture")
        return g.replay()

    def __getstate__(self):
        # pickling / deep-copying the module leaves the norm caches behind (the copy recomputes them; the cached
        # norms carry per-row coefficient caches that hold weak references, which pickle refuses)
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return _cache.drop_from_state(state)

    def _fd_peft_cache(self, adapter_name: Optional[str], norm: torch.Tensor) -> None:
        # PEFT's DoraCaching semantics for its `_dora_cache` (peft >= 0.19): filled only in eval mode while enabled.
        if not hasattr(self, "_dora_cache"):
            return
        if (not _peft_caching_enabled()) or self.training or adapter_name is None:
            self._cache_clear()
        else:
            self._cache_store(f"weight-norm-{adapter_name}", norm)

    def _fd_weight_norm(
        self,
        weight_src: torch.Tensor,
        weight_fn: Callable[[], torch.Tensor],
        lora_A: torch.Tensor,
        lora_B: torch.Tensor,
        scale: float,
        adapter_name: Optional[str],
    ) -> torch.Tensor:
        """Detached row norm of ``weight_fn() + scale * lora_B @ lora_A`` (effective [d_out, d_in] layout).

        ``weight_src`` is the stored base parameter (keyed for the cache); ``weight_fn`` produces the effective
        weight (dequantized / transposed / flattened) only when the norm must be computed.
        """
        kernels, budget = self._fd_options().kernels, _S.norm_budget_bytes
        if torch.compiler.is_compiling():
            if _S.cache_norm and _is_plain(weight_src):
                # inside its model's forward, the slot that the model's pre-forward refresh keeps current
                # (fastdora.slots; Dynamo guards on ``active``); else one opaque op that reads the cache when the
                # graph runs, where weight_fn() is a view of the stored weight (a dequantized copy would be a new
                # tensor at every call: traced as plain ops instead)
                root = getattr(self, SLOT_ROOT_ATTR, None)
                if root is not None and root.active:
                    slot = getattr(self, SLOT_ATTR, {}).get(adapter_name)
                    if slot is not None:
                        return slot
                if _dispatch.HAS_NORM_OP:
                    return _dispatch.compiled_norm(weight_fn(), lora_A, lora_B, scale, kernels)
            return factored_norm(weight_fn(), lora_A, lora_B, scale, None, budget, kernels)[0]
        if not _S.cache_norm:
            return factored_norm(weight_fn(), lora_A, lora_B, scale, None, budget, kernels)[0]
        dist = _distributed.active()
        key, wkey = _cache.keys(self, weight_src, lora_A, lora_B, scale, dist)
        if key is None or wkey is None:
            return factored_norm(weight_fn(), lora_A, lora_B, scale, None, budget, kernels)[0]
        hit = _cache.get(self, adapter_name, key)
        if hit is not None:
            return hit
        base_sq = _cache.base(self, wkey)
        base_was_cached = base_sq is not None
        weight = weight_fn()
        norm = None
        if base_was_cached and _S.graph_norm and not dist:
            norm = self._fd_graph_norm(adapter_name, weight, weight_src, lora_A, lora_B, scale, base_sq, budget,
                                       kernels)
        if norm is None:
            norm, base_sq = factored_norm(weight, lora_A, lora_B, scale, base_sq, budget, kernels)
        allow_row_coef_cache(norm)  # the eager composition may keep its per-row coefficients on a cached norm
        _cache.put(self, adapter_name, key, norm, wkey, base_sq, base_was_cached)
        return norm

    def _fd_compose(self, result, lora, norm, scaling, eps, out_dtype, bias=None, base_delta=None, feature_dim=-1):
        """The fused final layer output (every layer kind): ``dora_compose`` with this module's magnitude, options."""
        return dora_compose(
            result,
            lora,
            self.weight,
            norm,
            scaling,
            eps,
            bias=bias,
            base_delta=base_delta,
            out_dtype=out_dtype,
            feature_dim=feature_dim,
            kernels=self._fd_options().kernels,
            kind=self._fastdora_kind,
        )

    def _fd_output(
        self, lora, norm, eps, scaling, base_layer, base_result, base_delta, fastdora_result, out_dtype, feature_dim
    ):
        """Linear / conv output. Fused mode (``fastdora_result`` given): the final layer output in one expression.
        PEFT-style call: PEFT's delta ``(g - 1) * base_nobias + g * s * lora``."""
        if fastdora_result is not None:
            bias = getattr(base_layer, "bias", None) if base_delta is None else None
            return self._fd_compose(fastdora_result, lora, norm, scaling, eps, out_dtype, bias, base_delta, feature_dim)
        record(f"{self._fastdora_kind}:peft_style")
        if base_delta is None:
            bias = getattr(base_layer, "bias", None)
            if bias is not None:
                bias = bias.view(-1) if feature_dim == -1 else bias.view(1, -1, *([1] * (base_result.dim() - 2)))
            base_delta = base_result - bias if bias is not None else base_result
        vs = [1] * lora.dim()
        vs[feature_dim] = -1
        acc = acc_dtype_for(lora, base_delta, self.weight)
        g = _peft_style_g(self.weight, norm, eps, acc).view(vs)
        out = (g - 1) * base_delta.to(acc) + g * lora.to(acc) * scaling
        return out.to(torch.promote_types(lora.dtype, base_delta.dtype))


def _peft_style_g(magnitude: torch.Tensor, norm: torch.Tensor, eps: float, acc: torch.dtype) -> torch.Tensor:
    # g with autograd to the magnitude (used when PEFT-style callers invoke the magnitude module directly)
    return magnitude.reshape(-1).to(acc) / norm.to(acc).clamp_min(eps)


class FastDoraLinearLayer(_FastDoraMixin, PEFT_CLASSES["DoraLinearLayer"]):
    _fastdora_kind = "linear"

    def _fd_linear_norm(self, base_layer, lora_A, lora_B, scaling, adapter_name):
        fan_in_fan_out = self.fan_in_fan_out

        def weight_fn():
            return _transpose(_effective_weight(base_layer), fan_in_fan_out)

        return self._fd_weight_norm(
            _stored_weight(base_layer), weight_fn, lora_A.weight, lora_B.weight, scaling, adapter_name
        )

    def forward(
        self,
        x,
        *,
        lora_A,
        lora_B,
        scaling,
        base_layer,
        base_result=None,
        adapter_name="default",
        fastdora_result=None,
        fastdora_out_dtype=None,
    ):
        if _distributed.active():  # factors / base weight may be sharded outside their own calls
            norm, lora = _distributed.linear_norm_and_lora(self, x, base_layer, lora_A, lora_B, scaling, adapter_name)
        else:
            norm = self._fd_linear_norm(base_layer, lora_A, lora_B, scaling, adapter_name)
            lora = lora_B(lora_A(x))
        self._fd_peft_cache(adapter_name, norm)
        eps = eps_for(x.dtype)
        base_delta = None
        if base_result is None:
            base_delta = _distributed.base_delta(base_layer, x, self.fan_in_fan_out) if _distributed.active() else None
            if base_delta is None:
                weight = _effective_weight(base_layer).to(x.dtype)
                base_delta = F.linear(x, _transpose(weight, self.fan_in_fan_out))
        return self._fd_output(
            lora, norm, eps, scaling, base_layer, base_result, base_delta, fastdora_result, fastdora_out_dtype, -1
        )


class FastDoraEmbeddingLayer(_FastDoraMixin, PEFT_CLASSES["DoraEmbeddingLayer"]):
    _fastdora_kind = "embedding"

    def forward(
        self,
        x,
        *,
        lora_A,
        lora_B,
        scaling,
        base_layer,
        embed_fn,
        adapter_name="default",
        fastdora_result=None,
        fastdora_embed_scale=None,
        fastdora_out_dtype=None,
    ):
        # PEFT passes lora_A = embedding_A.T [num_emb, r], lora_B = embedding_B.T [r, dim]; the effective weight
        # is W.T [dim, num_emb] with factors A = embedding_A [r, num_emb], B = embedding_B [dim, r].
        w = base_layer.weight
        norm = self._fd_weight_norm(w, lambda: w.T, lora_A.T, lora_B.T, scaling, adapter_name)
        self._fd_peft_cache(adapter_name, norm)
        lora = embed_fn(x, lora_A) @ lora_B
        eps = eps_for(lora.dtype)
        if fastdora_result is not None:
            if fastdora_embed_scale is not None:
                lora = lora * fastdora_embed_scale.to(lora.dtype)
            return self._fd_compose(fastdora_result, lora, norm, scaling, eps, fastdora_out_dtype)
        record(f"{self._fastdora_kind}:peft_style")
        acc = acc_dtype_for(lora, self.weight)
        g = _peft_style_g(self.weight, norm, eps, acc)
        return g, g * lora.to(acc) * scaling


def _conv_without_bias(dora_layer, base_layer, x):
    """The base convolution without its bias, as the installed PEFT computes it where dropout leaves no base result:
    PEFT >= 0.22 calls the layer's own ``_conv_forward`` (its ``padding_mode`` included), older releases
    ``conv_fn(x, W, stride, padding, dilation, groups)`` (zero padding whatever the layer's mode)."""
    conv_fn = getattr(dora_layer, "conv_fn", None)
    if conv_fn is None:
        return compat.conv_without_bias(base_layer, x)
    return conv_fn(x, base_layer.weight, bias=None, stride=base_layer.stride, padding=base_layer.padding,
                   dilation=base_layer.dilation, groups=base_layer.groups)


class _FastDoraConvNdMixin(_FastDoraMixin):
    _fastdora_kind = "conv"

    def _fd_factors(self, base_layer, lora_A, lora_B):
        """Effective 2-D factors reproducing PEFT's ``B.view(-1, r) @ A.view(r, -1)`` reshaped to W, or None when that
        reshape does not map rows to output channels (then the dense PEFT formula is the definition)."""
        w = base_layer.weight
        r = lora_A.weight.shape[0]
        a2 = lora_A.weight.reshape(r, -1)
        b2 = lora_B.weight.reshape(-1, r)
        c_out = w.shape[0]
        if b2.shape[0] == c_out and a2.shape[1] * c_out == w.numel():
            return a2, b2
        return None

    def _fd_conv_norm(self, base_layer, lora_A, lora_B, scaling, adapter_name):
        w = base_layer.weight
        factors = self._fd_factors(base_layer, lora_A, lora_B)
        if factors is None:
            record("conv:dense_norm")
            r = lora_A.weight.shape[0]
            with torch.no_grad():
                lw = torch.mm(lora_B.weight.view(-1, r), lora_A.weight.view(r, -1)).reshape(w.shape)
                dense = w + scaling * lw
                return dense.flatten(1).to(acc_dtype_for(dense)).norm(dim=1)
        a2, b2 = factors
        return self._fd_weight_norm(w, lambda: w.reshape(w.shape[0], -1), a2, b2, scaling, adapter_name)

    def forward(
        self,
        x,
        *,
        lora_A,
        lora_B,
        scaling,
        base_layer,
        base_result=None,
        adapter_name="default",
        fastdora_result=None,
        fastdora_out_dtype=None,
    ):
        norm = self._fd_conv_norm(base_layer, lora_A, lora_B, scaling, adapter_name)
        self._fd_peft_cache(adapter_name, norm.view(1, -1, *([1] * (base_layer.weight.dim() - 2))))
        eps = eps_for(x.dtype)
        lora = lora_B(lora_A(x))
        base_delta = None
        if base_result is None:
            base_delta = _conv_without_bias(self, base_layer, x)
        return self._fd_output(
            lora, norm, eps, scaling, base_layer, base_result, base_delta, fastdora_result, fastdora_out_dtype, 1
        )


class FastDoraConv1dLayer(_FastDoraConvNdMixin, PEFT_CLASSES["DoraConv1dLayer"]):
    _fastdora_kind = "conv1d"


class FastDoraConv2dLayer(_FastDoraConvNdMixin, PEFT_CLASSES["DoraConv2dLayer"]):
    _fastdora_kind = "conv2d"


class FastDoraConv3dLayer(_FastDoraConvNdMixin, PEFT_CLASSES["DoraConv3dLayer"]):
    _fastdora_kind = "conv3d"


# ----------------------------------------------------------------------------------------------------- variants


def _out_dtype(module, result: torch.Tensor) -> Optional[torch.dtype]:
    # One active adapter: PEFT rounds `result + delta` once to the result dtype; write that dtype directly.
    # Several: PEFT threads the promoted (fp32) sum between adapters; keep that.
    return result.dtype if len(module.active_adapters) == 1 else None


def _invalidate(module, active_adapter: str) -> None:
    """A merge or unmerge changed W: drop the layer's cached norms and move the cache's epochs
    (:func:`fastdora.cache.invalidate`: PEFT >= 0.22 writes W through ``.data.copy_``, which moves no version counter,
    so the entries that the compiled path keeps elsewhere, ``fastdora.dispatch.cached_norm``, need it too)."""
    mag = _distributed.unwrap(module.lora_magnitude_vector[active_adapter])
    if isinstance(mag, _FastDoraMixin):
        mag._fd_invalidate()
    _cache.invalidate()


def _merge_wrapper(peft_cls, name: str):
    """Merge/unmerge change W: run PEFT's method, then :func:`_invalidate`."""
    peft_method = getattr(peft_cls, name)

    def method(module, active_adapter, orig_weight):
        out = peft_method(module, active_adapter, orig_weight)
        _invalidate(module, active_adapter)
        return out

    return staticmethod(method)


def _unmerge_fan_in_fan_out(module, active_adapter, orig_weight):
    """PEFT's Linear DoRA unmerge, with the ``fan_in_fan_out`` transpose that released PEFT < 0.21 omits (it raises
    a shape error there; identical to PEFT's formula otherwise)."""
    delta_weight = module.get_delta_weight(active_adapter)
    weight_norm = module._cache_pop(f"{active_adapter}-weight_norm")
    dora_factor = module.lora_magnitude_vector[active_adapter].weight / weight_norm
    dora_factor = transpose(dora_factor.view(-1, 1), module.fan_in_fan_out)
    return (orig_weight.data / dora_factor - delta_weight).to(orig_weight.dtype)


class FastDoraLinearVariant(PEFT_CLASSES["DoraLinearVariant"]):
    merge_safe = _merge_wrapper(PEFT_CLASSES["DoraLinearVariant"], "merge_safe")
    merge_unsafe = _merge_wrapper(PEFT_CLASSES["DoraLinearVariant"], "merge_unsafe")
    _unmerge_peft = _merge_wrapper(PEFT_CLASSES["DoraLinearVariant"], "unmerge")

    @staticmethod
    def unmerge(module, active_adapter, orig_weight):
        if not getattr(module, "fan_in_fan_out", False):
            return FastDoraLinearVariant._unmerge_peft(module, active_adapter, orig_weight)
        out = _unmerge_fan_in_fan_out(module, active_adapter, orig_weight)
        _invalidate(module, active_adapter)
        return out

    @staticmethod
    def forward(module, active_adapter, x, result, **kwargs):
        mag = module.lora_magnitude_vector[active_adapter]  # may be an FSDP1 unit: call it, check what it wraps
        if not isinstance(_distributed.unwrap(mag), _FastDoraMixin):
            return PEFT_CLASSES["DoraLinearVariant"].forward(module, active_adapter, x, result, **kwargs)
        if ("forward" not in module.__dict__ and type(mag) is FastDoraLinearLayer and _S.lean_forward
                and not _distributed.active() and lean_install_safe()):
            install_lean_forward(module)  # later calls of this module take the flattened path (lean_linear_forward)
        dropout = module.lora_dropout[active_adapter]
        if isinstance(dropout, nn.Identity) or not module.training:
            base_result = result
        else:
            x = dropout(x)
            base_result = None
        # no hooks on the magnitude module: its forward directly (what __call__ would run, minus __call__)
        return (mag.forward if _no_call_hooks(mag) else mag)(
            x,
            lora_A=module.lora_A[active_adapter],
            lora_B=module.lora_B[active_adapter],
            scaling=module.scaling[active_adapter],
            base_layer=_base_layer(module),
            base_result=base_result,
            adapter_name=active_adapter,
            fastdora_result=result,
            fastdora_out_dtype=_out_dtype(module, result),
        )


class FastDoraEmbeddingVariant(PEFT_CLASSES["DoraEmbeddingVariant"]):
    merge_safe = _merge_wrapper(PEFT_CLASSES["DoraEmbeddingVariant"], "merge_safe")
    merge_unsafe = _merge_wrapper(PEFT_CLASSES["DoraEmbeddingVariant"], "merge_unsafe")
    unmerge = _merge_wrapper(PEFT_CLASSES["DoraEmbeddingVariant"], "unmerge")

    @staticmethod
    def forward(module, active_adapter, x, result, **kwargs):
        mag = module.lora_magnitude_vector[active_adapter]
        if not isinstance(mag, _FastDoraMixin):
            return PEFT_CLASSES["DoraEmbeddingVariant"].forward(module, active_adapter, x, result, **kwargs)
        embed_scale = None
        if not mag._fd_options().legacy_embedding_compose and hasattr(module, "_get_embed_scale"):
            embed_scale = module._get_embed_scale()
        return mag(
            x,
            lora_A=module.lora_embedding_A[active_adapter].T,
            lora_B=module.lora_embedding_B[active_adapter].T,
            scaling=module.scaling[active_adapter],
            base_layer=_base_layer(module),
            embed_fn=module._embed,
            adapter_name=active_adapter,
            fastdora_result=result,
            fastdora_embed_scale=embed_scale,
            fastdora_out_dtype=_out_dtype(module, result),
        )


def _conv_variant(peft_name: str):
    peft_cls = PEFT_CLASSES[peft_name]

    class _V(peft_cls):
        merge_safe = _merge_wrapper(peft_cls, "merge_safe")
        merge_unsafe = _merge_wrapper(peft_cls, "merge_unsafe")
        unmerge = _merge_wrapper(peft_cls, "unmerge")

        @staticmethod
        def forward(module, active_adapter, x, result, **kwargs):
            mag = module.lora_magnitude_vector[active_adapter]
            # an FSDP1 unit around a conv magnitude module is not unwrapped: the conv norm reads lora_A/lora_B weights
            # outside their own units, so PEFT's path (which calls them) runs there
            if not isinstance(mag, _FastDoraMixin):
                return peft_cls.forward(module, active_adapter, x, result, **kwargs)
            return FastDoraLinearVariant.forward(module, active_adapter, x, result, **kwargs)

    _V.__name__ = _V.__qualname__ = "Fast" + peft_name
    return _V


FastDoraConv1dVariant = _conv_variant("DoraConv1dVariant")
FastDoraConv2dVariant = _conv_variant("DoraConv2dVariant")
FastDoraConv3dVariant = _conv_variant("DoraConv3dVariant")

# PEFT class -> fastdora class (layers and variants), and back
FAST_OF = {
    PEFT_CLASSES["DoraLinearLayer"]: FastDoraLinearLayer,
    PEFT_CLASSES["DoraEmbeddingLayer"]: FastDoraEmbeddingLayer,
    PEFT_CLASSES["DoraConv1dLayer"]: FastDoraConv1dLayer,
    PEFT_CLASSES["DoraConv2dLayer"]: FastDoraConv2dLayer,
    PEFT_CLASSES["DoraConv3dLayer"]: FastDoraConv3dLayer,
    PEFT_CLASSES["DoraLinearVariant"]: FastDoraLinearVariant,
    PEFT_CLASSES["DoraEmbeddingVariant"]: FastDoraEmbeddingVariant,
    PEFT_CLASSES["DoraConv1dVariant"]: FastDoraConv1dVariant,
    PEFT_CLASSES["DoraConv2dVariant"]: FastDoraConv2dVariant,
    PEFT_CLASSES["DoraConv3dVariant"]: FastDoraConv3dVariant,
}
PEFT_OF = {fast: peft for peft, fast in FAST_OF.items()}


# ------------------------------------------------------------------------------------------- lean module forward

try:  # PEFT's LoRA Linear: the one layer class the lean forward is installed on (exact type)
    from peft.tuners.lora.layer import Linear as _LoraLinear
except Exception:  # pragma: no cover - every supported PEFT has it
    _LoraLinear = None

_is_compiling = torch.compiler.is_compiling
_tracing = compat.tracing


def _autocast_round_trip(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """PEFT casts the input to the adapters' ``dtype`` before ``lora_A``; under autocast in ``x``'s own half dtype
    that cast is a round trip: ``F.linear`` casts the fp32 copy straight back (exactly: fp32 holds every bf16 /
    fp16 value), and the gradient's two casts are exact too. True when skipping both is exact: a half ``x``, fp32
    adapters, autocast on in ``x``'s dtype for its device."""
    if dtype != torch.float32 or x.dtype not in _HALF:
        return False
    dev = x.device.type
    try:
        return torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == x.dtype
    except (TypeError, AttributeError, RuntimeError):  # pragma: no cover - torch without per-device autocast queries
        return False


def lean_linear_forward(module: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's ``lora.Linear.forward`` for the common training / inference call, with the PEFT and fastdora layers
    between the module call and the composition flattened into one function (host time: this runs once per layer
    per forward, twice under gradient checkpointing).

    It runs the same operations on the same tensors in the same order as ``lora.Linear.forward`` through
    ``FastDoraLinearVariant.forward`` and ``FastDoraLinearLayer.forward`` -- base layer, PEFT's input cast,
    ``lora_A``, ``lora_B``, the cached norm (the key of ``_fd_weight_norm``; anything but a hit goes through that
    method), PEFT's ``_dora_cache`` bookkeeping, the fused composition -- so outputs, gradients and the recorded paths
    are identical. Every other call goes to the class's own ``forward`` (PEFT's, which routes through the fastdora
    variant as before): extra arguments (``adapter_names``, variant kwargs), adapters disabled or merged, not exactly
    one active adapter present on the layer, an adapter not converted to fastdora, dropout in training mode, hooks
    on the magnitude module or global module hooks, distributed engines, JIT tracing. The base layer, ``lora_A`` and
    ``lora_B`` are called as modules unless they are bare ``nn.Linear`` modules (then ``F.linear`` on their
    parameters: what their call runs).

    Under ``torch.compile`` Dynamo traces this function too: the class's chain computes the same (less the exact
    input-cast round trip below), but reads more module attributes, each a guard checked at every call of the compiled
    region (about a sixth more for a decoder layer). Traced, the norm comes from ``_fd_weight_norm`` (the model's norm
    slot, else the norm op) and the C++ node is not taken.

    One operation is left out where leaving it out is exact: under autocast with fp32 adapters and activations in
    the autocast dtype (HF Trainer's AMP), PEFT's cast of the input to fp32 before ``lora_A`` is undone by
    autocast's cast back inside ``F.linear`` (``_autocast_round_trip``). Skipping both gives the same ``lora_A``
    product and the same input gradient values (both casts and their backward casts are exact), and saves two
    activation-sized passes per layer forward and two in its backward. Only the order in which autograd sums the
    input gradient's contributions from several layers (q/k/v reading one input) may differ with the shorter graph.

    With ``layer_node`` (default), where the base layer, ``lora_A`` and ``lora_B`` are bare ``nn.Linear`` modules
    (bias-free adapters, frozen base weight and bias), no input cast is needed and ``fastdora.dispatch.layer_node``
    finds the C++ node on the Triton path, the three products and the composition run as that node's one autograd
    node (``dora_linear``): the same operations, bitwise the same outputs and gradients."""
    compiling = _is_compiling()
    a = module._active_adapter
    if type(a) is list:
        a = a[0] if len(a) == 1 else None
    mods = module._modules
    lora_A = mods["lora_A"]._modules.get(a) if a is not None else None
    if (
        lora_A is None
        or args
        or kwargs
        or module._disable_adapters
        or module.merged_adapters
        or (not compiling and _tracing())
        or _distributed.active()
        or type(module.lora_variant.get(a)) is not FastDoraLinearVariant
    ):
        return type(module).forward(module, x, *args, **kwargs)
    mag = mods["lora_magnitude_vector"]._modules.get(a)
    opts = mag.__dict__.get("_fastdora_options") or default_options()
    if (
        type(mag) is not FastDoraLinearLayer
        or not _S.lean_forward
        or (module.training and type(mods["lora_dropout"]._modules[a]) is not nn.Identity)
        or _global_hooks()
        or _own_hooks(mag)
    ):
        return type(module).forward(module, x, *args, **kwargs)
    lora_B = mods["lora_B"]._modules[a]
    scaling = module.scaling[a]
    base = mods["base_layer"]
    bare_base = _bare_linear(base)
    a_weight = lora_A._parameters["weight"]
    bare_a = _bare_linear(lora_A) and lora_A._parameters["bias"] is None
    b_weight = lora_B._parameters["weight"]
    plain_b = _bare_linear(lora_B) and lora_B._parameters["bias"] is None
    x_dtype = x.dtype  # the dtype PEFT's LoRA branch computes in (eps below)
    cast_x = False
    if x_dtype != a_weight.dtype and getattr(module, "cast_input_dtype_enabled", True):
        x_dtype = a_weight.dtype
        cast_x = not (bare_a and _autocast_round_trip(x, a_weight.dtype))
    if bare_base and bare_a and plain_b and not cast_x and _S.layer_node and not compiling:
        weight, bias = base._parameters["weight"], base._parameters["bias"]
        m = mag._parameters["weight"]
        node = None
        if not (weight.requires_grad or (bias is not None and bias.requires_grad)):
            node = _dispatch.layer_node(x, weight, m, opts.kernels)
        if node is not None:  # the whole layer as one autograd node (the C++ node's dora_linear)
            norm = _lean_norm(mag, a, opts, base, lora_A, lora_B, a_weight, b_weight, scaling)
            mag._fd_peft_cache(a, norm)
            record(_LINEAR_TRITON)
            train = m.requires_grad and torch.is_grad_enabled()
            discard = train and saves_discarded()
            from_y = (train and bias is None and opts.dm_from_output and _linear_out_dtype(x) in _FROM_Y_DTYPES
                      and _magnitude_nonzero(mag, m))
            return node.dora_linear(x, weight, bias, a_weight, b_weight, m, norm, float(scaling), eps_for(x_dtype),
                                    discard, from_y)
    if bare_base:
        result = F.linear(x, base._parameters["weight"], base._parameters["bias"])
    else:
        result = base(x)
    if cast_x:
        x = module._cast_input_dtype(x, a_weight.dtype)
    h = F.linear(x, a_weight) if bare_a else lora_A(x)
    lora = F.linear(h, b_weight) if plain_b else lora_B(h)
    base_layer = base if "base_layer" not in base._modules else module.get_base_layer()
    norm = _lean_norm(mag, a, opts, base_layer, lora_A, lora_B, a_weight, b_weight, scaling, compiling)
    mag._fd_peft_cache(a, norm)
    return dora_compose(result, lora, mag._parameters["weight"], norm, scaling, eps_for(x_dtype),
                        bias=getattr(base_layer, "bias", None), out_dtype=result.dtype, kernels=opts.kernels,
                        kind="linear")


_LINEAR_TRITON = path_key("linear", "triton")

# below this magnitude, dm = sum(dy * y) / m is not taken (y = g * inner with g = m / max(norm, eps): for |m| >= 1e-20
# and row norms below 1e6, g stays above 1e-26, far from bf16 / fp32 underflow at 1.2e-38)
_MAGNITUDE_FLOOR = 1e-20


# the output dtypes for which the C++ node may take dm from y (its dm_from_output rule: fp16's range loses y's low bits)
_FROM_Y_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (not fp64)
# magnitude modules of lean-forward layers (enable(model)'s and those checked once): a stale check batches every stale
# one on its device (_check_magnitudes)
CHECKED_MAGNITUDES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _linear_out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of ``F.linear(x, W)`` for a ``W`` of ``x``'s dtype (the base layer's output, the node's output):
    autocast's dtype for an fp32 / fp16 / bf16 ``x`` where autocast is on for its device, else ``x``'s."""
    dev = x.device.type
    if x.dtype in _AUTOCAST_ELIGIBLE and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _m_key(m: torch.Tensor) -> tuple:
    return (m.data_ptr(), m._version)


def _m_cached(mag: nn.Module, m: torch.Tensor) -> Optional[bool]:
    """The magnitude check's answer cached on ``mag`` for ``m`` as it is now (same tensor, storage and version), else
    None."""
    hit = mag.__dict__.get("_fastdora_m_nonzero")
    return hit[2] if hit is not None and hit[0] is m and hit[1] == _m_key(m) else None


def _m_store(mag: nn.Module, m: torch.Tensor, ok: bool) -> bool:
    mag.__dict__["_fastdora_m_nonzero"] = (m, _m_key(m), ok)
    return ok


def _magnitude_nonzero(mag: nn.Module, m: torch.Tensor) -> bool:
    """Whether every element of the magnitude ``m`` has ``|m| >= _MAGNITUDE_FLOOR`` (so that the whole-layer node may
    take the magnitude's gradient from its output, option ``dm_from_output``). Checked once per update of ``m`` (its
    storage and version counter) and cached on the magnitude module, so that a checkpoint's recomputation decides as
    its first forward did. The check is batched (:func:`_check_magnitudes`): after an optimizer step the first layer's
    forward checks every updated magnitude on its device with one host sync, the other layers find the answer cached.
    During a CUDA graph capture (no sync possible) the answer is False, cached for that version too."""
    ok = _m_cached(mag, m)
    if ok is not None:
        return ok
    if m.is_cuda and torch.cuda.is_current_stream_capturing():
        return _m_store(mag, m, False)
    CHECKED_MAGNITUDES.add(mag)
    return _check_magnitudes(mag, m)


def _stale_magnitude(mag: nn.Module, like: torch.Tensor) -> Optional[torch.Tensor]:
    """``mag``'s magnitude parameter if a batched check for ``like`` should include it: trainable, of ``like``'s type
    and device, and changed since its last check (or never checked)."""
    p = mag._parameters.get("weight")
    if (p is None or p is like or not p.requires_grad or type(p) is not type(like) or p.device != like.device
            or p.is_inference()):
        return None
    return p if _m_cached(mag, p) is None else None


def _check_magnitudes(mag: nn.Module, m: torch.Tensor) -> bool:
    """Check ``m`` and every other stale magnitude on its device (see :func:`_stale_magnitude`) in one pass: their
    elements concatenated (in the promoted dtype: exact for every float magnitude), one count of ``|m| < floor`` per
    magnitude from a cumulative sum, one host sync. Caches each answer under its magnitude's current key; returns
    ``m``'s."""
    group = [(mag, m)]
    for other in list(CHECKED_MAGNITUDES):
        p = None if other is mag else _stale_magnitude(other, m)
        if p is not None:
            group.append((other, p))
    with torch.no_grad():
        flat = [p.detach().reshape(-1) for _, p in group]
        bad = torch.cat(flat).abs() < _MAGNITUDE_FLOOR
        ends = torch.tensor([0] + [t.numel() for t in flat], device=bad.device).cumsum(0)
        counts = torch.cat([bad.new_zeros(1, dtype=torch.int64), bad.cumsum(0)])[ends]  # bad ones before each end
        oks = [c == 0 for c in torch.diff(counts).tolist()]
    for (module, p), ok in zip(group, oks):
        _m_store(module, p, ok)
    return oks[0]


def _lean_norm(mag, a, opts, base_layer, lora_A, lora_B, a_weight, b_weight, scaling, compiling=False):
    """The lean forward's norm: a cache hit checked here with ``_fd_weight_norm``'s key (``cache.local_key``); anything
    else through that method, which is also the traced path (``compiling``: the norm slot, else the norm op; the key
    reads version counters)."""
    if not compiling and mag.__dict__.get("_fastdora_norm") and _S.cache_norm:
        key, wkey = _cache.local_key(_stored_weight(base_layer), a_weight, b_weight, scaling)
        hit = _cache.get(mag, a, key) if wkey is not None else None
        if hit is not None:
            return hit
    return mag._fd_linear_norm(base_layer, lora_A, lora_B, scaling, a)


def lean_install_safe() -> bool:
    """Whether a module's first call (PEFT's forward chain) may install the lean forward for its later calls: not while
    saved tensors go through hooks other than a checkpoint recomputation's. The lean forward's graph can differ from
    the chain's (the whole-layer node saves three tensors where the chain's nodes save six), and non-reentrant
    checkpointing requires its recomputation to save exactly what its first forward saved: a module first called in
    a checkpoint's first forward installs it in that checkpoint's recomputation (after which its first forward and
    recomputation both take it). ``fastdora.enable(model)`` installs it up front; this covers layers PEFT creates
    later (process-wide mode)."""
    hook = compat.top_pack_hook()
    return hook is None or getattr(hook, "__code__", None) in compat.RECOMPUTE_PACK_CODES


# The lean forward is an instance attribute ``forward``: a method bound to its module. ``torch.compile`` then guards on
# the function (one for every layer) and traces the module by its source, so every layer of a model shares one
# compiled graph (a per-module ``functools.partial`` is guarded by its identity: one graph per layer, measured on the
# H200 to hit dynamo's recompile limit and send the layers back to eager). Pickle rebuilds a bound method as
# ``getattr(module, name)``: the function is also a class attribute of PEFT's LoRA ``Linear`` under that name.
_LEAN_NAME = "_fastdora_lean_forward"
lean_linear_forward.__name__ = _LEAN_NAME
if _LoraLinear is not None:
    setattr(_LoraLinear, _LEAN_NAME, lean_linear_forward)


def install_lean_forward(module: nn.Module) -> bool:
    """Make ``module(x)`` run :func:`lean_linear_forward` (an instance attribute ``forward`` bound to the module:
    picklable and deep-copyable, one compiled graph for all layers). Only PEFT's LoRA ``Linear`` itself, and only
    where nothing else has replaced ``forward`` on the instance (e.g. accelerate's hooks). Returns whether it is
    installed."""
    if _LoraLinear is None or type(module) is not _LoraLinear:
        return False
    current = module.__dict__.get("forward")
    if current is not None:
        return _is_lean(current)
    module.__dict__["forward"] = types.MethodType(lean_linear_forward, module)
    return True


def remove_lean_forward(module: nn.Module) -> None:
    if _is_lean(module.__dict__.get("forward")):
        del module.__dict__["forward"]


def is_fastdora_forward(fn) -> bool:
    """Whether ``fn`` (a module's instance-level ``forward``) is fastdora's own lean forward (plugins tell it from a
    foreign one that may bypass PEFT's DoRA path)."""
    return type(fn) is types.MethodType and fn.__func__ is lean_linear_forward


_is_lean = is_fastdora_forward
