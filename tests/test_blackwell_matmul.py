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

Not here: running the kernel. Mosaic GPU has no interpret mode for TMEM / ``tcgen05``, so
its numbers against :func:`reference` need a Blackwell GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from pallas_kernels import aot
from pallas_kernels.blackwell_matmul import (
    FORMATS,
    Config,
    blackwell_block_scaled_matmul,
    compile_report,
    get_default,
    mma_kinds,
    prepare_operands,
    reference,
    smem_bytes,
)
from pallas_kernels.mma_scales import from_mma_layout

FMTS = sorted(FORMATS)
M, N, K = 256, 384, 512  # two M tiles, three N tiles, several K-steps, M != N


def quantized(fmt: str, m: int = M, n: int = N, k: int = K, seed: int = 0):
    """x [m, k] and w [n, k], both quantized along K (the last axis) with lowbit."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    # rows of different magnitudes, so that scales differ from block to block and row to row
    w = jax.random.normal(kw, (n, k), jnp.float32) * jnp.exp2(jnp.arange(n) % 7 - 3.0)[:, None]
    return lb.quantize(x, fmt, axis=-1), lb.quantize(w, fmt, axis=-1)


def operands(qa, qb) -> dict:
    """The kernel's arguments from two QArrays."""
    kw = dict(a_codes=qa.codes, a_scales=qa.scales, b_codes=qb.codes, b_scales=qb.scales,
              fmt=qa.format_name)
    if qa.tensor_scale is not None:
        kw.update(a_tensor_scale=qa.tensor_scale, b_tensor_scale=qb.tensor_scale)
    return kw


