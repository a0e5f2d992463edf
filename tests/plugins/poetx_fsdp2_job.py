"""One POET-X training run of a tiny Llama, alone (a plain model) or as one rank of a torchrun job with FSDP2
(``fully_shard`` on every decoder layer and the root; CPU, gloo); used by test_poetx_fsdp2.py. A plain loop doing what
PoetXCallback does: torch AdamW with the ``Q`` parameters in a group of their own (half the learning rate, no weight
decay), ``fastdora.poetx.merge`` after every ``MERGE_INTERVAL``-th step, then the ``Q`` optimizer state dropped.
Global batch 4 per step whatever the number of processes (rank r takes rows 2r, 2r + 1 of each batch of 4).

usage: [torchrun --nproc_per_node 2] python poetx_fsdp2_job.py OUT_DIR

Writes OUT_DIR/rank<R>.pt: this rank's losses, the steps it merged after, the collective calls counted while it
merged (torch.distributed's functions, wrapped, and DTensor's functional collectives, by CommDebugMode), the
permutations each merge drew, and the final state dict with every sharded tensor gathered. With FSDP2 it also
merges a lone PoetXLinear (24 -> 40, bias, block 8: q_in / q_out of 3 / 5 rows, uneven shards) that is itself the
FSDP root, right after a forward (which leaves the root unsharded), against an unsharded copy: "lone_ok".
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.plugins._support import count_calls  # noqa: E402
from tests.plugins.test_poetx_callback import dataset, tiny_llama  # noqa: E402

from fastdora import poetx  # noqa: E402
from fastdora.plugins import _poetx_common as px  # noqa: E402

STEPS, MERGE_INTERVAL, GLOBAL_BATCH, LR = 5, 2, 4, 1e-2

torch.set_num_threads(1)
out = sys.argv[1]
world = int(os.environ.get("WORLD_SIZE", "1"))

calls = count_calls(dist, (
    "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv",
    "scatter", "gather", "broadcast_object_list", "all_gather_object", "reduce_scatter", "all_to_all",
    "all_to_all_single",
))

rank = 0
model = tiny_llama()
report = poetx.convert(model, block_size=8, merge_interval=MERGE_INTERVAL, seed=0)
if world > 1:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, torch.distributed.tensor.DTensor)

q_params = px.q_parameters(model)
q_ids = {id(p) for p in q_params}
others = [p for p in model.parameters() if p.requires_grad and id(p) not in q_ids]
opt = torch.optim.AdamW([{"params": others, "weight_decay": 0.01},
                         {"params": q_params, "lr": LR * 0.5, "weight_decay": 0.0}], lr=LR)

rows = dataset()
per_rank = GLOBAL_BATCH // world
losses, merges, drawn, dist_calls, comm_counts = [], [], [], 0, []
for step in range(1, STEPS + 1):
    batch = rows[(step - 1) * GLOBAL_BATCH + rank * per_rank:][:per_rank]
    ids = torch.stack([r["input_ids"] for r in batch])
    loss = model(input_ids=ids, labels=ids).loss  # every row has as many tokens: the ranks' mean is the global one
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    if px.merge_due(step, MERGE_INTERVAL):
        from torch.distributed.tensor.debug import CommDebugMode

        before = calls["n"]
        with CommDebugMode() as comm:
            merged = poetx.merge(model)
        dist_calls += calls["n"] - before
        comm_counts.append({str(k): v for k, v in comm.get_comm_counts().items()})
        px.reset_state(opt, px.q_parameters(model))
        merges.append(step)
        drawn.append({k: v.clone() for k, v in model.state_dict().items() if k.endswith(("perm_in", "perm_out"))})


def full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


lone = {}
if world > 1:  # a root FSDP module keeps its parameters unsharded after a forward: merge() must reshard it first
    def lone_layer():
        torch.manual_seed(0)
        layer = poetx.PoetXLinear(torch.nn.Linear(24, 40), 8, seed=3)
        with torch.no_grad():
            layer.q_in.normal_(0, 0.1)
            layer.q_out.normal_(0, 0.1)
        return layer

    ref, sharded = lone_layer(), lone_layer()
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(5))
    lone["forward_diff"] = (sharded(x) - ref(x)).abs().max().item()
    ref.merge()
    poetx.merge(sharded)
    lone["merged_equal"] = all(torch.equal(full(getattr(sharded, n)), p) for n, p in ref.named_parameters())
    lone["after_merge_diff"] = (sharded(x) - ref(x)).abs().max().item()

state = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
torch.save({"world": world, "losses": losses, "merges": merges, "converted": len(report.converted),
            "merged_layers": merged, "dist_calls_in_merges": dist_calls, "comm_counts": comm_counts,
            "drawn": drawn, "lone": lone, "state": state}, os.path.join(out, f"rank{rank}.pt"))
if world > 1:  # as poetx_ddp_job.py: every collective is done and the output written, no teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
