"""``C = A B`` on block-quantized operands: the Pallas kernel or the XLA reference.

>>> import jax.numpy as jnp
>>> from pallas_kernels.block_scaled_matmul import block_scaled_matmul
>>> from pallas_kernels.quantize import quantize  # lb.quantize, jitted on this path
>>> x, w = jnp.ones((16, 64)), jnp.ones((64, 32))
>>> a = quantize(x, "mxfp8", axis=-1, implementation="xla")  # blocks along K
>>> b = quantize(w, "mxfp4", axis=0, implementation="xla")  # along K too: codes [N, K/2]
>>> c = block_scaled_matmul(a, b, implementation="xla")
>>> c.shape, float(c[0, 0])
((16, 32), 64.0)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.core.qarray import QArray
from pallas_kernels._common import format_unsupported, is_pow2, select_implementation
from pallas_kernels.block_scaled_matmul.config import Config, get_default
from pallas_kernels.block_scaled_matmul.kernel import matmul_pallas
from pallas_kernels.block_scaled_matmul.reference import block_scaled_matmul_reference

__all__ = ["block_scaled_matmul"]

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_operand(x, name: str):
    if isinstance(x, QArray):
        shape = x.shape
    else:
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a QArray or a floating-point array, got {x.dtype}")
        shape = x.shape
    if len(shape) != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {shape}")
    return x


def _kernel_unsupported(x, name: str, k_axis: int) -> str | None:
    """Why the kernel cannot take operand ``x`` (None if it can)."""
    if isinstance(x, QArray):
        if (why := format_unsupported(x.format)) is not None:
            return f"{name}: {why}"
        if x.axes != (k_axis,) or len(x.block_shape) != 1:
            return (
                f"{name} must be quantized along K (axis {k_axis}) with 1-D blocks for the "
                f"kernel, got axes={x.axes}, block_shape={x.block_shape}; quantize it with "
                f"lb.quantize({name.lower()}, fmt, axis={k_axis})"
            )
        if not is_pow2(x.block_shape[0]) or x.block_shape[0] < 16:
            return f"{name}'s block size {x.block_shape[0]} is not a power of two >= 16"
    elif x.dtype not in KERNEL_DTYPES:
        return f"{name} has dtype {x.dtype} (the kernel reads float32, bfloat16, float16)"
    if 0 in x.shape:
        return f"{name} is empty ({x.shape})"
    return None


def block_scaled_matmul(
    a,
    b,
    *,
    out_dtype=jnp.float32,
    implementation: str | None = None,
    config: Config | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``dequantize(a) @ dequantize(b)`` with float32 accumulation, in ``out_dtype``.

    Args:
      a: ``[M, K]``: a QArray quantized along K (``lb.quantize(x, fmt, axis=-1)``) or a
        float32 / bfloat16 array (weight-only GEMMs).
      b: ``[K, N]``: a QArray quantized along K (``lb.quantize(w, fmt, axis=0)``: its codes are
        ``[N, K*bits/8]``) or a float array. At least one operand must be a QArray; the two
        may have different formats (e.g. MXFP8 E4M3 activations times E5M2 gradients).
      out_dtype: float32 (default), bfloat16 or float16.
      implementation: ``"xla"`` (dequantize + float32 dot), ``"pallas"`` (the kernel; falls
        back to the reference with a warning when it cannot run: no GPU and no ``interpret``,
        an operand not quantized along K), or None (the kernel on a GPU).
      config: the kernel's blocks (default: :func:`get_default`).
      interpret: run the kernel in Pallas interpret mode (CPU testing).
    """
    a = _check_operand(a, "A")
    b = _check_operand(b, "B")
    if not isinstance(a, QArray) and not isinstance(b, QArray):
        raise ValueError("at least one operand must be a QArray; for two arrays use jnp.dot")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"the contraction sizes differ: A is {a.shape} and B is {b.shape} (A [M, K], B [K, N])"
        )
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in KERNEL_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    blocks = tuple(x.block_shape[-1] for x in (a, b) if isinstance(x, QArray))
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a block_scaled_matmul.Config, got {type(config).__name__}")

    unsupported = _kernel_unsupported(a, "A", 1) or _kernel_unsupported(b, "B", 0)
    impl = select_implementation("block_scaled_matmul", implementation, interpret, unsupported)
    if impl == "xla":
        return block_scaled_matmul_reference(a, b, out_dtype=out_dtype)
    m, k = a.shape
    n = b.shape[1]
    if config is None:
        f32 = any(not isinstance(x, QArray) and x.dtype != jnp.bfloat16 for x in (a, b))
        config = get_default(m, n, k, block_sizes=blocks, high_precision_f32=f32)
    config.check(blocks)
    return matmul_pallas(a, b, config=config, out_dtype=out_dtype, interpret=interpret)
