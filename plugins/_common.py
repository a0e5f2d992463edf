"""Shared helpers of the trainer plugins (no math, no framework imports).

Every plugin funnels through :func:`enable_on` so that all of them expose the same options, unwrap the same
wrappers, warn the same way for models without DoRA, announce the conversion with the same one line
(:func:`announce`) and write the same ``fastdora_report.json`` (one file per rank: :func:`report_file_for_rank`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import Any, Callable, Optional

__all__ = [
    "OPTION_NAMES",
    "REPORT_FILE",
    "collect_options",
    "unwrap_model",
    "has_dora",
    "enable_on",
    "get_logger",
    "summary_line",
    "announce",
    "process_rank",
    "report_file_for_rank",
    "report_payload",
    "write_report",
    "is_main_process",
    "is_fastdora_forward",
    "foreign_forward_modules",
]

#: The core's public options (``fastdora.enable(**options)``, ``fastdora.config.Options``); every plugin exposes
#: exactly these.
OPTION_NAMES = ("kernels", "legacy_embedding_compose", "dm_from_output")

#: Written into the trainer's output directory at the end of training: by rank 0 under this name, by every other
#: rank as ``fastdora_report.rank<N>.json`` (:func:`report_file_for_rank`).
REPORT_FILE = "fastdora_report.json"

#: The library logger of fastdora (see :func:`get_logger`).
LOGGER_NAME = "fastdora"

_LOGGER_READY = False
_ANNOUNCED = False

_WRAPPERS = {
    "DistributedDataParallel",
    "DataParallel",
    "DeepSpeedEngine",
    "PipelineEngine",
    "FullyShardedDataParallel",
}


def collect_options(**options: Any) -> dict:
    """Drop the options left at ``None`` (the core's default / environment applies) and validate the rest now,
    so that a typo fails when the plugin is configured, not after the model has loaded."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"fastdora: unknown option(s) {unknown}; valid options: {list(OPTION_NAMES)}")
    chosen = {k: v for k, v in options.items() if v is not None}
    from fastdora.config import make_options

    make_options(**chosen)  # raises TypeError / ValueError naming the bad option
    return chosen


def unwrap_model(model: Any) -> Any:
    """Peel DDP / DeepSpeed / FSDP-style ``.module`` wrappers and ``torch.compile``'s ``_orig_mod``."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if inner is not None:
            model = inner
            continue
        # DDP, DataParallel, DeepSpeed engines and FSDP1 hold the real model in `.module`.
        if type(model).__name__ in _WRAPPERS:
            inner = getattr(model, "module", None)
            if inner is not None and hasattr(inner, "modules"):
                model = inner
                continue
        break
    return model


def has_dora(model: Any) -> bool:
    """True when some module carries a non-empty PEFT ``lora_magnitude_vector`` (a DoRA adapter)."""
    modules = getattr(model, "modules", None)
    if modules is None:
        return False
    for m in modules():
        mags = getattr(m, "lora_magnitude_vector", None)
        if mags is not None and len(mags) > 0:
            return True
    return False


def enable_on(model: Any, options: dict, logger: Optional[logging.Logger] = None, who: str = "fastdora"):
    """Convert the DoRA layers of ``model`` (unwrapped first). Returns the EnableReport, or ``None`` (with a clear
    warning) when the model has no DoRA layer: then nothing of fastdora is touched."""
    log = logger or get_logger("fastdora.plugins")
    inner = unwrap_model(model)
    if inner is None:
        return None
    if not has_dora(inner):
        log.warning(
            "%s: the model has no DoRA layer (no PEFT LoRA adapter with use_dora=True was found); "
            "fastdora does nothing for it.",
            who,
        )
        return None
    import fastdora

    report = fastdora.enable(inner, **options)
    if getattr(report, "disabled_reason", None):
        log.warning("%s: %s", who, report)
    return report


# --------------------------------------------------------------------------------------------------------------
# what the user sees: one line per process at default verbosity
# --------------------------------------------------------------------------------------------------------------
def get_logger(name: str = LOGGER_NAME) -> logging.Logger:
    """fastdora's library logger (or a child of it), set up on first use the way ``transformers`` sets up its own:
    when neither the ``fastdora`` logger nor the root logger has a handler, ``fastdora`` gets a stderr handler
    (``%(message)s``) and stops propagating; its level is INFO unless someone set one. So the plugins' INFO line
    shows at default verbosity under HF Trainer / TRL (whose ``transformers`` logger stays at WARNING), and goes
    through the application's handlers where it configured logging. Silence it with
    ``logging.getLogger("fastdora").setLevel(logging.WARNING)``."""
    global _LOGGER_READY
    if not _LOGGER_READY:
        _LOGGER_READY = True
        lib = logging.getLogger(LOGGER_NAME)
        if not lib.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            lib.addHandler(handler)
            lib.propagate = False
        if lib.level == logging.NOTSET:
            lib.setLevel(logging.INFO)
    return logging.getLogger(name)


def _paths_summary(report: Any) -> str:
    """Which implementation runs, from the report's options and C++-node status (no decision is made here)."""
    options = getattr(report, "options", None)
    kernels = getattr(options, "kernels", None)
    node = str(getattr(report, "native_node", None) or "")
    if kernels == "eager":
        return "eager PyTorch path (kernels='eager')"
    if node == "active":
        launch = getattr(report, "native_launch", None)
        if launch and launch != "direct":  # e.g. an unverified Triton version: Triton's own launcher runs
            return f"Triton kernels, C++ node active, kernel launch through {launch}"
        return "Triton kernels, C++ node active"
    if node.startswith("not used (") and node.endswith(")"):
        reason = node[len("not used (") : -1]
        if reason in ("no CUDA device", "Triton not importable"):
            return f"eager PyTorch path ({reason})"
    if node:
        return f"Triton kernels, C++ node: {node}"
    return f"kernels={kernels}" if kernels else ""


def _non_default_options(report: Any) -> str:
    options = getattr(report, "options", None)
    if options is None or not dataclasses.is_dataclass(options):
        return ""
    changed = []
    for f in dataclasses.fields(options):
        if f.name == "kernels" or f.default is dataclasses.MISSING:
            continue
        value = getattr(options, f.name)
        if value != f.default:
            changed.append(f"{f.name}={value}")
    return ", ".join(changed)


def summary_line(report: Any) -> str:
    """One line for the log, e.g. ``fastdora: on, converted 28 DoRA layer(s) (28 linear); Triton kernels, C++ node
    active``."""
    if getattr(report, "disabled_reason", None):
        return f"fastdora: off ({report.disabled_reason})"
    converted = dict(getattr(report, "converted", None) or {})
    total = int(getattr(report, "total_converted", sum(converted.values())) or 0)
    already = int(getattr(report, "already", 0) or 0)
    skipped = list(getattr(report, "skipped", None) or [])
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(converted.items()))
    head = f"fastdora: on, converted {total} DoRA layer(s)" + (f" ({kinds})" if kinds else "")
    if already:
        head += f", {already} already converted"
    if total + already == 0:
        head = "fastdora: no layer converted"
    parts = [head]
    if skipped:
        parts.append(f"{len(skipped)} left on stock PEFT (see fastdora_report.json)")
    paths = _paths_summary(report)
    if paths:
        parts.append(paths)
    extra = _non_default_options(report)
    if extra:
        parts.append(extra)
    return "; ".join(parts)


