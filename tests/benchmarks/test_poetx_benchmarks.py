"""The POET-X benchmarks: the plain-PyTorch POET-X (``benchmarks/_poetx_plain.py``) computes what fastdora's POET-X
computes (same permutations, same merges); ``poetx_model_bench.py``'s plan, target checks and a whole tiny run on the
CPU (one process per config, an out-of-memory config recorded as a result, a failing one as an error, the rest going
on); ``poetx_convergence.py``'s summary and a whole tiny run (the three runs in parallel processes); the layer
benchmark with the plain layer moved to the shared module; ``run_h200.sh``'s POET-X subcommands; a tiny run of
``poetx_step_profile.py``. Timings are not asserted (the H200 runs are in ``benchmarks/results/``)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from ._bench_path import BENCH, REPO, on_path


@pytest.fixture(scope="module")
def bench():
    with on_path():
        import _poetx_plain
        import poetx_convergence
        import poetx_model_bench
        yield dict(plain=_poetx_plain, pxm=poetx_model_bench, pxc=poetx_convergence)


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env.pop("POETX_MODEL_BENCH_FAIL", None)
    return env


def _tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def test_permutation_seed_is_fastdoras(bench):
    from fastdora.poetx.layer import permutation_seed

    for args in [(0, 0, 0), (0, 3, 1), (7, 12, 250), (2 ** 40, 5, 3), (-1, 0, 2)]:
        assert bench["plain"].permutation_seed(*args) == permutation_seed(*args)


def _natural(layer):
    """A fastdora POET-X layer's weight in the model's layout (it stores ``W'[i, j] = W[perm_out[i], perm_in[j]]``)."""
    return layer.weight.detach()[torch.argsort(layer.perm_out)][:, torch.argsort(layer.perm_in)]


def test_plain_poetx_equals_fastdora_through_merges(bench):
    """Same layers (names, order, normalised weights, permutations), the same loss and Q gradients in float32 with Q
    away from zero, the same weights and new permutations after each of three merges."""
    from fastdora import poetx
    from fastdora.poetx import PoetXLinear

    plain = bench["plain"]
    base = _tiny_llama()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    rep = poetx.convert(a, block_size=16, from_scratch_normalize=True, seed=3)
    names = plain.convert(b, 16, seed=3, normalize=True)
    assert names == rep.converted and len(names) == 14  # 2 layers x 7 projections; lm_head excluded
    fa = [m for m in a.modules() if isinstance(m, PoetXLinear)]
    fb = plain.layers(b)
    assert dict(a.named_parameters()).keys() == dict(b.named_parameters()).keys()  # the checksum's names match
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for x, y in zip(fa, fb):
            assert torch.equal(_natural(x), y.weight)
            assert torch.equal(x.perm_in, y.perm_in) and torch.equal(x.perm_out, y.perm_out)
        with torch.no_grad():
            for x, y in zip(fa, fb):
                for qa, qb in ((x.q_in, y.q_in), (x.q_out, y.q_out)):
                    q = torch.randn(qa.shape, generator=g) * 0.05
                    qa.copy_(q)
                    qb.copy_(q)
        la = a(input_ids=ids, labels=ids).loss
        lb = b(input_ids=ids, labels=ids).loss
        la.backward()
        lb.backward()
        assert abs(la.item() - lb.item()) <= 1e-5 * abs(lb.item())
        for x, y in zip(fa, fb):
            for qa, qb in ((x.q_in, y.q_in), (x.q_out, y.q_out)):
                assert (qa.grad - qb.grad).abs().max() <= 1e-4 * qb.grad.abs().max() + 1e-9
        for p in list(a.parameters()) + list(b.parameters()):
            p.grad = None
        assert poetx.merge(a) == plain.merge(b) == 14
        for x, y in zip(fa, fb):
            assert (_natural(x) - y.weight).abs().max() <= 1e-6
            assert x.q_in.abs().max() == 0 and y.q_in.abs().max() == 0
        with torch.no_grad():  # continue from identical weights (the float32 roundings of the two merges differ)
            for x, y in zip(fa, fb):
                y.weight.copy_(_natural(x))


def test_plain_permutation_gradient_is_the_inverse_gather(bench):
    """The convergence path's permutation (gradient: the gather by the inverse permutation) gives bitwise the
    gradients of autograd's own ``index_select`` backward (an ``index_add``), input and Q alike."""
    plain = bench["plain"]
    torch.manual_seed(0)
    w = torch.randn(48, 32, dtype=torch.float64)
    x = torch.randn(5, 7, 32, dtype=torch.float64)
    gy = torch.randn(5, 7, 48, dtype=torch.float64)
    perm = torch.randperm(32)
    t = x.clone().requires_grad_()
    plain._Permute.apply(t, perm, torch.argsort(perm)).backward(gy[..., :32])
    u = x.clone().requires_grad_()
    u.index_select(-1, perm).backward(gy[..., :32])
    assert torch.equal(t.grad, u.grad)
    grads = []
    for promote in (True, False):
        layer = plain.PlainPoetX(w, 16, promote=promote, seed=2).double()
        with torch.no_grad():
            layer.q_in.copy_(torch.randn(layer.q_in.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
            layer.q_out.copy_(torch.randn(layer.q_out.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
        xi = x.clone().requires_grad_()
        layer(xi).backward(gy)
        grads.append((xi.grad, layer.q_in.grad, layer.q_out.grad))
    for ga, gb in zip(*grads):
        assert torch.equal(ga, gb)


def test_plain_poetx_bf16_rounds_like_fastdora(bench):
    """bf16 weights and activations, float32 Q (no autocast): the block products in float32 rounded once to bf16 in
    both, so the outputs agree to a bf16 rounding."""
    from fastdora.poetx import PoetXLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 128, bias=True).to(torch.bfloat16)
    plain_layer = bench["plain"].PlainPoetX(lin.weight, 16, bias=lin.bias, promote=True)
    fd = PoetXLinear(lin, 16)
    with torch.no_grad():
        for qa, qb in ((fd.q_in, plain_layer.q_in), (fd.q_out, plain_layer.q_out)):
            q = torch.randn(qa.shape) * 0.05
            qa.copy_(q)
            qb.copy_(q)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    ya, yb = fd(x), plain_layer(x)
    assert ya.dtype == yb.dtype == torch.bfloat16
    assert ((ya.float() - yb.float()).abs() <= 2 ** -7 * yb.float().abs() + 1e-2).all()


# ---------------------------------------------------------------------------------------------------------------
# poetx_model_bench.py
# ---------------------------------------------------------------------------------------------------------------

def test_model_plan_priority_order(bench):
    pxm = bench["pxm"]
    cfgs = pxm.plan_configs("h200", "llama3-8b", 8)
    names = [(c["name"], c["layers"]) for c in cfgs]
    assert len(names) == len(set(names))
    # 1. the targets at full depth come first, then fast mode with the batched series, with no launch replayed,
    # replayed from Python without launch programs, with the series' operands split in the products' loads, and with
    # plain launches instead of programmatic dependent ones
    assert names[:10] == [("adamw", 32), ("poetx-fast-b256", 32), ("poetx-mem-b256", 32), ("poetx-int8-b256", 32),
                          ("lora-r160", 32), ("poetx-fast-b256-batched", 32), ("poetx-fast-b256-launchers", 32),
                          ("poetx-fast-b256-py-replay", 32), ("poetx-fast-b256-load-split", 32),
                          ("poetx-fast-b256-no-pdl", 32)]
    assert cfgs[5]["series"] == "batched" and "series" not in cfgs[1]
    assert cfgs[6]["launch"] == "launchers" and "launch" not in cfgs[1] and "series" not in cfgs[6]
    assert cfgs[7]["launch"] == "py-replay"
    assert cfgs[8]["split_operands"] is False and not any("split_operands" in c for c in cfgs[:8])
    assert cfgs[9]["pdl"] is False and not any("pdl" in c for c in cfgs[:9])
    # 2. b=512 at full depth, 3. the same eight configs at 8 layers, 4. the extra rows at full depth
    assert names[10:13] == [(f"poetx-{k}-b512", 32) for k in ("fast", "mem", "int8")]
    eight = sorted(n for n, _ in names[:13]
                   if not n.endswith(("-batched", "-launchers", "-py-replay", "-load-split", "-no-pdl")))
    assert sorted(n for n, L in names[13:21]) == eight and {L for _, L in names[13:21]} == {8}
    assert names[21:] == [("poetx-fast-b256-qbf16", 32), ("poetx-mem-b256-qbf16", 32), ("adamw-foreach", 32),
                          ("adamw-fp32-master", 32)]
    int8 = [c for c in cfgs if c["name"].startswith("poetx-int8")]
    assert all(c["weight_format"] == "int8" and c["mode"] == "mem" for c in int8)
    assert all(c["full_depth"] == (c["layers"] == 32) for c in cfgs)
    assert [c["name"] for c in pxm.plan_configs("targets", "llama3-8b", 8)] == [n for n, _ in names[:10]]
    # --layers at full depth: one run per config
    assert len(pxm.plan_configs("h200", "llama3-8b", 32)) == 17


def test_model_target_checks(bench):
    pxm = bench["pxm"]

    def rec(name, peak, tok, layers=32, status="ok", block=None):
        r = dict(name=name, layers=layers, full_depth=layers == 32, status=status, peak_alloc_gb=peak,
                 tokens_per_s=tok, step_s=1024 / tok, trainable_params=1, params=8e9, batch=1, seq=1024)
        if block:
            r["block"] = block
        return r

    results = [rec("adamw", 70.0, 9000.0), rec("poetx-fast-b256", 28.0, 8000.0, block=256),
               rec("poetx-mem-b256", 27.0, 6000.0, block=256),
               dict(rec("poetx-fast-b512", None, 1.0, block=512), status="oom", oom=dict(phase="warm-up")),
               rec("poetx-mem-b512", 30.0, 5000.0, block=512)]
    doc = dict(meta=dict(shape="llama3-8b"), results=results)
    _, rows = pxm.target_checks(doc)
    got = {(r[0], r[1]): (r[2], r[4]) for r in rows}
    assert got[("POET-X mem peak / AdamW", "L=32, b=256")] == ("0.386", "MISS")
    assert got[("POET-X fast peak / AdamW", "L=32, b=256")] == ("0.400", "PASS")
    assert got[("POET-X fast tokens/s / AdamW", "L=32, b=256")] == ("0.889", "PASS")
    assert got[("POET-X fast peak / AdamW", "L=32, b=512 (informational)")] == ("POET-X OOM", "MISS")
    assert got[("POET-X mem peak / AdamW", "L=32, b=512 (informational)")] == ("0.429", "MISS")
    md = pxm.markdown(doc)
    assert "| poetx-fast-b256 | 1 | 28.00 | 0.400x | 8000 | 0.889x |" in md
    assert "OOM (warm-up)" in md and "TARGETS: 2 PASS, 4 MISS, 0 NOT RUN" in md
    # an AdamW that does not fit passes the memory targets, misses the speed one
    doc["results"][0] = dict(rec("adamw", None, 1.0), status="oom", oom=dict(phase="warm-up"))
    _, rows = pxm.target_checks(doc)
    got = {(r[0], r[1]): (r[2], r[4]) for r in rows}
    assert got[("POET-X mem peak / AdamW", "L=32, b=256")] == ("AdamW OOM", "PASS")
    assert got[("POET-X fast tokens/s / AdamW", "L=32, b=256")] == ("AdamW OOM", "MISS")


def test_model_bench_tiny_end_to_end(tmp_path):
    """The tiny plan (forked workers; every kind of config: AdamW, LoRA, POET-X fast / mem / int8 / bf16 Q, fp32
    master weights, at both depths where the plan has them) with one config failing out of memory and one with
    another error: both recorded, every other config measured in its own process, JSON / markdown / plot written."""
    out = tmp_path / "pxm"
    env = dict(_env(), POETX_MODEL_BENCH_FAIL="poetx-mem-b32=oom,lora-r8=error")
    configs = "adamw,lora-r8,poetx-fast-b16,poetx-mem-b32,poetx-int8-b16,poetx-mem-b16-qbf16,adamw-fp32-master"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "poetx_model_bench.py"), "--tiny", "--device", "cpu",
                        "--out", str(out), "--budget-s", "3000", "--configs", configs], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "poetx_model_bench.json").read_text())
    assert doc["skipped"] == []
    assert sorted((e["name"], e["layers"]) for e in doc["errors"]) == [("lora-r8", 1), ("lora-r8", 2)]
    assert all("injected failure" in e["error"] for e in doc["errors"])
    res = {(x["name"], x["layers"]): x for x in doc["results"]}
    assert len(res) == 10 == len(doc["results"])
    assert sorted(res) == sorted([(n, L) for n in ("adamw", "poetx-fast-b16", "poetx-mem-b32", "poetx-int8-b16")
                                  for L in (1, 2)] + [("poetx-mem-b16-qbf16", 2), ("adamw-fp32-master", 2)])
    pids = [x["pid"] for x in doc["results"]]
    assert len(set(pids)) == len(pids) and doc["meta"]["parent_pid"] not in pids
    for L in (1, 2):
        assert res[("poetx-mem-b32", L)]["status"] == "oom"
        assert res[("poetx-mem-b32", L)]["oom"]["phase"] == "timed steps"
    for (name, layers), x in res.items():
        if x["status"] == "oom":
            continue
        assert x["status"] == "ok" and x["tokens_per_s"] > 0 and len(x["step_s_all"]) == 2
        assert all(v == v for v in x["losses"])  # finite losses
        if name.startswith("poetx"):
            assert x["convert_report"]["converted"] == 7 * layers
            assert list(x["convert_report"]["skipped"]) == ["lm_head"]
            assert x["merge_s"] > 0
            if name.endswith("qbf16"):  # Q in bf16 beside the bf16 embeddings, norms and lm_head
                assert "float32" not in x["trainable_by_dtype"]
            else:
                assert x["trainable_by_dtype"]["float32"] == x["convert_report"]["q_values"]
        if name.startswith("adamw"):
            assert x["trainable_params"] == x["params"]
    md = (out / "poetx_model_bench.md").read_text()
    assert "### Targets" in md and "**2 decoder layers (full depth)**" in md and "OOM (timed steps)" in md
    assert "Errors: lora-r8 L=2" in md
    assert (out / "poetx_model_bench.png").stat().st_size > 0


