"""Tests of the QArray container and the quantize / dequantize / fake_quantize API: pytree
behaviour, storage size and bit packing, padding, ranks and axes, 2-D tiles, dtypes, jit /
vmap / grad / checkpoint, and argument errors.

Expected values come from the specification (DESIGN.md, the OCP MX v1.0 code tables) and from
a small numpy reference quantizer (MX, floor mode) written here with ml_dtypes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowbit as lb

# format -> (ml_dtypes element type or None for MX INT8, code bits, emax, element max, block)
SPEC = {
    "mxfp8_e4m3": (ml_dtypes.float8_e4m3fn, 8, 8, 448.0, 32),
    "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 8, 15, 57344.0, 32),
    "mxfp6_e2m3": (ml_dtypes.float6_e2m3fn, 6, 2, 7.5, 32),
    "mxfp6_e3m2": (ml_dtypes.float6_e3m2fn, 6, 4, 28.0, 32),
    "mxfp4": (ml_dtypes.float4_e2m1fn, 4, 2, 6.0, 32),
    "mxint8": (None, 8, 0, 127.0 / 64.0, 32),
    "nvfp4": (ml_dtypes.float4_e2m1fn, 4, 2, 6.0, 16),
}
MX = [f for f in SPEC if f != "nvfp4"]
RNG = np.random.default_rng(0)


def randn(*shape, dtype=np.float32) -> np.ndarray:
    """Normal values with a spread of magnitudes (x 2**-4 .. 2**4)."""
    return (RNG.standard_normal(shape) * 2.0 ** RNG.integers(-4, 5, shape)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "block_shape", "dtype"))
def qdq(x, fmt, axis=-1, block_shape=None, dtype=None):
    """(QArray, dequantize(q, dtype), fake_quantize(x)) in one compiled call."""
    q = lb.quantize(x, fmt, axis, block_shape=block_shape)
    return q, lb.dequantize(q, dtype), lb.fake_quantize(x, fmt, axis, block_shape=block_shape)


def element_codes(values, fmt: str) -> np.ndarray:
    """uint8 codes of values on the element grid, from ml_dtypes (two's complement for
    MX INT8)."""
    dt = SPEC[fmt][0]
    v = np.asarray(values, np.float32)
    if dt is None:
        return np.round(v * 64).astype(np.int8).view(np.uint8)
    return v.astype(dt).view(np.uint8)


def unpack(packed, bits: int) -> np.ndarray:
    """Codes from packed bytes (FP4: low nibble first; FP6: little-endian 24-bit words
    c0 | c1 << 6 | c2 << 12 | c3 << 18)."""
    p = np.asarray(packed, np.uint8)
    if bits == 4:
        return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    if bits == 6:
        g = p.reshape(*p.shape[:-1], -1, 3).astype(np.uint32)
        w = g[..., 0] | g[..., 1] << 8 | g[..., 2] << 16
        return np.stack([w >> k & 0x3F for k in (0, 6, 12, 18)], -1).reshape(*p.shape[:-1], -1)
    return p


def ref_mx(x: np.ndarray, fmt: str, axes: tuple[int, ...], block_shape: tuple[int, ...]):
    """Numpy reference of MX fake quantization, floor mode (OCP MX v1.0): per block,
    e = floor(log2 amax) - emax (-127 for an all-zero block), elements RNE(clamp(x / 2**e)),
    value element * 2**e. Blocks tile ``axes`` with ``block_shape``; ragged edges zero-padded."""
    dt, _, emax, emax_val, _ = SPEC[fmt]
    x = np.asarray(x, np.float64)
    k = len(axes)
    perm = [i for i in range(x.ndim) if i not in axes] + list(axes)
    y = np.transpose(x, perm)
    lens = y.shape[-k:]
    y = np.pad(
        y, [(0, 0)] * (y.ndim - k) + [(0, -n % b) for n, b in zip(lens, block_shape, strict=True)]
    )
    lead = y.shape[:-k]
    split = [d for n, b in zip(y.shape[-k:], block_shape, strict=True) for d in (n // b, b)]
    yb = y.reshape(*lead, *split)
    amax = np.max(np.abs(yb), axis=tuple(len(lead) + 2 * i + 1 for i in range(k)), keepdims=True)
    e = np.clip(np.where(amax > 0, np.frexp(amax)[1] - 1 - emax, -127), -127, 127)
    v = np.clip(yb / np.ldexp(1.0, e), -emax_val, emax_val)
    if dt is None:
        r = np.round(v * 64) / 64
    else:
        r = v.astype(np.float32).astype(dt).astype(np.float64)
    out = (r * np.ldexp(1.0, e)).reshape(y.shape)
    out = out[(Ellipsis,) + tuple(slice(0, n) for n in lens)]
    return np.transpose(out, np.argsort(perm)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Pytree


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_qarray_is_a_pytree(fmt):
    x = jnp.asarray(randn(4, 64))
    q, dq, _ = qdq(x, fmt)
    leaves, treedef = jax.tree_util.tree_flatten(q)
    # Data: packed codes, scales (and NVFP4's tensor scale); the rest is static metadata.
    assert len(leaves) == (3 if fmt == "nvfp4" else 2)
    q2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(q2, lb.QArray)
    assert (q2.format_name, q2.shape, q2.dtype, q2.axes, q2.block_shape) == (
        q.format_name,
        q.shape,
        q.dtype,
        q.axes,
        q.block_shape,
    )
    for a, b in zip(jax.tree_util.tree_leaves(q2), leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    # Through jit as an argument and as a return value.
    q3 = jax.jit(lambda q: jax.tree.map(lambda a: a, q))(q)
    assert isinstance(q3, lb.QArray) and jax.tree_util.tree_structure(q3) == treedef
    for a, b in zip(jax.tree_util.tree_leaves(q3), leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.jit(lb.dequantize)(q), dq)
    assert q.format.name == fmt and fmt in repr(q)


@pytest.mark.parametrize(
    "fmt",
    [
        "mxfp4",
        "nvfp4",
    ],
)
def test_jit_matches_eager(fmt):
    x = np.clip(randn(2, 32), -2.5, 2.5)
    x[0, 0] = 2.612166  # the tensor amax
    q, dq, _ = qdq(jnp.asarray(x), fmt)
    qe = lb.quantize(jnp.asarray(x), fmt)
    np.testing.assert_array_equal(np.asarray(qe.tensor_scale), np.asarray(q.tensor_scale))
    np.testing.assert_array_equal(qe.codes, q.codes)
    np.testing.assert_array_equal(qe.scales, q.scales)
    np.testing.assert_array_equal(lb.dequantize(qe), dq)


# --------------------------------------------------------------------------------------------
# Storage: bits per element, packed layouts


@pytest.mark.parametrize(
    "fmt, bits",
    [
        ("mxfp4", 4.25),
        ("mxfp6_e2m3", 6.25),
        ("mxfp6_e3m2", 6.25),
        ("mxfp8_e4m3", 8.25),
        ("mxfp8_e5m2", 8.25),
        ("mxint8", 8.25),
        ("nvfp4", 4.5),
    ],
)
def test_storage_is_exactly_the_format_bits(fmt, bits):
    """With the block dividing the shape: the codes are packed (4 / 6 / 8 bits each), one
    byte per block scale, and NVFP4's float32 tensor scale on top."""
    x = jnp.asarray(randn(4, 64))
    q = qdq(x, fmt)[0]
    size, elem_bits, block = 4 * 64, SPEC[fmt][1], SPEC[fmt][4]
    assert q.codes.dtype == np.uint8 and q.codes.size * 8 == size * elem_bits
    assert q.scales.dtype == np.uint8 and q.scales.size == size // block
    assert q.size == size and q.ndim == 2
    if fmt == "nvfp4":
        assert q.tensor_scale.dtype == np.float32 and q.tensor_scale.shape == ()
        assert q.nbytes * 8 == bits * size + 32
    else:
        assert q.tensor_scale is None
        assert q.nbytes * 8 == bits * size and q.bits_per_element == bits
    assert lb.formats.get(fmt).bits_per_element == bits


