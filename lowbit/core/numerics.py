"""Rounding float32 values onto an element grid, and exact power-of-two arithmetic.

Everything here is elementwise integer/float32 arithmetic that XLA fuses into one loop: no
lookup tables, no ``exp2``/``log2`` (inexact, and flushed to zero near 2**-127 on CPU), no
casts through ml_dtypes types (``float8_e4m3fn`` turns values above 464 into NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.core.formats import ElementFormat

__all__ = [
    "pow2",
    "fmix32",
    "ldexp_exact",
    "ieee_div",
    "materialize",
    "exponent",
    "round_to_grid",
    "uniform_bits",
    "hash_constants",
    "hashed_bits",
    "key_words",
]

_MANT = 23
_BIAS = 127


def pow2(e: jax.Array) -> jax.Array:
    """``2.0**e`` as float32 for integer ``e`` in [-126, 127], built from the exponent bits."""
    e = jnp.asarray(e, jnp.int32)
    return lax.bitcast_convert_type((e + _BIAS) << _MANT, jnp.float32)


def ldexp_exact(x: jax.Array, k: int) -> jax.Array:
    """``x * 2**k`` for float32 ``x`` and a static int ``k``, by adding ``k`` to the exponent
    field: exact when ``x`` and the result are normal; zero (and flushed subnormals) stay
    zero.

    A float multiplication by a constant would do the same, but XLA reassociates
    ``(v * c) * broadcast(scale)`` into ``v * broadcast(scale * c)``, and ``scale * c`` can
    underflow to zero (or overflow) where the true product does not. Integer arithmetic on
    the bits is not reassociated.
    """
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    out = lax.bitcast_convert_type(bits + (k << _MANT), jnp.float32)
    return jnp.where((bits & 0x7F800000) == 0, x, out)


def _while_barrier(xs):
    # A loop that runs once, with a trip count XLA cannot know (isfinite of one element is
    # 0 or 1), is a real fusion boundary on XLA CPU; the body multiplies by (c+1)/(c+1) == 1
    # exactly, so XLA cannot drop the arrays from the loop state as loop-invariant.
    first = xs[0].reshape(-1)[0]
    n = jnp.isfinite(first).astype(jnp.int32) + (first != first).astype(jnp.int32)

    def body(c):
        i, arrays = c
        out = []
        for a in arrays:
            one = (i + 1).astype(a.dtype)
            out.append(a * (one / one))
        return i + 1, tuple(out)

    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), tuple(xs)))[1]


def materialize(*xs: jax.Array):
    """Float arrays ``xs`` unchanged, computed once by XLA before their consumers.

    XLA fuses a cheap producer into every consumer fusion and recomputes it there: a GELU
    feeding several quantizers, or per-block scale factors feeding a per-element loop (32x
    the work). ``lax.optimization_barrier`` prevents that on GPU; XLA CPU removes barriers
    before fusion, so on CPU the values pass through a once-run while loop instead.
    """
    if any(x.size == 0 for x in xs):
        return xs
    return lax.platform_dependent(
        xs, cpu=_while_barrier, default=lambda xs: lax.optimization_barrier(tuple(xs))
    )


def ieee_div(a, b) -> jax.Array:
    """``a / b`` correctly rounded in float32, for a ``b`` that broadcasts against ``a``.

    XLA rewrites divisions into forms that are not the float32 quotient: a division by a
    broadcast (a constant, a scalar, a per-block value) becomes a multiplication by the rounded
    reciprocal (1 ulp off for about a third of inputs, and differently with and without jit or
    vmap); ``(A / B) / C`` becomes ``A / (B * C)``, and ``A / (B / C)`` becomes ``(A * C) / B``.
    NVFP4 chains exactly these: ``(amax / 6) / t`` and ``1 / t`` with ``t = tamax / 2688``.
    Both operands get ``+ z`` with ``z = a * 0 + b * 0``: XLA cannot fold ``z`` (it is NaN for
    NaN or Inf; ``b * 0`` covers a constant ``a``, whose ``a * 0`` does fold), so the divisor
    is an elementwise value of ``a``'s shape, neither operand is a quotient, and XLA divides
    exactly. The last two rewrites were found by the native CPU kernel's cross-check
    (``lowbit/core/native.py``): they moved NVFP4 block scales by 1 ulp, which flipped roundings
    in training. A NaN or Inf operand makes the quotient NaN; lowbit divides only where that
    value is NaN anyway or unused.
    """
    z = a * np.float32(0) + b * np.float32(0)
    return (a + z) / (b + z)


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


def fmix32(h: jax.Array) -> jax.Array:
    # MurmurHash3's 32-bit finaliser: a bijection with full avalanche.
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def hash_constants(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two uint32 per-key constants ``(ka, kb)`` of :func:`uniform_bits`.

    Both key words are hashed into them first, so that keys differing in one word
    (``jax.random.key(s)`` is ``[0, s]``) give unrelated streams, not shuffled copies. Kernels
    compute them once per call and hash indices with :func:`hashed_bits`.
    """
    k0, k1 = key_words(key)
    ka = fmix32(k1 ^ fmix32(k0 + jnp.uint32(0x7F4A7C15)))
    kb = fmix32(ka ^ jnp.uint32(0x2545F491))
    return ka, kb


