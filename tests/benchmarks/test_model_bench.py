"""The model-level benchmark harness (``benchmarks/model_bench.py``): its default plan covers every row of the
targets table, and a whole run (parent, one forked worker per variant, report) works end to end on the CPU at tiny
shapes. Timings are not asserted here (the H200 runs are in ``benchmarks/results/``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ._bench_path import BENCH, REPO, on_path


@pytest.fixture(scope="module")
def mb():
    with on_path():
        import model_bench
        yield model_bench


def test_plan_h200_covers_the_targets(mb):
    cfgs = mb.plan_configs("h200", 8, 3)
    keys = [tuple(sorted(c.items())) for c in cfgs]
    assert len(keys) == len(set(keys)), "a config is planned twice"
    rows = {(c["shape"], c["rank"], c["setup"], c["variant"]) for c in cfgs}
    four = ("lora", "fastdora", "peft_dora", "eager")
    # the targets: Qwen3-8B r=384, AMP and pure bf16, all four variants
    for setup in ("amp", "bf16"):
        for v in four:
            assert ("qwen3-8b", 384, setup, v) in rows
    # both shapes at every rank, LoRA / fastdora / PEFT DoRA (the no-regression rows)
    for shape in ("qwen3-8b", "mistral-small-24b"):
        for r in (16, 64, 384, 768):
            for v in ("lora", "fastdora", "peft_dora"):
                assert (shape, r, "amp", v) in rows, (shape, r, v)
    # one full-depth run with the three variants the targets compare
    full = [c for c in cfgs if c.get("full_depth")]
    assert {c["variant"] for c in full} == {"lora", "fastdora", "peft_dora"}
    assert all(c["layers"] == mb.SHAPES["qwen3-8b"]["full_layers"] == 36 for c in full)
    # the target rows come first (a time budget drops the tail, never them), in exec workers (fresh interpreters)
    assert [c["rank"] for c in cfgs[:8]] == [384] * 8
    assert [c.get("spawn") for c in cfgs] == ["exec"] * 8 + [None] * (len(cfgs) - 8)
    assert all(not c.get("repeats") or c["repeats"] >= 3 for c in cfgs)


def test_every_plan_runs_known_variants(mb):
    """Each plan the parser offers yields configs (no duplicates) of the four variants only."""
    assert mb.VARIANTS == ["lora", "peft_dora", "fastdora", "eager"]
    for plan in mb.PLANS:
        cfgs = mb.plan_configs(plan, 8, 3)
        assert cfgs, plan
        assert {c["variant"] for c in cfgs} <= set(mb.VARIANTS), plan
        keys = [tuple(sorted(c.items())) for c in cfgs]
        assert len(keys) == len(set(keys)), plan
    # one setup's r=384 targets alone: all four variants
    assert [(c["setup"], c["rank"], c["variant"]) for c in mb.plan_configs("bf16", 8, 3)] == [
        ("bf16", 384, v) for v in mb.VARIANTS]


def test_settings_parsed_and_unknown_refused(mb, tmp_path):
    """--settings: Python literals (a bare word as a string); an unknown internal setting is refused before
    anything runs."""
    assert mb.parse_settings("") == {}
    assert mb.parse_settings("layer_node=False, norm_budget_mb=8,bwd_evict=evict_first") == {
        "layer_node": False, "norm_budget_mb": 8, "bwd_evict": "evict_first"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        mb.parse_settings("layer_node")
    mb.check_settings({"layer_node": False, "graph_norm": False})  # known: no error
    with pytest.raises(SystemExit, match="nope"):
        mb.check_settings({"nope": 1})
    r = subprocess.run([sys.executable, os.path.join(BENCH, "model_bench.py"), "--tiny", "--device", "cpu",
                        "--out", str(tmp_path / "mb"), "--settings", "nope=1"], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode != 0 and "nope" in r.stderr
    assert not (tmp_path / "mb").exists()


def test_every_variant_has_label_color_and_options(mb):
    """The report and plot name and colour every variant (a missing one raised KeyError after a whole run); every
    fastdora variant's options are valid ``fastdora.enable`` options."""
    from fastdora import config

    assert set(mb.VARIANT_LABEL) == set(mb.VARIANTS) == set(mb.VARIANT_COLOR)
    for v, opts in mb.FASTDORA_OPTIONS.items():
        assert v in mb.VARIANTS
        config.make_options(**opts)


