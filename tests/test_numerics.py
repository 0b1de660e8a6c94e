"""Tests of lowbit.core.numerics: the counter-based random bits, exact powers of two, rounding.

The statistical tests state their bound: each compares a statistic with the quantile of its
null distribution at a false-failure probability ALPHA = 1e-6 per test, split over the checks
in the test by Bonferroni (so a failure is a real defect, not bad luck).
"""

from __future__ import annotations

import functools
from statistics import NormalDist

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from scipy import stats

import lowbit as lb
from lowbit.core import numerics

ALPHA = 1e-6
N = 2**16  # samples per stream

_bits = jax.jit(numerics.uniform_bits, static_argnums=1)


def z_bound(n_checks: int) -> float:
    """Two-sided standard-normal quantile for n_checks simultaneous checks at total ALPHA."""
    return NormalDist().inv_cdf(1 - ALPHA / (2 * n_checks))


def raw_key(k0: int, k1: int) -> jax.Array:
    return jnp.array([k0, k1], jnp.uint32)


# Keys whose streams are tested: typed keys of adjacent seeds, raw keys differing by one in
# either word, and a key from jax.random.split.
KEYS = {
    "key(0)": jax.random.key(0),
    "key(1)": jax.random.key(1),
    "raw(1,0)": raw_key(1, 0),
    "raw(0xffffffff,0xffffffff)": raw_key(0xFFFFFFFF, 0xFFFFFFFF),
    "split": jax.random.split(jax.random.key(42))[1],
}


@functools.cache
def stream(name: str) -> np.ndarray:
    return np.asarray(_bits(KEYS[name], (N,)))


def chi2_uniform(samples: np.ndarray, buckets: int) -> float:
    counts = np.bincount(samples, minlength=buckets)
    expected = samples.size / buckets
    return float(np.sum((counts - expected) ** 2) / expected)


# --------------------------------------------------------------------------------------------
# uniform_bits


def test_uniform_bits_shape_dtype_and_determinism():
    key = jax.random.key(3)
    b = _bits(key, (4, 8))
    assert b.dtype == jnp.uint32 and b.shape == (4, 8)
    # A keyed hash of the flat index: the same key gives the same bits, whatever the shape.
    np.testing.assert_array_equal(b, np.asarray(_bits(key, (32,))).reshape(4, 8))
    np.testing.assert_array_equal(_bits(key, (4, 8)), b)
    # Typed keys and raw uint32[2] keys with the same data are the same key.
    np.testing.assert_array_equal(_bits(jax.random.key_data(key), (4, 8)), b)
    assert _bits(key, ()).shape == ()


def test_uniform_bits_rejects_bad_keys_and_sizes():
    with pytest.raises(TypeError, match="key must be"):
        numerics.uniform_bits(jnp.zeros(3, jnp.uint32), (4,))
    with pytest.raises(TypeError, match="key must be"):
        numerics.uniform_bits(jnp.zeros(2, jnp.float32), (4,))
    with pytest.raises(ValueError, match="fewer than 2\\*\\*32 elements"):
        numerics.uniform_bits(jax.random.key(0), (2**16, 2**16))


@pytest.mark.parametrize("name", list(KEYS))
def test_uniform_bits_chi_square(name):
    """Pearson chi-square against the uniform distribution, three views of each stream: the
    top 8 bits (256 buckets), the low 8 bits, and pairs of consecutive elements (top 4 bits
    of each: 256 buckets, which catches serial dependence). Null: chi2 with 255 degrees of
    freedom; threshold its upper ALPHA / 3 / len(KEYS) quantile (~ 392)."""
    b = stream(name)
    limit = stats.chi2.isf(ALPHA / 3 / len(KEYS), df=255)
    assert chi2_uniform((b >> 24).astype(np.int64), 256) < limit
    assert chi2_uniform((b & 0xFF).astype(np.int64), 256) < limit
    pairs = ((b[0::2] >> 28) << 4 | (b[1::2] >> 28)).astype(np.int64)
    assert chi2_uniform(pairs, 256) < limit


@pytest.mark.parametrize("name", list(KEYS))
def test_uniform_bits_each_bit_is_a_fair_coin(name):
    """The count of ones at each of the 32 bit positions is Binomial(N, 1/2) under the null:
    |count - N/2| <= z * sqrt(N)/2, z at ALPHA over 32 positions x len(KEYS) keys (~ 5.8)."""
    b = stream(name)
    ones = ((b[:, None] >> np.arange(32, dtype=np.uint32)) & 1).sum(axis=0)
    z = z_bound(32 * len(KEYS))
    assert np.all(np.abs(ones - N / 2) <= z * np.sqrt(N) / 2), ones


PAIRS = [
    ("key(0)", "key(1)"),  # adjacent seeds: word 1 + 1
    ("key(0)", "raw(1,0)"),  # the first key word differs by one
    ("key(0)", "split"),
    ("raw(0xffffffff,0xffffffff)", "key(0)"),
]


