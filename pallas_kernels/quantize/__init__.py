"""Fused block quantization (MX formats and NVFP4) of 2-D matrices: a Pallas Triton kernel
bit-exact with ``lowbit.quantize``."""

from pallas_kernels.quantize.api import quantize
from pallas_kernels.quantize.config import Config, get_default

__all__ = ["quantize", "Config", "get_default"]