def test_summary_table_ratios(mb):
    """The headline table: one row per config, fastdora's and the eager fallback's ratios to LoRA, PEFT DoRA's to
    fastdora; a variant not run shows "-"."""
    def rec(v, g, i, peak):
        return dict(shape="qwen3-8b", layers=8, setup="amp", rank=384, variant=v, grad_iter_s=g, infer_s=i,
                    train_peak_alloc_gb=peak)

    doc = dict(meta={}, results=[rec("lora", 1.0, 0.040, 10.0), rec("fastdora", 0.9, 0.036, 10.1),
                                 rec("peft_dora", 1.8, 0.090, 11.0), rec("eager", 1.1, 0.044, 10.0),
                                 dict(rec("lora", 2.0, 0.1, 5.0), rank=16),
                                 dict(rec("fastdora", 2.2, 0.1, 5.0), rank=16)])
    rows = mb.summary_table(doc).splitlines()
    assert len(rows) == 4 and rows[0].startswith("| shape | layers | setup | r | LoRA grad iter | fastdora / LoRA |")
    assert rows[2] == "| qwen3-8b | 8 | amp | 16 | 2.000 s | 1.100x | - | - | 1.000x | - | - | 1.000x |"
    assert rows[3] == ("| qwen3-8b | 8 | amp | 384 | 1.000 s | 0.900x | 2.000x | 1.100x | 0.900x | 2.500x | 1.100x "
                       "| 1.010x |")


