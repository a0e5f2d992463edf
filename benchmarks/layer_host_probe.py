#!/usr/bin/env python3
"""Host (CPU-side) cost of one DoRA layer call, without device work (issue 5: the training step is host-bound).

A stack of ``L`` PEFT Linear layers at a tiny size (d=64, 8 tokens) runs on the CPU, where every operator costs its
dispatch/Python overhead and almost no arithmetic. Variants, interleaved round by round (median and minimum over
rounds):

- ``lora``:           stock PEFT LoRA (the target: what the same layer costs without DoRA)
- ``fastdora_eager``: fastdora's exact PyTorch path (``kernels="eager"``), what runs without Triton
- ``fastdora_stub``:  fastdora's Triton path with the two kernel launchers replaced by ``empty_like`` outputs: the
                      Python/autograd cost of the kernel path itself, launches excluded
- ``fastdora_kpath``: fastdora's Triton path with its real launcher-side Python (checks, allocations, configs, the
                      autograd node) and only the three kernel launches (forward, backward, dm reduction) replaced by
                      no-ops: the closest CPU proxy of the kernel path's host cost
- ``peft_dora``:      stock PEFT DoRA
- ``fastdora_native`` (``--kpath --native``): the same launches replaced by no-ops, through the C++ composition node
                      (``fastdora.kernels.native``) instead of the Python autograd node
- ``--templates`` (with ``--kpath``): the kernel path's launches go through Triton's direct launch path and, for
  ``fastdora_native``, the C++ node's compiled-launcher templates (as on a GPU), with a compiled kernel whose ``run``
  does nothing: the host path of the GPU run minus the driver's launch calls (without it the C++ node falls back to
  the Python launchers on CPU tensors, which a GPU run never does)
- with ``--old-pkg DIR``: ``old_eager`` / ``old_stub``, the same for the fastdora package in ``DIR/fastdora`` (e.g.
  an earlier commit's ``core/``), imported under another name into the same process (before/after, interleaved)

Setups: ``fp32`` (fp32 model), ``amp`` (fp32 model under CPU bf16 autocast: the half-precision composition path),
``bf16`` (bf16 model and adapters: pure bf16; until session 22 the adapters stayed fp32, PEFT's default upcast,
i.e. bf16 base with fp32 adapters and no autocast). Modes: ``train`` (forward + backward, as in a training step)
and ``infer`` (no-grad forward).
The numbers are per layer and per call, in microseconds of this thread's CPU time (``time.thread_time``: host work,
not time spent descheduled), on the machine that runs the script: use them for
before/after comparisons of the host path (same machine, same run), not as device timings.

  python benchmarks/layer_host_probe.py --out /tmp/layer_host_probe.json
  # before/after in one process (the committed run: benchmarks/README.md, "Host cost per layer call on the CPU")
  mkdir -p /tmp/old && git archive 0369b03 core | tar -x -C /tmp/old && mv /tmp/old/core /tmp/old/fastdora
  python benchmarks/layer_host_probe.py --old-pkg /tmp/old --rounds 15 --iters 40 \
      --out benchmarks/results/cpu_host/layer_host_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _bench_io import load_package_as

VARIANTS = ("lora", "peft_dora", "fastdora_eager", "fastdora_stub")


def _stub_impl(oc):
    """fastdora's kernel path with the launches replaced by allocations of the outputs (``oc``: its ops.compose)."""
    import torch

    class _Stub:
        name = "triton"

        @staticmethod
        def compose_fwd(result, lora, magnitude, norm, scale, eps, bias, base_delta, out_dtype, save_inner, fd):
            y = torch.empty_like(result, dtype=out_dtype)
            return y, (torch.empty_like(result) if save_inner else None)

        @staticmethod
        def compose_bwd(dy, magnitude, norm, scale, eps, inner, delta_form, rd, ld, bd, need_dm, need_dbias, fd,
                        need_dlora=True):
            dm = torch.empty_like(magnitude) if need_dm else None
            d_lora = torch.empty_like(dy, dtype=ld) if need_dlora else None
            return torch.empty_like(dy, dtype=rd), d_lora, None, dm, None

    stub = _Stub()
    stub.apply = oc._apply_autograd(stub)
    return stub


