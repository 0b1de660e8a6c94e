"""One quantized GEMM of ``lowbit.dot_general``: the XLA emulation, or the Pallas kernels on CUDA.

``quantized_gemm(a, b, spec_a, spec_b, key_a, key_b)`` computes, for ``a [M, K]`` and
``b [K, N]`` (float32, already Hadamard-transformed by the caller), what ``lowbit.dot_general``
computes for one of its three GEMMs::

    lax.dot_general(quantize_operand(a, spec_a, 1, 0, key_a),
                    quantize_operand(b, spec_b, 0, 1, key_b),
                    (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=f32)

Two implementations, chosen per platform when the computation is lowered
(``lax.platform_dependent``), not when it is traced:

- ``default`` (CPU, TPU, ROCm, ...): the expression above, the XLA emulation, bit for bit;
- ``cuda``: clipping (``clip_rms``) in XLA, then the Pallas quantize kernel for
  each quantized operand (``a`` along axis 1, ``b`` along axis 0: K, bit-exact with lowbit's
  quantizer, stochastic rounding included), the block-scaled matmul kernel on the packed codes
  (a None spec: that operand enters in float32, the weight-only GEMM). It matches the
  emulation to float32-accumulation tolerance: the quantized values are the same, only the
  order of the float32 sums and where NVFP4's tensor scale is applied differ.

A pair of specs the kernels cannot take (:func:`kernel_supports`: per-tensor FP8, 2-D tiles,
a 1-D block that is not the format's own, a prescale gain, both operands high precision) runs
the emulation on
every platform. ``interpret=True`` forces the Pallas path in Pallas interpret mode (no
platform choice; CPU testing).

Since only the branch of the lowering platform is lowered, ``jax.export(...,
platforms=["cuda"])`` of a jitted ``quantized_gemm`` holds the Triton custom calls and a CPU
lowering none. A multi-platform export (``platforms=["cpu", "cuda"]``) lowers both branches
for both platforms, which the Triton kernels cannot (a Pallas call lowers only for a GPU or in
interpret mode): export for one platform at a time. The op is not differentiable (it serves
inside ``dot_general``'s custom VJP): differentiating it would differentiate the kernel branch.

>>> import jax.numpy as jnp
>>> from lowbit.recipes import QuantSpec
>>> a, b = jnp.ones((4, 64)), jnp.ones((64, 8))
>>> c = quantized_gemm(a, b, QuantSpec("mxfp8"), QuantSpec("mxfp4"), None, None)
>>> c.shape, float(c[0, 0])
((4, 8), 64.0)
>>> kernel_supports(QuantSpec("e4m3", granularity="tensor"), QuantSpec("mxfp4"))[0]
False
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit import formats as _formats
from lowbit.operand import quantize_operand
from lowbit.recipes import QuantSpec
from pallas_kernels._common import is_pow2
from pallas_kernels.block_scaled_matmul import get_default as _matmul_default
from pallas_kernels.block_scaled_matmul.kernel import matmul_pallas
from pallas_kernels.quantize import get_default as _quantize_default
from pallas_kernels.quantize.kernel import quantize_pallas

__all__ = ["quantized_gemm", "quantized_gemm_reference", "kernel_supports"]

_DN = (((1,), (0,)), ((), ()))


def _spec_unsupported(spec: QuantSpec | None, name: str) -> str | None:
    """Why the kernels cannot take operand spec ``spec`` (None if they can)."""
    if spec is None:
        return None
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{name} must be a lowbit.recipes.QuantSpec or None, got {spec!r}")
    if spec.granularity != "block":
        return (
            f"{name}: granularity={spec.granularity!r} ({spec.format} with one scale per "
            "tensor) has no block-scaled kernel"
        )
    fmt = _formats.get(spec.format)
    if spec.block_shape is not None:
        if len(spec.block_shape) != 1:
            return (
                f"{name}: a {len(spec.block_shape)}-D block_shape {spec.block_shape} (the "
                "kernels quantize with 1-D blocks along K)"
            )
        if spec.block_shape[0] != fmt.block_size:
            return (
                f"{name}: block_shape {spec.block_shape} is not {fmt.name}'s own block "
                f"({fmt.block_size},) (the quantize kernel's block)"
            )
    if not is_pow2(fmt.block_size) or fmt.block_size < 16:
        return f"{name}: block size {fmt.block_size} is not a power of two >= 16"
    if fmt.elem.bits not in (4, 6, 8):
        return f"{name}: {fmt.elem.bits}-bit elements (the kernels pack 4, 6 or 8 bits)"
    if fmt.tensor_scale and spec.scale_mode not in (None, "nvfp4"):
        return f"{name}: scale_mode={spec.scale_mode!r} does not apply to {fmt.name}"
    if spec.prescale != 1.0:
        return (
            f"{name}: prescale={spec.prescale} is a gain applied after the block scale is "
            "chosen, which the quantize kernel does not implement yet"
        )
    return None


def kernel_supports(spec_a: QuantSpec | None, spec_b: QuantSpec | None) -> tuple[bool, str]:
    """Whether the Pallas path can compute a GEMM with these operand specs, and why not.

    Returns ``(True, "")`` or ``(False, reason)``. Unsupported: per-tensor FP8
    (``granularity="tensor"``), 2-D ``block_shape`` tiles, a 1-D block other than the
    format's own, and two high-precision (None) operands (no quantized operand at all).
    """
    for spec, name in ((spec_a, "spec_a"), (spec_b, "spec_b")):
        reason = _spec_unsupported(spec, name)
        if reason is not None:
            return False, reason
    if spec_a is None and spec_b is None:
        return False, "both operands are high precision (None): a plain float32 dot"
    return True, ""


# --------------------------------------------------------------------------------------------
# The two implementations


def quantized_gemm_reference(a, b, spec_a, spec_b, key_a=None, key_b=None) -> jax.Array:
    """The XLA emulation: ``quantize_operand`` both operands along K, float32 dot."""
    aq = quantize_operand(a, spec_a, 1, 0, key_a)
    bq = quantize_operand(b, spec_b, 0, 1, key_b)
    return lax.dot_general(
        aq, bq, _DN, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _condition(x, spec: QuantSpec, axis: int):
    """The XLA part of ``quantize_operand`` before the quantizer: RMS clipping along the
    contraction axis (the same operations, so the same bits)."""
    if spec.clip_rms is not None:
        rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=axis, keepdims=True))
        bound = np.float32(spec.clip_rms) * rms
        x = jnp.clip(x, -bound, bound)
    return x


def _kernel_operand(x, spec: QuantSpec | None, axis: int, key, interpret: bool):
    """A QArray quantized along ``axis`` by the Pallas kernel, or ``x`` (None spec)."""
    if spec is None:
        return x
    x = _condition(x, spec, axis)
    fmt = _formats.get(spec.format)
    return quantize_pallas(
        x,
        fmt,
        axis,
        rounding=spec.rounding,
        key=key if spec.stochastic else None,
        scale_mode=spec.scale_mode if fmt.is_mx else None,
        config=_quantize_default(x.shape, fmt, axis),
        interpret=interpret,
    )


def _pallas_gemm(a, b, key_a, key_b, *, spec_a, spec_b, interpret: bool):
    qa = _kernel_operand(a, spec_a, 1, key_a, interpret)
    qb = _kernel_operand(b, spec_b, 0, key_b, interpret)
    (m, k), n = a.shape, b.shape[1]
    blocks = tuple(_formats.get(s.format).block_size for s in (spec_a, spec_b) if s is not None)
    config = _matmul_default(
        m, n, k, block_sizes=blocks, high_precision_f32=spec_a is None or spec_b is None
    )
    c = matmul_pallas(qa, qb, config=config, out_dtype=jnp.float32, interpret=interpret)
    return c


def _xla_gemm(a, b, key_a, key_b, *, spec_a, spec_b):
    return quantized_gemm_reference(a, b, spec_a, spec_b, key_a, key_b)


# --------------------------------------------------------------------------------------------
# The op


def _key_data(key, name: str):
    if key is None:
        return None
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise TypeError(
            f"{name} must be a jax.random.key(...) or uint32[2] key data, got "
            f"{key.dtype}{key.shape}"
        )
    return key


def quantized_gemm(
    a: jax.Array,
    b: jax.Array,
    spec_a: QuantSpec | None,
    spec_b: QuantSpec | None,
    key_a: jax.Array | None = None,
    key_b: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """float32 ``[M, N]``: ``a [M, K]`` and ``b [K, N]`` quantized along K, multiplied.

    Args:
      a, b: floating-point matrices (used as float32), already Hadamard-transformed.
      spec_a, spec_b: each operand's :class:`~lowbit.recipes.QuantSpec`, or None for a
        high-precision operand (weight-only GEMMs).
      key_a, key_b: uint32[2] key data (or typed keys) for the operand's stochastic
        rounding; exactly the keys ``lowbit.dot_general`` passes to ``quantize_operand``
        (ignored for a spec that rounds to nearest).
      interpret: run the Pallas path in Pallas interpret mode on any platform (testing);
        otherwise the Pallas path is lowered for CUDA and the XLA emulation elsewhere.
        Specs that :func:`kernel_supports` rejects run the emulation either way (with
        ``interpret=True``, with a warning).
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    for name, x in (("a", a), ("b", b)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point matrix, got dtype {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got shape {x.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"the contraction sizes differ: a is {a.shape} and b is {b.shape}")
    ok, reason = kernel_supports(spec_a, spec_b)  # also checks the spec types
    key_a, key_b = _key_data(key_a, "key_a"), _key_data(key_b, "key_b")
    for spec, key, name in ((spec_a, key_a, "spec_a"), (spec_b, key_b, "spec_b")):
        if spec is not None and spec.stochastic and key is None:
            raise ValueError(f"{name} rounds stochastically ({spec.format}): pass its key")
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if ok and 0 in a.shape + b.shape:
        ok, reason = False, f"an empty GEMM ({a.shape} x {b.shape})"
    xla = functools.partial(_xla_gemm, spec_a=spec_a, spec_b=spec_b)
    if not ok:
        if interpret:
            warnings.warn(
                f"quantized_gemm: the XLA emulation instead of the kernels: {reason}",
                stacklevel=2,
            )
        return xla(a, b, key_a, key_b)
    pallas = functools.partial(_pallas_gemm, spec_a=spec_a, spec_b=spec_b, interpret=interpret)
    if interpret:
        return pallas(a, b, key_a, key_b)
    return lax.platform_dependent(a, b, key_a, key_b, cuda=pallas, default=xla)
