"""Grouped block-scaled matmul as a Pallas Triton kernel: row tiles times their group's weight.

Operands: ``A``, ``T`` row tiles of ``bm`` rows (``[T, bm, K]``), each tile one tensor (a
QArray quantized along K with its leaves stacked per tile: ``codes [T, bm, K*bits/8]``, one
tensor scale per tile for NVFP4) or a high-precision ``[T, bm, K]`` array; ``B``, ``G`` weights
``[K, N]`` (a QArray stacked per group, quantized along K: ``codes [G, N, K*bits/8]``, one
tensor scale per group) or a high-precision ``[G, K, N]`` array; ``tile_group [T]`` int32.

A program owns the ``[bm, block_n]`` output block ``j`` of tile ``i``: it reads its group ``g =
tile_group[i]`` (a one-element block), loads ``B[g]``'s codes and scales (every group's block
is in the program's reach; ``g`` leads the load's one indexer: a pointer offset, no copy) and
runs the block-scaled matmul's K loop (``block_scaled_matmul.kernel.load_quantized``:
integer decoding, scales, a tensor-core dot with float32 accumulation). A tile whose group is
outside ``[0, G)`` runs no K step and writes zeros. The per-tile and per-group tensor scales
are combined outside the kernel (one float32 per tile) and multiply the accumulator at the
end, as in the block-scaled matmul. Padding: K and N to their blocks, G to a power of two
(Triton blocks are powers of two), all with zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import next_pow2, round_up
from pallas_kernels.block_scaled_matmul.kernel import Operand, load_quantized

__all__ = ["grouped_matmul_pallas"]


def _kernel(*refs, a_op: Operand, b_op: Operand, groups: int, block_k: int, num_k: int, cdt,
            precision, scaled: bool):
    it = iter(refs)
    tg_ref = next(it)
    a_refs = (next(it), next(it)) if a_op.quantized else (next(it),)
    b_refs = (next(it), next(it)) if b_op.quantized else (next(it),)
    t_ref = next(it) if scaled else None
    o_ref = next(it)
    bm, bn = o_ref.shape
    g = tg_ref[0]
    valid = (g >= 0) & (g < groups)
    gc = jnp.clip(g, 0, groups - 1)

    def body(k, acc):
        if a_op.quantized:
            a = load_quantized(*a_refs, k, block_k, a_op, cdt)  # [bm, bk]
        else:
            a = a_refs[0][:, pl.ds(pl.multiple_of(k * block_k, block_k), block_k)].astype(cdt)
        if b_op.quantized:
            b = load_quantized(*b_refs, k, block_k, b_op, cdt, lead=(gc,))  # [bn, bk]
            dims = (((1,), (1,)), ((), ()))
        else:
            b = b_refs[0][gc, pl.ds(pl.multiple_of(k * block_k, block_k), block_k), :]
            b = b.astype(cdt)
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(a, b, dims, precision=precision,
                                     preferred_element_type=jnp.float32)

    steps = jnp.where(valid, jnp.int32(num_k), jnp.int32(0))
    acc = lax.fori_loop(jnp.int32(0), steps, body, jnp.zeros((bm, bn), jnp.float32))
    if scaled:
        acc = acc * t_ref[0]
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad(x, shape):
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, s - d) for s, d in zip(shape, x.shape, strict=True)])


@functools.partial(
    jax.jit,
    static_argnames=("a_op", "b_op", "k", "n", "block_n", "block_k", "num_warps", "num_stages",
                     "out_dtype", "interpret"),
)
def grouped_matmul_pallas(tile_group, a_parts, b_parts, t, *, a_op: Operand, b_op: Operand,
                          k: int, n: int, block_n: int, block_k: int, num_warps: int,
                          num_stages: int, out_dtype, interpret: bool):
    """``[T, bm, N]`` from validated parts: ``a_parts`` (codes, scales) of the stacked tiles
    or ``(x,)``; ``b_parts`` likewise for the group stack; ``t`` float32 ``[T]`` (the tiles'
    combined tensor scales) or None."""
    ntiles, bm = (a_parts[0].shape[0], a_parts[0].shape[1])
    groups = b_parts[0].shape[0]
    gp = next_pow2(groups)
    np_, kt = round_up(n, block_n), round_up(k, block_k)
    inputs = [tile_group.astype(jnp.int32)]
    in_specs = [pl.BlockSpec((1,), lambda i, j: (i,))]
    if a_op.quantized:
        codes, scales = a_parts
        kb = kt * a_op.format.elem.bits // 8
        inputs += [_pad(codes, (ntiles, bm, kb)), _pad(scales, (ntiles, bm, kt // a_op.block))]
        in_specs += [pl.BlockSpec((None, bm, kb), lambda i, j: (i, 0, 0)),
                     pl.BlockSpec((None, bm, kt // a_op.block), lambda i, j: (i, 0, 0))]
    else:
        inputs.append(_pad(a_parts[0], (ntiles, bm, kt)))
        in_specs.append(pl.BlockSpec((None, bm, kt), lambda i, j: (i, 0, 0)))
    if b_op.quantized:
        codes, scales = b_parts
        kb = kt * b_op.format.elem.bits // 8
        inputs += [_pad(codes, (gp, np_, kb)), _pad(scales, (gp, np_, kt // b_op.block))]
        in_specs += [pl.BlockSpec((gp, block_n, kb), lambda i, j: (0, j, 0)),
                     pl.BlockSpec((gp, block_n, kt // b_op.block), lambda i, j: (0, j, 0))]
    else:
        inputs.append(_pad(b_parts[0], (gp, kt, np_)))
        in_specs.append(pl.BlockSpec((gp, kt, block_n), lambda i, j: (0, 0, j)))
    scaled = t is not None
    if scaled:
        inputs.append(t.astype(jnp.float32))
        in_specs.append(pl.BlockSpec((1,), lambda i, j: (i,)))
    hp = [jnp.dtype(op.dtype) for op in (a_op, b_op) if not op.quantized]
    cdt = jnp.bfloat16 if all(d == jnp.bfloat16 for d in hp) else jnp.float32
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    kernel = functools.partial(_kernel, a_op=a_op, b_op=b_op, groups=groups, block_k=block_k,
                               num_k=kt // block_k, cdt=cdt, precision=precision,
                               scaled=scaled)
    name = f"grouped_matmul_{a_op.fmt or a_op.dtype}_{b_op.fmt or b_op.dtype}"
    out = pl.pallas_call(
        kernel,
        grid=(ntiles, np_ // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bm, block_n), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((ntiles, bm, np_), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)
    return out[:, :, :n] if np_ != n else out
