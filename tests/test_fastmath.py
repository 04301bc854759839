"""The FMA-unit exp2 (fa4gen.kernels.fastmath): accuracy of its arithmetic, and its PTX."""

from __future__ import annotations

import numpy as np
import pytest

from fa4gen.kernels import fastmath


def test_polynomial_relative_error_below_bound():
    x = np.concatenate([np.linspace(-126.0, 0.0, 400_001, dtype=np.float32),
                        -np.random.default_rng(0).exponential(4.0, 100_000).astype(np.float32)])
    x = x[x > -126.0]
    got = fastmath.exp2_poly_reference(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got / want - 1.0)
    assert rel.max() <= fastmath.EXP2_POLY_MAX_REL_ERROR
    # well below the rounding of a bf16 probability (2^-9)
    assert rel.max() < 2.0**-9 / 10


@pytest.mark.parametrize("x", [-127.0, -200.0, -1e30, -np.inf])
def test_underflow_gives_exact_zero(x):
    assert fastmath.exp2_poly_reference(np.float32(x)) == 0.0


def test_integers_are_exact_powers_of_two():
    for k in range(0, 127):
        assert fastmath.exp2_poly_reference(np.float32(-k)) == np.float32(2.0**-k)


def test_ptx_uses_no_conversion_or_special_function_unit():
    ptx = fastmath.EXP2_POLY_PTX
    assert "ex2" not in ptx and "cvt" not in ptx
    assert ptx.count("fma.rn.ftz.f32") == 3
    # the float immediates are the coefficients, exactly
    for coefficient in fastmath.EXP2_POLY:
        assert fastmath._ptx_f32(coefficient) in ptx
