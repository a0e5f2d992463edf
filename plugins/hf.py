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

The core's public options are the constructor keywords (``None`` = the core's default, which the ``FASTDORA_*``
environment variables may set): ``kernels``, ``legacy_embedding_compose``, ``dm_from_output``.

``transformers`` is imported only when :class:`FastDoraCallback` is first looked up, so importing
``fastdora.plugins`` never imports it.
"""

from __future__ import annotations

from typing import Any

from ._common import (
    REPORT_FILE,
    announce,
    collect_options,
    enable_on,
    process_rank,
    report_file_for_rank,
    report_payload,
    write_report,
)

__all__ = ["FastDoraCallback", "make_callback"]  # noqa: F822 (FastDoraCallback: module __getattr__)


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

        def on_train_end(self, args, state, control, model=None, **kwargs):
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


_CLASS = None


def _get_class():
    global _CLASS
    if _CLASS is None:
        _CLASS = _build_class()
        globals()["FastDoraCallback"] = _CLASS
    return _CLASS


def make_callback(**options: Any):
    """``FastDoraCallback(**options)``; handy where a framework wants a factory."""
    return _get_class()(**options)


def __getattr__(name: str):
    if name == "FastDoraCallback":
        return _get_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