def announce(report: Any, logger: Optional[logging.Logger] = None) -> bool:
    """Log :func:`summary_line` once per process (on the ``fastdora`` logger unless ``logger`` is given), prefixed
    ``[rank N]`` in a job of several processes (each rank converts its own model). Returns whether it logged now."""
    global _ANNOUNCED
    if report is None or _ANNOUNCED or getattr(report, "disabled_reason", None):  # (enable_on warned already)
        return False
    _ANNOUNCED = True
    line = summary_line(report)
    rank, world = process_rank()
    if world > 1:
        line = f"[rank {rank}] {line}"
    log = logger or get_logger()
    nothing_runs = int(getattr(report, "total_converted", 0) or 0) + int(getattr(report, "already", 0) or 0) == 0
    (log.warning if nothing_runs else log.info)("%s", line)
    return True


# --------------------------------------------------------------------------------------------------------------
# foreign forwards (something that may bypass PEFT's DoRA path)
# --------------------------------------------------------------------------------------------------------------
def is_fastdora_forward(fn: Any) -> bool:
    """True when ``fn`` is the instance-level forward fastdora installs on a converted PEFT LoRA Linear."""
    import fastdora.layers as layers

    check: Callable[[Any], bool] = getattr(layers, "is_fastdora_forward", None) or layers._is_lean
    return bool(check(fn))


