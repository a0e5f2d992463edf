"""Hugging Face ``Trainer`` integration: :class:`FastDoraCallback`.

    from fastdora.plugins import FastDoraCallback
    trainer = Trainer(model=peft_model, args=args, train_dataset=ds, callbacks=[FastDoraCallback()])

The callback converts the DoRA layers of the (PEFT) model as soon as the trainer holds it (``on_init_end``), checks
again at ``on_train_begin`` (the trainer may have wrapped or replaced the model in between: DDP / DeepSpeed /
accelerate wrappers are peeled), says so in ONE line per process at default verbosity (``fastdora: on, converted
28 DoRA layer(s) (28 linear); ...`` on stderr through the ``fastdora`` logger, ``[rank N]`` first in a job of several
processes; the full report goes to the ``transformers`` logger at DEBUG), warns and does nothing for a model without
DoRA, and at ``on_train_end`` writes its report (which fastdora paths ran, ``fastdora.active_path_counter``) into
``args.output_dir`` on EVERY process: ``fastdora_report.json`` on rank 0, ``fastdora_report.rank<N>.json`` on rank N.
From ``on_step_begin`` to ``on_step_end`` of every optimizer step it holds a ``fastdora.step_scope`` on the model: where
the trainer compiled the whole model (``torch_compile=True``), the compiled graph reads each layer's norm slot instead
of calling fastdora's norm op per layer and forward.

The core's public options are the constructor keywords (``None`` = the core's default, which the ``FASTDORA_*``
environment variables may set): ``kernels``, ``legacy_embedding_compose``, ``dm_from_output``.

POET-X (:mod:`fastdora.poetx`) through :class:`PoetXCallback` (a plain model, no adapter)::

    from fastdora.plugins import PoetXCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[PoetXCallback(block_size=256, merge_interval=200, mode="fast")])
    trainer.train()
    fastdora.poetx.export(trainer.model)   # back to plain nn.Linear layers (merged weights)
    trainer.save_model("out")              # loads in stock transformers

At ``on_init_end``, inside ``Trainer.__init__`` and so before the trainer builds its optimizer, the callback converts
the model's plain ``nn.Linear`` layers (not ``exclude``: ``lm_head`` by default; embeddings are no linear layers;
layers whose features ``block_size`` does not divide are skipped and listed) and wraps the trainer's own
``create_optimizer``: the trainer's optimizer (``args.optim``: torch AdamW, fused or foreach, ...) is built as usual,
then the ``Q`` parameters move into a group of their own with ``lr_scale`` times the learning rate and no weight
decay, before the trainer builds its scheduler (which schedules that group like the others). After every
``merge_interval``-th optimizer step (``state.global_step``, so gradient accumulation counts optimizer steps) it
merges every layer and drops the optimizer's state of ``Q``. The state to resume lives in the model's state dict
(``Q``, the permutations, the merge count; the merged weights) and the trainer's checkpoint (optimizer, step), so
``resume_from_checkpoint`` continues the same run from any step. Permutations are seeded by ``args.seed``: every DDP
process draws the same ones and merges its own replica (nothing is broadcast). One line per process at default
verbosity; ``poetx_report.json`` (every converted and skipped layer with the reason, the merges) in ``output_dir``.
Options (``None``: the default): ``block_size`` (256), ``merge_interval`` (200), ``mode`` ("fast" / "mem"),
``lr_scale`` (0.5), ``exclude`` (``("lm_head",)``), ``weight_format`` ("dense", or "int8": the frozen weights as
group-wise int8 codes with float32 scales in groups of 128 input features, dequantised chunk by chunk in the GEMMs and
requantised at each merge; layers whose ``in_features`` 128 does not divide are skipped and listed).

``transformers`` is imported only when :class:`FastDoraCallback` or :class:`PoetXCallback` is first looked up, so
importing ``fastdora.plugins`` never imports it.
"""

from __future__ import annotations

import sys
from typing import Any

from ._common import (
    REPORT_FILE,
    announce,
    collect_options,
    enable_on,
    process_rank,
    report_file_for_rank,
    report_payload,
    unwrap_model,
    write_report,
)

__all__ = ["FastDoraCallback", "PoetXCallback", "make_callback", "make_poetx_callback"]  # noqa: F822 (module __getattr__)


