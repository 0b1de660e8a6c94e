"""Bit-exact checks of lowbit's element codes, rounding and block quantizers.

Oracles: tests/reference.py (an independent numpy implementation of DESIGN.md "Numerics"),
ml_dtypes casts (round to nearest even, subnormals kept) and hand-derived tie and saturation
vectors. Comparisons are on float32 bit patterns (so -0.0 != +0.0), NaN matching NaN.

XLA on CPU flushes float32 subnormals to zero: inputs are chosen so that every expected result
is a normal float or zero (asserted as a precondition). The FTZ-sensitive cases -- all-zero
blocks and blocks with amax near 2**-120, whose E8M0 scale 2**-127 is a float32 subnormal,
and inputs near 1e-30 -- still have normal results and are exact; an NVFP4 tensor scale below
2**-126 is tested only for what holds with or without flushing.

Speed: each quantizer configuration is one jitted program (quantize + dequantize +
fake_quantize, compiled once and shared by every test that uses the same configuration and
shape; ~0.2 s of XLA compile each). The default run covers every pair of (MX format, scale
mode, axis case) -- 36 configurations instead of 144 -- and every pair of (format, tile,
tile layout); the full products run with `pytest -m slow` (`make test-slow`).
"""

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowbit as lb
from lowbit import numerics, qarray
from tests import reference as ref
from tests.elements import LB_ELEMS, ML_DTYPES

FLOAT_ELEMS = sorted(ML_DTYPES)
MX_FORMATS = ref.MX_FORMATS
SCALE_MODES = ref.SCALE_MODES
F32_MIN_NORMAL = float(np.finfo(np.float32).smallest_normal)
E8M0_NAN, UE4M3_NAN = 0xFF, 0x7F

# --------------------------------------------------------------------------------------------
# Helpers


def assert_bits_equal(actual, expected, what: str = "", x=None):
    """float32 bit patterns equal, NaN (any payload or sign) matching NaN; names mismatches."""
    actual = np.asarray(actual)
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype}, expected float32"
    expected = np.asarray(expected).astype(np.float32)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    bits_a = np.where(nan_a, 0, actual.view(np.uint32))
    bits_e = np.where(nan_e, 0, expected.view(np.uint32))
    bad = (nan_a != nan_e) | (bits_a != bits_e)
    if np.any(bad):
        lines = []
        for i in map(tuple, np.argwhere(bad)[:8]):
            xi = "" if x is None else f" (x={np.asarray(x)[i]!r})"
            lines.append(f"  at {i}: got {actual[i]!r}, expected {expected[i]!r}{xi}")
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} differ\n" + "\n".join(lines))


