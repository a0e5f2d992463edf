"""Short DoRA fine-tune of a Qwen3-like decoder under FSDP1 / FSDP2 / DeepSpeed ZeRO-2/3 (or one process), with
fastdora or stock PEFT; writes losses, peak memory, norm-cache counters and the final trainable parameters.

One launch runs several (engine, impl) pairs in sequence, each from the same seed and data:

    # one process (reference): engine "single"
    python benchmarks/multigpu/train_dist.py --engines single --impls fastdora,peft --out /tmp/r
    # two processes
    torchrun --nproc_per_node 2 benchmarks/multigpu/train_dist.py --engines fsdp1,fsdp2,zero2,zero3 --out /tmp/r

Engines: single, ddp, fsdp1 (PEFT's fsdp_auto_wrap_policy), fsdp1_orig (same, use_orig_params=True), fsdp1_bf16
(same, bf16 MixedPrecision policy), fsdp2 (fully_shard per decoder layer + root), zero2, zero3 (torch AdamW).
(``accelerate launch --num_processes 2 benchmarks/multigpu/train_dist.py ...`` works the same way: the script only
reads the torchrun environment variables.) On CPU the process group uses gloo and DeepSpeed needs
``DS_ACCELERATOR=cpu``. Every rank sees a different slice of the same global batch, so an N-process run and the
one-process run on the whole global batch follow the same trajectory up to floating-point reassociation.

Outputs in ``--out``: ``<engine>-<impl>.json`` (losses per optimizer step, peak memory, path counters, timing) and,
with ``--save-params``, ``<engine>-<impl>.pt`` (full trainable parameters, fp32, on rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--engines", default="single")
    p.add_argument("--impls", default="fastdora,peft")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--micro-bs", type=int, default=2, help="per rank")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--bf16", action="store_true", help="bf16 compute (engine-native mixed precision / autocast)")
    p.add_argument("--global-world", type=int, default=0, help="single engine: emulate this many ranks' batch")
    p.add_argument("--save-params", action="store_true")
    p.add_argument("--data", default="random", choices=["random", "pattern"])
    p.add_argument("--fsdp1-mp", action="store_true", help="FSDP1 MixedPrecision(bf16) policy")
    p.add_argument("--fsdp1-orig-params", action="store_true", help="FSDP1 use_orig_params=True")
    p.add_argument("--zero3-release", action="store_true", help="ZeRO-3: no prefetch/reuse (params gone after use)")
    p.add_argument("--out", required=True)
    return p.parse_args()


def dist_info():
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return ws, rank, local


def device_for(local):
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def build_model(args, impl, device):
    import transformers
    from peft import LoraConfig, get_peft_model

    import fastdora

    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(64, args.seq),
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    if hasattr(model.config, "_attn_implementation"):
        model.config._attn_implementation = "sdpa"
    lcfg = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=args.dropout, use_dora=True, target_modules="all-linear"
    )
    torch.manual_seed(1)
    model = get_peft_model(model, lcfg)
    # non-trivial B so the DoRA norm depends on A and B from step 0
    torch.manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
        for m in model.modules():
            if hasattr(m, "lora_magnitude_vector") and "default" in getattr(m, "lora_magnitude_vector", {}):
                w = m.get_base_layer().weight
                lw = m.lora_B["default"].weight @ m.lora_A["default"].weight
                m.lora_magnitude_vector["default"].weight.copy_((w + m.scaling["default"] * lw).norm(dim=1))
    if impl == "fastdora":
        rep = fastdora.enable(model)
        assert rep.total_converted > 0, str(rep)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.to(device)


def global_batch(args, step, micro, rows):
    """The global micro-batch (step, micro) of ``rows`` sequences, the same for every world size. ``--data random``:
    uniform tokens (the loss stays near log(vocab)); ``--data pattern``: arithmetic token sequences with a random
    start and stride per row, which the model learns within a few steps (the loss falls, so a wrong or stale norm
    shows up as diverging curves)."""
    g = torch.Generator().manual_seed(1000 + 97 * step + micro)
    if getattr(args, "data", "random") == "pattern":
        start = torch.randint(0, args.vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 8, (rows, 1), generator=g)
        return (start + stride * torch.arange(args.seq)) % args.vocab
    return torch.randint(0, args.vocab, (rows, args.seq), generator=g)


def batches(args, step, micro, rank, ws, device):
    """Rank `rank`'s slice of the global micro-batch (step, micro): identical global data for every world size."""
    ids = global_batch(args, step, micro, ws * args.micro_bs)
    return ids[rank * args.micro_bs : (rank + 1) * args.micro_bs].to(device)


