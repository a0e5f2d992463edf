#!/usr/bin/env python3
"""Host microseconds per call of the pieces of fastdora's kernel path (issue 5: the step sits at the host/GPU
balance point; ``enqueue_probe.py`` measured ~100 us of host time per composition forward on the H200's host).

Each item runs ``--calls`` times back to back between two synchronisations (the GPU keeps up or queues: fewer
launches per chunk than the launch queue holds), ``--chunks`` times; the median per call is reported. Shapes: one
Qwen3-8B projection at seq 4096 (``M x N``), activations in bf16, magnitude and norm in fp32 (the AMP setup).

  python benchmarks/launch_cost.py --out DIR/launch_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/launch_cost.json")
    p.add_argument("--M", type=int, default=4096)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--chunks", type=int, default=7)
    a = p.parse_args()
    import torch

    from fastdora.kernels import _launch
    from fastdora.kernels import compose as kc
    from fastdora.ops import compose as oc

    dev = torch.device("cuda")
    bf = torch.bfloat16
    M, N = a.M, a.N
    r = torch.randn(M, N, device=dev, dtype=bf)
    lo = torch.randn(M, N, device=dev, dtype=bf)
    dy = torch.randn(M, N, device=dev, dtype=bf)
    mag = torch.rand(N, device=dev) + 0.5
    nrm = torch.rand(N, device=dev) + 0.5
    magp = torch.nn.Parameter(mag.clone())
    y0, inner = kc.compose_fwd(r, lo, mag, nrm, 0.5, 1e-6, None, None, bf, True)
    items = {}

    def timeit(name, fn, calls=a.calls):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        per = []
        for _ in range(a.chunks):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
        items[name] = {"us_median": statistics.median(per), "us_min": min(per)}
        print(f"{name:60s} {statistics.median(per):8.2f} us  (min {min(per):.2f})", flush=True)

    timeit("python: empty loop body", lambda: None)
    timeit("aten: torch.add(result, lora)", lambda: torch.add(r, lo))
    timeit("aten: lora * scale", lambda: lo * 0.5)
    timeit("aten: empty_like(result)", lambda: torch.empty_like(r))
    timeit("aten: empty_like(result, dtype=, memory_format=)",
           lambda: torch.empty_like(r, dtype=bf, memory_format=torch.contiguous_format))
    timeit("aten: torch.empty((M, N), dtype=, device=)", lambda: torch.empty((M, N), dtype=bf, device=dev))
    timeit("aten: result.new_empty(shape)", lambda: r.new_empty(r.shape))
    timeit("torch.cuda.current_device()", torch.cuda.current_device)
    timeit("launch: raw stream lookup", lambda: _launch._raw_stream(0))
    tens = (r, lo, r, mag, mag, nrm, y0, inner)
    ints = (M, N, N, N, N, N, N)
    timeit("tensor: 8 x data_ptr()", lambda: [t.data_ptr() for t in tens])
    consts = (False, False, True, False, 8, 1024)
    bm, bn, w = kc._fwd_config(M, N, dev)
    consts = (False, False, True, False, bm, bn)
    grid = (kc._cdiv(M, bm), kc._cdiv(N, bn), 1)
    timeit("launch: Launcher(_fwd_kernel) with built args", lambda: kc._FWD(grid, tens, ints, (0.5, 1e-6), consts, w))
    key = next(iter(kc._FWD.cache))
    compiled, function, packed = kc._FWD.cache[key]
    stream = _launch._raw_stream(0)
    args = (*tens, *ints, 0.5, 1e-6, *consts)
    rt = _launch._knobs.runtime

    def run_direct():
        compiled.run(grid[0], grid[1], grid[2], stream, function, packed, None, rt.launch_enter_hook,
                     rt.launch_exit_hook, *args)

    timeit("launch: CompiledKernel.run direct (tensor args)", run_direct)
    iargs = tuple(t.data_ptr() for t in tens) + args[len(tens):]

    def run_direct_int():
        compiled.run(grid[0], grid[1], grid[2], stream, function, packed, None, rt.launch_enter_hook,
                     rt.launch_exit_hook, *iargs)

    timeit("launch: CompiledKernel.run direct (int pointer args)", run_direct_int)

    def run_direct_int_nohooks():
        compiled.run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *iargs)

    timeit("launch: CompiledKernel.run direct (int pointer args, no hook objects)", run_direct_int_nohooks)
    timeit("compose_fwd (inference: y only)", lambda: kc.compose_fwd(r, lo, mag, nrm, 0.5, 1e-6, None, None, bf, False))
    timeit("compose_fwd (training: y and inner)", lambda: kc.compose_fwd(r, lo, mag, nrm, 0.5, 1e-6, None, None, bf, True))
    timeit("compose_bwd (d_result, d_lora, dm)", lambda: kc.compose_bwd(dy, mag, nrm, 0.5, 1e-6, inner, False, bf, bf,
                                                                        None, True, False))
    rg = r.clone().requires_grad_()
    lg = lo.clone().requires_grad_()

    def dora_fwd():
        return oc.dora_compose(rg, lg, magp, nrm, 0.5, 1e-6, out_dtype=bf, kind="linear")

    def lora_fwd():
        return rg + lg * 0.5

    timeit("autograd fwd: dora_compose (Triton)", dora_fwd)
    timeit("autograd fwd: LoRA's result + lora * scale", lora_fwd)

    def fb(f):
        def run():
            y = f()
            torch.autograd.backward(y, dy, inputs=[rg, lg])
        return run

    timeit("autograd fwd+bwd: dora_compose (Triton)", fb(dora_fwd), calls=50)
    timeit("autograd fwd+bwd: LoRA's result + lora * scale", fb(lora_fwd), calls=50)

    class _Trivial(torch.autograd.Function):  # the cost of any Python autograd node
        @staticmethod
        def forward(ctx, x, z):
            return torch.add(x, z)

        @staticmethod
        def backward(ctx, g):
            return g, g

    class _Saving(torch.autograd.Function):  # ... that also saves one activation
        @staticmethod
        def forward(ctx, x, z):
            y = torch.add(x, z)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            ctx.saved_tensors
            return g, g

    class _Direct(torch.autograd.Function):  # fastdora's launchers with nothing else around them
        @staticmethod
        def forward(ctx, x, z, m):
            y, i = kc.compose_fwd(x, z, m, nrm, 0.5, 1e-6, None, None, bf, True)
            ctx.save_for_backward(i)
            ctx.m = m
            return y

        @staticmethod
        def backward(ctx, g):
            i, = ctx.saved_tensors
            d_r, d_l, _, dm, _ = kc.compose_bwd(g, ctx.m, nrm, 0.5, 1e-6, i, False, bf, bf, None, True, False)
            return d_r, d_l, dm

    timeit("autograd fwd+bwd: trivial Python Function (add)", fb(lambda: _Trivial.apply(rg, lg)), calls=50)
    timeit("autograd fwd+bwd: Python Function saving one tensor", fb(lambda: _Saving.apply(rg, lg)), calls=50)
    timeit("autograd fwd+bwd: Function calling compose_fwd/bwd only", fb(lambda: _Direct.apply(rg, lg, magp)),
           calls=50)
    timeit("autograd fwd+bwd: one aten add", fb(lambda: rg + lg), calls=50)
    mag_ng = magp.detach()
    timeit("autograd fwd+bwd: dora_compose, magnitude without grad",
           fb(lambda: oc.dora_compose(rg, lg, mag_ng, nrm, 0.5, 1e-6, out_dtype=bf)), calls=50)

    with torch.autograd.set_multithreading_enabled(False):  # the backward on the calling thread
        timeit("calling-thread backward: Function calling compose_fwd/bwd only", fb(lambda: _Direct.apply(rg, lg, magp)),
               calls=50)
        timeit("calling-thread backward: LoRA's result + lora * scale", fb(lora_fwd), calls=50)
        timeit("calling-thread backward: trivial Python Function (add)", fb(lambda: _Trivial.apply(rg, lg)), calls=50)

    def on_worker_thread(name, fn, calls=200):  # the same loop on a fresh Python thread (the autograd engine's
        import threading                          # device thread is one)

        def body():
            torch.cuda.set_device(torch.cuda.current_device() if dev.index is None else dev.index)
            timeit(name, fn, calls=calls)

        th = threading.Thread(target=body)
        th.start()
        th.join()

    on_worker_thread("worker thread: compose_bwd (d_result, d_lora, dm)",
                     lambda: kc.compose_bwd(dy, mag, nrm, 0.5, 1e-6, inner, False, bf, bf, None, True, False))
    on_worker_thread("worker thread: aten torch.add(result, lora)", lambda: torch.add(r, lo))

    def no_autograd():
        _, i = kc.compose_fwd(r, lo, mag, nrm, 0.5, 1e-6, None, None, bf, True)
        kc.compose_bwd(dy, mag, nrm, 0.5, 1e-6, i, False, bf, bf, None, True, False)

    timeit("no autograd: compose_fwd + compose_bwd", no_autograd, calls=50)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": {"M": M, "N": N, "calls": a.calls, "chunks": a.chunks, "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cmd": " ".join(sys.argv)},
                   "items": items}, f, indent=1)


if __name__ == "__main__":
    main()
