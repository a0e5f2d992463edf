"""TRL SFTTrainer with a DoRA ``peft_config``, switched to fastdora by one callback.

    pip install "fastdora[trl]"
    python examples/trl_sft/train.py [--out DIR] [--steps N]

Builds a tiny Llama model, tokenizer and dataset locally (``examples/_tiny.py``), trains on CPU (or the first GPU),
and prints what fastdora did. ``fastdora_report.json`` lands in the output directory.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from _tiny import build_all, checkpointing_args  # noqa: E402
from fastdora.plugins.trl import FastDoraCallback  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", default=os.path.join(os.getcwd(), ".work", "example_trl"))
p.add_argument("--steps", type=int, default=10)
a = p.parse_args()

paths = build_all(a.out)
trainer = SFTTrainer(
    model=paths["model"],  # TRL loads it; with peft_config it builds the PeftModel before Trainer.__init__
    peft_config=LoraConfig(r=8, lora_alpha=16, use_dora=True, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj"]),
    train_dataset=load_dataset("json", data_files=paths["messages"], split="train"),  # conversational
    args=SFTConfig(output_dir=os.path.join(a.out, "run"), max_steps=a.steps, per_device_train_batch_size=4,
                   learning_rate=1e-3, logging_steps=1, report_to=[], max_length=64,
                   use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
                   **checkpointing_args(SFTConfig)),
    callbacks=[FastDoraCallback()],  # options: kernels=, legacy_embedding_compose=, dm_from_output=
)
trainer.train()
trainer.save_model(os.path.join(a.out, "run", "adapter"))
with open(os.path.join(a.out, "run", "fastdora_report.json")) as f:
    rep = json.load(f)
print(rep["report"], "| paths that ran:", rep["active_path_counter"])
