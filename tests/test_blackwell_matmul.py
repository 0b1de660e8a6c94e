"""The Blackwell block-scaled matmul (pallas_kernels.blackwell_matmul): what can be checked
without a Blackwell GPU.

On any CPU: the argument checks (each error names its argument); the wrapper's operand
preparation against independent decodings (the codes bitcast to float8 / float4 decode, with
the scales, to exactly what ``lowbit.dequantize`` gives; the scale tiles hold every scale at
the byte offset of cuBLAS's 1D block-scaling layout, written out here in NumPy); the MMA's sum
emulated in float64 from the prepared operands against :func:`reference` within float32
accumulation error (and a nibble-swapped operand must fail that check); the kernel traced
(``jax.eval_shape``) and lowered for CUDA through ``jax.export``.

With the CUDA plugin (``.venv-gpu``, ``JAX_PLATFORMS=cpu``): compiled for a device-less B200,
the PTX must hold the block-scaled ``tcgen05.mma`` kind of each format, with no spills.

The tests both Mosaic GPU kernels share are ``MosaicMatmulSpec``'s (tests/mosaic_base.py);
this file runs them for this kernel and adds its own.

Not here: running the kernel. Mosaic GPU has no interpret mode for TMEM / ``tcgen05``, so
its numbers against :func:`reference` need a Blackwell GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blackwell_matmul as bw
from pallas_kernels.mma_scales import from_mma_layout
from tests import mosaic_base as mb

FORMATS = bw.FORMATS
M, N, K = 256, 384, 512  # two M tiles, three N tiles, several K-steps, M != N


def tile_offsets(mn: int, k_blocks: int) -> np.ndarray:
    """Flat byte offset of every scale (r, c) in the tiled buffer: 128 x 4 tiles, K-tiles
    fastest, inside a tile (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4 (cuBLAS's "1D block
    scaling factors layout", CUTLASS's SfKMajorAtom)."""
    r, c = np.meshgrid(np.arange(mn), np.arange(k_blocks), indexing="ij")
    k_tiles = -(-k_blocks // 4)
    return ((r // 128) * k_tiles + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4


def block_values(elements, scale_tiles, mn: int, k: int, block: int) -> np.ndarray:
    """float64 elements times their block scales, decoded independently of lowbit: the element
    and scale dtypes' own casts (ml_dtypes), the scales read back by byte offset."""
    e = mb.f64(elements)
    flat = np.asarray(scale_tiles).reshape(-1)  # float8 scale dtype, tiled
    s = flat[tile_offsets(mn, k // block)].astype(np.float64)
    return e * np.repeat(s, block, axis=1)


def emulated_mma(a, b, sa, sb, t, rows_a, rows_b, k, block) -> np.ndarray:
    """What the kernel computes, in float64: sum over K of both block-scaled operands, times
    the tensor scales' product."""
    va = block_values(a, sa, rows_a, k, block)
    vb = block_values(b, sb, rows_b, k, block)
    c = va @ vb.T
    return c * float(t[0]) if t is not None else c


OTHER_COMPILES = {  # id -> compile_report's (args, kwargs)
    "nvfp4-bfloat16": (("nvfp4", 256, 384, 512), dict(out_dtype="bfloat16")),
    "mxfp8_e4m3-float16": (("mxfp8_e4m3", 128, 256, 128), dict(out_dtype="float16")),
    "mxfp4-float32": (("mxfp4", 384, 128, 256), dict(out_dtype="float32")),
}


class TestBlackwellMatmul(mb.MosaicMatmulSpec):
    module = "pallas_kernels.blackwell_matmul"
    formats = FORMATS
    matmul = staticmethod(bw.blackwell_block_scaled_matmul)
    reference = staticmethod(bw.reference)
    prepare_operands = staticmethod(bw.prepare_operands)
    config = bw.Config
    block_m, block_n = 128, 128
    shape = (M, N, K)
    small = ("nvfp4", 128, 128, 256)
    twice = ("mxfp4", 128, 128, 256)
    more_compiles = OTHER_COMPILES

    def kernel_errors(self):
        z = self.zeros
        return [
            ("mxfp6", mb.changed(z(), fmt="mxfp6_e2m3"), ValueError, r"fmt='mxfp6_e2m3'.*MXFP6"),
            ("K", z(k=320), ValueError, r"k=320 must be a multiple of block_k=128"),
            ("K FP4", z(k=160, fmt="mxfp4"), ValueError,
             r"k=160 must be a multiple of block_k=128"),
            ("K NVFP4", z(k=96, fmt="nvfp4"), ValueError, r"k=96 must be a multiple of block_k=64"),
            ("block_m", mb.changed(z(m=256), block_m=256), ValueError, r"block_m=256 must be 128"),
            ("block_n", mb.changed(z(n=256), block_n=256), ValueError, r"block_n=256 must be 128"),
            ("block_k blocks", mb.changed(z(k=256), block_k=96), ValueError,
             r"block_k=96 must be a multiple of 128"),
            ("block_k swizzle", mb.changed(z(k=384 * 2, fmt="nvfp4"), block_k=192), ValueError,
             r"block_k=192 gives rows of 96 bytes"),
        ]

    def check_mma(self, report, fmt):
        assert report["kinds"] == [FORMATS[fmt].ptx_kind]
        assert report["expected_kind"].endswith(".block_scale")

    # --- the format table -----------------------------------------------------------------

    def test_scale_dtypes(self, fmt):
        assert jnp.dtype(FORMATS[fmt].scale_dtype) == (
            jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.float8_e8m0fnu)

    def test_mma_kinds_reads_the_ptx_qualifiers(self):
        ptx = """
        tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%r1], %rd2, %rd3;
        tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%r1], %rd4, %rd5;
        tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd2, %rd3, %r4, %p1;
        tcgen05.cp.cta_group::1.32x128b.warpx4 [%r7], %rd8;
        """
        assert bw.mma_kinds(ptx) == ["kind::f16", "kind::mxf8f6f4.block_scale"]
        assert bw.mma_kinds("no mma here") == []

    @pytest.mark.parametrize("fmt, k, block_k", [("mxfp8_e4m3", 1024, 128), ("mxfp4", 1024, 256),
                                                 ("nvfp4", 1024, 256), ("mxfp4", 384, 128),
                                                 ("nvfp4", 64 * 3, 64)])
    def test_default_blocks(self, fmt, k, block_k):
        c = bw.get_default(fmt, 1024, 1024, k)
        assert (c.block_m, c.block_n, c.block_k) == (128, 128, block_k)
        assert c.num_stages == min(4, k // block_k)
        assert bw.smem_bytes(c, fmt) <= 227 * 1024  # sm_100's opt-in shared memory per block

    # --- operand preparation --------------------------------------------------------------

    def test_prepared_operands_decode_to_lowbits_values(self, fmt):
        """Bitcast codes times tiled scales == lowbit.dequantize, exactly (for NVFP4: with the
        tensor scale set to 1, which the kernel applies to the sum instead)."""
        qa, qb = mb.quantized(fmt, M, N, K)
        f = FORMATS[fmt]
        a, b, sa, sb, t = mb.call(bw.prepare_operands, mb.operands(qa, qb))
        assert (a.shape, b.shape) == ((M, K), (N, K))
        assert a.dtype == b.dtype == jnp.dtype(f.elem_dtype)
        assert sa.shape == (M // 128, K // f.block // 4, 32, 16)
        assert sb.shape == (N // 128, K // f.block // 4, 32, 16)
        assert sa.dtype == sb.dtype == jnp.dtype(f.scale_dtype)
        for elements, tiles, q, rows in ((a, sa, qa, M), (b, sb, qb, N)):
            got = block_values(elements, tiles, rows, K, f.block)
            np.testing.assert_array_equal(got, mb.dequantized(mb.unit_tensor_scale(q)))
            # and the tiles are the QArray's scales, byte for byte, in the MMA's order
            tiles_u8 = jax.lax.bitcast_convert_type(tiles, jnp.uint8)
            np.testing.assert_array_equal(from_mma_layout(tiles_u8, rows, K // f.block),
                                          q.scales)
        mb.check_tensor_scale_product(t, qa, qb)

    def test_fp4_codes_unpack_low_nibble_first(self):
        """The byte 0x21 holds codes 1 (0.5) then 2 (1.0): element 2i is the low nibble, as in
        lowbit's packing and the MMA's FP4 operand layout."""
        codes = jnp.full((128, 64), 0x21, jnp.uint8)
        a, *_ = bw.prepare_operands(codes, jnp.full((128, 4), 127, jnp.uint8), codes,
                                    jnp.full((128, 4), 127, jnp.uint8), fmt="mxfp4")
        np.testing.assert_array_equal(mb.f64(a[0, :4]), [0.5, 1, 0.5, 1])

    def test_emulated_kernel_matches_reference(self, fmt):
        qa, qb = mb.quantized(fmt, M, N, K, seed=1)
        kw = mb.operands(qa, qb)
        got = emulated_mma(*mb.call(bw.prepare_operands, kw), M, N, K, FORMATS[fmt].block)
        assert mb.fraction_off(got, mb.f64(mb.call(bw.reference, kw)), qa, qb, K) == 0

    @pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
    def test_emulated_kernel_check_catches_swapped_nibbles(self, fmt):
        """The check above can fail: FP4 codes with their nibbles swapped (high first) are far
        off."""
        qa, qb = mb.quantized(fmt, M, N, K, seed=2)
        kw = mb.operands(qa, qb)
        swapped = (qa.codes >> 4) | (qa.codes << 4)
        bad = emulated_mma(*mb.call(bw.prepare_operands, mb.changed(kw, a_codes=swapped)), M, N, K,
                           FORMATS[fmt].block)
        assert mb.fraction_off(bad, mb.f64(mb.call(bw.reference, kw)), qa, qb, K) > 0.5

    # --- device-less compile for a B200 (CUDA plugin only) --------------------------------

    @mb.needs_plugin
    @pytest.mark.parametrize("case", sorted(OTHER_COMPILES))
    def test_compiles_other_shapes_and_out_dtypes(self, case, reports):
        r = reports[case]
        assert r["kinds"] == [FORMATS[r["fmt"]].ptx_kind]
        assert (r["spill_stores"], r["spill_loads"]) == (0, 0)
