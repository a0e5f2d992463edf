"""End-to-end: HF ``Trainer`` and TRL (``SFTTrainer(peft_config=...)``, ``DPOTrainer`` with a PeftModel) with
``fastdora.plugins.FastDoraCallback``. Run inside the hf venv (transformers + trl + peft + torch).

usage: python test_hf_trl.py WORK_DIR [--only hf,hf_compile,sft,dpo,fsdp2,poetx_hf,poetx_sft] [--plugin-options JSON]

For each trainer: one run with the callback, one without (same seed, separate processes); asserts
- fastdora's path ran in the training process (fastdora_report.json written by the plugin, counter > 0; the
  probe also sees converted layers in the trained model),
- the loss curves agree within LOSS_ATOL,
- the saved adapter loads in stock PEFT in a fresh process (fastdora not imported) and gives the trained model's
  logits within LOGITS_ATOL,
- without the callback nothing of fastdora runs (no report, fastdora never imported, no converted layer).
``fsdp2``: the HF Trainer run under torchrun with 2 processes and ``fsdp_config={"version": 2}`` (one unit per
decoder layer), with and without the callback: each rank wrote its own report (``fastdora_report.json`` on rank 0,
``fastdora_report.rank1.json`` on rank 1) showing converted layers on which fastdora's path ran, the norm was
computed exactly once per layer per optimizer step on each rank, the loss curves agree within LOSS_ATOL, and nothing
of fastdora ran without the callback. On a machine without GPUs accelerate runs this as DDP (it has no FSDP for
``MULTI_CPU``); the engine it ran is recorded in the summary and asserted to be FSDP where CUDA is present. Sharded
DoRA on CPU is covered by ``tests/peft/test_distributed.py`` (FSDP1 / FSDP2 / ZeRO without a trainer).
``hf_compile``: the HF Trainer run with ``torch_compile=True`` and the callback (its graph reading the Linear layers'
norm slots of the callback's step scopes; the norm op for the embedding only): the norm computed once per layer per
optimizer step inside the compiled model, the losses equal to the eager runs' (fastdora and stock PEFT).
``poetx_hf`` / ``poetx_sft``: full training with ``fastdora.plugins.PoetXCallback`` (HF Trainer / TRL SFTTrainer,
gradient accumulation and checkpointing, merges every 3 optimizer steps, 8 steps, a checkpoint every 4), then the
same job resumed from ``checkpoint-4`` in a new process; asserts
- POET-X ran in the training process (``poetx_report.json`` written there: converted layers, merges after steps 3
  and 6; every layer merged twice),
- the loss went down, and the resumed run's losses of steps 5-8 equal the uninterrupted run's within LOSS_ATOL,
- the exported model loads in stock transformers in a fresh process (fastdora not imported, no missing or unexpected
  weight, plain ``nn.Linear`` layers) with the trained POET-X model's logits within LOGITS_ATOL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    HERE, PROBE_FILE, check_losses, check_no_report, check_rank_reports, check_report, compare_logits, free_port,
    log, run, stock_logits, tiny, write_summary,
)

DATA = {"hf": "text", "sft": "text", "dpo": "preference"}


def one(trainer: str, work: str, paths: dict, plugin_options: str) -> dict:
    py = sys.executable
    out = {}
    times = {}
    for mode in ("fastdora", "stock"):
        d = os.path.join(work, f"{trainer}_{mode}")
        cmd = [py, os.path.join(HERE, "hf_job.py"), "--trainer", trainer, "--model", paths["model"],
               "--data", paths[DATA[trainer]], "--out", d, "--steps", "4" if trainer == "dpo" else "8"]
        if mode == "fastdora":
            cmd += ["--fastdora", "--fastdora-options", plugin_options]
        times[mode] = run(cmd, log_path=os.path.join(work, f"{trainer}_{mode}.log"))
        out[mode] = d
    what = {"hf": "HF Trainer", "sft": "TRL SFTTrainer", "dpo": "TRL DPOTrainer"}[trainer]
    expect = ("linear:", "embedding:") if trainer == "hf" else ("linear:",)
    rep = check_report(out["fastdora"], what, expect)
    check_no_report(out["stock"], what + " (no callback)")
    with open(os.path.join(out["fastdora"], "probe_meta.json")) as f:
        meta_fast = json.load(f)
    with open(os.path.join(out["stock"], "probe_meta.json")) as f:
        meta_stock = json.load(f)
    assert meta_fast["converted_layers"] > 0 and meta_fast["path_counter_total"] > 0, meta_fast
    assert meta_stock == {**meta_stock, "fastdora_imported": False, "path_counter_total": 0, "converted_layers": 0}, \
        f"{what}: fastdora ran without the callback: {meta_stock}"
    log(f"{what}: without the callback: {meta_stock}")
    fl = json.load(open(os.path.join(out["fastdora"], "losses.json")))["losses"]
    sl = json.load(open(os.path.join(out["stock"], "losses.json")))["losses"]
    loss_diff = check_losses(fl, sl, what, must_decrease=trainer != "dpo")  # DPO on random pairs: noise
    stock_out = os.path.join(out["fastdora"], "stock_peft_logits.pt")
    t0 = time.time()
    stock_logits(py, paths["model"], os.path.join(out["fastdora"], "adapter"), stock_out)
    times["stock_load"] = time.time() - t0
    logit_diff = compare_logits(os.path.join(out["fastdora"], PROBE_FILE), stock_out, what)
    return {"trainer": what, "loss_max_abs_diff": loss_diff, "logits_max_abs_diff": logit_diff,
            "path_counter": rep["active_path_counter"], "fastdora_layers": rep["fastdora_layers"],
            "seconds": {k: round(v, 1) for k, v in times.items()}}


def one_fsdp2(work: str, paths: dict, plugin_options: str, steps: int = 4) -> dict:
    import torch

    what = "HF Trainer + fsdp_config version 2 (2 processes)"
    out, times = {}, {}
    for mode in ("fastdora", "stock"):
        d = os.path.join(work, f"fsdp2_{mode}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), os.path.join(HERE, "hf_job.py"), "--trainer", "hf", "--fsdp2",
               "--model", paths["model"],
               "--data", paths["text"], "--out", d, "--steps", str(steps)]
        if mode == "fastdora":
            cmd += ["--fastdora", "--fastdora-options", plugin_options]
        times[mode] = run(cmd, log_path=os.path.join(work, f"fsdp2_{mode}.log"), timeout=300)  # (~25 s each)
        out[mode] = d
    reps = check_rank_reports(out["fastdora"], what, world_size=2)  # every rank converts and runs its own model
    check_no_report(out["stock"], what + " (no callback)")
    fast = json.load(open(os.path.join(out["fastdora"], "losses.json")))
    stock = json.load(open(os.path.join(out["stock"], "losses.json")))
    assert fast["world_size"] == 2 and stock["world_size"] == 2, (fast["world_size"], stock["world_size"])
    if torch.cuda.is_available():
        assert fast["fsdp"] and stock["fsdp"], f"{what}: accelerate did not run FSDP: {fast.get('engine')}"
    assert not stock["final_state"]["fastdora_imported"], f"{what}: fastdora imported without the callback"
    for rank, rep in enumerate(reps):
        counter = rep["active_path_counter"]
        computed = counter.get("norm:computed", 0) + counter.get("norm:computed_base_cached", 0)
        assert computed == rep["fastdora_layers"] * steps, \
            f"{what}: rank {rank}: norm computed {computed} times for {rep['fastdora_layers']} layers x {steps} " \
            f"steps: {counter}"
    diff = check_losses(fast["losses"], stock["losses"], what)
    return {"trainer": what, "engine": fast.get("engine"), "fsdp": fast.get("fsdp"), "loss_max_abs_diff": diff,
            "path_counter": [rep["active_path_counter"] for rep in reps],
            "fastdora_layers": [rep["fastdora_layers"] for rep in reps],
            "seconds": {k: round(v, 1) for k, v in times.items()}}


def one_compile(work: str, paths: dict, plugin_options: str, steps: int = 8) -> dict:
    """HF Trainer with ``torch_compile=True`` and the callback: every DoRA layer ran inside the compiled model (no
    layer recorded an eager call), the compiled graph read the Linear layers' norm slots that the callback's step
    scopes refreshed (fastdora's norm op ran only for the embedding), the norm was computed once per layer per
    optimizer step, and the losses equal the eager runs' (with and without fastdora: the ``hf`` case's runs, made here
    if that case did not run)."""
    what = "HF Trainer, torch_compile=True"
    py = sys.executable
    eager = {}
    for mode in ("fastdora", "stock"):
        d = os.path.join(work, f"hf_{mode}")
        if not os.path.exists(os.path.join(d, "losses.json")):
            cmd = [py, os.path.join(HERE, "hf_job.py"), "--trainer", "hf", "--model", paths["model"],
                   "--data", paths["text"], "--out", d, "--steps", str(steps)]
            run(cmd + (["--fastdora", "--fastdora-options", plugin_options] if mode == "fastdora" else []),
                log_path=os.path.join(work, f"hf_{mode}.log"))
        eager[mode] = json.load(open(os.path.join(d, "losses.json")))["losses"]
    d = os.path.join(work, "hf_compile_fastdora")
    # without gradient checkpointing: with it, transformers' checkpointed layers can fall back to eager under
    # torch.compile (a graph break inside the checkpoint, from the `kernels` package's context variable), for LoRA too
    seconds = run([py, os.path.join(HERE, "hf_job.py"), "--trainer", "hf", "--compile", "--no-gc",
                   "--model", paths["model"], "--data", paths["text"], "--out", d, "--steps", str(steps),
                   "--fastdora", "--fastdora-options", plugin_options],
                  log_path=os.path.join(work, "hf_compile_fastdora.log"))
    rep = check_report(d, what, expect_keys=("norm:",))
    counter = rep["active_path_counter"]
    computed = counter.get("norm:computed", 0) + counter.get("norm:computed_base_cached", 0)
    assert computed == rep["fastdora_layers"] * steps, \
        f"{what}: norm computed {computed} times for {rep['fastdora_layers']} layers x {steps} steps: {counter}"
    # Linear layers read their norm slots (refreshed once per step by the callback's step scope); the tiny model's
    # DoRA embedding has no slot: its norm goes through fastdora's op, once per forward (no GA, no checkpointing)
    linear = rep["converted"].get("linear", 0)
    others = rep["fastdora_layers"] - linear
    assert linear > 0 and counter.get("norm:slot_refresh", 0) == linear * steps, \
        f"{what}: norm slots of {linear} Linear layers refreshed {counter.get('norm:slot_refresh', 0)} times: {counter}"
    assert counter.get("compiled:norm_op", 0) == others * steps, \
        f"{what}: fastdora's norm op ran {counter.get('compiled:norm_op', 0)} times in compiled graphs, for " \
        f"{others} layer(s) without a slot x {steps} steps: {counter}"
    assert not any(k.startswith(("linear:", "embedding:")) for k in counter), \
        f"{what}: DoRA layers ran outside the compiled graph: {counter}"
    compiled = json.load(open(os.path.join(d, "losses.json")))["losses"]
    diff = check_losses(compiled, eager["fastdora"], what + " vs eager fastdora")
    diff_stock = check_losses(compiled, eager["stock"], what + " vs eager stock PEFT")
    return {"trainer": what, "loss_max_abs_diff": diff, "loss_max_abs_diff_vs_stock": diff_stock,
            "path_counter": counter, "fastdora_layers": rep["fastdora_layers"], "seconds": {"compiled": seconds}}


POETX_MERGE_INTERVAL, POETX_STEPS = 3, 8


def one_poetx(trainer: str, work: str, paths: dict) -> dict:
    what = {"hf": "HF Trainer + POET-X", "sft": "TRL SFTTrainer + POET-X"}[trainer]
    options = json.dumps({"block_size": 16, "merge_interval": POETX_MERGE_INTERVAL})
    full, resumed = os.path.join(work, f"poetx_{trainer}_full"), os.path.join(work, f"poetx_{trainer}_resumed")
    times = {}
    base = [sys.executable, os.path.join(HERE, "poetx_job.py"), "--trainer", trainer, "--model", paths["model"],
            "--data", paths["text"], "--steps", str(POETX_STEPS), "--options", options]
    times["full"] = run(base + ["--out", full], log_path=full + ".log")
    times["resumed"] = run(base + ["--out", resumed, "--resume", os.path.join(full, "checkpoint-4")],
                           log_path=resumed + ".log")
    res_full = json.load(open(os.path.join(full, "losses.json")))
    res_resumed = json.load(open(os.path.join(resumed, "losses.json")))
    rep = json.load(open(os.path.join(full, "poetx_report.json")))
    expected = [s for s in range(1, POETX_STEPS + 1) if s % POETX_MERGE_INTERVAL == 0]
    assert rep["pid"] == res_full["pid"] != os.getpid(), f"{what}: the report is not the training process's"
    assert rep["converted"] and len(rep["converted"]) == res_full["poetx_layers"], rep
    assert rep["merges_at_steps"] == res_full["merges"] == expected, (rep["merges_at_steps"], expected)
    assert res_full["merge_counts"] == [len(expected)], res_full["merge_counts"]
    assert res_resumed["merges"] == [s for s in expected if s > 4] and res_resumed["merge_counts"] == [len(expected)]
    log(f"{what}: {len(rep['converted'])} layers converted, {len(rep['skipped'])} skipped "
        f"({sorted(set(rep['skipped'].values()))}); merges after steps {rep['merges_at_steps']}")
    curve = res_full["losses"]
    assert [s for s, _ in curve] == list(range(1, POETX_STEPS + 1)), curve
    assert curve[-1][1] < curve[0][1], f"{what}: loss did not go down: {curve}"
    tail = [(s, loss) for s, loss in res_resumed["losses"] if s > 4]
    resume_diff = check_losses(tail, curve[4:], what, must_decrease=False, names=("resumed at step 4", "uninterrupted"))
    stock_out = os.path.join(full, "stock_logits.pt")
    times["stock_load"] = run([sys.executable, os.path.join(HERE, "stock_model_check.py"),
                               os.path.join(full, "exported"), stock_out])
    logit_diff = compare_logits(os.path.join(full, PROBE_FILE), stock_out, what,
                                stock_name="exported model loaded in stock transformers")
    return {"trainer": what, "resume_loss_max_abs_diff": resume_diff, "logits_max_abs_diff": logit_diff,
            "merges": rep["merges_at_steps"], "converted_layers": len(rep["converted"]),
            "first_last_loss": [curve[0][1], curve[-1][1]], "seconds": {k: round(v, 1) for k, v in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work")
    p.add_argument("--only", default="hf,hf_compile,sft,dpo,fsdp2,poetx_hf,poetx_sft")
    p.add_argument("--plugin-options", default="{}", help="JSON dict of fastdora options for the plugin run")
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    paths = tiny(a.work)
    results = []
    for t in a.only.split(","):
        if t == "fsdp2":
            results.append(one_fsdp2(a.work, paths, a.plugin_options))
        elif t == "hf_compile":
            results.append(one_compile(a.work, paths, a.plugin_options))
        elif t.startswith("poetx_"):
            results.append(one_poetx(t[len("poetx_"):], a.work, paths))
        else:
            results.append(one(t, a.work, paths, a.plugin_options))
    write_summary(a.work, "hf_trl", {"results": results})
    log("PASS: " + ", ".join(r["trainer"] for r in results))


if __name__ == "__main__":
    main()
