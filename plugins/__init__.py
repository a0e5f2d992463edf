"""Thin trainer plugins for fastdora (no math; each imports its framework lazily).

- ``fastdora.plugins.FastDoraCallback`` / ``fastdora.plugins.hf``: Hugging Face ``Trainer`` (and TRL trainers).
- ``fastdora.plugins.trl``: the same callback for TRL (``SFTTrainer``, ``DPOTrainer``, ...).
- ``fastdora.plugins.axolotl.FastDoraPlugin``: Axolotl plugin (``plugins: [fastdora.plugins.axolotl.FastDoraPlugin]``).
- ``fastdora.plugins.llamafactory``: ``use_fast_dora: true`` in a LLaMA-Factory YAML
  (after ``python -m fastdora.plugins.llamafactory install``).

Importing this package imports no trainer framework.
"""

__all__ = ["FastDoraCallback"]


def __getattr__(name):
    if name == "FastDoraCallback":
        from .hf import FastDoraCallback

        return FastDoraCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