def test_model_bench_budget_skips_the_tail(tmp_path):
    out = tmp_path / "pxm"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "poetx_model_bench.py"), "--tiny", "--device", "cpu",
                        "--out", str(out), "--budget-s", "1", "--plan", "targets"], capture_output=True, text=True,
                       env=_env(), cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "poetx_model_bench.json").read_text())
    assert doc["results"] == [] and len(doc["skipped"]) == 10
    assert "Skipped (time budget): adamw L=2" in (out / "poetx_model_bench.md").read_text()
    r = subprocess.run([sys.executable, os.path.join(BENCH, "poetx_model_bench.py"), "--tiny", "--device", "cpu",
                        "--out", str(out), "--configs", "adamw,nope"], capture_output=True, text=True, env=_env(),
                       cwd=REPO, timeout=300)
    assert r.returncode != 0 and "unknown ['nope']" in r.stderr


# ---------------------------------------------------------------------------------------------------------------
# poetx_convergence.py
# ---------------------------------------------------------------------------------------------------------------

def _run(variant, losses, evals, **kw):
    return dict(variant=variant, seed=kw.pop("seed", 0), steps=len(losses), steps_planned=2000, losses=losses,
                evals=evals, final_eval_loss=evals[-1][1], min_eval_loss=min(e[1] for e in evals), train_s=100.0,
                init_hash=kw.pop("init_hash", "abc"), merges_at=[200, 400], merge_interval=200, truncated=False,
                finished=True, hidden=1024, layers=4, intermediate=2816, heads=16, kv_heads=4, params=45_884_416,
                batch=32, seq=256, lr=1e-3, block=128, q_lr_scale=0.5, q_params=1_000_000, trainable_params=1_600_000,
                corpus=dict(files=2000, train_bytes=30e6, eval_tokens=65536), **kw)


