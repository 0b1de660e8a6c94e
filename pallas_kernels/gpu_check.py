"""Compile, check and time every Pallas kernel on a GPU; or, with --dry-run, on a CPU.

    python -m pallas_kernels.gpu_check             # on a GPU: < 5 minutes on an H200
    python -m pallas_kernels.gpu_check --dry-run   # anywhere: CUDA lowering + interpret checks

GPU mode, for each kernel configuration:
- quantize (every format x axis x rounding) of a bf16 operand of the prefill-like GEMM
  (8192 x 8192) and, rounding to nearest along rows, of the decode-like activation (16 x 8192):
  bit-exact against ``lowbit.quantize`` run by XLA on the same GPU, then timed against it and
  against the bf16 ``jnp.dot`` of that GEMM (quantize time / dot time = the overhead it adds);
- quantize with the fused Hadamard transform and prescale of the recipes' backward GEMMs
  (quartet: MXFP4, b = 32, stochastic, prescale 3/4; mxfp4_bwd: b = 64; nvfp4's wgrad: NVFP4,
  b = 16, stochastic; and b = 256), random signs, along both axes: bit-exact against lowbit's
  fixed-order butterfly (``hadamard_transform(..., method="butterfly")``, computed by XLA in
  its own jit) then its quantizer with the prescale, timed against that XLA pair;
- block-scaled matmul (every format with itself, E4M3 x E5M2, weight-only bf16 x MXFP4 /
  MXFP8 / NVFP4) on the prefill-like 8192^3 and decode-like M=16, K=N=8192 GEMMs: checked
  against dequantize + float32 dot (the tolerance of tests/test_pallas_matmul.py), timed
  against ``jnp.dot`` in bf16 on the same shapes: TFLOP/s, GB/s (operand and output bytes
  over time) and the speed-up over the bf16 dot;
- ``quantized_gemm`` end to end, the forward and both backward GEMMs of the recipes
  ``GEMM_RECIPES`` as ``lowbit.dot_general(..., implementation="pallas")`` calls them (dgrad
  ``dy [M, N] @ w^T``, wgrad ``x^T @ dy``, each operand with the GEMM's spec, Hadamard
  transform, random signs and keys), on the 4096^3 GEMM: against the XLA emulation
  (``implementation="xla"``) within ``(2 K + 8) u (|A_q| @ |B_q|)`` (the quantized operands
  are the same, stochastic rounding included; only the order of the float32 sums differs),
  timed against it.
Every timed kernel is also printed as its time over its roofline on an H200
(``pallas_kernels.roofline``: the least bytes it must move and flops it must do, at 4.8 TB/s
and the dense BF16 peak; ``--roofline`` prints the bounds alone). A time budget (--budget-s,
default 270 s) skips what is left once spent, so the whole run stays
under 5 minutes even where compiles are slow; skipped rows are reported as such.

Dry-run mode (CPU): lowers every configuration above for CUDA through jax.export with the
exact blocks the GPU run uses (each Triton module verified), and runs each kernel with those
blocks in interpret mode on a small problem against the reference. Exit status 1 if anything
fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.core import formats
from lowbit.core.hadamard import hadamard_transform, random_signs
from lowbit.core.plan import make_plan
from lowbit.core.qarray import QArray
from lowbit.core.qarray import quantize as lowbit_quantize
from lowbit.gemm import recipes as lowbit_recipes
from pallas_kernels import mosaic_check, roofline
from pallas_kernels._common import export_for_cuda, format_unsupported, on_gpu, time_fn
from pallas_kernels.block_scaled_matmul import Config as MatmulConfig
from pallas_kernels.block_scaled_matmul import block_scaled_matmul
from pallas_kernels.block_scaled_matmul import get_default as matmul_default
from pallas_kernels.block_scaled_matmul.kernel import matmul_pallas
from pallas_kernels.block_scaled_matmul.reference import (
    block_scaled_matmul_reference,
    dequantized,
)
from pallas_kernels.grouped_matmul import check as grouped_check
from pallas_kernels.quantize import Config as QuantizeConfig
from pallas_kernels.quantize import get_default as quantize_default
from pallas_kernels.quantize import quantize
from pallas_kernels.quantize.kernel import quantize_pallas
from pallas_kernels.quantize.reference import quantize_reference
from pallas_kernels.quantized_gemm import kernel_supports, quantized_gemm
from pallas_kernels.quantized_gemm.reference import accumulation_excess

PREFILL = (8192, 8192, 8192)  # M, K, N
DECODE = (16, 8192, 8192)
# the formats the kernels decode (INT4 and ternary run in the XLA emulation)
FORMATS = [f for f in formats.names() if format_unsupported(formats.get(f)) is None]
# (format, rounding, Hadamard block, prescale) of the fused quantize cases (see the docstring)
HADAMARD_CASES = [
    ("mxfp4", "stochastic", 32, 0.75),
    ("mxfp4", "stochastic", 64, 0.75),
    ("nvfp4", "stochastic", 16, 1.0),
    ("mxfp8_e4m3", "nearest", 256, 1.0),
]
GEMM = (4096, 4096, 4096)  # M, K, N of the end-to-end quantized GEMMs
# recipes whose three GEMMs run end to end: MX and NVFP4 FQT, Quartet's backward (random
# Hadamard 32, stochastic rounding, prescale 3/4), Tseng et al.'s (Hadamard 64)
GEMM_RECIPES = ["mxfp8", "mxfp4", "nvfp4", "quartet", "mxfp4_bwd"]
MATMUL_PAIRS = [(f, f) for f in FORMATS] + [
    ("mxfp8_e4m3", "mxfp8_e5m2"),
    (None, "mxfp4"),  # W4A16 (None: a bf16 operand)
    (None, "mxfp8_e4m3"),  # W8A16
    (None, "nvfp4"),
]


@dataclasses.dataclass(frozen=True)
class QuantizeCase:
    fmt: str
    axis: int
    rounding: str
    shape: tuple[int, int]
    gemm: tuple[int, int, int]  # the GEMM whose operand this is (for the dot-time ratio)
    hadamard: int | None = None  # fused Hadamard block (random signs), or None
    prescale: float = 1.0
    scale_mode: str | None = None  # e.g. "4over6" (None: the format's default)
    tensor_block: int | None = None  # TetraJet-v2's double-block scales (NVFP4)

    @property
    def name(self) -> str:
        extra = (
            "" if self.hadamard is None
            else f" hadamard={self.hadamard} prescale={self.prescale}"
        )
        if self.scale_mode is not None:
            extra += f" scale_mode={self.scale_mode}"
        if self.tensor_block is not None:
            extra += f" tensor_block={self.tensor_block}"
        return (
            f"quantize {self.fmt:<10} axis={self.axis:>2} {self.rounding:<10} {self.shape}" + extra
        )

    @property
    def config(self) -> QuantizeConfig:
        return quantize_default(self.shape, self.fmt, self.axis, self.hadamard,
                                self.tensor_block)

    def kwargs(self, key) -> dict:
        """quantize's keyword arguments (signs drawn from ``key``)."""
        kw = dict(rounding=self.rounding, prescale=self.prescale)
        if self.scale_mode is not None:
            kw["scale_mode"] = self.scale_mode
        if self.tensor_block is not None:
            kw["tensor_block"] = self.tensor_block
        if self.hadamard is not None:
            kw.update(hadamard=self.hadamard, signs=random_signs(key, self.hadamard))
        return kw

    def kernel(self, x, key, signs_key, config=None):
        """The quantize kernel on the checked plan of ``x`` (signs drawn from ``signs_key``)."""
        kw = self.kwargs(signs_key)
        plan = make_plan(x.shape, self.fmt, self.axis % 2, None, self.scale_mode, self.rounding,
                         key, None, self.prescale, self.tensor_block)
        return quantize_pallas(x, plan, key, config=config or self.config,
                               hadamard=kw.get("hadamard"), signs=kw.get("signs"))

    def reference(self, x, key):
        """The XLA reference: lowbit's butterfly (its own jit, so XLA cannot fuse it into the
        quantizer), then lowbit's quantizer."""
        kw = self.kwargs(key)
        if self.hadamard is not None:
            x = _butterfly(x, self.hadamard, kw.pop("signs"), self.axis)
            kw.pop("hadamard")
        return quantize_reference(x, self.fmt, self.axis, key=key, **kw)


