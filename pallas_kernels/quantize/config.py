"""Block sizes of the quantize kernel.

A program quantizes one ``[block_rows, block_cols]`` tile of the input matrix ``x [R, C]``:
``block_rows`` runs along ``x``'s axis 0 and ``block_cols`` along axis 1, whichever axis is
quantized. The extent along the quantized axis must be a multiple of the format's block (32 for
MX, 16 for NVFP4), of the Hadamard block when the kernel applies one (16..256) and of the outer
block of double-block scales (``tensor_block``: the kernel computes each outer block's scale from
the blocks its tile holds); both extents must be powers of two (Triton tensors are).

>>> get_default((4096, 4096), "mxfp4", axis=-1)
Config(block_rows=16, block_cols=256, num_warps=4)
>>> get_default((4096, 4096), "mxfp4", axis=0, hadamard=256)
Config(block_rows=256, block_cols=16, num_warps=4)
>>> get_default((4096, 4096), "nvfp4", axis=-1, tensor_block=512)
Config(block_rows=8, block_cols=512, num_warps=4)
"""

from __future__ import annotations

import dataclasses

from lowbit.core import formats as _formats
from pallas_kernels._common import is_pow2, next_pow2, pow2_divisor, round_up

__all__ = ["Config", "get_default"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile of one kernel program and its Triton launch parameter."""

    block_rows: int
    block_cols: int
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_rows", "block_cols", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or not is_pow2(v):
                raise ValueError(f"{name}={v!r} must be a positive power of two")
        if self.num_warps > 32:
            raise ValueError(f"num_warps={self.num_warps} must be at most 32")

    def check(self, fmt, axis: int, hadamard: int | None = None,
              tensor_block: int | None = None) -> None:
        """Raise ValueError if this tile cannot quantize ``fmt`` along ``axis`` (0 or 1), with
        a Hadamard transform of block ``hadamard`` (None: none) inside the kernel and
        double-block scales of outer block ``tensor_block`` (None: none)."""
        fmt = _formats.get(fmt)
        bs = fmt.block_size
        axis = axis % 2
        along = self.block_cols if axis == 1 else self.block_rows
        name = "block_cols" if axis == 1 else "block_rows"
        if along % bs:
            raise ValueError(
                f"{name}={along} must be a multiple of {fmt.name}'s block size {bs} "
                f"(the tile extent along the quantized axis {axis})"
            )
        if hadamard is not None and along % hadamard:
            raise ValueError(
                f"{name}={along} must be a multiple of the Hadamard block {hadamard} "
                f"(the tile extent along the quantized axis {axis})"
            )
        if tensor_block is not None and along % tensor_block:
            raise ValueError(
                f"{name}={along} must be a multiple of {tensor_block=} (the outer block of "
                f"double-block scales; the tile extent along the quantized axis {axis})"
            )


def get_default(shape: tuple[int, int], fmt, axis: int = -1, hadamard: int | None = None,
                tensor_block: int | None = None) -> Config:
    """A tile for quantizing ``x`` of ``shape`` along ``axis``: about 4096 elements a program,
    long along the quantized axis for ``axis=-1`` (contiguous rows), square for ``axis=0``
    (the tile is transposed in registers), no larger than the padded matrix, and at least
    one ``hadamard`` block and one ``tensor_block`` (a power of two) long along the quantized
    axis. Four warps: compiled for H100 and B200 (``make gpu-aot``,
    ``pallas_kernels/aot_report.md``) none of ``gpu_check``'s 51 quantize configurations
    spills; the heaviest, Four Over Six along axis 0 (64 x 64 tiles, two candidates per block
    in registers), sits at 255 registers without spilling, so a larger tile there would."""
    fmt = _formats.get(fmt)
    bs = fmt.block_size
    hb = max(hadamard or 1, tensor_block or 1)
    r, c = shape
    axis = axis % 2
    if axis == 1:
        cp = round_up(c, bs)
        block_cols = max(bs, hb, pow2_divisor(cp, 256))
        block_rows = max(1, min(4096 // block_cols, next_pow2(r)))
    else:
        rp = round_up(r, bs)
        block_rows = max(bs, hb, pow2_divisor(rp, 64))
        block_cols = max(1, min(64, 4096 // block_rows, next_pow2(c)))
    return Config(block_rows=block_rows, block_cols=block_cols, num_warps=4)
