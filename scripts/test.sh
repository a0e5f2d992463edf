#!/usr/bin/env bash
# fastdora's test command (the README's; CI runs it through .ci/run). CPU only; installs what it needs itself.
#
#   bash scripts/test.sh            full suite: for the oldest and newest supported PEFT, fastdora's tests
#                                   (incl. Triton kernels under TRITON_INTERPRET=1) + PEFT's own DoRA tests with
#                                   fastdora enabled process-wide; the torch-dependent tests with the newest torch;
#                                   then the framework integration tests.
#   FASTDORA_TEST_QUICK=1 bash scripts/test.sh   fastdora's tests against the newest PEFT only.
#   FASTDORA_TEST_WORKERS=N bash scripts/test.sh  N pytest-xdist workers (default 2)
#
# Virtual environments are cached under $FASTDORA_WORK (default ./.work) within a run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${FASTDORA_WORK:-$ROOT/.work}
PY=${FASTDORA_PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
PEFT_OLDEST=0.18.1
PEFT_NEWEST=${FASTDORA_PEFT_NEWEST:-0.22.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
mkdir -p "$WORK"
t0=$(date +%s)
say() { printf '\n==== [%4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }

# Disk preflight: a full run builds ~23 GB of virtual environments under $WORK (test venv ~2.7 GB, newest-torch venv
# ~5.5 GB, framework venvs ~12.5 GB of which Axolotl 0.21's ~5.8 GB, example venv ~1.5 GB); a full disk otherwise shows
# up minutes later as a pip OSError mid-suite.
need_gb=${FASTDORA_TEST_MIN_FREE_GB:-$([ "${FASTDORA_TEST_QUICK:-0}" = 1 ] && echo 4 || echo 26)}
free_gb=$(( $(df -Pk "$WORK" | awk 'NR==2 {print $4}') / 1048576 ))
if [ "$free_gb" -lt "$need_gb" ]; then
  echo "fastdora tests: only ${free_gb} GB free under $WORK; the run needs about ${need_gb} GB" \
       "(venvs are cached there; free space or set FASTDORA_WORK to a larger disk)" >&2
  exit 1
fi

# The framework venvs of the integration tests are built in the background from the start (pip is network and disk
# bound, the tests below CPU bound; the tests install without bytecode compilation), in their own process group, and
# joined before the integration tests: a failed build fails the run there, with its log.
IT_PID=""
IT_LOG="$WORK/it_venvs.log"
if [ "${FASTDORA_TEST_QUICK:-0}" != 1 ] && [ -f "$ROOT/integration_tests/run_all.sh" ]; then
  set -m
  FASTDORA_WORK="$WORK" bash "$ROOT/integration_tests/run_all.sh" --venvs-only > "$IT_LOG" 2>&1 &
  IT_PID=$!
  set +m
  trap '[ -z "$IT_PID" ] || kill -- -"$IT_PID" 2>/dev/null || true' EXIT
  echo "framework venvs: building in the background (pid $IT_PID, log $IT_LOG)"
fi

# The newest torch the package index serves (on PyPI the CUDA build, which runs on CPU) runs the tests that depend on
# torch's internals and headers (the C++ node's build, torch.compile, parity with stock PEFT, the norm cache) with the
# newest PEFT; the main passes use torch 2.13.0, the CPU build. Its own venv (~6 GB), built in the background from the
# start like the framework venvs. pip reads no configuration file for it (PIP_CONFIG_FILE=/dev/null): a site
# configuration may cap torch below the newest release (a constraints file), and this venv is there to test that one.
TORCH_VENV="$WORK/venv-torch-newest"
TORCH_LOG="$WORK/venv-torch-newest.log"
TORCH_PID=""
build_torch_venv() {
  if [ ! -x "$TORCH_VENV/bin/python" ] || [ ! -f "$TORCH_VENV/.ok" ]; then
    rm -rf "$TORCH_VENV"
    "$PY" -m venv "$TORCH_VENV"
    export PIP_CONFIG_FILE=/dev/null
    "$TORCH_VENV/bin/pip" install -q --upgrade pip
    "$TORCH_VENV/bin/pip" install -q --no-compile --no-cache-dir torch "peft==$PEFT_NEWEST" transformers accelerate pytest \
      pytest-xdist parameterized safetensors
    "$TORCH_VENV/bin/pip" install -q --no-deps -e "$ROOT"
    touch "$TORCH_VENV/.ok"
  fi
}
if [ "${FASTDORA_TEST_QUICK:-0}" != 1 ]; then
  set -m
  build_torch_venv > "$TORCH_LOG" 2>&1 &
  TORCH_PID=$!
  set +m
  trap '[ -z "$IT_PID" ] || kill -- -"$IT_PID" 2>/dev/null || true; [ -z "$TORCH_PID" ] || kill -- -"$TORCH_PID" 2>/dev/null || true' EXIT
  echo "newest-torch venv: building in the background (pid $TORCH_PID, log $TORCH_LOG)"
fi

make_venv() {  # make_venv DIR PEFT_VERSION TRANSFORMERS_SPEC EXTRA...
  local dir=$1 peft=$2 tf=$3; shift 3
  if [ ! -x "$dir/bin/python" ] || [ ! -f "$dir/.ok" ]; then
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade pip
    "$dir/bin/pip" install -q "torch==2.13.0"
    "$dir/bin/pip" install -q "peft==$peft" "$tf" accelerate pytest pytest-xdist parameterized datasets \
      diffusers scipy scikit-learn protobuf sentencepiece safetensors attrs ruff "$@"
    # DeepSpeed (ZeRO-2/3 cases of tests/peft/test_distributed.py run on CPU): an sdist whose build imports torch
    "$dir/bin/pip" install -q --no-build-isolation "deepspeed==0.19.8" hjson ninja py-cpuinfo pydantic msgpack
    "$dir/bin/pip" install -q --no-deps -e "$ROOT"
    touch "$dir/.ok"
  fi
  "$dir/bin/python" -c "import torch, peft, fastdora; print('torch', torch.__version__, 'peft', peft.__version__, 'fastdora', fastdora.__file__)"
}

peft_source() {  # the released sdist of PEFT (it ships PEFT's tests)
  local v=$1 d="$WORK/peft-src"
  if [ ! -d "$d/peft-$v/tests" ]; then
    mkdir -p "$d"
    "$PY" -m pip download -q --no-deps --no-binary :all: "peft==$v" -d "$d"
    tar -xzf "$d/peft-$v.tar.gz" -C "$d"
    touch "$d/peft-$v/tests/__init__.py"
  fi
  echo "$d/peft-$v"
}

# pytest-xdist workers for fastdora's tests (default 2, the CI host's cores). Tests marked `slow` are collected first;
# `--maxschedchunk 1` keeps xdist's load scheduler from handing them all to one worker as its first contiguous chunk
WORKERS=${FASTDORA_TEST_WORKERS:-2}

run_fastdora_tests() {  # run_fastdora_tests VENV [pytest arguments]
  local venv=$1; shift
  (cd "$ROOT" && "$venv/bin/python" -m pytest tests -q -m "not gpu" -p no:cacheprovider -n "$WORKERS" \
    --maxschedchunk 1 "$@")
}

# the tests that do not touch PEFT (kernels under the interpreter, launch code, POET-X, the source checks) and the
# torch.compile tests (minutes of compilation; fastdora's compiled path does not depend on the PEFT release) run once,
# with the newest PEFT; the oldest PEFT's pass runs everything else
PEFT_FREE=(--ignore=tests/kernels/test_kernels_interpret.py --ignore=tests/kernels/test_launch.py
           --ignore=tests/kernels/test_launch_guard.py --ignore=tests/poetx --ignore=tests/test_architecture.py
           --ignore=tests/test_compat.py --ignore=tests/peft/test_compile.py)

run_peft_dora_tests() {  # run_peft_dora_tests VENV PEFT_VERSION
  local src; src=$(peft_source "$2")
  local files=(tests/test_custom_models.py tests/test_lora_variants.py tests/test_initialization.py)
  local helpers=()
  grep -q "class TestDoraCaching" "$src/tests/test_helpers.py" && helpers=(tests/test_helpers.py::TestDoraCaching)
  # deselected: the cases that download a model from the hub (no network here)
  (cd "$src" && OMP_NUM_THREADS=1 PYTHONPATH="$ROOT/tests/peft_compat" "$1/bin/python" -m pytest \
      "${files[@]}" "${helpers[@]}" -k "dora or DoRA or Dora" -p fastdora_pytest_plugin -o addopts="" -q \
      -n "$WORKERS" -p no:cacheprovider \
      --deselect tests/test_custom_models.py::TestPeftCustomModel::test_gpt2_dora_merge_and_unload \
      --deselect tests/test_custom_models.py::TestPeftCustomModel::test_gpt2_dora_merge_and_unload_safe_merge \
      --deselect tests/test_custom_models.py::TestPeftCustomModel::test_dora_save_and_load_remapping \
      --deselect tests/test_helpers.py::TestDoraCaching::test_dora_caching_linear \
      --deselect tests/test_helpers.py::TestDoraCaching::test_dora_caching_embedding \
      -W ignore::UserWarning)
}

VENV="$WORK/venv-test"

say "venv: newest PEFT $PEFT_NEWEST (+ triton for the interpreter tests, bitsandbytes + hqq for quantized bases, matplotlib for the benchmarks' plots)"
make_venv "$VENV" "$PEFT_NEWEST" "transformers" "triton" "bitsandbytes" "hqq" "matplotlib"
say "ruff check (pyflakes + pycodestyle errors; pyproject.toml [tool.ruff])"
"$VENV/bin/ruff" check "$ROOT"
say "fastdora tests, PEFT $PEFT_NEWEST"
run_fastdora_tests "$VENV"
if [ "${FASTDORA_TEST_QUICK:-0}" = 1 ]; then say "quick mode: done"; exit 0; fi

say "PEFT $PEFT_NEWEST's own DoRA tests with fastdora enabled process-wide"
run_peft_dora_tests "$VENV" "$PEFT_NEWEST"

say "same venv, oldest PEFT $PEFT_OLDEST (with the transformers it supports)"
"$VENV/bin/pip" install -q "peft==$PEFT_OLDEST" "transformers<=5.6.0"
# newer transformers require the `kernels` package, whose current release the older transformers cannot import
# ("Either a revision or a version must be specified"); they do not need it
"$VENV/bin/pip" uninstall -q -y kernels || true
rm -f "$VENV/.ok"  # the cached venv now holds the oldest PEFT: rebuild next time
"$VENV/bin/python" -c "import peft; assert peft.__version__ == '$PEFT_OLDEST', peft.__version__; print('peft', peft.__version__)"
say "fastdora tests, PEFT $PEFT_OLDEST (the PEFT-dependent ones)"
run_fastdora_tests "$VENV" "${PEFT_FREE[@]}"
say "PEFT $PEFT_OLDEST's own DoRA tests with fastdora enabled process-wide"
run_peft_dora_tests "$VENV" "$PEFT_OLDEST"

say "fastdora's torch-dependent tests with the newest torch (venv started in the background at the start)"
if ! wait "$TORCH_PID"; then
  cat "$TORCH_LOG" >&2
  echo "building the newest-torch venv failed (log above: $TORCH_LOG)" >&2
  exit 1
fi
TORCH_PID=""
"$TORCH_VENV/bin/python" -c "import torch, peft, fastdora; print('torch', torch.__version__, 'peft', peft.__version__)"
(cd "$ROOT" && "$TORCH_VENV/bin/python" -m pytest -q -m "not gpu" -p no:cacheprovider -n "$WORKERS" \
  tests/kernels/test_native_node.py tests/kernels/test_launch_guard.py tests/peft/test_compile.py \
  tests/peft/test_parity.py tests/peft/test_cache_and_api.py)

if [ -f "$ROOT/integration_tests/run_all.sh" ]; then
  say "framework venvs (started in the background at $(date -u -d @"$t0" +%H:%M:%S) UTC)"
  if ! wait "$IT_PID"; then
    cat "$IT_LOG" >&2
    echo "building the framework venvs failed (log above: $IT_LOG; pip logs: $WORK/venvs/*.install.log)" >&2
    exit 1
  fi
  IT_PID=""
  cat "$IT_LOG"
  say "framework integration tests (each framework in its own venv)"
  FASTDORA_WORK="$WORK" bash "$ROOT/integration_tests/run_all.sh"
fi

say "the README's main command (scripts/run_example.sh, its own venv), checked against stock PEFT"
example_log="$WORK/example_check.log"
if FASTDORA_WORK="$WORK" FASTDORA_PYTHON="$PY" bash "$ROOT/scripts/run_example.sh" --check 1e-4 \
    --out "$WORK/example_check" > "$example_log" 2>&1; then
  grep -E "^(device|stock PEFT|fastdora|loss curves|outputs|check)" "$example_log"
else
  tail -40 "$example_log" >&2
  echo "the README's main command failed (full log: $example_log)" >&2
  exit 1
fi
say "all tests passed"