@dataclasses.dataclass(frozen=True)
class MatmulCase:
    a: str | None
    b: str | None
    mkn: tuple[int, int, int]

    @property
    def name(self) -> str:
        return f"matmul {self.a or 'bf16':<10} x {self.b or 'bf16':<10} MKN={self.mkn}"

    @property
    def config(self) -> MatmulConfig:
        m, k, n = self.mkn
        blocks = tuple(formats.get(f).block_size for f in (self.a, self.b) if f)
        return matmul_default(m, n, k, block_sizes=blocks)


def quantize_cases() -> list[QuantizeCase]:
    cases = [
        QuantizeCase(f, axis, r, PREFILL[:2], PREFILL)
        for f in FORMATS
        for axis in (-1, 0)
        for r in ("nearest", "stochastic")
    ]
    cases += [QuantizeCase(f, -1, "nearest", DECODE[:2], DECODE) for f in FORMATS]
    cases += [
        QuantizeCase(f, axis, r, PREFILL[:2], PREFILL, hadamard=b, prescale=g)
        for f, r, b, g in HADAMARD_CASES
        for axis in (-1, 0)
    ]
    # the 2026 NVFP4 options (issue 25): Four Over Six, TetraJet-v2's double-block scales and
    # MS-EDEN (after its random Hadamard of 128)
    cases += [
        QuantizeCase("nvfp4", axis, r, PREFILL[:2], PREFILL, **kw)
        for axis in (-1, 0)
        for r, kw in (
            ("nearest", {"scale_mode": "4over6"}),
            ("nearest", {"tensor_block": 128}),
            ("stochastic", {"tensor_block": 128, "hadamard": 16}),
            ("eden", {"hadamard": 128}),
        )
    ]
    # (a Hadamard block that does not divide the quantized axis: a small test shape)
    return [c for c in cases if c.hadamard is None or c.shape[c.axis] % c.hadamard == 0]


