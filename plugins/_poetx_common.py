"""Shared logic of the POET-X trainer plugins (no math: that is :mod:`fastdora.poetx`; no framework imports).

Every POET-X plugin goes through these helpers so that all of them take the same options (:data:`OPTION_NAMES`,
validated by :func:`collect_options` before a model loads), refuse the same bad models (:func:`check_model`),
convert the same way (:func:`convert_for_training`), give the ``Q`` parameters the same optimizer group
(:func:`split_q_group`), reset the same optimizer state at a merge (:func:`reset_state`), log the same one line
(:func:`announce`) and write the same ``poetx_report.json`` (one file per rank).
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Optional

from ._common import get_logger, process_rank, report_file_for_rank, unwrap_model, write_report

__all__ = [
    "OPTION_NAMES",
    "DEFAULTS",
    "REPORT_FILE",
    "collect_options",
    "check_model",
    "convert_for_training",
    "q_parameters",
    "split_q_group",
    "reset_state",
    "merge_due",
    "summary_line",
    "announce",
    "report_payload",
    "write_rank_report",
]

#: The public POET-X options, with a user's reason each:
#: ``block_size`` (quality and cost: larger blocks mix more features per step, at a higher cost per layer),
#: ``merge_interval`` (optimizer steps between merges; the paper's recipes use 200),
#: ``mode`` ("fast" keeps one more activation per layer, "mem" recomputes it: least memory),
#: ``lr_scale`` (the ``Q`` parameters' learning rate as a fraction of the trainer's; the paper uses about half),
#: ``exclude`` (layer names left as plain ``nn.Linear``, e.g. the output head),
#: ``weight_format`` ("dense" keeps the frozen weights as they are, "int8" holds them as group-wise int8 codes with
#: float32 scales, groups of 128 input features: about a quarter of float32's weight memory; layers whose
#: ``in_features`` 128 does not divide are skipped and listed).
OPTION_NAMES = ("block_size", "merge_interval", "mode", "lr_scale", "exclude", "weight_format")

DEFAULTS = {"block_size": 256, "merge_interval": 200, "mode": "fast", "lr_scale": 0.5, "exclude": ("lm_head",),
            "weight_format": "dense"}

#: Written into the trainer's output directory: by rank 0 under this name, by rank N as ``poetx_report.rank<N>.json``.
REPORT_FILE = "poetx_report.json"

_ANNOUNCED = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _exclude_tuple(value: Any) -> tuple:
    """``exclude`` as a tuple of names: a list / tuple of strings, or one string (comma-separated names allowed, the
    way LLaMA-Factory and Axolotl write lists in a YAML scalar)."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"POET-X: exclude must be a list of layer names or a comma-separated string, got {value!r}")
    if not all(isinstance(v, str) and v.strip() for v in items):
        raise ValueError(f"POET-X: exclude must hold non-empty layer names, got {value!r}")
    return tuple(v.strip() for v in items)


