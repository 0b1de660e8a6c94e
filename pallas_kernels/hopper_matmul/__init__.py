"""Block-scaled ``C = A B^T`` on Hopper's FP8 ``wgmma`` (MXFP8 as is; MXFP4 / NVFP4 decoded to E4M3
in shared memory, MXFP6 by the wrapper), block scales applied to the float32 accumulation per
block of 32 (DeepGEMM-style), as a Pallas Mosaic GPU kernel, with its XLA reference and a
device-less H100 compile report. Runs on sm_90a GPUs only; see :mod:`.kernel`."""

from pallas_kernels.hopper_matmul.kernel import (
    FORMATS,
    Config,
    WgmmaFormat,
    compile_report,
    e2m1_to_e4m3_bits,
    get_default,
    hopper_block_scaled_matmul,
    kernel_inputs,
    pair_packed,
    prepare_operands,
    reference,
    smem_bytes,
    wgmma_forms,
)

__all__ = [
    "FORMATS",
    "Config",
    "WgmmaFormat",
    "compile_report",
    "e2m1_to_e4m3_bits",
    "get_default",
    "hopper_block_scaled_matmul",
    "kernel_inputs",
    "pair_packed",
    "prepare_operands",
    "reference",
    "smem_bytes",
    "wgmma_forms",
]