@functools.partial(jax.jit, static_argnums=(1, 3))
def _butterfly(x, b, signs, axis):
    return hadamard_transform(x, b, signs=signs, axis=axis, method="butterfly")


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """One GEMM of a recipe as ``lowbit.dot_general`` sends it to ``quantized_gemm``."""

    recipe: str
    gemm: str  # "fwd", "dlhs", "drhs"
    mkn: tuple[int, int, int]  # of this GEMM: a [M, K] @ b [K, N]

    @property
    def spec(self):
        return getattr(lowbit_recipes.get(self.recipe), self.gemm)

    @property
    def name(self) -> str:
        return f"quantized_gemm {self.recipe:<10} {self.gemm:<5} MKN={self.mkn}"

    def args(self, key, dtype=jnp.bfloat16):
        """``(a, b, keys, signs)``: operands drawn from ``key``, rounding keys, signs."""
        m, k, n = self.mkn
        a = jax.random.normal(jax.random.fold_in(key, 1), (m, k), dtype)
        b = jax.random.normal(jax.random.fold_in(key, 2), (k, n), dtype)
        keys = tuple(jax.random.key_data(jax.random.fold_in(key, i)) for i in (3, 4))
        g = self.spec
        signs = random_signs(key, g.hadamard) if g.hadamard and g.random_signs else None
        return a, b, keys, signs

    def call(self, implementation, interpret=False):
        g = self.spec

        def f(a, b, keys, signs):
            return quantized_gemm(a, b, g.lhs, g.rhs, *keys, hadamard=g.hadamard or None,
                                  signs=signs, implementation=implementation,
                                  interpret=interpret)

        return f


def gemm_cases() -> list[GemmCase]:
    """Every GEMM of ``GEMM_RECIPES`` that the kernels take (as dot_general lays it out)."""
    m, k, n = GEMM
    shapes = {"fwd": (m, k, n), "dlhs": (m, n, k), "drhs": (k, m, n)}
    out = []
    for r in GEMM_RECIPES:
        for g in ("fwd", "dlhs", "drhs"):
            spec = getattr(lowbit_recipes.get(r), g)
            if kernel_supports(spec.lhs, spec.rhs)[0]:
                out.append(GemmCase(r, g, shapes[g]))
    return out


def quantize_roofline_of(case: QuantizeCase, device=roofline.H200) -> roofline.Roofline:
    """The roofline of a quantize case (its bf16 input, its QArray)."""
    kw = {k: v for k, v in (("scale_mode", case.scale_mode),
                            ("tensor_block", case.tensor_block)) if v is not None}
    return roofline.quantize_roofline(case.shape, case.fmt, case.axis, hadamard=case.hadamard,
                                      device=device, **kw)


