"""One quantized GEMM of ``lowbit.dot_general``: the XLA emulation, or the Pallas kernels on CUDA.

``quantized_gemm(a, b, spec_a, spec_b, key_a, key_b, hadamard=..., signs=...)`` computes, for
``a [M, K]`` and ``b [K, N]``, what ``lowbit.dot_general`` computes for one of its three
GEMMs: each operand Hadamard-transformed along K (when the GEMM has a transform) and
quantized along K per its spec, then a float32-accumulated product
(:func:`~pallas_kernels.quantized_gemm.reference.quantized_gemm_reference`).

Implementations (``implementation=``, the same vocabulary as every op):

- ``"xla"``: the emulation in pure XLA on every platform, the reference;
- ``"pallas"`` or None: the Pallas kernels when the computation is lowered for CUDA, and the
  emulation elsewhere (with lowbit's compiled CPU kernel for the quantizers on CPU), chosen
  per platform when the computation is lowered (``lax.platform_dependent``), not when it is
  traced. ``"pallas"`` warns when the specs have no kernel (None falls back silently);
- ``interpret=True`` forces the kernel path in Pallas interpret mode (CPU testing).

On CUDA the kernel path is Mosaic GPU's block-scaled matmul where the target GPU has one
for the specs (Blackwell's ``tcgen05.mma``, Hopper's FP8 ``wgmma``:
:mod:`pallas_kernels.quantized_gemm.mosaic`), else the Triton kernels; the choice is made
when the CUDA branch is traced, from the compute capability being compiled for
(``lowbit.gemm.implementation.gpu_arch``) and the implementation's ``gpu_kernels``.

A pair of specs the kernels cannot take (:func:`kernel_supports`: per-tensor FP8, 2-D tiles,
a 1-D block that is not the format's own, both operands high precision) runs
the emulation on every platform.

Since only the branch of the lowering platform is lowered, ``jax.export(...,
platforms=["cuda"])`` of a jitted ``quantized_gemm`` holds the Triton custom calls and a CPU
lowering none. A multi-platform export (``platforms=["cpu", "cuda"]``) lowers both branches
for both platforms, which the Triton kernels cannot (a Pallas call lowers only for a GPU or in
interpret mode): export for one platform at a time. The op is not differentiable (it serves
inside ``dot_general``'s custom VJP): differentiating it would differentiate the kernel branch.

>>> import jax.numpy as jnp
>>> from lowbit.gemm.recipes import QuantSpec
>>> a, b = jnp.ones((4, 64)), jnp.ones((64, 8))
>>> c = quantized_gemm(a, b, QuantSpec("mxfp8"), QuantSpec("mxfp4"), None, None)
>>> c.shape, float(c[0, 0])
((4, 8), 64.0)
>>> kernel_supports(QuantSpec("e4m3", granularity="tensor"), QuantSpec("mxfp4"))[0]
False
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.gemm.implementation import Implementation, gpu_arch, resolve
from lowbit.gemm.recipes import QuantSpec
from pallas_kernels.quantized_gemm.kernel import kernel_supports, quantized_gemm_pallas
from pallas_kernels.quantized_gemm.mosaic import family, mosaic_supports, quantized_gemm_mosaic
from pallas_kernels.quantized_gemm.reference import quantized_gemm_reference

__all__ = ["quantized_gemm", "quantized_gemm_reference", "kernel_supports"]


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


def _mosaic_family(impl: Implementation, spec_a, spec_b) -> str | None:
    """The Mosaic GPU kernel family this GEMM runs on in the CUDA branch (None: Triton), by
    the compute capability being compiled for (``lowbit.gemm.implementation.gpu_arch``, read
    when the branch is traced) and ``impl.gpu_kernels``; ``"mosaic"`` warns where it falls
    back."""
    if impl.gpu_kernels == "triton":
        return None
    arch = gpu_arch()
    fam = family(arch)
    why = f"compute capability {arch} has no Mosaic GPU kernel here" if fam is None else None
    if fam is not None:
        ok, why = mosaic_supports(fam, spec_a, spec_b)
        if ok:
            return fam
    if impl.gpu_kernels == "mosaic":
        warnings.warn(f"quantized_gemm: the Triton kernels instead of Mosaic GPU: {why}",
                      stacklevel=3)
    return None


def quantized_gemm(
    a: jax.Array,
    b: jax.Array,
    spec_a: QuantSpec | None,
    spec_b: QuantSpec | None,
    key_a: jax.Array | None = None,
    key_b: jax.Array | None = None,
    *,
    hadamard: int | None = None,
    signs: jax.Array | None = None,
    implementation: str | None | Implementation = None,
    interpret: bool = False,
) -> jax.Array:
    """float32 ``[M, N]``: ``a [M, K]`` and ``b [K, N]`` quantized along K, multiplied.

    Args:
      a, b: floating-point matrices (used as float32).
      spec_a, spec_b: each operand's :class:`~lowbit.gemm.recipes.QuantSpec`, or None for a
        high-precision operand (weight-only GEMMs).
      key_a, key_b: uint32[2] key data (or typed keys) for the operand's stochastic
        rounding; exactly the keys ``lowbit.dot_general`` passes to ``quantize_operand``
        (ignored for a spec that rounds to nearest).
      hadamard: block size of a Hadamard transform along K applied to both operands first
        (``GemmSpec.hadamard``), or None; ``signs``: its float32 ``[hadamard]`` +-1 signs.
      implementation: ``"xla"``, ``"pallas"``, None (module docstring), or the
        ``lowbit.gemm.implementation.Implementation`` they resolve to.
      interpret: run the kernel path in Pallas interpret mode on any platform (testing).
        Specs that :func:`kernel_supports` rejects run the emulation either way (with
        ``interpret=True`` or ``implementation="pallas"``, with a warning).
    """
    impl = resolve(implementation)
    a, b = jnp.asarray(a), jnp.asarray(b)
    for name, x in (("a", a), ("b", b)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point matrix, got dtype {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got shape {x.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"the contraction sizes differ: a is {a.shape} and b is {b.shape}")
    if hadamard is not None and a.shape[1] % hadamard:
        raise ValueError(
            f"K={a.shape[1]} must be a multiple of the Hadamard block hadamard={hadamard}"
        )
    ok, reason = kernel_supports(spec_a, spec_b)  # also checks the spec types
    key_a, key_b = _key_data(key_a, "key_a"), _key_data(key_b, "key_b")
    for spec, key, name in ((spec_a, key_a, "spec_a"), (spec_b, key_b, "spec_b")):
        if spec is not None and spec.stochastic and key is None:
            raise ValueError(f"{name} rounds stochastically ({spec.format}): pass its key")
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if ok and 0 in a.shape + b.shape:
        ok, reason = False, f"an empty GEMM ({a.shape} x {b.shape})"
    common = dict(spec_a=spec_a, spec_b=spec_b, hadamard=hadamard)
    if impl.requested == "xla" and not interpret:
        return quantized_gemm_reference(a, b, spec_a, spec_b, key_a, key_b, hadamard=hadamard,
                                        signs=signs, native=False)

    def xla(a, b, key_a, key_b, signs):
        return quantized_gemm_reference(a, b, spec_a, spec_b, key_a, key_b, hadamard=hadamard,
                                        signs=signs)

    if not ok:
        if interpret or impl.warns:
            warnings.warn(
                f"quantized_gemm: the XLA emulation instead of the kernels: {reason}",
                stacklevel=2,
            )
        return xla(a, b, key_a, key_b, signs)

    def pallas(a, b, key_a, key_b, signs):
        fam = None if interpret else _mosaic_family(impl, spec_a, spec_b)
        if fam is not None:
            return quantized_gemm_mosaic(a, b, key_a, key_b, fam=fam, signs=signs, **common)
        return quantized_gemm_pallas(a, b, key_a, key_b, signs=signs, interpret=interpret,
                                     **common)

    if interpret:
        return pallas(a, b, key_a, key_b, signs)
    return lax.platform_dependent(a, b, key_a, key_b, signs, cuda=pallas, default=xla)

