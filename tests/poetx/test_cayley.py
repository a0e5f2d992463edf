"""The orthogonal blocks (fastdora.poetx.cayley) against the dense float64 oracle."""

from __future__ import annotations

import pytest
import torch

from fastdora.poetx.cayley import cayley_neumann, orthogonality_error, skew_from_packed, skew_size

from . import oracle


def _packed(n_blocks, b, scale, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_blocks, skew_size(b), generator=gen, dtype=torch.float64) * scale).to(dtype)


def test_packed_layout_is_the_row_major_strict_upper_triangle():
    q = skew_from_packed(torch.tensor([[1.0, 2.0, 3.0]]), 3)
    assert torch.equal(q[0], torch.tensor([[0.0, 1.0, 2.0], [-1.0, 0.0, 3.0], [-2.0, -3.0, 0.0]]))
    p = _packed(3, 7, 1.0)
    assert torch.equal(skew_from_packed(p, 7), oracle.skew(p, 7))


@pytest.mark.parametrize("b", [2, 3, 8, 16])
@pytest.mark.parametrize("terms", [1, 2, 3, 4, 5])
def test_series_equals_the_truncated_cayley_neumann_product(b, terms):
    p = _packed(3, b, 0.2)
    ref = oracle.series(oracle.skew(p, b), terms)  # (I + Q)(I + Q + ... + Q^k)
    torch.testing.assert_close(cayley_neumann(p, b, terms), ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(cayley_neumann(p.float(), b, terms), ref.float(), rtol=0, atol=2e-6)


def test_three_terms_is_i_plus_2q_plus_2q2_plus_2q3_plus_q4():
    p = _packed(2, 8, 0.3)
    q = oracle.skew(p, 8)
    eye = torch.eye(8, dtype=torch.float64)
    q2 = q @ q
    torch.testing.assert_close(cayley_neumann(p, 8), eye + 2 * q + 2 * q2 + 2 * q2 @ q + q2 @ q2, rtol=0, atol=1e-14)


@pytest.mark.parametrize("terms", [1, 2, 3, 4])
def test_truncation_is_the_cayley_transform_times_i_minus_q_to_the_k_plus_1(terms):
    """G_k = C·(I − Q^{k+1}) with C = (I + Q)(I − Q)⁻¹, and GᵀG − I = (I − (−Q)^{k+1})(I − Q^{k+1}) − I."""
    p = _packed(2, 8, 0.3)
    q = oracle.skew(p, 8)
    eye = torch.eye(8, dtype=torch.float64)
    qk1 = torch.linalg.matrix_power(q, terms + 1)
    g = cayley_neumann(p, 8, terms)
    torch.testing.assert_close(g, oracle.cayley(q) @ (eye - qk1), rtol=0, atol=1e-13)
    deviation = (eye - (-1) ** (terms + 1) * qk1) @ (eye - qk1) - eye
    torch.testing.assert_close(g.mT @ g - eye, deviation, rtol=0, atol=1e-13)
    assert orthogonality_error(g).item() == pytest.approx(torch.linalg.matrix_norm(deviation).max().item(),
                                                           rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("terms", [1, 2, 3, 4, 5])
def test_singular_values_follow_from_those_of_q(terms):
    """odd k: |1 − (−1)^((k+1)/2)·λ^(k+1)|; even k: √(1 + λ^(2k+2)), over the singular values λ of Q."""
    p = _packed(2, 8, 0.3)
    lam = torch.linalg.svdvals(oracle.skew(p, 8))
    if terms % 2:
        expected = (1 - (-1) ** ((terms + 1) // 2) * lam ** (terms + 1)).abs()
    else:
        expected = (1 + lam ** (2 * terms + 2)).sqrt()
    got = torch.linalg.svdvals(cayley_neumann(p, 8, terms))
    torch.testing.assert_close(got.sort(-1).values, expected.sort(-1).values, rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_zero_gives_the_identity_exactly(dtype):
    g = cayley_neumann(torch.zeros(4, skew_size(16), dtype=dtype), 16)
    assert g.dtype == dtype
    assert torch.equal(g, torch.eye(16, dtype=dtype).expand(4, 16, 16))
    assert orthogonality_error(g).item() == 0.0


@pytest.mark.parametrize("terms", [1, 2, 3, 5])
def test_backward_equals_autograd_through_the_oracle(terms):
    b = 6
    p = _packed(3, b, 0.25).requires_grad_()
    p_ref = p.detach().clone().requires_grad_()
    grad_g = torch.randn(3, b, b, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (cayley_neumann(p, b, terms) * grad_g).sum().backward()
    (oracle.series(oracle.skew(p_ref, b), terms) * grad_g).sum().backward()
    torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: cayley_neumann(t, b, terms), (p.detach().clone().requires_grad_(),))


def test_float32_backward_is_close_to_float64():
    b = 16
    p64 = _packed(4, b, 1e-2).requires_grad_()
    p32 = p64.detach().float().requires_grad_()
    grad_g = torch.randn(4, b, b, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (cayley_neumann(p64, b) * grad_g).sum().backward()
    (cayley_neumann(p32, b) * grad_g.float()).sum().backward()
    assert oracle.rel_err(p32.grad, p64.grad) < 1e-6


# Measured max-over-blocks ‖GᵀG − I‖_F of float32 blocks (4 blocks, Q entries ~ N(0, σ²), 3 terms):
#   b=16:  σ=1e-3: 1.4e-7   σ=1e-2: 7.9e-5
#   b=256: σ=1e-3: 8.0e-6   σ=1e-2: 7.7e-2     (2 terms at b=256: 5.6e-7 and 3.0e-3)
# For odd terms the error is 2‖Q^{k+1}‖ to first order (4th power for 3 terms); for even terms ‖Q^{2k+2}‖.
@pytest.mark.parametrize("b, sigma, terms, bound", [
    (16, 1e-3, 3, 5e-7),
    (16, 1e-2, 3, 2e-4),
    (256, 1e-3, 3, 2e-5),
    (256, 1e-2, 3, 0.15),
    (256, 1e-3, 2, 2e-6),
    (256, 1e-2, 2, 6e-3),
])
def test_orthogonality_error_at_realistic_norms(b, sigma, terms, bound):
    p = _packed(4, b, sigma)
    g32 = cayley_neumann(p.float(), b, terms)
    err = orthogonality_error(g32).item()
    # the float32 value is the exact deviation plus float32 rounding of G (~1e-7·√b)
    exact = orthogonality_error(cayley_neumann(p, b, terms)).item()
    assert err == pytest.approx(exact, abs=2e-7 * b ** 0.5)
    assert bound / 20 <= err <= bound


def test_invalid_arguments():
    with pytest.raises(ValueError, match="terms"):
        cayley_neumann(torch.zeros(1, 6), 4, terms=0)
    with pytest.raises(ValueError, match="shape"):
        cayley_neumann(torch.zeros(1, 5), 4)
    with pytest.raises(ValueError, match="block_size"):
        cayley_neumann(torch.zeros(1, 0), 1)
    with pytest.raises(TypeError, match="floating"):
        cayley_neumann(torch.zeros(1, 6, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="blocks"):
        orthogonality_error(torch.zeros(2, 3, 4))


def test_autocast_does_not_lower_the_series_precision():
    """Under a caller's bf16 autocast (a layer's forward in an AMP step) the blocks and the gradient of Q are the ones
    computed without autocast, exactly: the series runs in Q's dtype."""
    torch.manual_seed(4)
    b = 16
    packed = torch.randn(3, skew_size(b)) * (0.3 / b ** 0.5)
    grad_g = torch.randn(3, b, b)

    def run(autocast):
        p = packed.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            g = cayley_neumann(p, b)
        g.backward(grad_g)
        return g, p.grad

    (g_ref, d_ref), (g_amp, d_amp) = run(False), run(True)
    assert g_amp.dtype == torch.float32
    assert torch.equal(g_amp, g_ref) and torch.equal(d_amp, d_ref)
