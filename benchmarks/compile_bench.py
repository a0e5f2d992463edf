#!/usr/bin/env python3
"""DoRA under ``torch.compile``: fastdora vs stock PEFT DoRA vs stock PEFT LoRA, each compiled, side by side in one run.

The model and the step are ``model_bench.py``'s (random-initialised Qwen3-8B-shaped decoder, ``--layers`` layers,
DoRA / LoRA r on q,k,v,o,gate,up,down with rsLoRA, sequence 4096, batch 1, non-reentrant gradient checkpointing,
loss on the last 1024 tokens, an SGD lr=0 step that bumps every adapter's version counter as a real step does).
Scope ``layers``: every decoder layer is compiled (``layer.compile(mode=...)``, regional compilation: the layers
share one compiled graph per grad mode). Scope ``model``: the whole PEFT model is wrapped in ``torch.compile`` (what
HF Trainer's ``torch_compile=True`` does through Accelerate), measured for the first rank and setup. Mode ``eager``
runs the same model uncompiled, for reference.

Each config runs in its own process. A batch of processes builds, compiles and warms up at the same time (compilation
is CPU work); then the parent runs their timed parts in interleaved rounds (a few iterations of each process in turn,
one process at a time on the GPU), so that a slow drift of the GPU's clocks or temperature hits every config alike.

Measures: gradient-iteration time (``--ga`` micro-batches fwd+bwd + optimizer step), inference forward time (eval,
no_grad, the 4096-token prefill; in steady state: each round's timed forwards follow one untimed forward, which after
the round's training computes fastdora's norms once), peak allocated memory of the timed training iterations, the
number of graphs compiled (``torch._dynamo`` counters: a recompilation across optimizer steps or micro-batches would
show here), and for fastdora how often the norm was computed / reused (``fastdora.active_path_counter``). Medians
over repeats.

Usage (one H200, ~7 minutes):
  python benchmarks/compile_bench.py --out DIR
  python benchmarks/compile_bench.py --report DIR/compile_bench.json        # tables from saved results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

VARIANT_LABEL = {"lora": "PEFT LoRA", "peft_dora": "PEFT DoRA", "fastdora": "fastdora",
                 "fastdora_op": "fastdora, composition as custom ops",
                 "fastdora_norm_op": "fastdora, norm through the op (no slots)"}
# targets: fastdora / LoRA (compiled, default mode) and PEFT DoRA / fastdora (training)
TARGET_TRAIN, TARGET_INFER, TARGET_VS_DORA = 1.05, 1.03, 1.8


def plan(ranks, setups, modes, scopes=("layers",)) -> list:
    """Configs in the order they are measured: every (rank, setup) with the three variants compiled in the first
    mode and scope; the other modes (LoRA and fastdora; ``eager``: not compiled) at the first rank; ``fastdora_op``
    (the composition as fastdora's Triton custom ops, ``Settings.compiled_compose_op``) at the first rank and mode;
    the other scopes (the three variants) at the first rank, setup and mode. A variant's configs sit next to
    LoRA's, so that a batch of processes holds the configs compared with each other."""
    cfgs = []
    for r in ranks:
        for s in setups:
            for v in ("lora", "fastdora", "peft_dora") + (("fastdora_op", "fastdora_norm_op") if r == ranks[0] else ()):
                cfgs.append(dict(rank=r, setup=s, variant=v, mode=modes[0], scope=scopes[0]))
    for m in modes[1:]:
        for s in setups:
            for v in ("lora", "fastdora"):
                cfgs.append(dict(rank=ranks[0], setup=s, variant=v, mode=m, scope=scopes[0]))
    for sc in scopes[1:]:
        for v in ("lora", "fastdora", "peft_dora"):
            cfgs.append(dict(rank=ranks[0], setup=setups[0], variant=v, mode=modes[0], scope=sc))
    return cfgs


# ------------------------------------------------------------------------------------------------------- worker


def run_worker(a) -> None:
    import gc

    import torch
    import torch.nn.functional as F

    import model_bench as mb

    dev = torch.device(a.device)
    a.shape = "tiny" if a.tiny else "qwen3-8b"
    variant = a.variant
    if variant == "fastdora_op":
        from fastdora.config import SETTINGS

        SETTINGS.compiled_compose_op = True
    if variant in ("fastdora_op", "fastdora_norm_op"):
        a.variant = "fastdora"
    model = mb.build_model(a, dev)
    model, info = mb.apply_adapter(model, a, dev)
    if variant == "fastdora_norm_op":
        from fastdora import slots

        slots.uninstall(model)  # every compiled layer calls fastdora::cached_norm, as before the slots
    if a.mode == "reduce-overhead":
        # CUDA graph trees reuse a graph's output memory at its next replay, and a checkpointed layer replays its
        # forward inside the backward ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
        # run", LoRA and fastdora alike): CUDA-graphed configs run without gradient checkpointing
        model.get_base_model().gradient_checkpointing_disable()
    info["gradient_checkpointing"] = a.mode != "reduce-overhead"
    run = model
    if a.mode != "eager":
        # transformers' checkpointed layers trace the checkpoint inside the compiled region; a context variable that
        # the `kernels` package sets in attention would break that graph (and run the whole layer eagerly)
        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        if a.scope == "model":
            run = torch.compile(model, mode=None if a.mode == "default" else a.mode)
        else:
            for layer in model.get_base_model().model.layers:
                layer.compile(mode=None if a.mode == "default" else a.mode)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.0)
    ctx, micro, sync = mb.step_inputs(a, dev)
    keep = a.loss_tokens + 1

    def loss_of(ids):
        with ctx():
            logits = run(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
        return F.cross_entropy(logits[0, :-1].float(), ids[0, -a.loss_tokens:])

    # CUDA graph trees (mode="reduce-overhead") reuse their outputs' memory at the next replay: mark each step
    mark = (torch.compiler.cudagraph_mark_step_begin if a.mode == "reduce-overhead" else (lambda: None))

    # one fastdora step scope per optimizer step, as fastdora's trainer callback opens them (the whole model
    # compiled: its graph reads the norm slots inside it)
    fd = sys.modules.get("fastdora")
    scope = (lambda: fd.step_scope(model)) if fd is not None else contextlib.nullcontext

    def grad_iter():
        with scope():
            for ids in micro:
                mark()
                (loss_of(ids) / len(micro)).backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    def infer():
        mark()
        with torch.no_grad(), ctx():
            return run(input_ids=micro[0], logits_to_keep=1, use_cache=False).logits

    host = []  # per timed call: the seconds until fn() returned, before the closing sync (the host's share)

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        sync()
        return time.perf_counter() - t0

    gc_s = [0.0, 0]  # seconds in Python's cyclic garbage collector and collections, while timed

    def gc_clock(phase, info, _t=[0.0]):
        if phase == "start":
            _t[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - _t[0]
            gc_s[1] += 1

    rec = dict(rank=a.rank, setup=a.setup, variant=variant, mode=a.mode,
               scope=a.scope, layers=a.layers, seq=a.seq, ga=a.ga,
               versions=dict(torch=torch.__version__), **info)
    for mod in ("transformers", "peft", "triton"):
        try:
            rec["versions"][mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    from torch._dynamo.utils import counters

    t0 = time.perf_counter()
    model.train()
    rec["warmup_grad_s"] = [timed(grad_iter) for _ in range(a.warmup)]
    model.eval()
    rec["warmup_infer_s"] = [timed(infer) for _ in range(a.warmup)]
    model.train()
    rec["warmup_s"] = time.perf_counter() - t0
    graphs_after_warmup = int(counters["stats"]["unique_graphs"])
    gc.collect()
    print("READY", flush=True)
    if fd is not None:
        fd.active_path_counter.clear()
    counts = (lambda: dict(fd.active_path_counter)) if fd is not None else dict
    train_counter, ts, ti, peak = {}, [], [], 0
    host.clear()
    host_train, host_infer = [], []
    gc.callbacks.append(gc_clock)
    # the parent's commands, one per round: "train K" / "infer K" (K timed iterations), "done"
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "done":
            break
        k = int(cmd[1])
        before = counts()
        if cmd[0] == "train":
            model.train()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            ts += [timed(grad_iter) for _ in range(k)]
            host_train += host[-k:]
            if dev.type == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated(dev))
            for n, v in counts().items():
                train_counter[n] = train_counter.get(n, 0) + v - before.get(n, 0)
        else:
            model.eval()
            # steady state: the adapters changed in the training round before, so the first forward computes each
            # layer's norm once (fastdora; untimed, run for every variant alike); the timed ones reuse them
            infer()
            sync()
            ti += [timed(infer) for _ in range(k)]
            host_infer += host[-k:]
        print("OK", flush=True)
    rec["grad_iter_s_all"], rec["grad_iter_s"] = ts, statistics.median(ts)
    if dev.type == "cuda":
        rec["train_peak_alloc_gb"] = peak / 1e9
    rec["infer_s_all"], rec["infer_s"] = ti, statistics.median(ti)
    gc.callbacks.remove(gc_clock)
    # host-bound check: the host's time to issue an iteration against its wall time (close to 1: the GPU waited)
    rec["grad_host_s"], rec["infer_host_s"] = statistics.median(host_train), statistics.median(host_infer)
    rec["gc_s_timed"], rec["gc_collections_timed"] = gc_s
    model.train()  # (the profiled iteration below trains)
    if a.profile:  # GPU kernels and host syncs on CUDA; the host's Python functions on any device
        cuda = dev.type == "cuda"
        rec["profile"] = profile_iteration(grad_iter, sync) if cuda else {}
        if cuda:
            rec["profile"]["host_syncs"] = host_syncs(grad_iter, sync)
        rec["profile"]["host_functions"] = host_functions(grad_iter, sync)
        model.eval()
        infer()  # (the adapters changed in the profiled iterations: the first forward computes the norms)
        sync()
        rec["profile_infer"] = profile_iteration(infer, sync) if cuda else {}
        rec["profile_infer"]["host_functions"] = host_functions(infer, sync)
        model.train()
    rec["graphs_compiled"] = int(counters["stats"]["unique_graphs"])
    rec["graphs_compiled_while_timed"] = rec["graphs_compiled"] - graphs_after_warmup
    rec["graph_breaks"] = int(sum(counters["graph_break"].values()))
    if fd is not None:
        c = dict(fd.active_path_counter)
        rec["norm_counts_train"] = {k: v for k, v in train_counter.items() if k.startswith("norm:")}
        rec["norm_op_calls_train"] = train_counter.get("compiled:norm_op", 0)
        # DoRA layer calls that ran outside a compiled graph (each records its path; traced calls do not)
        rec["eager_layer_calls_train"] = sum(v for k, v in train_counter.items() if k.startswith("linear:"))
        rec["norm_counts_infer"] = {k: v - train_counter.get(k, 0) for k, v in c.items() if k.startswith("norm:")}
    with open(a.result, "w") as f:
        json.dump(rec, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # the driver frees the device memory


# ------------------------------------------------------------------------------------------------------- parent


def profile_iteration(grad_iter, sync, top: int = 30) -> dict:
    """One gradient iteration (or inference forward) under ``torch.profiler``: GPU time per kernel name (the ``top``
    largest, with counts), the total GPU kernel time and launch count, the host time and count of the CUDA runtime
    and driver calls (kernel launches, copies, syncs), and the host time of fastdora's cached-norm op."""
    import torch

    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CPU, act.CUDA]) as prof:
        grad_iter()
        sync()
    kernels, host, api = {}, {}, {}
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0)
        if dev_us and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] = (dev_us / 1e3, e.count)
        elif e.key.startswith("cu") and e.device_type == torch.autograd.DeviceType.CPU:
            api[e.key] = (round(e.cpu_time_total / 1e3, 3), e.count)
        if "fastdora" in e.key:
            host[e.key] = (e.cpu_time_total / 1e3, e.count)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return dict(gpu_kernel_ms_total=sum(v[0] for v in kernels.values()),
                gpu_kernel_launches=sum(v[1] for v in kernels.values()),
                top_kernels=[[k[:90], round(v[0], 3), v[1]] for k, v in ranked[:top]],
                cuda_api_host_ms=dict(sorted(api.items(), key=lambda kv: -kv[1][0])),
                fastdora_ops_host_ms=host, gpu_idle=gpu_idle(prof))


