"""What the tests of the two Mosaic GPU block-scaled matmuls share, written once.

tests/test_blackwell_matmul.py (``tcgen05.mma``, B200) and tests/test_hopper_matmul.py (FP8
``wgmma``, H100) check kernels that take the same operands, lowbit's QArrays quantized along
K, validate them alike (:mod:`pallas_kernels.mosaic_common`) and report a device-less compile
alike. Here: the helpers both use, and :class:`MosaicMatmulSpec`, the tests whose body is the
same for both kernels; each test file subclasses it and says which kernel (class attributes).

Compile reports run in a fresh Python process, one per test class (:func:`compile_reports`):
Mosaic GPU runs ptxas for the first target a process compiles for only (see
:func:`pallas_kernels.mosaic_common.compile_with_dump`), so a B200 and an H100 compile cannot
share the test process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from pallas_kernels import aot
from pallas_kernels.mosaic_common import operand_shapes, positional_matmul

ROOT = Path(__file__).resolve().parents[1]

needs_plugin = pytest.mark.skipif(
    not aot.available()[0],
    reason=f"device-less GPU compile: {aot.available()[1]} (run with .venv-gpu)",
)


# --------------------------------------------------------------------------------------------
# Operands


def quantized(fmt: str, m: int, n: int, k: int, seed: int = 0):
    """x [m, k] and w [n, k], both quantized along K (the last axis) with lowbit."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    # rows of different magnitudes, so that scales differ from block to block and row to row
    w = jax.random.normal(kw, (n, k), jnp.float32) * jnp.exp2(jnp.arange(n) % 7 - 3.0)[:, None]
    return lb.quantize(x, fmt, axis=-1), lb.quantize(w, fmt, axis=-1)


def operands(qa, qb) -> dict:
    """The kernel's arguments from two QArrays."""
    kw = dict(a_codes=qa.codes, a_scales=qa.scales, b_codes=qb.codes, b_scales=qb.scales,
              fmt=qa.format_name)
    if qa.tensor_scale is not None:
        kw.update(a_tensor_scale=qa.tensor_scale, b_tensor_scale=qb.tensor_scale)
    return kw


def zero_operands(formats: dict, fmt: str, m: int, n: int, k: int) -> dict:
    """The arguments of an all-zero ``[m, k] x [n, k]`` matmul in ``fmt`` (``formats``: the
    kernel's table), tensor scales 1 where the format has them."""
    f = formats[fmt]
    codes, scales, u8 = k * f.bits // 8, k // f.block, jnp.uint8
    kw = dict(a_codes=jnp.zeros((m, codes), u8), a_scales=jnp.zeros((m, scales), u8),
              b_codes=jnp.zeros((n, codes), u8), b_scales=jnp.zeros((n, scales), u8), fmt=fmt)
    if f.tensor_scaled:
        kw.update(a_tensor_scale=1.0, b_tensor_scale=1.0)
    return kw


def call(fn, kw):
    """``fn`` on the argument dict ``kw``, the four arrays positionally."""
    kw = dict(kw)
    args = [kw.pop(n) for n in ("a_codes", "a_scales", "b_codes", "b_scales")]
    return fn(*args, **kw)


def changed(kw, **changes) -> dict:
    return {**kw, **changes}


def specs(f, m: int, n: int, k: int) -> list[jax.ShapeDtypeStruct]:
    """The kernel's arguments for ``jax.eval_shape`` / ``jax.export`` (format record ``f``)."""
    return [jax.ShapeDtypeStruct(s, d) for s, d in operand_shapes(f, m, n, k)]


# --------------------------------------------------------------------------------------------
# Values


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def dequantized(q) -> np.ndarray:
    return f64(lb.dequantize(q, jnp.float32))


def unit_tensor_scale(q):
    """``q`` with its tensor scale (if any) set to 1: the kernels apply it to the sum."""
    return q if q.tensor_scale is None else dataclasses.replace(q, tensor_scale=jnp.float32(1.0))


def check_tensor_scale_product(t, qa, qb) -> None:
    """The prepared ``t``: ``a_t * b_t`` in float32 as a ``(1,)`` array, None without."""
    if qa.tensor_scale is None:
        assert t is None
        return
    assert t.shape == (1,) and t.dtype == jnp.float32
    assert float(t[0]) == float(np.float32(qa.tensor_scale) * np.float32(qb.tensor_scale))


