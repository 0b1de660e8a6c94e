"""The Mosaic GPU matmuls in ``python -m pallas_kernels.gpu_check``.

On a GPU (:func:`check_gpu`), for the family the GPU has (Hopper's FP8 ``wgmma`` on an H100 /
H200, Blackwell's block-scaled ``tcgen05.mma`` on a B200), every format it takes, at the
prefill-like and decode-like shapes:

- ``quantized_gemm(..., implementation="pallas")`` as the dispatch runs it (both operands
  quantized in XLA, the Mosaic GPU matmul) against the XLA emulation, to float32
  accumulation tolerance ``(2 K + 8) 2**-24 (|A_q| @ |B_q|)``;
- its time end to end against the same GEMM on the Triton kernels (``gpu_kernels="triton"``),
  and the Mosaic GPU matmul alone (on operands quantized once) against the bf16 ``jnp.dot``
  and against its roofline (``pallas_kernels.roofline``).

The other family is compiled only (``make gpu-aot``), and a GPU with neither (compute
capability other than 9.0 and 10.x) runs none: both are said in the output.

Without a GPU (:func:`check_dry`): each family's wrapper with the kernel's XLA ``reference``
in the kernel's place against the emulation, and the export for an abstract H100 / B200
holding one Mosaic GPU call and no Triton kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowbit.gemm.implementation import gpu_arch, resolve
from lowbit.gemm.recipes import QuantSpec
from pallas_kernels import roofline
from pallas_kernels._common import (
    MOSAIC_CUSTOM_CALL_TARGETS,
    TRITON_CUSTOM_CALL_TARGETS,
    export_for_cuda,
    time_fn,
)
from pallas_kernels.quantized_gemm import quantized_gemm
from pallas_kernels.quantized_gemm.mosaic import (
    FAMILIES,
    family,
    family_formats,
    kernel,
    kernel_operands,
    module,
    quantized_gemm_mosaic,
)
from pallas_kernels.quantized_gemm.reference import accumulation_excess

__all__ = ["check_gpu", "check_dry", "gemm_excess"]

DEVICE_KINDS = {"blackwell": "NVIDIA B200", "hopper": "NVIDIA H100 80GB HBM3"}
ROOFLINES = {"blackwell": (roofline.blackwell_matmul_roofline, roofline.B200),
             "hopper": (roofline.hopper_matmul_roofline, roofline.H200)}


@functools.partial(jax.jit, static_argnames="spec")
def gemm_excess(c, ref, a, b, *, spec: QuantSpec):
    """``accumulation_excess`` of both operands in ``spec`` (nearest rounding): <= 0 passes."""
    return accumulation_excess(c, ref, a, b, spec, spec)


def _gemm(spec, implementation):
    return jax.jit(lambda a, b: quantized_gemm(a, b, spec, spec, implementation=implementation))


def _operands(key, m, k, n):
    ka, kb = jax.random.split(key)
    a = jax.random.normal(ka, (m, k), jnp.float32) * jnp.exp(jax.random.normal(kb, (m, k)))
    b = jax.random.normal(kb, (k, n), jnp.float32)
    return a, b


def check_gpu(run, shapes) -> None:
    """The GPU section (``run``: gpu_check's ``GpuRun``; ``shapes``: ``(M, K, N)`` pairs
    whose bf16 dot ``run.dot_time`` holds)."""
    arch = gpu_arch()
    fam = family(arch)
    print("\n-- Mosaic GPU matmuls (quantized_gemm's dispatch): vs the XLA emulation; time vs "
          "the Triton kernels, the bf16 dot and the roofline")
    for other in sorted(FAMILIES):
        if other != fam:
            print(f"{other}: compiled only (make gpu-aot): this GPU "
                  f"({jax.devices()[0].device_kind}, compute capability {arch}) is not one")
    if fam is None:
        return
    mosaic = resolve("pallas", gpu_kernels="mosaic")
    triton = resolve("pallas", gpu_kernels="triton")
    roof_fn, device = ROOFLINES[fam]
    matmul = jax.jit(kernel(fam), static_argnames=("fmt", "out_dtype"))
    for m, k, n in shapes:
        a, b = _operands(run.key, m, k, n)
        for fmt in family_formats(fam):
            name = f"mosaic {fam} {fmt} MKN={(m, k, n)}"
            if run.over_budget(name):
                continue
            spec = QuantSpec(fmt)
            fm, ft, fe = _gemm(spec, mosaic), _gemm(spec, triton), _gemm(spec, "xla")

            def measure(fm=fm, ft=ft, fe=fe, fmt=fmt, spec=spec, a=a, b=b):
                err = float(gemm_excess(fm(a, b), fe(a, b), a, b, spec=spec))
                operands = lambda a, b: {  # noqa: E731
                    k: v for k, v in kernel_operands(a, b, None, None, spec_a=spec,
                                                     spec_b=spec, fam=fam).items() if k != "fmt"}
                kw = jax.jit(operands)(a, b) | {"fmt": fmt}
                alone = time_fn(lambda: matmul(**kw, out_dtype=jnp.bfloat16), ())
                return err, time_fn(fm, (a, b)), time_fn(ft, (a, b)), alone

            if (got := run.attempt(name, measure)) is None:
                continue
            err, tm, tt, tk = got
            if err > 0:
                run.failures.append(name)
            td = run.dot_time[(m, k, n)]
            roof = roof_fn(m, k, n, fmt, out_itemsize=2, device=device).seconds
            print(f"{name}: {'ok' if err <= 0 else 'OUT OF TOLERANCE'} (excess {err:.1e}) "
                  f"end to end {tm * 1e6:9.1f} us | Triton {tt * 1e6:9.1f} us "
                  f"({tt / tm:5.2f}x) | matmul alone {tk * 1e6:9.1f} us "
                  f"{2 * m * n * k / tk / 1e12:7.1f} TFLOP/s, bf16 dot {td / tk:5.2f}x, "
                  f"{tk / roof:5.2f}x its roofline ({roof * 1e6:.1f} us)")


def check_dry(failures: list, dry_check) -> None:
    """The dry-run section (``dry_check``: gpu_check's ``_dry_check``)."""
    print("\n-- Mosaic GPU matmuls: the wrapper with the kernel's XLA reference (small shape, "
          "vs the emulation); export for an abstract H100 / B200 (one Mosaic GPU call, no "
          "Triton)")
    key = jax.random.key(0)
    for fam in sorted(FAMILIES):
        for fmt in family_formats(fam):

            def check(fam=fam, fmt=fmt):
                spec = QuantSpec(fmt)
                a, b = _operands(key, 40, 96, 72)
                c = quantized_gemm_mosaic(a, b, None, None, spec_a=spec, spec_b=spec, fam=fam,
                                          matmul=module(fam).reference)
                ref = quantized_gemm(a, b, spec, spec, implementation="xla")
                err = float(gemm_excess(c, ref, a, b, spec=spec))
                f32 = jax.ShapeDtypeStruct((256, 512), jnp.float32)
                text = export_for_cuda(
                    lambda x, y: quantized_gemm(x, y, spec, spec, implementation="pallas"),
                    f32, jax.ShapeDtypeStruct((512, 256), jnp.float32),
                    device_kind=DEVICE_KINDS[fam]).mlir_module()
                calls = [sum(text.count(f"@{t}(") for t in ts)
                         for ts in (MOSAIC_CUSTOM_CALL_TARGETS, TRITON_CUSTOM_CALL_TARGETS)]
                ok = err <= 0 and calls == [1, 0]
                return ok, (f": reference in the kernel's place {'ok' if err <= 0 else 'FAILED'}"
                            f" (excess {err:.1e}); export for {DEVICE_KINDS[fam]}: "
                            f"{calls[0]} Mosaic GPU call(s), {calls[1]} Triton")

            dry_check(failures, f"mosaic {fam} {fmt}", check)
