"""The kernel path of one quantized GEMM: the Pallas quantize kernel for each operand, then the
block-scaled matmul kernel on the packed codes.

Each quantized operand goes through ``pallas_kernels.quantize`` along K (``a`` along axis 1,
``b`` along axis 0; bit-exact with lowbit's quantizer, stochastic rounding included), on the
operand's checked quantization plan (``lowbit.gemm.operand.spec_plan``, the very plan the
XLA path quantizes with: format, scale rule, rounding and ``prescale``). The GEMM's Hadamard
transform runs inside that kernel, on the tile it loaded (lowbit's fixed-order butterfly);
the codes hold the prescaled elements and the matmul's float32 result is divided by the two
prescales. Two cases transform in XLA first (the same ``lowbit.core.hadamard`` call as the
emulation): a high-precision (None) operand, which enters the matmul in float32 (the
weight-only GEMM), and a ``clip_rms`` spec, whose RMS clip (XLA) reads the transformed
operand. It matches the emulation to float32-accumulation tolerance: the quantized values are
the same, only the order of the float32 sums, where NVFP4's tensor scale and the prescales
are applied, and (on inputs where the transform's float32 arithmetic is inexact) the
butterfly's against the dense form's rounding differ.

This path calls the two kernels' entry points (``quantize_pallas`` on a checked plan,
``matmul_pallas``), not their ops' ``api.py``: an ``api.py`` chooses its implementation from
JAX's default backend when it is traced, while ``quantized_gemm`` runs this path in the CUDA
branch of a ``lax.platform_dependent``, which is traced on every machine (a CPU included, to
export for CUDA) and lowered only for CUDA; the api's choice would be the CPU's there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.core import formats as _formats
from lowbit.core.qarray import undo_prescale
from lowbit.gemm.operand import clip_to_rms, hadamard_along, spec_plan
from lowbit.gemm.recipes import QuantSpec
from pallas_kernels._common import format_unsupported, is_pow2
from pallas_kernels.block_scaled_matmul import get_default as _matmul_default
from pallas_kernels.block_scaled_matmul.kernel import matmul_pallas
from pallas_kernels.quantize import get_default as _quantize_default
from pallas_kernels.quantize.kernel import quantize_pallas

__all__ = ["kernel_configs", "kernel_supports", "quantized_gemm_pallas"]


def _spec_unsupported(spec: QuantSpec | None, name: str) -> str | None:
    """Why the kernels cannot take operand spec ``spec`` (None if they can)."""
    if spec is None:
        return None
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{name} must be a lowbit.gemm.recipes.QuantSpec or None, got {spec!r}")
    if spec.granularity != "block":
        return (
            f"{name}: granularity={spec.granularity!r} ({spec.format} with one scale per "
            f"{spec.granularity}) has no block-scaled kernel"
        )
    if spec.scale_std is not None:
        return (
            f"{name}: scale_std={spec.scale_std} (QuEST's per-block scale from the block's "
            "spread runs in the emulation)"
        )
    if spec.amax is not None:
        return (
            f"{name}: a static (calibrated) amax={spec.amax} (the kernels take each call's "
            "own amax)"
        )
    if spec.rounding == "eden":
        return f"{name}: rounding='eden' (MS-EDEN's corrected scales run in the emulation)"
    if spec.pow2_tensor_scale:
        return f"{name}: pow2_tensor_scale (a power-of-two tensor scale runs in the emulation)"
    if spec.tensor_block is not None:
        return (
            f"{name}: tensor_block={spec.tensor_block} (the kernels take one tensor scale per "
            "operand, not double-block scales)"
        )
    fmt = _formats.get(spec.format)
    if (why := format_unsupported(fmt)) is not None:
        return f"{name}: {why}"
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
    return None


def kernel_supports(spec_a: QuantSpec | None, spec_b: QuantSpec | None) -> tuple[bool, str]:
    """Whether the Pallas path can compute a GEMM with these operand specs, and why not.

    Returns ``(True, "")`` or ``(False, reason)``. Unsupported: per-tensor FP8
    (``granularity="tensor"``), 2-D ``block_shape`` tiles, a 1-D block other than the
    format's own, a static ``amax`` (calibrated, post-training quantization), and two
    high-precision (None) operands (no quantized operand at all).
    Supported with every rounding, scale mode, ``prescale``, ``clip_rms`` and Hadamard
    transform.
    """
    for spec, name in ((spec_a, "spec_a"), (spec_b, "spec_b")):
        reason = _spec_unsupported(spec, name)
        if reason is not None:
            return False, reason
    if spec_a is None and spec_b is None:
        return False, "both operands are high precision (None): a plain float32 dot"
    return True, ""


def _fuses_hadamard(spec: QuantSpec, hadamard) -> bool:
    """Whether the quantize kernel applies the GEMM's Hadamard transform itself (not after an
    RMS clip, which reads the transformed operand in XLA)."""
    return hadamard is not None and spec.clip_rms is None


def kernel_configs(m: int, k: int, n: int, spec_a: QuantSpec | None,
                   spec_b: QuantSpec | None, hadamard: int | None = None) -> dict:
    """The blocks each kernel of the GEMM ``a [m, k] @ b [k, n]`` runs with: ``"a"`` and
    ``"b"`` the quantize kernels' (absent for a high-precision operand), ``"matmul"`` the
    matmul's. What :func:`quantized_gemm_pallas` launches, so that a report of the kernels
    (``make gpu-aot``) can name them."""
    out = {}
    for name, spec, shape, axis in (("a", spec_a, (m, k), 1), ("b", spec_b, (k, n), 0)):
        if spec is not None:
            h = hadamard if _fuses_hadamard(spec, hadamard) else None
            out[name] = _quantize_default(shape, _formats.get(spec.format), axis, h)
    blocks = tuple(_formats.get(s.format).block_size for s in (spec_a, spec_b) if s is not None)
    out["matmul"] = _matmul_default(
        m, n, k, block_sizes=blocks, high_precision_f32=spec_a is None or spec_b is None
    )
    return out


def _kernel_operand(x, spec: QuantSpec | None, axis: int, key, interpret: bool, hadamard,
                    signs, config):
    """A QArray quantized along ``axis`` by the Pallas kernel with blocks ``config`` (the
    Hadamard transform fused where it can be), or ``x`` (None spec, transformed in XLA)."""
    if spec is None:
        return x if hadamard is None else hadamard_along(x, axis, hadamard, signs)
    if hadamard is not None and not _fuses_hadamard(spec, hadamard):
        x = hadamard_along(x, axis, hadamard, signs)
        hadamard = signs = None
    x = clip_to_rms(x, spec, axis)
    plan = spec_plan(spec, x.shape, axis, key)
    return quantize_pallas(
        x,
        plan,
        key if plan.stochastic else None,
        config=config,
        interpret=interpret,
        hadamard=hadamard,
        signs=signs,
    )


def quantized_gemm_pallas(a, b, key_a, key_b, *, spec_a, spec_b, hadamard=None, signs=None,
                          interpret: bool = False) -> jax.Array:
    """The kernel path for specs :func:`kernel_supports` accepts (checked by the caller)."""
    (m, k), n = a.shape, b.shape[1]
    configs = kernel_configs(m, k, n, spec_a, spec_b, hadamard)
    qa = _kernel_operand(a, spec_a, 1, key_a, interpret, hadamard, signs, configs.get("a"))
    qb = _kernel_operand(b, spec_b, 0, key_b, interpret, hadamard, signs, configs.get("b"))
    c = matmul_pallas(qa, qb, config=configs["matmul"], out_dtype=jnp.float32,
                      interpret=interpret)
    for spec in (spec_a, spec_b):  # the codes hold prescaled elements: undo each once
        if spec is not None and spec.prescale != 1.0:
            c = undo_prescale(c, spec.prescale)
    return c
