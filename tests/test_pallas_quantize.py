"""The fused quantize op (pallas_kernels/quantize) against lowbit.quantize, bit for bit.

One shared test base runs per implementation: ``xla`` (the reference path of the api) and
``pallas`` in interpret mode (the Triton kernel's body evaluated by XLA on CPU, with tiles
chosen so that every test runs several programs). Quantization is exact arithmetic, so every
comparison is of codes, scales and the NVFP4 tensor scale, bit for bit, stochastic rounding
included (same key). The inputs hold an all-zero block, a NaN block, an Inf block, values near
1e-30 and values that saturate.

Without a GPU the Triton path is checked by lowering every kernel configuration for CUDA
through jax.export, with each Triton module run through the MLIR verifier (test_lowers_for_cuda).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from pallas_kernels._common import export_for_cuda, on_gpu
from pallas_kernels.quantize import Config, get_default, quantize
from pallas_kernels.quantize.kernel import quantize_pallas
from pallas_kernels.quantize.reference import quantize_reference

cpu_only = pytest.mark.skipif(on_gpu(), reason="checks the fallback on a machine without a GPU")

FORMATS = lb.formats.names()  # every MX format and nvfp4
AXES = (-1, 0)
ROUNDINGS = ("nearest", "stochastic")
KEY = jax.random.key(7)


def _lowbit(x, fmt, axis=-1, **kw) -> lb.QArray:
    """The oracle: lb.quantize, jitted (eager lowbit dispatches op by op, seconds a call; the
    jitted function is the one the xla implementation runs, so each compiles once)."""
    return quantize_reference(x, fmt, axis, **kw)


def _matrix(shape, seed=0, dtype=jnp.float32, specials=True) -> jax.Array:
    """Wide dynamic range, plus special blocks (rows 0-3 and columns 0-3 hold them, so they
    land in blocks along either axis)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(2.0 * rng.standard_normal(shape))
    if specials:
        x[0, :] = 0.0  # all-zero blocks along axis -1
        x[:, 0] = 0.0  # ... and along axis 0
        x[1, 5] = np.nan
        x[2, 40 % shape[1]] = np.inf
        x[3, :] = rng.standard_normal(shape[1]) * 1e-30
        x[5, 7] = -1e30  # saturates its block's neighbours to zero
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _assert_same_qarray(q: lb.QArray, r: lb.QArray):
    assert (q.format_name, q.shape, q.dtype, q.axes, q.block_shape) == (
        r.format_name,
        r.shape,
        r.dtype,
        r.axes,
        r.block_shape,
    )
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(r)
    assert q.codes.shape == r.codes.shape and q.codes.dtype == r.codes.dtype == jnp.uint8
    assert q.scales.shape == r.scales.shape and q.scales.dtype == r.scales.dtype
    np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(r.scales))
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    if r.tensor_scale is None:
        assert q.tensor_scale is None
    else:
        assert np.asarray(q.tensor_scale).view(np.uint32) == np.asarray(r.tensor_scale).view(
            np.uint32
        )