def accumulation_bound(qa, qb, k) -> np.ndarray:
    """|C - C_ref| bound for two float32 sums of K products (any order, any grouping):
    2 K eps |A||B|^T, plus float32 rounding of the result."""
    abs_a, abs_b = np.abs(dequantized(qa)), np.abs(dequantized(qb))
    return 2 * k * np.finfo(np.float32).eps * (abs_a @ abs_b.T) + 1e-30


def fraction_off(c, ref, qa, qb, k) -> float:
    """The fraction of ``c``'s elements farther from ``ref`` than :func:`accumulation_bound`."""
    return float(np.mean(np.abs(c - ref) > accumulation_bound(qa, qb, k)))


# --------------------------------------------------------------------------------------------
# Compile reports, in a fresh process

_CHILD = """
import importlib, json, sys
report = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
out = {}
for key, (args, kwargs) in json.load(sys.stdin).items():
    try:
        out[key] = report(*args, **kwargs)
    except Exception as e:  # reported per compile, read by the test that wants it
        out[key] = {"error": f"{type(e).__name__}: {e}"}
print("REPORTS " + json.dumps(out))
"""


class Reports(dict):
    """id -> ``compile_report``'s dict (tuples read back as lists); a compile that raised
    fails the test that reads it, with the error."""

    def __getitem__(self, key):
        r = super().__getitem__(key)
        if "error" in r:
            pytest.fail(f"compile_report {key!r}: {r['error']}")
        return r


