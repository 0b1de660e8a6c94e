"""The tiled scale layout of Blackwell's block-scaled MMA (pallas_kernels.mma_scales).

Two independent references, both in NumPy: the byte-offset formula written out per scale
(cuBLAS's "1D block scaling factors layout", CUTLASS's ``SfKMajorAtom`` tiled K-fastest), and a
transcription of the ``format_scales`` helper that jax's own tcgen05 tests apply before
``tcgen05_mma(..., a_scale=, b_scale=)`` (jax-ml/jax@cec06d11 tests/mosaic/gpu_test.py:2455-2464).
Scales are random bytes, so any permutation error shows; shapes cover exact multiples of the
128 x 4 tile and ragged ones (padding checked byte by byte), leading group dims, and jit.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.mma_scales import (
    PAD_BYTE,
    from_mma_layout,
    mma_layout_shape,
    to_mma_layout,
)

# (MN, K/block): exact tiles, ragged MN, ragged K/block, both, a single scale, more than 2 tiles
SHAPES = [(128, 4), (256, 8), (200, 6), (129, 5), (1, 1), (32, 17), (384, 3), (127, 12)]
LEADING = [(), (3,), (2, 2)]


def random_scales(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def offset(r: int, c: int, k_blocks: int) -> int:
    """Flat byte offset of scale (r, c) in the tiled buffer of one operand, written out."""
    k_tiles = -(-k_blocks // 4)
    tile = (r // 128) * k_tiles + c // 4  # 128 x 4 tiles, row-major, K-tiles fastest
    return tile * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4


def reference_by_offset(scales: np.ndarray) -> np.ndarray:
    """Scatter every scale of ``[..., MN, Kb]`` to its offset; untouched bytes stay PAD_BYTE."""
    *lead, mn, kb = scales.shape
    mn_p, kb_p = -(-mn // 128) * 128, -(-kb // 4) * 4
    out = np.full((*lead, mn_p * kb_p), PAD_BYTE, np.uint8)
    for idx in np.ndindex(*lead):
        for r, c in itertools.product(range(mn), range(kb)):
            out[idx + (offset(r, c, kb),)] = scales[idx + (r, c)]
    return out.reshape(*lead, mn_p // 128, kb_p // 4, 32, 16)


def reference_jax_tests(scales: np.ndarray) -> np.ndarray:
    """jax's ``format_scales`` (tests/mosaic/gpu_test.py:2455-2464 at cec06d11) in NumPy, per
    2-D slice; K/block padded to 4 here too (jax's test asserts it already is)."""
    *lead, mn, kb = scales.shape
    out = []
    for idx in np.ndindex(*lead):
        s = scales[idx]
        pad_mn, pad_k = (mn + 127) // 128 * 128, (kb + 3) // 4 * 4
        s = np.pad(s, ((0, pad_mn - mn), (0, pad_k - kb)))
        out.append(
            s.reshape(pad_mn // 128, 4, 32, pad_k // 4, 4)
            .transpose(0, 3, 2, 1, 4)
            .reshape(pad_mn // 128, pad_k // 4, 32, 16)
        )
    return np.stack(out).reshape(*lead, *out[0].shape)


def test_offsets_fill_each_tile_once():
    """The formula is a bijection from the padded (MNp, Kbp) grid onto the buffer."""
    mn, kb = 256, 8
    offs = {offset(r, c, kb) for r in range(mn) for c in range(kb)}
    assert offs == set(range(mn * kb))
    assert offset(0, 1, kb) == 1 and offset(32, 0, kb) == 4 and offset(1, 0, kb) == 16
    assert offset(0, 4, kb) == 512 and offset(128, 0, kb) == 2 * 512


@pytest.mark.parametrize("mn,kb", SHAPES)
def test_matches_offset_formula(mn, kb):
    s = random_scales((mn, kb), seed=mn * 31 + kb)
    got = np.asarray(to_mma_layout(s))
    assert got.dtype == np.uint8
    assert got.shape == mma_layout_shape(mn, kb) == (-(-mn // 128), -(-kb // 4), 32, 16)
    np.testing.assert_array_equal(got, reference_by_offset(s))


@pytest.mark.parametrize("lead", LEADING)
@pytest.mark.parametrize("mn,kb", [(200, 6), (128, 4)])
def test_leading_dims_and_jit(lead, mn, kb):
    s = random_scales((*lead, mn, kb), seed=len(lead))
    tiled = jax.jit(to_mma_layout)(s)
    ref = reference_by_offset(s)
    np.testing.assert_array_equal(np.asarray(tiled), ref)
    np.testing.assert_array_equal(np.asarray(tiled), reference_jax_tests(s))
    # each group on its own tiles: group g is exactly the 2-D layout of scales[g]
    for idx in np.ndindex(*lead):
        np.testing.assert_array_equal(np.asarray(tiled)[idx], reference_by_offset(s[idx]))
    back = jax.jit(from_mma_layout, static_argnums=(1, 2))(tiled, mn, kb)
    np.testing.assert_array_equal(np.asarray(back), s)


@pytest.mark.parametrize("mn,kb", SHAPES)
def test_matches_jax_format_scales(mn, kb):
    s = random_scales((mn, kb), seed=7 + mn + kb)
    np.testing.assert_array_equal(np.asarray(to_mma_layout(s)), reference_jax_tests(s))


@pytest.mark.parametrize("mn,kb", [(200, 6), (129, 5), (32, 17), (1, 1)])
def test_padding_is_pad_byte_and_round_trip(mn, kb):
    s = random_scales((mn, kb), seed=3)
    s[s == PAD_BYTE] = 1  # so that a pad byte can only come from padding
    tiled = np.asarray(to_mma_layout(s)).reshape(-1)
    real = {offset(r, c, kb) for r in range(mn) for c in range(kb)}
    pad = np.array(sorted(set(range(tiled.size)) - real), dtype=np.int64)
    mn_p, kb_p = -(-mn // 128) * 128, -(-kb // 4) * 4
    assert pad.size == mn_p * kb_p - mn * kb
    assert np.all(tiled[pad] == PAD_BYTE)
    assert np.all(tiled[sorted(real)] != PAD_BYTE)
    np.testing.assert_array_equal(np.asarray(from_mma_layout(to_mma_layout(s), mn, kb)), s)


def test_pad_byte_is_finite_in_both_scale_encodings():
    """0 is 2^-127 in E8M0 and +0 in E4M3 (finite: x 0 gives 0); E8M0's 1.0 (127) would be NaN
    as E4M3 and turn zero-padded NVFP4 blocks into NaN."""
    b = np.array([PAD_BYTE], np.uint8)
    assert float(b.view(ml_dtypes.float8_e8m0fnu)[0]) == 2.0**-127
    assert float(b.view(ml_dtypes.float8_e4m3fn)[0]) == 0.0
    assert np.isnan(float(np.array([127], np.uint8).view(ml_dtypes.float8_e4m3fn)[0]))


def test_inverse_of_tiled_input():
    """to_mma_layout(from_mma_layout(t)) == t for any t whose pad bytes are PAD_BYTE."""
    mn, kb = 200, 6
    t = np.asarray(to_mma_layout(random_scales((2, mn, kb), seed=11)))
    np.testing.assert_array_equal(np.asarray(to_mma_layout(from_mma_layout(t, mn, kb))), t)


def test_tiles_are_self_contained():
    """Tile (i, j) is the layout of rows 128i.. and scale columns 4j.. alone: what a kernel's
    BlockSpec ``(bmn // 128, bkb // 4, 32, 16)`` at ``(i, j, 0, 0)`` relies on."""
    s = random_scales((384, 12), seed=5)
    tiled = np.asarray(to_mma_layout(s))
    for i, j in np.ndindex(3, 3):
        sub = s[128 * i : 128 * (i + 1), 4 * j : 4 * (j + 1)]
        np.testing.assert_array_equal(tiled[i, j], np.asarray(to_mma_layout(sub))[0, 0])


@pytest.mark.parametrize("dtype", [jnp.float8_e8m0fnu, jnp.float8_e4m3fn])
def test_float8_scales_move_bit_for_bit(dtype):
    s = random_scales((130, 5), seed=2)
    x = jax.lax.bitcast_convert_type(jnp.asarray(s), dtype)
    tiled = to_mma_layout(x)
    assert tiled.dtype == dtype
    got = np.asarray(jax.lax.bitcast_convert_type(tiled, jnp.uint8))
    np.testing.assert_array_equal(got, reference_by_offset(s))
    back = jax.lax.bitcast_convert_type(from_mma_layout(tiled, 130, 5), jnp.uint8)
    np.testing.assert_array_equal(np.asarray(back), s)


def test_lowbit_scales_go_through():
    """The scales a QArray stores for an [M, K] operand quantized along K."""
    from lowbit.core.qarray import quantize

    x = jax.random.normal(jax.random.key(0), (130, 96))
    q = quantize(x, "nvfp4", axis=-1)
    assert q.scales.shape == (130, 6) and q.scales.dtype == jnp.uint8
    np.testing.assert_array_equal(
        np.asarray(to_mma_layout(q.scales)), reference_by_offset(np.asarray(q.scales))
    )


def test_reference_tells_plausible_wrong_layouts_apart():
    """The check can fail: near-miss layouts (the q/l order inside a tile swapped, M-tiles
    fastest, no transpose) all differ from the reference on random bytes."""
    s = random_scales((256, 8), seed=9)
    ref = reference_by_offset(s)
    x = s.reshape(2, 4, 32, 2, 4)
    wrong = [
        x.transpose(0, 3, 1, 2, 4).reshape(2, 2, 32, 16),  # (4, 32, 4) inside a tile
        x.transpose(3, 0, 2, 1, 4).reshape(2, 2, 32, 16),  # tiles M-fastest
        s.reshape(2, 2, 32, 16),  # plain row-major reshape
    ]
    for w in wrong:
        assert not np.array_equal(w, ref)


def test_bad_inputs():
    with pytest.raises(TypeError, match="one byte"):
        to_mma_layout(jnp.zeros((128, 4), jnp.float32))
    with pytest.raises(ValueError, match="MN, K/block"):
        to_mma_layout(jnp.zeros((4,), jnp.uint8))
    t = to_mma_layout(jnp.zeros((200, 6), jnp.uint8))
    with pytest.raises(ValueError, match="tiled must be"):
        from_mma_layout(t, 300, 6)
    with pytest.raises(ValueError, match="positive"):
        mma_layout_shape(0, 4)
