#!/usr/bin/env python3
"""Where does a training iteration's time go? (issue 5 diagnosis, model level)

Runs the model-bench setup (``model_bench.build_model`` / ``apply_adapter``: Qwen3-8B shapes, N layers, rsLoRA, seq
4096, gradient checkpointing, AMP or bf16) for each variant in its own process and, per micro-batch of the timed
gradient iterations, records

  - ``host_ms``: time until ``loss.backward()`` returned (no synchronisation: what the CPU spends enqueueing)
  - ``gpu_ms``: CUDA-event time between the micro-batch's first and last enqueued work
  - ``wall_ms`` per iteration (synchronised), Python GC pauses, Triton JIT compilations during the timed iterations,
  - synchronising calls (``torch.cuda.set_sync_debug_mode``) with the stack that made them,
  - a cProfile (tottime) of one whole iteration,
  - (CUDA) a torch.profiler trace of one whole iteration: device time per kernel and per group (fastdora's kernels,
    GEMMs, attention, reductions, elementwise), and the GPU's busy time against the iteration's span, which
    separates "more GPU work" from "GPU waiting for the host".

If ``host_ms`` ~ ``wall_ms`` the iteration is host-bound; compilations or syncs in the timed region are bugs.

  python benchmarks/host_probe.py --out DIR [--variants lora,fastdora] [--layers 8] [--setup amp]
  python benchmarks/host_probe.py --out DIR --variants lora,fastdora,fastdora_old --old-pkg OLD  # OLD/fastdora
  python benchmarks/host_probe.py --tiny --device cpu --out /tmp/hp       # CPU smoke test
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _bench_io import gc_pause_meter  # noqa: E402


def worker(a):
    import torch
    import torch.nn.functional as F

    import model_bench as mb

    rec_pkg = None
    if a.variant in ("fastdora", "eager"):  # which fastdora package ran (before/after comparisons)
        import fastdora

        rec_pkg = os.path.dirname(fastdora.__file__)
    dev = torch.device(a.device)
    a.shape = "tiny" if a.tiny else a.shape
    model = mb.build_model(a, dev)
    model, info = mb.apply_adapter(model, a, dev)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.0)
    ctx, micro, sync = mb.step_inputs(a, dev)
    cuda = dev.type == "cuda"

    def mbatch(ids, n):
        with ctx():
            logits = model(input_ids=ids, logits_to_keep=a.loss_tokens + 1, use_cache=False).logits
        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, -a.loss_tokens:]) / n
        loss.backward()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    # instrumentation: GC pauses, Triton compilations
    gc_ms = gc_pause_meter()
    compiles = []
    try:
        import triton

        def post_compile(*args, **kw):
            compiles.append(str(kw.get("repr") or kw.get("fn") or args)[:160])
            return None

        triton.knobs.runtime.jit_post_compile_hook = post_compile
    except Exception as e:  # noqa: BLE001
        compiles.append(f"(no compile hook: {e!r})")

    model.train()
    for _ in range(a.warmup):  # warm-up: two short iterations (compile, allocator, norm with cached base)
        for ids in micro[:2]:
            mbatch(ids, 2)
        step()
    sync()
    n_compile_warm = len(compiles)
    rec = dict(variant=a.label or a.variant, setup=a.setup, layers=a.layers, rank=a.rank, iters=[], info=info,
               compiles_warmup=n_compile_warm, fastdora_pkg=rec_pkg)
    for _ in range(a.repeats):
        gc_ms[0] = 0.0
        it = dict(host_ms=[], gpu_ms=[])
        sync()
        t_it = time.perf_counter()
        for ids in micro:
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            mbatch(ids, a.ga)
            it["host_ms"].append((time.perf_counter() - t0) * 1e3)
            if cuda:
                e1.record()
                it["_ev"] = it.get("_ev", []) + [(e0, e1)]
        t0 = time.perf_counter()
        step()
        it["step_host_ms"] = (time.perf_counter() - t0) * 1e3
        sync()
        it["wall_ms"] = (time.perf_counter() - t_it) * 1e3
        it["gpu_ms"] = [e0.elapsed_time(e1) for e0, e1 in it.pop("_ev", [])]
        it["gc_ms"] = gc_ms[0]
        rec["iters"].append(it)
    rec["compiles_timed"] = compiles[n_compile_warm:]
    rec["wall_ms_median"] = statistics.median(i["wall_ms"] for i in rec["iters"])
    rec["host_ms_per_mb_median"] = statistics.median(h for i in rec["iters"] for h in i["host_ms"])
    if cuda:
        rec["gpu_ms_per_mb_median"] = statistics.median(h for i in rec["iters"] for h in i["gpu_ms"])

    # synchronising calls in one micro-batch (+ step)
    syncs = []
    if cuda:
        def show(message, category, filename, lineno, file=None, line=None):
            st = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]]
            syncs.append(dict(msg=str(message)[:200], stack=st[-10:]))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            old = warnings.showwarning
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                mbatch(micro[0], 1)
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = old
        sync()
    rec["syncs"] = syncs[:20]
    rec["n_syncs"] = len(syncs)

    # cProfile of one whole iteration
    pr = cProfile.Profile()
    sync()
    pr.enable()
    for ids in micro:
        mbatch(ids, a.ga)
    step()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    rec["cprofile_tottime"] = s.getvalue()
    if cuda:  # device kernel time of one whole iteration: is the GPU work itself larger, or is the GPU idle?
        try:  # (new, not yet run on a GPU: a failure here must not lose the timings above)
            rec["kernel_profile"] = kernel_profile(lambda: ([mbatch(ids, a.ga) for ids in micro], step()), sync)
        except Exception as e:  # noqa: BLE001
            rec["kernel_profile"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    with open(a.result, "w") as f:
        json.dump(rec, f, indent=1)


_KERNEL_GROUPS = (  # (group, substrings of the kernel name), first match wins
    ("fastdora_norm", ("_norm_gram_kernel", "_norm_u_tma_kernel", "_norm_combine_kernel", "_split_parts_kernel",
                       "_g_sum_kernel")),
    ("fastdora", ("_dora_fwd_kernel", "_dora_bwd_kernel", "_dora_reduce_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "sm80_xmma", "cublas")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("reduce", ("reduce", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def _group(name: str) -> str:
    low = name.lower()
    for g, keys in _KERNEL_GROUPS:
        if any(k in low for k in keys):
            return g
    return "other"


def kernel_profile(run, sync, top=80):
    """One call of ``run`` under torch.profiler: per-kernel device time (count, total), per-group sums, the GPU's busy
    time (union of kernel intervals) against the span from first kernel start to last kernel end."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    out = summarize_kernels(kernels, top)
    try:  # host side: where the CPU time of the iteration goes (aten ops, CUDA runtime calls), by self time
        cpu = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages() if e.self_cpu_time_total > 0]
        out["cpu_self_ms_total"] = sum(c[2] for c in cpu) / 1e3
        out["cpu_events"] = sum(c[1] for c in cpu)
        out["cpu_top"] = [dict(name=k[:120], count=n, self_ms=us / 1e3)
                          for k, n, us in sorted(cpu, key=lambda c: -c[2])[:top]]
    except Exception as e:  # noqa: BLE001 - diagnostics only
        out["cpu_error"] = repr(e)
    return out


