#!/usr/bin/env bash
# Device script (session 14 call 3, nvidia-h200): the GPU suite on the final code, the composition kernels' table
# (new backward configuration), the norm per Qwen3-8B shape vs session 12's core/ (OLD_PKG, default .carry/s12), and
# one profiled iteration per variant, AMP then pure bf16 (kernel-time breakdown: the norm recompute's share).
#   bash benchmarks/run_s14_final.sh      (from the repository root)
set -uo pipefail
source benchmarks/_env.sh
OLD=${OLD_PKG:-.carry/s12}
t0=$(date +%s)
python -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -12 | tee $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - t0 )) s"
python benchmarks/kernels_bench.py --sections copy,compose --out $OUT/compose.json 2>&1 | grep -v -e Warn -e _warn_once \
  | tail -40 > $OUT/compose.log
echo "compose $(( $(date +%s) - t0 )) s"
python benchmarks/kernels_bench.py --sections norm_modes --old-pkg $OLD --out $OUT/norm_modes.json 2>&1 \
  | grep -v -e Warn -e _warn_once | cut -c1-600 > $OUT/norm_modes.log
echo "norm $(( $(date +%s) - t0 )) s"
for setup in amp bf16; do
  if [ $(( $(date +%s) - t0 )) -lt ${HOST_BUDGET_S:-420} ]; then
    python benchmarks/host_probe.py --setup $setup --variants lora,fastdora --out $OUT/hp_$setup 2>&1 \
      | grep -v -e Warn -e _warn_once > $OUT/host_probe_$setup.log
    for f in $OUT/hp_$setup/*.json; do cp $f $OUT/$(basename $f .json)_$setup.json; done; rm -rf $OUT/hp_$setup
  fi
  echo "host $setup $(( $(date +%s) - t0 )) s"
done
cd $OUT && tar czf s14_final.tgz *.json *.log && find . -maxdepth 1 -type f ! -name s14_final.tgz ! -name gpu_tests.log -delete; ls -la
