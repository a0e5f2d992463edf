#!/usr/bin/env python3
"""Pure host cost of a training micro-batch at real shapes, measured while the GPU is asleep (issue 5 diagnosis).

``host_probe.py`` / ``stall_probe.py`` time micro-batches on a GPU that is busy with the previous ones, so the host
time they see is bounded by the GPU (launches block once the queue is full) and cannot separate "more Python" from
"the host waits for something". Here each measured micro-batch starts behind a long ``torch.cuda._sleep`` kernel:
every launch of the micro-batch queues up behind it, nothing the host does can wait for GPU work of the micro-batch,
and the host time until ``backward()`` returns is the host's own work. If the sleep kernel is no longer running when
``backward()`` returns (``gpu_was_busy: false``), the host waited for the GPU somewhere (a synchronising call, a
full launch queue): that is reported, not hidden. With transformers' causal LMs it is always false: the causal-mask
construction synchronises once per forward (session 13, benchmarks/README.md), so the forward's host time includes
the sleep; the backward's host time (which includes the checkpoint recomputation) is the clean measurement.

Per variant (all built in ONE process, measured interleaved): host ms of the forward and of the backward (which
includes the checkpoint recomputation), the number of kernel launches of the micro-batch (a profiler pass), and the
GPU time of the micro-batch's work after the sleep. With ``--breakdown`` the DoRA/LoRA layer calls are wrapped with
timers (per-call host microseconds of PEFT's LoRA ``Linear.forward``, fastdora's composition forward/backward node
and its launcher functions); the wrappers add their own small cost to every variant alike.

Variants: model_bench's (``lora``, ``fastdora``, ``eager``, ...) plus ``fastdora_stub`` (fastdora with the
composition's kernels replaced by output allocations: the host cost without the composition's launches).

  python benchmarks/enqueue_probe.py --out DIR/enqueue_amp.json --setup amp [--layers 1] [--breakdown]
  python benchmarks/enqueue_probe.py --tiny --out /tmp/eq.json          # CPU smoke test (no sleep, no GPU)
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _timers(current):
    """(variant, name) -> [total seconds, calls]; ``wrap(obj, attr, name)`` times ``obj.attr`` (a function or
    staticmethod), charged to the variant ``current[0]`` names."""
    acc = collections.defaultdict(lambda: [0.0, 0])

    def wrap(obj, attr, name):
        raw = obj.__dict__[attr]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        @functools.wraps(fn)
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                rec = acc[(current[0], name)]
                rec[0] += time.perf_counter() - t0
                rec[1] += 1

        setattr(obj, attr, staticmethod(timed) if isinstance(raw, staticmethod) else timed)

    return acc, wrap


def gap_report(torch, model, microbatch, v, n_mb, sync, min_gap_us=20.0, top=12):
    """Profile ``n_mb`` back-to-back micro-batches (no sleep) and group the GPU's idle gaps between consecutive kernels
    by the kernel that follows the gap: where the device waited for the host."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n_mb):
            microbatch(v)
        sync()
    kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type.name == "CUDA")
    by_next = collections.defaultdict(lambda: [0.0, 0])
    idle = 0.0
    for (s0, e0, _), (s1, _, n1) in zip(kern, kern[1:]):
        gap = s1 - max(e0, s0)
        if gap >= min_gap_us:
            idle += gap
            rec = by_next[n1[:90]]
            rec[0] += gap
            rec[1] += 1
    span = kern[-1][1] - kern[0][0] if kern else 0.0
    busy = sum(e - s for s, e, _ in kern)
    out = {"span_ms": span / 1e3, "kernel_ms": busy / 1e3, "idle_gaps_ms": idle / 1e3, "kernels": len(kern),
           "top_gaps_by_next_kernel": [{"next": k, "ms": t / 1e3, "count": c}
                                       for k, (t, c) in sorted(by_next.items(), key=lambda kv: -kv[1][0])[:top]]}
    print(f"{v}: {n_mb} micro-batches back to back: span {out['span_ms']:.1f} ms, kernels {out['kernel_ms']:.1f} ms,"
          f" idle gaps >= {min_gap_us:.0f} us {out['idle_gaps_ms']:.1f} ms", flush=True)
    for g in out["top_gaps_by_next_kernel"]:
        print(f"    {g['ms']:8.2f} ms in {g['count']:5d} gaps before {g['next']}", flush=True)
    return out


