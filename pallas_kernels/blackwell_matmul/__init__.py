"""Block-scaled ``C = A B^T`` on Blackwell's native MXFP8 / MXFP4 / NVFP4 MMA (``tcgen05.mma``
with ``.block_scale``), as a Pallas Mosaic GPU kernel, with its XLA reference and a
device-less B200 compile report. Runs on sm_100 GPUs only; see :mod:`.kernel`."""

from pallas_kernels.blackwell_matmul.kernel import (
    FORMATS,
    Config,
    MmaFormat,
    blackwell_block_scaled_matmul,
    compile_report,
    get_default,
    mma_kinds,
    prepare_operands,
    reference,
    smem_bytes,
)

__all__ = [
    "FORMATS",
    "Config",
    "MmaFormat",
    "blackwell_block_scaled_matmul",
    "compile_report",
    "get_default",
    "mma_kinds",
    "prepare_operands",
    "reference",
    "smem_bytes",
]
