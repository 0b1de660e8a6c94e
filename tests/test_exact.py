"""Bit-exact checks of lowbit's element codes and rounding, and the oracles themselves.

The block quantizers' spec tests (ties, saturation, special-value blocks, random inputs, 2-D
tiles, against tests/reference.py) are written once in tests/quantizer_base.py and run per
implementation (tests/test_quantizer_xla.py, _native.py, _pallas.py). What stays here is not
per implementation: every code of every element format (lowbit's decode and encode against
ml_dtypes and the reference's code tables), lowbit's round_to_grid against ml_dtypes casts, the
reference's own rounding against ml_dtypes, the ml_dtypes pitfall the saturation tests guard
against, and two checks of lowbit's XLA path only: hypothesis-generated blocks, and NVFP4 under
vmap (each row its own tensor scale). Comparisons are on float32 bit patterns (so -0.0 !=
+0.0), NaN matching NaN.
"""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowbit as lb
from lowbit.core import numerics, qarray
from tests import reference as ref
from tests import test_quantizer_xla
from tests.elements import LB_ELEMS, ML_DTYPES
from tests.quantizer_base import (
    BASE_ROWS,
    F32_MIN_NORMAL,
    MX_FORMATS,
    NVFP4_TRAINING_BLOCKS,
    assert_bits_equal,
    assert_codes_equal,
    assert_normal_or_zero,
    nvfp4_division_sensitive_rows,
    nvfp4_reciprocal_sensitive_matrix,
    nvfp4_training_rows,
)

FLOAT_ELEMS = sorted(ML_DTYPES)
INT_STEP = {"int8": 2.0**-6, "int4": 1.0, "ternary": 1.0}  # value of code 1

# Other test modules (tests/test_native.py, tests/test_pallas_quantize.py) import these by
# their former names from here.
_nvfp4_division_sensitive_rows = nvfp4_division_sensitive_rows
_nvfp4_reciprocal_sensitive_matrix = nvfp4_reciprocal_sensitive_matrix
__all__ = [
    "NVFP4_TRAINING_BLOCKS",
    "_nvfp4_division_sensitive_rows",
    "_nvfp4_reciprocal_sensitive_matrix",
]


@functools.cache
def _decoder(elem):
    return jax.jit(lambda c: qarray.decode_elements(c, elem))


def decode(codes, elem) -> np.ndarray:
    """lowbit's decode_elements, on codes padded to a power-of-two length (few compiles)."""
    codes = np.asarray(codes, np.uint8)
    flat = codes.reshape(-1)
    n = 1 << max(int(flat.size - 1).bit_length(), 6)
    out = np.asarray(_decoder(elem)(jnp.asarray(np.pad(flat, (0, n - flat.size)))))
    return out[: flat.size].reshape(codes.shape)


# --------------------------------------------------------------------------------------------
# Element codes: every code of every element format


@pytest.mark.parametrize("name", sorted(LB_ELEMS))
def test_decode_every_code(name):
    elem = LB_ELEMS[name]
    codes = np.arange(2**elem.bits, dtype=np.uint8)
    got = decode(codes, elem)
    if name in INT_STEP:
        # two's complement in elem.bits bits; the most negative code (-128 in MX INT8, -8 in
        # INT4, -2 in ternary) is unused
        half = 2 ** (elem.bits - 1)
        used = codes != half
        k = np.where(codes >= half, codes.astype(np.int64) - 2 * half, codes)
        expected = k.astype(np.float64) * INT_STEP[name]
        assert_bits_equal(got[used], expected[used], f"{name} decode vs k * step")
    else:
        used = np.ones(codes.shape, bool)
        expected = codes.view(ML_DTYPES[name]).astype(np.float32)
        assert_bits_equal(got, expected, f"{name} decode vs ml_dtypes")
    assert_bits_equal(got[used], ref.code_values(ref.ELEMS[name])[used], f"{name} vs reference")


@pytest.mark.parametrize("name", sorted(LB_ELEMS))
def test_encode_inverts_decode_for_every_finite_code(name):
    elem = LB_ELEMS[name]
    codes = np.arange(2**elem.bits, dtype=np.uint8)
    vals = decode(codes, elem)
    finite = np.isfinite(vals) & ((codes != 2 ** (elem.bits - 1)) if name in INT_STEP else True)
    enc = np.asarray(jax.jit(qarray.encode_elements, static_argnums=1)(vals[finite], elem))
    assert_codes_equal(enc, codes[finite], f"{name} encode(decode(c))")
    nonfinite = codes[~np.isfinite(vals)].tolist()  # the special codes DESIGN.md names
    assert nonfinite == {
        "e4m3": [0x7F, 0xFF],
        "e5m2": [0x7C, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF],
    }.get(name, [])


# --------------------------------------------------------------------------------------------
# numerics.round_to_grid against ml_dtypes casts


_round = jax.jit(numerics.round_to_grid, static_argnums=1)


