"""Fused block quantization of a 2-D matrix in one Pallas Triton kernel.

One program reads a ``[block_rows, block_cols]`` tile of ``x`` (bf16, f16 or f32), transposes it
in registers when the blocks run along axis 0, optionally applies lowbit's blockwise
(randomised) Hadamard transform along the quantized axis to the tile it holds, and writes the
tile's packed codes and block scales in ``lowbit.quantize``'s layout (quantized axis last):
block amax as an integer max of the bit patterns, shared exponent or E4M3 scale, scaling, an
optional prescale, saturation, rounding (nearest even, or stochastic with lowbit's counter hash of
each element's flat index in that layout), element codes, packing (two FP4 codes a byte low
nibble first; four FP6 codes in three bytes, written with three stride-3 stores; one byte for
FP8 and INT8). NVFP4's tensor amax is one reduction before the kernel (it needs the whole
tensor): an XLA reduction of ``x``, or, with a Hadamard transform, a small Pallas kernel that
transforms each tile the same way and writes its finite maximum.

NVFP4's other scale rules, each computed by ``lowbit.core.scales``' or ``lowbit.core.qarray``'s
own arithmetic on the tile (bit-identical to the XLA path):

- Four Over Six (``lowbit.core.scales.four_over_six``, arXiv 2512.02010): each block quantized
  with both candidate scales in the kernel, from the tensor scales computed before it.
- MS-EDEN (``rounding="eden"``; Quartet II, arXiv 2601.22813, IST-DASLab/Quartet-II @ 8776a90b,
  ``lowbit.core.scales.ms_eden``): the kernel runs ``ms_eden_blocks`` on its blocks (after the
  fused Hadamard transform, as the XLA path quantizes the transformed tensor) and writes the
  final E2M1 codes and each block's corrected float32 scale ``s1`` (NaN for a non-finite
  block) in place of the scale codes; the tensor scale ``max(s1) / 256`` needs every block,
  so XLA then runs ``ms_eden_scales`` with lowbit's random bits (the top 16 of
  ``uniform_bits(key, ...)`` per block, in the XLA path's blocked order) and encodes the E4M3
  scales. No tensor amax pass runs.
- Double-block scales (``tensor_block``; TetraJet-v2, thu-ml/TetraJet-v2-NVFP4Training @
  ca5953f6, ``kernels/csrc/quant_fp4.cu:257-328``, as ``lowbit.core.qarray`` computes them):
  the tile's extent along the quantized axis is a multiple of the outer block (a power of two,
  :class:`Config`), so each outer block's finite amax is a max over the tile's own blocks and
  the kernel writes its float32 outer scale beside the codes and E4M3 scales: one read of
  ``x``, as TetraJet-v2's kernel quantizes an outer block from registers. Zero padding
  changes no maximum, so a partial last outer block gets lowbit's scale.

The result is bit-identical to ``lowbit.quantize`` (``lowbit.core.qarray.quantize_with_plan`` with
the plan's ``prescale``; tests/test_pallas_quantize.py); the numerics are lowbit's own, with the
substitutes in :mod:`pallas_kernels._numerics`. Shapes that are not multiples of the tile are
zero-padded before the kernel and the outputs sliced (zeros quantize to zero codes, as lowbit's
own padding does).

The Hadamard transform (``hadamard=b``) is the fixed-order butterfly of
``lowbit.core.hadamard.hadamard_transform(..., method="butterfly")``, operation for operation: the
signs (exact), ``log2(b)`` stages of sums and differences, one multiplication by
``float32(1/sqrt(b))``, and the rounding to ``x``'s dtype that ``hadamard_transform`` returns.
The stages are in constant-geometry order (each pairs the first half of every block with its
second half and interleaves the sums and differences), which combines the same operands as
lowbit's in-place stages ``h = b/2, ..., 1`` and ends in the natural order: reshape, an equal
split and a last-axis stack, all of which Triton lowers (no value slicing, no gathers). So the
kernel's transformed values equal lowbit's butterfly bit for bit, and lowbit's default dense
form (a matmul, whose summation order is the backend's) to float32 rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lowbit.core import formats as _formats
from lowbit.core.formats import E4M3
from lowbit.core.hadamard import BLOCK_SIZES as HADAMARD_SIZES
from lowbit.core.numerics import hash_constants, hashed_bits, pow2
from lowbit.core.plan import Plan
from lowbit.core.qarray import (
    E8M0_NAN,
    UE4M3_NAN,
    QArray,
    encode_elements,
    mx_scale_exponent,
    nvfp4_tensor_scale,
)
from lowbit.core.scales import (
    FOUR_OVER_SIX_METRICS,
    block_sum,
    four_over_six,
    four_over_six_tensor_scales,
    ms_eden_blocks,
    ms_eden_scales,
)
from pallas_kernels import _numerics as nx
from pallas_kernels._common import is_pow2, round_up
from pallas_kernels.quantize.config import Config

__all__ = ["quantize_pallas", "hadamard_rows", "check_hadamard"]


def check_hadamard(x_shape, axis: int, hadamard, signs) -> None:
    """Raise ValueError for a Hadamard block or signs the kernel cannot take."""
    if hadamard is None:
        if signs is not None:
            raise ValueError("signs apply only with a Hadamard transform: pass hadamard=b")
    else:
        if isinstance(hadamard, bool) or hadamard not in HADAMARD_SIZES:
            raise ValueError(f"hadamard={hadamard!r} must be one of {HADAMARD_SIZES} or None")
        n = x_shape[axis]
        if n % hadamard:
            raise ValueError(
                f"x.shape[{axis}]={n} (the quantized axis) must be a multiple of {hadamard=}"
            )
        if signs is not None and tuple(np.shape(signs)) != (hadamard,):
            raise ValueError(f"signs must have shape ({hadamard},), got {np.shape(signs)}")


def hadamard_rows(v: jax.Array, b: int, signs: jax.Array | None = None) -> jax.Array:
    """``hadamard_transform(v, b, signs=signs, method="butterfly")`` of float32 ``v [R, C]``
    along its last axis, in Triton-lowerable operations (see the module docstring)."""
    rows, cols = v.shape
    n, h = rows * cols // b, b // 2
    y = v.reshape(n, b)
    if signs is not None:
        y = y * signs.reshape(1, b)
    for _ in range(b.bit_length() - 1):
        top, bot = jnp.split(y.reshape(n, 2, h), 2, axis=1)
        top, bot = top.reshape(n, h), bot.reshape(n, h)
        y = jnp.stack([top + bot, top - bot], axis=-1).reshape(n, b)
    y = y * np.float32(1.0 / math.sqrt(b))
    return y.reshape(rows, cols)


def _load(x_ref, signs_ref, *, axis, hadamard, valid):
    """The program's tile as float32 in the moved layout (quantized axis last), transformed.

    ``valid``: with random signs, the transform of zero padding can hold -0, whose codes
    differ from the +0 of lowbit's padding; where such padding is in the output (a Hadamard
    block shorter than the format's block), positions ``>= valid`` along the quantized axis
    are set to +0.
    """
    x = x_ref[...]
    dtype = x.dtype
    x = x.astype(jnp.float32)
    if axis == 0:
        x = x.T  # rows of the moved layout ([C, R]): blocks run along the last axis
    if hadamard is None:
        return x
    x = hadamard_rows(x, hadamard, None if signs_ref is None else signs_ref[...])
    if dtype != jnp.float32:  # hadamard_transform returns x's dtype
        x = x.astype(dtype).astype(jnp.float32)
    if valid is not None:
        cols = x.shape[1]
        start = pl.program_id(1 if axis == 1 else 0) * cols
        pos = lax.broadcasted_iota(jnp.int32, x.shape, 1) + start
        x = jnp.where(pos < valid, x, np.float32(0))
    return x


def _kernel(
    *refs,
    fmt,
    axis,
    stochastic,
    scale_mode,
    stride,
    index_stride,
    interpret,
    hadamard,
    has_signs,
    valid,
    prescale,
    tensor_block,
    eden,
):
    it = iter(refs)
    x_ref = next(it)
    signs_ref = next(it) if has_signs else None
    key_ref = next(it) if stochastic else None
    t_ref = next(it) if _has_tensor_scale(fmt, tensor_block, eden) else None
    # MS-EDEN: scales_ref holds each block's corrected float32 scale s1 (NaN: a non-finite
    # block), which XLA turns into E4M3 codes after the kernel (ms_eden_scales)
    codes_ref, scales_ref = next(it), next(it)
    outer_ref = next(it) if tensor_block is not None else None
    elem, bs = fmt.elem, fmt.block_size

    x = _load(x_ref, signs_ref, axis=axis, hadamard=hadamard, valid=valid)
    rows, cols = x.shape
    nb = cols // bs
    xb = x.reshape(rows, nb, bs)
    # Block amax on bit patterns: integer order is float order for |x|; NaN > Inf > finite.
    abits = lax.bitcast_convert_type(xb, jnp.int32) & 0x7FFFFFFF
    amax_bits = jnp.max(abits, axis=2, keepdims=True)
    amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
    finite = amax_bits < nx.INF_BITS

    rbits = None
    if stochastic:
        rbits = _random_bits(key_ref, (rows, nb, bs), x_ref.shape, axis, stride, index_stride)

    # The steps of lowbit.core.qarray's block quantizer, in its order.
    div = functools.partial(nx.ieee_div, interpret=interpret)
    q = scode = None
    if fmt.is_mx:
        e = mx_scale_exponent(amax, elem, scale_mode)
        scode = jnp.where(finite, e + 127, E8M0_NAN)
        d_hi = jnp.clip(-e, -126, 127)
        v = xb * pow2(d_hi)
        if elem.emax == 0:  # MX INT8 can need 2**-e == 2**-127
            v = v * pow2(-e - d_hi)
        if prescale != 1.0:
            v = v * np.float32(prescale)
    elif eden:  # the per-block half of MS-EDEN: final codes and corrected scales
        q, s1 = ms_eden_blocks(xb, amax, finite, (2,), elem, div=div, rnd=_round_kw,
                               sum_=functools.partial(block_sum, halves="reshape"))
        scales_ref[...] = jnp.where(finite, s1, np.float32(np.nan)).reshape(rows, nb)
    elif tensor_block is not None:  # TetraJet-v2: the outer blocks lie inside the tile
        v, s, big = _double_block_tile(xb, abits, amax, finite, elem, tensor_block // bs, div)
        if prescale != 1.0:
            v = v * np.float32(prescale)
        outer_ref[...] = big
        scode = jnp.where(finite, nx.encode(s, E4M3), UE4M3_NAN)
    elif scale_mode in FOUR_OVER_SIX_METRICS:  # t_ref: decode, encode, tensor amax
        q, s = _four_over_six_tile(xb, amax, t_ref, elem, scale_mode, rbits, prescale,
                                   interpret)
        scode = jnp.where(finite, nx.encode(s, E4M3), UE4M3_NAN)
    else:  # NVFP4
        t = t_ref[0]
        s_raw = jnp.minimum(div(div(amax, np.float32(elem.max)), t), np.float32(E4M3.max))
        s = nx.round_to_grid(jnp.where(t > 0, s_raw, np.float32(0)), E4M3)
        # x * ((1 / t) / s), as lowbit: the reciprocal per block, a product per element
        live = s > 0
        inv_t = div(jnp.full(s.shape, 1.0, jnp.float32), jnp.broadcast_to(t, s.shape))
        r = jnp.where(live, div(inv_t, jnp.where(live, s, 1.0)), 0.0)
        v = xb * r
        if prescale != 1.0:
            v = v * np.float32(prescale)
        v = jnp.where(r > 0, v, np.float32(0))
        scode = jnp.where(finite, nx.encode(s, E4M3), UE4M3_NAN)
    if q is None:
        q = nx.round_to_grid(v, elem, rbits, saturate=True)
    q = jnp.where(finite, q, np.float32(0))  # a NaN/Inf block: NaN scale, zero codes
    _store_codes(codes_ref, nx.encode(q, elem).reshape(rows, cols), elem.bits)
    if scode is not None:
        scales_ref[...] = scode.reshape(rows, nb).astype(jnp.uint8)


def _random_bits(key_ref, shape, tile, axis, stride, index_stride):
    """lowbit's random bits of the program's elements ``shape = (rows, nb, bs)`` (the moved
    layout of a ``tile = (block_rows, block_cols)`` of ``x``): the counter hash of each
    element's flat index in the tensor's own (padded, row-major) layout, as lowbit.quantize
    draws them; rows of the moved layout are the tensor's columns for axis 0."""
    block_rows, block_cols = tile
    bs = shape[2]
    i, j = pl.program_id(0), pl.program_id(1)
    row0, col0 = (i * block_rows, j * block_cols) if axis == 1 else (j * block_cols, i * block_rows)
    r = lax.broadcasted_iota(jnp.int32, shape, 0) + row0
    c = (
        lax.broadcasted_iota(jnp.int32, shape, 1) * bs
        + lax.broadcasted_iota(jnp.int32, shape, 2)
        + col0
    )
    if axis == 1:
        idx = r.astype(jnp.uint32) * jnp.uint32(stride) + c.astype(jnp.uint32)
    else:
        idx = c.astype(jnp.uint32) * jnp.uint32(index_stride) + r.astype(jnp.uint32)
    return hashed_bits(idx, key_ref[0], key_ref[1])


