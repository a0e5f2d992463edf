"""LLaMA-Factory (0.9.5) integration: ``use_fast_dora: true`` in the training YAML.

Install once per environment (writes ``fastdora_llamafactory.pth`` into site-packages)::

    pip install "fastdora[llamafactory]"
    python -m fastdora.plugins.llamafactory install      # ... uninstall | status

Then, in the YAML of ``llamafactory-cli train cfg.yaml`` (``finetuning_type: lora`` + ``use_dora: true``)::

    use_fast_dora: true
    # optional (each defaults to the core's default; FASTDORA_* environment variables apply):
    fast_dora_kernels: auto                    # auto | triton | eager
    fast_dora_legacy_embedding_compose: false
    fast_dora_cache_norm: true
    fast_dora_norm_budget_mb: 16

Why a ``.pth`` file: ``llamafactory-cli train`` re-runs itself under ``torchrun`` for several devices (or with
``FORCE_TORCHRUN=1``); each worker is a fresh interpreter, so a patch applied in the parent only is lost. The
``.pth`` line runs :mod:`fastdora.plugins.llamafactory_boot` at every interpreter start of the environment; that
module imports nothing heavy and only registers an import hook. When LLaMA-Factory itself imports

- ``llamafactory.hparams.parser``: :func:`patch_parser` swaps ``FinetuningArguments`` in the parser's argument lists
  for a subclass with the ``use_fast_dora`` / ``fast_dora_*`` fields (so they are known keys; a misspelled key still
  gets LLaMA-Factory's ``Some keys are not used by the HfArgumentParser``, a bad value a ``ValueError``);
- ``llamafactory.model.loader``: :func:`patch_loader` wraps ``init_adapter`` (called by ``load_model`` by global
  name right after the PEFT model is built) to call ``fastdora.enable(model, **options)`` when ``use_fast_dora``;
- ``llamafactory.train.tuner``: :func:`patch_tuner` adds a callback that re-checks the model at train begin and
  writes ``fastdora_report.json`` into ``output_dir`` at train end (only when ``use_fast_dora`` was set).

Without ``use_fast_dora: true`` nothing of fastdora runs. Without the ``.pth`` the key is unknown to LLaMA-Factory.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from typing import Any, Optional

from ._common import collect_options, enable_on

__all__ = ["install", "uninstall", "status", "patch_parser", "patch_loader", "patch_tuner", "PTH_NAME"]

PTH_NAME = "fastdora_llamafactory.pth"
BOOT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamafactory_boot.py")

#: YAML key -> core option
CFG_KEYS = {
    "fast_dora_kernels": "kernels",
    "fast_dora_legacy_embedding_compose": "legacy_embedding_compose",
    "fast_dora_cache_norm": "cache_norm",
    "fast_dora_norm_budget_mb": "norm_budget_mb",
}

_ARG_LISTS = ("_TRAIN_ARGS", "_INFER_ARGS", "_EVAL_ARGS", "_TRAIN_MCA_ARGS")


class _State:
    options: Optional[dict] = None  # set when init_adapter ran with use_fast_dora: true (this process)
    report: Any = None


STATE = _State()


def _logger():
    try:
        from llamafactory.extras import logging as lf_logging

        return lf_logging.get_logger("llamafactory.fastdora")  # under LLaMA-Factory's handler
    except Exception:  # pragma: no cover
        import logging

        return logging.getLogger("fastdora.plugins.llamafactory")


def _log_info(msg: str) -> None:
    log = _logger()
    (getattr(log, "info_rank0", None) or log.info)(msg)


# --------------------------------------------------------------------------------------------------------------
# the argument dataclass
# --------------------------------------------------------------------------------------------------------------
def _fields_mixin_check(self) -> None:
    for key in ("use_fast_dora", "fast_dora_legacy_embedding_compose", "fast_dora_cache_norm"):
        val = getattr(self, key)
        if val is not None and not isinstance(val, bool):
            raise ValueError(f"{key} must be true or false, got {val!r}")
    if self.fast_dora_kernels is not None and self.fast_dora_kernels not in ("auto", "triton", "eager"):
        raise ValueError(f"fast_dora_kernels must be one of auto, triton, eager; got {self.fast_dora_kernels!r}")
    if self.fast_dora_norm_budget_mb is not None:
        v = self.fast_dora_norm_budget_mb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"fast_dora_norm_budget_mb must be a positive number, got {v!r}")
    if self.use_fast_dora:
        options_from_args(self)  # the core's own validation, early


def make_finetuning_arguments(base: type) -> type:
    """A dataclass subclass of LLaMA-Factory's ``FinetuningArguments`` with the fastdora fields."""
    if getattr(base, "_fastdora_fields", False):
        return base

    @dataclasses.dataclass
    class FinetuningArguments(base):  # same name, so LLaMA-Factory's help and logs look as usual
        use_fast_dora: bool = dataclasses.field(
            default=False,
            metadata={"help": "Run the DoRA layers (use_dora: true) through fastdora (exact, faster, leaner)."},
        )
        fast_dora_kernels: Optional[str] = dataclasses.field(
            default=None, metadata={"help": "fastdora kernels: auto, triton or eager (default: auto)."}
        )
        fast_dora_legacy_embedding_compose: Optional[bool] = dataclasses.field(
            default=None, metadata={"help": "Compose DoRA embeddings as PEFT 0.13-0.17 did (no embed_scale)."}
        )
        fast_dora_cache_norm: Optional[bool] = dataclasses.field(
            default=None, metadata={"help": "Reuse the DoRA weight norm while W, A, B, s are unchanged."}
        )
        fast_dora_norm_budget_mb: Optional[float] = dataclasses.field(
            default=None, metadata={"help": "Working-set budget of fastdora's eager weight norm (MB)."}
        )

        def __post_init__(self):
            super().__post_init__()
            _fields_mixin_check(self)

    FinetuningArguments._fastdora_fields = True
    FinetuningArguments.__module__ = __name__
    FinetuningArguments.__qualname__ = "FinetuningArguments"
    globals()["FinetuningArguments"] = FinetuningArguments  # picklable by reference
    return FinetuningArguments