def _build_class():
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers.fastdora")  # under transformers' handler and verbosity

    class FastDoraCallback(TrainerCallback):
        """Switch a trainer's PEFT DoRA model to fastdora (see the module docstring)."""

        def __init__(
            self,
            *,
            kernels: str | None = None,
            legacy_embedding_compose: bool | None = None,
            dm_from_output: bool | None = None,
            write_report: bool = True,
            report_file: str = REPORT_FILE,
            framework: str = "hf",
        ):
            self.options = collect_options(
                kernels=kernels,
                legacy_embedding_compose=legacy_embedding_compose,
                dm_from_output=dm_from_output,
            )
            self.write_report = write_report
            self.report_file = report_file
            self.framework = framework
            self.report = None
            self.latest = None
            self._logged = False
            self._warned_no_dora = False
            self.announce_logger = None  # the one line's logger (None: ``fastdora``'s); frameworks set their own
            self._scope = None  # the open fastdora.step_scope of the current optimizer step

        # -- conversion ----------------------------------------------------------------------------------
        def _convert(self, model: Any, when: str) -> None:
            if model is None:
                return
            from ._common import has_dora, unwrap_model

            inner = unwrap_model(model)
            if not has_dora(inner):
                if not self._warned_no_dora:
                    self._warned_no_dora = True
                    logger.warning(
                        "fastdora: FastDoraCallback found no DoRA layer in the trainer's model (%s at %s); "
                        "fastdora does nothing. Use a PEFT LoraConfig with use_dora=True.",
                        type(inner).__name__,
                        when,
                    )
                return
            report = enable_on(inner, self.options, logger=logger, who="fastdora")  # idempotent
            if report is None:
                return
            if self.report is None or getattr(report, "total_converted", 0):
                self.report = report  # the one that converted the model: the headline of the log / JSON
            self.latest = report  # describes the model as it is now
            if not self._logged:
                self._logged = True
                logger.debug("fastdora enabled (%s): %s", when, report)
                announce(report, logger=self.announce_logger)  # the one line at default verbosity, once per process

        def on_init_end(self, args, state, control, model=None, **kwargs):
            self._convert(model, "on_init_end")
            return control

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            # The trainer may have wrapped (DDP / DeepSpeed) or replaced the model since __init__.
            self._convert(model, "on_train_begin")
            return control

        # -- one step scope per optimizer step: where the trainer compiled the whole model (torch_compile=True), its
        # graphs read the layers' norm slots instead of calling fastdora's norm op per layer and forward
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if self.report is not None and model is not None and self._scope is None:
                import fastdora

                from ._common import unwrap_model

                self._scope = fastdora.step_scope(unwrap_model(model))
                self._scope.__enter__()
            return control

        def on_step_end(self, args, state, control, **kwargs):
            self._close_scope()
            return control

        def _close_scope(self) -> None:
            if self._scope is not None:
                scope, self._scope = self._scope, None
                scope.__exit__(None, None, None)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self._close_scope()
            if self.write_report:  # every rank: each converted and ran its own model
                rank, _ = process_rank(args)
                payload = report_payload(self.report, self.options, self.framework, self.latest, args=args)
                path = write_report(
                    getattr(args, "output_dir", None), payload, report_file_for_rank(self.report_file, rank)
                )
                logger.info(
                    "fastdora: path counter at train end %s (report: %s)", payload["active_path_counter"], path
                )
            return control

    FastDoraCallback.__module__ = __name__
    FastDoraCallback.__qualname__ = "FastDoraCallback"
    return FastDoraCallback


