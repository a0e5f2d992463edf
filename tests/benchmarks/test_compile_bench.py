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
