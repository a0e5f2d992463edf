#!/usr/bin/env python3
"""The eager (exact PyTorch) composition at a real activation size on the CPU: this checkout vs another fastdora
package, interleaved in one process, forward (training path, ``inner`` kept) and backward, plus each one's error
against an fp64 reference. The CPU's elementwise passes are memory-bound like the GPU's, so fewer activation-sized
passes show here too; the GPU numbers come from ``kernels_bench.py`` (``eager_fwd_train_ms`` / ``eager_bwd_ms``).

  mkdir -p /tmp/old && git archive 0369b03 core | tar -x -C /tmp/old && mv /tmp/old/core /tmp/old/fastdora
  python benchmarks/eager_compose_cpu.py --old-pkg /tmp/old --out benchmarks/results/cpu_host/eager_compose_cpu.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _bench_io import load_package_as  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--old-pkg", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="/tmp/eager_compose_cpu.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    pkgs = {"this checkout": importlib.import_module("fastdora.ops.compose")}
    load_package_as(a.old_pkg, "fastdora_old")
    pkgs["old"] = importlib.import_module("fastdora_old.ops.compose")
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    res = torch.randn(a.tokens, a.d, generator=g).to(bf)
    lora = (0.3 * torch.randn(a.tokens, a.d, generator=g)).to(bf)
    dy = torch.randn(a.tokens, a.d, generator=g).to(bf)
    mag = 1.0 + 0.05 * torch.randn(a.d, generator=g)
    norm = torch.ones(a.d)
    s, eps = 0.7, 1e-6
    ref = (mag.double() / norm.double()) * (res.double() + s * lora.double())
    out = {"tokens": a.tokens, "d": a.d, "dtype": "bf16 activations, fp32 magnitude (AMP)", "threads": 1,
           "variants": {}}
    times = {k: {"fwd": [], "bwd": []} for k in pkgs}
    for rnd in range(a.rounds):
        for name, oc in (pkgs.items() if rnd % 2 == 0 else list(pkgs.items())[::-1]):
            t0 = time.perf_counter()
            y, inner = oc.compose_fwd_eager(res, lora, mag, norm, s, eps, None, None, bf, True)
            t1 = time.perf_counter()
            oc.compose_bwd_eager(dy, mag, norm, s, eps, inner, False, bf, bf, None, True, False)
            t2 = time.perf_counter()
            times[name]["fwd"].append((t1 - t0) * 1e3)
            times[name]["bwd"].append((t2 - t1) * 1e3)
            if rnd == 0:
                err = (y.double() - ref).abs()
                ulp = torch.finfo(bf).eps * ref.abs()
                out["variants"][name] = {"max_abs_err": err.max().item(),
                                         "frac_beyond_one_rounding": (err > ulp).double().mean().item()}
    for name, t in times.items():
        v = out["variants"][name]
        v.update(fwd_ms_median=statistics.median(t["fwd"]), bwd_ms_median=statistics.median(t["bwd"]), rounds=t)
        print(f"{name:14s} fwd {v['fwd_ms_median']:7.1f} ms  bwd {v['bwd_ms_median']:7.1f} ms  "
              f"max err {v['max_abs_err']:.3g}  beyond one rounding {100 * v['frac_beyond_one_rounding']:.2f}%")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
