"""lowbit's core numerics: one tensor at a time, no GEMM, no framework.

Lowest first: ``formats`` (element, scale and block formats, the name registry),
``numerics`` (rounding onto an element grid, the counter hash), ``hadamard`` (blockwise
transforms), ``plan`` (the one checked description of how to quantize a tensor), ``native``
(the compiled CPU kernel, ``_native/``), ``qarray`` (the QArray pytree, quantize / dequantize /
fake_quantize). Nothing here imports the GEMM layer (``lowbit.gemm``) or anything above it.
"""