def matmul_roofline_of(case: MatmulCase, device=roofline.H200) -> roofline.Roofline:
    """The roofline of a matmul case (bf16 output, as it is timed)."""
    return roofline.matmul_roofline(*case.mkn, case.a, case.b, device=device)


def gemm_roofline_of(case: GemmCase, device=roofline.H200) -> roofline.Roofline:
    """The roofline of an end-to-end GEMM case: its operands' quantize kernels, then the
    matmul to float32."""
    g = case.spec
    fmt = lambda s: None if s is None else s.format  # noqa: E731
    return roofline.gemm_roofline(*case.mkn, fmt(g.lhs), fmt(g.rhs), hadamard=g.hadamard or None,
                                  device=device)


def roofline_table(device=roofline.H200) -> str:
    """The markdown roofline table of every configuration this check runs (``--roofline``)."""
    rows = [
        "| kernel | MB moved | GFLOP | roofline (us) | roof | best speed-up over the bf16 GEMM "
        "(a quantize: the time it adds to it) |",
        "|---|---:|---:|---:|---|---:|",
    ]

    def row(name, r, gemm, quantize=False):
        g = roofline.bf16_gemm_roofline(*gemm, device)
        rel = (f"+{100 * r.seconds / g.seconds:.1f}% of its time" if quantize
               else f"{g.seconds / r.seconds:.2f}x")
        rows.append(f"| {' '.join(name.split())} | {r.bytes / 1e6:,.1f} | {r.flops / 1e9:,.1f} "
                    f"| {r.seconds * 1e6:,.1f} | {r.bound} | {rel} |")

    for c in quantize_cases():
        row(c.name, quantize_roofline_of(c, device), c.gemm, quantize=True)
    for c in matmul_cases():
        row(c.name, matmul_roofline_of(c, device), c.mkn)
    for c in gemm_cases():
        row(c.name, gemm_roofline_of(c, device), c.mkn)
    return "\n".join(rows) + "\n"


MOSAIC_FORMATS = ("mxfp8_e4m3", "mxfp4", "nvfp4")


def mosaic_roofline_table() -> str:
    """The markdown roofline table of the Mosaic GPU matmuls (``pallas_kernels.blackwell_matmul``
    on a B200, ``pallas_kernels.hopper_matmul`` on an H200; compiled device-less, not yet
    timed here), at the prefill and decode shapes, each against the bf16 GEMM on its device."""
    rows = [
        "| kernel | device | MB moved | GFLOP | roofline (us) | roof | best speed-up over the "
        "bf16 GEMM |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    kernels = (("blackwell", roofline.blackwell_matmul_roofline, roofline.B200),
               ("hopper", roofline.hopper_matmul_roofline, roofline.H200))
    for name, fn, device in kernels:
        for mkn in (PREFILL, DECODE):
            for fmt in MOSAIC_FORMATS:
                r = fn(*mkn, fmt, device=device)
                g = roofline.bf16_gemm_roofline(*mkn, device)
                rows.append(f"| {name} {fmt} MKN={mkn} | {device.name} | {r.bytes / 1e6:,.1f} "
                            f"| {r.flops / 1e9:,.1f} | {r.seconds * 1e6:,.1f} | {r.bound} "
                            f"| {g.seconds / r.seconds:.2f}x |")
    return "\n".join(rows) + "\n"


@functools.partial(jax.jit, static_argnames="case")
def _gemm_excess(c, ref, a, b, keys, signs, *, case: GemmCase):
    """max(|C - C_ref| - tol) with tol = (2K + 8) 2**-24 (|A_q| @ |B_q|), ``A_q``, ``B_q``
    the operands as the emulation quantizes them: <= 0 passes."""
    g = case.spec
    return accumulation_excess(c, ref, a, b, g.lhs, g.rhs, *keys, hadamard=g.hadamard or None,
                               signs=signs)


def gemm_close(case: GemmCase, c, ref, a, b, keys, signs) -> tuple[bool, float]:
    """Whether the kernels' ``c`` is the emulation's ``ref`` up to float32 summation order,
    and the largest difference."""
    excess = float(_gemm_excess(c, ref, a, b, keys, signs, case=case))
    return excess <= 0, float(jnp.max(jnp.abs(c - ref)))


def matmul_cases() -> list[MatmulCase]:
    return [MatmulCase(a, b, mkn) for mkn in (PREFILL, DECODE) for a, b in MATMUL_PAIRS]


# --------------------------------------------------------------------------------------------
# Checks


