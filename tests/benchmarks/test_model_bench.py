"""The model-level benchmark harness (issue 5, ``benchmarks/model_bench.py``): its default plan covers every row the
issue asks for, and a whole run (parent, one forked worker per variant, report) works end to end on the CPU at tiny
shapes. Timings are not asserted here (the H200 runs are in ``benchmarks/results/``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")


@pytest.fixture(scope="module")
def mb():
    sys.path.insert(0, BENCH)
    try:
        import model_bench
        yield model_bench
    finally:
        sys.path.remove(BENCH)


def test_plan_h200_covers_issue_5(mb):
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


def test_every_variant_has_label_color_and_options(mb):
    """The report and plot name and colour every variant (a missing one raised KeyError after a whole run); every
    fastdora variant's options are valid ``fastdora.enable`` options."""
    from fastdora import config

    assert set(mb.VARIANT_LABEL) == set(mb.VARIANTS) == set(mb.VARIANT_COLOR)
    for v, opts in mb.FASTDORA_OPTIONS.items():
        assert v in mb.VARIANTS
        config.make_options(**opts)


def test_fork_cuda_failure_is_recognised(mb):
    """The errors a forked worker raises when the parent initialised CUDA: the parent falls back to exec workers."""
    assert mb.fork_broke_cuda("RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with ...")
    assert mb.fork_broke_cuda("torch.AcceleratorError: CUDA error: initialization error\nCUDA kernel errors ...")
    assert not mb.fork_broke_cuda("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not mb.fork_broke_cuda("RuntimeError: variant fastdora_old needs --old-pkg DIR (DIR/fastdora)")


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
           "--repeats", "1", "--inf-repeats", "1", "--warmup", "1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(cmd + ["--sequence", "lora,nope"], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode != 0 and "unknown ['nope']" in r.stderr and not out.exists()
    r = subprocess.run(cmd + ["--sequence", "fastdora,lora,fastdora"], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "model_bench.json").read_text())
    assert [(x["rank"], x["setup"], x["variant"]) for x in doc["results"]] == [
        (8, "amp", "fastdora"), (8, "amp", "lora"), (8, "amp", "fastdora")]
    assert "[profile]" not in r.stdout  # plan tiny's profiling flags are not copied
    assert "fastdora DoRA | 2 |" in (out / "model_bench.md").read_text()  # the two processes pooled


@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_tiny_run_end_to_end(tmp_path, spawn):
    out = tmp_path / "mb"
    variants = ["lora", "peft_dora", "fastdora", "eager"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, os.path.join(BENCH, "model_bench.py"), "--tiny", "--device", "cpu",
                        "--out", str(out), "--spawn", spawn, "--variants", ",".join(variants), "--repeats", "2"],
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


