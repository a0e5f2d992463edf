"""Small I/O helpers shared by the benchmark scripts (run as scripts: this folder is on sys.path)."""

from __future__ import annotations

import json


def load_docs(paths: str) -> list:
    """The JSON documents named in ``paths`` (one path, or several separated by commas)."""
    docs = []
    for pth in paths.split(","):
        with open(pth) as f:
            docs.append(json.load(f))
    return docs