# E2M1 codes (OCP MX v1.0, table of FP4 values): magnitude -> code, sign bit 0x8.
E2M1_CODE = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}
FP4_BLOCK = [0.5, 6.0, -1.0, 3.0, 0.0, -0.5, 1.5, -6.0, 2.0, 4.0, -3.0, -4.0, 1.0, -2.0, -1.5, 0.0]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_packing_low_nibble_first(fmt):
    """Values on the E2M1 grid with amax 6: MX scale 2**0 (floor(log2 6) - 2 = 0, E8M0 code
    127); NVFP4 with tensor_amax = 2688 has t = 1 and s = e4m3(6 / 6 / 1) = 1.0 (code 0x38).
    Elements are the values themselves; byte i = code[2i] | code[2i+1] << 4."""
    x = np.array(FP4_BLOCK * 2, np.float32)
    kw = {"tensor_amax": 2688.0} if fmt == "nvfp4" else {}
    q = jax.jit(lambda x: lb.quantize(x, fmt, **kw))(x)
    codes = [E2M1_CODE[abs(v)] | (0x8 if np.signbit(v) else 0) for v in x]
    want = [lo | hi << 4 for lo, hi in zip(codes[0::2], codes[1::2], strict=True)]
    assert want[:2] == [0x71, 0x5A]  # (0.5, 6.0) and (-1.0, 3.0)
    np.testing.assert_array_equal(q.codes, want)
    np.testing.assert_array_equal(q.scales, [127] if fmt == "mxfp4" else [0x38, 0x38])
    np.testing.assert_array_equal(lb.dequantize(q), x)


