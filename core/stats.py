"""Counters proving which fastdora path ran (tests and plugins read them)."""

from __future__ import annotations

import collections

import torch

__all__ = ["active_path_counter", "record", "reset", "path_key"]

#: e.g. {"linear:triton": 12, "linear:eager": 3, "norm:computed": 2, "norm:cached": 13}
active_path_counter: collections.Counter = collections.Counter()


def record(key: str) -> None:
    if not torch.compiler.is_compiling():
        active_path_counter[key] += 1


_PATH_KEYS: dict = {}


def path_key(kind: str, impl: str) -> str:
    """``f"{kind}:{impl}"``, interned once per pair (the composition records one per call)."""
    k = _PATH_KEYS.get((kind, impl))
    if k is None:
        k = _PATH_KEYS[(kind, impl)] = f"{kind}:{impl}"
    return k


def reset() -> None:
    active_path_counter.clear()