def hashed_bits(idx: jax.Array, ka: jax.Array, kb: jax.Array) -> jax.Array:
    """uint32 random bits of flat element indices ``idx`` (uint32) under constants ``ka, kb``.

    ``(idx ^ ka) * odd + kb`` is a bijection of the index for each key, and fmix32 is a
    bijection with full avalanche: one round per element is enough for rounding decisions.
    """
    return fmix32((idx ^ ka) * jnp.uint32(0x9E3779B9) + kb)


def uniform_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Counter-based uint32 random bits: a keyed hash of each element's flat index.

    Far cheaper than ``jax.random.bits`` on CPU (no threefry), and fused by XLA into the
    consumer. Quality is tested in tests/test_numerics.py (uniformity, key independence).
    Element ``i`` (row-major flat index) gets ``hashed_bits(i, *hash_constants(key))``.
    """
    ka, kb = hash_constants(key)
    n = 1
    for d in shape:
        n *= d
    if n >= 2**32:
        raise ValueError(f"stochastic rounding supports fewer than 2**32 elements, got {n}")
    idx = lax.iota(jnp.uint32, n).reshape(shape) if shape else jnp.uint32(0)
    return hashed_bits(idx, ka, kb)


def round_to_grid(
    v: jax.Array,
    elem: ElementFormat,
    *,
    rbits: jax.Array | None = None,
    saturate: bool = False,
) -> jax.Array:
    """Round float32 ``v`` (inside ``[-elem.max, elem.max]``, or anywhere with ``saturate``:
    clamped to it first) onto ``elem``'s grid.

    Nearest-even when ``rbits`` is None; otherwise stochastic rounding driven by the uint32
    random bits ``rbits`` (same shape): round up with probability equal to the distance from
    the lower neighbour in grid steps, so ``E[round(v)] = v``. Subnormals are kept.

    Nearest-even: the grid step of ``|v|``'s binade is ``2**(E - mbits)`` with
    ``E = max(floor(log2 |v|), emin)`` (subnormals share the lowest binade's step), and
    ``(|v| + M) - M`` with ``M = 2**(E + 23 - mbits)`` rounds ``|v|`` to a multiple of it,
    half to even, in the float32 adder: ``M``'s ulp is the step, and ``M`` is an even number
    of steps, so the adder's even choice is the grid's. ``M`` comes from ``|v|``'s own exponent
    bits per element (a constant ``M`` would be folded away by XLA), so both additions are exact
    and nothing is reassociated: 8 operations per element, with no select between paths.

    Stochastic, above the smallest normal ``2**emin``: the grid is float32 with ``mbits``
    mantissa bits, so rounding is integer arithmetic on the bit pattern (add a random integer
    below one ulp, then truncate). Below it the grid step is ``q = 2**(emin - mbits)`` and
    ``|v| / q`` is exact: ``floor(|v|/q + u)`` is computed exactly as ``floor + (u < frac)``.
    """
    a = jnp.abs(v)
    if saturate:  # one min on |v| instead of a two-sided clip of v (NaN stays NaN)
        a = jnp.minimum(a, np.float32(elem.max))
    shift = _MANT - elem.mbits
    if rbits is None:
        ebits = lax.bitcast_convert_type(a, jnp.int32) >> _MANT
        ebits = jnp.maximum(ebits, elem.emin + _BIAS)
        magic = lax.bitcast_convert_type((ebits + shift) << _MANT, jnp.float32)
        return _with_sign((a + magic) - magic, v, elem)
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    low = jnp.uint32((1 << shift) - 1)
    bits = bits + (rbits >> (32 - shift))
    normal = lax.bitcast_convert_type(bits & ~low, jnp.float32)
    # Power-of-two constant multiplies, exact here: |v| < 2**emin and the results are
    # normal. (The abs before and the select after keep XLA from folding the constants into
    # the caller's per-block scale factors, which could under- or overflow.)
    q = np.float32(2.0 ** (elem.emin - elem.mbits))
    y = a * np.float32(1.0 / q)  # |v| in grid steps
    fl = jnp.floor(y)
    u = (rbits >> 8).astype(jnp.float32) * np.float32(2.0**-24)
    sub = (fl + (u < (y - fl)).astype(jnp.float32)) * q
    r = jnp.where(a < np.float32(elem.min_normal), sub, normal)
    return _with_sign(r, v, elem)


def _with_sign(r: jax.Array, v: jax.Array, elem: ElementFormat) -> jax.Array:
    """``r >= 0`` with ``v``'s sign."""
    if elem.is_int:  # two's complement has no -0: a negative value that rounds to 0 is +0
        return jnp.where(r == 0, np.float32(0), jnp.copysign(r, v))
    # copysign on the bits (r >= 0): two integer ops where jnp.copysign lowers to five
    sign = lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0x80000000)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(r, jnp.uint32) | sign, jnp.float32)
