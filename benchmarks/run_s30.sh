#!/usr/bin/env bash
# Device script (session 30, nvidia-h200), from the repository root.
#
#   bash benchmarks/run_s30.sh first   the C++ node built; rowscale_probe.py (the eager fallback's per-row passes in
#                                      plain PyTorch, op by op; PROBE_S, default 60); then issue 5's training
#                                      equivalence on one GPU: train_equivalence.py, seeds 0 and 1, 1000 steps, the
#                                      four runs (PEFT DoRA / fastdora x 2 seeds) at once (TRAIN_S, the workers' time
#                                      limit, default 420)
#   bash benchmarks/run_s30.sh eagerab the eager fallback (row kernels, fused lora_B + addmm) against --old-pkg's
#                                      (session 29's core 22f0a2d, carried as .carry/prevpkg/fastdora) and against
#                                      fuse_lora_b=False (eager_nofuse): the eager / composition GPU tests (TESTS_S,
#                                      default 150), then model_bench --plan bf16 --sequence EAB_SEQ in exec workers
#                                      (EAB_S, default 200)
#   bash benchmarks/run_s30.sh harness issue 5's whole harness: model_bench.py --plan h200 (BENCH_S, default 520);
#                                      with FASTDORA_CACHE_DIR=$PWD/.carry/fdcache (eagerab's fdcache.tgz unpacked,
#                                      carried) the node loads from the cache instead of a ~50 s build; then
#                                      tests/test_eager_rows.py -m gpu until END_S (default 588)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
OLD_PKG=${OLD_PKG:-.carry/prevpkg}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]; node; smi_start; gpu_tests
case "${1:-first}" in
  first)
    node
    timeout ${PROBE_S:-60} python benchmarks/rowscale_probe.py --out $OUT/rowscale_probe.json 2>&1 \
      | grep -v Warn | tee $OUT/rowscale_probe.log
    echo "probe $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    timeout $(( ${TRAIN_S:-420} + 70 )) python benchmarks/train_equivalence.py --out /tmp/te --seeds 0 1 --steps 1000 \
      --parallel 4 --max-train-s ${TRAIN_S:-420} --timeout-s $(( ${TRAIN_S:-420} + 50 )) \
      > $OUT/train_equivalence_log.txt 2>&1
    cp /tmp/te/train_equivalence.{json,md,png} $OUT/ 2>/dev/null
    grep -v "Warn\|warn" $OUT/train_equivalence_log.txt | tail -20
    ;;
  eagerab)
    # the C++ node built beside the tests (CPU), its cache returned for the harness call (carry it as .carry/fdcache)
    (node > $OUT/node.log 2>&1; tar czf $OUT/fdcache.tgz -C $FASTDORA_CACHE_DIR .) &
    gpu_tests gpu_tests_eager.log ${TESTS_S:-150} tests/test_eager_rows.py tests/test_kernels_gpu.py \
      tests/test_gpu_layers.py -k "eager or compose or strided or row or fused or dispatch"
    TAG=eager_ab FILES="json md" bench bf16 ${EAB_S:-200} --spawn exec --old-pkg $OLD_PKG \
      --sequence ${EAB_SEQ:-lora,eager,eager_old,eager_nofuse,eager,lora,eager_old,eager}
    wait
    ;;
  harness)
    node
    bench h200 ${BENCH_S:-520} --spawn ${SPAWN:-fork}
    left=$(( ${END_S:-588} - ($(date +%s) - t0) ))  # then the eager GPU tests in the time left
    [ $left -gt 20 ] && gpu_tests gpu_tests_eager_rows.log $left tests/test_eager_rows.py
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
