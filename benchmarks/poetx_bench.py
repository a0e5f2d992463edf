"""One POET-X layer, forward + backward, at Llama-8B shapes: fastdora's POET-X (fast / mem modes, with its Triton
kernels and with its PyTorch path; ``poetx-fast-f32blocks``: fast mode with the series writing float32 blocks that each
block product splits again, ``fastdora.poetx.replay.SPLIT_BLOCKS = False``; ``poetx-fast-no-pdl``: fast mode with its
kernels launched plainly rather than as programmatic dependent launches, ``fastdora._launch.PDL = False``) against a
trainable ``nn.Linear`` and a plain PyTorch POET-X written the straightforward way (``_poetx_plain.PlainPoetX``: blocks
built with batched matmuls, separate gathers of the activations, autograd backward).

Shapes 4096→4096, 4096→14336, 14336→4096; sequence 2048, batch 1 and 4; block sizes 256 and 512; bfloat16 activations
and weight, float32 ``Q``. Each row: the median time of ``y = layer(x); y.backward(dy)`` (``triton.testing.do_bench``
on CUDA, ``time.perf_counter`` on CPU), the ratio to ``nn.Linear``, and the peak memory of one step above what the
inputs hold. Prints a table and writes JSON (``--out``).

``--sections ops`` times the single operations instead, kernels against the PyTorch path at 4096 features and 2048 /
8192 tokens: ``rotate`` (forward and transposed), ``block_outer``, the Cayley–Neumann forward and backward, and
``rotate`` / ``block_outer`` / the permutation pass / the Cayley–Neumann series (72 blocks, a gate projection's) under
the tile configurations of ``ROTATE_SWEEP`` / ``OUTER_SWEEP`` / ``GATHER_SWEEP`` / ``CAYLEY_SWEEP`` (and the series'
product precisions).

Usage:
  python benchmarks/poetx_bench.py --out poetx_bench.json                  # CUDA, the layer grid (~2 min on an H200)
  python benchmarks/poetx_bench.py --sections ops --out poetx_ops.json     # the single operations
  python benchmarks/poetx_bench.py --sections permute --out permute.json   # the permutation pass vs a plain copy
  python benchmarks/poetx_bench.py --device cpu --tiny --out /tmp/x.json   # tiny shapes on CPU: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time

import torch
from torch import nn

from fastdora import _launch
from fastdora.poetx import PoetXLinear
from fastdora.poetx import kernels as poetx_kernels
from fastdora.poetx import ops as poetx_ops
from fastdora.poetx import replay as poetx_replay
from fastdora.poetx import cayley
from fastdora.poetx.cayley import cayley_neumann, skew_size

from _poetx_plain import PlainPoetX  # this folder is on sys.path when run as a script

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
BATCHES = [1, 4]
SEQ = 2048
BLOCKS = [256, 512]
TINY = dict(shapes=[(64, 64), (64, 128), (128, 64)], batches=[1, 2], seq=16, blocks=[16, 32])
VARIANTS = ["linear", "plain", "poetx-fast-torch", "poetx-fast", "poetx-fast-f32blocks", "poetx-fast-no-pdl",
            "poetx-mem"]


def _layer(variant: str, weight: torch.Tensor, b: int) -> nn.Module:
    d_out, d_in = weight.shape
    if variant == "linear":
        lin = nn.Linear(d_in, d_out, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(weight)
        return lin
    if variant == "plain":
        return PlainPoetX(weight, b)
    base = nn.Linear(d_in, d_out, bias=False, device="meta")
    base.weight = nn.Parameter(weight.detach().clone())
    layer = PoetXLinear(base, b, mode="mem" if variant == "poetx-mem" else "fast")
    with torch.no_grad():  # a layer in training: Q away from zero
        layer.q_in.normal_(0, 0.3 / b ** 0.5)
        layer.q_out.normal_(0, 0.3 / b ** 0.5)
    return layer


def _timer(device: str, reps: int):
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    def cpu_median(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_median


def run(device: str, tiny: bool, variants: list) -> list:
    shapes = TINY["shapes"] if tiny else SHAPES
    batches = TINY["batches"] if tiny else BATCHES
    seq = TINY["seq"] if tiny else SEQ
    blocks = TINY["blocks"] if tiny else BLOCKS
    dtype = torch.bfloat16
    timer = _timer(device, reps=3 if tiny else 10)
    rows = []
    for d_in, d_out in shapes:
        weight = (torch.randn(d_out, d_in, device=device) / d_in ** 0.5).to(dtype)
        for batch in batches:
            x = torch.randn(batch, seq, d_in, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(batch, seq, d_out, device=device, dtype=dtype)
            base_ms = None
            for b in blocks:
                for variant in variants:
                    if variant == "linear" and b != blocks[0]:
                        continue  # nn.Linear has no block size: measured once per shape and batch
                    layer = _layer(variant, weight, b)

                    def step(layer=layer):
                        x.grad = None
                        layer(x).backward(dy)
                        for p in layer.parameters():
                            p.grad = None

                    # "-f32blocks": the series writes float32 blocks that each block product splits again;
                    # "-no-pdl": the kernels launched plainly (the layer's launches recorded again for it and after it)
                    poetx_replay.clear()
                    with _settings(poetx_kernels, ENABLED=variant != "poetx-fast-torch"), \
                            _settings(poetx_replay, SPLIT_BLOCKS=variant != "poetx-fast-f32blocks"), \
                            _settings(_launch, PDL=variant != "poetx-fast-no-pdl"):
                        step()  # compiles the kernels, records the launches, fills the caches
                        if device == "cuda":
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            before = torch.cuda.memory_allocated()
                            step()
                            torch.cuda.synchronize()
                            peak_mb = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
                        else:
                            peak_mb = None
                        ms = timer(step)
                    if variant == "linear":
                        base_ms = ms
                    rows.append(dict(d_in=d_in, d_out=d_out, batch=batch, seq=seq, block=b, variant=variant, ms=ms,
                                     vs_linear=None if base_ms is None else ms / base_ms, peak_mb=peak_mb))
                    print(_fmt(rows[-1]), flush=True)
                    del layer
    return rows


ROTATE_SWEEP = [dict(block_m=64, block_c=128, block_k=32, warps=4), dict(block_m=64, block_c=256, block_k=32, warps=8),
                dict(block_m=128, block_c=128, block_k=32, warps=8), dict(block_m=32, block_c=256, block_k=64, warps=8),
                dict(block_m=16, block_c=256, block_k=64, warps=4, blocks_per_prog="all"),
                dict(block_m=32, block_c=128, block_k=64, warps=4, blocks_per_prog="all"),
                dict(block_m=64, block_c=128, block_k=32, warps=4, blocks_per_prog=4)]
OUTER_SWEEP = [dict(block_n=64, block_c=64, warps=4), dict(block_n=64, block_c=128, warps=8),
               dict(block_n=32, block_c=128, warps=8), dict(block_n=128, block_c=128, warps=8)]
GATHER_SWEEP = [dict(block_r=8, block_c=512, warps=4), dict(block_r=32, block_c=256, warps=8),
                dict(block_r=64, block_c=128, warps=8), dict(block_r=16, block_c=1024, warps=8),
                dict(block_r=4, block_c=1024, warps=4), dict(block_r=1, block_c=4096, warps=8),
                dict(block_r=2, block_c=2048, warps=8)]
# the Cayley–Neumann products' tiles, and their fp32 product precision ("tf32x3", the default; "tf32"; "ieee")
CAYLEY_SWEEP = [dict(block_t=64, block_k=32, warps=4), dict(block_t=64, block_k=64, warps=4),
                dict(block_t=128, block_k=32, warps=8), dict(block_t=64, block_k=32, warps=8),
                dict(block_t=32, block_k=32, warps=4), dict(block_t=128, block_k=16, warps=8)]


def run_ops(device: str, tiny: bool, sweep: bool = False) -> list:
    """Each operation alone: kernels vs the PyTorch path (and tile sweeps), median ms."""
    timer = _timer(device, reps=3 if tiny else 10)
    d = 64 if tiny else 4096
    rows = []

    def record(op, n, b, variant, fn):
        ms = timer(fn)
        rows.append(dict(op=op, tokens=n, d=d, block=b, variant=variant, ms=ms))
        print(f"{op:<16} tokens {n:<5} d {d} b={b:<4} {variant:<40} {ms:9.3f} ms", flush=True)

    def record_with(attr, value, *args):
        """``record(*args)`` with ``poetx_kernels.<attr>`` set to ``value`` (restored afterwards)."""
        with _settings(poetx_kernels, **{attr: value}):
            record(*args)

    poetx_kernels.BLOCK_OUTER = True  # each operation's kernel against PyTorch, the block-gradient kernel included
    for b in (TINY["blocks"] if tiny else BLOCKS):
        packed = torch.randn(d // b, skew_size(b), device=device) * (0.3 / b ** 0.5)
        g = cayley_neumann(packed, b).detach()
        grad_g = torch.randn_like(g)
        perm = torch.randperm(d, device=device)
        for n in ((16,) if tiny else (2048, 8192)):
            t = torch.randn(n, d, device=device, dtype=torch.bfloat16)
            c = torch.randn(n, d, device=device, dtype=torch.bfloat16)
            p = packed.clone().requires_grad_()
            tp = poetx_ops._gather(t, perm)
            cases = [
                ("rotate", lambda: poetx_ops.rotate(t, perm, g)),
                ("rotate-T", lambda: poetx_ops.rotate(t, perm, g, transpose=True)),
                ("block_outer", lambda: poetx_ops.block_outer(t, c, perm, g)),
                ("permute", lambda: poetx_ops._gather(t, perm)),
                ("block products", lambda: poetx_ops._block_mm(tp, g, False, None, None)),
                ("block gradient", lambda: poetx_ops._block_outer(tp, c, g)),
                ("cayley fwd+bwd", lambda: cayley_neumann(p, b).backward(grad_g)),
            ]
            for op, fn in cases:
                if op == "cayley fwd+bwd" and n != (16 if tiny else 2048):
                    continue  # no tokens involved
                variants = [("kernels", True, False), ("pytorch", False, False)]
                if op in ("rotate", "rotate-T", "block_outer"):
                    variants.append(("kernels, permutation fused", True, True))
                for name, enabled, fused in variants:
                    with _settings(poetx_kernels, ENABLED=enabled, PERMUTE_FUSED=fused):
                        record(op, n, b, name, fn)
            if not sweep:
                continue
            for cfg in ROTATE_SWEEP:
                record_with("ROTATE_CONFIG", cfg, "rotate", n, b, f"kernels {cfg}", cases[0][1])
            if n == (16 if tiny else 2048):  # no tokens involved; a gate projection's blocks (4096 + 14336 features:
                # 72 of 256)
                n_many = 4 if tiny else 18432 // b
                many = torch.randn(n_many, skew_size(b), device=device) * (0.3 / b ** 0.5)
                g_many = torch.randn(n_many, b, b, device=device)
                pm = many.clone().requires_grad_()

                def cayley_many():
                    cayley_neumann(pm, b).backward(g_many)

                for cfg in CAYLEY_SWEEP:
                    record_with("CAYLEY_CONFIG", cfg, "cayley fwd+bwd", n, b, f"{n_many} blocks, kernels {cfg}",
                                cayley_many)
                for prec in ("tf32", "ieee"):
                    record_with("CAYLEY_PRECISION", prec, "cayley fwd+bwd", n, b,
                                f"{n_many} blocks, kernels, {prec} products", cayley_many)
            for cfg in GATHER_SWEEP:
                record_with("GATHER_CONFIG", cfg, "permute", n, b, f"kernels {cfg}", cases[3][1])
            if poetx_kernels.applies(t):
                perm32 = perm.to(torch.int32)
                record("permute", n, b, "kernels, int32 index", lambda: poetx_kernels.gather(t, perm32))
            for cfg in OUTER_SWEEP:
                record_with("OUTER_CONFIG", cfg, "block_outer", n, b, f"kernels {cfg}", cases[2][1])
    return rows


def run_profile(device: str, tiny: bool, top: int = 25) -> list:
    """One fwd+bwd of a fast-mode layer (kernels and PyTorch path) under ``torch.profiler``: GPU time per kernel."""
    shapes = [(64, 64, 2, 16)] if tiny else [(4096, 4096, 1, 256), (4096, 4096, 4, 256), (4096, 14336, 4, 256)]
    seq = TINY["seq"] if tiny else SEQ
    act = torch.profiler.ProfilerActivity
    out = []
    for d_in, d_out, batch, b in shapes:
        weight = (torch.randn(d_out, d_in, device=device) / d_in ** 0.5).to(torch.bfloat16)
        x = torch.randn(batch, seq, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(batch, seq, d_out, device=device, dtype=torch.bfloat16)
        for variant in ("linear", "poetx-fast", "poetx-fast-torch"):
            layer = _layer(variant, weight, b)
            with _settings(poetx_kernels, ENABLED=variant != "poetx-fast-torch"):
                for _ in range(3):
                    layer(x).backward(dy)
                if device == "cuda":
                    torch.cuda.synchronize()
                acts = [act.CPU] + ([act.CUDA] if device == "cuda" else [])
                with torch.profiler.profile(activities=acts) as prof:
                    layer(x).backward(dy)
                    if device == "cuda":
                        torch.cuda.synchronize()
            kernels = {}
            for e in prof.key_averages():
                us = getattr(e, "self_device_time_total", 0) or 0
                if us and e.device_type == torch.autograd.DeviceType.CUDA:
                    kernels[e.key] = (us / 1e3, e.count)
            ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
            total = sum(v[0] for v in kernels.values())
            host = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
                           if e.device_type == torch.autograd.DeviceType.CPU), key=lambda r: -r[1])
            host_ms = sum(r[1] for r in host)
            print(f"--- {d_in}->{d_out} batch {batch} b={b} {variant}: GPU kernel time {total:.3f} ms, host (self CPU "
                  f"time of the profiled ops) {host_ms:.3f} ms", flush=True)
            for k, (ms, n) in ranked:
                print(f"   {ms:8.3f} ms  x{n:<3} {k[:110]}", flush=True)
            print("   host, largest self CPU times:", flush=True)
            for k, ms, n in host[:12]:
                print(f"   {ms:8.3f} ms  x{n:<3} {k[:110]}", flush=True)
            out.append(dict(d_in=d_in, d_out=d_out, batch=batch, block=b, variant=variant, gpu_ms=total,
                            host_ms=host_ms, kernels=[[k[:110], ms, n] for k, (ms, n) in ranked],
                            host=[[k[:110], ms, n] for k, ms, n in host[:top]]))
    return out


def run_host(device: str, tiny: bool, top: int = 30) -> list:
    """Host time of a fast-mode layer's fwd+bwd (kernels path), 4096 -> 4096, batch 1, b=256: the Python functions with
    the largest own time under ``cProfile`` over 20 steps, printed and returned."""
    import cProfile
    import pstats

    d, batch, b = (64, 2, 16) if tiny else (4096, 1, 256)
    seq = TINY["seq"] if tiny else SEQ
    weight = (torch.randn(d, d, device=device) / d ** 0.5).to(torch.bfloat16)
    x = torch.randn(batch, seq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(batch, seq, d, device=device, dtype=torch.bfloat16)
    layer = _layer("poetx-fast", weight, b)
    for _ in range(5):
        layer(x).backward(dy)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        layer(x).backward(dy)
    host_ms = (time.perf_counter() - t0) / 20 * 1e3  # the GPU runs behind: this is the host's time per step
    if device == "cuda":
        torch.cuda.synchronize()

    def launched():
        t0 = time.perf_counter()
        for _ in range(20):
            layer(x).backward(dy)
        return (time.perf_counter() - t0) / 20 * 1e3

    host_ms_launchers = _without_replay(launched)  # the same steps, no launch replayed
    if device == "cuda":
        torch.cuda.synchronize()
    host_ms_py_replay = _without_programs(lambda: (layer(x).backward(dy), launched())[1])  # replayed from Python
    layer(x).backward(dy)  # the segments recorded again (with launch programs), outside what is measured below
    if device == "cuda":
        torch.cuda.synchronize()
    # the same steps with every kernel launched through Triton's JIT dispatch (no cached launch, nothing replayed)
    launchers = [v for v in vars(poetx_kernels).values() if type(v).__name__ == "Launcher"]
    fast = [(lc, lc.fast) for lc in launchers]
    for lc in launchers:
        lc.fast = False
    host_ms_jit = _without_replay(launched)
    for lc, was in fast:
        lc.fast = was
    if device == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        layer(x).backward(dy)
    prof.disable()
    if device == "cuda":
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = sorted(((f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}({fn[2]})", st[2] / 20 * 1e3, st[3] / 20 * 1e3, st[1] / 20)
                   for fn, st in stats.stats.items()), key=lambda r: -r[1])[:top]
    print(f"--- host time per fwd+bwd (no sync): {host_ms:.3f} ms ({host_ms_py_replay:.3f} ms replayed from Python "
          f"without launch programs, {host_ms_launchers:.3f} ms with no launch replayed, {host_ms_jit:.3f} ms with "
          "every kernel launched through Triton's JIT); functions by own time per step (ms own, ms cumulative, "
          "calls):", flush=True)
    for name, own, cum, calls in rows:
        print(f"   {own:8.3f} {cum:8.3f} {calls:6.1f}  {name}", flush=True)
    per_call = _host_per_call(device, tiny, layer, d, b)
    return [dict(host_ms=host_ms, host_ms_py_replay=host_ms_py_replay, host_ms_launchers=host_ms_launchers,
                 host_ms_jit_launch=host_ms_jit,
                 functions=[list(r) for r in rows],
                 per_call_us=per_call)]


@contextlib.contextmanager
def _settings(module, **values):
    """The block with ``module``'s attributes set to ``values``, each restored afterwards to what it was."""
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def _without_replay(fn):
    """``fn()`` with every POET-X kernel launch made through its launcher (``fastdora.poetx.replay`` off)."""
    with _settings(poetx_replay, ENABLED=False):
        return fn()


