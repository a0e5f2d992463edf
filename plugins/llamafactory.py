"""LLaMA-Factory (0.9.5) integration: ``use_fast_dora: true`` in the training YAML.

Install once per environment (writes ``fastdora_llamafactory.pth`` into site-packages)::

    pip install "fastdora[llamafactory]"
    python -m fastdora.plugins.llamafactory install      # ... uninstall | status

Then, in the YAML of ``llamafactory-cli train cfg.yaml`` (``finetuning_type: lora`` + ``use_dora: true``)::

    use_fast_dora: true
    # optional (each defaults to the core's default; FASTDORA_* environment variables apply):
    fast_dora_kernels: auto                    # auto | triton | eager
    fast_dora_legacy_embedding_compose: false
    fast_dora_dm_from_output: true

Why a ``.pth`` file: ``llamafactory-cli train`` re-runs itself under ``torchrun`` for several devices (or with
``FORCE_TORCHRUN=1``); each worker is a fresh interpreter, so a patch applied in the parent only is lost. The
``.pth`` line runs :mod:`fastdora.plugins.llamafactory_boot` at every interpreter start of the environment; that
module imports nothing (not even fastdora) and only registers an import hook, so interpreters that never import
LLaMA-Factory pay a file read and nothing else; a ``.pth`` left behind by ``pip uninstall fastdora`` stays silent.
When LLaMA-Factory itself imports

- ``llamafactory.hparams.parser``: :func:`patch_parser` swaps ``FinetuningArguments`` in the parser's argument lists
  for a subclass with the ``use_fast_dora`` / ``fast_dora_*`` fields (so they are known keys; a misspelled key still
  gets LLaMA-Factory's ``Some keys are not used by the HfArgumentParser``, a bad value a ``ValueError``);
- ``llamafactory.model.loader``: :func:`patch_loader` wraps ``init_adapter`` (called by ``load_model`` by global
  name right after the PEFT model is built) to call ``fastdora.enable(model, **options)`` when ``use_fast_dora``
  (for inference / ``llamafactory-cli export``, where LLaMA-Factory merges the adapter, a model without DoRA layers
  is expected: no warning then);
- ``llamafactory.train.tuner``: :func:`patch_tuner` adds a callback that re-checks the model at train begin and
  writes ``fastdora_report.json`` into ``output_dir`` at train end (``fastdora_report.rank<N>.json`` on rank N
  under torchrun; only when ``use_fast_dora`` was set).

POET-X (:mod:`fastdora.poetx`: full training of the model's linear layers through orthogonal rotations; needs
``finetuning_type: full``)::

    use_poetx: true
    # optional (defaults in brackets):
    poetx_block_size: 256          # [256] orthogonal block size; must divide the layers' features
    poetx_merge_interval: 200      # [200] optimizer steps between merges
    poetx_mode: fast               # [fast] fast | mem
    poetx_lr_scale: 0.5            # [0.5] learning rate of the rotations, times learning_rate
    poetx_exclude: lm_head         # [lm_head] comma-separated layer names left as they are
    poetx_weight_format: dense     # [dense] dense | int8 (frozen weights as int8 codes, groups of 128 inputs)

The parser rejects ``use_poetx`` with another ``finetuning_type``, with ``use_fast_dora`` and bad values; the wrapped
``init_adapter`` records the options, and the train-time callback hands them to
:class:`fastdora.plugins.hf.PoetXCallback` (conversion inside the trainer's constructor, merges, ``poetx_report.json``).

Without ``use_fast_dora: true`` / ``use_poetx: true`` nothing of fastdora runs. Without the ``.pth`` the keys are
unknown to LLaMA-Factory. ``python -m fastdora.plugins.llamafactory status`` says whether the ``.pth`` is there and
runs this fastdora; ``uninstall`` removes it (run it before ``pip uninstall fastdora``; a ``.pth`` left behind anyway
does nothing and says nothing, and can be deleted by hand: ``status`` prints its path).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from typing import Any, Optional

from . import _poetx_common as px
from ._common import announce, collect_options, enable_on, has_dora, unwrap_model

__all__ = ["install", "uninstall", "status", "pth_text", "patch_parser", "patch_loader", "patch_tuner",
           "init_adapter_action", "make_finetuning_arguments", "PTH_NAME", "CFG_KEYS", "POETX_CFG_KEYS", "FIELD_NAMES"]

PTH_NAME = "fastdora_llamafactory.pth"
BOOT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamafactory_boot.py")

#: YAML key -> core option
CFG_KEYS = {
    "fast_dora_kernels": "kernels",
    "fast_dora_legacy_embedding_compose": "legacy_embedding_compose",
    "fast_dora_dm_from_output": "dm_from_output",
}
#: POET-X YAML key -> PoetXCallback option
POETX_CFG_KEYS = {f"poetx_{name}": name for name in px.OPTION_NAMES}
#: every field the FinetuningArguments subclass adds (a switch + one per option, for fastdora's DoRA and for POET-X)
FIELD_NAMES = ("use_fast_dora",) + tuple(CFG_KEYS) + ("use_poetx",) + tuple(POETX_CFG_KEYS)

_ARG_LISTS = ("_TRAIN_ARGS", "_INFER_ARGS", "_EVAL_ARGS", "_TRAIN_MCA_ARGS")


class _State:
    options: Optional[dict] = None  # set when init_adapter ran with use_fast_dora: true (this process)
    report: Any = None
    poetx_options: Optional[dict] = None  # set when init_adapter ran for training with use_poetx: true


STATE = _State()


def _logger():
    try:
        from llamafactory.extras import logging as lf_logging

        return lf_logging.get_logger("llamafactory.fastdora")  # under LLaMA-Factory's handler
    except Exception:  # pragma: no cover
        import logging

        return logging.getLogger("fastdora.plugins.llamafactory")


# --------------------------------------------------------------------------------------------------------------
# the argument dataclass
# --------------------------------------------------------------------------------------------------------------
def _fields_mixin_check(self) -> None:
    # HfArgumentParser.parse_dict hands YAML values to the dataclass unconverted: check them here.
    for key in ("use_fast_dora", "fast_dora_legacy_embedding_compose", "fast_dora_dm_from_output"):
        val = getattr(self, key)
        if val is not None and not isinstance(val, bool):
            raise ValueError(f"{key} must be true or false, got {val!r}")
    if self.fast_dora_kernels is not None and self.fast_dora_kernels not in ("auto", "triton", "eager"):
        raise ValueError(f"fast_dora_kernels must be one of auto, triton, eager; got {self.fast_dora_kernels!r}")
    if self.use_fast_dora:
        options_from_args(self)  # the core's own validation, early
    if self.use_poetx is not None and not isinstance(self.use_poetx, bool):
        raise ValueError(f"use_poetx must be true or false, got {self.use_poetx!r}")
    if self.use_poetx:
        if getattr(self, "finetuning_type", "full") != "full":
            raise ValueError(f"use_poetx needs finetuning_type: full (POET-X trains the model's own linear layers; "
                             f"an adapter on the same layers is not supported), got {self.finetuning_type!r}")
        if self.use_fast_dora:
            raise ValueError("use_poetx and use_fast_dora are exclusive (POET-X trains the full model, fastdora's "
                             "DoRA an adapter)")
        poetx_options_from_args(self)  # bad values fail here, before a model loads


_SUBCLASSES: dict = {}  # LLaMA-Factory's FinetuningArguments -> the subclass (one per base and process)


def make_finetuning_arguments(base: type) -> type:
    """A dataclass subclass of LLaMA-Factory's ``FinetuningArguments`` with the fastdora fields.

    Unknown keys: LLaMA-Factory parses the YAML with ``HfArgumentParser.parse_dict(..., allow_extra_keys=False)``
    (unless ``ALLOW_EXTRA_ARGS=1`` is set), which raises ``ValueError: Some keys are not used by the
    HfArgumentParser: [...]`` for every key that is no field of its argument dataclasses. So each fastdora key is
    declared here as a real dataclass field (:data:`FIELD_NAMES`, checked below) and nothing else is: a misspelled
    ``fast_dora_kernal`` / ``use_fastdora`` or a removed option stays unknown and fails there, before any model
    loads."""
    if getattr(base, "_fastdora_fields", False):
        return base
    if base in _SUBCLASSES:
        return _SUBCLASSES[base]

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
        fast_dora_dm_from_output: Optional[bool] = dataclasses.field(
            default=None,
            metadata={
                "help": "Take the DoRA magnitude's gradient from the layer's output (saves an activation per layer); "
                "false if the model edits a DoRA layer's output in place."
            },
        )

        use_poetx: bool = dataclasses.field(
            default=False,
            metadata={"help": "Train the model's linear layers with POET-X (finetuning_type: full)."},
        )
        poetx_block_size: Optional[int] = dataclasses.field(
            default=None, metadata={"help": "POET-X orthogonal block size (default 256)."}
        )
        poetx_merge_interval: Optional[int] = dataclasses.field(
            default=None, metadata={"help": "Optimizer steps between POET-X merges (default 200)."}
        )
        poetx_mode: Optional[str] = dataclasses.field(
            default=None, metadata={"help": "POET-X memory mode: fast or mem (default fast)."}
        )
        poetx_lr_scale: Optional[float] = dataclasses.field(
            default=None, metadata={"help": "Learning rate of the rotations, times learning_rate (default 0.5)."}
        )
        poetx_exclude: Optional[str] = dataclasses.field(
            default=None, metadata={"help": "Comma-separated layer names POET-X leaves as they are (default lm_head)."}
        )
        poetx_weight_format: Optional[str] = dataclasses.field(
            default=None,
            metadata={"help": "POET-X frozen weights: dense, or int8 (group-wise int8 codes; default dense)."},
        )

        def __post_init__(self):
            super().__post_init__()
            _fields_mixin_check(self)

    declared = {f.name for f in dataclasses.fields(FinetuningArguments)} - {f.name for f in dataclasses.fields(base)}
    if declared != set(FIELD_NAMES):  # the parser knows exactly these keys, so it rejects every other fast_dora_*
        raise RuntimeError(f"fastdora: FinetuningArguments fields {sorted(declared)} != {sorted(FIELD_NAMES)}")
    FinetuningArguments._fastdora_fields = True
    _SUBCLASSES[base] = FinetuningArguments
    FinetuningArguments.__module__ = __name__
    FinetuningArguments.__qualname__ = "FinetuningArguments"
    globals()["FinetuningArguments"] = FinetuningArguments  # picklable by reference
    return FinetuningArguments


def options_from_args(finetuning_args: Any) -> dict:
    return collect_options(**{opt: getattr(finetuning_args, key, None) for key, opt in CFG_KEYS.items()})


def poetx_options_from_args(finetuning_args: Any) -> dict:
    return px.collect_options(**{opt: getattr(finetuning_args, key, None) for key, opt in POETX_CFG_KEYS.items()})


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


def init_adapter_action(finetuning_args: Any, is_trainable: Optional[bool], model: Any) -> str:
    """What the wrapped ``init_adapter`` does with the model it returned:

    - ``"off"``: ``use_fast_dora`` is not set;
    - ``"enable"``: the model has DoRA layers: convert them;
    - ``"merged"``: no DoRA layer and not trainable: inference / ``llamafactory-cli export``, where LLaMA-Factory
      merges the adapter into the weights (``merge_and_unload``) inside ``init_adapter``: nothing to do, no warning;
    - ``"no_dora"``: no DoRA layer in a model being trained: warn (the config is not a DoRA one)."""
    if not getattr(finetuning_args, "use_fast_dora", False):
        return "off"
    if has_dora(unwrap_model(model)):
        return "enable"
    return "merged" if is_trainable is False else "no_dora"


def _init_adapter_call_args(args: tuple, kwargs: dict) -> tuple:
    """``(finetuning_args, is_trainable)`` of ``init_adapter(config, model, model_args, finetuning_args,
    is_trainable)``; ``is_trainable`` is ``None`` when not passed."""
    finetuning_args = kwargs.get("finetuning_args", args[3] if len(args) > 3 else None)
    is_trainable = kwargs.get("is_trainable", args[4] if len(args) > 4 else None)
    return finetuning_args, (None if is_trainable is None else bool(is_trainable))


def _wrap_init_adapter(orig):
    if getattr(orig, "_fastdora_wrapped", False):
        return orig

    def init_adapter(*args, **kwargs):
        model = orig(*args, **kwargs)
        finetuning_args, is_trainable = _init_adapter_call_args(args, kwargs)
        if getattr(finetuning_args, "use_poetx", False) and is_trainable is not False:
            # converted by the train-time callback, inside the trainer's constructor (before its optimizer)
            STATE.poetx_options = poetx_options_from_args(finetuning_args)
        action = init_adapter_action(finetuning_args, is_trainable, model)
        if action == "off":
            return model
        options = options_from_args(finetuning_args)
        if action == "merged":
            _logger().debug(
                "fastdora (use_fast_dora): no DoRA layer left after init_adapter for inference / export "
                "(LLaMA-Factory merged the adapter into the weights); nothing to do."
            )
            return model
        report = enable_on(model, options, logger=_logger(), who="fastdora (use_fast_dora)")
        STATE.options = options
        if report is not None:
            STATE.report = report
            _logger().debug(f"fastdora enabled (use_fast_dora: true): {report}")
            announce(report, logger=_logger())  # the one line at default verbosity (once per process)
        return model

    init_adapter._fastdora_wrapped = True
    init_adapter.__wrapped__ = orig
    return init_adapter


def patch_loader(loader_module) -> None:
    loader_module.init_adapter = _wrap_init_adapter(loader_module.init_adapter)


def _make_tuner_callback():
    from transformers import TrainerCallback

    from .hf import make_callback, make_poetx_callback

    class FastDoraLlamaFactoryCallback(TrainerCallback):
        """Inert unless ``init_adapter`` ran with ``use_fast_dora: true`` or ``use_poetx: true`` in this process:
        forwards the trainer's events to :class:`~fastdora.plugins.hf.FastDoraCallback` /
        :class:`~fastdora.plugins.hf.PoetXCallback`."""

        def __init__(self):
            self.inner = None
            self.poetx = None

        def _get(self) -> list:
            if self.inner is None and STATE.options is not None:
                self.inner = make_callback(**STATE.options, framework="llamafactory")
                self.inner.report = STATE.report
                self.inner._logged = True  # init_adapter logged it already
                self.inner.announce_logger = _logger()
            if self.poetx is None and STATE.poetx_options is not None:
                self.poetx = make_poetx_callback(**STATE.poetx_options, framework="llamafactory")
                self.poetx.announce_logger = _logger()
            return [cb for cb in (self.inner, self.poetx) if cb is not None]

        def _forward(self, event, args, state, control, **kwargs):
            for cb in self._get():
                control = getattr(cb, event)(args, state, control, **kwargs) or control
            return control

        def on_init_end(self, args, state, control, **kwargs):
            return self._forward("on_init_end", args, state, control, **kwargs)

        def on_train_begin(self, args, state, control, **kwargs):
            return self._forward("on_train_begin", args, state, control, **kwargs)

        def on_step_end(self, args, state, control, **kwargs):
            return self._forward("on_step_end", args, state, control, **kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            return self._forward("on_train_end", args, state, control, **kwargs)

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
#: What the ``.pth`` line runs (site.py executes ``.pth`` lines that start with ``import``, one line each, and prints
#: a traceback for any that raises): read the boot file and execute it, and do nothing at all when it is gone (``pip
#: uninstall fastdora`` leaves this ``.pth`` behind) or anything else fails. Costs one small file read and compile at
#: interpreter start; imports nothing. The boot file imports fastdora only when LLaMA-Factory's modules are imported,
#: and stays silent when fastdora is no longer importable then (see llamafactory_boot.py).
_PTH_CODE = """\
try:
    p = {boot!r}
    try:
        f = open(p, "rb")
    except OSError:
        f = None
    if f is not None:
        with f:
            src = f.read()
        exec(compile(src, p, "exec"), {{"__name__": "_fastdora_llamafactory_boot", "__file__": p}})
