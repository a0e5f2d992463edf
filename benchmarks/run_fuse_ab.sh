#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (~5 min): fuse_lora_b on vs off at the model level, and the GPU layer tests.
#   GPU 0: model_bench --plan amp_fuse (LoRA, fastdora, fastdora_nofuse, fastdora, fastdora_nofuse, PEFT DoRA)
#   GPU 1: tests/test_gpu_layers.py, then model_bench --plan bf16_fuse
#   bash benchmarks/run_fuse_ab.sh        (writes $OUT/fuse_ab_{amp,bf16}.json and logs)
set -u
source "$(dirname "$0")/_env.sh"  # $OUT, PYTHONPATH -> this checkout's core/ as fastdora
( CUDA_VISIBLE_DEVICES=1 timeout 110 python3 -m pytest -q -m gpu tests/test_gpu_layers.py -p no:cacheprovider \
    > "$OUT/gpu_layer_tests.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 python3 benchmarks/model_bench.py --out /tmp/fb --plan bf16_fuse --budget-s 170 --repeats 7 \
    > "$OUT/fuse_ab_bf16.log" 2>&1; cp /tmp/fb/model_bench.json "$OUT/fuse_ab_bf16.json" ) &
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/model_bench.py --out /tmp/fa --plan amp_fuse --budget-s 170 --repeats 7 \
  > "$OUT/fuse_ab_amp.log" 2>&1; cp /tmp/fa/model_bench.json "$OUT/fuse_ab_amp.json"
wait
tail -1 "$OUT/gpu_layer_tests.log"
grep -hE "done|FAIL|SKIP" "$OUT/fuse_ab_amp.log" "$OUT/fuse_ab_bf16.log" | cut -c1-170
python3 - "$OUT" <<'PY'
import json, sys, statistics
for s in ("amp", "bf16"):
    try:
        d = json.load(open(f"{sys.argv[1]}/fuse_ab_{s}.json"))
    except Exception as e:
        print(s, e); continue
    for r in d["results"]:
        it = [x for x, g in zip(r["grad_iter_s_all"], r["grad_iter_gc_ms_all"]) if g < 50]
        print(s, r["variant"], "median %.3f min %.3f (no-GC iters %d) peak %.2f GB" % (statistics.median(it), min(it), len(it), r["train_peak_alloc_gb"]))
PY