def clean(name):
    name = re.sub(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod|module)\.", "", name)
    return name


def trainable_state(engine, model):
    out = {}
    if engine.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        ctx = FSDP.summon_full_params(model, writeback=False)
    elif engine == "zero3":
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters([p for p in model.parameters() if p.requires_grad])
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[clean(n)] = t.detach().float().cpu().clone()
    return out


def zero3_selfcheck(args, model, device):
    """Outside any forward every ZeRO-3 param is partitioned: fastdora's norm must then gather W (cache miss only) and
    copy A, B inside their own calls. Compare with the norm of the gathered dense weights."""
    import deepspeed

    import fastdora
    from fastdora import distributed as fdd
    from fastdora.stats import active_path_counter

    layer = next(m for m in model.modules() if "default" in getattr(m, "lora_magnitude_vector", {}))
    base, A, B = layer.get_base_layer(), layer.lora_A["default"], layer.lora_B["default"]
    mag, s = fdd.unwrap(layer.lora_magnitude_vector["default"]), layer.scaling["default"]
    status = {"W": str(base.weight.ds_status), "A": str(A.weight.ds_status), "B": str(B.weight.ds_status)}
    before = dict(active_path_counter)
    fastdora.invalidate_norm_cache()
    x = torch.randn(3, base.in_features, device=device, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    with torch.no_grad():
        norm, _ = fdd.linear_norm_and_lora(mag, x, base, A, B, s, "default")
        with deepspeed.zero.GatheredParameters([base.weight, A.weight, B.weight]):
            ref = (base.weight.float() + s * B.weight.float() @ A.weight.float()).norm(dim=1)
    after = dict(active_path_counter)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    return {"status_outside_forward": status, "counters": delta, "max_abs_err": float((norm - ref).abs().max())}


def run_one(args, engine, impl, ws, rank, device):
    import fastdora
    from fastdora.stats import active_path_counter, reset

    reset()
    data_ws = args.global_world if (engine == "single" and args.global_world) else ws
    model = build_model(args, impl, device)
    params = [p for p in model.parameters() if p.requires_grad]
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    ds_engine = None
    if engine == "single" or engine == "ddp":
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.AdamW(params, lr=args.lr)
    elif engine in ("fsdp1", "fsdp1_bf16", "fsdp1_orig"):
        from peft.utils.other import fsdp_auto_wrap_policy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision

        # --bf16: fp32 params + autocast (an FSDP1 MixedPrecision policy breaks stock PEFT here: PEFT casts x to
        # lora_A.weight.dtype read outside the lora_A unit, whose dtype differs between forward and recompute)
        mp = None
        if args.fsdp1_mp or engine == "fsdp1_bf16":  # bf16 MixedPrecision policy + bf16 autocast
            mp = MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)
            amp = torch.autocast(device.type, dtype=torch.bfloat16)
        model = FSDP(
            model,
            auto_wrap_policy=fsdp_auto_wrap_policy(model),
            use_orig_params=args.fsdp1_orig_params or engine == "fsdp1_orig",
            device_id=device,  # CPU (gloo) needs it explicitly
            mixed_precision=mp,
        )  # with --bf16 also autocast, as accelerate does (PEFT casts x to lora_A.weight.dtype outside the unit)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if args.bf16 else MixedPrecisionPolicy()
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    elif engine in ("zero2", "zero3"):
        import deepspeed

        cfg = {
            "train_micro_batch_size_per_gpu": args.micro_bs,
            "gradient_accumulation_steps": args.grad_accum,
            "zero_optimization": {"stage": 2 if engine == "zero2" else 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if args.zero3_release:  # release every param right after its module's forward: no prefetch, no reuse
            cfg["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0,
                                            stage3_max_live_parameters=0)
        if args.bf16:
            cfg["bf16"] = {"enabled": True}
        opt = torch.optim.AdamW(params, lr=args.lr)
        ds_engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        amp = contextlib.nullcontext()
    else:
        raise ValueError(engine)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    fwd = ds_engine if ds_engine is not None else model
    for step in range(args.steps):
        t0 = time.perf_counter()
        tot = torch.zeros((), device=device, dtype=torch.float64)
        for micro in range(args.grad_accum):
            ids = batches(args, step, micro, 0 if engine == "single" else rank, data_ws, device)
            if engine == "single" and data_ws > 1:  # the whole global batch in one process
                ids = global_batch(args, step, micro, data_ws * args.micro_bs).to(device)
            with amp:
                loss = fwd(input_ids=ids, labels=ids).loss
            tot += loss.detach().double()
            if ds_engine is not None:
                ds_engine.backward(loss)
                ds_engine.step()
            else:
                (loss / args.grad_accum).backward()
        if ds_engine is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if ws > 1 and engine != "single":
            dist.all_reduce(tot)
            tot /= ws
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(tot / args.grad_accum))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    counters = dict(active_path_counter) if impl == "fastdora" else {}
    selfcheck = zero3_selfcheck(args, ds_engine.module, device) if (engine == "zero3" and impl == "fastdora") else None
    state = trainable_state(engine, ds_engine.module if ds_engine is not None else model)
    res = {
        "engine": engine,
        "impl": impl,
        "world_size": ws if engine != "single" else 1,
        "losses": losses,
        "step_time_s": times,
        "median_step_time_s": sorted(times[1:] or times)[len(times[1:] or times) // 2],
        "peak_mem_gib": peak,
        "counters": counters,
        "fastdora_epoch": fastdora.cache.epoch(),
        "zero3_selfcheck": selfcheck,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "config": {k: v for k, v in vars(args).items() if k not in ("engines", "impls", "out")},
        "torch": torch.__version__,
    }
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{engine}-{impl}.json"), "w") as f:
            json.dump(res, f, indent=1)
        if args.save_params:
            torch.save(state, os.path.join(args.out, f"{engine}-{impl}.pt"))
        print(f"[{engine}/{impl}] losses {['%.6f' % x for x in losses]} peak {peak} counters {res['counters']}",
              flush=True)
    del model, opt, ds_engine, fwd, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if ws > 1 and dist.is_initialized():
        dist.barrier()


def main():
    args = parse()
    ws, rank, local = dist_info()
    device = device_for(local)
    engines = [e for e in args.engines.split(",") if e]
    if ws > 1 or any(e != "single" for e in engines):
        if any(e.startswith("zero") for e in engines):
            import deepspeed

            if device.type == "cpu":  # skip DeepSpeed's JIT C++ shared-memory op (minutes to build): gloo suffices
                import deepspeed.ops

                deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
            deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        else:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    for engine in engines:
        for impl in [i for i in args.impls.split(",") if i]:
            if engine in ("fsdp1_bf16", "fsdp1_orig") and impl == "peft":
                # stock PEFT fails in both (CheckpointError / IndexError, see README): fastdora only
                continue
            run_one(args, engine, impl, ws, rank, device)
    if dist.is_initialized():
        dist.destroy_process_group()
    if ws > 1:
        # every result is written: leave without the interpreter's teardown, where a gloo / DeepSpeed worker thread
        # still joinable at exit has aborted a rank after a complete CPU run (std::terminate, SIGABRT)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
