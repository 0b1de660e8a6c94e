"""lowbit's GEMM layer: the three quantized GEMMs of a linear layer.

``implementation`` (the one table of ``implementation=`` values and where a request is
resolved), ``recipes`` (QuantSpec / GemmSpec / Recipe and the registry), ``operand`` (one
GEMM operand: Hadamard transform and quantization along its contraction axis; shared by the
XLA emulation and the Pallas kernels in ``pallas_kernels``) and ``dot_general`` (the custom-VJP
``dot_general`` and ``einsum``). Built on ``lowbit.core``; the framework layer
(``lowbit.flax``) and everything above it build on this.
"""
