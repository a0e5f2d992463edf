#!/usr/bin/env bash
# End-to-end tests of the trainer plugins, one virtual environment per framework (their pins conflict).
#
#   integration_tests/run_all.sh                 # all: hf (HF Trainer + TRL SFT/DPO, POET-X), axolotl (DoRA),
#                                                # axolotl021 (DoRA, POET-X), llamafactory (DoRA, POET-X)
#   FASTDORA_IT_ONLY="hf llamafactory" integration_tests/run_all.sh
#   integration_tests/run_all.sh --venvs-only    # build (or find cached) the venvs, run no test
#
# Environment:
#   FASTDORA_IT_VENVS   where the venvs are created and cached (default: $FASTDORA_WORK/venvs, FASTDORA_WORK defaulting
#                       to <repo>/.work, git-ignored). A venv is reused while its requirements file and this script are
#                       unchanged (stamp file); delete it to rebuild.
#   FASTDORA_IT_WORK    scratch directory for models, runs and logs (default: $FASTDORA_WORK/it; wiped per test)
#   FASTDORA_IT_ONLY    subset of: hf axolotl axolotl021 llamafactory (default: all four); axolotl is Axolotl 0.19
#                       (Python 3.11), axolotl021 Axolotl 0.21 (Python 3.12)
#   FASTDORA_IT_PLUGIN_OPTIONS  JSON dict of fastdora options given to every plugin (default {}: core defaults)
#   FASTDORA_IT_PYTHON  Python 3.11 interpreter (default: python3.11, else python3); torch==2.13.0 is the local wheel
#   FASTDORA_IT_PYTHON312  Python 3.12 interpreter for axolotl021 (default: python3.12, else pyenv's newest 3.12);
#                       its torch==2.13.0 comes from PyPI (the CUDA build: no CPU build of torch is on PyPI)
#   FASTDORA_IT_SKIP_TORCHRUN=1  skip LLaMA-Factory's 2-process torchrun run
#   FASTDORA_IT_LANES   how many framework tests run at the same time (default 2; with more than 1, OMP_NUM_THREADS
#                       defaults to 1)
#
# Prints the wall time of every venv build and every test, and exits non-zero on the first failure (stopping the
# tests still running).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENVS="${FASTDORA_IT_VENVS:-${FASTDORA_WORK:-$REPO/.work}/venvs}"
WORK="${FASTDORA_IT_WORK:-${FASTDORA_WORK:-$REPO/.work}/it}"
ONLY="${FASTDORA_IT_ONLY:-hf axolotl axolotl021 llamafactory}"
VENVS_ONLY=0
[[ "${1:-}" == --venvs-only ]] && VENVS_ONLY=1
OPTIONS="${FASTDORA_IT_PLUGIN_OPTIONS:-}"
[[ -n "$OPTIONS" ]] || OPTIONS='{}'
PY="${FASTDORA_IT_PYTHON:-$(command -v python3.11 || command -v python3)}"
REQ="$REPO/integration_tests/requirements"
mkdir -p "$VENVS" "$WORK"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled AXOLOTL_DO_NOT_TRACK=1 DISABLE_VERSION_CHECK=1

ts() { date -u +%H:%M:%S; }
declare -A TIMES

python312() {  # a Python 3.12 interpreter that runs (a pyenv shim may exist without the version being selected)
  local c
  for c in "${FASTDORA_IT_PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    [[ -n "$c" ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$c"; return; }
  done
  echo "no Python 3.12 interpreter found (Axolotl >= 0.20 needs one): set FASTDORA_IT_PYTHON312" >&2
  return 1
}

pip_q() {  # quiet pip; the log keeps everything, the tail is shown on failure. No bytecode compilation at install
  # (it costs CPU while other work runs; the tests compile only the modules they import)
  local venv="$1"; shift
  if ! "$venv/bin/pip" install --quiet --no-compile "$@" >>"$venv.install.log" 2>&1; then
    grep -v "^WARNING: Location" "$venv.install.log" | tail -40; return 1
  fi
}

build_venv() {  # build_venv NAME: creates $VENVS/NAME unless its stamp matches the requirements file
  local name="$1" venv="$VENVS/$1" stamp
  stamp="$(cat "$REQ/$name.txt" "$0" | sha256sum | cut -c1-16)"
  if [[ -f "$venv/.fastdora-stamp" && "$(cat "$venv/.fastdora-stamp")" == "$stamp" ]]; then
    echo "[$(ts)] venv $name: cached ($venv)"; return 0
  fi
  rm -rf "$venv" "$venv.install.log"
  case "$name" in
    axolotl021) "$(python312)" -m venv "$venv" ;;
    *) "$PY" -m venv "$venv" ;;
  esac
  case "$name" in
    axolotl)
      pip_q "$venv" --no-deps axolotl==0.19.0
      pip_q "$venv" -r "$REQ/axolotl.txt" ;;
    axolotl021)
      pip_q "$venv" --no-deps axolotl==0.21.0
      pip_q "$venv" -r "$REQ/axolotl021.txt" ;;
    llamafactory)
      pip_q "$venv" -r "$REQ/llamafactory.txt"
      "$venv/bin/pip" uninstall --quiet -y torchvision >>"$venv.install.log" 2>&1 || true
      local sp; sp="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      for so in "$sp"/torchaudio/lib/*.so; do [[ -e "$so" ]] && mv "$so" "$so.disabled"; done ;;
    *)
      pip_q "$venv" -r "$REQ/$name.txt" ;;
  esac
  echo "$stamp" > "$venv/.fastdora-stamp"
}

