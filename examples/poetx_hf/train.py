"""POET-X training of a (tiny) Llama with the Hugging Face Trainer: one callback, then a plain model.

    python examples/poetx_hf/train.py                   # CPU by default; the first GPU when one is present
    python examples/poetx_hf/train.py --steps 60 --hidden 256 --block-size 64 --merge-interval 20

Builds a small Llama model, tokenizer and dataset locally (``examples/_tiny.py``; no model hub), trains every linear
layer but ``lm_head`` with POET-X (``W`` frozen between two learned block-orthogonal rotations, folded into ``W``
every ``--merge-interval`` optimizer steps), exports the model back to plain ``nn.Linear`` layers, saves it, loads
it with stock transformers and compares its outputs with the trained model's. The one line that matters:

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[PoetXCallback(block_size=256, merge_interval=200, mode="fast")])
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples/ (_tiny.py)

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments, set_seed,
)

from _tiny import PROBE_TEXT, build_datasets, build_model, build_tokenizer, checkpointing_args  # noqa: E402
from fastdora import poetx  # noqa: E402
from fastdora.plugins import PoetXCallback  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.getcwd(), ".work", "example_poetx"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--merge-interval", type=int, default=10)
    p.add_argument("--mode", default="fast", choices=["fast", "mem"])
    p.add_argument("--check", type=float, default=None, metavar="TOL",
                   help="exit 1 unless the loss went down, the merges came every --merge-interval steps and the "
                        "exported model, loaded by stock transformers, gives the trained model's logits within TOL")
    a = p.parse_args()

    model_dir = os.path.join(a.out, f"model_h{a.hidden}_l{a.layers}")
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        build_model(model_dir, build_tokenizer(model_dir), hidden=a.hidden, layers=a.layers)
    data = build_datasets(os.path.join(a.out, "data"), n=max(64, a.steps * a.batch))["text"]
    gpu = torch.cuda.is_available()

    set_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = load_dataset("json", data_files=data, split="train")
    ds = ds.map(lambda r: tok(r["text"], truncation=True, max_length=a.seq_len), remove_columns=["text"])
    args = TrainingArguments(
        output_dir=os.path.join(a.out, "run"), max_steps=a.steps, per_device_train_batch_size=a.batch,
        learning_rate=a.lr, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=not gpu, bf16=gpu, seed=0, **checkpointing_args(TrainingArguments), disable_tqdm=True,
        log_level="warning",
    )
    callback = PoetXCallback(block_size=a.block_size, merge_interval=a.merge_interval, mode=a.mode)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback],
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'CPU'}; Llama hidden={a.hidden} layers={a.layers}; "
          f"POET-X block_size={a.block_size}, mode={a.mode}; {a.steps} steps")
    print(f"loss       : {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"merges     : after optimizer steps {callback.merges}")

    ids = tok(PROBE_TEXT, return_tensors="pt").input_ids.to(trainer.model.device)
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits.float().cpu()
    poetx.export(model)  # every POET-X layer back to nn.Linear with its merged weight
    plain_dir = os.path.join(a.out, "plain_model")
    trainer.save_model(plain_dir)
    tok.save_pretrained(plain_dir)
    stock = AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (stock(input_ids=ids.cpu()).logits.float() - trained).abs().max().item()
    print(f"exported   : {plain_dir} (plain transformers checkpoint); max |logits(stock load) - logits(trained)| "
          f"= {diff:.2e}")
    print(f"report     : {os.path.join(args.output_dir, 'poetx_report.json')}")
    if a.check is not None:
        expected = [s for s in range(1, a.steps + 1) if s % a.merge_interval == 0]
        problems = [msg for bad, msg in (
            (not losses[-1] < losses[0], "the loss did not go down"),
            (callback.merges != expected, f"merges {callback.merges}, expected {expected}"),
            (not diff <= a.check, f"logit difference {diff:.2e} > {a.check}"),
        ) if bad]
        if problems:
            print("CHECK FAILED: " + "; ".join(problems))
            sys.exit(1)
        print(f"check passed (tolerance {a.check})")


if __name__ == "__main__":
    main()
