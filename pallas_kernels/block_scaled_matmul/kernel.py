"""Block-scaled matmul ``C = A B`` on packed MX / NVFP4 operands, as a Pallas Triton kernel.

Operands: ``A [M, K]`` and ``B [K, N]``, each either a QArray quantized along K (1-D blocks; so
``A.codes`` is ``[M, K*bits/8]`` and ``B.codes``, with K moved last, ``[N, K*bits/8]``) or a
high-precision array (weight-only GEMMs such as W4A16: ``A`` bf16, ``B`` MXFP4).

A program owns a ``[block_m, block_n]`` tile of C and loops over K in ``block_k`` steps. Each
step loads the packed codes of both operand tiles (FP4: one byte holds two codes, split with a
shift and a mask and interleaved with a join; FP6: three stride-3 byte loads give the 24-bit
groups of four codes; FP8/INT8: one byte a code), decodes them with lowbit's integer
arithmetic (``lowbit.core.qarray.decode_elements``: no lookup tables), multiplies each K-block by
its scale (E8M0 as two exact powers of two, or an E4M3 value, as ``lowbit.core.qarray.dequantize``
does) and feeds the tile to a tensor-core dot with float32 accumulation.

Why the dequantized tile can be bf16 without loss: an MX element has at most 4 significant bits
(MX INT8: 7) and its scale is a power of two; an NVFP4 element times its E4M3 block scale has at
most 6 -- all exact in bf16's 8. NVFP4's float32 tensor scales are applied to the float32
accumulator at the end (``acc * t_a * t_b``). When a high-precision operand is float32 (or
float16) the tile is float32 instead and the dot runs in IEEE float32 (``Precision.HIGHEST``;
slower, no TF32). So C differs from the reference (dequantize, float32 dot) only by the order
of float32 accumulation (and NVFP4's tensor scale, applied to the sum rather than to each
element).

Shapes that are not multiples of the blocks are zero-padded (zero codes and zero scales
dequantize to 0) and C is sliced back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lowbit.core import formats as _formats
from lowbit.core.formats import E4M3
from lowbit.core.numerics import pow2
from lowbit.core.qarray import E8M0_NAN, QArray, decode_elements
from pallas_kernels._common import round_up
from pallas_kernels.block_scaled_matmul.config import Config

__all__ = ["Operand", "load_quantized", "matmul_pallas"]


@dataclasses.dataclass(frozen=True)
class Operand:
    """Static description of one operand: a quantized format (name, block size) or, with
    ``fmt=None``, a high-precision array of ``dtype``."""

    fmt: str | None
    block: int = 0
    dtype: str = "bfloat16"

    @property
    def quantized(self) -> bool:
        return self.fmt is not None

    @property
    def format(self):
        return _formats.get(self.fmt)


def load_quantized(codes_ref, scales_ref, k, bk: int, op: Operand, cdt, lead: tuple = ()):
    """Dequantized ``[rows, bk]`` tile (``cdt``) of K-step ``k``: decode, then scale.
    ``lead``: indices of leading axes taken first, in the same indexer (``(g,)``: the grouped
    kernel's group; Triton lowers one indexer per load)."""
    fmt = op.format
    elem, bs = fmt.elem, op.block
    rows = codes_ref.shape[len(lead)]
    at = lambda d: (*lead, slice(None), d)  # noqa: E731
    if elem.bits == 8:
        c = codes_ref[at(pl.ds(pl.multiple_of(k * bk, bk), bk))].astype(jnp.int32)
    elif elem.bits == 4:
        half = bk // 2
        p = codes_ref[at(pl.ds(pl.multiple_of(k * half, half), half))].astype(jnp.int32)
        c = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(rows, bk)  # low nibble first
    else:  # 6 bits: bytes (b0, b1, b2) hold c0 | c1 << 6 | c2 << 12 | c3 << 18
        quarter = bk // 4
        start = k * (3 * quarter)
        b0, b1, b2 = (
            codes_ref[at(pl.ds(start + t, quarter, stride=3))].astype(jnp.int32)
            for t in range(3)
        )
        w = b0 | (b1 << 8) | (b2 << 16)
        c0, c1, c2, c3 = ((w >> (6 * t)) & 0x3F for t in range(4))
        # [rows, quarter, 2, 2] with [.., a, b] = c_{2a+b}: joins only on the last axis
        c = jnp.stack([jnp.stack([c0, c2], axis=-1), jnp.stack([c1, c3], axis=-1)], axis=-1)
        c = c.reshape(rows, bk)
    # lowbit's code tables and scale decoding (lowbit.core.qarray.dequantize), in integer ops
    vals = decode_elements(c, elem).reshape(rows, bk // bs, bs)
    nbk = bk // bs
    s = scales_ref[at(pl.ds(pl.multiple_of(k * nbk, nbk), nbk))].astype(jnp.int32)
    if fmt.is_mx:
        e = s - 127
        s_hi = jnp.clip(e, -126, 127)
        hi = jnp.where(s == E8M0_NAN, np.float32(np.nan), pow2(s_hi))
        y = (vals * hi[:, :, None]) * pow2(e - s_hi)[:, :, None]
    else:
        y = vals * decode_elements(s, E4M3)[:, :, None]
    return y.reshape(rows, bk).astype(cdt)


def _kernel(
    *refs, a_op: Operand, b_op: Operand, block_k: int, num_k: int, cdt, precision, scaled: bool
):
    it = iter(refs)
    a_refs = (next(it), next(it)) if a_op.quantized else (next(it),)
    b_refs = (next(it), next(it)) if b_op.quantized else (next(it),)
    t_ref = next(it) if scaled else None
    o_ref = next(it)
    bm, bn = o_ref.shape

    def body(k, acc):
        if a_op.quantized:
            a = load_quantized(*a_refs, k, block_k, a_op, cdt)  # [bm, bk]
        else:
            a = a_refs[0][:, pl.ds(pl.multiple_of(k * block_k, block_k), block_k)]
            a = a.astype(cdt)
        if b_op.quantized:
            b = load_quantized(*b_refs, k, block_k, b_op, cdt)  # [bn, bk]
            dims = (((1,), (1,)), ((), ()))
        else:
            b = b_refs[0][pl.ds(pl.multiple_of(k * block_k, block_k), block_k), :]
            b = b.astype(cdt)  # [bk, bn]
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(
            a, b, dims, precision=precision, preferred_element_type=jnp.float32
        )

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
    if scaled:
        acc = (acc * t_ref[0]) * t_ref[1]
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile_index(pid, num_m: int, num_n: int, group_m: int):
    """(i, j) of program ``pid``: column-major within groups of ``group_m`` tile-rows."""
    width = group_m * num_n
    first_m = (pid // width) * group_m
    size = jnp.minimum(num_m - first_m, group_m)
    return first_m + (pid % width) % size, (pid % width) // size


def _pad2(x, rows: int, cols: int):
    if x.shape == (rows, cols):
        return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


@functools.partial(
    jax.jit,
    static_argnames=("a_op", "b_op", "m", "n", "k", "config", "out_dtype", "interpret"),
)
def _matmul(
    a_parts,
    b_parts,
    t,
    *,
    a_op: Operand,
    b_op: Operand,
    m: int,
    n: int,
    k: int,
    config: Config,
    out_dtype,
    interpret: bool,
):
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    mp, np_, kt = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    num_m, num_n = mp // bm, np_ // bn
    tile = functools.partial(_tile_index, num_m=num_m, num_n=num_n, group_m=config.group_m)

    inputs, in_specs = [], []
    for op, parts, rows, row_of in ((a_op, a_parts, mp, 0), (b_op, b_parts, np_, 1)):
        row_map = lambda pid, row_of=row_of: (tile(pid)[row_of], 0)
        if op.quantized:
            codes, scales = parts
            kb = kt * op.format.elem.bits // 8
            inputs += [_pad2(codes, rows, kb), _pad2(scales, rows, kt // op.block)]
            in_specs += [
                pl.BlockSpec((bm if row_of == 0 else bn, kb), row_map),
                pl.BlockSpec((bm if row_of == 0 else bn, kt // op.block), row_map),
            ]
        elif row_of == 0:  # A [M, K]
            inputs.append(_pad2(parts[0], mp, kt))
            in_specs.append(pl.BlockSpec((bm, kt), row_map))
        else:  # B [K, N]
            inputs.append(_pad2(parts[0], kt, np_))
            in_specs.append(pl.BlockSpec((kt, bn), lambda pid: (0, tile(pid)[1])))
    scaled = t is not None
    if scaled:
        inputs.append(t)
        in_specs.append(pl.BlockSpec((2,), lambda pid: (0,)))

    hp = [jnp.dtype(op.dtype) for op in (a_op, b_op) if not op.quantized]
    cdt = jnp.bfloat16 if all(d == jnp.bfloat16 for d in hp) else jnp.float32
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    kernel = functools.partial(
        _kernel,
        a_op=a_op,
        b_op=b_op,
        block_k=bk,
        num_k=kt // bk,
        cdt=cdt,
        precision=precision,
        scaled=scaled,
    )
    name = f"block_scaled_matmul_{a_op.fmt or a_op.dtype}_{b_op.fmt or b_op.dtype}"
    out = pl.pallas_call(
        kernel,
        grid=(num_m * num_n,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda pid: tile(pid)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=name,
    )(*inputs)
    return out[:m, :n] if (mp, np_) != (m, n) else out


def matmul_pallas(a, b, *, config: Config, out_dtype=jnp.float32, interpret: bool = False):
    """The kernel on validated operands (see :func:`block_scaled_matmul`): each a QArray
    quantized along K with 1-D blocks, or a 2-D array."""

    def describe(x):
        if isinstance(x, QArray):
            op = Operand(x.format_name, x.block_shape[0])
            return op, (x.codes, x.scales), x.tensor_scale
        return Operand(None, 0, jnp.dtype(x.dtype).name), (x,), None

    a_op, a_parts, ta = describe(a)
    b_op, b_parts, tb = describe(b)
    m, k = a.shape
    n = b.shape[1]
    t = None
    if ta is not None or tb is not None:
        one = jnp.float32(1.0)
        t = jnp.stack(
            [
                one if ta is None else ta.astype(jnp.float32),
                one if tb is None else tb.astype(jnp.float32),
            ]
        )
    return _matmul(
        a_parts,
        b_parts,
        t,
        a_op=a_op,
        b_op=b_op,
        m=m,
        n=n,
        k=k,
        config=config,
        out_dtype=jnp.dtype(out_dtype),
        interpret=interpret,
    )
