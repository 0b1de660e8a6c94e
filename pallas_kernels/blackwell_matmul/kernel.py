"""Block-scaled ``C = A B^T`` on Blackwell (sm_100): a Pallas Mosaic GPU kernel on ``tcgen05.mma``.

Blackwell's tensor cores multiply MXFP8, MXFP4 and NVFP4 operands natively: ``tcgen05.mma``
with ``kind::mxf8f6f4`` / ``kind::mxf4`` / ``kind::mxf4nvf4`` and ``.block_scale`` reads the
codes from shared memory, one scale per block of K from tensor memory (TMEM), and accumulates
in float32 in TMEM. Nothing is decoded in registers: the codes lowbit packs are the MMA's
operands byte for byte (FP8: one byte a code; FP4: two codes a byte, low nibble first, which
is also how ``lax.bitcast_convert_type`` splits a byte into two ``float4_e2m1fn``).

Operands, as lowbit stores ``x [M, K]`` and a weight laid out ``[N, K]``, both quantized
along K (``lowbit.core.qarray.quantize(x, fmt, axis=-1)``):

- ``a_codes [M, K * bits / 8]`` and ``b_codes [N, K * bits / 8]``, uint8;
- ``a_scales [M, K / block]`` and ``b_scales [N, K / block]``, uint8 (E8M0 for MX, blocks of
  32; unsigned E4M3 for NVFP4, blocks of 16);
- NVFP4 only: the float32 tensor scales ``a_tensor_scale`` and ``b_tensor_scale``.

The wrapper (:func:`prepare_operands`, outside the kernel) bitcasts the codes to the MMA's
element dtype and re-lays each operand's scales with
:func:`pallas_kernels.mma_scales.to_mma_layout` into the ``(MN/128, K/block/4, 32, 16)``
tiles that ``tcgen05.cp`` moves from SMEM to TMEM.

The kernel. One CTA (one warpgroup, 128 threads) owns a ``[128, block_n]`` tile of C; the
grid is ``(M / 128, N / block_n)``. Inside it, warp 0 issues the TMA loads of each K-step
(codes of A and B, the scale tiles of A and B) into a ring of ``num_stages`` SMEM slots;
warp 1 waits for a slot, copies its scale tiles into that slot's TMEM columns
(``plgpu.async_copy_scales_to_tmem``) and issues the block-scaled MMA, whose completion frees
the slot for the next load (``consumed`` barrier). After the last MMA the whole warpgroup
reads the float32 accumulator from TMEM in ``[128, epilogue_n]`` slices, multiplies NVFP4's
product of the two tensor scales in (``acc * (a_t * b_t)``), casts to ``out_dtype`` and stores
each slice through SMEM with a TMA copy.

Constraints (checked by :func:`blackwell_block_scaled_matmul`, ``ValueError`` naming the
argument): ``block_m == 128`` (one MMA has M = 128 rows per CTA) and ``block_n == 128`` (a
block of B's scales is a whole 128-row tile, and jax 0.10.2 slices TMEM by columns only for
one 128-row tile); M a multiple of ``block_m``, N of ``block_n``, K of ``block_k``; ``block_k``
a multiple of ``4 * block`` (the scale tiles hold 4 blocks of K) whose row of codes is 32, 64
or a multiple of 128 bytes (the SMEM swizzle, which sets the MMA's K step: 128 FP8 or 256
FP4 codes at the 128-byte swizzle). Both operands are K-major (FP4 must be), and FP8 takes
E8M0 scales only, as the formats have them. MXFP6 is not offered: Mosaic GPU's ``tcgen05.mma`` in
jax 0.10.2 takes float8 and float4 operands only (``jax/experimental/mosaic/gpu/tcgen05.py``,
``mma``: "Unsupported element type" for anything else).

Numerics: every product of two codes and their two scales is exact, and the sum is kept in a
float32 accumulator, so C should equal :func:`reference` (``lowbit.core.qarray.dequantize``
of both operands, a float32 dot) up to float32 accumulation error: the summation order (and
the tensor core's internal precision, which NVIDIA does not specify bit for bit) differ, and
NVFP4's tensor scales multiply the sum rather than each element. That tolerance is to be
confirmed on a GPU.

It runs on a Blackwell GPU only. Mosaic GPU has no interpret mode for TMEM and
``tcgen05`` (nor any CPU lowering), so on this CPU-only machine the kernel is checked by
compiling it for a device-less B200 (:func:`compile_report`), and its numbers against
:func:`reference` wait for a GPU.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_common as mc
from pallas_kernels.mma_scales import to_mma_layout

__all__ = [
    "FORMATS",
    "MmaFormat",
    "Config",
    "get_default",
    "prepare_operands",
    "blackwell_block_scaled_matmul",
    "reference",
    "compile_report",
    "mma_kinds",
    "smem_bytes",
]


@dataclasses.dataclass(frozen=True)
class MmaFormat:
    """How one lowbit format meets ``tcgen05.mma``: the element dtype the codes are bitcast
    to, its bits, the block size, the scale dtype the scale bytes are bitcast to, whether a
    float32 tensor scale comes along, and the PTX ``kind`` the MMA must use."""

    name: str
    elem_dtype: jnp.dtype
    bits: int
    block: int
    scale_dtype: jnp.dtype
    tensor_scaled: bool
    ptx_kind: str


FORMATS = {
    f.name: f
    for f in (
        MmaFormat("mxfp8_e4m3", jnp.float8_e4m3fn, 8, 32, jnp.float8_e8m0fnu, False,
                  "kind::mxf8f6f4.block_scale"),
        MmaFormat("mxfp8_e5m2", jnp.float8_e5m2, 8, 32, jnp.float8_e8m0fnu, False,
                  "kind::mxf8f6f4.block_scale"),
        MmaFormat("mxfp4", jnp.float4_e2m1fn, 4, 32, jnp.float8_e8m0fnu, False,
                  "kind::mxf4.block_scale"),
        MmaFormat("nvfp4", jnp.float4_e2m1fn, 4, 16, jnp.float8_e4m3fn, True,
                  "kind::mxf4nvf4.block_scale"),
    )
}
_ALIASES = {"mxfp8": "mxfp8_e4m3"}
_NOT_OFFERED = {
    "mxfp6_e2m3": "MXFP6",
    "mxfp6_e3m2": "MXFP6",
    "mxfp6": "MXFP6",
}


def _mma_format(fmt: str) -> MmaFormat:
    name = _ALIASES.get(fmt, fmt)
    if name in FORMATS:
        return FORMATS[name]
    if name in _NOT_OFFERED:
        raise ValueError(
            f"fmt={fmt!r}: {_NOT_OFFERED[name]} is not offered by this kernel (Mosaic GPU's "
            "tcgen05_mma in jax 0.10.2 takes float8 and float4 operands only); use the "
            "XLA reference or pallas_kernels.block_scaled_matmul"
        )
    raise ValueError(f"fmt={fmt!r}: expected one of {sorted(FORMATS) + sorted(_ALIASES)}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of the kernel: ``block_m x block_n`` of C per CTA, ``block_k`` codes of K
    per pipeline step, ``num_stages`` SMEM slots, ``epilogue_n`` columns of C per store."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_stages: int = 4
    epilogue_n: int = 32


def get_default(fmt: str, m: int, n: int, k: int) -> Config:
    """128 x 128 tiles; K-steps of 128 bytes of codes a row (128 FP8 / 256 FP4 codes, the
    MMA's K step at the 128-byte swizzle), fewer where K is short; 4 slots.

    >>> get_default("nvfp4", 1024, 1024, 1024)
    Config(block_m=128, block_n=128, block_k=256, num_stages=4, epilogue_n=32)
    """
    f = _mma_format(fmt)
    block_k = 1024 // f.bits
    while block_k > 4 * f.block and k % block_k:
        block_k //= 2
    steps = max(1, k // block_k)
    return Config(block_k=block_k, num_stages=min(4, steps))


def _swizzle(block_k: int, bits: int) -> int:
    """The SMEM swizzle (bytes) for rows of ``block_k`` codes: 128 if the row is a multiple of
    128 bytes, else the row itself if it is 32 or 64 bytes; 0 when none fits."""
    row = block_k * bits // 8
    if row % 128 == 0:
        return 128
    return row if row in (32, 64) else 0


def _check_config(config: Config, f: MmaFormat, m: int, n: int, k: int) -> None:
    if config.block_m != 128:
        raise ValueError(
            f"block_m={config.block_m} must be 128 (tcgen05.mma has M = 128 rows per CTA)"
        )
    if config.block_n != 128:
        raise ValueError(
            f"block_n={config.block_n} must be 128 (a block of B's scales is one 128-row TMEM "
            "tile; jax 0.10.2 slices TMEM by columns only within one such tile)"
        )
    if config.block_k % (4 * f.block):
        raise ValueError(
            f"block_k={config.block_k} must be a multiple of {4 * f.block} for {f.name} "
            f"(a scale tile holds 4 blocks of {f.block})"
        )
    if not _swizzle(config.block_k, f.bits):
        raise ValueError(
            f"block_k={config.block_k} gives rows of {config.block_k * f.bits // 8} bytes of "
            f"{f.name} codes; the SMEM swizzle needs 32, 64 or a multiple of 128"
        )
    if config.num_stages < 1:
        raise ValueError(f"num_stages={config.num_stages} must be at least 1")
    if config.block_n % config.epilogue_n or (config.epilogue_n * 4) % 32:
        raise ValueError(
            f"epilogue_n={config.epilogue_n} must divide block_n={config.block_n} and be a "
            "multiple of 8"
        )
    for name, size, blk, blk_name in (
        ("m", m, config.block_m, "block_m"),
        ("n", n, config.block_n, "block_n"),
        ("k", k, config.block_k, "block_k"),
    ):
        if size % blk:
            raise ValueError(f"{name}={size} must be a multiple of {blk_name}={blk}")


def _elements(codes: jax.Array, f: MmaFormat) -> jax.Array:
    """Packed uint8 codes ``[rows, K*bits/8]`` as the MMA's element dtype ``[rows, K]``."""
    e = lax.bitcast_convert_type(codes, f.elem_dtype)
    return e.reshape(codes.shape[0], -1)  # FP4: [rows, K/2, 2] (low nibble first) -> [rows, K]


def prepare_operands(
    a_codes, a_scales, b_codes, b_scales, *, fmt: str, a_tensor_scale=None, b_tensor_scale=None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """What the kernel reads: ``(a [M, K], b [N, K], a_scale_tiles, b_scale_tiles, t)``.

    Codes bitcast to the element dtype (``float8_e4m3fn``, ``float8_e5m2``,
    ``float4_e2m1fn``); scales re-laid by :func:`~pallas_kernels.mma_scales.to_mma_layout`
    to ``(MN/128, K/block/4, 32, 16)`` and bitcast to ``float8_e8m0fnu`` (MX) or
    ``float8_e4m3fn`` (NVFP4); ``t`` the float32 product ``a_t * b_t`` as a ``(1,)`` array
    (NVFP4), else None. Validates like :func:`blackwell_block_scaled_matmul`, without the
    tile constraints.

    >>> import jax.numpy as jnp
    >>> a, b, sa, sb, t = prepare_operands(
    ...     jnp.zeros((128, 128), jnp.uint8), jnp.zeros((128, 8), jnp.uint8),
    ...     jnp.zeros((256, 128), jnp.uint8), jnp.zeros((256, 8), jnp.uint8), fmt="mxfp4")
    >>> a.shape, a.dtype, sb.shape, sb.dtype, t
    ((128, 256), dtype(float4_e2m1fn), (2, 2, 32, 16), dtype(float8_e8m0fnu), None)
    """
    f = _mma_format(fmt)
    ops = mc.check_operands(a_codes, a_scales, b_codes, b_scales, f,
                            a_tensor_scale=a_tensor_scale, b_tensor_scale=b_tensor_scale)

    def tiles(s):  # uint8 scales [rows, K / block] -> the MMA's scale tiles
        return lax.bitcast_convert_type(to_mma_layout(s), f.scale_dtype)

    return (_elements(ops.a_codes, f), _elements(ops.b_codes, f), tiles(ops.a_scales),
            tiles(ops.b_scales), ops.tensor_scale)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static sizes of one kernel: blocks, K-steps, slots, scales per step."""

    f: MmaFormat
    bm: int
    bn: int
    bk: int
    epi_n: int
    k_steps: int
    stages: int
    out_dtype: jnp.dtype

    @property
    def kb(self) -> int:  # scales (blocks of K) per operand row per step
        return self.bk // self.f.block

    @property
    def kt(self) -> int:  # scale tiles along K per step
        return self.kb // 4


def _scratch(p: _Plan) -> tuple:
    """SMEM ring of ``stages`` slots (codes and scale tiles of A and B), two output buffers,
    TMEM (accumulator, one slot of scales per stage) and the barriers."""
    f = p.f
    swizzle = _swizzle(p.bk, f.bits)
    operand_transforms = (
        plgpu.TilingTransform((8, 8 * swizzle // f.bits)),
        plgpu.SwizzleTransform(swizzle),
    )
    out_bits = jnp.dtype(p.out_dtype).itemsize * 8
    out_swizzle = plgpu.find_swizzle(p.epi_n * out_bits)
    out_transforms = (
        plgpu.TilingTransform((8, 8 * out_swizzle // out_bits)),
        plgpu.SwizzleTransform(out_swizzle),
    )
    scales_tmem = plgpu.TMEMLayout.SCALES_LAYOUT
    return (
        plgpu.SMEM((p.stages, p.bm, p.bk), f.elem_dtype, transforms=operand_transforms),
        plgpu.SMEM((p.stages, p.bn, p.bk), f.elem_dtype, transforms=operand_transforms),
        plgpu.SMEM((p.stages, p.bm // 128, p.kt, 32, 16), f.scale_dtype),
        plgpu.SMEM((p.stages, p.bn // 128, p.kt, 32, 16), f.scale_dtype),
        plgpu.SMEM((2, p.bm, p.epi_n), p.out_dtype, transforms=out_transforms),
        plgpu.TMEM((p.bm, p.bn), jnp.float32),
        plgpu.TMEM((p.bm, p.stages * p.kb), f.scale_dtype, layout=scales_tmem),
        plgpu.TMEM((p.bn, p.stages * p.kb), f.scale_dtype, layout=scales_tmem),
        plgpu.Barrier(num_arrivals=4, num_barriers=p.stages),  # 4 TMA copies a step
        plgpu.Barrier(num_barriers=p.stages, orders_tensor_core=True),
        plgpu.Barrier(orders_tensor_core=True),
    )


def _load_warp(p: _Plan, gmem, smem, loaded, consumed, mi, ni):
    """Warp 0: TMA loads of every K-step into slot ``step % stages``, once the MMA that last
    read the slot is done."""
    a_gmem, b_gmem, as_gmem, bs_gmem = gmem
    a_smem, b_smem, as_smem, bs_smem = smem
    mt, nt = p.bm // 128, p.bn // 128

    def step(ki, carry):
        slot = lax.rem(ki, p.stages)

        @pl.when(ki >= p.stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])

        ks, kts = pl.ds(ki * p.bk, p.bk), pl.ds(ki * p.kt, p.kt)
        barrier = loaded.at[slot]
        plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(mi * p.bm, p.bm), ks], a_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(ni * p.bn, p.bn), ks], b_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(as_gmem.at[pl.ds(mi * mt, mt), kts], as_smem.at[slot], barrier)
        plgpu.copy_gmem_to_smem(bs_gmem.at[pl.ds(ni * nt, nt), kts], bs_smem.at[slot], barrier)
        return carry

    lax.fori_loop(0, p.k_steps, step, None)


def _mma_warp(p: _Plan, smem, tmem, loaded, consumed, mma_done):
    """Warp 1: per K-step, wait for the slot, copy its scale tiles to the slot's TMEM columns
    and issue the block-scaled MMA (which frees the slot when done); after the last, signal
    ``mma_done``."""
    a_smem, b_smem, as_smem, bs_smem = smem
    acc_tmem, as_tmem, bs_tmem = tmem

    def step(ki, carry):
        slot = lax.rem(ki, p.stages)
        plgpu.barrier_wait(loaded.at[slot])
        cols = pl.ds(slot * p.kb, p.kb)
        # tcgen05.cp then tcgen05.mma issued by one thread run in order: no wait in between
        plgpu.async_copy_scales_to_tmem(as_smem.at[slot], as_tmem.at[:, cols])
        plgpu.async_copy_scales_to_tmem(bs_smem.at[slot], bs_tmem.at[:, cols])
        plgpu.tcgen05_mma(
            acc_tmem,
            a_smem.at[slot],
            plgpu.transpose_ref(b_smem.at[slot], (1, 0)),  # B [N, K] read as K x N
            consumed.at[slot],
            a_scale=as_tmem.at[:, cols],
            b_scale=bs_tmem.at[:, cols],
            accumulate=ki > 0,
        )

        @pl.when(ki == p.k_steps - 1)
        def _():
            plgpu.tcgen05_commit_arrive(mma_done)

        return carry

    lax.fori_loop(0, p.k_steps, step, None)


def _epilogue(p: _Plan, acc_tmem, out_smem, out_gmem, scale, mi, ni):
    """The whole warpgroup: ``[128, epi_n]`` slices of the accumulator, times NVFP4's tensor
    scales, cast, through two SMEM buffers to GMEM by TMA."""
    for j in range(p.bn // p.epi_n):
        buf = out_smem.at[j % 2]
        acc = plgpu.async_load_tmem(acc_tmem.at[:, pl.ds(j * p.epi_n, p.epi_n)])
        if scale is not None:
            acc = acc * scale
        buf[...] = acc.astype(p.out_dtype)
        plgpu.commit_smem()
        dst = out_gmem.at[pl.ds(mi * p.bm, p.bm), pl.ds(ni * p.bn + j * p.epi_n, p.epi_n)]
        plgpu.copy_smem_to_gmem(buf, dst)
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the other buffer is free again
    plgpu.wait_load_tmem()
    plgpu.wait_smem_to_gmem(0)


def _kernel_call(a, b, a_tiles, b_tiles, t, *, f: MmaFormat, config: Config, out_dtype):
    """The ``plgpu.kernel`` over prepared operands (see the module docstring)."""
    (m, k), n = a.shape, b.shape[0]
    k_steps = k // config.block_k
    p = _Plan(f=f, bm=config.block_m, bn=config.block_n, bk=config.block_k,
              epi_n=config.epilogue_n, k_steps=k_steps,
              stages=min(config.num_stages, k_steps), out_dtype=jnp.dtype(out_dtype))

    def body(*refs):
        n_in = 5 if f.tensor_scaled else 4
        gmem, t_gmem = refs[:4], (refs[4] if f.tensor_scaled else None)
        out_gmem, *scratch = refs[n_in:]
        smem, out_smem, tmem = scratch[:4], scratch[4], scratch[5:8]
        loaded, consumed, mma_done = scratch[8:]
        mi, ni = lax.axis_index("m"), lax.axis_index("n")

        @plgpu.warp_map
        def _(warp):
            @pl.when(warp == 0)
            def _():
                _load_warp(p, gmem, smem, loaded, consumed, mi, ni)

            @pl.when(warp == 1)
            def _():
                _mma_warp(p, smem, tmem, loaded, consumed, mma_done)

        plgpu.barrier_wait(mma_done)
        scale = t_gmem[0] if t_gmem is not None else None
        _epilogue(p, tmem[0], out_smem, out_gmem, scale, mi, ni)

    call = mc.tile_kernel(body, shape=(m, n), block=(p.bm, p.bn), out_dtype=p.out_dtype,
                          scratch_types=_scratch(p),
                          name=f"blackwell_{f.name}_{p.bm}x{p.bn}x{p.bk}_s{p.stages}")
    return call(a, b, a_tiles, b_tiles, *((t,) if f.tensor_scaled else ()))


def blackwell_block_scaled_matmul(
    a_codes, a_scales, b_codes, b_scales, *, fmt: str, a_tensor_scale=None, b_tensor_scale=None,
    out_dtype=jnp.float32, block_m: int = 128, block_n: int = 128, block_k: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """``C [M, N] = dequantize(A) @ dequantize(B)^T`` on Blackwell's block-scaled MMA.

    Args:
      a_codes, a_scales: A ``[M, K]`` quantized along K: uint8 codes ``[M, K*bits/8]`` and
        uint8 scales ``[M, K/block]`` (a QArray's ``codes`` and ``scales``).
      b_codes, b_scales: B ``[N, K]`` (a weight laid out N x K) quantized along K, likewise.
      fmt: ``"mxfp8_e4m3"`` (alias ``"mxfp8"``), ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"``
        (both operands).
      a_tensor_scale, b_tensor_scale: NVFP4's float32 tensor scales (required for NVFP4,
        forbidden otherwise); C is multiplied by ``a_t * b_t`` in the epilogue.
      out_dtype: float32, bfloat16 or float16.
      block_m, block_n: 128 (see the module docstring); block_k: K per pipeline step
        (default :func:`get_default`); num_stages: SMEM slots (default 4, at most the steps).

    Raises ValueError naming the argument when a shape or block does not fit: M a multiple
    of ``block_m``, N of ``block_n``, K of ``block_k``, ``block_k`` of ``4 * block``.

    Runs on a Blackwell GPU only (Mosaic GPU has no interpret mode for TMEM / tcgen05);
    elsewhere use :func:`reference`, or compile it device-less with :func:`compile_report`.
    """
    f = _mma_format(fmt)
    out_dtype = mc.check_out_dtype(out_dtype)
    a, b, a_tiles, b_tiles, t = prepare_operands(
        a_codes, a_scales, b_codes, b_scales, fmt=f.name,
        a_tensor_scale=a_tensor_scale, b_tensor_scale=b_tensor_scale,
    )
    (m, k), n = a.shape, b.shape[0]
    config = mc.tiles(get_default(f.name, m, n, k), block_m=block_m, block_n=block_n,
                      block_k=block_k, num_stages=num_stages)
    _check_config(config, f, m, n, k)
    return _kernel_call(a, b, a_tiles, b_tiles, t, f=f, config=config, out_dtype=out_dtype)


def reference(
    a_codes, a_scales, b_codes, b_scales, *, fmt: str, a_tensor_scale=None,
    b_tensor_scale=None, out_dtype=jnp.float32,
) -> jax.Array:
    """What :func:`blackwell_block_scaled_matmul` computes, in XLA: both operands
    dequantized by lowbit, NVFP4's tensor scales on every element rather than on the sum, and
    a float32 dot (:func:`pallas_kernels.mosaic_common.reference_matmul`, which checks the
    arguments alike)."""
    return mc.reference_matmul(a_codes, a_scales, b_codes, b_scales, _mma_format(fmt),
                               a_tensor_scale=a_tensor_scale, b_tensor_scale=b_tensor_scale,
                               out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# Device-less compilation for a B200

_MMA_KIND = re.compile(r"tcgen05\.mma\.cta_group::\d\.(kind::[\w:.]+)")


def mma_kinds(ptx: str) -> list[str]:
    """The distinct ``kind::...`` qualifiers of the ``tcgen05.mma`` instructions in ``ptx``,
    up to and including ``block_scale`` (``scale_vec`` and the rest dropped).

    >>> mma_kinds("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X [%r1]")
    ['kind::mxf4nvf4.block_scale']
    """
    kinds = set()
    for k in _MMA_KIND.findall(ptx):
        parts = k.split(".")
        kinds.add(".".join(parts[: parts.index("block_scale") + 1]) if "block_scale" in parts
                  else parts[0])
    return sorted(kinds)


def smem_bytes(config: Config, fmt: str, out_dtype=jnp.float32) -> int:
    """Shared memory the kernel's scratch asks for (barriers aside): ``num_stages`` slots of
    both operands' codes and scale tiles, and two ``[block_m, epilogue_n]`` output buffers.

    >>> smem_bytes(get_default("nvfp4", 1024, 1024, 1024), "nvfp4")  # 4 x (32 + 4) + 32 KiB
    180224
    """
    f = _mma_format(fmt)
    c = config
    codes = (c.block_m + c.block_n) * c.block_k * f.bits // 8
    scales = (c.block_m + c.block_n) // 128 * (c.block_k // f.block // 4) * 512
    return c.num_stages * (codes + scales) + 2 * c.block_m * c.epilogue_n * jnp.dtype(
        out_dtype).itemsize


def compile_report(fmt: str, m: int, n: int, k: int, *, target: str = "b200",
                   out_dtype=jnp.float32, block_k: int | None = None,
                   num_stages: int | None = None) -> dict:
    """Compile the kernel for a device-less ``target`` (``"b200"``) and report its code.

    Needs the CUDA plugin (``.venv-gpu``, ``JAX_PLATFORMS=cpu``; raises RuntimeError without
    it, or where this process compiled Mosaic GPU kernels for another target). Compiles with
    :func:`pallas_kernels.mosaic_common.compile_with_dump` (under the target's mesh, whose
    device gives Mosaic GPU the compute capability, 10.0 for the B200) and reads the PTX and
    the ``ptxas -v`` log that Mosaic GPU writes while it compiles the kernel. Returns a dict:
    ``kinds`` (the ``tcgen05.mma`` kinds in the PTX, :func:`mma_kinds`), ``expected_kind``,
    ``registers``, ``spill_stores``, ``spill_loads``, ``stack`` (bytes per thread),
    ``kernel`` (its name), ``config``, ``smem_bytes``, ``compile_s`` (seconds to lower and
    compile the jitted wrapper), ``ptxas_ms`` (ptxas's own compile time) and ``xla_kernels``
    (XLA's fusions around it: the scale re-layouts, NVFP4's tensor-scale product).
    """
    f = _mma_format(fmt)
    out_dtype = jnp.dtype(out_dtype)
    config = mc.override(get_default(f.name, m, n, k), block_k=block_k, num_stages=num_stages)
    build, stats = mc.compile_matmul(
        blackwell_block_scaled_matmul, f, m, n, k, target, out_dtype=out_dtype,
        block_m=config.block_m, block_n=config.block_n, block_k=config.block_k,
        num_stages=config.num_stages,
    )
    steps = k // config.block_k
    return dict(
        fmt=f.name, shape=(m, n, k), target=target, kinds=mma_kinds(build.ptx),
        expected_kind=f.ptx_kind, **stats,
        config=dataclasses.asdict(
            dataclasses.replace(config, num_stages=min(config.num_stages, steps))),
        smem_bytes=smem_bytes(config, f.name, out_dtype),
    )
