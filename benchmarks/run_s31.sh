#!/usr/bin/env bash
# Device script (session 31, nvidia-h200), from the repository root; the node cache from session 30 carried
# (FASTDORA_CACHE_DIR=$PWD/.carry/fdcache: the C++ node loads instead of a ~50 s build; a stale cache rebuilds it).
#
#   bash benchmarks/run_s31.sh harness  issue 5's whole harness on the final tree, all 41 configs in one go:
#                                       model_bench.py --plan h200 (BENCH_S, default 548), then in the time left until
#                                       END_S (default 590) the eager model test under checkpointing (fuse_lora_b off
#                                       and on) and tests/test_eager_rows.py -m gpu
#   bash benchmarks/run_s31.sh suite    the whole GPU suite: pytest -m gpu tests/ (SUITE_S, default 420)
#   bash benchmarks/run_s31.sh train    issue 5's training equivalence on the final tree: train_equivalence.py, seeds
#                                       0 and 1, 1000 steps, the four runs at once on one GPU (TRAIN_S, default 400)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]; node; gpu_tests; train_eq
case "${1:-harness}" in
  harness)
    node
    bench h200 ${BENCH_S:-548}
    left=$(( ${END_S:-590} - ($(date +%s) - t0) ))
    [ $left -gt 15 ] && gpu_tests gpu_tests_eager.log $left \
      tests/test_gpu_layers.py::test_model_parity_eager_path_checkpointed tests/test_eager_rows.py
    ;;
  suite)
    node
    gpu_tests gpu_tests_suite.log ${SUITE_S:-420} tests/
    ;;
  train)
    node
    train_eq ${TRAIN_S:-400}
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
