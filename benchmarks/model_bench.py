#!/usr/bin/env python3
"""Model-level DoRA benchmark: fastdora vs stock PEFT DoRA vs stock PEFT LoRA.

Random-initialised decoders with real shapes (Qwen3-8B, Mistral-Small-24B; N decoder layers), DoRA / LoRA on
q,k,v,o,gate,up,down (rsLoRA, lora_alpha=16, lora_B filled with small random values so no operand is all zeros),
seq 4096, batch 1, gradient accumulation 8, non-reentrant gradient checkpointing, loss on the last 1024 tokens
(``logits_to_keep=1025``), then an optimizer step on the adapter parameters (SGD, lr=0: a real in-place update
that bumps every parameter's version counter, so a norm cache is invalidated and recomputed once per iteration,
exactly as in training).

Setups:
  amp  : base bf16, adapters fp32 (PEFT's default autocast_adapter_dtype=True), forward under bf16 autocast
  bf16 : everything bf16 (adapters cast to bf16), no autocast

Variants (each in its own process):
  lora       stock PEFT LoRA, same rank
  peft_dora  stock PEFT DoRA
  fastdora   stock PEFT DoRA + fastdora.enable(model)
  eager      stock PEFT DoRA + fastdora.enable(model, kernels="eager")   (the "eager fallback": no Triton)
``--settings NAME=VALUE,...`` runs the fastdora variants under ``fastdora.config.override(...)`` (internal settings,
e.g. ``layer_node=False``), to measure what one design choice buys.

Measures: gradient-iteration time (8 micro-batches fwd+bwd + optimizer step + zero_grad), inference forward time
(eval, no_grad, prefill of the 4096 tokens, ``logits_to_keep=1``), peak allocated / reserved memory of the training
iterations and of inference. Medians over repeats after warm-up.

Plans (``--plan``, in priority order within each: a time budget drops the tail):
  h200     (default) the whole harness on one H200 in < 10 minutes (``--budget-s 548``): Qwen3-8B shapes, 8 layers,
           r=384, AMP and pure bf16, all four variants (the targets); full depth (36 layers) r=384 AMP; r=16 both
           setups; Mistral-Small-24B shapes (3 layers) r=384 both setups; AMP r=16/64/768 on Mistral, r=64/768 on Qwen3
  targets  Qwen3-8B r=384 and r=16, both setups, all four variants (the AMP r=384 ones profiled)
  full     every shape x rank x setup (longer than 10 minutes)
  amp, bf16  one setup's r=384 targets alone: LoRA, fastdora, PEFT DoRA, eager fallback
  tiny     CPU smoke test (``--tiny``)

Usage:
  python benchmarks/model_bench.py --out DIR [--budget-s 548] [--plan h200]                       # parent
  python benchmarks/model_bench.py --report DIR/model_bench.json                                 # tables + plot
  python benchmarks/model_bench.py --tiny --device cpu --out /tmp/mb                             # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SHAPES = {
    "qwen3-8b": dict(arch="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, full_layers=36),
    "mistral-small-24b": dict(arch="mistral", hidden_size=5120, intermediate_size=32768, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, vocab_size=131072, full_layers=40),
    "tiny": dict(arch="qwen3", hidden_size=64, intermediate_size=160, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, full_layers=2),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = ["lora", "peft_dora", "fastdora", "eager"]
VARIANT_LABEL = {"lora": "PEFT LoRA", "peft_dora": "PEFT DoRA", "fastdora": "fastdora DoRA",
                 "eager": "fastdora eager"}
VARIANT_COLOR = {"lora": "#888888", "peft_dora": "#d62728", "fastdora": "#2ca02c", "eager": "#1f77b4"}
# the variants that run fastdora, with their fastdora.enable() options
FASTDORA_OPTIONS = {"fastdora": {}, "eager": {"kernels": "eager"}}


# ----------------------------------------------------------------------------------------------------------------
# worker: one (shape, layers, rank, setup, variant) in this process
# ----------------------------------------------------------------------------------------------------------------

def _thread_stats():
    """Per thread of this process (Linux /proc; {} elsewhere): name, CPU seconds (user + system), the CPU it last ran
    on, voluntary / involuntary context switches."""
    out = {}
    try:
        tick = os.sysconf("SC_CLK_TCK")
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                st = dict(line.split(":", 1) for line in f if ":" in line)
            out[tid] = dict(name=name, cpu_s=(int(fields[11]) + int(fields[12])) / tick, cpu=int(fields[36]),
                            vol=int(st["voluntary_ctxt_switches"]), invol=int(st["nonvoluntary_ctxt_switches"]))
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return out


def _thread_delta(before, after):
    """The threads that used CPU between two _thread_stats() snapshots, busiest first."""
    rows = []
    for tid, b in after.items():
        a0 = before.get(tid, dict(cpu_s=0.0, vol=0, invol=0))
        cpu = b["cpu_s"] - a0["cpu_s"]
        if cpu > 0 or tid not in before:
            rows.append(dict(tid=int(tid), name=b["name"], cpu_s=round(cpu, 3), last_cpu=b["cpu"],
                             vol=b["vol"] - a0["vol"], invol=b["invol"] - a0["invol"]))
    return sorted(rows, key=lambda r: -r["cpu_s"])


def _sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_model(cfg_args, dev):
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    sh = dict(SHAPES[cfg_args.shape])
    arch = sh.pop("arch")
    sh.pop("full_layers")
    cls = Qwen3Config if arch == "qwen3" else MistralConfig
    cfg = cls(**sh, num_hidden_layers=cfg_args.layers, max_position_embeddings=max(cfg_args.seq, 4096),
              tie_word_embeddings=False, use_cache=False, rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model


def step_inputs(a, dev):
    """(autocast context factory of the setup, the GA micro-batches of token ids, a device sync): the same seed and
    batches for every variant."""
    import contextlib

    import torch

    ctx = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if a.setup == "amp" else contextlib.nullcontext
    vocab = SHAPES[a.shape]["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(123)
    micro = [torch.randint(0, vocab, (1, a.seq), generator=g).to(dev) for _ in range(a.ga)]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    return ctx, micro, sync


def apply_adapter(model, a, dev):
    import torch
    from peft import LoraConfig, get_peft_model

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lcfg = LoraConfig(r=a.rank, lora_alpha=16, use_rslora=True, use_dora=(a.variant != "lora"),
                      target_modules=TARGETS, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(1)
    with torch.device(dev):  # adapter weights created and initialised on the device (PEFT builds them on the CPU
        # and moves them otherwise: seconds per config at r=384 on 8 layers, the largest part of a worker's set-up)
        model = get_peft_model(model, lcfg, autocast_adapter_dtype=(a.setup == "amp"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-3)  # a trained-looking adapter; zeros would flatter the matmuls
            if a.setup == "bf16" and p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)
    info = {}
    if a.variant in FASTDORA_OPTIONS:
        try:
            import fastdora
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"variant {a.variant} needs `import fastdora` (pip install -e . from the repo root, "
                               f"or PYTHONPATH with core/ mapped to fastdora): {e!r}") from e
        rep = fastdora.enable(model, **FASTDORA_OPTIONS[a.variant])
        info["enable_report"] = _jsonable(rep)
    return model, info


def native_node_info() -> dict:
    """Whether this process's fastdora ran its composition through the C++ node (fastdora.kernels.native), and
    how many launches went through its templates / through the Python launchers."""
    mod = sys.modules.get("fastdora.kernels.native")
    if mod is None:
        return {"status": "not imported"}
    return {"status": mod.status(), **(mod.NODE.stats() if mod.NODE is not None else {})}


def _jsonable(obj):
    import dataclasses
    if dataclasses.is_dataclass(obj):
        try:
            return json.loads(json.dumps(dataclasses.asdict(obj), default=str))
        except Exception:  # noqa: BLE001
            pass
    if isinstance(obj, dict):
        return json.loads(json.dumps(obj, default=str))
    return str(obj)


def path_counter():
    try:
        import fastdora.layers as L
        return dict(L.active_path_counter)
    except Exception:  # noqa: BLE001
        return None


def preimport():
    """torch, transformers' model classes and PEFT (~7-10 s of CPU on the H200 host). The fork-mode parent imports
    them once and forks every worker from there, so no worker imports anything while another one is measured;
    fastdora is left to the worker (so that the parent never touches CUDA)."""
    import importlib

    mods = ["torch", "transformers", "peft", "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.mistral.modeling_mistral"]
    for m in mods:
        try:
            importlib.import_module(m)
        except ImportError:
            pass  # reported where the worker uses it


def run_worker(a):
    """One config in this process; the fastdora variants under ``--settings``' internal settings, if any."""
    settings = parse_settings(a.settings)
    if settings and a.variant in FASTDORA_OPTIONS:
        from fastdora import config

        with config.override(**settings):
            return measure(a, settings)
    return measure(a, {})


