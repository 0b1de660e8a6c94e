"""Pallas Triton GPU kernels for lowbit, one folder per op (api, kernel, config, reference, bench).

- :mod:`pallas_kernels.quantize`: fused block quantization of a 2-D matrix along rows or
  columns, bit-exact with ``lowbit.quantize`` (every MX format and NVFP4, nearest or
  stochastic rounding).
- :mod:`pallas_kernels.block_scaled_matmul`: ``C = A B`` on packed MX / NVFP4 operands
  quantized along K, or weight-only (one operand bf16 / float32).
- :mod:`pallas_kernels.quantized_gemm`: one GEMM of ``lowbit.dot_general`` (Hadamard
  transform, quantization of both operands along K, block-scaled matmul): the two kernels
  above on CUDA, the XLA emulation elsewhere. ``lowbit.dot_general(..., implementation=
  "pallas")`` reaches it through its implementation table.
- :mod:`pallas_kernels.gpu_check`: compile, check and time them all on a GPU (``--dry-run``:
  CUDA lowering and interpret-mode checks on a CPU).

Each op's ``implementation=None`` runs the kernel on a GPU and the XLA reference elsewhere.
The package imports only the layers of ``lowbit`` below ``dot_general`` (formats, numerics,
hadamard, qarray, recipes, operand); ``tests/test_layering.py`` checks it.
"""
