"""Fused block quantization of a 2-D matrix in one Pallas Triton kernel.

One program reads a ``[block_rows, block_cols]`` tile of ``x`` (bf16, f16 or f32), transposes it
in registers when the blocks run along axis 0, and writes the tile's packed codes and block
scales in ``lowbit.quantize``'s layout (quantized axis last): block amax as an integer max of
the bit patterns, shared exponent or E4M3 scale, scaling, saturation, rounding (nearest even,
or stochastic with lowbit's counter hash of each element's flat index in that layout), element
codes, packing (two FP4 codes a byte low nibble first; four FP6 codes in three bytes, written
with three stride-3 stores; one byte for FP8 and INT8). NVFP4's tensor amax is one XLA
reduction before the kernel (it needs the whole tensor).

The result is bit-identical to ``lowbit.quantize`` (tests/test_pallas_quantize.py); the
numerics are :mod:`pallas_kernels._numerics`. Shapes that are not multiples of the tile are
zero-padded before the kernel and the outputs sliced (zeros quantize to zero codes, as lowbit's
own padding does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lowbit import formats as _formats
from lowbit.formats import E4M3
from lowbit.qarray import E8M0_NAN, NVFP4_TENSOR_DIVISOR, UE4M3_NAN, QArray
from pallas_kernels import _numerics as nx
from pallas_kernels._common import round_up
from pallas_kernels.quantize.config import Config

__all__ = ["quantize_pallas", "tensor_scale"]


def _kernel(*refs, fmt, axis, stochastic, scale_mode, stride, index_stride, interpret):
    it = iter(refs)
    x_ref = next(it)
    key_ref = next(it) if stochastic else None
    t_ref = next(it) if fmt.tensor_scale else None
    codes_ref, scales_ref = next(it), next(it)
    elem, bs = fmt.elem, fmt.block_size

    x = x_ref[...].astype(jnp.float32)
    block_rows, block_cols = x.shape
    if axis == 0:
        x = x.T  # rows of the moved layout ([C, R]): blocks run along the last axis
    rows, cols = x.shape
    nb = cols // bs
    xb = x.reshape(rows, nb, bs)
    # Block amax on bit patterns: integer order is float order for |x|; NaN > Inf > finite.
    amax_bits = jnp.max(lax.bitcast_convert_type(xb, jnp.int32) & 0x7FFFFFFF, axis=2, keepdims=True)
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
        rbits = nx.hashed_bits(idx, key_ref[0], key_ref[1])

    if fmt.is_mx:
        e = nx.mx_scale_exponent(amax_bits, elem, scale_mode)
        scode = jnp.where(finite, e + 127, E8M0_NAN)
        d_hi = jnp.clip(-e, -126, 127)
        v = xb * nx.pow2(d_hi)
        if elem.emax == 0:  # MX INT8 can need 2**-e == 2**-127
            v = v * nx.pow2(-e - d_hi)
    else:  # NVFP4
        div = functools.partial(nx.ieee_div, interpret=interpret)
        amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
        t = t_ref[0]
        s_raw = jnp.minimum(div(div(amax, np.float32(elem.max)), t), np.float32(E4M3.max))
        s = nx.round_to_grid(jnp.where(t > 0, s_raw, np.float32(0)), E4M3)
        # x * ((1 / t) / s), as lowbit: the reciprocal per block, a product per element
        live = s > 0
        inv_t = div(jnp.full(s.shape, 1.0, jnp.float32), jnp.broadcast_to(t, s.shape))
        r = jnp.where(live, div(inv_t, jnp.where(live, s, 1.0)), 0.0)
        v = xb * r
        scode = jnp.where(finite, nx.encode(s, E4M3), UE4M3_NAN)
    v = jnp.clip(v, -elem.max, elem.max)
    if not fmt.is_mx:
        v = jnp.where(r > 0, v, np.float32(0))
    q = nx.round_to_grid(v, elem, rbits)
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


def tensor_scale(x: jax.Array, tensor_amax=None) -> jax.Array:
    """NVFP4's float32 tensor scale ``amax / (448 * 6)``, as ``lowbit.quantize`` computes it
    (amax over finite values, on bit patterns; a correctly rounded division)."""
    if tensor_amax is None:
        bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
        bits = jnp.where(bits < nx.INF_BITS, bits, 0)
        tamax = lax.bitcast_convert_type(jnp.max(bits), jnp.float32)
    else:
        tamax = jnp.asarray(tensor_amax, jnp.float32)
    d = np.float32(NVFP4_TENSOR_DIVISOR)
    return tamax / (d + tamax * np.float32(0))


@functools.partial(
    jax.jit,
    static_argnames=("fmt", "axis", "stochastic", "scale_mode", "config", "interpret"),
)
def _quantize(x, key_consts, tensor_amax, *, fmt, axis, stochastic, scale_mode, config, interpret):
    fmt = _formats.get(fmt)
    bs = fmt.block_size
    bits = fmt.elem.bits
    r, c = x.shape
    br, bc = config.block_rows, config.block_cols
    rp, cp = round_up(r, br), round_up(c, bc)
    if (rp, cp) != (r, c):
        x = jnp.pad(x, ((0, rp - r), (0, cp - c)))
    if axis == 1:
        stride = round_up(c, bs)
        out_rows, out_len = rp, cp
        out_block = (br, bc)
        out_map = lambda i, j: (i, j)
    else:
        stride = round_up(r, bs)
        out_rows, out_len = cp, rp
        out_block = (bc, br)
        out_map = lambda i, j: (j, i)

    inputs = [x]
    in_specs = [pl.BlockSpec((br, bc), lambda i, j: (i, j))]
    if stochastic:
        inputs.append(key_consts)
        in_specs.append(pl.BlockSpec((2,), lambda i, j: (0,)))
    t = None
    if fmt.tensor_scale:
        t = tensor_scale(x, tensor_amax)
        inputs.append(t.reshape(1))
        in_specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))

    kernel = functools.partial(
        _kernel,
        fmt=fmt,
        axis=axis,
        stochastic=stochastic,
        scale_mode=scale_mode,
        stride=stride,
        index_stride=c,  # axis 0: the tensor's row length (its columns are not padded)
        interpret=interpret,
    )
    codes, scales = pl.pallas_call(
        kernel,
        grid=(rp // br, cp // bc),
        in_specs=in_specs,
        out_specs=(
            pl.BlockSpec((out_block[0], out_block[1] * bits // 8), out_map),
            pl.BlockSpec((out_block[0], out_block[1] // bs), out_map),
        ),
        out_shape=(
            jax.ShapeDtypeStruct((out_rows, out_len * bits // 8), jnp.uint8),
            jax.ShapeDtypeStruct((out_rows, out_len // bs), jnp.uint8),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name=f"quantize_{fmt.name}_axis{axis}",
    )(*inputs)
    n_rows = r if axis == 1 else c
    if codes.shape != (n_rows, stride * bits // 8):
        codes = codes[:n_rows, : stride * bits // 8]
        scales = scales[:n_rows, : stride // bs]
    return codes, scales, t


def quantize_pallas(
    x: jax.Array,
    fmt,
    axis: int = -1,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    scale_mode: str | None = None,
    tensor_amax=None,
    config: Config,
    interpret: bool = False,
) -> QArray:
    """The kernel on validated arguments (see :func:`pallas_kernels.quantize.quantize`)."""
    fmt = _formats.get(fmt)
    axis = axis % 2
    stochastic = rounding == "stochastic"
    key_consts = nx.hash_constants(key) if stochastic else None
    if fmt.is_mx:
        scale_mode = "floor" if scale_mode is None else scale_mode
        tensor_amax = None
    else:
        scale_mode = None
    codes, scales, t = _quantize(
        x,
        key_consts,
        tensor_amax,
        fmt=fmt.name,
        axis=axis,
        stochastic=stochastic,
        scale_mode=scale_mode,
        config=config,
        interpret=interpret,
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