@pytest.mark.parametrize("a, b", PAIRS)
def test_streams_of_different_keys_are_uncorrelated(a, b):
    """Streams u = top 24 bits / 2**24 from two keys: the Pearson correlation at lags -2..2
    is ~ N(0, 1/N) under independence, so |r| <= z / sqrt(N) (z at ALPHA over 5 lags x
    len(PAIRS) pairs, ~ 5.5: |r| < 0.022); and the fraction of equal bits between the two
    streams is Binomial(32 N, 1/2) / (32 N): within z / (2 sqrt(32 N)) of 1/2."""
    ua = (stream(a) >> 8).astype(np.float64) / 2**24
    ub = (stream(b) >> 8).astype(np.float64) / 2**24
    z = z_bound(5 * len(PAIRS))
    for lag in range(-2, 3):
        x, y = (ua[lag:], ub[: N - lag]) if lag >= 0 else (ua[:lag], ub[-lag:])
        r = np.corrcoef(x, y)[0, 1]
        assert abs(r) <= z / np.sqrt(x.size), (lag, r)
    equal = np.unpackbits(~(stream(a) ^ stream(b)).view(np.uint8)).mean()
    assert abs(equal - 0.5) <= z_bound(len(PAIRS)) / (2 * np.sqrt(32 * N))


def test_streams_of_adjacent_seeds_are_not_permutations_of_each_other():
    """Two independent streams of N 32-bit words hold the same multiset of values with
    probability ~0; a stream that is a re-indexing of another does."""
    assert not np.array_equal(np.sort(stream("key(0)")), np.sort(stream("key(1)")))


def test_stream_has_no_serial_correlation():
    """Within one stream, elements i and i + lag are uncorrelated (|r| <= z / sqrt(N), z at
    ALPHA over 8 lags), including lags that are powers of two."""
    u = (stream("key(0)") >> 8).astype(np.float64) / 2**24
    z = z_bound(8)
    for lag in (1, 2, 3, 16, 32, 256, 4096, 2**15):
        r = np.corrcoef(u[:-lag], u[lag:])[0, 1]
        assert abs(r) <= z / np.sqrt(N - lag), (lag, r)


# --------------------------------------------------------------------------------------------
# pow2, exponent


def test_pow2_is_exact_over_its_range():
    e = np.arange(-126, 128, dtype=np.int32)
    got = np.asarray(jax.jit(numerics.pow2)(e))
    want = np.ldexp(np.float32(1.0), e).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_exponent_is_floor_log2_for_every_binade():
    e = np.arange(-126, 128)
    mant = np.array([1.0, 1.5, 2.0 - 2.0**-23], np.float32)  # lowest, middle, highest in binade
    x = (mant[None, :] * np.ldexp(np.float32(1.0), e)[:, None]).astype(np.float32)
    x = np.concatenate([x, -x]).ravel()
    got = np.asarray(jax.jit(numerics.exponent)(x))
    _, ex = np.frexp(x)  # |x| = m * 2**ex, m in [0.5, 1)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ex - 1)
    # Zero and float32 subnormals: -127 (documented).
    tiny = np.array([0.0, -0.0, 2.0**-149, 2.0**-127, 2.0**-126 - 2.0**-149], np.float32)
    np.testing.assert_array_equal(jax.jit(numerics.exponent)(tiny), -127)


# --------------------------------------------------------------------------------------------
# round_to_grid (the exhaustive comparison lives elsewhere; a few values per format here)

ELEMS = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "int8": None,
}
_round = jax.jit(numerics.round_to_grid, static_argnums=1)


def sample_values(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(grid, values): every other grid point, midpoints (ties) and quarter points between
    neighbours, with both signs, inside [-max, max]."""
    if ELEMS[name] is None:
        grid = np.arange(0, 128) / 64.0
    else:
        codes = np.arange(2 ** {"e2m1": 3, "e2m3": 5, "e3m2": 5}.get(name, 7), dtype=np.uint8)
        grid = codes.view(ELEMS[name]).astype(np.float64)
        grid = grid[np.isfinite(grid)]
    lo, hi = grid[:-1], grid[1:]
    v = np.concatenate([grid[::2], (lo + hi) / 2, lo + (hi - lo) / 4, hi - (hi - lo) / 4])
    return grid, np.concatenate([v, -v]).astype(np.float32)


@pytest.mark.parametrize("name", list(ELEMS))
def test_round_to_grid_nearest_even_matches_ml_dtypes(name):
    elem = getattr(lb.formats, name.upper())
    _, v = sample_values(name)
    got = np.asarray(_round(jnp.asarray(v), elem))
    if ELEMS[name] is None:
        want = (np.round(v.astype(np.float64) * 64.0) / 64.0).astype(np.float32)  # half-even
        want = want + np.float32(0)  # two's complement INT8 has no -0
    else:
        want = v.astype(ELEMS[name]).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", list(ELEMS))
def test_round_to_grid_stochastic_is_exactly_unbiased_over_stratified_bits(name):
    """With rbits running over 256 evenly spaced values (top byte 0..255, the rest zero), a
    uniform rounder rounds up for exactly distance * 256 of them when the distance to the
    lower neighbour is a multiple of 1/256 grid steps, as it is for these mid and quarter
    points: every result is a grid neighbour and the mean over the 256 is exactly v."""
    elem = getattr(lb.formats, name.upper())
    grid, v = sample_values(name)
    a = np.abs(v.astype(np.float64))
    down = np.copysign(grid[np.searchsorted(grid, a, side="right") - 1], v)
    up = np.copysign(grid[np.searchsorted(grid, a, side="left")], v)
    rbits = (np.arange(256, dtype=np.uint32) << 24)[:, None] * np.ones(v.shape, np.uint32)
    vb = np.broadcast_to(v, rbits.shape)
    got = np.asarray(_round(jnp.asarray(vb), elem, rbits=jnp.asarray(rbits)), np.float64)
    assert np.all((got == down) | (got == up))
    np.testing.assert_array_equal(got.mean(axis=0), v.astype(np.float64))
    assert np.any(got != got[:1])  # both neighbours are reached