def test_convergence_summary(bench):
    pxc = bench["pxc"]
    n = 2000
    base = [3.0 - i / 1000 for i in range(n)]
    doc = dict(meta={}, errors=[], runs=[
        _run("adamw", [x - 0.1 for x in base], [(1000, 2.0), (2000, 1.2)]),
        _run("poetx", base, [(1000, 2.1), (2000, 1.3)]),
        _run("plain", [x + (1e-3 if i % 2 else 0.0) for i, x in enumerate(base)], [(1000, 2.1), (2000, 1.302)])])
    s = pxc.summarize(doc)
    pv = s["poetx_vs_plain"]
    assert pv["same_init"] and pv["first_step"] == 0.0 and abs(pv["mean"] - 5e-4) < 1e-9
    assert abs(pv["max"] - 1e-3) < 1e-9 and abs(pv["final_eval_diff"] - 2e-3) < 1e-9 and pv["eval_step"] == 2000
    pa = s["poetx_vs_adamw"]
    assert pa["eval_step"] == 2000 and abs(pa["diff"] - 0.1) < 1e-9
    md = pxc.markdown(doc)
    assert "POET-X EQUALS PLAIN: PASS" in md and "above AdamW (+8.3%)" in md
    # a different init, a large difference, or fewer than 2000 steps: MISS
    doc["runs"][2]["init_hash"] = "other"
    assert "POET-X EQUALS PLAIN: MISS" in pxc.markdown(dict(doc, summary=pxc.summarize(doc)))
    doc["runs"][2]["init_hash"] = "abc"
    for r in doc["runs"]:
        r["losses"], r["steps"], r["truncated"] = r["losses"][:1500], 1500, True
    md = pxc.markdown(dict(doc, summary=pxc.summarize(doc)))
    assert "1500 (truncated)" in md and "Fewer than 2000 steps ran" in md and "POET-X EQUALS PLAIN: MISS" in md