def host_profile(torch, microbatch, v, n_mb, sleep, top=40):
    """cProfile of ``n_mb`` micro-batches of variant ``v``, each behind a GPU sleep, with the backward on the calling
    thread (the autograd engine's device thread is invisible to cProfile): host seconds per function, per
    micro-batch. cProfile's own per-call cost inflates Python-heavy code alike in every variant."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(n_mb):
            sleep()
            prof.enable()
            microbatch(v)
            prof.disable()
    sleep()
    st = pstats.Stats(prof)
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"function": f"{os.path.basename(fname)}:{line}({func})", "calls_per_mb": nc / n_mb,
                     "tottime_ms_per_mb": tt * 1e3 / n_mb, "cumtime_ms_per_mb": ct * 1e3 / n_mb})
    rows.sort(key=lambda r: -r["tottime_ms_per_mb"])
    total = sum(r["tottime_ms_per_mb"] for r in rows)
    print(f"{v}: cProfile, {n_mb} micro-batches (backward on the calling thread): {total:.1f} ms host per"
          " micro-batch (incl. the wait at the causal mask's sync)", flush=True)
    for r in rows[:top]:
        print(f"    {r['tottime_ms_per_mb']:8.2f} ms {r['cumtime_ms_per_mb']:8.2f} cum {r['calls_per_mb']:7.0f} calls"
              f"  {r['function'][:110]}", flush=True)
    return {"total_ms_per_mb": total, "top": rows[:120]}


def write_trace(torch, microbatch, v, sleep, path):
    """A torch.profiler trace (CPU ops, CUDA runtime calls, kernels) of one micro-batch of ``v`` behind a GPU sleep,
    gzipped (read it in Perfetto / chrome://tracing, or with json)."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sleep()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        microbatch(v)
        sleep()
    raw = path[:-3]
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as fi, gzip.open(path, "wb") as fo:
        shutil.copyfileobj(fi, fo)
    os.remove(raw)
    print(f"{v}: trace {path} ({os.path.getsize(path) / 1e6:.1f} MB)", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/enqueue_probe.json")
    p.add_argument("--setup", default="amp", choices=["amp", "bf16"])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--loss-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sleep-ms", type=float, default=400.0, help="GPU sleep ahead of each measured micro-batch")
    p.add_argument("--variants", default="lora,fastdora,fastdora_stub")
    p.add_argument("--breakdown", action="store_true", help="time the layer calls (wrappers)")
    p.add_argument("--gaps", type=int, default=0, metavar="MB",
                   help="also profile MB back-to-back micro-batches without the sleep and report where the GPU idles")
    p.add_argument("--old-pkg", default=None, help="variant fastdora_old: the fastdora package in DIR/fastdora")
    p.add_argument("--cprofile", type=int, default=0, metavar="MB",
                   help="also cProfile MB micro-batches per variant behind the sleep, the backward on the calling "
                        "thread (so its Python, the checkpoint recomputation, is seen): host time per function")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="also write DIR/trace_<variant>.json.gz: a torch.profiler trace (CPU ops, CUDA runtime "
                        "calls, kernels) of one micro-batch per variant behind the sleep")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test")
    a = p.parse_args()
    import torch
    import torch.nn.functional as F

    import model_bench as mb

    dev = torch.device("cpu" if a.tiny else "cuda")
    if a.tiny:
        a.shape, a.seq, a.loss_tokens, a.layers, a.rank, a.rounds = "tiny", 64, 16, 1, 8, 2
    a.ga = 1
    ctx, micro, sync = mb.step_inputs(a, dev)
    ids = micro[0]
    cuda = dev.type == "cuda"

    stub_flag, current = [False], [None]
    runs = {}
    for v in a.variants.split(","):
        model, _ = mb.build_in_process(a, dev, "fastdora" if v == "fastdora_stub" else v)
        model.train()
        runs[v] = model
    if "fastdora_stub" in runs:
        from layer_host_probe import _stub_impl

        from fastdora import dispatch
        from fastdora.ops import compose as oc

        stub, real = _stub_impl(oc), dispatch.compose_impl
        dispatch.compose_impl = lambda *args, **kw: stub if stub_flag[0] else real(*args, **kw)

    acc = None
    if a.breakdown:
        acc, wrap = _timers(current)
        from peft.tuners.lora import layer as peft_layer

        wrap(peft_layer.Linear, "forward", "peft Linear.forward (whole layer)")
        if any(v.startswith("fastdora") for v in runs):
            from fastdora import layers as fl
            from fastdora.ops import compose as oc

            wrap(fl.FastDoraLinearVariant, "forward", "fastdora variant forward")
            wrap(fl._FastDoraMixin, "_fd_weight_norm", "fastdora norm-cache lookup")
            wrap(oc._DoraCompose, "forward", "_DoraCompose.forward")
            wrap(oc._DoraCompose, "backward", "_DoraCompose.backward")
            try:
                from fastdora.kernels import compose as kc

                wrap(kc._TritonImpl, "compose_fwd", "triton compose_fwd (launcher)")
                wrap(kc._TritonImpl, "compose_bwd", "triton compose_bwd (launcher)")
            except Exception as e:  # noqa: BLE001 - no Triton (CPU smoke test)
                print("no triton timers:", repr(e))

    def microbatch(v):
        model = runs[v]
        stub_flag[0], current[0] = v == "fastdora_stub", v
        try:
            t0 = time.perf_counter()
            with ctx():
                logits = model(input_ids=ids, logits_to_keep=a.loss_tokens + 1, use_cache=False).logits
            loss = F.cross_entropy(logits[0, :-1].float(), ids[0, -a.loss_tokens:])
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
        finally:
            stub_flag[0] = False
        model.zero_grad(set_to_none=True)
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    cycles_per_ms = None
    if cuda:  # calibrate torch.cuda._sleep
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.cuda._sleep(int(2e8))
        e1.record()
        sync()
        cycles_per_ms = 2e8 / e0.elapsed_time(e1)

    def sleep():  # an idle GPU, then a long sleep kernel ahead of what the host enqueues next
        sync()
        if cuda:
            torch.cuda._sleep(int(a.sleep_ms * cycles_per_ms))

    launches = {}
    for v in runs:  # warm-up (compile, allocator, cached norms) and a launch count
        for _ in range(3):
            microbatch(v)
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                microbatch(v)
                sync()
            launches[v] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    if acc is not None:
        acc.clear()
    sync()
    rows = []
    for rnd in range(a.rounds):
        for v in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
            busy = None
            if cuda:
                sleep()
                e_sleep, e_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e_sleep.record()
            fwd, bwd = microbatch(v)
            if cuda:
                busy = not e_sleep.query()  # still sleeping: the host never waited for the GPU
                e_end.record()
            sync()
            row = dict(variant=v, round=rnd, host_fwd_ms=fwd, host_bwd_ms=bwd, host_ms=fwd + bwd, gpu_was_busy=busy,
                       gpu_ms=e_sleep.elapsed_time(e_end) if cuda else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for v in runs:
        rs = [r for r in rows if r["variant"] == v]
        if not rs:
            continue
        s = {k: statistics.median(r[k] for r in rs) for k in ("host_fwd_ms", "host_bwd_ms", "host_ms")}
        s["host_ms_min"] = min(r["host_ms"] for r in rs)
        if cuda:
            s["gpu_ms"] = statistics.median(r["gpu_ms"] for r in rs)
            s["all_gpu_busy"] = all(r["gpu_was_busy"] for r in rs)
            s["launches"] = launches.get(v)
        summary[v] = s
    base = summary.get("lora")
    for v, s in summary.items():
        extra = f"  host vs LoRA +{s['host_ms'] - base['host_ms']:.1f} ms" if base else ""
        print(f"{v:16s} host fwd {s['host_fwd_ms']:7.1f}  bwd {s['host_bwd_ms']:7.1f}  total {s['host_ms']:7.1f} ms"
              f" (min {s['host_ms_min']:.1f})  gpu {s.get('gpu_ms') or 0:7.1f} ms  launches {s.get('launches')}"
              f"  gpu busy throughout: {s.get('all_gpu_busy')}{extra}", flush=True)
    breakdown = None
    if acc is not None:
        n = a.rounds  # every variant ran `rounds` measured micro-batches
        breakdown = {f"{v}: {k}": {"ms_per_microbatch": t * 1e3 / n, "calls_per_microbatch": c / n,
                                   "us_per_call": t * 1e6 / max(c, 1)}
                     for (v, k), (t, c) in sorted(acc.items())}
        for k, b in breakdown.items():
            print(f"  {k:56s} {b['us_per_call']:8.1f} us/call  {b['calls_per_microbatch']:6.0f} calls/mb"
                  f"  {b['ms_per_microbatch']:7.2f} ms/mb", flush=True)
    gaps = {v: gap_report(torch, runs[v], microbatch, v, a.gaps, sync) for v in runs} if (cuda and a.gaps) else None
    profiles = {v: host_profile(torch, microbatch, v, a.cprofile, sleep) for v in runs} if a.cprofile else None
    if a.trace:
        for v in runs:
            write_trace(torch, microbatch, v, sleep, os.path.join(a.trace, f"trace_{v}.json.gz"))
    meta = {"setup": a.setup, "shape": a.shape, "layers": a.layers, "rank": a.rank, "seq": a.seq,
            "sleep_ms": a.sleep_ms, "torch": torch.__version__, "cmd": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "summary": summary, "breakdown": breakdown, "gaps": gaps, "rows": rows,
                   "host_profile": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
