"""The block-scaled matmul op (pallas_kernels/block_scaled_matmul) against its reference.

Reference: ``lb.dequantize`` both operands, a float32 dot at ``Precision.HIGHEST``. One shared
test base runs per implementation: ``xla`` and ``pallas`` in interpret mode (blocks smaller
than the problem, so every test runs several programs and several K steps).

Tolerance (float32 accumulation). The dequantized products are exact in float32 in both (the
kernel's bf16 tiles hold the dequantized values exactly, see kernel.py), so C differs from the
reference only in the order of K float32 additions and, for NVFP4, in where the tensor scale
is applied: elementwise ``|C - C_ref| <= (2 K + 4) * 2**-24 * (|A| @ |B|)`` (each of the two
sums is within ``(K - 1) u sum|a b|`` of the exact one, ``u = 2**-24``; NVFP4 adds a few
roundings of ``t``). A bfloat16 output adds one bf16 rounding (``2**-8`` relative) of either.

Without a GPU the Triton path is checked by lowering every configuration for CUDA through
jax.export, each Triton module run through the MLIR verifier.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from pallas_kernels._common import export_for_cuda, format_unsupported, on_gpu
from pallas_kernels.block_scaled_matmul import Config, block_scaled_matmul, get_default
from pallas_kernels.block_scaled_matmul.kernel import matmul_pallas
from pallas_kernels.block_scaled_matmul.reference import (
    block_scaled_matmul_reference,
    dequantized,
)

cpu_only = pytest.mark.skipif(on_gpu(), reason="checks the fallback on a machine without a GPU")

FORMATS = [f for f in lb.formats.names() if format_unsupported(lb.formats.get(f)) is None]
# (A, B): every format with itself, mixed formats, and weight-only GEMMs (None = bf16,
# "f32" = float32 high-precision operand).
PAIRS = [(f, f) for f in FORMATS] + [
    ("mxfp8_e4m3", "mxfp8_e5m2"),
    ("nvfp4", "mxfp4"),
    ("mxfp6_e2m3", "mxint8"),
    (None, "mxfp4"),  # W4A16
    (None, "mxfp8_e4m3"),  # W8A16
    (None, "nvfp4"),
    ("f32", "mxfp4"),
    ("mxfp8_e4m3", None),
]


def _ids(pair):
    return "-".join(p or "bf16" for p in pair)


def _data(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, k)))
    w = rng.standard_normal((k, n)) * np.exp(rng.standard_normal((k, n)))
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(x, fmt, axis):
    return lb.quantize(x, fmt, axis)


def _operand(x, fmt, axis):
    if fmt is None:
        return x.astype(jnp.bfloat16)
    if fmt == "f32":
        return x
    return _quantize(x, fmt, axis)


_reference = block_scaled_matmul_reference  # jitted


@jax.jit
def _magnitude(a, b):
    """|A| @ |B| of the dequantized operands (the scale of the accumulation error)."""
    return jnp.dot(
        jnp.abs(dequantized(a)), jnp.abs(dequantized(b)), precision=jax.lax.Precision.HIGHEST
    )


def _assert_close(c, a, b, out_dtype=jnp.float32):
    k = a.shape[1]
    ref = _reference(a, b, out_dtype=out_dtype)
    assert c.shape == ref.shape and c.dtype == ref.dtype == out_dtype
    mag = _magnitude(a, b)
    tol = (2 * k + 4) * 2.0**-24 * mag
    if out_dtype != jnp.float32:
        tol = tol + 2.0**-8 * jnp.abs(ref.astype(jnp.float32))
    err = jnp.abs(c.astype(jnp.float32) - ref.astype(jnp.float32))
    bad = ~(err <= tol)
    assert not bool(jnp.any(bad)), (
        f"{int(bad.sum())} entries off; worst excess {float(jnp.max(err - tol))}"
    )


class MatmulTestBase:
    implementation: str = "xla"
    interpret: bool = False
    config: Config | None = None

    def matmul(self, a, b, **kw):
        kw.setdefault("config", self.config)
        return block_scaled_matmul(
            a, b, implementation=self.implementation, interpret=self.interpret, **kw
        )

    @pytest.mark.parametrize("pair", PAIRS, ids=_ids)
    def test_matches_reference(self, pair):
        x, w = _data(32, 128, 32)
        a, b = _operand(x, pair[0], -1), _operand(w, pair[1], 0)
        _assert_close(self.matmul(a, b), a, b)

    @pytest.mark.parametrize(
        "pair", [("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"), ("mxfp6_e3m2", None)], ids=_ids
    )
    def test_unaligned_shapes_are_padded(self, pair):
        x, w = _data(20, 80, 24, seed=1)  # K = 80: not a multiple of 32 nor of block_k
        a, b = _operand(x, pair[0], -1), _operand(w, pair[1], 0)
        _assert_close(self.matmul(a, b), a, b)

    def test_bfloat16_output(self):
        x, w = _data(32, 128, 32, seed=2)
        a, b = _operand(x, "mxfp8_e4m3", -1), _operand(w, "mxfp4", 0)
        _assert_close(self.matmul(a, b, out_dtype=jnp.bfloat16), a, b, jnp.bfloat16)

    def test_nan_block_poisons_its_row_only(self):
        x, w = _data(32, 64, 32, seed=3)
        x = x.at[3, 40].set(jnp.nan)
        a, b = _operand(x, "mxfp8_e4m3", -1), _operand(w, "mxfp8_e4m3", 0)
        c = np.asarray(self.matmul(a, b))
        assert np.isnan(c[3]).all() and np.isfinite(np.delete(c, 3, axis=0)).all()

    def test_rejects_bad_arguments(self):
        x, w = _data(16, 64, 16)
        a, b = _operand(x, "mxfp4", -1), _operand(w, "mxfp4", 0)
        with pytest.raises(ValueError, match="contraction sizes differ"):
            self.matmul(a, _operand(w[:32], "mxfp4", 0))
        with pytest.raises(ValueError, match="at least one operand must be a QArray"):
            self.matmul(x, w)
        with pytest.raises(ValueError, match="2-D matrix"):
            self.matmul(a, w[None])
        with pytest.raises(TypeError, match="floating-point"):
            self.matmul(a, jnp.ones((64, 16), jnp.int32))
        with pytest.raises(ValueError, match="out_dtype"):
            self.matmul(a, b, out_dtype=jnp.int32)


class TestMatmulXla(MatmulTestBase):
    implementation = "xla"


class TestMatmulPallasInterpret(MatmulTestBase):
    implementation = "pallas"
    interpret = True
    # 2 x 2 programs on 32 x 32, two K steps on K = 128 (three on the padded K = 80 -> 96)
    config = Config(block_m=16, block_n=16, block_k=64, group_m=2)

    def test_block_k_must_cover_the_format_block(self):
        x, w = _data(16, 64, 16)
        a, b = _operand(x, "mxfp4", -1), _operand(w, "mxfp4", 0)
        with pytest.raises(ValueError, match=r"block_k=16 must be a multiple of .* 32"):
            self.matmul(a, b, config=Config(16, 16, 16))

    def test_default_config_runs(self):
        x, w = _data(24, 96, 40, seed=4)
        a, b = _operand(x, "nvfp4", -1), _operand(w, "mxfp6_e2m3", 0)
        _assert_close(self.matmul(a, b, config=None), a, b)

    def test_operand_not_quantized_along_k_falls_back(self):
        x, w = _data(16, 64, 32)
        a = _operand(x, "mxfp8_e4m3", -1)
        b = _quantize(w, "mxfp8_e4m3", -1)  # blocks along N, not K
        with pytest.warns(UserWarning, match="B must be quantized along K"):
            c = self.matmul(a, b)
        _assert_close(c, a, b)


@cpu_only
def test_default_implementation_on_cpu_is_the_reference():
    x, w = _data(16, 64, 16)
    a, b = _operand(x, "mxfp4", -1), _operand(w, "mxfp4", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = block_scaled_matmul(a, b)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(_reference(a, b)))
    with pytest.warns(UserWarning, match="needs a GPU"):
        block_scaled_matmul(a, b, implementation="pallas")


@pytest.mark.parametrize("mkn", [(1, 32, 1), (16, 8192, 8192), (8192, 8192, 8192), (100, 80, 3)])
def test_default_config_is_valid(mkn):
    for blocks, f32 in (((32,), False), ((16, 32), False), ((32,), True)):
        cfg = get_default(*mkn, block_sizes=blocks, high_precision_f32=f32)
        cfg.check(blocks)


def test_config_rejects_bad_blocks():
    with pytest.raises(ValueError, match="power of two"):
        Config(16, 48, 64)
    with pytest.raises(ValueError, match="at least 16"):
        Config(8, 16, 64)


# --------------------------------------------------------------------------------------------
# CUDA lowering of every configuration: all operand pairs, both output dtypes, the default
# blocks of gpu_check's prefill (8192^3) and decode (M = 16) shapes.


def _operand_spec(fmt, shape, axis):
    """A QArray of ShapeDtypeStructs (or an array spec) for jax.export."""
    if fmt in (None, "f32"):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16 if fmt is None else jnp.float32)
    return jax.eval_shape(
        lambda x: lb.quantize(x, fmt, axis), jax.ShapeDtypeStruct(shape, jnp.float32)
    )


def _export(pair, m, k, n, config=None, out_dtype=jnp.float32):
    a = _operand_spec(pair[0], (m, k), -1)
    b = _operand_spec(pair[1], (k, n), 0)
    if config is None:
        blocks = tuple(q.block_shape[0] for q in (a, b) if isinstance(q, lb.QArray))
        config = get_default(m, n, k, block_sizes=blocks, high_precision_f32="f32" in pair)
    return export_for_cuda(
        lambda a, b: matmul_pallas(a, b, config=config, out_dtype=out_dtype), a, b
    )


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_lowers_for_cuda(pair):
    exported = _export(pair, 256, 512, 256, out_dtype=jnp.bfloat16)
    assert exported.platforms == ("cuda",)
    assert "xla.gpu.triton" in exported.mlir_module()
    # and with the small blocks the interpret-mode tests use
    _export(pair, 32, 128, 32, config=TestMatmulPallasInterpret.config)


@pytest.mark.parametrize(
    "pair",
    [("mxfp8_e4m3",) * 2, ("mxfp6_e2m3",) * 2, ("mxfp4",) * 2, ("nvfp4",) * 2, (None, "mxfp4")],
    ids=_ids,
)
def test_gpu_check_shapes_lower_for_cuda(pair):
    _export(pair, 8192, 8192, 8192)
    _export(pair, 16, 8192, 8192, out_dtype=jnp.bfloat16)
