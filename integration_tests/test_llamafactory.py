"""End-to-end: ``llamafactory-cli train cfg.yaml`` (LLaMA-Factory 0.9.5) with ``use_fast_dora: true``, single process
and under torchrun (``FORCE_TORCHRUN=1 NPROC_PER_NODE=2``: two CPU workers, gloo). Run inside the llamafactory venv
after ``python -m fastdora.plugins.llamafactory install``.

usage: python test_llamafactory.py WORK_DIR [--plugin-options JSON] [--skip-torchrun] [--only dora,poetx]

Runs (same seed, SFT, DoRA on all linear layers, LLaMA-Factory's gradient checkpointing, fp32 on CPU):
  single/fastdora, single/stock (no key), torchrun/fastdora, torchrun/stock, plus three runs that must fail fast:
  a misspelled switch, a misspelled option and a bad value; and ``llamafactory-cli export`` of the trained adapter
  with ``use_fast_dora: true`` (LLaMA-Factory merges the adapter: fastdora must not warn about a model without DoRA).
Asserts: fastdora_report.json (written in the training process; under torchrun each rank writes its own,
fastdora_report.json by rank 0 and fastdora_report.rank1.json by rank 1, from two processes) with counter > 0; losses
equal within LOSS_ATOL; the saved adapter in stock PEFT (fresh process) gives the trained model's logits; without
the key no layer is converted and the counter stays 0.

POET-X (``poetx``): ``use_poetx: true`` with ``finetuning_type: full``, ``poetx_block_size: 16``,
``poetx_merge_interval: 3``, gradient accumulation 2, LLaMA-Factory's gradient checkpointing, 8 optimizer steps and a
checkpoint every 4, in one process; then the same config with ``resume_from_checkpoint: <run>/checkpoint-4`` in a new
``llamafactory-cli train``. Asserts the same as the Axolotl test's POET-X part (``common.check_poetx_training`` /
``check_poetx_export``: the report from the training process, merges after optimizer steps 3 and 6, loss going down,
resumed losses equal within LOSS_ATOL, the saved model exported and loaded by stock transformers with the trained
logits within LOGITS_ATOL), and that no ``fastdora_report*.json`` is written; plus two runs that must fail fast: a
misspelled ``poetx_blocksize`` (LLaMA-Factory's unknown-key error) and ``poetx_weight_format: int4`` (naming the value).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    HERE, POETX_GRAD_ACCUM, POETX_MERGE_INTERVAL, POETX_RESUME_STEP, POETX_STEPS, PROBE_FILE, check_losses,
    check_no_report, check_poetx_export, check_poetx_training, check_rank_reports, check_report, compare_logits,
    find_trainer_state, log, losses_from_state, run, stock_logits, tiny, write_config, write_summary,
)

OPTION_KEYS = {"kernels": "fast_dora_kernels", "legacy_embedding_compose": "fast_dora_legacy_embedding_compose",
               "dm_from_output": "fast_dora_dm_from_output"}


#: POET-X runs: full training (no adapter) with the POET-X keys, gradient accumulation, a checkpoint every 4 steps
POETX_KEYS = ["use_poetx: true", "poetx_block_size: 16", f"poetx_merge_interval: {POETX_MERGE_INTERVAL}"]
POETX_CFG = {"finetuning_type": "full", "gradient_accumulation_steps": str(POETX_GRAD_ACCUM),
             "max_steps": str(POETX_STEPS), "save_strategy": "steps", "save_steps": str(POETX_RESUME_STEP),
             "learning_rate": "3.0e-3"}
_LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "use_dora")


def config(paths: dict, out: str, extra: list, overrides: dict | None = None) -> str:
    """The training YAML: DoRA on all linear layers, or with ``overrides`` (key -> value) the keys replaced; with
    ``finetuning_type: full`` the LoRA keys are left out."""
    with open(os.path.join(paths["data_dir"], "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({"tiny_alpaca": {"file_name": "alpaca.jsonl"}}, f)
    lines = [
        f"model_name_or_path: {paths['model']}",
        "stage: sft",
        "do_train: true",
        "finetuning_type: lora",
        "lora_rank: 8",
        "lora_alpha: 16",
        "lora_dropout: 0.0",
        "lora_target: all",
        "use_dora: true",
        "dataset: tiny_alpaca",
        f"dataset_dir: {paths['data_dir']}",
        "template: default",
        "cutoff_len: 64",
        "overwrite_cache: true",
        f"output_dir: {out}",
        "overwrite_output_dir: true",
        "logging_steps: 1",
        "save_strategy: 'no'",
        "plot_loss: false",
        "per_device_train_batch_size: 2",
        "gradient_accumulation_steps: 1",
        "learning_rate: 2.0e-3",
        "max_steps: 8",
        "lr_scheduler_type: constant",
        "warmup_steps: 0",
        "bf16: false",
        "report_to: none",
        "seed: 0",
        "dataloader_num_workers: 0",
        "ddp_timeout: 600",
    ]
    if overrides:
        full = overrides.get("finetuning_type") == "full"
        keys = [line.split(":", 1)[0] for line in lines]
        lines = [f"{key}: {overrides[key]}" if key in overrides else line
                 for line, key in zip(lines, keys) if not (full and key in _LORA_KEYS)]
        lines += [f"{key}: {value}" for key, value in overrides.items() if key not in keys]
    return write_config(out, lines + extra)


def check_export(cli: str, env: dict, paths: dict, adapter: str, export_dir: str) -> float:
    """``llamafactory-cli export`` of the trained DoRA adapter with ``use_fast_dora: true`` left in the YAML:
    LLaMA-Factory merges the adapter inside ``init_adapter``, so the model fastdora sees has no DoRA layer; that is
    expected there and must not produce fastdora's "no DoRA layer" warning."""
    shutil.rmtree(export_dir, ignore_errors=True)
    cfg = write_config(export_dir, [
        f"model_name_or_path: {paths['model']}",
        f"adapter_name_or_path: {adapter}",
        "template: default",
        "finetuning_type: lora",
        f"export_dir: {export_dir}",
        "export_device: cpu",
        "use_fast_dora: true",
    ])
    logp = export_dir + ".log"
    dt = run([cli, "export", cfg], env=env, log_path=logp, timeout=600)
    text = open(logp, encoding="utf-8", errors="replace").read()
    assert "no DoRA layer" not in text, "fastdora warned about a model without DoRA on export:\n" + text[-3000:]
    assert os.path.exists(os.path.join(export_dir, "config.json")), f"export wrote no model into {export_dir}"
    log(f"LLaMA-Factory export with use_fast_dora: true: merged model in {export_dir}, no fastdora warning")
    return dt


