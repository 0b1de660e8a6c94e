"""Kernel-side numerics: lowbit's rounding, codes and hash, in Triton-lowerable operations.

Each function here mirrors one of :mod:`lowbit.numerics` / :mod:`lowbit.qarray` operation for
operation, so that a kernel run in interpret mode (where XLA evaluates the kernel body, with
the same float semantics as the reference, subnormal flushing on CPU included) and the compiled
Triton kernel both reproduce ``lowbit.quantize`` bit for bit. They differ from lowbit only
where the Triton lowering of jax 0.10 lacks a primitive:

- no ``round`` (``jnp.round``): round half to even of a small non-negative float is
  ``floor`` plus a tie rule, exact;
- no ``copysign``: the sign bit is OR-ed into the bit pattern;
- float32 division in Triton is ``div.full.f32`` (approximate, up to 2 ulp): correctly rounded
  division (what XLA does, and what NVFP4's scales need) is inline PTX ``div.rn.f32`` on the
  GPU; in interpret mode it is lowbit's own ``a / (b + a * 0)``;
- no gathers, no value slicing: codes are decoded with shifts and masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plgpu

from lowbit import numerics as lowbit_numerics
from lowbit.formats import ElementFormat
from lowbit.numerics import fmix32

__all__ = [
    "fmix32",
    "hash_constants",
    "hashed_bits",
    "pow2",
    "ieee_div",
    "round_to_grid",
    "encode",
    "decode",
    "mx_scale_exponent",
]

_MANT = 23
_BIAS = 127
INF_BITS = 0x7F800000


def hash_constants(key: jax.Array) -> jax.Array:
    """uint32[2] (ka, kb): the per-key constants of ``lowbit.numerics.uniform_bits``."""
    from lowbit.numerics import key_words

    k0, k1 = key_words(key)
    ka = fmix32(k1 ^ fmix32(k0 + jnp.uint32(0x7F4A7C15)))
    kb = fmix32(ka ^ jnp.uint32(0x2545F491))
    return jnp.stack([ka, kb])


def hashed_bits(idx: jax.Array, ka: jax.Array, kb: jax.Array) -> jax.Array:
    """Random bits of flat indices ``idx`` (uint32): equal to ``uniform_bits(key, shape)``
    at those indices."""
    return fmix32((idx ^ ka) * jnp.uint32(0x9E3779B9) + kb)


def pow2(e: jax.Array) -> jax.Array:
    """``2.0**e`` (float32) for int32 ``e`` in [-126, 127], from the exponent bits."""
    return lax.bitcast_convert_type((e + _BIAS) << _MANT, jnp.float32)


def ieee_div(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
    """Correctly rounded float32 ``a / b`` (``b`` broadcasts against ``a``)."""
    b = jnp.broadcast_to(b, a.shape)
    if interpret:  # the kernel is inlined into XLA: guard it as lowbit does
        return lowbit_numerics.ieee_div(a, b)
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )[0]


def _copysign(r: jax.Array, v: jax.Array) -> jax.Array:
    """``copysign(r, v)`` for ``r >= 0``."""
    rb = lax.bitcast_convert_type(r, jnp.uint32)
    sb = lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0x80000000)
    return lax.bitcast_convert_type(rb | sb, jnp.float32)


def round_to_grid(v: jax.Array, elem: ElementFormat, rbits: jax.Array | None = None):
    """``lowbit.numerics.round_to_grid`` (``v`` inside ``[-elem.max, elem.max]``)."""
    a = jnp.abs(v)
    shift = _MANT - elem.mbits
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    keep = jnp.uint32(~((1 << shift) - 1) & 0xFFFFFFFF)  # a constant (Triton: no `not` of one)
    if rbits is None:
        bits = bits + (jnp.uint32((1 << (shift - 1)) - 1) + ((bits >> shift) & jnp.uint32(1)))
    else:
        bits = bits + (rbits >> (32 - shift))
    normal = lax.bitcast_convert_type(bits & keep, jnp.float32)
    q = 2.0 ** (elem.emin - elem.mbits)
    y = a * np.float32(1.0 / q)  # exact: |v| in grid steps
    fl = jnp.floor(y)
    frac = y - fl  # exact
    if rbits is None:
        # round half to even: up above one half, and at one half when floor is odd
        odd = (fl - np.float32(2.0) * jnp.floor(fl * np.float32(0.5))) == np.float32(1.0)
        up = (frac > np.float32(0.5)) | ((frac == np.float32(0.5)) & odd)
    else:
        u = (rbits >> 8).astype(jnp.float32) * np.float32(2.0**-24)
        up = u < frac
    sub = (fl + up.astype(jnp.float32)) * np.float32(q)
    r = jnp.where(a < np.float32(elem.min_normal), sub, normal)
    if elem.is_int:  # two's complement has no -0
        return jnp.where(r == 0, np.float32(0), _copysign(r, v))
    return _copysign(r, v)


def encode(v: jax.Array, elem: ElementFormat) -> jax.Array:
    """int32 codes (0..255) of float32 values on ``elem``'s grid (``encode_elements``)."""
    if elem.is_int:
        k = (v * np.float32(64.0)).astype(jnp.int32)  # exact integers -127..127
        return k & 0xFF
    bits = lax.bitcast_convert_type(v, jnp.int32)
    sign = (bits >> 31) & 1
    abits = bits & 0x7FFFFFFF
    a = lax.bitcast_convert_type(abits, jnp.float32)
    e_field = jnp.maximum(((abits >> _MANT) & 0xFF) - _BIAS + elem.bias, 0)
    mant_normal = (abits >> (_MANT - elem.mbits)) & ((1 << elem.mbits) - 1)
    mant_sub = (a * np.float32(1.0 / elem.min_subnormal)).astype(jnp.int32)
    mant = jnp.where(e_field > 0, mant_normal, mant_sub)
    return (e_field << elem.mbits) | mant | (sign << (elem.ebits + elem.mbits))