def options_from_args(finetuning_args: Any) -> dict:
    return collect_options(**{opt: getattr(finetuning_args, key, None) for key, opt in CFG_KEYS.items()})


# --------------------------------------------------------------------------------------------------------------
# patches (called by the import hook right after LLaMA-Factory's module executed; each is idempotent)
# --------------------------------------------------------------------------------------------------------------
def patch_parser(parser_module) -> None:
    base = getattr(parser_module, "FinetuningArguments")
    sub = make_finetuning_arguments(base)
    for name in _ARG_LISTS:
        lst = getattr(parser_module, name, None)
        if isinstance(lst, list):
            for i, cls in enumerate(lst):
                if cls is base:
                    lst[i] = sub


def _wrap_init_adapter(orig):
    if getattr(orig, "_fastdora_wrapped", False):
        return orig

    def init_adapter(*args, **kwargs):
        model = orig(*args, **kwargs)
        finetuning_args = kwargs.get("finetuning_args", args[3] if len(args) > 3 else None)
        if getattr(finetuning_args, "use_fast_dora", False):
            options = options_from_args(finetuning_args)
            report = enable_on(model, options, logger=_logger(), who="fastdora (use_fast_dora)")
            STATE.options = options
            if report is not None:
                STATE.report = report
                _log_info(f"fastdora enabled (use_fast_dora: true): {report}")
        return model

    init_adapter._fastdora_wrapped = True
    init_adapter.__wrapped__ = orig
    return init_adapter


def patch_loader(loader_module) -> None:
    loader_module.init_adapter = _wrap_init_adapter(loader_module.init_adapter)


def _make_tuner_callback():
    from transformers import TrainerCallback

    from .hf import make_callback

    class FastDoraLlamaFactoryCallback(TrainerCallback):
        """Inert unless ``init_adapter`` ran with ``use_fast_dora: true`` in this process."""

        def __init__(self):
            self.inner = None

        def _get(self):
            if self.inner is None and STATE.options is not None:
                self.inner = make_callback(**STATE.options, framework="llamafactory")
                self.inner.report = STATE.report
                self.inner._logged = True  # init_adapter logged it already
            return self.inner

        def on_init_end(self, args, state, control, **kwargs):
            inner = self._get()
            return inner.on_init_end(args, state, control, **kwargs) if inner else control

        def on_train_begin(self, args, state, control, **kwargs):
            inner = self._get()
            return inner.on_train_begin(args, state, control, **kwargs) if inner else control

        def on_train_end(self, args, state, control, **kwargs):
            inner = self._get()
            return inner.on_train_end(args, state, control, **kwargs) if inner else control

    return FastDoraLlamaFactoryCallback()


def patch_tuner(tuner_module) -> None:
    orig = tuner_module._training_function
    if getattr(orig, "_fastdora_wrapped", False):
        return

    def _training_function(config):
        callbacks = config.get("callbacks")
        if isinstance(callbacks, list):
            callbacks.append(_make_tuner_callback())
        return orig(config)

    _training_function._fastdora_wrapped = True
    _training_function.__wrapped__ = orig
    tuner_module._training_function = _training_function


# --------------------------------------------------------------------------------------------------------------
# install / uninstall of the .pth
# --------------------------------------------------------------------------------------------------------------
def _pth_line(boot_file: str) -> str:
    # One line (site.py executes lines that start with "import"); a no-op once fastdora is uninstalled.
    return (
        f"import os; _fastdora_boot = {boot_file!r}; "
        "os.path.exists(_fastdora_boot) and exec(compile(open(_fastdora_boot).read(), _fastdora_boot, 'exec'), "
        "{'__name__': '_fastdora_llamafactory_boot', '__file__': _fastdora_boot})\n"
    )


def _site_dir(site_dir: Optional[str]) -> str:
    return site_dir or sysconfig.get_paths()["purelib"]


def install(site_dir: Optional[str] = None) -> str:
    path = os.path.join(_site_dir(site_dir), PTH_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write("# fastdora: makes `use_fast_dora` known to LLaMA-Factory (see fastdora.plugins.llamafactory)\n")
        f.write(_pth_line(BOOT_FILE))
    return path


def uninstall(site_dir: Optional[str] = None) -> Optional[str]:
    path = os.path.join(_site_dir(site_dir), PTH_NAME)
    if os.path.exists(path):
        os.remove(path)
        return path
    return None


def status(site_dir: Optional[str] = None) -> dict:
    path = os.path.join(_site_dir(site_dir), PTH_NAME)
    return {
        "pth": path,
        "installed": os.path.exists(path),
        "hook_active": any(getattr(f, "_fastdora_llamafactory_hook", False) for f in sys.meta_path),
        "boot_file": BOOT_FILE,
    }


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m fastdora.plugins.llamafactory", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["install", "uninstall", "status"])
    p.add_argument("--site-dir", default=None, help="site-packages directory (default: this interpreter's purelib)")
    a = p.parse_args(argv)
    if a.command == "install":
        print(f"fastdora: wrote {install(a.site_dir)}")
    elif a.command == "uninstall":
        path = uninstall(a.site_dir)
        print(f"fastdora: removed {path}" if path else "fastdora: nothing to remove")
    else:
        print(status(a.site_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
