"""One POET-X training run (its own process) for the HF Trainer / TRL end-to-end test.

usage: python poetx_job.py --trainer {hf,sft} --model DIR --data FILE --out DIR [--steps N] [--resume CKPT]
                           [--options JSON]

Full training of the tiny Llama with ``fastdora.plugins.PoetXCallback`` (no adapter): gradient accumulation 2,
non-reentrant gradient checkpointing, fp32 on CPU, fixed seed, a checkpoint every 4 optimizer steps. Writes
OUT/losses.json (the logged losses, the callback's merges, the layers' merge counts), OUT/poetx_report.json (written
by the plugin), OUT/probe_logits.pt (the trained POET-X model on the probe text) and OUT/exported/ (the model after
``fastdora.poetx.export``, saved by the trainer: a plain transformers checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=["hf", "sft"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    p.add_argument("--options", default='{"block_size": 16, "merge_interval": 3}', help="PoetXCallback options")
    a = p.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, set_seed

    from _tiny import PROBE_TEXT, checkpointing_args
    from fastdora import poetx
    from fastdora.plugins import PoetXCallback  # the plugin under test

    set_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    ds = load_dataset("json", data_files=a.data, split="train")
    common = dict(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, logging_steps=1, save_strategy="steps", save_steps=4, report_to=[],
        use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, **checkpointing_args(TrainingArguments),
        dataloader_num_workers=0, bf16=False, fp16=False,
        lr_scheduler_type="cosine", warmup_steps=1, disable_tqdm=True,
    )
    callback = PoetXCallback(**json.loads(a.options))
    if a.trainer == "hf":
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        ds = ds.map(lambda r: tok(r["text"], truncation=True, max_length=64), remove_columns=["text"])
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=ds, callbacks=[callback],
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    else:
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=ds, callbacks=[callback],
                             args=SFTConfig(**common, max_length=64, dataset_text_field="text"))

    trainer.train(resume_from_checkpoint=a.resume)
    layers = [m for m in trainer.model.modules() if isinstance(m, poetx.PoetXLinear)]
    ids = tok(PROBE_TEXT, return_tensors="pt").input_ids.to(trainer.model.device)
    trainer.model.eval()
    with torch.no_grad():
        torch.save(trainer.model(input_ids=ids).logits.float().cpu(), os.path.join(a.out, "probe_logits.pt"))
    poetx.export(trainer.model)
    trainer.save_model(os.path.join(a.out, "exported"))
    tok.save_pretrained(os.path.join(a.out, "exported"))
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    result = {"losses": losses, "merges": callback.merges, "poetx_layers": len(layers),
              "merge_counts": sorted({int(m.merge_count) for m in layers}), "pid": os.getpid()}
    with open(os.path.join(a.out, "losses.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
