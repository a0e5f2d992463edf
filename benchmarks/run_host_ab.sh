#!/usr/bin/env bash
# Device script (session 13): host-path before/after in ONE process per setup. OLD_PKG (default .carry/s12) holds the
# earlier package as DIR/fastdora; variants lora, fastdora (this checkout), fastdora_old.
#   bash benchmarks/run_host_ab.sh [gpu]     (from the repository root; "gpu" first runs the GPU test suite)
set -uo pipefail
source benchmarks/_env.sh
OLD=${OLD_PKG:-.carry/s12}
if [ "${1:-}" = gpu ]; then
  python -m pytest tests -m gpu -q -x -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests.log
fi
python benchmarks/launch_cost.py --out $OUT/launch_cost.json 2>&1 | grep -v Warn | tee $OUT/launch_cost.log
for setup in amp bf16; do
  python benchmarks/enqueue_probe.py --setup $setup --layers 8 --rounds 5 --variants lora,fastdora,fastdora_old \
    --old-pkg $OLD --out $OUT/eq_${setup}_L8.json 2>&1 | grep -v -e '^{' -e Warn -e _warn_once | tee $OUT/eq_${setup}_L8.log
done
for setup in amp bf16; do
  python benchmarks/stall_probe.py --setup $setup --rounds 5 --conditions default \
    --variants lora,fastdora,fastdora_old --old-pkg $OLD --out $OUT/stall_${setup}.json 2>&1 \
    | grep -v -e '^{' -e Warn -e _warn_once | tee $OUT/stall_${setup}.log
done
