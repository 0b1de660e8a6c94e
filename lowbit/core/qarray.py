"""Block-scaled quantization: the QArray pytree, quantize / dequantize / fake_quantize.

Layout. Blocks are formed where they lie (no transpose of the input). For storage, the
quantized axes are moved to the end (in the order given) and zero-padded to a multiple of the
block; ``codes`` hold the packed element codes of that layout (two FP4 codes a
byte, low nibble first; four FP6 codes in three bytes, little-endian; one byte for FP8 and
INT8) and ``scales`` one byte per block (E8M0 exponent, or unsigned E4M3 for NVFP4). NVFP4 also
carries a float32 ``tensor_scale``. ``dequantize`` restores the original shape and axis order.

>>> import jax.numpy as jnp, lowbit as lb
>>> x = jnp.linspace(-1.0, 1.0, 64).reshape(2, 32)
>>> q = lb.quantize(x, "mxfp4")
>>> q.codes.shape, q.scales.shape, q.nbytes
((2, 16), (2, 1), 34)
>>> bool(jnp.all(lb.dequantize(q) == lb.fake_quantize(x, "mxfp4")))
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.core import formats as _formats
from lowbit.core import hadamard as _hadamard
from lowbit.core import native as _native
from lowbit.core.formats import E4M3, BlockFormat, ElementFormat
from lowbit.core.numerics import (
    exponent,
    ieee_div,
    ldexp_exact,
    materialize,
    pow2,
    round_to_grid,
    uniform_bits,
)
from lowbit.core.plan import (  # the plan's home; re-exported here for qarray's callers
    ROUNDINGS,
    SCALE_MODES,
    Plan,
    check_prescale,
    make_plan,
    scale_mode_of,
)
from lowbit.core.scales import (  # the scale rules' home; re-exported here
    FOUR_OVER_SIX_METRICS,
    four_over_six,
    ms_eden,
    mx_scale_exponent,
    nvfp4_tensor_scale,
)

__all__ = [
    "QArray",
    "quantize",
    "dequantize",
    "fake_quantize",
    "encode_elements",
    "decode_elements",
    "SCALE_MODES",
    "ROUNDINGS",
    # Shared internals (used by lowbit's operand quantization, the compiled CPU kernel and
    # the Pallas kernels; not re-exported by ``lowbit``):
    "Plan",
    "make_plan",
    "scale_mode_of",
    "check_prescale",
    "quantize_with_plan",
    "fake_quantize_with_plan",
    "undo_prescale",
    "mx_scale_exponent",
    "nvfp4_tensor_scale",
    "absmean_scales",
    "ABSMEAN_FLOOR",
    "pack_codes",
]

E8M0_NAN = 0xFF
UE4M3_NAN = 0x7F


# --------------------------------------------------------------------------------------------
# The pytree


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scales", "tensor_scale"],
    meta_fields=["format_name", "shape", "dtype", "axes", "block_shape", "tensor_block"],
)
@dataclasses.dataclass(frozen=True)
class QArray:
    """A block-quantized tensor: packed codes, block scales and static metadata.

    Attributes:
      codes: uint8, packed element codes; shape ``[*other, *padded_axes]`` with the last
        dimension divided by the packing ratio (2 for FP4, 4/3 for FP6).
      scales: uint8 block-scale codes, shape ``[*other, *blocks_per_axis]``.
      tensor_scale: float32 scalar (NVFP4, INT4, ternary), else None; with ``tensor_block``
        float32 ``[*other, outer_blocks]``, one per ``tensor_block`` elements along the axis
        (storage order, as ``scales``).
      format_name, shape, dtype: the format and the original tensor's shape and dtype.
      axes: the quantized axes of the original tensor (non-negative), in block order.
      block_shape: block extent along each of ``axes``.
      tensor_block: None, or NVFP4's outer block (TetraJet-v2's double-block scaling).
    """

    codes: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array | None
    format_name: str
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[int, ...]
    block_shape: tuple[int, ...]
    tensor_block: int | None = None

    @property
    def format(self) -> BlockFormat:
        return _formats.get(self.format_name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, one byte per block scale, 4 per tensor (or outer-block)
        scale."""
        n = self.codes.size * self.codes.dtype.itemsize + self.scales.size
        return n + (4 * self.tensor_scale.size if self.tensor_scale is not None else 0)

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / self.size

    def dequantize(self, dtype=None) -> jax.Array:
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        return (
            f"QArray({self.format_name}, shape={self.shape}, axes={self.axes}, "
            f"block_shape={self.block_shape}, codes={self.codes.dtype}{list(self.codes.shape)}, "
            f"scales={self.scales.dtype}{list(self.scales.shape)})"
        )