def assert_codes_equal(actual, expected, what: str = ""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == np.uint8, f"{what}: dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bad = actual != expected
    assert not np.any(bad), (
        f"{what}: {int(bad.sum())} differ, first at {np.argwhere(bad)[:4].tolist()}: "
        f"got {actual[bad][:4]}, expected {expected[bad][:4]}"
    )


def assert_normal_or_zero(values, what: str = ""):
    """Precondition: expected results are not float32 subnormals (flushed by XLA on CPU)."""
    v = np.abs(np.asarray(values, np.float32))
    sub = (v > 0) & (v < F32_MIN_NORMAL)
    assert not np.any(sub), f"{what}: test input gives float32 subnormal results {v[sub][:4]}"


@functools.cache
def quantizer(fmt, mode=None, axis=-1, block_shape=None, with_tensor_amax=False):
    """One jitted program per configuration: (QArray, dequantize, fake_quantize)."""
    kw = dict(axis=axis, scale_mode=mode, block_shape=block_shape)

    def run(x, tensor_amax=None):
        q = lb.quantize(x, fmt, tensor_amax=tensor_amax, **kw)
        return q, lb.dequantize(q), lb.fake_quantize(x, fmt, tensor_amax=tensor_amax, **kw)

    if with_tensor_amax:
        return jax.jit(run)
    return jax.jit(lambda x: run(x))


def run_quantizer(x, fmt, mode=None, axis=-1, block_shape=None, tensor_amax=None):
    if tensor_amax is None:
        return quantizer(fmt, mode, axis, block_shape)(jnp.asarray(x))
    fn = quantizer(fmt, mode, axis, block_shape, with_tensor_amax=True)
    return fn(jnp.asarray(x), jnp.float32(tensor_amax))


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


def check_qarray(q, y, expected: ref.Quantized, x, what: str):
    """Dequantized bits, scale bytes, decoded element codes and tensor scale against the
    reference."""
    assert isinstance(q, lb.QArray)
    assert q.shape == x.shape
    assert_bits_equal(y, expected.values, f"{what}: dequantize", x)
    assert_codes_equal(q.scales, expected.scale_codes, f"{what}: scale bytes")
    elem = q.format.elem
    codes = ref.unpack_codes(q.codes, elem.bits)
    assert codes.shape == expected.elems.shape, f"{what}: unpacked codes {codes.shape}"
    decoded = decode(codes, elem)
    live = ~np.isnan(expected.elems)  # element codes of a NaN/Inf block are unspecified
    assert_bits_equal(
        np.where(live, decoded, np.float32(0)),
        np.where(live, expected.elems, 0.0),
        f"{what}: decoded element codes",
    )
    if expected.tensor_scale is not None:
        assert_bits_equal(np.asarray(q.tensor_scale), expected.tensor_scale, f"{what}: t")


# Where mixed_inputs plants +-Inf, as (line, column) of the moved layout (the quantized axis
# last, other axes flattened in order). Line 0's first block is all zero. (NaN has its own
# tests below: test_mx_zero_nan_inf_blocks, test_nan_block_in_a_larger_tensor.)
SPECIALS = [(np.inf, 1, 2), (-np.inf, 2, -1), (np.inf, 4, 0)]
TINY_LINE = 5  # scaled by 2**-100 (about 7.9e-31)


def mixed_inputs(shape, axis, seed, spread, block):
    """float32 x whose lines along ``axis`` each hold one distribution: standard normal,
    student-t (2 degrees of freedom) or normal with 4% outliers of 1e2..1e4, each line scaled
    by 2**k (|k| <= spread); plus a zero block, +Inf and -Inf blocks (in unscaled normal
    lines, which never hold the tensor's largest magnitude) and a line near 1e-30."""
    rng = np.random.default_rng(seed)
    axis = axis % len(shape)
    moved = tuple(s for i, s in enumerate(shape) if i != axis) + (shape[axis],)
    rows, n = math.prod(moved[:-1]), moved[-1]
    normal = rng.standard_normal((rows, n))
    heavy = rng.standard_t(2.0, (rows, n))
    outlier = rng.standard_normal((rows, n))
    hit = rng.random((rows, n)) < 0.04
    outlier[hit] *= rng.choice([-1.0, 1.0], hit.sum()) * 10.0 ** rng.uniform(2, 4, hit.sum())
    kind = (np.arange(rows) % 3)[:, None]
    x = np.select([kind == 0, kind == 1], [normal, heavy], outlier)
    x = x * 2.0 ** rng.integers(-spread, spread + 1, (rows, 1))
    special_lines = [0] + [line for _, line, _ in SPECIALS]
    x[special_lines] = normal[special_lines]
    x[0, :block] = 0.0
    for value, line, col in SPECIALS:
        x[line, col] = value
    x[TINY_LINE] = normal[TINY_LINE] * 2.0**-100
    return np.ascontiguousarray(np.moveaxis(x.astype(np.float32).reshape(moved), -1, axis))


def check_planted_specials(q, y, x, axis, nan_byte):
    """Hand checks of the planted blocks: NaN scale byte and NaN values for the Inf blocks,
    byte 0 and +0.0 values for the zero block; for NVFP4 the 1e-30 line is all +0.0 (its
    block scales round to 0 next to the O(1) lines)."""
    ax = axis % x.ndim
    block = q.block_shape[0]
    scales = np.asarray(q.scales).reshape(-1, q.scales.shape[-1])
    ym = np.moveaxis(np.asarray(y), ax, -1).reshape(scales.shape[0], -1)
    n = ym.shape[1]
    for _, line, col in SPECIALS:
        b = (col % n) // block
        assert scales[line, b] == nan_byte
        assert np.all(np.isnan(ym[line, b * block : (b + 1) * block]))
    assert scales[0, 0] == 0
    assert np.all(ym[0, :block].view(np.uint32) == 0)
    assert not np.any(np.isnan(ym[[0, 3, TINY_LINE]]))
    if nan_byte == UE4M3_NAN:
        assert np.all(ym[TINY_LINE].view(np.uint32) == 0)
        assert np.all(scales[TINY_LINE] == 0)


# Axis cases: 2-D and 3-D, axis 0, 1, -1; padded (45 -> 64, 70 -> 96, 33 -> 64, 6 -> 32,
# 50 -> 64) except the 2-D axis -1 case, whose 64 is a whole number of blocks.
AXIS_CASES = [
    ((45, 70), 0),
    ((45, 70), 1),
    ((45, 64), -1),
    ((33, 6, 50), 0),
    ((33, 6, 50), 1),
    ((33, 6, 50), -1),
]
AXIS_IDS = [f"{'x'.join(map(str, s))}-axis{a}" for s, a in AXIS_CASES]


@functools.cache
def case_inputs(case: int, block: int) -> np.ndarray:
    shape, axis = AXIS_CASES[case]
    x = mixed_inputs(shape, axis, seed=case, spread=20 if block == 32 else 4, block=block)
    if block == 16:  # NVFP4: some values 2**-12 smaller, for subnormal and zero block scales
        x.reshape(-1)[7::97] *= np.float32(2.0**-12)
    x.setflags(write=False)
    return x


# Every pair of (format, axis case) once, with scale mode (f + a) % 4: every (format, mode)
# and every (mode, axis case) pair appears too.
MX_PAIRWISE = [
    (fmt, SCALE_MODES[(f + a) % 4], a)
    for f, fmt in enumerate(MX_FORMATS)
    for a in range(len(AXIS_CASES))
]
MX_FULL = [(fmt, m, a) for fmt in MX_FORMATS for m in SCALE_MODES for a in range(len(AXIS_CASES))]


def _mx_params(cases, fake: bool, slow: bool = False):
    out = []
    for fmt, mode, a in cases:
        marks = [pytest.mark.slow] if slow else []
        out.append(pytest.param(fmt, mode, a, marks=marks, id=f"{fmt}-{mode}-{AXIS_IDS[a]}"))
    return out


# --------------------------------------------------------------------------------------------
# Element codes: every code of every element format


@pytest.mark.parametrize("name", sorted(LB_ELEMS))
def test_decode_every_code(name):
    elem = LB_ELEMS[name]
    codes = np.arange(2**elem.bits, dtype=np.uint8)
    got = decode(codes, elem)
    if name == "int8":
        used = codes != 0x80  # -128 is unused in MX INT8
        expected = codes.view(np.int8).astype(np.float64) * 2.0**-6
        assert_bits_equal(got[used], expected[used], "int8 decode vs k * 2**-6")
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
    finite = np.isfinite(vals) & ((codes != 0x80) if name == "int8" else True)
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


# --------------------------------------------------------------------------------------------
# Ties and saturation through quantize / dequantize, with the block scale pinned.
# All MX cases use one shape, (24, 32) with the default scale mode (DESIGN.md: floor), so each
# format compiles once; the NVFP4 cases use (24, 16).

BASE_ROWS = 24

# (lo, hi, tie -> expected): adjacent grid values and the neighbour whose code is even (its
# mantissa LSB is 0), worked out by hand from each format's bit layout: in the subnormal
# range, across the subnormal/normal and binade boundaries, and at the top of the range.
TIES = {
    "e2m1": [(0, 0.5, 0), (0.5, 1, 1), (1, 1.5, 1), (1.5, 2, 2), (2, 3, 2), (3, 4, 4), (4, 6, 4)],
    "e2m3": [
        (0, 1 / 8, 0),
        (1 / 8, 2 / 8, 2 / 8),
        (2 / 8, 3 / 8, 2 / 8),
        (7 / 8, 1, 1),
        (1, 9 / 8, 1),
        (15 / 8, 2, 2),
        (2, 2.25, 2),
        (2.25, 2.5, 2.5),
        (3.75, 4, 4),
        (4, 4.5, 4),
        (7, 7.5, 7),
    ],
    "e3m2": [
        (0, 1 / 16, 0),
        (1 / 16, 2 / 16, 2 / 16),
        (3 / 16, 4 / 16, 4 / 16),
        (4 / 16, 5 / 16, 4 / 16),
        (1, 1.25, 1),
        (1.25, 1.5, 1.5),
        (1.75, 2, 2),
        (2, 2.5, 2),
        (20, 24, 24),
        (24, 28, 24),
    ],
    "e4m3": [
        (0, 2**-9, 0),
        (2**-9, 2**-8, 2**-8),
        (2**-8, 3 * 2**-9, 2**-8),
        (7 * 2**-9, 2**-6, 2**-6),
        (2**-6, 9 * 2**-9, 2**-6),
        (1, 1.125, 1),
        (1.125, 1.25, 1.25),
        (1.875, 2, 2),
        (2, 2.25, 2),
        (240, 256, 256),
        (256, 288, 256),
        (384, 416, 384),
        (416, 448, 448),
    ],
    "e5m2": [
        (0, 2**-16, 0),
        (2**-16, 2**-15, 2**-15),
        (3 * 2**-16, 2**-14, 2**-14),
        (2**-14, 5 * 2**-16, 2**-14),
        (1, 1.25, 1),
        (1.25, 1.5, 1.5),
        (1.75, 2, 2),
        (2, 2.5, 2),
        (40960, 49152, 49152),
        (49152, 57344, 49152),
    ],
    "int8": [
        (0, 1 / 64, 0),
        (1 / 64, 2 / 64, 2 / 64),
        (2 / 64, 3 / 64, 2 / 64),
        (63 / 64, 1, 1),
        (1, 65 / 64, 1),
        (125 / 64, 126 / 64, 126 / 64),
        (126 / 64, 127 / 64, 126 / 64),
    ],
}

# Values above an element's max but below 2**(emax + 1), so that floor mode keeps the scale
# at the anchor's and the element must saturate to +-max. E4M3 includes (464, 480], where an
# ml_dtypes cast gives NaN.
SATURATING = {
    "e4m3": [448.5, 449, 460, 463.99, 464, 464.01, 470, 479.99, 480, 481, 500, 511.9],
    "e5m2": [57345, 59000, 61439, 61440, 61441, 65535],
    "e3m2": [28.01, 29, 30, 31.99],
    "e2m3": [7.51, 7.75, 7.99],
    "e2m1": [6.01, 6.5, 7, 7.99],
    "int8": [127 / 64 + 1e-4, 127.5 / 64, 1.99],
}


def _neg(v, name):
    """-v as the format holds it: -0.0 for floats, +0.0 for INT8 (no negative zero)."""
    return 0.0 if (name == "int8" and v == 0) else -float(v)


def anchored_rows(values, anchor, width, rows=BASE_ROWS):
    """(rows, width): the anchor in column 0 of each used row (it sets the block amax), the
    values after it; unused rows are all zero."""
    per = width - 1
    used = -(-len(values) // per)
    assert used <= rows
    out = np.zeros((rows, width), np.float64)
    out[:used, 0] = anchor
    flat = np.zeros(used * per)
    flat[: len(values)] = values
    out[:used, 1:] = flat.reshape(used, per)
    return out


def _tie_vectors(name):
    """(inputs, expected) at every hand-derived tie, one float32 ulp either side, negated."""
    xs, ys = [], []
    for lo, hi, even in TIES[name]:
        assert lo < (lo + hi) / 2 < hi and even in (lo, hi)
        mid = np.float32((lo + hi) / 2)
        up, down = np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))
        for x, y in [(mid, even), (up, hi), (down, lo)]:
            xs += [float(x), -float(x)]
            ys += [y, _neg(y, name)]
    return np.array(xs), np.array(ys, np.float64)


