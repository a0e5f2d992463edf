#!/usr/bin/env python3
"""What makes a stream capture fail, for fastdora's norm graphs (session 20 diagnosis).

The GPU suite showed norm-graph captures failing (and, before fastdora restored it, every later CUDA random op
raising "Offset increment outside graph capture encountered unexpectedly") only after other tests' models -- the
owners of earlier graphs -- had been freed. Each case below captures a small kernel on a side stream in thread-local
mode, as ``fastdora.ops.norm_graph`` does, records whether the capture succeeded and its error, whether CUDA random
numbers work right after, and, after a failure, whether one empty capture into a fresh pool restores them:

- ``reuse_dead_pool``: every graph of a pool freed, then a capture into that pool (its handle kept, as a shared
  pool is);
- ``reuse_kept_pool``: the same with an empty keeper graph holding the pool (what fastdora does);
- ``free_graph_inside``: a graph of another (kept) pool freed during the capture;
- ``gc_cycle_inside``: ``gc.collect()`` during the capture, with a reference cycle holding a graph;
- ``free_tensor_inside`` / ``free_event_inside``: a CUDA tensor / a recorded event freed during the capture.

  python benchmarks/graph_gc_probe.py --out DIR/graph_gc_probe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import warnings


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/graph_gc_probe.json")
    a = p.parse_args()
    import torch

    warnings.simplefilter("ignore")
    dev = torch.device("cuda")
    x = torch.randn(1 << 20, device=dev)

    def capture(pool, body=lambda: None):
        side, g, err = torch.cuda.Stream(), torch.cuda.CUDAGraph(), None
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                g.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    _ = x * 2
                    body()
                finally:
                    g.capture_end()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        torch.cuda.current_stream().wait_stream(side)
        return g, err

    def rng_ok():
        try:
            torch.randn(4, device=dev)
            return True
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e)[:100]}"

    def kept_pool():
        pool = torch.cuda.graph_pool_handle()
        keeper, err = capture(pool)
        assert err is None, err
        return pool, keeper

    results = {}

    def record(name, err):
        r = results[name] = {"captured": err is None, "error": err, "rng_after": rng_ok()}
        if err is not None:
            capture(torch.cuda.graph_pool_handle())  # heal: an empty capture into a fresh pool
            r["rng_after_heal"] = rng_ok()
        print(name, r, flush=True)

    # 1. every graph of a pool freed, the handle reused
    pool = torch.cuda.graph_pool_handle()
    g1, err = capture(pool)
    assert err is None, err
    del g1
    record("reuse_dead_pool", capture(pool)[1])
    # 2. the same, a keeper graph holding the pool
    pool, keeper = kept_pool()
    g1, err = capture(pool)
    del g1
    record("reuse_kept_pool", capture(pool)[1])
    # 3. a graph freed inside the capture (its pool kept alive by a keeper)
    pool2, keeper2 = kept_pool()
    holder = [capture(pool2)[0]]
    record("free_graph_inside", capture(pool, holder.clear)[1])
    # 4. the cyclic GC inside the capture, collecting a cycle that holds a graph
    gc.collect()

    class Node:
        pass

    n = Node()
    n.self, n.graph = n, capture(pool2)[0]
    del n
    record("gc_cycle_inside", capture(pool, gc.collect)[1])
    # 5. a CUDA tensor / a recorded event freed inside the capture
    holder = [torch.randn(1 << 22, device=dev)]
    record("free_tensor_inside", capture(pool, holder.clear)[1])
    ev = torch.cuda.Event()
    ev.record()
    holder = [ev]
    del ev
    record("free_event_inside", capture(pool, holder.clear)[1])
    with open(a.out, "w") as f:
        json.dump({"torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
