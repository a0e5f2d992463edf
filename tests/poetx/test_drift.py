"""Hundreds of merges: the weight's singular values stay those it started with, up to the series' truncation
(predicted exactly by the float64 replay) and rounding (float32: negligible; bfloat16: a random walk)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fastdora.poetx import PoetXLinear

from . import oracle

D, B, MERGES = 64, 16, 300


def _layer(dtype, terms):
    """64x64 with singular values evenly spread over [0.5, 1.5]: well conditioned, so that relative errors of every
    singular value are meaningful (with a random Gaussian weight the smallest ones are near zero)."""
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))
    base = nn.Linear(D, D)
    with torch.no_grad():
        base.weight.copy_((u * torch.linspace(0.5, 1.5, D, dtype=torch.float64)) @ v.T)
    return PoetXLinear(base.to(dtype), B, terms=terms)


def _merge_many(layer, sigma, merges, gen, replay):
    """``merges`` merges, each after setting Q to N(0, sigma²) entries (a merge interval's worth of updates). Returns
    ``replay`` carried through the same merges in float64 (the dense oracle on the exact blocks of the same Q values)
    and the bounds on every singular value's ratio s/s0 from the blocks' extreme singular values (σ_i(R W P) ∈
    [σ_min(R)σ_min(P), σ_max(R)σ_max(P)]·σ_i(W))."""
    lo = hi = 1.0
    for _ in range(merges):
        with torch.no_grad():
            layer.q_in.copy_(torch.randn(layer.q_in.shape, generator=gen) * sigma)
            layer.q_out.copy_(torch.randn(layer.q_out.shape, generator=gen) * sigma)
            g_in = oracle.series(oracle.skew(layer.q_in, B), layer.terms)
            g_out = oracle.series(oracle.skew(layer.q_out, B), layer.terms)
            s_in, s_out = torch.linalg.svdvals(g_in), torch.linalg.svdvals(g_out)
            lo *= (s_in.min() * s_out.min()).item()
            hi *= (s_in.max() * s_out.max()).item()
            replay = oracle.factor(g_out, layer.perm_out) @ replay @ oracle.factor(g_in, layer.perm_in)
        layer.merge()
    return replay, lo, hi


# Measured (300 merges, 64x64, b=16, float32 weight and Q):
#   terms=3, σ=1e-3: max relative singular-value error 1.0e-6; weight vs float64 replay 1.9e-6 (rounding)
#   terms=3, σ=1e-2: 2.9e-3, all of it the truncation (each block's singular values are 1 − λ⁴ ≤ 1: a contraction;
#                    the float64 replay has the same 2.9e-3)
#   terms=2, σ=1e-2: 7.0e-6 (even terms: singular values √(1 + λ⁶) — growth, far smaller)
@pytest.mark.parametrize("terms, sigma, max_rel", [(3, 1e-3, 1e-5), (3, 1e-2, 5e-3), (2, 1e-2, 3e-5)])
def test_float32_merges_keep_the_singular_values(terms, sigma, max_rel):
    layer = _layer(torch.float32, terms)
    s0 = torch.linalg.svdvals(oracle.natural_weight(layer).double())
    replay, lo, hi = _merge_many(layer, sigma, MERGES, torch.Generator().manual_seed(1),
                                 oracle.natural_weight(layer).double())
    s = torch.linalg.svdvals(oracle.natural_weight(layer).double())
    assert ((s - s0).abs() / s0).max() <= max_rel
    # float32 rounding over 300 merges (measured 1.9e-6)
    assert oracle.rel_err(oracle.natural_weight(layer), replay) <= 1e-5
    ratio = s / s0
    assert (ratio >= lo * (1 - 1e-5)).all() and (ratio <= hi * (1 + 1e-5)).all()
    s_replay = torch.linalg.svdvals(replay)
    assert ((s - s_replay).abs() / s0).max() <= 1e-5  # what drift there is, is the method's, not rounding's


# Measured (terms=3, σ=1e-3, bfloat16 weight, float32 Q): after 300 merges the weight is 3.0e-2 (relative Frobenius)
# from the float64 replay and 1.5e-2 after 75 (ratio 2.04): each merge rounds R·W·P once to bfloat16, and the
# roundings add up as a random walk (√4 = 2), not as a bias (which would give 4). Singular values move by up to
# 7.3e-3·s_max (1.4e-2 relative for the smallest, 0.5·s_max). Training with a bfloat16 weight therefore loses about
# 2⁻⁸·√merges of the weight (relative); a float32 weight (bfloat16 GEMMs under autocast) keeps the float32 figures.
def test_bf16_merges_drift_as_a_random_walk_of_roundings():
    layer = _layer(torch.bfloat16, 3)
    s0 = torch.linalg.svdvals(oracle.natural_weight(layer).double())
    gen = torch.Generator().manual_seed(1)
    replay, _, _ = _merge_many(layer, 1e-3, MERGES // 4, gen, oracle.natural_weight(layer).double())
    err_quarter = oracle.rel_err(oracle.natural_weight(layer), replay)
    replay, _, _ = _merge_many(layer, 1e-3, MERGES - MERGES // 4, gen, replay)
    err = oracle.rel_err(oracle.natural_weight(layer), replay)
    assert err <= 2 ** -8 * math.sqrt(MERGES)
    assert 1.5 <= err / err_quarter <= 2.7
    s = torch.linalg.svdvals(oracle.natural_weight(layer).double())
    assert (s - s0).abs().max() <= 2e-2 * s0.max()
