"""The fused quantize op (pallas_kernels/quantize) against lowbit.quantize, bit for bit.

One shared test base runs per implementation: ``xla`` (the reference path of the api) and
``pallas`` in interpret mode (the Triton kernel's body evaluated by XLA on CPU, with tiles
chosen so that every test runs several programs). Quantization is exact arithmetic, so every
comparison is of codes, scales and the NVFP4 tensor scale, bit for bit, stochastic rounding
included (same key). The inputs hold an all-zero block, a NaN block, an Inf block, values near
1e-30 and values that saturate. Scale modes, NVFP4's calibrated tensor amax and its
division-sensitive inputs, and the dequantized values run for the kernel from the shared spec
base against the NumPy reference (tests/test_quantizer_pallas.py).

Fused Hadamard transform (``hadamard=b``): the kernel follows lowbit's fixed-order butterfly,
so on any input it is bit-exact with ``hadamard_transform(..., method="butterfly")`` then
``lowbit.quantize``. Against lowbit's default dense form (a matmul, whose summation order is the
backend's) bit-exactness holds where the transform is exact: small integers times powers of two
with b in {16, 64, 256} (1/sqrt(b) a power of two, every partial sum exact, no zero inputs so no
signed-zero differences). On random inputs the two forms agree to float32 rounding, so a value
within an ulp of a rounding boundary (of the element grid, or of a scale's binade) can round
the other way: at most 0.1 % of the code bytes and 1 % of the block scales may differ, and
NVFP4's tensor scale by a few ulp (measured: at most 1 code byte in 65536, no scale).

Prescale gain (``gain=g``): bit-exact with ``lowbit.core.qarray.quantize_with_plan`` for
``make_plan(..., prescale=g)``; dividing the dequantized values by ``g`` gives lowbit's
fake-quantized values for that plan.

NVFP4's MS-EDEN (``rounding="eden"``) and TetraJet-v2's double-block scales (``tensor_block``):
bit-exact with lowbit (codes, scales, tensor or outer scales, values) on Gaussian, heavy-tailed,
row-scaled, all-zero and NaN/Inf inputs, along both axes, with and without a fused Hadamard
transform (MS-EDEN's random Hadamard of 128 included); the outer blocks the kernel declines fall
back to the reference with a warning.

Without a GPU the Triton path is checked by lowering every kernel configuration for CUDA
through jax.export, with each Triton module run through the MLIR verifier (test_lowers_for_cuda,
test_hadamard_and_gain_lower_for_cuda: every configuration the tests here run, along both
axes, and the default tiles of larger shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.core import numerics as lowbit_numerics
from lowbit.core import qarray as lowbit_qarray
from lowbit.core.hadamard import random_signs
from pallas_kernels import _numerics as nx
from pallas_kernels._common import export_for_cuda, format_unsupported, on_gpu
from pallas_kernels.quantize import Config, get_default, quantize
from pallas_kernels.quantize.kernel import quantize_pallas
from pallas_kernels.quantize.reference import quantize_reference
from tests.elements import LB_ELEMS

cpu_only = pytest.mark.skipif(on_gpu(), reason="checks the fallback on a machine without a GPU")

# every format the kernels decode: the MX formats and nvfp4 (int4 and ternary fall back to
# the reference: tests/test_int4_ternary.py)
FORMATS = [f for f in lb.formats.names() if format_unsupported(lb.formats.get(f)) is None]
AXES = (-1, 0)
ROUNDINGS = ("nearest", "stochastic")
KEY = jax.random.key(7)


class HCase(NamedTuple):
    """A fused-Hadamard configuration: format, axis, Hadamard block, rounding, gain, input
    dtype, shape, random signs or not."""

    fmt: str
    axis: int
    hadamard: int
    rounding: str
    gain: float
    dtype: str
    shape: tuple[int, int]
    signs: bool = True

    def kwargs(self) -> dict:
        signs = random_signs(jax.random.key(self.hadamard), self.hadamard) if self.signs else None
        key = KEY if self.rounding == "stochastic" else None
        return dict(
            rounding=self.rounding, key=key, hadamard=self.hadamard, signs=signs, prescale=self.gain
        )


# The recipes' fused operands (quartet's backward: MXFP4, b = 32, stochastic, gain 3/4;
# nvfp4's wgrad: NVFP4, b = 16, stochastic) along both axes, and the edges: b = 64 and 256, a
# Hadamard block shorter than the format's with padding kept in the output (80 = 2.5 MX
# blocks, along either axis), bfloat16 input, no signs, MX INT8.
HADAMARD_CASES = [
    HCase("mxfp4", -1, 16, "stochastic", 0.75, "float32", (32, 80)),
    HCase("mxfp4", 0, 32, "stochastic", 0.75, "float32", (64, 64)),
    HCase("nvfp4", 0, 16, "stochastic", 1.0, "float32", (64, 48)),
    HCase("nvfp4", -1, 64, "nearest", 0.75, "bfloat16", (32, 128)),
    HCase("mxfp8_e4m3", -1, 256, "nearest", 1.0, "bfloat16", (32, 256), signs=False),
    HCase("mxint8", 0, 16, "stochastic", 0.75, "float32", (80, 32)),
]
# (fmt, axis, rounding, gain): the recipes' gain on stochastic MXFP4 and NVFP4, and a gain
# above 1 that makes elements saturate (MX INT8 with a gain: HADAMARD_CASES).
GAIN_CASES = [
    ("mxfp4", 0, "stochastic", 0.75),
    ("nvfp4", -1, "stochastic", 0.75),
    ("mxfp8_e5m2", 0, "nearest", 1.5),
]


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _gain_oracle(x, key, fmt, axis, rounding, gain):
    """lowbit's quantizer with a plan gain; its dequantized values unscaled; lowbit's
    fake-quantized values for that plan; the codes without the gain."""
    plan = lowbit_qarray.make_plan(x.shape, fmt, axis, None, None, rounding, key, None, gain)
    q = lowbit_qarray.quantize_with_plan(x, plan, key, None)
    unscaled = lowbit_qarray.undo_prescale(lowbit_qarray.dequantize(q), gain)
    fake = lowbit_qarray.fake_quantize_with_plan(x, key, None, plan, native=False)[0]
    plain = lowbit_qarray.make_plan(x.shape, fmt, axis, None, None, rounding, key, None)
    return q, unscaled, fake, lowbit_qarray.quantize_with_plan(x, plain, key, None).codes


def _hcase_id(case: HCase) -> str:
    signs = "" if case.signs else "-nosigns"
    return (
        f"{case.fmt}-axis{case.axis}-h{case.hadamard}-{case.rounding}-g{case.gain}-"
        f"{case.dtype}-{case.shape[0]}x{case.shape[1]}{signs}"
    )


def _gain_id(case) -> str:
    return "-".join(str(c) for c in case)


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


def _exact_matrix(shape, axis, seed=0, dtype=jnp.float32) -> jax.Array:
    """Inputs whose Hadamard transform is exact in float32 for b in {16, 64, 256}: nonzero
    integers -7..7 times 2**k (k in -3..3 per element, and a power of two per line across the
    quantized axis from 2**-20 to 2**20), so every partial sum of a block fits in 24 bits and
    every product by 1/sqrt(b) is exact; no zeros, so no sum can be -0. Exact in bfloat16 too."""
    rng = np.random.default_rng(seed)
    v = rng.integers(1, 8, shape) * rng.choice([-1.0, 1.0], shape)
    v = v * 2.0 ** rng.integers(-3, 4, shape)
    lines = shape[1 - axis % 2]
    line_scale = 2.0 ** rng.integers(-20, 21, lines)
    v = v * (line_scale[None, :] if axis % 2 == 0 else line_scale[:, None])
    return jnp.asarray(v.astype(np.float32)).astype(dtype)


def _assert_close_qarray(q: lb.QArray, r: lb.QArray):
    """q and r from Hadamard transforms that agree to float32 rounding: the dequantized values
    are equal (the sign of zero aside: the butterfly turns a zero block with random signs into
    signed zeros, the dense form into +0) except for a stated fraction within an ulp of a
    rounding boundary; the block scales except for 1 %; NVFP4's tensor scales by a few ulp
    (the values compared with q's tensor scale on both sides)."""
    scales_q, scales_r = np.asarray(q.scales), np.asarray(r.scales)
    assert scales_q.shape == scales_r.shape
    scales_off = np.sum(scales_q != scales_r)
    assert scales_off <= 1e-2 * scales_q.size, f"{scales_off} of {scales_q.size} scales differ"
    if r.tensor_scale is not None:
        np.testing.assert_allclose(float(q.tensor_scale), float(r.tensor_scale), rtol=2.0**-20)
        r = dataclasses.replace(r, tensor_scale=q.tensor_scale)
    yq, yr = (np.asarray(_dequantize(a, jnp.float32)) for a in (q, r))
    off = np.sum((yq != yr) & ~(np.isnan(yq) & np.isnan(yr)))
    assert off <= 1e-3 * yq.size, f"{off} of {yq.size} dequantized values differ"


_dequantize = jax.jit(lb.dequantize, static_argnums=1)


def _assert_same_qarray(q: lb.QArray, r: lb.QArray):
    assert (q.format_name, q.shape, q.dtype, q.axes, q.block_shape, q.tensor_block) == (
        r.format_name,
        r.shape,
        r.dtype,
        r.axes,
        r.block_shape,
        r.tensor_block,
    )
    assert jax.tree_util.tree_structure(q) == jax.tree_util.tree_structure(r)
    assert q.codes.shape == r.codes.shape and q.codes.dtype == r.codes.dtype == jnp.uint8
    assert q.scales.shape == r.scales.shape and q.scales.dtype == r.scales.dtype
    np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(r.scales))
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes))
    if r.tensor_scale is None:
        assert q.tensor_scale is None
    else:
        # a scalar, or one per outer block (double-block scales), bit for bit
        np.testing.assert_array_equal(
            np.asarray(q.tensor_scale).view(np.uint32), np.asarray(r.tensor_scale).view(np.uint32)
        )