def compile_reports(module: str, calls: dict[str, tuple[tuple, dict]],
                    function: str = "compile_report") -> Reports:
    """``module.<function>(*args, **kwargs)`` (``compile_report`` by default) for each
    ``id: (args, kwargs)`` of ``calls`` (JSON values: dtypes by name), in order, in one fresh
    Python process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _CHILD, module, function],
                         input=json.dumps(calls),
                         capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("REPORTS ")]
    if run.returncode or not lines:
        raise RuntimeError(f"compile_report in a fresh process failed:\n{run.stderr[-4000:]}")
    return Reports(json.loads(lines[-1].removeprefix("REPORTS ")))


# --------------------------------------------------------------------------------------------
# The shared tests


class MosaicMatmulSpec:
    """The tests both kernels pass alike; a subclass names its kernel:

    ``module``, the package (``compile_report`` is run from it in a fresh process);
    ``formats``, its table; ``matmul``, ``reference``, ``prepare_operands``, ``config`` (its
    public functions and ``Config``, as staticmethods); ``block_m`` / ``block_n``, its default
    tile (the operands of the argument checks are one tile); ``shape``, the ``(M, N, K)``
    traced and lowered; ``lowered``, the formats lowered for CUDA (None: all); ``small``, a
    ``(fmt, m, n, k)`` for the reference's out_dtype; ``twice``, compile_report's arguments
    for two compiles in one process; ``more_compiles``, ``id: (args, kwargs)`` of the
    subclass's own compile tests. Hooks: :meth:`kernel_errors` (its own argument checks) and
    :meth:`check_mma` (the MMA instructions a compile report must hold).

    A test argument ``fmt`` not parametrized explicitly runs for every format of the table.
    """

    module: str
    formats: dict
    matmul: Callable
    reference: Callable
    prepare_operands: Callable
    config: type
    block_m: int
    block_n: int
    shape: tuple[int, int, int]
    lowered: list[str] | None = None
    small: tuple[str, int, int, int]
    twice: tuple
    more_compiles: dict = {}

    def zeros(self, m=None, n=None, k=128, fmt="mxfp8_e4m3") -> dict:
        return zero_operands(self.formats, fmt, m or self.block_m, n or self.block_n, k)

    def kernel_errors(self) -> list[tuple]:
        """(id, arguments, error, match) of the kernel's own argument checks."""
        return []

    def check_mma(self, report: dict, fmt: str) -> None:
        """Assert the MMA instructions of a compile report at 1024^3 in ``fmt``."""
        raise NotImplementedError

    def common_errors(self) -> list[tuple]:
        bm, bn, z, u8 = self.block_m, self.block_n, self.zeros, jnp.uint8
        return [
            ("unknown format", changed(z(), fmt="mxfp9"), ValueError,
             r"fmt='mxfp9'.*expected one of"),
            ("codes not uint8", changed(z(), a_codes=jnp.zeros((bm, 128), jnp.int8)),
             TypeError, r"a_codes must be uint8"),
            ("codes 3-D", changed(z(), b_codes=jnp.zeros((1, bn, 128), u8)), ValueError,
             r"b_codes must be 2-D"),
            ("scales shape", changed(z(), a_scales=jnp.zeros((bm, 5), u8)), ValueError,
             rf"a_scales has shape \({bm}, 5\).*needs \({bm}, 4\)"),
            ("scales rows", changed(z(), b_scales=jnp.zeros((bn // 2, 4), u8)), ValueError,
             rf"b_scales has shape \({bn // 2}, 4\)"),
            ("scales two bytes", changed(z(), a_scales=jnp.zeros((bm, 4), jnp.uint16)),
             TypeError, r"a_scales must hold one byte per scale, got uint16"),
            ("scales float32", changed(z(), a_scales=jnp.zeros((bm, 4), jnp.float32)),
             TypeError, r"a_scales must hold one byte per scale, got float32"),
            ("K differs", changed(z(), b_codes=jnp.zeros((bn, 256), u8),
                                  b_scales=jnp.zeros((bn, 8), u8)), ValueError,
             r"different K \(128 and 256\)"),
            ("M", z(m=bm * 3 // 2), ValueError,
             rf"m={bm * 3 // 2} must be a multiple of block_m={bm}"),
            ("N", z(n=bn + 8), ValueError, rf"n={bn + 8} must be a multiple of block_n={bn}"),
            ("num_stages", changed(z(), num_stages=0), ValueError,
             r"num_stages=0 must be at least 1"),
            ("nvfp4 without tensor scale", changed(z(fmt="nvfp4", k=256), b_tensor_scale=None),
             ValueError, r"b_tensor_scale is required for nvfp4"),
            ("tensor scale for MX", changed(z(), a_tensor_scale=1.0), ValueError,
             r"a_tensor_scale is only for NVFP4"),
            ("tensor scale not scalar", changed(z(fmt="nvfp4", k=256),
                                                a_tensor_scale=jnp.ones(2)),
             ValueError, r"a_tensor_scale must be a scalar"),
            ("out_dtype", changed(z(), out_dtype=jnp.int32), ValueError, r"out_dtype must be"),
        ]

    def pytest_generate_tests(self, metafunc):
        explicit = set()
        for mark in metafunc.definition.iter_markers("parametrize"):
            names = mark.args[0]
            explicit |= {s.strip() for s in (names.split(",") if isinstance(names, str)
                                             else names)}
        if "fmt" in metafunc.fixturenames and "fmt" not in explicit:
            metafunc.parametrize("fmt", sorted(self.formats))
        if "lowered_fmt" in metafunc.fixturenames:
            metafunc.parametrize("lowered_fmt", self.lowered or sorted(self.formats))
        if "error_case" in metafunc.fixturenames:
            cases = self.common_errors() + self.kernel_errors()
            metafunc.parametrize("error_case", [c[1:] for c in cases], ids=[c[0] for c in cases])

    @pytest.fixture(scope="class")
    @classmethod
    def reports(cls) -> Reports:
        """Every compile the class's tests read, in one fresh process."""
        calls = {fmt: ((fmt, 1024, 1024, 1024), {}) for fmt in sorted(cls.formats)}
        calls |= {"twice-1": (cls.twice, {}), "twice-2": (cls.twice, {})}
        return compile_reports(cls.module, calls | cls.more_compiles)

    # --- the format table and the argument checks ---------------------------------------

    def test_format_table_agrees_with_lowbit(self, fmt):
        f, lf = self.formats[fmt], lb.formats.get(fmt)
        assert f.name == fmt
        assert f.block == lf.block_size
        assert f.bits == lf.elem.bits
        assert f.tensor_scaled == (fmt == "nvfp4")

    def test_bad_arguments_raise_naming_them(self, error_case):
        kw, error, match = error_case
        with pytest.raises(error, match=match):
            call(self.matmul, kw)

    def test_reference_checks_its_arguments_too(self):
        with pytest.raises(ValueError, match=r"b_tensor_scale is required"):
            call(self.reference, changed(self.zeros(fmt="nvfp4", k=256), b_tensor_scale=None))
        with pytest.raises(ValueError, match=r"a_scales has shape"):
            call(self.reference, changed(self.zeros(),
                                         a_scales=jnp.zeros((self.block_m, 3), jnp.uint8)))
        with pytest.raises(ValueError, match=r"different K \(128 and 256\)"):
            call(self.reference, changed(self.zeros(), b_codes=jnp.zeros((8, 256), jnp.uint8),
                                         b_scales=jnp.zeros((8, 8), jnp.uint8)))

    @pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4"])
    def test_scales_of_any_one_byte_dtype_are_their_bytes(self, fmt):
        """Scales typed as their float8 dtype (E8M0 for MX, E4M3 for NVFP4) are taken as
        the same bytes as lowbit's uint8."""
        m, n, k = self.small[1:]
        kw = operands(*quantized(fmt, m, n, k))
        dtype = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.float8_e8m0fnu
        typed = changed(kw, a_scales=jax.lax.bitcast_convert_type(kw["a_scales"], dtype),
                        b_scales=jax.lax.bitcast_convert_type(kw["b_scales"], dtype))
        for fn in (self.prepare_operands, self.reference):
            for got, want in zip(jax.tree.leaves(call(fn, typed)), jax.tree.leaves(call(fn, kw)),
                                 strict=True):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # --- the reference --------------------------------------------------------------------

    def test_reference_is_dequantize_and_a_float32_dot(self, fmt):
        m, n, k = self.shape
        qa, qb = quantized(fmt, m, n, k, seed=1)
        ref = f64(call(self.reference, operands(qa, qb)))
        want = dequantized(qa) @ dequantized(qb).T
        assert np.all(np.abs(ref - want) <= accumulation_bound(qa, qb, k))

    @pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
    def test_reference_casts_to_out_dtype(self, out_dtype):
        fmt, m, n, k = self.small
        c = call(self.reference, changed(operands(*quantized(fmt, m, n, k)), out_dtype=out_dtype))
        assert c.shape == (m, n) and c.dtype == jnp.dtype(out_dtype)

    # --- the kernel, traced and lowered (any machine) ------------------------------------

    def test_kernel_traces(self, fmt):
        m, n, k = self.shape
        fn = positional_matmul(self.matmul, fmt=fmt, out_dtype=jnp.bfloat16)
        out = jax.eval_shape(fn, *specs(self.formats[fmt], m, n, k))
        assert (out.shape, out.dtype) == ((m, n), jnp.bfloat16)

    def test_kernel_lowers_for_cuda(self, lowered_fmt):
        """Pallas -> Mosaic GPU lowering (the MMA's shape and operand checks included) via
        jax.export; no CUDA plugin needed."""
        m, n, k = self.shape
        fn = jax.jit(positional_matmul(self.matmul, fmt=lowered_fmt))
        exp = jax.export.export(fn, platforms=["cuda"])(*specs(self.formats[lowered_fmt], m, n, k))
        assert "mosaic_gpu" in exp.mlir_module()
        assert exp.out_avals[0].shape == (m, n)

    # --- device-less compile (CUDA plugin only) -----------------------------------------

    @needs_plugin
    def test_compiles_without_spills(self, fmt, reports):
        r = reports[fmt]
        self.check_mma(r, fmt)
        assert (r["spill_stores"], r["spill_loads"], r["stack"]) == (0, 0, 0)
        assert 0 < r["registers"] <= 255
        assert r["smem_bytes"] <= 227 * 1024  # the opt-in shared memory per block

    @needs_plugin
    def test_compile_report_twice_in_one_process(self, reports):
        """Mosaic GPU reuses a kernel it compiled before; the report names each compile apart."""
        first, second = reports["twice-1"], reports["twice-2"]
        assert first["kernel"] != second["kernel"]
        assert first["registers"] == second["registers"]

    def test_config_is_frozen(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            self.config().block_k = 64
