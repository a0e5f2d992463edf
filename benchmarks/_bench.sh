# Sourced by the run_s22+ device scripts after benchmarks/_env.sh (needs $OUT and the script's start time $t0):
#   bench PLAN BUDGET_S [model_bench arguments]   runs model_bench.py --plan PLAN, writes its log, JSON, table and
#   plot to $OUT (model_bench_TAG.*; TAG: $TAG, default PLAN; FILES="json" keeps the JSON only), prints the
#   per-config lines, MISS / TARGETS lines and warnings
#   node        builds the C++ composition node (so that no worker builds it inside a timed run)
#   smi_start   the GPU's clocks / power / throttle reasons every 200 ms into $OUT/smi.csv, until `kill $smi`
#   gpu_tests LOG TIMEOUT_S [pytest targets]   pytest -m gpu, the log's last 40 lines to $OUT/LOG
#   train_eq TRAIN_S   issue 5's training equivalence on one GPU: seeds 0 and 1, 1000 steps, the four runs at once
#                      (TRAIN_S: the workers' time limit); its log, JSON, table and curves to $OUT
bench() {
  local tag=${TAG:-$1}
  timeout $(( $2 + 65 )) python benchmarks/model_bench.py --out /tmp/mb_$tag --plan $1 --budget-s $2 "${@:3}" \
    > $OUT/mb_$tag.log 2>&1
  [ -f /tmp/mb_$tag/model_bench.json ] && python benchmarks/model_bench.py --report /tmp/mb_$tag/model_bench.json \
    > /dev/null 2>&1
  for f in ${FILES:-json md png}; do cp /tmp/mb_$tag/model_bench.$f $OUT/model_bench_$tag.$f 2>/dev/null; done
  grep "^\[\|MISS\|TARGETS\|fallback\|Warn" $OUT/mb_$tag.log | tail -60
  echo "bench $tag $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
}
smi_start() {
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,\
clocks_throttle_reasons.active --format=csv -lms 200 > $OUT/smi.csv 2>&1 &
  smi=$!
}
node() {
  python -c "from fastdora.kernels import native; native.node(required=True)" 2>&1 | grep -v Warn | tail -2
  echo "node $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
}
gpu_tests() {  # gpu_tests LOG TIMEOUT_S [pytest targets]
  local log=$1 limit=$2
  timeout $limit python -m pytest "${@:3}" -m gpu -q -p no:cacheprovider 2>&1 | tail -40 > $OUT/$log
  tail -8 $OUT/$log
  echo "tests $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
}
train_eq() {  # train_eq TRAIN_S
  timeout $(( $1 + 70 )) python benchmarks/train_equivalence.py --out /tmp/te --seeds 0 1 --steps 1000 --parallel 4 \
    --max-train-s $1 --timeout-s $(( $1 + 50 )) > $OUT/train_equivalence_log.txt 2>&1
  cp /tmp/te/train_equivalence.{json,md,png} $OUT/ 2>/dev/null
  grep -v "Warn\|warn" $OUT/train_equivalence_log.txt | tail -20
  echo "train $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
}
