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

Implementation. Two forms of the same linear map, chosen per backend and block size by
:func:`default_method` (``method=`` overrides it):

- ``"dense"``: each block times the ``b x b`` matrix ``D H`` (``H D`` for the inverse), one
  ``lax.dot_general`` at ``Precision.HIGHEST`` with float32 accumulation: ``2 b`` flops per
  element, which is what a GPU's tensor cores and XLA:CPU's matmul do best for ``b <= 256``.
  Its summation order is the backend's.
- ``"butterfly"``: ``log2(b)`` radix-2 stages of sums and differences (``O(n log b)``
  additions). Its arithmetic is fixed, operation for operation: the signs (an exact
  multiplication by +-1), then stages ``h = b/2, b/4, ..., 1``, each replacing the pair
  ``(v[i], v[i + h])`` of every group of ``2h`` by ``(v[i] + v[i + h], v[i] - v[i + h])``,
  then one multiplication by ``float32(1/sqrt(b))`` (the inverse: stages, scale, signs). Any
  implementation that follows it (the compiled CPU kernel's fused Hadamard) reproduces it bit
  for bit; the two forms agree to float32 rounding (tested against the float64 matrix).

Measured on XLA:CPU (2 cores, ``benchmarks/bench_hadamard.py``, 4096 x 1024 float32, in
multiples of a memory pass ``x * 2 + 1``): along the last axis the dense form costs 2.1-2.4x
for b = 16..64, 4x at 128 and 8.5x at 256, the butterfly 10-27x; along a leading axis (the
weight-gradient GEMM's operands, blocked along tokens) the dense form costs 5-8x for b <= 64,
the butterfly 6-17x, and the butterfly wins from b = 128. The table in :func:`default_method`
follows these numbers. (In CPU training the quantizer's compiled kernel applies the transform
itself, fused with the quantization: see ``lowbit.core.native``.)

Both forms are plain ``jax.numpy`` / ``lax`` linear ops, so ``jit``, ``vmap``, ``jvp`` and
``grad`` work as usual; the gradient of a transform is its transpose (``inverse=True`` with the
same signs).

>>> import jax, jax.numpy as jnp
>>> from lowbit.core.hadamard import hadamard_transform, random_signs
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
from jax import lax

__all__ = [
    "BLOCK_SIZES",
    "METHODS",
    "default_method",
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


METHODS = ("dense", "butterfly")
"""The two forms of the transform (see the module docstring)."""


def default_method(block_size: int, axis_is_last: bool = True, backend: str | None = None) -> str:
    """The faster form for this block size, axis position and backend (default: JAX's).

    Measured on XLA:CPU (module docstring): the dense block matmul along the last axis for
    every size, and along a leading axis up to b = 64, the butterfly beyond. Accelerators
    (GPU, TPU) run the dense form on their matrix units.
    """
    b = _check_block_size(block_size)
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu" and not axis_is_last and b >= 128:
        return "butterfly"
    return "dense"


def _signed_matrix(b: int, signs: jax.Array | None, inverse: bool, dtype) -> jax.Array:
    """``D H`` (``H D`` with ``inverse``) as the right factor of row vectors: ``v @ M``."""
    h = jnp.asarray(hadamard_matrix(b), dtype)
    if signs is None:
        return h
    return h * (signs[None, :] if inverse else signs[:, None])


def _dense(v: jax.Array, b: int, signs, inverse: bool, axis: int) -> jax.Array:
    """``v`` (compute dtype) blocked along ``axis``: each block times ``D H`` / ``H D``."""
    m = _signed_matrix(b, signs, inverse, v.dtype)
    shape = v.shape
    blocked = v.reshape(*shape[:axis], shape[axis] // b, b, *shape[axis + 1 :])
    y = lax.dot_general(
        blocked, m, (((axis + 1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=v.dtype,
    )  # [..., blocks, *after, b]
    if axis + 1 != blocked.ndim - 1:
        y = jnp.moveaxis(y, -1, axis + 1)
    return y.reshape(shape)


def _butterfly(v: jax.Array, b: int, signs, inverse: bool, axis: int) -> jax.Array:
    """The fixed-order butterfly (module docstring), along ``axis``, in place (no transpose)."""
    shape = v.shape
    pre, n, post = shape[:axis], shape[axis], shape[axis + 1 :]
    scale = jnp.asarray(1.0 / math.sqrt(b), v.dtype)

    def along(s):  # a [b] vector broadcast along ``axis`` of the blocked view
        return s.astype(v.dtype).reshape((1,) * len(pre) + (1, b) + (1,) * len(post))

    blocked = v.reshape(*pre, n // b, b, *post)
    if signs is not None and not inverse:
        blocked = blocked * along(signs)
    d = len(pre) + 1  # the in-block axis
    h = b // 2
    while h >= 1:
        y = blocked.reshape(*pre, n // b, b // (2 * h), 2, h, *post)
        # split (not indexing): its transpose is a concatenate, so the VJP is the same
        # butterfly and fuses the same way (slicing would transpose to pads and adds).
        top, bot = (jnp.squeeze(t, d + 1) for t in jnp.split(y, 2, axis=d + 1))
        blocked = jnp.stack([top + bot, top - bot], axis=d + 1).reshape(blocked.shape)
        h //= 2
    blocked = blocked * scale
    if signs is not None and inverse:
        blocked = blocked * along(signs)
    return blocked.reshape(shape)


def hadamard_transform(
    x: jax.Array,
    block_size: int,
    *,
    signs: jax.Array | None = None,
    inverse: bool = False,
    axis: int = -1,
    method: str | None = None,
) -> jax.Array:
    """Orthonormal Walsh–Hadamard transform along ``axis`` in blocks of ``block_size``.

    Each block ``v`` (``block_size`` consecutive elements along ``axis``) becomes
    ``H (D v)`` with ``H = hadamard_matrix(block_size)`` and ``D = diag(signs)`` (identity when
    ``signs`` is None); with ``inverse=True`` it becomes ``(H D)^T v = D (H v)``. Without signs
    the transform is its own inverse. Computed in float32 (float64 for float64 input) and
    returned in ``x``'s dtype.

    Args:
      x: floating-point array (float32 or bfloat16) of any rank >= 1; its length along
        ``axis`` must be a multiple of ``block_size``.
      block_size: a power of two in 16..256 (static under ``jit``).
      signs: optional ``[block_size]`` vector of +-1 (e.g. ``random_signs``), shared by all
        blocks. May be a traced value.
      inverse: apply the inverse (= transpose) transform.
      axis: the axis the blocks run along (no transpose is made for it).
      method: ``"dense"`` or ``"butterfly"`` (see the module docstring); None:
        :func:`default_method` for this backend.

    Returns:
      An array of ``x``'s shape and dtype.

    Raises:
      ValueError: bad ``block_size``, ``axis`` or ``method``, an axis length that is not a
        multiple of the block, or ``signs`` of the wrong shape. TypeError: non-floating ``x``.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(32.0).reshape(1, 32)
    >>> y = hadamard_transform(x, 16)
    >>> bool(jnp.allclose(jnp.linalg.norm(y), jnp.linalg.norm(x)))  # orthonormal
    True
    >>> bool(jnp.allclose(hadamard_transform(y, 16), x, atol=1e-4))  # an involution
    True
    >>> z = hadamard_transform(x.T, 16, axis=0, method="butterfly")  # blocks down a column
    >>> bool(jnp.allclose(z.T, y, atol=1e-5))
    True
    """
    b = _check_block_size(block_size)
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have at least one axis, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x of rank {x.ndim}")
    axis %= x.ndim
    n = x.shape[axis]
    if n % b:
        raise ValueError(
            f"axis {axis} of x (length {n}, shape {x.shape}) must be a multiple of "
            f"block_size={b}"
        )
    if method is None:
        method = default_method(b, axis == x.ndim - 1)
    elif method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
    cdt = _compute_dtype(x.dtype)
    if signs is not None:
        signs = jnp.asarray(signs)
        if signs.shape != (b,):
            raise ValueError(f"signs must have shape (block_size,) = ({b},), got {signs.shape}")
        signs = signs.astype(cdt)
    v = x.astype(cdt)
    if x.size == 0:
        return x
    form = _dense if method == "dense" else _butterfly
    return form(v, b, signs, inverse, axis).astype(x.dtype)


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
    block.

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