@pytest.mark.parametrize("k", [0, -7, 9])
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_hand_derived_ties(fmt, k):
    name = ref.MX_ELEM[fmt]
    emax = ref.ELEMS[name].emax
    xs, ys = _tie_vectors(name)
    # The anchor 2**emax puts floor(log2(amax)) at emax, so the block scale is exactly 2**k.
    x = (anchored_rows(xs, 2.0**emax, 32) * 2.0**k).astype(np.float32)
    expected = (anchored_rows(ys, 2.0**emax, 32) * 2.0**k).astype(np.float32)
    assert_normal_or_zero(expected)
    q, y, _ = run_quantizer(x, fmt)
    used = np.any(x != 0, axis=1)
    assert np.all(np.asarray(q.scales)[used] == 127 + k)
    assert_bits_equal(y, expected, f"{fmt} ties, scale 2**{k}", x)


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_every_tie_rounds_to_even_code(fmt):
    """Every midpoint of adjacent grid values (from the reference's code enumeration) goes to
    the neighbour with the even code; a positive grid's codes ascend with its values."""
    name = ref.MX_ELEM[fmt]
    elem = ref.ELEMS[name]
    grid, codes = ref.positive_grid(elem)
    assert np.all(np.diff(codes) > 0)
    mids = (grid[:-1] + grid[1:]) / 2
    even = np.where(codes[:-1] % 2 == 0, grid[:-1], grid[1:])
    xs = np.concatenate([mids, -mids])
    ys = np.concatenate([even, [_neg(v, name) for v in even]])
    x = anchored_rows(xs, 2.0**elem.emax, 32).astype(np.float32)
    expected = anchored_rows(ys, 2.0**elem.emax, 32).astype(np.float32)
    q, y, _ = run_quantizer(x, fmt)
    used = np.any(x != 0, axis=1)
    assert np.all(np.asarray(q.scales)[used] == 127)
    assert_bits_equal(y, expected, f"{fmt} every tie", x)