def _is_foreign(module: Any, fn: Any) -> bool:
    if is_fastdora_forward(fn):
        return False
    # accelerate's hooks (device_map / offload) wrap the forward that was there (``_old_forward``): transparent
    old = vars(module).get("_old_forward")
    if old is not None and getattr(module, "_hf_hook", None) is not None:
        return not (is_fastdora_forward(old) or getattr(old, "__func__", None) is getattr(type(module), "forward", 0))
    return True


def foreign_forward_modules(model: Any) -> list:
    """Names of the DoRA modules of ``model`` whose instance-level ``forward`` is neither fastdora's nor an
    accelerate hook around the class forward: something replaced PEFT's DoRA path there."""
    inner = unwrap_model(model)
    named = getattr(inner, "named_modules", None)
    if named is None:
        return []
    found = []
    for name, m in named():
        if not getattr(m, "lora_magnitude_vector", None):
            continue
        fn = vars(m).get("forward")
        if fn is not None and _is_foreign(m, fn):
            found.append(name)
    return found


def _counter_dict() -> dict:
    try:
        import fastdora

        counter = getattr(fastdora, "active_path_counter", None)
        if counter is None:
            from fastdora.layers import active_path_counter as counter
        return {str(k): int(v) for k, v in sorted(counter.items())}
    except Exception:
        return {}


def report_payload(report: Any, options: dict, framework: str, latest: Any = None, args: Any = None) -> dict:
    """A JSON-able summary: the enable report that converted the model (its ``as_dict()``), the plugin's options,
    the number of DoRA (layer, adapter) pairs on fastdora after the latest ``enable()``,
    ``fastdora.active_path_counter`` (which fastdora paths ran in THIS process, and how often) and this process's
    rank and world size."""
    rank, world = process_rank(args)
    payload: dict = {"framework": framework, "plugin_options": dict(options), "rank": rank, "world_size": world}
    latest = latest if latest is not None else report
    if report is None:
        payload.update(enabled=False, fastdora_layers=0)
    else:
        as_dict = getattr(report, "as_dict", None)
        payload["enable_report"] = as_dict() if as_dict is not None else {}
        payload["report"] = str(report)
        total = int(getattr(latest, "total_converted", 0) or 0)
        already = int(getattr(latest, "already", 0) or 0)
        payload.update(
            enabled=not getattr(latest, "disabled_reason", None),
            converted={str(k): int(v) for k, v in dict(getattr(report, "converted", {}) or {}).items()},
            skipped=[list(map(str, s)) for s in (getattr(latest, "skipped", None) or [])],
            fastdora_layers=total + already,  # (layer, adapter) pairs running fastdora after the last enable()
        )
    payload["active_path_counter"] = _counter_dict()
    payload["active_path_total"] = sum(payload["active_path_counter"].values())
    payload["pid"] = os.getpid()
    try:
        import fastdora

        payload["fastdora_version"] = getattr(fastdora, "__version__", None)
    except Exception:
        pass
    return payload


def write_report(output_dir: Optional[str], payload: dict, filename: str = REPORT_FILE) -> Optional[str]:
    if not output_dir:
        return None
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, filename)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def process_rank(args: Any = None) -> tuple:
    """``(rank, world size)`` of this process: HF ``TrainingArguments.process_index`` / ``world_size`` when given,
    else torch.distributed's when initialised, else the launcher's ``RANK`` / ``WORLD_SIZE`` (torchrun sets them),
    else ``(0, 1)``."""
    proc = getattr(args, "process_index", None)
    if proc is not None:
        return int(proc), int(getattr(args, "world_size", 1) or 1)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # pragma: no cover - a broken torch.distributed must not break the report
        pass
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    return (rank or 0), (world or 1)


def report_file_for_rank(filename: str = REPORT_FILE, rank: int = 0) -> str:
    """``fastdora_report.json`` for rank 0, ``fastdora_report.rank<N>.json`` for rank N (each rank converts and
    runs its own model, so each writes its own report)."""
    if not rank:
        return filename
    root, ext = os.path.splitext(filename)
    return f"{root}.rank{int(rank)}{ext or '.json'}"


def is_main_process(args: Any = None) -> bool:
    """Rank 0 of the job (see :func:`process_rank`)."""
    return process_rank(args)[0] == 0