def measure(a, settings):
    import torch
    import torch.nn.functional as F

    t_import = time.perf_counter()
    if a.wait_go:
        # an exec worker imports transformers / PEFT before READY (CPU only, while the previous config runs): ~5-10 s
        # less per exec config (importing after "go", plan h200's 8 exec configs took 199 s instead of 123 s)
        preimport()
        t_import = time.perf_counter() - t_import
        print("READY", flush=True)
        line = sys.stdin.readline()
        if line.strip() != "go":
            sys.exit(3)
    t_start = time.perf_counter()
    if not a.wait_go:
        preimport()  # a no-op in a forked worker (the parent imported these before forking)
        t_import = time.perf_counter() - t_import
    dev = torch.device(a.device)
    rec = dict(shape=a.shape, layers=a.layers, rank=a.rank, setup=a.setup, variant=a.variant, seq=a.seq,
               ga=a.ga, loss_tokens=a.loss_tokens, device=str(dev), pid=os.getpid())
    if settings:
        rec["settings"] = settings
    rec["versions"] = dict(torch=torch.__version__)
    for mod in ("transformers", "peft", "triton"):
        try:
            rec["versions"][mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    if dev.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(dev)
    rec["import_s"] = t_import  # exec workers: before READY (outside worker_s); forked: ~0 (the parent imported)
    t_model = time.perf_counter()
    model = build_model(a, dev)
    rec["model_s"] = time.perf_counter() - t_model
    model, info = apply_adapter(model, a, dev)
    rec.update(info)
    trainable = [p for p in model.parameters() if p.requires_grad]
    rec["trainable_params"] = sum(p.numel() for p in trainable)
    rec["trainable_dtype"] = str(trainable[0].dtype)
    rec["build_s"] = time.perf_counter() - t_start
    opt = torch.optim.SGD(trainable, lr=0.0)
    ctx, micro, _ = step_inputs(a, dev)
    keep = a.loss_tokens + 1

    def loss_of(ids):
        with ctx():
            logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
        return F.cross_entropy(logits[0, :-1].float(), ids[0, -a.loss_tokens:])

    def grad_iter(n_micro=a.ga):
        for ids in micro[:n_micro]:
            (loss_of(ids) / n_micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def infer():
        with torch.no_grad(), ctx():
            return model(input_ids=micro[0], logits_to_keep=1, use_cache=False).logits

    import gc

    gc_ms = [0.0, 0.0]

    def gc_cb(phase, _info):  # Python GC pauses inside timed regions (a full collection can take ~0.25 s here)
        if phase == "start":
            gc_ms[1] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_ms[1]) * 1e3

    gc.callbacks.append(gc_cb)

    host = [0.0]

    def timed(fn):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        host[0] = time.perf_counter() - t0  # the host's enqueue time (no sync inside fn): ~ the total when host-bound
        _sync(dev)
        return time.perf_counter() - t0

    model.train()
    probe = next(p for n, p in model.named_parameters() if "lora_A" in n and p.requires_grad)
    v0 = probe._version
    # warm-up (Triton compile/autotune, allocator, cuBLAS heuristics) on a.warmup_ga micro-batches + a step
    t, warm_peaks = [], []
    for _ in range(a.warmup):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t.append(timed(lambda: grad_iter(min(a.warmup_ga, a.ga))))
        if dev.type == "cuda":
            warm_peaks.append(torch.cuda.max_memory_allocated(dev) / 1e9)
    rec["warmup_grad_s"] = t
    rec["warmup_peak_alloc_gb"] = warm_peaks  # per warm-up iteration (the first compiles kernels, builds caches)
    # the objects alive now (the imported modules, the model, the warm-up's) are left out of later collections: a
    # full collection would otherwise walk the whole heap inside a timed iteration (0.33-0.42 s, measured in one
    # iteration in five before this); iterations still pay their own garbage's collections (grad_iter_gc_ms)
    gc.collect()
    gc.freeze()
    rec["norm_invalidated_per_step"] = probe._version > v0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ts, gcs, hs = [], [], []
    th0 = _thread_stats()
    w0 = time.time()
    for _ in range(a.repeats):
        gc_ms[0] = 0.0
        ts.append(timed(grad_iter))
        gcs.append(gc_ms[0])
        hs.append(host[0])
    rec["grad_iter_window"] = [w0, time.time()]  # wall clock (epoch s): the parent's GPU samples of these iterations
    rec["grad_iter_threads"] = _thread_delta(th0, _thread_stats())
    rec["grad_iter_s_all"] = ts
    rec["grad_iter_gc_ms_all"] = gcs
    rec["grad_iter_host_s_all"] = hs
    rec["grad_iter_s"] = statistics.median(ts)
    rec["grad_iter_min_s"] = min(ts)
    if dev.type == "cuda":
        rec["train_peak_alloc_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        rec["train_peak_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / 1e9
    rec["loss_last"] = float(loss_of(micro[0]).detach())

    model.eval()
    for _ in range(a.inf_warmup):
        timed(infer)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ti = [timed(infer) for _ in range(a.inf_repeats)]
    rec["infer_s_all"] = ti
    rec["infer_s"] = statistics.median(ti)
    if dev.type == "cuda":
        rec["infer_peak_alloc_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        rec["infer_peak_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / 1e9
    rec["path_counter"] = path_counter()
    rec["native_node"] = native_node_info()

    if a.profile_out:
        rec["profile"] = profile(model, grad_iter, infer, dev, a)
    rec["worker_s"] = time.perf_counter() - t_start
    with open(a.result, "w") as f:
        json.dump(rec, f, indent=1)
    if a.wait_go or a.forked:  # a parent's worker: exit now (the driver frees the device memory; tearing the
        # model and the CUDA context down object by object costs ~1.3 s per config)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def profile(model, grad_iter, infer, dev, a):
    """Top kernels of one grad iteration (a.profile_ga micro-batches + optimizer step) and one inference."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out = {}
    lines = []
    for name, fn, train in (("grad_iter", lambda: grad_iter(a.profile_ga), True), ("inference", infer, False)):
        model.train(train)
        fn()
        _sync(dev)
        with tprof(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            wall = time.perf_counter() - t0
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kern) / 1e6 if kern else 0.0
        ka = prof.key_averages()
        sort = "device_time_total" if dev.type == "cuda" else "cpu_time_total"
        try:
            table = ka.table(sort_by=sort, row_limit=30, max_name_column_width=70)
        except Exception:  # noqa: BLE001
            table = ka.table(sort_by="cpu_time_total", row_limit=30)
        out[name] = dict(wall_s=wall, kernel_count=len(kern), kernel_busy_s=busy,
                         gpu_busy_frac=(busy / wall if wall else None))
        lines.append(f"==== {a.shape} L={a.layers} r={a.rank} {a.setup} {a.variant} :: {name} "
                     f"(micro-batches={a.profile_ga if train else 1}) wall {wall*1e3:.1f} ms, "
                     f"{len(kern)} kernels, kernel time {busy*1e3:.1f} ms "
                     f"(GPU busy {100*busy/wall if wall else 0:.0f}%)\n")
        lines.append(table + "\n")
    with open(a.profile_out, "a") as f:
        f.writelines(lines)
    return out


# ----------------------------------------------------------------------------------------------------------------
# parent: plan, schedule within a time budget, collect
# ----------------------------------------------------------------------------------------------------------------

PLANS = ["h200", "targets", "full", "amp", "bf16", "tiny"]


def parse_settings(text: str) -> dict:
    """``--settings``: ``"layer_node=False,norm_budget_mb=8"`` -> ``{"layer_node": False, "norm_budget_mb": 8}``
    (values are Python literals; a bare word is taken as a string). The names are checked by
    ``fastdora.config.override`` (an unknown one raises ``TypeError``)."""
    import ast

    out = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--settings: {item!r} is not NAME=VALUE")
        try:
            out[name.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            out[name.strip()] = raw.strip()
    return out


def check_settings(settings: dict) -> None:
    """Refuse unknown internal settings before anything runs (in a subprocess: the parent never imports
    fastdora, which may initialise CUDA)."""
    if not settings:
        return
    code = "import sys, fastdora.config as c; c.override(**eval(sys.argv[1])).__enter__()"
    r = subprocess.run([sys.executable, "-c", code, repr(settings)], capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"--settings: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")


def plan_configs(plan, layers_q, layers_m):
    """Configs in priority order. Each: dict(shape, layers, rank, setup, variant[, profile])."""
    cfgs = []

    def add(shape, layers, rank, setups=("amp", "bf16"), variants=VARIANTS):
        for s in setups:
            for v in variants:
                cfgs.append(dict(shape=shape, layers=layers, rank=rank, setup=s, variant=v))

    if plan == "tiny":
        add("tiny", 2, 8)
        add("tiny", 2, 4, setups=("amp",), variants=("lora", "peft_dora", "fastdora"))
        for c in cfgs[:4]:
            c["profile"] = True
        cfgs[1]["spawn"] = "exec"  # as plan h200's target block: an exec worker among forked ones (CPU tests)
        return cfgs
    if plan in ("amp", "bf16"):  # one setup's r=384 targets alone (any other order: --sequence)
        add("qwen3-8b", layers_q, 384, setups=(plan,))
        return cfgs
    three = ("lora", "fastdora", "peft_dora")
    four = three + ("eager",)
    full = SHAPES["qwen3-8b"]["full_layers"]
    if plan == "h200":  # the whole harness in one go on one H200 (< 10 min with --budget-s 548), in priority order:
        # 1. the targets: Qwen3-8B r=384, both setups, all four variants; in fresh interpreters (exec workers, as a
        # training job runs) under the default --spawn fork: a forked worker measured the host-heavy variants up to
        # 7-13% slower (the eager fallback in pure bf16: 1.250x of LoRA forked vs 1.159-1.168x exec)
        add("qwen3-8b", layers_q, 384, variants=four)
        for c in cfgs:
            c["spawn"] = "exec"
        # 2. full depth (36 layers), r=384 AMP (2 timed iterations: ~5 s each)
        for v in three:
            cfgs.append(dict(shape="qwen3-8b", layers=full, rank=384, setup="amp", variant=v, full_depth=True))
        # 3. no regression at r=16 (both setups; the eager fallback in AMP)
        add("qwen3-8b", layers_q, 16, variants=three)
        add("qwen3-8b", layers_q, 16, setups=("amp",), variants=("eager",))
        # 4. the second shape at the target rank, both setups
        add("mistral-small-24b", layers_m, 384, variants=three)
        # 5. the other ranks (AMP, 3 timed iterations each): Mistral r=16/64/768, Qwen3 r=64/768 incl. eager
        n = len(cfgs)
        for r in (16, 64, 768):
            add("mistral-small-24b", layers_m, r, setups=("amp",), variants=three)
        for r in (64, 768):
            add("qwen3-8b", layers_q, r, setups=("amp",), variants=four)
        for c in cfgs[n:]:
            c["repeats"] = 3
        return cfgs
    # 1. the targets: Qwen3-8B r=384, both precisions, all four variants; the AMP ones also profiled
    add("qwen3-8b", layers_q, 384)
    for c in cfgs[:4]:
        c["profile"] = True
    # 2. no-regression: r=16
    add("qwen3-8b", layers_q, 16)
    if plan == "targets":
        return cfgs
    # 3. second shape, target rank then small rank
    add("mistral-small-24b", layers_m, 384, variants=three)
    add("mistral-small-24b", layers_m, 16, variants=three)
    # 4. the other ranks
    for r in (64, 768):
        add("qwen3-8b", layers_q, r, variants=three)
    for r in (64, 768):
        add("mistral-small-24b", layers_m, r, variants=three)
    for r in (16, 64, 768):  # plan full
        add("qwen3-8b", layers_q, r, variants=("eager",))
    # 5. full depth, one rank/setup (only if the budget is left)
    for v in three:
        cfgs.append(dict(shape="qwen3-8b", layers=full, rank=384, setup="amp", variant=v, full_depth=True))
    seen, out = set(), []
    for c in cfgs:
        k = tuple(sorted(c.items()))
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


def estimate_s(c, observed):
    """Wall-clock guess for one config, from the median observed wall of the same (shape, layers) (PEFT DoRA's
    divided by 1.3). A median, not the largest: the first fastdora worker also builds the C++ node and compiles
    the Triton kernels (~25 s once per machine), which no later config repeats."""
    key = (c["shape"], c["layers"])
    if observed.get(key):
        base = statistics.median(observed[key])
    else:
        per_layer = {"qwen3-8b": 1.5, "mistral-small-24b": 4.3, "tiny": 0.5}[c["shape"]]
        base = 8 + per_layer * c["layers"]
    if c.get("variant") == "peft_dora":
        base *= 1.3
    return base


def worker_cmd(c, a, result, profile_out):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--wait-go",
           "--shape", c["shape"], "--layers", str(c["layers"]), "--rank", str(c["rank"]),
           "--setup", c["setup"], "--variant", c["variant"], "--device", a.device, "--result", result,
           "--seq", str(a.seq), "--ga", str(a.ga), "--loss-tokens", str(a.loss_tokens),
           "--warmup", str(a.warmup), "--warmup-ga", str(a.warmup_ga), "--repeats", str(a.repeats),
           "--inf-warmup", str(a.inf_warmup), "--inf-repeats", str(a.inf_repeats)]
    if c.get("full_depth") or c.get("repeats"):
        cmd[cmd.index("--repeats") + 1] = str(c.get("repeats") or 2)
    if c.get("profile"):
        cmd += ["--profile-out", profile_out]
    if a.settings:
        cmd += ["--settings", a.settings]
    return cmd


class Pending:
    def __init__(self, c, cmd, result):
        self.c, self.cmd, self.result = c, cmd, result
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO)

    def go(self, timeout):
        """Wait for READY (imports done while the previous config ran), then start it and wait."""
        line = self.proc.stdout.readline()
        t0 = time.perf_counter()
        if line.strip() != "READY":
            out, err = self.proc.communicate()
            return None, time.perf_counter() - t0, f"worker did not get ready: {line}{out}{err}"[-4000:]
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            return None, time.perf_counter() - t0, f"timeout after {timeout}s\n{err[-3000:]}"
        wall = time.perf_counter() - t0
        if self.proc.returncode != 0 or not os.path.exists(self.result):
            return None, wall, f"rc={self.proc.returncode}\n{err[-4000:]}"
        with open(self.result) as f:
            return json.load(f), wall, None

    def cancel(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


class Forked:
    """One config in a process forked from the parent, which has imported torch / transformers / PEFT but has not
    touched CUDA (each worker creates its own CUDA context, exactly as a fresh process). Output goes to ``log``."""

    def __init__(self, c, cmd, result, log):
        self.c, self.cmd, self.result, self.log, self.pid = c, cmd, result, log, None

    def go(self, timeout):
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the worker
            try:
                fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                wa = build_parser().parse_args([x for x in self.cmd[2:] if x != "--wait-go"] + ["--forked"])
                run_worker(wa)  # exits through os._exit(0) after writing the result
            except BaseException:  # noqa: BLE001
                import traceback
                traceback.print_exc()
            finally:  # reached only on failure
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(2)
        self.pid = pid
        status = None
        while time.perf_counter() - t0 < timeout:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            self.cancel()
        wall = time.perf_counter() - t0
        self.pid = None
        with open(self.log, errors="replace") as f:
            err = f.read()
        if status is None:
            return None, wall, f"timeout after {timeout}s\n{err[-3000:]}"
        if os.waitstatus_to_exitcode(status) != 0 or not os.path.exists(self.result):
            return None, wall, f"rc={os.waitstatus_to_exitcode(status)}\n{err[-4000:]}"
        with open(self.result) as f:
            return json.load(f), wall, None

    def cancel(self):
        if self.pid is not None:
            import signal
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = None


# a forked worker's CUDA failing because the parent initialised the driver (which the check below cannot see when
# it happened below torch, e.g. cudaGetDeviceCount without NVML): the parent then falls back to exec workers
_FORK_CUDA_ERRORS = ("CUDA error: initialization error", "Cannot re-initialize CUDA in forked subprocess",
                     "CUDA driver initialization failed", "cudaErrorInitializationError")


def fork_broke_cuda(err: str) -> bool:
    return any(e in err for e in _FORK_CUDA_ERRORS)


class GpuSampler:
    """``nvidia-smi`` sampling the GPU's SM clock, power draw, temperature, utilisation and clock-event reasons every
    ``ms`` milliseconds into ``path`` while the parent runs its workers; nothing where the device is not CUDA or
    ``nvidia-smi`` is missing. Each result then gets the samples of its timed iterations (``gpu_during_grad_iter``):
    whether LoRA and fastdora ran at the same clocks (on the H200 their timed windows ran at the 700 W power cap,
    SM clock 1.66-1.90 GHz instead of 1.98)."""

    QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active"

    def __init__(self, path, ms, device):
        import shutil

        self.path, self.proc = path, None
        exe = shutil.which("nvidia-smi")
        if ms <= 0 or exe is None or not str(device).startswith("cuda"):
            return
        vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        idx = str(device).partition(":")[2] or "0"
        gpu = vis if vis.isdigit() else idx  # the GPU the workers use (an index; UUIDs: the first GPU)
        self.f = open(path, "w")
        self.proc = subprocess.Popen([exe, "-i", gpu, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                      "-lms", str(int(ms))], stdout=self.f, stderr=subprocess.DEVNULL)

    def stop(self):
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.f.close()
        with open(self.path) as f:
            return f.read()


def gpu_samples(text):
    """nvidia-smi CSV (``GpuSampler.QUERY``, no header, no units) -> [(epoch s, SM MHz, W, C, util %, reasons)];
    unparsable lines (e.g. "[N/A]") are skipped."""
    out = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) != 6:
            continue
        try:
            stamp, frac = f[0].rsplit(".", 1)
            t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
            out.append((t, float(f[1]), float(f[2]), float(f[3]), float(f[4]), int(f[5], 16)))
        except ValueError:
            continue
    return out


def gpu_window(samples, window):
    """The samples inside ``window`` = [start, end] (epoch s): medians of SM clock / power / temperature, mean
    utilisation, the fraction with the SW power cap (0x4) or any hardware slowdown (0x8 | 0x40 | 0x80: HW, thermal,
    power brake) among the clock-event reasons; None without samples there."""
    w = [x for x in samples if window[0] <= x[0] <= window[1]]
    if not w:
        return None
    return dict(n=len(w), sm_mhz=statistics.median(x[1] for x in w), power_w=statistics.median(x[2] for x in w),
                temp_c=statistics.median(x[3] for x in w), util_pct=sum(x[4] for x in w) / len(w),
                sw_power_cap=sum(1 for x in w if x[5] & 0x4) / len(w),
                hw_slowdown=sum(1 for x in w if x[5] & (0x8 | 0x40 | 0x80)) / len(w))


def run_parent(a):
    cfgs = plan_configs(a.plan, a.layers, a.layers_mistral)
    if a.variants:
        keep = a.variants.split(",")
        unknown = sorted(set(keep) - set(VARIANTS))
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown} (known: {VARIANTS})")
        cfgs = [c for c in cfgs if c["variant"] in keep]
    if a.sequence:  # the plan's first config (shape, layers, rank, setup) with these variants, in this order
        seq = a.sequence.split(",")
        unknown = sorted(set(seq) - set(VARIANTS))
        if unknown or not cfgs:
            raise SystemExit(f"--sequence: unknown {unknown} (known: {VARIANTS})" if unknown else
                             "--sequence: the plan has no config")
        first = {k: cfgs[0][k] for k in ("shape", "layers", "rank", "setup")}
        cfgs = [dict(first, variant=v) for v in seq]
    try:
        settings = parse_settings(a.settings)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    check_settings(settings)
    if a.spawn == "fork":
        # before torch is imported: torch.cuda.is_available() (transformers may call it) then asks NVML instead of
        # initialising the CUDA driver, which a forked child could not use
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        t = time.perf_counter()
        preimport()
        import torch
        if torch.cuda.is_initialized():  # a forked worker could not use CUDA
            print("WARNING: CUDA got initialised in the parent while importing; falling back to --spawn exec",
                  flush=True)
            a.spawn = "exec"
        else:
            print(f"parent imports {time.perf_counter() - t:.1f} s (workers are forked from here)", flush=True)
    os.makedirs(a.out, exist_ok=True)
    wdir = os.path.join(a.out, "workers")
    os.makedirs(wdir, exist_ok=True)
    profile_out = os.path.join(a.out, "model_bench_profile.txt")
    if os.path.exists(profile_out):
        os.remove(profile_out)
    t_begin = time.perf_counter()
    results, skipped, errors, observed = [], [], [], {}

    def spawn_of(c):  # --spawn exec: every worker; --spawn fork: all but the configs the plan puts in exec workers
        return "exec" if a.spawn == "exec" or (c.get("spawn") == "exec" and not a.all_forked) else "fork"

    def make(i):
        c = cfgs[i]
        res = os.path.join(wdir, f"cfg{i:03d}.json")
        if os.path.exists(res):
            os.remove(res)
        if spawn_of(c) == "fork":
            return Forked(c, worker_cmd(c, a, res, profile_out), res, res[:-5] + ".log")
        return Pending(c, worker_cmd(c, a, res, profile_out), res)

    def save():
        doc = dict(meta=dict(argv=sys.argv, plan=a.plan, parent_pid=os.getpid(), seq=a.seq, ga=a.ga,
                             loss_tokens=a.loss_tokens, warmup=a.warmup, repeats=a.repeats,
                             inf_warmup=a.inf_warmup, inf_repeats=a.inf_repeats,
                             lora_alpha=16, use_rslora=True, targets=TARGETS, spawn=a.spawn, settings=settings,
                             total_s=time.perf_counter() - t_begin,
                             date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())),
                   results=results, skipped=skipped, errors=errors)
        path = os.path.join(a.out, "model_bench.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)
        return path

    sampler = GpuSampler(os.path.join(a.out, "gpu_samples.csv"), a.gpu_sample_ms, a.device)
    nxt = make(0) if (cfgs and spawn_of(cfgs[0]) == "exec") else None
    for i, c in enumerate(cfgs):
        cur = nxt or make(i)
        nxt = None
        elapsed = time.perf_counter() - t_begin
        est = estimate_s(c, observed)
        tag = (f"{c['shape']} L={c['layers']} r={c['rank']} {c['setup']} {c['variant']}"
               + (" [profile]" if c.get("profile") else "") + (" [full depth]" if c.get("full_depth") else ""))
        if elapsed + est > a.budget_s:
            cur.cancel()
            skipped.append(dict(c, reason=f"budget: {elapsed:.0f}s used + ~{est:.0f}s est > {a.budget_s}s"))
            print(f"[{elapsed:6.1f}s] SKIP {tag} (est {est:.0f}s, budget)", flush=True)
            if i + 1 < len(cfgs) and spawn_of(cfgs[i + 1]) == "exec":
                nxt = make(i + 1)
            continue
        # exec mode: the next worker starts (imports torch, CPU only) while this one builds its model; it imports
        # the rest and touches CUDA only after "go". fork mode: nothing runs beside the worker.
        if i + 1 < len(cfgs) and spawn_of(cfgs[i + 1]) == "exec":
            nxt = make(i + 1)
        timeout = max(60.0, min(a.budget_s - elapsed + 30, 3 * est + 60))
        rec, wall, err = cur.go(timeout=timeout)
        if err and spawn_of(c) == "fork" and fork_broke_cuda(err):
            print(f"WARNING: a forked worker could not use CUDA ({err.strip().splitlines()[-1][:200]}); "
                  f"falling back to --spawn exec", flush=True)
            a.spawn = "exec"
            cur = make(i)
            rec, wall, err = cur.go(timeout=timeout)
        key = (c["shape"], c["layers"])
        observed.setdefault(key, []).append(wall / (1.3 if c["variant"] == "peft_dora" else 1.0))
        if err:
            errors.append(dict(c, error=err))
            tail = "\n    ".join(err.strip().splitlines()[-12:])
            print(f"[{elapsed:6.1f}s] FAIL {tag} ({wall:.1f}s):\n    {tail}", flush=True)
            save()
            continue
        rec["wall_s"] = wall
        rec["spawn"] = spawn_of(c)
        rec["full_depth"] = bool(c.get("full_depth"))
        results.append(rec)
        print(f"[{elapsed:6.1f}s] done {tag}: grad {rec['grad_iter_s']:.3f}s  inf {rec['infer_s']*1e3:.1f}ms  "
              f"peak {rec.get('train_peak_alloc_gb', float('nan')):.2f}GB  ({wall:.1f}s)", flush=True)
        save()  # after every config: a run stopped from outside keeps what it measured
    if nxt is not None:
        nxt.cancel()
    text = sampler.stop()
    if text is not None:
        samples = gpu_samples(text)
        for rec in results:
            if rec.get("grad_iter_window"):
                rec["gpu_during_grad_iter"] = gpu_window(samples, rec["grad_iter_window"])
    report(save(), a.out)


# ----------------------------------------------------------------------------------------------------------------
# report: markdown tables, targets PASS/MISS, plot
# ----------------------------------------------------------------------------------------------------------------

_PEAKS = ("train_peak_alloc_gb", "train_peak_reserved_gb", "infer_peak_alloc_gb", "infer_peak_reserved_gb")


def _pool(rs):
    """One config run in several worker processes (``--sequence`` with a variant repeated): the median over every
    process's timed iterations, the largest peak memory; ``per_process`` keeps each process's own
    median. A config run once is returned as it is."""
    if len(rs) == 1:
        return rs[0]
    m = dict(rs[0])
    for f in ("grad_iter_s", "infer_s"):
        vals = [x for r in rs for x in r.get(f + "_all", [r[f]])]
        m[f + "_all"] = vals
        m[f] = statistics.median(vals)
    m["grad_iter_min_s"] = min(m["grad_iter_s_all"])
    m["grad_iter_gc_ms_all"] = [x for r in rs for x in r.get("grad_iter_gc_ms_all", [])]
    for f in _PEAKS:
        vals = [r[f] for r in rs if f in r]
        if vals:
            m[f] = max(vals)
    m["processes"] = len(rs)
    m["per_process"] = [dict(grad_iter_s=r["grad_iter_s"], infer_s=r["infer_s"]) for r in rs]
    return m


def _index(results):
    groups = {}
    for r in results:
        groups.setdefault((r["shape"], r["layers"], r["setup"], r["rank"], r["variant"]), []).append(r)
    return {k: _pool(rs) for k, rs in groups.items()}


def tables(doc):
    idx = _index(doc["results"])
    groups = sorted({k[:4] for k in idx}, key=lambda k: (k[0] != "qwen3-8b", k[0], k[1], k[2], k[3]))
    md = []
    m = doc.get("meta", {})
    md.append(f"seq {m.get('seq')}, batch 1, grad accumulation {m.get('ga')}, loss on last {m.get('loss_tokens')} "
              f"tokens, non-reentrant gradient checkpointing, rsLoRA alpha 16, targets q,k,v,o,gate,up,down; "
              f"grad iter = {m.get('ga')} micro-batches fwd+bwd + SGD(lr=0) step; medians of n timed iterations "
              f"(n: the column; {m.get('repeats')} unless the plan sets fewer) after {m.get('warmup')} warm-up "
              f"(inference: {m.get('inf_repeats')} after {m.get('inf_warmup')}).\n")
    md.append("| shape | layers | setup | r | variant | n | grad iter (s) | vs LoRA | PEFT DoRA / this | "
              "inference (ms) | vs LoRA | PEFT DoRA / this | train peak alloc (GB) | train peak reserved (GB) | "
              "inf peak alloc (GB) | path |")
    md.append("|" + "---|" * 16)
    for gk in groups:
        lora = idx.get(gk + ("lora",))
        pd = idx.get(gk + ("peft_dora",))
        for v in VARIANTS:
            r = idx.get(gk + (v,))
            if r is None:
                continue

            def rat(x, y):
                return f"{x / y:.3f}x" if (x and y) else "-"
            pc = r.get("path_counter") or {}
            path = ", ".join(f"{k}" for k in sorted(pc) if pc[k]) if pc else ""
            md.append(f"| {gk[0]} | {gk[1]} | {gk[2]} | {gk[3]} | {VARIANT_LABEL[v]} | "
                      f"{len(r.get('grad_iter_s_all', [0]))} | {r['grad_iter_s']:.3f} | "
                      f"{rat(r['grad_iter_s'], lora and lora['grad_iter_s'])} | "
                      f"{rat(pd and pd['grad_iter_s'], r['grad_iter_s'])} | {r['infer_s'] * 1e3:.1f} | "
                      f"{rat(r['infer_s'], lora and lora['infer_s'])} | {rat(pd and pd['infer_s'], r['infer_s'])} | "
                      f"{r.get('train_peak_alloc_gb', float('nan')):.2f} | "
                      f"{r.get('train_peak_reserved_gb', float('nan')):.2f} | "
                      f"{r.get('infer_peak_alloc_gb', float('nan')):.2f} | {path} |")
    spawns = {r.get("spawn", m.get("spawn")) for r in doc["results"]}
    if len(spawns) > 1:
        ex = sorted({(r["shape"], r["layers"], r["setup"], r["rank"]) for r in doc["results"]
                     if r.get("spawn") == "exec"})
        md.append("\nWorkers: forked from the parent, except these configs' (a fresh interpreter each, exec): "
                  + "; ".join(f"{k[0]} L={k[1]} {k[2]} r={k[3]}" for k in ex) + ".")
    gpu = [r for r in doc["results"] if r.get("gpu_during_grad_iter")]
    if gpu:
        md.append("\nThe GPU during each process's timed iterations (nvidia-smi samples: median SM clock, power, "
                  "temperature; mean utilisation; share of samples at the SW power cap / a hardware slowdown):")
        for r in gpu:
            g = r["gpu_during_grad_iter"]
            md.append(f"- {r['shape']} L={r['layers']} {r['setup']} r={r['rank']} {VARIANT_LABEL[r['variant']]} "
                      f"(grad iter {r['grad_iter_s']:.3f} s): {g['sm_mhz']:.0f} MHz, {g['power_w']:.0f} W, "
                      f"{g['temp_c']:.0f} C, {g['util_pct']:.0f}%, power cap {100 * g['sw_power_cap']:.0f}%, "
                      f"slowdown {100 * g['hw_slowdown']:.0f}% ({g['n']} samples)")
    pooled = [(k, r) for k, r in idx.items() if r.get("processes", 1) > 1]
    if pooled:
        md.append("\nPooled over alternating worker processes (median of all their timed iterations); each process's "
                  "own median grad iter / inference:")
        for k, r in sorted(pooled):
            md.append(f"- {k[0]} L={k[1]} {k[2]} r={k[3]} {VARIANT_LABEL[k[4]]}: " + ", ".join(
                f"{p['grad_iter_s']:.3f} s / {p['infer_s'] * 1e3:.1f} ms" for p in r["per_process"]))
    return "\n".join(md)


def summary_table(doc):
    """One row per (shape, layers, setup, rank): LoRA's gradient iteration, then fastdora's and the eager fallback's
    ratios to LoRA and PEFT DoRA's to fastdora (time: median gradient iteration / inference; memory: peak allocated
    of the training iterations). The headline table of benchmarks/README.md."""
    idx = _index(doc["results"])
    groups = sorted({k[:4] for k in idx}, key=lambda k: (k[0] != "qwen3-8b", k[0], k[1], k[2], k[3]))

    def rat(a, b, field):
        x, y = a and a.get(field), b and b.get(field)
        return f"{x / y:.3f}x" if (x and y) else "-"

    md = ["| shape | layers | setup | r | LoRA grad iter | fastdora / LoRA | PEFT DoRA / fastdora | eager / LoRA | "
          "inference: fastdora / LoRA | PEFT DoRA / fastdora | eager / LoRA | peak alloc fastdora / LoRA |",
          "|" + "---|" * 12]
    for g in groups:
        lo, pd, fd, eg = (idx.get(g + (v,)) for v in ("lora", "peft_dora", "fastdora", "eager"))
        md.append(f"| {g[0]} | {g[1]} | {g[2]} | {g[3]} | "
                  + (f"{lo['grad_iter_s']:.3f} s" if lo else "-") + " | "
                  + " | ".join([rat(fd, lo, "grad_iter_s"), rat(pd, fd, "grad_iter_s"), rat(eg, lo, "grad_iter_s"),
                                rat(fd, lo, "infer_s"), rat(pd, fd, "infer_s"), rat(eg, lo, "infer_s"),
                                rat(fd, lo, "train_peak_alloc_gb")]) + " |")
    return "\n".join(md)


def target_checks(doc):
    idx = _index(doc["results"])
    rows = []

    def chk(name, value, op, thr, where):
        if value is None:
            rows.append((name, where, "n/a", f"{op} {thr}", "NOT RUN"))
            return
        ok = value <= thr if op == "<=" else value >= thr
        rows.append((name, where, f"{value:.3f}", f"{op} {thr}", "PASS" if ok else "MISS"))

    def get(k, field):
        r = idx.get(k)
        return r[field] if (r and field in r) else None

    def ratio(x, y):
        return x / y if (x is not None and y) else None

    tgt = [k for k in idx if k[0] == "qwen3-8b" and k[3] == 384 and k[4] == "fastdora"]
    layers = sorted({k[1] for k in tgt})
    for L in layers:
        # the full-depth run is one setup (AMP) without the eager fallback: only what it ran is checked there
        full = L == SHAPES["qwen3-8b"]["full_layers"]
        for setup, (sp_g, sp_i) in (("amp", (1.85, 2.2)), ("bf16", (1.45, 1.7))):
            g = ("qwen3-8b", L, setup, 384)
            if full and g + ("fastdora",) not in idx:
                continue
            where = f"qwen3-8b L={L} r=384 {setup}"
            fd_g, fd_i = get(g + ("fastdora",), "grad_iter_s"), get(g + ("fastdora",), "infer_s")
            lo_g, lo_i = get(g + ("lora",), "grad_iter_s"), get(g + ("lora",), "infer_s")
            pd_g, pd_i = get(g + ("peft_dora",), "grad_iter_s"), get(g + ("peft_dora",), "infer_s")
            eg_g, eg_i = get(g + ("eager",), "grad_iter_s"), get(g + ("eager",), "infer_s")
            chk("fastdora grad iter / LoRA", ratio(fd_g, lo_g), "<=", 1.03, where)
            chk("fastdora inference / LoRA", ratio(fd_i, lo_i), "<=", 1.02, where)
            chk("PEFT DoRA / fastdora grad iter (speed-up)", ratio(pd_g, fd_g), ">=", sp_g, where)
            chk("PEFT DoRA / fastdora inference (speed-up)", ratio(pd_i, fd_i), ">=", sp_i, where)
            if not (full and eg_g is None):
                chk("eager fallback grad iter / LoRA (tax)", ratio(eg_g, lo_g), "<=", 1.19, where)
                chk("eager fallback inference / LoRA (tax)", ratio(eg_i, lo_i), "<=", 1.09, where)
            fa = get(g + ("fastdora",), "train_peak_alloc_gb")
            chk("fastdora peak alloc / LoRA", ratio(fa, get(g + ("lora",), "train_peak_alloc_gb")), "<=", 1.03, where)
    # every config: fastdora not slower than PEFT DoRA, peak alloc never above PEFT DoRA
    for k in sorted(idx):
        if k[4] != "fastdora":
            continue
        g = k[:4]
        where = f"{g[0]} L={g[1]} r={g[3]} {g[2]}"
        pd = idx.get(g + ("peft_dora",))
        if pd is None:
            continue
        r = idx[k]
        chk("fastdora grad iter / PEFT DoRA", r["grad_iter_s"] / pd["grad_iter_s"], "<=", 1.0, where)
        chk("fastdora inference / PEFT DoRA", r["infer_s"] / pd["infer_s"], "<=", 1.0, where)
        if "train_peak_alloc_gb" in r and "train_peak_alloc_gb" in pd:
            chk("fastdora peak alloc / PEFT DoRA", r["train_peak_alloc_gb"] / pd["train_peak_alloc_gb"], "<=", 1.0,
                where)
    md = ["| target | where | measured | threshold | result |", "|---|---|---|---|---|"]
    md += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n".join(md), rows


def plot(doc, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: matplotlib unavailable: {e})")
        return False
    idx = _index(doc["results"])
    groups = sorted({(k[0], k[1], k[2]) for k in idx}, key=lambda k: (k[0] != "qwen3-8b", k[0], k[1], k[2]))
    if not groups:
        return False
    metrics = [("grad_iter_s", "grad iteration (s)"), ("infer_s", "inference fwd (ms)"),
               ("train_peak_alloc_gb", "train peak alloc (GB)")]
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 3.2 * len(groups)), squeeze=False)
    for gi, g in enumerate(groups):
        ranks = sorted({k[3] for k in idx if k[:3] == g})
        for mi, (field, label) in enumerate(metrics):
            ax = axes[gi][mi]
            w = 0.8 / len(VARIANTS)
            for vi, v in enumerate(VARIANTS):
                xs, ys = [], []
                for ri, r in enumerate(ranks):
                    rec = idx.get(g + (r, v))
                    if rec and field in rec:
                        xs.append(ri + (vi - 1.5) * w)
                        ys.append(rec[field] * (1e3 if field == "infer_s" else 1.0))
                if xs:
                    ax.bar(xs, ys, w, label=VARIANT_LABEL[v], color=VARIANT_COLOR[v])
            ax.set_xlim(-0.6, max(len(ranks), 3) - 0.4)  # one rank: bars as wide as in the 4-rank panels
            ax.set_xticks(range(len(ranks)))
            ax.set_xticklabels([f"r={r}" for r in ranks])
            ax.set_title(f"{g[0]} L={g[1]} {g[2]}: {label}", fontsize=9)
    handles = {}
    for ax in axes.flat:  # one legend above the panels (inside one it covered bars)
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="upper center", ncol=len(handles), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.2 * len(groups))))
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def report(path, outdir=None):
    """Tables + plot from one model_bench.json, or from several (``a.json,b.json``: e.g. one parent per GPU),
    merged into ``outdir/model_bench.json``."""
    from _bench_io import load_docs

    paths = path.split(",")
    docs = load_docs(path)
    doc = docs[0]
    if len(docs) > 1:
        doc = dict(meta=dict(docs[0].get("meta", {}), merged_from=[d.get("meta") for d in docs],
                             total_s=max(d.get("meta", {}).get("total_s", 0) for d in docs)),
                   results=[r for d in docs for r in d["results"]],
                   skipped=[r for d in docs for r in d.get("skipped", [])],
                   errors=[r for d in docs for r in d.get("errors", [])])
    outdir = outdir or os.path.dirname(os.path.abspath(paths[0]))
    os.makedirs(outdir, exist_ok=True)
    if len(docs) > 1:
        with open(os.path.join(outdir, "model_bench.json"), "w") as f:
            json.dump(doc, f, indent=1)
    t = tables(doc)
    tc, rows = target_checks(doc)
    extra = []
    if doc.get("skipped"):
        extra.append("Skipped (time budget): " + "; ".join(
            f"{s['shape']} L={s['layers']} r={s['rank']} {s['setup']} {s['variant']}" for s in doc["skipped"]))
    if doc.get("errors"):
        extra.append("Errors: " + "; ".join(
            f"{e['shape']} L={e['layers']} r={e['rank']} {e['setup']} {e['variant']}: "
            f"{(e['error'].strip().splitlines() or [''])[-1][:200]}" for e in doc["errors"]))
    vers = next((r.get("versions") for r in doc["results"]), {})
    gpu = next((r.get("gpu") for r in doc["results"] if r.get("gpu")), "cpu")
    head = f"Device: {gpu}; versions: {vers}; run {doc.get('meta', {}).get('date')}, " \
           f"total {doc.get('meta', {}).get('total_s', 0):.0f} s\n"
    if doc.get("meta", {}).get("settings"):
        head += f"\nfastdora variants under internal settings {doc['meta']['settings']} (fastdora.config.override)\n"
    md = (head + "\n### Summary\n\n" + summary_table(doc) + "\n\n### All results\n\n" + t + "\n\n### Targets\n\n" + tc
          + "\n" + ("\n" + "\n\n".join(extra) + "\n" if extra else ""))
    with open(os.path.join(outdir, "model_bench.md"), "w") as f:
        f.write(md)
    plot(doc, os.path.join(outdir, "model_bench.png"))
    print("\n" + md)
    n_pass = sum(r[4] == "PASS" for r in rows)
    n_miss = sum(r[4] == "MISS" for r in rows)
    print(f"TARGETS: {n_pass} PASS, {n_miss} MISS, {sum(r[4] == 'NOT RUN' for r in rows)} NOT RUN")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--wait-go", action="store_true")
    p.add_argument("--forked", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spawn", default="fork", choices=["fork", "exec"],
                   help="parent: fork each worker from the parent after importing torch/transformers/PEFT once "
                        "(default; nothing else runs while a worker is measured), or exec a fresh interpreter per "
                        "worker (the next one starts while the current one builds its model)")
    p.add_argument("--all-forked", action="store_true",
                   help="with --spawn fork: fork the configs the plan runs in exec workers too (plan h200: its "
                        "r=384 target block)")
    p.add_argument("--report", help="regenerate tables/plot from a model_bench.json (or several, comma-separated)")
    p.add_argument("--report-out", help="--report: folder for the merged json / md / png")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--plan", default="h200", choices=PLANS)
    p.add_argument("--variants", help="parent: run only these variants of the plan (comma-separated)")
    p.add_argument("--sequence", help="parent: run the plan's first config (shape, layers, rank, setup) with these "
                   "variants in this order, repeats allowed, pooled in the report (comma-separated; e.g. --plan "
                   "bf16 --sequence lora,fastdora,lora,fastdora)")
    p.add_argument("--settings", default="",
                   help="internal settings for the fastdora variants, NAME=VALUE comma-separated (Python literals, "
                        "e.g. layer_node=False,graph_norm=False): the worker runs under "
                        "fastdora.config.override(...)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test): --plan tiny, short seq")
    p.add_argument("--budget-s", type=float, default=548.0,
                   help="parent: launch no config expected to end after this many seconds")
    p.add_argument("--layers", type=int, default=8, help="decoder layers for Qwen3-8B shapes")
    p.add_argument("--layers-mistral", type=int, default=3, help="decoder layers for Mistral-Small-24B shapes")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-sample-ms", type=int, default=200,
                   help="parent: sample the GPU's clocks / power with nvidia-smi this often (0: off)")
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--setup", default="amp", choices=["amp", "bf16"])
    p.add_argument("--variant", default="fastdora", choices=VARIANTS)
    p.add_argument("--result")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--ga", type=int, default=8)
    p.add_argument("--loss-tokens", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3,
                   help="warm-up iterations (3: the norm-recompute kernels with a cached base compile at the 2nd step, "
                        "its CUDA graph is captured at the 3rd)")
    p.add_argument("--warmup-ga", type=int, default=2, help="micro-batches per warm-up iteration")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--inf-warmup", type=int, default=2)
    p.add_argument("--inf-repeats", type=int, default=7)
    p.add_argument("--profile-out")
    p.add_argument("--profile-ga", type=int, default=2)
    return p


def main():
    a = build_parser().parse_args()
    if a.tiny:
        a.plan = "tiny"
        a.seq, a.loss_tokens, a.ga = min(a.seq, 128), min(a.loss_tokens, 32), min(a.ga, 2)
        a.layers = 2
        a.repeats, a.inf_repeats = min(a.repeats, 2), min(a.inf_repeats, 2)
    from _bench_io import dispatch

    dispatch(a, report, run_worker, run_parent)


if __name__ == "__main__":
    main()