def same_qarray(q: QArray, r: QArray) -> bool:
    ok = q.codes.shape == r.codes.shape and q.scales.shape == r.scales.shape
    ok = ok and bool(jnp.all(q.codes == r.codes)) and bool(jnp.all(q.scales == r.scales))
    if r.tensor_scale is not None:  # a scalar, or one outer scale per outer block
        a, b = np.asarray(q.tensor_scale), np.asarray(r.tensor_scale)
        ok = ok and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    return bool(ok)


@jax.jit
def _excess(c, ref, a, b):
    """max(|C - C_ref| - tol) with tol = (2K + 4) 2**-24 (|A| @ |B|): <= 0 passes."""
    mag = jnp.dot(
        jnp.abs(dequantized(a)), jnp.abs(dequantized(b)), precision=jax.lax.Precision.HIGHEST
    )
    tol = (2 * a.shape[1] + 4) * 2.0**-24 * mag
    return jnp.max(jnp.abs(c.astype(jnp.float32) - ref) - tol)


def matmul_close(c, a, b) -> tuple[bool, float]:
    ref = block_scaled_matmul_reference(a, b)
    excess = float(_excess(c, ref, a, b))
    return excess <= 0, float(jnp.max(jnp.abs(c.astype(jnp.float32) - ref)))


def _operand(x, fmt, axis):
    return x if fmt is None else quantize_reference(x, fmt, axis)


def _nbytes(x) -> int:
    return x.nbytes if isinstance(x, QArray) else x.size * x.dtype.itemsize


# --------------------------------------------------------------------------------------------
# GPU mode


@dataclasses.dataclass
class GpuRun:
    """What the GPU mode's sections share: the key, the time budget, the bf16 dot times and
    the names that failed or were skipped."""

    budget_s: float
    key: jax.Array = dataclasses.field(default_factory=lambda: jax.random.key(0))
    t_start: float = dataclasses.field(default_factory=time.perf_counter)
    dot_time: dict = dataclasses.field(default_factory=dict)
    failures: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)

    def over_budget(self, name) -> bool:
        if time.perf_counter() - self.t_start > self.budget_s:
            self.skipped.append(name)
            print(f"{name}: SKIPPED (time budget of {self.budget_s:.0f} s spent)")
            return True
        return False

    def attempt(self, name, fn):
        """``fn()``, or None after reporting an exception (one broken kernel should not hide
        the others)."""
        try:
            return fn()
        except Exception as e:
            self.failures.append(name)
            print(f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}")
            return None


def _time_dots(run: GpuRun) -> None:
    for m, k, n in (PREFILL, DECODE):
        x = jax.random.normal(run.key, (m, k), jnp.bfloat16)
        w = jax.random.normal(run.key, (k, n), jnp.bfloat16)
        dot = jax.jit(
            lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        )
        t = time_fn(dot, (x, w))
        run.dot_time[(m, k, n)] = t
        print(
            f"jnp.dot bf16 MKN={(m, k, n)}: {t * 1e6:9.1f} us  "
            f"{2 * m * n * k / t / 1e12:7.1f} TFLOP/s  "
            f"{(2 * (m * k + k * n + m * n)) / t / 1e9:7.1f} GB/s"
        )


def _check_quantize(run: GpuRun) -> None:
    print("\n-- quantize: bit-exact vs lowbit.quantize (XLA); time vs XLA and vs the bf16 dot")
    key = run.key
    for case in quantize_cases():
        if run.over_budget(case.name):
            continue
        x = jax.random.normal(jax.random.fold_in(key, 1), case.shape, jnp.bfloat16)
        x = x * jnp.exp(jax.random.normal(key, case.shape, jnp.bfloat16))
        kern = jax.jit(
            lambda x, k, c=case: quantize(
                x, c.fmt, c.axis, key=k, implementation="pallas", **c.kwargs(k)
            )
        )
        ref = lambda x, k, c=case: c.reference(x, k)  # its parts are jitted

        def measure(kern=kern, ref=ref, x=x):
            q, r = kern(x, key), ref(x, key)
            return q, same_qarray(q, r), time_fn(kern, (x, key)), time_fn(ref, (x, key))

        if (got := run.attempt(case.name, measure)) is None:
            continue
        q, exact, tk, tr = got
        if not exact:
            run.failures.append(case.name)
        gbs = (_nbytes(x) + q.nbytes) / tk / 1e9
        roof = quantize_roofline_of(case).seconds
        print(
            f"{case.name}: {'bit-exact' if exact else 'MISMATCH'}  {tk * 1e6:8.1f} us "
            f"{gbs:7.1f} GB/s | XLA {tr * 1e6:8.1f} us ({tr / tk:4.2f}x faster) | "
            f"{tk / run.dot_time[case.gemm]:6.3f} of the bf16 dot | "
            f"{tk / roof:5.2f}x its roofline ({roof * 1e6:.1f} us)"
        )


