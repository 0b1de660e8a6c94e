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


def export_for_cuda(fn: Callable, *arg_specs, verify: bool = True) -> jax.export.Exported:
    """``jax.export`` of ``fn`` for CUDA (works on a CPU-only machine).

    Only the serialization check of the Triton custom call is disabled; every other check
    (and the full Pallas-to-Triton lowering) runs. With ``verify``, each Triton module is also
    run through the MLIR verifier (jax 0.10 does not: it ships the module unverified to XLA,
    so a power-of-two size or type error would otherwise surface only when a GPU compiles it).
    Verification hooks a jax internal; where that internal is absent it is skipped.
    """
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CUSTOM_CALL_TARGETS]
    export = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)
    with _verifying_triton_modules(verify):
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