class QuantizeTestBase:
    """Shared tests; subclasses choose the implementation."""

    implementation: str = "xla"
    interpret: bool = False
    # the form of lowbit's Hadamard transform whose arithmetic the implementation follows
    hadamard_method: str | None = None

    def config(self, shape, fmt, axis, hadamard=None) -> Config | None:
        return None

    def quantize(self, x, fmt, axis=-1, **kw) -> lb.QArray:
        return quantize(
            x,
            fmt,
            axis,
            implementation=self.implementation,
            interpret=self.interpret,
            config=self.config(x.shape, fmt, axis, kw.get("hadamard")),
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

    def test_stochastic_codes_depend_on_the_key(self):
        x = _matrix((32, 64), seed=5, specials=False)
        a = self.quantize(x, "mxfp4", -1, rounding="stochastic", key=jax.random.key(1))
        b = self.quantize(x, "mxfp4", -1, rounding="stochastic", key=jax.random.key(2))
        assert np.mean(np.asarray(a.codes) != np.asarray(b.codes)) > 0.1

    @pytest.mark.parametrize("case", HADAMARD_CASES, ids=_hcase_id)
    def test_hadamard(self, case: HCase):
        if self.implementation == "xla" and case != HADAMARD_CASES[0]:
            pytest.skip("the xla implementation is the reference: one case checks the plumbing")
        kw, dtype = case.kwargs(), jnp.dtype(case.dtype)
        if case.hadamard in (16, 64, 256):  # exact arithmetic: lowbit's default, bit for bit
            x = _exact_matrix(case.shape, case.axis, seed=1, dtype=dtype)
            q = self.quantize(x, case.fmt, case.axis, **kw)
            _assert_same_qarray(q, _lowbit(x, case.fmt, case.axis, **kw))
        x = _matrix(case.shape, seed=2, dtype=dtype)
        q = self.quantize(x, case.fmt, case.axis, **kw)
        ref = _lowbit(x, case.fmt, case.axis, hadamard_method=self.hadamard_method, **kw)
        _assert_same_qarray(q, ref)  # the same arithmetic: bit for bit, specials included
        _assert_close_qarray(q, _lowbit(x, case.fmt, case.axis, **kw))

    @pytest.mark.parametrize("case", GAIN_CASES, ids=_gain_id)
    def test_gain_matches_quantize_with_plan(self, case):
        if self.implementation == "xla" and case != GAIN_CASES[0]:
            pytest.skip("the xla implementation is the reference: one case checks the plumbing")
        fmt, axis, rounding, gain = case
        x = _matrix((32, 64), seed=11, specials=False)
        key = KEY if rounding == "stochastic" else None
        q = self.quantize(x, fmt, axis, rounding=rounding, key=key, prescale=gain)
        oracle, unscaled, fake, unscaled_codes = _gain_oracle(x, key, fmt, axis, rounding, gain)
        _assert_same_qarray(q, oracle)
        # the codes hold the gained elements: unscaled, lowbit's fake-quantized values
        np.testing.assert_array_equal(np.asarray(unscaled), np.asarray(fake))
        assert np.mean(np.asarray(q.codes) != np.asarray(unscaled_codes)) > 0.1

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
        with pytest.raises(ValueError, match="tensor_amax applies only to formats with an amax"):
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
        with pytest.raises(ValueError, match=r"hadamard=24 must be one of \(16, 32"):
            self.quantize(x, "mxfp4", hadamard=24)
        with pytest.raises(ValueError, match=r"x.shape\[1\]=64 .* multiple of hadamard=128"):
            self.quantize(x, "mxfp4", -1, hadamard=128)
        with pytest.raises(ValueError, match="signs apply only with a Hadamard transform"):
            self.quantize(x, "mxfp4", signs=jnp.ones(16))
        with pytest.raises(ValueError, match=r"signs must have shape \(16,\)"):
            self.quantize(x, "mxfp4", hadamard=16, signs=jnp.ones(32))
        with pytest.raises(ValueError, match="prescale must be a finite positive float"):
            self.quantize(x, "mxfp4", prescale=0.0)
        with pytest.raises(TypeError, match="prescale must be a Python float"):
            self.quantize(x, "mxfp4", prescale=jnp.float32(0.75))
        with pytest.raises(ValueError, match="block_cols=32 must be a multiple of the Hadamard"):
            quantize(
                x,
                "mxfp4",
                -1,
                hadamard=64,
                config=Config(16, 32),
                implementation=self.implementation,
                interpret=self.interpret,
            )


class TestQuantizeXla(QuantizeTestBase):
    implementation = "xla"


class TestQuantizePallasInterpret(QuantizeTestBase):
    implementation = "pallas"
    interpret = True
    hadamard_method = "butterfly"

    def config(self, shape, fmt, axis, hadamard=None) -> Config:
        # Tiles smaller than the matrix: several programs, both grid axes.
        along = max(2 * lb.formats.get(fmt).block_size, hadamard or 1)
        return Config(16, along) if axis % 2 == 1 else Config(along, 16)

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
    for b in (16, 256):
        cfg = get_default(shape, fmt, axis, hadamard=b)
        cfg.check(fmt, axis, b)
        assert cfg.block_rows * cfg.block_cols <= 8192


def test_numerics_substitutes_match_lowbit():
    """pallas_kernels._numerics' substitutes (stochastic rounding, MX INT8 codes) against
    lowbit's own functions, bit for bit, on every element format over its range (saturation
    and the subnormal binade included)."""
    rng = np.random.default_rng(0)
    v = rng.standard_normal(8192) * np.exp2(rng.uniform(-12, 2, 8192))
    v = jnp.asarray(v.astype(np.float32))
    rbits = jax.random.bits(jax.random.key(0), v.shape, jnp.uint32)

    @jax.jit
    def both(v, rbits):
        out = {}
        for name, elem in LB_ELEMS.items():
            if name in ("int4", "ternary"):  # no kernel decodes them
                continue
            w = v * np.float32(elem.max / 4)
            q = lowbit_numerics.round_to_grid(w, elem, saturate=True)
            out[name] = (
                nx.round_to_grid(w, elem, rbits, saturate=True),
                lowbit_numerics.round_to_grid(w, elem, rbits=rbits, saturate=True),
                nx.encode(q, elem),
                lowbit_qarray.encode_elements(q, elem).astype(jnp.int32),
            )
        return out

    for name, (ours, theirs, codes, lowbit_codes) in both(v, rbits).items():
        np.testing.assert_array_equal(
            np.asarray(ours).view(np.uint32), np.asarray(theirs).view(np.uint32), err_msg=name
        )
        np.testing.assert_array_equal(np.asarray(codes), np.asarray(lowbit_codes), err_msg=name)


# --------------------------------------------------------------------------------------------
# CUDA lowering: every kernel configuration (format x axis x rounding, both input dtypes)


def _export(
    fmt,
    axis,
    rounding,
    dtype=jnp.float32,
    shape=(64, 128),
    config=None,
    tensor_amax=None,
    hadamard=None,
    signs=False,
    gain=1.0,
):
    config = config or get_default(shape, fmt, axis, hadamard)
    specs = [jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((2,), jnp.uint32)]
    if signs:
        specs.append(jax.ShapeDtypeStruct((hadamard,), jnp.float32))

    def fn(x, key, signs=None):
        plan = lowbit_qarray.make_plan(
            x.shape, fmt, axis % 2, None, None, rounding, key, tensor_amax, gain
        )
        return quantize_pallas(
            x, plan, key, tensor_amax, config=config, hadamard=hadamard, signs=signs
        )

    return export_for_cuda(fn, *specs)


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
    plan = lowbit_qarray.make_plan((64, 128), "mxint8", 1, None, mode, "nearest", None, None)
    export_for_cuda(lambda x: quantize_pallas(x, plan, config=Config(16, 64)), spec)


def test_gpu_check_shapes_lower_for_cuda():
    # the default tiles of the 8192 x 8192 operands that gpu_check times, and float32 input
    for fmt, axis in (("mxfp4", -1), ("mxfp6_e2m3", 0), ("nvfp4", 0)):
        _export(fmt, axis, "nearest", shape=(8192, 8192))
    _export("nvfp4", -1, "stochastic", dtype=jnp.float32, tensor_amax=2.0)


@pytest.mark.parametrize("case", HADAMARD_CASES, ids=_hcase_id)
def test_hadamard_lowers_for_cuda(case: HCase):
    # the interpret-mode tests' tiles and shapes, and the default tile of a larger operand
    cfg = TestQuantizePallasInterpret().config(case.shape, case.fmt, case.axis, case.hadamard)
    kw = dict(hadamard=case.hadamard, signs=case.signs, gain=case.gain)
    exported = _export(
        case.fmt, case.axis, case.rounding, jnp.dtype(case.dtype), case.shape, cfg, **kw
    )
    n_kernels = 2 if case.fmt == "nvfp4" else 1  # NVFP4: the transformed tensor's amax first
    assert exported.mlir_module().count("xla.gpu.triton") == n_kernels
    _export(case.fmt, case.axis, case.rounding, jnp.bfloat16, (512, 512), **kw)


@pytest.mark.parametrize("case", GAIN_CASES, ids=_gain_id)
def test_gain_lowers_for_cuda(case):
    fmt, axis, rounding, gain = case
    cfg = TestQuantizePallasInterpret().config((32, 64), fmt, axis)
    _export(fmt, axis, rounding, shape=(32, 64), config=cfg, gain=gain)


# --------------------------------------------------------------------------------------------
# MS-EDEN and double-block scales (NVFP4's scale rules the kernel computes with lowbit's own
# arithmetic): bit for bit against the XLA path, codes, scales, tensor or outer scales and
# the values of lb.fake_quantize, on every kind of input below.

KINDS = ("gaussian", "heavy", "rows", "zeros", "specials")


def _kind_matrix(kind, shape, seed=0, dtype=jnp.float32) -> jax.Array:
    """Gaussian; heavy-tailed (student-t, df=2); row-scaled (each row and each column times
    10**u, u in [-6, 6], so lines along either axis differ by up to 12 decades); all zeros;
    Gaussian with a NaN, a +Inf, a -Inf, an all-zero line and values near 1e-30."""
    rng = np.random.default_rng(seed)
    if kind == "heavy":
        x = rng.standard_t(2, shape)
    elif kind == "zeros":
        x = np.zeros(shape)
    else:
        x = rng.standard_normal(shape)
    if kind == "rows":
        x = x * 10.0 ** rng.uniform(-6, 6, (shape[0], 1)) * 10.0 ** rng.uniform(-6, 6, shape[1])
    if kind == "specials":
        x[0, :] = 0.0
        x[:, 0] = 0.0
        x[1, 5] = np.nan
        x[2, 40 % shape[1]] = np.inf
        x[7, 3] = -np.inf
        x[3, :] = rng.standard_normal(shape[1]) * 1e-30
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


class ScaleCase(NamedTuple):
    """An NVFP4 scale-rule configuration: axis, rounding (``"eden"`` for MS-EDEN), outer block
    (None: MS-EDEN), fused Hadamard block (None: none), gain, input dtype, shape, tile."""

    axis: int
    rounding: str
    tensor_block: int | None
    hadamard: int | None
    gain: float
    dtype: str
    shape: tuple[int, int]
    tile: tuple[int, int]

    def kwargs(self) -> dict:
        signs = None if self.hadamard is None else random_signs(jax.random.key(3), self.hadamard)
        key = None if self.rounding == "nearest" else KEY
        return dict(rounding=self.rounding, key=key, tensor_block=self.tensor_block,
                    hadamard=self.hadamard, signs=signs, prescale=self.gain)


# MS-EDEN as Quartet II's backward runs it (after a random Hadamard of 128, along either axis)
# and without a transform; double-block scales (TetraJet-v2's 128, a partial last outer block
# along either axis: 320 = 2.5 outer blocks), stochastic with a gain, with a fused Hadamard
# transform, outer blocks of one block (16), and a tile holding several outer blocks.
SCALE_CASES = [
    ScaleCase(-1, "eden", None, None, 1.0, "float32", (40, 96), (8, 32)),
    ScaleCase(0, "eden", None, None, 1.0, "float32", (96, 40), (32, 8)),
    ScaleCase(-1, "eden", None, 128, 1.0, "float32", (24, 256), (8, 128)),
    ScaleCase(0, "eden", None, 128, 1.0, "bfloat16", (128, 48), (128, 16)),
    ScaleCase(-1, "nearest", 128, None, 1.0, "float32", (24, 320), (8, 128)),
    ScaleCase(0, "nearest", 128, None, 1.0, "float32", (320, 24), (128, 8)),
    ScaleCase(-1, "stochastic", 32, 16, 0.75, "float32", (24, 96), (8, 64)),
    ScaleCase(0, "nearest", 64, 64, 1.0, "bfloat16", (128, 40), (64, 16)),
    ScaleCase(-1, "stochastic", 16, None, 1.0, "float32", (24, 48), (8, 32)),
]


def _scale_id(case: ScaleCase) -> str:
    rule = "eden" if case.rounding == "eden" else f"outer{case.tensor_block}-{case.rounding}"
    h = f"-h{case.hadamard}" if case.hadamard else ""
    return f"axis{case.axis}-{rule}{h}-g{case.gain}-{case.dtype}"


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _fake_oracle(x, key, signs, axis, rounding, tensor_block, hadamard, gain):
    """The XLA path's fake-quantized values: lb.fake_quantize of the transformed tensor (the
    butterfly, the kernel's arithmetic), or for a gain the plan's fake quantizer (lowbit's
    fake_quantize takes no prescale)."""
    if hadamard is not None:
        x = lb.core.hadamard.hadamard_transform(x, hadamard, signs=signs, axis=axis,
                                                method="butterfly")
    if gain == 1.0:
        return lb.fake_quantize(x, "nvfp4", axis, rounding=rounding, key=key,
                                tensor_block=tensor_block)
    plan = lowbit_qarray.make_plan(x.shape, "nvfp4", axis, None, None, rounding, key, None,
                                   gain, tensor_block)
    return lowbit_qarray.fake_quantize_with_plan(x, key, None, plan, native=False)[0]


def _assert_same_values(y, ref, what):
    """Equal float arrays, bit for bit (the sign of zero included) except NaN's payload."""
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref), err_msg=what)
    ok = ~np.isnan(ref)
    np.testing.assert_array_equal(y.view(np.uint32)[ok], ref.view(np.uint32)[ok], err_msg=what)


