#!/usr/bin/env bash
# Device script (session 15, nvidia-h200): GPU suite, then the whole norm per Qwen3-8B shape at r=384 per product mode
# (norm_modes: AMP with A split in registers vs split once into bf16 parts, whole or in K chunks within the working-set
# limit; pure bf16), each with its error vs fp64 (also where the quadratic term dominates, at 1024x4096) and its peak
# working set; then one profiled AMP iteration per variant (the norm recompute's share of the kernel time).
#   bash benchmarks/run_s15.sh            (from the repository root; call 2. Call 1 ran the norm GPU tests
#                                          (-k norm) and norm_modes with the variants listed in kernels_bench.py)
set -uo pipefail
source benchmarks/_env.sh
t0=$(date +%s)
python -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
python benchmarks/kernels_bench.py --sections norm_modes --out $OUT/norm_modes.json 2>&1 \
  | grep -v -e Warn -e _warn_once | cut -c1-4000 > $OUT/norm_modes.log
echo "norm $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
if [ $(( $(date +%s) - t0 )) -lt ${HOST_BUDGET_S:-360} ]; then
  python benchmarks/host_probe.py --setup amp --variants lora,fastdora --out $OUT/hp_amp 2>&1 \
    | grep -v -e Warn -e _warn_once > $OUT/host_probe_amp.log
  cp $OUT/hp_amp/*.json $OUT/ 2>/dev/null; rm -rf $OUT/hp_amp
fi
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
cd $OUT && tar czf s15_call.tgz *.json *.log && ls -la
