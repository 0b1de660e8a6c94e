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
from lowbit.core.qarray import E8M0_NAN, UE4M3_NAN, QArray, mx_scale_exponent, nvfp4_tensor_scale
from lowbit.core.scales import (
    FOUR_OVER_SIX_METRICS,
    block_sum,
    four_over_six,
    four_over_six_tensor_scales,
)
from pallas_kernels import _numerics as nx
from pallas_kernels._common import round_up
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
):
    it = iter(refs)
    x_ref = next(it)
    signs_ref = next(it) if has_signs else None
    key_ref = next(it) if stochastic else None
    t_ref = next(it) if fmt.tensor_scale else None
    codes_ref, scales_ref = next(it), next(it)
    elem, bs = fmt.elem, fmt.block_size

    block_rows, block_cols = x_ref.shape
    x = _load(x_ref, signs_ref, axis=axis, hadamard=hadamard, valid=valid)
    rows, cols = x.shape
    nb = cols // bs
    xb = x.reshape(rows, nb, bs)
    # Block amax on bit patterns: integer order is float order for |x|; NaN > Inf > finite.
    amax_bits = jnp.max(lax.bitcast_convert_type(xb, jnp.int32) & 0x7FFFFFFF, axis=2, keepdims=True)
    amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
    finite = amax_bits < nx.INF_BITS

    rbits = None
    if stochastic:
        i, j = pl.program_id(0), pl.program_id(1)
        row0, col0 = (
            (i * block_rows, j * block_cols) if axis == 1 else (j * block_cols, i * block_rows)
        )
        shape = (rows, nb, bs)
        r = lax.broadcasted_iota(jnp.int32, shape, 0) + row0
        c = (
            lax.broadcasted_iota(jnp.int32, shape, 1) * bs
            + lax.broadcasted_iota(jnp.int32, shape, 2)
            + col0
        )
        # Flat index in the tensor's own (padded, row-major) layout, as lowbit.quantize
        # draws its random bits: rows of the moved layout are the tensor's columns for axis 0.
        if axis == 1:
            idx = r.astype(jnp.uint32) * jnp.uint32(stride) + c.astype(jnp.uint32)
        else:
            idx = c.astype(jnp.uint32) * jnp.uint32(index_stride) + r.astype(jnp.uint32)
        rbits = hashed_bits(idx, key_ref[0], key_ref[1])

    # The steps of lowbit.core.qarray's block quantizer, in its order.
    if fmt.is_mx:
        e = mx_scale_exponent(amax, elem, scale_mode)
        scode = jnp.where(finite, e + 127, E8M0_NAN)
        d_hi = jnp.clip(-e, -126, 127)
        v = xb * pow2(d_hi)
        if elem.emax == 0:  # MX INT8 can need 2**-e == 2**-127
            v = v * pow2(-e - d_hi)
        if prescale != 1.0:
            v = v * np.float32(prescale)
    elif scale_mode in FOUR_OVER_SIX_METRICS:  # t_ref: decode, encode, tensor amax
        q, s = _four_over_six_tile(xb, amax, t_ref, elem, scale_mode, rbits, prescale,
                                   interpret)
        scode = jnp.where(finite, nx.encode(s, E4M3), UE4M3_NAN)
    else:  # NVFP4
        div = functools.partial(nx.ieee_div, interpret=interpret)
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
    if scale_mode not in FOUR_OVER_SIX_METRICS:
        q = nx.round_to_grid(v, elem, rbits, saturate=True)
    q = jnp.where(finite, q, np.float32(0))  # a NaN/Inf block: NaN scale, zero codes
    codes = nx.encode(q, elem).reshape(rows, cols)

    bits = elem.bits
    if bits == 8:
        codes_ref[...] = codes.astype(jnp.uint8)
    elif bits == 4:
        g = codes.reshape(rows, cols // 2, 2)
        g = g << (lax.broadcasted_iota(jnp.int32, g.shape, 2) * 4)
        codes_ref[...] = jnp.sum(g, axis=2).astype(jnp.uint8)
    else:  # 6 bits: c0 | c1 << 6 | c2 << 12 | c3 << 18, three bytes little-endian
        g = codes.reshape(rows, cols // 4, 4)
        w = jnp.sum(g << (lax.broadcasted_iota(jnp.int32, g.shape, 2) * 6), axis=2)
        for b in range(3):
            codes_ref[:, pl.ds(b, cols // 4, stride=3)] = ((w >> (8 * b)) & 0xFF).astype(jnp.uint8)
    scales_ref[...] = scode.reshape(rows, nb).astype(jnp.uint8)


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
    if fmt.tensor_scale:
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
    )
    name = f"quantize_{fmt.name}_axis{axis}" + (f"_hadamard{hadamard}" if hadamard else "")
    codes, scales = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=(
            pl.BlockSpec((out_block[0], out_block[1] * bits // 8), out_map),
            pl.BlockSpec((out_block[0], out_block[1] // bs), out_map),
        ),
        out_shape=(
            jax.ShapeDtypeStruct((out_rows, out_len * bits // 8), jnp.uint8),
            jax.ShapeDtypeStruct((out_rows, out_len // bs), jnp.uint8),
        ),
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(*inputs)
    n_rows = r if axis == 1 else c
    if codes.shape != (n_rows, stride * bits // 8):
        codes = codes[:n_rows, : stride * bits // 8]
        scales = scales[:n_rows, : stride // bs]
    return codes, scales, t


def plan_unsupported(plan: Plan) -> str | None:
    """Why the kernel cannot compute ``plan``'s options (None if it can): double-block scales
    and MS-EDEN run in the XLA path (``lowbit.quantize``) for now."""
    if plan.tensor_block is not None:
        return (f"tensor_block={plan.tensor_block} (double-block scales) yet; lowbit.quantize "
                "computes it")
    if plan.eden:
        return "rounding='eden' (MS-EDEN) yet; lowbit.quantize computes it"
    return None


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
    blocks of the format's own size along axis 0 or 1): the format, scale rule, rounding and
    prescale all come from the plan (see :func:`pallas_kernels.quantize.quantize`).

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
    config.check(fmt, axis, hadamard)
    key_consts = jnp.stack(hash_constants(key)) if plan.stochastic else None
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
    )
