"""Block-scaled ``C = A B^T`` on Hopper (sm_90a): a Pallas Mosaic GPU kernel on FP8 ``wgmma``.

Hopper's tensor cores have no block-scaled MMA: ``wgmma.mma_async`` multiplies E4M3 / E5M2
operands and accumulates in float32, one scale for the whole product. The block scales are
therefore applied to the accumulation, DeepGEMM's "fine-grained scaling": for every block of
32 codes along K the kernel runs the FP8 ``wgmma`` (K = 32 per instruction: one block is one
instruction) into a fresh float32 partial product in registers, then promotes it into the
float32 accumulator, ``acc += partial * s_a[:, None] * s_b[None, :]`` (``s_a`` one scale per
row of A, ``s_b`` one per row of B, i.e. per column of C).

Operands, as lowbit stores ``x [M, K]`` and a weight laid out ``[N, K]``, both quantized
along K (``lowbit.core.qarray.quantize(x, fmt, axis=-1)``): ``a_codes [M, K*bits/8]``,
``a_scales [M, K/block]`` (uint8), likewise ``b_codes``, ``b_scales`` for B, and NVFP4's
float32 tensor scales. :func:`prepare_operands` (in XLA, outside the kernel) turns them into
what the kernel reads:

- MXFP8 (``mxfp8_e4m3``, ``mxfp8_e5m2``): the codes bitcast to ``float8_e4m3fn`` /
  ``float8_e5m2``, as they are: lowbit's ``[rows, K]`` layout is K-major, which FP8 ``wgmma``
  requires of both operands.
- MXFP4, MXFP6 (``e2m3``, ``e3m2``), NVFP4: the codes decoded to E4M3 bytes. Exact: every
  E2M1, E2M3 and E3M2 value is an E4M3 value (E4M3 has more exponent range and at least as
  many mantissa bits). FP4 is decoded inside the kernel, in shared memory: the wrapper only
  re-packs the codes in pairs of blocks (:func:`pair_packed`: each 32 bytes hold a block of 32
  in their low nibbles and the next block in their high nibbles; lowbit packs neighbours),
  the kernel reads half a byte a code by TMA and, per K step, decodes the low nibbles into one
  E4M3 tile and the high nibbles into another (:func:`e2m1_to_e4m3_bits`, integer ops on 32-bit
  lanes), so that every block of 32 is a whole 32-code column of one tile for its ``wgmma``,
  with no interleave in registers. FP6 (three bytes for four codes) is still decoded to E4M3
  by the wrapper in XLA: one more pass over the operand in HBM, at a byte a code.
- NVFP4's blocks are 16 codes, FP8 ``wgmma``'s K step is 32: each block of 16 is padded with
  16 zero codes to a K step of its own (K doubles; each step then has one scale per operand
  row, the block's E4M3 scale). Exact (the padded products are zero) at twice the MMA work.
  The alternative, multiplying the E4M3 block scale into the operand before the MMA, is not
  exact in FP8 (E2M1 x E4M3 needs up to 6 significant bits; E4M3 has 4).
- scales: decoded to float32 (exact: E8M0 is 2^(e-127), unsigned E4M3 a float8 value) and
  transposed to ``[K/32, rows]``, so that one K step's scales are a contiguous row per
  operand.
- NVFP4's tensor scales: their float32 product ``a_t * b_t`` multiplies C in the epilogue.

The kernel. One CTA, one warpgroup (128 threads), owns a ``[block_m, block_n]`` tile of C
(``block_m = 64``, one ``wgmma`` M; ``block_n <= 128``) over the grid ``(M / block_m,
N / block_n)``. :func:`jax.experimental.pallas.mosaic_gpu.emit_pipeline` streams K in steps of
``block_k`` codes (TMA into ``num_stages`` SMEM slots, codes in 32-byte swizzled tiles of
``8 x 32`` so that each block of 32 codes is a whole tile column the ``wgmma`` can read);
per step and per block of 32, one ``wgmma`` (wait) and one promotion. The epilogue multiplies
NVFP4's tensor scales, casts to ``out_dtype`` and stores through SMEM by TMA. Registers: the
accumulator and the partial product, ``2 * block_m * block_n / 128`` float32 a thread (128
at 64 x 128; ptxas allocates 255 in all, with no spills: :func:`compile_report`).

Numerics: every product of two codes is exact in the MMA; each block's partial sum is a
float32 sum of 32 exact products (the tensor core's internal order and precision, which
NVIDIA does not specify bit for bit), scaled exactly for MX (powers of two) and rounded once
for NVFP4's E4M3 scales, then added in float32. So C equals :func:`reference` (lowbit's
``dequantize`` of both operands, a float32 dot) to float32 accumulation tolerance, not bit
for bit; the tolerance is to be confirmed on a GPU.

It runs on a Hopper GPU only (``wgmma`` is sm_90a; Mosaic GPU has no interpret mode and no
CPU lowering), so on this CPU-only machine the kernel is checked by compiling it for a
device-less H100 (:func:`compile_report`), and its numbers against :func:`reference` wait
for a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lowbit.core.qarray import dequantize
from pallas_kernels import mosaic_common as mc

__all__ = [
    "FORMATS",
    "WgmmaFormat",
    "Config",
    "get_default",
    "prepare_operands",
    "kernel_inputs",
    "pair_packed",
    "e2m1_to_e4m3_bits",
    "hopper_block_scaled_matmul",
    "reference",
    "compile_report",
    "wgmma_forms",
    "smem_bytes",
]

K_STEP = 32  # FP8 wgmma's K per instruction: one block of scales per instruction
_SMEM_LIMIT = 227 * 1024  # sm_90's opt-in shared memory per block


@dataclasses.dataclass(frozen=True)
class WgmmaFormat:
    """How one lowbit format meets FP8 ``wgmma``: the lowbit format, its code bits and block,
    the FP8 dtype the kernel multiplies (``float8_e4m3fn`` or ``float8_e5m2``), whether the
    codes are decoded to it (FP4 / FP6) or bitcast (FP8), whether a float32 tensor scale comes
    along (NVFP4), and the ``wgmma`` operand type in the PTX."""

    name: str
    bits: int
    block: int
    mma_dtype: jnp.dtype
    decoded: bool
    tensor_scaled: bool

    @property
    def ptx_type(self) -> str:
        return "e5m2" if jnp.dtype(self.mma_dtype) == jnp.float8_e5m2 else "e4m3"

    @property
    def k_pad(self) -> int:
        """How much longer K is in the kernel than in the operand (NVFP4: 2, each block of 16
        padded to a K step of 32)."""
        return K_STEP // self.block

    @property
    def smem_decode(self) -> bool:
        """Whether the kernel decodes the codes to E4M3 in shared memory (FP4: it reads the
        packed codes, :func:`pair_packed`) rather than reading E4M3 bytes (FP8 as they are,
        FP6 decoded by the wrapper)."""
        return self.bits == 4

    @property
    def k_multiple(self) -> int:
        """What the kernel's K and ``block_k`` must be a multiple of: FP8 wgmma's K step, two
        of them for FP4 (a pair of blocks shares each packed byte)."""
        return 2 * K_STEP if self.smem_decode else K_STEP


FORMATS = {
    f.name: f
    for f in (
        WgmmaFormat("mxfp8_e4m3", 8, 32, jnp.float8_e4m3fn, False, False),
        WgmmaFormat("mxfp8_e5m2", 8, 32, jnp.float8_e5m2, False, False),
        WgmmaFormat("mxfp6_e2m3", 6, 32, jnp.float8_e4m3fn, True, False),
        WgmmaFormat("mxfp6_e3m2", 6, 32, jnp.float8_e4m3fn, True, False),
        WgmmaFormat("mxfp4", 4, 32, jnp.float8_e4m3fn, True, False),
        WgmmaFormat("nvfp4", 4, 16, jnp.float8_e4m3fn, True, True),
    )
}
_ALIASES = {"mxfp8": "mxfp8_e4m3"}


def _wgmma_format(fmt: str) -> WgmmaFormat:
    name = _ALIASES.get(fmt, fmt)
    if name not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: expected one of {sorted(FORMATS) + sorted(_ALIASES)}")
    return FORMATS[name]


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes: ``block_m x block_n`` of C per CTA (one warpgroup), ``block_k`` codes of
    the kernel's K (NVFP4: the padded K) per pipeline step, ``num_stages`` SMEM slots."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_stages: int = 4


def get_default(fmt: str, m: int, n: int, k: int) -> Config:
    """64 x 128 tiles (accumulator and partial product: 128 registers a thread); K steps of
    128 codes of the kernel's K (4 blocks of 32), fewer where K is short; up to 4 slots.

    >>> get_default("nvfp4", 1024, 1024, 1024)
    Config(block_m=64, block_n=128, block_k=128, num_stages=4)
    """
    f = _wgmma_format(fmt)
    kk = k * f.k_pad
    block_k = 128
    while block_k > f.k_multiple and kk % block_k:
        block_k //= 2
    return Config(block_k=block_k, num_stages=max(1, min(4, kk // block_k)))


def _check_config(config: Config, f: WgmmaFormat, m: int, n: int, k: int) -> None:
    """``k`` is the operand's K (the kernel's is ``k * f.k_pad``)."""
    if config.block_m != 64:
        raise ValueError(
            f"block_m={config.block_m} must be 64 (one wgmma M per warpgroup; 128 would hold "
            "256 float32 registers a thread in accumulator and partial product)"
        )
    if config.block_n % 8 or not 8 <= config.block_n <= 128:
        raise ValueError(
            f"block_n={config.block_n} must be a multiple of 8 in [8, 128] (wgmma's N; the "
            "accumulator and the partial product take block_n float32 registers a thread)"
        )
    if config.block_k % f.k_multiple:
        why = ("two FP8 wgmma K steps: FP4's packed bytes hold a pair of blocks"
               if f.smem_decode else "FP8 wgmma's K step, one block of scales")
        raise ValueError(f"block_k={config.block_k} must be a multiple of {f.k_multiple} ({why})")
    if config.num_stages < 1:
        raise ValueError(f"num_stages={config.num_stages} must be at least 1")
    if smem_bytes(config, f.name) > _SMEM_LIMIT:
        raise ValueError(
            f"num_stages={config.num_stages} slots of block_k={config.block_k} and "
            f"block_n={config.block_n} need {smem_bytes(config, f.name)} bytes of shared "
            f"memory; sm_90 has {_SMEM_LIMIT}"
        )
    if m % config.block_m:
        raise ValueError(f"m={m} must be a multiple of block_m={config.block_m}")
    if n % config.block_n:
        raise ValueError(f"n={n} must be a multiple of block_n={config.block_n}")
    if (k * f.k_pad) % config.block_k:
        kernel_k = f" (the kernel's K, NVFP4's K padded to {k * f.k_pad})" if f.k_pad > 1 else ""
        raise ValueError(f"k={k}{kernel_k} must be a multiple of block_k={config.block_k}")


def _elements(codes, f: WgmmaFormat, rows: int, k: int) -> jax.Array:
    """``[rows, K * k_pad]`` in ``f.mma_dtype``: FP8 codes bitcast; FP4 / FP6 codes decoded
    (lowbit's own decode, scales set to 1, then an exact cast to E4M3); NVFP4's blocks of 16
    each padded with 16 zeros."""
    if not f.decoded:
        return lax.bitcast_convert_type(codes, f.mma_dtype)
    one = 0x38 if f.tensor_scaled else 127  # E4M3 1.0 / E8M0 2^0
    unit = jnp.full((rows, k // f.block), one, jnp.uint8)
    ts = jnp.float32(1.0) if f.tensor_scaled else None
    values = dequantize(mc.as_qarray(codes, unit, ts, f, rows, k), jnp.float32)
    e = values.astype(f.mma_dtype)
    if f.k_pad > 1:
        e = e.reshape(rows, k // f.block, f.block)
        e = jnp.pad(e, ((0, 0), (0, 0), (0, K_STEP - f.block))).reshape(rows, k * f.k_pad)
    return e


def e2m1_to_e4m3_bits(n: jax.Array) -> jax.Array:
    """The E4M3 byte of each E2M1 code ``n`` (int32 in [0, 16)), as uint8: the sign moved to
    bit 7; a normal code ``(e, m)`` (``e`` in 1..3) is ``2^(e-1) (1 + m/2)``, E4M3 exponent
    ``e + 6`` (bias 7) and mantissa ``m << 2``; the subnormal ``0.5`` is E4M3's ``2^-1``
    (``0x30``), and zero is zero. Integer ops only, so that the kernel runs it on registers
    (Mosaic GPU computes on 32-bit lanes) and a CPU test checks it bit for bit.

    >>> [hex(int(b)) for b in e2m1_to_e4m3_bits(jnp.array([1, 2, 7, 15]))]
    ['0x30', '0x38', '0x4c', '0xcc']
    """
    e, m = (n >> 1) & 3, n & 1
    normal = ((e + 6) << 3) | (m << 2)
    return (((n & 8) << 4) | jnp.where(e == 0, m * 0x30, normal)).astype(jnp.uint8)


def pair_packed(codes, f: WgmmaFormat, rows: int, k: int) -> jax.Array:
    """FP4 codes as the kernel reads them: uint8 ``[rows, Kk / 2]`` (``Kk = K * k_pad``), each
    run of 64 codes of the kernel's K (two blocks of 32) as 32 bytes whose low nibbles are the
    first block and high nibbles the second (lowbit packs neighbours, low nibble first); NVFP4's
    blocks of 16 are each padded with 16 zero codes first. The kernel decodes the low nibbles
    of a K step into one SMEM tile and the high ones into another, so each block of 32 is a
    whole 32-code column of one of them, with no interleave in registers.

    >>> import types
    >>> f = types.SimpleNamespace(bits=4, block=32, k_pad=1)
    >>> codes = jnp.array([[0x11] * 16 + [0x22] * 16], jnp.uint8)  # a block of 1s, one of 2s
    >>> pair_packed(codes, f, 1, 64).tolist() == [[0x21] * 32]
    True
    """
    nibbles = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(rows, k)
    if f.k_pad > 1:
        nibbles = nibbles.reshape(rows, k // f.block, f.block)
        nibbles = jnp.pad(nibbles, ((0, 0), (0, 0), (0, K_STEP - f.block)))
    pairs = nibbles.reshape(rows, k * f.k_pad // (2 * K_STEP), 2, K_STEP)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(rows, k * f.k_pad // 2)


def _scales_f32(scales, f: WgmmaFormat) -> jax.Array:
    """uint8 scales ``[rows, K/block]`` as float32 ``[K/block, rows]`` (one K step a row)."""
    dtype = jnp.float8_e4m3fn if f.tensor_scaled else jnp.float8_e8m0fnu
    return lax.bitcast_convert_type(scales, dtype).astype(jnp.float32).T


def prepare_operands(
    a_codes, a_scales, b_codes, b_scales, *, fmt: str, a_tensor_scale=None, b_tensor_scale=None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """What the kernel reads: ``(a [M, Kk], b [N, Kk], a_scales [Kk/32, M], b_scales [Kk/32,
    N], t)``, ``Kk = K`` (NVFP4: ``2 K``).

    ``a``, ``b`` in ``float8_e4m3fn`` (``float8_e5m2`` for ``mxfp8_e5m2``): FP8 codes
    bitcast, FP4 / FP6 codes decoded to E4M3 (exact), NVFP4's blocks of 16 padded to 32 with
    zeros; scales as float32, transposed; ``t`` the float32 product ``a_t * b_t`` as a
    ``(1,)`` array (NVFP4), else None. Validates like :func:`hopper_block_scaled_matmul`,
    without the tile constraints.

    >>> import jax.numpy as jnp
    >>> a, b, sa, sb, t = prepare_operands(
    ...     jnp.zeros((64, 64), jnp.uint8), jnp.zeros((64, 8), jnp.uint8),
    ...     jnp.zeros((128, 64), jnp.uint8), jnp.zeros((128, 8), jnp.uint8), fmt="nvfp4",
    ...     a_tensor_scale=1.0, b_tensor_scale=2.0)
    >>> a.shape, a.dtype, sb.shape, sb.dtype, t
    ((64, 256), dtype(float8_e4m3fn), (8, 128), dtype('float32'), Array([2.], dtype=float32))
    """
    f = _wgmma_format(fmt)
    ops = mc.check_operands(a_codes, a_scales, b_codes, b_scales, f,
                            a_tensor_scale=a_tensor_scale, b_tensor_scale=b_tensor_scale)
    return _operands(ops, f, _elements)


def _operands(ops: mc.Operands, f: WgmmaFormat, codes) -> tuple:
    """``(a, b, a_scales, b_scales, t)`` of checked operands, the codes through ``codes``
    (:func:`_elements` or :func:`pair_packed`), the scales float32 ``[Kk/32, rows]``."""
    return (
        codes(ops.a_codes, f, ops.m, ops.k),
        codes(ops.b_codes, f, ops.n, ops.k),
        _scales_f32(ops.a_scales, f),
        _scales_f32(ops.b_scales, f),
        ops.tensor_scale,
    )


def kernel_inputs(
    a_codes, a_scales, b_codes, b_scales, *, fmt: str, a_tensor_scale=None, b_tensor_scale=None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """What the kernel's call takes: :func:`prepare_operands`, except that FP4 codes stay
    packed (:func:`pair_packed`, uint8 ``[rows, Kk / 2]``) for the kernel to decode in shared
    memory. Validates alike.

    >>> import jax.numpy as jnp
    >>> a, *_ = kernel_inputs(
    ...     jnp.zeros((64, 64), jnp.uint8), jnp.zeros((64, 8), jnp.uint8),
    ...     jnp.zeros((128, 64), jnp.uint8), jnp.zeros((128, 8), jnp.uint8), fmt="nvfp4",
    ...     a_tensor_scale=1.0, b_tensor_scale=2.0)
    >>> a.shape, a.dtype
    ((64, 128), dtype('uint8'))
    """
    f = _wgmma_format(fmt)
    ops = mc.check_operands(a_codes, a_scales, b_codes, b_scales, f,
                            a_tensor_scale=a_tensor_scale, b_tensor_scale=b_tensor_scale)
    if f.smem_decode and ops.k * f.k_pad % f.k_multiple:
        raise ValueError(
            f"k={ops.k} must be a multiple of {f.k_multiple // f.k_pad} for {f.name} (the "
            "kernel reads FP4 codes packed in pairs of blocks of its K)"
        )
    return _operands(ops, f, pair_packed if f.smem_decode else _elements)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static sizes of one kernel."""

    f: WgmmaFormat
    bm: int
    bn: int
    bk: int
    k_steps: int
    stages: int
    out_dtype: jnp.dtype


def _tiled(minor_bytes: int, bits: int, swizzle: int | None = None) -> tuple:
    swizzle = swizzle or plgpu.find_swizzle(minor_bytes * 8)
    return (plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle))