def summarize_kernels(kernels, top=80):
    """``kernels``: (name, start_us, end_us) per kernel execution."""
    if not kernels:
        return dict(error="no CUDA kernel events recorded")
    per, groups = {}, {}
    spans = sorted((s0, e0) for _, s0, e0 in kernels)
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s0, e0 in spans[1:]:
        if s0 > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    busy += cur_e - cur_s
    for name, s0, e0 in kernels:
        c = per.setdefault(name, [0, 0.0])
        c[0] += 1
        c[1] += e0 - s0
        g = _group(name)
        groups[g] = groups.get(g, 0.0) + (e0 - s0)
    total = sum(v[1] for v in per.values())
    span = spans[-1][1] - spans[0][0]
    return dict(
        kernel_ms_total=total / 1e3,
        gpu_busy_ms=busy / 1e3,
        span_ms=span / 1e3,
        idle_fraction=1.0 - busy / span if span else None,
        n_kernels=len(kernels),
        groups_ms={k: v / 1e3 for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        top=[dict(name=n[:160], count=c, ms=us / 1e3)
             for n, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]],
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default="/tmp/host_probe")
    p.add_argument("--variants", default="lora,fastdora")
    p.add_argument("--variant", default="fastdora")
    p.add_argument("--label", default=None, help="worker: name of the variant in the results")
    p.add_argument("--old-pkg", default=None,
                   help="a folder holding another fastdora package: variant 'fastdora_old' runs it (before/after)")
    p.add_argument("--result")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--setup", default="amp", choices=["amp", "bf16"])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--ga", type=int, default=8)
    p.add_argument("--loss-tokens", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    if a.tiny:
        a.seq, a.loss_tokens, a.layers, a.rank = 64, 16, 2, 8
    if a.worker:
        return worker(a)
    os.makedirs(a.out, exist_ok=True)
    results = []
    for v in a.variants.split(","):
        res = os.path.join(a.out, f"hp_{v}_{a.setup}.json")
        env = dict(os.environ)
        if v == "fastdora_old":
            if not a.old_pkg:
                raise SystemExit("variant fastdora_old needs --old-pkg")
            env["PYTHONPATH"] = os.path.abspath(a.old_pkg) + os.pathsep + env.get("PYTHONPATH", "")
        wv = "fastdora" if v == "fastdora_old" else v
        cmd = [sys.executable, __file__, "--worker", "--variant", wv, "--label", v, "--result", res] + [
            x for k in ("device", "shape", "layers", "rank", "setup", "seq", "ga", "loss_tokens", "warmup", "repeats")
            for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))] + (["--tiny"] if a.tiny else [])
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        print(f"== {v} {a.setup}: rc={rc} {time.perf_counter() - t0:.0f}s", flush=True)
        if rc == 0:
            results.append(json.load(open(res)))
    for r in results:
        print(f"\n#### {r['variant']} {r['setup']} L={r['layers']} r={r['rank']}: wall/iter {r['wall_ms_median']:.1f} ms, "
              f"host/mb {r['host_ms_per_mb_median']:.1f} ms, gpu/mb {r.get('gpu_ms_per_mb_median', float('nan')):.1f} ms,"
              f" compiles warm/timed {r['compiles_warmup']}/{len(r['compiles_timed'])}, syncs {r['n_syncs']}")
        for it in r["iters"]:
            print("   iter wall %.1f gc %.1f step_host %.1f | host %s | gpu %s" % (
                it["wall_ms"], it["gc_ms"], it["step_host_ms"], " ".join(f"{x:.1f}" for x in it["host_ms"]),
                " ".join(f"{x:.1f}" for x in it["gpu_ms"])))
        for c in r["compiles_timed"][:5]:
            print("   compile:", c)
        for s_ in r["syncs"][:6]:
            print("   sync:", s_["msg"][:100], "\n      " + "\n      ".join(s_["stack"][-6:]))
        kp = r.get("kernel_profile")
        if kp and "error" not in kp:
            print(f"   one iteration on the GPU: kernels {kp['kernel_ms_total']:.1f} ms ({kp['n_kernels']} launches), "
                  f"busy {kp['gpu_busy_ms']:.1f} of {kp['span_ms']:.1f} ms (idle {100 * kp['idle_fraction']:.1f}%); "
                  + ", ".join(f"{k} {v:.1f}" for k, v in kp["groups_ms"].items()))
            if "cpu_top" in kp:
                print(f"   host under the profiler: {kp['cpu_events']} events, self time {kp['cpu_self_ms_total']:.1f} ms;"
                      " top: " + ", ".join(f"{c['name']} {c['self_ms']:.1f}ms/{c['count']}" for c in kp["cpu_top"][:12]))
        print("\n".join(r["cprofile_tottime"].splitlines()[:45]))
    kps = {r["variant"]: r.get("kernel_profile") or {} for r in results}
    lora_ms = kps.get("lora", {}).get("kernel_ms_total")
    for v, kp in kps.items():  # the norm recompute's share: its kernels vs LoRA's kernel time per iteration (issue 3)
        norm_ms = kp.get("groups_ms", {}).get("fastdora_norm")
        if norm_ms is not None and lora_ms:
            print(f"\n#### {v}: norm kernels {norm_ms:.2f} ms per iteration = {100 * norm_ms / lora_ms:.2f}% of LoRA's "
                  f"kernel time ({lora_ms:.1f} ms)")
    with open(os.path.join(a.out, "host_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