def test_convergence_tiny_end_to_end(tmp_path):
    out = tmp_path / "pxc"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "poetx_convergence.py"), "--tiny", "--device", "cpu",
                        "--out", str(out)], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "poetx_convergence.json").read_text())
    assert doc["errors"] == []
    runs = {x["variant"]: x for x in doc["runs"]}
    assert set(runs) == {"adamw", "poetx", "plain"}
    assert len({x["corpus"]["train_bytes"] for x in runs.values()}) == 1
    for v, x in runs.items():
        assert x["steps"] == 30 and x["finished"] and not x["truncated"] and len(x["losses"]) == 30
        assert [e[0] for e in x["evals"]] == [10, 20, 30]
        assert x["merges_at"] == ([] if v == "adamw" else [10, 20, 30])
    assert runs["poetx"]["convert"]["converted"] == runs["plain"]["convert"]["converted"] == 14
    assert runs["poetx"]["q_params"] == runs["plain"]["q_params"] > 0
    pv = doc["summary"]["poetx_vs_plain"]
    assert pv["same_init"] and pv["steps"] == 30
    assert pv["first_step"] <= 1e-3 and pv["mean"] <= 5e-3  # bf16 autocast on the CPU
    md = (out / "poetx_convergence.md").read_text()
    assert "POET-X EQUALS PLAIN" in md and "Fewer than 2000 steps ran" in md and "**Against AdamW**" in md
    assert (out / "poetx_convergence.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------------------------
# poetx_bench.py and run_h200.sh
# ---------------------------------------------------------------------------------------------------------------

def test_layer_bench_tiny_plain_variant(tmp_path):
    out = tmp_path / "layer.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "poetx_bench.py"), "--device", "cpu", "--tiny",
                        "--variants", "linear,plain,poetx-fast,poetx-fast-no-pdl", "--out", str(out)],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {x["variant"] for x in rows} == {"linear", "plain", "poetx-fast", "poetx-fast-no-pdl"}
    assert all(x["ms"] > 0 for x in rows)


