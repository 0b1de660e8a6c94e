"""Grouped ``C[tile i] = A[tile i] B[group of tile i]`` on block-quantized operands: the Pallas
kernel or the XLA reference.

>>> import jax, jax.numpy as jnp, lowbit as lb
>>> from pallas_kernels.grouped_matmul import grouped_block_scaled_matmul
>>> x, w = jnp.ones((4, 16, 64)), jnp.ones((2, 64, 32))    # 4 tiles of 16 rows, 2 groups
>>> a = jax.vmap(lambda t: lb.quantize(t, "mxfp8", axis=-1))(x)  # one tensor per tile
>>> b = jax.vmap(lambda g: lb.quantize(g, "mxfp4", axis=0))(w)   # one tensor per group
>>> c = grouped_block_scaled_matmul(a, b, jnp.array([0, 0, 1, 2]), implementation="xla")
>>> c.shape, float(c[0, 0, 0]), float(c[3, 0, 0])                # group 2: no such group
((4, 16, 32), 64.0, 0.0)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowbit.core.qarray import QArray
from pallas_kernels._common import format_unsupported, is_pow2, select_implementation
from pallas_kernels.block_scaled_matmul.kernel import Operand
from pallas_kernels.grouped_matmul.kernel import grouped_matmul_pallas
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference

__all__ = ["GroupedConfig", "grouped_block_scaled_matmul", "run_kernel"]

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Output block width, K step and Triton launch parameters (the row block is the tile's
    ``bm``). The block-scaled matmul's large-problem tile: eight warps (see its
    ``config.get_default`` on register pressure), ``block_k = 64``."""

    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or not is_pow2(v):
                raise ValueError(f"{name}={v!r} must be a positive power of two")
        if self.block_n < 16 or self.block_k < 16:
            raise ValueError(f"block_n={self.block_n} and block_k={self.block_k} must be >= 16")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages!r} must be a positive int")


def _stacked(x) -> bool:
    return isinstance(x, QArray) and x.codes.ndim == len(x.shape) + 1


def _check(x, name: str, lead: str, per: str):
    """``x`` as given (a stacked QArray) or as an array, with a clear error otherwise."""
    if isinstance(x, QArray):
        if not _stacked(x) or len(x.shape) != 2:
            raise ValueError(
                f"{name} must be a QArray stacked over its {lead} (jax.vmap of lb.quantize over "
                f"a [{lead[0].upper()}, {per}] array: one tensor per {lead[:-1]}), got codes "
                f"{x.codes.shape} for shape {x.shape}")
        return x
    x = jnp.asarray(x)
    if x.ndim != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a stacked QArray or a floating [{lead[0].upper()}, "
                         f"{per}] array, got {x.dtype}{x.shape}")
    return x


def _shape3(x):
    return (x.codes.shape[0], *x.shape) if isinstance(x, QArray) else tuple(x.shape)


def _unsupported(x, name: str, k_axis: int, bm: int | None) -> str | None:
    if isinstance(x, QArray):
        if (why := format_unsupported(x.format)) is not None:
            return f"{name}: {why}"
        if x.axes != (k_axis,) or len(x.block_shape) != 1:
            return (f"{name} must be quantized along K (axis {k_axis} of each tensor) with 1-D "
                    f"blocks, got axes={x.axes}, block_shape={x.block_shape}")
        if not is_pow2(x.block_shape[0]) or x.block_shape[0] < 16:
            return f"{name}'s block size {x.block_shape[0]} is not a power of two >= 16"
        if x.tensor_scale is not None and x.tensor_scale.ndim != 1:
            return f"{name} has outer block scales (tensor_block): the kernel takes one per tensor"
    elif jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        return f"{name} has dtype {x.dtype} (the kernel reads float32, bfloat16, float16)"
    if bm is not None and (not is_pow2(bm) or bm < 16):
        return f"A's tiles have {bm} rows: the kernel needs a power of two >= 16"
    return None