def test_e4m3_ml_dtypes_cast_gives_nan_above_464():
    """The pitfall the saturation tests guard against (DESIGN.md, 'Casting pitfalls')."""
    assert np.isnan(np.float32(470).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


@pytest.mark.parametrize("k", [0, -7, 9])
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_saturates_to_max(fmt, k):
    name = ref.MX_ELEM[fmt]
    elem = ref.ELEMS[name]
    sat = np.array(SATURATING[name], np.float64)
    assert np.all((sat > elem.max) & (sat < 2.0 ** (elem.emax + 1)))
    xs = np.concatenate([sat, -sat, [elem.max, -elem.max]])
    ys = np.concatenate([np.full(sat.size, elem.max), np.full(sat.size, -elem.max)])
    ys = np.concatenate([ys, [elem.max, -elem.max]])
    x = (anchored_rows(xs, 2.0**elem.emax, 32) * 2.0**k).astype(np.float32)
    expected = (anchored_rows(ys, 2.0**elem.emax, 32) * 2.0**k).astype(np.float32)
    q, y, fake = run_quantizer(x, fmt)
    used = np.any(x != 0, axis=1)
    assert np.all(np.asarray(q.scales)[used] == 127 + k)
    assert np.all(np.isfinite(np.asarray(y)))
    assert_bits_equal(y, expected, f"{fmt} saturation, scale 2**{k}", x)
    assert_bits_equal(fake, expected, f"{fmt} fake_quantize saturation, scale 2**{k}", x)


# NVFP4 with tensor_amax = 2688 = 448 * 6, so that t = 1 exactly and s = RNE_e4m3(amax_b / 6).


@pytest.mark.parametrize("s", [1.0, 4.0, 0.25])
def test_nvfp4_hand_derived_element_ties(s):
    xs, ys = _tie_vectors("e2m1")
    # The anchor 6 * s makes amax_b / 6 / t = s, a value on the E4M3 grid.
    x = (anchored_rows(xs, 6.0, 16) * s).astype(np.float32)
    expected = (anchored_rows(ys, 6.0, 16) * s).astype(np.float32)
    q, y, fake = run_quantizer(x, "nvfp4", tensor_amax=2688.0)
    assert_bits_equal(np.asarray(q.tensor_scale), np.float32(1.0), "t")
    s_code = np.float32(s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    used = np.any(x != 0, axis=1)
    assert np.all(np.asarray(q.scales)[used, 0] == s_code)
    assert_bits_equal(y, expected, f"nvfp4 ties, s={s}", x)
    assert_bits_equal(fake, expected, f"nvfp4 fake_quantize ties, s={s}", x)


# Block scale s_raw = amax_b / 6 at an E4M3 tie -> the even neighbour (as in TIES["e4m3"]),
# and s_raw above 448 -> 448.
NVFP4_SCALE_TIES = [
    (2**-10, 0.0),
    (3 * 2**-10, 2**-8),
    (5 * 2**-10, 2**-8),
    (15 * 2**-10, 2**-6),
    (1.0625, 1.0),
    (1.1875, 1.25),
    (1.9375, 2.0),
    (2.125, 2.0),
    (400.0, 384.0),
    (432.0, 448.0),
    (460.0, 448.0),
    (1000.0, 448.0),
]


def test_nvfp4_block_scale_ties_and_saturation():
    s_raw = np.array([a for a, _ in NVFP4_SCALE_TIES])
    rng = np.random.default_rng(3)
    x = np.zeros((BASE_ROWS, 16))
    x[: s_raw.size] = rng.uniform(-1, 1, (s_raw.size, 16)) * 6 * s_raw[:, None]
    x[: s_raw.size, 0] = 6 * s_raw  # the block amax: exact in float32, amax / 6 == s_raw
    x = x.astype(np.float32)
    q, y, fake = run_quantizer(x, "nvfp4", tensor_amax=2688.0)
    s_expected = np.float32([s for _, s in NVFP4_SCALE_TIES])
    codes = s_expected.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert_codes_equal(np.asarray(q.scales)[: s_raw.size, 0], codes, "nvfp4 block scale bytes")
    expected = ref.nvfp4_quantize(x, tensor_amax=2688.0)
    assert_normal_or_zero(expected.values)
    assert np.all(expected.values[0] == 0)  # s rounds to 0: the block is zeros
    check_qarray(q, y, expected, x, "nvfp4 scale ties")
    assert_bits_equal(fake, expected.values, "nvfp4 fake_quantize scale ties", x)


def test_nvfp4_saturates_elements_when_block_scale_clips():
    # t = 1; s_raw = 6000 / 6 = 1000 -> s = 448, so x / 448 exceeds 6 for |x| > 2688;
    # 1568 / 448 = 3.5 is an E2M1 tie (3 or 4 -> 4), 100 / 448 < 0.25 -> 0.
    x = np.zeros((BASE_ROWS, 16), np.float32)
    x[0] = [6000, -3000, 2688, 2689, -2700, 100, 1568, 0] * 2
    expected = np.zeros_like(x)
    expected[0] = [2688, -2688, 2688, 2688, -2688, 0, 4 * 448, 0] * 2
    q, y, fake = run_quantizer(x, "nvfp4", tensor_amax=2688.0)
    assert np.asarray(q.scales)[0, 0] == 0x7E  # 448 = S.1111.110
    assert_bits_equal(y, expected, "nvfp4 saturation", x)
    assert_bits_equal(fake, expected, "nvfp4 fake_quantize saturation", x)


# Two NVFP4 tensors from a training step (tiny GPT, nvfp4 recipe: a (16, 64, 256) activation
# and a (16, 64, 64) one), reduced to the block that went wrong and the tensor's amax. XLA
# rewrote (amax / 6) / t into amax / (6 * t) (s_raw 184.0 instead of 183.99998, an E4M3 tie:
# s = 192 instead of 176) and 1 / (tamax / 2688) into 2688 / tamax (r 1 ulp high, x * r =
# 3.5000002 instead of 3.4999998: E2M1 4 instead of 3). Found by the native kernel's check.
NVFP4_TRAINING_BLOCKS = [
    ([-0.07977195829153061, -0.0928848460316658, -0.049612291157245636, 0.07748080790042877,
      0.021946197375655174, 0.07781267911195755, 0.22371549904346466, 0.08873916417360306,
      -0.017720282077789307, -0.09799240529537201, -0.10386866331100464, -0.033271100372076035,
      0.18365246057510376, -0.044825002551078796, 0.15613622963428497, 0.1333160102367401],
     0.5446986556053162),
    ([-0.36784806847572327, 0.9213835597038269, 0.13473504781723022, 0.061383623629808426,
      0.09135536104440689, -1.5270532369613647, -0.3780451714992523, 0.7453017830848694,
      -2.414548397064209, -1.8911420106887817, -1.2487531900405884, -0.6336798667907715,
      0.5682953596115112, -1.3385666608810425, 0.7545039057731628, -0.13124613463878632],
     3.5695111751556396),
]


def _nvfp4_division_sensitive_rows(n: int = 48, seed: int = 0, tamax=None) -> np.ndarray:
    """Rows of two NVFP4 blocks (a block, then one holding the tensor amax) whose block
    scale (amax / 6) / t, computed step by step in float32, falls on the other side of an
    E4M3 rounding tie than amax / (6 * t) does: any reassociation of the two divisions
    changes the result. Each row is its own tensor, or with ``tamax`` they all share it."""
    f32 = np.float32
    rng = np.random.default_rng(seed)
    grid = ref.positive_grid(ref.ELEMS["e4m3"])[0]
    ties = (grid[1:] + grid[:-1]) / 2
    ties = ties[(ties > 1) & (ties < 440)]
    rows = []
    while len(rows) < n:
        row_tamax = f32(rng.uniform(0.05, 200.0)) if tamax is None else f32(tamax)
        t = f32(row_tamax / f32(2688))
        tie = f32(rng.choice(ties))
        amax = f32(tie * 6 * t)
        for _ in range(64):
            two_step = f32(f32(amax / f32(6)) / t)
            one_step = f32(amax / f32(f32(6) * t))
            if (two_step < tie) != (one_step < tie) and amax <= row_tamax:
                row = np.zeros(32, np.float32)
                row[:16] = rng.uniform(-1, 1, 16).astype(np.float32) * amax
                row[int(rng.integers(16))] = -amax if rng.integers(2) else amax
                row[16] = row_tamax
                rows.append(row)
                break
            amax = np.nextafter(amax, f32(np.inf) if two_step < tie else f32(0))
    return np.stack(rows)


def _nvfp4_reciprocal_sensitive_matrix(n: int = 16, seed: int = 0) -> np.ndarray:
    """One NVFP4 tensor (n blocks of 16) whose r = (1 / t) / s, computed step by step in
    float32, differs from (2688 / tamax) / s, with one element per block placed so that
    x * r lands on the other side of an E2M1 rounding tie with the two values of r."""
    f32 = np.float32
    rng = np.random.default_rng(seed)
    while True:
        tamax = f32(rng.uniform(0.05, 200.0))
        t = f32(tamax / f32(2688))
        if f32(f32(1) / t) != f32(f32(2688) / tamax):
            break
    s = ref.round_to_grid(np.array([f32(f32(tamax / f32(6)) / t)]), ref.ELEMS["e4m3"])[0][0]
    s = f32(min(s, 448.0))
    r_exact = f32(f32(f32(1) / t) / s)
    r_other = f32(f32(f32(2688) / tamax) / s)
    x = np.zeros((n, 16), np.float32)
    x[:, 0] = tamax  # every block's amax is the tensor's: the same s in every block
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    found = 0
    for i in range(n):
        tie = f32(ties[i % len(ties)])
        v = f32(tie / r_exact)
        for _ in range(64):
            a, b = f32(v * r_exact), f32(v * r_other)
            if (a < tie) != (b < tie):
                x[i, 1 + i % 15] = -v if i % 2 else v
                found += 1
                break
            v = np.nextafter(v, f32(np.inf) if a < tie else f32(0))
    assert found >= n // 2, f"only {found} of {n} blocks found a tie to straddle"
    return x


def test_nvfp4_divisions_are_not_reassociated():
    rows = _nvfp4_division_sensitive_rows()
    blocks = np.zeros((len(NVFP4_TRAINING_BLOCKS), 32), np.float32)
    for i, (block, tamax) in enumerate(NVFP4_TRAINING_BLOCKS):
        blocks[i, :16] = block
        blocks[i, 16] = tamax
    for x in (rows, blocks):
        expected = np.stack([ref.nvfp4_quantize(r[None]).values[0] for r in x])
        fake = jax.jit(jax.vmap(lambda r: lb.fake_quantize(r[None], "nvfp4")[0]))(x)
        assert_bits_equal(fake, expected, "nvfp4 with a tensor scale that is not 1", x)
        q, y, fake2 = run_quantizer(x[:1], "nvfp4")
        assert_bits_equal(fake2, ref.nvfp4_quantize(x[:1]).values, "nvfp4 (one row)", x[:1])
    x = _nvfp4_reciprocal_sensitive_matrix()
    q, y, fake = run_quantizer(x, "nvfp4")
    expected = ref.nvfp4_quantize(x)
    check_qarray(q, y, expected, x, "nvfp4, 1 / t at E2M1 ties")
    assert_bits_equal(fake, expected.values, "nvfp4 fake_quantize, 1 / t at E2M1 ties", x)


# --------------------------------------------------------------------------------------------
# Random inputs (with planted zero and +-Inf blocks and a line near 1e-30) against the
# reference: MX formats x scale modes x axes, and NVFP4


def _check_mx_case(fmt, mode, a, fake_only):
    shape, axis = AXIS_CASES[a]
    x = case_inputs(a, 32)
    expected = ref.mx_quantize(x, fmt, axis, mode)
    assert_normal_or_zero(expected.values)
    q, y, fake = run_quantizer(x, fmt, mode, axis)
    what = f"{fmt} {mode} {AXIS_IDS[a]}"
    if fake_only:
        assert_bits_equal(fake, expected.values, f"{what}: fake_quantize", x)
        return
    check_qarray(q, y, expected, x, what)
    check_planted_specials(q, y, x, axis, E8M0_NAN)


@pytest.mark.parametrize("fmt,mode,a", _mx_params(MX_PAIRWISE, fake=False))
def test_mx_quantize_matches_reference(fmt, mode, a):
    _check_mx_case(fmt, mode, a, fake_only=False)


@pytest.mark.parametrize("fmt,mode,a", _mx_params(MX_PAIRWISE, fake=True))
def test_mx_fake_quantize_matches_reference(fmt, mode, a):
    _check_mx_case(fmt, mode, a, fake_only=True)


@pytest.mark.parametrize("fmt,mode,a", _mx_params(MX_FULL, fake=False, slow=True))
def test_mx_quantize_matches_reference_full(fmt, mode, a):
    _check_mx_case(fmt, mode, a, fake_only=False)


@pytest.mark.parametrize("fmt,mode,a", _mx_params(MX_FULL, fake=True, slow=True))
def test_mx_fake_quantize_matches_reference_full(fmt, mode, a):
    _check_mx_case(fmt, mode, a, fake_only=True)


def test_mxint8_fake_quantize_small_negative_is_positive_zero():
    """x[0, 1] / 2**e = -2**-10 rounds to 0, and INT8 code 0 is +0.0 (no -0 in INT8)."""
    x = np.zeros((BASE_ROWS, 32), np.float32)
    x[0, :2] = [1.0, -(2.0**-10)]
    _, y, fake = run_quantizer(x, "mxint8")
    assert np.asarray(y)[0, 1].view(np.uint32) == 0  # the round trip gives +0.0
    assert np.asarray(fake)[0, 1].view(np.uint32) == 0


def assert_amax_outside_nonfinite_blocks(x, axis, block_shape=None):
    """Precondition for NVFP4 inputs with Inf blocks (see
    test_nvfp4_tensor_amax_keeps_finite_values_of_a_nan_block): the tensor's largest finite
    magnitude is not in a block that holds Inf."""
    b = ref.to_blocks(x, axis, block_shape, ref.NVFP4_BLOCK)
    finite_blocks = np.all(np.isfinite(b), axis=-1)
    assert np.max(np.abs(b[finite_blocks])) == np.max(np.abs(x[np.isfinite(x)]))


NVFP4_AMAX = {"own": None, "amax/4": 0.25, "amax*4": 4.0}  # factor times the true amax


def _check_nvfp4_case(a, amax_id, fake_only):
    shape, axis = AXIS_CASES[a]
    x = case_inputs(a, 16)
    factor = NVFP4_AMAX[amax_id]
    finite = np.isfinite(x)
    true_amax = np.max(np.abs(x[finite]))
    tensor_amax = None if factor is None else float(np.float32(factor * true_amax))
    expected = ref.nvfp4_quantize(x, axis, tensor_amax=tensor_amax)
    assert_normal_or_zero(expected.values)
    assert_amax_outside_nonfinite_blocks(x, axis)
    q, y, fake = run_quantizer(x, "nvfp4", None, axis, tensor_amax=tensor_amax)
    what = f"nvfp4 {AXIS_IDS[a]} tensor_amax={amax_id}"
    if fake_only:
        assert_bits_equal(fake, expected.values, f"{what}: fake_quantize", x)
        return
    check_qarray(q, y, expected, x, what)
    check_planted_specials(q, y, x, axis, UE4M3_NAN)


NVFP4_PAIRWISE = [(a, list(NVFP4_AMAX)[a % 3]) for a in range(len(AXIS_CASES))]
NVFP4_FULL = [(a, t) for a in range(len(AXIS_CASES)) for t in NVFP4_AMAX]


def _nv_params(cases, slow=False):
    marks = [pytest.mark.slow] if slow else []
    return [pytest.param(a, t, marks=marks, id=f"{AXIS_IDS[a]}-{t}") for a, t in cases]


@pytest.mark.parametrize("a,amax_id", _nv_params(NVFP4_PAIRWISE))
def test_nvfp4_quantize_matches_reference(a, amax_id):
    _check_nvfp4_case(a, amax_id, fake_only=False)


@pytest.mark.parametrize("a,amax_id", _nv_params(NVFP4_PAIRWISE))
def test_nvfp4_fake_quantize_matches_reference(a, amax_id):
    _check_nvfp4_case(a, amax_id, fake_only=True)


@pytest.mark.parametrize("a,amax_id", _nv_params(NVFP4_FULL, slow=True))
def test_nvfp4_matches_reference_full(a, amax_id):
    _check_nvfp4_case(a, amax_id, fake_only=False)
    _check_nvfp4_case(a, amax_id, fake_only=True)


# Arbitrary finite float32 blocks (normal magnitudes up to 2**127, or zero: MX results are then
# normal floats or zero), placed in the (24, 32) default-mode programs compiled above.
_magnitudes = st.floats(F32_MIN_NORMAL, 2.0**127, width=32) | st.just(0.0)
_signed = st.tuples(_magnitudes, st.booleans()).map(lambda t: -t[0] if t[1] else t[0])


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
    q, y, fake = run_quantizer(x, fmt)
    check_qarray(q, y, expected, x, f"{fmt} hypothesis")
    assert_bits_equal(fake, expected.values, f"{fmt} hypothesis fake_quantize", x)


# --------------------------------------------------------------------------------------------
# Zero blocks, tiny inputs, NaN and Inf (beyond the blocks planted in the random inputs)


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_zero_nan_inf_blocks(fmt):
    """Row 0 all zero (byte 0, +0.0); a NaN, a +Inf and a -Inf block (byte 0xFF, NaN); the
    other blocks as the reference. Row 4 holds a small negative value that rounds to -0.0."""
    x = np.random.default_rng(4).standard_normal((BASE_ROWS, 32)).astype(np.float32)
    x[0] = 0.0
    x[1, 5], x[2, 31], x[3, 0] = np.nan, np.inf, -np.inf
    x[4, 1] = -(2.0**-12)
    q, y, fake = run_quantizer(x, fmt)
    assert np.asarray(q.scales)[:4, 0].tolist() == [0, E8M0_NAN, E8M0_NAN, E8M0_NAN]
    y = np.asarray(y)
    assert np.all(np.isnan(y[1:4])) and not np.any(np.isnan(y[4:]))
    assert np.all(y[0].view(np.uint32) == 0)
    expected = ref.mx_quantize(x, fmt)
    check_qarray(q, y, expected, x, f"{fmt} special blocks")
    assert_bits_equal(fake, expected.values, f"{fmt} fake_quantize special blocks", x)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4"])
def test_nan_block_in_a_larger_tensor(fmt):
    """As test_mx_zero_nan_inf_blocks, in a (256, 32) tensor: the NaN block's scale byte is
    the NaN code and it dequantizes to NaN; the other blocks are the reference's."""
    x = np.random.default_rng(12).standard_normal((256, 32)).astype(np.float32)
    x[1, 2] = np.nan
    q, y, fake = run_quantizer(x, fmt)
    block = lb.formats.get(fmt).block_size
    nan_byte = E8M0_NAN if fmt != "nvfp4" else UE4M3_NAN
    assert np.asarray(q.scales)[1, 0] == nan_byte
    assert np.all(np.isnan(np.asarray(y)[1, :block]))
    assert np.all(np.isnan(np.asarray(fake)[1, :block]))
    expected = ref.nvfp4_quantize(x) if fmt == "nvfp4" else ref.mx_quantize(x, fmt)
    check_qarray(q, y, expected, x, f"{fmt} NaN block, (256, 32)")


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "nvfp4"])
def test_block_max_and_nan_at_every_position_of_a_block(fmt):
    """Row p has its largest magnitude (negative on odd rows) at position p, and row block + p
    a NaN there: the block maximum is found wherever it lies (the reduction runs as maxima of
    halves, then over the last few lanes), and every NaN row gets the NaN scale byte."""
    block = lb.formats.get(fmt).block_size
    rng = np.random.default_rng(21)
    x = rng.uniform(-1.0, 1.0, (2 * block, block)).astype(np.float32)
    for p in range(block):
        x[p, p] = 3.0 * (-1) ** p
        x[block + p, p] = np.nan
    q, y, fake = run_quantizer(x, fmt)
    nan_byte = E8M0_NAN if fmt != "nvfp4" else UE4M3_NAN
    scales = np.asarray(q.scales)[:, 0]
    assert np.all(scales[block:] == nan_byte) and np.all(scales[:block] != nan_byte)
    assert np.all(np.isnan(np.asarray(y)[block:])) and not np.any(np.isnan(np.asarray(y)[:block]))
    finite = x[:block]
    expected = ref.nvfp4_quantize(finite) if fmt == "nvfp4" else ref.mx_quantize(finite, fmt)
    q, y, fake = run_quantizer(finite, fmt)
    check_qarray(q, y, expected, finite, f"{fmt} block max at every position")