def _round_inputs(name, n=20000, seed=0):
    """Hand-picked (grid points, every midpoint, one float32 ulp either side of it, zeros,
    max) and random (log-uniform and uniform) float32 values inside [-max, max]."""
    elem = ref.ELEMS[name]
    grid, _ = ref.positive_grid(elem)
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    hand = np.concatenate(
        [
            grid.astype(np.float32),
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, np.float32(0)),
            np.float32([grid[1] / 4, grid[1] * 0.75, elem.max]),
            np.nextafter(np.float32(elem.max), np.float32(0))[None],
        ]
    )
    rng = np.random.default_rng(seed)
    lo = np.log2(grid[1]) - 4
    logu = 2.0 ** rng.uniform(lo, np.log2(elem.max), n) * rng.choice([-1.0, 1.0], n)
    uni = rng.uniform(-elem.max, elem.max, n // 4)
    v = np.concatenate([hand, -hand, np.float32([0.0, -0.0]), logu, uni]).astype(np.float32)
    v = np.clip(v, -elem.max, elem.max)
    assert_normal_or_zero(v, "round_to_grid inputs")
    return v


@pytest.mark.parametrize("name", FLOAT_ELEMS)
def test_round_to_grid_matches_ml_dtypes_cast(name):
    v = _round_inputs(name)
    expected = v.astype(ML_DTYPES[name]).astype(np.float32)
    got = np.asarray(_round(jnp.asarray(v), LB_ELEMS[name]))
    assert_bits_equal(got, expected, f"round_to_grid {name}", v)


@pytest.mark.parametrize("name", FLOAT_ELEMS)
def test_reference_rounding_matches_ml_dtypes_cast(name):
    """The test oracle agrees with ml_dtypes, values and codes, including at every tie."""
    v = _round_inputs(name, n=5000, seed=1)
    vals, codes = ref.round_to_grid(v, ref.ELEMS[name])
    expected = v.astype(ML_DTYPES[name])
    assert_bits_equal(vals.astype(np.float32), expected.astype(np.float32), name, v)
    assert_codes_equal(codes, expected.view(np.uint8) & (2 ** ref.ELEMS[name].bits - 1), name)


def test_round_to_grid_int8_is_nearest_even_multiple_of_2_pow_minus_6():
    rng = np.random.default_rng(2)
    mx = np.float32(127 / 64)
    ties = (np.arange(-253, 254, 2) / 128).astype(np.float32)  # every half-step tie
    v = np.concatenate([ties, rng.uniform(-mx, mx, 20000).astype(np.float32)])
    v = np.clip(v, -mx, mx)
    expected = (np.round(v.astype(np.float64) * 64) / 64).astype(np.float32)  # half to even
    expected = expected + np.float32(0)  # two's complement INT8 has no -0: -0.0 -> +0.0
    got = np.asarray(_round(jnp.asarray(v), lb.formats.INT8))
    assert_bits_equal(got, expected, "round_to_grid int8", v)


def test_e4m3_ml_dtypes_cast_gives_nan_above_464():
    """The pitfall the saturation tests guard against (DESIGN.md, 'Casting pitfalls')."""
    assert np.isnan(np.float32(470).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


# --------------------------------------------------------------------------------------------
# lowbit's XLA path only


# Arbitrary finite float32 blocks (normal magnitudes up to 2**127, or zero: MX results are then
# normal floats or zero), in the (24, 32) default-mode programs the XLA spec tests also use.
_magnitudes = st.floats(F32_MIN_NORMAL, 2.0**127, width=32) | st.just(0.0)
_signed = st.tuples(_magnitudes, st.booleans()).map(lambda t: -t[0] if t[1] else t[0])
XLA = test_quantizer_xla.TestXLAQuantizer()


@settings(suppress_health_check=[HealthCheck.large_base_example])
@given(
    fmt=st.sampled_from(MX_FORMATS),
    blocks=hnp.arrays(np.float32, (3, 32), elements=_signed),
)
def test_mx_arbitrary_floats_match_reference(fmt, blocks):
    x = np.zeros((BASE_ROWS, 32), np.float32)
    x[:3] = blocks
    expected = ref.mx_quantize(x, fmt)
    assert_normal_or_zero(expected.values)
    XLA.check(XLA.run(x, fmt), expected, x, f"{fmt} hypothesis", fmt)


def test_nvfp4_vmapped_rows_are_separate_tensors():
    """fake_quantize under vmap: each row its own tensor (its own tensor scale), on rows
    whose results change if the scale divisions are reassociated."""
    x = np.concatenate([nvfp4_division_sensitive_rows(), nvfp4_training_rows()])
    expected = np.stack([ref.nvfp4_quantize(r[None]).values[0] for r in x])
    with lb.native.mode("off"):
        fake = jax.jit(jax.vmap(lambda r: lb.fake_quantize(r[None], "nvfp4")[0]))(x)
    assert_bits_equal(fake, expected, "nvfp4 vmapped over rows", x)