def grouped_block_scaled_matmul(a, b, tile_group, *, out_dtype=jnp.float32,
                                implementation: str | None = None,
                                config: GroupedConfig | None = None,
                                interpret: bool = False) -> jax.Array:
    """``[T, bm, N]``: each row tile of ``a`` times the weight of its group, float32 sums.

    Args:
      a: ``T`` row tiles ``[bm, K]``: a QArray stacked per tile (``jax.vmap`` of
        ``lb.quantize(tile, fmt, axis=-1)``; each tile one tensor, e.g. a group's rows with
        the group's tensor amax) or a float ``[T, bm, K]`` array (weight-only GEMMs).
      b: ``G`` weights ``[K, N]``: a QArray stacked per group (``jax.vmap`` of
        ``lb.quantize(w, fmt, axis=0)``) or a float ``[G, K, N]`` array. At least one of
        ``a``, ``b`` is a QArray.
      tile_group: int ``[T]``, the group of each tile; outside ``[0, G)`` the tile gives zeros.
      out_dtype: float32, bfloat16 or float16.
      implementation: ``"xla"`` (the reference), ``"pallas"`` (the kernel; the reference with
        a warning where it cannot run), None (the kernel on a GPU).
      config: :class:`GroupedConfig` (default: its defaults, narrowed to the problem).
      interpret: run the kernel in Pallas interpret mode (CPU testing).
    """
    a = _check(a, "A", "tiles", "bm, K")
    b = _check(b, "B", "groups", "K, N")
    if not isinstance(a, QArray) and not isinstance(b, QArray):
        raise ValueError("at least one operand must be a QArray; for two arrays use jnp.einsum")
    (t, bm, k), (_, kb_, n) = _shape3(a), _shape3(b)
    if k != kb_:
        raise ValueError(f"the contraction sizes differ: A's tiles are [{bm}, {k}], B's "
                         f"weights [{kb_}, {n}]")
    tile_group = jnp.asarray(tile_group)
    if tile_group.shape != (t,) or not jnp.issubdtype(tile_group.dtype, jnp.integer):
        raise ValueError(f"tile_group must be an int array of shape ({t},) (one group per "
                         f"tile), got {tile_group.dtype}{tile_group.shape}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in KERNEL_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if config is not None and not isinstance(config, GroupedConfig):
        raise TypeError(f"config must be a GroupedConfig, got {type(config).__name__}")
    unsupported = _unsupported(a, "A", 1, bm) or _unsupported(b, "B", 0, None)
    impl = select_implementation("grouped_block_scaled_matmul", implementation, interpret,
                                 unsupported)
    if impl == "xla":
        return grouped_matmul_reference(a, b, tile_group, out_dtype=out_dtype)
    return run_kernel(a, b, tile_group, config=config, out_dtype=out_dtype, interpret=interpret)


def run_kernel(a, b, tile_group, *, config: GroupedConfig | None = None,
               out_dtype=jnp.float32, interpret: bool = False) -> jax.Array:
    """The kernel on validated operands (see :func:`grouped_block_scaled_matmul`), with no
    fallback: what the CUDA lowering tests export."""
    cfg = config or GroupedConfig()
    (t, _, k), (g, _, n) = _shape3(a), _shape3(b)
    blocks = tuple(x.block_shape[0] for x in (a, b) if isinstance(x, QArray))
    block_k = max(16, *blocks, min(cfg.block_k, 1 << max(0, (k - 1).bit_length())))
    block_n = max(16, min(cfg.block_n, 1 << max(0, (n - 1).bit_length())))
    if any(block_k % bs for bs in blocks):
        raise ValueError(f"block_k={block_k} must be a multiple of the block sizes {blocks}")

    def parts(x):
        if isinstance(x, QArray):
            return Operand(x.format_name, x.block_shape[0]), (x.codes, x.scales), x.tensor_scale
        return Operand(None, 0, jnp.dtype(x.dtype).name), (x,), None

    a_op, a_parts, ta = parts(a)
    b_op, b_parts, tb = parts(b)
    scale = None
    if ta is not None or tb is not None:
        scale = jnp.ones((t,), jnp.float32)
        if ta is not None:
            scale = scale * ta.astype(jnp.float32)
        if tb is not None:
            scale = scale * tb.astype(jnp.float32)[jnp.clip(tile_group, 0, g - 1)]
    return grouped_matmul_pallas(
        tile_group, a_parts, b_parts, scale, a_op=a_op, b_op=b_op, k=k, n=n, block_n=block_n,
        block_k=block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        out_dtype=jnp.dtype(out_dtype), interpret=interpret)
