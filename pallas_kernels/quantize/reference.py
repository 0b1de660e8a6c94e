"""The XLA reference of the quantize kernel: lowbit's Hadamard transform and quantizer.

``quantize_reference(x, fmt, axis, ...)`` is ``lowbit.quantize`` itself, preceded, with
``hadamard=b``, by ``lowbit.core.hadamard.hadamard_transform(x, b, signs=signs, axis=axis)``, and
with a ``prescale`` by ``lowbit.core.qarray.quantize_with_plan`` for ``make_plan(...,
prescale=prescale)``. The
kernel must return the very same :class:`lowbit.core.qarray.QArray` (codes, scales, tensor scale,
bit for bit) for a 2-D input quantized along axis 0 or 1 with 1-D blocks: always without a
Hadamard transform, and with one where the transform's arithmetic is exact or where the
reference transforms with ``hadamard_method="butterfly"`` (the kernel's fixed order). NVFP4's
scale rules are the plan's: Four Over Six, MS-EDEN (``rounding="eden"``, whose random bits
come from ``key``) and double-block scales (``tensor_block``) included.
"""

from __future__ import annotations

import functools

import jax

from lowbit.core import formats as _formats
from lowbit.core.hadamard import hadamard_transform
from lowbit.core.plan import make_plan
from lowbit.core.qarray import QArray, quantize_with_plan

__all__ = ["quantize_reference"]


@functools.partial(
    jax.jit,
    static_argnames=("fmt", "axis", "rounding", "scale_mode", "hadamard", "method", "prescale",
                     "tensor_block"),
)
def _quantize_jit(
    x, key, tensor_amax, signs, *, fmt, axis, rounding, scale_mode, hadamard, method, prescale,
    tensor_block,
):
    if hadamard is not None:
        x = hadamard_transform(x, hadamard, signs=signs, axis=axis, method=method)
    plan = make_plan(x.shape, fmt, axis, None, scale_mode, rounding, key, tensor_amax, prescale,
                     tensor_block)
    return quantize_with_plan(x, plan, key, tensor_amax)


def quantize_reference(
    x: jax.Array,
    fmt,
    axis: int = -1,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    scale_mode: str | None = None,
    tensor_amax=None,
    hadamard: int | None = None,
    signs: jax.Array | None = None,
    prescale: float = 1.0,
    hadamard_method: str | None = None,
    tensor_block: int | None = None,
) -> QArray:
    """``lowbit.quantize(hadamard_transform(x, hadamard, signs=signs, axis=axis), fmt, axis,
    ...)`` with 1-D blocks of the format's size and the plan prescale ``prescale`` (jitted).

    ``hadamard_method``: ``hadamard_transform``'s ``method`` (None: lowbit's default for the
    backend; ``"butterfly"``: the kernel's arithmetic).
    """
    fmt = _formats.get(fmt).name
    return _quantize_jit(
        x,
        key,
        tensor_amax,
        signs,
        fmt=fmt,
        axis=axis,
        rounding=rounding,
        scale_mode=scale_mode,
        hadamard=hadamard,
        method=hadamard_method,
        prescale=float(prescale),
        tensor_block=tensor_block,
    )
