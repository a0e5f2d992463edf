"""TRL integration: TRL's trainers are Hugging Face ``Trainer`` subclasses, so :class:`FastDoraCallback` works as is.

    from trl import SFTConfig, SFTTrainer
    from peft import LoraConfig
    from fastdora.plugins.trl import FastDoraCallback

    trainer = SFTTrainer(
        model=model,                                   # a transformers model ...
        peft_config=LoraConfig(use_dora=True, ...),    # ... wrapped by TRL before Trainer.__init__
        args=SFTConfig(...),
        train_dataset=ds,
        callbacks=[FastDoraCallback()],                # or FastDoraCallback(kernels="eager", ...)
    )

Also works with a ``PeftModel`` passed in directly, and with the other TRL trainers that take a PEFT model
(``DPOTrainer``, ``KTOTrainer``, ``ORPOTrainer``, ``RewardTrainer``, ``GRPOTrainer``...): TRL builds the PeftModel in
its ``__init__`` before ``Trainer.__init__`` runs, so the callback's ``on_init_end`` already sees it; gradient
checkpointing, switched on inside ``train()``, needs nothing more. ``trl`` itself is not imported here.

POET-X: ``SFTTrainer(model=model, args=..., callbacks=[PoetXCallback(...)])`` with no ``peft_config`` (POET-X
trains the model's own linear layers; see :mod:`fastdora.plugins.hf`).
"""

__all__ = ["FastDoraCallback", "PoetXCallback", "make_callback"]  # noqa: F822 (module __getattr__)


def __getattr__(name):
    if name in ("FastDoraCallback", "PoetXCallback", "make_callback"):
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