def _without_programs(fn):
    """``fn()`` with the replayed launches made one by one from Python (``fastdora.poetx.replay.PROGRAMS`` off; the
    segments recorded again, before and after)."""
    poetx_replay.clear()
    try:
        with _settings(poetx_replay, PROGRAMS=False):
            return fn()
    finally:
        poetx_replay.clear()


def _host_per_call(device: str, tiny: bool, layer, d: int, b: int) -> dict:
    """Host microseconds per call of each operation of the layer's step at 64 tokens (the GPU keeps up: what is
    measured is the time to issue the call), and of an ``nn.Linear`` forward + backward for scale."""
    n = 64
    t = torch.randn(n, d, device=device, dtype=torch.bfloat16)
    t.requires_grad_()
    g, _ = layer.blocks()
    g = g.detach()
    perm = layer.perm_in
    w = layer.weight
    linear = nn.Linear(d, d, bias=False, device=device, dtype=torch.bfloat16)
    dy = torch.randn(n, d, device=device, dtype=torch.bfloat16)
    kern = poetx_kernels.applies(t, g)
    ops = {
        "torch.empty": lambda: torch.empty((n, d), device=device, dtype=torch.bfloat16),
        "F.linear (GEMM)": lambda: torch.nn.functional.linear(t, w),
        "nn.Linear fwd+bwd": lambda: linear(t).backward(dy),
        "gather (permutation pass)": lambda: poetx_ops._gather(t, perm, kern),
        "rotate (block product)": lambda: poetx_ops._block_mm(t, g, False, None, None, kern),
        "block_outer": lambda: poetx_ops._block_outer(t, t, g, None, kern),
        "layer fwd+bwd": lambda: layer(t).backward(dy),
        "layer fwd+bwd, launches not replayed": lambda: _without_replay(lambda: layer(t).backward(dy)),
    }
    reps = 20 if tiny else 300
    out = {}
    for name, fn in ops.items():
        for _ in range(5):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        us = (time.perf_counter() - t0) / reps * 1e6
        if device == "cuda":
            torch.cuda.synchronize()
        out[name] = us
        print(f"   host per call {us:8.1f} us  {name}", flush=True)
    return out


