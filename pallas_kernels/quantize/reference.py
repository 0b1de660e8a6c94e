"""The XLA reference of the quantize kernel: ``lowbit.quantize`` itself.

The kernel must return the very same :class:`lowbit.QArray` (codes, scales, tensor scale, bit
for bit) for a 2-D input quantized along axis 0 or 1 with 1-D blocks.
"""

from __future__ import annotations

import functools

import jax

import lowbit as lb

__all__ = ["quantize_reference"]


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "rounding", "scale_mode"))
def _quantize_jit(x, key, tensor_amax, *, fmt, axis, rounding, scale_mode):
    return lb.quantize(
        x, fmt, axis, rounding=rounding, key=key, scale_mode=scale_mode, tensor_amax=tensor_amax
    )


def quantize_reference(
    x: jax.Array,
    fmt,
    axis: int = -1,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    scale_mode: str | None = None,
    tensor_amax=None,
) -> lb.QArray:
    """``lb.quantize(x, fmt, axis, ...)`` with 1-D blocks of the format's size (jitted)."""
    fmt = lb.formats.get(fmt).name
    return _quantize_jit(
        x, key, tensor_amax, fmt=fmt, axis=axis, rounding=rounding, scale_mode=scale_mode
    )
