"""Helper of ``benchmarks/axolotl_h200.sh``: builds the local model, tokenizer, data and the three Axolotl configs,
then collects the three runs into one JSON and a markdown table.

    python benchmarks/axolotl_h200.py prepare WORK [--tiny]  # WORK/model, WORK/data, WORK/<run>.yaml for each run
    python benchmarks/axolotl_h200.py collect WORK OUT        # OUT/axolotl_h200.{json,md}
    python benchmarks/axolotl_h200.py slim-bnb DIR CUDA       # DIR's bitsandbytes wheel keeps the CUDA and CPU library

The three runs share one config and differ only in:
- ``fastdora``: ``plugins: [fastdora.plugins.axolotl.FastDoraPlugin]`` (which switches Axolotl's LoRA kernels off);
- ``axolotl_kernels``: no fastdora, Axolotl's fused LoRA/DoRA kernels on (its default for LoRA adapters: the four
  ``lora_*_kernel`` keys left unset);
- ``peft``: no fastdora, the four ``lora_*_kernel: false``: stock PEFT DoRA (the reference).
Default shape: a Llama decoder, hidden 2048, intermediate 8192, 16 heads (8 KV heads), 4 layers, random weights in
bf16; DoRA r=64 (alpha 128) on q, k, v, o, gate, up, down; sequence 2048, micro-batch 4, 60 steps, bf16, sdpa,
gradient checkpointing. ``--tiny``: hidden 64, 2 layers, sequence 64, 2 steps, fp32 (a CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))

RUNS = ("fastdora", "axolotl_kernels", "peft")
REFERENCE = "peft"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KERNEL_KEYS = ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel", "lora_embedding_kernel")
SHAPES = {
    "h200": dict(hidden=2048, intermediate=8192, heads=16, kv_heads=8, layers=4, seq=2048, micro_batch=4, steps=60,
                 r=64, alpha=128, bf16=True),
    "tiny": dict(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=2, seq=64, micro_batch=2, steps=2, r=8,
                 alpha=16, bf16=False),
}


def build_model(work: str, shape: dict) -> str:
    import torch
    from _tiny import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = os.path.join(work, "model")
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return model_dir
    tok = build_tokenizer(model_dir)
    tok.model_max_length = 2 * shape["seq"]
    tok.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=2 * shape["seq"], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if shape["bf16"]:
        model = model.to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {model_dir}: Llama, hidden {shape['hidden']}, {shape['layers']} layers, {n / 1e6:.1f}M parameters, "
          f"vocab {len(tok)}, {'bf16' if shape['bf16'] else 'fp32'}")
    return model_dir


def build_data(work: str, shape: dict) -> str:
    """Random-word texts, each about two sequences long; Axolotl's completion format cuts them into full-length
    chunks, so every micro-batch is full (``pad_to_sequence_len`` too)."""
    from _tiny import _WORDS

    rng = random.Random(0)
    rows = shape["steps"] * shape["micro_batch"] // 2 + 8
    path = os.path.join(work, "data", "text.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(_WORDS) for _ in range(2 * shape["seq"]))}) + "\n")
    return path


def config_lines(work: str, shape: dict, run: str, model_dir: str, data: str) -> list:
    lines = [
        f"base_model: {model_dir}",
        "tokenizer_type: AutoTokenizer",
        "datasets:",
        f"  - path: {data}",
        "    ds_type: json",
        "    type: completion",
        f"dataset_prepared_path: {os.path.join(work, 'prepared')}",
        "val_set_size: 0",
        f"output_dir: {os.path.join(work, 'run_' + run)}",
        f"sequence_len: {shape['seq']}",
        "sample_packing: false",
        "pad_to_sequence_len: true",
        "adapter: lora",
        "peft_use_dora: true",
        f"lora_r: {shape['r']}",
        f"lora_alpha: {shape['alpha']}",
        "lora_dropout: 0.0",
        f"lora_target_modules: [{', '.join(TARGETS)}]",
        f"micro_batch_size: {shape['micro_batch']}",
        "gradient_accumulation_steps: 1",
        f"max_steps: {shape['steps']}",
        "num_epochs: 1",
        "optimizer: adamw_torch",
        "lr_scheduler: constant",
        "learning_rate: 0.0002",
        "warmup_steps: 0",
        f"bf16: {str(shape['bf16']).lower()}",
        "fp16: false",
        "tf32: false",
        "attn_implementation: sdpa",
        "gradient_checkpointing: true",
        "logging_steps: 1",
        "save_strategy: 'no'",
        "seed: 0",
        "dataloader_num_workers: 0",
        "plugins:",
        "  - axolotl_bench_probe.BenchProbePlugin",
    ]
    if run == "fastdora":
        lines.append("  - fastdora.plugins.axolotl.FastDoraPlugin")
    elif run == "peft":
        lines += [f"{k}: false" for k in KERNEL_KEYS]
    return lines


def prepare(work: str, tiny: bool) -> None:
    shape = SHAPES["tiny" if tiny else "h200"]
    os.makedirs(work, exist_ok=True)
    model_dir = build_model(work, shape)
    data = build_data(work, shape)
    for run in RUNS:
        path = os.path.join(work, run + ".yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(config_lines(work, shape, run, model_dir, data)) + "\n")
        print(f"config: {path}")
    with open(os.path.join(work, "shape.json"), "w", encoding="utf-8") as f:
        json.dump(shape, f)


def _curve_diff(a: list, b: list) -> dict | None:
    if not a or not b:
        return None
    da, db = dict((s, v) for s, v in a), dict((s, v) for s, v in b)
    steps = sorted(set(da) & set(db))
    if not steps:
        return None
    d = [abs(da[s] - db[s]) for s in steps]
    return {"steps": len(steps), "max_abs": max(d), "mean_abs": statistics.fmean(d),
            "final_abs": d[-1], "mean_abs_last10": statistics.fmean(d[-10:])}


def _load(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def collect(work: str, out: str) -> dict:
    shape = _load(os.path.join(work, "shape.json")) or {}
    status = _load(os.path.join(work, "status.json")) or {}
    runs = {}
    for run in RUNS:
        d = os.path.join(work, "run_" + run)
        probe = _load(os.path.join(d, "bench_probe.json"))
        rep = _load(os.path.join(d, "fastdora_report.json"))
        r = {"rc": status.get(run, {}).get("rc"), "wall_s": status.get(run, {}).get("wall_s"), "probe": probe}
        if probe:
            r.update(median_step_s=probe["median_step_s"], peak_alloc_gb=(probe["peak_alloc_bytes"] or 0) / 1e9,
                     losses=probe["losses"])
            layers = probe.get("layer_forwards") or {}
            r["dora_layers"] = probe["dora_layers"]
            r["dora_layers_forwarded"] = sum(1 for v in layers.values() if v["forwards"] > 0)
            r["dora_layers_all_triton"] = sum(1 for v in layers.values()
                                              if v["forwards"] > 0 and v["triton_forwards"] == v["forwards"])
        if rep is not None:
            r["fastdora_report"] = rep
        runs[run] = r
    ref = runs[REFERENCE].get("losses")
    diffs = {f"{run}_vs_{REFERENCE}": _curve_diff(runs[run].get("losses"), ref) for run in RUNS if run != REFERENCE}
    fd = runs["fastdora"]
    triton_every_layer = bool(fd.get("dora_layers")) and fd.get("dora_layers_all_triton") == fd.get("dora_layers")
    result = {"shape": shape, "runs": runs, "loss_diffs": diffs, "fastdora_triton_in_every_dora_layer":
              triton_every_layer, "versions": _load(os.path.join(work, "versions.json"))}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "axolotl_h200.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(out, "axolotl_h200.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)
    return result


def markdown(res: dict) -> str:
    s = res["shape"]
    v = res.get("versions") or {}
    head = (f"`axolotl train`, Llama hidden {s.get('hidden')}, {s.get('layers')} layers, DoRA r={s.get('r')} on "
            f"{', '.join(TARGETS)}, sequence {s.get('seq')}, micro-batch {s.get('micro_batch')}, "
            f"{s.get('steps')} steps, {'bf16' if s.get('bf16') else 'fp32'}, sdpa, gradient checkpointing. "
            + ", ".join(f"{k} {val}" for k, val in v.items()) + ".")
    rows = ["| run | rc | median step | vs PEFT DoRA | peak allocated | DoRA layers: forwarded / Triton in every "
            "forward | wall (whole `axolotl train`) |", "|---|---|---|---|---|---|---|"]
    ref = res["runs"][REFERENCE].get("median_step_s")
    names = {"fastdora": "fastdora plugin", "axolotl_kernels": "Axolotl's LoRA kernels (no plugin)",
             "peft": "stock PEFT DoRA (kernels off)"}
    for run in RUNS:
        r = res["runs"][run]
        med = r.get("median_step_s")
        rel = f"{med / ref:.3f}x" if med and ref else "-"
        tri = (f"{r.get('dora_layers_forwarded')} of {r.get('dora_layers')} / {r.get('dora_layers_all_triton')}"
               if r.get("dora_layers") is not None else "-")
        step = f"{med * 1000:.1f} ms" if med else "-"
        peak = f"{r['peak_alloc_gb']:.2f} GB" if r.get("peak_alloc_gb") else "-"
        rows.append(f"| {names[run]} | {r.get('rc')} | {step} | {rel} | {peak} | {tri} | {r.get('wall_s') or '-'} s |")
    lines = [head, "", *rows, ""]
    for k, d in res["loss_diffs"].items():
        lines.append(f"- loss curve {k.replace('_vs_', ' vs ')}: " + (
            "n/a" if d is None else f"{d['steps']} steps, max |diff| {d['max_abs']:.2e}, mean {d['mean_abs']:.2e}, "
            f"last 10 mean {d['mean_abs_last10']:.2e}"))
    rep = res["runs"]["fastdora"].get("fastdora_report") or {}
    lines.append(f"- fastdora: Triton path in every forward of every DoRA layer (steps "
                 f"{(res['runs']['fastdora'].get('probe') or {}).get('hook_steps')}): "
                 f"{res['fastdora_triton_in_every_dora_layer']}; report: {rep.get('report')}; path counter "
                 f"{rep.get('active_path_counter')}")
    return "\n".join(lines) + "\n"


def slim_bitsandbytes(wheel_dir: str, cuda: str) -> None:
    """Rewrite the bitsandbytes wheel in ``wheel_dir`` without the libraries of other CUDA / ROCm / XPU versions
    (their files and RECORD lines), so that the wheel set fits one carry to the GPU machine."""
    import glob
    import re
    import zipfile

    src = glob.glob(os.path.join(wheel_dir, "bitsandbytes-*.whl"))
    if len(src) != 1:
        raise SystemExit(f"expected one bitsandbytes wheel in {wheel_dir}, found {src}")
    drop = re.compile(r"libbitsandbytes_(?!cpu\.|cuda%s\.)\w+\.so" % re.escape(cuda))
    tmp = src[0] + ".tmp"
    with zipfile.ZipFile(src[0]) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        kept = [i for i in zin.infolist() if not drop.search(i.filename)]
        if not any(f"cuda{cuda}." in i.filename for i in kept):
            raise SystemExit(f"the bitsandbytes wheel has no library for CUDA {cuda}")
        for item in kept:
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(True) if not drop.search(line)).encode()
            zout.writestr(item, data)
    os.replace(tmp, src[0])


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("work")
    pp.add_argument("--tiny", action="store_true")
    pc = sub.add_parser("collect")
    pc.add_argument("work")
    pc.add_argument("out")
    ps = sub.add_parser("slim-bnb")
    ps.add_argument("dir")
    ps.add_argument("cuda")
    a = p.parse_args()
    if a.cmd == "prepare":
        prepare(a.work, a.tiny)
    elif a.cmd == "collect":
        collect(a.work, a.out)
    else:
        slim_bitsandbytes(a.dir, a.cuda)


if __name__ == "__main__":
    main()
