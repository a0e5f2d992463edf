#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (< 6 min): the norm's product / accumulation modes, and the GPU suite.
#   GPU 1: the GPU test suite (defaults), then (FORCED=1, default) the norm GPU tests again with candidate modes forced
#   GPU 0: kernels_bench.py --sections norm_modes (time + error vs fp64 per mode; OLD_PKG's norm side by side)
#   MODEL=1: then the model benchmark's r=384 targets, AMP on GPU 0 and pure bf16 on GPU 1 (LoRA, fastdora, PEFT
#            DoRA, and OLD_PKG's fastdora when given; plans "amp[_ab]" / "bf16[_ab]"), merged into
#            $OUT/model_bench.{json,md,png}
#   HOST=1: then host_probe.py (host time per micro-batch, GPU kernel-time breakdown), bf16 and AMP
#   KB=sections: after norm_modes, these kernels_bench.py sections on GPU 0 ($OUT/kernels.json; e.g. compose,layer)
#   PLAN_AMP / PLAN_BF16: the model benchmark's plans (default amp[_ab] / bf16[_ab])
#   bash benchmarks/run_norm_modes.sh [OLD_PKG]     (writes $OUT/norm_modes.json, $OUT/norm_modes.log, test logs)
set -u
source "$(dirname "$0")/_env.sh"  # $OUT, PYTHONPATH -> this checkout's core/ as fastdora
OLD=${1:-}
forced() {  # $1: python statements run on fastdora.kernels.norm (kn) before the norm GPU tests
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -c "
import sys, pytest
import fastdora.kernels.norm as kn
$1
sys.exit(pytest.main(['-q', '-m', 'gpu', 'tests/test_kernels_gpu.py', '-k', 'norm', '-p', 'no:cacheprovider']))"
}
( CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_gpu_layers.py \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  [ "${FORCED:-1}" = 1 ] && for f in "kn._ACC_OVERRIDE.update({1: (2, False), 'G': (2, False), 0: (2, False)})" \
           "kn._ONE_PRODUCT_HALF = True; kn._ACC_OVERRIDE.update({'one': (2, False), 'G1': (2, False)})" \
           "kn._SPLIT_PARTS = 2; kn._ACC_OVERRIDE.update({1: (2, False), 'G': (2, False)})"; do
    echo "== forced: $f"; forced "$f" 2>&1 | grep -E "Error|rel err|passed|failed" | tail -30
  done > "$OUT/gpu_tests_forced.log" 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/kernels_bench.py --sections norm_modes --out "$OUT/norm_modes.json" \
  ${OLD:+--old-pkg "$OLD"} > "$OUT/norm_modes.log" 2>&1
[ -n "${KB:-}" ] && CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/kernels_bench.py --sections "$KB" \
  --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
wait
[ -n "${KB:-}" ] && grep -vE "^\s*$" "$OUT/kernels.log" | tail -40 | cut -c1-250
tail -2 "$OUT/gpu_tests.log"; grep -E "^FAILED|Error" "$OUT/gpu_tests.log" | head; cut -c1-300 "$OUT/gpu_tests_forced.log"
python3 - "$OUT/norm_modes.log" <<'PY'
import sys, json
for line in open(sys.argv[1]):
    if not line.startswith('{'):
        print(line.rstrip()[:300]); continue
    r = json.loads(line)
    print(r['shape'], r['AB'], 'eager %.2g' % r['eager_relerr'], 'old %.4f ms (gpu %.4f) %.2g' % (r['old_ms'], r['old_gpu_ms'], r['old_relerr']) if 'old_ms' in r else '')
    for v in r['variants']:
        if 'error' in v: print('   ', v['name'], v['error'][:200]); continue
        print('    %-16s %.4f ms (gpu %.4f, +base %.4f)  err %.2g  det %s  usplit %s' % (v['name'], v['ms'], v['gpu_ms'], v['ms_with_base'], v['relerr'], v['deterministic'], v['u_split']))
PY
if [ "${MODEL:-0}" = 1 ]; then
  ab=""; [ -n "$OLD" ] && ab="_ab"
  (CUDA_VISIBLE_DEVICES=1 python3 benchmarks/model_bench.py --out /tmp/mb1 --plan ${PLAN_BF16:-bf16$ab} --budget-s 240 --repeats 7 \
    ${OLD:+--old-pkg "$OLD"} > "$OUT/model_bf16.log" 2>&1) &
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/model_bench.py --out /tmp/mb0 --plan ${PLAN_AMP:-amp$ab} --budget-s 240 --repeats 7 \
    ${OLD:+--old-pkg "$OLD"} > "$OUT/model_amp.log" 2>&1
  wait
  python3 benchmarks/model_bench.py --report /tmp/mb0/model_bench.json,/tmp/mb1/model_bench.json --report-out "$OUT" \
    > /dev/null 2>&1
  grep -E "done|FAIL|SKIP" "$OUT/model_amp.log" "$OUT/model_bf16.log" | cut -c1-170
  grep -B2 -A26 "### Targets" "$OUT/model_bench.md" | grep -E "^\|" | head -24
fi
if [ "${HOST:-0}" = 1 ]; then  # host probe with a GPU kernel-time breakdown, bf16 on GPU 0 and AMP on GPU 1
  v=lora,fastdora; [ -n "$OLD" ] && v=lora,fastdora,fastdora_old
  (CUDA_VISIBLE_DEVICES=1 timeout 170 python3 benchmarks/host_probe.py --out /tmp/hpa --variants $v --repeats 3 \
    ${OLD:+--old-pkg "$OLD"} > "$OUT/host_probe_amp.log" 2>&1; cp /tmp/hpa/host_probe.json "$OUT/host_probe_amp.json") &
  CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/host_probe.py --out /tmp/hpb --setup bf16 --variants $v \
    --repeats 3 ${OLD:+--old-pkg "$OLD"} > "$OUT/host_probe_bf16.log" 2>&1; cp /tmp/hpb/host_probe.json "$OUT/host_probe_bf16.json"
  wait
  grep -hE "^####|one iteration on the GPU|host under" "$OUT/host_probe_amp.log" "$OUT/host_probe_bf16.log" | cut -c1-300
fi