def collect_options(**options: Any) -> dict:
    """All of :data:`OPTION_NAMES`, validated: ``None`` takes the default (:data:`DEFAULTS`). Raises ``TypeError`` for
    an unknown option and ``ValueError`` naming the option for a bad value, so that a typo fails when the plugin is
    configured, before the model loads."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"POET-X: unknown option(s) {unknown}; valid options: {list(OPTION_NAMES)}")
    out = {k: (DEFAULTS[k] if options.get(k) is None else options[k]) for k in OPTION_NAMES}
    if not _is_int(out["block_size"]) or out["block_size"] < 2:
        raise ValueError(f"POET-X: block_size must be an int >= 2, got {out['block_size']!r}")
    if not _is_int(out["merge_interval"]) or out["merge_interval"] <= 0:
        raise ValueError(f"POET-X: merge_interval must be an int > 0 (optimizer steps), got {out['merge_interval']!r}")
    from fastdora.poetx.ops import MODES

    if out["mode"] not in MODES:
        raise ValueError(f"POET-X: mode must be one of {list(MODES)}, got {out['mode']!r}")
    scale = out["lr_scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"POET-X: lr_scale must be a number > 0, got {scale!r}")
    out["lr_scale"] = float(scale)
    out["exclude"] = _exclude_tuple(out["exclude"])
    from fastdora.poetx.layer import WEIGHT_FORMATS

    if not isinstance(out["weight_format"], str) or out["weight_format"] not in WEIGHT_FORMATS:
        raise ValueError(f"POET-X: weight_format must be one of {list(WEIGHT_FORMATS)}, got {out['weight_format']!r}")
    return out


# --------------------------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------------------------
def _excluded(name: str, exclude: Iterable[str]) -> bool:
    padded = f".{name}."
    return any(f".{e}." in padded for e in exclude)


def check_model(model: Any, exclude: Iterable[str] = ()) -> None:
    """Raise ``ValueError`` for a model POET-X cannot train as asked: one that is already converted, or one with PEFT
    adapter layers (LoRA / DoRA) that are not excluded (an adapter and POET-X on the same layer are not supported)."""
    from fastdora.poetx import PoetXLinear

    inner = unwrap_model(model)
    if any(isinstance(m, PoetXLinear) for m in inner.modules()):
        raise ValueError(
            "POET-X: the model is already converted (it contains PoetXLinear layers); give the trainer the original "
            "model (a POET-X checkpoint is resumed with resume_from_checkpoint, not by converting twice)"
        )
    adapters = [name for name, m in inner.named_modules()
                if (hasattr(m, "lora_A") or hasattr(m, "base_layer")) and not _excluded(name, exclude)]
    if adapters:
        raise ValueError(
            f"POET-X: {len(adapters)} layer(s) carry a PEFT adapter (LoRA / DoRA), e.g. {adapters[0]!r}: POET-X and an "
            "adapter on the same layer are not supported. Train the base model without an adapter (POET-X replaces "
            "it), or list those layers in exclude."
        )


def convert_for_training(model: Any, options: dict, seed: int = 0):
    """:func:`check_model`, then :func:`fastdora.poetx.convert` (in place; permutations seeded by ``seed``, the same
    on every rank). Raises ``ValueError`` with every skip reason when no layer can be converted (e.g. ``block_size``
    larger than, or not dividing, every layer's features). Returns the core's ``ConvertReport``."""
    from fastdora import poetx

    check_model(model, options["exclude"])
    inner = unwrap_model(model)
    weight_format = options.get("weight_format", DEFAULTS["weight_format"])
    report = poetx.convert(inner, block_size=options["block_size"], merge_interval=options["merge_interval"],
                           mode=options["mode"], exclude=options["exclude"], seed=int(seed),
                           weight_format=weight_format)
    if not report.converted:
        reasons = "; ".join(f"{n}: {r}" for n, r in list(report.skipped.items())[:8])
        more = len(report.skipped) - 8
        fix = "pick a block_size that divides the layers' in_features and out_features"
        if weight_format == "int8":
            fix += f" (and weight_format 'int8' needs in_features divisible by {report.group_size})"
        raise ValueError(
            f"POET-X converted no layer of {type(inner).__name__} with block_size={options['block_size']}"
            f"{', weight_format=' + repr(weight_format) if weight_format != 'dense' else ''} "
            f"({reasons}{f'; and {more} more' if more > 0 else ''}); {fix}"
        )
    return report


def q_parameters(model: Any) -> list:
    """The ``q_in`` / ``q_out`` parameters of every POET-X layer of ``model``, in model order."""
    from fastdora.poetx import PoetXLinear

    out = []
    for m in unwrap_model(model).modules():
        if isinstance(m, PoetXLinear):
            out += [m.q_in, m.q_out]
    return out


# --------------------------------------------------------------------------------------------------------------
# the optimizer
# --------------------------------------------------------------------------------------------------------------
def base_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside accelerate's / SageMaker's wrappers (their ``.optimizer``)."""
    seen = set()
    while getattr(optimizer, "optimizer", None) is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer if hasattr(optimizer, "add_param_group") else None


def split_q_group(optimizer: Any, q_params: list, lr_scale: float) -> list:
    """Move the ``Q`` parameters out of the optimizer's param groups into groups of their own: for each group that
    holds some, one new group with the same settings, ``lr`` times ``lr_scale`` and no weight decay (decay would pull
    the rotations towards the identity, not regularise the weights). Done right after the trainer builds its
    optimizer, before its learning-rate scheduler, which then schedules the new groups like the others. Returns the
    new groups. Raises ``ValueError`` when the optimizer does not hold every ``Q`` parameter."""
    opt = base_optimizer(optimizer)
    if opt is None:
        raise ValueError(f"POET-X: the trainer's optimizer {type(optimizer).__name__} has no param groups")
    wanted = {id(p) for p in q_params}
    found: set = set()
    new_groups = []
    for group in list(opt.param_groups):
        mine = [p for p in group["params"] if id(p) in wanted]
        if not mine:
            continue
        found.update(id(p) for p in mine)
        group["params"] = [p for p in group["params"] if id(p) not in wanted]
        settings = {k: v for k, v in group.items() if k != "params"}
        for key in ("lr", "initial_lr"):
            if key in settings:
                settings[key] = settings[key] * lr_scale
        if "weight_decay" in settings:
            settings["weight_decay"] = 0.0
        new_groups.append({**settings, "params": mine})
    if found != wanted:
        raise ValueError(
            f"POET-X: the trainer's optimizer holds {len(found)} of the {len(wanted)} Q parameters; POET-X needs the "
            "trainer to build its optimizer over the converted model's trainable parameters"
        )
    for group in new_groups:
        opt.add_param_group(group)
    return new_groups


def reset_state(optimizer: Any, params: list) -> int:
    """Forget the optimizer's state of ``params`` (moments and step count): their next step is a fresh optimizer's
    first step. Returns how many had state."""
    opt = base_optimizer(optimizer)
    if opt is None:
        return 0
    return sum(opt.state.pop(p, None) is not None for p in params)


def merge_due(global_step: int, merge_interval: int) -> bool:
    """A merge follows optimizer step ``global_step`` (counted from 1) when it is a multiple of ``merge_interval``."""
    return global_step > 0 and global_step % merge_interval == 0


# --------------------------------------------------------------------------------------------------------------
# what the user sees
# --------------------------------------------------------------------------------------------------------------
def summary_line(report: Any, options: dict) -> str:
    """e.g. ``fastdora POET-X: converted 14 linear layer(s) (block_size=256, mode='fast', merge every 200 steps,
    Q learning rate 0.5x); 2 skipped (see poetx_report.json)``."""
    line = (f"fastdora POET-X: converted {len(report.converted)} linear layer(s) (block_size={report.block_size}, "
            f"mode={report.mode!r}, merge every {report.merge_interval} steps, Q learning rate "
            f"{options['lr_scale']:g}x"
            + (f", int8 weights in groups of {report.group_size}" if report.weight_format == "int8" else "") + ")")
    if report.skipped:
        line += f"; {len(report.skipped)} skipped (see {REPORT_FILE})"
    return line


def announce(report: Any, options: dict, logger: Any = None) -> bool:
    """Log :func:`summary_line` once per process (``[rank N]`` first in a job of several processes). Returns whether
    it logged now."""
    global _ANNOUNCED
    if report is None or _ANNOUNCED:
        return False
    _ANNOUNCED = True
    line = summary_line(report, options)
    rank, world = process_rank()
    if world > 1:
        line = f"[rank {rank}] {line}"
    (logger or get_logger()).info("%s", line)
    return True


def report_payload(report: Any, options: dict, framework: str, merges: list, args: Any = None,
                   q_lr: Optional[list] = None) -> dict:
    """A JSON-able summary: the options, the converted layers, every skipped layer with its reason, the merges this
    process made (optimizer steps), the ``Q`` groups' learning rates and this process's rank."""
    rank, world = process_rank(args)
    payload: dict = {"framework": framework, "method": "poetx", "plugin_options": {**options,
                                                                                   "exclude": list(options["exclude"])},
                     "rank": rank, "world_size": world, "pid": os.getpid()}
    if report is not None:
        payload.update(converted=list(report.converted), skipped=dict(report.skipped),
                       trainable_parameters=int(report.trainable_parameters), seed=int(report.seed),
                       terms=int(report.terms), weight_format=report.weight_format,
                       group_size=int(report.group_size), report=str(report))
    payload.update(merges_at_steps=list(merges), q_group_lr=q_lr)
    return payload


def write_rank_report(output_dir: Optional[str], payload: dict, args: Any = None,
                      filename: str = REPORT_FILE) -> Optional[str]:
    rank, _ = process_rank(args)
    return write_report(output_dir, payload, report_file_for_rank(filename, rank))
