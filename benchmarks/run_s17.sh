#!/usr/bin/env bash
# Device script (session 17, nvidia-h200), from the repository root:
#   bash benchmarks/run_s17.sh tma     benchmarks/u_tma_probe.py: the AMP U pass with TMA descriptor loads (plain,
#                                      persistent, warp-specialised) vs the pointer-load kernel (call 1)
#   bash benchmarks/run_s17.sh tmanorm the whole AMP norm per Qwen3-8B shape, defaults vs pointer loads and other
#                                      chunkings (calls 2-3 ran the script's earlier version: the TMA pass patched
#                                      into the then-shipped code; see git history)
#   bash benchmarks/run_s17.sh check   norm and launcher GPU tests, the U-split sweep of the whole norm per shape
#                                      (norm_breakdown.py --parts usplit), host_probe.py AMP (call 5)
#   bash benchmarks/run_s17.sh final   the GPU suite (-m gpu), the whole norm per shape (defaults), then
#                                      host_probe.py AMP (lora, fastdora): the norm kernels' share of an iteration
set -uo pipefail
source benchmarks/_env.sh
t0=$(date +%s)
case "${1:-tma}" in
  tma)
    (cd benchmarks && python u_tma_probe.py --parts u --out $OUT/u_tma.json) 2>&1 | grep -v -e Warn -e _warn_once \
      | cut -c1-1500 > $OUT/u_tma.log
    ;;
  tmanorm)
    (cd benchmarks && python u_tma_probe.py --parts norm --out $OUT/u_tma_norm.json) 2>&1 \
      | grep -v -e Warn -e _warn_once | cut -c1-1500 > $OUT/u_tma_norm.log
    ;;
  check)
    python -m pytest tests/test_kernels_gpu.py tests/test_launch.py -m gpu -q -p no:cacheprovider -rf \
      -k "norm or gram or launch" 2>&1 | tail -15 | tee $OUT/gpu_norm_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    python benchmarks/norm_breakdown.py --parts usplit --out $OUT/norm_usplit.json 2>&1 \
      | grep -v -e Warn -e _warn_once | cut -c1-3000 > $OUT/norm_usplit.log
    python benchmarks/host_probe.py --setup amp --variants lora,fastdora --out $OUT/hp_amp 2>&1 \
      | grep -v -e Warn -e _warn_once > $OUT/host_probe_amp.log
    cp $OUT/hp_amp/hp_*.json $OUT/ 2>/dev/null; rm -rf $OUT/hp_amp
    grep "norm kernels" $OUT/host_probe_amp.log
    ;;
  final)
    python -m pytest tests -m gpu -q -p no:cacheprovider -rf 2>&1 > $OUT/gpu_tests_full.log
    tail -25 $OUT/gpu_tests_full.log | tee $OUT/gpu_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    python benchmarks/norm_breakdown.py --parts none --out $OUT/norm_defaults.json 2>&1 \
      | grep -v -e Warn -e _warn_once | cut -c1-3000 > $OUT/norm_defaults.log
    python benchmarks/host_probe.py --setup amp --variants lora,fastdora --out $OUT/hp_amp 2>&1 \
      | grep -v -e Warn -e _warn_once > $OUT/host_probe_amp.log
    cp $OUT/hp_amp/hp_*.json $OUT/ 2>/dev/null; rm -rf $OUT/hp_amp
    grep "norm kernels" $OUT/host_probe_amp.log
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
cd $OUT && tar czf s17_call.tgz $(ls *.json *.log 2>/dev/null) && ls -la
[ "$(ls | wc -l)" -le 8 ] || find . -maxdepth 1 -type f ! -name s17_call.tgz ! -name gpu_tests.log ! -name times.log \
  ! -name host_probe_amp.log -delete  # at most 8 files come back: the rest stays in the tarball