except Exception:
    pass
"""

_PTH_HEADER = (
    "# fastdora: makes `use_fast_dora` known to LLaMA-Factory (python -m fastdora.plugins.llamafactory status)\n"
)


def _pth_line(boot_file: str) -> str:
    code = _PTH_CODE.format(boot=boot_file)
    line = f"import sys; exec({code!r}, {{}})\n"
    assert "\n" not in line[:-1]  # one line
    return line


def pth_text(boot_file: str = BOOT_FILE) -> str:
    """The whole content of ``fastdora_llamafactory.pth``."""
    return _PTH_HEADER + _pth_line(boot_file)


def _site_dir(site_dir: Optional[str]) -> str:
    return site_dir or sysconfig.get_paths()["purelib"]


def install(site_dir: Optional[str] = None) -> str:
    path = os.path.join(_site_dir(site_dir), PTH_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(pth_text(BOOT_FILE))
    os.replace(tmp, path)  # never a half-written .pth
    return path


def uninstall(site_dir: Optional[str] = None) -> Optional[str]:
    path = os.path.join(_site_dir(site_dir), PTH_NAME)
    if os.path.exists(path):
        os.remove(path)
        return path
    return None


def _pth_target(path: str) -> Optional[str]:
    """The boot file a ``.pth`` written by :func:`install` runs (``None`` if unreadable / not ours)."""
    import ast
    import re

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"exec\((.*), \{\}\)\s*$", text, re.M)
    if not m:
        return None
    try:
        code = ast.literal_eval(m.group(1))
        m2 = re.search(r"^    p = (.*)$", code, re.M)
        return ast.literal_eval(m2.group(1)) if m2 else None
    except (ValueError, SyntaxError):
        return None


def status(site_dir: Optional[str] = None) -> dict:
    path = os.path.join(_site_dir(site_dir), PTH_NAME)
    installed = os.path.exists(path)
    target = _pth_target(path) if installed else None
    return {
        "pth": path,
        "installed": installed,
        "pth_boot_file": target,  # what the .pth runs
        "pth_current": installed and target == BOOT_FILE,  # it runs this fastdora's boot file
        "boot_file": BOOT_FILE,
        "hook_active": any(getattr(f, "_fastdora_llamafactory_hook", False) for f in sys.meta_path),
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
        st = status(a.site_dir)
        if not st["installed"]:
            print(f"fastdora: not installed ({st['pth']} absent): `use_fast_dora` is unknown to LLaMA-Factory here")
        elif st["pth_current"]:
            print(f"fastdora: installed: {st['pth']} runs {st['boot_file']}")
        else:
            print(f"fastdora: {st['pth']} runs {st['pth_boot_file']!r}, not this fastdora's {st['boot_file']}: "
                  "run `python -m fastdora.plugins.llamafactory install` again")
        print(f"  import hook active in this interpreter: {st['hook_active']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
