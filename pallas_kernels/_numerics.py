"""The few kernel-side numerics that cannot be lowbit's own: substitutes for what Triton lacks.

The kernels import lowbit's numerics directly wherever the Pallas Triton lowering (jax 0.10 and
0.11) accepts them, so there is one definition of each rule: the counter hash
(``lowbit.core.numerics.hash_constants`` / ``hashed_bits``), exact powers of two (``pow2``),
nearest-even rounding (``round_to_grid``), the element code tables
(``lowbit.core.qarray.encode_elements`` / ``decode_elements``), the MX shared exponent
(``mx_scale_exponent``) and NVFP4's tensor scale (``nvfp4_tensor_scale``, computed by XLA
before the kernel). ``tests/test_pallas_quantize.py`` lowers every kernel configuration for
CUDA, which is what shows that these lower.

What is left here, each with the primitive that fails, operation for operation equal to lowbit
(tested against it on every element format):

- :func:`ieee_div`: Triton lowers a float32 ``/`` to ``div.full.f32`` (approximate, up to
  2 ulp); NVFP4's scales need the correctly rounded quotient that XLA computes, so on the GPU
  it is inline PTX ``div.rn.f32``. In interpret mode (XLA evaluates the kernel body) it is
  ``lowbit.core.numerics.ieee_div`` itself, whose guard keeps XLA from rewriting the division.
- :func:`encode`: ``encode_elements`` rounds MX INT8 codes with ``jnp.round``, which has no
  Triton lowering ("Unimplemented primitive in Pallas Triton lowering: round"); the value is
  an exact integer there, so a truncating conversion is the same. Floating-point elements use
  ``encode_elements``.
- :func:`round_to_grid` with random bits: lowbit's stochastic branch masks with ``~low`` of
  a ``jnp.uint32`` constant, a ``not`` of a literal that the Triton lowering rejects
  (``'TypedNdArray' object has no attribute 'type'``); here the mask is a Python constant.
  Nearest rounding is ``lowbit.core.numerics.round_to_grid``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plgpu

from lowbit.core import numerics as lowbit_numerics
from lowbit.core.formats import ElementFormat
from lowbit.core.qarray import encode_elements

__all__ = ["INF_BITS", "ieee_div", "encode", "round_to_grid"]

_MANT = 23
INF_BITS = 0x7F800000  # bit pattern of +Inf: |x| bits >= this is Inf or NaN


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


def encode(v: jax.Array, elem: ElementFormat) -> jax.Array:
    """int32 codes (0..255) of float32 values on ``elem``'s grid: ``encode_elements``."""
    if elem.is_int:  # v * 64 is an exact integer in -127..127: truncation is rounding
        return (v * np.float32(64.0)).astype(jnp.int32) & 0xFF
    return encode_elements(v, elem).astype(jnp.int32)


def round_to_grid(
    v: jax.Array, elem: ElementFormat, rbits: jax.Array | None = None, *, saturate: bool = False
) -> jax.Array:
    """``lowbit.core.numerics.round_to_grid(v, elem, rbits=rbits, saturate=saturate)``."""
    if rbits is None:
        return lowbit_numerics.round_to_grid(v, elem, saturate=saturate)
    # lowbit's stochastic branch, with its mask ``~low`` as a Python constant (see above)
    a = jnp.abs(v)
    if saturate:
        a = jnp.minimum(a, np.float32(elem.max))
    shift = _MANT - elem.mbits
    keep = jnp.uint32(~((1 << shift) - 1) & 0xFFFFFFFF)
    bits = lax.bitcast_convert_type(a, jnp.uint32) + (rbits >> (32 - shift))
    normal = lax.bitcast_convert_type(bits & keep, jnp.float32)
    q = np.float32(2.0 ** (elem.emin - elem.mbits))
    y = a * np.float32(1.0 / q)
    fl = jnp.floor(y)
    u = (rbits >> 8).astype(jnp.float32) * np.float32(2.0**-24)
    sub = (fl + (u < (y - fl)).astype(jnp.float32)) * q
    r = jnp.where(a < np.float32(elem.min_normal), sub, normal)
    if elem.is_int:  # two's complement has no -0
        return jnp.where(r == 0, np.float32(0), jnp.copysign(r, v))
    sign = lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0x80000000)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(r, jnp.uint32) | sign, jnp.float32)
