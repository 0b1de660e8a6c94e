"""The XLA reference of the block-scaled matmul: dequantize, then a float32 dot.

``lowbit.core.qarray.dequantize`` each QArray operand to float32 (high-precision operands are
upcast), multiply with ``Precision.HIGHEST`` (IEEE float32 on every backend: no TF32 on GPUs)
and float32 accumulation, and cast to ``out_dtype``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.core.qarray import QArray, dequantize

__all__ = ["block_scaled_matmul_reference", "dequantized"]


def dequantized(x) -> jax.Array:
    """float32 values of an operand: a QArray dequantized, or an array upcast."""
    if isinstance(x, QArray):
        return dequantize(x, jnp.float32)
    return jnp.asarray(x).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames="out_dtype")
def block_scaled_matmul_reference(a, b, *, out_dtype=jnp.float32) -> jax.Array:
    """``dequantize(a) @ dequantize(b)`` in float32, cast to ``out_dtype`` (jitted)."""
    c = jnp.dot(
        dequantized(a),
        dequantized(b),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return c.astype(out_dtype)
