#!/usr/bin/env python3
"""Where does the GPU wait during a training iteration? (issue 5 diagnosis: GPU idle time by phase and by cause)

Session 24's nvidia-smi samples put LoRA's timed iterations at ~97% GPU utilisation and fastdora's at ~91-95%, with
fastdora's kernel time within ~0.6% of LoRA's (session 23): the pure-bf16 tax looks like GPU idle, not GPU work.
This probe measures the idle directly. LoRA and fastdora (or any of model_bench's variants) are built in ONE process
and run interleaved; per round and variant: one unprofiled iteration (wall time, the reference; host ms per phase:
``fwd0`` / ``bwd0`` the first micro-batch, which recomputes the norms, ``fwd*`` / ``bwd*`` the others, ``step``)
and one profiled iteration (8 micro-batches + optimizer step) per mode under ``torch.profiler``:

  - ``cuda``: kernels and CUDA runtime calls only (the least profiler overhead on the host): how much of the
    iteration the GPU is idle, in which phase (``bwd`` includes the checkpoint recomputation), in gaps of which
    size, and whether the host was late (the launch that ends a gap was made after the gap began: host-bound) or
    the GPU waited on something else;
  - ``ops``: also the CPU ops (more host overhead, so more gaps): each host-late gap charged to the innermost CPU
    op (or ``record_function`` range) around the launch that ended it, and the host's own time by thread (the
    main one / the autograd engine's device thread), phase group and op (``host_breakdown``).

Per (variant, mode): medians over rounds of wall, kernel time, idle time, idle by phase / gap size / cause, the
synchronising or allocating runtime calls (``cudaStreamSynchronize``, ``cudaMemcpy*``, ``cudaMalloc``, ``cudaFree``,
...: count and host time), the top idle-causing ops and the host breakdown. ``--pyspy DIR``: afterwards each
variant's iterations sampled by py-spy (``fold_stacks``). Session 25's runs: benchmarks/README.md.

  python benchmarks/gap_probe.py --out DIR/gap_bf16.json --setup bf16 [--rounds 3] [--modes cuda,ops]
  python benchmarks/gap_probe.py --tiny --out /tmp/gap.json                   # CPU smoke test (no CUDA events)
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import model_bench as mb  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
PHASE_NAMES = ("fwd", "bwd", "step")  # the record_function ranges of iteration(): fwd:<i>, bwd:<i>, step:0
SMALL_CHILDREN = 12  # host_breakdown: an op instance with at most this many direct children counts as "small"
# runtime calls that block the host or may (allocation / free / copies / syncs)
SYNCING = ("Synchronize", "Memcpy", "Malloc", "Free", "cudaStreamWaitEvent", "cudaEventQuery")
SIZE_BINS = ((10, "<10us"), (50, "10-50us"), (200, "50-200us"), (1000, "0.2-1ms"), (float("inf"), ">1ms"))


def _bin(us):
    return next(name for lim, name in SIZE_BINS if us < lim)


def _phase_key(name, idx):
    """fwd0 / bwd0: the first micro-batch (the one that recomputes the norms after a step); fwd* / bwd*: the rest."""
    return name + ("" if name == "step" else "0" if idx == "0" else "*")


def _median_tree(trees: list):
    """Per leaf of nested dicts of numbers, the median over ``trees`` (a leaf missing or None in one counts as 0)."""
    if any(isinstance(t, dict) for t in trees):
        keys = sorted({k for t in trees if isinstance(t, dict) for k in t}, key=str)
        return {k: _median_tree([t.get(k) if isinstance(t, dict) else None for t in trees]) for k in keys}
    return statistics.median(t or 0.0 for t in trees) if trees else None


def _phase_at(phases, ts) -> str:
    """The key of the phase range holding host time ``ts`` ("outside" if none)."""
    return next((key for s, t, key in phases if s <= ts <= t), "outside")


def analyse(trace: dict, min_gap_us: float = 2.0, top: int = 15, marks=None) -> dict:
    """GPU idle of one profiled iteration from a chrome trace (torch.profiler's export_chrome_trace).

    The window runs from the first GPU event to the last one. Idle = the window minus the union of all GPU events
    (kernels, copies, memsets, any stream). Each idle gap of at least ``min_gap_us`` is attributed to the phase
    (``record_function`` ranges named fwd<i> / bwd<i> / step, by the host time of the launch that ends it) and is
    ``host_late`` when that launch was made after the GPU went idle (the host had nothing queued), else
    ``gpu_wait`` (the next work was queued but waited: a dependency, an event, a copy). ``marks``: the phases as
    (name "fwd:<i>" / ..., start, end) in host Unix ns (time.time_ns()), used where the trace holds no
    ``record_function`` ranges (a CUDA-only profile may record none), mapped through its baseTimeNanoseconds."""
    ev = trace.get("traceEvents", [])
    gpu = sorted((e for e in ev if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        return {"gpu_events": 0}
    launch = {}  # correlation id -> (host start time, thread) of the runtime call that launched it
    runtime = []
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launch[corr] = (e["ts"], e.get("tid"))
            runtime.append(e)
    phases = []  # (start, end, key): fwd0 / bwd0 (the micro-batch that recomputes the norms), fwd* / bwd*, step
    for e in ev:
        name, _, idx = e.get("name", "").partition(":")
        if e.get("cat") == "user_annotation" and name in PHASE_NAMES and "dur" in e:
            phases.append((e["ts"], e["ts"] + e["dur"], _phase_key(name, idx)))
    if not phases and marks and "baseTimeNanoseconds" in trace:
        base = trace["baseTimeNanoseconds"]
        for full, t0, t1 in marks:
            name, _, idx = full.partition(":")
            phases.append(((t0 - base) / 1e3, (t1 - base) / 1e3, _phase_key(name, idx)))
    ops = collections.defaultdict(list)  # thread -> [(start, end, name)] by start
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e \
                and e.get("name", "").partition(":")[0] not in PHASE_NAMES:
            ops[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for lst in ops.values():
        lst.sort()
    starts = {tid: [o[0] for o in lst] for tid, lst in ops.items()}

    def op_of(ts, tid):
        """The innermost (latest-starting) CPU op of the launching thread whose range holds ts."""
        lst = ops.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), ts) - 1
        for j in range(i, max(i - 2000, -1), -1):  # a bounded look-back
            s, t, name = lst[j]
            if t >= ts:
                return name
        return "(no op)"

    t_first, t_last = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy_end = gpu[0]["ts"]
    idle = 0.0
    kern_us = 0.0
    by_phase = collections.Counter()
    by_bin = collections.Counter()
    by_cause = collections.Counter()
    by_op = collections.Counter()
    n_gaps = collections.Counter()
    for e in gpu:
        kern_us += e["dur"]
        gap = e["ts"] - busy_end
        if gap >= min_gap_us:
            idle += gap
            corr = (e.get("args") or {}).get("correlation")
            lts, ltid = launch.get(corr, (None, None))
            late = lts is not None and lts > busy_end
            ph = _phase_at(phases, lts) if lts is not None else "unknown"
            cause = "host_late" if late else "gpu_wait"
            by_phase[f"{ph}/{cause}"] += gap
            by_bin[_bin(gap)] += gap
            by_cause[cause] += gap
            n_gaps[cause] += 1
            if late and ops:
                by_op[op_of(lts, ltid)] += gap
        busy_end = max(busy_end, e["ts"] + e["dur"])
    syncs = collections.defaultdict(lambda: [0, 0.0])
    for e in runtime:
        if any(k in e["name"] for k in SYNCING):
            rec = syncs[e["name"]]
            rec[0] += 1
            rec[1] += e.get("dur", 0)
    launches = sum(1 for e in runtime if "Launch" in e["name"])
    window = t_last - t_first
    return {
        "gpu_events": len(gpu), "launches": launches,
        "window_ms": window / 1e3, "gpu_event_ms": kern_us / 1e3, "idle_ms": idle / 1e3,
        "busy_frac": 1 - idle / window if window else None,
        "idle_ms_by_cause": {k: v / 1e3 for k, v in by_cause.items()},
        "gaps_by_cause": dict(n_gaps),
        "idle_ms_by_phase": {k: v / 1e3 for k, v in sorted(by_phase.items())},
        "idle_ms_by_size": {name: by_bin[name] / 1e3 for _, name in SIZE_BINS},
        "host_late_ms_by_op": {k: v / 1e3 for k, v in by_op.most_common(top)},
        "runtime_calls": {k: {"count": c, "host_ms": d / 1e3} for k, (c, d) in sorted(syncs.items())},
        **(host_breakdown(ev, phases) if ops else {}),
    }


def host_breakdown(ev, phases, top: int = 40) -> dict:
    """Host time of the profiled iteration by thread and phase group from the CPU ops (``ops`` mode): per thread
    (``main``: the one that ran the phases' ranges; ``other``: the autograd engine's device thread and any other)
    and phase group (fwd / bwd / step by the op's start), the time inside top-level ops, and the self time
    (duration minus direct children) of every op and record_function range by name: where the host's time goes.
    Runtime calls (launches etc.) count as children of the op that made them. ``host_self_small_ms``: the same for
    the instances with at most SMALL_CHILDREN direct children, e.g. a composition node's backward apart from the
    one per decoder layer that runs the layer's checkpoint recomputation (hundreds of children)."""
    main_tid = next((e.get("tid") for e in ev if e.get("cat") == "user_annotation"
                     and e.get("name", "").partition(":")[0] in PHASE_NAMES), None)
    spans = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function") \
                and "dur" in e and e.get("name", "").partition(":")[0] not in PHASE_NAMES:
            spans[e.get("tid")].append((e["ts"], -e["dur"], e["name"], e.get("cat")))

    def group(ts):  # fwd / bwd / step / outside
        return _phase_at(phases, ts).rstrip("0*")

    top_ms = collections.Counter()
    self_ms = collections.defaultdict(collections.Counter)
    count = collections.defaultdict(collections.Counter)
    small_ms = collections.defaultdict(collections.Counter)  # instances with few direct children (e.g. an autograd
    small_n = collections.defaultdict(collections.Counter)   # node's backward without the recomputation it triggers)
    for tid, lst in spans.items():
        kind = "main" if tid == main_tid else "other"
        lst.sort()
        stack = []  # [end, name, children_us, start, direct children]

        def close(item):
            end, name, kids, start, n_kids = item
            g = f"{kind}/{group(start)}"
            self_ms[g][name] += (end - start - kids) / 1e3
            count[g][name] += 1
            if n_kids <= SMALL_CHILDREN:
                small_ms[g][name] += (end - start - kids) / 1e3
                small_n[g][name] += 1

        for ts, neg, name, _cat in lst:
            end = ts - neg
            while stack and stack[-1][0] <= ts:
                close(stack.pop())
            if stack:
                stack[-1][2] += end - ts
                stack[-1][4] += 1
            else:
                top_ms[f"{kind}/{group(ts)}"] += (end - ts) / 1e3
            stack.append([end, name, 0.0, ts, 0])
        while stack:
            close(stack.pop())

    def flat(c):
        return {f"{g}|{k}": v for g, cc in c.items() for k, v in cc.most_common(top)}

    return {"host_top_level_ms": dict(top_ms), "host_self_ms": flat(self_ms),
            "host_calls": {f"{g}|{k}": count[g][k] for g, c in self_ms.items() for k, _ in c.most_common(top)},
            "host_self_small_ms": flat(small_ms),
            "host_calls_small": {f"{g}|{k}": small_n[g][k] for g, c in small_ms.items() for k, _ in c.most_common(top)}}



WAITING = ("cudaStreamSynchronize", "cuStreamSynchronize", "cudaDeviceSynchronize", "pthread_cond_wait",
           "pthread_cond_timedwait", "futex", "__futex", "sem_wait", "do_futex_wait", "epoll_wait", "nanosleep",
           "poll (", "take_gil", "PyThread_acquire_lock", "lock_PyThread_acquire_lock")


def fold_stacks(text: str, top: int = 40, main_marker: str | None = None) -> dict:
    """py-spy's raw (collapsed) output -> per thread: samples, samples whose stack shows a wait (a sync, a
    condition variable / futex, the GIL) and the rest (``cpu``); inclusive samples by function (each frame counted
    once per stack), for the ``top`` functions; self samples by leaf frame. With ``main_marker``, the main thread's
    stacks without that frame (outside the measured loop) are left out."""
    threads = collections.defaultdict(lambda: {"samples": 0, "waiting": 0, "incl": collections.Counter(),
                                               "self": collections.Counter()})
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = stack.split(";")
        name = frames[0].split(":", 1)[1].strip() if ":" in frames[0] else frames[0]
        if main_marker and name == "MainThread" and main_marker not in stack:
            continue
        t = threads[name]
        t["samples"] += n
        body = frames[1:]
        if any(w in f for f in body[-6:] for w in WAITING):
            t["waiting"] += n
        for f in set(body):
            t["incl"][f] += n
        if body:
            t["self"][body[-1]] += n
    return {name: {"samples": t["samples"], "waiting": t["waiting"], "cpu": t["samples"] - t["waiting"],
                   "incl": dict(t["incl"].most_common(top)), "self": dict(t["self"].most_common(top))}
            for name, t in threads.items()}


def pyspy_sample(run_iteration, sync, a, variant) -> dict:
    """Runs ``run_iteration`` for ``a.pyspy_s`` seconds with py-spy attached to this process (stopped by SIGINT
    right after); the raw stacks go to a.pyspy/pyspy_<variant>.txt.gz; returns the folded stacks and each thread's
    CPU / waiting ms per iteration (the main thread's samples outside ``run_iteration`` left out)."""
    import gzip
    import shutil
    import signal
    import subprocess

    exe = shutil.which("py-spy")
    if exe is None:
        raise RuntimeError("--pyspy needs py-spy on PATH (pip install py-spy)")
    os.makedirs(a.pyspy, exist_ok=True)
    raw = os.path.join(a.pyspy, f"pyspy_{variant}.txt")
    cmd = [exe, "record", "--pid", str(os.getpid()), "--rate", str(a.pyspy_rate), "--format", "raw", "--output", raw,
           "--duration", str(int(a.pyspy_s + 60)), "--threads", "--idle"] + (["--native"] if a.pyspy_native else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(1.0)  # attached
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < a.pyspy_s:
        run_iteration()
        sync()
        n += 1
    wall = time.perf_counter() - t0
    proc.send_signal(signal.SIGINT)
    log = proc.communicate(timeout=120)[0].decode(errors="replace")
    if not os.path.exists(raw):
        raise RuntimeError(f"py-spy wrote nothing: {log[-800:]}")
    with open(raw) as f:
        text = f.read()
    with gzip.open(raw + ".gz", "wt") as f:
        f.write(text)
    os.remove(raw)
    folded = fold_stacks(text, main_marker=run_iteration.__name__ + " (")
    ms = 1e3 / a.pyspy_rate / n
    return {"iterations": n, "wall_s": wall, "iter_ms": wall * 1e3 / n, "rate": a.pyspy_rate,
            "per_iter_ms_by_thread": {k: {"cpu": round(t["cpu"] * ms, 1), "waiting": round(t["waiting"] * ms, 1)}
                                      for k, t in folded.items()},
            "threads": folded, "log": log[-400:]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/gap_probe.json")
    mb.add_probe_args(p, "bf16")
    p.add_argument("--modes", default="cuda,ops")
    p.add_argument("--min-gap-us", type=float, default=2.0)
    p.add_argument("--pyspy", help="after the rounds, sample each variant's iterations with py-spy (Python stacks, "
                   "--pyspy-native: and native ones, of every thread, idle included) into "
                   "PYSPY/pyspy_<variant>.txt.gz; needs py-spy on PATH")
    p.add_argument("--pyspy-s", type=float, default=10.0, help="seconds of sampling per variant")
    p.add_argument("--pyspy-rate", type=int, default=250)
    p.add_argument("--pyspy-native", action="store_true",
                   help="native frames too (py-spy pauses the process per sample: session 25's H200 run slowed an "
                        "iteration ~40x, so the samples show where host CPU goes when the host is the only limit)")
    a = p.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile, record_function

    dev, runs = mb.probe_runs(a)
    ctx, micro, sync = mb.step_inputs(a, dev)

    marks = []

    @contextlib.contextmanager
    def phase(name):  # a record_function range, and its host Unix ns (for a trace without CPU ranges)
        t0 = time.time_ns()
        with record_function(name):
            yield
        marks.append((name, t0, time.time_ns()))

    def iteration(v):
        model, opt, _ = runs[v]
        marks.clear()
        for i, ids in enumerate(micro):
            with phase(f"fwd:{i}"):
                with ctx():
                    logits = model(input_ids=ids, logits_to_keep=a.loss_tokens + 1, use_cache=False).logits
                loss = F.cross_entropy(logits[0, :-1].float(), ids[0, -a.loss_tokens:]) / a.ga
            with phase(f"bwd:{i}"):
                loss.backward()
        with phase("step:0"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    def phase_ms(ms):
        """Host ms per phase key of an iteration's marks (fwd: until the loss is enqueued, incl. the causal mask's
        sync; bwd: until backward() returned)."""
        acc = collections.Counter()
        for full, t0, t1 in ms:
            name, _, idx = full.partition(":")
            acc[_phase_key(name, idx)] += (t1 - t0) / 1e6
        return dict(acc)

    for v in runs:  # warm-up: compile, autotune, allocator; two steps (the norm recompute with a cached base)
        for _ in range(3):
            iteration(v)
    sync()
    gc.collect()
    gc.freeze()
    modes = a.modes.split(",")
    acts = {"cuda": [ProfilerActivity.CUDA], "ops": [ProfilerActivity.CPU, ProfilerActivity.CUDA]}
    if a.tiny:
        acts = {m: [ProfilerActivity.CPU] for m in modes}
    with profile(activities=acts[modes[-1]]):  # the profiler's own first-use set-up (CUPTI), outside the rounds
        torch.ones(1, device=dev).add_(1)
        sync()
    rows = []
    order = list(runs)
    tmp = tempfile.mkdtemp(prefix="gap_probe_")
    for rnd in range(a.rounds):
        k = rnd % len(order)
        for v in order[k:] + order[:k]:
            sync()
            t0 = time.perf_counter()
            iteration(v)
            sync()
            row = dict(variant=v, round=rnd, wall_ms=(time.perf_counter() - t0) * 1e3, host_phase_ms=phase_ms(marks))
            for m in modes:
                sync()
                with profile(activities=acts[m]) as prof:
                    t0 = time.perf_counter()
                    iteration(v)
                    sync()
                    wall = (time.perf_counter() - t0) * 1e3
                path = os.path.join(tmp, f"{v}_{m}.json")
                prof.export_chrome_trace(path)
                with open(path) as f:
                    row[m] = dict(wall_ms=wall, **analyse(json.load(f), a.min_gap_us, marks=marks))
                os.remove(path)
            rows.append(row)
            short = {m: {k2: row[m].get(k2) for k2 in ("wall_ms", "gpu_event_ms", "idle_ms", "idle_ms_by_cause")}
                     for m in modes}
            print(json.dumps(dict(variant=v, round=rnd, wall_ms=round(row["wall_ms"], 1), **short), default=str),
                  flush=True)

    spy = {}
    if a.pyspy:
        for v in order:
            def spied(v=v):
                iteration(v)

            try:
                spy[v] = pyspy_sample(spied, sync, a, v)
            except Exception as e:  # noqa: BLE001  (e.g. no ptrace permission): the rounds' results still count
                spy[v] = {"error": repr(e)}
                print(f"py-spy {v} failed: {e!r}", flush=True)
                continue
            print(f"py-spy {v}: {spy[v]['iterations']} iterations, {spy[v]['iter_ms']:.0f} ms each, per thread "
                  f"{json.dumps(spy[v]['per_iter_ms_by_thread'])}", flush=True)

    summary = {v: _median_tree([{k: r[k] for k in ("wall_ms", "host_phase_ms", *modes)}
                                for r in rows if r["variant"] == v]) for v in runs}
    for v, s in summary.items():
        print(f"== {v}: unprofiled wall {s['wall_ms']:.1f} ms, host per phase "
              f"{json.dumps({k2: round(x, 1) for k2, x in s['host_phase_ms'].items()})}", flush=True)
        for m in modes:
            sm = s[m]
            print(f"   [{m}] wall {sm['wall_ms']:.1f}  gpu events {sm.get('gpu_event_ms', 0.0):.1f}  "
                  f"idle {sm.get('idle_ms', 0.0):.1f} ms"
                  f"  by cause {json.dumps(sm.get('idle_ms_by_cause', {}))}", flush=True)
            print(f"        by phase {json.dumps(sm.get('idle_ms_by_phase', {}))}", flush=True)
            print(f"        by size {json.dumps(sm.get('idle_ms_by_size', {}))}", flush=True)
            if sm.get("host_top_level_ms"):
                print(f"        host in top-level ops {json.dumps(sm['host_top_level_ms'])}", flush=True)
            if sm.get("host_late_ms_by_op"):
                top = sorted(sm["host_late_ms_by_op"].items(), key=lambda t: -t[1])[:8]
                print(f"        host-late by op {json.dumps(dict(top))}", flush=True)
            print(f"        runtime {json.dumps(sm.get('runtime_calls', {}))}", flush=True)
    meta = {"setup": a.setup, "shape": a.shape, "layers": a.layers, "rank": a.rank, "seq": a.seq, "ga": a.ga,
            "min_gap_us": a.min_gap_us, "torch": torch.__version__, "cmd": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "info": {v: mb._jsonable(r[2]) for v, r in runs.items()}, "native_node": mb.native_node_info()}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows, "pyspy": spy}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
