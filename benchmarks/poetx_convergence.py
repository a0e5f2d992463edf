#!/usr/bin/env python3
"""POET-X convergence: a small Llama pre-trained from scratch with AdamW, with fastdora's POET-X and with the
plain-PyTorch POET-X of ``_poetx_plain.py``, same init, same batches, the three runs at once on one GPU.

The model: a Llama (default hidden 1024, 4 layers, intermediate 2816, 16 heads / 4 KV heads, head_dim 64, vocabulary
384: raw bytes; 45.9M parameters; shallow and wide because a step at this size is bound by kernel launches, which grow
with the layers, not by arithmetic), random init from the seed (on the CPU, identical in every process), fp32 weights,
bf16 autocast. The corpus: the Python standard library's source as bytes (``train_equivalence.load_corpus``, every
20th file held out for evaluation). Each optimizer step: 32 sequences of 256 byte tokens sampled from a CPU generator
seeded by the seed (the same batches for every run), loss on every token, grad-norm clip 1.0, AdamW (betas 0.9 / 0.95,
no weight decay, fused on CUDA), lr 1e-3 with 100 warm-up steps and a cosine to 10%.

Runs (one process each):
  adamw   every parameter trained by AdamW (transformers' init).
  poetx   fastdora's POET-X (``poetx.convert(..., from_scratch_normalize=True)``: each weight row scaled to unit norm,
          the normalised start the method trains from; block 128, fast mode) on every decoder linear layer, lm_head
          excluded; the paper's recipe: Q by AdamW at 0.5x the learning rate, the embeddings, norms and lm_head by
          AdamW at the base rate; every 200 steps ``poetx.merge(model)`` and the optimizer state of Q reset.
  plain   the same with ``_poetx_plain`` (the same normalised weights, permutations and merges; the block products in
          fp32 as fastdora computes them): the two POET-X curves should differ only by rounding.

Deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG); held-out eval loss every 200
steps (after that step's merge) and at the end. Reports per run the final and minimum eval loss and the time; POET-X
against the plain version: the same init (checksum of the parameters, whose names match), the first step's loss
difference, the mean and max per-step |loss difference| over the curve and before the first merge, the eval-loss
differences; against AdamW, where POET-X stands. Writes poetx_convergence.{json,md,png}; each worker rewrites its
partial result at every eval, so a run stopped from outside keeps its curves.

Usage:
  python benchmarks/poetx_convergence.py --out DIR [--steps 2000] [--max-train-s 400]   # the three runs at once
  python benchmarks/poetx_convergence.py --report DIR/poetx_convergence.json             # tables + plot again
  python benchmarks/poetx_convergence.py --tiny --device cpu --out /tmp/pxc               # CPU smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VOCAB = 384
VARIANTS = ["adamw", "poetx", "plain"]
LABEL = {"adamw": "AdamW", "poetx": "fastdora POET-X", "plain": "plain-PyTorch POET-X"}
COLOR = {"adamw": "#888888", "poetx": "#2ca02c", "plain": "#1f77b4"}
# fastdora's POET-X vs the plain version, "equal within bf16 tolerance": bf16 keeps 8 significant bits (2^-8 = 3.9e-3
# relative, ~5e-3 of a loss near 1.3 nats). The first step sees the same weights and batch: only the forward's
# rounding differs. Over the curve, rounding differences grow through training (each step's update depends on the
# previous ones) but stay far below a change of data order (see --control).
TOL = dict(first_step=2e-3, mean_step=5e-3, final_eval=5e-3)


def lr_factor(step, warmup, steps):
    if step < warmup:
        return (step + 1) / warmup
    prog = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog))


def build_model(a, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.hidden // a.heads, max_position_embeddings=max(a.seq, 512), rms_norm_eps=1e-6,
                      tie_word_embeddings=False, use_cache=False, attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(a.seed)
    return LlamaForCausalLM(cfg)  # fp32, on the CPU: the same init in every process


def run_worker(a):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.nn.functional as F

    from train_equivalence import load_corpus, to_ids

    t_start = time.perf_counter()
    dev = torch.device(a.device)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False

    root, nfiles, train_b, held_b = load_corpus(a.max_corpus_bytes)
    train, held = to_ids(train_b, torch), to_ids(held_b, torch)

    model = build_model(a, torch)
    n_params = sum(p.numel() for p in model.parameters())
    convert_info, q_params, layout = None, [], {}
    if a.variant == "poetx":
        from fastdora import poetx
        from fastdora.poetx import PoetXLinear

        rep = poetx.convert(model, block_size=a.block, merge_interval=a.merge_interval, mode=a.mode,
                            exclude=("lm_head",), seed=a.seed, from_scratch_normalize=True)
        convert_info = dict(converted=len(rep.converted), skipped=dict(rep.skipped), q_values=rep.trainable_parameters)
        q_params = [p for m in model.modules() if isinstance(m, PoetXLinear) for p in (m.q_in, m.q_out)]
        # fastdora stores a POET-X weight in its permutations' frame, W'[i, j] = W[perm_out[i], perm_in[j]]
        layout = {f"{n}.weight": m.weight[torch.argsort(m.perm_out)][:, torch.argsort(m.perm_in)]
                  for n, m in model.named_modules() if isinstance(m, PoetXLinear)}

        def merge():
            return poetx.merge(model)
    elif a.variant == "plain":
        import _poetx_plain as plain

        names = plain.convert(model, a.block, exclude=("lm_head",), seed=a.seed, normalize=True, promote=True)
        q_params = plain.q_parameters(model)
        convert_info = dict(converted=len(names), skipped={}, q_values=sum(p.numel() for p in q_params))

        def merge():
            return plain.merge(model)
    model.to(dev)
    # the parameters by name (POET-X and the plain version name theirs alike), each weight in the model's layout
    h = hashlib.sha256()
    for n, p in sorted(model.named_parameters()):
        h.update(n.encode())
        h.update(layout.get(n, p).detach().float().cpu().numpy().tobytes())
    init_hash = h.hexdigest()[:16]
    qid = {id(p) for p in q_params}
    base = [p for p in model.parameters() if p.requires_grad and id(p) not in qid]
    groups = [dict(params=base, lr=a.lr, base_lr=a.lr)]
    if q_params:
        groups.append(dict(params=q_params, lr=a.lr * a.q_lr_scale, base_lr=a.lr * a.q_lr_scale))
    trainable = [p for g in groups for p in g["params"]]
    kw = dict(fused=True) if dev.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **kw)

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
    evals, merges = [], []
    rec = dict(variant=a.variant, seed=a.seed, steps_planned=a.steps, batch=a.batch, seq=a.seq, lr=a.lr,
               q_lr_scale=a.q_lr_scale if q_params else None, block=a.block if q_params else None,
               mode=a.mode if a.variant == "poetx" else None, merge_interval=a.merge_interval if q_params else None,
               layers=a.layers, hidden=a.hidden, intermediate=a.intermediate, heads=a.heads, kv_heads=a.kv_heads,
               params=n_params, trainable_params=sum(p.numel() for p in trainable),
               q_params=sum(p.numel() for p in q_params), init_hash=init_hash, convert=convert_info,
               corpus=dict(root=root, files=nfiles, train_bytes=train.numel(), eval_bytes=held.numel(),
                           eval_tokens=n_eval * a.seq),
               device=str(dev), gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
               versions=dict(torch=torch.__version__, transformers=__import__("transformers").__version__))

    def write(steps_done, done):
        rec.update(steps=steps_done, truncated=steps_done < a.steps, finished=done,
                   losses=losses[:steps_done].tolist(), grad_norms=gnorms[:steps_done].tolist(), evals=list(evals),
                   merges_at=list(merges), train_s=time.perf_counter() - t0, total_s=time.perf_counter() - t_start)
        if evals:
            rec["final_eval_loss"] = evals[-1][1]
            rec["min_eval_loss"] = min(e[1] for e in evals)
        with open(a.result + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(a.result + ".tmp", a.result)

    model.train()
    t0 = time.perf_counter()
    steps_done = a.steps
    for step in range(a.steps):
        if a.max_train_s and step % 25 == 0 and time.perf_counter() - t0 > a.max_train_s:
            steps_done = step  # out of time: keep what ran (reported as truncated)
            break
        x = train[starts[step].unsqueeze(1) + ar].to(dev, non_blocking=True).long()
        loss = fwd_loss(x)
        loss.backward()
        gnorms[step] = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        f = lr_factor(step, a.warmup_steps, a.steps)
        for grp in opt.param_groups:
            grp["lr"] = grp["base_lr"] * f
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
        if q_params and (step + 1) % a.merge_interval == 0:
            merge()
            for p in q_params:  # the moments of Q describe the old factors
                opt.state.pop(p, None)
            merges.append(step + 1)
        if a.eval_every and (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
            evals.append((step + 1, evaluate()))
            write(step + 1, False)
    if not evals or evals[-1][0] != steps_done:
        evals.append((steps_done, evaluate()))
    write(steps_done, True)


# ----------------------------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------------------------

def worker_argv(a, variant, seed, result):
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--seed", str(seed),
            "--result", result]
    for k in ("device", "steps", "batch", "seq", "lr", "q_lr_scale", "warmup_steps", "block", "merge_interval", "mode",
              "layers", "hidden", "intermediate", "heads", "kv_heads", "eval_batches", "eval_every", "max_train_s",
              "threads", "max_corpus_bytes"):
        argv += ["--" + k.replace("_", "-"), str(getattr(a, k))]
    return argv


def run_parent(a):
    os.makedirs(a.out, exist_ok=True)
    wdir = os.path.join(a.out, "workers")
    os.makedirs(wdir, exist_ok=True)
    jobs = [(v, a.seed) for v in a.variants.split(",")]
    if a.control:  # the same POET-X with another data order / init: the scale of a difference that matters
        jobs.append(("poetx", a.seed + 1))
    t0 = time.perf_counter()
    meta = dict(argv=sys.argv, parallel=a.parallel, timeout_s=a.timeout_s, max_train_s=a.max_train_s, tol=TOL,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    results, errors = {}, []

    def save():
        meta["total_s"] = time.perf_counter() - t0
        doc = dict(meta=meta, runs=[results[k] for k in sorted(results, key=lambda k: (k[1], VARIANTS.index(k[0])))],
                   errors=errors)
        summarize(doc, a.seed)
        path = os.path.join(a.out, "poetx_convergence.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)
        return path

    running, queue = [], list(jobs)
    while queue or running:
        while queue and len(running) < a.parallel:
            v, s = queue.pop(0)
            res = os.path.join(wdir, f"{v}_seed{s}.json")
            if os.path.exists(res):
                os.remove(res)
            log = open(os.path.join(wdir, f"{v}_seed{s}.log"), "w")
            p = subprocess.Popen(worker_argv(a, v, s, res), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            running.append((v, s, res, p, log))
        time.sleep(0.5)
        for item in list(running):
            v, s, res, p, log = item
            killed = False
            if p.poll() is None:
                if time.perf_counter() - t0 > a.timeout_s:
                    p.kill()
                    p.wait()
                    killed = True
                else:
                    continue
            running.remove(item)
            log.close()
            if os.path.exists(res):  # finished, or the partial curves of a run stopped early
                with open(res) as f:
                    r = json.load(f)
                r["killed"] = killed or p.returncode != 0
                results[(v, s)] = r
                print(f"[{time.perf_counter() - t0:6.1f}s] {v} seed {s}: {r['steps']} steps"
                      f"{' (partial)' if not r.get('finished') else ''}, final eval {r.get('final_eval_loss', 0):.4f}, "
                      f"train {r['train_s']:.1f}s", flush=True)
            if p.returncode != 0 or not os.path.exists(res):
                with open(os.path.join(wdir, f"{v}_seed{s}.log"), errors="replace") as f:
                    tail = f.read()[-3000:]
                errors.append(dict(variant=v, seed=s, rc=p.returncode, killed=killed, log_tail=tail))
                print(f"[{time.perf_counter() - t0:6.1f}s] {v} seed {s}: FAILED rc={p.returncode}\n{tail}", flush=True)
            save()
    report(save(), a.out)


# ----------------------------------------------------------------------------------------------------------------
# summary, report, plot
# ----------------------------------------------------------------------------------------------------------------

def _diffs(x, y):
    return [abs(p - q) for p, q in zip(x["losses"], y["losses"])]


def summarize(doc, seed=None):
    runs = {(r["variant"], r["seed"]): r for r in doc["runs"]}
    seed = min((s for _, s in runs), default=0) if seed is None else seed
    summ = dict(seed=seed, runs={})
    for (v, s), r in runs.items():
        if s == seed:
            summ["runs"][v] = dict(steps=r["steps"], truncated=r.get("truncated"), finished=r.get("finished"),
                                   final_eval=r.get("final_eval_loss"), min_eval=r.get("min_eval_loss"),
                                   first_loss=r["losses"][0] if r["losses"] else None, train_s=r["train_s"],
                                   steps_per_s=r["steps"] / r["train_s"] if r["train_s"] else None,
                                   merges=len(r.get("merges_at", [])))
    px, pl, ad = runs.get(("poetx", seed)), runs.get(("plain", seed)), runs.get(("adamw", seed))
    if px and pl and px["losses"] and pl["losses"]:
        d = _diffs(px, pl)
        first_merge = px.get("merge_interval") or len(d)
        pe, qe = dict((int(k), v) for k, v in px["evals"]), dict((int(k), v) for k, v in pl["evals"])
        common = sorted(set(pe) & set(qe))
        ed = [abs(pe[k] - qe[k]) for k in common]
        summ["poetx_vs_plain"] = dict(
            same_init=px["init_hash"] == pl["init_hash"], steps=len(d), first_step=d[0],
            max_before_first_merge=max(d[:first_merge]), mean=sum(d) / len(d), max=max(d),
            mean_last100=sum(d[-100:]) / len(d[-100:]), eval_step=common[-1] if common else None,
            final_eval_diff=ed[-1] if ed else None, max_eval_diff=max(ed) if ed else None)
    if px and ad and px.get("final_eval_loss") is not None and ad.get("final_eval_loss") is not None:
        pe, ae = dict((int(k), v) for k, v in px["evals"]), dict((int(k), v) for k, v in ad["evals"])
        common = sorted(set(pe) & set(ae))
        k = common[-1] if common else None
        summ["poetx_vs_adamw"] = dict(eval_step=k, poetx=pe.get(k), adamw=ae.get(k),
                                      diff=(pe[k] - ae[k]) if common else None,
                                      min_poetx=px.get("min_eval_loss"), min_adamw=ad.get("min_eval_loss"))
    ctrl = runs.get(("poetx", seed + 1))
    if px and ctrl:
        d = _diffs(px, ctrl)
        summ["control"] = dict(what="fastdora POET-X, seed vs seed + 1 (init, permutations and data order)",
                               mean=sum(d) / len(d),
                               final_eval_diff=abs(px.get("final_eval_loss", 0) - ctrl.get("final_eval_loss", 0)))
    doc["summary"] = summ
    return summ


def markdown(doc):
    s = doc.get("summary") or summarize(doc)
    r0 = next((r for r in doc["runs"]), None)
    lines = []
    if r0:
        c = r0["corpus"]
        lines.append(
            f"Device: {r0.get('gpu') or r0.get('device')}; versions {r0.get('versions')}; model: Llama, hidden "
            f"{r0['hidden']}, {r0['layers']} layers, intermediate {r0['intermediate']}, {r0['heads']} heads / "
            f"{r0['kv_heads']} KV, {r0['params'] / 1e6:.1f}M parameters, byte vocabulary {VOCAB}; fp32 weights, "
            f"bf16 autocast; {r0['steps_planned']} steps x {r0['batch']} x {r0['seq']} tokens; AdamW lr {r0['lr']} "
            f"(warm-up + cosine to 10%), grad clip 1.0; corpus {c['files']} stdlib .py files "
            f"({c['train_bytes'] / 1e6:.1f} MB train, {c['eval_tokens']} held-out eval tokens).\n")
    poet = next((r for r in doc["runs"] if r["variant"] in ("poetx", "plain")), None)
    if poet:
        rest = (poet["trainable_params"] - poet["q_params"]) / 1e6
        lines.append(f"POET-X: b={poet['block']}, merge every {poet['merge_interval']} steps, Q lr "
                     f"{poet['q_lr_scale']}x, rows normalised at conversion, lm_head excluded; "
                     f"{poet['q_params'] / 1e6:.1f}M Q values + {rest:.2f}M embedding / norm / lm_head parameters "
                     f"trained.\n")
    lines.append("Runs in parallel processes on one device: train time and steps/s are not a speed comparison.\n")
    lines.append("| run | steps | merges | final eval loss | min eval loss | first step loss | train (s) | steps/s |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        r = s["runs"].get(v)
        if not r:
            continue

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        lines.append(f"| {LABEL[v]} | {r['steps']}{' (truncated)' if r['truncated'] else ''} | {r['merges']} | "
                     f"{f(r['final_eval'], '.4f')} | {f(r['min_eval'], '.4f')} | {f(r['first_loss'], '.4f')} | "
                     f"{r['train_s']:.0f} | {f(r['steps_per_s'], '.1f')} |")
    ok = None
    pv = s.get("poetx_vs_plain")
    if pv:
        checks = [("same init (parameter checksum)", pv["same_init"], None, "True"),
                  ("first step \\|loss diff\\|", pv["first_step"], TOL["first_step"], None),
                  ("mean \\|step-loss diff\\| over the curve", pv["mean"], TOL["mean_step"], None),
                  (f"eval \\|loss diff\\| at step {pv['eval_step']}", pv["final_eval_diff"], TOL["final_eval"], None)]
        lines.append("\n**fastdora POET-X vs plain-PyTorch POET-X** (bf16 tolerance)\n")
        lines.append("| check | measured | threshold | result |")
        lines.append("|---|---|---|---|")
        ok = True
        for what, val, thr, want in checks:
            if thr is None:
                good = bool(val)
                shown = str(val)
            else:
                good = val is not None and val <= thr
                shown = "-" if val is None else f"{val:.2e}"
            ok &= good
            lines.append(f"| {what} | {shown} | {want or f'<= {thr:g}'} | {'PASS' if good else 'MISS'} |")
        med = "-" if pv["max_eval_diff"] is None else f"{pv['max_eval_diff']:.2e}"
        lines.append(f"\nAlso: max |step-loss diff| {pv['max']:.2e} over {pv['steps']} steps "
                     f"({pv['max_before_first_merge']:.2e} before the first merge), mean over the last 100 steps "
                     f"{pv['mean_last100']:.2e}, max eval diff {med}.")
        steps_ok = min(s["runs"]["poetx"]["steps"], s["runs"]["plain"]["steps"]) >= 2000
        if not steps_ok:
            lines.append("\nFewer than 2000 steps ran (truncated or a short run): the curves are not the full "
                         "comparison.")
        ok &= steps_ok
        lines.append(f"\nPOET-X EQUALS PLAIN: {'PASS' if ok else 'MISS'}")
    c = s.get("control")
    if c:
        lines.append(f"\nFor scale, {c['what']}: mean |step-loss diff| {c['mean']:.2e}, final eval diff "
                     f"{c['final_eval_diff']:.2e}.")
    pa = s.get("poetx_vs_adamw")
    if pa and pa["eval_step"]:
        rel = pa["diff"] / pa["adamw"] if pa["adamw"] else float("nan")
        where = "below" if pa["diff"] < 0 else "above"
        lines.append(f"\n**Against AdamW** (eval at step {pa['eval_step']}): POET-X {pa['poetx']:.4f} vs AdamW "
                     f"{pa['adamw']:.4f}: {abs(pa['diff']):.4f} nats {where} AdamW ({100 * rel:+.1f}%); minimum eval "
                     f"loss POET-X {pa['min_poetx']:.4f}, AdamW {pa['min_adamw']:.4f}.")
    if doc.get("errors"):
        lines.append("\nErrors: " + "; ".join(f"{e['variant']} seed {e['seed']} rc={e['rc']}"
                                              + (" (killed at the time limit)" if e.get("killed") else "")
                                              for e in doc["errors"]))
    return "\n".join(lines) + "\n"


def plot(doc, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: matplotlib unavailable: {e})")
        return False
    seed = doc.get("summary", {}).get("seed", 0)
    runs = {r["variant"]: r for r in doc["runs"] if r["seed"] == seed}
    if not runs:
        return False

    def smooth(xs, k=20):
        out, acc = [], 0.0
        for i, x in enumerate(xs):
            acc += x
            if i >= k:
                acc -= xs[i - k]
            out.append(acc / min(i + 1, k))
        return out

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    ax = axes[0]
    for v in VARIANTS:
        r = runs.get(v)
        if not r:
            continue
        ax.plot(smooth(r["losses"]), color=COLOR[v], lw=1, label=f"{LABEL[v]} train (20-step mean)",
                ls="--" if v == "plain" else "-")
        ax.plot([e[0] for e in r["evals"]], [e[1] for e in r["evals"]], "o", color=COLOR[v], ms=3,
                label=f"{LABEL[v]} eval")
    merges = (runs.get("poetx") or runs.get("plain") or {}).get("merges_at", [])
    for i, m in enumerate(merges):
        ax.axvline(m, color="#cccccc", lw=0.6, zorder=0, label="merge" if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / byte)")
    lo = [e[1] for r in runs.values() for e in r["evals"]]
    if lo:
        ax.set_ylim(min(lo) - 0.2, max(min(lo) + 2.5, min(lo) + 0.5))
    ax.set_title("loss")
    ax.legend(fontsize=7)
    ax = axes[1]
    if runs.get("poetx") and runs.get("plain"):
        d = _diffs(runs["poetx"], runs["plain"])
        ax.semilogy([max(x, 1e-7) for x in d], lw=0.5, color="#2ca02c", label="|fastdora POET-X - plain| per step")
    if runs.get("poetx") and runs.get("adamw"):
        d = _diffs(runs["poetx"], runs["adamw"])
        ax.semilogy(smooth([max(x, 1e-7) for x in d]), lw=0.8, color="#888888",
                    label="|POET-X - AdamW| (20-step mean), for scale")
    ax.axhline(TOL["mean_step"], color="r", ls=":", lw=0.8, label=f"{TOL['mean_step']:g} (mean tolerance)")
    ax.set_xlabel("optimizer step")
    ax.set_title("per-step loss differences")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def report(path, outdir=None):
    from _bench_io import load_docs

    doc = load_docs(path)[0]
    outdir = outdir or os.path.dirname(os.path.abspath(path))
    os.makedirs(outdir, exist_ok=True)
    if "summary" not in doc:
        summarize(doc)
    md = markdown(doc)
    with open(os.path.join(outdir, "poetx_convergence.md"), "w") as f:
        f.write(md)
    plot(doc, os.path.join(outdir, "poetx_convergence.png"))
    print("\n" + md)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--report", help="markdown + plot again from a poetx_convergence.json")
    p.add_argument("--report-out", help="--report: folder for the md / png (default: the JSON's)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "poetx_convergence"))
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, 30 steps, merges every 10")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--control", action="store_true",
                   help="a fourth run: fastdora POET-X with seed + 1 (the scale of a difference that matters)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", default="poetx", choices=VARIANTS)
    p.add_argument("--result")
    p.add_argument("--parallel", type=int, default=4, help="concurrent runs (processes)")
    p.add_argument("--timeout-s", type=float, default=460.0, help="parent: kill the runs still going after this")
    p.add_argument("--max-train-s", type=float, default=400.0, help="a worker stops (truncated) after this")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--q-lr-scale", type=float, default=0.5)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--merge-interval", type=int, default=200)
    p.add_argument("--mode", default="fast", choices=["fast", "mem"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--max-corpus-bytes", type=int, default=0)
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    if a.tiny:
        a.steps, a.batch, a.seq, a.layers, a.hidden, a.intermediate = 30, 4, 32, 2, 64, 128
        a.heads, a.kv_heads, a.block, a.merge_interval, a.eval_every, a.eval_batches = 4, 2, 16, 10, 10, 2
        a.warmup_steps, a.max_corpus_bytes, a.threads = 5, 2_000_000, 1
    unknown = sorted(set(a.variants.split(",")) - set(VARIANTS))
    if unknown and not a.worker:
        p.error(f"--variants: unknown {unknown}")
    from _bench_io import dispatch

    dispatch(a, report, run_worker, run_parent)


if __name__ == "__main__":
    main()
