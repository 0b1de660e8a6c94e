"""Block-scaled matmul on packed MX / NVFP4 operands (and weight-only W4A16 / W8A16): a Pallas
Triton kernel matching ``dequantize`` then a float32 dot."""

from pallas_kernels.block_scaled_matmul.api import block_scaled_matmul
from pallas_kernels.block_scaled_matmul.config import Config, get_default

__all__ = ["block_scaled_matmul", "Config", "get_default"]
