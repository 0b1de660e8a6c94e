"""Rounding float32 values onto an element grid, and exact power-of-two arithmetic.

Everything here is elementwise integer/float32 arithmetic that XLA fuses into one loop: no
lookup tables, no ``exp2``/``log2`` (inexact, and flushed to zero near 2**-127 on CPU), no
casts through ml_dtypes types (``float8_e4m3fn`` turns values above 464 into NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.formats import ElementFormat

__all__ = [
    "pow2",
    "exponent",
    "round_to_grid",
    "uniform_bits",
    "key_words",
]

_MANT = 23
_BIAS = 127


def pow2(e: jax.Array) -> jax.Array:
    """``2.0**e`` as float32 for integer ``e`` in [-126, 127], built from the exponent bits."""
    e = jnp.asarray(e, jnp.int32)
    return lax.bitcast_convert_type((e + _BIAS) << _MANT, jnp.float32)


def exponent(x: jax.Array) -> jax.Array:
    """``floor(log2(|x|))`` of a normal float32 (int32); -127 for zero and subnormals."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return ((bits >> _MANT) & 0xFF) - _BIAS


def key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two uint32 words from a JAX PRNG key (typed ``jax.random.key`` or raw ``PRNGKey``)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key = jnp.asarray(key)
    if key.dtype != jnp.uint32 or key.shape[-1:] != (2,) or key.ndim != 1:
        raise TypeError(
            f"key must be a jax.random.key(...) or a uint32[2] PRNGKey, got {key.dtype}{key.shape}"
        )
    return key[0], key[1]


def _fmix32(h: jax.Array) -> jax.Array:
    # MurmurHash3's 32-bit finaliser: a bijection with full avalanche.
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Counter-based uint32 random bits: a keyed hash of each element's flat index.

    Far cheaper than ``jax.random.bits`` on CPU (no threefry), and fused by XLA into the
    consumer. Quality is tested in tests/test_numerics.py (uniformity, key independence).
    """
    k0, k1 = key_words(key)
    n = 1
    for d in shape:
        n *= d
    if n >= 2**32:
        raise ValueError(f"stochastic rounding supports fewer than 2**32 elements, got {n}")
    idx = lax.iota(jnp.uint32, n).reshape(shape) if shape else jnp.uint32(0)
    h = _fmix32(idx * jnp.uint32(0x9E3779B9) + k0)
    return _fmix32(h ^ k1)


def round_to_grid(
    v: jax.Array,
    elem: ElementFormat,
    *,
    rbits: jax.Array | None = None,
) -> jax.Array:
    """Round float32 ``v`` (already inside ``[-elem.max, elem.max]``) onto ``elem``'s grid.

    Nearest-even when ``rbits`` is None; otherwise stochastic rounding driven by the uint32
    random bits ``rbits`` (same shape): round up with probability equal to the distance from
    the lower neighbour in grid steps, so ``E[round(v)] = v``. Subnormals are kept. The grid
    step at ``|v|`` is ``2**(max(floor(log2|v|), emin) - mbits)``, a power of two, so
    ``|v| / step`` is exact and rounding it to an integer is the whole job.
    """
    a = jnp.abs(v)
    e = jnp.maximum(exponent(a), elem.emin) - elem.mbits
    y = a * pow2(-e)  # exact: |v| in grid steps
    if rbits is None:
        r = jnp.round(y)  # round half to even
    else:
        fl = jnp.floor(y)
        u = (rbits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
        r = fl + (u < (y - fl)).astype(jnp.float32)
    return jnp.copysign(r * pow2(e), v)
