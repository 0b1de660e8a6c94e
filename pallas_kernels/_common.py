"""Shared plumbing of the Pallas kernels: implementation choice, CUDA export, timing.

Every op folder (``quantize/``, ``block_scaled_matmul/``) has an ``api.py`` that picks the
implementation with :func:`select_implementation`: ``"xla"`` (the reference, runs everywhere),
``"pallas"`` (the Triton kernel; on a machine without a GPU only with ``interpret=True``), or
``None`` (the kernel on a GPU, the reference elsewhere). A request the kernel cannot serve
(no GPU, an unsupported layout) falls back to the reference with a warning that says why.

:func:`export_for_cuda` lowers a function for CUDA through ``jax.export`` on any machine,
CPU-only ones included: this runs the whole Pallas -> Triton-IR lowering, which is where
non-power-of-two blocks, gathers and value slices are rejected. The Triton custom call has no
serialization-compatibility guarantee, so that one check (and only that one) is disabled.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import jax

from lowbit.gemm.implementation import resolve

__all__ = [
    "TRITON_CUSTOM_CALL_TARGETS",
    "MOSAIC_CUSTOM_CALL_TARGETS",
    "TRITON_EXPORT_DEVICE",
    "abstract_gpu_mesh",
    "export_for_cuda",
    "on_gpu",
    "select_implementation",
    "format_unsupported",
    "is_pow2",
    "next_pow2",
    "pow2_divisor",
    "round_up",
    "time_fn",
]

# The custom-call target of a Pallas Triton kernel: "__gpu$xla.gpu.triton" on jax 0.10 and
# later; "triton_kernel_call" on older releases. Disabling a check for a target that does not
# occur is harmless, so both are listed.
TRITON_CUSTOM_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")
# The custom-call target of a Pallas Mosaic GPU kernel.
MOSAIC_CUSTOM_CALL_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu")


def format_unsupported(fmt) -> str | None:
    """Why the kernels cannot decode block format ``fmt`` (None if they can): they take the
    MX formats and NVFP4; INT4 and ternary run in the XLA emulation."""
    if fmt.is_mx or fmt.is_nvfp4:
        return None
    return f"{fmt.name} (the kernels decode the MX formats and NVFP4; {fmt.name} runs in XLA)"


def on_gpu() -> bool:
    """True when JAX's default backend is a GPU."""
    return jax.default_backend() == "gpu"


def select_implementation(
    op: str, implementation: str | None, interpret: bool, unsupported: str | None
) -> str:
    """``"xla"`` or ``"pallas"`` for a call of ``op`` (``implementation``: a value of
    ``lowbit.gemm.implementation.IMPLEMENTATIONS`` or a resolved ``Implementation``).

    ``unsupported`` is None when the kernel can serve the call, else the reason it cannot.
    An explicit ``"pallas"`` that cannot run warns and falls back to ``"xla"``.
    """
    impl = resolve(implementation)
    if impl.requested == "xla":
        return "xla"
    if unsupported is None and not (interpret or on_gpu()):
        unsupported = (
            f"the Pallas Triton kernel needs a GPU (default backend: {jax.default_backend()}); "
            "pass interpret=True to run it in interpret mode"
        )
    if unsupported is None:
        return "pallas"
    if impl.warns:
        warnings.warn(f"{op}: falling back to the XLA reference: {unsupported}", stacklevel=3)
    return "xla"


# The GPU that export_for_cuda lowers for unless told: an Ada L40 (sm_89, FP8 tensor cores,
# neither wgmma nor tcgen05), where lowbit's GEMMs lower the Triton kernels.
TRITON_EXPORT_DEVICE = "NVIDIA L40"


def abstract_gpu_mesh(device_kind: str):
    """A one-device ``jax.sharding.AbstractMesh`` (axis ``"x"``) of an abstract GPU of
    ``device_kind`` (e.g. ``"NVIDIA H100 80GB HBM3"``): enter it with
    ``jax.sharding.use_abstract_mesh`` to trace and lower for that GPU without one. jax 0.11
    and later need it to lower a Pallas Triton kernel on a machine with no GPU; Mosaic GPU and
    ``lowbit.gemm.implementation.gpu_arch`` read the GPU's compute capability from it."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                         platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)


def export_for_cuda(fn: Callable, *arg_specs, verify: bool = True,
                    device_kind: str = TRITON_EXPORT_DEVICE) -> jax.export.Exported:
    """``jax.export`` of ``fn`` for CUDA (works on a CPU-only machine).

    Traced and lowered under :func:`abstract_gpu_mesh` of ``device_kind``: the GPU it is
    exported for, which picks the kernels of ``lowbit.dot_general(..., implementation=
    "pallas")`` (``lowbit.gemm.implementation``): the default (:data:`TRITON_EXPORT_DEVICE`)
    lowers the Triton kernels; an H100 or B200 kind lowers the Mosaic GPU matmuls where they
    take the GEMM. (jax 0.10's Triton lowering compiles for compute capability 9.0 whatever the
    device; jax 0.11 and later for the device's.)

    Only the serialization checks of the Triton and Mosaic GPU custom calls are disabled;
    every other check (and the full Pallas lowering) runs. With ``verify``, each Triton module
    is also run through the MLIR verifier (jax 0.10 does not: it ships the module unverified
    to XLA, so a power-of-two size or type error would otherwise surface only when a GPU
    compiles it). Verification hooks a jax internal; where that internal is absent it is
    skipped.
    """
    checks = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in TRITON_CUSTOM_CALL_TARGETS + MOSAIC_CUSTOM_CALL_TARGETS]
    export = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)
    with _verifying_triton_modules(verify), \
            jax.sharding.use_abstract_mesh(abstract_gpu_mesh(device_kind)):
        return export(*arg_specs)


@contextlib.contextmanager
def _verifying_triton_modules(enabled: bool):
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg

        lowering = reg.lowering
        original = lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        enabled = False
    if not enabled:
        yield
        return

    def lower_and_verify(*args, **kwargs):
        result = original(*args, **kwargs)
        if not result.module.operation.verify():  # raises MLIRError with diagnostics
            raise RuntimeError("the Triton module failed MLIR verification")
        return result

    lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n (n > 0)."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def time_fn(
    fn: Callable, args: Sequence, *, batches: int = 5, calls: int = 10, warmup: int = 2
) -> float:
    """Seconds per call of ``fn(*args)``: the median over ``batches`` of ``calls`` back-to-back
    asynchronous calls awaited once (so dispatch overlaps the device work, as in a real step).
    ``fn`` should be jitted; the warm-up calls compile it."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)