#: tile configurations of the series section (``CAYLEY_CONFIG`` values; "stages": Triton's software pipelining)
SERIES_SWEEP = [dict(block_t=64, block_k=32, warps=4), dict(block_t=64, block_k=32, warps=4, stages=2),
                dict(block_t=128, block_k=32, warps=8, stages=2), dict(block_t=128, block_k=16, warps=8, stages=3),
                dict(block_t=128, block_k=32, warps=4, stages=2), dict(block_t=64, block_k=64, warps=4, stages=2),
                dict(block_t=64, block_k=16, warps=4, stages=4), dict(block_t=128, block_k=32, warps=8, stages=3),
                dict(block_t=64, block_k=32, warps=4, stages=3)]


def run_series(device: str, tiny: bool) -> list:
    """The Cayley–Neumann series alone (``k = 3``, b=256), forward and backward timed apart, at a gate projection's 72
    blocks and at 1024 blocks (one chunk of the batched series, :mod:`fastdora.poetx.batch`): the kernels under each
    tile configuration of ``SERIES_SWEEP`` and product precision, and the same products as cuBLAS batched matmuls
    (``torch.baddbmm``, TF32 and float32) with their elementwise passes: what a library GEMM takes for this work."""
    timer = _timer(device, reps=3 if tiny else 10)
    b = 16 if tiny else 256
    rows = []
    for n in ((4,) if tiny else (72, 1024)):
        packed = torch.randn(n, skew_size(b), device=device) * (0.3 / b ** 0.5)
        grad_g = torch.randn(n, b, b, device=device)
        flop_fwd, flop_bwd = 2 * 2 * n * b ** 3, 5 * 2 * n * b ** 3  # two products forward, five backward

        def record(variant, fwd, bwd):
            ms_f, ms_b = timer(fwd), timer(bwd)
            rows.append(dict(blocks=n, block=b, variant=variant, fwd_ms=ms_f, bwd_ms=ms_b,
                             fwd_tflops=flop_fwd / ms_f / 1e9, bwd_tflops=flop_bwd / ms_b / 1e9))
            print(f"series  {n:5d} blocks b={b}  {variant:<58} fwd {ms_f:8.3f} ms ({flop_fwd / ms_f / 1e9:6.1f} "
                  f"TFLOP/s)  bwd {ms_b:8.3f} ms ({flop_bwd / ms_b / 1e9:6.1f} TFLOP/s)", flush=True)

        if poetx_kernels.applies(packed):
            from triton.runtime.errors import OutOfResources

            # "bf16x3-load-split": the backward's bf16x3 products splitting each fp32 operand tile in their loads
            # (SPLIT_OPERANDS = False, as the forward's do) instead of reading operands split once by the launch that
            # produced them
            for label, prec, split_ops in (("tf32x3", "tf32x3", True), ("bf16x3", "bf16x3", True),
                                           ("bf16x3-load-split", "bf16x3", False), ("tf32", "tf32", True)):
                for cfg in SERIES_SWEEP:
                    try:
                        with _settings(poetx_kernels, CAYLEY_CONFIG=cfg, CAYLEY_PRECISION=prec,
                                       SPLIT_OPERANDS=split_ops):
                            record(f"kernels {label} {cfg}",
                                   lambda: poetx_kernels.cayley_forward(packed, b, 3),
                                   lambda: poetx_kernels.cayley_backward(packed, grad_g, b, 3))
                    except OutOfResources as err:  # a tile set this GPU cannot hold
                        print(f"series  {n:5d} blocks b={b}  kernels {label} {cfg}: {err}", flush=True)
        q = cayley.skew_from_packed(packed, b)
        eye = torch.eye(b, device=device)
        for name, tf32 in (("cuBLAS baddbmm, TF32", True), ("cuBLAS baddbmm, float32", False)):
            def fwd():  # G = I + 2Q + 2S + S·(S + 2Q), S = Q·Q
                s = torch.bmm(q, q)
                return torch.baddbmm(eye + 2 * (q + s), s, s + 2 * q)

            def bwd():  # the five products of the backward (fastdora.poetx.kernels._cayley3_backward)
                s = torch.bmm(q, q)
                d_s = torch.baddbmm(torch.baddbmm(2 * grad_g, grad_g, s - 2 * q), s, grad_g)
                return torch.baddbmm(torch.baddbmm(2 * grad_g, s, grad_g, alpha=2), d_s + d_s.mT, q, alpha=-1)

            with _settings(torch.backends.cuda.matmul, allow_tf32=tf32):
                record(name, fwd, bwd)
    return rows


