"""Fresh process, stock transformers only: load MODEL_DIR, save the logits of the probe text to OUT.

usage: python stock_model_check.py MODEL_DIR OUT.pt

Fails if fastdora gets imported, if a weight is missing or unexpected, or if a layer is not a plain nn.Linear.
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from _tiny import PROBE_TEXT  # noqa: E402

model_dir, out = sys.argv[1:3]
tok = AutoTokenizer.from_pretrained(model_dir)
model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
assert not any(info.values()), f"loading {model_dir}: {info}"
linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
assert linears and all(type(m) is torch.nn.Linear for m in linears), {type(m).__name__ for m in linears}
model.eval()
ids = tok(PROBE_TEXT, return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(input_ids=ids).logits
torch.save(logits.cpu(), out)
assert "fastdora" not in sys.modules, "fastdora was imported in the stock-transformers check"
print(f"stock transformers logits saved to {out}; shape {tuple(logits.shape)}")
