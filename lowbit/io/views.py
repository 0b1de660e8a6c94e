"""Exact rearrangements of packed 2-D weights for export: the ``[out, in]`` view of a QArray
and its rows, moving codes and scales as they are (never requantizing).

A QArray stores its codes and scales with its quantized axis last, so a ``[K, N]`` kernel
quantized along K (how lowbit's Flax layers hold a ``Linear``'s weight) is stored exactly as
the ``[N, K]`` matrix quantized along its last axis: the layout of a PyTorch ``Linear``'s
``weight`` and of a GGML row-major tensor. :func:`as_rows` gives that view (metadata only);
:func:`take_rows` selects or permutes its rows (output features), e.g. to split a fused q/k/v
projection or to apply a checkpoint converter's row permutation; a per-tensor scale is kept,
so the pieces of a fused projection share it.

>>> import jax.numpy as jnp, lowbit as lb
>>> w = jnp.arange(64 * 6, dtype=jnp.float32).reshape(64, 6) / 100  # [K, N]
>>> q = lb.quantize(w, "nvfp4", axis=0)
>>> r = as_rows(q)
>>> r.shape, r.axes
((6, 64), (1,))
>>> bool(jnp.all(lb.dequantize(r) == lb.dequantize(q).T))
True
>>> bool(jnp.all(lb.dequantize(take_rows(r, [4, 0])) == lb.dequantize(q).T[jnp.array([4, 0])]))
True
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lowbit.core.qarray import QArray

__all__ = ["as_rows", "take_rows"]


def _check_2d(q: QArray, where: str) -> None:
    if not isinstance(q, QArray):
        raise TypeError(f"{where}: expected a QArray, got {type(q).__name__}")
    if len(q.shape) != 2 or len(q.axes) != 1 or q.tensor_block is not None:
        raise ValueError(
            f"{where}: expected a 2-D QArray with 1-D blocks along one axis and one tensor "
            f"scale, got shape {q.shape}, axes {q.axes}, block_shape {q.block_shape}, "
            f"tensor_block {q.tensor_block}"
        )


def as_rows(q: QArray) -> QArray:
    """The ``[out, in]`` view of a 2-D QArray with 1-D blocks: quantized along its last axis
    (``q`` itself when it already is; else its transpose, the same codes and scales)."""
    _check_2d(q, "as_rows")
    if q.axes == (1,):
        return q
    return dataclasses.replace(q, shape=(q.shape[1], q.shape[0]), axes=(1,))


def take_rows(q: QArray, rows) -> QArray:
    """Rows ``rows`` (integer indices, in that order) of the ``[out, in]`` QArray ``q``
    (quantized along its last axis): its codes' and scales' rows, its tensor scale kept."""
    _check_2d(q, "take_rows")
    if q.axes != (1,):
        raise ValueError(f"take_rows: expected a QArray quantized along its last axis (see "
                         f"as_rows), got axes {q.axes}")
    idx = np.asarray(rows)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"take_rows: rows must be a 1-D sequence of ints, got {rows!r}")
    if idx.size and (idx.min() < 0 or idx.max() >= q.shape[0]):
        raise ValueError(f"take_rows: rows must lie in [0, {q.shape[0]}), got {idx.min()} .. "
                         f"{idx.max()}")
    return dataclasses.replace(q, codes=q.codes[idx], scales=q.scales[idx],
                               shape=(int(idx.size), q.shape[1]))
