"""The CPU fast path of ``fake_quantize``: a compiled XLA FFI kernel, one pass per block.

XLA:CPU cannot fuse a reduction into the loop that consumes it, so the XLA emulation reads
every block twice: once for the block maxima, once to scale and round. On a 4096 x 4096
float32 array, against a memory-bound ``x * 2 + 1`` on 2 cores, that costs 1.35-1.45x for MX
formats with nearest rounding and 1.5-1.65x with stochastic rounding or NVFP4; the kernel in
``lowbit/core/_native/fake_quantize_cpu.cc`` reads each block once, while it is in L1: 1.08-1.13x,
1.18-1.29x (``benchmarks/bench_quantize.py``, both paths side by side; a training step of
the ``s`` GPT under MX recipes is 10 % faster, ``bench_step.py``). It computes what the XLA
path computes, bit for bit (``tests/test_native.py`` compares them over every format, scale
mode, rounding, axis, gain and special value), so which path ran never changes a number.

Fused Hadamard transform. Recipes rotate a GEMM operand along its contraction axis right
before quantizing it (``qarray.fake_quantize_with_plan(..., hadamard=b, signs=s)``); on
XLA:CPU the transform costs several memory passes. The kernel applies it to each chunk while
the chunk is in cache, following ``lowbit.core.hadamard``'s butterfly operation for operation, so
its values are those of ``hadamard_transform(x, b, signs=s, method="butterfly")`` then the XLA
quantizer, bit for bit (NVFP4's own tensor amax is that of the transformed tensor: a first
pass transforms and reduces). Measured with ``bench_quantize.py`` (4096 x 4096, two runs of
20 interleaved rounds, medians): MXFP4 with stochastic rounding and gain 3/4, b = 16..64,
1.36-1.40x of ``x * 2 + 1`` along the last axis (the kernel without the transform: 1.36x),
1.48-1.69x along axis 0 (1.26-1.35x), against 3.3-3.9x and 4.1-4.9x for the XLA path's
dense transform then its quantizer; NVFP4 1.42-1.56x and 1.73-2.04x (1.16-1.30x without the
transform), against 2.9-3.2x and 4.0-5.8x. 16 x 16 tiles: NVFP4 1.26-1.32x (XLA path
1.51-1.57x), MXFP8 1.07-1.10x (1.37-1.41x). These rows time kernel calls after kernel calls;
after an XLA-path call (which allocates and frees arrays of x's size) the same calls measured
0.1-0.4x more.

Where it applies: on the CPU backend, 1-D blocks (any axis, any block size) and 2-D tiles
(any two axes, any tile), with a fused Hadamard transform (1-D blocks, b in 16..256 dividing
the axis length), every MX format and NVFP4, nearest and stochastic rounding, NVFP4's
block-scale rules (Four Over Six, ``lowbit.core.scales.four_over_six``, arXiv 2512.02010;
TetraJet-v2's double-block ``tensor_block``, 1-D blocks as the plan allows; MS-EDEN,
``rounding="eden"``, ``lowbit.core.scales.ms_eden``, Quartet II, arXiv 2601.22813), under ``jit``,
``vmap`` (signs batched too) and ``grad`` (the straight-through gradient is defined outside
it); ``clip_gradient=True`` keeps the XLA path. Padding to whole blocks happens inside the
kernel (no pad or slice passes). On GPU and TPU, and when lowering for them (``jax.export(...,
platforms=["cuda"])``), the XLA path is used: the choice is a ``lax.platform_dependent``.

The rules. Four Over Six and MS-EDEN need a block's elements together. The kernel works
on 16 blocks at once, one SIMD lane per block (element k of each block in vector k: rows of
1-D blocks are transposed in registers, the strided walk loads them as they lie), so the
per-block maxima, scales, divisions and choices are vector operations, and each block's
error sums (Four Over Six) or sum(u * u), sum(u * q) (MS-EDEN) are added as whole vectors
in ``lowbit.core.scales.block_sum``'s one order, so the 4-vs-6 choice and the corrected
scales are the XLA path's, bit for bit (tests/test_native_scale_rules.py pins the order on
blocks whose choice it flips). MS-EDEN's tensor scale ``max(s1) / 256`` depends on every
block: the kernel runs two passes, the first writing each element's E2M1 code (one byte: a
quarter of x's size) and each block's corrected scale, the second the values from them (x
is read once; letting XLA do ``ms_eden_scales`` would cost two more full passes).
Measured (4096 x 4096 float32, 2 cores shared with a training run, noisy), in multiples of
``x * 2 + 1``, medians of 20 interleaved rounds, two runs, the bench's rule candidates
alone: Four Over Six 1.49-1.61x along the last axis (MSE 1.51-1.55x, MAE 1.49-1.50x, max
1.57-1.61x) and 1.38-1.48x along axis 0; MS-EDEN 1.54-1.56x and 1.42-1.45x; plain NVFP4
1.42-1.44x and 1.24-1.26x in the same rounds (one block at a time, before: Four Over Six
2.5-3.9x and 2.9-4.3x, MS-EDEN 1.9x and 2.4x). Above issue 25's 1.3x, but within
1.05-1.2x of plain NVFP4, which is itself above it here: Four Over Six shares its
tensor-amax pass (a read of x), MS-EDEN writes and reads the codes instead. In
``bench_quantize.py``'s full table the same rows read 1.04-1.07x / 1.01-1.02x and
1.09-1.11x / 1.02-1.03x (fastest over fastest 1.41-1.50x and 1.33-1.43x), because there its
baseline, timed right after XLA-path calls, measures 34 ms against 24-26 ms alone.
``tensor_block=128``: 0.85-0.95x in that table (1.16-1.26x of mins).

Building. The kernel is compiled once per machine, with the C++ compiler on ``PATH`` (``$CXX``,
else ``c++``/``g++``) against the XLA FFI headers that ship with jaxlib, into
``$LOWBIT_NATIVE_CACHE`` (default ``~/.cache/lowbit/native``), keyed by the source, the
jaxlib version, the compiler and the CPU. ``make`` builds it (:func:`main`);
otherwise the first call that can use it builds it (a few seconds). Without a compiler,
lowbit uses the XLA path and :func:`why_unavailable` says why.

Policy: ``LOWBIT_NATIVE=auto`` (default) uses the kernel when the process computes on CPU
(the default backend) with one CPU device, ``on`` whenever it is available, ``off`` never;
:func:`mode` changes it for a block of code. (``auto`` on a GPU machine neither builds nor
uses it: the GPU lowers the XLA path anyway.)
The ``auto`` rule exists because XLA's SPMD partitioner cannot split a custom call: with
several CPU devices (``--xla_force_host_platform_device_count``) a sharded input would be
gathered onto every device, where the XLA path stays sharded. A module exported for CPU with
the kernel in it needs ``jax.export.DisabledSafetyCheck.custom_call("lowbit_fake_quantize")``
and this module imported where it is loaded; export under ``mode("off")`` to avoid both.

>>> import lowbit as lb
>>> with lb.native.mode("off"):
...     lb.native.active()
False
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.core import hadamard as _hadamard
from lowbit.core.numerics import key_words
from lowbit.core.scales import EDEN_SCALE_OVERRIDE, FOUR_OVER_SIX_METRICS, oas_constant

__all__ = [
    "TARGET",
    "MODES",
    "NativeBuildError",
    "available",
    "plan_attributes",
    "active",
    "build",
    "library_path",
    "main",
    "mode",
    "kernel_format",
    "supports",
    "why_unavailable",
]

TARGET = "lowbit_fake_quantize"
MODES = ("auto", "on", "off")
SOURCE = Path(__file__).resolve().parent / "_native" / "fake_quantize_cpu.cc"
_CXXFLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-fPIC",
    "-shared",
    # Neither changes a value: no errno from math functions (floor), and no assumption that
    # a floating-point operation can trap, which lets GCC vectorise the rounding loops.
    "-fno-math-errno",
    "-fno-trapping-math",
    # No a * b + c contracted into an FMA (GCC contracts in C++ even under -std=c++17): the
    # kernel's arithmetic is the XLA path's, operation for operation.
    "-ffp-contract=off",
    "-w",
)
_KINDS = {"mx_float": 0, "mx_int": 1, "nvfp4": 2}
_SCALE_MODES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3, "oas": 4}
# NVFP4's block-scale rules (the kernel's Rule) and Four Over Six's block errors (its Metric).
_RULES = {"plain": 0, "four_over_six": 1, "double_block": 2, "eden": 3}
_METRICS = {"mse": 0, "mae": 1, "max": 2}

_log = logging.getLogger("lowbit")
_lock = threading.Lock()
_state: dict[str, Any] = {"loaded": False, "error": None}
_mode = os.environ.get("LOWBIT_NATIVE", "auto").strip().lower() or "auto"


class NativeBuildError(RuntimeError):
    """The CPU kernel could not be compiled or loaded (the message holds the compiler's)."""


# --------------------------------------------------------------------------------------------
# Building and loading


def _cache_dir() -> Path:
    if os.environ.get("LOWBIT_NATIVE_CACHE"):
        return Path(os.environ["LOWBIT_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowbit" / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and, on Linux, its CPU flags."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    sig += line
    except OSError:
        sig += platform.processor()
    return sig


@functools.cache
def _build_key(compiler: str) -> str:
    import jaxlib

    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        jaxlib.__version__.encode(),
        repr(version).encode(),
        _cpu_signature().encode(),
        " ".join(_CXXFLAGS).encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def library_path() -> Path | None:
    """Where this machine's build of the kernel lives (None without a compiler)."""
    compiler = _compiler()
    if compiler is None:
        return None
    return _cache_dir() / f"lowbit_cpu_{_build_key(compiler)}.so"


def build(force: bool = False) -> Path:
    """Compile the kernel for this machine (unless already built) and return its path.

    Raises :class:`NativeBuildError` when there is no C++ compiler or compilation fails. The
    library is written to a temporary file and renamed, so concurrent builds are safe.
    """
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError(
            "no C++ compiler found (tried $CXX, c++, g++, clang++): lowbit uses its XLA path"
        )
    out = library_path()
    assert out is not None
    if out.exists() and not force:
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise NativeBuildError(
            f"cannot write the kernel to {out.parent} ({e}); set LOWBIT_NATIVE_CACHE"
        ) from e
    cmd = [compiler, *_CXXFLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    _log.info("lowbit: compiling the CPU fake-quantize kernel: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        raise NativeBuildError(f"could not run {compiler}: {e}") from e
    if proc.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(
            f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}"
        )
    try:
        os.replace(tmp, out)
    except OSError as e:
        raise NativeBuildError(f"cannot write the kernel to {out} ({e})") from e
    return out


def _load() -> bool:
    """Build (if needed), load and register the kernel once per process."""
    with _lock:
        if _state["loaded"] or _state["error"] is not None:
            return _state["loaded"]
        try:
            path = build()
            lib = ctypes.cdll.LoadLibrary(str(path))
            jax.ffi.register_ffi_target(
                TARGET, jax.ffi.pycapsule(lib.LowbitFakeQuantize), platform="cpu"
            )
        except (NativeBuildError, OSError, AttributeError) as e:
            _state["error"] = f"{type(e).__name__}: {e}"
            _log.info("lowbit: CPU kernel unavailable, using the XLA path (%s)", e)
            return False
        _state["loaded"] = True
        _state["lib"] = lib
        return True


def available() -> bool:
    """Whether the kernel is built (building it now if a compiler is there) and loaded."""
    return _load()


def why_unavailable() -> str | None:
    """None when :func:`available`; otherwise the reason (no compiler, a compile error)."""
    return None if _load() else _state["error"]


# --------------------------------------------------------------------------------------------
# Policy


def _check_mode(m: str) -> str:
    m = str(m).strip().lower()
    if m not in MODES:
        raise ValueError(f"lowbit native mode must be one of {MODES}, got {m!r}")
    return m


@contextlib.contextmanager
def mode(m: str):
    """Use the kernel ``"on"`` (whenever available), ``"off"``, or ``"auto"`` (one CPU
    device) inside this block (process-wide, not per thread).

    It applies when a function is traced, and JAX keeps a Python function's trace across
    ``jax.jit`` wrappers: a function traced before keeps its path. Trace a new function (a
    lambda around it) or call ``jax.clear_caches()`` to switch.
    """
    global _mode
    m = _check_mode(m)
    saved = _mode
    _mode = m
    try:
        yield
    finally:
        _mode = saved


def active() -> bool:
    """Whether ``fake_quantize`` traced now would use the kernel on CPU."""
    m = _check_mode(_mode)
    if m == "off":
        return False
    if m == "auto" and (
        jax.default_backend() != "cpu" or len(jax.local_devices(backend="cpu")) != 1
    ):
        return False
    return available()


# --------------------------------------------------------------------------------------------
# The call


def kernel_format(fmt) -> bool:
    """Whether the kernel computes this block format: the MX formats and NVFP4. INT4 and
    ternary run in the XLA path (the kernel's NVFP4 factors divide by E2M1's 6, and it has no
    absmean scale)."""
    return fmt.is_mx or fmt.is_nvfp4


def supports(plan, hadamard: int | None = None) -> bool:
    """Whether the kernel handles this quantization plan (``lowbit.core.plan.Plan``), with a fused
    Hadamard transform of block ``hadamard`` along the plan's axis when that is not None.

    1-D blocks along any axis and 2-D tiles over any two axes; a Hadamard block only with
    1-D blocks, of a size in ``lowbit.core.hadamard.BLOCK_SIZES`` that divides the axis length.
    Stochastic rounding needs fewer than 2**32 (padded) elements.

    >>> from lowbit.core import qarray
    >>> plan = qarray.make_plan((64, 64), "mxfp4", -1, None, None, "nearest", None, None)
    >>> supports(plan), supports(plan, 32), supports(plan, 48)
    (True, True, False)
    """
    if len(plan.axes) not in (1, 2) or len(plan.block_shape) != len(plan.axes):
        return False
    if not kernel_format(plan.fmt):
        return False
    if (plan.scale_mode not in _SCALE_MODES and plan.scale_mode != "nvfp4"
            and plan.scale_mode not in FOUR_OVER_SIX_METRICS):
        return False
    if hadamard is not None:
        if len(plan.axes) != 1 or hadamard not in _hadamard.BLOCK_SIZES:
            return False
        if plan.shape[plan.axes[0]] % hadamard:
            return False
    n = int(np.prod(plan.padded_shape, dtype=np.int64))
    # the random bits (and MS-EDEN's block indices) are uint32 hashes of indices
    return 0 < n and not ((plan.stochastic or plan.eden) and n >= 2**32)


def fake_quantize(
    x: jax.Array, key, tensor_amax, plan, xla_fn, *, hadamard=None, signs=None
) -> jax.Array:
    """``xla_fn(x)`` on every platform but CPU, where the kernel computes the same values.

    ``x`` is the caller's array (any float dtype), ``plan`` a ``lowbit.core.plan.Plan`` for which
    :func:`supports` holds, ``key`` uint32[2] key data (stochastic plans), ``tensor_amax``
    NVFP4's calibrated amax or None. ``hadamard`` (a block size) and ``signs`` (float32
    ``[hadamard]`` of +-1, or None): transform along the plan's axis first, as
    ``lowbit.core.hadamard.hadamard_transform(..., method="butterfly")`` does, bit for bit (an
    NVFP4 tensor amax of its own is then that of the transformed tensor). For an ``x`` other
    than float32 the XLA path rounds the transformed tensor to ``x``'s dtype: so does this
    one, with the butterfly in XLA and the kernel quantizing its result.
    """
    if not supports(plan, hadamard):
        raise ValueError(
            f"the CPU kernel does not support this plan (block_shape {plan.block_shape} over "
            f"axes {plan.axes} of shape {plan.shape}, hadamard={hadamard}): check supports()"
        )
    if hadamard is not None and signs is not None and jnp.shape(signs) != (hadamard,):
        raise ValueError(
            f"signs must have shape (hadamard,) = ({hadamard},), got {jnp.shape(signs)}"
        )
    return jax.lax.platform_dependent(
        x,
        cpu=lambda x: _call(x, key, tensor_amax, plan, hadamard, signs),
        default=xla_fn,
    )


def _geometry(plan) -> dict[str, np.int64]:
    """The kernel's view of ``plan``: x as [P, A, M, C, Q] with tiles (block_a, block_c) over
    (A, C); 1-D blocks have A = M = 1 (see ``_native/fake_quantize_cpu.cc``)."""
    shape = plan.shape
    pad = dict(zip(plan.axes, plan.padded, strict=True))
    blk = dict(zip(plan.axes, plan.block_shape, strict=True))
    if len(plan.axes) == 1:
        (hi,) = plan.axes
        a_len = a_pad = block_a = 1
        outer, mid = math.prod(shape[:hi]), 1
    else:
        lo, hi = sorted(plan.axes)
        a_len, a_pad, block_a = shape[lo], pad[lo], blk[lo]
        outer, mid = math.prod(shape[:lo]), math.prod(shape[lo + 1 : hi])
    dims = {
        "outer": outer,
        "a_len": a_len,
        "a_pad": a_pad,
        "mid": mid,
        "c_len": shape[hi],
        "c_pad": pad[hi],
        "inner": math.prod(shape[hi + 1 :]),
        "block_a": block_a,
        "block_c": blk[hi],
    }
    return {k: np.int64(v) for k, v in dims.items()}


def _rule(plan) -> str:
    """The kernel's NVFP4 block-scale rule for ``plan``: Four Over Six
    (``lowbit.core.scales.four_over_six``), TetraJet-v2's double-block scales
    (``qarray._double_block``), MS-EDEN (``lowbit.core.scales.ms_eden``) or the plain one."""
    if plan.scale_mode in FOUR_OVER_SIX_METRICS:
        return "four_over_six"
    if plan.tensor_block is not None:
        return "double_block"
    return "eden" if plan.eden else "plain"


def plan_attributes(plan) -> dict[str, np.generic]:
    """The kernel's static FFI attributes, all derived from ``plan`` (a ``lowbit.core.plan.Plan``):
    the element grid, the scale rule (NVFP4: plain, Four Over Six with its block error,
    double-block with its outer block, MS-EDEN with its scale constant), the prescale, the
    rounding and the geometry. A new quantizer option of the plan reaches the kernel here and
    nowhere else."""
    fmt, elem = plan.fmt, plan.fmt.elem
    kind = "nvfp4" if fmt.tensor_scale else ("mx_int" if elem.is_int else "mx_float")
    metric = FOUR_OVER_SIX_METRICS.get(plan.scale_mode, "mse")
    # MS-EDEN's 1 / (6 / override) as Quartet II's launchers compute it: 6 / override in
    # float64 (a Python float), rounded to float32, then a float32 reciprocal.
    eden_inv = np.float32(1.0) / np.float32(6.0 / EDEN_SCALE_OVERRIDE)
    return {
        "kind": np.int32(_KINDS[kind]),
        "scale_mode": np.int32(_SCALE_MODES.get(plan.scale_mode, 0)),
        "mbits": np.int32(elem.mbits),
        "emin": np.int32(elem.emin),
        "emax": np.int32(elem.emax),
        "max": np.float32(elem.max),
        "oas_c": np.float32(oas_constant(elem) if fmt.is_mx else 0.0),
        "prescale": np.float32(plan.prescale),
        "stochastic": np.int32(plan.stochastic),
        "rule": np.int32(_RULES[_rule(plan)]),
        "metric": np.int32(_METRICS[metric]),
        "tensor_block": np.int64(plan.tensor_block or 0),
        "eden_inv_fp4_max": np.float32(eden_inv if plan.eden else 0.0),
        **_geometry(plan),
    }


def _call(x, key, tensor_amax, plan, hadamard, signs) -> jax.Array:
    if hadamard is not None and x.dtype != jnp.float32:
        # The XLA path rounds the transformed tensor to x's dtype before quantizing it:
        # transform here, then quantize that.
        x = _hadamard.hadamard_transform(
            x, hadamard, signs=signs, axis=plan.axes[0], method="butterfly"
        )
        hadamard = signs = None
    xf = x.astype(jnp.float32)
    if plan.stochastic or plan.eden:  # MS-EDEN rounds its block scales stochastically
        words = jnp.stack(key_words(key))
    else:
        words = jnp.zeros((2,), jnp.uint32)
    has_tamax = tensor_amax is not None
    tamax = jnp.asarray(tensor_amax if has_tamax else 0.0, jnp.float32).reshape(1)
    has_signs = hadamard is not None and signs is not None
    signs_in = jnp.asarray(signs, jnp.float32) if has_signs else jnp.zeros((1,), jnp.float32)
    scale = np.float32(1.0 / math.sqrt(hadamard)) if hadamard else np.float32(1.0)
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct(xf.shape, jnp.float32), vmap_method="broadcast_all"
    )
    y = call(
        xf,
        words,
        tamax,
        signs_in,
        **plan_attributes(plan),
        has_tensor_amax=np.int32(has_tamax),
        hadamard=np.int32(hadamard or 0),
        has_signs=np.int32(has_signs),
        hadamard_scale=scale,
    )
    return y.astype(x.dtype)


def main(argv: list[str] | None = None) -> int:
    """Build the kernel for this machine and print whether lowbit will use it (``make`` runs
    this). Never fails: without a compiler lowbit runs its XLA path. ``--force`` rebuilds."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        path = build(force="--force" in argv)
    except NativeBuildError as e:
        print(f"lowbit native CPU kernel: not built ({e}); fake_quantize uses its XLA path")
        return 0
    status = "ready" if available() else f"not loadable ({why_unavailable()})"
    print(f"lowbit native CPU kernel: {status}: {path}")
    return 0
