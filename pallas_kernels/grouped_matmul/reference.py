"""The XLA reference of the grouped block-scaled matmul: dequantize each tile and each group's
weight, then one float32 dot per tile against its group's weight."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.core.qarray import QArray, dequantize

__all__ = ["grouped_matmul_reference", "dequantized_tiles", "dequantized_stack"]


def dequantized_tiles(a) -> jax.Array:
    """float32 ``[T, bm, K]`` of the row tiles (a stacked QArray: one tensor per tile)."""
    if isinstance(a, QArray):
        return jax.vmap(lambda q: dequantize(q, jnp.float32))(a)
    return jnp.asarray(a).astype(jnp.float32)


def dequantized_stack(b) -> jax.Array:
    """float32 ``[G, K, N]`` of the group weights (a stacked QArray: one tensor per group)."""
    if isinstance(b, QArray):
        return jax.vmap(lambda q: dequantize(q, jnp.float32))(b)
    return jnp.asarray(b).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames="out_dtype")
def grouped_matmul_reference(a, b, tile_group, *, out_dtype=jnp.float32) -> jax.Array:
    """``[T, bm, N]``: tile ``i`` times group ``tile_group[i]``'s weight; zeros for a tile whose
    group is outside ``[0, G)``."""
    x = dequantized_tiles(a)
    w = dequantized_stack(b)
    g = w.shape[0]
    valid = (tile_group >= 0) & (tile_group < g)
    wt = w[jnp.clip(tile_group, 0, g - 1)]  # [T, K, N]
    y = jnp.einsum("tmk,tkn->tmn", x, wt, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    return jnp.where(valid[:, None, None], y, 0.0).astype(out_dtype)
