"""Bit accounting: what a tensor takes in storage under a quantization spec.

One function of a spec and a shape, :func:`storage_bits`, with the conventions the studies
differ on as explicit keywords (nothing here picks one for them):

- ``float_bits``: what an element the spec keeps in high precision counts (``spec=None``);
- ``tensor_scale``: whether the single float32 tensor scale (NVFP4, INT4, ternary, per-tensor
  FP8) counts, 32 bits per tensor;
- ``axes``: None counts blocks as if the shape divided into them (bits per element times
  elements); the quantized axes (as :attr:`lowbit.QArray.axes`) count the zero padding a
  packed array holds, so that the count equals ``8 * QArray.nbytes`` of the packed tensor
  (tested for every format).

Which convention each study uses:

=====================================  ===========  ============  =========================
study                                  float bits   tensor scale  padding
=====================================  ===========  ============  =========================
``lowbit.flax.describe`` (per element)  its dtype    not counted   no (:func:`bits_per_element`)
``lowbit.autoquant`` costs, ``Scores``  16 (bf16)    counted       no
``experiments.pareto.weight_memory``   16 (bf16)    counted       no
``lowbit.ptq.bits_per_param``          its dtype    counted       yes: measured bytes
                                                                  (:func:`leaf_nbytes`)
=====================================  ===========  ============  =========================

>>> import lowbit as lb
>>> from lowbit.bits import storage_bits
>>> spec = lb.recipes.get("nvfp4").fwd.rhs                       # 16x16 tiles
>>> storage_bits(spec, (32, 32)), storage_bits(spec, (32, 32), tensor_scale=False)
(4160.0, 4128.0)
>>> storage_bits(None, (32, 32)), storage_bits(None, (32, 32), float_bits=32.0)
(16384.0, 32768.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lowbit.core import formats as _formats
from lowbit.core.qarray import QArray
from lowbit.gemm.recipes import QuantSpec

__all__ = [
    "FLOAT_BITS",
    "TENSOR_SCALE_BITS",
    "bits_per_element",
    "storage_bits",
    "leaf_nbytes",
]

FLOAT_BITS = 16.0  # a float weight counted as bf16, as deployed
TENSOR_SCALE_BITS = 32.0  # one float32 scale per tensor (NVFP4, INT4, ternary, per-tensor FP8)


def _spec(spec) -> QuantSpec | None:
    if spec is None or isinstance(spec, QuantSpec):
        return spec
    return QuantSpec(_formats.get(spec).name)


def bits_per_element(spec: QuantSpec | str | None, *, float_bits: float = FLOAT_BITS) -> float:
    """Stored bits per element under ``spec``: packed codes plus the block scales' share,
    no tensor scale (:attr:`lowbit.gemm.recipes.QuantSpec.bits_per_element`); ``float_bits`` for
    None (the element kept in high precision). ``spec``: a QuantSpec or a format name.

    >>> bits_per_element("mxfp4"), bits_per_element(None, float_bits=32.0)
    (4.25, 32.0)
    """
    spec = _spec(spec)
    if spec is None:
        return float(float_bits)
    return float(spec.bits_per_element)


def _padded_size(shape: tuple[int, ...], axes: Sequence[int], block: tuple[int, ...]) -> int:
    ndim = len(shape)
    axes = [int(a) % ndim for a in axes]
    if len(axes) != len(block):
        raise ValueError(f"axes={tuple(axes)} and block shape {block} differ in length")
    padded = list(shape)
    for a, b in zip(axes, block, strict=True):
        padded[a] = -(-shape[a] // b) * b
    return math.prod(padded)


def storage_bits(
    spec: QuantSpec | str | None,
    shape: Sequence[int],
    *,
    float_bits: float = FLOAT_BITS,
    tensor_scale: bool = True,
    axes: Sequence[int] | None = None,
) -> float:
    """Storage bits of a tensor of ``shape`` under ``spec`` (a QuantSpec, a format name, or
    None: kept in high precision, ``float_bits`` per element).

    Block formats: codes and block scales (:func:`bits_per_element` per element), plus
    :data:`TENSOR_SCALE_BITS` when the format has a tensor scale and ``tensor_scale``; with
    ``axes`` (the quantized axes, one per block dimension), the zero padding of the packed
    blocks too: ``storage_bits(spec, x.shape, axes=q.axes) == 8 * q.nbytes``. Per-tensor and
    per-row specs (FP8, INT8): 8 bits per element, plus one tensor scale when
    ``tensor_scale`` (a per-row weight's row scales are not counted).

    >>> from lowbit.bits import storage_bits
    >>> storage_bits("mxfp4", (1024,)), storage_bits("mxfp4", (1000,), axes=(0,))
    (4352.0, 4352.0)
    """
    spec = _spec(spec)
    n = math.prod(int(d) for d in shape)
    if spec is None:
        return float_bits * n
    if spec.granularity != "block":
        return 8.0 * n + (TENSOR_SCALE_BITS if tensor_scale else 0.0)
    fmt = _formats.get(spec.format)
    outer = spec.tensor_block is not None  # float32 outer scales instead of a tensor scale
    extra = TENSOR_SCALE_BITS if tensor_scale and fmt.tensor_scale and not outer else 0.0
    if axes is None:
        return spec.bits_per_element * n + extra
    block = tuple(spec.block_shape) if spec.block_shape is not None else (fmt.block_size,)
    p = _padded_size(tuple(int(d) for d in shape), axes, block)
    codes, code_bytes = fmt.elem.pack_group
    scale_bits = fmt.scale.bits * (p // math.prod(block))
    if outer:  # one per tensor_block along the (single) axis, per row
        (a,) = axes
        length = -(-int(shape[a]) // block[0]) * block[0]
        rows = p // length
        extra = TENSOR_SCALE_BITS * rows * -(-length // spec.tensor_block)
    return float(8 * code_bytes * p // codes + scale_bits) + extra


def leaf_nbytes(x) -> int:
    """Bytes a leaf holds: a :class:`lowbit.QArray`'s codes and scales (``nbytes``), any
    other array its elements in its dtype."""
    if isinstance(x, QArray):
        return int(x.nbytes)
    return int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
