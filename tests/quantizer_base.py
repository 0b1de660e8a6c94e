"""The quantizer spec tests, written once and run for every implementation.

``QuantizerSpec`` holds the tests; each subclass (tests/test_quantizer_xla.py,
tests/test_quantizer_native.py, tests/test_quantizer_pallas.py) says how its implementation
quantizes (hooks) and what it can serve (capability attributes). The oracles:
tests/reference.py (an independent NumPy implementation of DESIGN.md "Numerics": values,
element codes, scale codes, the NVFP4 tensor scale) and hand-derived vectors (ties, saturation,
block-scale ties, special-value blocks). Comparisons are on float32 bit patterns (-0.0 != +0.0),
NaN matching NaN.

Paths: an implementation with a packed output (``quantize_fn``) is checked on its QArray
(scale bytes, element codes decoded with the reference's code table, tensor scale) and on
``lb.dequantize`` of it; one with a ``fake_quantize_fn`` on those values. Every test checks every
path the implementation has, so each test can fail for each implementation.

Capabilities: a test is parametrized from the implementation's class attributes (formats,
which (shape, axis) cases it takes, features such as 2-D tiles), in the class's
``pytest_generate_tests``. A test it cannot serve at all is generated once, skipped, with the
reason the subclass gives.

XLA on CPU flushes float32 subnormals to zero: inputs are chosen so that every expected result
is a normal float or zero (asserted as a precondition). The FTZ-sensitive cases -- all-zero
blocks and blocks with amax near 2**-120, whose E8M0 scale 2**-127 is a float32 subnormal, and
inputs near 1e-30 -- still have normal results and are exact; an NVFP4 tensor scale below
2**-126 is tested only for what holds with or without flushing.

Speed: each configuration is one program per implementation (quantize + dequantize +
fake_quantize as the implementation has them), traced, checked (``check_program``: it really
runs this implementation), compiled once and shared by every test with the same configuration
and shape (``QuantizerSpec.program``, cached per class). Random inputs cover every pair of (MX
format, scale mode, axis case) the implementation takes, not the product; the products run
with ``pytest -m slow``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowbit as lb
from tests import reference as ref

MX_FORMATS = ref.MX_FORMATS
ALL_FORMATS = (*MX_FORMATS, "nvfp4")
SCALE_MODES = ref.SCALE_MODES
F32_MIN_NORMAL = float(np.finfo(np.float32).smallest_normal)
E8M0_NAN, UE4M3_NAN = ref.E8M0_NAN, ref.UE4M3_NAN
BASE_ROWS = 24  # the hand-vector tests: (24, 32) MX, (24, 16) NVFP4, one program per format
KEY = jax.random.key_data(jax.random.key(7))

# --------------------------------------------------------------------------------------------
# Assertions


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


def reference(x, fmt, mode=None, axis=-1, block_shape=None, tensor_amax=None) -> ref.Quantized:
    if fmt == "nvfp4":
        return ref.nvfp4_quantize(x, axis, tensor_amax=tensor_amax, block_shape=block_shape)
    return ref.mx_quantize(x, fmt, axis, mode or "floor", block_shape=block_shape)


def ref_elem(fmt: str) -> ref.Elem:
    return ref.ELEMS["e2m1" if fmt == "nvfp4" else ref.MX_ELEM[fmt]]


def nan_byte(fmt: str) -> int:
    return UE4M3_NAN if fmt == "nvfp4" else E8M0_NAN


def block_size(fmt: str) -> int:
    return ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MX_BLOCK


# --------------------------------------------------------------------------------------------
# Inputs

# Where mixed_inputs plants +-Inf, as (line, column) of the moved layout (the quantized axis
# last, other axes flattened in order). Line 0's first block is all zero. (NaN has its own
# tests: test_mx_zero_nan_inf_blocks, test_nan_block_in_a_larger_tensor.)
SPECIALS = [(np.inf, 1, 2), (-np.inf, 2, -1), (np.inf, 4, 0)]
TINY_LINE = 5  # scaled by 2**-100 (about 7.9e-31)


def mixed_inputs(shape, axis, seed, spread, block):
    """float32 x whose lines along ``axis`` each hold one distribution: standard normal,
    student-t (2 degrees of freedom) or normal with 4% outliers of 1e2..1e4, each line scaled
    by 2**k (|k| <= spread); plus a zero block, +Inf and -Inf blocks (in unscaled normal
    lines, which never hold the tensor's largest magnitude) and a line near 1e-30, where x
    has those lines (SPECIALS, TINY_LINE)."""
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
    special_lines = [line for line in [0] + [s[1] for s in SPECIALS] if line < rows]
    x[special_lines] = normal[special_lines]
    x[0, :block] = 0.0
    for value, line, col in SPECIALS:
        if line < rows:
            x[line, col] = value
    if TINY_LINE < rows:
        x[TINY_LINE] = normal[TINY_LINE] * 2.0**-100
    return np.ascontiguousarray(np.moveaxis(x.astype(np.float32).reshape(moved), -1, axis))


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


def assert_amax_outside_nonfinite_blocks(x, axis, block_shape=None):
    """Precondition for NVFP4 inputs with Inf blocks (see
    test_nvfp4_tensor_amax_keeps_finite_values_of_a_nan_block): the tensor's largest finite
    magnitude is not in a block that holds Inf."""
    b = ref.to_blocks(x, axis, block_shape, ref.NVFP4_BLOCK)
    finite_blocks = np.all(np.isfinite(b), axis=-1)
    assert np.max(np.abs(b[finite_blocks])) == np.max(np.abs(x[np.isfinite(x)]))


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


def tie_vectors(name):
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


# Block scale s_raw = amax_b / 6 at an E4M3 tie -> the even neighbour (as in TIES["e4m3"]),
# and s_raw above 448 -> 448 (NVFP4 with t = 1).
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

# Two NVFP4 tensors from a training step (tiny GPT, nvfp4 recipe: a (16, 64, 256) activation
# and a (16, 64, 64) one), reduced to the block that went wrong and the tensor's amax. XLA
# rewrote (amax / 6) / t into amax / (6 * t) (s_raw 184.0 instead of 183.99998, an E4M3 tie:
# s = 192 instead of 176) and 1 / (tamax / 2688) into 2688 / tamax (r 1 ulp high, x * r =
# 3.5000002 instead of 3.4999998: E2M1 4 instead of 3). Found by the native kernel's check.
# fmt: off
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
# fmt: on


def nvfp4_training_rows() -> np.ndarray:
    """NVFP4_TRAINING_BLOCKS as rows of two blocks (the block, then its tensor's amax)."""
    rows = np.zeros((len(NVFP4_TRAINING_BLOCKS), 32), np.float32)
    for i, (block, tamax) in enumerate(NVFP4_TRAINING_BLOCKS):
        rows[i, :16], rows[i, 16] = block, tamax
    return rows


def nvfp4_division_sensitive_rows(n: int = 48, seed: int = 0, tamax=None) -> np.ndarray:
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


def nvfp4_reciprocal_sensitive_matrix(n: int = 16, seed: int = 0) -> np.ndarray:
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


# --------------------------------------------------------------------------------------------
# Test parameters, built from an implementation's capabilities


def pairwise(fmts, modes, cases):
    """(fmt, mode, case) rows covering every pair of (fmt, mode), (fmt, case) and (mode,
    case): the two larger factors as a product, the third chosen by (i + j) modulo its length
    (which covers its pairs when the product's factors are at least as long)."""
    if len(cases) >= len(modes):
        rows = [
            (f, modes[(i + j) % len(modes)], c)
            for i, f in enumerate(fmts)
            for j, c in enumerate(cases)
        ]
    else:
        rows = [
            (f, m, cases[(i + j) % len(cases)])
            for i, f in enumerate(fmts)
            for j, m in enumerate(modes)
        ]
    for a, b in itertools.combinations(range(3), 2):
        want = {(u, v) for u in ([fmts, modes, cases][a]) for v in ([fmts, modes, cases][b])}
        assert {(r[a], r[b]) for r in rows} == want, "pairwise rows miss a pair"
    return rows


class Unsupported(str):
    """Why an implementation cannot serve a test (its one generated case is skipped)."""


def cases(argnames: str, make):
    """Parametrize a spec test from its implementation: ``make(spec)`` returns the
    ``pytest.param``s (or values) for ``argnames``, or an :class:`Unsupported` reason."""

    def deco(fn):
        fn.spec_cases = (argnames, make)
        return fn

    return deco


def _p(*values, id, slow=False):
    return pytest.param(*values, id=id, marks=[pytest.mark.slow] if slow else [])


# --------------------------------------------------------------------------------------------


class Outputs:
    """What one implementation produced for one input: ``qarray`` and ``dequantized``
    (``lb.dequantize(qarray)``) for a packed path, ``fake`` for a fake_quantize path (None
    where it has none). ``values`` lists the value arrays, named."""

    def __init__(self, qarray, dequantized, fake):
        self.qarray = qarray
        self.dequantized = None if dequantized is None else np.asarray(dequantized)
        self.fake = None if fake is None else np.asarray(fake)

    @property
    def values(self) -> list[tuple[str, np.ndarray]]:
        out = [("dequantize", self.dequantized), ("fake_quantize", self.fake)]
        return [(n, v) for n, v in out if v is not None]

    @property
    def scales(self) -> np.ndarray | None:
        return None if self.qarray is None else np.asarray(self.qarray.scales)


class QuantizerSpec:
    """Spec tests of a block quantizer; subclasses provide the hooks and capabilities.

    Hooks (each returns a traceable function ``(x, key, tensor_amax) -> ...``, ``key`` uint32[2]
    key data or None, ``tensor_amax`` a float32 scalar or None): :meth:`quantize_fn` (a
    QArray; None if the implementation has no packed output) and :meth:`fake_quantize_fn`
    (values; None if it has none). :meth:`trace_context` is entered while tracing and
    lowering; :meth:`check_program` asserts the traced program runs this implementation.

    Capabilities: ``formats``; :meth:`takes` (which (shape, axis) cases); ``tiles``,
    ``custom_blocks``, ``stochastic_vs_xla``, ``large_shape``: True/a value where served, an
    :class:`Unsupported` reason where not.
    """

    name = "abstract"
    formats = ALL_FORMATS
    tiles: bool | Unsupported = True
    custom_blocks: bool | Unsupported = True  # 1-D blocks other than the format's own
    stochastic_vs_xla: bool | Unsupported = True  # stochastic rounding bit-identical to XLA
    large_shape: tuple[int, int] | Unsupported = Unsupported("no size-dependent code path")

    # --- hooks ------------------------------------------------------------------------------

    def quantize_fn(self, fmt, scale_mode, axis, block_shape, rounding):
        return None

    def fake_quantize_fn(self, fmt, scale_mode, axis, block_shape, rounding):
        return None

    @staticmethod
    def lowbit_entry(fn, fmt, scale_mode, axis, block_shape, rounding):
        """``fn`` (``lb.quantize`` or ``lb.fake_quantize``) with this configuration bound:
        ``(x, key, tensor_amax) -> result`` (the hooks of the lowbit-backed subclasses)."""

        def call(x, key, tensor_amax):
            return fn(
                x,
                fmt,
                axis,
                scale_mode=scale_mode,
                block_shape=block_shape,
                rounding=rounding,
                key=key,
                tensor_amax=tensor_amax,
            )

        return call

    def trace_context(self):
        return contextlib.nullcontext()

    def check_program(self, jaxpr: str, hlo: str) -> None:
        raise NotImplementedError

    def takes(self, shape, axis) -> bool:
        """Whether this implementation quantizes ``shape`` along ``axis`` (1-D blocks)."""
        return True

    # --- programs ---------------------------------------------------------------------------

    @classmethod
    @functools.cache
    def program(cls, fmt, mode, axis, block_shape, shape, dtype, rounding, with_amax):
        """The compiled ``(x, key, tensor_amax) -> (QArray, dequantized, fake)`` of one
        configuration (None for a path the implementation lacks), traced afresh (a new
        function: JAX reuses a function's trace, and the compiled CPU kernel is chosen when
        tracing) inside :meth:`trace_context` and checked by :meth:`check_program`."""
        self = cls()
        q_fn = self.quantize_fn(fmt, mode, axis, block_shape, rounding)
        f_fn = self.fake_quantize_fn(fmt, mode, axis, block_shape, rounding)
        assert q_fn is not None or f_fn is not None, f"{cls.__name__} has no path"

        def run(x, key, tensor_amax):
            q = None if q_fn is None else q_fn(x, key, tensor_amax)
            y = None if q is None else lb.dequantize(q)
            fake = None if f_fn is None else f_fn(x, key, tensor_amax)
            return q, y, fake

        key_spec = jax.ShapeDtypeStruct((2,), jnp.uint32) if rounding == "stochastic" else None
        amax_spec = jax.ShapeDtypeStruct((), jnp.float32) if with_amax else None
        with self.trace_context():
            traced = jax.jit(run).trace(jax.ShapeDtypeStruct(shape, dtype), key_spec, amax_spec)
            lowered = traced.lower()
        self.check_program(str(traced.jaxpr), lowered.as_text())
        return lowered.compile()

    def run(
        self,
        x,
        fmt,
        mode=None,
        axis=-1,
        block_shape=None,
        tensor_amax=None,
        rounding="nearest",
        key=None,
        dtype=jnp.float32,
    ) -> Outputs:
        x = jnp.asarray(x, dtype)
        shape = tuple(x.shape)
        if isinstance(axis, list):
            axis = tuple(axis)
        fn = type(self).program(
            fmt, mode, axis, block_shape, shape, jnp.dtype(dtype), rounding, tensor_amax is not None
        )
        t = None if tensor_amax is None else jnp.float32(tensor_amax)
        k = None if rounding == "nearest" else (KEY if key is None else key)
        return Outputs(*fn(x, k, t))

    # --- checks -----------------------------------------------------------------------------

    def check(self, out: Outputs, expected: ref.Quantized, x, what: str, fmt: str):
        """Every path against the reference: values bit for bit; for a QArray also its scale
        bytes, its element codes (decoded with the reference's code table) and the tensor
        scale."""
        what = f"{self.name} {what}"
        for name, v in out.values:
            assert_bits_equal(v, expected.values, f"{what}: {name}", x)
        q = out.qarray
        if q is None:
            return
        assert isinstance(q, lb.QArray) and q.shape == np.shape(x), f"{what}: {q!r}"
        assert_codes_equal(q.scales, expected.scale_codes, f"{what}: scale bytes")
        elem = ref_elem(fmt)
        codes = ref.unpack_codes(q.codes, elem.bits)
        assert codes.shape == expected.elems.shape, f"{what}: unpacked codes {codes.shape}"
        decoded = ref.code_values(elem)[codes]
        live = ~np.isnan(expected.elems)  # element codes of a NaN/Inf block are unspecified
        assert_bits_equal(
            np.where(live, decoded, 0.0).astype(np.float32),
            np.where(live, expected.elems, 0.0),
            f"{what}: element codes",
        )
        if expected.tensor_scale is not None:
            assert_bits_equal(np.asarray(q.tensor_scale), expected.tensor_scale, f"{what}: t")
        else:
            assert q.tensor_scale is None, f"{what}: an MX QArray with a tensor scale"

    def check_values(self, out: Outputs, expected, x, what: str):
        """Every value path against hand-derived expected values."""
        assert out.values, f"{self.name}: no value path"
        for name, v in out.values:
            assert_bits_equal(v, expected, f"{self.name} {what}: {name}", x)

    def check_planted_specials(self, out: Outputs, x, axis, fmt):
        """Hand checks of mixed_inputs' planted blocks: NaN values (and the NaN scale byte)
        for the Inf blocks, +0.0 (byte 0) for the zero block; for NVFP4 the 1e-30 line is all
        +0.0 (its block scales round to 0 next to the O(1) lines)."""
        ax = axis % x.ndim
        block = block_size(fmt)
        scales = out.scales
        for name, y in out.values:
            ym = np.moveaxis(y, ax, -1)
            ym = ym.reshape(-1, ym.shape[-1])
            n = ym.shape[1]
            for _, line, col in SPECIALS:
                b = (col % n) // block
                assert np.all(np.isnan(ym[line, b * block : (b + 1) * block])), name
            assert np.all(ym[0, :block].view(np.uint32) == 0), name
            assert not np.any(np.isnan(ym[[0, 3, TINY_LINE]])), name
            if fmt == "nvfp4":
                assert np.all(ym[TINY_LINE].view(np.uint32) == 0), name
        if scales is not None:
            scales = scales.reshape(-1, scales.shape[-1])
            n = np.moveaxis(np.asarray(x), ax, -1).shape[-1]
            for _, line, col in SPECIALS:
                assert scales[line, (col % n) // block] == nan_byte(fmt)
            assert scales[0, 0] == 0
            if fmt == "nvfp4":
                assert np.all(scales[TINY_LINE] == 0)

    # --- parametrization --------------------------------------------------------------------

    def pytest_generate_tests(self, metafunc):
        spec_cases = getattr(metafunc.function, "spec_cases", None)
        if spec_cases is None:
            return
        argnames, make = spec_cases
        params = make(self)
        if isinstance(params, Unsupported) or not params:
            reason = f"{self.name}: {params or 'no case it serves'}"
            n = len(argnames.split(","))
            values = (None,) * n
            marks = [pytest.mark.skip(reason=reason)]
            if metafunc.function.__name__.endswith("_full"):  # as its cases would be
                marks.append(pytest.mark.slow)
            params = [pytest.param(*values, marks=marks, id="n/a")]
        metafunc.parametrize(argnames, params)

    def mx_formats(self):
        return [f for f in MX_FORMATS if f in self.formats]

    def any_formats(self, names=ALL_FORMATS):
        return [f for f in ALL_FORMATS if f in self.formats and f in names]

    def nvfp4(self, values):
        return values if "nvfp4" in self.formats else Unsupported("no nvfp4")

    def axis_cases(self):
        return [i for i, (s, a) in enumerate(AXIS_CASES) if self.takes(s, a)]

    def mx_random_params(self, full=False):
        fmts, taken = self.mx_formats(), self.axis_cases()
        if full:
            rows = list(itertools.product(fmts, SCALE_MODES, taken))
        else:
            rows = pairwise(fmts, SCALE_MODES, taken)
        return [_p(f, m, a, id=f"{f}-{m}-{AXIS_IDS[a]}", slow=full) for f, m, a in rows]

    def nvfp4_random_params(self, full=False):
        taken, amax_ids = self.axis_cases(), list(NVFP4_AMAX)
        if full:
            rows = list(itertools.product(taken, amax_ids))
        else:  # every axis case once, every amax choice (the calibrated ones first)
            rows = [(a, amax_ids[(i + 1) % 3]) for i, a in enumerate(taken)]
        return self.nvfp4([_p(a, t, id=f"{AXIS_IDS[a]}-{t}", slow=full) for a, t in rows])

    def tile_params(self, full=False):
        if isinstance(self.tiles, Unsupported):
            return self.tiles
        out = []
        for f, fmt in enumerate(self.any_formats()):
            for c in range(len(TILE_CASES)):
                for t in range(len(TILES)) if full else [(f + c) % len(TILES)]:
                    mode = None if fmt == "nvfp4" else SCALE_MODES[(f + 2 * c + t) % 4]
                    tid = f"{fmt}-{mode}-{TILES[t][0]}x{TILES[t][1]}-{TILE_IDS[c]}"
                    out.append(_p(fmt, mode, t, c, id=tid, slow=full))
        return out

    def custom_block_params(self):
        if isinstance(self.custom_blocks, Unsupported):
            return self.custom_blocks
        return [
            _p(fmt, c, id=f"{fmt}-{CUSTOM_BLOCK_IDS[c]}")
            for c, fmt in enumerate(CUSTOM_BLOCK_FORMATS)
            if self.takes(*CUSTOM_BLOCK_CASES[c][:2]) and fmt in self.formats
        ]

    def near_max_params(self):
        """Each MX format in floor mode (the largest exponent it reaches, 127 - emax), INT8 in
        the modes that ask for 2**128 and clamp to 2**127 (ceil, even, rceil), NVFP4."""
        rows = [(f, None) for f in self.mx_formats()]
        rows += [("mxint8", m) for m in ("ceil", "even", "rceil") if "mxint8" in self.formats]
        rows += [("nvfp4", None)] * ("nvfp4" in self.formats)
        return [_p(f, m, id=f"{f}-{m or 'default'}") for f, m in rows]

    def stochastic_params(self):
        if isinstance(self.stochastic_vs_xla, Unsupported):
            return self.stochastic_vs_xla
        taken = self.axis_cases()
        return [
            _p(fmt, taken[i % len(taken)], id=f"{fmt}-{AXIS_IDS[taken[i % len(taken)]]}")
            for i, fmt in enumerate(self.any_formats())
        ]

    # ========================================================================================
    # Ties and saturation, with the block scale pinned (one (24, 32) program per MX format,
    # default scale mode: floor; (24, 16) for NVFP4)

    @cases(
        "fmt,k", lambda s: [_p(f, k, id=f"{f}-2**{k}") for f in s.mx_formats() for k in (0, -7, 9)]
    )
    def test_mx_hand_derived_ties(self, fmt, k):
        name = ref.MX_ELEM[fmt]
        emax = ref.ELEMS[name].emax
        xs, ys = tie_vectors(name)
        # The anchor 2**emax puts floor(log2(amax)) at emax, so the block scale is exactly 2**k.
        x = (anchored_rows(xs, 2.0**emax, 32) * 2.0**k).astype(np.float32)
        expected = (anchored_rows(ys, 2.0**emax, 32) * 2.0**k).astype(np.float32)
        assert_normal_or_zero(expected)
        out = self.run(x, fmt)
        if out.scales is not None:
            used = np.any(x != 0, axis=1)
            assert np.all(out.scales[used] == 127 + k)
        self.check_values(out, expected, x, f"{fmt} ties, scale 2**{k}")

    @cases("fmt", lambda s: s.mx_formats())
    def test_mx_every_tie_rounds_to_even_code(self, fmt):
        """Every midpoint of adjacent grid values (from the reference's code enumeration)
        goes to the neighbour with the even code; a positive grid's codes ascend with its
        values."""
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
        out = self.run(x, fmt)
        if out.scales is not None:
            assert np.all(out.scales[np.any(x != 0, axis=1)] == 127)
        self.check_values(out, expected, x, f"{fmt} every tie")

    @cases(
        "fmt,k", lambda s: [_p(f, k, id=f"{f}-2**{k}") for f in s.mx_formats() for k in (0, -7, 9)]
    )
    def test_mx_saturates_to_max(self, fmt, k):
        name = ref.MX_ELEM[fmt]
        elem = ref.ELEMS[name]
        sat = np.array(SATURATING[name], np.float64)
        assert np.all((sat > elem.max) & (sat < 2.0 ** (elem.emax + 1)))
        xs = np.concatenate([sat, -sat, [elem.max, -elem.max]])
        ys = np.concatenate([np.full(sat.size, elem.max), np.full(sat.size, -elem.max)])
        ys = np.concatenate([ys, [elem.max, -elem.max]])
        x = (anchored_rows(xs, 2.0**elem.emax, 32) * 2.0**k).astype(np.float32)
        expected = (anchored_rows(ys, 2.0**elem.emax, 32) * 2.0**k).astype(np.float32)
        out = self.run(x, fmt)
        if out.scales is not None:
            assert np.all(out.scales[np.any(x != 0, axis=1)] == 127 + k)
        self.check_values(out, expected, x, f"{fmt} saturation, scale 2**{k}")

    def test_mxint8_small_negative_is_positive_zero(self):
        """x[0, 1] / 2**e = -2**-10 rounds to 0, and INT8 code 0 is +0.0 (no -0 in INT8)."""
        x = np.zeros((BASE_ROWS, 32), np.float32)
        x[0, :2] = [1.0, -(2.0**-10)]
        out = self.run(x, "mxint8")
        for name, y in out.values:
            assert y[0, 1].view(np.uint32) == 0, f"{name}: {y[0, 1]!r}"
        self.check(out, reference(x, "mxint8"), x, "mxint8 -0", "mxint8")

    # NVFP4 with tensor_amax = 2688 = 448 * 6, so that t = 1 exactly and s = RNE_e4m3(amax/6).

    @cases("s", lambda s: s.nvfp4([1.0, 4.0, 0.25]))
    def test_nvfp4_hand_derived_element_ties(self, s):
        xs, ys = tie_vectors("e2m1")
        # The anchor 6 * s makes amax_b / 6 / t = s, a value on the E4M3 grid.
        x = (anchored_rows(xs, 6.0, 16) * s).astype(np.float32)
        expected = (anchored_rows(ys, 6.0, 16) * s).astype(np.float32)
        out = self.run(x, "nvfp4", tensor_amax=2688.0)
        if out.qarray is not None:
            assert_bits_equal(np.asarray(out.qarray.tensor_scale), np.float32(1.0), "t")
            s_code = np.float32(s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            assert np.all(out.scales[np.any(x != 0, axis=1), 0] == s_code)
        self.check_values(out, expected, x, f"nvfp4 ties, s={s}")

    @cases("fmt", lambda s: s.any_formats(["nvfp4"]))
    def test_nvfp4_block_scale_ties_and_saturation(self, fmt):
        s_raw = np.array([a for a, _ in NVFP4_SCALE_TIES])
        rng = np.random.default_rng(3)
        x = np.zeros((BASE_ROWS, 16))
        x[: s_raw.size] = rng.uniform(-1, 1, (s_raw.size, 16)) * 6 * s_raw[:, None]
        x[: s_raw.size, 0] = 6 * s_raw  # the block amax: exact in float32, amax / 6 == s_raw
        x = x.astype(np.float32)
        out = self.run(x, "nvfp4", tensor_amax=2688.0)
        s_expected = np.float32([s for _, s in NVFP4_SCALE_TIES])
        if out.scales is not None:
            codes = s_expected.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            assert_codes_equal(out.scales[: s_raw.size, 0], codes, "nvfp4 block scale bytes")
        expected = reference(x, "nvfp4", tensor_amax=2688.0)
        assert_normal_or_zero(expected.values)
        assert np.all(expected.values[0] == 0)  # s rounds to 0: the block is zeros
        # the reference's block scales are the hand-derived ones
        assert_bits_equal(expected.scale[: s_raw.size, 0].astype(np.float32), s_expected)
        self.check(out, expected, x, "nvfp4 scale ties", "nvfp4")

    @cases("fmt", lambda s: s.any_formats(["nvfp4"]))
    def test_nvfp4_saturates_elements_when_block_scale_clips(self, fmt):
        # t = 1; s_raw = 6000 / 6 = 1000 -> s = 448, so x / 448 exceeds 6 for |x| > 2688;
        # 1568 / 448 = 3.5 is an E2M1 tie (3 or 4 -> 4), 100 / 448 < 0.25 -> 0.
        x = np.zeros((BASE_ROWS, 16), np.float32)
        x[0] = [6000, -3000, 2688, 2689, -2700, 100, 1568, 0] * 2
        expected = np.zeros_like(x)
        expected[0] = [2688, -2688, 2688, 2688, -2688, 0, 4 * 448, 0] * 2
        out = self.run(x, "nvfp4", tensor_amax=2688.0)
        if out.scales is not None:
            assert out.scales[0, 0] == 0x7E  # 448 = S.1111.110
        self.check_values(out, expected, x, "nvfp4 saturation")

    @cases("tensor_amax", lambda s: s.nvfp4([0.0, 0.5, 3.0, 1e6]))
    def test_nvfp4_calibrated_tensor_amax(self, tensor_amax):
        """A calibrated amax below the data's clips block scales at 448 (0.5, 3); far above
        it rounds them to small or zero E4M3 values (1e6); 0 makes t = 0: every block zero."""
        x = np.random.default_rng(13).standard_normal((BASE_ROWS, 16)).astype(np.float32)
        x[0] *= 40
        expected = reference(x, "nvfp4", tensor_amax=tensor_amax)
        assert_normal_or_zero(expected.values)
        if tensor_amax == 0:
            assert np.all(expected.values.view(np.uint32) == 0)
        out = self.run(x, "nvfp4", tensor_amax=tensor_amax)
        self.check(out, expected, x, f"nvfp4 tensor_amax={tensor_amax}", "nvfp4")

    @cases("fmt", lambda s: s.any_formats(["nvfp4"]))
    def test_nvfp4_divisions_are_not_reassociated(self, fmt):
        """Rows whose block scale crosses an E4M3 tie if (amax / 6) / t is reassociated (each
        its own tensor; then sharing one tensor amax), the training blocks where the XLA
        path did so, and a tensor whose 1 / t differs from 2688 / tamax with elements
        straddling E2M1 ties."""
        own = np.concatenate([nvfp4_division_sensitive_rows(), nvfp4_training_rows()])
        for i, row in enumerate(own):  # each row its own tensor: one (1, 32) program
            x = row[None]
            self.check(self.run(x, "nvfp4"), reference(x, "nvfp4"), x, f"row {i}", "nvfp4")
        for what, x in [
            ("rows sharing tamax 37.3", nvfp4_division_sensitive_rows(16, seed=2, tamax=37.3)),
            ("1 / t at E2M1 ties", nvfp4_reciprocal_sensitive_matrix()),
        ]:
            self.check(self.run(x, "nvfp4"), reference(x, "nvfp4"), x, f"nvfp4 {what}", "nvfp4")

    # ========================================================================================
    # Random inputs (with planted zero and +-Inf blocks and a line near 1e-30)

    def _check_mx_case(self, fmt, mode, a):
        shape, axis = AXIS_CASES[a]
        x = case_inputs(a, 32)
        expected = reference(x, fmt, mode, axis)
        assert_normal_or_zero(expected.values)
        out = self.run(x, fmt, mode, axis)
        self.check(out, expected, x, f"{fmt} {mode} {AXIS_IDS[a]}", fmt)
        self.check_planted_specials(out, x, axis, fmt)

    @cases("fmt,mode,a", lambda s: s.mx_random_params())
    def test_mx_random_inputs_match_reference(self, fmt, mode, a):
        self._check_mx_case(fmt, mode, a)

    @cases("fmt,mode,a", lambda s: s.mx_random_params(full=True))
    def test_mx_random_inputs_match_reference_full(self, fmt, mode, a):
        self._check_mx_case(fmt, mode, a)

    def _check_nvfp4_case(self, a, amax_id):
        shape, axis = AXIS_CASES[a]
        x = case_inputs(a, 16)
        factor = NVFP4_AMAX[amax_id]
        true_amax = np.max(np.abs(x[np.isfinite(x)]))
        tensor_amax = None if factor is None else float(np.float32(factor * true_amax))
        expected = reference(x, "nvfp4", axis=axis, tensor_amax=tensor_amax)
        assert_normal_or_zero(expected.values)
        assert_amax_outside_nonfinite_blocks(x, axis)
        out = self.run(x, "nvfp4", None, axis, tensor_amax=tensor_amax)
        self.check(out, expected, x, f"nvfp4 {AXIS_IDS[a]} tensor_amax={amax_id}", "nvfp4")
        self.check_planted_specials(out, x, axis, "nvfp4")

    @cases("a,amax_id", lambda s: s.nvfp4_random_params())
    def test_nvfp4_random_inputs_match_reference(self, a, amax_id):
        self._check_nvfp4_case(a, amax_id)

    @cases("a,amax_id", lambda s: s.nvfp4_random_params(full=True))
    def test_nvfp4_random_inputs_match_reference_full(self, a, amax_id):
        self._check_nvfp4_case(a, amax_id)

    @cases(
        "fmt,a",
        lambda s: [
            _p(f, a, id=f"{f}-{AXIS_IDS[a]}")
            for f, a in [("mxfp4", 0), ("mxfp8_e5m2", 2), ("mxint8", 1)]
            if f in s.formats and s.takes(*AXIS_CASES[a])
        ],
    )
    def test_mx_bfloat16_input(self, fmt, a):
        """bfloat16 x (MX values have at most 8 significant bits and float32's exponent
        range: exact in bfloat16): the reference's values, in x's dtype."""
        shape, axis = AXIS_CASES[a]
        x = np.asarray(jnp.asarray(case_inputs(a, 32), jnp.bfloat16).astype(jnp.float32))
        expected = reference(x, fmt, None, axis)
        assert_normal_or_zero(expected.values)
        assert_bits_equal(
            np.asarray(jnp.asarray(expected.values, jnp.bfloat16), np.float32),
            expected.values,
            "precondition: exact in bfloat16",
        )
        out = self.run(x, fmt, None, axis, dtype=jnp.bfloat16)
        for name, y in out.values:
            assert y.dtype == jnp.bfloat16, f"{name}: {y.dtype}"
        as_f32 = Outputs(
            out.qarray,
            *(None if v is None else v.astype(np.float32) for v in (out.dequantized, out.fake)),
        )
        self.check(as_f32, expected, x, f"{fmt} bfloat16 {AXIS_IDS[a]}", fmt)

    # ========================================================================================
    # Zero blocks, tiny and huge inputs, NaN and Inf

    @cases("fmt", lambda s: s.mx_formats())
    def test_mx_zero_nan_inf_blocks(self, fmt):
        """Row 0 all zero (byte 0, +0.0); a NaN, a +Inf and a -Inf block (byte 0xFF, NaN);
        the other blocks as the reference. Row 4 holds a small negative value that rounds
        to -0.0."""
        x = np.random.default_rng(4).standard_normal((BASE_ROWS, 32)).astype(np.float32)
        x[0] = 0.0
        x[1, 5], x[2, 31], x[3, 0] = np.nan, np.inf, -np.inf
        x[4, 1] = -(2.0**-12)
        out = self.run(x, fmt)
        if out.scales is not None:
            assert out.scales[:4, 0].tolist() == [0, E8M0_NAN, E8M0_NAN, E8M0_NAN]
        for name, y in out.values:
            assert np.all(np.isnan(y[1:4])) and not np.any(np.isnan(y[4:])), name
            assert np.all(y[0].view(np.uint32) == 0), name
        self.check(out, reference(x, fmt), x, f"{fmt} special blocks", fmt)

    @cases("fmt", lambda s: s.any_formats(["mxfp8_e4m3", "nvfp4"]))
    def test_nan_block_in_a_larger_tensor(self, fmt):
        """As test_mx_zero_nan_inf_blocks, in a (256, 32) tensor: the NaN block's scale byte
        is the NaN code and it dequantizes to NaN; the other blocks are the reference's."""
        x = np.random.default_rng(12).standard_normal((256, 32)).astype(np.float32)
        x[1, 2] = np.nan
        out = self.run(x, fmt)
        block = block_size(fmt)
        if out.scales is not None:
            assert out.scales[1, 0] == nan_byte(fmt)
        for name, y in out.values:
            assert np.all(np.isnan(y[1, :block])), name
            assert np.sum(np.isnan(y)) == block, name
        self.check(out, reference(x, fmt), x, f"{fmt} NaN block, (256, 32)", fmt)

    @cases("fmt", lambda s: s.any_formats(["mxfp4", "mxfp8_e4m3", "nvfp4"]))
    def test_block_max_and_nan_at_every_position_of_a_block(self, fmt):
        """Row p has its largest magnitude (negative on odd rows) at position p, and row
        block + p a NaN there: the block maximum is found wherever it lies (an implementation
        may reduce by halves, then over the last few lanes), and every NaN row is NaN."""
        block = block_size(fmt)
        rng = np.random.default_rng(21)
        x = rng.uniform(-1.0, 1.0, (2 * block, block)).astype(np.float32)
        for p in range(block):
            x[p, p] = 3.0 * (-1) ** p
            x[block + p, p] = np.nan
        out = self.run(x, fmt)
        if out.scales is not None:
            scales = out.scales[:, 0]
            assert np.all(scales[block:] == nan_byte(fmt))
            assert np.all(scales[:block] != nan_byte(fmt))
        for name, y in out.values:
            assert np.all(np.isnan(y[block:])) and not np.any(np.isnan(y[:block])), name
        self.check(out, reference(x, fmt), x, f"{fmt} block max at every position", fmt)

    @cases("fmt", lambda s: s.any_formats())
    def test_all_zero_tensor(self, fmt):
        x = np.zeros((BASE_ROWS, 32 if fmt != "nvfp4" else 16), np.float32)
        out = self.run(x, fmt)
        if out.qarray is not None:
            assert np.all(out.scales == 0)
            if fmt == "nvfp4":
                assert float(out.qarray.tensor_scale) == 0.0
        for name, y in out.values:
            assert np.all(y.view(np.uint32) == 0), f"{name}: not all +0.0 (0/0 NaN?)"
        self.check(out, reference(x, fmt), x, f"{fmt} all zero", fmt)

    @cases("fmt", lambda s: s.any_formats(["nvfp4"]))
    def test_nvfp4_mixed_nan_inf_zero_blocks(self, fmt):
        """A NaN, a +Inf and a -Inf block get the NaN scale byte and NaN values; the zero
        block byte 0 and +0.0; the tensor amax (50) comes from the finite values only."""
        x = np.random.default_rng(5).standard_normal((BASE_ROWS, 16)).astype(np.float32)
        x[0] = 0.0
        x[1, 5], x[2, 15], x[3, 0] = np.nan, np.inf, -np.inf
        x[4, 0] = 50.0
        out = self.run(x, "nvfp4")
        if out.qarray is not None:
            assert out.scales[:4, 0].tolist() == [0, UE4M3_NAN, UE4M3_NAN, UE4M3_NAN]
            t = np.asarray(out.qarray.tensor_scale)
            assert_bits_equal(t, np.float32(50) / np.float32(2688), "t")
        for name, y in out.values:
            assert np.all(np.isnan(y[1:4])) and not np.any(np.isnan(y[4:])), name
            assert np.all(y[0].view(np.uint32) == 0), name
        self.check(out, reference(x, "nvfp4"), x, "nvfp4 special blocks", "nvfp4")

    @cases("fmt", lambda s: s.any_formats(["nvfp4"]))
    def test_nvfp4_tensor_amax_keeps_finite_values_of_a_nan_block(self, fmt):
        """The tensor amax ignores non-finite values, not the finite values next to them."""
        x = np.random.default_rng(6).standard_normal((BASE_ROWS, 16)).astype(np.float32)
        x[0, 0] = np.nan
        x[0, 1] = 100.0  # the largest finite magnitude, in the same block as the NaN
        expected = reference(x, "nvfp4")
        assert expected.tensor_scale == np.float32(100) / np.float32(2688)
        # without a packed tensor scale, t shows in the other blocks' values: with t from
        # their own amax (about 3), these blocks would come out differently
        other = reference(x[1:], "nvfp4")
        assert not np.array_equal(expected.values[1:], other.values)
        self.check(self.run(x, "nvfp4"), expected, x, "nvfp4 NaN block holding the amax", "nvfp4")

    @cases("fmt", lambda s: s.any_formats())
    def test_tensor_of_values_near_1e_minus_30(self, fmt):
        """Every block ~1e-30: results are normal floats, so exact on every backend; for
        NVFP4 t ~ 4e-34 and s*t are normal too."""
        rng = np.random.default_rng(7)
        x = rng.standard_normal((BASE_ROWS, 32 if fmt != "nvfp4" else 16)) * 1e-30
        x = x.astype(np.float32)
        expected = reference(x, fmt)
        assert_normal_or_zero(expected.values)
        assert np.all(np.isfinite(expected.values)) and np.any(expected.values != 0)
        self.check(self.run(x, fmt), expected, x, f"{fmt} 1e-30", fmt)

    @cases("fmt", lambda s: s.mx_formats())
    def test_mx_block_amax_near_2_pow_minus_120(self, fmt):
        """Blocks of normal floats in [2**-126, 2**-120]: the scale is 2**-127 (E4M3, E5M2)
        or near it, a float32 subnormal that XLA on CPU flushes to zero, so it must never be
        a factor. With normal inputs every MX result is a normal float or zero (an element of
        x / 2**e is >= 2 when e = -127): exact, never NaN."""
        rng = np.random.default_rng(8)
        mag = 2.0 ** rng.uniform(-126, -120, (BASE_ROWS, 32))
        x = (mag * rng.choice([-1.0, 1.0], mag.shape)).astype(np.float32)
        x[:, 0] = 2.0**-120
        x[::2, 0] *= -1
        assert_normal_or_zero(x)
        expected = reference(x, fmt)
        assert_normal_or_zero(expected.values)
        assert np.all(expected.scale_codes == SCALE_BYTE_AT_2_POW_MINUS_120[fmt])
        self.check(self.run(x, fmt), expected, x, f"{fmt} amax 2**-120", fmt)

    @cases("fmt", lambda s: s.any_formats(["nvfp4"]))
    def test_nvfp4_tensor_amax_near_2_pow_minus_120(self, fmt):
        """t = 2**-120 / 2688 is a float32 subnormal: flushed on CPU (all zeros), kept
        elsewhere (the reference). Either way no NaN, and each value is the reference's or
        zero."""
        rng = np.random.default_rng(9)
        shape = (BASE_ROWS, 16)
        x = 2.0 ** rng.uniform(-126, -120, shape) * rng.choice([-1.0, 1.0], shape)
        x = x.astype(np.float32)
        x[0, 0] = 2.0**-120
        with np.errstate(over="ignore"):
            expected = reference(x, "nvfp4").values
        out = self.run(x, "nvfp4")
        for name, got in out.values:
            assert not np.any(np.isnan(got)), name
            assert np.all((got == expected) | (got == 0)), name

    @cases("fmt,mode", lambda s: s.near_max_params())
    def test_blocks_near_float32_max(self, fmt, mode):
        """Blocks whose amax is near float32's max (3.4e38), mixed with O(1) blocks: the
        scale exponent reaches its top, elements saturate, and every value stays finite.
        (In the float formats' ceil, even and rceil modes an element can round up to
        2**128, which float32 cannot hold: DESIGN.md does not say what a value is then.)"""
        rng = np.random.default_rng(14)
        width = block_size(fmt)
        x = rng.standard_normal((BASE_ROWS, width))
        x[::2] = np.clip(x[::2] * 1.2e38, -3.4e38, 3.4e38)
        x[0, 0] = np.finfo(np.float32).max
        x[2, 3] = -np.finfo(np.float32).max
        x = x.astype(np.float32)
        expected = reference(x, fmt, mode)
        assert np.all(np.isfinite(expected.values))
        assert_normal_or_zero(expected.values)
        if fmt == "mxint8" and mode is not None:  # e clamped to 127: x[0, 0] saturates
            assert expected.scale_codes[0, 0] == 254 and expected.values[0, 0] == 127 * 2.0**121
        self.check(self.run(x, fmt, mode), expected, x, f"{fmt} {mode} near float32 max", fmt)

    # ========================================================================================
    # Other 1-D blocks and ranks; 2-D tiles (each tile one block of its flattened values)

    @cases("fmt,c", lambda s: s.custom_block_params())
    def test_custom_1d_blocks_and_ranks(self, fmt, c):
        shape, axis, block = CUSTOM_BLOCK_CASES[c]
        x = mixed_inputs(shape, axis, seed=30 + c, spread=4, block=block)
        if fmt == "nvfp4":
            assert_amax_outside_nonfinite_blocks(x, axis, (block,))
        expected = reference(x, fmt, None, axis, block_shape=(block,))
        assert_normal_or_zero(expected.values)
        out = self.run(x, fmt, None, axis, block_shape=(block,))
        self.check(out, expected, x, f"{fmt} {CUSTOM_BLOCK_IDS[c]}", fmt)

    def _check_tiles(self, fmt, mode, t, c):
        shape, axis = TILE_CASES[c]
        tile = TILES[t]
        # The planted zero run and +-Inf values land in some tiles: those must be zero / NaN.
        x = mixed_inputs(shape, -1, seed=10 + c, spread=4 if fmt == "nvfp4" else 20, block=16)
        # The tensor's largest magnitude, far from the Inf values (which sit in the first rows).
        x.reshape(-1)[-1] = 2 * np.max(np.abs(x[np.isfinite(x)]))
        tamax = None
        if fmt == "nvfp4":
            assert_amax_outside_nonfinite_blocks(x, axis, tile)
            if c == 2:  # a calibrated tensor amax below the data's (block scales clip)
                tamax = float(np.float32(np.max(np.abs(x[np.isfinite(x)])) / 4))
        expected = reference(x, fmt, mode, axis, block_shape=tile, tensor_amax=tamax)
        assert_normal_or_zero(expected.values)
        out = self.run(x, fmt, mode, axis, block_shape=tile, tensor_amax=tamax)
        if out.qarray is not None:
            assert out.qarray.block_shape == tile
        what = f"{fmt} {mode} tile {tile} axis={axis} tensor_amax={tamax}"
        self.check(out, expected, x, what, fmt)

    @cases("fmt,mode,t,c", lambda s: s.tile_params())
    def test_2d_tiles_match_reference(self, fmt, mode, t, c):
        self._check_tiles(fmt, mode, t, c)

    @cases("fmt,mode,t,c", lambda s: s.tile_params(full=True))
    def test_2d_tiles_match_reference_full(self, fmt, mode, t, c):
        self._check_tiles(fmt, mode, t, c)

    @cases("fmt", lambda s: s.tiles if isinstance(s.tiles, Unsupported) else ["mxfp8_e4m3"])
    def test_2d_tile_nan_block(self, fmt):
        """A NaN in one 16x16 tile: that tile's scale is NaN and its values NaN; the others
        are the reference's."""
        x = np.random.default_rng(11).standard_normal((40, 70)).astype(np.float32)
        x[20, 40] = np.nan
        out = self.run(x, "mxfp8_e4m3", None, -1, block_shape=(16, 16))
        if out.scales is not None:
            assert out.scales.shape == (3, 5)
            assert out.scales[1, 2] == E8M0_NAN and np.sum(out.scales == E8M0_NAN) == 1
        for name, y in out.values:
            assert np.all(np.isnan(y[16:32, 32:48])) and np.sum(np.isnan(y)) == 256, name
        expected = reference(x, "mxfp8_e4m3", block_shape=(16, 16))
        self.check(out, expected, x, "mxfp8 16x16 tile with NaN", "mxfp8_e4m3")

    # ========================================================================================
    # Size-dependent paths; stochastic rounding (no reference: bit-identical to lowbit's XLA
    # path, which tests/test_properties.py checks statistically)

    @cases(
        "fmt",
        lambda s: (
            s.large_shape
            if isinstance(s.large_shape, Unsupported)
            else s.any_formats(["mxfp8_e4m3", "nvfp4"])
        ),
    )
    def test_a_large_tensor_matches_reference(self, fmt):
        shape = self.large_shape
        for axis in (0, 1):
            x = mixed_inputs(shape, axis, seed=40 + axis, spread=4, block=block_size(fmt))
            expected = reference(x, fmt, None, axis)
            assert_normal_or_zero(expected.values)
            out = self.run(x, fmt, None, axis)
            self.check(out, expected, x, f"{fmt} {shape} axis {axis}", fmt)

    @cases("fmt,a", lambda s: s.stochastic_params())
    def test_stochastic_rounding_matches_the_xla_path(self, fmt, a):
        shape, axis = AXIS_CASES[a]
        x = case_inputs(a, block_size(fmt))
        out = self.run(x, fmt, None, axis, rounding="stochastic")
        want = xla_stochastic(fmt, axis, shape)(jnp.asarray(x), KEY)
        other = xla_stochastic(fmt, axis, shape)(jnp.asarray(x), KEY + 1)
        assert not np.array_equal(np.asarray(want[1]), np.asarray(other[1])), "key unused"
        for name, v in out.values:
            assert_bits_equal(v, want[1], f"{self.name} {fmt} stochastic: {name}", x)
        if out.qarray is not None:
            q, w = out.qarray, want[0]
            assert_codes_equal(q.scales, np.asarray(w.scales), "stochastic: scale bytes")
            assert_codes_equal(q.codes, np.asarray(w.codes), "stochastic: codes")


@functools.cache
def xla_stochastic(fmt, axis, shape):
    """lowbit's XLA path with stochastic rounding: (QArray, fake_quantize values)."""

    def run(x, key):
        kw = dict(rounding="stochastic", key=key)
        return lb.quantize(x, fmt, axis, **kw), lb.fake_quantize(x, fmt, axis, **kw)

    with lb.native.mode("off"):
        lowered = jax.jit(run).lower(jax.ShapeDtypeStruct(shape, jnp.float32), KEY)
    assert lb.native.TARGET not in lowered.as_text()
    return lowered.compile()


NVFP4_AMAX = {"own": None, "amax/4": 0.25, "amax*4": 4.0}  # factor times the true amax

# Floor-mode scale byte for a block whose amax is exactly 2**-120: e = -120 - emax, >= -127.
SCALE_BYTE_AT_2_POW_MINUS_120 = {
    "mxfp8_e4m3": 0,
    "mxfp8_e5m2": 0,
    "mxfp6_e3m2": 3,
    "mxfp6_e2m3": 5,
    "mxfp4": 5,
    "mxint8": 7,
}

# (shape, axis): the last two axes of a matrix; the axes named in reverse order with an axis
# between them; the two leading axes (strided tiles) with a trailing one.
TILE_CASES = [((40, 70), -1), ((40, 3, 50), (2, 0)), ((20, 48, 5), (0, 1))]
TILE_IDS = ["40x70", "40x3x50-axes2,0", "20x48x5-axes0,1"]
TILES = [(16, 16), (32, 32), (8, 16)]

# 1-D blocks other than the format's own, and ranks 1 and 4: (shape, axis, block)
CUSTOM_BLOCK_CASES = [
    ((3, 50, 6), 1, 16),  # middle axis
    ((2, 3, 4, 96), 2, 8),  # short axis padded to one block, rank 4
    ((130,), 0, 64),  # rank 1
    ((5, 24), -1, 24),  # a block that is neither 16 nor 32
]
CUSTOM_BLOCK_IDS = ["3x50x6-axis1-b16", "2x3x4x96-axis2-b8", "130-axis0-b64", "5x24-axis-1-b24"]
CUSTOM_BLOCK_FORMATS = ["mxfp6_e3m2", "nvfp4", "mxfp4", "mxint8"]
