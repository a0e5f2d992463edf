"""Shared helpers of the plugin tests: a tiny PEFT DoRA model, a log-record collector, stand-ins for the frameworks
that are not installed in the test environment (Axolotl, LLaMA-Factory) and a subprocess runner."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_dora_model(embedding: bool = False):
    """A PEFT model with DoRA on two Linear layers (and an Embedding when asked); fp32 on the CPU."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.q = nn.Linear(16, 16)
            self.v = nn.Linear(16, 16)

        def forward(self, x):
            return self.v(self.q(self.emb(x)))

    torch.manual_seed(0)
    targets = ["q", "v"] + (["emb"] if embedding else [])
    return get_peft_model(Tiny(), LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=True))


class Records(logging.Handler):
    """Collects the records of one logger (attach with :func:`collect`)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level: int = logging.NOTSET) -> list:
        return [r.getMessage() for r in self.records if r.levelno >= level]


def collect(monkeypatch, name: str) -> Records:
    log = logging.getLogger(name)
    handler = Records()
    monkeypatch.setattr(log, "level", logging.DEBUG)
    monkeypatch.setattr(log, "disabled", False)
    monkeypatch.setattr(log, "handlers", [handler])
    monkeypatch.setattr(log, "_cache", {})  # Logger caches isEnabledFor() per level
    return handler


def fresh_announce(monkeypatch) -> None:
    """Forget that this process announced fastdora already (the line is once per process)."""
    from fastdora.plugins import _common

    monkeypatch.setattr(_common, "_ANNOUNCED", False)


def stub_axolotl(monkeypatch) -> None:
    """Just enough of ``axolotl`` for ``fastdora.plugins.axolotl._build_plugin``: ``BasePlugin`` and
    ``axolotl.utils.logging.get_logger``."""

    class BasePlugin:
        def __init__(self):
            pass

    mods = {
        "axolotl": types.ModuleType("axolotl"),
        "axolotl.integrations": types.ModuleType("axolotl.integrations"),
        "axolotl.integrations.base": types.ModuleType("axolotl.integrations.base"),
        "axolotl.utils": types.ModuleType("axolotl.utils"),
        "axolotl.utils.logging": types.ModuleType("axolotl.utils.logging"),
    }
    mods["axolotl.integrations.base"].BasePlugin = BasePlugin
    mods["axolotl.utils.logging"].get_logger = logging.getLogger
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def run_python(args: list, code: str, cwd: str, env: dict | None = None, timeout: int = 300):
    """``sys.executable ARGS -c CODE``; returns the CompletedProcess (text, stdout and stderr apart)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args, "-c", code], cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)