def run_permute(device: str, tiny: bool) -> list:
    """The permutation pass alone (``gather``, bf16, a random permutation of the features) at the widths of a
    Llama-8B layer (1024, 4096, 14336) and 1024 / 2048 / 8192 tokens: the kernel at its default tiling (its tiles
    are swept by ``--sections ops --sweep``), beside ``index_select`` and a plain copy of the same bytes (the
    memory-bound floor); the kernel's first call is timed apart (it includes its compilation)."""
    timer = _timer(device, reps=3 if tiny else 10)
    rows = []
    for n in ((16,) if tiny else (1024, 2048, 8192)):
        for d in ((64, 100) if tiny else (1024, 4096, 14336)):
            t = torch.randn(n, d, device=device, dtype=torch.bfloat16)
            perm = torch.randperm(d, device=device)
            want = t.index_select(-1, perm)
            gb = 2 * t.numel() * t.element_size() / 1e9  # read once, written once

            def record(variant, fn, first_ms=None):
                ms = timer(fn)
                rows.append(dict(tokens=n, d=d, variant=variant, ms=ms, gb_per_s=gb / ms * 1e3, first_ms=first_ms))
                first = "" if first_ms is None else f"  (first call {first_ms:9.1f} ms)"
                print(f"permute tokens {n:5d} d {d:6d}  {variant:<52} {ms:8.4f} ms {gb / ms * 1e3:7.0f} GB/s{first}",
                      flush=True)

            record("copy (floor)", lambda: torch.empty_like(t).copy_(t))
            record("index_select", lambda: t.index_select(-1, perm))
            if not poetx_kernels.applies(t):
                continue
            t0 = time.perf_counter()
            got = poetx_kernels.gather(t, perm)
            if device == "cuda":
                torch.cuda.synchronize()
            first_ms = (time.perf_counter() - t0) * 1e3
            if not torch.equal(got, want):
                raise AssertionError(f"gather differs from index_select at {n}x{d}")
            record("kernels", lambda: poetx_kernels.gather(t, perm), first_ms)
    return rows