@pytest.mark.parametrize("fmt", [*MX_FORMATS, "nvfp4"])
def test_all_zero_tensor(fmt):
    x = np.zeros((BASE_ROWS, 32 if fmt != "nvfp4" else 16), np.float32)
    q, y, fake = run_quantizer(x, fmt)
    assert np.all(np.asarray(q.scales) == 0)
    assert np.all(np.asarray(y).view(np.uint32) == 0)  # +0.0, no 0/0 NaN
    assert np.all(np.asarray(fake).view(np.uint32) == 0)
    if fmt == "nvfp4":
        assert float(q.tensor_scale) == 0.0


def test_nvfp4_mixed_nan_inf_zero_blocks():
    """A NaN, a +Inf and a -Inf block get the NaN scale byte and NaN values; the zero block
    byte 0 and +0.0; the tensor amax (50) comes from the finite values only."""
    x = np.random.default_rng(5).standard_normal((BASE_ROWS, 16)).astype(np.float32)
    x[0] = 0.0
    x[1, 5], x[2, 15], x[3, 0] = np.nan, np.inf, -np.inf
    x[4, 0] = 50.0
    q, y, fake = run_quantizer(x, "nvfp4")
    assert np.asarray(q.scales)[:4, 0].tolist() == [0, UE4M3_NAN, UE4M3_NAN, UE4M3_NAN]
    assert_bits_equal(np.asarray(q.tensor_scale), np.float32(50) / np.float32(2688), "t")
    assert np.all(np.isnan(np.asarray(y)[1:4]))
    assert np.all(np.asarray(y)[0].view(np.uint32) == 0)
    expected = ref.nvfp4_quantize(x)
    check_qarray(q, y, expected, x, "nvfp4 special blocks")
    assert_bits_equal(fake, expected.values, "nvfp4 fake_quantize special blocks", x)