def test_fork_cuda_failure_is_recognised(mb):
    """The errors a forked worker raises when the parent initialised CUDA: the parent falls back to exec workers."""
    assert mb.fork_broke_cuda("RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with ...")
    assert mb.fork_broke_cuda("torch.AcceleratorError: CUDA error: initialization error\nCUDA kernel errors ...")
    assert not mb.fork_broke_cuda("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not mb.fork_broke_cuda("RuntimeError: fastdora: kernels='triton' was requested but Triton is not importable")


def test_variants_filter_rejects_unknown(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(BENCH, "model_bench.py"), "--tiny", "--device", "cpu",
                        "--out", str(tmp_path / "mb"), "--variants", "lora,nope"], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown ['nope']" in r.stderr
    assert not (tmp_path / "mb").exists()  # refused before anything ran


def test_sequence_runs_the_given_order(tmp_path):
    """--sequence: the plan's first config with exactly these variants in this order (repeats pooled in the report);
    unknown names are refused before anything runs."""
    out = tmp_path / "mb"
    cmd = [sys.executable, os.path.join(BENCH, "model_bench.py"), "--tiny", "--device", "cpu", "--out", str(out),
           "--repeats", "1", "--inf-repeats", "1", "--warmup", "1", "--budget-s", "3000"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(cmd + ["--sequence", "lora,nope"], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode != 0 and "unknown ['nope']" in r.stderr and not out.exists()
    # with an internal setting: the fastdora workers run under fastdora.config.override, LoRA's ignores it
    r = subprocess.run(cmd + ["--sequence", "fastdora,lora,fastdora", "--settings", "lean_forward=False"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "model_bench.json").read_text())
    assert [(x["rank"], x["setup"], x["variant"]) for x in doc["results"]] == [
        (8, "amp", "fastdora"), (8, "amp", "lora"), (8, "amp", "fastdora")]
    assert [x.get("settings") for x in doc["results"]] == [{"lean_forward": False}, None, {"lean_forward": False}]
    assert doc["meta"]["settings"] == {"lean_forward": False}
    assert "[profile]" not in r.stdout  # plan tiny's profiling flags are not copied
    md = (out / "model_bench.md").read_text()
    assert "fastdora DoRA | 2 |" in md  # the two processes pooled
    assert "internal settings {'lean_forward': False}" in md


@pytest.mark.slow
@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_tiny_run_end_to_end(tmp_path, spawn):
    out = tmp_path / "mb"
    variants = ["lora", "peft_dora", "fastdora", "eager"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, os.path.join(BENCH, "model_bench.py"), "--tiny", "--device", "cpu",
                        "--out", str(out), "--spawn", spawn, "--variants", ",".join(variants), "--repeats", "2",
                        "--budget-s", "3000"],  # no config skipped on a slow or busy CPU
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "model_bench.json").read_text())
    assert doc["meta"]["spawn"] == spawn
    assert doc["errors"] == [] and doc["skipped"] == []
    res = doc["results"]
    # plan tiny: r=8 in both setups with all four variants, r=4 AMP without eager
    assert sorted((x["rank"], x["setup"], x["variant"]) for x in res) == sorted(
        [(8, s, v) for s in ("amp", "bf16") for v in variants] + [(4, "amp", v) for v in variants if v != "eager"])
    pids = [x["pid"] for x in res]
    assert len(set(pids)) == len(pids) and doc["meta"]["parent_pid"] not in pids, "each config in its own process"
    # plan tiny puts its second config in an exec worker (as plan h200 its target block); --all-forked is not given
    assert [x["spawn"] for x in res] == [spawn, "exec"] + [spawn] * (len(res) - 2)
    for x in res:
        assert x["grad_iter_s"] > 0 and x["infer_s"] > 0 and len(x["grad_iter_s_all"]) == 2
        # the host's enqueue time of each timed iteration (CPU: the whole iteration) and the threads' CPU time
        assert all(0 < h <= t for h, t in zip(x["grad_iter_host_s_all"], x["grad_iter_s_all"]))
        if sys.platform.startswith("linux"):
            assert sum(t["cpu_s"] for t in x["grad_iter_threads"]) > 0, x["grad_iter_threads"]
        assert x["norm_invalidated_per_step"], "the optimizer step must bump the adapter versions"
        if x["variant"] in ("fastdora", "eager"):
            rep = x["enable_report"]
            assert rep["converted"] == {"linear": 14} and not rep["skipped"], rep  # 2 layers x 7 projections
            assert x["path_counter"].get("linear:eager", 0) > 0  # CPU: the PyTorch path
        else:
            assert "enable_report" not in x
    md = (out / "model_bench.md").read_text()
    assert "| tiny | 2 | amp | 8 | fastdora DoRA | 2 |" in md and "### Targets" in md
    assert "### Summary" in md and "\n| tiny | 2 | amp | 4 | " in md
    assert ("except these configs' (a fresh interpreter each, exec): tiny L=2 amp r=8" in md) == (spawn == "fork")


def test_gpu_samples_attributed_to_timed_windows(mb):
    """nvidia-smi's CSV (the sampler's query, no header / units) parsed and cut to one process's timed iterations:
    the numbers of the samples inside the window only, the power-cap share from the clock-event reasons."""
    def stamp(t):
        return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(int(t))) + f".{int(round((t % 1) * 1000)):03d}"

    t0 = 1_800_000_000.0
    rows = [(t0 - 1.0, 345, 79.0, 38, 0, 0x1),      # idle, before the window
            (t0 + 0.2, 1800, 690.5, 61, 95, 0x4),   # power-capped
            (t0 + 0.4, 1700, 698.0, 62, 97, 0x4),
            (t0 + 0.6, 1980, 500.0, 60, 90, 0x0),
            (t0 + 0.8, 1750, 700.0, 63, 98, 0x44),  # power cap + thermal slowdown
            (t0 + 3.0, 1980, 130.0, 45, 0, 0x0)]    # after the window
    text = "\n".join(f"{stamp(t)}, {c}, {p:.2f}, {T}, {u}, 0x{r:016x}" for t, c, p, T, u, r in rows)
    text += "\n[N/A], [N/A], [N/A], [N/A], [N/A], [N/A]\n"
    samples = mb.gpu_samples(text)
    assert len(samples) == 6 and abs(samples[1][0] - (t0 + 0.2)) < 1e-6
    g = mb.gpu_window(samples, [t0, t0 + 1.0])
    assert g["n"] == 4
    assert g["sm_mhz"] == 1775 and g["power_w"] == (690.5 + 698.0) / 2 and g["temp_c"] == 61.5
    assert g["util_pct"] == (95 + 97 + 90 + 98) / 4
    assert g["sw_power_cap"] == 0.75 and g["hw_slowdown"] == 0.25
    assert mb.gpu_window(samples, [t0 + 1.0, t0 + 2.0]) is None
    # no CUDA device / no nvidia-smi: nothing is started, nothing to attribute
    assert mb.GpuSampler("/nonexistent/x.csv", 200, "cpu").stop() is None
    # the report lists each process's GPU state
    rec = dict(shape="qwen3-8b", layers=8, setup="bf16", rank=384, variant="fastdora", grad_iter_s=1.1, infer_s=0.037,
               gpu_during_grad_iter=g)
    md = mb.tables(dict(meta={}, results=[rec, dict(rec, variant="lora", gpu_during_grad_iter=None)]))
    assert "- qwen3-8b L=8 bf16 r=384 fastdora DoRA (grad iter 1.100 s): 1775 MHz, 694 W, 62 C, 95%, " \
           "power cap 75%, slowdown 25% (4 samples)" in md
    assert "PEFT LoRA (grad iter" not in md  # no samples: no line


def test_gpu_sampler_runs_nvidia_smi(mb, tmp_path, monkeypatch):
    """The sampler's process plumbing with a stand-in ``nvidia-smi`` on PATH (the arguments it is given, samples
    read back after stop); the real tool's output format is the one parsed above."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" > {tmp_path}/args\n"
                    "while true; do\n"
                    "  echo \"$(date '+%Y/%m/%d %H:%M:%S').500, 1830, 690.25, 62, 96, 0x0000000000000004\"\n"
                    "  sleep 0.05\n"
                    "done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    t0 = time.time()
    sampler = mb.GpuSampler(str(tmp_path / "gpu.csv"), 50, "cuda")
    time.sleep(0.6)
    samples = mb.gpu_samples(sampler.stop())
    args = (tmp_path / "args").read_text().split()
    assert args == ["-i", "3", f"--query-gpu={mb.GpuSampler.QUERY}", "--format=csv,noheader,nounits", "-lms", "50"]
    assert len(samples) >= 3 and all(s[1:] == (1830.0, 690.25, 62.0, 96.0, 4) for s in samples)
    assert all(abs(s[0] - t0) < 5 for s in samples)  # local-time stamps read back as epoch seconds
    assert sampler.proc.poll() is not None  # stopped
