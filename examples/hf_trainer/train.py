"""A real (tiny) DoRA fine-tune with the Hugging Face Trainer, switched to fastdora by one callback.

    python examples/hf_trainer/train.py                  # CPU by default; the first GPU when one is present
    python examples/hf_trainer/train.py --steps 50 --hidden 256 --layers 4 --out /tmp/fastdora_example

Builds a small Llama model, tokenizer and dataset locally (``examples/_tiny.py``; no model hub), then trains the
same DoRA adapter twice from the same seed: once with stock PEFT, once with ``FastDoraCallback()``. Prints the mean
step time, the peak memory, the loss curves' largest difference and the largest difference between the outputs of
the fastdora-trained model computed by fastdora and by stock PEFT (``fastdora.disable``), and saves the adapter
(a plain PEFT checkpoint: it loads without fastdora). On the CPU the timings are indicative only (a tiny model on
a shared CPU; the ratio varies from run to run): fastdora's speed claims are measured on GPU (benchmarks/README.md).

The one line that matters:

    trainer = Trainer(model=peft_model, args=args, train_dataset=ds, callbacks=[FastDoraCallback()])
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples/ (_tiny.py)

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainerCallback,
    TrainingArguments, set_seed,
)

from _tiny import PROBE_TEXT, build_datasets, build_model, build_tokenizer, checkpointing_args  # noqa: E402

#: printed beside the timings when the device is the CPU (step times of a tiny model on a shared CPU vary a lot)
CPU_TIMING_NOTE = ("timings on CPU are indicative only; fastdora's speed claims are measured on GPU "
                   "(benchmarks/README.md)")


def timing_lines(device: str, mem: str, stock_step: float, stock_peak: float, fast_step: float,
                 fast_peak: float) -> list:
    """The two timing lines (``stock PEFT :`` / ``fastdora   :``); on the CPU the second says that CPU timings are
    indicative only."""
    note = f"; {CPU_TIMING_NOTE}" if device == "CPU" else ""
    return [
        f"stock PEFT : {stock_step * 1e3:8.1f} ms/step, {mem} {stock_peak:8.1f} MiB",
        f"fastdora   : {fast_step * 1e3:8.1f} ms/step, {mem} {fast_peak:8.1f} MiB   "
        f"(x{stock_step / fast_step:.2f} speed{note})",
    ]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kw):
        self._sync()
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self._sync()
        self.times.append(time.perf_counter() - self._t)


def train_once(a, model_dir: str, data: str, use_fastdora: bool):
    set_seed(0)
    device_gpu = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(
        r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0, use_dora=True, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    ds = load_dataset("json", data_files=data, split="train")
    ds = ds.map(lambda r: tok(r["text"], truncation=True, max_length=a.seq_len), remove_columns=["text"])
    out = os.path.join(a.out, "fastdora" if use_fastdora else "stock")
    args = TrainingArguments(
        output_dir=out, max_steps=a.steps, per_device_train_batch_size=a.batch, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not device_gpu, seed=0,
        **checkpointing_args(TrainingArguments),
        bf16=device_gpu and a.bf16, lr_scheduler_type="constant", disable_tqdm=True, log_level="warning",
    )
    timer = StepTimer()
    callbacks = [timer]
    if use_fastdora:
        from fastdora.plugins import FastDoraCallback

        callbacks.append(FastDoraCallback(kernels=a.kernels))
    if device_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device_gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    steady = timer.times[2:] or timer.times  # skip warm-up steps
    model.save_pretrained(os.path.join(out, "adapter"))
    return trainer.model, tok, losses, sum(steady) / len(steady), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.getcwd(), ".work", "example_hf"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--kernels", default=None, choices=["auto", "triton", "eager"])
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on GPU")
    p.add_argument("--check", type=float, default=None, metavar="TOL",
                   help="exit 1 unless the loss curves and the trained model's logits agree with stock PEFT within "
                        "TOL and fastdora's composition ran (the test suite runs this on the CPU)")
    a = p.parse_args()

    model_dir = os.path.join(a.out, f"model_h{a.hidden}_l{a.layers}")
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        build_model(model_dir, build_tokenizer(model_dir), hidden=a.hidden, layers=a.layers)
    data = build_datasets(os.path.join(a.out, "data"), n=max(64, a.steps * a.batch))["text"]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"device: {device}; model: Llama hidden={a.hidden} layers={a.layers}; DoRA r={a.rank}; "
          f"{a.steps} steps of batch {a.batch} x {a.seq_len} tokens, gradient checkpointing")

    _, _, stock_losses, stock_step, stock_peak = train_once(a, model_dir, data, use_fastdora=False)
    model, tok, fast_losses, fast_step, fast_peak = train_once(a, model_dir, data, use_fastdora=True)

    import fastdora

    ids = tok(PROBE_TEXT, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    model.eval()
    with torch.no_grad():
        y_fast = model(input_ids=ids).logits.float()
        fastdora.disable(model)  # the same weights through stock PEFT
        y_stock = model(input_ids=ids).logits.float()
    mem = "peak CUDA memory" if torch.cuda.is_available() else "peak process RSS"
    for line in timing_lines(device, mem, stock_step, stock_peak, fast_step, fast_peak):
        print(line)
    print(f"loss curves: {len(fast_losses)} steps, max |loss(fastdora) - loss(stock)| = "
          f"{max(abs(x - y) for x, y in zip(fast_losses, stock_losses)):.2e}")
    print(f"outputs    : max |logits(fastdora) - logits(stock PEFT)| on the trained model = "
          f"{(y_fast - y_stock).abs().max().item():.2e}")
    print(f"fastdora paths that ran: {dict(fastdora.active_path_counter)}")
    print(f"adapter (plain PEFT checkpoint): {os.path.join(a.out, 'fastdora', 'adapter')}")
    if a.check is not None:
        loss_diff = max(abs(x - y) for x, y in zip(fast_losses, stock_losses))
        logit_diff = (y_fast - y_stock).abs().max().item()
        ran = sum(v for k, v in fastdora.active_path_counter.items() if k.startswith("linear:"))
        problems = [msg for bad, msg in (
            (len(fast_losses) != a.steps or len(stock_losses) != a.steps, f"not {a.steps} logged steps each"),
            (not loss_diff <= a.check, f"loss difference {loss_diff:.2e} > {a.check}"),
            (not logit_diff <= a.check, f"logit difference {logit_diff:.2e} > {a.check}"),
            (ran == 0, "fastdora's composition never ran"),
        ) if bad]
        if problems:
            print("CHECK FAILED: " + "; ".join(problems))
            sys.exit(1)
        print(f"check passed (tolerance {a.check})")


if __name__ == "__main__":
    main()
