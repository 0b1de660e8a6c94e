"""Block quantization of a 2-D matrix: the Pallas kernel or the XLA reference.

>>> import jax.numpy as jnp
>>> from pallas_kernels.quantize import quantize
>>> x = jnp.linspace(-1.0, 1.0, 64 * 128).reshape(64, 128)
>>> q = quantize(x, "mxfp4", axis=0, implementation="xla")
>>> q.codes.shape, q.scales.shape
((128, 32), (128, 2))

With ``hadamard=b`` the kernel quantizes lowbit's blockwise Hadamard transform of ``x`` along
the quantized axis, computed on the tile it loaded; with a ``prescale`` (a recipe's
``QuantSpec.prescale``) the codes hold the elements times it (divide dequantized values by it):

>>> from lowbit.core.hadamard import random_signs
>>> import jax
>>> s = random_signs(jax.random.key(0), 32)
>>> q = quantize(x, "mxfp4", axis=0, hadamard=32, signs=s, prescale=0.75, implementation="xla")
>>> q.codes.shape
(128, 32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.core import formats as _formats
from lowbit.core.plan import make_plan
from lowbit.core.qarray import QArray
from lowbit.gemm.implementation import Implementation
from pallas_kernels._common import format_unsupported, select_implementation
from pallas_kernels.quantize.config import Config, get_default
from pallas_kernels.quantize.kernel import check_hadamard, plan_unsupported, quantize_pallas
from pallas_kernels.quantize.reference import quantize_reference

__all__ = ["quantize"]

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def quantize(
    x: jax.Array,
    fmt,
    axis: int = -1,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    scale_mode: str | None = None,
    tensor_amax=None,
    hadamard: int | None = None,
    signs: jax.Array | None = None,
    prescale: float = 1.0,
    tensor_block: int | None = None,
    implementation: str | None | Implementation = None,
    config: Config | None = None,
    interpret: bool = False,
) -> QArray:
    """Quantize the matrix ``x [R, C]`` along ``axis`` (0 or -1) to ``fmt``; a ``QArray``
    identical to ``lowbit.quantize(x, fmt, axis, ...)`` (see below for ``hadamard``,
    ``prescale``). The options are checked once, into a ``lowbit.core.qarray.Plan`` (the one
    validated description of the quantizer) that the kernel takes.

    Args:
      x: 2-D float32, bfloat16 or float16 matrix.
      fmt: a format name (every MX format and ``nvfp4``) or BlockFormat.
      axis: the axis the blocks run along: -1/1 (rows, the forward GEMM's activations) or
        0/-2 (columns, for the backward GEMMs).
      rounding, key, scale_mode, tensor_amax, tensor_block: as in ``lowbit.quantize``;
        MS-EDEN (``rounding="eden"``; its random Hadamard of 128 is ``hadamard=128,
        signs=...``, applied first as in the XLA path) and double-block scales as the
        kernel module describes; an outer block the kernel declines (``plan_unsupported``)
        runs in the XLA reference, with a warning when ``implementation="pallas"`` asked.
      hadamard: None, or a Hadamard block size (16..256, a divisor of ``x.shape[axis]``):
        quantize ``lowbit.core.hadamard.hadamard_transform(x, hadamard, signs=signs, axis=axis)``
        (NVFP4's tensor amax is that of the transformed tensor). The kernel transforms each
        tile in registers with lowbit's fixed-order butterfly: bit-identical to
        ``hadamard_transform(..., method="butterfly")``, and to lowbit's default dense form
        wherever that form's arithmetic is exact (to float32 rounding elsewhere).
      signs: the ``[hadamard]`` vector of +-1 of a randomised transform (e.g.
        ``lowbit.core.hadamard.random_signs``), or None.
      prescale: a static positive float, ``lowbit.core.qarray.Plan.prescale`` (a recipe's
        ``QuantSpec.prescale``): block scales are chosen from the (transformed) input, the
        scaled elements multiplied by ``prescale`` before rounding, so the codes hold the
        prescaled elements; ``lowbit.core.qarray.undo_prescale`` divides the dequantized values
        by it. Bit-identical to ``lowbit.core.qarray.quantize_with_plan``.
      implementation: ``"xla"`` (the reference), ``"pallas"`` (the kernel; falls back to the
        reference with a warning when it cannot run), or None (the kernel on a GPU).
      config: the kernel's tile (default: :func:`get_default`).
      interpret: run the kernel in Pallas interpret mode (CPU testing).
    """
    fmt = _formats.get(fmt)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point matrix, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(
            f"x must be a 2-D matrix, got shape {x.shape}; lowbit.quantize handles other ranks"
        )
    if axis not in (-2, -1, 0, 1):
        raise ValueError(f"axis must be 0 or -1 (or 1, -2) for a matrix, got {axis}")
    ax = axis % 2
    check_hadamard(x.shape, ax, hadamard, signs)
    plan = make_plan(x.shape, fmt, ax, None, scale_mode, rounding, key, tensor_amax, prescale,
                     tensor_block)
    if config is not None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be a quantize.Config, got {type(config).__name__}")
        config.check(fmt, ax, hadamard, plan.tensor_block)
    n_padded = x.shape[1 - ax] * plan.padded[0]
    if plan.stochastic and n_padded >= 2**32:
        raise ValueError(f"stochastic rounding supports fewer than 2**32 elements, got {n_padded}")

    unsupported = format_unsupported(fmt) or plan_unsupported(plan)
    if unsupported is not None:
        pass
    elif x.dtype not in KERNEL_DTYPES:
        unsupported = f"dtype {x.dtype} (the kernel reads float32, bfloat16, float16)"
    elif x.size == 0:
        unsupported = f"an empty matrix {x.shape}"
    impl = select_implementation("quantize", implementation, interpret, unsupported)
    if impl == "xla":
        return quantize_reference(
            x,
            fmt,
            ax,
            rounding=rounding,
            key=key,
            scale_mode=scale_mode,
            tensor_amax=tensor_amax,
            hadamard=hadamard,
            signs=signs,
            prescale=plan.prescale,
            tensor_block=tensor_block,
        )
    if config is None:
        config = get_default(x.shape, fmt, ax, hadamard, plan.tensor_block)
    return quantize_pallas(
        x, plan, key, tensor_amax, config=config, interpret=interpret, hadamard=hadamard,
        signs=signs,
    )