def test_nvfp4_tensor_amax_keeps_finite_values_of_a_nan_block():
    """The tensor amax ignores non-finite values, not the finite values next to them."""
    x = np.random.default_rng(6).standard_normal((BASE_ROWS, 16)).astype(np.float32)
    x[0, 0] = np.nan
    x[0, 1] = 100.0  # the largest finite magnitude, in the same block as the NaN
    expected = ref.nvfp4_quantize(x)
    assert expected.tensor_scale == np.float32(100) / np.float32(2688)
    q, y, _ = run_quantizer(x, "nvfp4")
    check_qarray(q, y, expected, x, "nvfp4 NaN block holding the amax")


@pytest.mark.parametrize("fmt", [*MX_FORMATS, "nvfp4"])
def test_tensor_of_values_near_1e_minus_30(fmt):
    """Every block ~1e-30 (the random-input tests hold a 1e-30 line next to O(1) lines):
    results are normal floats, so exact on every backend; for NVFP4 t ~ 4e-34 and s*t are
    normal too."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((BASE_ROWS, 32 if fmt != "nvfp4" else 16)) * 1e-30
    x = x.astype(np.float32)
    expected = ref.nvfp4_quantize(x) if fmt == "nvfp4" else ref.mx_quantize(x, fmt)
    assert_normal_or_zero(expected.values)
    assert np.all(np.isfinite(expected.values)) and np.any(expected.values != 0)
    q, y, fake = run_quantizer(x, fmt)
    check_qarray(q, y, expected, x, f"{fmt} 1e-30")
    assert_bits_equal(fake, expected.values, f"{fmt} fake_quantize 1e-30", x)


# Floor-mode scale byte for a block whose amax is exactly 2**-120: e = -120 - emax, >= -127.
SCALE_BYTE_AT_2_POW_MINUS_120 = {
    "mxfp8_e4m3": 0,
    "mxfp8_e5m2": 0,
    "mxfp6_e3m2": 3,
    "mxfp6_e2m3": 5,
    "mxfp4": 5,
    "mxint8": 7,
}


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_block_amax_near_2_pow_minus_120(fmt):
    """Blocks of normal floats in [2**-126, 2**-120]: the scale is 2**-127 (E4M3, E5M2) or
    near it, a float32 subnormal that XLA on CPU flushes to zero, so it must never be a
    factor. With normal inputs every MX result is a normal float or zero (an element of
    x / 2**e is >= 2 when e = -127): exact, never NaN."""
    rng = np.random.default_rng(8)
    mag = 2.0 ** rng.uniform(-126, -120, (BASE_ROWS, 32))
    x = (mag * rng.choice([-1.0, 1.0], mag.shape)).astype(np.float32)
    x[:, 0] = 2.0**-120
    x[::2, 0] *= -1
    assert_normal_or_zero(x)
    expected = ref.mx_quantize(x, fmt)
    assert_normal_or_zero(expected.values)
    q, y, fake = run_quantizer(x, fmt)
    assert np.all(np.asarray(q.scales) == SCALE_BYTE_AT_2_POW_MINUS_120[fmt])
    check_qarray(q, y, expected, x, f"{fmt} amax 2**-120")
    assert_bits_equal(fake, expected.values, f"{fmt} fake_quantize amax 2**-120", x)


def test_nvfp4_tensor_amax_near_2_pow_minus_120():
    """t = 2**-120 / 2688 is a float32 subnormal: flushed on CPU (all zeros), kept elsewhere
    (the reference). Either way no NaN, and each value is the reference's or zero."""
    rng = np.random.default_rng(9)
    x = 2.0 ** rng.uniform(-126, -120, (BASE_ROWS, 16)) * rng.choice([-1.0, 1.0], (BASE_ROWS, 16))
    x = x.astype(np.float32)
    x[0, 0] = 2.0**-120
    expected = ref.nvfp4_quantize(x).values
    q, y, fake = run_quantizer(x, "nvfp4")
    for got in [np.asarray(y), np.asarray(fake)]:
        assert not np.any(np.isnan(got))
        assert np.all((got == expected) | (got == 0))


