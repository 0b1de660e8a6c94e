"""The XLA emulation of one quantized GEMM: the reference the kernel path must match.

Both operands are prepared exactly as ``lowbit.dot_general`` prepares the operands of each of
its GEMMs (``lowbit.gemm.operand.quantize_operand``: the optional Hadamard transform along K, then
block quantization along K, dequantized to float32), then multiplied with float32
accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.gemm.operand import quantize_operand
from lowbit.gemm.recipes import QuantSpec

__all__ = ["quantized_gemm_reference", "accumulation_excess"]

DN = (((1,), (0,)), ((), ()))


def quantized_gemm_reference(
    a: jax.Array,
    b: jax.Array,
    spec_a: QuantSpec | None,
    spec_b: QuantSpec | None,
    key_a: jax.Array | None = None,
    key_b: jax.Array | None = None,
    *,
    hadamard: int | None = None,
    signs: jax.Array | None = None,
    native: bool = True,
) -> jax.Array:
    """float32 ``[M, N]``: ``a [M, K]`` and ``b [K, N]`` (Hadamard-transformed and) quantized
    along K, multiplied. ``native=False``: pure XLA (no compiled CPU kernel)."""
    aq = quantize_operand(a, spec_a, 1, 0, key_a, hadamard=hadamard, signs=signs, native=native)
    bq = quantize_operand(b, spec_b, 0, 1, key_b, hadamard=hadamard, signs=signs, native=native)
    return lax.dot_general(
        aq, bq, DN, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def accumulation_excess(c, ref, a, b, spec_a, spec_b, key_a=None, key_b=None, *,
                        hadamard=None, signs=None) -> jax.Array:
    """How far a kernel's ``c`` lies outside the float32 accumulation bound around the
    emulation's ``ref``: ``max(|c - ref| - (2 K + 8) 2**-24 (|A_q| @ |B_q|))``, ``A_q`` and
    ``B_q`` the operands as the emulation quantizes them (pure XLA). <= 0 passes: the
    quantized values are the same, only the order of the K float32 sums (and where NVFP4's
    tensor scale is applied) may differ."""
    kw = dict(hadamard=hadamard, signs=signs, native=False)
    aq = quantize_operand(a, spec_a, 1, 0, key_a, **kw)
    bq = quantize_operand(b, spec_b, 0, 1, key_b, **kw)
    mag = jnp.dot(jnp.abs(aq), jnp.abs(bq), precision=lax.Precision.HIGHEST)
    return jnp.max(jnp.abs(c - ref) - (2 * aq.shape[1] + 8) * 2.0**-24 * mag)