def _check_matmul(run: GpuRun) -> None:
    print("\n-- block-scaled matmul: vs dequantize + float32 dot; time vs the bf16 jnp.dot")
    for case in matmul_cases():
        if run.over_budget(case.name):
            continue
        m, k, n = case.mkn
        x = jax.random.normal(jax.random.fold_in(run.key, 2), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.fold_in(run.key, 3), (k, n), jnp.bfloat16)
        a, b = _operand(x, case.a, -1), _operand(w, case.b, 0)
        kern = jax.jit(
            lambda a, b: block_scaled_matmul(a, b, out_dtype=jnp.bfloat16, implementation="pallas")
        )
        kern32 = jax.jit(lambda a, b: block_scaled_matmul(a, b, implementation="pallas"))

        def measure(kern=kern, kern32=kern32, a=a, b=b):
            return (*matmul_close(kern32(a, b), a, b), time_fn(kern, (a, b)))

        if (got := run.attempt(case.name, measure)) is None:
            continue
        ok, err, tk = got
        if not ok:
            run.failures.append(case.name)
        td = run.dot_time[case.mkn]
        gbs = (_nbytes(a) + _nbytes(b) + 2 * m * n) / tk / 1e9
        roof = matmul_roofline_of(case).seconds
        print(
            f"{case.name}: {'ok' if ok else 'OUT OF TOLERANCE'} (max err {err:.2e})  "
            f"{tk * 1e6:9.1f} us {2 * m * n * k / tk / 1e12:7.1f} TFLOP/s {gbs:7.1f} GB/s | "
            f"bf16 dot {td * 1e6:9.1f} us | speed-up {td / tk:5.2f}x | "
            f"{tk / roof:5.2f}x its roofline ({roof * 1e6:.1f} us)"
        )


def _check_gemms(run: GpuRun) -> None:
    print("\n-- quantized_gemm end to end (a recipe's GEMMs): vs the XLA emulation, time vs it")
    for case in gemm_cases():
        if run.over_budget(case.name):
            continue
        args = case.args(run.key)
        kern, emul = jax.jit(case.call("pallas")), jax.jit(case.call("xla"))

        def measure(kern=kern, emul=emul, args=args, case=case):
            c, ref = kern(*args), emul(*args)
            return (*gemm_close(case, c, ref, *args), time_fn(kern, args), time_fn(emul, args))

        if (got := run.attempt(case.name, measure)) is None:
            continue
        ok, err, tk, te = got
        if not ok:
            run.failures.append(case.name)
        m, k, n = case.mkn
        roof = gemm_roofline_of(case).seconds
        print(
            f"{case.name}: {'ok' if ok else 'OUT OF TOLERANCE'} (max err {err:.2e})  "
            f"{tk * 1e6:9.1f} us {2 * m * n * k / tk / 1e12:7.1f} TFLOP/s | XLA emulation "
            f"{te * 1e6:9.1f} us ({te / tk:5.2f}x faster) | "
            f"{tk / roof:5.2f}x its roofline ({roof * 1e6:.1f} us)"
        )


def run_gpu(budget_s: float) -> int:
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    run = GpuRun(budget_s)
    _time_dots(run)
    _check_quantize(run)
    _check_matmul(run)
    grouped_check.check_gpu(run)
    _check_gemms(run)
    mosaic_check.check_gpu(run, (PREFILL, DECODE))
    failures, skipped = run.failures, run.skipped
    spent = time.perf_counter() - run.t_start
    print(f"\n{len(failures)} failed, {len(skipped)} skipped, {spent:.0f} s")
    for name in failures:
        print(f"FAILED: {name}")
    return 1 if failures else 0


# --------------------------------------------------------------------------------------------
# Dry-run mode


