"""Axolotl integration: ``FastDoraPlugin``.

In the training YAML (the exact lines)::

    adapter: lora
    peft_use_dora: true
    plugins:
      - fastdora.plugins.axolotl.FastDoraPlugin
    # optional, each defaults to the core's default (FASTDORA_* environment variables apply):
    fast_dora_kernels: auto                    # auto | triton | eager
    fast_dora_legacy_embedding_compose: false  # PEFT 0.13-0.17 embedding DoRA composition
    fast_dora_dm_from_output: true             # false if the model edits a DoRA layer's output in place

What the plugin does, in the process that trains (``axolotl train`` re-launches itself with accelerate; plugins are
loaded again in the child):

- ``register`` (raw config, before Axolotl validates it): a ``fast_dora_*`` key that is not one of the three above
  (or a ``fastdora_*`` / ``use_fast_dora`` look-alike) is an error naming it and the valid keys; then, and again at
  ``pre_model_load`` (which also validates the options' values): for a DoRA config
  (``peft_use_dora: true`` with ``adapter: lora``/``qlora``) it switches OFF Axolotl's fused LoRA kernels
  (``lora_qkv_kernel``, ``lora_o_kernel``, ``lora_mlp_kernel``, ``lora_embedding_kernel``). Axolotl auto-enables them
  for LoRA adapters, and their DoRA path replaces the attention / MLP / embedding forwards and so bypasses PEFT's DoRA
  layers (and fastdora with them). It logs which keys it changed; a key the user set to ``true`` is overridden
  with a warning.
- ``post_lora_load`` / ``post_model_load``: ``fastdora.enable(model, **options)`` (idempotent); one line per process
  says what was converted. ``post_model_load`` also warns when a DoRA module carries a foreign instance-level
  ``forward`` (:func:`check_foreign_forwards`; fastdora's own is recognised).
- ``add_callbacks_pre_trainer``: adds :class:`fastdora.plugins.hf.FastDoraCallback` with the same options, which
  re-checks the model at ``on_train_begin`` and writes ``fastdora_report.json`` into ``output_dir`` at the end
  (``fastdora_report.rank<N>.json`` from rank N of a multi-process run).

POET-X (:mod:`fastdora.poetx`, full training of the model's linear layers through orthogonal rotations, no
adapter): ``PoetXPlugin``::

    plugins:
      - fastdora.plugins.axolotl.PoetXPlugin
    # optional (defaults in brackets):
    poetx_block_size: 256          # [256] orthogonal block size; must divide the layers' features
    poetx_merge_interval: 200      # [200] optimizer steps between merges
    poetx_mode: fast               # [fast] fast | mem (least memory, one more GEMM per backward)
    poetx_lr_scale: 0.5            # [0.5] learning rate of the rotations, times learning_rate
    poetx_exclude: [lm_head]       # [lm_head] layers left as they are
    poetx_weight_format: dense     # [dense] dense | int8 (frozen weights as int8 codes, groups of 128 inputs)

``register`` rejects an unknown ``poetx_*`` key (naming the valid ones) and an ``adapter:`` (an adapter and POET-X on
the same layer are not supported); ``pre_model_load`` checks the values; ``add_callbacks_pre_trainer`` gives the
trainer :class:`fastdora.plugins.hf.PoetXCallback`, which converts the model inside the trainer's constructor, before
the optimizer exists, and merges during training (``poetx_report.json`` in ``output_dir``).

``axolotl`` and ``pydantic`` are imported only when a plugin or its argument class is looked up.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

from . import _poetx_common as px
from ._common import announce, collect_options, enable_on, foreign_forward_modules

__all__ = [  # noqa: F822 (FastDoraPlugin, FastDoraArgs: built on first access, module __getattr__)
    "FastDoraPlugin",
    "FastDoraArgs",
    "PoetXPlugin",
    "PoetXArgs",
    "POETX_CFG_KEYS",
    "poetx_options_from_cfg",
    "check_poetx_cfg",
    "AXOLOTL_LORA_KERNEL_KEYS",
    "CFG_KEYS",
    "options_from_cfg",
    "check_cfg_keys",
    "check_foreign_forwards",
]

#: Axolotl's fused LoRA kernels; each has its own DoRA path that bypasses PEFT's DoRA layer.
AXOLOTL_LORA_KERNEL_KEYS = ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel", "lora_embedding_kernel")

#: YAML key -> core option
CFG_KEYS = {
    "fast_dora_kernels": "kernels",
    "fast_dora_legacy_embedding_compose": "legacy_embedding_compose",
    "fast_dora_dm_from_output": "dm_from_output",
}

#: former options, now internal settings of the core (not configurable from a training config)
_FORMER_KEYS = ("fast_dora_cache_norm", "fast_dora_norm_budget_mb")


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


def _looks_like_ours(key: str) -> bool:
    k = key.lower().replace("-", "_")
    return k.startswith(("fast_dora_", "fastdora_")) or k in ("fast_dora", "fastdora", "use_fast_dora", "use_fastdora")


def check_cfg_keys(cfg: Any) -> None:
    """Raise ``ValueError`` for a config key that looks like the plugin's (``fast_dora_*``, ``fastdora_*``,
    ``use_fast_dora``) but is not one of :data:`CFG_KEYS`; the message names the key(s) and the valid ones."""
    try:
        keys = [str(k) for k in cfg.keys()]
    except AttributeError:
        keys = [str(k) for k in vars(cfg)]
    bad = sorted(k for k in keys if _looks_like_ours(k) and k not in CFG_KEYS)
    if not bad:
        return
    hints = []
    for k in bad:
        if k in _FORMER_KEYS:
            hints.append(f"{k} is no longer an option (fastdora sets it internally): remove it")
        elif k.lower().replace("-", "_") in ("use_fast_dora", "use_fastdora", "fast_dora", "fastdora"):
            hints.append(f"{k} is not an Axolotl key: listing fastdora.plugins.axolotl.FastDoraPlugin under "
                         "plugins: is what switches fastdora on")
        else:
            close = difflib.get_close_matches(k.lower().replace("-", "_").replace("fastdora_", "fast_dora_"),
                                              list(CFG_KEYS), n=1, cutoff=0.6)
            if close:
                hints.append(f"{k}: did you mean {close[0]}?")
    raise ValueError(
        f"fastdora: unknown config key(s) {bad} for the FastDoraPlugin; valid keys: {list(CFG_KEYS)}"
        + (" (" + "; ".join(hints) + ")" if hints else "")
    )


def check_foreign_forwards(model: Any, log=None) -> list:
    """Warn when DoRA modules of ``model`` carry an instance-level ``forward`` that is not fastdora's (something,
    such as Axolotl's fused LoRA kernels, may bypass PEFT's DoRA path there). Returns the modules' names."""
    bypass = foreign_forward_modules(model)
    if bypass:
        (log or _get_logger()).warning(
            "fastdora: %d DoRA module(s) have an instance-level forward that is not fastdora's (e.g. %s): something "
            "(such as Axolotl's fused LoRA kernels) may bypass PEFT's DoRA path; set lora_*_kernel: false.",
            len(bypass),
            bypass[0],
        )
    return bypass


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


