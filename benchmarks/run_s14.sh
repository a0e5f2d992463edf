#!/usr/bin/env bash
# Device script (session 14, nvidia-h200): GPU suite; the norm per Qwen3-8B shape with B G in the U pass (default) vs
# in the combine kernel vs session 12's core/ (OLD_PKG, default .carry/s12); the backward kernel configuration sweep;
# one profiled AMP iteration per variant (kernel-time breakdown: the norm recompute's share).
#   bash benchmarks/run_s14.sh            (from the repository root; call 1)
#   BWD_CFGS='[[64,128,8,8,false,false,null],[64,128,8,4,false,true,null]]' BWD_ROUNDS=3 bash benchmarks/run_s14.sh
#                                         (call 2: the default backward configuration vs the sweep's best, 3 rounds)
set -uo pipefail
source benchmarks/_env.sh
OLD=${OLD_PKG:-.carry/s12}
t0=$(date +%s)
python -m pytest tests/test_kernels_gpu.py tests/test_gpu_layers.py -m gpu -q -p no:cacheprovider 2>&1 | tail -12 \
  | tee $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - t0 )) s"
python benchmarks/kernels_bench.py --sections norm_modes --old-pkg $OLD --out $OUT/norm_modes.json 2>&1 \
  | grep -v -e Warn -e _warn_once | cut -c1-600 > $OUT/norm_modes.log
echo "norm $(( $(date +%s) - t0 )) s"
python benchmarks/kernels_bench.py --sections bwd_sweep --out $OUT/bwd_sweep.json ${BWD_CFGS:+--bwd-cfgs "$BWD_CFGS"} \
  --bwd-rounds ${BWD_ROUNDS:-1} 2>&1 | grep -v -e Warn -e _warn_once > $OUT/bwd_sweep.log
echo "sweep $(( $(date +%s) - t0 )) s"
if [ "${HOST:-1}" = 1 ]; then
  python benchmarks/host_probe.py --setup amp --variants lora,fastdora --out $OUT/hp_amp 2>&1 \
    | grep -v -e Warn -e _warn_once > $OUT/host_probe_amp.log
  cp $OUT/hp_amp/*.json $OUT/ 2>/dev/null; rm -rf $OUT/hp_amp
fi
echo "total $(( $(date +%s) - t0 )) s"
cd $OUT && tar czf s14_call.tgz *.json *.log && find . -maxdepth 1 -type f ! -name s14_call.tgz ! -name gpu_tests.log -delete; ls -la