@pytest.mark.parametrize("case", SCALE_CASES, ids=_scale_id)
def test_the_kernel_computes_ms_eden_and_double_block_scales(case: ScaleCase):
    kw = case.kwargs()
    cfg = Config(*case.tile)
    dtype = jnp.dtype(case.dtype)
    for seed, kind in enumerate(KINDS):
        x = _kind_matrix(kind, case.shape, seed, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback to the reference
            q = quantize(x, "nvfp4", case.axis, implementation="pallas", interpret=True,
                         config=cfg, **kw)
        ref = _lowbit(x, "nvfp4", case.axis, hadamard_method="butterfly", **kw)
        assert q.tensor_block == case.tensor_block, kind
        _assert_same_qarray(q, ref)
        if case.tensor_block is not None:  # one outer scale per tensor_block elements
            n = case.shape[case.axis]
            assert q.tensor_scale.shape == (case.shape[1 + case.axis], -(-n // case.tensor_block))
        y = lowbit_qarray.undo_prescale(_dequantize(q, None), case.gain)
        ref_y = lowbit_qarray.undo_prescale(_dequantize(ref, None), case.gain)
        _assert_same_values(y, ref_y, f"{kind}: values")
        # (a line of 1e-30 gives its outer block S ~ 1e-36, an all-zero block there s = 2**-9:
        # S * s is a float32 subnormal, which every implementation counts as 0, so those
        # elements quantize to 0 in lb.quantize and lb.fake_quantize alike)
        fake = _fake_oracle(x, kw["key"], kw["signs"], case.axis, case.rounding,
                            case.tensor_block, case.hadamard, case.gain)
        # lb.fake_quantize's values, NaN where they are NaN; the sign of a zero aside (with a
        # gain, lowbit's own values give a negative element that rounds to zero -0 jitted and
        # +0 eagerly, whether or not it runs outer blocks)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(fake, np.float32),
                                      err_msg=f"{kind}: values against lb.fake_quantize")
        if kind == "specials":  # a non-finite block: the NaN scale code
            assert np.any(np.asarray(q.scales) == lowbit_qarray.UE4M3_NAN)


def test_ms_eden_scales_depend_on_the_key_as_lowbits_do():
    x = _kind_matrix("gaussian", (16, 64), seed=4)
    cfg = Config(8, 32)
    a, b = (quantize(x, "nvfp4", rounding="eden", key=jax.random.key(k), config=cfg,
                     implementation="pallas", interpret=True) for k in (1, 2))
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))  # nearest
    assert np.mean(np.asarray(a.scales) != np.asarray(b.scales)) > 0.1
    _assert_same_qarray(b, _lowbit(x, "nvfp4", rounding="eden", key=jax.random.key(2)))