def test_gap_probe_attributes_idle_time():
    """gap_probe.analyse on a hand-built trace: the idle gaps between GPU events, their phase, size and cause
    (host late: the launch ending a gap came after the GPU went idle; else a GPU-side wait), the op around a late
    launch (innermost, on the launching thread), and the synchronising runtime calls."""
    sys.path.insert(0, BENCH)
    try:
        import gap_probe
    finally:
        sys.path.remove(BENCH)

    def kern(ts, dur, corr, cat="kernel"):
        return {"cat": cat, "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def rt(ts, corr, name="cudaLaunchKernel", tid=1, dur=2):
        return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {"correlation": corr}}

    def span(name, ts, dur, tid=1, cat="user_annotation"):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    ev = [
        span("fwd:0", 0, 400), span("bwd:0", 400, 600), span("fwd:1", 1000, 300), span("step:0", 1300, 200),
        span("aten::mm", 0, 50, cat="cpu_op"), span("fastdora::norm", 100, 300), span("aten::add", 150, 10,
                                                                                           cat="cpu_op"),  # ended
        span("aten::mul", 160, 5, tid=2, cat="cpu_op"),  # another thread: never the launching op
        rt(10, 1), kern(20, 100, 1),                 # busy 20-120
        rt(30, 2), kern(125, 5, 2),                  # gap 5 us, launched before the GPU went idle: gpu_wait
        rt(162, 3), kern(200, 50, 3),                # gap 70 us, launched at 162 > 130: host late, in fastdora::norm
        rt(450, 4), kern(460, 40, 4, "gpu_memcpy"),  # gap 210 us, host late, in bwd0, no op around it
        rt(1100, 5), kern(2600, 10, 5),              # gap 2100 us, host late in fwd*
        rt(1320, 6, name="cudaStreamSynchronize", dur=30), rt(1400, 7, name="cudaFree", dur=8),
    ]
    r = gap_probe.analyse({"traceEvents": ev}, min_gap_us=2.0)
    assert r["gpu_events"] == 5 and r["launches"] == 5
    assert r["window_ms"] == pytest.approx((2610 - 20) / 1e3)
    assert r["gpu_event_ms"] == pytest.approx(205 / 1e3)
    assert r["idle_ms"] == pytest.approx((5 + 70 + 210 + 2100) / 1e3)
    assert r["idle_ms_by_cause"] == pytest.approx({"gpu_wait": 0.005, "host_late": 2.38})
    assert r["idle_ms_by_phase"] == pytest.approx({"fwd0/gpu_wait": 0.005, "fwd0/host_late": 0.07,
                                                   "bwd0/host_late": 0.21, "fwd*/host_late": 2.1})
    assert r["idle_ms_by_size"] == pytest.approx({"<10us": 0.005, "10-50us": 0.0, "50-200us": 0.07,
                                                  "0.2-1ms": 0.21, ">1ms": 2.1})
    assert r["host_late_ms_by_op"] == pytest.approx({"fastdora::norm": 0.07, "(no op)": 2.31})
    assert r["runtime_calls"] == {"cudaStreamSynchronize": {"count": 1, "host_ms": 0.03},
                                  "cudaFree": {"count": 1, "host_ms": 0.008}}
    assert gap_probe.analyse({"traceEvents": ev[:8]}) == {"gpu_events": 0}
    # the host's time: top-level ops per thread (main: the phases' thread) and phase group, self time by op
    assert r["host_top_level_ms"] == pytest.approx({"main/fwd": 0.352, "main/bwd": 0.002, "main/step": 0.038,
                                                    "other/fwd": 0.005})
    assert r["host_self_ms"] == pytest.approx({
        "main/fwd|fastdora::norm": 0.288, "main/fwd|aten::mm": 0.046, "main/fwd|aten::add": 0.010,
        "main/fwd|cudaLaunchKernel": 0.008, "main/bwd|cudaLaunchKernel": 0.002,
        "main/step|cudaStreamSynchronize": 0.030, "main/step|cudaFree": 0.008, "other/fwd|aten::mul": 0.005})
    assert r["host_calls"]["main/fwd|cudaLaunchKernel"] == 4
    assert r["host_self_small_ms"] == pytest.approx(r["host_self_ms"])  # every op here has few children
    assert r["host_calls_small"]["main/fwd|fastdora::norm"] == 1
    many = ev + [rt(110 + i, 100 + i, dur=0.5) for i in range(gap_probe.SMALL_CHILDREN + 1)]  # norm: 15 children
    r3 = gap_probe.analyse({"traceEvents": many})
    assert "main/fwd|fastdora::norm" in r3["host_self_ms"] and "main/fwd|fastdora::norm" not in r3["host_self_small_ms"]
    assert r3["host_self_small_ms"]["main/fwd|aten::add"] == pytest.approx(0.010)
    # without record_function ranges (a CUDA-only profile): the phases from host Unix-ns marks and the trace's base
    base = 1_000_000_000
    marks = [("fwd:0", base, base + 400_000), ("bwd:0", base + 400_000, base + 1_000_000),
             ("fwd:1", base + 1_000_000, base + 1_300_000)]
    bare = [e for e in ev if e["cat"] != "user_annotation"]
    r2 = gap_probe.analyse({"traceEvents": bare, "baseTimeNanoseconds": base}, marks=marks)
    assert r2["idle_ms_by_phase"] == r["idle_ms_by_phase"]
    assert r2["host_late_ms_by_op"] == pytest.approx({"(no op)": 2.38})  # fastdora::norm was a range: gone


def test_gap_probe_median_tree():
    """The probe's summary: per leaf of the rows' nested results the median over rows, missing leaves as 0."""
    sys.path.insert(0, BENCH)
    try:
        import gap_probe
    finally:
        sys.path.remove(BENCH)
    rows = [{"wall_ms": 3.0, "ops": {"idle": {"a": 1.0, "b": 5.0}, "n": 4}},
            {"wall_ms": 1.0, "ops": {"idle": {"a": 3.0}, "n": 6}},
            {"wall_ms": 2.0, "ops": {"idle": {"a": 2.0, "b": None}, "n": 5}}]
    assert gap_probe._median_tree(rows) == {"wall_ms": 2.0, "ops": {"idle": {"a": 2.0, "b": 0.0}, "n": 5}}


