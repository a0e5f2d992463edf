"""Thin trainer plugins for fastdora (no math; each imports its framework lazily).

- ``fastdora.plugins.FastDoraCallback`` / ``fastdora.plugins.hf``: Hugging Face ``Trainer`` (and TRL trainers).
- ``fastdora.plugins.PoetXCallback``: POET-X training (:mod:`fastdora.poetx`) in a Hugging Face / TRL trainer.
- ``fastdora.plugins.trl``: the same callback for TRL (``SFTTrainer``, ``DPOTrainer``, ...).
- ``fastdora.plugins.axolotl.FastDoraPlugin``: Axolotl plugin (``plugins: [fastdora.plugins.axolotl.FastDoraPlugin]``);
  ``fastdora.plugins.axolotl.PoetXPlugin`` for POET-X.
- ``fastdora.plugins.llamafactory``: ``use_fast_dora: true`` in a LLaMA-Factory YAML
  (after ``python -m fastdora.plugins.llamafactory install``); ``use_poetx: true`` for POET-X.

Importing this package imports no trainer framework.
"""

__all__ = ["FastDoraCallback", "PoetXCallback"]  # noqa: F822 (module __getattr__)


def __getattr__(name):
    if name in ("FastDoraCallback", "PoetXCallback"):
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
