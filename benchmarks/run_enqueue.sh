#!/usr/bin/env bash
# Device script (session 13): pure host cost per micro-batch behind a sleeping GPU, and where the GPU idles.
#   bash benchmarks/run_enqueue.sh            (from the repository root, on the H200; results in $OUT)
set -uo pipefail
source benchmarks/_env.sh
P="python benchmarks/enqueue_probe.py"
for setup in amp bf16; do
  $P --setup $setup --out $OUT/eq_$setup.json 2>&1 | grep -v '^{' | tee $OUT/eq_$setup.log
done
$P --setup amp --breakdown --rounds 5 --out $OUT/eq_amp_breakdown.json 2>&1 | grep -v '^{' | tee $OUT/eq_amp_breakdown.log
for setup in amp bf16; do
  $P --setup $setup --layers 8 --rounds 3 --gaps 2 --variants lora,fastdora --out $OUT/eq_${setup}_L8.json 2>&1 \
    | grep -v '^{' | tee $OUT/eq_${setup}_L8.log
done