class _NoopCompiled:
    """Stands in for Triton's ``CompiledKernel`` (``--templates``): launches through it do nothing."""

    function, packed_metadata = 0, ()

    @staticmethod
    def run(*args):
        return None

    @staticmethod
    def launch_metadata(*args):
        return None


class _NoopLauncher:
    """A kernel launcher that launches nothing, shaped like Triton's interpreter path for fastdora.kernels.native
    (its launch templates then pass tensors to a no-op): the host path with every launch's GPU-side cost removed."""

    fast, interpreted = False, True

    class fn:  # noqa: N801 - stands in for the JIT function: fn[grid](*args, **opts)
        @staticmethod
        def __class_getitem__(grid):
            return _noop

    def __call__(self, *args, **kw):
        return None


def _noop(*args, **kw):
    return None


def worker(a):
    import contextlib
    import importlib

    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if a.setup == "bf16" else torch.float32
    pkgs = {"fastdora": importlib.import_module("fastdora")}
    if a.old_pkg:
        pkgs["old"] = load_package_as(a.old_pkg, "fastdora_old")
    kinds = ("eager", "stub") + (("kpath",) if a.kpath else ())
    variants = ["lora", "peft_dora"] + [f"{label}_{k}" for label in pkgs for k in kinds]
    native_mod = [None]  # (fastdora.kernels.native, its C++ module) with --native
    if a.native:
        variants.append("fastdora_native")
    stub_on = {}  # package label -> [mode]: its dispatch returns the stub / kernel path while that model runs
    for label, pkg in pkgs.items():
        dispatch = importlib.import_module(pkg.__name__ + ".dispatch")
        oc = importlib.import_module(pkg.__name__ + ".ops.compose")
        kpath = None
        if a.kpath:
            kc = importlib.import_module(pkg.__name__ + ".kernels.compose")
            if a.templates:  # the direct launch path with a compiled kernel that does nothing
                lm = importlib.import_module(pkg.__name__ + ".kernels._launch")
                if not (kc._FWD.fast and kc._BWD.fast):
                    raise SystemExit("--templates: this Triton has no direct launch path")
                lm.Launcher._jit = lambda self, *args, **kw: _NoopCompiled()
                lm._raw_stream = lambda idx: 0
                for launcher in (kc._FWD, kc._BWD, kc._RED):
                    launcher.cache.clear()
            else:
                for launcher in ("_FWD", "_BWD", "_RED"):
                    setattr(kc, launcher, _NoopLauncher())
            kpath = kc.TRITON
            if a.native and label == "fastdora":
                nat = importlib.import_module(pkg.__name__ + ".kernels.native")
                native_mod[0] = (nat, nat.node(required=True))
                if a.templates:
                    native_mod[0][1].testing_host_templates(True)  # templates on CPU tensors, as on a GPU
                nat.NODE = None  # only while the native variant runs
        flag, stub, real = [None], _stub_impl(oc), dispatch.compose_impl

        def pick(*args, _flag=flag, _stub=stub, _real=real, _kpath=kpath, **kw):
            if _flag[0] == "stub":
                return _stub
            return _kpath if _flag[0] in ("kpath", "native") else _real(*args, **kw)

        dispatch.compose_impl = pick
        stub_on[label] = flag
    models = {}
    for v in variants:
        torch.manual_seed(0)
        base = nn.Sequential(*[nn.Linear(a.d, a.d, bias=False) for _ in range(a.layers)]).to(dtype)
        cfg = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=[str(i) for i in range(a.layers)],
                         use_dora=v != "lora")
        pm = get_peft_model(base, cfg)
        if a.setup == "bf16":  # pure bf16, as the model bench's bf16 setup: PEFT made the adapters fp32
            for prm in pm.parameters():
                prm.data = prm.data.to(torch.bfloat16)
        label = v.rsplit("_", 1)[0]
        if label in pkgs:
            pkgs[label].enable(pm, kernels="eager")
        models[v] = pm
    x = torch.randn(a.tokens, a.d, dtype=dtype, requires_grad=True)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.setup == "amp" else contextlib.nullcontext

    def call(v):
        pm = models[v]
        kind = v.rsplit("_", 1)[-1]
        flag = stub_on.get(v.rsplit("_", 1)[0]) if kind in ("stub", "kpath", "native") else None
        if flag is not None:
            flag[0] = kind
        if kind == "native":
            native_mod[0][0].NODE = native_mod[0][1]
        try:
            if a.mode == "train":
                with ctx():
                    y = pm(x)
                y.float().sum().backward()
            else:
                with torch.no_grad(), ctx():
                    pm(x)
        finally:
            if flag is not None:
                flag[0] = None
            if kind == "native":
                native_mod[0][0].NODE = None

    for v in variants:  # warm-up: norms cached, allocator warm
        for _ in range(50):
            call(v)
    per = {v: [] for v in variants}
    for rnd in range(a.rounds):  # interleaved, alternating order: slow drifts of the machine hit every variant
        for v in (variants if rnd % 2 == 0 else variants[::-1]):
            t0 = time.thread_time()  # CPU time of this thread: what the host path costs, minus preemption
            for _ in range(a.iters):
                call(v)
            per[v].append((time.thread_time() - t0) / a.iters / a.layers * 1e6)
    res = {v: statistics.median(ts) for v, ts in per.items()}
    with open(a.result, "w") as f:
        json.dump({"setup": a.setup, "mode": a.mode, "us_per_layer": res,
                   "native_stats": native_mod[0][1].stats() if native_mod[0] else None,
                   "us_per_layer_min": {v: min(ts) for v, ts in per.items()}, "rounds": per}, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--result")
    p.add_argument("--setup", default="amp", choices=["fp32", "amp", "bf16"])
    p.add_argument("--mode", default="train", choices=["train", "infer"])
    p.add_argument("--setups", default="fp32,amp,bf16")
    p.add_argument("--modes", default="train,infer")
    p.add_argument("--old-pkg", default=None, help="a folder holding another fastdora package (before/after)")
    p.add_argument("--kpath", action="store_true", help="add the *_kpath variants (needs Triton importable)")
    p.add_argument("--native", action="store_true",
                   help="with --kpath: add fastdora_native (the C++ composition node, launches no-ops)")
    p.add_argument("--templates", action="store_true",
                   help="with --kpath: launches through the direct path / the C++ node's templates, doing nothing")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", default="/tmp/layer_host_probe.json")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    out = {"argv": sys.argv[1:], "python": sys.version.split()[0], "old_pkg": a.old_pkg, "results": []}
    for setup in a.setups.split(","):
        for mode in a.modes.split(","):
            res = a.out + f".{setup}.{mode}.part"
            cmd = [sys.executable, __file__, "--worker", "--result", res, "--setup", setup, "--mode", mode] + [
                x for k in ("layers", "d", "rank", "tokens", "rounds", "iters") for x in (f"--{k}", str(getattr(a, k)))
            ] + (["--old-pkg", os.path.abspath(a.old_pkg)] if a.old_pkg else []) + [
                f"--{k}" for k in ("kpath", "native", "templates") if getattr(a, k)]
            subprocess.check_call(cmd)
            with open(res) as f:
                r = json.load(f)
            os.remove(res)
            out["results"].append(r)
            if r.get("native_stats"):
                print(f"C++ node launches: {r['native_stats']}")
            for stat, us in (("median", r["us_per_layer"]), ("min", r["us_per_layer_min"])):
                print(f"{setup:5s} {mode:5s} {stat:6s} us/layer: " + "  ".join(
                    f"{v} {t:6.1f} ({t / us['lora']:.2f}x)" for v, t in us.items()), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
