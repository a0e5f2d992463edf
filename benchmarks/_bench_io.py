"""I/O helpers shared by model_bench.py and train_equivalence.py (run as scripts: this folder is on sys.path)."""

from __future__ import annotations

import json
import sys
import traceback


def load_docs(paths: str) -> list:
    """The JSON documents named in ``paths`` (one path, or several separated by commas)."""
    docs = []
    for pth in paths.split(","):
        with open(pth) as f:
            docs.append(json.load(f))
    return docs


def dispatch(a, report, run_worker, run_parent) -> None:
    """The scripts' common entry: ``--report`` (tables from saved results), ``--worker`` (one measured process: a
    traceback and exit code 2 on failure, which the parent reports), else the parent."""
    if a.report:
        report(a.report, a.report_out)
    elif a.worker:
        try:
            run_worker(a)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            sys.exit(2)
    else:
        run_parent(a)
