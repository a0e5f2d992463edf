"""Build the tiny local model and the alpaca dataset for examples/llamafactory/dora_fastdora.yaml."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _tiny import build_all  # noqa: E402

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(".work", "tiny")
paths = build_all(out)
with open(os.path.join(paths["data_dir"], "dataset_info.json"), "w") as f:
    json.dump({"tiny_alpaca": {"file_name": "alpaca.jsonl"}}, f)
print(f"model: {paths['model']}; data: {paths['data_dir']}")