def _dry_check(failures: list, name: str, check) -> None:
    """Print ``name`` and what ``check()`` says (``(ok, text)``), or the error it raised; a
    failure joins ``failures``."""
    try:
        ok, text = check()
    except Exception as e:
        ok, text = False, f"ERROR {type(e).__name__}: {str(e)[:300]}"
    print(f"{name}{text}")
    if not ok:
        failures.append(name)


def run_dry() -> int:
    t_start = time.perf_counter()
    failures = []
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    print(
        "-- every configuration: CUDA export (GPU shapes, verified Triton modules) and an "
        "interpret-mode check (small shape, same blocks)"
    )
    for case in quantize_cases():
        cfg = case.config

        def check(case=case, cfg=cfg):
            spec = jax.ShapeDtypeStruct(case.shape, jnp.bfloat16)
            export_for_cuda(
                lambda x, k: case.kernel(x, k, key, cfg),
                spec,
                jax.ShapeDtypeStruct((2,), jnp.uint32),
            )
            small = (min(case.shape[0], 2 * cfg.block_rows), min(case.shape[1], 2 * cfg.block_cols))
            x = jnp.asarray(
                rng.standard_normal(small) * np.exp(rng.standard_normal(small)), jnp.bfloat16
            )
            q = quantize(
                x, case.fmt, case.axis, key=key, implementation="pallas", interpret=True,
                config=cfg, **case.kwargs(key),
            )
            ok = same_qarray(q, case.reference(x, key))
            return ok, f" {cfg}: lowers for CUDA; interpret {small}: " + (
                "bit-exact" if ok else "FAILED")

        _dry_check(failures, case.name, check)
    for case in matmul_cases():

        def check(case=case, cfg=case.config):
            m, k, n = case.mkn
            export_for_cuda(
                lambda a, b: matmul_pallas(a, b, config=cfg, out_dtype=jnp.bfloat16),
                operand_spec(case.a, (m, k), -1),
                operand_spec(case.b, (k, n), 0),
            )
            sm, sk, sn = min(m, cfg.block_m), min(k, 2 * cfg.block_k), min(n, 2 * cfg.block_n)
            x = jnp.asarray(rng.standard_normal((sm, sk)), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal((sk, sn)), jnp.bfloat16)
            a, b = _operand(x, case.a, -1), _operand(w, case.b, 0)
            c = block_scaled_matmul(a, b, implementation="pallas", interpret=True, config=cfg)
            ok, err = matmul_close(c, a, b)
            return ok, (f" {cfg}: lowers for CUDA; interpret {(sm, sk, sn)}: "
                        f"{'ok' if ok else 'FAILED'} (max err {err:.1e})")

        _dry_check(failures, case.name, check)
    grouped_check.check_dry(failures, _dry_check)
    for case in gemm_cases():

        def check(case=case):
            m, k, n = case.mkn
            small = GemmCase(case.recipe, case.gemm, (min(m, 64), min(k, 256), min(n, 64)))
            export_for_cuda(case.call("pallas"), *jax.eval_shape(case.args, key))
            args = small.args(key, jnp.float32)
            c = small.call("pallas", interpret=True)(*args)
            ok, err = gemm_close(small, c, small.call("xla")(*args), *args)
            return ok, (f": lowers for CUDA; interpret {small.mkn}: "
                        f"{'ok' if ok else 'FAILED'} (max err {err:.1e})")

        _dry_check(failures, case.name, check)
    mosaic_check.check_dry(failures, _dry_check)
    print(f"\n{len(failures)} failed, {time.perf_counter() - t_start:.0f} s")
    for name in failures:
        print(f"FAILED: {name}")
    return 1 if failures else 0


def operand_spec(fmt, shape, axis):
    """The abstract operand of a matmul case: a bf16 array (``fmt`` None) or the QArray of
    ``fmt`` quantized along ``axis``."""
    if fmt is None:
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    return jax.eval_shape(
        lambda x: lowbit_quantize(x, fmt, axis), jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    )


# --------------------------------------------------------------------------------------------
# Block-size sweep (GPU, opt-in): candidates for the get_default heuristics

