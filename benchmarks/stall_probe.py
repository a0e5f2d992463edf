#!/usr/bin/env python3
"""Is fastdora's training iteration limited by Python work or by the host waiting? (issue 5 diagnosis)

``host_probe.py`` measured (H200, Qwen3-8B shapes, 8 layers, r=384, AMP): fastdora's GPU kernel time per iteration
only ~2% above LoRA's, yet 1.2-1.3x its wall time, with per-micro-batch host times that jump between 139 and 229 ms
(LoRA: 146-155 ms); under cProfile both took the same ~1.52 s per iteration. This probe runs LoRA and fastdora in ONE
process (same host, same allocator state, interleaved iteration by iteration, so a slow process cannot bias one
variant) under several process-wide conditions and records per iteration:

  - ``wall_ms`` (synchronised), ``cpu_ms`` (CPU time of the whole process: all threads) and ``main_cpu_ms`` (the
    calling thread: the forward; the backward runs on the autograd engine's device thread),
  - CUDA caching-allocator events during the iteration (device mallocs / frees, retries),
  - Python GC time.

Conditions: ``default``; ``no_mt_bwd`` (``torch.autograd.set_multithreading_enabled(False)``: the backward runs in
the calling thread); ``no_gc`` (``gc.disable()`` for the iteration); ``switch_1ms`` (``sys.setswitchinterval``
1 ms instead of 5: faster GIL hand-over between threads); ``no_step`` (no ``optimizer.step()``: W, A, B unchanged, so
fastdora's norms stay cached and are never recomputed). Variants: any of model_bench's (``lora``, ``fastdora``,
``eager``, ``fastdora_fuse``, ...), each built once in this process. Per micro-batch host times (until
``backward()`` returned) are recorded too. The order of the variants rotates by one position per round.

  python benchmarks/stall_probe.py --out DIR/stall_probe_amp.json [--setup amp|bf16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import model_bench as mb  # noqa: E402
from _bench_io import gc_pause_meter  # noqa: E402

CONDITIONS = ("default", "no_mt_bwd", "no_gc", "switch_1ms", "no_step")
_ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/stall_probe.json")
    mb.add_probe_args(p, "amp")
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    a = p.parse_args()
    import torch
    import torch.nn.functional as F

    dev, runs = mb.probe_runs(a)
    ctx, micro, sync = mb.step_inputs(a, dev)
    cuda = dev.type == "cuda"

    def iteration(v, step=True):
        model, opt, _ = runs[v]
        mb_ms = []
        for ids in micro:
            t0 = time.perf_counter()
            with ctx():
                logits = model(input_ids=ids, logits_to_keep=a.loss_tokens + 1, use_cache=False).logits
            loss = F.cross_entropy(logits[0, :-1].float(), ids[0, -a.loss_tokens:]) / a.ga
            loss.backward()
            mb_ms.append((time.perf_counter() - t0) * 1e3)
        if step:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return mb_ms

    @contextlib.contextmanager
    def condition(c):
        if c == "no_mt_bwd":
            with torch.autograd.set_multithreading_enabled(False):
                yield
        elif c == "no_gc":
            gc.disable()
            try:
                yield
            finally:
                gc.enable()
        elif c == "switch_1ms":
            old = sys.getswitchinterval()
            sys.setswitchinterval(1e-3)
            try:
                yield
            finally:
                sys.setswitchinterval(old)
        else:
            yield

    gc_ms = gc_pause_meter()
    conds = a.conditions.split(",")
    for v in runs:  # warm-up: compile, allocator, cached norms; two steps, so that the norm kernels of a
        for c in conds:  # recompute with a cached base (first run after the second step) compile here too
            for _ in range(2):
                with condition(c):
                    iteration(v, c != "no_step")
    sync()
    rows = []
    order = [(v, c) for v in runs for c in conds]
    for rnd in range(a.rounds):
        # the order rotates by one per round: over len(order) rounds every variant runs once in every position
        # (session 18: with a fixed or mirrored order the middle one was the slow position twice)
        k = rnd % len(order)
        for v, c in order[k:] + order[:k]:
            stats0 = torch.cuda.memory_stats(dev) if cuda else {}
            gc_ms[0] = 0.0
            sync()
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            with condition(c):
                mb_ms = iteration(v, c != "no_step")
                sync()
            row = dict(variant=v, condition=c, round=rnd, wall_ms=(time.perf_counter() - t0) * 1e3, mb_host_ms=mb_ms,
                       cpu_ms=(time.process_time() - c0) * 1e3, main_cpu_ms=(time.thread_time() - m0) * 1e3,
                       gc_ms=gc_ms[0])
            if cuda:
                stats1 = torch.cuda.memory_stats(dev)
                row.update({k: stats1.get(k, 0) - stats0.get(k, 0) for k in _ALLOC_KEYS})
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for v in runs:
        for c in conds:
            rs = [r for r in rows if r["variant"] == v and r["condition"] == c]
            summary[f"{v}/{c}"] = {k: statistics.median(r[k] for r in rs) for k in ("wall_ms", "cpu_ms", "main_cpu_ms")}
    base = {c: summary[f"lora/{c}"]["wall_ms"] for c in conds} if "lora" in runs else {}
    for key, s in summary.items():
        v, c = key.split("/")
        ratio = f"  vs LoRA {s['wall_ms'] / base[c]:.3f}x" if c in base else ""
        print(f"{key:24s} wall {s['wall_ms']:8.1f} ms  cpu {s['cpu_ms']:8.1f}  main-thread cpu {s['main_cpu_ms']:8.1f}"
              f"{ratio}", flush=True)
    meta = {"setup": a.setup, "shape": a.shape, "layers": a.layers, "rank": a.rank, "seq": a.seq, "ga": a.ga,
            "torch": torch.__version__, "cmd": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "info": {v: mb._jsonable(r[2]) for v, r in runs.items()}, "native_node": mb.native_node_info()}
    print("C++ composition node:", meta["native_node"], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