@pytest.mark.parametrize("tensor_block", [48, 2048])
def test_declined_outer_blocks_fall_back_with_a_warning(tensor_block):
    """An outer block that no power-of-two tile can span whole (48), or longer than the
    kernel's tiles go (2048): the api computes lowbit's result in XLA, with a warning that
    says why; the kernel's entry point refuses the plan."""
    from pallas_kernels.quantize.kernel import MAX_TENSOR_BLOCK, plan_unsupported

    assert tensor_block % 16 == 0 and (tensor_block > MAX_TENSOR_BLOCK or tensor_block % 3 == 0)
    x = _kind_matrix("gaussian", (8, 96 if tensor_block == 48 else 2048), seed=5)
    plan = lowbit_qarray.make_plan(x.shape, "nvfp4", 1, None, None, "nearest", None, None,
                                   tensor_block=tensor_block)
    why = plan_unsupported(plan)
    assert why is not None and f"tensor_block={tensor_block}" in why
    with pytest.warns(UserWarning, match=f"falling back .*tensor_block={tensor_block}"):
        q = quantize(x, "nvfp4", tensor_block=tensor_block, implementation="pallas",
                     interpret=True)
    _assert_same_qarray(q, _lowbit(x, "nvfp4", tensor_block=tensor_block))
    with pytest.raises(ValueError, match="does not compute tensor_block"):
        quantize_pallas(x, plan, config=Config(8, 64))