def gpu_idle(prof, min_gap_us: float = 5.0, top: int = 12) -> dict:
    """Where the GPU waited inside a profiled call: the span from its first kernel's start to its last kernel's end,
    the busy time (the union of the kernel intervals), the idle gaps of at least ``min_gap_us`` (count and total) and
    the ``top`` largest, each ``[us, ms from the first kernel, kernel before, kernel after]``: a gap is time in which
    the GPU had nothing queued (the host was issuing, or waiting on a sync)."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    evs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == cuda and e.time_range.end > e.time_range.start)
    if not evs:
        return {}
    t0, busy, gaps = evs[0][0], 0.0, []
    cur_s, cur_e, last = evs[0]
    for start, stop, name in evs[1:]:
        if start > cur_e:
            busy += cur_e - cur_s
            if start - cur_e >= min_gap_us:
                gaps.append((start - cur_e, cur_e - t0, last[:60], name[:60]))
            cur_s, cur_e, last = start, stop, name
        elif stop > cur_e:
            cur_e, last = stop, name
    busy += cur_e - cur_s
    gaps.sort(key=lambda g: -g[0])
    return dict(span_ms=round((cur_e - t0) / 1e3, 3), busy_ms=round(busy / 1e3, 3),
                idle_ms=round(sum(g[0] for g in gaps) / 1e3, 3), gaps=len(gaps),
                largest=[[round(g[0], 1), round(g[1] / 1e3, 3), g[2], g[3]] for g in gaps[:top]])


def host_functions(fn, sync, top: int = 60) -> dict:
    """One call of ``fn`` under Python's ``cProfile``: the ``top`` functions by own host time (``own``), by cumulative
    time (``cumulative``) and fastdora's functions by cumulative time (``fastdora``), each ``[function, own ms,
    cumulative ms, calls]``, to compare where the host time of variants goes (cProfile's overhead inflates all)."""
    import cProfile
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats
    # fastdora's source files: those of its imported modules (wherever the package is installed from)
    files = {getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n.split(".")[0] == "fastdora"}
    rows = [(f"{os.path.basename(f)}:{line}:{name}", tt * 1e3, ct * 1e3, nc, f)
            for (f, line, name), (cc, nc, tt, ct, _) in stats.items()]
    own = sorted(rows, key=lambda r: -r[1])[:top]
    cumulative = sorted(rows, key=lambda r: -r[2])[:top]
    ours = sorted((r for r in rows if r[4] in files), key=lambda r: -r[2])[:top]
    return {name: [[k, round(tt, 3), round(ct, 3), nc] for k, tt, ct, nc, _ in sel]
            for name, sel in (("own", own), ("cumulative", cumulative), ("fastdora", ours))}


def host_syncs(grad_iter, sync) -> dict:
    """One gradient iteration with torch's CUDA sync debug mode on: how many operations made the host wait for the
    GPU, by message (each such wait empties the GPU's queue)."""
    import warnings

    import torch

    sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            grad_iter()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync()
    by_msg = {}
    for w in caught:
        msg = f"{os.path.basename(w.filename)}:{w.lineno}: " + str(w.message).splitlines()[0][:100]
        by_msg[msg] = by_msg.get(msg, 0) + 1
    return by_msg


def worker_cmd(c, a, result) -> list:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--result", result, "--device", a.device,
           "--rank", str(c["rank"]), "--setup", c["setup"], "--variant", c["variant"], "--mode", c["mode"],
           "--scope", c["scope"],
           "--layers", str(a.layers), "--seq", str(a.seq), "--ga", str(a.ga), "--loss-tokens", str(a.loss_tokens),
           "--warmup", str(a.warmup)]
    return cmd + (["--tiny"] if a.tiny else []) + (["--profile"] if a.profile else [])