# --------------------------------------------------------------------------------------------
# Element codes


def encode_elements(v: jax.Array, elem: ElementFormat) -> jax.Array:
    """uint8 codes of float32 values that lie exactly on ``elem``'s grid (sign-magnitude;
    ``elem.bits``-bit two's complement for integer grids: MX INT8, INT4, ternary)."""
    v = v.astype(jnp.float32)
    if elem.is_int:  # ``elem.bits``-bit two's complement of value * 2**int_shift
        k = jnp.round(ldexp_exact(v, elem.int_shift)).astype(jnp.int32)
        return (k & ((1 << elem.bits) - 1)).astype(jnp.uint8)
    bits = lax.bitcast_convert_type(v, jnp.uint32)
    sign = (bits >> 31).astype(jnp.uint8)
    a = jnp.abs(v)
    abits = lax.bitcast_convert_type(a, jnp.int32)
    e_field = jnp.maximum(exponent(a) + elem.bias, 0)
    mant_normal = (abits >> (23 - elem.mbits)) & ((1 << elem.mbits) - 1)
    mant_sub = ldexp_exact(a, elem.mbits - elem.emin).astype(jnp.int32)
    mant = jnp.where(e_field > 0, mant_normal, mant_sub)
    code = (e_field << elem.mbits) | mant
    return code.astype(jnp.uint8) | (sign << (elem.ebits + elem.mbits))


def decode_elements(codes: jax.Array, elem: ElementFormat) -> jax.Array:
    """float32 values of uint8 element codes (inverse of :func:`encode_elements`); E5M2's
    Inf/NaN codes and E4M3's NaN code decode to Inf/NaN."""
    codes = codes.astype(jnp.uint8)
    if elem.is_int:
        c = codes.astype(jnp.int32) & ((1 << elem.bits) - 1)
        k = c - (((c >> (elem.bits - 1)) & 1) << elem.bits)  # sign extension
        return ldexp_exact(k.astype(jnp.float32), -elem.int_shift)
    c = codes.astype(jnp.int32)
    nbits = elem.ebits + elem.mbits
    sign = (c >> nbits) & 1
    e_field = (c >> elem.mbits) & ((1 << elem.ebits) - 1)
    mant = c & ((1 << elem.mbits) - 1)
    normal_bits = ((e_field - elem.bias + 127) << 23) | (mant << (23 - elem.mbits))
    normal = lax.bitcast_convert_type(normal_bits, jnp.float32)
    sub = ldexp_exact(mant.astype(jnp.float32), elem.emin - elem.mbits)
    mag = jnp.where(e_field == 0, sub, normal)
    emax_field = (1 << elem.ebits) - 1
    if elem.has_inf:  # IEEE-like specials (E5M2)
        special = jnp.where(mant == 0, np.float32(np.inf), np.float32(np.nan))
        mag = jnp.where(e_field == emax_field, special, mag)
    elif elem.name == "e4m3":  # S.1111.111 is NaN
        mag = jnp.where((e_field == emax_field) & (mant == 7), np.float32(np.nan), mag)
    return jnp.where(sign == 1, -mag, mag)


