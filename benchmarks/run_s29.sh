#!/usr/bin/env bash
# Device script (session 29, nvidia-h200), from the repository root: the batched magnitude check (dm_from_output's
# |m| check: one host sync per optimizer step for all layers, where session 28's core synced once per layer and step)
# against session 28's core (08959c9) as variant fastdora_old, and issue 5's whole harness.
#   mkdir -p .carry/prevpkg /tmp/s29old && git archive 08959c9 core | tar -x -C /tmp/s29old \
#     && mv /tmp/s29old/core .carry/prevpkg/fastdora
# Run `suite` with carry [".carry/prevpkg"].
#
#   bash benchmarks/run_s29.sh suite   both C++ nodes built (this core's and --old-pkg's), the whole GPU test suite
#                                      (TESTS_S, default 300), then model_bench --plan bf16 (Qwen3-8B shapes, 8 layers,
#                                      r=384, pure bf16) --sequence SEQ in exec workers in the time left (until END_S,
#                                      default 555)
#   bash benchmarks/run_s29.sh harness issue 5's whole harness: model_bench.py --plan h200 (BENCH_S, default 500;
#                                      SPAWN, default fork: the harness's default, 41 configs in < 10 minutes)
#   bash benchmarks/run_s29.sh eager   where the eager fallback's pure-bf16 time goes: model_bench --plan eager_bf16 in
#                                      exec workers (LoRA, eager, fastdora profiled once each, then LoRA / eager again;
#                                      EAGER_S, default 330), the profile in model_bench_profile.txt
#   bash benchmarks/run_s29.sh eagerab the eager fallback against --old-pkg's: the GPU norm tests (TESTS_S, default
#                                      90), then model_bench --plan bf16 --sequence EAB_SEQ in exec workers: LoRA, eager
#                                      and eager_old (--old-pkg's eager) interleaved (EAB_S, 130). Call 4 ran it on an
#                                      experiment since reverted (the eager norm's U and G as half GEMMs with fp32
#                                      outputs): see benchmarks/README.md, session 29
#   bash benchmarks/run_s29.sh train   issue 5's training equivalence on one GPU: train_equivalence.py, seeds 0 and 1,
#                                      1000 steps, the four runs (PEFT DoRA / fastdora x 2 seeds) at once (TRAIN_S, the
#                                      workers' time limit, default 450)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
OLD_PKG=${OLD_PKG:-.carry/prevpkg}
SEQ=${SEQ:-lora,fastdora,fastdora_old,fastdora_old,fastdora,lora,lora,fastdora,fastdora_old,fastdora_old,fastdora,lora}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]; node; smi_start; gpu_tests
case "${1:-suite}" in
  suite)
    (cd $OLD_PKG && PYTHONPATH=$PWD python -c \
      "from fastdora.kernels import native; native.node(required=True); print('old node', native.status())" \
      2>&1 | grep -v Warn | tail -2) &
    node
    wait
    gpu_tests gpu_tests.log ${TESTS_S:-300} tests
    left=$(( ${END_S:-555} - ($(date +%s) - t0) - 65 ))
    [ $left -gt 60 ] && TAG=seq_bf16 FILES="json md" bench bf16 $left --spawn exec --sequence $SEQ --old-pkg $OLD_PKG
    ;;
  harness)
    node
    bench h200 ${BENCH_S:-500} --spawn ${SPAWN:-fork}
    ;;
  eager)
    TAG=eager FILES="json md" bench eager_bf16 ${EAGER_S:-330} --spawn exec
    cp /tmp/mb_eager/model_bench_profile.txt $OUT/ 2>/dev/null
    grep "^====" $OUT/model_bench_profile.txt
    ;;
  eagerab)
    gpu_tests gpu_tests_norm.log ${TESTS_S:-90} tests/test_kernels_gpu.py -k "factored_norm_gpu or realistic_scales"
    TAG=eager_ab FILES="json md" bench bf16 ${EAB_S:-130} --spawn exec --old-pkg $OLD_PKG \
      --sequence ${EAB_SEQ:-lora,eager,eager_old,eager_old,eager,lora,eager,eager_old}
    ;;
  train)
    node
    timeout $(( ${TRAIN_S:-450} + 70 )) python benchmarks/train_equivalence.py --out /tmp/te --seeds 0 1 --steps 1000 \
      --parallel 4 --max-train-s ${TRAIN_S:-450} --timeout-s $(( ${TRAIN_S:-450} + 50 )) > $OUT/train_equivalence_log.txt 2>&1
    cp /tmp/te/train_equivalence.{json,md,png} $OUT/ 2>/dev/null
    grep -v "Warn\|warn" $OUT/train_equivalence_log.txt | tail -20
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
