"""Export a POET-X model trained through a framework's CLI: what a user does with the framework's saved output.

usage: python poetx_export.py TRAINED_DIR TOKENIZER_DIR EXPORT_DIR RELOADED_LOGITS.pt

TRAINED_DIR is the framework's output directory: the POET-X model saved by the trainer at the end of training (its
state dict holds the merged weights, ``q_in`` / ``q_out``, the permutations and merge counts) and the plugin's
``poetx_report.json`` (the options). The architecture is built from TRAINED_DIR's config, converted with those
options (``fastdora.poetx.convert``), the saved state dict loaded into it (strict: every key must match), the logits of
the probe text saved to RELOADED_LOGITS.pt (the test compares them with the training process's), then
``fastdora.poetx.export`` turns it back into plain ``nn.Linear`` layers and ``save_pretrained`` writes EXPORT_DIR (with
TOKENIZER_DIR's tokenizer), a checkpoint for stock transformers (``stock_model_check.py``).
"""

from __future__ import annotations

import glob
import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from _tiny import PROBE_TEXT  # noqa: E402

from fastdora import poetx  # noqa: E402

trained, tok_dir, export_dir, logits_out = sys.argv[1:5]
with open(os.path.join(trained, "poetx_report.json"), encoding="utf-8") as f:
    rep = json.load(f)
opts = rep["plugin_options"]
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(trained), dtype=torch.float32)
report = poetx.convert(model, block_size=opts["block_size"], mode=opts["mode"], exclude=opts["exclude"],
                       seed=rep["seed"], weight_format=opts.get("weight_format", "dense"))
assert report.converted == rep["converted"], (report.converted, rep["converted"])
files = sorted(glob.glob(os.path.join(trained, "model*.safetensors")))
assert files, f"no model*.safetensors in {trained}"
state = {}
for path in files:
    state.update(load_file(path))
model.load_state_dict(state, strict=True)  # the trained model: weights, Q, permutations, merge counts
tok = AutoTokenizer.from_pretrained(tok_dir)
ids = tok(PROBE_TEXT, return_tensors="pt").input_ids
model.eval()
with torch.no_grad():
    torch.save(model(input_ids=ids).logits.float(), logits_out)
merges = sorted({int(m.merge_count) for m in model.modules() if isinstance(m, poetx.PoetXLinear)})
poetx.export(model)
assert not any(isinstance(m, poetx.PoetXLinear) for m in model.modules())
model.save_pretrained(export_dir)
tok.save_pretrained(export_dir)
print(f"reloaded {len(report.converted)} POET-X layers (merge counts {merges}) from {trained}; exported to "
      f"{export_dir}")