def test_gap_probe_tiny_run(tmp_path):
    """The probe runs end to end on the CPU (no GPU events there: the analysis is the test above)."""
    out = tmp_path / "gap.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, os.path.join(BENCH, "gap_probe.py"), "--tiny", "--rounds", "1", "--out",
                    str(out)], check=True, env=env, cwd=REPO, capture_output=True, timeout=600)
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"lora", "fastdora"}
    assert [r["variant"] for r in doc["rows"]] == ["lora", "fastdora"]
    assert all(r["cuda"]["gpu_events"] == 0 and r["ops"]["wall_ms"] > 0 for r in doc["rows"])


def test_gpu_host_probe_cpu_run(tmp_path):
    """gpu_host_probe.py end to end on the CPU (the eager path; the GPU variants need CUDA): every setup x mode has
    per-variant microseconds per layer for LoRA and fastdora, and the cProfile tables of the profiled modes name
    fastdora's lean forward for fastdora and not for LoRA."""
    out = tmp_path / "ghp.json"
    subprocess.run([sys.executable, os.path.join(BENCH, "gpu_host_probe.py"), "--device", "cpu", "--d", "16",
                    "--tokens", "2", "--rank", "4", "--layers", "2", "--rounds", "2", "--iters", "2", "--warmup", "1",
                    "--cprofile", "2", "--out", str(out)], check=True, cwd=REPO, capture_output=True, timeout=600)
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {f"{s}/{m}" for s in ("bf16", "amp") for m in ("train", "ckpt", "fwd")}
    for key, res in doc["results"].items():
        assert set(res["us_per_layer"]) == {"lora", "fastdora"} and min(res["us_per_layer"].values()) > 0, key
        assert all(len(r) == 2 for r in res["rounds"].values()), key
        if key.endswith(("/fwd", "/ckpt")):
            fns = {v: " ".join(r["fn"] for r in rows) for v, rows in res["cprofile"].items()}
            assert "lean_linear_forward" in fns["fastdora"] and "lean_linear_forward" not in fns["lora"], key
        else:
            assert "cprofile" not in res, key


def test_gap_probe_folds_pyspy_stacks():
    """gap_probe.fold_stacks on hand-written py-spy raw lines: per thread, waits (a sync / futex / the GIL near the
    leaf) vs CPU, inclusive counts once per stack, self counts by leaf, main-thread stacks outside the loop left out."""
    sys.path.insert(0, BENCH)
    try:
        import gap_probe
    finally:
        sys.path.remove(BENCH)
    text = "\n".join([
        "thread (1): MainThread;main (a.py:1);spied (a.py:2);forward (m.py:3);at::mm (libtorch.so) 7",
        "thread (1): MainThread;main (a.py:1);spied (a.py:2);forward (m.py:3);forward (m.py:3);cudaStreamSynchronize"
        " (libcudart.so) 3",
        "thread (1): MainThread;main (a.py:1);time_sleep (libpython.so) 50",  # outside the loop
        "thread (2): pt_autograd_0;Engine::thread_main (libtorch.so);pthread_cond_wait (libc.so.6) 20",
        "thread (2): pt_autograd_0;Engine::thread_main (libtorch.so);ComposeNode::apply (native.so) 5",
        "not a stack line",
    ])
    f = gap_probe.fold_stacks(text, main_marker="spied (")
    assert f["MainThread"]["samples"] == 10 and f["MainThread"]["waiting"] == 3 and f["MainThread"]["cpu"] == 7
    assert f["MainThread"]["incl"]["forward (m.py:3)"] == 10  # counted once per stack, not per frame
    assert f["MainThread"]["self"] == {"at::mm (libtorch.so)": 7, "cudaStreamSynchronize (libcudart.so)": 3}
    auto = f["pt_autograd_0"]
    assert (auto["samples"], auto["waiting"], auto["cpu"]) == (25, 20, 5)
    assert gap_probe.fold_stacks(text)["MainThread"]["samples"] == 60
