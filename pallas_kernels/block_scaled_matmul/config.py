"""Block sizes of the block-scaled matmul kernel.

A program computes one ``[block_m, block_n]`` tile of ``C``, looping over ``K`` in steps of
``block_k``; programs are ordered in groups of ``group_m`` tile-rows so that neighbouring
programs share operand tiles in L2. ``block_k`` must be a multiple of each quantized operand's
block size (16 or 32), every block a power of two (Triton tensors are), and ``block_m``,
``block_n`` at least 16 (the smallest tensor-core tile).

>>> get_default(8192, 8192, 8192)
Config(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
>>> get_default(16, 8192, 8192)
Config(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=8, num_stages=3)
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._common import is_pow2, next_pow2

__all__ = ["Config", "get_default"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile of one kernel program and its Triton launch parameters."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or not is_pow2(v):
                raise ValueError(f"{name}={v!r} must be a positive power of two")
        for name in ("block_m", "block_n"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 16")
        if self.block_k < 16:
            raise ValueError(f"block_k={self.block_k} must be at least 16")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"group_m={self.group_m!r} must be a positive int")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages!r} must be a positive int")

    def check(self, block_sizes: tuple[int, ...]) -> None:
        """Raise ValueError unless ``block_k`` is a multiple of every operand block size."""
        for b in block_sizes:
            if self.block_k % b:
                raise ValueError(
                    f"block_k={self.block_k} must be a multiple of the operands' block size {b}"
                )


def get_default(
    m: int,
    n: int,
    k: int,
    *,
    block_sizes: tuple[int, ...] = (32,),
    high_precision_f32: bool = False,
) -> Config:
    """A tile for ``C [m, n] = A [m, k] B [k, n]``.

    Decode-like ``m <= 64``: the smallest ``block_m`` that holds ``m``, narrow ``block_n``
    (enough programs to fill the GPU) and ``block_k = 128``. Otherwise 128x128 tiles with
    ``block_k = 64`` (32 for float32 operands, whose tiles are twice the bytes). Eight warps,
    three stages. Blocks never exceed the padded problem.

    Why eight warps and these ``block_k``: the kernel decodes each operand tile in registers
    (integer ops per element) before the MMA, so a thread holds its share of both decoded
    tiles besides the accumulator. Compiled for H100 and B200 (``make gpu-aot``,
    ``pallas_kernels/aot_report.md``), the former defaults (4 warps; ``block_k = 256`` for
    decode) sat at 255 registers and spilled in 13 of gpu_check's 22 matmul configurations on
    H100 and 7 on B200: 28 to 368 B per thread at 128x128x64 (MXFP6, MXFP8, NVFP4 on H100;
    with 4 warps a thread holds a 128-register accumulator besides its share of both decoded
    128x64 tiles) and 592 to 1,400 B at 16x64x256 (a thread decodes 128 elements of B's tile
    per step), every format but MXINT8. With 8 warps the
    accumulator and each decoded tile are half per thread: 128x128x64 needs 128 (MXFP6) to
    222 (E4M3 x E5M2) registers and nothing spills; decode at 16x64x128 needs 80 (NVFP4) to 159
    (16x64x256 with 8 warps still spilled 200 to 280 B for MXFP8). No configuration that
    this function picks for ``gpu_check``'s shapes spills on either target
    (``tests/test_gpu_aot.py`` holds the report to that).
    """
    bk_min = max(block_sizes + (16,))
    if m <= 64:
        block_m = max(16, next_pow2(m))
        block_n, block_k, group_m = 64, 128, 1
    else:
        block_m, block_n, block_k, group_m = 128, 128, 64, 8
    if high_precision_f32:
        block_k //= 2
    block_m = min(block_m, max(16, next_pow2(m)))
    block_n = min(block_n, max(16, next_pow2(n)))
    block_k = max(bk_min, min(block_k, next_pow2(k)))
    return Config(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        group_m=group_m,
        num_warps=8,
        num_stages=3,
    )
