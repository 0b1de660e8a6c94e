"""The Mosaic GPU path of one quantized GEMM: Blackwell's block-scaled ``tcgen05.mma`` or
Hopper's FP8 ``wgmma``, chosen by the compute capability of the GPU being compiled for.

``quantized_gemm`` (``implementation="pallas"``) takes this path in its CUDA branch when
:func:`family` names a kernel for the target and :func:`mosaic_supports` accepts the specs;
otherwise the Triton kernels (:mod:`.kernel`) run as before. The table
(``lowbit.gemm.implementation``):

=================================  =====================================  =====================
compute capability of the target   kernel                                  formats (both sides)
=================================  =====================================  =====================
10.x (B200, GB200, B300: sm_100a)  ``pallas_kernels.blackwell_matmul``    MXFP8 (E4M3, E5M2),
                                                                           MXFP4, NVFP4
9.0 (H100, H200, GH200: sm_90a)    ``pallas_kernels.hopper_matmul``       every MX format,
                                                                           NVFP4
other, or none known               Triton (``.kernel``)                   all the kernels take
=================================  =====================================  =====================

The compute capability is the one Mosaic GPU itself compiles for
(:func:`lowbit.gemm.implementation.gpu_arch`): the device of the abstract mesh in effect
(``jax.set_mesh`` of a device-less topology's mesh, or ``jax.sharding.use_abstract_mesh``),
else JAX's default device when it is a GPU.

What runs, per GEMM ``a [M, K] @ b [K, N]``:

1. each operand quantized along K by lowbit's own XLA quantizer
   (``lowbit.gemm.operand.quantize_operand(..., packed=True)``: the same plan, keys and
   rounding as the emulation, the Hadamard transform and RMS clip first), giving ``a``'s
   codes ``[M, K * bits / 8]`` and ``b``'s ``[N, K * bits / 8]`` (a QArray's storage order
   puts the quantized axis last, which is the ``[N, K]`` layout the MMA reads), one scale
   byte per block and NVFP4's tensor scales. XLA fuses this with the kernels' re-layout of
   the scales (``pallas_kernels.mma_scales.to_mma_layout`` on Blackwell). No Triton kernel
   runs on this path;
2. M, N and K zero-padded to the kernel's tiles (zero codes and zero scales add exact zeros);
3. the Mosaic GPU matmul, float32 out, sliced back to ``[M, N]`` and divided by each
   operand's ``prescale``, as the Triton path does.

It takes both-operand GEMMs whose two specs have the same format (the kernels take one
``fmt``); a weight-only GEMM (one side None: W4A16 / W8A16) and a mixed-format pair run the
Triton kernels, which multiply a float32 operand directly. Quantizing the high-precision
activation on the fly to MXFP8 for the block-scaled MMA would change the numerics that the
recipe names (the emulation keeps that operand exact), so it is not done silently.

The values match the emulation as the Triton path does: the same codes and scales, a
float32 accumulation in another order (and NVFP4's tensor scales applied to the sum). Mosaic
GPU has no interpret mode for TMEM, ``tcgen05`` or ``wgmma``: on a CPU the wrapper is tested
with each kernel's XLA ``reference`` in place of the kernel (``matmul=``), and the kernels
themselves by compiling for a device-less B200 / H100
(:func:`pallas_kernels.quantized_gemm.mosaic_report.compile_gemm_report`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lowbit.core.qarray import undo_prescale
from lowbit.gemm.operand import quantize_operand
from lowbit.gemm.recipes import QuantSpec

__all__ = ["FAMILIES", "family", "module", "family_formats", "mosaic_supports", "kernel",
           "kernel_operands",
           "quantized_gemm_mosaic", "tile_multiples", "padded_sizes"]

FAMILIES = {
    "blackwell": ("pallas_kernels.blackwell_matmul", "blackwell_block_scaled_matmul"),
    "hopper": ("pallas_kernels.hopper_matmul", "hopper_block_scaled_matmul"),
}
"""Each Mosaic GPU kernel family: its module and matmul (imported on first use)."""

def module(fam: str):
    """Family ``fam``'s kernel package (imported on first use)."""
    if fam not in FAMILIES:
        raise ValueError(f"fam must be one of {sorted(FAMILIES)}, got {fam!r}")
    return importlib.import_module(FAMILIES[fam][0])


def family_formats(fam: str) -> tuple[str, ...]:
    """The formats family ``fam``'s kernel takes: its format table's names.

    >>> family_formats("blackwell")
    ('mxfp4', 'mxfp8_e4m3', 'mxfp8_e5m2', 'nvfp4')
    """
    return tuple(sorted(module(fam).FORMATS))


def family(arch: tuple[int, int] | None) -> str | None:
    """The Mosaic GPU kernel family for compute capability ``arch`` (None: none).

    ``tcgen05`` is on the data-centre Blackwell parts (10.x: sm_100a, sm_103a), not on
    consumer Blackwell (12.x); Hopper's ``wgmma`` needs sm_90a exactly.

    >>> family((10, 0)), family((9, 0)), family((8, 9)), family(None)
    ('blackwell', 'hopper', None, None)
    """
    if arch is None:
        return None
    if arch[0] == 10:
        return "blackwell"
    if tuple(arch) == (9, 0):
        return "hopper"
    return None


