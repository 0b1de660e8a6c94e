"""Grouped block-scaled matmul (the forward and input-gradient GEMMs of ``lb.ragged_dot``):
row tiles of packed MX / NVFP4 codes, each multiplied by its group's packed weight, as a Pallas
Triton kernel matching dequantize-then-dot per group."""

from pallas_kernels.grouped_matmul.api import GroupedConfig, grouped_block_scaled_matmul
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference

__all__ = ["grouped_block_scaled_matmul", "grouped_matmul_reference", "GroupedConfig"]
