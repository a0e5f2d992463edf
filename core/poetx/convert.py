"""Model-level POET-X: :func:`convert` a model's linear layers, :func:`merge` them, :func:`export` a plain model."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from torch import nn

from . import batch as _batch
from . import quant
from .layer import WEIGHT_FORMATS, PoetXLinear
from .ops import MODES

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch built without torch.distributed
    FSDPModule = None

__all__ = ["ConvertReport", "convert", "merge", "export", "PEFT_REASON"]

PEFT_REASON = "has a PEFT adapter (DoRA and POET-X on the same layer are not supported)"


@dataclasses.dataclass
class ConvertReport:
    """What :func:`convert` did.

    Attributes:
        converted: dotted names of the layers now :class:`~fastdora.poetx.PoetXLinear`, in model order (their
            ``layer_index``).
        skipped: dotted name -> reason, for every linear layer (and PEFT adapter layer) left as it was.
        trainable_parameters: number of ``q_in`` / ``q_out`` values added.
        block_size, merge_interval, mode, terms, seed, from_scratch_normalize: the settings used;
            ``merge_interval`` is the schedule for the training loop (merge every that many optimizer steps).
        weight_format, group_size: how the converted layers hold their weights ("dense", or "int8" with that group
            size).
    """

    converted: list[str]
    skipped: dict[str, str]
    trainable_parameters: int
    block_size: int
    merge_interval: int
    mode: str
    terms: int
    seed: int
    from_scratch_normalize: bool
    weight_format: str = "dense"
    group_size: int = quant.GROUP_SIZE

    def __str__(self) -> str:
        lines = [
            f"POET-X: converted {len(self.converted)} linear layers (block_size={self.block_size}, mode={self.mode!r}, "
            f"terms={self.terms}, merge every {self.merge_interval} steps), {self.trainable_parameters:,} trainable "
            f"values" + (", weight rows normalised" if self.from_scratch_normalize else "")
            + (f", int8 weights in groups of {self.group_size}" if self.weight_format == "int8" else "")
        ]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(block_size, merge_interval, mode, terms, exclude, seed, weight_format, group_size) -> tuple[str, ...]:
    if not _is_int(block_size) or block_size <= 1:
        raise ValueError(f"block_size must be an int > 1, got {block_size!r}")
    if not _is_int(merge_interval) or merge_interval <= 0:
        raise ValueError(f"merge_interval must be an int > 0, got {merge_interval!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not _is_int(terms) or terms < 1:
        raise ValueError(f"terms must be an int >= 1, got {terms!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if not _is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    if not all(isinstance(e, str) and e for e in exclude):
        raise ValueError(f"exclude must be non-empty strings, got {exclude!r}")
    return exclude


def _excluded_by(name: str, exclude: tuple[str, ...]) -> Optional[str]:
    """The first entry of ``exclude`` that is a whole-component dotted sub-path of ``name``, else None."""
    padded = f".{name}."
    return next((e for e in exclude if f".{e}." in padded), None)


def _is_peft_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") or hasattr(module, "base_layer")


def _skip_reason(linear: nn.Linear, name: str, block_size: int, exclude, shared: set,
                 group_size: Optional[int]) -> Optional[str]:
    if type(linear) is not nn.Linear:
        return f"is a {type(linear).__name__} (a subclass of nn.Linear): only plain nn.Linear layers are converted"
    entry = _excluded_by(name, exclude)
    if entry is not None:
        return f"excluded by {entry!r}"
    weight = linear.weight
    if not weight.is_floating_point():
        return f"its weight is {weight.dtype}, not floating point"
    if weight.is_meta:
        return "its weight is on the meta device (not materialised)"
    if id(weight) in shared:
        return "its weight is shared with another module (tied weights)"
    for what, size in (("in_features", linear.in_features), ("out_features", linear.out_features)):
        if block_size > size:
            return f"block_size {block_size} exceeds {what} {size}"
        if size % block_size:
            return f"{what} {size} is not divisible by block_size {block_size}"
    if group_size is not None and linear.in_features % group_size:
        return f"in_features {linear.in_features} is not divisible by group_size {group_size} (weight_format 'int8')"
    return None


def convert(
    model: nn.Module,
    block_size: int = 256,
    merge_interval: int = 200,
    mode: str = "fast",
    terms: int = 3,
    exclude: Iterable[str] = ("lm_head",),
    seed: int = 0,
    from_scratch_normalize: bool = False,
    weight_format: str = "dense",
    group_size: int = quant.GROUP_SIZE,
) -> ConvertReport:
    """Replace, in place, every plain ``nn.Linear`` of ``model`` by a :class:`~fastdora.poetx.PoetXLinear`.

    Converted layers compute what they computed before (``Q = 0``; up to floating-point summation order: a layer
    stores its weight in the frame of its permutations, so its GEMM adds the same products in another order, and adds
    the bias after the GEMM), unless ``from_scratch_normalize`` is set: then each weight row is
    scaled to unit L2 norm first (the normalised initialisation for training from scratch; it changes the function).
    Layers are skipped, with the reason in the report, when they are excluded, a subclass of ``nn.Linear``
    (quantised or special-purpose layers), inside a PEFT adapter layer, tied to another module, or their features
    are smaller than or not divisible by ``block_size`` (or, with ``weight_format="int8"``, ``in_features`` is not
    divisible by ``group_size``). With "int8", each converted layer computes what ``nn.Linear`` with the dequantised
    weight computes (the quantisation is the only change, within float32 rounding), and the floating-point weight is
    released when the model held its only reference.

    Args:
        model: the model (not itself an ``nn.Linear``: wrap a lone layer in :class:`~fastdora.poetx.PoetXLinear`).
        block_size: the orthogonal blocks' size ``b``, an int > 1.
        merge_interval: optimizer steps between merges (recorded in the report for the training loop), an int > 0.
        mode: "fast" or "mem" (:mod:`fastdora.poetx.ops`).
        terms: Neumann powers of the Cayley series, an int >= 1.
        exclude: a module is excluded when an entry is a whole-component dotted sub-path of its name ("lm_head"
            excludes "lm_head" and "model.lm_head"; "layers.0" excludes everything under any "layers.0").
        seed: the permutations' seed (with each layer's index and merge count).
        from_scratch_normalize: see above.
        weight_format: "dense" (the weights as they are) or "int8" (group-wise int8 codes and float32 scales,
            :mod:`fastdora.poetx.quant`).
        group_size: consecutive input features per int8 scale (default 128); used with "int8" only.

    Raises:
        ValueError: invalid settings, ``model`` already converted, or ``model`` itself an ``nn.Linear``.
    """
    exclude = _validate(block_size, merge_interval, mode, terms, exclude, seed, weight_format, group_size)
    int8_group = group_size if weight_format == "int8" else None
    if isinstance(model, nn.Linear):
        raise ValueError("convert() replaces the linear layers inside a model; wrap a single nn.Linear with "
                         "PoetXLinear(layer, block_size) instead")
    if any(isinstance(m, PoetXLinear) for m in model.modules()):
        raise ValueError("the model is already converted to POET-X (it contains PoetXLinear layers)")

    seen, shared = set(), set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))

    converted: list[str] = []
    skipped: dict[str, str] = {}
    trainable = 0

    def visit(parent: nn.Module, prefix: str) -> None:
        nonlocal trainable
        for child_name, child in list(parent.named_children()):
            name = f"{prefix}{child_name}"
            if _is_peft_layer(child):
                skipped[name] = PEFT_REASON
            elif isinstance(child, nn.Linear):
                reason = _skip_reason(child, name, block_size, exclude, shared, int8_group)
                if reason is not None:
                    skipped[name] = reason
                    continue
                if from_scratch_normalize:
                    with torch.no_grad():
                        w = child.weight
                        w.copy_(w.float() / torch.linalg.vector_norm(w.float(), dim=1, keepdim=True))
                layer = PoetXLinear(child, block_size, mode=mode, terms=terms, seed=seed, layer_index=len(converted),
                                    weight_format=weight_format, group_size=group_size)
                setattr(parent, child_name, layer)
                converted.append(name)
                trainable += layer.q_in.numel() + layer.q_out.numel()
            else:
                visit(child, f"{name}.")

    visit(model, "")
    # one Cayley series per forward for all fast-mode layers (fastdora.poetx.batch)
    _batch.install(model, [m for m in model.modules() if isinstance(m, PoetXLinear)])
    return ConvertReport(converted, skipped, trainable, block_size, merge_interval, mode, terms, seed,
                         from_scratch_normalize, weight_format, group_size)


def merge(model: nn.Module) -> int:
    """:meth:`~fastdora.poetx.PoetXLinear.merge` every POET-X layer of ``model``; returns how many were merged.

    Under FSDP2 every rank calls it (between optimizer steps, like the plain case). It first reshards the model's
    FSDP modules (``FSDPModule.reshard``: local, no communication), so that the merge writes the sharded parameters
    FSDP gathers from, not an unsharded copy left by a forward (FSDP keeps the root's parameters unsharded after a
    forward); each layer's merge then all-gathers its ``W``, ``q_in`` and ``q_out`` (three all-gathers per layer, no
    broadcast: :mod:`fastdora.poetx.layer`)."""
    if FSDPModule is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    layers = [m for m in model.modules() if isinstance(m, PoetXLinear)]
    for layer in layers:
        layer.merge()
    return len(layers)


def export(model: nn.Module) -> nn.Module:
    """Replace, in place, every POET-X layer by its :meth:`~fastdora.poetx.PoetXLinear.to_linear`; returns the model
    (the new ``nn.Linear`` when ``model`` itself is a POET-X layer). The result has the original model's state-dict
    keys and loads into a fresh copy of the original architecture."""
    if isinstance(model, PoetXLinear):
        return model.to_linear()
    _batch.uninstall(model)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, PoetXLinear):
                setattr(parent, child_name, child.to_linear())
    return model