def test_supported_scale_rules_are_not_declined():
    from pallas_kernels.quantize.kernel import plan_unsupported

    for kw in (dict(rounding="eden", key=KEY), dict(tensor_block=128), dict(tensor_block=1024),
               dict(tensor_block=16, rounding="stochastic", key=KEY)):
        plan = lowbit_qarray.make_plan((8, 2048), "nvfp4", 1, None, None,
                                       kw.get("rounding", "nearest"), kw.get("key"), None,
                                       tensor_block=kw.get("tensor_block"))
        assert plan_unsupported(plan) is None, kw


def test_double_block_tiles_span_whole_outer_blocks():
    x = jnp.ones((32, 256))
    with pytest.raises(ValueError, match=r"block_cols=64 must be a multiple of tensor_block=128"):
        quantize(x, "nvfp4", tensor_block=128, config=Config(16, 64), implementation="pallas",
                 interpret=True)
    with pytest.raises(ValueError, match=r"block_rows=64 must be a multiple of tensor_block=128"):
        quantize(x.T, "nvfp4", 0, tensor_block=128, config=Config(64, 16),
                 implementation="pallas", interpret=True)
    for shape, axis, tb in (((4096, 4096), 1, 128), ((7, 100), 0, 128), ((16, 8192), 1, 1024),
                            ((8192, 64), 0, 1024), ((64, 512), 1, 16)):
        cfg = get_default(shape, "nvfp4", axis, tensor_block=tb)
        cfg.check("nvfp4", axis, tensor_block=tb)
        assert cfg.block_rows * cfg.block_cols <= 8192
        cfg = get_default(shape, "nvfp4", axis, hadamard=256, tensor_block=tb)
        cfg.check("nvfp4", axis, 256, tb)


