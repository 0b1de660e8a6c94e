"""What the Pallas Mosaic GPU block-scaled matmuls share: checks, reference, device-less compile.

:mod:`pallas_kernels.blackwell_matmul` (``tcgen05.mma``, sm_100) and
:mod:`pallas_kernels.hopper_matmul` (FP8 ``wgmma``, sm_90a) take the same operands, as lowbit
stores ``x [M, K]`` and a weight ``[N, K]`` quantized along K: packed uint8 codes
``[rows, K * bits / 8]``, one scale byte per block ``[rows, K / block]`` and, for NVFP4, the
float32 tensor scales. Here, once for both:

- the argument checks (:func:`check_operands`, :func:`check_out_dtype`), each error naming its
  argument, and the XLA reference both kernels are checked against (:func:`reference_matmul`);
- the blocks a call runs with (:func:`tiles`) and the launch, one CTA per tile of C
  (:func:`tile_kernel`);
- the device-less compile (:func:`compile_matmul`: :func:`compile_with_dump`,
  :func:`kernel_stats`): Mosaic GPU compiles its kernels itself, inside XLA's compile, so
  their PTX and ``ptxas -v`` log come from Mosaic GPU's own dump (:func:`mosaic_dump`), not
  from XLA's. One target per process (see :func:`compile_with_dump`).

A kernel describes its formats with a record of its own (``MmaFormat``, ``WgmmaFormat``); what
this module reads of one is :class:`BlockFormat`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import itertools
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from lowbit.core.qarray import QArray, dequantize
from pallas_kernels import aot

__all__ = [
    "OUT_DTYPES",
    "MOSAIC_DUMP_ENV",
    "BlockFormat",
    "Operands",
    "MosaicBuild",
    "check_out_dtype",
    "check_operand",
    "check_tensor_scale",
    "check_operands",
    "as_qarray",
    "reference_matmul",
    "override",
    "tiles",
    "operand_shapes",
    "positional_matmul",
    "mosaic_dump",
    "compile_with_dump",
    "kernel_stats",
    "compile_tagged",
    "compile_matmul",
    "kernel_name_suffix",
    "tile_kernel",
    "load",
]

OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MOSAIC_DUMP_ENV = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS")


class BlockFormat(Protocol):
    """What this module reads of a kernel's format record: lowbit's format ``name``, the
    code ``bits``, the ``block`` size along K and whether a float32 tensor scale comes along
    (``tensor_scaled``, NVFP4)."""

    name: str
    bits: int
    block: int
    tensor_scaled: bool


# --------------------------------------------------------------------------------------------
# Argument checks and the reference


def check_out_dtype(out_dtype) -> jnp.dtype:
    """``out_dtype`` as a dtype; ValueError unless float32, bfloat16 or float16.

    >>> check_out_dtype("bfloat16")
    dtype(bfloat16)
    """
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    return out_dtype


def check_operand(codes, scales, f: BlockFormat, side: str) -> tuple[int, int]:
    """(rows, K) of one operand (``side`` ``"a"`` or ``"b"``, which the errors name):
    ValueError / TypeError naming the argument unless ``codes`` is uint8 ``[rows,
    K * bits / 8]`` and ``scales`` is ``[rows, K / block]`` of a one-byte dtype.

    >>> import types
    >>> f = types.SimpleNamespace(name="mxfp4", bits=4, block=32)
    >>> check_operand(jnp.zeros((8, 64), jnp.uint8), jnp.zeros((8, 4), jnp.uint8), f, "a")
    (8, 128)
    """
    codes_name, scales_name = f"{side}_codes", f"{side}_scales"
    if codes.ndim != 2:
        raise ValueError(f"{codes_name} must be 2-D [rows, K*bits/8], got shape {codes.shape}")
    if codes.dtype != jnp.uint8:
        raise TypeError(f"{codes_name} must be uint8 (packed codes), got {codes.dtype}")
    if scales.ndim != 2:
        raise ValueError(f"{scales_name} must be 2-D [rows, K/block], got shape {scales.shape}")
    if scales.dtype.itemsize != 1:
        raise TypeError(f"{scales_name} must hold one byte per scale, got {scales.dtype}")
    rows, nbytes = codes.shape
    k = nbytes * 8 // f.bits
    if nbytes * 8 % f.bits or k % f.block or scales.shape != (rows, k // f.block):
        raise ValueError(
            f"{scales_name} has shape {scales.shape}; {codes_name} {codes.shape} of {f.name} "
            f"({f.bits}-bit codes, blocks of {f.block}) needs ({rows}, {k // f.block}) and "
            f"K={k} a multiple of {f.block}"
        )
    return rows, k


def check_tensor_scale(ts, f: BlockFormat, name: str) -> jax.Array | None:
    """NVFP4's tensor scale ``ts`` (argument ``name``) as a float32 scalar; None for the
    formats without one. ValueError when it is missing, not a scalar, or given for a format
    that has none."""
    if not f.tensor_scaled:
        if ts is not None:
            raise ValueError(f"{name} is only for NVFP4; {f.name} has none (got {ts!r})")
        return None
    if ts is None:
        raise ValueError(f"{name} is required for {f.name} (the float32 tensor scale)")
    ts = jnp.asarray(ts)
    if ts.size != 1:
        raise ValueError(f"{name} must be a scalar (one tensor scale), got shape {ts.shape}")
    return ts.astype(jnp.float32).reshape(())


class Operands(NamedTuple):
    """Both operands, checked (:func:`check_operands`): codes as arrays, scales as uint8,
    ``A [m, k]`` and ``B [n, k]``, and the float32 tensor scales (None unless NVFP4)."""

    a_codes: jax.Array
    a_scales: jax.Array
    b_codes: jax.Array
    b_scales: jax.Array
    m: int
    n: int
    k: int
    a_tensor_scale: jax.Array | None
    b_tensor_scale: jax.Array | None

    @property
    def tensor_scale(self) -> jax.Array | None:
        """``a_t * b_t`` as a float32 ``(1,)`` array, what the kernels multiply C by in their
        epilogue (None without tensor scales)."""
        if self.a_tensor_scale is None:
            return None
        return (self.a_tensor_scale * self.b_tensor_scale).reshape(1)


def check_operands(a_codes, a_scales, b_codes, b_scales, f: BlockFormat, *,
                   a_tensor_scale=None, b_tensor_scale=None) -> Operands:
    """Check the arguments every kernel and reference takes (:func:`check_operand` for each
    operand, the same K for both, :func:`check_tensor_scale`), errors naming the argument.

    Scales of any one-byte dtype are taken (lowbit's uint8, or ``float8_e8m0fnu`` /
    ``float8_e4m3fn`` holding the same bytes) and bitcast to uint8.

    >>> import types
    >>> f = types.SimpleNamespace(name="nvfp4", bits=4, block=16, tensor_scaled=True)
    >>> codes, scales = jnp.zeros((8, 64), jnp.uint8), jnp.zeros((8, 8), jnp.uint8)
    >>> ops = check_operands(codes, scales, codes, scales, f, a_tensor_scale=2.0,
    ...                      b_tensor_scale=3.0)
    >>> ops.m, ops.n, ops.k, ops.tensor_scale
    (8, 8, 128, Array([6.], dtype=float32))
    """
    a_codes, a_scales = jnp.asarray(a_codes), jnp.asarray(a_scales)
    b_codes, b_scales = jnp.asarray(b_codes), jnp.asarray(b_scales)
    m, k_a = check_operand(a_codes, a_scales, f, "a")
    n, k_b = check_operand(b_codes, b_scales, f, "b")
    if k_a != k_b:
        raise ValueError(
            f"a_codes {a_codes.shape} and b_codes {b_codes.shape} hold different K "
            f"({k_a} and {k_b}): A is [M, K] and B is [N, K], both quantized along K"
        )
    ta = check_tensor_scale(a_tensor_scale, f, "a_tensor_scale")
    tb = check_tensor_scale(b_tensor_scale, f, "b_tensor_scale")

    def u8(s):
        return s if s.dtype == jnp.uint8 else lax.bitcast_convert_type(s, jnp.uint8)

    return Operands(a_codes, u8(a_scales), b_codes, u8(b_scales), m, n, k_a, ta, tb)


def as_qarray(codes, scales, tensor_scale, f: BlockFormat, rows: int, k: int) -> QArray:
    """One operand as the QArray lowbit would have made: ``[rows, k]`` quantized along its
    last axis, uint8 ``codes`` and ``scales``, float32."""
    return QArray(
        codes=codes,
        scales=scales,
        tensor_scale=tensor_scale,
        format_name=f.name,
        shape=(rows, k),
        dtype=jnp.float32,
        axes=(1,),
        block_shape=(f.block,),
    )


def reference_matmul(a_codes, a_scales, b_codes, b_scales, f: BlockFormat, *,
                     a_tensor_scale=None, b_tensor_scale=None,
                     out_dtype=jnp.float32) -> jax.Array:
    """What the kernels compute, in XLA: both operands checked (:func:`check_operands`),
    ``lowbit.core.qarray.dequantize``-d to float32 and multiplied ``A @ B^T`` in IEEE float32
    (``Precision.HIGHEST``), cast to ``out_dtype``. Each kernel's ``reference`` is this on
    its own format table.

    >>> import types
    >>> f = types.SimpleNamespace(name="mxfp8_e4m3", bits=8, block=32, tensor_scaled=False)
    >>> ones = jnp.full((4, 32), 0x38, jnp.uint8)  # E4M3 1.0
    >>> one = jnp.full((4, 1), 127, jnp.uint8)  # E8M0 2^0
    >>> float(reference_matmul(ones, one, ones, one, f)[0, 0])
    32.0
    """
    ops = check_operands(a_codes, a_scales, b_codes, b_scales, f,
                         a_tensor_scale=a_tensor_scale, b_tensor_scale=b_tensor_scale)
    a = dequantize(as_qarray(ops.a_codes, ops.a_scales, ops.a_tensor_scale, f, ops.m, ops.k),
                   jnp.float32)
    b = dequantize(as_qarray(ops.b_codes, ops.b_scales, ops.b_tensor_scale, f, ops.n, ops.k),
                   jnp.float32)
    c = jnp.dot(a, b.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return c.astype(out_dtype)


# --------------------------------------------------------------------------------------------
# Tiles and the kernel launch


def override(config, **fields):
    """The dataclass ``config`` (a kernel's :func:`get_default`) with each of ``fields`` that
    is not None (the caller's choice) put in.

    >>> @dataclasses.dataclass(frozen=True)
    ... class Tiles:
    ...     block_k: int = 128
    ...     num_stages: int = 4
    >>> override(Tiles(), block_k=None, num_stages=2)
    Tiles(block_k=128, num_stages=2)
    """
    return dataclasses.replace(config, **{k: v for k, v in fields.items() if v is not None})


def tiles(default, *, block_m: int, block_n: int, block_k: int | None,
          num_stages: int | None):
    """The blocks a matmul call runs with: the caller's ``block_m`` and ``block_n`` as given
    (the kernel checks them), its ``block_k`` and ``num_stages`` where not None, else
    ``default``'s (the kernel's :func:`get_default` for the shape)."""
    return dataclasses.replace(override(default, block_k=block_k, num_stages=num_stages),
                               block_m=block_m, block_n=block_n)


# The kernel-name suffix of the compile under way (compile_matmul), and a counter for
# new ones.
_REPORTS = itertools.count()
_NAME_SUFFIX: contextvars.ContextVar[str] = contextvars.ContextVar("mosaic_kernel_name_suffix",
                                                                   default="")


def kernel_name_suffix() -> str:
    """What a kernel appends to its name: nothing, except while :func:`compile_matmul`
    compiles it (``_aot<n>``, a suffix no other compile of this process has).

    >>> kernel_name_suffix()
    ''
    """
    return _NAME_SUFFIX.get()


def tile_kernel(body: Callable, *, shape: tuple[int, int], block: tuple[int, int], out_dtype,
                scratch_types, name: str):
    """``plgpu.kernel`` of ``body`` with one CTA per ``block`` tile of the output C of
    ``shape`` (the grid ``(M / bm, N / bn)``, named ``"m"`` and ``"n"``), named ``name``
    followed by :func:`kernel_name_suffix`."""
    (m, n), (bm, bn) = shape, block
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m // bm, n // bn),
        grid_names=("m", "n"),
        scratch_types=scratch_types,
        kernel_name=name + kernel_name_suffix(),
    )


# Whether plgpu.load takes an index (jax 0.10: load(src, idx, *, layout); jax 0.12 dropped
# it: load(src, *, layout), the ref sliced with .at instead).
_LOAD_TAKES_IDX = "idx" in inspect.signature(plgpu.load).parameters


def load(ref, layout):
    """``plgpu.load`` of the whole ``ref`` (slice it with ``.at`` first) in ``layout``, on jax
    0.10 (which takes an index too) through 0.12 (which does not)."""
    if _LOAD_TAKES_IDX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


# --------------------------------------------------------------------------------------------
# Device-less compilation


def operand_shapes(f: BlockFormat, m: int, n: int, k: int) -> list[tuple[tuple, jnp.dtype]]:
    """``(shape, dtype)`` of the arguments of a ``[m, k] x [n, k]`` matmul in format ``f``:
    codes and scales of A, of B, then (NVFP4) the two float32 tensor scales.

    >>> import types
    >>> f = types.SimpleNamespace(bits=4, block=32, tensor_scaled=False)
    >>> [s for s, _ in operand_shapes(f, 128, 256, 64)]
    [(128, 32), (128, 2), (256, 32), (256, 2)]
    """
    codes_k, u8 = k * f.bits // 8, jnp.dtype(jnp.uint8)
    shapes = [((m, codes_k), u8), ((m, k // f.block), u8), ((n, codes_k), u8),
              ((n, k // f.block), u8)]
    return shapes + [((), jnp.dtype(jnp.float32))] * (2 if f.tensor_scaled else 0)


def positional_matmul(matmul: Callable, **kw) -> Callable:
    """``matmul`` as a function of the arguments of :func:`operand_shapes`, in that order
    (the tensor scales last, absent for formats without): what is jitted over them.
    ``kw``: its other keyword arguments (``fmt``, blocks)."""

    def fn(a_codes, a_scales, b_codes, b_scales, *tensor_scales):
        ta, tb = tensor_scales if tensor_scales else (None, None)
        return matmul(a_codes, a_scales, b_codes, b_scales, a_tensor_scale=ta,
                      b_tensor_scale=tb, **kw)

    return fn


@contextlib.contextmanager
def mosaic_dump(directory: str):
    """Make Mosaic GPU write each kernel's PTX and ``ptxas -v`` log to ``directory`` while
    the block runs (the variables :data:`MOSAIC_DUMP_ENV`, restored after)."""
    old = {v: os.environ.get(v) for v in MOSAIC_DUMP_ENV}
    os.environ.update(MOSAIC_GPU_DUMP_TO=directory, MOSAIC_GPU_DUMP_PTX="1",
                      MOSAIC_GPU_DUMP_PTXAS="1")
    try:
        yield
    finally:
        for v, val in old.items():
            if val is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = val


class MosaicBuild(NamedTuple):
    """What :func:`compile_with_dump` read: Mosaic GPU's PTX and ``ptxas -v`` log, the seconds
    to lower and compile, how many kernels XLA launches in all (its fusions included) and how
    many of them are Pallas Triton kernels."""

    ptx: str
    ptxas_log: str
    seconds: float
    xla_kernels: int
    triton_kernels: int = 0


# The target of the first Mosaic GPU compile of this process (see compile_with_dump).
_mosaic_target: str | None = None


def compile_with_dump(fn: Callable, shapes, target: str) -> MosaicBuild:
    """Compile ``fn`` on arguments of ``shapes`` (``(shape, dtype)`` pairs) for the
    device-less ``target`` (``"h100"``, ``"b200"``) and read Mosaic GPU's dump.

    Needs the CUDA plugin (:mod:`pallas_kernels.aot`; RuntimeError without it). Lowers under
    ``jax.set_mesh`` of the target's one-device mesh (Mosaic GPU reads the compute capability
    from the abstract mesh's device; without one it assumes 9.0), with no compilation cache (a
    hit would skip Mosaic GPU's compile and its dump).

    One target per process: jaxlib 0.10.2 sets up Mosaic GPU's ptxas step once, for the
    compute capability of the first Mosaic GPU compile (``registerAssemblyToBinaryPass`` in a
    ``call_once``, ``jaxlib/mosaic/gpu/custom_call.cc``), so an H100 kernel after a B200 one
    fails in ptxas ("cannot be compiled for architecture 'sm_100a'") and the reverse likewise.
    A call for another target than this process's first raises RuntimeError up front.
    """
    global _mosaic_target
    name = getattr(target, "name", target)
    if _mosaic_target not in (None, name):
        raise RuntimeError(
            f"target={name!r}: this process compiled Mosaic GPU kernels for "
            f"{_mosaic_target!r}, and Mosaic GPU runs ptxas for its first target only; "
            "compile for another target in a fresh process"
        )
    with aot.session(target) as t, tempfile.TemporaryDirectory(prefix="lowbit-mosaic-") as d:
        specs = [t.spec(shape, dtype) for shape, dtype in shapes]
        cache = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        start = time.perf_counter()
        try:
            with mosaic_dump(d), jax.set_mesh(t.mesh):
                kernels, _ = t.compile(jax.jit(fn), *specs)
        finally:
            jax.config.update("jax_enable_compilation_cache", cache)
        seconds = time.perf_counter() - start
        _mosaic_target = name
        ptx = "\n".join(p.read_text() for p in sorted(Path(d).rglob("*.ptx")))
        # Mosaic GPU's PTX is ISA 9.0 in jax 0.10.2, newer than the ptxas of
        # nvidia-cuda-nvcc-cu12 12.9 accepts ("Unsupported .version 9.0; current version is
        # '8.8'"), so the log of Mosaic GPU's own ptxas is the one read here.
        log = "\n".join(p.read_text() for p in sorted(Path(d).rglob("*.ptxas")))
    return MosaicBuild(ptx, log, seconds, len(kernels), sum(k.pallas for k in kernels))


def kernel_stats(build: MosaicBuild, tag: str) -> dict:
    """The ptxas numbers of the one kernel of ``build`` whose name holds ``tag``
    (see :func:`compile_matmul`): ``kernel`` (its name), ``registers``, ``spill_stores``,
    ``spill_loads``, ``stack`` (bytes per thread), ``compile_s``, ``ptxas_ms`` (ptxas's own
    compile time) and ``xla_kernels``. RuntimeError unless there is PTX and one such kernel."""
    stats = {name: st for name, st in aot.parse_ptxas(build.ptxas_log).items() if tag in name}
    if len(stats) != 1 or not build.ptx:
        raise RuntimeError(
            f"expected Mosaic GPU's PTX and the ptxas log of one kernel tagged {tag!r}; got "
            f"{len(build.ptx)} characters of PTX and kernels {sorted(stats)} in:\n"
            f"{build.ptxas_log[-2000:]}"
        )
    ((name, st),) = stats.items()
    ptxas_ms = re.findall(r"Compile time = ([\d.]+) ms", build.ptxas_log)
    return dict(
        kernel=name,
        registers=st["registers"],
        spill_stores=st["spill_stores"],
        spill_loads=st["spill_loads"],
        stack=st["stack"],
        compile_s=round(build.seconds, 2),
        ptxas_ms=float(ptxas_ms[-1]) if ptxas_ms else None,
        xla_kernels=build.xla_kernels,
        triton_kernels=build.triton_kernels,
    )


def compile_tagged(fn: Callable, shapes, target: str) -> tuple[MosaicBuild, dict]:
    """Compile ``fn`` (whose Mosaic GPU kernel is named with :func:`kernel_name_suffix`) on
    arguments of ``shapes`` for the device-less ``target``: ``(build, stats)``, Mosaic GPU's
    dump (:func:`compile_with_dump`) and the ptxas numbers of the kernel
    (:func:`kernel_stats`).

    The kernel is named apart from every other compile of this process: Mosaic GPU keeps the
    kernels it compiled and would neither compile nor dump the same one again, and the suffix
    finds this kernel's numbers in the ptxas log.
    """
    tag = f"_aot{next(_REPORTS)}"
    token = _NAME_SUFFIX.set(tag)
    try:
        build = compile_with_dump(fn, shapes, target)
    finally:
        _NAME_SUFFIX.reset(token)
    return build, kernel_stats(build, tag)


def compile_matmul(matmul: Callable, f: BlockFormat, m: int, n: int, k: int, target: str,
                   **kw) -> tuple[MosaicBuild, dict]:
    """Compile a kernel's public ``[m, k] x [n, k]`` matmul in format ``f`` for the
    device-less ``target`` (:func:`compile_tagged`). ``kw``: the matmul's other keyword
    arguments (``out_dtype``, blocks); ``fmt`` is ``f.name``."""
    fn = positional_matmul(matmul, fmt=f.name, **kw)
    return compile_tagged(fn, operand_shapes(f, m, n, k), target)
