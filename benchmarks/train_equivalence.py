#!/usr/bin/env python3
"""Training equivalence: fastdora DoRA vs stock PEFT DoRA, same init, same data order.

A randomly initialised Qwen3-style causal LM (default: hidden 1024, 12 layers, intermediate 2816, 16 heads / 8 KV,
head_dim 64, ~150M parameters; base frozen in bf16) with DoRA r=64 (rsLoRA, alpha 16) on all linear projections
(q,k,v,o,gate,up,down; adapters fp32) is trained under bf16 autocast with AdamW for --steps optimizer steps on real
text available offline: the CPython standard library's .py files (sysconfig stdlib dir), tokenised as raw bytes
(byte 0 separates files; vocab padded to 384). Every 20th file (sorted by path) is held out for evaluation.

Per seed, both variants get the same base init and adapter init (built on the CPU from the seed, checksummed), the
same batches (sampled from a CPU generator seeded by the seed) and deterministic kernels
(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG), so any difference comes from the implementation.

Reports per seed: mean / max per-step |loss_fastdora - loss_peft| (target mean <= 1e-3), final held-out eval loss
difference (target <= 5e-4), and, for scale, the seed-to-seed difference of the same variant. Writes
train_equivalence.json and train_equivalence.png.

Usage:
  python benchmarks/train_equivalence.py --out DIR                     # 2 seeds x 2 variants, in parallel processes
  python benchmarks/train_equivalence.py --tiny --device cpu --out /tmp/te   # CPU smoke test
  python benchmarks/train_equivalence.py --report DIR/train_equivalence.json
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 384


def load_corpus(max_bytes=None):
    """(train_bytes, eval_bytes) from the stdlib's .py files; every 20th sorted file held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f and "dist-packages" not in f)
    if sum(os.path.getsize(f) for f in files[:2000]) < 5_000_000:  # stripped stdlib: add installed packages' source
        root = root + " + " + sysconfig.get_paths()["purelib"]
        files += sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "**", "*.py"), recursive=True))
    train, held = bytearray(), bytearray()
    for i, fn in enumerate(files):
        try:
            with open(fn, "rb") as f:
                data = f.read()
        except OSError:
            continue
        dst = held if i % 20 == 0 else train
        dst += data
        dst.append(0)  # document separator: NUL never occurs in source files
        if max_bytes and len(train) > max_bytes and len(held) > max_bytes // 20:
            break
    return root, len(files), bytes(train), bytes(held)


def to_ids(b, torch):
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)  # uint8; widened per batch


