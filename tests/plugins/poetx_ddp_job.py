"""One POET-X training run with the Hugging Face Trainer, alone or as one rank of a torchrun job (CPU, gloo); used by
test_poetx_ddp.py. Global batch 4 per optimizer step whatever the number of processes.

usage: [torchrun --nproc_per_node 2] python poetx_ddp_job.py OUT_DIR

Writes OUT_DIR/rank<R>.pt: the logged losses, the callback's merges, the number of torch.distributed calls made
while the callback merged, and the final state dict.
"""

import os
import sys

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.plugins._support import count_calls  # noqa: E402
from tests.plugins.test_poetx_callback import dataset, tiny_llama  # noqa: E402

from fastdora.plugins import PoetXCallback  # noqa: E402

torch.set_num_threads(1)
out = sys.argv[1]
world = int(os.environ.get("WORLD_SIZE", "1"))

calls = count_calls(dist, (
    "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv",
    "scatter", "gather", "broadcast_object_list", "all_gather_object",
))


class CountedPoetX(PoetXCallback):
    """Counts torch.distributed calls during the callback's merges and keeps the permutations each merge drew (before
    any later forward, where DDP's buffer broadcast would overwrite a rank's own)."""

    in_merges = 0
    drawn: list = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        before, merged = calls["n"], len(self.merges)
        control = super().on_step_end(args, state, control, model=model, **kwargs)
        self.in_merges += calls["n"] - before
        if len(self.merges) > merged:
            perms = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("perm_in", "perm_out"))}
            self.drawn.append(perms)
        return control


model = tiny_llama()
cb = CountedPoetX(block_size=8, merge_interval=2)
args = TrainingArguments(
    output_dir=out, max_steps=5, per_device_train_batch_size=4 // world, learning_rate=1e-2, logging_steps=1,
    save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, lr_scheduler_type="constant",
    disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=True,
    gradient_checkpointing_kwargs={"use_reentrant": False},
)
trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[cb])
trainer.train()
rank = trainer.args.process_index
torch.save({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "merges": cb.merges,
            "calls_in_merges": cb.in_merges, "drawn": cb.drawn, "world": trainer.args.world_size,
            "state": {k: v.clone() for k, v in model.state_dict().items()}}, os.path.join(out, f"rank{rank}.pt"))
if torch.distributed.is_available() and torch.distributed.is_initialized():
    # torchrun workers: every collective is done and this rank's output written; exit without tearing the process
    # group down (a group left to the interpreter's exit can abort the process, "terminate called without an active
    # exception"; a closing barrier can wait out the test's whole timeout on a loaded 2-core machine)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