class QuantizeTestBase:
    """Shared tests; subclasses choose the implementation."""

    implementation: str = "xla"
    interpret: bool = False

    def config(self, shape, fmt, axis) -> Config | None:
        return None

    def quantize(self, x, fmt, axis=-1, **kw) -> lb.QArray:
        return quantize(
            x,
            fmt,
            axis,
            implementation=self.implementation,
            interpret=self.interpret,
            config=self.config(x.shape, fmt, axis),
            **kw,
        )

    @pytest.mark.parametrize("rounding", ROUNDINGS)
    @pytest.mark.parametrize("axis", AXES)
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_matches_lowbit_bit_for_bit(self, fmt, axis, rounding):
        x = _matrix((64, 128))
        key = KEY if rounding == "stochastic" else None
        q = self.quantize(x, fmt, axis, rounding=rounding, key=key)
        _assert_same_qarray(q, _lowbit(x, fmt, axis, rounding=rounding, key=key))

    @pytest.mark.parametrize(("fmt", "axis"), [("mxfp4", -1), ("mxfp6_e3m2", 0), ("nvfp4", 0)])
    def test_unaligned_shapes_are_padded_like_lowbit(self, fmt, axis):
        x = _matrix((40, 72), seed=1)  # neither axis a multiple of 32 or of the tile
        for rounding, key in (("nearest", None), ("stochastic", KEY)):
            q = self.quantize(x, fmt, axis, rounding=rounding, key=key)
            _assert_same_qarray(q, _lowbit(x, fmt, axis, rounding=rounding, key=key))

    @pytest.mark.parametrize(("fmt", "axis"), [("mxfp8_e4m3", 0), ("nvfp4", -1)])
    def test_bfloat16_input(self, fmt, axis):
        x = _matrix((32, 64), seed=2, dtype=jnp.bfloat16)
        q = self.quantize(x, fmt, axis, rounding="stochastic", key=KEY)
        _assert_same_qarray(q, _lowbit(x, fmt, axis, rounding="stochastic", key=KEY))

    @pytest.mark.parametrize("mode", ["ceil", "even", "rceil"])
    def test_scale_modes(self, mode):
        x = _matrix((32, 64), seed=3)
        for fmt in ("mxfp8_e5m2", "mxint8", "mxfp4"):
            q = self.quantize(x, fmt, -1, scale_mode=mode)
            _assert_same_qarray(q, _lowbit(x, fmt, -1, scale_mode=mode))

    def test_nvfp4_division_sensitive_scales(self):
        """Rows whose block scale crosses an E4M3 tie if (amax / 6) / t or 1 / t is
        reassociated (tests/test_exact.py): interpret mode inlines the kernel where XLA can
        see t = tamax / 2688, and must still divide exactly."""
        from tests.test_exact import (
            _nvfp4_division_sensitive_rows,
            _nvfp4_reciprocal_sensitive_matrix,
        )

        for x in (
            _nvfp4_division_sensitive_rows(n=16, seed=2, tamax=37.3),
            _nvfp4_reciprocal_sensitive_matrix(n=32, seed=3),
        ):
            x = jnp.asarray(x)
            _assert_same_qarray(self.quantize(x, "nvfp4", -1), _lowbit(x, "nvfp4", -1))

    def test_nvfp4_calibrated_tensor_amax(self):
        x = _matrix((32, 64), seed=4, specials=False)
        q = self.quantize(x, "nvfp4", 0, tensor_amax=3.0)
        _assert_same_qarray(q, _lowbit(x, "nvfp4", 0, tensor_amax=3.0))

    def test_stochastic_codes_depend_on_the_key(self):
        x = _matrix((32, 64), seed=5, specials=False)
        a = self.quantize(x, "mxfp4", -1, rounding="stochastic", key=jax.random.key(1))
        b = self.quantize(x, "mxfp4", -1, rounding="stochastic", key=jax.random.key(2))
        assert np.mean(np.asarray(a.codes) != np.asarray(b.codes)) > 0.1

    def test_round_trip_through_dequantize(self):
        x = _matrix((32, 64), seed=6, specials=False)
        q = self.quantize(x, "mxfp8_e4m3", 0)
        y = jax.jit(lb.dequantize)(q)
        np.testing.assert_array_equal(
            np.asarray(y),
            np.asarray(jax.jit(lb.fake_quantize, static_argnums=(1, 2))(x, "mxfp8_e4m3", 0)),
        )

    def test_rejects_bad_arguments(self):
        x = jnp.ones((32, 64))
        with pytest.raises(ValueError, match="2-D matrix"):
            self.quantize(jnp.ones((2, 32, 64)), "mxfp4")
        with pytest.raises(ValueError, match="axis must be 0 or -1"):
            self.quantize(x, "mxfp4", 2)
        with pytest.raises(ValueError, match="needs a PRNG key"):
            self.quantize(x, "mxfp4", rounding="stochastic")
        with pytest.raises(ValueError, match="rounding must be one of"):
            self.quantize(x, "mxfp4", rounding="up")
        with pytest.raises(ValueError, match="unknown format"):
            self.quantize(x, "mxfp5")
        with pytest.raises(ValueError, match="scale_mode"):
            self.quantize(x, "nvfp4", scale_mode="floor")
        with pytest.raises(ValueError, match="tensor_amax applies only to NVFP4"):
            self.quantize(x, "mxfp4", tensor_amax=1.0)
        with pytest.raises(TypeError, match="floating-point"):
            self.quantize(jnp.ones((32, 64), jnp.int32), "mxfp4")
        with pytest.raises(ValueError, match=r"block_cols=16 must be a multiple of .* 32"):
            quantize(
                x,
                "mxfp4",
                -1,
                config=Config(16, 16),
                implementation=self.implementation,
                interpret=self.interpret,
            )