def pack_codes(codes: jax.Array, elem: ElementFormat) -> jax.Array:
    """Element codes (uint8, one a code) packed along the last axis: two FP4 / INT4 codes a
    byte (low nibble first), four FP6 codes in three bytes, ternary five trits a byte."""
    n, _ = elem.pack_group
    if n == 1:
        return codes
    g = codes.reshape(*codes.shape[:-1], codes.shape[-1] // n, n)
    if elem.name == "ternary":  # base 3, first code least significant: trit = code + 1
        t = (g.astype(jnp.int32) + 1) & 3
        return (t[..., 0] + 3 * t[..., 1] + 9 * t[..., 2] + 27 * t[..., 3]
                + 81 * t[..., 4]).astype(jnp.uint8)
    if elem.bits == 4:
        return g[..., 0] | (g[..., 1] << 4)
    w = g.astype(jnp.uint32)
    w = w[..., 0] | (w[..., 1] << 6) | (w[..., 2] << 12) | (w[..., 3] << 18)
    b = jnp.stack([w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF], axis=-1).astype(jnp.uint8)
    return b.reshape(*codes.shape[:-1], codes.shape[-1] // 4 * 3)


def _unpack(packed: jax.Array, elem: ElementFormat) -> jax.Array:
    n, nb = elem.pack_group
    if n == 1:
        return packed
    if elem.name == "ternary":
        b = packed.astype(jnp.int32)
        trits = [(b // d) % 3 for d in (1, 3, 9, 27, 81)]
        out = (jnp.stack(trits, axis=-1) - 1) & 3  # back to 2-bit two's complement
        return out.astype(jnp.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * 5)
    if elem.bits == 4:
        lo, hi = packed & 0xF, packed >> 4
        out = jnp.stack([lo, hi], axis=-1)
        return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    g = packed.reshape(*packed.shape[:-1], packed.shape[-1] // nb, nb).astype(jnp.uint32)
    w = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
    out = jnp.stack([(w >> s) & 0x3F for s in (0, 6, 12, 18)], axis=-1).astype(jnp.uint8)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] // 3 * 4)


# --------------------------------------------------------------------------------------------
# Argument checking and layout
def _check_input(x, name: str = "x") -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name} must be a floating-point array (float32, bfloat16, float16), got {x.dtype}"
        )
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    return x


def _to_blocks(x: jax.Array, plan: Plan) -> jax.Array:
    """``x`` -> float32 in :attr:`Plan.blocked_shape` (zero-padded, blocks in place)."""
    x = x.astype(jnp.float32)
    if plan.padded_shape != x.shape:
        x = jnp.pad(x, [(0, p - d) for p, d in zip(plan.padded_shape, x.shape, strict=True)])
    return x.reshape(plan.blocked_shape)


def _from_blocks(y: jax.Array, plan: Plan) -> jax.Array:
    """Inverse of :func:`_to_blocks` (drops the padding)."""
    y = y.reshape(plan.padded_shape)
    if plan.padded_shape != plan.shape:
        y = y[tuple(slice(0, d) for d in plan.shape)]
    return y


def _to_storage(a: jax.Array, plan: Plan) -> jax.Array:
    """Codes or scales from the tensor's axis order to the storage order (quantized axes
    last, in block order)."""
    return jnp.transpose(a, plan.perm) if plan.moves_axes else a


def _from_storage(a: jax.Array, plan: Plan) -> jax.Array:
    return jnp.transpose(a, np.argsort(plan.perm)) if plan.moves_axes else a


# --------------------------------------------------------------------------------------------
# Scales


@dataclasses.dataclass
class _Quantized:
    """Elements on the grid (float32, pre-scale) and per-block scale data, blocked layout."""

    elems: jax.Array
    scale_code: jax.Array  # uint8, blocked layout with size-1 block dims
    mul: Any  # callable elems -> dequantized float32
    finite: jax.Array  # bool per block: False where the block holds NaN or Inf
    clipped: jax.Array | None = None
    tensor_scale: jax.Array | None = None


def _e4m3_scaled(q, s, t, finite, clipped, plan: Plan) -> _Quantized:
    """The :class:`_Quantized` of E4M3-scaled blocks (NVFP4, INT4): elements ``q``, block
    scales ``s`` and tensor (or outer-block) scales ``t``, values ``(q * s) * t`` with the
    prescale undone; a non-finite block gets the NaN scale code and NaN values."""
    code = jnp.where(finite, encode_elements(s, E4M3), jnp.uint8(UE4M3_NAN))
    s_or_nan = jnp.where(finite, s, np.float32(np.nan))

    def mul(elems, s=s_or_nan, t=t):
        return undo_prescale((elems * s) * t, plan.prescale)

    return _Quantized(q, code, mul, finite, clipped, tensor_scale=t)


_INF_BITS = 0x7F800000


def _amax_bits(xb: jax.Array, plan: Plan, finite_only: bool = False) -> jax.Array:
    """Block max of ``|x|`` as int32 bit patterns (keepdims).

    For non-negative floats the integer order is the float order, with +Inf above every
    finite value and NaN above +Inf, so an integer max propagates NaN and Inf reliably
    (XLA's CPU float max reduction can drop NaN). With ``finite_only``, NaN and Inf count
    as zero (for NVFP4's tensor amax, which ignores non-finite values).
    """
    bits = lax.bitcast_convert_type(xb, jnp.int32) & 0x7FFFFFFF
    if finite_only:
        bits = jnp.where(bits < _INF_BITS, bits, 0)
    axes = plan.block_axes
    if axes == (xb.ndim - 1,):
        # Blocks along the minor axis: XLA:CPU emits a slow loop for a reduction over a short
        # minor axis (its fast float path drops NaN). Elementwise maxima of halves first
        # (vectorised across blocks), 32 -> 16 -> 8 -> 4, then a reduction over 4: measured
        # 0.14x of a memory-bound pass instead of 0.39x (4096 x 4096 float32, 2 cores).
        while bits.shape[-1] > 4 and bits.shape[-1] % 2 == 0:
            h = bits.shape[-1] // 2
            bits = jnp.maximum(bits[..., :h], bits[..., h:])
    return jnp.max(bits, axis=axes, keepdims=True)


def _quantize_blocks(xb, plan: Plan, key, tensor_amax, want_clip: bool) -> _Quantized:
    fmt, elem = plan.fmt, plan.fmt.elem
    rbits = uniform_bits(key, xb.shape) if plan.stochastic else None
    if fmt.is_absmean:  # one scale per tensor: no block maxima
        return _quantize_absmean(xb, plan, rbits, want_clip)
    amax_bits = _amax_bits(xb, plan)
    amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
    finite = amax_bits < _INF_BITS  # False for blocks holding NaN or Inf

    if fmt.is_mx:
        e = mx_scale_exponent(amax, elem, plan.scale_mode)
        code = jnp.where(finite, (e + 127).astype(jnp.uint8), jnp.uint8(E8M0_NAN))
        # Per-block multipliers, computed once per block (the barrier keeps XLA from
        # recomputing them for every element): x * 2**-e and q * 2**e, each as two exact
        # power-of-two factors so no factor is a float32 subnormal (2**-127 flushes to zero
        # on CPU). A non-finite block gets a NaN factor and dequantizes to NaN.
        d_hi = jnp.clip(-e, -126, 127)
        s_hi = jnp.clip(e, -126, 127)
        nan = np.float32(np.nan)
        inv_hi, inv_lo = pow2(d_hi), pow2(-e - d_hi)
        mul_hi = jnp.where(finite, pow2(s_hi), nan)
        mul_lo = pow2(e - s_hi)
        inv_hi, inv_lo, mul_hi, mul_lo = materialize(inv_hi, inv_lo, mul_hi, mul_lo)
        v = xb * inv_hi
        if elem.emax == 0:  # only MX INT8 can need 2**-e == 2**-127 (amax >= 2**127)
            v = v * inv_lo
        if plan.prescale != 1.0:
            v = v * np.float32(plan.prescale)
        clipped = jnp.abs(v) > elem.max if want_clip else None
        q = round_to_grid(v, elem, rbits=rbits, saturate=True)

        def mul(elems, hi=mul_hi, lo=mul_lo):
            return undo_prescale((elems * hi) * lo, plan.prescale)

        return _Quantized(q, code, mul, finite, clipped)

    if plan.tensor_block is not None:
        return _double_block(xb, plan, amax_bits, finite, rbits, want_clip)
    if plan.eden:
        return _eden_blocks(xb, plan, key, amax, finite, want_clip)
    # NVFP4 (and INT4): a float32 tensor scale and unsigned-E4M3 block scales.
    if tensor_amax is None:
        # The tensor amax ignores NaN and Inf values (not the finite values beside them):
        # the block maxima give it unless some block is non-finite, when a second reduction
        # over the finite values runs (lax.cond: only then).
        tamax_bits = lax.cond(
            jnp.all(finite),
            lambda: jnp.max(amax_bits),
            lambda: jnp.max(_amax_bits(xb, plan, finite_only=True)),
        )
        tamax = lax.bitcast_convert_type(tamax_bits, jnp.float32)
    else:
        tamax = jnp.asarray(tensor_amax, jnp.float32)
    if plan.scale_mode in FOUR_OVER_SIX_METRICS:
        return _four_over_six_blocks(xb, plan, amax, tamax, finite, rbits, want_clip)
    t = nvfp4_tensor_scale(tamax, elem.max)
    s_raw = jnp.minimum(ieee_div(ieee_div(amax, np.float32(elem.max)), t),
                        np.float32(E4M3.max))
    s = round_to_grid(jnp.where(t > 0, s_raw, 0.0), E4M3)
    # Elements x * ((1 / t) / s): one multiplication per element, the reciprocal per block
    # (DESIGN.md allows it in place of x / (s * t); both divisions here are exact IEEE).
    live = s > 0
    r = jnp.where(live, ieee_div(ieee_div(np.float32(1.0), t), jnp.where(live, s, 1.0)), 0.0)
    (r,) = materialize(r)
    v = xb * r
    if plan.prescale != 1.0:
        v = v * np.float32(plan.prescale)
    clipped = jnp.abs(v) > elem.max if want_clip else None
    v = jnp.where(r > 0, v, 0.0)
    q = round_to_grid(v, elem, rbits=rbits, saturate=True)
    return _e4m3_scaled(q, s, t, finite, clipped, plan)


def _outer_blocks(bits: jax.Array, plan: Plan):
    """Per-block int32 maxima (blocked layout, keepdims) -> ``(m, expand)``: the maxima of
    their outer blocks (``plan.tensor_block`` elements along the axis), outer blocks last, and
    the function that broadcasts an array of that shape back to every block."""
    (pos,) = (p - 1 for p in plan.block_axes)  # the blocks dim of the blocked layout
    k = plan.tensor_block // plan.block_shape[0]
    m = jnp.moveaxis(jnp.squeeze(bits, pos + 1), pos, -1)
    nb = m.shape[-1]
    m = jnp.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, -nb % k)])
    m = jnp.max(m.reshape(*m.shape[:-1], -1, k), axis=-1)

    def expand(a):
        a = jnp.repeat(a, k, axis=-1)[..., :nb]
        return jnp.expand_dims(jnp.moveaxis(a, -1, pos), pos + 1)

    return m, expand


