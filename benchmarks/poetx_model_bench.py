#!/usr/bin/env python3
"""POET-X at model level: peak memory and tokens/s of a Llama-8B-shaped model trained with AdamW (all parameters),
PEFT LoRA r=160 and fastdora's POET-X (fast / mem / 8-bit, b=256 and 512), side by side in one run.

The model: Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32 heads / 8 KV heads, head_dim 128, vocabulary
128256, untied lm_head), random weights (``from_config``, seeded), sdpa attention. One training step: batch 1,
sequence 1024, random token ids (the same for every config), the causal-LM loss on every token (transformers'
``labels=``), backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``. Each config runs in its own process
(fresh CUDA state; by default forked from a parent that has imported torch / transformers / PEFT without touching
CUDA), 3 warm-up steps (the first compiles the Triton kernels and allocates the optimizer states), then the median
of 8 timed steps: tokens/s = 1024 / median step time; peak = ``torch.cuda.max_memory_allocated`` over the timed steps
(weights, optimizer states, gradients, activations and temporaries; reserved memory recorded beside it).

Precision setup (the same rules for every method; what HF Trainer with ``bf16=True`` and its default optimizer runs,
and what the paper compares):

- weights bf16; the forward under bf16 autocast; no gradient checkpointing (``--grad-ckpt`` turns it on for all):
  at batch 1 x 1024 tokens the activations are small, and checkpointing would erase the difference between POET-X's
  fast mode (which keeps each GEMM output for the backward) and its mem mode (which recomputes it).
- one ``torch.optim.AdamW(fused=True)`` (HF Trainer's default ``adamw_torch_fused``; no temporaries the size of the
  parameters during the step), betas (0.9, 0.95), lr 1e-5, weight decay 0.01 (0 for POET-X's Q, as the plugins set
  it). Its moments take each parameter's dtype: **bf16 moments for bf16 parameters** (8 bytes per trained parameter
  with its gradient: the full 8B model then fits one H200), fp32 moments for fp32 parameters.
- ``adamw``: every parameter trainable (embeddings, norms, lm_head included).
- ``lora-r160``: stock PEFT LoRA, r=160, alpha 320, on q,k,v,o,gate,up,down of every decoder layer, adapters fp32
  (PEFT's default ``autocast_adapter_dtype``), base frozen.
- ``poetx-*``: ``fastdora.poetx.convert`` on every decoder linear layer (the 7 projections of each layer; ``lm_head``
  excluded as in the paper's recipe), ``Q`` fp32 (fastdora's default) with fp32 moments at 0.5x the learning rate;
  embeddings, norms and lm_head stay bf16 and trainable with AdamW (the paper's recipe). ``fast`` / ``mem``: the two
  memory modes; ``int8``: ``weight_format="int8"`` (group size 128) in mem mode (8-bit: the least memory).
  After the timed steps two ``poetx.merge(model)`` are timed: the first of the process (it also compiles the
  merge's kernels: ``merge_first_s`` in the JSON) and the next (``merge (s)`` in the table; a merge every 200 steps in
  the paper's recipe: the table's amortised tokens/s adds 1/200 of it to each step).
- ``-batched``: the fast-mode layers' blocks from a few batched Cayley series per forward (``fastdora.poetx.batch``,
  ``batch.ENABLED = True``), beside the default (every layer its own series), at full depth in both plans.
- ``-launchers``: fast mode with every kernel launch made through its launcher (``fastdora.poetx.replay.ENABLED =
  False``), beside the default (each layer's launches recorded once and replayed), at full depth in both plans.
- ``-py-replay``: fast mode with the replayed launches made one by one through each kernel's compiled Triton
  launcher from Python (``fastdora.poetx.replay.PROGRAMS = False``) instead of one C++ launch program per segment.
- ``-load-split``: fast mode with the Cayley–Neumann backward's products splitting every fp32 operand tile into its
  bf16 parts in their loads (``fastdora.poetx.kernels.SPLIT_OPERANDS = False``, as the forward does) instead of
  reading operands split once by the launch that produced them, beside the default, at full depth in both plans.
- ``-no-pdl``: fast mode with the POET-X kernels launched plainly (``fastdora._launch.PDL = False``) instead of as
  programmatic dependent launches (Hopper and later: each kernel's launch and the scheduling of its programs overlap
  the end of the kernel before it), beside the default, at full depth in both plans.
- extra rows (the plan's tail): ``-qbf16``: Q and its moments in bf16 (as the paper's public implementation keeps
  them); ``adamw-foreach``: torch's default multi-tensor AdamW (a temporary the size of the moments during the step);
  ``adamw-fp32-master``: fp32 weights with fp32 moments under bf16 autocast (16 bytes per parameter plus the
  activations: expected not to fit 141 GB at full depth; an OOM is recorded as a result).

Plan ``h200`` (priority order; ``--budget-s`` drops the tail): 1. full depth (32 layers): AdamW, POET-X fast / mem /
int8 at b=256, LoRA r=160 (the targets), POET-X fast ``-batched``, ``-launchers``, ``-py-replay``, ``-load-split`` and
``-no-pdl``; 2. full depth: POET-X fast / mem / int8 at b=512; 3. ``--layers`` (8) decoder layers: the same eight
configs (the per-layer cost, with the embeddings' share smaller); 4. full depth: the extra rows. Plan ``targets``:
block 1 alone.

Targets (full depth, b=256, the paper's ratios on an H100): POET-X mem peak <= 0.37x AdamW's, fast <= 0.43x,
fast tokens/s >= 0.85x AdamW's (the paper measured ~0.76x). The b=512 rows are checked against the same thresholds
(informational: the paper quotes b=256).

Usage:
  python benchmarks/poetx_model_bench.py --out DIR [--budget-s 460] [--plan h200|targets] [--layers 8]
  python benchmarks/poetx_model_bench.py --report DIR/poetx_model_bench.json        # tables + plot again
  python benchmarks/poetx_model_bench.py --tiny --device cpu --out /tmp/pxm         # CPU smoke test, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256, rope_theta=500000.0, full_layers=32, blocks=(256, 512),
                      rank=160, group_size=128),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=512, rope_theta=10000.0, full_layers=2, blocks=(16, 32), rank=8, group_size=32),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PLANS = ["h200", "targets"]
MERGE_INTERVAL = 200
Q_LR_SCALE = 0.5
# the paper's Table (H100 80 GB, Llama-8B, batch 1, sequence 1024, b=256): peak GB, tokens/s
PAPER = {"adamw": (76.3, 9300), "poetx-fast-b256": (33.1, 7100), "poetx-mem-b256": (27.9, 5300),
         "poetx-int8-b256": (23.6, None), "lora-r160": (33.6, None)}
# thresholds: (what, config, field, op, value)
TARGET_RULES = [("POET-X mem peak / AdamW", "poetx-mem-b{b}", "peak_alloc_gb", "<=", 0.37),
                ("POET-X fast peak / AdamW", "poetx-fast-b{b}", "peak_alloc_gb", "<=", 0.43),
                ("POET-X fast tokens/s / AdamW", "poetx-fast-b{b}", "tokens_per_s", ">=", 0.85)]


#: module settings as the first config found them (a process may set up several configs: the step profile)
_DEFAULTS: dict = {}


def config_name(c: dict) -> str:
    m = c["method"]
    if m == "adamw":
        return "adamw" + {"fused": "", "foreach": "-foreach"}[c.get("optim", "fused")] + (
            "-fp32-master" if c.get("master") == "fp32" else "")
    if m == "lora":
        return f"lora-r{c['rank']}"
    kind = "int8" if c.get("weight_format") == "int8" else c["mode"]
    return (f"poetx-{kind}-b{c['block']}" + ("-qbf16" if c.get("q_dtype") == "bf16" else "")
            + ("-batched" if c.get("series") == "batched" else "")
            + (f"-{c['launch']}" if c.get("launch") else "")
            + (f"-{c['series_precision']}" if c.get("series_precision") else "")
            + ("-load-split" if c.get("split_operands") is False else "")
            + ("-no-pdl" if c.get("pdl") is False else ""))


def plan_configs(plan: str, shape: str, layers: int) -> list:
    """Configs in priority order: dict(method, layers, full_depth[, mode, weight_format, block, rank, q_dtype, optim,
    master])."""
    sh = SHAPES[shape]
    full, (b0, b1), rank = sh["full_layers"], sh["blocks"], sh["rank"]

    def poetx(b, kind, n, **kw):
        mode = "mem" if kind == "int8" else kind
        return dict(method="poetx", mode=mode, weight_format="int8" if kind == "int8" else "dense", block=b,
                    layers=n, **kw)

    def block(b, n):
        return [poetx(b, k, n) for k in ("fast", "mem", "int8")]

    cfgs = [dict(method="adamw", layers=full)] + block(b0, full) + [dict(method="lora", rank=rank, layers=full)]
    cfgs += [poetx(b0, "fast", full, series="batched")]  # the batched series, side by side
    cfgs += [poetx(b0, "fast", full, launch="launchers")]  # every launch through its launcher, side by side
    cfgs += [poetx(b0, "fast", full, launch="py-replay")]  # replayed from Python, no C++ launch programs
    cfgs += [poetx(b0, "fast", full, split_operands=False)]  # series backward: operands split in the loads
    cfgs += [poetx(b0, "fast", full, pdl=False)]  # plain launches instead of programmatic dependent ones
    if plan == "h200":
        cfgs += block(b1, full)
        cfgs += [dict(method="adamw", layers=layers)] + block(b0, layers) + [
            dict(method="lora", rank=rank, layers=layers)] + block(b1, layers)
        cfgs += [poetx(b0, "fast", full, q_dtype="bf16"), poetx(b0, "mem", full, q_dtype="bf16"),
                 dict(method="adamw", optim="foreach", layers=full),
                 dict(method="adamw", master="fp32", layers=full)]
    for c in cfgs:
        c["full_depth"] = c["layers"] == full
        c["name"] = config_name(c)
    seen, out = set(), []
    for c in cfgs:  # --layers equal to the full depth: one run per config
        k = (c["name"], c["layers"])
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


# ----------------------------------------------------------------------------------------------------------------
# worker: one config in this process
# ----------------------------------------------------------------------------------------------------------------

def preimport():
    import importlib

    for m in ("torch", "transformers", "peft", "transformers.models.llama.modeling_llama"):
        try:
            importlib.import_module(m)
        except ImportError:
            pass  # reported where the worker uses it


def build_model(shape: str, layers: int, dtype, dev):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sh = {k: v for k, v in SHAPES[shape].items() if k not in ("full_layers", "blocks", "rank", "group_size")}
    cfg = LlamaConfig(**sh, num_hidden_layers=layers, max_position_embeddings=8192, tie_word_embeddings=False,
                      use_cache=False, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(s in str(e) for s in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")))


def setup_method(model, c: dict, a, dev):
    """Trainable parameters and the optimizer's param groups for config ``c``; returns (model, groups, info)."""
    import torch

    lr, info = a.lr, {}
    if c["method"] == "adamw":
        params = [p for p in model.parameters()]
        for p in params:
            p.requires_grad_(True)
        return model, [dict(params=params, lr=lr, weight_decay=0.01)], info
    if c["method"] == "lora":
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=c["rank"], lora_alpha=2 * c["rank"], target_modules=TARGETS, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")
        torch.manual_seed(1)
        with torch.device(dev):  # adapters created on the device
            model = get_peft_model(model, lcfg)  # adapters fp32 (autocast_adapter_dtype=True), base frozen
        params = [p for p in model.parameters() if p.requires_grad]
        return model, [dict(params=params, lr=lr, weight_decay=0.01)], info
    from fastdora import poetx
    from fastdora.poetx import PoetXLinear

    rep = poetx.convert(model, block_size=c["block"], merge_interval=MERGE_INTERVAL, mode=c["mode"],
                        exclude=("lm_head",), seed=0, weight_format=c["weight_format"],
                        group_size=SHAPES[a.shape]["group_size"])
    info["convert_report"] = dict(converted=len(rep.converted), skipped=dict(rep.skipped),
                                  q_values=rep.trainable_parameters)
    layers = [m for m in model.modules() if isinstance(m, PoetXLinear)]
    if len(layers) != 7 * c["layers"]:
        raise RuntimeError(f"POET-X converted {len(layers)} layers, expected {7 * c['layers']}: {rep}")
    from fastdora.poetx import batch, replay
    from fastdora.poetx import kernels as poetx_kernels

    # "-batched": the fast-mode layers' blocks from a few batched series per forward (fastdora.poetx.batch, off by
    # default: measured slower than one series per layer); every other config: each layer its own series
    batch.ENABLED = c.get("series") == "batched"
    # "-launchers": every kernel launch through its launcher, none replayed (fastdora.poetx.replay off)
    replay.ENABLED = c.get("launch") != "launchers"
    # "-py-replay": replayed launches one by one through Triton's compiled launchers (no C++ launch programs)
    replay.PROGRAMS = c.get("launch") != "py-replay"
    # "-no-pdl": the POET-X kernels launched plainly, not as programmatic dependent launches (fastdora._launch.PDL)
    from fastdora import _launch

    _launch.PDL = c.get("pdl", True)
    replay.clear()
    # "-tf32x3" (a precision name): the series' products of a training step in that precision instead of the default
    default = _DEFAULTS.setdefault("series_precision", poetx_kernels.CAYLEY_PRECISION)
    poetx_kernels.CAYLEY_PRECISION = c.get("series_precision") or default
    # "-load-split": the series backward's bf16x3 products split each operand tile in their loads (the operands are
    # otherwise split once, by the launch that produces them)
    poetx_kernels.SPLIT_OPERANDS = c.get("split_operands", True)
    if c.get("q_dtype") == "bf16":
        for m in layers:
            m.q_in = torch.nn.Parameter(m.q_in.detach().to(torch.bfloat16))
            m.q_out = torch.nn.Parameter(m.q_out.detach().to(torch.bfloat16))
    q = [p for m in layers for p in (m.q_in, m.q_out)]
    qid = {id(p) for p in q}
    # embeddings, norms, lm_head (the converted layers' weights are frozen, or int8 buffers)
    others = [p for p in model.parameters() if id(p) not in qid and p.requires_grad]
    return model, [dict(params=others, lr=lr, weight_decay=0.01),
                   dict(params=q, lr=lr * Q_LR_SCALE, weight_decay=0.0)], info


