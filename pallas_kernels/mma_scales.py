"""Block scales in the tiled layout of Blackwell's block-scaled MMA (``tcgen05.mma``).

Why. ``tcgen05.mma`` with ``a_scale`` / ``b_scale`` reads the block scales from tensor memory
(TMEM), and Mosaic GPU fills TMEM from shared memory with ``tcgen05.cp .32x128b .warpx4``: each
copy moves one 32-row x 16-byte slab and replicates it to the four 32-lane quarters of TMEM.
Row ``32 q + l`` of the operand finds its 4 scales (4 consecutive blocks along K) in bytes
``4 q .. 4 q + 3`` of slab row ``l`` (jax's ``scales_layout()``: the factor 4 over rows is
spread over 4 consecutive TMEM columns, not over the quarters), so 128 rows x 4 scale
columns make one 512-byte tile. A QArray stores the scales of an ``[MN, K]`` operand
quantized along K row-major as ``scales_MKb`` (``[MN, K / block]``, one byte per block: E8M0
for MX, unsigned E4M3 for NVFP4); :func:`to_mma_layout` rearranges them into those tiles and
:func:`from_mma_layout` undoes it. The layout depends on neither the block size (16 or 32)
nor the scale encoding: it only moves bytes.

Layout. Pad ``MN`` to ``MNp = 128 * ceil(MN / 128)`` and ``Kb = K / block`` to
``Kbp = 4 * ceil(Kb / 4)``; the result is the C-contiguous array of shape
``(MNp / 128, Kbp / 4, 32, 16)`` (uint8), in which scale ``(r, c)`` sits at flat byte offset::

    offset(r, c) = ((r // 128) * (Kbp // 4) + c // 4) * 512      # tiles, K-tiles fastest
                   + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4  # inside a 512-byte tile

that is ``tiled[r // 128, c // 4, r % 32, 4 * ((r // 32) % 4) + c % 4] = scales[r, c]``.
Leading dims (groups, batch) stay in front, ``[..., MN, Kb] -> [..., MNp/128, Kbp/4, 32, 16]``:
each group starts on a tile of its own, as grouped GEMMs need.

Sources (read, not copied):

- jax-ml/jax, the Mosaic GPU tcgen05 path that ``plgpu.async_copy_scales_to_tmem`` lowers to.
  ``jax/experimental/mosaic/gpu/tcgen05.py`` of the installed jax 0.10.2, lines 1614-1640
  (``async_copy_scales_smem_to_tmem``: the SMEM ref "must be contiguous with shape
  ``(MN // 128, K // 4, 32, 16)``", with a pad / reshape ``(MNp//128, 4, 32, Kb//4, 4)`` /
  transpose ``(0, 3, 2, 1, 4)`` recipe), 1706 (the shape check), 1728 (tile ``(i, j)`` goes to
  TMEM column ``4 * (MNp/128 * j + i)``), 1077 (``scales_layout()``, TMEM ``(MNp, Kb)``); the
  same at commit cec06d116c05f0d52adfceee3d3b730fdbcb0ce5, lines 1818-1844, 1910, 1932, 1146.
  Its tests lay scales out that way before ``tcgen05_mma(..., a_scale=, b_scale=)``:
  ``tests/mosaic/gpu_test.py:2455-2464`` (``format_scales``, zero padding of MN),
  ``tests/pallas/mosaic_gpu_test.py:6323-6330`` (Pallas; FP8 and FP4 operands, E8M0 scales,
  blocks of 16 and 32) and ``:6479-6486`` (E4M3 scales, blocks of 16, as NVFP4) at that
  commit. The copy's docstring cites the PTX ISA, "scale factor A layout 1X":
  https://docs.nvidia.com/cuda/parallel-thread-execution/#tcgen05-mma-scale-factor-a-layout-1x
- NVIDIA/cutlass at commit 7107b05535f8977f5ecb9d01ee203205b1fd9bc4,
  ``include/cutlass/detail/sm100_blockscaled_layout.hpp:54-55`` (``SfKMajorAtom``: rows
  ``(32, 4) : (16, 4)``, scale columns ``(SFVecSize, 4) : (0, 1)``) and ``:93, :97``
  (``tile_to_shape(SfAtom, (M, K[, L]), Step<_2, _1[, _3]>)``: K-tiles fastest, batch L
  outermost). CUTLASS indexes by element ``k`` (stride 0 over the ``SFVecSize`` elements of a
  block); indexed by scale column ``c = k // SFVecSize`` it is the formula above.
- cuBLAS, "1D Block Scaling Factors Layout" (VEC32_UE8M0 / VEC16_UE4M3 scale modes):
  https://docs.nvidia.com/cuda/cublas/#d-block-scaling-factors-layout. Same 128 x 4 tiles,
  same ``(32, 4, 4)`` order inside a tile (row % 32, then row // 32, then column), same
  row-major order of tiles: the flat bytes of :func:`to_mma_layout` are cuBLAS's buffer. jax's
  4-D shape is only a view of it, ``(32, 16)`` being ``(32, 4 x 4)``; nothing is transposed.

Padding. Pad bytes are :data:`PAD_BYTE` = 0, as in jax's tests. It is finite in both scale
encodings (E8M0 0x00 = 2^-127, E4M3 0x00 = +0), so a padded row or block multiplies
zero-padded operand elements (QArray zero-pads K to the block; a kernel zero-fills the rest of
its tile) and adds exactly 0; padded MN rows only reach accumulator rows or columns beyond the
real output. E8M0's 1.0 (127) is no good: 0x7F is NaN in E4M3, and NaN x 0 = NaN.

In a kernel, one ``(bmn, bk)`` operand block takes scale block ``(bmn // 128, bk // block // 4,
32, 16)`` at index ``(i, k, 0, 0)``; jax 0.10.2's copy takes at most 2 MN tiles (MN <= 256,
tcgen05.py:1720) and a multiple of 4 scale columns, hence the padding of K/block.

>>> import jax.numpy as jnp
>>> s = (jnp.arange(200 * 6) % 256).astype(jnp.uint8).reshape(200, 6)  # MN 200, K/block 6
>>> t = to_mma_layout(s)
>>> t.shape, int(t[1, 0, 8, 4 * 1 + 2]) == int(s[128 + 32 + 8, 2])  # row 168, column 2
((2, 2, 32, 16), True)
>>> bool(jnp.all(from_mma_layout(t, 200, 6) == s))
True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["PAD_BYTE", "ROWS", "COLS", "mma_layout_shape", "to_mma_layout", "from_mma_layout"]

PAD_BYTE = 0  # finite in E8M0 (2^-127) and in E4M3 (+0); see the module docstring
ROWS = 128  # MN rows per tile (the 128 lanes of TMEM)
COLS = 4  # scale columns (blocks along K) per tile


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mma_layout_shape(mn: int, k_blocks: int) -> tuple[int, int, int, int]:
    """The tiled shape for ``mn`` rows of ``k_blocks`` scales: ``(MNp/128, Kbp/4, 32, 16)``.

    >>> mma_layout_shape(200, 6)
    (2, 2, 32, 16)
    """
    if mn < 1 or k_blocks < 1:
        raise ValueError(f"{mn=} and {k_blocks=} must be positive")
    return (_cdiv(mn, ROWS), _cdiv(k_blocks, COLS), 32, 16)


def _as_bytes(x: jax.Array, name: str) -> jax.Array:
    """``x`` as uint8 (scales are one byte each; float8 scale dtypes are bitcast, not cast)."""
    x = jnp.asarray(x)
    if x.dtype.itemsize != 1:
        raise TypeError(f"{name} must hold one byte per scale (uint8 or float8), got {x.dtype}")
    return x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)


def _from_bytes(x: jax.Array, dtype) -> jax.Array:
    return x if dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, dtype)


def _swap_tile_axes(lead: int) -> tuple[int, ...]:
    """Axes ``(..., a, b, c, d, e) -> (..., a, d, c, b, e)``: its own inverse."""
    return (*range(lead), lead, lead + 3, lead + 2, lead + 1, lead + 4)


def to_mma_layout(scales_MKb: jax.Array) -> jax.Array:
    """Row-major scales ``[..., MN, K/block]`` -> MMA tiles ``[..., MNp/128, Kbp/4, 32, 16]``.

    Pads MN to a multiple of 128 and K/block to a multiple of 4 with :data:`PAD_BYTE`; keeps the
    dtype (uint8, or a float8 scale dtype, moved bit for bit). A pad, reshapes and one
    transpose: runs under ``jax.jit``, before the ``pallas_call`` that consumes it.
    """
    dtype = jnp.asarray(scales_MKb).dtype
    x = _as_bytes(scales_MKb, "scales_MKb")
    if x.ndim < 2:
        raise ValueError(f"scales_MKb must be [..., MN, K/block], got shape {x.shape}")
    *lead, mn, kb = x.shape
    mn_tiles, kb_tiles, _, _ = mma_layout_shape(mn, kb)
    pad = [(0, 0)] * len(lead) + [(0, mn_tiles * ROWS - mn), (0, kb_tiles * COLS - kb)]
    x = jnp.pad(x, pad, constant_values=PAD_BYTE)
    # row r = 128 i + 32 q + l, column c = 4 j + u:  (i, q, l, j, u) -> (i, j, l, q, u)
    x = x.reshape(*lead, mn_tiles, ROWS // 32, 32, kb_tiles, COLS)
    x = x.transpose(_swap_tile_axes(len(lead)))
    return _from_bytes(x.reshape(*lead, mn_tiles, kb_tiles, 32, 16), dtype)


def from_mma_layout(tiled: jax.Array, mn: int, k_blocks: int) -> jax.Array:
    """The inverse of :func:`to_mma_layout`: ``[..., MNp/128, Kbp/4, 32, 16] -> [..., mn, Kb]``.

    ``mn`` and ``k_blocks`` are the unpadded sizes; the padding is dropped. Keeps the dtype.
    """
    dtype = jnp.asarray(tiled).dtype
    x = _as_bytes(tiled, "tiled")
    want = mma_layout_shape(mn, k_blocks)
    if x.ndim < 4 or tuple(x.shape[-4:]) != want:
        raise ValueError(f"tiled must be [..., *{want}] for {mn=}, {k_blocks=}; got {x.shape}")
    *lead, mn_tiles, kb_tiles, _, _ = x.shape
    x = x.reshape(*lead, mn_tiles, kb_tiles, 32, ROWS // 32, COLS)
    x = x.transpose(_swap_tile_axes(len(lead)))
    x = x.reshape(*lead, mn_tiles * ROWS, kb_tiles * COLS)
    return _from_bytes(x[..., :mn, :k_blocks], dtype)