class TestQuantizeXla(QuantizeTestBase):
    implementation = "xla"


class TestQuantizePallasInterpret(QuantizeTestBase):
    implementation = "pallas"
    interpret = True

    def config(self, shape, fmt, axis) -> Config:
        # Tiles smaller than the matrix: several programs, both grid axes.
        bs = lb.formats.get(fmt).block_size
        return Config(16, 2 * bs) if axis % 2 == 1 else Config(2 * bs, 16)

    def test_default_config_runs(self):
        x = _matrix((64, 128), seed=8)
        q = quantize(x, "mxfp6_e2m3", 0, implementation="pallas", interpret=True)
        _assert_same_qarray(q, _lowbit(x, "mxfp6_e2m3", 0))


@cpu_only
def test_default_implementation_on_cpu_is_the_reference():
    x = _matrix((32, 64), seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = quantize(x, "mxfp4")
    _assert_same_qarray(q, _lowbit(x, "mxfp4"))


@cpu_only
def test_explicit_pallas_without_gpu_falls_back_with_a_warning():
    x = _matrix((32, 64), seed=10)
    with pytest.warns(UserWarning, match="needs a GPU"):
        q = quantize(x, "mxfp4", implementation="pallas")
    _assert_same_qarray(q, _lowbit(x, "mxfp4"))
    with pytest.raises(ValueError, match="implementation must be one of"):
        quantize(x, "mxfp4", implementation="triton")


@pytest.mark.parametrize("shape", [(1, 32), (7, 100), (4096, 4096), (16, 8192), (8192, 8192)])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_default_config_is_valid(shape, axis, fmt):
    cfg = get_default(shape, fmt, axis)
    cfg.check(fmt, axis)
    assert cfg.block_rows * cfg.block_cols <= 8192


def test_config_rejects_non_powers_of_two():
    with pytest.raises(ValueError, match="power of two"):
        Config(24, 64)


# --------------------------------------------------------------------------------------------
# CUDA lowering: every kernel configuration (format x axis x rounding, both input dtypes)


def _export(fmt, axis, rounding, dtype=jnp.float32, shape=(64, 128), config=None, tensor_amax=None):
    config = config or get_default(shape, fmt, axis)
    spec = jax.ShapeDtypeStruct(shape, dtype)
    key_spec = jax.ShapeDtypeStruct((2,), jnp.uint32)

    def fn(x, key):
        return quantize_pallas(
            x, fmt, axis, rounding=rounding, key=key, config=config, tensor_amax=tensor_amax
        )

    return export_for_cuda(fn, spec, key_spec)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_lowers_for_cuda(fmt, axis, rounding):
    exported = _export(fmt, axis, rounding, dtype=jnp.bfloat16, shape=(256, 512))
    assert exported.platforms == ("cuda",)
    assert "xla.gpu.triton" in exported.mlir_module()
    # and with the small tiles the interpret-mode tests use
    cfg = TestQuantizePallasInterpret().config((64, 128), fmt, axis)
    _export(fmt, axis, rounding, shape=(64, 128), config=cfg)


@pytest.mark.parametrize("mode", ["ceil", "even", "rceil"])
def test_scale_modes_lower_for_cuda(mode):
    spec = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    export_for_cuda(
        lambda x: quantize_pallas(x, "mxint8", -1, scale_mode=mode, config=Config(16, 64)), spec
    )


def test_gpu_check_shapes_lower_for_cuda():
    # the default tiles of the 8192 x 8192 operands that gpu_check times, and float32 input
    for fmt, axis in (("mxfp4", -1), ("mxfp6_e2m3", 0), ("nvfp4", 0)):
        _export(fmt, axis, "nearest", shape=(8192, 8192))
    _export("nvfp4", -1, "stochastic", dtype=jnp.float32, tensor_amax=2.0)
