#!/usr/bin/env bash
# The main job: a real DoRA fine-tune of a tiny, locally built Llama with HF Trainer + fastdora's callback
# (CPU by default, GPU if present). Prints step time, peak memory and the max output difference vs stock PEFT.
# Uses the current python if fastdora + transformers are importable, else makes a venv under $FASTDORA_WORK (./.work).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${FASTDORA_WORK:-$ROOT/.work}
PY=${FASTDORA_PYTHON:-python3}
if ! "$PY" -c "import fastdora, transformers, peft, accelerate, datasets" 2>/dev/null; then
  VENV="$WORK/venv-example"
  STAMP=$(cat "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)  # rebuilt when requirements change
  if [ ! -f "$VENV/.ok" ] || [ "$(cat "$VENV/.ok")" != "$STAMP" ]; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/python" -c "import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)" \
      && "$VENV/bin/pip" install -q "torch==2.13.0" || "$VENV/bin/pip" install -q torch
    "$VENV/bin/pip" install -q -e "$ROOT[hf]"
    echo "$STAMP" > "$VENV/.ok"
  fi
  PY="$VENV/bin/python"
fi
exec "$PY" "$ROOT/examples/hf_trainer/train.py" "$@"
