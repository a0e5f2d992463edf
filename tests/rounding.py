"""The composition kernels' precision contract, checked against fp64: fp32 math, one rounding to the output dtype.

The eager half-precision path rounds intermediates (``result + (g-1)*result`` then ``+ g*s*lora``) and can be off
by several ulp where terms cancel, so comparisons of the kernels against it need data-dependent tolerances; this
contract does not.
"""

from __future__ import annotations

import torch

_MANTISSA = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
# the spacing of the dtype's subnormals: below its smallest normal an ulp is this, not 2**(exponent - mantissa)
_SUBNORMAL_ULP = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -149}


def assert_one_rounding(k: torch.Tensor, ref64: torch.Tensor, terms64: torch.Tensor, what: str) -> None:
    """|k - ref| <= 1 ulp of ref in k's dtype (a correct rounding is 1/2 ulp; an fp32 evaluation may fall on the
    other side of a rounding boundary) + 1e-6 x the magnitude of the summed terms (fp32 evaluation error)."""
    ref64 = ref64.double()
    _, e = torch.frexp(ref64)
    ulp = torch.ldexp(torch.ones_like(ref64), (e - _MANTISSA[k.dtype]).to(torch.int32)).clamp_min(
        _SUBNORMAL_ULP[k.dtype])
    bound = ulp + 1e-6 * terms64.double()
    err = (k.double() - ref64).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements beyond one rounding, "
                           f"worst {float((err - bound).max()):.3g}")


def ref_compose64(result, lora, magnitude, norm, scale, eps):
    """fp64 plain-form composition: (y, inner, |terms of y|, |terms of inner|, g)."""
    g = magnitude.double() / norm.double().clamp_min(eps)
    r, lo = result.double(), lora.double()
    inner = r + scale * lo
    t_inner = r.abs() + abs(scale) * lo.abs()
    return g * inner, inner, g.abs() * t_inner, t_inner, g