def _double_block(xb, plan: Plan, amax_bits, finite, rbits, want_clip):
    """NVFP4 with TetraJet-v2's double-block scales (``plan.tensor_block``).

    thu-ml/TetraJet-v2-NVFP4Training @ ca5953f6, ``kernels/csrc/quant_fp4.cu:257-328``
    (``quant_fp4_from_reg``): the outer scale ``S = (amax_128 / 448) / 6`` in float32 (1 where
    that is 0, line 274), the block scale ``(amax_16 / S) / 6`` (2**-9 where that is 0, line
    283) rounded to E4M3 (nearest, saturating), elements ``x * (1 / (S * s))`` rounded to
    E2M1 (nearest-even, saturating), values ``(q * s) * S``. The kernels build with
    ``--use_fast_math`` (approximate division); lowbit divides exactly. The outer amax
    ignores NaN and Inf, as the tensor amax does; a non-finite block comes out NaN.
    """
    elem = plan.fmt.elem
    fin_bits = lax.cond(jnp.all(finite), lambda: amax_bits,
                        lambda: _amax_bits(xb, plan, finite_only=True))
    outer, expand = _outer_blocks(fin_bits, plan)
    # the outer scales on the outer blocks themselves: a division of a broadcast would be
    # rewritten by XLA into a multiplication by a rounded reciprocal (see ieee_div)
    big = ieee_div(ieee_div(lax.bitcast_convert_type(outer, jnp.float32),
                            np.float32(E4M3.max)), np.float32(elem.max))
    (big,) = materialize(jnp.where(big == 0, np.float32(1.0), big))
    big = expand(big)
    amax = lax.bitcast_convert_type(jnp.where(finite, amax_bits, 0), jnp.float32)
    s_raw = ieee_div(ieee_div(amax, big), np.float32(elem.max))
    s = round_to_grid(jnp.where(s_raw == 0, np.float32(2.0**-9), s_raw), E4M3, saturate=True)
    # big * s can be a float32 subnormal (an outer block of values near 1e-30 holding an
    # all-zero block): every implementation counts it as 0 (XLA:CPU flushes it, and 1 / 0
    # would make the elements NaN), so those elements quantize to 0
    prod = big * s
    live = prod >= np.float32(2.0**-126)
    r = jnp.where(live, ieee_div(np.float32(1.0), jnp.where(live, prod, 1.0)), 0.0)
    (r,) = materialize(r)
    v = xb * r
    if plan.prescale != 1.0:
        v = v * np.float32(plan.prescale)
    clipped = jnp.abs(v) > elem.max if want_clip else None
    q = round_to_grid(v, elem, rbits=rbits, saturate=True)
    return _e4m3_scaled(q, s, big, finite, clipped, plan)