@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "mxfp6_e3m2"])
def test_fp6_packing_little_endian_24_bit_words(fmt):
    """Four FP6 codes in three bytes: w = c0 | c1 << 6 | c2 << 12 | c3 << 18, stored
    little-endian. The block's amax is the element max, so the E8M0 scale is 2**0."""
    emax_val = SPEC[fmt][3]
    head = {"mxfp6_e2m3": [0.125, 7.5, -2.5, 1.0], "mxfp6_e3m2": [0.0625, 28.0, -2.5, 1.0]}[fmt]
    grid = np.arange(32, dtype=np.uint8).view(SPEC[fmt][0]).astype(np.float32)
    x = np.concatenate([head, grid[1:29]]).astype(np.float32)
    x[5::3] *= -1
    assert x.size == 32 and np.max(np.abs(x)) == emax_val
    q = jax.jit(lambda x: lb.quantize(x, fmt))(x)
    c = element_codes(x, fmt).astype(np.uint32).reshape(8, 4)
    w = c[:, 0] | c[:, 1] << 6 | c[:, 2] << 12 | c[:, 3] << 18
    want = np.stack([w & 0xFF, (w >> 8) & 0xFF, w >> 16], axis=-1).ravel()
    if fmt == "mxfp6_e2m3":  # codes 0x01, 0x1F, 0x32, 0x08 -> w = 0x2327C1
        assert list(want[:3]) == [0xC1, 0x27, 0x23]
    np.testing.assert_array_equal(q.codes, want)
    np.testing.assert_array_equal(q.scales, [127])
    np.testing.assert_array_equal(lb.dequantize(q), x)


@pytest.mark.parametrize(
    "fmt, head, head_codes",
    [
        # E4M3: 448 = S.1111.110, -1 = 1.0111.000, 2**-9 = smallest subnormal.
        ("mxfp8_e4m3", [448.0, -1.0, 2.0**-9], [0x7E, 0xB8, 0x01]),
        # E5M2: 57344 = 0.11110.11, -1 = 1.01111.00, 2**-16 = smallest subnormal.
        ("mxfp8_e5m2", [57344.0, -1.0, 2.0**-16], [0x7B, 0xBC, 0x01]),
        # MX INT8: two's complement k / 64; amax 127/64 -> scale 2**0.
        ("mxint8", [127 / 64, -1.0, 2.0**-6, -127 / 64], [0x7F, 0xC0, 0x01, 0x81]),
    ],
)
def test_byte_codes(fmt, head, head_codes):
    x = np.zeros(32, np.float32)
    x[: len(head)] = head
    q = jax.jit(lambda x: lb.quantize(x, fmt))(x)
    np.testing.assert_array_equal(q.codes[: len(head)], head_codes)
    np.testing.assert_array_equal(q.codes[len(head) :], 0)
    np.testing.assert_array_equal(q.scales, [127])


# --------------------------------------------------------------------------------------------
# Padding, ranks and axes, 2-D tiles


