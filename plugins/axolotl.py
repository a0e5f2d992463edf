"""Axolotl integration: ``FastDoraPlugin``.

In the training YAML (the exact lines)::

    adapter: lora
    peft_use_dora: true
    plugins:
      - fastdora.plugins.axolotl.FastDoraPlugin
    # optional, each defaults to the core's default (FASTDORA_* environment variables apply):
    fast_dora_kernels: auto                    # auto | triton | eager
    fast_dora_legacy_embedding_compose: false  # PEFT 0.13-0.17 embedding DoRA composition
    fast_dora_cache_norm: true
    fast_dora_norm_budget_mb: 16

What the plugin does, in the process that trains (``axolotl train`` re-launches itself with accelerate; plugins are
loaded again in the child):

- ``register`` (raw config, before Axolotl validates it) and again ``pre_model_load``: for a DoRA config
  (``peft_use_dora: true`` with ``adapter: lora``/``qlora``) it switches OFF Axolotl's fused LoRA kernels
  (``lora_qkv_kernel``, ``lora_o_kernel``, ``lora_mlp_kernel``, ``lora_embedding_kernel``). Axolotl auto-enables them
  for LoRA adapters, and their DoRA path replaces the attention / MLP / embedding forwards and so bypasses PEFT's DoRA
  layers (and fastdora with them). It logs which keys it changed; a key the user set to ``true`` is overridden
  with a warning.
- ``post_lora_load`` / ``post_model_load``: ``fastdora.enable(model, **options)`` (idempotent) and logs the report.
- ``add_callbacks_pre_trainer``: adds :class:`fastdora.plugins.hf.FastDoraCallback` with the same options, which
  re-checks the model at ``on_train_begin`` and writes ``fastdora_report.json`` into ``output_dir`` at the end.

``axolotl`` and ``pydantic`` are imported only when ``FastDoraPlugin`` / ``FastDoraArgs`` are looked up.
"""

from __future__ import annotations

import logging
from typing import Any

from ._common import collect_options, enable_on

__all__ = ["FastDoraPlugin", "FastDoraArgs", "AXOLOTL_LORA_KERNEL_KEYS", "options_from_cfg"]

#: Axolotl's fused LoRA kernels; each has its own DoRA path that bypasses PEFT's DoRA layer.
AXOLOTL_LORA_KERNEL_KEYS = ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel", "lora_embedding_kernel")

#: YAML key -> core option
CFG_KEYS = {
    "fast_dora_kernels": "kernels",
    "fast_dora_legacy_embedding_compose": "legacy_embedding_compose",
    "fast_dora_cache_norm": "cache_norm",
    "fast_dora_norm_budget_mb": "norm_budget_mb",
}


def _get_logger():
    try:
        from axolotl.utils.logging import get_logger

        return get_logger("axolotl.integrations.fastdora")  # under Axolotl's logging configuration
    except Exception:  # pragma: no cover
        return logging.getLogger("fastdora.plugins.axolotl")


def _cfg_get(cfg: Any, key: str) -> Any:
    try:
        return cfg.get(key)
    except AttributeError:
        return getattr(cfg, key, None)


def is_dora_cfg(cfg: Any) -> bool:
    return bool(_cfg_get(cfg, "peft_use_dora")) and _cfg_get(cfg, "adapter") in ("lora", "qlora")


def options_from_cfg(cfg: Any) -> dict:
    return collect_options(**{opt: _cfg_get(cfg, key) for key, opt in CFG_KEYS.items()})


def switch_off_lora_kernels(cfg: Any, stage: str, log=None) -> dict:
    """For a DoRA config, set every Axolotl fused-LoRA-kernel key to False; returns {key: previous value}."""
    log = log or _get_logger()
    if not is_dora_cfg(cfg):
        return {}
    changed = {}
    for key in AXOLOTL_LORA_KERNEL_KEYS:
        prev = _cfg_get(cfg, key)
        if prev is False:
            continue
        cfg[key] = False
        changed[key] = prev
    if changed:
        forced = [k for k, v in changed.items() if v]
        if forced:
            log.warning(
                "fastdora (%s): overriding %s=true to false: Axolotl's fused LoRA kernels run their own DoRA "
                "path, which bypasses PEFT's DoRA layers and so fastdora.",
                stage,
                ", ".join(forced),
            )
        auto = [k for k, v in changed.items() if not v]
        if auto:
            log.info(
                "fastdora (%s): DoRA config: set %s to false (Axolotl would auto-enable its fused LoRA kernels, "
                "whose DoRA path bypasses PEFT's DoRA layers); fastdora runs the DoRA layers instead.",
                stage,
                ", ".join(auto),
            )
    return changed


