#!/usr/bin/env bash
# Device script (session 13): backward kernel L2 policy (default vs evict_first on the dy / inner loads), GPU kernel
# tests, then the compose section at the default policy.   bash benchmarks/run_evict.sh   (results in $OUT)
set -uo pipefail
source benchmarks/_env.sh
python -m pytest tests/test_kernels_gpu.py -m gpu -q -x -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/gpu_kernel_tests.log
python benchmarks/kernels_bench.py --sections copy,evict --out $OUT/evict.json 2>&1 | tee $OUT/evict.log \
  | grep -v "^{"
python3 - "$OUT/evict.json" <<'PY'
import json, sys, statistics
rows = json.load(open(sys.argv[1]))["evict"]
for key in sorted({(r["tokens"], r["d"], r["mode"]) for r in rows}):
    med = {p: statistics.median(r["bwd_pct"] for r in rows if (r["tokens"], r["d"], r["mode"]) == key
                                and r["policy"] == p) for p in ("default", "evict_first")}
    print(key, " ".join(f"{p} {v:.1f}%" for p, v in med.items()))
PY