def _eden_blocks(xb, plan: Plan, key, amax, finite, want_clip):
    """NVFP4 with MS-EDEN block scales (``lowbit.core.scales.ms_eden``); the scale's random
    bits are the top 16 of one keyed word per block."""
    noise = uniform_bits(key, amax.shape) >> 16
    q, s, ts = ms_eden(xb, amax, finite, plan.block_axes, plan.fmt.elem, noise)
    clipped = None
    if want_clip:  # the elements are scaled by 1 / s0, whose block max is above 6 by design
        clipped = jnp.zeros(xb.shape, bool)
    return _e4m3_scaled(q, s, ts, finite, clipped, plan)


def _four_over_six_blocks(xb, plan: Plan, amax, tamax, finite, rbits, want_clip):
    """NVFP4 with Four Over Six block scales (``lowbit.core.scales.four_over_six``)."""
    q, s, t, v = four_over_six(xb, amax, tamax, plan.block_axes, plan.fmt.elem,
                               FOUR_OVER_SIX_METRICS[plan.scale_mode], rbits=rbits,
                               prescale=plan.prescale)
    clipped = jnp.abs(v) > plan.fmt.elem.max if want_clip else None
    return _e4m3_scaled(q, s, t, finite, clipped, plan)


ABSMEAN_FLOOR = 1e-5  # BitNet's clamp of the mean |w| (and of the per-token amax)