#: POET-X YAML key -> PoetXCallback option
POETX_CFG_KEYS = {f"poetx_{name}": name for name in px.OPTION_NAMES}


def poetx_options_from_cfg(cfg: Any) -> dict:
    return px.collect_options(**{opt: _cfg_get(cfg, key) for key, opt in POETX_CFG_KEYS.items()})


def _looks_like_poetx(key: str) -> bool:
    k = key.lower().replace("-", "_")
    return k.startswith(("poetx", "poet_x", "use_poetx", "use_poet_x"))


def check_poetx_cfg(cfg: Any) -> None:
    """Raise ``ValueError`` for a ``poetx*`` key that is not one of :data:`POETX_CFG_KEYS` (naming it and the valid
    keys) and for a config with a PEFT adapter (``adapter: lora`` / ``qlora``): POET-X trains the model's own linear
    layers, an adapter on the same layers is not supported."""
    try:
        keys = [str(k) for k in cfg.keys()]
    except AttributeError:
        keys = [str(k) for k in vars(cfg)]
    bad = sorted(k for k in keys if _looks_like_poetx(k) and k not in POETX_CFG_KEYS)
    if bad:
        hints = []
        for k in bad:
            if k.lower().replace("-", "_").removeprefix("use_") in ("poetx", "poet_x"):
                hints.append(f"{k} is not an Axolotl key: listing fastdora.plugins.axolotl.PoetXPlugin under "
                             "plugins: is what switches POET-X on")
                continue
            close = difflib.get_close_matches(k.lower().replace("-", "_").replace("poet_x_", "poetx_"),
                                              list(POETX_CFG_KEYS), n=1, cutoff=0.6)
            if close:
                hints.append(f"{k}: did you mean {close[0]}?")
        raise ValueError(
            f"fastdora: unknown config key(s) {bad} for the PoetXPlugin; valid keys: {list(POETX_CFG_KEYS)}"
            + (" (" + "; ".join(hints) + ")" if hints else "")
        )
    adapter = _cfg_get(cfg, "adapter")
    if adapter:
        raise ValueError(
            f"fastdora: PoetXPlugin with adapter: {adapter}: POET-X trains the model's own linear layers and an "
            "adapter on the same layers is not supported; remove adapter: (and lora_* / peft_use_dora)"
        )


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
        fast_dora_dm_from_output: Optional[bool] = Field(
            default=None,
            json_schema_extra={
                "description": "the magnitude's gradient from the layer's output (saves an activation per layer); "
                "false if the model edits a DoRA layer's output in place"
            },
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
            # A misspelled fast_dora_* key fails here, before anything is loaded. (Values are checked by Axolotl's
            # schema, FastDoraArgs, and again by the core at pre_model_load, after the schema's coercion.)
            check_cfg_keys(cfg)
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
                log.debug("fastdora enabled (%s): %s", stage, report)
                # the one line at default verbosity (once per process), on Axolotl's logger: Axolotl's handlers
                # drop INFO records of loggers outside axolotl.*
                announce(report, logger=log)
                self.report = report

        def post_lora_load(self, cfg, model):
            self._enable(cfg, model, "post_lora_load")

        def post_model_load(self, cfg, model):
            self._enable(cfg, model, "post_model_load")
            if is_dora_cfg(cfg):
                check_foreign_forwards(model, log)

        def add_callbacks_pre_trainer(self, cfg, model):
            if not is_dora_cfg(cfg):
                return []
            from .hf import make_callback

            cb = make_callback(**options_from_cfg(cfg), framework="axolotl")
            cb.report = self.report  # the conversion done at post_lora_load (already logged)
            cb._logged = self.report is not None
            cb.announce_logger = log
            return [cb]

    FastDoraPlugin.__module__ = __name__
    FastDoraPlugin.__qualname__ = "FastDoraPlugin"
    return FastDoraPlugin


def _build_poetx_args():
    from typing import Literal, Optional, Union

    from pydantic import BaseModel, Field

    class PoetXArgs(BaseModel):
        """Axolotl config keys of the POET-X plugin (validated by Axolotl's pydantic config)."""

        poetx_block_size: Optional[int] = Field(
            default=None, json_schema_extra={"description": "POET-X orthogonal block size (default 256)"})
        poetx_merge_interval: Optional[int] = Field(
            default=None, json_schema_extra={"description": "optimizer steps between POET-X merges (default 200)"})
        poetx_mode: Optional[Literal["fast", "mem"]] = Field(
            default=None, json_schema_extra={"description": "fast | mem (least memory; default fast)"})
        poetx_lr_scale: Optional[float] = Field(
            default=None,
            json_schema_extra={"description": "learning rate of the rotations, times learning_rate (default 0.5)"})
        poetx_exclude: Optional[Union[list[str], str]] = Field(
            default=None, json_schema_extra={"description": "layer names left unconverted (default [lm_head])"})
        poetx_weight_format: Optional[Literal["dense", "int8"]] = Field(
            default=None,
            json_schema_extra={"description": "frozen weights: dense, or int8 (group-wise codes; default dense)"})

    PoetXArgs.__module__ = __name__
    PoetXArgs.__qualname__ = "PoetXArgs"
    return PoetXArgs


def _build_poetx_plugin():
    from axolotl.integrations.base import BasePlugin

    log = _get_logger()

    class PoetXPlugin(BasePlugin):
        """Axolotl plugin: POET-X training of the model's linear layers (see the module docstring)."""

        def get_input_args(self) -> str:
            return "fastdora.plugins.axolotl.PoetXArgs"

        def register(self, cfg):  # raw config, before validation: a misspelled poetx_* key fails here
            check_poetx_cfg(cfg)

        def pre_model_load(self, cfg):  # validated config, in the training process
            check_poetx_cfg(cfg)
            poetx_options_from_cfg(cfg)  # fail before the model loads on a bad value

        def add_callbacks_pre_trainer(self, cfg, model):
            from .hf import make_poetx_callback

            cb = make_poetx_callback(**poetx_options_from_cfg(cfg), framework="axolotl")
            cb.announce_logger = log  # Axolotl's handlers drop INFO records of loggers outside axolotl.*
            return [cb]

    PoetXPlugin.__module__ = __name__
    PoetXPlugin.__qualname__ = "PoetXPlugin"
    return PoetXPlugin


_BUILT: dict = {}


def __getattr__(name: str):
    builders = {"FastDoraPlugin": _build_plugin, "FastDoraArgs": _build_args, "PoetXPlugin": _build_poetx_plugin,
                "PoetXArgs": _build_poetx_args}
    if name in builders:
        if name not in _BUILT:
            _BUILT[name] = builders[name]()
            globals()[name] = _BUILT[name]
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
