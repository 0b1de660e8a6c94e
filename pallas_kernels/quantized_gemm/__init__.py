"""One quantized GEMM (the building block of ``lowbit.dot_general``'s three GEMMs): the XLA
emulation (``reference.py``) or the Pallas kernels on CUDA (``kernel.py``), picked in
``api.py`` by ``implementation=None | "xla" | "pallas"``."""

from pallas_kernels.quantized_gemm.api import kernel_supports, quantized_gemm
from pallas_kernels.quantized_gemm.reference import quantized_gemm_reference

__all__ = ["quantized_gemm", "quantized_gemm_reference", "kernel_supports"]