def _store_codes(codes_ref, codes, bits):
    """Pack int32 element codes ``[rows, cols]`` into ``codes_ref``: one byte each for 8 bits,
    two FP4 codes a byte low nibble first, four FP6 codes in three bytes little-endian."""
    rows, cols = codes.shape
    if bits == 8:
        codes_ref[...] = codes.astype(jnp.uint8)
    elif bits == 4:
        g = codes.reshape(rows, cols // 2, 2)
        g = g << (lax.broadcasted_iota(jnp.int32, g.shape, 2) * 4)
        codes_ref[...] = jnp.sum(g, axis=2).astype(jnp.uint8)
    else:  # 6 bits: c0 | c1 << 6 | c2 << 12 | c3 << 18, written with three stride-3 stores
        g = codes.reshape(rows, cols // 4, 4)
        w = jnp.sum(g << (lax.broadcasted_iota(jnp.int32, g.shape, 2) * 6), axis=2)
        for b in range(3):
            codes_ref[:, pl.ds(b, cols // 4, stride=3)] = ((w >> (8 * b)) & 0xFF).astype(jnp.uint8)


def _has_tensor_scale(fmt, tensor_block, eden) -> bool:
    """Whether the kernel takes a tensor scale computed before it: NVFP4's plain and Four Over
    Six scales; not double-block scales (per tile) nor MS-EDEN's (from the kernel's output)."""
    return fmt.tensor_scale and tensor_block is None and not eden


def _double_block_tile(xb, abits, amax, finite, elem, k, div):
    """TetraJet-v2's double-block scales on a tile whose outer blocks (``k`` blocks each, along
    the last axis) lie inside it: ``(v, s, big)``, the scaled elements, the E4M3 block scales
    and the float32 outer scales ``[rows, nb / k]``. The arithmetic of
    ``lowbit.core.qarray``'s double-block path (thu-ml/TetraJet-v2-NVFP4Training @ ca5953f6,
    ``kernels/csrc/quant_fp4.cu:257-328``): the outer amax over the finite values (NaN and Inf
    count as 0; zero padding changes no maximum), ``S = (amax_outer / 448) / 6`` (1 where 0),
    ``s = E4M3((amax_16 / S) / 6)`` (2**-9 where 0; nearest, saturating; 0 amax for a
    non-finite block), elements ``x * (1 / (S * s))``."""
    rows, nb, _ = xb.shape
    fin = jnp.max(jnp.where(abits < nx.INF_BITS, abits, 0), axis=2)  # [rows, nb]
    outer = jnp.max(fin.reshape(rows, nb // k, k), axis=2)  # [rows, nb / k]
    big = div(div(lax.bitcast_convert_type(outer, jnp.float32), np.float32(E4M3.max)),
              np.float32(elem.max))
    big = jnp.where(big == 0, np.float32(1.0), big)
    big_b = jnp.broadcast_to(big.reshape(rows, nb // k, 1), (rows, nb // k, k))
    big_b = big_b.reshape(rows, nb, 1)
    amax = jnp.where(finite, amax, np.float32(0))
    s_raw = div(div(amax, big_b), np.float32(elem.max))
    s = nx.round_to_grid(jnp.where(s_raw == 0, np.float32(2.0**-9), s_raw), E4M3, saturate=True)
    prod = big_b * s  # a subnormal product counts as 0, as in qarray._double_block
    live = prod >= np.float32(2.0**-126)
    r = jnp.where(live, div(jnp.full(s.shape, 1.0, jnp.float32),
                            jnp.where(live, prod, 1.0)), 0.0)
    return xb * r, s, big


def _four_over_six_tile(xb, amax, t_ref, elem, scale_mode, rbits, prescale, interpret):
    """Four Over Six on a tile's blocks: ``lowbit.core.scales.four_over_six`` with the kernel's
    division and stochastic rounding, the tensor's ``(encode, decode)`` from ``t_ref``."""
    return four_over_six(
        xb, amax, t_ref[2], (2,), elem, FOUR_OVER_SIX_METRICS[scale_mode], rbits=rbits,
        prescale=prescale, scales=(t_ref[1], t_ref[0]),
        div=functools.partial(nx.ieee_div, interpret=interpret), rnd=_round_kw,
        sum_=functools.partial(block_sum, halves="reshape"),
    )[:2]


def _round_kw(v, elem, *, rbits=None, saturate=False):
    return nx.round_to_grid(v, elem, rbits, saturate=saturate)


def _amax_kernel(*refs, axis, hadamard, has_signs):
    """One program's finite maximum of ``|transformed tile|`` (int32 bit pattern)."""
    it = iter(refs)
    x_ref = next(it)
    signs_ref = next(it) if has_signs else None
    o_ref = next(it)
    x = _load(x_ref, signs_ref, axis=axis, hadamard=hadamard, valid=None)
    bits = lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
    bits = jnp.where(bits < nx.INF_BITS, bits, 0)  # NaN and Inf do not count
    o_ref[...] = jnp.max(bits).reshape(1, 1)


def _finite_amax(x: jax.Array) -> jax.Array:
    """max |x| over finite values (float32; as lowbit.quantize: on bit patterns)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
    bits = jnp.where(bits < nx.INF_BITS, bits, 0)
    return lax.bitcast_convert_type(jnp.max(bits), jnp.float32)


@functools.partial(
    jax.jit,
    static_argnames=(
        "fmt",
        "axis",
        "stochastic",
        "scale_mode",
        "config",
        "interpret",
        "hadamard",
        "prescale",
        "tensor_block",
        "eden",
    ),
)
def _quantize(
    x,
    key_consts,
    tensor_amax,
    signs,
    *,
    fmt,
    axis,
    stochastic,
    scale_mode,
    config,
    interpret,
    hadamard,
    prescale,
    tensor_block=None,
    eden=False,
):
    fmt = _formats.get(fmt)
    bs = fmt.block_size
    bits = fmt.elem.bits
    r, c = x.shape
    br, bc = config.block_rows, config.block_cols
    rp, cp = round_up(r, br), round_up(c, bc)
    if (rp, cp) != (r, c):
        x = jnp.pad(x, ((0, rp - r), (0, cp - c)))
    n = c if axis == 1 else r  # length of the quantized axis
    stride = round_up(n, bs)
    if axis == 1:
        out_rows, out_len = rp, cp
        out_block = (br, bc)
        out_map = lambda i, j: (i, j)
    else:
        out_rows, out_len = cp, rp
        out_block = (bc, br)
        out_map = lambda i, j: (j, i)
    grid = (rp // br, cp // bc)
    compiler_params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1)
    has_signs = signs is not None

    x_inputs, x_specs = [x], [pl.BlockSpec((br, bc), lambda i, j: (i, j))]
    if has_signs:
        x_inputs.append(signs.astype(jnp.float32))
        x_specs.append(pl.BlockSpec((hadamard,), lambda i, j: (0,)))
    inputs, in_specs = list(x_inputs), list(x_specs)
    if stochastic:
        inputs.append(key_consts)
        in_specs.append(pl.BlockSpec((2,), lambda i, j: (0,)))
    t = None
    if _has_tensor_scale(fmt, tensor_block, eden):
        if tensor_amax is not None:
            tamax = jnp.asarray(tensor_amax, jnp.float32)
        elif hadamard is None:
            tamax = _finite_amax(x)
        else:  # the amax of the transformed tensor, transformed tile by tile as below
            tile_amax = pl.pallas_call(
                functools.partial(_amax_kernel, axis=axis, hadamard=hadamard, has_signs=has_signs),
                grid=grid,
                in_specs=x_specs,
                out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)),
                out_shape=jax.ShapeDtypeStruct(grid, jnp.int32),
                compiler_params=compiler_params,
                interpret=interpret,
                name=f"quantize_amax_hadamard{hadamard}_axis{axis}",
            )(*x_inputs)
            tamax = lax.bitcast_convert_type(jnp.max(tile_amax), jnp.float32)
        if scale_mode in FOUR_OVER_SIX_METRICS:
            encode, t = four_over_six_tensor_scales(tamax)
            inputs.append(jnp.stack([t, encode, tamax]))
            in_specs.append(pl.BlockSpec((3,), lambda i, j: (0,)))
        else:
            t = nvfp4_tensor_scale(tamax)
            inputs.append(t.reshape(1))
            in_specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))

    # -0 from transformed zero padding is visible only where the output keeps padding
    # (stride > n), which happens only for a Hadamard block shorter than the format's.
    valid = n if (has_signs and stride != n) else None
    kernel = functools.partial(
        _kernel,
        fmt=fmt,
        axis=axis,
        stochastic=stochastic,
        scale_mode=scale_mode,
        stride=stride,
        index_stride=c,  # axis 0: the tensor's row length (its columns are not padded)
        interpret=interpret,
        hadamard=hadamard,
        has_signs=has_signs,
        valid=valid,
        prescale=prescale,
        tensor_block=tensor_block,
        eden=eden,
    )
    out_specs = [
        pl.BlockSpec((out_block[0], out_block[1] * bits // 8), out_map),
        pl.BlockSpec((out_block[0], out_block[1] // bs), out_map),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((out_rows, out_len * bits // 8), jnp.uint8),
        jax.ShapeDtypeStruct((out_rows, out_len // bs), jnp.float32 if eden else jnp.uint8),
    ]
    if tensor_block is not None:  # one float32 outer scale per tensor_block elements
        out_specs.append(pl.BlockSpec((out_block[0], out_block[1] // tensor_block), out_map))
        out_shape.append(jax.ShapeDtypeStruct((out_rows, out_len // tensor_block), jnp.float32))
    name = f"quantize_{fmt.name}_axis{axis}" + (f"_hadamard{hadamard}" if hadamard else "")
    name += ("_eden" if eden else "") + (f"_outer{tensor_block}" if tensor_block else "")
    codes, scales, *outer = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        out_shape=tuple(out_shape),
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(*inputs)
    n_rows = r if axis == 1 else c
    nb = stride // bs
    if codes.shape != (n_rows, stride * bits // 8):
        codes = codes[:n_rows, : stride * bits // 8]
        scales = scales[:n_rows, :nb]
    if tensor_block is not None:  # as lowbit stores them: one per outer block, the last partial
        (t,) = outer
        t = t[:n_rows, : -(-nb // (tensor_block // bs))]
    if eden:
        scales, t = _eden_scales(scales, key_consts, axis)
    return codes, scales, t


def _eden_scales(s1, key_consts, axis):
    """MS-EDEN's tensor-wide half in XLA, on the kernel's corrected scales ``s1`` (storage
    layout ``[lines, blocks]``, NaN for a non-finite block): ``lowbit.core.scales.ms_eden_scales``
    with lowbit's random bits, the top 16 of ``uniform_bits(key, amax.shape)`` for the block
    maxima in lowbit's blocked layout (``[lines, blocks, 1]`` along axis 1, ``[blocks, 1,
    lines]`` along axis 0: there the flat index runs over lines first)."""
    lines, nb = s1.shape
    finite = ~jnp.isnan(s1)
    s1 = jnp.where(finite, s1, np.float32(0))
    idx = lax.iota(jnp.uint32, lines * nb)
    idx = idx.reshape(lines, nb) if axis == 1 else idx.reshape(nb, lines).T
    noise = hashed_bits(idx, key_consts[0], key_consts[1]) >> 16
    s, ts = ms_eden_scales(s1, noise)
    return jnp.where(finite, encode_elements(s, E4M3), jnp.uint8(UE4M3_NAN)), ts


def plan_unsupported(plan: Plan) -> str | None:
    """Why the kernel cannot compute ``plan``'s options (None if it can).

    Double-block scales (``plan.tensor_block``) are computed per tile, whose extent along the
    quantized axis is a multiple of the outer block (:class:`Config`): one read of ``x``, as
    TetraJet-v2's own kernel quantizes an outer block from registers. That needs a power-of-two
    outer block (Triton tiles are powers of two) no longer than :data:`MAX_TENSOR_BLOCK`; other
    outer blocks run in the XLA path (``lowbit.quantize``). MS-EDEN (``plan.eden``) runs in
    any configuration: the kernel writes the codes and the corrected scales, XLA the tensor
    scale and the stochastically rounded E4M3 scales (they need every block's scale)."""
    tb = plan.tensor_block
    if tb is not None and not (is_pow2(tb) and tb <= MAX_TENSOR_BLOCK):
        return (f"tensor_block={tb} (double-block scales whose outer block is not a power of "
                f"two up to {MAX_TENSOR_BLOCK}: a tile spans whole outer blocks); "
                "lowbit.quantize computes it")
    return None


MAX_TENSOR_BLOCK = 1024
"""The longest outer block of double-block scales that the kernel computes: one program's tile
spans at least one outer block along the quantized axis (1024 elements: a quarter of the
default tile's 4096; TetraJet-v2's outer block is 128)."""

def quantize_pallas(
    x: jax.Array,
    plan: Plan,
    key: jax.Array | None = None,
    tensor_amax=None,
    *,
    config: Config,
    interpret: bool = False,
    hadamard: int | None = None,
    signs: jax.Array | None = None,
) -> QArray:
    """The kernel for a checked ``plan`` (``lowbit.core.qarray.make_plan`` of the 2-D ``x``, 1-D
    blocks of the format's own size along axis 0 or 1): the format, scale rule, rounding
    (MS-EDEN included: ``key`` draws its scales' random bits), prescale and outer block all
    come from the plan (see :func:`pallas_kernels.quantize.quantize`); a plan
    :func:`plan_unsupported` declines raises ValueError.

    ``hadamard``, ``signs``: quantize ``hadamard_transform(x, hadamard, signs=signs,
    axis=axis)``, transformed inside the kernel. With ``plan.prescale`` the codes hold the
    prescaled elements (divide dequantized values by it: ``lowbit.core.qarray.undo_prescale``).
    """
    fmt = plan.fmt
    if len(plan.shape) != 2 or plan.block_shape != (fmt.block_size,) or plan.shape != x.shape:
        raise ValueError(
            f"the quantize kernel takes a plan of a 2-D matrix with 1-D blocks of "
            f"{fmt.name}'s own size ({fmt.block_size},), got block_shape {plan.block_shape} "
            f"over axes {plan.axes} of shape {plan.shape} for x of shape {x.shape}"
        )
    if (why := plan_unsupported(plan)) is not None:
        raise ValueError(f"the Pallas quantize kernel does not compute {why}")
    (axis,) = plan.axes
    check_hadamard(x.shape, axis, hadamard, signs)
    config.check(fmt, axis, hadamard, plan.tensor_block)
    key_consts = jnp.stack(hash_constants(key)) if plan.stochastic or plan.eden else None
    codes, scales, t = _quantize(
        x,
        key_consts,
        tensor_amax if fmt.tensor_scale else None,
        None if signs is None else jnp.asarray(signs),
        fmt=fmt.name,
        axis=axis,
        stochastic=plan.stochastic,
        scale_mode=plan.scale_mode if plan.scale_mode != "nvfp4" else None,
        config=config,
        interpret=interpret,
        hadamard=hadamard,
        prescale=plan.prescale,
        tensor_block=plan.tensor_block,
        eden=plan.eden,
    )
    return QArray(
        codes=codes,
        scales=scales,
        tensor_scale=t,
        format_name=fmt.name,
        shape=tuple(x.shape),
        dtype=x.dtype,
        axes=(axis,),
        block_shape=(fmt.block_size,),
        tensor_block=plan.tensor_block,
    )