SWEEP_MATMUL = {
    PREFILL: [
        MatmulConfig(128, 128, 64, 8, 4, 3),
        MatmulConfig(128, 128, 64, 8, 8, 3),
        MatmulConfig(128, 256, 64, 8, 8, 3),
        MatmulConfig(256, 128, 64, 8, 8, 3),
        MatmulConfig(128, 128, 128, 8, 8, 3),
        MatmulConfig(64, 128, 64, 8, 4, 4),
    ],
    DECODE: [
        MatmulConfig(16, 64, 256, 1, 4, 3),
        MatmulConfig(16, 32, 256, 1, 4, 3),
        MatmulConfig(16, 64, 512, 1, 4, 3),
        MatmulConfig(16, 128, 256, 1, 4, 4),
        MatmulConfig(16, 64, 128, 1, 4, 4),
        MatmulConfig(16, 64, 256, 1, 8, 3),
    ],
}
SWEEP_QUANTIZE = {
    -1: [
        QuantizeConfig(16, 256, 4),
        QuantizeConfig(32, 256, 4),
        QuantizeConfig(8, 512, 4),
        QuantizeConfig(32, 128, 4),
        QuantizeConfig(64, 256, 8),
    ],
    0: [
        QuantizeConfig(64, 64, 4),
        QuantizeConfig(32, 32, 4),
        QuantizeConfig(128, 64, 8),
        QuantizeConfig(64, 128, 8),
        QuantizeConfig(128, 128, 8),
    ],
}


def run_sweep(budget_s: float) -> None:
    """Time candidate blocks (mxfp4 / mxfp8 / W4A16 matmuls, mxfp4 quantize); print each."""
    t_start = time.perf_counter()
    key = jax.random.key(0)
    print("\n-- block sweep (defaults marked *)")
    for mkn, configs in SWEEP_MATMUL.items():
        m, k, n = mkn
        x = jax.random.normal(key, (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.bfloat16)
        for fa, fb in (("mxfp4", "mxfp4"), ("mxfp8_e4m3", "mxfp8_e4m3"), (None, "mxfp4")):
            a, b = _operand(x, fa, -1), _operand(w, fb, 0)
            default = MatmulCase(fa, fb, mkn).config
            for cfg in configs:
                if time.perf_counter() - t_start > budget_s:
                    print("sweep: time budget spent")
                    return
                kern = jax.jit(
                    lambda a, b, cfg=cfg: block_scaled_matmul(
                        a, b, out_dtype=jnp.bfloat16, implementation="pallas", config=cfg
                    )
                )
                try:
                    tk = time_fn(kern, (a, b))
                    res = f"{tk * 1e6:9.1f} us {2 * m * n * k / tk / 1e12:7.1f} TFLOP/s"
                except Exception as e:
                    res = f"ERROR {type(e).__name__}: {str(e)[:200]}"
                star = "*" if cfg == default else " "
                print(f"{star}matmul {fa or 'bf16'} x {fb} MKN={mkn} {cfg}: {res}")
    x = jax.random.normal(key, PREFILL[:2], jnp.bfloat16)
    for axis, configs in SWEEP_QUANTIZE.items():
        default = quantize_default(x.shape, "mxfp4", axis)
        for cfg in configs:
            if time.perf_counter() - t_start > budget_s:
                print("sweep: time budget spent")
                return
            kern = jax.jit(
                lambda x, cfg=cfg, axis=axis: quantize(
                    x, "mxfp4", axis, implementation="pallas", config=cfg
                )
            )
            try:
                tk = time_fn(kern, (x,))
                nbytes = x.nbytes + x.size * 17 // 32  # 4-bit codes + a scale byte per 32
                res = f"{tk * 1e6:9.1f} us {nbytes / tk / 1e9:7.1f} GB/s"
            except Exception as e:
                res = f"ERROR {type(e).__name__}: {str(e)[:200]}"
            star = "*" if cfg == default else " "
            print(f"{star}quantize mxfp4 axis={axis} {x.shape} {cfg}: {res}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: CUDA lowering of every kernel + interpret-mode checks",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="GPU mode: skip what is left after this many seconds",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="GPU mode: afterwards, time candidate block sizes (another budget-s at most)",
    )
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="print each configuration's H200 roofline (pallas_kernels.roofline) and exit",
    )
    args = parser.parse_args(argv)
    if args.roofline:
        print(roofline_table(), end="")
        print()
        print(mosaic_roofline_table(), end="")
        return 0
    if args.dry_run:
        return run_dry()
    if not on_gpu():
        print(f"no GPU (default backend: {jax.default_backend()}); use --dry-run")
        return 2
    status = run_gpu(args.budget_s)
    if args.sweep:
        run_sweep(args.budget_s)
    return status


if __name__ == "__main__":
    sys.exit(main())