def _block_product(a_ref, b_ref, acc_ref):
    """One block of K: ``a [bm, 32] @ b [bn, 32]^T`` by one FP8 ``wgmma`` (B read K-major)
    into a fresh float32 accumulator, waited for and returned as registers."""
    plgpu.wgmma(acc_ref, a_ref, plgpu.transpose_ref(b_ref, (1, 0)))
    return acc_ref[...]


def _decode_to(src, lo, hi):
    """The packed FP4 tile ``src`` (uint8, :func:`pair_packed`) decoded to E4M3 in SMEM: its
    low nibbles into ``lo``, its high nibbles into ``hi`` (same shape, same tiling)."""
    x = src[...].astype(jnp.int32)  # Mosaic GPU's arithmetic runs on 16- or 32-bit lanes
    lo[...] = lax.bitcast_convert_type(e2m1_to_e4m3_bits(x & 15), jnp.float8_e4m3fn)
    hi[...] = lax.bitcast_convert_type(e2m1_to_e4m3_bits(x >> 4), jnp.float8_e4m3fn)


def _kernel_call(a, b, sa, sb, t, *, f: WgmmaFormat, config: Config, out_dtype):
    """The ``plgpu.kernel`` over prepared operands (see the module docstring)."""
    m, n = a.shape[0], b.shape[0]
    kk = a.shape[1] * (2 if f.smem_decode else 1)
    k_steps = kk // config.block_k
    p = _Plan(
        f=f,
        bm=config.block_m,
        bn=config.block_n,
        bk=config.block_k,
        k_steps=k_steps,
        stages=min(config.num_stages, k_steps),
        out_dtype=jnp.dtype(out_dtype),
    )
    chunks = p.bk // K_STEP
    # 32-byte swizzle: one 8 x 32 tile is one block of 32 codes, so each wgmma's K slice
    # is whole tiles (FP4: 32 packed bytes, a pair of blocks, decode to one such tile each).
    code_transforms = _tiled(K_STEP, 8, swizzle=32)
    out_bits = p.out_dtype.itemsize * 8
    tile_k = p.bk // 2 if f.smem_decode else p.bk  # bytes of codes per row and K step

    def body(*refs):
        n_in = 5 if f.tensor_scaled else 4
        a_gmem, b_gmem, sa_gmem, sb_gmem = refs[:4]
        t_gmem = refs[4] if f.tensor_scaled else None
        out_gmem, out_smem, *decoded = refs[n_in:]
        mi, ni = lax.axis_index("m"), lax.axis_index("n")

        def step(_, a_smem, b_smem, sa_smem, sb_smem, acc):
            if f.smem_decode:
                a_lo, a_hi, b_lo, b_hi = decoded
                _decode_to(a_smem, a_lo, a_hi)
                _decode_to(b_smem, b_lo, b_hi)
                plgpu.commit_smem()  # the stores seen by wgmma, by every thread
            for j in range(chunks):
                if f.smem_decode:  # block j: the low (even j) or high nibbles of pair j // 2
                    a_src, b_src = (a_lo, b_lo) if j % 2 == 0 else (a_hi, b_hi)
                    ks = pl.ds((j // 2) * K_STEP, K_STEP)
                else:
                    a_src, b_src, ks = a_smem, b_smem, pl.ds(j * K_STEP, K_STEP)
                mma = functools.partial(_block_product, a_src.at[:, ks], b_src.at[:, ks])
                part = pl.run_scoped(mma, plgpu.ACC((p.bm, p.bn), jnp.float32))
                s_a = mc.load(sa_smem.at[j], plgpu.Layout.WGMMA.reduce(1))
                s_b = mc.load(sb_smem.at[j], plgpu.Layout.WGMMA.reduce(0))
                acc = acc + part * lax.broadcast_in_dim(
                    s_a, (p.bm, p.bn), [0]
                ) * lax.broadcast_in_dim(s_b, (p.bm, p.bn), [1])
            return acc

        acc0 = plgpu.layout_cast(jnp.zeros((p.bm, p.bn), jnp.float32), plgpu.Layout.WGMMA)
        pipeline = plgpu.emit_pipeline(
            step,
            grid=(p.k_steps,),
            in_specs=[
                plgpu.BlockSpec((p.bm, tile_k), lambda k: (0, k), transforms=code_transforms),
                plgpu.BlockSpec((p.bn, tile_k), lambda k: (0, k), transforms=code_transforms),
                plgpu.BlockSpec((chunks, p.bm), lambda k: (k, 0)),
                plgpu.BlockSpec((chunks, p.bn), lambda k: (k, 0)),
            ],
            max_concurrent_steps=p.stages,
            init_carry=acc0,
        )
        ms, ns = pl.ds(mi * p.bm, p.bm), pl.ds(ni * p.bn, p.bn)
        acc = pipeline(a_gmem.at[ms], b_gmem.at[ns], sa_gmem.at[:, ms], sb_gmem.at[:, ns])
        if t_gmem is not None:
            acc = acc * t_gmem[0]
        out_smem[...] = acc.astype(p.out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[ms, ns])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM(
        (p.bm, p.bn), p.out_dtype, transforms=_tiled(p.bn * p.out_dtype.itemsize, out_bits)
    )]
    if f.smem_decode:  # the decoded low and high nibbles of A's and B's K step
        scratch += [plgpu.SMEM((rows, tile_k), jnp.float8_e4m3fn, transforms=code_transforms)
                    for rows in (p.bm, p.bm, p.bn, p.bn)]
    call = mc.tile_kernel(body, shape=(m, n), block=(p.bm, p.bn), out_dtype=p.out_dtype,
                          scratch_types=tuple(scratch),
                          name=f"hopper_{f.name}_{p.bm}x{p.bn}x{p.bk}_s{p.stages}")
    return call(a, b, sa, sb, *((t,) if f.tensor_scaled else ()))


def hopper_block_scaled_matmul(
    a_codes, a_scales, b_codes, b_scales, *, fmt: str, a_tensor_scale=None, b_tensor_scale=None,
    out_dtype=jnp.float32, block_m: int = 64, block_n: int = 128, block_k: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """``C [M, N] = dequantize(A) @ dequantize(B)^T`` on Hopper's FP8 ``wgmma``, block scales
    applied to the float32 accumulation per block of 32 (see the module docstring).

    Args:
      a_codes, a_scales: A ``[M, K]`` quantized along K: uint8 codes ``[M, K*bits/8]`` and
        uint8 scales ``[M, K/block]`` (a QArray's ``codes`` and ``scales``).
      b_codes, b_scales: B ``[N, K]`` (a weight laid out N x K) quantized along K, likewise.
      fmt: ``"mxfp8_e4m3"`` (alias ``"mxfp8"``), ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``,
        ``"mxfp6_e3m2"``, ``"mxfp4"`` or ``"nvfp4"`` (both operands).
      a_tensor_scale, b_tensor_scale: NVFP4's float32 tensor scales (required for NVFP4,
        forbidden otherwise); C is multiplied by ``a_t * b_t`` in the epilogue.
      out_dtype: float32, bfloat16 or float16.
      block_m: 64; block_n: a multiple of 8 up to 128; block_k: codes of the kernel's K
        (NVFP4: K padded to 2 K) per pipeline step, a multiple of 32 (default
        :func:`get_default`); num_stages: SMEM slots (default 4, at most the steps).

    Raises ValueError naming the argument when a shape or block does not fit.

    Runs on a Hopper GPU (sm_90a) only; elsewhere use :func:`reference`, or compile it
    device-less with :func:`compile_report`.
    """
    f = _wgmma_format(fmt)
    out_dtype = mc.check_out_dtype(out_dtype)
    a, b, sa, sb, t = kernel_inputs(
        a_codes, a_scales, b_codes, b_scales, fmt=f.name,
        a_tensor_scale=a_tensor_scale, b_tensor_scale=b_tensor_scale,
    )
    m, n = a.shape[0], b.shape[0]
    k = sa.shape[0] * K_STEP // f.k_pad
    config = mc.tiles(get_default(f.name, m, n, k), block_m=block_m, block_n=block_n,
                      block_k=block_k, num_stages=num_stages)
    _check_config(config, f, m, n, k)
    return _kernel_call(a, b, sa, sb, t, f=f, config=config, out_dtype=out_dtype)


def reference(
    a_codes, a_scales, b_codes, b_scales, *, fmt: str, a_tensor_scale=None,
    b_tensor_scale=None, out_dtype=jnp.float32,
) -> jax.Array:
    """What :func:`hopper_block_scaled_matmul` computes, in XLA: lowbit's values of both
    operands and one float32 dot (:func:`pallas_kernels.mosaic_common.reference_matmul`,
    which checks the arguments alike). The kernel's E4M3 decode and NVFP4 padding are exact;
    its per-block promotion differs from this by float32 rounding only."""
    return mc.reference_matmul(a_codes, a_scales, b_codes, b_scales, _wgmma_format(fmt),
                               a_tensor_scale=a_tensor_scale, b_tensor_scale=b_tensor_scale,
                               out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# Device-less compilation for an H100

_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.(\w+)\.(\w+)\.(\w+)")


def wgmma_forms(ptx: str) -> list[str]:
    """The distinct ``wgmma.mma_async`` forms in ``ptx``: shape, accumulator type and the two
    operand types, as ``"m64n128k32.f32.e4m3.e4m3"``.

    >>> wgmma_forms("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1}, %rd1;")
    ['m64n128k32.f32.e4m3.e4m3']
    """
    return sorted({".".join(m) for m in _WGMMA.findall(ptx)})


def smem_bytes(config: Config, fmt: str, out_dtype=jnp.float32) -> int:
    """Shared memory the kernel asks for (barriers aside): ``num_stages`` slots of both
    operands' codes (FP4: packed, half a byte a code) and float32 scales, FP4's decoded E4M3
    tiles of one K step, and the ``[block_m, block_n]`` output buffer.

    >>> smem_bytes(get_default("mxfp8", 1024, 1024, 1024), "mxfp8")  # 4 x (24 + 3) + 32 KiB
    143360
    """
    f = _wgmma_format(fmt)
    c = config
    rows = c.block_m + c.block_n
    codes = rows * c.block_k // (2 if f.smem_decode else 1)
    scales = rows * (c.block_k // K_STEP) * 4
    decoded = rows * c.block_k if f.smem_decode else 0  # FP4: the E4M3 tiles decoded into
    out = c.block_m * c.block_n * jnp.dtype(out_dtype).itemsize
    return c.num_stages * (codes + scales) + decoded + out


def compile_report(fmt: str, m: int, n: int, k: int, *, target: str = "h100",
                   out_dtype=jnp.float32, block_n: int = 128, block_k: int | None = None,
                   num_stages: int | None = None) -> dict:
    """Compile the kernel for a device-less ``target`` (``"h100"``, sm_90a) and report its
    code.

    Needs the CUDA plugin (``.venv-gpu``, ``JAX_PLATFORMS=cpu``; raises RuntimeError without
    it, or where this process compiled Mosaic GPU kernels for another target). Compiles with
    :func:`pallas_kernels.mosaic_common.compile_with_dump` (under the target's mesh, whose
    device gives Mosaic GPU the compute capability) and reads the PTX and the ``ptxas -v`` log
    Mosaic GPU writes while it compiles the kernel. Returns a dict: ``arch`` (the PTX's
    ``.target``), ``wgmma`` (the ``wgmma.mma_async`` forms in the PTX, :func:`wgmma_forms`),
    ``ptx_type`` (the operand type expected), ``registers``, ``spill_stores``,
    ``spill_loads``, ``stack``, ``kernel``, ``config``, ``smem_bytes``, ``compile_s``,
    ``ptxas_ms`` and ``xla_kernels`` (XLA's fusions around it: the decode, the scale
    conversions).
    """
    if target != "h100":
        raise ValueError(
            f"target={target!r}: the kernel is for Hopper only ('h100', sm_90a); wgmma does not "
            "exist on sm_100a (Mosaic GPU: \"'nvvm.wgmma.fence.aligned' op is not supported on "
            'sm_100a"), use pallas_kernels.blackwell_matmul there'
        )
    f = _wgmma_format(fmt)
    out_dtype = jnp.dtype(out_dtype)
    config = mc.override(get_default(f.name, m, n, k), block_n=block_n, block_k=block_k,
                         num_stages=num_stages)
    build, stats = mc.compile_matmul(
        hopper_block_scaled_matmul, f, m, n, k, target, out_dtype=out_dtype, block_m=config.block_m,
        block_n=config.block_n, block_k=config.block_k, num_stages=config.num_stages,
    )
    steps = k * f.k_pad // config.block_k
    return dict(
        fmt=f.name, shape=(m, n, k), target=target,
        arch=sorted(set(re.findall(r"\.target\s+(\w+)", build.ptx))),
        wgmma=wgmma_forms(build.ptx), ptx_type=f.ptx_type, **stats,
        config=dataclasses.asdict(
            dataclasses.replace(config, num_stages=min(config.num_stages, steps))),
        smem_bytes=smem_bytes(config, f.name, out_dtype),
    )