def absmean_scales(x: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """BitNet b1.58's tensor scale of ``x`` (any layout, zero padding allowed) whose true size
    is ``n``: ``gamma = max(sum |x| / n, 1e-5)`` in float32; returns ``(r, t)`` with the
    element multiplier ``r = 1 / gamma`` and the stored scale ``t = 1 / r``, so that
    ``code * t`` is BitNet's ``code / r`` exactly (``code`` in -1, 0, 1). A tensor holding NaN
    or Inf gets ``t = NaN`` (there is no block scale to hold it: every value dequantizes to
    NaN)."""
    a = jnp.abs(x.astype(jnp.float32))
    gamma = jnp.maximum(ieee_div(jnp.sum(a), np.float32(n)), np.float32(ABSMEAN_FLOOR))
    r = ieee_div(np.float32(1.0), gamma)
    t = ieee_div(np.float32(1.0), r)
    return r, jnp.where(jnp.all(jnp.isfinite(a)), t, np.float32(np.nan))


def _quantize_absmean(xb, plan: Plan, rbits, want_clip: bool) -> _Quantized:
    """Ternary (``fmt.is_absmean``): ``clip(round(x * r), -1, 1)``, values ``code * t``
    (:func:`absmean_scales`); BitNet b1.58's ``weight_quant``."""
    elem = plan.fmt.elem
    r, t = absmean_scales(xb, math.prod(plan.shape))
    (r,) = materialize(r)
    v = xb * r
    if plan.prescale != 1.0:
        v = v * np.float32(plan.prescale)
    clipped = jnp.abs(v) > elem.max if want_clip else None
    q = round_to_grid(v, elem, rbits=rbits, saturate=True)
    # per block, as the other formats' fields are: all finite, or all NaN with t
    per_block = tuple(1 if i in plan.block_axes else d for i, d in enumerate(xb.shape))
    finite = jnp.broadcast_to(jnp.isfinite(t), per_block)

    def mul(elems, t=t):
        return undo_prescale(elems * t, plan.prescale)

    return _Quantized(q, jnp.zeros(per_block, jnp.uint8), mul, finite, clipped, tensor_scale=t)


def undo_prescale(y: jax.Array, prescale: float) -> jax.Array:
    """Undo an element prescale (:attr:`Plan.prescale`) on dequantized values."""
    return y if prescale == 1.0 else ieee_div(y, np.float32(prescale))


def _squeeze_blocks(a: jax.Array, plan: Plan) -> jax.Array:
    return jnp.squeeze(a, axis=plan.block_axes)


# --------------------------------------------------------------------------------------------
# Public functions


def quantize(
    x: jax.Array,
    fmt: str | BlockFormat,
    axis: int | tuple[int, ...] = -1,
    *,
    scale_mode: str | None = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    block_shape: tuple[int, ...] | None = None,
    tensor_amax: jax.Array | float | None = None,
    tensor_block: int | None = None,
) -> QArray:
    """Quantize ``x`` to a block-scaled format; returns a :class:`QArray`.

    Args:
      x: floating-point array of any rank.
      fmt: a format name (``lb.formats.names()``) or :class:`BlockFormat`.
      axis: the axis the blocks run along; with a 2-D ``block_shape``, the pair of tiled axes
        (default: the last two).
      scale_mode: MX shared-exponent rule: ``"floor"`` (OCP MX v1.0, default), ``"ceil"``,
        ``"even"``, ``"rceil"`` (smallest power of two that does not clip), ``"oas"`` (OAS,
        qwix's rule). NVFP4: ``"nvfp4"`` (default) or Four Over Six, ``"4over6"`` (each
        block scaled to 4 or to 6, whichever has the smaller squared error), ``"4over6_mae"``,
        ``"4over6_max"`` (see ``lowbit.core.scales``).
      rounding: ``"nearest"`` (half to even) or ``"stochastic"`` (needs ``key``).
      key: PRNG key for stochastic rounding.
      block_shape: None (the format's own 1-D block, the one its specification defines),
        ``(b,)``, or a 2-D tile such as ``(16, 16)``; extents are powers of two (else a
        ValueError naming what is accepted; ``lowbit.core.plan.check_block_shape``).
      tensor_amax: NVFP4 only: calibrated per-tensor absolute max (default: ``x``'s own).
      tensor_block: NVFP4 only: TetraJet-v2's double-block scaling, a float32 outer scale per
        ``tensor_block`` elements along ``axis`` (a multiple of 16, e.g. 128) in place of the
        tensor scale (``QArray.tensor_scale`` then holds one per outer block).

    Padding: a quantized axis whose length is not a multiple of its block is zero-padded at
    its end to the next multiple (100 columns of MXFP4: 128, 4 blocks). Zeros never change a
    block's scale (an amax) nor the tensor scale, so every value quantizes as without the
    padding; ``q.shape`` stays ``x``'s and ``dequantize`` returns it, but ``codes`` and
    ``scales`` hold the padded blocks (5.44 bits per element instead of 4.25 in that example).
    A ``lowbit.core.plan.PaddingWarning`` says so once per format, axis length and block.

    >>> import jax.numpy as jnp, lowbit as lb
    >>> q = lb.quantize(jnp.array([[0.3, -1.7, 5.0, 100.0] * 8]), "mxfp4")
    >>> lb.dequantize(q)[0, :4].tolist()
    [0.0, -0.0, 8.0, 96.0]
    """
    x = _check_input(x)
    plan = make_plan(x.shape, fmt, axis, block_shape, scale_mode, rounding, key, tensor_amax,
                     tensor_block=tensor_block)
    return quantize_with_plan(x, plan, key, tensor_amax)


def quantize_with_plan(x, plan: Plan, key, tensor_amax) -> QArray:
    """:func:`quantize` for a checked plan. With ``plan.prescale != 1`` the codes hold the
    elements of ``x * prescale`` (scale chosen from ``x``); divide dequantized values by it."""
    qz = _quantize_blocks(_to_blocks(x, plan), plan, key, tensor_amax, want_clip=False)
    elem = plan.fmt.elem
    elems = jnp.where(qz.finite, qz.elems, 0.0)  # a NaN/Inf block: NaN scale, zero codes
    codes = _to_storage(encode_elements(elems, elem).reshape(plan.padded_shape), plan)
    if plan.fmt.is_absmean:  # no block scales
        scales = jnp.zeros((0,), jnp.uint8)
    else:
        scales = _to_storage(_squeeze_blocks(qz.scale_code, plan), plan)
    t = qz.tensor_scale
    if plan.tensor_block is not None:  # per block -> one per outer block, storage order
        k = plan.tensor_block // plan.block_shape[0]
        t = _to_storage(_squeeze_blocks(t, plan), plan)[..., ::k]
    return QArray(
        codes=pack_codes(codes, elem),
        scales=scales,
        tensor_scale=t,
        format_name=plan.fmt.name,
        shape=tuple(x.shape),
        dtype=x.dtype,
        axes=plan.axes,
        block_shape=plan.block_shape,
        tensor_block=plan.tensor_block,
    )


def dequantize(q: QArray, dtype=None) -> jax.Array:
    """Values of a :class:`QArray` in ``dtype`` (default: the dtype it was quantized from).

    >>> import jax.numpy as jnp, lowbit as lb
    >>> lb.dequantize(lb.quantize(jnp.ones((4, 32)), "nvfp4"), jnp.bfloat16).dtype
    dtype(bfloat16)
    """
    if not isinstance(q, QArray):
        raise TypeError(f"q must be a QArray, got {type(q).__name__}")
    fmt = q.format
    elem = fmt.elem
    plan = make_plan(q.shape, fmt, q.axes, q.block_shape, None, "nearest", None, None,
                     tensor_block=q.tensor_block, warn_padding=False)  # said at quantize
    codes = _from_storage(_unpack(q.codes, elem), plan).reshape(plan.blocked_shape)
    elems = decode_elements(codes, elem)
    if fmt.is_absmean:
        return _from_blocks(elems * q.tensor_scale, plan).astype(q.dtype if dtype is None
                                                                 else dtype)
    scales = jnp.expand_dims(_from_storage(q.scales, plan), plan.block_axes)
    if fmt.is_mx:
        e = scales.astype(jnp.int32) - 127
        s_hi = jnp.clip(e, -126, 127)
        hi = jnp.where(scales == E8M0_NAN, np.float32(np.nan), pow2(s_hi))
        y = (elems * hi) * pow2(e - s_hi)
    else:
        s = decode_elements(scales, E4M3)
        t = q.tensor_scale
        if q.tensor_block is not None:  # one per outer block -> per block
            k = q.tensor_block // q.block_shape[0]
            t = jnp.repeat(t, k, axis=-1)[..., : q.scales.shape[-1]]
            t = jnp.expand_dims(_from_storage(t, plan), plan.block_axes)
        y = (elems * s) * t
    return _from_blocks(y, plan).astype(q.dtype if dtype is None else dtype)


def fake_quantize_with_plan(
    x,
    key,
    tensor_amax,
    plan: Plan,
    want_clip: bool = False,
    *,
    hadamard: int | None = None,
    signs: jax.Array | None = None,
    native: bool = True,
):
    """Fake-quantized ``x`` per a checked ``plan``, and (``want_clip``) where it saturated.

    With ``hadamard=b`` (a 1-D plan only), ``x`` is first transformed along the plan's axis by
    ``lowbit.core.hadamard.hadamard_transform(x, b, signs=signs)`` and the result, in the rotated
    basis, is quantized. ``native`` allows the compiled CPU kernel (``lowbit.core.native``) where it
    applies and is active: it computes the XLA path's values bit for bit, except that its
    fused Hadamard follows the butterfly's fixed arithmetic (``method="butterfly"``), which
    the XLA path's default dense form matches to float32 rounding. Returns ``(y, clipped)``
    (``clipped`` None unless asked for).
    """
    if hadamard is not None and len(plan.axes) != 1:
        raise ValueError(
            f"a Hadamard transform before quantization needs 1-D blocks, got block_shape "
            f"{plan.block_shape} over axes {plan.axes}"
        )

    def rotate(x, method=None):
        if hadamard is None:
            return x
        return _hadamard.hadamard_transform(x, hadamard, signs=signs, axis=plan.axes[0],
                                            method=method)

    if native and not want_clip and _native.supports(plan, hadamard) and _native.active():
        # On CPU, the compiled one-pass kernel (see lowbit/core/native.py).
        def xla(x):
            return fake_quantize_with_plan_xla(rotate(x), key, tensor_amax, plan, False)[0]

        y = _native.fake_quantize(x, key, tensor_amax, plan, xla, hadamard=hadamard,
                                  signs=signs)
        return y, None
    return fake_quantize_with_plan_xla(rotate(x), key, tensor_amax, plan, want_clip)


def fake_quantize_with_plan_xla(x, key, tensor_amax, plan: Plan, want_clip: bool):
    qz = _quantize_blocks(_to_blocks(x, plan), plan, key, tensor_amax, want_clip)
    y = _from_blocks(qz.mul(qz.elems), plan).astype(x.dtype)
    if not want_clip:
        return y, None
    return y, _from_blocks(qz.clipped, plan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _fake_quantize_ste(x, key, tensor_amax, plan: Plan, clip_grad: bool):
    return fake_quantize_with_plan(x, key, tensor_amax, plan, False)[0]


@_fake_quantize_ste.defjvp
def _fake_quantize_ste_jvp(plan, clip_grad, primals, tangents):
    x, key, tensor_amax = primals
    dx = tangents[0]
    y, clipped = fake_quantize_with_plan(x, key, tensor_amax, plan, clip_grad)
    if clip_grad:
        dx = jnp.where(clipped, jnp.zeros_like(dx), dx)
    return y, dx


def fake_quantize(
    x: jax.Array,
    fmt: str | BlockFormat,
    axis: int | tuple[int, ...] = -1,
    *,
    scale_mode: str | None = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    block_shape: tuple[int, ...] | None = None,
    tensor_amax: jax.Array | float | None = None,
    tensor_block: int | None = None,
    clip_gradient: bool = False,
) -> jax.Array:
    """``dequantize(quantize(x, ...))`` in one fused pass, with a straight-through gradient.

    Bit-identical to the round trip (tested), without encoding or packing codes. The
    gradient is the identity (STE); with ``clip_gradient=True`` it is zero where ``x``
    saturated (``|x| / scale > elem.max``). Arguments as in :func:`quantize`, and padding
    too: an axis that is no multiple of its block is quantized as if zero-padded (zeros never
    change a scale; a ``PaddingWarning`` once per case) and returned at ``x``'s shape.

    >>> import jax, jax.numpy as jnp, lowbit as lb
    >>> x = jnp.linspace(-3.0, 3.0, 32)
    >>> bool(jnp.all(jax.grad(lambda x: lb.fake_quantize(x, "mxfp4").sum())(x) == 1.0))
    True
    """
    x = _check_input(x)
    plan = make_plan(x.shape, fmt, axis, block_shape, scale_mode, rounding, key, tensor_amax,
                     tensor_block=tensor_block)
    if key is not None and jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return _fake_quantize_ste(x, key, tensor_amax, plan, bool(clip_gradient))
