# Sourced by benchmarks/run_h200.sh (from the repository root): unbuffered Python and `import fastdora` resolving to
# this checkout's core/ (+ plugins/) through /tmp/fdp on PYTHONPATH, with no install step. An installed fastdora
# (pip install -e .) resolves to the same files.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/fdp/fastdora && for f in "$PWD"/core/*; do ln -sfn "$f" /tmp/fdp/fastdora/; done
ln -sfn "$PWD/plugins" /tmp/fdp/fastdora/plugins
export PYTHONPATH=/tmp/fdp${PYTHONPATH:+:$PYTHONPATH}