def _find_trainer(trainer_cls, model: Any):
    """The ``Trainer`` whose ``__init__`` is running this callback's ``on_init_end`` (callbacks are not given the
    trainer): the nearest caller frame whose ``self`` is a ``trainer_cls`` holding ``model``."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, trainer_cls) and (model is None or getattr(owner, "model", None) is model):
            return owner
        frame = frame.f_back
    return None


def _build_poetx_class():
    from transformers import Trainer, TrainerCallback
    from transformers.utils import logging as hf_logging

    from . import _poetx_common as px

    logger = hf_logging.get_logger("transformers.fastdora")

    class PoetXCallback(TrainerCallback):
        """Train a model's linear layers with POET-X inside a Hugging Face ``Trainer`` (see the module docstring)."""

        def __init__(
            self,
            *,
            block_size: int | None = None,
            merge_interval: int | None = None,
            mode: str | None = None,
            lr_scale: float | None = None,
            exclude: Any = None,
            weight_format: str | None = None,
            write_report: bool = True,
            report_file: str = px.REPORT_FILE,
            framework: str = "hf",
        ):
            self.options = px.collect_options(block_size=block_size, merge_interval=merge_interval, mode=mode,
                                              lr_scale=lr_scale, exclude=exclude, weight_format=weight_format)
            self.write_report = write_report
            self.report_file = report_file
            self.framework = framework
            self.report = None  # fastdora.poetx.ConvertReport of the conversion
            self.merges: list = []  # optimizer steps after which this process merged
            self.announce_logger = None  # the one line's logger (None: ``fastdora``'s); frameworks set their own
            self._model = None  # the converted model (unwrapped)
            self._optimizer = None  # the trainer's optimizer, holding the Q groups
            self._q_groups: list = []

        # -- conversion, before the trainer builds its optimizer ---------------------------------------------
        def _convert(self, model: Any, seed: int) -> None:
            inner = unwrap_model(model)
            if inner is None or inner is self._model:
                return
            self.report = px.convert_for_training(inner, self.options, seed=seed)
            self._model = inner
            logger.debug("fastdora POET-X: %s", self.report)
            px.announce(self.report, self.options, logger=self.announce_logger)

        def _attach(self, trainer: Any) -> None:
            """Convert ``trainer.model`` now and have the trainer's own ``create_optimizer`` put the ``Q`` parameters
            into groups of their own (:func:`~fastdora.plugins._poetx_common.split_q_group`)."""
            if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
                raise ValueError("POET-X: the Trainer's DeepSpeed and FSDP are not supported by PoetXCallback; use "
                                 "DDP (torchrun without --fsdp / --deepspeed), or FSDP2 (fully_shard) in your own "
                                 "loop with fastdora.poetx.merge")
            if getattr(trainer, "optimizer", None) is not None:
                raise ValueError("POET-X: the trainer was given an optimizer (optimizers=...), built before the "
                                 "model was converted; let the trainer build its own (optim=..., "
                                 "optimizer_cls_and_kwargs=...)")
            self._convert(trainer.model, getattr(trainer.args, "seed", 0))
            create = trainer.create_optimizer
            if getattr(create, "_fastdora_poetx", None) is self:
                return

            def create_optimizer(model=None):
                self._convert(trainer.model if model is None else model, getattr(trainer.args, "seed", 0))
                fresh = trainer.optimizer is None
                optimizer = create() if model is None else create(model)
                if fresh:
                    lr_scale = self.options["lr_scale"]
                    self._q_groups = px.split_q_group(optimizer, px.q_parameters(self._model), lr_scale)
                    self._optimizer = optimizer
                return optimizer

            create_optimizer._fastdora_poetx = self
            trainer.create_optimizer = create_optimizer

        def on_init_end(self, args, state, control, model=None, **kwargs):
            trainer = _find_trainer(Trainer, model)
            if trainer is None:
                raise RuntimeError("POET-X: PoetXCallback found no Trainer building itself; pass it to the "
                                   "trainer's constructor: Trainer(..., callbacks=[PoetXCallback(...)])")
            self._attach(trainer)
            return control

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if self._model is None or unwrap_model(model) is not self._model or not self._q_groups:
                raise RuntimeError(
                    "POET-X: the trainer's model or optimizer was not set up by PoetXCallback (it must be in the "
                    "trainer's constructor, callbacks=[...], not added later with add_callback; a model_init or a "
                    "replaced model is not supported)")
            return control

        # -- merges ------------------------------------------------------------------------------------------
        def on_step_end(self, args, state, control, **kwargs):
            if px.merge_due(state.global_step, self.options["merge_interval"]):
                from fastdora import poetx

                poetx.merge(self._model)
                px.reset_state(self._optimizer, px.q_parameters(self._model))
                self.merges.append(int(state.global_step))
                logger.debug("fastdora POET-X: merged after optimizer step %d", state.global_step)
            return control

        # -- report ------------------------------------------------------------------------------------------
        def payload(self, args: Any = None) -> dict:
            q_lr = [g.get("initial_lr", g.get("lr")) for g in self._q_groups] or None
            return px.report_payload(self.report, self.options, self.framework, self.merges, args=args, q_lr=q_lr)

        def on_train_end(self, args, state, control, **kwargs):
            if self.write_report:  # every rank
                path = px.write_rank_report(getattr(args, "output_dir", None), self.payload(args), args,
                                            self.report_file)
                logger.info("fastdora POET-X: %d merge(s) in this run (report: %s)", len(self.merges), path)
            return control

    PoetXCallback.__module__ = __name__
    PoetXCallback.__qualname__ = "PoetXCallback"
    return PoetXCallback


_CLASSES: dict = {}


def _get_class(name: str = "FastDoraCallback"):
    if name not in _CLASSES:
        _CLASSES[name] = {"FastDoraCallback": _build_class, "PoetXCallback": _build_poetx_class}[name]()
        globals()[name] = _CLASSES[name]
    return _CLASSES[name]


def make_callback(**options: Any):
    """``FastDoraCallback(**options)``; handy where a framework wants a factory."""
    return _get_class("FastDoraCallback")(**options)


def make_poetx_callback(**options: Any):
    """``PoetXCallback(**options)``; handy where a framework wants a factory."""
    return _get_class("PoetXCallback")(**options)


def __getattr__(name: str):
    if name in ("FastDoraCallback", "PoetXCallback"):
        return _get_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
