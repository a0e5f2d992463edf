#!/usr/bin/env bash
# One device call on ONE GPU (nvidia-h200), nothing else running: the model benchmark's r=384 plans one after the
# other (each variant still in its own process), to compare against runs where the AMP and bf16 plans shared a host
# on two GPUs. Default plans: amp_fuse then bf16_fuse (LoRA, fuse_lora_b on / off alternating, PEFT DoRA).
#   bash benchmarks/run_seq.sh [PLAN ...]      (writes $OUT/model_bench.{json,md,png}, $OUT/model_<plan>.log)
set -u
source "$(dirname "$0")/_env.sh"  # $OUT, PYTHONPATH -> this checkout's core/ as fastdora
plans=("$@"); [ ${#plans[@]} = 0 ] && plans=(amp_fuse bf16_fuse)
reports=()
for p in "${plans[@]}"; do
  python3 benchmarks/model_bench.py --out "/tmp/mb_$p" --plan "$p" --budget-s 280 --repeats 7 \
    ${OLD_PKG:+--old-pkg "$OLD_PKG"} > "$OUT/model_$p.log" 2>&1
  reports+=("/tmp/mb_$p/model_bench.json")
  grep -E "done|FAIL|SKIP" "$OUT/model_$p.log" | cut -c1-170
done
python3 benchmarks/model_bench.py --report "$(IFS=,; echo "${reports[*]}")" --report-out "$OUT" > /dev/null 2>&1
python3 - "$OUT/model_bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); rows = d["results"] if "results" in d else d
for x in rows:
    print(x["setup"], x["variant"], "median %.3f" % x["grad_iter_s"], "all", " ".join("%.3f" % v for v in x["grad_iter_s_all"]),
          "gc", " ".join("%.0f" % v for v in x["grad_iter_gc_ms_all"]))
PY
