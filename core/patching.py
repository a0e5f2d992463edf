"""enable / disable: convert PEFT DoRA layers to fastdora (per model, or process-wide) and back."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional

from peft.tuners.lora import variants as peft_variants
import torch
from torch import nn

from . import cache as _cache
from . import config as _config
from . import layers as _layers
from . import slots as _slots

__all__ = ["EnableReport", "enable", "disable", "process_wide_enabled"]

_KIND_NAMES = {
    _layers.FastDoraLinearLayer: "linear",
    _layers.FastDoraEmbeddingLayer: "embedding",
    _layers.FastDoraConv1dLayer: "conv1d",
    _layers.FastDoraConv2dLayer: "conv2d",
    _layers.FastDoraConv3dLayer: "conv3d",
}
# which magnitude-layer class belongs with which variant class
_VARIANT_FOR_LAYER = {
    _layers.FastDoraLinearLayer: _layers.FastDoraLinearVariant,
    _layers.FastDoraEmbeddingLayer: _layers.FastDoraEmbeddingVariant,
    _layers.FastDoraConv1dLayer: _layers.FastDoraConv1dVariant,
    _layers.FastDoraConv2dLayer: _layers.FastDoraConv2dVariant,
    _layers.FastDoraConv3dLayer: _layers.FastDoraConv3dVariant,
}

_process_wide = False


@dataclasses.dataclass
class EnableReport:
    """What ``fastdora.enable`` did. ``str(report)`` is a one-paragraph summary for logs."""

    converted: dict = dataclasses.field(default_factory=dict)  # kind -> number of (layer, adapter) pairs
    skipped: list = dataclasses.field(default_factory=list)  # (module name, adapter, reason): left on stock PEFT
    already: int = 0  # pairs that were already converted (enable is idempotent)
    process_wide: bool = False
    disabled_reason: Optional[str] = None  # set when nothing was done (kill switch)
    options: Optional[_config.Options] = None
    native_node: Optional[str] = None  # the composition's C++ autograd node: "active" or why not (kernels/native.py)
    native_launch: Optional[str] = None  # how the active node launches: "direct" or why through Triton's launcher

    @property
    def total_converted(self) -> int:
        return sum(self.converted.values())

    @property
    def dora_layers_found(self) -> int:
        return self.total_converted + self.already + len(self.skipped)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["options"] = dataclasses.asdict(self.options) if self.options else None
        d["skipped"] = [list(s) for s in self.skipped]
        d["total_converted"] = self.total_converted
        return d

    def __str__(self) -> str:
        if self.disabled_reason:
            return f"fastdora: not enabled ({self.disabled_reason})"
        parts = []
        if self.process_wide:
            parts.append("process-wide mode on: DoRA layers PEFT creates from now on use fastdora")
        if self.converted or not self.process_wide:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.converted.items())) or "none"
            parts.append(f"converted {self.total_converted} DoRA layer(s) ({kinds})")
        if self.already:
            parts.append(f"{self.already} already converted")
        if self.skipped:
            reasons = collections.Counter(reason for _, _, reason in self.skipped)
            parts.append(
                f"{len(self.skipped)} left on stock PEFT: "
                + "; ".join(f"{n}x {r}" for r, n in reasons.most_common())
            )
        if self.options is not None:
            parts.append(f"kernels={self.options.kernels}")
        if self.native_node is not None:
            node = f"C++ composition node: {self.native_node}"
            if self.native_launch is not None and self.native_node == "active":
                node += f" (kernel launch: {self.native_launch})"
            parts.append(node)
        return "fastdora: " + "; ".join(parts)


def _lora_layers(model: nn.Module):
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            mags = getattr(module, "lora_magnitude_vector", None)
            if mags:
                yield name, module


def _why_unsupported(module, adapter: str, variant, mag) -> Optional[str]:
    fast_layer = _layers.FAST_OF.get(type(mag))
    if fast_layer is None:
        return f"magnitude module {type(mag).__name__} is not one of PEFT's DoRA layers"
    fast_variant = _layers.FAST_OF.get(type(variant))
    if fast_variant is None:
        return f"LoRA variant {type(variant).__name__} is not one of PEFT's DoRA variants"
    if _VARIANT_FOR_LAYER[fast_layer] is not fast_variant:
        return f"variant {type(variant).__name__} does not match magnitude layer {type(mag).__name__}"
    if hasattr(module, "lora_A") and adapter in module.lora_A:
        lora_A, lora_B = module.lora_A[adapter], module.lora_B[adapter]
        if getattr(lora_B, "bias", None) is not None:
            return "lora_B has a bias (lora_bias=True)"
        if not isinstance(lora_A.weight, nn.Parameter) or not isinstance(lora_B.weight, nn.Parameter):
            return "LoRA factors are not plain parameters"
    return None


def _convert_model(model: nn.Module, options: _config.Options, report: EnableReport) -> None:
    for name, module in _lora_layers(model):
        for adapter, mag in module.lora_magnitude_vector.items():
            variant = module.lora_variant.get(adapter) if hasattr(module, "lora_variant") else None
            if type(mag) in _layers.PEFT_OF and type(variant) in _layers.PEFT_OF:
                mag.__dict__["_fastdora_options"] = options
                mag._fd_invalidate()
                report.already += 1
                _install_lean(module, mag, options)
                continue
            reason = _why_unsupported(module, adapter, variant, mag)
            if reason is not None:
                report.skipped.append((name, adapter, reason))
                continue
            fast_layer = _layers.FAST_OF[type(mag)]
            mag.__class__ = fast_layer  # same object, same nn.Parameter, same state-dict keys
            mag.__dict__["_fastdora_options"] = options
            mag._fd_invalidate()
            module.lora_variant[adapter] = _layers.FAST_OF[type(variant)]()
            _install_lean(module, mag, options)
            kind = _KIND_NAMES[fast_layer]
            report.converted[kind] = report.converted.get(kind, 0) + 1


def _install_lean(module: nn.Module, mag: nn.Module, options: _config.Options) -> None:
    """The lean forward from the first call on (``fastdora.layers.install_lean_forward``; it checks every call's
    conditions itself): the first call then takes the same path as every later one, also in a checkpoint's first
    forward and its recomputation."""
    if _config.SETTINGS.lean_forward and type(mag) is _layers.FastDoraLinearLayer:
        if _layers.install_lean_forward(module):
            _layers.CHECKED_MAGNITUDES.add(mag)  # the magnitude check batches the model's layers from the first step


def _set_peft_globals(fast: bool) -> None:
    for name, peft_cls in _layers.PEFT_CLASSES.items():
        setattr(peft_variants, name, _layers.FAST_OF[peft_cls] if fast else peft_cls)


def process_wide_enabled() -> bool:
    return _process_wide


def enable(model: Optional[nn.Module] = None, **options: Any) -> EnableReport:
    """Switch fastdora on.

    With ``model`` (a PEFT model or any module containing PEFT LoRA layers): converts every DoRA layer in place.
    Without: process-wide mode; every DoRA layer PEFT creates afterwards in this process uses fastdora.
    Idempotent. Options are keyword-only (see ``fastdora.config.Options``); an unknown option raises ``TypeError``,
    a bad value ``ValueError``.
    """
    global _process_wide
    opts = _config.make_options(**options)
    report = EnableReport(options=opts)
    if _config.killed():
        report.disabled_reason = "kill switch FASTDORA=0 is set; stock PEFT runs"
        return report
    if model is None:
        _layers.set_default_options(opts)
        _set_peft_globals(True)
        _process_wide = True
        report.process_wide = True
        report.native_node, report.native_launch = _native_node(opts)
        return report
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastdora.enable(model=...) expects a torch.nn.Module, got {type(model).__name__}")
    _convert_model(model, opts, report)
    _slots.install(model)
    report.native_node, report.native_launch = _native_node(opts)
    return report


def _native_node(opts: _config.Options) -> tuple[str, Optional[str]]:
    """Build / import the C++ composition node now where it would serve this process (CUDA and Triton present, not
    ``kernels="eager"``), so its one-time compile and self-check happen here rather than in the first training step;
    ``(its status, how it launches)``."""
    if opts.kernels == "eager":
        return "not used (kernels='eager')", None
    if not torch.cuda.is_available():
        return "not used (no CUDA device)", None
    from . import dispatch

    if not dispatch.triton_available():
        return "not used (Triton not importable)", None
    from .kernels import native

    dispatch.native_node()
    return native.status(), (native.launch_status() if native.NODE is not None else None)


def disable(model: Optional[nn.Module] = None) -> int:
    """Back to stock PEFT: for ``model`` (returns the number of layers restored), or end the process-wide mode
    (returns 0). Parameters and checkpoints are untouched."""
    global _process_wide
    if model is None:
        _set_peft_globals(False)
        _layers.set_default_options(None)
        _process_wide = False
        return 0
    restored = 0
    _slots.uninstall(model)
    for _, module in _lora_layers(model):
        _layers.remove_lean_forward(module)
        for adapter, mag in module.lora_magnitude_vector.items():
            variant = module.lora_variant.get(adapter)
            if type(variant) in _layers.PEFT_OF:
                module.lora_variant[adapter] = _layers.PEFT_OF[type(variant)]()
            if type(mag) in _layers.PEFT_OF:
                mag.__class__ = _layers.PEFT_OF[type(mag)]
                for attr in ("_fastdora_options",) + _cache.ATTRS:
                    mag.__dict__.pop(attr, None)
                restored += 1
    return restored