install_fastdora() {  # editable and without dependencies: the venv's pins stay as they are
  local venv="$VENVS/$1"
  pip_q "$venv" --no-deps -e "$REPO"
  if [[ "$1" == llamafactory ]]; then
    "$venv/bin/python" -m fastdora.plugins.llamafactory install
  fi
}

declare -A TEST=( [hf]=test_hf_trl.py [axolotl]=test_axolotl.py [axolotl021]=test_axolotl.py
                  [llamafactory]=test_llamafactory.py )
# POET-X through `axolotl train` runs on the newest Axolotl only (it adds ~3.5 min on 0.19 on the 2-core machine;
# `test_axolotl.py WORK --only poetx` in the axolotl venv runs it there by hand)
declare -A ARGS=( [axolotl]="--only dora" )

# 1. venvs, built in parallel (network and disk bound)
t0=$(date +%s)
pids=()
for name in $ONLY; do
  [[ -n "${TEST[$name]:-}" ]] || { echo "unknown framework $name"; exit 2; }
  ( s=$(date +%s); build_venv "$name"; install_fastdora "$name"
    echo "[$(ts)] venv $name ready in $(( $(date +%s) - s ))s ($(du -sh "$VENVS/$name" | cut -f1))" ) &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
TIMES[venvs]=$(( $(date +%s) - t0 ))
[[ $failed == 0 ]] || { echo "[$(ts)] a venv build failed (logs: $VENVS/*.install.log)" >&2; exit 1; }
echo "[$(ts)] all venvs ready in ${TIMES[venvs]}s"
[[ $VENVS_ONLY == 1 ]] && exit 0

# 2. tests, FASTDORA_IT_LANES at a time (default 2: each is mostly one Python process; one thread each on a shared host),
# the longest first; each writes to its own log, printed when it ends; the first failure stops the others
LANES="${FASTDORA_IT_LANES:-2}"
[[ "$LANES" =~ ^[1-9][0-9]*$ ]] || { echo "FASTDORA_IT_LANES must be a positive integer, got '$LANES'" >&2; exit 2; }
[[ "$LANES" == 1 ]] || export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
declare -A LANE_NAME=() LANE_START=()
set -m  # each test in its own process group, so that a failure can stop a running one with its trainer processes
start_test() {
  local name="$1" extra=() more=()
  rm -rf "${WORK:?}/$name" "$WORK/$name.log"
  [[ "$name" == llamafactory && "${FASTDORA_IT_SKIP_TORCHRUN:-0}" == 1 ]] && extra+=(--skip-torchrun)
  [[ -n "${ARGS[$name]:-}" ]] && read -ra more <<< "${ARGS[$name]}" && extra+=("${more[@]}")
  echo "[$(ts)] ===== $name: started (log $WORK/$name.log) ====="
  "$VENVS/$name/bin/python" "$REPO/integration_tests/${TEST[$name]}" "$WORK/$name" \
      --plugin-options "$OPTIONS" "${extra[@]}" > "$WORK/$name.log" 2>&1 &
  LANE_NAME[$!]="$name"; LANE_START[$!]=$(date +%s)
}
reap_test() {  # waits for one running test; prints its log; on failure stops the others and exits
  local pid rc=0 name
  wait -n -p pid "${!LANE_NAME[@]}" || rc=$?
  name="${LANE_NAME[$pid]}"
  TIMES[$name]=$(( $(date +%s) - LANE_START[$pid] ))
  unset "LANE_NAME[$pid]"
  echo "[$(ts)] ===== $name: output ====="
  cat "$WORK/$name.log"
  if [[ $rc != 0 ]]; then
    echo "[$(ts)] $name FAILED (exit $rc) after ${TIMES[$name]}s; log: $WORK/$name.log" >&2
    for pid in "${!LANE_NAME[@]}"; do kill -- -"$pid" 2>/dev/null || true; done
    exit 1
  fi
  echo "[$(ts)] $name passed in ${TIMES[$name]}s"
}
ORDER=()
for name in axolotl021 llamafactory hf axolotl $ONLY; do  # longest first (2-core CI host: ~470, 470, 410, 190 s
  # alone), then any other requested one: each requested name once
  if [[ " $ONLY " == *" $name "* && " ${ORDER[*]} " != *" $name "* ]]; then ORDER+=("$name"); fi
done
for name in "${ORDER[@]}"; do
  while (( ${#LANE_NAME[@]} >= LANES )); do reap_test; done
  start_test "$name"
done
while (( ${#LANE_NAME[@]} > 0 )); do reap_test; done
set +m

echo "[$(ts)] integration tests passed; wall times (s):"
for k in "${!TIMES[@]}"; do echo "  $k: ${TIMES[$k]}"; done
echo "  total: $(( $(date +%s) - t0 ))"
