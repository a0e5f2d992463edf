"""Counters proving which fastdora path ran (tests and plugins read them)."""

from __future__ import annotations

import collections

import torch

__all__ = ["active_path_counter", "record", "reset"]

#: e.g. {"linear:triton": 12, "linear:eager": 3, "norm:computed": 2, "norm:cached": 13}
active_path_counter: collections.Counter = collections.Counter()


def record(key: str) -> None:
    if not torch.compiler.is_compiling():
        active_path_counter[key] += 1


def reset() -> None:
    active_path_counter.clear()