def call(fn, kw):
    kw = dict(kw)
    args = [kw.pop(n) for n in ("a_codes", "a_scales", "b_codes", "b_scales")]
    return fn(*args, **kw)


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
    e = np.asarray(elements.astype(jnp.float32), np.float64)
    flat = np.asarray(scale_tiles).reshape(-1)  # float8 scale dtype, tiled
    s = flat[tile_offsets(mn, k // block)].astype(np.float64)
    return e * np.repeat(s, block, axis=1)


# --------------------------------------------------------------------------------------------
# The format table


@pytest.mark.parametrize("fmt", FMTS)
def test_format_table_agrees_with_lowbit(fmt):
    f, lf = FORMATS[fmt], lb.formats.get(fmt)
    assert f.block == lf.block_size
    assert f.bits == lf.elem.bits
    assert f.tensor_scaled == (fmt == "nvfp4")
    assert jnp.dtype(f.scale_dtype) == (jnp.float8_e4m3fn if fmt == "nvfp4"
                                        else jnp.float8_e8m0fnu)


def test_mma_kinds_reads_the_ptx_qualifiers():
    ptx = """
    tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%r1], %rd2, %rd3;
    tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X [%r1], %rd4, %rd5;
    tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd2, %rd3, %r4, %p1;
    tcgen05.cp.cta_group::1.32x128b.warpx4 [%r7], %rd8;
    """
    assert mma_kinds(ptx) == ["kind::f16", "kind::mxf8f6f4.block_scale"]
    assert mma_kinds("no mma here") == []


# --------------------------------------------------------------------------------------------
# Argument checks


def _mx(m=128, n=128, k=128, fmt="mxfp8_e4m3"):
    f = FORMATS[fmt]
    u8 = jnp.uint8
    return dict(a_codes=jnp.zeros((m, k * f.bits // 8), u8),
                a_scales=jnp.zeros((m, k // f.block), u8),
                b_codes=jnp.zeros((n, k * f.bits // 8), u8),
                b_scales=jnp.zeros((n, k // f.block), u8), fmt=fmt)


def _with(kw, **changes):
    return {**kw, **changes}


ERRORS = [
    ("unknown format", _with(_mx(), fmt="mxfp9"), ValueError, r"fmt='mxfp9'.*expected one of"),
    ("mxfp6", _with(_mx(), fmt="mxfp6_e2m3"), ValueError, r"fmt='mxfp6_e2m3'.*MXFP6"),
    ("codes not uint8", _with(_mx(), a_codes=jnp.zeros((128, 128), jnp.int8)), TypeError,
     r"a_codes must be uint8"),
    ("codes 3-D", _with(_mx(), b_codes=jnp.zeros((1, 128, 128), jnp.uint8)), ValueError,
     r"b_codes must be 2-D"),
    ("scales shape", _with(_mx(), a_scales=jnp.zeros((128, 5), jnp.uint8)), ValueError,
     r"a_scales has shape \(128, 5\).*needs \(128, 4\)"),
    ("scales rows", _with(_mx(), b_scales=jnp.zeros((64, 4), jnp.uint8)), ValueError,
     r"b_scales has shape \(64, 4\)"),
    ("scales two bytes", _with(_mx(), a_scales=jnp.zeros((128, 4), jnp.uint16)), TypeError,
     r"a_scales must hold one byte"),
    ("K differs", _with(_mx(), b_codes=jnp.zeros((128, 256), jnp.uint8),
                        b_scales=jnp.zeros((128, 8), jnp.uint8)), ValueError,
     r"different K \(128 and 256\)"),
    ("M", _mx(m=192), ValueError, r"m=192 must be a multiple of block_m=128"),
    ("N", _mx(n=160), ValueError, r"n=160 must be a multiple of block_n=128"),
    ("K", _mx(k=320), ValueError, r"k=320 must be a multiple of block_k=128"),
    ("K FP4", _mx(k=160, fmt="mxfp4"), ValueError, r"k=160 must be a multiple of block_k=128"),
    ("K NVFP4", _with(_mx(k=96, fmt="nvfp4"), a_tensor_scale=1.0, b_tensor_scale=1.0),
     ValueError, r"k=96 must be a multiple of block_k=64"),
    ("block_m", _with(_mx(m=256), block_m=256), ValueError, r"block_m=256 must be 128"),
    ("block_n", _with(_mx(n=256), block_n=256), ValueError, r"block_n=256 must be 128"),
    ("block_k blocks", _with(_mx(k=256), block_k=96), ValueError,
     r"block_k=96 must be a multiple of 128"),
    ("block_k swizzle", _with(_mx(k=384 * 2, fmt="nvfp4"), block_k=192,
                              a_tensor_scale=1.0, b_tensor_scale=1.0), ValueError,
     r"block_k=192 gives rows of 96 bytes"),
    ("num_stages", _with(_mx(), num_stages=0), ValueError, r"num_stages=0 must be at least 1"),
    ("nvfp4 without tensor scale", _with(_mx(fmt="nvfp4", k=256), a_tensor_scale=1.0),
     ValueError, r"b_tensor_scale is required for nvfp4"),
    ("tensor scale for MX", _with(_mx(), a_tensor_scale=1.0), ValueError,
     r"a_tensor_scale is only for NVFP4"),
    ("tensor scale not scalar", _with(_mx(fmt="nvfp4", k=256), a_tensor_scale=jnp.ones(2),
                                      b_tensor_scale=1.0), ValueError,
     r"a_tensor_scale must be a scalar"),
    ("out_dtype", _with(_mx(), out_dtype=jnp.int32), ValueError, r"out_dtype must be"),
]


@pytest.mark.parametrize("kw, error, match", [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_bad_arguments_raise_naming_them(kw, error, match):
    with pytest.raises(error, match=match):
        call(blackwell_block_scaled_matmul, kw)


def test_reference_checks_its_arguments_too():
    with pytest.raises(ValueError, match=r"b_tensor_scale is required"):
        call(reference, _with(_mx(fmt="nvfp4", k=256), a_tensor_scale=1.0))
    with pytest.raises(ValueError, match=r"a_scales has shape"):
        call(reference, _with(_mx(), a_scales=jnp.zeros((128, 3), jnp.uint8)))


@pytest.mark.parametrize("fmt, k, block_k", [("mxfp8_e4m3", 1024, 128), ("mxfp4", 1024, 256),
                                             ("nvfp4", 1024, 256), ("mxfp4", 384, 128),
                                             ("nvfp4", 64 * 3, 64)])
def test_default_blocks(fmt, k, block_k):
    c = get_default(fmt, 1024, 1024, k)
    assert (c.block_m, c.block_n, c.block_k) == (128, 128, block_k)
    assert c.num_stages == min(4, k // block_k)
    assert smem_bytes(c, fmt) <= 227 * 1024  # sm_100's opt-in shared memory per block


# --------------------------------------------------------------------------------------------
# Operand preparation


@pytest.mark.parametrize("fmt", FMTS)
def test_prepared_operands_decode_to_lowbits_values(fmt):
    """Bitcast codes times tiled scales == lowbit.dequantize, exactly (for NVFP4: with the
    tensor scale set to 1, which the kernel applies to the sum instead)."""
    qa, qb = quantized(fmt)
    f = FORMATS[fmt]
    a, b, sa, sb, t = call(prepare_operands, operands(qa, qb))
    assert (a.shape, b.shape) == ((M, K), (N, K))
    assert a.dtype == b.dtype == jnp.dtype(f.elem_dtype)
    assert sa.shape == (M // 128, K // f.block // 4, 32, 16)
    assert sb.shape == (N // 128, K // f.block // 4, 32, 16)
    assert sa.dtype == sb.dtype == jnp.dtype(f.scale_dtype)
    for elements, tiles, q, rows in ((a, sa, qa, M), (b, sb, qb, N)):
        got = block_values(elements, tiles, rows, K, f.block)
        if q.tensor_scale is not None:
            q = dataclasses.replace(q, tensor_scale=jnp.float32(1.0))
        want = np.asarray(lb.dequantize(q, jnp.float32), np.float64)
        np.testing.assert_array_equal(got, want)
        # and the tiles are the QArray's scales, byte for byte, in the MMA's order
        tiles_u8 = jax.lax.bitcast_convert_type(tiles, jnp.uint8)
        np.testing.assert_array_equal(from_mma_layout(tiles_u8, rows, K // f.block), q.scales)
    if f.tensor_scaled:
        assert t.shape == (1,) and t.dtype == jnp.float32
        assert float(t[0]) == float(np.float32(qa.tensor_scale) * np.float32(qb.tensor_scale))
    else:
        assert t is None


def test_fp4_codes_unpack_low_nibble_first():
    """The byte 0x21 holds codes 1 (0.5) then 2 (1.0): element 2i is the low nibble, as in
    lowbit's packing and the MMA's FP4 operand layout."""
    codes = jnp.full((128, 64), 0x21, jnp.uint8)
    a, *_ = prepare_operands(codes, jnp.full((128, 4), 127, jnp.uint8), codes,
                             jnp.full((128, 4), 127, jnp.uint8), fmt="mxfp4")
    np.testing.assert_array_equal(np.asarray(a[0, :4].astype(jnp.float32)), [0.5, 1, 0.5, 1])


def emulated_mma(a, b, sa, sb, t, rows_a, rows_b, k, block) -> np.ndarray:
    """What the kernel computes, in float64: sum over K of both block-scaled operands, times
    the tensor scales' product."""
    va = block_values(a, sa, rows_a, k, block)
    vb = block_values(b, sb, rows_b, k, block)
    c = va @ vb.T
    return c * float(t[0]) if t is not None else c


def accumulation_bound(qa, qb, k) -> np.ndarray:
    """|C - C_ref| bound for two float32 sums of K products (either order): 2 K eps |A||B|^T,
    plus float32 rounding of the result."""
    abs_a = np.abs(np.asarray(lb.dequantize(qa, jnp.float32), np.float64))
    abs_b = np.abs(np.asarray(lb.dequantize(qb, jnp.float32), np.float64))
    return 2 * k * np.finfo(np.float32).eps * (abs_a @ abs_b.T) + 1e-30


@pytest.mark.parametrize("fmt", FMTS)
def test_emulated_kernel_matches_reference(fmt):
    qa, qb = quantized(fmt, seed=1)
    kw = operands(qa, qb)
    f = FORMATS[fmt]
    got = emulated_mma(*call(prepare_operands, kw), M, N, K, f.block)
    ref = np.asarray(call(reference, kw), np.float64)
    want = np.asarray(lb.dequantize(qa, jnp.float32), np.float64) @ np.asarray(
        lb.dequantize(qb, jnp.float32), np.float64).T
    bound = accumulation_bound(qa, qb, K)
    assert np.all(np.abs(ref - want) <= bound)  # the reference is dequantize + a float32 dot
    assert np.all(np.abs(got - ref) <= bound)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_emulated_kernel_check_catches_swapped_nibbles(fmt):
    """The check above can fail: FP4 codes with their nibbles swapped (high first) are far
    off."""
    qa, qb = quantized(fmt, seed=2)
    kw = operands(qa, qb)
    swapped = (qa.codes >> 4) | (qa.codes << 4)
    bad = emulated_mma(*call(prepare_operands, _with(kw, a_codes=swapped)), M, N, K,
                       FORMATS[fmt].block)
    ref = np.asarray(call(reference, kw), np.float64)
    assert np.mean(np.abs(bad - ref) > accumulation_bound(qa, qb, K)) > 0.5


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_reference_casts_to_out_dtype(out_dtype):
    qa, qb = quantized("nvfp4", m=128, n=128, k=256)
    c = call(reference, _with(operands(qa, qb), out_dtype=out_dtype))
    assert c.shape == (128, 128) and c.dtype == jnp.dtype(out_dtype)


# --------------------------------------------------------------------------------------------
# The kernel, traced and lowered (any machine)


def _specs(fmt, m, n, k):
    f = FORMATS[fmt]
    u8 = jnp.uint8
    specs = [jax.ShapeDtypeStruct((m, k * f.bits // 8), u8),
             jax.ShapeDtypeStruct((m, k // f.block), u8),
             jax.ShapeDtypeStruct((n, k * f.bits // 8), u8),
             jax.ShapeDtypeStruct((n, k // f.block), u8)]
    if f.tensor_scaled:
        specs += [jax.ShapeDtypeStruct((), jnp.float32)] * 2
    return specs


def _fn(fmt, **kw):
    def fn(a, sa, b, sb, *ts):
        ta, tb = ts if ts else (None, None)
        return blackwell_block_scaled_matmul(a, sa, b, sb, fmt=fmt, a_tensor_scale=ta,
                                             b_tensor_scale=tb, **kw)
    return fn


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_traces(fmt):
    out = jax.eval_shape(_fn(fmt, out_dtype=jnp.bfloat16), *_specs(fmt, M, N, K))
    assert (out.shape, out.dtype) == ((M, N), jnp.bfloat16)


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_lowers_for_cuda(fmt):
    """Pallas -> Mosaic GPU lowering (tcgen05 shape and scale checks included) via jax.export;
    no CUDA plugin needed."""
    exp = jax.export.export(jax.jit(_fn(fmt)), platforms=["cuda"])(*_specs(fmt, M, N, K))
    text = exp.mlir_module()
    assert "mosaic_gpu" in text
    assert exp.out_avals[0].shape == (M, N)


# --------------------------------------------------------------------------------------------
# Device-less compile for a B200 (CUDA plugin only)

needs_plugin = pytest.mark.skipif(
    not aot.available()[0],
    reason=f"device-less GPU compile: {aot.available()[1]} (run with .venv-gpu)",
)


@needs_plugin
@pytest.mark.parametrize("fmt", FMTS)
def test_compiles_to_block_scaled_tcgen05_without_spills(fmt):
    r = compile_report(fmt, 1024, 1024, 1024)
    assert r["kinds"] == [FORMATS[fmt].ptx_kind]
    assert r["expected_kind"].endswith(".block_scale")
    assert (r["spill_stores"], r["spill_loads"], r["stack"]) == (0, 0, 0)
    assert 0 < r["registers"] <= 255
    assert r["smem_bytes"] <= 227 * 1024


@needs_plugin
@pytest.mark.parametrize("fmt, shape, out_dtype", [
    ("nvfp4", (256, 384, 512), jnp.bfloat16),
    ("mxfp8_e4m3", (128, 256, 128), jnp.float16),
    ("mxfp4", (384, 128, 256), jnp.float32),
])
def test_compiles_other_shapes_and_out_dtypes(fmt, shape, out_dtype):
    r = compile_report(fmt, *shape, out_dtype=out_dtype)
    assert r["kinds"] == [FORMATS[fmt].ptx_kind]
    assert (r["spill_stores"], r["spill_loads"]) == (0, 0)


@needs_plugin
def test_compile_report_twice_in_one_process():
    """Mosaic GPU reuses a kernel it compiled before; the report names each compile apart."""
    first = compile_report("mxfp4", 128, 128, 256)
    second = compile_report("mxfp4", 128, 128, 256)
    assert first["kernel"] != second["kernel"]
    assert first["registers"] == second["registers"]


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().block_k = 64  # type: ignore[misc]