# --------------------------------------------------------------------------------------------
# 2-D tiles: each tile is one block (its values flattened)

TILE_CASES = [((40, 70), -1), ((40, 3, 50), (2, 0))]
TILE_IDS = ["40x70", "40x3x50-axes2,0"]
TILES = [(16, 16), (32, 32)]
TILE_FORMATS = [*MX_FORMATS, "nvfp4"]


def _tile_params(full: bool):
    out = []
    for f, fmt in enumerate(TILE_FORMATS):
        for c in range(len(TILE_CASES)):
            tiles = range(len(TILES)) if full else [(f + c) % 2]
            for t in tiles:
                mode = None if fmt == "nvfp4" else SCALE_MODES[(f + 2 * c + t) % 4]
                marks = [pytest.mark.slow] if full else []
                tid = f"{fmt}-{mode}-{TILES[t][0]}x{TILES[t][1]}-{TILE_IDS[c]}"
                out.append(pytest.param(fmt, mode, t, c, marks=marks, id=tid))
    return out


def _check_tiles(fmt, mode, t, c):
    shape, axis = TILE_CASES[c]
    tile = TILES[t]
    # The planted zero run and +-Inf values land in some tiles: those must be zero / NaN.
    x = mixed_inputs(shape, -1, seed=10 + c, spread=4 if fmt == "nvfp4" else 20, block=16)
    # The tensor's largest magnitude, far from the Inf values (which sit in the first rows).
    x.reshape(-1)[-1] = 2 * np.max(np.abs(x[np.isfinite(x)]))
    if fmt == "nvfp4":
        assert_amax_outside_nonfinite_blocks(x, axis, tile)
        expected = ref.nvfp4_quantize(x, axis, block_shape=tile)
    else:
        expected = ref.mx_quantize(x, fmt, axis, mode, block_shape=tile)
    assert_normal_or_zero(expected.values)
    q, y, fake = run_quantizer(x, fmt, mode, axis, block_shape=tile)
    assert q.block_shape == tile
    what = f"{fmt} {mode} tile {tile} axis={axis}"
    check_qarray(q, y, expected, x, what)
    assert_bits_equal(fake, expected.values, f"{what}: fake_quantize", x)


