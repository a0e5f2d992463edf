# Sourced by the run_s22+ device scripts after benchmarks/_env.sh (needs $OUT and the script's start time $t0):
#   bench PLAN BUDGET_S [model_bench arguments]   runs model_bench.py --plan PLAN, writes its log, JSON, table and
#   plot to $OUT (model_bench_PLAN.*), prints the per-config lines, MISS / TARGETS lines and warnings
bench() {
  timeout $(( $2 + 65 )) python benchmarks/model_bench.py --out /tmp/mb_$1 --plan $1 --budget-s $2 "${@:3}" \
    > $OUT/mb_$1.log 2>&1
  [ -f /tmp/mb_$1/model_bench.json ] && python benchmarks/model_bench.py --report /tmp/mb_$1/model_bench.json \
    > /dev/null 2>&1
  for f in json md png; do cp /tmp/mb_$1/model_bench.$f $OUT/model_bench_$1.$f 2>/dev/null; done
  grep "^\[\|MISS\|TARGETS\|fallback\|Warn" $OUT/mb_$1.log | tail -60
  echo "bench $1 $(( $(date +%s) - t0 )) s" | tee -a $OUT/times.log
}