def run_worker(a):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    t_start = time.perf_counter()
    dev = torch.device(a.device)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False

    root, nfiles, train_b, held_b = load_corpus(a.max_corpus_bytes)
    train = to_ids(train_b, torch)
    held = to_ids(held_b, torch)

    # init (CPU, seeded: identical across variants and processes)
    torch.manual_seed(a.seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.hidden // a.heads, max_position_embeddings=max(a.seq, 512),
                      tie_word_embeddings=False, use_cache=False, rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    n_base = sum(p.numel() for p in model.parameters())
    lcfg = LoraConfig(r=a.rank, lora_alpha=16, use_rslora=True, use_dora=True, target_modules=TARGETS,
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg)  # adapters fp32 (autocast_adapter_dtype=True)
    model.to(dev)
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        if p.requires_grad:
            h.update(n.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    init_hash = h.hexdigest()[:16]
    report = None
    if a.variant == "fastdora":
        try:
            import fastdora
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"variant fastdora needs `import fastdora` (pip install -e . from the repo root): {e!r}")
        if not hasattr(fastdora, "enable"):
            raise RuntimeError("fastdora has no enable() yet")
        report = str(fastdora.enable(model, **({"kernels": a.kernels} if a.kernels else {})))
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)

    def lr_at(step):
        if step < a.warmup_steps:
            return a.lr * (step + 1) / a.warmup_steps
        prog = (step - a.warmup_steps) / max(1, a.steps - a.warmup_steps)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))

    g = torch.Generator().manual_seed(10_000 + a.seed)
    starts = torch.randint(0, train.numel() - a.seq - 1, (a.steps, a.batch), generator=g)
    ar = torch.arange(a.seq + 1)
    n_eval = min(a.eval_batches * a.batch, (held.numel() - 1) // (a.seq + 1))
    ev = held[: n_eval * (a.seq + 1)].view(n_eval, a.seq + 1).long()

    def fwd_loss(x):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    def evaluate():
        model.eval()
        tot = torch.zeros((), device=dev, dtype=torch.float64)
        with torch.no_grad():
            for i in range(0, n_eval, a.batch):
                x = ev[i:i + a.batch].to(dev)
                tot += fwd_loss(x).double() * x.shape[0]
        model.train()
        return float(tot / n_eval)

    losses = torch.zeros(a.steps, device=dev, dtype=torch.float32)
    gnorms = torch.zeros(a.steps, device=dev, dtype=torch.float32)
    evals = []
    model.train()
    t0 = time.perf_counter()
    steps_done = a.steps
    for step in range(a.steps):
        if a.max_train_s and step % 50 == 0 and time.perf_counter() - t0 > a.max_train_s:
            steps_done = step  # out of time: keep what ran (reported as truncated)
            break
        x = train[starts[step].unsqueeze(1) + ar].to(dev, non_blocking=True).long()
        loss = fwd_loss(x)
        loss.backward()
        gnorms[step] = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
        if a.eval_every and (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
            evals.append((step + 1, evaluate()))
    final_eval = evaluate()
    evals.append((steps_done, final_eval))
    losses, gnorms = losses[:steps_done], gnorms[:steps_done]
    train_s = time.perf_counter() - t0
    counter = None
    try:
        import fastdora.layers as L
        counter = dict(L.active_path_counter)
    except Exception:  # noqa: BLE001
        pass
    rec = dict(variant=a.variant, seed=a.seed, steps=steps_done, steps_planned=a.steps,
               truncated=steps_done < a.steps, batch=a.batch, seq=a.seq, lr=a.lr, rank=a.rank,
               layers=a.layers, hidden=a.hidden, base_params=n_base, trainable_params=n_train, init_hash=init_hash,
               corpus=dict(root=root, files=nfiles, train_bytes=train.numel(), eval_bytes=held.numel(),
                           eval_tokens=n_eval * a.seq),
               losses=losses.tolist(), grad_norms=gnorms.tolist(), evals=evals, final_eval_loss=final_eval,
               train_s=train_s, total_s=time.perf_counter() - t_start, enable_report=report,
               path_counter=counter, device=str(dev),
               gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
               versions=dict(torch=torch.__version__, peft=__import__("peft").__version__,
                             transformers=__import__("transformers").__version__))
    with open(a.result, "w") as f:
        json.dump(rec, f)


def run_parent(a):
    os.makedirs(a.out, exist_ok=True)
    wdir = os.path.join(a.out, "te_workers")
    os.makedirs(wdir, exist_ok=True)
    jobs = [(s, v) for s in a.seeds for v in ("peft", "fastdora")]
    base = [sys.executable, os.path.abspath(__file__), "--worker"]
    passthru = ["--device", a.device, "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
                "--lr", str(a.lr), "--rank", str(a.rank), "--layers", str(a.layers), "--hidden", str(a.hidden),
                "--intermediate", str(a.intermediate), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
                "--eval-batches", str(a.eval_batches), "--eval-every", str(a.eval_every),
                "--warmup-steps", str(a.warmup_steps), "--max-train-s", str(a.max_train_s),
                "--threads", str(a.threads)]
    if a.max_corpus_bytes:
        passthru += ["--max-corpus-bytes", str(a.max_corpus_bytes)]
    if a.kernels:
        passthru += ["--kernels", a.kernels]
    t0 = time.perf_counter()
    running, results, errors = [], {}, []
    queue = list(jobs)
    while queue or running:
        while queue and len(running) < a.parallel:
            s, v = queue.pop(0)
            res = os.path.join(wdir, f"seed{s}_{v}.json")
            if os.path.exists(res):
                os.remove(res)
            log = open(os.path.join(wdir, f"seed{s}_{v}.log"), "w")
            p = subprocess.Popen(base + passthru + ["--seed", str(s), "--variant", v, "--result", res],
                                 stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            running.append((s, v, res, p, log))
        time.sleep(0.5)
        for item in list(running):
            s, v, res, p, log = item
            if p.poll() is None:
                if time.perf_counter() - t0 > a.timeout_s:
                    p.kill()
                    p.wait()
                else:
                    continue
            running.remove(item)
            log.close()
            if p.returncode == 0 and os.path.exists(res):
                with open(res) as f:
                    results[(s, v)] = json.load(f)
                r = results[(s, v)]
                print(f"[{time.perf_counter() - t0:6.1f}s] seed {s} {v}: final eval {r['final_eval_loss']:.5f}, "
                      f"last loss {r['losses'][-1]:.4f}, train {r['train_s']:.1f}s", flush=True)
            else:
                with open(os.path.join(wdir, f"seed{s}_{v}.log")) as f:
                    tail = f.read()[-3000:]
                errors.append(dict(seed=s, variant=v, rc=p.returncode, log_tail=tail))
                print(f"[{time.perf_counter() - t0:6.1f}s] seed {s} {v}: FAILED rc={p.returncode}\n{tail}",
                      flush=True)
    doc = dict(meta=dict(argv=sys.argv, total_s=time.perf_counter() - t0, parallel=a.parallel,
                         date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())),
               runs=[results[k] for k in sorted(results)], errors=errors)
    path = os.path.join(a.out, "train_equivalence.json")
    summarize(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    report(path, a.out)


def summarize(doc):
    runs = {(r["seed"], r["variant"]): r for r in doc["runs"]}
    seeds = sorted({s for s, _ in runs})
    summ = []
    for s in seeds:
        p, f = runs.get((s, "peft")), runs.get((s, "fastdora"))
        if not (p and f):
            continue
        d = [abs(x - y) for x, y in zip(p["losses"], f["losses"])]  # common prefix of steps
        pe, fe = dict((int(k), v) for k, v in p["evals"]), dict((int(k), v) for k, v in f["evals"])
        common = sorted(set(pe) & set(fe))
        cstep = common[-1] if common else None
        summ.append(dict(seed=s, same_init=p["init_hash"] == f["init_hash"], steps=len(d),
                         eval_step=cstep, eval_peft=pe.get(cstep), eval_fastdora=fe.get(cstep),
                         same_steps=(p["steps"] == f["steps"] and not p.get("truncated") and not f.get("truncated")),
                         mean_abs_step_loss_diff=sum(d) / len(d), max_abs_step_loss_diff=max(d),
                         mean_abs_step_loss_diff_last100=sum(d[-100:]) / len(d[-100:]),
                         final_eval_peft=pe.get(cstep, float("nan")), final_eval_fastdora=fe.get(cstep, float("nan")),
                         final_eval_abs_diff=(abs(pe[cstep] - fe[cstep]) if cstep else float("nan")),
                         first_step_loss_diff=d[0],
                         train_s_peft=p["train_s"], train_s_fastdora=f["train_s"]))
    ctrl = None
    if len(seeds) >= 2 and (seeds[0], "peft") in runs and (seeds[1], "peft") in runs:
        a, b = runs[(seeds[0], "peft")], runs[(seeds[1], "peft")]
        d = [abs(x - y) for x, y in zip(a["losses"], b["losses"])]
        ctrl = dict(what="PEFT DoRA seed-to-seed (different init and data order)",
                    mean_abs_step_loss_diff=sum(d) / len(d),
                    final_eval_abs_diff=abs(a["final_eval_loss"] - b["final_eval_loss"]))
    doc["summary"] = summ
    doc["seed_to_seed_control"] = ctrl
    return doc


def report(path, outdir=None):
    """Markdown + plot from one train_equivalence.json, or from several (``a.json,b.json``: e.g. one parent per GPU,
    one seed each), merged into ``outdir/train_equivalence.json``."""
    from _bench_io import load_docs

    paths = path.split(",")
    docs = load_docs(path)
    doc = docs[0]
    outdir = outdir or os.path.dirname(os.path.abspath(paths[0]))
    os.makedirs(outdir, exist_ok=True)
    if len(docs) > 1:
        doc = dict(meta=dict(docs[0].get("meta", {}), merged_from=[d.get("meta") for d in docs]),
                   runs=sorted((r for d in docs for r in d["runs"]), key=lambda r: (r["seed"], r["variant"])),
                   errors=[e for d in docs for e in d.get("errors", [])])
        summarize(doc)
        with open(os.path.join(outdir, "train_equivalence.json"), "w") as f:
            json.dump(doc, f)
    if "summary" not in doc:
        summarize(doc)
    r0 = doc["runs"][0] if doc["runs"] else {}
    lines = []
    if r0:
        lines.append(f"Device: {r0.get('gpu') or r0.get('device')}; versions {r0.get('versions')}; model: Qwen3-style, "
                     f"hidden {r0['hidden']}, {r0['layers']} layers, {r0['base_params'] / 1e6:.0f}M base params (bf16, "
                     f"frozen), DoRA r={r0['rank']} on q,k,v,o,gate,up,down ({r0['trainable_params'] / 1e6:.1f}M "
                     f"trainable, fp32), bf16 autocast, AdamW lr {r0['lr']} (warmup + cosine), grad clip 1.0, "
                     f"{r0['steps']} steps x {r0['batch']} x {r0['seq']} byte tokens; corpus: "
                     f"{r0['corpus']['files']} stdlib .py files ({r0['corpus']['train_bytes'] / 1e6:.1f} MB train, "
                     f"{r0['corpus']['eval_tokens']} held-out eval tokens).\n")
    lines.append("| seed | same init | steps (both) | mean abs step-loss diff | max | mean last 100 | eval step | "
                 "eval PEFT | eval fastdora | abs diff | mean diff <= 1e-3 | eval diff <= 5e-4 |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok_all = True
    for s in doc["summary"]:
        m_ok = s["mean_abs_step_loss_diff"] <= 1e-3
        e_ok = s["final_eval_abs_diff"] <= 5e-4
        ok_all &= m_ok and e_ok and s["same_init"] and s.get("same_steps", True) and s["steps"] >= 1000
        lines.append(f"| {s['seed']} | {s['same_init']} | {s['steps']} | {s['mean_abs_step_loss_diff']:.2e} | "
                     f"{s['max_abs_step_loss_diff']:.2e} | {s['mean_abs_step_loss_diff_last100']:.2e} | "
                     f"{s.get('eval_step')} | "
                     f"{s['final_eval_peft']:.5f} | {s['final_eval_fastdora']:.5f} | {s['final_eval_abs_diff']:.2e} | "
                     f"{'PASS' if m_ok else 'MISS'} | {'PASS' if e_ok else 'MISS'} |")
    c = doc.get("seed_to_seed_control")
    if c:
        lines.append(f"\nFor scale, {c['what']}: mean abs step-loss diff {c['mean_abs_step_loss_diff']:.2e}, "
                     f"final eval diff {c['final_eval_abs_diff']:.2e}.")
    for r in doc["runs"]:
        if r["variant"] == "fastdora":
            peft_s = next((q["train_s"] for q in doc["runs"] if q["seed"] == r["seed"] and q["variant"] == "peft"),
                          float("nan"))
            lines.append(f"\nfastdora seed {r['seed']}: enable report {r.get('enable_report')}; paths "
                         f"{r.get('path_counter')}; train {r['train_s']:.1f}s vs PEFT {peft_s:.1f}s")
    if doc.get("errors"):
        lines.append("\nErrors: " + "; ".join(f"seed {e['seed']} {e['variant']} rc={e['rc']}" for e in doc["errors"]))
        ok_all = False
    lines.append(f"\nTRAIN EQUIVALENCE: {'PASS' if ok_all and doc['summary'] else 'MISS'}")
    md = "\n".join(lines)
    with open(os.path.join(outdir, "train_equivalence.md"), "w") as f:
        f.write(md + "\n")
    plot(doc, os.path.join(outdir, "train_equivalence.png"))
    print("\n" + md)


def plot(doc, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: matplotlib unavailable: {e})")
        return
    runs = {(r["seed"], r["variant"]): r for r in doc["runs"]}
    seeds = sorted({s for s, _ in runs})
    if not seeds:
        return
    fig, axes = plt.subplots(2, len(seeds), figsize=(6.5 * len(seeds), 7), squeeze=False)

    def smooth(xs, k=20):
        out, acc = [], 0.0
        for i, x in enumerate(xs):
            acc += x
            if i >= k:
                acc -= xs[i - k]
            out.append(acc / min(i + 1, k))
        return out
    for j, s in enumerate(seeds):
        ax = axes[0][j]
        for v, col in (("peft", "#d62728"), ("fastdora", "#2ca02c")):
            r = runs.get((s, v))
            if r:
                ax.plot(smooth(r["losses"]), color=col, lw=1, label=f"{v} train (20-step mean)")
                ev = r["evals"]
                ax.plot([e[0] for e in ev], [e[1] for e in ev], "o--", color=col, ms=4, label=f"{v} held-out eval")
        ax.set_title(f"seed {s}: loss")
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        p, f = runs.get((s, "peft")), runs.get((s, "fastdora"))
        if p and f:
            d = [abs(x - y) for x, y in zip(p["losses"], f["losses"])]
            ax.semilogy([max(x, 1e-9) for x in d], lw=0.6, color="#555555", label="|loss diff| per step")
            ax.axhline(1e-3, color="r", ls=":", label="1e-3")
            ax.legend(fontsize=8)
        ax.set_title(f"seed {s}: |loss_fastdora - loss_peft|")
        ax.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--report", help="markdown + plot from a train_equivalence.json (or several, comma-separated)")
    p.add_argument("--report-out", help="--report: folder for the merged json / md / png")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, 20 steps")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", default="fastdora", choices=["peft", "fastdora"])
    p.add_argument("--kernels", default=None, help="fastdora kernels option (default: fastdora's auto)")
    p.add_argument("--result")
    p.add_argument("--parallel", type=int, default=4, help="concurrent runs (processes)")
    p.add_argument("--timeout-s", type=float, default=420.0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--max-corpus-bytes", type=int, default=0)
    p.add_argument("--max-train-s", type=float, default=170.0, help="worker stops (truncated) after this")
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    if a.tiny:
        a.steps, a.batch, a.seq, a.layers, a.hidden, a.intermediate = 20, 2, 32, 2, 64, 128
        a.heads, a.kv_heads, a.rank, a.eval_batches, a.eval_every = 4, 2, 8, 2, 10
        a.warmup_steps, a.max_corpus_bytes, a.parallel = 5, 2_000_000, 2
    from _bench_io import dispatch

    dispatch(a, report, run_worker, run_parent)


if __name__ == "__main__":
    main()
