"""Shared helpers of the trainer plugins (no math, no framework imports).

Every plugin funnels through :func:`enable_on` so that all of them expose the same options, unwrap the same
wrappers, warn the same way for models without DoRA and write the same ``fastdora_report.json``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

__all__ = [
    "OPTION_NAMES",
    "REPORT_FILE",
    "collect_options",
    "unwrap_model",
    "has_dora",
    "enable_on",
    "report_payload",
    "write_report",
    "is_main_process",
]

#: The core's options (``fastdora.enable(**options)``); every plugin exposes each of them.
OPTION_NAMES = ("kernels", "legacy_embedding_compose", "cache_norm", "norm_budget_mb")

#: Written into the trainer's output directory at the end of training (main process only).
REPORT_FILE = "fastdora_report.json"

_LOG = logging.getLogger("fastdora.plugins")

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
    log = logger or _LOG
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


def _counter_dict() -> dict:
    try:
        import fastdora

        counter = getattr(fastdora, "active_path_counter", None)
        if counter is None:
            from fastdora.layers import active_path_counter as counter
        return {str(k): int(v) for k, v in sorted(counter.items())}
    except Exception:
        return {}


def report_payload(report: Any, options: dict, framework: str, latest: Any = None) -> dict:
    """A JSON-able summary: the enable report that converted the model (its ``as_dict()``), the plugin's options,
    the number of DoRA (layer, adapter) pairs on fastdora after the latest ``enable()`` and
    ``fastdora.active_path_counter`` (which fastdora paths ran in THIS process, and how often)."""
    payload: dict = {"framework": framework, "plugin_options": dict(options)}
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


def is_main_process(args: Any = None) -> bool:
    """Rank 0 of the job (HF ``TrainingArguments.process_index`` when available, else torch.distributed's rank)."""
    proc = getattr(args, "process_index", None)
    if proc is not None:
        return int(proc) == 0
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