def test_permute_section_tiny(tmp_path):
    """The permutation-pass section runs and records its reference rows (the kernels' rows need the GPU)."""
    out = tmp_path / "permute.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "poetx_bench.py"), "--device", "cpu", "--tiny",
                        "--sections", "permute", "--out", str(out)], capture_output=True, text=True, env=_env(),
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["permute"]
    assert {(x["d"], x["variant"]) for x in rows} == {(d, v) for d in (64, 100) for v in ("copy (floor)",
                                                                                         "index_select")}
    assert all(x["ms"] > 0 and x["gb_per_s"] > 0 for x in rows)


def test_run_h200_lists_the_poetx_subcommands():
    r = subprocess.run(["bash", os.path.join(BENCH, "run_h200.sh"), "nope"], capture_output=True, text=True)
    assert r.returncode == 2
    for sub in ("poetx-layer", "poetx-model", "poetx-train"):
        assert sub in r.stderr


def test_step_profile_tiny_end_to_end(tmp_path):
    """``poetx_step_profile.py --tiny --device cpu``: every config runs its steps and the profiled one; the JSON has a
    row per config with its times and its largest operators."""
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "poetx_step_profile.py"), "--tiny", "--device", "cpu",
                        "--out", str(out)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["tiny"] and [row["config"] for row in doc["rows"]] == ["adamw", "poetx-fast", "poetx-fast-batched",
                                                                      "poetx-fast-launchers", "poetx-fast-py-replay",
                                                                      "poetx-fast-tf32x3", "poetx-fast-load-split",
                                                                      "poetx-fast-no-pdl", "poetx-mem"]
    for row in doc["rows"]:
        assert row["wall_ms"] > 0 and row["host_ms"] > 0 and row["gpu_kernel_ms"] > 0 and row["kernels"]