def run_parent(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    cfgs = plan([int(r) for r in a.ranks.split(",")], a.setups.split(","), a.modes.split(","),
                tuple(a.scopes.split(",")))
    cfgs = select(cfgs, a.variants)
    results, t_start = [], time.time()
    for idx in batches(cfgs, a.parallel):
        batch = []
        for i, c in ((i, cfgs[i]) for i in idx):
            if time.time() - t_start > a.budget_s:
                break
            res = os.path.join(a.out, f"cfg{i:02d}.json")
            p = subprocess.Popen(worker_cmd(c, a, res), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(os.path.join(a.out, f"cfg{i:02d}.log"), "w"), text=True, cwd=REPO)
            batch.append((c, p, res))
        # every process of the batch compiles and warms up first (CPU-heavy); then the timed parts run in interleaved
        # rounds, one process at a time
        ready = [p.stdout.readline().strip() == "READY" for _, p, _ in batch]
        for phase, total in (("train", a.repeats), ("infer", a.inf_repeats)):
            per_round = -(-total // a.rounds)
            for _ in range(a.rounds):
                for i, (c, p, res) in enumerate(batch):
                    if ready[i]:
                        ready[i] = _command(p, f"{phase} {per_round}")
        for (c, p, res), alive in zip(batch, ready):
            rec, err = None, None
            if alive:
                p.stdin.write("done\n")
                p.stdin.flush()
                try:
                    p.wait(timeout=a.config_timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    err = "timeout"
                if err is None and os.path.exists(res):
                    with open(res) as f:
                        rec = json.load(f)
            else:
                p.kill()
            if rec is None:
                p.wait()
                rec = dict(c, error=err or f"worker failed (rc {p.returncode}); see {os.path.basename(res)[:-5]}.log")
            results.append(rec)
            print(f"[{time.time() - t_start:5.0f}s] {c} -> "
                  + (rec.get("error") or f"grad {rec['grad_iter_s']:.4f}s infer {rec['infer_s'] * 1e3:.2f}ms "
                                         f"graphs {rec['graphs_compiled']}"), flush=True)
        if not batch:
            break
    doc = dict(when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), args=vars(a), results=results)
    path = os.path.join(a.out, "compile_bench.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    report(path)


def select(cfgs: list, variants: str) -> list:
    """The configs of the comma-separated ``variants`` (all for an empty string) and PEFT LoRA's, every comparison's
    baseline; an unknown name is an error."""
    if not variants:
        return cfgs
    keep = {v.strip() for v in variants.split(",") if v.strip()} | {"lora"}
    unknown = keep - set(VARIANT_LABEL)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANT_LABEL)}")
    return [c for c in cfgs if c["variant"] in keep]


def batches(cfgs: list, size: int) -> list:
    """Config indices in batches of at most ``size`` (a larger group alone), each batch whole groups of configs
    compared with each other (same rank, setup, mode and scope), so that compared configs run in interleaved rounds."""
    groups, out = [], []
    for i, c in enumerate(cfgs):
        key = (c["rank"], c["setup"], c["mode"], c.get("scope"))
        if groups and groups[-1][0] == key:
            groups[-1][1].append(i)
        else:
            groups.append((key, [i]))
    for _, idx in groups:
        if out and len(out[-1]) + len(idx) <= size:
            out[-1] += idx
        else:
            out.append(list(idx))
    return out


def _command(p, line: str) -> bool:
    """Send one round's command to a worker; whether it answered OK (a failed worker closes its stdout)."""
    try:
        p.stdin.write(line + "\n")
        p.stdin.flush()
    except (BrokenPipeError, OSError):
        return False
    return p.stdout.readline().strip() == "OK"


def _scope(r: dict) -> str:
    """A result's compile scope (results saved before the whole-model scope existed: each layer compiled)."""
    return r.get("scope", "layers")


def _row(results, **k):
    for r in results:
        if "error" not in r and all((_scope(r) if n == "scope" else r.get(n)) == v for n, v in k.items()):
            return r
    return None


def report(path: str, out_dir: str = None) -> None:
    with open(path) as f:
        doc = json.load(f)
    res = doc["results"]
    lines = [f"# DoRA under torch.compile ({doc['when']})", "",
             "| rank | setup | mode | scope | variant | grad iter (s) | vs LoRA | inference (ms) | vs LoRA "
             "| peak train (GB) | graphs | norm computed / reused (train) |", "|" + "---|" * 12]
    checks = []
    for r in res:
        if "error" in r:
            lines.append(f"| {r['rank']} | {r['setup']} | {r['mode']} | {_scope(r)} | {r['variant']} "
                         f"| error: {r['error']} | | | | | | |")
            continue
        scope = _scope(r)
        lora = _row(res, rank=r["rank"], setup=r["setup"], mode=r["mode"], scope=scope, variant="lora")
        tr = r["grad_iter_s"] / lora["grad_iter_s"] if lora else float("nan")
        ir = r["infer_s"] / lora["infer_s"] if lora else float("nan")
        nc = r.get("norm_counts_train", {})
        norms = (f"{nc.get('norm:computed', 0) + nc.get('norm:computed_base_cached', 0)} / {nc.get('norm:cached', 0)}"
                 if "norm_counts_train" in r else "")
        lines.append(f"| {r['rank']} | {r['setup']} | {r['mode']} | {scope} | {VARIANT_LABEL[r['variant']]} | "
                     f"{r['grad_iter_s']:.4f} | {tr:.3f}x | {r['infer_s'] * 1e3:.2f} | {ir:.3f}x | "
                     f"{r.get('train_peak_alloc_gb', float('nan')):.2f} | {r['graphs_compiled']} | {norms} |")
        if r["variant"] == "fastdora" and r["mode"] != "eager" and lora:
            tag = f"r={r['rank']} {r['setup']} {r['mode']} {scope}"
            checks.append((f"{tag}: train fastdora / LoRA", tr, TARGET_TRAIN, tr <= TARGET_TRAIN))
            checks.append((f"{tag}: inference fastdora / LoRA", ir, TARGET_INFER, ir <= TARGET_INFER))
            dora = _row(res, rank=r["rank"], setup=r["setup"], mode=r["mode"], scope=scope, variant="peft_dora")
            if dora:
                sp = dora["grad_iter_s"] / r["grad_iter_s"]
                checks.append((f"{tag}: train PEFT DoRA / fastdora", sp, TARGET_VS_DORA, sp >= TARGET_VS_DORA))
            checks.append((f"{tag}: graphs compiled while timed", r["graphs_compiled_while_timed"], 0,
                           r["graphs_compiled_while_timed"] == 0))
            checks.append((f"{tag}: DoRA layer calls outside compiled graphs", r["eager_layer_calls_train"], 0,
                           r["eager_layer_calls_train"] == 0))
    lines += ["", "| check | value | target | |", "|---|---|---|---|"]
    for name, v, t, ok in checks:
        lines.append(f"| {name} | {v:.3f} | {t} | {'PASS' if ok else 'MISS'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(out_dir or os.path.dirname(path), "compile_bench.md"), "w") as f:
        f.write(text)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--report", help="tables from a saved compile_bench.json")
    p.add_argument("--report-out")
    p.add_argument("--out", default=os.path.join(HERE, "results", "compile_bench"))
    p.add_argument("--ranks", default="384,16")
    p.add_argument("--setups", default="amp,bf16")
    p.add_argument("--modes", default="default,reduce-overhead",
                   help="torch.compile modes; the first is measured for every rank and setup")
    p.add_argument("--scopes", default="layers,model",
                   help="what is compiled: layers (each decoder layer), model (the whole PEFT model, as HF Trainer "
                        "does); the first is measured for every config, the others at the first rank and setup")
    p.add_argument("--variants", default="",
                   help="comma-separated subset of the planned variants (default: all; PEFT LoRA always runs)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds the timed iterations are split into")
    p.add_argument("--parallel", type=int, default=8, help="processes building and compiling at the same time")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no batch after this many seconds")
    p.add_argument("--config-timeout-s", type=float, default=120.0)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one gradient iteration and one inference forward per config (GPU time per "
                        "kernel and host syncs on CUDA; the host's Python functions on any device; in the JSON)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--result")
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--setup", default="amp", choices=["amp", "bf16"])
    p.add_argument("--variant", default="fastdora", choices=list(VARIANT_LABEL))
    p.add_argument("--mode", default="default")
    p.add_argument("--scope", default="layers", choices=["layers", "model"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--ga", type=int, default=4)
    p.add_argument("--loss-tokens", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=8, help="timed gradient iterations per config")
    p.add_argument("--inf-repeats", type=int, default=12, help="timed inference forwards per config")
    return p


def main() -> None:
    a = build_parser().parse_args()
    if a.tiny:
        a.seq, a.loss_tokens, a.ga, a.layers = min(a.seq, 64), min(a.loss_tokens, 16), min(a.ga, 2), 2
        a.repeats, a.inf_repeats, a.warmup = 2, 2, 2
    from _bench_io import dispatch

    dispatch(a, report, run_worker, run_parent)


if __name__ == "__main__":
    main()