def test_default_tiles_compute_ms_eden_and_double_block_scales():
    x = _kind_matrix("heavy", (48, 256), seed=6)
    for axis, kw in ((-1, dict(tensor_block=128)), (0, dict(rounding="eden", key=KEY))):
        q = quantize(x, "nvfp4", axis, implementation="pallas", interpret=True, **kw)
        _assert_same_qarray(q, _lowbit(x, "nvfp4", axis, **kw))


@pytest.mark.parametrize("case", SCALE_CASES, ids=_scale_id)
def test_ms_eden_and_double_block_lower_for_cuda(case: ScaleCase):
    """The interpret-mode tests' tiles and shapes, and the default tile of a larger bfloat16
    operand: one Triton kernel each (neither rule runs an amax pass first)."""
    for shape, cfg, dtype in ((case.shape, Config(*case.tile), jnp.dtype(case.dtype)),
                              ((512, 512), None, jnp.bfloat16)):
        cfg = cfg or get_default(shape, "nvfp4", case.axis, case.hadamard, case.tensor_block)
        specs = [jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((2,), jnp.uint32)]
        if case.hadamard:
            specs.append(jax.ShapeDtypeStruct((case.hadamard,), jnp.float32))

        def fn(x, key, signs=None, cfg=cfg):
            plan = lowbit_qarray.make_plan(x.shape, "nvfp4", case.axis % 2, None, None,
                                           case.rounding, key, None, case.gain,
                                           case.tensor_block)
            return quantize_pallas(x, plan, key, config=cfg, hadamard=case.hadamard,
                                   signs=signs)

        exported = export_for_cuda(fn, *specs)
        assert exported.mlir_module().count("xla.gpu.triton") == 1
