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

On CUDA, which kernels ``gemm="pallas"`` runs depends on the GPU the computation is compiled
for (:func:`gpu_arch`: the device of the abstract mesh in effect, as Mosaic GPU reads it, else
JAX's default device) and on :attr:`Implementation.gpu_kernels`:

=============================  ==============================================================
compute capability             ``gpu_kernels="auto"`` (default)
=============================  ==============================================================
10.x (B200, GB200, B300)       Mosaic GPU on ``tcgen05.mma`` with block scales
                               (``pallas_kernels.blackwell_matmul``): MXFP8, MXFP4, NVFP4
9.0 (H100, H200, GH200)        Mosaic GPU on FP8 ``wgmma`` (``pallas_kernels.hopper_matmul``):
                               every MX format and NVFP4
other, or none known           the Pallas Triton kernels
=============================  ==============================================================

A GEMM the Mosaic kernels do not take (weight-only, mixed formats, MXFP6 on Blackwell) runs
the Triton kernels; ``gpu_kernels="triton"`` runs Triton everywhere (jax deprecates that
backend from 0.12 on), ``"mosaic"`` asks for Mosaic GPU and warns where it falls back
(``pallas_kernels.quantized_gemm.mosaic`` has the details).

``cpu_kernel`` allows the compiled CPU kernel (:mod:`lowbit.core.native`) to run the
emulation's quantizers; whether it does is ``lowbit.core.native``'s process policy
(``LOWBIT_NATIVE=auto|on|off``, ``lb.native.mode``), read when the quantizer is traced.

>>> from lowbit.gemm.implementation import resolve
>>> resolve("xla").gemm, resolve("xla").cpu_kernel, resolve("pallas").gpu_kernels
('xla', False, 'auto')
>>> resolve(None, backend="cpu").label, resolve(None, backend="gpu").label
('emulation', 'pallas')
>>> resolve(resolve("pallas")) == resolve("pallas")
True
"""

from __future__ import annotations

import dataclasses
import importlib

import jax

__all__ = ["IMPLEMENTATIONS", "GPU_KERNELS", "KERNELS", "Implementation", "resolve", "validate",
           "kernel", "gpu_arch"]

IMPLEMENTATIONS = (None, "xla", "pallas")
"""The values of every ``implementation=`` argument, from the GEMM up to the experiment configs."""

GPU_KERNELS = ("auto", "mosaic", "triton")
"""The values of :attr:`Implementation.gpu_kernels` (module docstring)."""

# Compute capability by device kind, for an abstract device (jax.sharding.AbstractDevice
# carries its kind only): NVIDIA's published numbers, as jax's Pallas Triton gpu_info has them.
_ARCH_BY_KIND = (("GB300", (10, 3)), ("B300", (10, 3)), ("GB200", (10, 0)), ("B200", (10, 0)),
                 ("GH200", (9, 0)), ("H200", (9, 0)), ("H100", (9, 0)), ("H800", (9, 0)),
                 ("H20", (9, 0)))

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
      gpu_kernels: which GPU kernels ``gemm="pallas"`` lowers on CUDA, one of
        :data:`GPU_KERNELS`: ``"auto"`` (Mosaic GPU where the target's compute capability has
        one for the GEMM, else Triton), ``"mosaic"`` (the same, warning where it falls back)
        or ``"triton"``.
    """

    requested: str | None
    gemm: str
    cpu_kernel: bool
    interpret: bool = False
    gpu_kernels: str = "auto"

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
    gpu_kernels: str = "auto",
) -> Implementation:
    """The :class:`Implementation` that ``implementation`` asks for on ``backend`` (default:
    JAX's default backend); an :class:`Implementation` comes back unchanged. ``name`` is
    the argument's name in the error for a value outside :data:`IMPLEMENTATIONS`.
    ``interpret=True`` (with ``"pallas"`` only): the kernels in Pallas interpret mode on any
    platform, for tests on a CPU. ``gpu_kernels``: :attr:`Implementation.gpu_kernels`.

    >>> resolve("pallas", interpret=True).interpret
    True
    """
    if isinstance(implementation, Implementation):
        return implementation
    if gpu_kernels not in GPU_KERNELS:
        raise ValueError(f"gpu_kernels must be one of {GPU_KERNELS}, got {gpu_kernels!r}")
    if validate(implementation, name) != "pallas" and interpret:
        raise ValueError(
            f"interpret=True runs the Pallas kernels in interpret mode: it needs "
            f"{name}='pallas', got {implementation!r}"
        )
    if implementation == "xla":
        return Implementation("xla", "xla", cpu_kernel=False)
    if implementation == "pallas":
        return Implementation("pallas", "pallas", cpu_kernel=True, interpret=bool(interpret),
                              gpu_kernels=gpu_kernels)
    backend = jax.default_backend() if backend is None else backend
    return Implementation(None, "pallas" if backend == "gpu" else "xla", cpu_kernel=True,
                          gpu_kernels=gpu_kernels)


def gpu_arch() -> tuple[int, int] | None:
    """The compute capability of the GPU a computation traced now is compiled for, or None.

    As Mosaic GPU reads it: the device of the abstract mesh in effect (``jax.set_mesh`` of a
    mesh, a device-less topology's included, or ``jax.sharding.use_abstract_mesh``), else
    JAX's default device. A device with a ``compute_capability`` gives it; an abstract device
    (its kind only) gives the kind's (H100 / H200 / GH200: 9.0, B200 / GB200: 10.0, B300 /
    GB300: 10.3); a CPU or an unknown kind gives None.

    >>> gpu_arch() is None  # on a CPU, with no mesh set
    True
    >>> from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    >>> b200 = AbstractDevice(device_kind="NVIDIA B200", num_cores=148, platform="gpu")
    >>> with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=b200)):
    ...     gpu_arch()
    (10, 0)
    """
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        device = jax.devices()[0]
    if getattr(device, "platform", None) not in ("gpu", "cuda"):
        return None
    cc = getattr(device, "compute_capability", None)
    if isinstance(cc, str) and cc.replace(".", "").isdigit() and "." in cc:
        major, minor = cc.split(".")
        return int(major), int(minor)
    kind = getattr(device, "device_kind", "")
    return next((arch for name, arch in _ARCH_BY_KIND if name in kind), None)


def kernel(gemm: str):
    """The GEMM op of :data:`KERNELS` named ``gemm`` (imported on first use)."""
    module, attr = KERNELS[gemm]
    return getattr(importlib.import_module(module), attr)
