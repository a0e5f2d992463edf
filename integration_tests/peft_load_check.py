"""Fresh process, stock PEFT only: load BASE + ADAPTER, save the logits of the probe text to OUT.

usage: python peft_load_check.py BASE_DIR ADAPTER_DIR OUT.pt

Fails if fastdora gets imported (no .pth hook, plugin or process-wide mode may leak into a plain PEFT load).
"""

import os
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from _tiny import PROBE_TEXT  # noqa: E402

base_dir, adapter_dir, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(base_dir)
model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
model = PeftModel.from_pretrained(model, adapter_dir)
model.eval()
assert any(getattr(m, "lora_magnitude_vector", None) for m in model.modules()), "adapter has no DoRA layer"
ids = tok(PROBE_TEXT, return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(input_ids=ids).logits
torch.save(logits.cpu(), out)
assert "fastdora" not in sys.modules, "fastdora was imported in the stock-PEFT check"
print(f"stock PEFT logits saved to {out}; shape {tuple(logits.shape)}")