#: tile configurations of the rotate section (``ROTATE_CONFIG`` values; "stages": Triton's software pipelining)
ROTATE_TILES = [dict(block_m=64, block_c=128, block_k=32, warps=4), dict(block_m=128, block_c=128, block_k=32, warps=8),
                dict(block_m=128, block_c=128, block_k=32, warps=8, stages=3),
                dict(block_m=128, block_c=128, block_k=64, warps=8, stages=3),
                dict(block_m=128, block_c=256, block_k=32, warps=8, stages=3),
                dict(block_m=64, block_c=256, block_k=32, warps=8, stages=3),
                dict(block_m=128, block_c=128, block_k=64, warps=4, stages=4)]


def run_rotate(device: str, tiny: bool) -> list:
    """The block product of the layer (contiguous blocks, bf16 activations, float32 blocks of 256, 4096 features;
    forward and transposed) at 2048 and 8192 tokens under each tile configuration of ``ROTATE_TILES``, beside one
    bf16 GEMM of the same operands' shapes as a reference (``[N, 4096] × [4096, 256]``: the same FLOPs once)."""
    timer = _timer(device, reps=3 if tiny else 10)
    d, b = (64, 16) if tiny else (4096, 256)
    g = cayley_neumann(torch.randn(d // b, skew_size(b), device=device) * (0.3 / b ** 0.5), b)
    rows = []
    for n in ((16,) if tiny else (1024, 2048, 8192)):
        t = torch.randn(n, d, device=device, dtype=torch.bfloat16)
        w = torch.randn(d, b, device=device, dtype=torch.bfloat16)
        cases = [("gemm [N, d] x [d, b] (reference)", None, lambda: t @ w)]
        if poetx_kernels.applies(t, g):
            hi, lo = poetx_kernels.split_blocks(g, t.dtype)
            for cfg in ROTATE_TILES:
                for transpose in (False, True):
                    cases.append((f"kernels {'T ' if transpose else ''}{cfg}", cfg,
                                  lambda transpose=transpose: poetx_kernels.rotate(t, None, g, transpose=transpose)))
                    cases.append((f"kernels {'T ' if transpose else ''}presplit {cfg}", cfg,
                                  lambda transpose=transpose: poetx_kernels.rotate(t, None, hi, transpose=transpose,
                                                                                   lo=lo)))
            cases.append(("split_blocks (once per block set)", None,
                          lambda: poetx_kernels.split_blocks(g, t.dtype)))
        for name, cfg, fn in cases:
            with _settings(poetx_kernels, ROTATE_CONFIG=cfg or {}):
                ms = timer(fn)
            rows.append(dict(tokens=n, d=d, block=b, variant=name, ms=ms))
            print(f"rotate  tokens {n:5d} d {d} b={b}  {name:<90} {ms:8.3f} ms", flush=True)
        if poetx_kernels.applies(t, g):  # the block gradient, tokens split over programs from split_rows tokens each
            for split_rows in (512, 1024, 2048, 1 << 30):
                with _settings(poetx_kernels, OUTER_CONFIG=dict(split_rows=split_rows)):
                    ms = timer(lambda: poetx_kernels.block_outer(t, t, None, g))
                rows.append(dict(tokens=n, d=d, block=b, variant=f"block_outer split_rows={split_rows}", ms=ms))
                print(f"outer   tokens {n:5d} d {d} b={b}  split_rows={split_rows:<79} {ms:8.3f} ms", flush=True)
    return rows


def _fmt(r: dict) -> str:
    ratio = "" if r["vs_linear"] is None else f"{r['vs_linear']:.2f}x"
    peak = "" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
    return (f"{r['d_in']:>6}->{r['d_out']:<6} batch {r['batch']} seq {r['seq']} b={r['block']:<4} "
            f"{r['variant']:<17} {r['ms']:9.3f} ms {ratio:>7} {peak:>8} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (checks the script, measures nothing useful)")
    ap.add_argument("--sections", default="layer", help="comma separated: layer (the layer grid), ops, "
                    "profile (GPU time per kernel), host (cProfile), series (the Cayley–Neumann series alone), "
                    "rotate (the block product's tiles), permute (the permutation pass)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma separated subset of {VARIANTS}")
    ap.add_argument("--sweep", action="store_true", help="ops: also the tile configurations of ROTATE_SWEEP / "
                    "OUTER_SWEEP / GATHER_SWEEP / CAYLEY_SWEEP")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}")
    if "linear" in variants:  # nn.Linear first: the ratios need its time
        variants.remove("linear")
        variants.insert(0, "linear")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device (use --device cpu --tiny to check the script)")
    torch.manual_seed(0)
    sections = [x for x in a.sections.split(",") if x]
    known = {"layer", "ops", "profile", "host", "series", "rotate", "permute"}
    if set(sections) - known:
        ap.error(f"unknown sections {sorted(set(sections) - known)}")
    rows = run(a.device, a.tiny, variants) if "layer" in sections else []
    op_rows = run_ops(a.device, a.tiny, a.sweep) if "ops" in sections else []
    profile_rows = run_profile(a.device, a.tiny) if "profile" in sections else []
    host_rows = run_host(a.device, a.tiny) if "host" in sections else []
    series_rows = run_series(a.device, a.tiny) if "series" in sections else []
    rotate_rows = run_rotate(a.device, a.tiny) if "rotate" in sections else []
    permute_rows = run_permute(a.device, a.tiny) if "permute" in sections else []
    device = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor()
    meta = dict(torch=torch.__version__, device=device, triton_kernels=poetx_kernels.AVAILABLE and a.device == "cuda",
                tiny=a.tiny)
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        meta["triton"] = None
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, ops=op_rows, profile=profile_rows, host=host_rows,
                           series=series_rows, rotate=rotate_rows, permute=permute_rows), f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