@pytest.mark.parametrize(
    "fmt, shape, axis",
    [
        ("mxfp4", (3, 45), -1),
        ("mxfp6_e2m3", (45, 2), 0),
        ("mxfp8_e4m3", (33,), 0),
        ("nvfp4", (2, 3, 21), -1),
    ],
)
def test_padding_to_whole_blocks(fmt, shape, axis):
    """A ragged axis is zero-padded to whole blocks (zeros change no block amax, nor the NVFP4
    tensor amax): the result is the padded array's, cut back to the original shape."""
    bits, block = SPEC[fmt][1], SPEC[fmt][4]
    x = randn(*shape)
    n = shape[axis]
    padded = -(-n // block) * block
    q, dq, fq = qdq(jnp.asarray(x), fmt, axis)
    other = tuple(d for i, d in enumerate(shape) if i != axis % len(shape))
    assert q.codes.shape == other + (padded * bits // 8,)
    assert q.scales.shape == other + (padded // block,)
    assert q.shape == shape and dq.shape == shape and fq.shape == shape
    np.testing.assert_array_equal(fq, dq)
    assert not np.any(unpack(q.codes, bits)[..., n:])  # the padding holds zero codes
    if fmt != "nvfp4":
        np.testing.assert_array_equal(dq, ref_mx(x, fmt, (axis % len(shape),), (block,)))
        return
    pad = [(0, 0)] * len(shape)
    pad[axis] = (0, padded - n)
    qp, dqp, _ = qdq(jnp.asarray(np.pad(x, pad)), fmt, axis)
    np.testing.assert_array_equal(q.scales, qp.scales)
    np.testing.assert_array_equal(q.codes, qp.codes)
    np.testing.assert_array_equal(dq, np.take(np.asarray(dqp), np.arange(n), axis=axis))


RANK_AXIS = [(r, a) for r in range(1, 5) for a in range(r)] + [(3, -1), (4, -3)]


@pytest.mark.parametrize("rank, axis", RANK_AXIS)
def test_any_rank_and_axis(rank, axis):
    """Ranks 1-4, every axis (and negative ones): MX against the numpy reference (blocks of 32
    along ``axis``, ragged length 37); the quantized layout is [*other, axis]."""
    fmt = MX[(rank + axis) % len(MX)]
    shape = [3, 2, 2][: rank - 1]
    shape.insert(axis % rank, 37)
    x = randn(*shape)
    q, dq, fq = qdq(jnp.asarray(x), fmt, axis)
    want = ref_mx(x, fmt, (axis % rank,), (32,))
    np.testing.assert_array_equal(dq, want)
    np.testing.assert_array_equal(fq, want)
    assert q.axes == (axis % rank,) and q.shape == tuple(shape)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_nvfp4_any_axis_is_the_moved_axis_quantized_last(axis):
    """NVFP4 (no exact numpy reference: its tensor scale is a float32 quotient): quantizing
    along ``axis`` equals quantizing the array with that axis moved last."""
    x = randn(*[(20, 3, 2), (3, 20, 2), (3, 2, 20)][axis])
    dq = qdq(jnp.asarray(x), "nvfp4", axis)[1]
    dq_last = qdq(jnp.asarray(np.moveaxis(x, axis, -1)), "nvfp4", -1)[1]
    np.testing.assert_array_equal(dq, np.moveaxis(np.asarray(dq_last), -1, axis))


TILES = [
    # (format, shape, axis, block_shape, quantized axes, scales shape)
    ("mxfp8_e4m3", (32, 48), -1, (16, 16), (0, 1), (2, 3)),
    ("mxfp4", (2, 40, 40), -1, (32, 32), (1, 2), (2, 2, 2)),
    ("mxint8", (64, 32, 3), (0, 1), (32, 32), (0, 1), (3, 2, 1)),
    ("mxfp6_e3m2", (48, 3, 32), (2, 0), (16, 16), (2, 0), (3, 2, 3)),
]


@pytest.mark.parametrize("fmt, shape, axis, block_shape, axes, scales_shape", TILES)
def test_2d_tiles(fmt, shape, axis, block_shape, axes, scales_shape):
    """One scale per (b0 x b1) tile of the two quantized axes (default: the last two); MX
    values against the numpy reference."""
    x = randn(*shape)
    q, dq, fq = qdq(jnp.asarray(x), fmt, axis, block_shape)
    assert q.axes == axes and q.block_shape == block_shape
    assert q.scales.shape == scales_shape
    want = ref_mx(x, fmt, axes, block_shape)
    np.testing.assert_array_equal(dq, want)
    np.testing.assert_array_equal(fq, want)


def test_2d_tile_is_a_block_of_its_flattened_values():
    """A 16 x 16 tile quantizes like a 1-D block of its 256 values: the same amax, the same
    tensor amax, the same elements (bit for bit; NVFP4, which has no exact numpy reference)."""
    fmt = "nvfp4"
    x = randn(32, 48)
    dq_tile = qdq(jnp.asarray(x), fmt, -1, (16, 16))[1]
    # [32, 48] -> [2, 16, 3, 16] -> [2, 3, 16 * 16]: one row of 256 per tile.
    rows = x.reshape(2, 16, 3, 16).transpose(0, 2, 1, 3).reshape(2, 3, 256)
    dq_rows = np.asarray(qdq(jnp.asarray(rows), fmt, -1, (256,))[1])
    np.testing.assert_array_equal(
        dq_tile, dq_rows.reshape(2, 3, 16, 16).transpose(0, 2, 1, 3).reshape(32, 48)
    )


# --------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4"])
def test_bfloat16_input_round_trips_in_its_own_dtype(fmt):
    x16 = jnp.asarray(randn(4, 64), jnp.bfloat16)
    q16, dq16, fq16 = qdq(x16, fmt)
    q32, dq32, _ = qdq(x16.astype(jnp.float32), fmt)
    # bf16 -> float32 is exact, so the codes are those of the float32 values.
    np.testing.assert_array_equal(q16.codes, q32.codes)
    np.testing.assert_array_equal(q16.scales, q32.scales)
    assert q16.dtype == jnp.bfloat16 and dq16.dtype == jnp.bfloat16 and fq16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(dq16, dq32.astype(jnp.bfloat16))
    np.testing.assert_array_equal(fq16, dq16)
    # dtype= overrides the default.
    np.testing.assert_array_equal(qdq(x16, fmt, dtype=jnp.float32)[1], dq32)


@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "nvfp4"])
def test_dequantize_dtype_argument(fmt):
    x = jnp.asarray(randn(4, 64))
    q, dq, _ = qdq(x, fmt)
    assert q.dtype == jnp.float32 and dq.dtype == jnp.float32
    dq16, dq32 = jax.jit(lambda q: (lb.dequantize(q, jnp.bfloat16), q.dequantize()))(q)
    assert dq16.dtype == jnp.bfloat16 and dq32.dtype == jnp.float32
    np.testing.assert_array_equal(dq16, dq.astype(jnp.bfloat16))
    np.testing.assert_array_equal(dq32, dq)


# --------------------------------------------------------------------------------------------
# Transformations: vmap, keys


_fq = jax.jit(lb.fake_quantize, static_argnames=("fmt", "axis", "clip_gradient", "scale_mode"))


def test_vmap_mx_matches_the_batched_call():
    """MX blocks never cross slices, so vmapping over rows equals quantizing along -1."""
    x = jnp.asarray(randn(4, 70))
    got = jax.jit(jax.vmap(lambda r: lb.fake_quantize(r, "mxfp6_e2m3")))(x)
    np.testing.assert_array_equal(got, _fq(x, "mxfp6_e2m3"))
    codes = jax.jit(jax.vmap(lambda r: lb.quantize(r, "mxfp6_e2m3").codes))(x)
    np.testing.assert_array_equal(codes, qdq(x, "mxfp6_e2m3")[0].codes)
    # Mapping over axis 1, with blocks along the slice's axis 0.
    y = jnp.asarray(randn(64, 3))
    f = jax.vmap(lambda c: lb.fake_quantize(c, "mxfp4", axis=0), in_axes=1, out_axes=1)
    np.testing.assert_array_equal(jax.jit(f)(y), _fq(y, "mxfp4", axis=0))


def test_vmap_nvfp4_uses_a_tensor_scale_per_slice():
    """Under vmap each slice is a tensor of its own: its own tensor amax."""
    x = randn(3, 64) * np.array([[1.0], [100.0], [0.01]], np.float32)
    got = np.asarray(jax.jit(jax.vmap(lambda r: lb.fake_quantize(r, "nvfp4")))(jnp.asarray(x)))
    for i in range(3):
        np.testing.assert_array_equal(got[i], _fq(jnp.asarray(x[i : i + 1]), "nvfp4")[0])
    assert not np.array_equal(got, _fq(jnp.asarray(x), "nvfp4"))


def test_typed_and_raw_keys_are_the_same_key():
    x = jnp.asarray(randn(2, 64))
    kw = dict(rounding="stochastic")
    f = jax.jit(
        lambda x, k: (
            lb.fake_quantize(x, "mxfp4", key=k, **kw),
            lb.quantize(x, "mxfp4", key=k, **kw).codes,
        )
    )
    key = jax.random.key(11)
    typed, raw = f(x, key), f(x, jax.random.key_data(key))
    for a, b in zip(typed, raw, strict=True):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# Gradients


def vjp(x, ct, **kw):
    """The vector-Jacobian product of fake_quantize at x with cotangent ct."""
    return jax.vjp(lambda x: lb.fake_quantize(x, **kw), x)[1](ct)[0]


_vjp = jax.jit(vjp, static_argnames=("fmt", "clip_gradient", "scale_mode", "rounding"))


@pytest.mark.parametrize("fmt", list(SPEC))
def test_gradient_is_the_identity(fmt):
    """Straight-through estimator: the VJP returns the cotangent unchanged, bit for bit,
    saturated elements included (default clip_gradient=False)."""
    x = randn(3, 64)
    x[:, 0] *= 1e3  # elements far above the rest of their block
    ct = jnp.asarray(randn(3, 64))
    np.testing.assert_array_equal(_vjp(jnp.asarray(x), ct, fmt=fmt), ct)


def test_gradient_is_the_identity_with_stochastic_rounding_and_bfloat16():
    x = jnp.asarray(randn(3, 64), jnp.bfloat16)
    ct = jnp.asarray(randn(3, 64), jnp.bfloat16)
    f = jax.jit(
        lambda x, ct, k: jax.vjp(
            lambda x: lb.fake_quantize(x, "mxfp4", rounding="stochastic", key=k), x
        )[1](ct)[0]
    )
    g = f(x, ct, jax.random.key(0))
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(g, ct)


def clipping_example(fmt: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """(x, saturated mask, kwargs): one block in which some elements exceed the element max
    once scaled, built from the spec.

    MX floor mode: scale 2**(floor(log2 amax) - emax) = 2**0 when amax's binade is the
    element's top binade; an amax whose mantissa exceeds the max's mantissa then clips.
    E2M1 (max 6 = 1.5 * 4): 7 and -6.5 clip, 6 does not. E4M3 (max 448 = 1.75 * 256): 480 and
    -464 clip, 448 does not. NVFP4 with tensor_amax 2688 (t = 1): a block amax of 6.3 gives
    s = e4m3(6.3 / 6 = 1.05) = 1.0 (E4M3 neighbours 1.0 and 1.125), so 6.3 and -6.2 clip and
    5.9 does not.
    """
    head, kw = {
        "mxfp4": ([7.0, -6.5, 6.0, 1.0], {"scale_mode": "floor"}),
        "mxfp8_e4m3": ([480.0, -464.0, 448.0, 1.0], {"scale_mode": "floor"}),
        "nvfp4": ([6.3, -6.2, 5.9, 1.0], {"tensor_amax": 2688.0}),
    }[fmt]
    x = np.full((2, 32), 0.75, np.float32)
    x[0, :4] = head
    mask = np.zeros(x.shape, bool)
    mask[0, :2] = True
    return x, mask, kw


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "nvfp4"])
def test_clip_gradient_is_zero_exactly_where_saturated(fmt):
    x, mask, kw = clipping_example(fmt)
    ct = jnp.asarray(randn(*x.shape))

    @jax.jit
    def grads(x, ct):
        ones = jax.grad(lambda x: jnp.sum(lb.fake_quantize(x, fmt, clip_gradient=True, **kw)))
        return (
            vjp(x, ct, fmt=fmt, clip_gradient=True, **kw),
            vjp(x, ct, fmt=fmt, clip_gradient=False, **kw),
            ones(x),
        )

    clipped, straight, ones = grads(x, ct)
    np.testing.assert_array_equal(clipped, np.where(mask, 0.0, ct))
    np.testing.assert_array_equal(straight, ct)
    # grad of a sum: 0 at saturated elements, 1 elsewhere.
    np.testing.assert_array_equal(ones, np.where(mask, 0.0, 1.0))