def poetx_runs(cli: str, env: dict, paths: dict, work: str, times: dict) -> dict:
    """``use_poetx: true`` (``finetuning_type: full``) in one process: the uninterrupted run, the same run resumed from
    its ``checkpoint-4`` (``resume_from_checkpoint``) in a new ``llamafactory-cli train``, and the export of the saved
    model (:func:`common.check_poetx_training`, :func:`common.check_poetx_export`)."""
    what = "LLaMA-Factory + POET-X"
    full, resumed = os.path.join(work, "lf_poetx_full"), os.path.join(work, "lf_poetx_resumed")
    for name, out, extra in (("full", full, []),
                             ("resumed", resumed,
                              [f"resume_from_checkpoint: {os.path.join(full, f'checkpoint-{POETX_RESUME_STEP}')}"])):
        shutil.rmtree(out, ignore_errors=True)
        cfg = config(paths, out, POETX_KEYS + extra, POETX_CFG)
        times[f"poetx_{name}"] = run([cli, "train", cfg], env=env, log_path=out + ".log", timeout=1200)
    text = open(full + ".log", encoding="utf-8", errors="replace").read()
    assert "fastdora POET-X: converted" in text, "the plugin's 'fastdora POET-X: converted ...' line is not in the log"
    assert not glob.glob(os.path.join(full, "fastdora_report*.json")), "fastdora's DoRA ran in a POET-X run"
    result = check_poetx_training(full, resumed, what)
    t0 = time.time()
    result.update(check_poetx_export(sys.executable, full, paths["model"], what, env={"HF_HUB_OFFLINE": "1"}))
    times["poetx_export"] = time.time() - t0
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work")
    p.add_argument("--plugin-options", default="{}")
    p.add_argument("--skip-torchrun", action="store_true")
    p.add_argument("--only", default="dora,poetx", help="dora (use_fast_dora) and / or poetx (use_poetx) runs")
    a = p.parse_args()
    a.work = os.path.abspath(a.work)  # (checkpoint paths in the configs)
    os.makedirs(a.work, exist_ok=True)
    paths = tiny(a.work)
    options = json.loads(a.plugin_options)
    fd_keys = ["use_fast_dora: true"] + [f"{OPTION_KEYS[k]}: {json.dumps(v)}" for k, v in options.items()]
    bindir = os.path.dirname(sys.executable)
    cli = os.path.join(bindir, "llamafactory-cli")
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "DISABLE_VERSION_CHECK": "1",
        "WANDB_MODE": "disabled",
        "CUDA_VISIBLE_DEVICES": "",
        "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": os.path.join(HERE, "lf_probe") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "FASTDORA_PROBE_TOKENIZER": paths["model"],
        "OMP_NUM_THREADS": "1",
    }
    summary, times = {}, {}
    only = set(a.only.split(","))

    # 1. wrong key / wrong value fail fast with LLaMA-Factory's own errors
    for name, extra, needle in [
        ("misspelled_key", ["use_fastdora: true"], "are not used by the HfArgumentParser"),
        ("misspelled_option", ["use_fast_dora: true", "fast_dora_kernal: eager"],
         "are not used by the HfArgumentParser"),
        ("bad_value", ["use_fast_dora: maybe"], "use_fast_dora must be true or false"),
        ("poetx_misspelled_option", POETX_KEYS + ["poetx_blocksize: 16"], "are not used by the HfArgumentParser"),
        ("poetx_bad_value", POETX_KEYS + ["poetx_weight_format: int4"],
         "weight_format must be one of ['dense', 'int8'], got 'int4'"),
    ]:
        if ("poetx" if name.startswith("poetx") else "dora") not in only:
            continue
        out = os.path.join(a.work, f"lf_{name}")
        cfg = config(paths, out, extra, POETX_CFG if name.startswith("poetx") else None)
        proc = subprocess.run([cli, "train", cfg], env={**os.environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600)
        assert proc.returncode != 0 and needle in proc.stdout, f"{name}: expected failure with {needle!r}:\n" + \
            proc.stdout[-3000:]
        line = next(ln for ln in proc.stdout.splitlines() if needle in ln)
        log(f"LLaMA-Factory {name}: fails as expected: {line.strip()[:200]}")

    modes = [("single", {}), ("torchrun", {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"})]
    if a.skip_torchrun:
        modes = modes[:1]
    if "dora" not in only:
        modes = []
    for mode, menv in modes:
        outs = {}
        for run_kind in ("fastdora", "stock"):
            out = os.path.join(a.work, f"lf_{mode}_{run_kind}")
            shutil.rmtree(out, ignore_errors=True)
            cfg = config(paths, out, fd_keys if run_kind == "fastdora" else [])
            times[f"{mode}_{run_kind}"] = run([cli, "train", cfg], env={**env, **menv},
                                              log_path=out + ".log", timeout=1200)
            outs[run_kind] = out
        what = f"LLaMA-Factory ({mode})"
        if mode == "torchrun":  # each worker converts its own model and writes its own report
            rep = check_rank_reports(outs["fastdora"], what, world_size=2)[0]
        else:
            rep = check_report(outs["fastdora"], what)
        with open(os.path.join(outs["fastdora"], "probe_meta.json")) as f:
            meta_fast = json.load(f)
        assert meta_fast["converted_layers"] > 0 and meta_fast["path_counter_total"] > 0, meta_fast
        if mode == "torchrun":
            assert meta_fast["world_size"] == 2, meta_fast
        check_no_report(outs["stock"], what + " (no use_fast_dora)")
        with open(os.path.join(outs["stock"], "probe_meta.json")) as f:
            meta_stock = json.load(f)
        # the .pth hook is installed, so fastdora.plugins is imported to register the YAML keys; but nothing runs
        assert meta_stock["converted_layers"] == 0 and meta_stock["path_counter_total"] == 0, meta_stock
        log(f"{what}: without use_fast_dora (training process): {meta_stock}")
        fl = losses_from_state(find_trainer_state(outs["fastdora"]))
        sl = losses_from_state(find_trainer_state(outs["stock"]))
        loss_diff = check_losses(fl, sl, what)
        stock_out = os.path.join(outs["fastdora"], "stock_peft_logits.pt")
        stock_logits(sys.executable, paths["model"], outs["fastdora"], stock_out, env={"HF_HUB_OFFLINE": "1"})
        logit_diff = compare_logits(os.path.join(outs["fastdora"], PROBE_FILE), stock_out, what)
        summary[mode] = {"loss_max_abs_diff": loss_diff, "logits_max_abs_diff": logit_diff,
                         "path_counter": rep["active_path_counter"], "fastdora_layers": rep["fastdora_layers"],
                         "world_size": meta_fast["world_size"]}
        if mode == "single":
            times["export"] = check_export(cli, env, paths, outs["fastdora"], os.path.join(a.work, "lf_export"))
    if "poetx" in only:
        summary["poetx"] = poetx_runs(cli, env, paths, a.work, times)
    summary["seconds"] = {k: round(v, 1) for k, v in times.items()}
    write_summary(a.work, "llamafactory", summary)
    log("PASS: LLaMA-Factory " + ", ".join([m for m, _ in modes] + (["POET-X"] if "poetx" in only else [])))


if __name__ == "__main__":
    main()
