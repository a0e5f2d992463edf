#!/usr/bin/env bash
# Device script (session 24, nvidia-h200), from the repository root; no carry needed (the image's PEFT).
#
#   bash benchmarks/run_s24.sh fuse      the C++ node built first (no worker builds it), the whole GPU test suite
#                                        (incl. the fused node's compose_b tests), then fuse_lora_b on vs off:
#                                        model_bench --plan bf16_fuse, then amp_fuse, in exec workers (LoRA, on, off,
#                                        on, off, PEFT DoRA at Qwen3-8B r=384; FUSE_S seconds each, default 140)
#   bash benchmarks/run_s24.sh ab        the fused node's GPU tests (tests/test_native_node.py -m gpu), then this core/
#                                        vs an earlier one (OLD_PKG/fastdora, carried; e.g. e71a7fb, session 23's
#                                        measured code) alternating in exec workers: model_bench --plan bf16, then amp,
#                                        --sequence lora,fastdora,fastdora_old,fastdora,fastdora_old,lora (AB_S seconds
#                                        each, default 170), with the GPU's clocks / power / throttle reasons sampled
#                                        every 200 ms (smi.csv)
#   bash benchmarks/run_s24.sh var       process-to-process variance, this core/ vs OLD_PKG's (both C++ nodes built first):
#                                        model_bench --plan ${SETUP:-bf16} --sequence (one throw-away fastdora worker
#                                        that compiles the Triton kernels, then LoRA, new, old x3, LoRA) in exec
#                                        workers, then the same in forked workers; per worker the host's enqueue time
#                                        per iteration and each thread's CPU time / context switches (JSON); host.txt:
#                                        lscpu, the GPU's clocks; smi.csv sampled every 200 ms
#   bash benchmarks/run_s24.sh suite     the whole GPU test suite (pytest tests -m gpu; TESTS_S, default 420: call 1's 220 s
#                                        cut it after 153 tests), then the harness (BENCH_S, default 0: none)
#   bash benchmarks/run_s24.sh harness   issue 5's whole harness: model_bench.py --plan h200 (BENCH_S, default 520)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]; node; smi_start
case "${1:-fuse}" in
  fuse)
    node
    timeout ${TESTS_S:-220} python -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -25 > $OUT/gpu_tests.log
    tail -8 $OUT/gpu_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    for p in bf16_fuse amp_fuse; do bench $p ${FUSE_S:-140} --spawn exec; done
    ;;
  ab)
    node
    smi_start
    timeout ${TESTS_S:-150} python -m pytest tests/test_native_node.py -m gpu -q -p no:cacheprovider 2>&1 | tail -25 \
      > $OUT/gpu_tests_native.log
    tail -8 $OUT/gpu_tests_native.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    for p in bf16 amp; do  # session 24 call 2 ran these as plans bf16_ab2 / amp_ab2: the same configs in this order
      TAG=${p}_ab2 bench $p ${AB_S:-170} --spawn exec --old-pkg ${OLD_PKG:-.carry/prevpkg} \
        --sequence lora,fastdora,fastdora_old,fastdora,fastdora_old,lora
    done
    kill $smi
    ;;
  var)
    { lscpu; nvidia-smi -q -d CLOCK,PERFORMANCE,POWER; } > $OUT/host.txt 2>&1
    node
    python - ${OLD_PKG:-.carry/prevpkg} <<'PY' 2>&1 | grep -v Warn | tail -2
import os, sys
sys.path.insert(0, "benchmarks")
from _bench_io import load_package_as
old = load_package_as(os.path.abspath(sys.argv[1]), "fastdora_old")
import fastdora_old.kernels.native as n
n.node(required=True)
print("old node", n.node() is not None)
PY
    echo "old node $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    smi_start
    seq=fastdora,lora,fastdora,fastdora_old,fastdora,fastdora_old,fastdora,fastdora_old,lora
    for sp in exec fork; do
      TAG=var_$sp FILES=json bench ${SETUP:-bf16} ${VAR_S:-200} --spawn $sp --sequence $seq \
        --old-pkg ${OLD_PKG:-.carry/prevpkg}
    done
    kill $smi
    ;;
  suite)
    node
    timeout ${TESTS_S:-420} python -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -25 > $OUT/gpu_tests.log
    tail -8 $OUT/gpu_tests.log
    echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    [ "${BENCH_S:-0}" -gt 0 ] && bench h200 $BENCH_S --spawn ${SPAWN:-fork}
    ;;
  harness)
    node
    bench h200 ${BENCH_S:-520} --spawn ${SPAWN:-fork}
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