def test_rceil_never_clips():
    """rceil picks the smallest scale that does not clip, so clip_gradient changes nothing."""
    x = jnp.asarray(randn(4, 64) * 1e3)
    ct = jnp.asarray(randn(4, 64))
    g = _vjp(x, ct, fmt="mxfp4", clip_gradient=True, scale_mode="rceil")
    np.testing.assert_array_equal(g, ct)


@pytest.mark.parametrize("clip_gradient", [False, True])
def test_gradients_under_checkpoint(clip_gradient):
    x, mask, kw = clipping_example("mxfp4")
    w = jnp.asarray(randn(*x.shape))

    def loss(x):
        return jnp.sum(lb.fake_quantize(x, "mxfp4", clip_gradient=clip_gradient, **kw) * w)

    g, g_plain = jax.jit(lambda x: (jax.grad(jax.checkpoint(loss))(x), jax.grad(loss)(x)))(x)
    want = np.where(mask, 0.0, w) if clip_gradient else w
    np.testing.assert_array_equal(g, want)
    np.testing.assert_array_equal(g, g_plain)


# --------------------------------------------------------------------------------------------
# Errors

X2 = np.ones((2, 32), np.float32)
X1 = np.ones(32, np.float32)

BAD = [
    # (x, args, kwargs, exception, message pattern)
    (X2, ("mxfp5",), {}, ValueError, r"unknown format 'mxfp5'; known formats: .*mxfp4.*nvfp4"),
    (np.ones((2, 32), np.int32), ("mxfp4",), {}, TypeError, r"x must be a floating-point array"),
    (np.ones(32, np.complex64), ("mxfp4",), {}, TypeError, r"x must be a floating-point array"),
    (np.float32(1.0), ("mxfp4",), {}, ValueError, r"x must have at least one dimension"),
    (X2, ("mxfp4", 2), {}, ValueError, r"axis 2 is out of range for an array of rank 2"),
    (X2, ("mxfp4", -3), {}, ValueError, r"axis -3 is out of range"),
    (X2, ("mxfp4", (0, 0)), {"block_shape": (16, 16)}, ValueError, r"axis=\(0, 0\) repeats"),
    (X2, ("mxfp4", 0), {"block_shape": (16, 16)}, ValueError, r"2-D block_shape needs axis="),
    (X1, ("mxfp4",), {"block_shape": (16, 16)}, ValueError, r"block_shape=\(16, 16\) is a 2-D"),
    (X1, ("mxfp4",), {"block_shape": (15,)}, ValueError, r"block_shape=\(15,\).*multiple of 2"),
    (X1, ("mxfp6",), {"block_shape": (30,)}, ValueError, r"block_shape=\(30,\).*multiple of 4"),
    (X1, ("nvfp4",), {"block_shape": (0,)}, ValueError, r"block_shape must be"),
    (X1, ("mxfp4",), {"rounding": "stochastic"}, ValueError, r"rounding='stochastic' needs"),
    (X1, ("mxfp4",), {"rounding": "up"}, ValueError, r"rounding must be one of"),
    (X1, ("mxfp4",), {"scale_mode": "round"}, ValueError, r"scale_mode must be one of"),
    (X1, ("nvfp4",), {"scale_mode": "floor"}, ValueError, r"scale_mode='floor' does not apply"),
    (X1, ("mxfp8",), {"tensor_amax": 1.0}, ValueError, r"tensor_amax applies only to"),
    (X1, ("nvfp4",), {"tensor_amax": np.nan}, ValueError, r"tensor_amax must be a finite"),
    (X1, ("nvfp4",), {"tensor_amax": np.inf}, ValueError, r"tensor_amax must be a finite"),
    (X1, ("nvfp4",), {"tensor_amax": -1.0}, ValueError, r"tensor_amax must be a finite"),
    (X1, ("nvfp4",), {"tensor_amax": np.ones(2)}, ValueError, r"tensor_amax must be a finite"),
]


@pytest.mark.parametrize("fn", [lb.quantize, lb.fake_quantize], ids=["quantize", "fake"])
@pytest.mark.parametrize("x, args, kwargs, exc, match", BAD)
def test_bad_arguments_raise_clear_errors(fn, x, args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fn(x, *args, **kwargs)


def test_dequantize_rejects_non_qarrays():
    with pytest.raises(TypeError, match="q must be a QArray"):
        lb.dequantize(np.ones(4, np.float32))