def mosaic_supports(fam: str, spec_a: QuantSpec | None, spec_b: QuantSpec | None
                    ) -> tuple[bool, str]:
    """Whether family ``fam`` takes a GEMM with these specs (already accepted by the
    kernels' :func:`~pallas_kernels.quantized_gemm.kernel.kernel_supports`), and why not.

    >>> mosaic_supports("blackwell", QuantSpec("mxfp4"), QuantSpec("mxfp4"))
    (True, '')
    >>> mosaic_supports("blackwell", QuantSpec("mxfp6_e2m3"), QuantSpec("mxfp6_e2m3"))[1]
    "mxfp6_e2m3: the blackwell kernel takes ('mxfp4', 'mxfp8_e4m3', 'mxfp8_e5m2', 'nvfp4')"
    """
    formats = family_formats(fam)
    if spec_a is None or spec_b is None:
        return False, "a weight-only GEMM (one operand high precision) runs Triton's float32 path"
    if spec_a.format != spec_b.format:
        return False, f"mixed formats {spec_a.format} x {spec_b.format} (one fmt per kernel)"
    if spec_a.format not in formats:
        return False, f"{spec_a.format}: the {fam} kernel takes {formats}"
    return True, ""


def tile_multiples(fam: str, fmt: str) -> tuple[int, int, int]:
    """What M, N and K are padded to a multiple of for family ``fam`` and format ``fmt``:
    the CTA tile of C, and along K the least step the kernel takes (Blackwell: a scale tile's
    4 blocks; Hopper: wgmma's K step of 32, which NVFP4's blocks of 16 are each padded to, two
    of them for FP4, whose packed bytes hold a pair of blocks).

    >>> tile_multiples("blackwell", "nvfp4"), tile_multiples("hopper", "mxfp4")
    ((128, 128, 64), (64, 128, 64))
    """
    block = 16 if fmt == "nvfp4" else 32
    if fam == "blackwell":
        return 128, 128, 4 * block
    return 64, 128, 2 * block if fmt in ("mxfp4", "nvfp4") else block


def padded_sizes(fam: str, fmt: str, m: int, k: int, n: int) -> tuple[int, int, int]:
    """``(M, K, N)`` of a GEMM as family ``fam``'s kernel runs it: each rounded up to its
    :func:`tile_multiples` (a K that is not whole blocks is padded to them on the way).

    >>> padded_sizes("blackwell", "mxfp4", 16, 96, 8192)
    (128, 128, 8192)
    """
    tm, tn, tk = tile_multiples(fam, fmt)
    return tuple(math.ceil(x / t) * t for x, t in ((m, tm), (k, tk), (n, tn)))


def _pad(codes, scales, rows: int, k: int, bits: int, block: int):
    """Codes ``[r, K * bits / 8]`` and scales ``[r, K / block]`` zero-padded to ``rows`` rows
    and ``k`` elements of K."""
    r, nbytes = codes.shape
    codes = jnp.pad(codes, ((0, rows - r), (0, k * bits // 8 - nbytes)))
    scales = jnp.pad(scales, ((0, rows - r), (0, k // block - scales.shape[1])))
    return codes, scales


def kernel(fam: str) -> Callable:
    """Family ``fam``'s matmul (imported on first use)."""
    return getattr(module(fam), FAMILIES[fam][1])


def kernel_operands(a, b, key_a, key_b, *, spec_a: QuantSpec, spec_b: QuantSpec, fam: str,
                    hadamard=None, signs=None) -> dict:
    """The keyword arguments of family ``fam``'s matmul for ``a [M, K] @ b [K, N]``: both
    operands quantized along K as the emulation quantizes them, codes and scales zero-padded
    to the kernel's tiles (:func:`tile_multiples`), NVFP4's tensor scales, ``fmt``."""
    qa = quantize_operand(a, spec_a, 1, 0, key_a, packed=True, hadamard=hadamard, signs=signs)
    qb = quantize_operand(b, spec_b, 0, 1, key_b, packed=True, hadamard=hadamard, signs=signs)
    fmt = spec_a.format
    bits, block = qa.format.elem.bits, qa.block_shape[0]
    mp, kp, np_ = padded_sizes(fam, fmt, a.shape[0], a.shape[1], b.shape[1])
    a_codes, a_scales = _pad(qa.codes, qa.scales, mp, kp, bits, block)
    b_codes, b_scales = _pad(qb.codes, qb.scales, np_, kp, bits, block)
    return dict(a_codes=a_codes, a_scales=a_scales, b_codes=b_codes, b_scales=b_scales, fmt=fmt,
                a_tensor_scale=qa.tensor_scale, b_tensor_scale=qb.tensor_scale)


def quantized_gemm_mosaic(a, b, key_a, key_b, *, spec_a: QuantSpec, spec_b: QuantSpec,
                          fam: str, hadamard=None, signs=None,
                          matmul: Callable | None = None) -> jax.Array:
    """float32 ``[M, N]``: the GEMM on family ``fam``'s kernel (specs accepted by
    :func:`mosaic_supports`, checked by the caller). ``matmul``: a function with the kernel's
    signature in its place (the kernel's ``reference`` on a CPU)."""
    kw = kernel_operands(a, b, key_a, key_b, spec_a=spec_a, spec_b=spec_b, fam=fam,
                         hadamard=hadamard, signs=signs)
    matmul = kernel(fam) if matmul is None else matmul
    c = matmul(**kw, out_dtype=jnp.float32)[: a.shape[0], : b.shape[1]]
    for spec in (spec_a, spec_b):  # the codes hold prescaled elements: undo each once
        if spec.prescale != 1.0:
            c = undo_prescale(c, spec.prescale)
    return c