def decode(c: jax.Array, elem: ElementFormat) -> jax.Array:
    """float32 values of int32 codes 0..255 (``decode_elements``)."""
    if elem.is_int:
        k = jnp.where(c >= 128, c - 256, c)
        return k.astype(jnp.float32) * np.float32(2.0**-6)
    nbits = elem.ebits + elem.mbits
    sign = (c >> nbits) & 1
    e_field = (c >> elem.mbits) & ((1 << elem.ebits) - 1)
    mant = c & ((1 << elem.mbits) - 1)
    normal_bits = ((e_field - elem.bias + _BIAS) << _MANT) | (mant << (_MANT - elem.mbits))
    normal = lax.bitcast_convert_type(normal_bits, jnp.float32)
    sub = mant.astype(jnp.float32) * np.float32(elem.min_subnormal)
    mag = jnp.where(e_field == 0, sub, normal)
    emax_field = (1 << elem.ebits) - 1
    if elem.has_inf:
        special = jnp.where(mant == 0, np.float32(np.inf), np.float32(np.nan))
        mag = jnp.where(e_field == emax_field, special, mag)
    elif elem.name == "e4m3":
        mag = jnp.where((e_field == emax_field) & (mant == 7), np.float32(np.nan), mag)
    return jnp.where(sign == 1, -mag, mag)


def mx_scale_exponent(amax_bits: jax.Array, elem: ElementFormat, mode: str) -> jax.Array:
    """``lowbit.qarray.mx_scale_exponent`` from the int32 bit pattern of the block amax."""
    bits = amax_bits
    amax = lax.bitcast_convert_type(bits, jnp.float32)
    mant = bits & 0x7FFFFF
    exp = ((bits >> _MANT) & 0xFF) - _BIAS
    if mode == "floor":
        e = exp - elem.emax
    elif mode == "ceil":
        e = exp + (mant != 0).astype(jnp.int32) - elem.emax
    elif mode == "even":
        half = 1 << (_MANT - elem.mbits - 1)
        rounded = (bits + half) & ~((1 << (_MANT - elem.mbits)) - 1)
        e = ((rounded >> _MANT) & 0xFF) - _BIAS - elem.emax
    elif mode == "rceil":
        m_bits = int(np.float32(elem.max).view(np.int32))
        e = exp - elem.emax + (mant > (m_bits & 0x7FFFFF)).astype(jnp.int32)
    else:
        raise ValueError(f"unknown scale_mode {mode!r}")
    e = jnp.where(amax > 0, e, -127)  # float compare, as the reference (FTZ on CPU)
    return jnp.clip(e, -127, 127)
