#!/usr/bin/env bash
# fastdora vs stock PEFT DoRA under FSDP1 / FSDP2 / DeepSpeed ZeRO-2 / ZeRO-3 on 2 GPUs, plus the 1-GPU reference.
# Run from the repo root on a 2-GPU machine (device tool kind nvidia-h200-x2; carry .whl for deepspeed and its deps:
# deepspeed-0.19.8 (pure Python), hjson, pydantic, pydantic_core, annotated-types, typing-inspection).
# Writes $OUT/multigpu_h200x2.json (all runs) and $OUT/log.txt.
set -uo pipefail
OUT=${OUT:-/tmp/fastdora_multigpu}
mkdir -p "$OUT" /tmp/fdres
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# `import fastdora` without installing: core/ is the fastdora package
mkdir -p /tmp/fdpkg && ln -sfn "$PWD/core" /tmp/fdpkg/fastdora && export PYTHONPATH=/tmp/fdpkg:${PYTHONPATH:-}
# Qwen3-like: 4 decoder layers, hidden 2048, MLP 6144, 16 heads (8 KV, head_dim 128), vocab 32768; DoRA r=16 on all
# 28 linear layers; bf16; gradient checkpointing; 2 ranks x micro-batch 2 x seq 1024, 2 accumulation steps; 20 steps;
# learnable data (arithmetic token sequences, --data pattern) and lr 1e-3, so the loss falls within the 20 steps.
PY=${PY:-python3}
ARGS=${ARGS:-"--steps 20 --grad-accum 2 --micro-bs 2 --seq 1024 --layers 4 --hidden 2048 --inter 6144 --heads 16 --kv-heads 8
      --head-dim 128 --vocab 32768 --rank 16 --lr 1e-3 --bf16 --data pattern"}
ARGS="$ARGS --out /tmp/fdres"
$PY -c "import torch, deepspeed; print(torch.__version__, torch.cuda.device_count(), deepspeed.__version__)" 2>&1 | tail -1 | tee "$OUT/log.txt"
ENGINES=fsdp1,fsdp2,zero2,zero3
$PY -c "import deepspeed" 2>/dev/null || ENGINES=fsdp1,fsdp2
timeout 330 $PY -m torch.distributed.run --nproc_per_node 2 benchmarks/multigpu/train_dist.py --engines $ENGINES $ARGS 2>&1 | grep -v -i warn | tee -a "$OUT/log.txt"
CUDA_VISIBLE_DEVICES=0 timeout 90 $PY benchmarks/multigpu/train_dist.py --engines single --global-world 2 $ARGS 2>&1 | grep -v -i warn | tee -a "$OUT/log.txt"
$PY - "$OUT" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/fdres/*.json"))}
summary = {}
for name, r in runs.items():
    eng, impl = name.split("-")
    other = runs.get(f"{eng}-{'peft' if impl == 'fastdora' else 'fastdora'}")
    ref = runs.get("single-fastdora")
    def rel(a, b):
        return max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"])) if a and b else None
    summary[name] = {"final_loss": r["losses"][-1], "peak_mem_gib": r["peak_mem_gib"],
                     "median_step_time_s": r["median_step_time_s"],
                     "max_rel_loss_diff_vs_other_impl_same_engine": rel(r, other),
                     "max_rel_loss_diff_vs_single_gpu_fastdora": rel(r, ref)}
json.dump({"summary": summary, "runs": runs}, open(os.path.join(sys.argv[1], "multigpu_h200x2.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
