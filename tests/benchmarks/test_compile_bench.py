"""``benchmarks/compile_bench.py``'s plan and batching: every variant compared with LoRA sits in LoRA's batch of
processes (their timed iterations run in interleaved rounds), and the whole-model scope is planned beside each layer
compiled. The H200 runs are in ``benchmarks/results/``; a CPU run of the whole script takes minutes (``--tiny``)."""

from __future__ import annotations

import pytest

from ._bench_path import on_path


@pytest.fixture(scope="module")
def cb():
    with on_path():
        import compile_bench
        yield compile_bench


def _group(c):
    return c["rank"], c["setup"], c["mode"], c["scope"]


@pytest.mark.parametrize("size", [3, 4, 8, 9])
def test_batches_keep_compared_configs_together(cb, size):
    cfgs = cb.plan([384, 16], ["amp", "bf16"], ["default", "reduce-overhead"], ("layers", "model"))
    batches = cb.batches(cfgs, size)
    assert sorted(i for b in batches for i in b) == list(range(len(cfgs)))  # every config once
    where = {i: n for n, b in enumerate(batches) for i in b}
    groups: dict = {}
    for i, c in enumerate(cfgs):
        groups.setdefault(_group(c), []).append(i)
    for key, idx in groups.items():
        assert len({where[i] for i in idx}) == 1, key  # one batch per compared group
        assert any(cfgs[i]["variant"] == "lora" for i in idx), key  # each group has its baseline
    for b in batches:  # a batch holds at most `size` processes unless one group alone is larger
        assert len(b) <= size or len({_group(cfgs[i]) for i in b}) == 1


def test_plan_scopes_and_modes(cb):
    cfgs = cb.plan([384, 16], ["amp", "bf16"], ["default", "reduce-overhead"], ("layers", "model"))
    model = [c for c in cfgs if c["scope"] == "model"]
    assert {c["variant"] for c in model} == {"lora", "fastdora", "peft_dora"}
    assert {(c["rank"], c["setup"], c["mode"]) for c in model} == {(384, "amp", "default")}
    ro = [c for c in cfgs if c["mode"] == "reduce-overhead"]
    assert {c["variant"] for c in ro} == {"lora", "fastdora"} and {c["rank"] for c in ro} == {384}
    for r in (384, 16):
        for s in ("amp", "bf16"):
            got = {c["variant"] for c in cfgs if (c["rank"], c["setup"], c["mode"], c["scope"]) == (r, s, "default",
                                                                                                     "layers")}
            assert {"lora", "fastdora", "peft_dora"} <= got


@pytest.mark.parametrize("seed", range(4))
def test_gpu_idle_against_a_time_grid(cb, seed):
    """The busy time (union of kernel intervals) and the idle gaps, against a 1-us grid over random overlapping
    intervals; CPU events are ignored."""
    import random
    import types

    import torch

    rng = random.Random(seed)
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(a, b, name, kind=cuda):
        return types.SimpleNamespace(time_range=types.SimpleNamespace(start=a, end=b), name=name, device_type=kind)

    spans, t = [], 0
    for k in range(60):
        t += rng.choice([0, 1, 3, 6, 20])  # overlaps, short gaps, long gaps
        d = rng.randint(1, 15)
        spans.append((t, t + d, f"k{k}"))
        t += rng.randint(0, d)
    events = [ev(*s) for s in rng.sample(spans, len(spans))] + [ev(0, 10_000, "host op", cpu)]
    got = cb.gpu_idle(types.SimpleNamespace(events=lambda: events), min_gap_us=5.0, top=100)
    t0, t1 = min(s[0] for s in spans), max(s[1] for s in spans)
    covered = [any(a <= x < b for a, b, _ in spans) for x in range(t0, t1)]
    runs, x = [], 0
    while x < len(covered):  # maximal idle runs on the grid
        if covered[x]:
            x += 1
            continue
        y = x
        while y < len(covered) and not covered[y]:
            y += 1
        runs.append(y - x)
        x = y
    assert got["span_ms"] == pytest.approx((t1 - t0) / 1e3)
    assert got["busy_ms"] == pytest.approx(sum(covered) / 1e3)
    assert got["gaps"] == sum(r >= 5 for r in runs)
    assert got["idle_ms"] == pytest.approx(sum(r for r in runs if r >= 5) / 1e3)
    assert [g[0] for g in got["largest"]] == sorted((r for r in runs if r >= 5), reverse=True)


def test_select_variants_keeps_the_baseline(cb):
    cfgs = cb.plan([384, 16], ["amp", "bf16"], ["default"], ("layers",))
    assert cb.select(cfgs, "") == cfgs
    got = cb.select(cfgs, "fastdora, peft_dora")
    assert {c["variant"] for c in got} == {"lora", "fastdora", "peft_dora"}
    assert len(got) == 12 and all(c in cfgs for c in got)
    with pytest.raises(SystemExit, match="unknown"):
        cb.select(cfgs, "fastdora,dora")
