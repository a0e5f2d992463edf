"""Shared helpers of the plugin tests: a tiny PEFT DoRA model, a log-record collector, stand-ins for the frameworks
that are not installed in the test environment (Axolotl, LLaMA-Factory), a subprocess runner, and what the torchrun
jobs share (a free port, their environment, counted collective calls)."""

from __future__ import annotations

import logging
import os
import socket
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a torchrun rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict:
    """This process's environment for a job started alone or under torchrun: without a torchrun launcher's rank
    variables (a test run under torchrun must not pass them on), one thread per process, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def count_calls(module, names) -> dict:
    """Replace each function ``module.<name>`` with a wrapper that counts its calls; returns the counter
    (``{"n": calls so far}``). The torchrun jobs wrap ``torch.distributed``'s collectives with it."""
    calls = {"n": 0}

    def counting(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in names:
        setattr(module, name, counting(getattr(module, name)))
    return calls
