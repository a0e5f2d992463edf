#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (< 6 min): the norm's product modes and tilings, and the GPU suite.
#   GPU 1: the GPU test suite (defaults), then the norm GPU tests again with each candidate mode forced
#          (_ONE_PRODUCT_HALF = True: bf16/fp16 W and A as one exact product; _SPLIT_PARTS = 2: AMP hi + mid)
#   GPU 0: kernels_bench.py --sections norm_modes (time + error vs fp64 per mode, U split over K, G tilings)
#   bash benchmarks/run_norm_modes.sh      (writes $OUT/norm_modes.json, $OUT/norm_modes.log)
set -u
OUT=${OUT:-$PWD/benchmarks/results/session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mkdir -p /tmp/fdp/fastdora && for f in "$PWD"/core/*; do ln -sfn "$f" /tmp/fdp/fastdora/; done
ln -sfn "$PWD/plugins" /tmp/fdp/fastdora/plugins
export PYTHONPATH=/tmp/fdp
forced() {  # $1: python statements run on fastdora.kernels.norm (kn) before the norm GPU tests
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -c "
import sys, pytest
import fastdora.kernels.norm as kn
$1
sys.exit(pytest.main(['-q', '-m', 'gpu', 'tests/test_kernels_gpu.py', '-k', 'norm', '-p', 'no:cacheprovider']))"
}
( CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_gpu_layers.py \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  { echo "== forced: _ONE_PRODUCT_HALF = True"; forced "kn._ONE_PRODUCT_HALF = True" 2>&1 | grep -E "Error|rel err|passed|failed" | tail -40
    echo "== forced: _SPLIT_PARTS = 2"; forced "kn._SPLIT_PARTS = 2" 2>&1 | grep -E "Error|rel err|passed|failed" | tail -40
  } > "$OUT/gpu_tests_forced.log" 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/kernels_bench.py --sections norm_modes --out "$OUT/norm_modes.json" \
  > "$OUT/norm_modes.log" 2>&1
wait
tail -2 "$OUT/gpu_tests.log"; cat "$OUT/gpu_tests_forced.log" | cut -c1-300
grep -v "G best" "$OUT/norm_modes.log" | python3 -c "
import sys, json
for line in sys.stdin:
    if not line.startswith('{'): print(line.rstrip()[:300]); continue
    r = json.loads(line)
    print(r['shape'], r['AB'], 'eager', '%.2g' % r['eager_relerr'], 'ksplit', {k: round(v, 3) for k, v in r['U_ksplit_ms'].items()})
    for v in r['variants']:
        print('   ', v['name'][:40], v['U_ms'] if isinstance(v['U_ms'], str) else round(v['U_ms'], 4), v['norm_cached_base_ms'] and round(v['norm_cached_base_ms'], 4), v['relerr'] and '%.2g' % v['relerr'])
"
grep "G best" "$OUT/norm_modes.log" | cut -c1-400