def _build_args():
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class FastDoraArgs(BaseModel):
        """Axolotl config keys of the fastdora plugin (validated by Axolotl's pydantic config)."""

        fast_dora_kernels: Optional[Literal["auto", "triton", "eager"]] = Field(
            default=None, json_schema_extra={"description": "fastdora kernels: auto | triton | eager"}
        )
        fast_dora_legacy_embedding_compose: Optional[bool] = Field(
            default=None,
            json_schema_extra={"description": "compose DoRA embeddings as PEFT 0.13-0.17 did (no embed_scale)"},
        )
        fast_dora_cache_norm: Optional[bool] = Field(
            default=None, json_schema_extra={"description": "reuse the weight norm while W, A, B, s are unchanged"}
        )
        fast_dora_norm_budget_mb: Optional[float] = Field(
            default=None, gt=0, json_schema_extra={"description": "working-set budget of the eager norm (MB)"}
        )

    FastDoraArgs.__module__ = __name__
    FastDoraArgs.__qualname__ = "FastDoraArgs"
    return FastDoraArgs


def _build_plugin():
    from axolotl.integrations.base import BasePlugin

    log = _get_logger()

    class FastDoraPlugin(BasePlugin):
        """Axolotl plugin: exact, fast DoRA through fastdora (see the module docstring)."""

        def __init__(self):
            super().__init__()
            self.report = None

        def get_input_args(self) -> str:
            return "fastdora.plugins.axolotl.FastDoraArgs"

        def register(self, cfg):  # raw config, before validation (before the LoRA-kernel auto-enable)
            switch_off_lora_kernels(cfg, "register", log)

        def pre_model_load(self, cfg):  # validated config, in the training process
            switch_off_lora_kernels(cfg, "pre_model_load", log)
            options_from_cfg(cfg)  # fail early on a bad option

        def _enable(self, cfg, model, stage):
            if not is_dora_cfg(cfg):
                if self.report is None and stage == "post_model_load":
                    log.warning(
                        "fastdora: FastDoraPlugin is listed but the config is not a DoRA config "
                        "(peft_use_dora: true with adapter: lora/qlora); fastdora does nothing."
                    )
                return
            report = enable_on(model, options_from_cfg(cfg), logger=log, who="fastdora")
            if report is not None and self.report is None:
                log.info("fastdora enabled (%s): %s", stage, report)
                self.report = report

        def post_lora_load(self, cfg, model):
            self._enable(cfg, model, "post_lora_load")

        def post_model_load(self, cfg, model):
            self._enable(cfg, model, "post_model_load")
            bypass = [
                name
                for name, m in model.named_modules()
                if getattr(m, "lora_magnitude_vector", None) and "forward" in vars(m)
            ]
            if bypass and is_dora_cfg(cfg):
                log.warning(
                    "fastdora: %d DoRA module(s) have an instance-level forward (e.g. %s): something (such as "
                    "Axolotl's fused LoRA kernels) may bypass PEFT's DoRA path; set lora_*_kernel: false.",
                    len(bypass),
                    bypass[0],
                )

        def add_callbacks_pre_trainer(self, cfg, model):
            if not is_dora_cfg(cfg):
                return []
            from .hf import make_callback

            cb = make_callback(**options_from_cfg(cfg), framework="axolotl")
            cb.report = self.report  # the conversion done at post_lora_load (already logged)
            cb._logged = self.report is not None
            return [cb]

    FastDoraPlugin.__module__ = __name__
    FastDoraPlugin.__qualname__ = "FastDoraPlugin"
    return FastDoraPlugin


_BUILT: dict = {}


def __getattr__(name: str):
    builders = {"FastDoraPlugin": _build_plugin, "FastDoraArgs": _build_args}
    if name in builders:
        if name not in _BUILT:
            _BUILT[name] = builders[name]()
            globals()[name] = _BUILT[name]
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
