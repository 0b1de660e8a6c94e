"""Rounding on block scales already chosen: the half of quantization that algorithms which fix
a block's scale and then pick its elements one at a time (GPTQ) need, and the QArray they
build from those elements.

:func:`round_on_scales` is :func:`lowbit.core.qarray.quantize`'s arithmetic once a block's scale
is known (tested equal to it bit for bit for every format and scale rule);
:func:`with_elements` puts new element and scale codes into a QArray's layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.core import formats as _formats
from lowbit.core import qarray as _qa
from lowbit.core.formats import E4M3
from lowbit.core.numerics import ieee_div, pow2, round_to_grid
from lowbit.core.scales import FOUR_OVER_SIX_METRICS

__all__ = ["round_on_scales", "with_elements"]


def round_on_scales(x: jax.Array, scale_codes: jax.Array, tensor_scale, fmt,
                    scale_mode: str | None = None) -> tuple:
    """``(elements, values)`` of ``x`` rounded to nearest on given block scales: each element
    of ``x`` with the scale code of its block (``scale_codes`` broadcast against ``x``; E8M0
    for MX, unsigned E4M3 for NVFP4 and INT4, with ``tensor_scale`` broadcast likewise, None
    for MX). The arithmetic of :func:`quantize` once the scale is chosen: MX ``x * 2**-e`` (as
    two normal power-of-two factors), NVFP4 ``x * ((1 / t) / s)`` (``scale_mode`` Four Over
    Six: ``x * (1 / (t * s))``, as its reference computes), round to nearest even with
    saturation, then ``(q * 2**e)`` or ``(q * s) * t``; a NaN scale code gives NaN values. For
    algorithms that fix a block's scale and then choose its elements one at a time (GPTQ).

    >>> import jax.numpy as jnp, lowbit as lb
    >>> x = jnp.linspace(-3.0, 3.0, 32)
    >>> q = lb.quantize(x, "mxfp4")
    >>> _, v = round_on_scales(x, q.scales, None, "mxfp4")
    >>> bool(jnp.all(v == lb.dequantize(q)))
    True
    """
    fmt = _formats.get(fmt)
    elem = fmt.elem
    x = jnp.asarray(x, jnp.float32)
    codes = jnp.asarray(scale_codes).astype(jnp.int32)
    if fmt.is_mx:
        e = codes - 127
        d_hi = jnp.clip(-e, -126, 127)
        s_hi = jnp.clip(e, -126, 127)
        v = x * pow2(d_hi)
        if elem.emax == 0:  # as quantize: only MX INT8 can need 2**-127
            v = v * pow2(-e - d_hi)
        q = round_to_grid(v, elem, saturate=True)
        mul_hi = jnp.where(codes == _qa.E8M0_NAN, np.float32(np.nan), pow2(s_hi))
        return q, (q * mul_hi) * pow2(e - s_hi)
    if fmt.is_absmean or tensor_scale is None:
        raise ValueError(
            f"round_on_scales takes MX formats, or E4M3-scaled ones ({fmt.name}) with their "
            "tensor_scale"
        )
    s = _qa.decode_elements(codes.astype(jnp.uint8), E4M3)
    t = jnp.asarray(tensor_scale, jnp.float32)
    live = s > 0
    s1 = jnp.where(live, s, 1.0)
    if scale_mode in FOUR_OVER_SIX_METRICS:
        r = ieee_div(np.float32(1.0), t * s1)
    else:
        r = ieee_div(ieee_div(np.float32(1.0), t), s1)
    r = jnp.where(live, r, 0.0)
    q = round_to_grid(jnp.where(r > 0, x * r, 0.0), elem, saturate=True)
    return q, (q * s) * t


def with_elements(q: _qa.QArray, elems: jax.Array, scales: jax.Array) -> _qa.QArray:
    """``q`` with new element codes and block-scale codes: ``elems`` the elements (on the
    element grid, before scaling) of the padded tensor in storage order (the quantized axis
    last: ``q.codes``'s shape before packing), ``scales`` the scale codes in ``q.scales``'s
    shape. 1-D blocks; the tensor scale, shape and metadata are ``q``'s."""
    if len(q.axes) != 1:
        raise ValueError(f"with_elements takes 1-D blocks, got axes {q.axes}")
    scales = jnp.asarray(scales, jnp.uint8)
    if scales.shape != q.scales.shape:
        raise ValueError(f"scales has shape {scales.shape}, expected {q.scales.shape}")
    elem = q.format.elem
    codes = _qa.pack_codes(_qa.encode_elements(elems, elem), elem)
    if codes.shape != q.codes.shape:
        raise ValueError(f"elems give codes of shape {codes.shape}, expected {q.codes.shape}")
    return dataclasses.replace(q, codes=codes, scales=scales)
