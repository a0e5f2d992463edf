"""Small I/O helpers shared by the benchmark scripts (run as scripts: this folder is on sys.path)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback


def load_package_as(path: str, name: str):
    """Import the ``fastdora`` package found in ``path`` (``path/fastdora``, e.g. an earlier commit's ``core/``) under
    the top-level name ``name``, next to the installed one (its modules import each other relatively)."""
    pkg_dir = os.path.join(path, "fastdora")
    spec = importlib.util.spec_from_file_location(name, os.path.join(pkg_dir, "__init__.py"),
                                                  submodule_search_locations=[pkg_dir])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def gc_pause_meter() -> list:
    """Registers a ``gc.callbacks`` hook adding every collection's duration (ms) to the returned one-element list;
    the caller resets ``meter[0] = 0.0`` before each measured region."""
    import gc
    import time

    meter = [0.0]
    t0 = [0.0]

    def cb(phase, _info):
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            meter[0] += (time.perf_counter() - t0[0]) * 1e3

    gc.callbacks.append(cb)
    return meter


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