@pytest.mark.parametrize("fmt,mode,t,c", _tile_params(full=False))
def test_2d_tiles_match_reference_on_flattened_tiles(fmt, mode, t, c):
    _check_tiles(fmt, mode, t, c)


@pytest.mark.parametrize("fmt,mode,t,c", _tile_params(full=True))
def test_2d_tiles_match_reference_full(fmt, mode, t, c):
    _check_tiles(fmt, mode, t, c)


def test_2d_tile_nan_block():
    """A NaN in one 16x16 tile: that tile's scale is NaN and dequantizes to NaN; the others
    are the reference's."""
    x = np.random.default_rng(11).standard_normal((40, 70)).astype(np.float32)
    x[20, 40] = np.nan
    q, y, fake = run_quantizer(x, "mxfp8_e4m3", None, -1, block_shape=(16, 16))
    scales = np.asarray(q.scales)
    assert scales.shape == (3, 5)
    assert scales[1, 2] == E8M0_NAN and np.sum(scales == E8M0_NAN) == 1
    assert np.all(np.isnan(np.asarray(y)[16:32, 32:48]))
    expected = ref.mx_quantize(x, "mxfp8_e4m3", block_shape=(16, 16))
    check_qarray(q, y, expected, x, "mxfp8 16x16 tile with NaN")
    assert_bits_equal(fake, expected.values, "mxfp8 16x16 tile with NaN: fake_quantize", x)
