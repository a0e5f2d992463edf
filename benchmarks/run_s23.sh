#!/usr/bin/env bash
# Device script (session 23, nvidia-h200), from the repository root; no carry needed. The C++ composition node is
# built on the device by the first fastdora process (cached in FASTDORA_CACHE_DIR for the later ones).
#
#   bash benchmarks/run_s23.sh diag      where the pure-bf16 tax goes with the C++ node: enqueue_probe (host time of
#                                        the forward / backward per micro-batch behind a sleeping GPU, GPU idle gaps
#                                        of 4 back-to-back micro-batches; LoRA vs fastdora, 8 Qwen3-8B layers), then
#                                        model_bench --plan final in forked workers (FINAL_S, default 200 s)
#   bash benchmarks/run_s23.sh profile   the host side of one micro-batch, LoRA vs fastdora (pure bf16, 8 Qwen3-8B layers):
#                                        enqueue_probe --cprofile 2 (host time per Python function, backward on the
#                                        calling thread) and --trace (a torch.profiler trace per variant, gzipped)
#   bash benchmarks/run_s23.sh sweep     composition kernel configurations at the model bench's activation shapes
#                                        (kernels_bench.py --sections mb_shapes: 4096 x 1024 / 4096 / 12288, bf16)
#   bash benchmarks/run_s23.sh spawn     fork vs exec workers side by side: the C++ node built first (so no worker
#                                        builds it), then per setup (AMP, bf16) plan amp|bf16 at r=384
#                                        (LoRA, fastdora) with --spawn exec, fork, exec, fork
#   bash benchmarks/run_s23.sh harness   issue 5's whole harness: model_bench.py --plan h200 (BENCH_S, default 520)
set -uo pipefail
source benchmarks/_env.sh
export FASTDORA_CACHE_DIR=${FASTDORA_CACHE_DIR:-/tmp/fdcache}
t0=$(date +%s)
source benchmarks/_bench.sh  # bench PLAN BUDGET_S [model_bench arguments]
gaps() {  # setup
  timeout 150 python benchmarks/enqueue_probe.py --setup $1 --layers 8 --rounds ${ROUNDS:-3} --gaps 4 \
    --variants ${VARIANTS:-lora,fastdora} --out $OUT/gaps_$1.json 2>&1 | grep -v -e Warn -e _warn_once > $OUT/gaps_$1.log
  grep -B3 -A10 "idle gaps" $OUT/gaps_$1.log | cut -c1-150
  echo "gaps $1 $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
}
case "${1:-diag}" in
  diag)
    gaps bf16
    bench final ${FINAL_S:-200} --spawn fork
    ;;
  profile)
    timeout 200 python benchmarks/enqueue_probe.py --setup bf16 --layers 8 --rounds 2 --cprofile 2 --trace $OUT \
      --variants lora,fastdora --out $OUT/host_bf16.json 2>&1 | grep -v -e Warn -e _warn_once > $OUT/host_bf16.log
    grep -A25 "cProfile" $OUT/host_bf16.log | cut -c1-160
    echo "profile $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    ;;
  sweep)
    timeout 400 python benchmarks/kernels_bench.py --sections mb_shapes --rep 60 --out $OUT/mb_shapes.json \
      > $OUT/mb_shapes.log 2>&1
    tail -5 $OUT/mb_shapes.log
    echo "sweep $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    ;;
  spawn)
    python -c "from fastdora.kernels import native; native.node(required=True)" 2>&1 | grep -v Warn | tail -2
    echo "node $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    for setup in ${SETUPS:-amp bf16}; do
      for sp in exec fork exec fork; do
        timeout 120 python benchmarks/model_bench.py --out /tmp/sp_${setup}_$sp --plan $setup --variants lora,fastdora --budget-s 60 \
          --spawn $sp 2>&1 | grep "^\[" | sed "s/^/$sp /" | tee -a $OUT/spawn.log
        python - "$setup" "$sp" >> $OUT/spawn_rows.jsonl <<'PY'
import json, sys
d = json.load(open(f"/tmp/sp_{sys.argv[1]}_{sys.argv[2]}/model_bench.json"))
for r in d["results"]:
    print(json.dumps({"spawn": sys.argv[2], "setup": r["setup"], "variant": r["variant"],
                      "grad_iter_s_all": r["grad_iter_s_all"], "gc_ms": r["grad_iter_gc_ms_all"]}))
PY
        rm -rf /tmp/sp_${setup}_$sp
      done
    done
    echo "spawn $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
    ;;
  harness)
    bench h200 ${BENCH_S:-520} --spawn ${SPAWN:-fork}
    ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
