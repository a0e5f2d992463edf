#!/usr/bin/env bash
# Device script (session 16, nvidia-h200), from the repository root:
#   bash benchmarks/run_s16.sh breakdown   the norm GPU tests (-k "norm or gram"), then benchmarks/norm_breakdown.py
#                                          (per Qwen3-8B shape at r=384: G pass from upper-triangle vs all tiles,
#                                          K-split sweeps of the U and G passes, cuBLAS fp32 G for comparison)
#   bash benchmarks/run_s16.sh variants    norm_breakdown.py's U-pass variants and U-split sweeps
#   bash benchmarks/run_s16.sh chained     the norm GPU tests, then norm_breakdown.py's U-pass variants, U-split and
#                                          G-split sweeps (U passes chained, G partials packed)
#   bash benchmarks/run_s16.sh final       the GPU suite (-m gpu), the whole norm per shape (defaults and U_VARIANTS;
#                                          call 4: NB_PARTS=none, defaults only), then host_probe.py AMP (lora,
#                                          fastdora): the norm kernels' share of an iteration (calls 4 and 5)
#   bash benchmarks/run_s16.sh normtests   the norm GPU tests alone (call 6)
set -uo pipefail
source benchmarks/_env.sh
t0=$(date +%s)
case "${1:-breakdown}" in
  breakdown)
    python -m pytest tests/test_kernels_gpu.py -m gpu -q -p no:cacheprovider -k "norm or gram" 2>&1 | tail -15 \
      | tee $OUT/gpu_norm_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    python benchmarks/norm_breakdown.py --out $OUT/norm_breakdown.json 2>&1 | grep -v -e Warn -e _warn_once \
      | cut -c1-6000 > $OUT/norm_breakdown.log
    ;;
  variants)  # call 2 (session 16's U_VARIANTS then: two chained accumulators, chained one-product rows) + splits
    python benchmarks/norm_breakdown.py --parts ucfg,usplit --out $OUT/norm_variants.json 2>&1 \
      | grep -v -e Warn -e _warn_once | cut -c1-8000 > $OUT/norm_variants.log
    ;;
  chained)  # call 3: chained U passes and packed G partials as defaults: norm GPU tests, then the variants and sweeps
    python -m pytest tests/test_kernels_gpu.py -m gpu -q -p no:cacheprovider -k "norm or gram" 2>&1 | tail -15 \
      | tee $OUT/gpu_norm_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    python benchmarks/norm_breakdown.py --parts ucfg,usplit,gsplit --out $OUT/norm_chained.json 2>&1 \
      | grep -v -e Warn -e _warn_once | cut -c1-8000 > $OUT/norm_chained.log
    ;;
  final)  # call 4: the GPU suite, the defaults' norm per shape, one profiled AMP iteration (norm share)
    python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
    tail -25 $OUT/gpu_tests_full.log | tee $OUT/gpu_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    python benchmarks/norm_breakdown.py --parts ${NB_PARTS:-ucfg} --out $OUT/norm_defaults.json 2>&1 \
      | grep -v -e Warn -e _warn_once | cut -c1-3000 > $OUT/norm_defaults.log
    python benchmarks/host_probe.py --setup amp --variants lora,fastdora --out $OUT/hp_amp 2>&1 \
      | grep -v -e Warn -e _warn_once > $OUT/host_probe_amp.log
    cp $OUT/hp_amp/hp_*.json $OUT/ 2>/dev/null; rm -rf $OUT/hp_amp
    grep "norm kernels" $OUT/host_probe_amp.log
    ;;
  normtests)  # call 6: the norm GPU tests on the final core/ (after call 5's experiment was taken out again)
    python -m pytest tests/test_kernels_gpu.py -m gpu -q -p no:cacheprovider -rf -k "norm or gram" 2>&1 | tail -15 \
      | tee $OUT/gpu_norm_tests.log
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
cd $OUT && tar czf s16_call.tgz $(ls *.json *.log 2>/dev/null) && ls -la
[ "$(ls | wc -l)" -le 8 ] || find . -maxdepth 1 -type f ! -name s16_call.tgz ! -name gpu_tests.log ! -name times.log \
  ! -name host_probe_amp.log -delete  # at most 8 files come back: the rest stays in the tarball
