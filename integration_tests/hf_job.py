"""One training run (its own process) for the HF Trainer / TRL end-to-end tests.

usage: python hf_job.py --trainer {hf,sft,dpo} --model DIR --data FILE --out DIR [--fastdora] [--steps N]
       python -m torch.distributed.run --nproc_per_node 2 hf_job.py --trainer hf --fsdp2 ...   (HF Trainer + FSDP2)

DoRA (r=8) on all Llama linear layers (+ the input embedding for --trainer hf), gradient checkpointing, fp32 on CPU
(or the first GPU when present), fixed seed. Without --fastdora, fastdora is never imported in this process.
Writes OUT/losses.json, OUT/adapter/ (save_model), OUT/probe_logits.pt and OUT/probe_meta.json (probe.py) and, with
--fastdora, OUT/fastdora_report.json (written by the plugin). With --fsdp2 (HF Trainer sharded by accelerate's FSDP2,
one unit per decoder layer, linear targets only): OUT/losses.json (rank 0) and the plugin's report of each rank
(fastdora_report.json from rank 0, fastdora_report.rank1.json from rank 1); no probe forward and no adapter save
(both would need every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))  # _tiny.py

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=["hf", "sft", "dpo"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fastdora", action="store_true")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reentrant", action="store_true", help="reentrant gradient checkpointing (HF's default)")
    p.add_argument("--fastdora-options", default="{}", help="JSON dict of FastDoraCallback options")
    p.add_argument("--fsdp2", action="store_true", help="--trainer hf under FSDP2 (launch with torchrun)")
    p.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument("--no-gc", action="store_true", help="without gradient checkpointing")
    a = p.parse_args()

    import torch
    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, set_seed

    from _tiny import checkpointing_args
    from probe import ProbeCallback, fastdora_state

    set_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    targets = TARGETS + (["embed_tokens"] if a.trainer == "hf" and not a.fsdp2 else [])
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, use_dora=True,
                      task_type="CAUSAL_LM")
    ds = load_dataset("json", data_files=a.data, split="train")
    use_cpu = not torch.cuda.is_available()
    common = dict(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4, learning_rate=2e-3, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=use_cpu, seed=0, data_seed=0,
        **checkpointing_args(TrainingArguments, use_reentrant=a.reentrant, enabled=not a.no_gc),
        dataloader_num_workers=0, bf16=False, fp16=False, lr_scheduler_type="constant", warmup_steps=0,
        torch_compile=a.compile,
    )
    if a.fsdp2:
        assert a.trainer == "hf", "--fsdp2 is for --trainer hf"
        common.update(fsdp="full_shard auto_wrap", fsdp_config={
            "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    callbacks = [] if a.fsdp2 else [ProbeCallback(a.model)]
    if a.fastdora:
        from fastdora.plugins import FastDoraCallback  # the plugin under test

        callbacks.insert(0, FastDoraCallback(**json.loads(a.fastdora_options)))

    if a.trainer == "hf":
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        ds = ds.map(lambda r: tok(r["text"], truncation=True, max_length=64), remove_columns=["text"])
        model = get_peft_model(model, lora)
        model.enable_input_require_grads()
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=ds,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=callbacks)
    elif a.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, peft_config=lora, processing_class=tok, train_dataset=ds,
                             args=SFTConfig(**common, max_length=64, dataset_text_field="text"), callbacks=callbacks)
    else:
        from trl import DPOConfig, DPOTrainer

        model = get_peft_model(model, lora)  # a PeftModel passed in; the reference is the adapter-disabled model
        trainer = DPOTrainer(model=model, ref_model=None, processing_class=tok, train_dataset=ds,
                             args=DPOConfig(**common, max_length=64), callbacks=callbacks)

    trainer.train()
    if not a.fsdp2:
        trainer.save_model(os.path.join(a.out, "adapter"))
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    state = fastdora_state(trainer.model)
    if trainer.args.process_index == 0:
        with open(os.path.join(a.out, "losses.json"), "w", encoding="utf-8") as f:
            # what accelerate ran: on a machine without GPUs a Trainer given fsdp_config runs DDP (accelerate has no
            # FSDP for MULTI_CPU)
            engine = str(getattr(trainer.accelerator.state, "distributed_type", "unknown"))
            json.dump({"losses": losses, "final_state": state, "world_size": trainer.args.world_size,
                       "engine": engine, "fsdp": bool(getattr(trainer, "is_fsdp_enabled", False))}, f)
    print(json.dumps({"losses": losses, **state}), flush=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # torchrun workers: every collective is done and every output written; exit without tearing the process
        # group down (a group left to the interpreter's exit can abort the process, "terminate called without an
        # active exception"; a closing barrier once hung a 2-core CI run for its whole timeout)
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
