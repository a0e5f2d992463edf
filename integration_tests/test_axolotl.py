"""End-to-end: ``axolotl train cfg.yaml`` (Axolotl 0.19 on Python 3.11, or 0.21 on Python 3.12; its default
accelerate launcher: training runs in a child process) with ``plugins: [fastdora.plugins.axolotl.FastDoraPlugin]``.
Run inside an Axolotl venv.

usage: python test_axolotl.py WORK_DIR [--plugin-options JSON] [--only dora,poetx]

Two runs, same seed, DoRA on all linear layers, gradient checkpointing, fp32 on CPU:
- fastdora: the plugin listed, Axolotl's ``lora_*_kernel`` keys left unset (Axolotl auto-enables its fused LoRA
  kernels for LoRA adapters; the plugin must switch them off for DoRA and say so in the log);
- stock: no fastdora plugin, ``lora_*_kernel: false`` (stock PEFT DoRA is the reference).
Both runs must start from the same adapter. Axolotl < 0.21 does not seed the adapter's initialisation, so there both
start from one saved, seeded DoRA adapter (``lora_model_dir``, non-zero ``lora_B``); Axolotl 0.21 calls
``set_seed(cfg.seed)`` right before ``get_peft_model`` (``loaders/adapter.py``), so there both initialise their own
adapter, and the test checks that the two initial adapters are bit-identical (the probe's checksum at train begin).
Asserts: fastdora_report.json with counter > 0 (written in the training process), the plugin's log line about the
kernels, its one ``fastdora: on, converted ...`` line and no warning about foreign instance-level forwards (fastdora's
own lean forward is not one), losses equal within LOSS_ATOL, the saved adapter in stock PEFT (fresh process) gives the
trained model's logits, and without the plugin fastdora is never imported in the training process. A third run with a
misspelled ``fast_dora_kernal`` key must fail at config load, naming the key.

POET-X (``poetx``): full training (no adapter) with ``plugins: [fastdora.plugins.axolotl.PoetXPlugin]`` and
``poetx_block_size: 16``, ``poetx_merge_interval: 3``, gradient accumulation 2, gradient checkpointing, 8 optimizer
steps and a checkpoint every 4; then the same config with ``resume_from_checkpoint: <run>/checkpoint-4`` in a new
``axolotl train``. Asserts (``common.check_poetx_training`` / ``check_poetx_export``): ``poetx_report.json`` written
by the training process (its pid is the probe's) with the converted layers and merges after optimizer steps 3 and 6
(6 in the resumed run; every layer's merge count 2 in both), the plugin's ``fastdora POET-X: converted ...`` line, the
loss going down, the resumed losses of steps 5-8 equal to the uninterrupted run's within LOSS_ATOL, and the model
Axolotl saved, reloaded with fastdora (same logits as the training process's within 1e-6), exported with
``fastdora.poetx.export`` and loaded by stock transformers in a fresh process (fastdora not imported, no missing or
unexpected weight, plain ``nn.Linear`` layers), gives the trained model's logits within LOGITS_ATOL. A misspelled
``poetx_blocksize`` key must fail at config load, naming it and suggesting ``poetx_block_size``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    HERE, POETX_GRAD_ACCUM, POETX_MERGE_INTERVAL, POETX_RESUME_STEP, POETX_STEPS, PROBE_FILE, check_losses,
    check_no_report, check_poetx_export, check_poetx_training, check_report, compare_logits, find_trainer_state, log,
    losses_from_state, make_init_adapter, run, stock_logits, tiny, write_config, write_summary,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KERNEL_KEYS = ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel", "lora_embedding_kernel")
#: the first Axolotl release that seeds the adapter's initialisation (``set_seed`` before ``get_peft_model``)
SEEDED_INIT_SINCE = (0, 21)
OPTION_KEYS = {"kernels": "fast_dora_kernels", "legacy_embedding_compose": "fast_dora_legacy_embedding_compose",
               "dm_from_output": "fast_dora_dm_from_output"}


def config(paths: dict, out: str, prepared: str, fastdora: bool, options: dict) -> str:
    lines = [
        f"base_model: {paths['model']}",
        "tokenizer_type: AutoTokenizer",
        "datasets:",
        f"  - path: {paths['text']}",
        "    ds_type: json",
        "    type: completion",
        f"dataset_prepared_path: {prepared}",
        "val_set_size: 0",
        f"output_dir: {out}",
        "sequence_len: 64",
        "sample_packing: false",
        "adapter: lora",
        "lora_r: 8",
        "lora_alpha: 16",
        "lora_dropout: 0.0",
        "lora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
    ]
    if paths.get("init_adapter"):  # Axolotl < 0.21 does not seed the adapter's initialisation
        lines.append(f"lora_model_dir: {paths['init_adapter']}")
    lines += [
        "peft_use_dora: true",
        "micro_batch_size: 4",
        "gradient_accumulation_steps: 1",
        "max_steps: 8",
        "num_epochs: 1",
        "optimizer: adamw_torch",
        "lr_scheduler: constant",
        "learning_rate: 0.002",
        "warmup_steps: 0",
        "bf16: false",
        "fp16: false",
        "tf32: false",
        "gradient_checkpointing: true",
        "logging_steps: 1",
        "save_strategy: steps",
        "save_steps: 8",
        "seed: 0",
        "dataloader_num_workers: 0",
        "plugins:",
    ]
    if fastdora:
        lines.append("  - fastdora.plugins.axolotl.FastDoraPlugin")
    lines.append("  - axolotl_probe.ProbePlugin")
    if fastdora:
        lines += [f"{OPTION_KEYS[k]}: {json.dumps(v)}" for k, v in options.items()]
    else:
        lines += [f"{k}: false" for k in KERNEL_KEYS]
    return write_config(out, lines)


def poetx_config(paths: dict, out: str, prepared: str, extra: list) -> str:
    """Full training of the tiny model with ``plugins: [fastdora.plugins.axolotl.PoetXPlugin]`` and ``poetx_*`` keys (no
    adapter): gradient accumulation, checkpointing, merges every 3 optimizer steps, a checkpoint every 4."""
    return write_config(out, [
        f"base_model: {paths['model']}",
        "tokenizer_type: AutoTokenizer",
        "datasets:",
        f"  - path: {paths['text']}",
        "    ds_type: json",
        "    type: completion",
        f"dataset_prepared_path: {prepared}",
        "val_set_size: 0",
        f"output_dir: {out}",
        "sequence_len: 64",
        "sample_packing: false",
        "micro_batch_size: 4",
        f"gradient_accumulation_steps: {POETX_GRAD_ACCUM}",
        f"max_steps: {POETX_STEPS}",
        "num_epochs: 1",
        "optimizer: adamw_torch",
        "lr_scheduler: constant",
        "learning_rate: 0.003",
        "warmup_steps: 0",
        "bf16: false",
        "fp16: false",
        "tf32: false",
        "gradient_checkpointing: true",
        "logging_steps: 1",
        "save_strategy: steps",
        f"save_steps: {POETX_RESUME_STEP}",
        "seed: 0",
        "dataloader_num_workers: 0",
        "plugins:",
        "  - fastdora.plugins.axolotl.PoetXPlugin",
        "  - axolotl_probe.ProbePlugin",
        "poetx_block_size: 16",
        f"poetx_merge_interval: {POETX_MERGE_INTERVAL}",
    ] + extra)


def poetx_runs(paths: dict, work: str, env: dict, bindir: str, times: dict) -> dict:
    """``axolotl train`` with the POET-X plugin: a misspelled ``poetx_`` key fails at config load naming it; the
    uninterrupted run, the same run resumed from its ``checkpoint-4`` (``resume_from_checkpoint``) in a new ``axolotl
    train``, and the export of the saved model (:func:`common.check_poetx_training`, :func:`common.check_poetx_export`).
    """
    what = "Axolotl + POET-X"
    out = os.path.join(work, "axolotl_poetx_misspelled")
    cfg = poetx_config(paths, out, os.path.join(work, "prepared_poetx"), ["poetx_blocksize: 16"])
    t0 = time.time()
    proc = subprocess.run([os.path.join(bindir, "axolotl"), "train", cfg], env={**os.environ, **env},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    times["poetx_misspelled"] = time.time() - t0
    assert proc.returncode != 0 and "poetx_blocksize" in proc.stdout and "did you mean poetx_block_size" in \
        proc.stdout, "a misspelled poetx_ key did not fail naming it:\n" + proc.stdout[-3000:]
    assert not os.path.exists(os.path.join(out, "poetx_report.json")), "training ran despite the bad key"
    line = next((ln for ln in proc.stdout.splitlines() if "unknown config key" in ln), "")
    log(f"{what}: misspelled key fails as expected: {line.strip()[:200]}")

    full, resumed = os.path.join(work, "axolotl_poetx_full"), os.path.join(work, "axolotl_poetx_resumed")
    for name, d, extra in (("full", full, []),
                           ("resumed", resumed,
                            [f"resume_from_checkpoint: {os.path.join(full, f'checkpoint-{POETX_RESUME_STEP}')}"])):
        shutil.rmtree(d, ignore_errors=True)
        cfg = poetx_config(paths, d, os.path.join(work, "prepared_poetx"), extra)
        times[f"poetx_{name}"] = run([os.path.join(bindir, "axolotl"), "train", cfg], env=env, log_path=d + ".log",
                                     timeout=1200)
    text = open(full + ".log", encoding="utf-8", errors="replace").read()
    assert "fastdora POET-X: converted" in text, "the plugin's 'fastdora POET-X: converted ...' line is not in the log"
    result = check_poetx_training(full, resumed, what)
    t0 = time.time()
    result.update(check_poetx_export(sys.executable, full, paths["model"], what, env={"HF_HUB_OFFLINE": "1"}))
    times["poetx_export"] = time.time() - t0
    return result


def check_misspelled_key(paths: dict, work: str, env: dict, bindir: str, options: dict) -> None:
    out = os.path.join(work, "axolotl_misspelled")
    shutil.rmtree(out, ignore_errors=True)
    cfg = config(paths, out, os.path.join(work, "prepared_misspelled"), True, options)
    with open(cfg, "a", encoding="utf-8") as f:
        f.write("fast_dora_kernal: eager\n")
    proc = subprocess.run([os.path.join(bindir, "axolotl"), "train", cfg], env={**os.environ, **env},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode != 0 and "fast_dora_kernal" in proc.stdout and "fast_dora_kernels" in proc.stdout, \
        "a misspelled fast_dora_ key did not fail naming it:\n" + proc.stdout[-3000:]
    assert not os.path.exists(os.path.join(out, "fastdora_report.json")), "training ran despite the bad key"
    line = next((ln for ln in proc.stdout.splitlines() if "unknown config key" in ln), "")
    log(f"Axolotl misspelled key: fails as expected: {line.strip()[:200]}")


def dora_runs(paths: dict, work: str, env: dict, bindir: str, options: dict, times: dict) -> dict:
    """``axolotl train`` with and without the FastDoraPlugin (same seed, same initial adapter), then the stock-PEFT
    load of the saved adapter and the misspelled-key run (see the module docstring)."""
    outs = {}
    for mode in ("fastdora", "stock"):
        out = os.path.join(work, f"axolotl_{mode}")
        shutil.rmtree(out, ignore_errors=True)
        cfg = config(paths, out, os.path.join(work, f"prepared_{mode}"), mode == "fastdora", options)
        logp = os.path.join(work, f"axolotl_{mode}.log")
        times[mode] = run([os.path.join(bindir, "axolotl"), "train", cfg], env=env, log_path=logp, timeout=1200)
        outs[mode] = (out, logp)

    what = "Axolotl"
    out, logp = outs["fastdora"]
    rep = check_report(out, what)
    text = open(logp, encoding="utf-8", errors="replace").read()
    assert "fastdora (register): DoRA config: set" in text, "the plugin did not log switching the LoRA kernels off"
    assert "LoRA kernels: DoRA enabled" not in text, "Axolotl's fused LoRA kernels were applied to the DoRA model"
    assert "instance-level forward" not in text, "the plugin took fastdora's own forward for a foreign one"
    assert "fastdora: on, converted" in text, "the plugin's 'fastdora: on, converted ...' line is not in the log"
    line = next(ln for ln in text.splitlines() if "fastdora (register)" in ln)
    log(f"{what}: plugin log: {line.strip()[-200:]}")
    with open(os.path.join(out, "probe_meta.json")) as f:
        meta_fast = json.load(f)
    assert meta_fast["converted_layers"] > 0, meta_fast
    sout, _ = outs["stock"]
    check_no_report(sout, what + " (no plugin)")
    with open(os.path.join(sout, "probe_meta.json")) as f:
        meta_stock = json.load(f)
    assert not meta_stock["fastdora_imported"] and meta_stock["converted_layers"] == 0, meta_stock
    log(f"{what}: without the plugin (training process): {meta_stock}")
    assert meta_fast["init_adapter_tensors"] > 0, meta_fast
    assert meta_fast["init_adapter_sha256"] == meta_stock["init_adapter_sha256"], \
        f"{what}: the two runs started from different adapters: {meta_fast} vs {meta_stock}"
    log(f"{what}: both runs started from the same adapter ({meta_fast['init_adapter_tensors']} tensors, sha256 "
        f"{meta_fast['init_adapter_sha256'][:16]}...)")
    fl = losses_from_state(find_trainer_state(out))
    sl = losses_from_state(find_trainer_state(sout))
    loss_diff = check_losses(fl, sl, what)
    stock_out = os.path.join(out, "stock_peft_logits.pt")
    stock_logits(sys.executable, paths["model"], out, stock_out, env={"HF_HUB_OFFLINE": "1"})
    logit_diff = compare_logits(os.path.join(out, PROBE_FILE), stock_out, what)
    check_misspelled_key(paths, work, env, bindir, options)
    return {"loss_max_abs_diff": loss_diff, "logits_max_abs_diff": logit_diff,
            "path_counter": rep["active_path_counter"], "fastdora_layers": rep["fastdora_layers"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work")
    p.add_argument("--plugin-options", default="{}")
    p.add_argument("--only", default="dora,poetx", help="dora (FastDoraPlugin) and / or poetx (PoetXPlugin) runs")
    a = p.parse_args()
    a.work = os.path.abspath(a.work)  # (checkpoint paths in the configs)
    os.makedirs(a.work, exist_ok=True)
    paths = tiny(a.work)
    version = importlib.metadata.version("axolotl")
    seeded = tuple(int(x) for x in version.split(".")[:2]) >= SEEDED_INIT_SINCE
    only = set(a.only.split(","))
    if "dora" in only:
        if not seeded:
            paths["init_adapter"] = make_init_adapter(paths["model"], os.path.join(a.work, "init_adapter"), TARGETS)
        log(f"Axolotl {version}: both DoRA runs start from "
            + ("Axolotl's own seeded adapter initialisation" if seeded else "one saved, seeded DoRA adapter"))
    options = json.loads(a.plugin_options)
    bindir = os.path.dirname(sys.executable)
    env = {
        "AXOLOTL_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "CUDA_VISIBLE_DEVICES": "",
    }
    summary, times = {"axolotl": version, "seeded_init": seeded}, {}
    if "dora" in only:
        summary.update(dora_runs(paths, a.work, env, bindir, options, times))
    if "poetx" in only:
        summary["poetx"] = poetx_runs(paths, a.work, env, bindir, times)
    summary["seconds"] = {k: round(v, 1) for k, v in times.items()}
    write_summary(a.work, "axolotl", summary)
    log(f"PASS: Axolotl {version} " + ", ".join(sorted(only)))


if __name__ == "__main__":
    main()