def _injected_failure(name, torch):
    """Tests only: ``POETX_MODEL_BENCH_FAIL="NAME=oom,NAME2=error"`` makes those configs fail before their timed steps
    (an out-of-memory error, recorded as a result, or another error, recorded as a failure)."""
    for item in filter(None, os.environ.get("POETX_MODEL_BENCH_FAIL", "").split(",")):
        cname, _, kind = item.partition("=")
        if cname == name:
            if kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")
            raise RuntimeError("injected failure")


def run_worker(a):
    import gc

    import torch

    c = json.loads(a.config)
    dev = torch.device(a.device)
    rec = dict(c, shape=a.shape, seq=a.seq, batch=a.batch, device=str(dev), pid=os.getpid(), grad_ckpt=a.grad_ckpt,
               versions=dict(torch=torch.__version__))
    for mod in ("transformers", "peft", "triton"):
        try:
            rec["versions"][mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    cuda = dev.type == "cuda"
    if cuda:
        rec["gpu"] = torch.cuda.get_device_name(dev)
        rec["gpu_total_gb"] = torch.cuda.get_device_properties(dev).total_memory / 1e9
    t_start = time.perf_counter()

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    phase = "build"
    try:
        dtype = torch.float32 if c.get("master") == "fp32" else torch.bfloat16
        model = build_model(a.shape, c["layers"], dtype, dev)
        rec["params"] = sum(p.numel() for p in model.parameters())
        if a.grad_ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model, groups, info = setup_method(model, c, a, dev)
        rec.update(info)
        model.train()
        trainable = [p for g in groups for p in g["params"]]
        rec["trainable_params"] = sum(p.numel() for p in trainable)
        by_dtype = {}
        for p in trainable:
            key = str(p.dtype).replace("torch.", "")
            by_dtype[key] = by_dtype.get(key, 0) + p.numel()
        rec["trainable_by_dtype"] = by_dtype
        rec["model_bytes_gb"] = (sum(p.numel() * p.element_size() for p in model.parameters())
                                 + sum(b.numel() * b.element_size() for b in model.buffers())) / 1e9
        impl = c.get("optim", "fused")
        kw = dict(fused=True) if (impl == "fused" and cuda) else dict(foreach=(impl == "foreach"))
        opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, **kw)
        rec["optimizer"] = dict(impl=impl if cuda else f"{impl} (cpu: {'foreach' if kw['foreach'] else 'for-loop'})",
                                lr=a.lr, q_lr_scale=Q_LR_SCALE if c["method"] == "poetx" else None)
        g = torch.Generator().manual_seed(123)
        vocab = SHAPES[a.shape]["vocab_size"]
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev)
        rec["build_s"] = time.perf_counter() - t_start
        losses = []

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        phase = "warm-up"
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        rec["warmup_s"] = [timed(step) for _ in range(a.warmup)]
        if cuda:
            rec["warmup_peak_alloc_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
            rec["static_alloc_gb"] = torch.cuda.memory_allocated(dev) / 1e9  # weights + optimizer states
        rec["opt_state_gb"] = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                                  if torch.is_tensor(t)) / 1e9
        gc.collect()
        gc.freeze()  # the objects alive now are left out of the timed steps' collections
        phase = "timed steps"
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        _injected_failure(c["name"], torch)
        w0 = time.time()
        ts = [timed(step) for _ in range(a.repeats)]
        rec["timed_window"] = [w0, time.time()]  # epoch s: the parent's GPU clock / power samples of these steps
        rec["step_s_all"] = ts
        rec["step_s"] = statistics.median(ts)
        rec["tokens_per_s"] = a.batch * a.seq / rec["step_s"]
        if cuda:
            rec["peak_alloc_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
            rec["peak_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / 1e9
        rec["losses"] = [float(x) for x in losses]
        if c["method"] == "poetx":
            from fastdora import poetx

            phase = "merge"
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            # the first merge of a process also compiles the merge's kernels (float32 block products): timed apart
            rec["merge_first_s"] = timed(lambda: poetx.merge(model))
            rec["merge_s"] = timed(lambda: poetx.merge(model))
            if cuda:
                rec["merge_peak_alloc_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        if not _is_oom(e):
            raise
        rec["status"] = "oom"
        rec["oom"] = dict(phase=phase, error=str(e).strip().splitlines()[0][:400],
                          peak_alloc_gb=torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else None)
        print(f"OOM in {phase}: {rec['oom']['error']}", flush=True)
    rec["worker_s"] = time.perf_counter() - t_start
    with open(a.result + ".tmp", "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(a.result + ".tmp", a.result)


# ----------------------------------------------------------------------------------------------------------------
# parent: the plan within a time budget, one process per config
# ----------------------------------------------------------------------------------------------------------------

def worker_args(c, a, result):
    args = ["--worker", "--config", json.dumps(c), "--device", a.device, "--shape", a.shape, "--result", result,
            "--seq", str(a.seq), "--batch", str(a.batch), "--warmup", str(a.warmup), "--repeats", str(a.repeats),
            "--lr", str(a.lr)]
    if a.grad_ckpt:
        args.append("--grad-ckpt")
    return args


def run_one(c, a, result, log, spawn, timeout):
    """Run one config in a forked or exec'd process; returns (record or None, wall s, error or None)."""
    if os.path.exists(result):
        os.remove(result)
    argv = worker_args(c, a, result)
    t0 = time.perf_counter()
    if spawn == "exec":
        with open(log, "w") as f:
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv, stdout=f, stderr=subprocess.STDOUT,
                                 cwd=REPO)
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = None
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 2
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                run_worker(build_parser().parse_args(argv))
                code = 0
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # the driver frees the device memory; no teardown object by object
        rc = None
        while time.perf_counter() - t0 < timeout:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.05)
        else:
            import signal

            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    wall = time.perf_counter() - t0
    with open(log, errors="replace") as f:
        out = f.read()
    if rc is None:
        return None, wall, f"timeout after {timeout:.0f}s\n{out[-3000:]}"
    if rc != 0 or not os.path.exists(result):
        return None, wall, f"rc={rc}\n{out[-4000:]}"
    with open(result) as f:
        return json.load(f), wall, None


def estimate_s(c, a, observed, compiled):
    """Wall-clock guess for one config: the median wall of the configs already run at the same depth (if any), else
    a per-layer guess; plus ~30 s for the first POET-X config of a block size on CUDA (Triton compiles)."""
    if a.device != "cuda":
        return 5.0
    same = observed.get(c["layers"])
    base = statistics.median(same) if same else 10.0 + 0.8 * c["layers"]
    if c["method"] == "poetx" and c["block"] not in compiled:
        base += 30.0
    return base


def run_parent(a):
    cfgs = plan_configs(a.plan, a.shape, a.layers)
    if a.configs:
        keep = [x for x in a.configs.split(",") if x]
        names = {c["name"] for c in cfgs}
        unknown = sorted(set(keep) - names)
        if unknown:
            raise SystemExit(f"--configs: unknown {unknown} (the plan has {sorted(names)})")
        cfgs = [c for c in cfgs if c["name"] in keep]
    spawn = a.spawn
    # before torch is imported: the allocator setting for every worker, and an NVML device check in the parent
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if spawn == "fork":
        t = time.perf_counter()
        preimport()
        import torch

        if torch.cuda.is_initialized():
            print("WARNING: CUDA got initialised in the parent while importing; falling back to --spawn exec")
            spawn = "exec"
        else:
            print(f"parent imports {time.perf_counter() - t:.1f} s (workers are forked from here)", flush=True)
    os.makedirs(a.out, exist_ok=True)
    wdir = os.path.join(a.out, "workers")
    os.makedirs(wdir, exist_ok=True)
    t_begin = time.perf_counter()
    results, skipped, errors, observed, compiled = [], [], [], {}, set()
    try:
        from model_bench import GpuSampler, fork_broke_cuda, gpu_samples, gpu_window
    except Exception:  # noqa: BLE001
        GpuSampler = None

        def fork_broke_cuda(err):
            return "CUDA" in err and "fork" in err

    meta = dict(argv=sys.argv, plan=a.plan, shape=a.shape, layers=a.layers, seq=a.seq, batch=a.batch,
                warmup=a.warmup, repeats=a.repeats, lr=a.lr, q_lr_scale=Q_LR_SCALE, merge_interval=MERGE_INTERVAL,
                grad_ckpt=a.grad_ckpt, spawn=spawn, budget_s=a.budget_s, parent_pid=os.getpid(),
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))

    def save():
        meta["total_s"] = time.perf_counter() - t_begin
        doc = dict(meta=meta, results=results, skipped=skipped, errors=errors)
        path = os.path.join(a.out, "poetx_model_bench.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)
        with open(os.path.join(a.out, "poetx_model_bench.md"), "w") as f:
            f.write(markdown(doc))
        return path

    sampler = GpuSampler(os.path.join(a.out, "gpu_samples.csv"), 200, a.device) if GpuSampler else None
    for i, c in enumerate(cfgs):
        elapsed = time.perf_counter() - t_begin
        est = estimate_s(c, a, observed, compiled)
        tag = f"{c['name']} L={c['layers']}"
        if elapsed + est > a.budget_s:
            skipped.append(dict(c, reason=f"budget: {elapsed:.0f}s used + ~{est:.0f}s est > {a.budget_s:.0f}s"))
            print(f"[{elapsed:6.1f}s] SKIP {tag} (est {est:.0f}s, budget)", flush=True)
            save()
            continue
        timeout = max(60.0, min(a.budget_s - elapsed + 60, 3 * est + 90))
        res, log = os.path.join(wdir, f"cfg{i:02d}.json"), os.path.join(wdir, f"cfg{i:02d}.log")
        rec, wall, err = run_one(c, a, res, log, spawn, timeout)
        if err and spawn == "fork" and fork_broke_cuda(err):
            print("WARNING: a forked worker could not use CUDA; falling back to --spawn exec", flush=True)
            spawn = meta["spawn"] = "exec"
            rec, wall, err = run_one(c, a, res, log, spawn, timeout)
        if c["method"] == "poetx":
            compiled.add(c["block"])
        if err:
            errors.append(dict(c, error=err, wall_s=wall))
            tail = "\n    ".join(err.strip().splitlines()[-10:])
            print(f"[{elapsed:6.1f}s] FAIL {tag} ({wall:.1f}s):\n    {tail}", flush=True)
            save()
            continue
        observed.setdefault(c["layers"], []).append(wall)
        rec["wall_s"], rec["spawn"] = wall, spawn
        results.append(rec)
        if rec["status"] == "oom":
            print(f"[{elapsed:6.1f}s] OOM  {tag} in {rec['oom']['phase']} ({wall:.1f}s)", flush=True)
        else:
            peak = rec.get("peak_alloc_gb")
            print(f"[{elapsed:6.1f}s] done {tag}: step {rec['step_s'] * 1e3:.1f} ms, {rec['tokens_per_s']:.0f} tok/s, "
                  f"peak {'-' if peak is None else f'{peak:.2f} GB'} ({wall:.1f}s)", flush=True)
        save()  # after every config: a run stopped from outside keeps what it measured
    text = sampler.stop() if sampler else None
    if text:
        samples = gpu_samples(text)
        for rec in results:
            if rec.get("timed_window"):
                rec["gpu_during_steps"] = gpu_window(samples, rec["timed_window"])
    report(save(), a.out)


# ----------------------------------------------------------------------------------------------------------------
# report: tables, targets, plot
# ----------------------------------------------------------------------------------------------------------------

def _index(results):
    """(layers, name) -> record (the last one run)."""
    return {(r["layers"], r["name"]): r for r in results}


def _order(name):
    base = ["adamw", "lora", "poetx-fast", "poetx-mem", "poetx-int8"]
    for i, b in enumerate(base):
        if name.startswith(b):
            return (i, len(name), name)
    return (len(base), len(name), name)


def summary_table(doc) -> str:
    idx = _index(doc["results"])
    md = []
    for layers in sorted({k[0] for k in idx}, reverse=True):
        adam = idx.get((layers, "adamw"))
        ok_adam = adam if adam and adam.get("status") == "ok" else None
        full = next(r["full_depth"] for k, r in idx.items() if k[0] == layers)
        n = next((r["params"] for k, r in idx.items() if k[0] == layers and "params" in r), None)
        md.append(f"\n**{layers} decoder layers{' (full depth)' if full else ''}**"
                  + (f" ({_count(n)} parameters)" if n else "") + "\n")
        md.append("| config | trainable | peak alloc (GB) | peak / AdamW | tokens/s | tokens/s / AdamW | step (ms) | "
                  "weights + optimizer states (GB) | merge (s) | tokens/s with a merge every 200 steps |")
        md.append("|" + "---|" * 10)
        for k in sorted((k for k in idx if k[0] == layers), key=lambda k: _order(k[1])):
            r = idx[k]
            if r.get("status") == "oom":
                o = r["oom"]
                peak = f"OOM ({o['phase']}" + (f"; {o['peak_alloc_gb']:.1f} at failure)" if o.get("peak_alloc_gb")
                                                else ")")
                md.append(f"| {k[1]} | {_count(r.get('trainable_params'))} | {peak} | - | - | - | - | - | - | - |")
                continue

            def ratio(field):
                x, y = r.get(field), ok_adam and ok_adam.get(field)
                return f"{x / y:.3f}x" if (x and y) else "-"
            peak = r.get("peak_alloc_gb")
            amort = "-"
            if r.get("merge_s") is not None:
                amort = f"{a_tok(r):.0f}"
            md.append(f"| {k[1]} | {_count(r['trainable_params'])} | {'-' if peak is None else f'{peak:.2f}'} | "
                      f"{ratio('peak_alloc_gb')} | {r['tokens_per_s']:.0f} | {ratio('tokens_per_s')} | "
                      f"{r['step_s'] * 1e3:.1f} | {_f(r.get('static_alloc_gb'))} | {_f(r.get('merge_s'), 3)} | "
                      f"{amort} |")
    return "\n".join(md)


def a_tok(r):
    """tokens/s with one merge every MERGE_INTERVAL steps."""
    return r["batch"] * r["seq"] / (r["step_s"] + r["merge_s"] / MERGE_INTERVAL)


def _count(n):
    if not n:
        return "-"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def target_checks(doc):
    idx = _index(doc["results"])
    rows = []
    sh = SHAPES[doc.get("meta", {}).get("shape") or "llama3-8b"]
    head_block = min(sh["blocks"])
    full = sorted({k[0] for k, r in idx.items() if r.get("full_depth")}) or [sh["full_layers"]]  # none ran: NOT RUN
    for layers in full:
        adam = idx.get((layers, "adamw"))
        blocks = {r["block"] for k, r in idx.items() if k[0] == layers and r.get("block")} | {head_block}
        for b in sorted(blocks):
            where = f"L={layers}, b={b}" + ("" if b == head_block else " (informational)")
            for what, cname, field, op, thr in TARGET_RULES:
                r = idx.get((layers, cname.format(b=b)))
                if r is None or adam is None:
                    rows.append((what, where, "n/a", f"{op} {thr}", "NOT RUN"))
                    continue
                if r.get("status") != "ok" or adam.get("status") != "ok":
                    bad = "POET-X" if r.get("status") != "ok" else "AdamW"
                    # an AdamW that does not fit passes a memory target by definition; anything else failed
                    res = "PASS" if (bad == "AdamW" and field == "peak_alloc_gb") else "MISS"
                    rows.append((what, where, f"{bad} OOM", f"{op} {thr}", res))
                    continue
                x, y = r.get(field), adam.get(field)
                if not (x and y):
                    rows.append((what, where, "n/a", f"{op} {thr}", "NOT RUN"))
                    continue
                v = x / y
                ok = v <= thr if op == "<=" else v >= thr
                rows.append((what, where, f"{v:.3f}", f"{op} {thr}", "PASS" if ok else "MISS"))
    md = ["| target | where | measured | threshold | result |", "|---|---|---|---|---|"]
    md += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n".join(md), rows


def paper_table(doc) -> str:
    idx = _index(doc["results"])
    full = [k[0] for k, r in idx.items() if r.get("full_depth")]
    if not full:
        return ""
    layers = max(full)
    adam = idx.get((layers, "adamw"))
    md = ["| config | paper peak (GB) | paper / AdamW | measured / AdamW | paper tokens/s | paper / AdamW | "
          "measured / AdamW |", "|---|---|---|---|---|---|---|"]
    for name, (pk, tok) in PAPER.items():
        r = idx.get((layers, name))
        ok = r and r.get("status") == "ok" and adam and adam.get("status") == "ok"
        mp = f"{r['peak_alloc_gb'] / adam['peak_alloc_gb']:.3f}x" if ok and r.get("peak_alloc_gb") else "-"
        mt = f"{r['tokens_per_s'] / adam['tokens_per_s']:.3f}x" if ok else "-"
        pt = f"{tok / PAPER['adamw'][1]:.3f}x" if tok else "-"
        md.append(f"| {name} | {pk} | {pk / PAPER['adamw'][0]:.3f}x | {mp} | {tok or '-'} | {pt} | {mt} |")
    return "\n".join(md)


def markdown(doc) -> str:
    m = doc.get("meta", {})
    r0 = next((r for r in doc["results"]), {})
    head = (f"Device: {r0.get('gpu') or r0.get('device', '?')}; versions {r0.get('versions')}; run {m.get('date')}, "
            f"total {m.get('total_s', 0):.0f} s.\n\n"
            f"{m.get('shape')} shapes, batch {m.get('batch')} x sequence {m.get('seq')}, random token ids, loss on "
            f"every token; bf16 weights, bf16 autocast, gradient checkpointing "
            f"{'on' if m.get('grad_ckpt') else 'off'}; "
            f"AdamW (fused on CUDA unless the name says foreach; moments in each parameter's dtype), lr {m.get('lr')}, "
            f"POET-X Q at {m.get('q_lr_scale')}x; median of {m.get('repeats')} steps after {m.get('warmup')} "
            f"warm-up; peak = max_memory_allocated over the timed steps; one process per config.\n")
    tc, rows = target_checks(doc)
    parts = [head, "### Summary", summary_table(doc), "\n### Targets\n", tc]
    n = {s: sum(r[4] == s for r in rows) for s in ("PASS", "MISS", "NOT RUN")}
    parts.append(f"\nTARGETS: {n['PASS']} PASS, {n['MISS']} MISS, {n['NOT RUN']} NOT RUN")
    pt = paper_table(doc)
    if pt:
        parts += ["\n### Against the paper's ratios (H100 80 GB, same model and step)\n", pt]
    if doc.get("skipped"):
        parts.append("\nSkipped (time budget): " + "; ".join(f"{s['name']} L={s['layers']}" for s in doc["skipped"]))
    if doc.get("errors"):
        parts.append("\nErrors: " + "; ".join(
            f"{e['name']} L={e['layers']}: {(e['error'].strip().splitlines() or [''])[-1][:200]}"
            for e in doc["errors"]))
    return "\n".join(parts) + "\n"


def plot(doc, png) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: matplotlib unavailable: {e})")
        return False
    idx = _index(doc["results"])
    depths = sorted({k[0] for k in idx}, reverse=True)
    if not depths:
        return False
    fig, axes = plt.subplots(len(depths), 2, figsize=(14, 3.8 * len(depths)), squeeze=False)
    colors = {"adamw": "#888888", "lora": "#9467bd", "poetx-fast": "#2ca02c", "poetx-mem": "#1f77b4",
              "poetx-int8": "#ff7f0e"}
    for di, layers in enumerate(depths):
        names = sorted((k[1] for k in idx if k[0] == layers), key=_order)
        adam = idx.get((layers, "adamw"))
        adam = adam if adam and adam.get("status") == "ok" else None
        for mi, (field, label) in enumerate((("peak_alloc_gb", "peak allocated (GB)"),
                                             ("tokens_per_s", "tokens/s"))):
            ax = axes[di][mi]
            for i, n in enumerate(names):
                r = idx[(layers, n)]
                col = next((v for k, v in colors.items() if n.startswith(k)), "#333333")
                if r.get("status") != "ok" or r.get(field) is None:
                    ax.text(i, 0, "OOM" if r.get("status") == "oom" else "n/a", ha="center", va="bottom", fontsize=8)
                    continue
                ax.bar(i, r[field], color=col, hatch="//" if "qbf16" in n or "-b512" in n else None)
                if adam and adam.get(field):
                    ax.text(i, r[field], f"{r[field] / adam[field]:.2f}x", ha="center", va="bottom", fontsize=7)
            if adam and adam.get(field):
                if field == "peak_alloc_gb":
                    for thr, ls in ((0.43, "--"), (0.37, ":")):
                        ax.axhline(adam[field] * thr, color="k", ls=ls, lw=0.8, label=f"{thr}x AdamW")
                else:
                    ax.axhline(adam[field] * 0.85, color="k", ls="--", lw=0.8, label="0.85x AdamW")
                ax.legend(fontsize=7, loc="upper right")
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
            ax.set_title(f"{doc.get('meta', {}).get('shape')} L={layers}: {label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def report(path, outdir=None):
    from _bench_io import load_docs

    doc = load_docs(path)[0]
    outdir = outdir or os.path.dirname(os.path.abspath(path))
    os.makedirs(outdir, exist_ok=True)
    md = markdown(doc)
    with open(os.path.join(outdir, "poetx_model_bench.md"), "w") as f:
        f.write(md)
    plot(doc, os.path.join(outdir, "poetx_model_bench.png"))
    print("\n" + md)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--report", help="tables + plot again from a poetx_model_bench.json")
    p.add_argument("--report-out", help="--report: folder for the md / png (default: the JSON's)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "poetx_model_bench"))
    p.add_argument("--plan", default="h200", choices=PLANS)
    p.add_argument("--configs", help="run only these configs of the plan (comma-separated names, e.g. "
                   "adamw,poetx-fast-b256)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the reduced-depth block")
    p.add_argument("--budget-s", type=float, default=460.0,
                   help="parent: launch no config expected to end after this many seconds")
    p.add_argument("--spawn", default="fork", choices=["fork", "exec"],
                   help="fork each worker from the parent (imports done once) or exec a fresh interpreter")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script, measures nothing)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--grad-ckpt", action="store_true", help="non-reentrant gradient checkpointing for every config")
    return p


def main():
    a = build_parser().parse_args()
    if a.tiny:
        a.shape, a.layers = "tiny", 1
        a.seq, a.warmup, a.repeats = min(a.seq, 32), min(a.warmup, 1), min(a.repeats, 2)
    if not a.worker and not a.report and a.device == "cuda":
        import shutil

        if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
            raise SystemExit("no CUDA device (use --tiny --device cpu to check the script)")
    from _bench_io import dispatch

    dispatch(a, report, run_worker, run_parent)


if __name__ == "__main__":
    main()
