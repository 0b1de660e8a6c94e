"""The Hopper block-scaled matmul (pallas_kernels.hopper_matmul): what can be checked without
a Hopper GPU.

On any CPU: the argument checks (each error names its argument); the wrapper's operand
preparation against independent decodings (E2M1 codes to E4M3 bytes bit for bit against a table
written out here, the in-kernel decode included, and FP4's packing in pairs of blocks, which the
kernel decodes in shared memory; every format's FP8 elements times its float32 scales exactly
what ``lowbit.dequantize`` gives; NVFP4's padding of each block of 16 to a K step of 32 with
zeros); the kernel's block-scaled accumulation emulated from the prepared operands, in float64
and in the kernel's own float32 order (one partial sum per block of 32, scaled, added to a
float32 accumulator), against :func:`reference` within float32 accumulation error, and the same
check failing for NVFP4 without the padding (two blocks of 16 under one scale); the kernel
traced and lowered for CUDA through ``jax.export``.

With the CUDA plugin (``.venv-gpu``, ``JAX_PLATFORMS=cpu``): compiled for a device-less H100
(sm_90a), Mosaic GPU's PTX must hold ``wgmma.mma_async`` on ``.e4m3`` (``.e5m2`` for
``mxfp8_e5m2``) operands, and its ptxas log no spills.

The tests both Mosaic GPU kernels share are ``MosaicMatmulSpec``'s (tests/mosaic_base.py);
this file runs them for this kernel and adds its own.

Not here: running the kernel. Mosaic GPU has no interpret mode, so its numbers against
:func:`reference` need a Hopper GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import hopper_matmul as hm
from tests import mosaic_base as mb

FORMATS = hm.FORMATS
M, N, K = 128, 256, 256  # two M tiles, two N tiles, several K steps, M != N

# E2M1 code -> E4M3 byte: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (E4M3: bias 7, 3 mantissa bits), then the
# same with the sign bit (code 8, -0, is the byte 0x80).
E2M1_TO_E4M3 = [0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C]
E2M1_TO_E4M3 += [0x80 | b for b in E2M1_TO_E4M3]


def emulated_wgmma(a, b, sa, sb, t, *, dtype=np.float64) -> np.ndarray:
    """The kernel's sum: per K step of 32 a partial product of the FP8 elements, times the
    step's scale of each row of A and of B, added to the accumulator, all in ``dtype``
    (float32: the kernel's rounding points; float64: nearly exact); then the tensor scales."""
    ea, eb = mb.f64(a).astype(dtype), mb.f64(b).astype(dtype)
    sa, sb = mb.f64(sa).astype(dtype), mb.f64(sb).astype(dtype)
    acc = np.zeros((ea.shape[0], eb.shape[0]), dtype)
    for j in range(ea.shape[1] // 32):
        part = ea[:, j * 32 : (j + 1) * 32] @ eb[:, j * 32 : (j + 1) * 32].T
        acc = acc + part * sa[j][:, None] * sb[j][None, :]
    return acc * dtype(t[0]) if t is not None else acc


OTHER_COMPILES = {  # id -> compile_report's (args, kwargs); its wgmma has N = block_n
    "nvfp4-bfloat16-128": (("nvfp4", 128, 384, 512), dict(out_dtype="bfloat16", block_n=128)),
    "mxfp8_e4m3-float16-64": (("mxfp8_e4m3", 64, 64, 96), dict(out_dtype="float16", block_n=64)),
}


class TestHopperMatmul(mb.MosaicMatmulSpec):
    module = "pallas_kernels.hopper_matmul"
    formats = FORMATS
    matmul = staticmethod(hm.hopper_block_scaled_matmul)
    reference = staticmethod(hm.reference)
    prepare_operands = staticmethod(hm.prepare_operands)
    config = hm.Config
    block_m, block_n = 64, 128
    shape = (M, N, K)
    lowered = ["mxfp8_e5m2", "nvfp4"]
    small = ("mxfp6_e3m2", 64, 128, 64)
    twice = ("mxfp8_e4m3", 64, 128, 128)
    more_compiles = OTHER_COMPILES

    def kernel_errors(self):
        z = self.zeros
        return [
            ("int4", mb.changed(z(), fmt="int4"), ValueError, r"fmt='int4'"),
            ("FP6 bytes", mb.changed(z(fmt="mxfp6_e2m3"), a_codes=jnp.zeros((64, 97), jnp.uint8)),
             ValueError, r"a_scales has shape \(64, 4\); a_codes \(64, 97\)"),
            ("K", mb.changed(z(k=224), block_k=128), ValueError,
             r"k=224 must be a multiple of block_k=128"),
            ("K NVFP4", mb.changed(z(k=96, fmt="nvfp4"), block_k=128), ValueError,
             r"k=96 \(the kernel's K, NVFP4's K padded to 192\) must be a multiple of "
             r"block_k=128"),
            ("K NVFP4 pairs", z(k=48, fmt="nvfp4"), ValueError,
             r"k=48 must be a multiple of 32 for nvfp4"),
            ("block_m", mb.changed(z(m=128), block_m=128), ValueError, r"block_m=128 must be 64"),
            ("block_n", mb.changed(z(n=256), block_n=256), ValueError,
             r"block_n=256 must be a multiple of 8 in \[8, 128\]"),
            ("block_n odd", mb.changed(z(n=128), block_n=12), ValueError, r"block_n=12 must be"),
            ("block_k", mb.changed(z(k=256), block_k=48), ValueError,
             r"block_k=48 must be a multiple of 32"),
            ("block_k FP4", mb.changed(z(k=256, fmt="mxfp4"), block_k=32), ValueError,
             r"block_k=32 must be a multiple of 64 \(two FP8 wgmma K steps"),
            ("K FP4", z(k=96, fmt="mxfp4"), ValueError,
             r"k=96 must be a multiple of 64 for mxfp4"),
            ("shared memory", mb.changed(z(k=2048), block_k=512, num_stages=4), ValueError,
             r"num_stages=4 slots of block_k=512 .* bytes of shared memory"),
        ]

    def check_mma(self, report, fmt):
        t = FORMATS[fmt].ptx_type
        assert report["arch"] == ["sm_90a"]
        assert report["wgmma"] == [f"m64n128k32.f32.{t}.{t}"]

    # --- the format table -----------------------------------------------------------------

    def test_decode_and_padding(self, fmt):
        f = FORMATS[fmt]
        assert f.decoded == (f.bits < 8)
        assert f.ptx_type == ("e5m2" if fmt == "mxfp8_e5m2" else "e4m3")
        assert f.k_pad == (2 if fmt == "nvfp4" else 1)

    def test_wgmma_forms_reads_the_ptx_instructions(self):
        ptx = """
        wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1, %f2}, %rd1, %rd2, p, 1, 1;
        wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1, %f2}, %rd3, %rd4, p, 1, 1;
        wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;
        wgmma.fence.sync.aligned;
        """
        assert hm.wgmma_forms(ptx) == ["m64n128k32.f32.e4m3.e4m3", "m64n64k16.f32.bf16.bf16"]
        assert hm.wgmma_forms("no mma here") == []

    @pytest.mark.parametrize("fmt, k, block_k", [("mxfp8_e4m3", 1024, 128), ("nvfp4", 1024, 128),
                                                 ("mxfp4", 192, 64), ("nvfp4", 96, 64),
                                                 ("mxfp8_e5m2", 96, 32), ("mxfp6_e3m2", 64, 64)])
    def test_default_blocks(self, fmt, k, block_k):
        c = hm.get_default(fmt, 1024, 1024, k)
        assert (c.block_m, c.block_n, c.block_k) == (64, 128, block_k)
        assert c.num_stages == min(4, k * FORMATS[fmt].k_pad // block_k)
        assert hm.smem_bytes(c, fmt) <= 227 * 1024  # sm_90's opt-in shared memory per block

    # --- operand preparation --------------------------------------------------------------

    @pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
    def test_fp4_codes_decode_to_e4m3_bit_for_bit(self, fmt):
        """Every byte of packed E2M1 codes (low nibble first) becomes the two E4M3 bytes of the
        table above; for NVFP4 each block of 16 is followed by 16 zero bytes."""
        f = FORMATS[fmt]
        codes = jnp.arange(256, dtype=jnp.uint8).reshape(8, 32)  # every byte once, K = 64
        scales = jnp.full((8, 64 // f.block), 0x38 if f.tensor_scaled else 127, jnp.uint8)
        ts = dict(a_tensor_scale=1.0, b_tensor_scale=1.0) if f.tensor_scaled else {}
        a, *_ = hm.prepare_operands(codes, scales, codes, scales, fmt=fmt, **ts)
        assert a.dtype == jnp.float8_e4m3fn
        got = np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
        byte = np.arange(256).reshape(8, 32)
        want = np.stack(
            [np.take(E2M1_TO_E4M3, byte & 15), np.take(E2M1_TO_E4M3, byte >> 4)], axis=-1
        ).reshape(8, 64)
        if f.k_pad > 1:
            want = np.pad(want.reshape(8, 4, 16), ((0, 0), (0, 0), (0, 16))).reshape(8, 128)
        np.testing.assert_array_equal(got, want)

    def test_in_kernel_decode_is_the_table_bit_for_bit(self):
        """The decode the kernel runs on its registers (integer ops on 32-bit lanes), run
        here on every E2M1 code: the E4M3 byte of the table, and ml_dtypes' own cast."""
        got = np.asarray(hm.e2m1_to_e4m3_bits(jnp.arange(16, dtype=jnp.int32)))
        np.testing.assert_array_equal(got, E2M1_TO_E4M3)
        values = np.arange(16, dtype=np.uint8).view(jnp.float4_e2m1fn).astype(np.float32)
        np.testing.assert_array_equal(got, values.astype(jnp.float8_e4m3fn).view(np.uint8))

    @pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
    def test_kernel_reads_fp4_packed_in_pairs_of_blocks(self, fmt):
        """kernel_inputs keeps FP4 packed, half a byte a code of the kernel's K: decoding K
        step block j as the kernel does (the low nibbles of pair j // 2 for even j, the high
        ones for odd j, through the table above) gives prepare_operands' E4M3 elements of
        that block exactly (NVFP4: padding included), and the scales are the same."""
        qa, qb = mb.quantized(fmt, M, N, K, seed=3)
        kw = mb.operands(qa, qb)
        packed = mb.call(hm.kernel_inputs, kw)
        elements = mb.call(hm.prepare_operands, kw)
        kk = K * FORMATS[fmt].k_pad
        for x, e, rows in ((packed[0], elements[0], M), (packed[1], elements[1], N)):
            assert x.dtype == jnp.uint8 and x.shape == (rows, kk // 2)
            x, e = np.asarray(x), np.asarray(jax.lax.bitcast_convert_type(e, jnp.uint8))
            for j in range(kk // 32):
                pair = x[:, (j // 2) * 32 : (j // 2 + 1) * 32]
                nibbles = pair & 15 if j % 2 == 0 else pair >> 4
                np.testing.assert_array_equal(np.take(E2M1_TO_E4M3, nibbles),
                                              e[:, j * 32 : (j + 1) * 32])
        for got, want in zip(packed[2:4], elements[2:4], strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_prepared_operands_decode_to_lowbits_values(self, fmt):
        """FP8 elements times float32 scales (one per K step of 32, transposed) ==
        lowbit.dequantize, exactly (NVFP4: the padding removed, the tensor scale set to 1,
        which the kernel applies to the sum instead)."""
        qa, qb = mb.quantized(fmt, M, N, K)
        f = FORMATS[fmt]
        a, b, sa, sb, t = mb.call(hm.prepare_operands, mb.operands(qa, qb))
        kk = K * f.k_pad
        assert (a.shape, b.shape) == ((M, kk), (N, kk))
        assert (sa.shape, sb.shape) == ((kk // 32, M), (kk // 32, N))
        assert a.dtype == b.dtype == jnp.dtype(f.mma_dtype)
        assert sa.dtype == sb.dtype == jnp.float32
        for elements, scales, q, rows in ((a, sa, qa, M), (b, sb, qb, N)):
            e = mb.f64(elements).reshape(rows, kk // 32, 32)
            if f.k_pad > 1:
                assert np.all(e[:, :, 16:] == 0)
                e = e[:, :, :16]
            got = (e * mb.f64(scales).T[:, :, None]).reshape(rows, K)
            np.testing.assert_array_equal(got, mb.dequantized(mb.unit_tensor_scale(q)))
        mb.check_tensor_scale_product(t, qa, qb)

    def test_mxfp8_codes_are_passed_as_they_are(self):
        qa, qb = mb.quantized("mxfp8_e5m2", 64, 64, 64)
        a, b, *_ = mb.call(hm.prepare_operands, mb.operands(qa, qb))
        np.testing.assert_array_equal(jax.lax.bitcast_convert_type(a, jnp.uint8), qa.codes)
        np.testing.assert_array_equal(jax.lax.bitcast_convert_type(b, jnp.uint8), qb.codes)

    def test_emulated_kernel_matches_reference(self, fmt):
        qa, qb = mb.quantized(fmt, M, N, K, seed=1)
        kw = mb.operands(qa, qb)
        prepared = mb.call(hm.prepare_operands, kw)
        ref = mb.f64(mb.call(hm.reference, kw))
        for dtype in (np.float64, np.float32):
            got = emulated_wgmma(*prepared, dtype=dtype)
            assert mb.fraction_off(got, ref, qa, qb, K) == 0, dtype

    def test_emulated_kernel_check_catches_nvfp4_without_padding(self):
        """The check above can fail: NVFP4's two blocks of 16 of a K step of 32 under the first
        block's scale (what a kernel without the padding would compute) are far off."""
        qa, qb = mb.quantized("nvfp4", M, N, K, seed=2)
        kw = mb.operands(qa, qb)
        a, b, sa, sb, t = mb.call(hm.prepare_operands, kw)
        def unpad(e):  # each K step of 32 back to its block of 16
            return e.reshape(e.shape[0], -1, 32)[:, :, :16].reshape(e.shape[0], -1)

        bad = emulated_wgmma(unpad(a), unpad(b), sa[::2], sb[::2], t)
        assert mb.fraction_off(bad, mb.f64(mb.call(hm.reference, kw)), qa, qb, K) > 0.5

    # --- device-less compile for an H100 (CUDA plugin only) -------------------------------

    @mb.needs_plugin
    @pytest.mark.parametrize("case", sorted(OTHER_COMPILES))
    def test_compiles_other_shapes_and_out_dtypes(self, case, reports):
        r = reports[case]
        block_n = OTHER_COMPILES[case][1]["block_n"]
        assert r["wgmma"] == [f"m64n{block_n}k32.f32.e4m3.e4m3"]
        assert (r["spill_stores"], r["spill_loads"]) == (0, 0)

    def test_compile_report_is_for_hopper_only(self):
        """wgmma is sm_90a only: a B200 target is refused before anything is compiled."""
        with pytest.raises(ValueError, match=r"target='b200'.*Hopper only"):
            hm.compile_report("mxfp8_e4m3", 64, 128, 128, target="b200")
