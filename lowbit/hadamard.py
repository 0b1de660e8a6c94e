"""Blockwise (randomised) Walsh–Hadamard transforms for block quantization.

The transform acts on the last axis in independent blocks of ``b`` elements (``b`` a power of
two in 16..256). Inside a block it multiplies the row vector ``v`` by the orthonormal Sylvester
Hadamard matrix ``H = H_b / sqrt(b)``, ``H_1 = [1]``, ``H_2k = [[H_k, H_k], [H_k, -H_k]]``, so
``H[i, j] = (-1)**popcount(i & j) / sqrt(b)``. ``H`` is symmetric and orthogonal
(``H H^T = I``), hence ``v H = H v`` and applying the transform twice is the identity.

Randomised transform. With a sign vector ``d`` of +-1 (``D = diag(d)``, see ``random_signs``)
each block becomes ``H (D v)``: the signs are applied first. ``Q = H D`` (acting on column
vectors; ``v D H`` for row vectors) is still orthogonal, and its inverse is
``Q^T = D H``: apply ``H``, then the signs (``inverse=True``).

Why the GEMM result is unchanged. For ``y = x w`` with ``x [M, K]`` and ``w [K, N]``, transform
both operands along the contraction axis ``K`` with the same ``Q``, acting per block of ``K``
(``Q`` is then block-diagonal, still orthogonal): the rows of ``x`` become ``x Q^T`` and the
columns of ``w`` become ``Q w``, and ``(x Q^T)(Q w) = x (Q^T Q) w = x w``. With the library's
functions, ``hadamard_transform(x, b)`` and ``hadamard_transform(w.T, b).T`` (same ``signs``).
The identity is exact in exact arithmetic; quantizing the transformed operands is where the
difference shows, and that is the point:

Why it helps block quantization. A block-scaled format picks one scale per block from the
block's largest magnitude, so the grid step, and with it the quantization error, grows with the
block's amax; one outlier forces a coarse grid on every other element of its block (with FP4's
3-bit significands many of them flush to zero). ``H`` mixes all ``b`` elements of a block into
every output with weights of equal magnitude ``1/sqrt(b)``: an isolated outlier ``A`` becomes
``+-A/sqrt(b)`` in every position, its energy spread evenly, while the block's L2 norm is
unchanged. The outputs are close to Gaussian, so the block's amax drops towards a few times
its RMS and the error relative to the block's norm becomes that of a Gaussian block: a clear
gain for heavy-tailed blocks (activation and gradient outliers), none for blocks that were
already Gaussian. A fixed ``H`` can also concentrate: it maps a constant block to a single spike
``sqrt(b) * e_0``. Random signs make that unlikely for any fixed input, structured or not, and
make the rotation (and so the quantization error) vary with the key.
Both operands of the GEMM must use the same block size and signs along the contraction axis.

Implementation. ``log2(b)`` radix-2 butterfly stages, each a reshape to ``[blocks, b/2h, 2, h]``
and a sum/difference of the two halves: ``O(n log b)`` additions, no ``b x b`` matmul. The cast
to float32, the signs and the ``1/sqrt(b)`` scale fuse into the first stage and the inverse's
signs into the last, so XLA runs ``log2(b)`` elementwise loops over the array. Everything is
plain ``jax.numpy`` on linear ops, so ``jit``, ``vmap``, ``jvp`` and ``grad`` work as usual;
the gradient of a transform is its transpose (``inverse=True`` with the same signs), and the
VJP has the same ``log2(b)``-stage structure (see ``_butterflies``). On XLA:CPU each stage is one
pass over memory: a 4096x4096 float32 transform measured 3-4x the time of ``x * 2 + 1`` for
b = 32 and 128 (radix-4/8 passes and small Kronecker-factor matmuls measured no faster).

>>> import jax, jax.numpy as jnp
>>> from lowbit.hadamard import hadamard_transform, random_signs
>>> x = jnp.zeros((2, 32)).at[:, 3].set(8.0)  # one outlier per block of 16
>>> y = hadamard_transform(x, 16)
>>> float(jnp.abs(y).max())  # 8 / sqrt(16)
2.0
>>> s = random_signs(jax.random.key(0), 16)
>>> z = hadamard_transform(x, 16, signs=s)
>>> bool(jnp.allclose(hadamard_transform(z, 16, signs=s, inverse=True), x, atol=1e-6))
True
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BLOCK_SIZES",
    "hadamard_transform",
    "random_signs",
    "hadamard_matrix",
]

BLOCK_SIZES = (16, 32, 64, 128, 256)
"""Supported Hadamard block sizes: powers of two from 16 to 256."""


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    try:
        b = operator.index(block_size)
    except TypeError:
        raise TypeError(
            f"block_size must be an int, got {type(block_size).__name__} {block_size!r}"
        ) from None
    if b not in BLOCK_SIZES:
        raise ValueError(
            f"block_size={b} must be a power of two between {BLOCK_SIZES[0]} and "
            f"{BLOCK_SIZES[-1]}, i.e. one of {BLOCK_SIZES}"
        )
    return b


def _compute_dtype(dtype) -> jnp.dtype:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array (float32 or bfloat16), got {dtype}")
    # float64 only exists with jax_enable_x64; keep it rather than silently losing precision.
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def _butterflies(v: jax.Array, b: int, post: jax.Array | None) -> jax.Array:
    """Unnormalised Sylvester transform of each row of ``v [nblocks, b]``.

    Stage ``h`` (``b/2, ..., 2, 1``) pairs element ``i`` with ``i + h`` inside every group of
    ``2h`` and replaces them with their sum and difference. The stages act on different bits
    of the in-block index, so their order does not matter. ``post`` (a ``[b]`` vector or None)
    multiplies the output, folded into the last stage so XLA fuses it.
    """
    nblk = v.shape[0]
    h = b // 2
    while h >= 1:
        y = v.reshape(nblk, b // (2 * h), 2, h)
        # split (not indexing): its transpose is a concatenate, so the VJP is the same
        # butterfly and fuses the same way (slicing would transpose to pads and adds).
        top, bot = (t.reshape(nblk, b // (2 * h), h) for t in jnp.split(y, 2, axis=2))
        s, d = top + bot, top - bot
        if h == 1 and post is not None:
            p = post.reshape(1, b // 2, 2, 1)
            s, d = s * p[:, :, 0, :], d * p[:, :, 1, :]
        v = jnp.stack([s, d], axis=2)
        h //= 2
    return v.reshape(nblk, b)


def hadamard_transform(
    x: jax.Array,
    block_size: int,
    *,
    signs: jax.Array | None = None,
    inverse: bool = False,
) -> jax.Array:
    """Orthonormal Walsh–Hadamard transform of the last axis in blocks of ``block_size``.

    Each block ``v`` (``block_size`` consecutive elements of the last axis) becomes
    ``H (D v)`` with ``H = hadamard_matrix(block_size)`` and ``D = diag(signs)`` (identity when
    ``signs`` is None); with ``inverse=True`` it becomes ``(H D)^T v = D (H v)``. Without signs
    the transform is its own inverse. Computed in float32 (float64 for float64 input) and
    returned in ``x``'s dtype.

    Args:
      x: floating-point array (float32 or bfloat16), any leading dimensions; the last axis
        length must be a multiple of ``block_size``.
      block_size: a power of two in 16..256 (static under ``jit``).
      signs: optional ``[block_size]`` vector of +-1 (e.g. ``random_signs``), shared by all
        blocks. May be a traced value.
      inverse: apply the inverse (= transpose) transform.

    Returns:
      An array of ``x``'s shape and dtype.

    Raises:
      ValueError: bad ``block_size``, last axis not a multiple of it, or ``signs`` of the
        wrong shape. TypeError: non-floating ``x``.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(32.0).reshape(1, 32)
    >>> y = hadamard_transform(x, 16)
    >>> bool(jnp.allclose(jnp.linalg.norm(y), jnp.linalg.norm(x)))  # orthonormal
    True
    >>> bool(jnp.allclose(hadamard_transform(y, 16), x, atol=1e-4))  # an involution
    True
    """
    b = _check_block_size(block_size)
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have at least one axis, got a scalar")
    n = x.shape[-1]
    if n % b:
        raise ValueError(
            f"the last axis of x (length {n}, shape {x.shape}) must be a multiple of block_size={b}"
        )
    cdt = _compute_dtype(x.dtype)
    scale = jnp.asarray(1.0 / math.sqrt(b), cdt)
    pre = scale.reshape(1, 1)
    post = None
    if signs is not None:
        signs = jnp.asarray(signs)
        if signs.shape != (b,):
            raise ValueError(f"signs must have shape (block_size,) = ({b},), got {signs.shape}")
        signs = signs.astype(cdt)
        if inverse:
            post = signs
        else:
            pre = (signs * scale).reshape(1, b)
    v = x.reshape(x.size // b, b).astype(cdt) * pre
    return _butterflies(v, b, post).reshape(x.shape).astype(x.dtype)


def random_signs(key: jax.Array, block_size: int) -> jax.Array:
    """A float32 ``[block_size]`` vector of independent, equiprobable +-1 signs.

    ``key`` is a ``jax.random.key(...)`` or a legacy ``PRNGKey``; the same key gives the same
    signs. Use one vector for both operands of a GEMM (see the module docstring).

    >>> import jax
    >>> s = random_signs(jax.random.key(0), 16)
    >>> s.shape, s.dtype, sorted({float(v) for v in s})
    ((16,), dtype('float32'), [-1.0, 1.0])
    """
    b = _check_block_size(block_size)
    return jax.random.rademacher(key, (b,), dtype=jnp.float32)


def hadamard_matrix(block_size: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix, float64 numpy ``[block_size, block_size]``.

    ``H[i, j] = (-1)**popcount(i & j) / sqrt(block_size)``; symmetric, ``H @ H = I``. For
    docs and tests: ``hadamard_transform(x, b)`` equals ``x @ hadamard_matrix(b)`` on each
    block (without forming this matrix).

    >>> H = hadamard_matrix(16)
    >>> H.shape, bool(np.allclose(H @ H.T, np.eye(16))), float(H[1, 1] * 4)
    ((16, 16), True, -1.0)
    """
    b = _check_block_size(block_size)
    idx = np.arange(b)
    ij = idx[:, None] & idx[None, :]
    parity = np.zeros((b, b), np.int64)
    for k in range(b.bit_length() - 1):
        parity ^= (ij >> k) & 1
    return np.where(parity == 1, -1.0, 1.0) / math.sqrt(b)
