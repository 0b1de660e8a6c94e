"""``implementation=``: its values, what each runs, and the one place a request is resolved.

Every op with more than one implementation takes ``implementation=None | "xla" | "pallas"``
(:data:`IMPLEMENTATIONS`), from :func:`lowbit.dot_general` up to the Flax rules and the
experiment configs. The entry point (``lb.dot_general``, ``lb.einsum``,
``lowbit.flax.quantize``, a config's ``quant.implementation``) resolves the request once, with
:func:`resolve`, into a frozen :class:`Implementation`; every layer below takes that value as
given (``resolve`` of an :class:`Implementation` returns it unchanged) and none validates it
again.

=============  ==================  ==========  ============================================
requested      backend             ``gemm``    quantizers (``cpu_kernel``)
=============  ==================  ==========  ============================================
``"xla"``      any                 ``"xla"``   pure XLA ops (False): the reference
``"pallas"``   any                 ``"pallas"``  compiled CPU kernel where it applies (True)
None           ``"gpu"``           ``"pallas"``  (True; never used off CPU)
None           ``"cpu"``, others   ``"xla"``   compiled CPU kernel where it applies (True)
=============  ==================  ==========  ============================================

``gemm="xla"`` is the XLA emulation: operands fake-quantized, then ``lax.dot_general`` with
float32 accumulation. ``gemm="pallas"`` sends each GEMM the kernels can take through
:data:`KERNELS` (``pallas_kernels.quantized_gemm``), which lowers the Pallas kernels when the
computation is lowered for CUDA and the emulation elsewhere: that per-platform branch is part
of what ``"pallas"`` means, not a second decision. A GEMM the kernels cannot take runs the
emulation; when ``"pallas"`` was asked for by name, it says so with a warning that names the
shape or spec and the kernel's constraint (:attr:`Implementation.warns`).

``cpu_kernel`` allows the compiled CPU kernel (:mod:`lowbit.core.native`) to run the
emulation's quantizers; whether it does is ``lowbit.core.native``'s process policy
(``LOWBIT_NATIVE=auto|on|off``, ``lb.native.mode``), read when the quantizer is traced.

>>> from lowbit.gemm.implementation import resolve
>>> resolve("xla")
Implementation(requested='xla', gemm='xla', cpu_kernel=False, interpret=False)
>>> resolve(None, backend="cpu").label, resolve(None, backend="gpu").label
('emulation', 'pallas')
>>> resolve(resolve("pallas")) == resolve("pallas")
True
"""

from __future__ import annotations

import dataclasses
import importlib

import jax

__all__ = ["IMPLEMENTATIONS", "KERNELS", "Implementation", "resolve", "validate", "kernel"]

IMPLEMENTATIONS = (None, "xla", "pallas")
"""The values of every ``implementation=`` argument, from the GEMM up to the experiment configs."""

KERNELS = {
    "pallas": ("pallas_kernels.quantized_gemm", "quantized_gemm"),
    # the grouped GEMM's kernel (lowbit.ragged_dot's forward and input-gradient GEMMs)
    "pallas_grouped": ("pallas_kernels.grouped_matmul.api", "run_kernel"),
}
"""The GEMM implementations outside lowbit, imported on first use: lowbit reaches
``pallas_kernels`` only through this table (``pallas_kernels`` imports lowbit's lower
layers, never the layer that dispatches to it)."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A resolved ``implementation=`` request (make one with :func:`resolve`).

    Attributes:
      requested: the request as the caller made it: None, ``"xla"`` or ``"pallas"``.
      gemm: ``"xla"`` (the XLA emulation) or ``"pallas"`` (the kernels of :data:`KERNELS`
        where they can take the GEMM, the emulation elsewhere).
      cpu_kernel: whether the emulation's quantizers may run on the compiled CPU kernel.
      interpret: with ``gemm="pallas"``, run the kernels in Pallas interpret mode on every
        platform instead of lowering them for CUDA only (testing them on a CPU).
    """

    requested: str | None
    gemm: str
    cpu_kernel: bool
    interpret: bool = False

    @property
    def label(self) -> str:
        """What runs, in a word: ``"xla"``, ``"pallas"`` or ``"emulation"`` (the XLA
        emulation with the compiled CPU kernel for its quantizers where it applies)."""
        if self.requested == "xla":
            return "xla"
        return "pallas" if self.gemm == "pallas" else "emulation"

    @property
    def warns(self) -> bool:
        """Whether a GEMM that falls back from the kernels to the emulation warns: only when
        ``"pallas"`` was asked for by name (None picks the kernels only where it can)."""
        return self.requested == "pallas"


def validate(implementation, name: str = "implementation") -> str | None:
    """``implementation`` unchanged if it is one of :data:`IMPLEMENTATIONS`, else a
    ValueError naming ``name``: for a config that records the request as written (its
    ``config.json``) and resolves it where it enters the library."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{name} must be one of {IMPLEMENTATIONS} (None: the best available for the "
            f"backend), got {implementation!r}"
        )
    return implementation


def resolve(
    implementation: str | None | Implementation = None,
    *,
    backend: str | None = None,
    interpret: bool = False,
    name: str = "implementation",
) -> Implementation:
    """The :class:`Implementation` that ``implementation`` asks for on ``backend`` (default:
    JAX's default backend); an :class:`Implementation` comes back unchanged. ``name`` is
    the argument's name in the error for a value outside :data:`IMPLEMENTATIONS`.
    ``interpret=True`` (with ``"pallas"`` only): the kernels in Pallas interpret mode on any
    platform, for tests on a CPU.

    >>> resolve("pallas", interpret=True).interpret
    True
    """
    if isinstance(implementation, Implementation):
        return implementation
    if validate(implementation, name) != "pallas" and interpret:
        raise ValueError(
            f"interpret=True runs the Pallas kernels in interpret mode: it needs "
            f"{name}='pallas', got {implementation!r}"
        )
    if implementation == "xla":
        return Implementation("xla", "xla", cpu_kernel=False)
    if implementation == "pallas":
        return Implementation("pallas", "pallas", cpu_kernel=True, interpret=bool(interpret))
    backend = jax.default_backend() if backend is None else backend
    return Implementation(None, "pallas" if backend == "gpu" else "xla", cpu_kernel=True)


def kernel(gemm: str):
    """The GEMM op of :data:`KERNELS` named ``gemm`` (imported on first use)."""
    module, attr = KERNELS[gemm]
    return getattr(importlib.import_module(module), attr)
