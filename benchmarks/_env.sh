# Sourced by the benchmarks/run_*.sh device scripts (from the repository root): $OUT, unbuffered Python, and
# `import fastdora` resolving to this checkout's core/ (+ plugins/) through /tmp/fdp, with no install step.
OUT=${OUT:-$PWD/benchmarks/results/session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mkdir -p /tmp/fdp/fastdora && for f in "$PWD"/core/*; do ln -sfn "$f" /tmp/fdp/fastdora/; done
ln -sfn "$PWD/plugins" /tmp/fdp/fastdora/plugins
export PYTHONPATH=/tmp/fdp
