"""pallas_kernels.quantized_gemm: one GEMM of lowbit.dot_general, emulation or kernels.

The spec tests are written once (tests/gemm_base.py) and run here per implementation: the
pure-XLA emulation, "pallas" on CPU, the compiled CPU kernel, and the Pallas path in interpret
mode. On CPU the op must be the XLA emulation bit for bit (``lax.platform_dependent`` keeps its
``default`` branch), for every operand-spec pair any registered recipe uses, stochastic
rounding and high-precision (None) operands included. The Pallas path is checked two ways
without a GPU: in interpret mode against the emulation to float32-accumulation tolerance, and
by lowering for CUDA through jax.export: the exported module must hold the Triton custom calls
(one per quantized operand, one for the matmul), a CPU export none.

Tolerance (as tests/test_pallas_matmul.py): the quantized operands are the same values on both
paths, so C differs only in the order of K float32 additions and NVFP4's tensor scales applied
to the sum:
``|C - C_ref| <= (2 K + 8) * 2**-24 * (|A_q| @ |B_q|)``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lowbit as lb
from lowbit.core.hadamard import random_signs
from lowbit.gemm.implementation import resolve
from lowbit.gemm.operand import quantize_operand
from lowbit.gemm.recipes import GemmSpec, QuantSpec, Recipe
from pallas_kernels._common import TRITON_CUSTOM_CALL_TARGETS, export_for_cuda, on_gpu
from pallas_kernels.quantized_gemm import kernel_supports, quantized_gemm
from tests.dot_general_base import BTK96_KN, BTK_KN, MK_KN, DotGeneralSpec, parametrize_spec
from tests.gemm_base import (
    KEY_A,
    KEY_B,
    PAIRS,
    SR4,
    SR4P,
    SUPPORTED,
    QuantizedGemmSpec,
    data,
    pair_id,
    parametrize_gemm_spec,
    recipe_pairs,
    spec_name,
)

cpu_only = pytest.mark.skipif(on_gpu(), reason="checks the CPU (emulation) branch")
native_only = pytest.mark.skipif(not lb.native.available(), reason="no compiled CPU kernel")

_name, _ids, _data, _recipe_pairs = spec_name, pair_id, data, recipe_pairs


def pytest_generate_tests(metafunc):
    parametrize_gemm_spec(metafunc)
    parametrize_spec(metafunc)  # the dot_general spec's subclasses (below)


def _emulation(a, b, spec_a, spec_b, key_a, key_b):
    """What lowbit.dot_general computes for this GEMM (written out, not imported)."""
    return lax.dot_general(
        quantize_operand(a, spec_a, 1, 0, key_a),
        quantize_operand(b, spec_b, 0, 1, key_b),
        (((1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


# --------------------------------------------------------------------------------------------
# The spec tests (tests/gemm_base.py), once per implementation


@cpu_only
class TestXLA(QuantizedGemmSpec):
    """implementation="xla": the pure-XLA emulation is the reference itself, so only the NumPy
    comparison applies (comparing it with the emulation would compare one program with itself:
    57 s of the suite's CPU time for nothing)."""

    implementation = "xla"
    test_matches_the_emulation = None
    test_hadamard_along_k = None


@cpu_only
class TestPallasOnCPU(QuantizedGemmSpec):
    """implementation="pallas" on CPU lowers the emulation branch: bit for bit."""

    implementation = "pallas"


@cpu_only
@native_only
class TestCompiledCPUKernel(QuantizedGemmSpec):
    """implementation=None with the compiled CPU kernel forced on (the test process has
    several CPU devices, where ``auto`` keeps it off): the same bits."""

    implementation = None
    native = "on"


INTERPRET_PAIRS = [
    (QuantSpec("mxfp8_e4m3", scale_mode="rceil"),) * 2,
    (QuantSpec("mxfp4"),) * 2,
    (QuantSpec("nvfp4"),) * 2,
    (SR4, SR4),
    (None, QuantSpec("mxfp4")),
    (QuantSpec("mxfp4", clip_rms=2.92),) * 2,
    (SR4P, SR4P),
]


class TestPallasInterpret(QuantizedGemmSpec):
    """The kernel path in Pallas interpret mode: the same quantized operands, float32 sums in
    the kernel's order (tolerance). Interpret mode is slow: a few pairs, small shapes."""

    interpret = True
    exact = False
    pairs = INTERPRET_PAIRS
    numpy_pairs = [(QuantSpec("mxfp6_e2m3"), QuantSpec("nvfp4")), (None, QuantSpec("mxfp4"))]
    hadamard_sizes = (16,)
    shape = (32, 64, 32)

    def test_runs_the_kernels(self):
        a, b = data(32, 64, 32)
        fn = functools.partial(quantized_gemm, spec_a=QuantSpec("mxfp4"),
                               spec_b=QuantSpec("mxfp4"), interpret=True)
        assert "pallas_call" in str(jax.make_jaxpr(fn)(a, b))

    @pytest.mark.parametrize("spec", [SR4P, QuantSpec("mxfp4", clip_rms=2.92)], ids=spec_name)
    def test_the_quantize_kernels_transform_unless_a_clip_reads_the_rotation(self, spec):
        a, b = data(32, 64, 32)

        def fn(a, b, signs):
            return quantized_gemm(a, b, spec, spec, KEY_A, KEY_B, hadamard=16, signs=signs,
                                  interpret=True)

        jaxpr = str(jax.make_jaxpr(fn)(a, b, random_signs(jax.random.key(0), 16)))
        names = set(re.findall(r"name=(quantize_\w+)", jaxpr))
        fused = spec.clip_rms is None
        suffix = "_hadamard16" if fused else ""
        assert names == {f"quantize_mxfp4_axis1{suffix}", f"quantize_mxfp4_axis0{suffix}"}


def _jit(fn, pair, **kw):
    return jax.jit(functools.partial(fn, spec_a=pair[0], spec_b=pair[1], **kw))


# --------------------------------------------------------------------------------------------
# CPU: the emulation, bit for bit


@cpu_only
def test_cpu_eager_is_the_eager_emulation():
    a, b = _data(16, 64, 16, seed=1)
    pair = (None, SR4)  # eager lowbit dispatches op by op: one quantized operand is enough
    c = quantized_gemm(a, b, *pair, KEY_A, KEY_B)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(_emulation(a, b, *pair, KEY_A, KEY_B)))


@cpu_only
def test_keys_are_the_ones_dot_general_passes():
    """The forward GEMM of lowbit.dot_general (no Hadamard) is quantized_gemm with the keys
    dot_general derives for its two operands."""
    from lowbit.gemm.operand import fold_key as _fold

    spec = SR4
    recipe = Recipe("gemm_test", fwd=GemmSpec(spec, QuantSpec("nvfp4", rounding="stochastic")))
    x, w = _data(16, 64, 24, seed=2)
    key = jax.random.key_data(jax.random.key(5))
    y = jax.jit(lambda x, w, k: lb.dot_general(x, w, (((1,), (0,)), ((), ())), recipe, k))(
        x, w, key
    )
    c = _jit(quantized_gemm, (recipe.fwd.lhs, recipe.fwd.rhs))(
        x, w, key_a=_fold(key, 0, 0), key_b=_fold(key, 0, 1)
    )
    np.testing.assert_array_equal(np.asarray(c), np.asarray(y))


# --------------------------------------------------------------------------------------------
# kernel_supports


def test_kernel_supports():
    assert kernel_supports(QuantSpec("mxfp4"), QuantSpec("nvfp4")) == (True, "")
    assert kernel_supports(None, SR4) == (True, "")
    assert kernel_supports(QuantSpec("mxfp4", block_shape=(32,)), None)[0]
    for pair, why in [
        ((QuantSpec("e4m3", granularity="tensor"), QuantSpec("mxfp4")), "granularity='tensor'"),
        ((QuantSpec("nvfp4"), QuantSpec("nvfp4", block_shape=(16, 16))), "2-D block_shape"),
        ((QuantSpec("mxfp4", block_shape=(16,)), None), "not mxfp4's own block"),
        ((None, None), "both operands are high precision"),
    ]:
        ok, reason = kernel_supports(*pair)
        assert not ok and why in reason, reason
    with pytest.raises(TypeError, match="QuantSpec"):
        kernel_supports("mxfp4", None)
    assert kernel_supports(SR4P, SR4P) == (True, "")  # a prescale gain is the kernel's gain
    # every recipe's GEMMs but per-tensor FP8, NVFP4's 16x16 weight tiles and QuEST's
    # std-scaled forward (quartet's)
    for pair in _recipe_pairs():
        tiles = any(s is not None and s.block_shape == (16, 16) for s in pair)
        tensor = any(s is not None and s.granularity == "tensor" for s in pair)
        quest = any(s is not None and s.scale_std is not None for s in pair)
        # int8 per token (bitnet, w*a8) and int4 / ternary weights run in the emulation
        rows = any(s is not None and s.granularity == "row" for s in pair)
        ints = any(s is not None and s.format in ("int4", "ternary") for s in pair)
        # MS-EDEN's corrected scales and double-block scales run in the emulation
        fos = any(s is not None and (s.rounding == "eden" or s.tensor_block is not None)
                  for s in pair)
        pow2 = any(s is not None and s.pow2_tensor_scale for s in pair)  # power-of-two t
        expected = not (tensor or tiles or quest or rows or ints or fos or pow2)  # W-only too
        assert kernel_supports(*pair)[0] == expected
    assert kernel_supports(QuantSpec("nvfp4", scale_mode="4over6"), None) == (True, "")
    ok, reason = kernel_supports(QuantSpec("nvfp4", rounding="eden"), None)
    assert not ok and "MS-EDEN" in reason
    ok, reason = kernel_supports(QuantSpec("nvfp4", tensor_block=128), None)
    assert not ok and "double-block" in reason
    ok, reason = kernel_supports(QuantSpec("mxfp4", scale_std=2.9), None)
    assert not ok and "scale_std=2.9" in reason
    ok, reason = kernel_supports(QuantSpec("nvfp4", pow2_tensor_scale=True), None)
    assert not ok and "power-of-two tensor scale runs in the emulation" in reason
    static = QuantSpec("nvfp4", amax=3.0)  # a calibrated static amax: the emulation runs
    ok, reason = kernel_supports(static, QuantSpec("nvfp4"))
    assert not ok and "static (calibrated) amax" in reason


def test_rejects_bad_arguments():
    a, b = _data(16, 64, 16)
    spec = QuantSpec("mxfp4")
    with pytest.raises(ValueError, match="contraction sizes differ"):
        quantized_gemm(a, b[:32], spec, spec)
    with pytest.raises(ValueError, match="2-D matrix"):
        quantized_gemm(a[None], b, spec, spec)
    with pytest.raises(TypeError, match="floating-point"):
        quantized_gemm(a.astype(jnp.int32), b, spec, spec)
    with pytest.raises(ValueError, match="pass its key"):
        quantized_gemm(a, b, spec, SR4, KEY_A, None)
    with pytest.raises(TypeError, match="key_a"):
        quantized_gemm(a, b, SR4, spec, jnp.zeros((3,), jnp.uint32))


# --------------------------------------------------------------------------------------------
# The Pallas path in interpret mode, against the emulation


def test_interpret_with_unsupported_specs_warns_and_emulates():
    a, b = _data(16, 64, 16, seed=4)
    pair = (QuantSpec("e4m3", granularity="tensor"), QuantSpec("mxfp4"))
    with pytest.warns(UserWarning, match="granularity='tensor'"):
        c = _jit(quantized_gemm, pair, interpret=True)(a, b)
    np.testing.assert_array_equal(
        np.asarray(c), np.asarray(_jit(_emulation, pair)(a, b, key_a=None, key_b=None))
    )


# --------------------------------------------------------------------------------------------
# Lowering: the kernels for CUDA, the emulation for CPU


def _triton_calls(text: str) -> int:
    """Triton custom calls in exported StableHLO text (pretty or generic form)."""
    return sum(
        text.count(f"custom_call @{t}(") + text.count(f'call_target_name = "{t}"')
        for t in TRITON_CUSTOM_CALL_TARGETS
    )


def _arg_specs(m, k, n):
    f32, key = jax.ShapeDtypeStruct, jax.ShapeDtypeStruct((2,), jnp.uint32)
    return f32((m, k), jnp.float32), f32((k, n), jnp.float32), key, key


def _fn(pair):
    return lambda a, b, key_a, key_b: quantized_gemm(a, b, *pair, key_a, key_b)


@pytest.mark.parametrize("pair", SUPPORTED, ids=_ids)
def test_kernel_path_lowers_for_cuda(pair):
    specs = _arg_specs(256, 512, 128)
    exported = export_for_cuda(_fn(pair), *specs)
    assert exported.platforms == ("cuda",)
    # one quantize kernel per quantized operand, one matmul
    assert _triton_calls(exported.mlir_module()) == sum(s is not None for s in pair) + 1
    cpu = jax.export.export(jax.jit(_fn(pair)), platforms=["cpu"])(*specs)
    assert _triton_calls(cpu.mlir_module()) == 0


@pytest.mark.parametrize("pair", [p for p in PAIRS if p not in SUPPORTED], ids=_ids)
def test_unsupported_specs_lower_the_emulation_for_cuda(pair):
    exported = export_for_cuda(_fn(pair), *_arg_specs(64, 128, 32))
    assert _triton_calls(exported.mlir_module()) == 0


def test_unaligned_shapes_lower_for_cuda():
    pair = (QuantSpec("nvfp4", rounding="stochastic"), QuantSpec("mxfp6_e3m2"))
    exported = export_for_cuda(_fn(pair), *_arg_specs(20, 80, 24))
    assert _triton_calls(exported.mlir_module()) == 3


# --------------------------------------------------------------------------------------------
# lowbit.dot_general(..., implementation="pallas"): all three GEMMs through quantized_gemm

_DN3 = (((2,), (0,)), ((), ()))  # x [B, T, K] . w [K, N]
# quartet's scheme (QuEST forward in the emulation, the backward GEMMs on its quantized
# operands through the kernels, trust masks) with nearest rounding in the backward, whose
# stochastic draws would differ for the kernels' transposed operands
_Q = lb.recipes.get("quartet")
_QB = dataclasses.replace(_Q.dlhs.lhs, rounding="nearest")
QUARTET_NEAREST = _Q.replace(
    name="quartet_nearest",
    dlhs=dataclasses.replace(_Q.dlhs, lhs=_QB, rhs=_QB),
    drhs=dataclasses.replace(_Q.drhs, lhs=_QB, rhs=_QB),
)
NEAREST_RECIPES = ["mxfp8", "mxfp4", "nvfp4", "fp8", "qat_mxfp4", "qat_nvfp4", QUARTET_NEAREST]


# The dot_general spec (tests/dot_general_base.py) per implementation of the kernel path: the
# three GEMMs against the independent reference, on the layouts the kernels take (2-D, and
# leading axes with 256 tokens). On CPU, "pallas" lowers the emulation branch of each GEMM;
# in interpret mode the Pallas quantize and matmul kernels themselves run every GEMM, the
# backward's transposed operands included (elsewhere only a GPU runs them).


@cpu_only
class TestDotGeneralPallasOnCPU(DotGeneralSpec):
    implementation = "pallas"
    recipes = tuple(NEAREST_RECIPES)
    cases = (BTK_KN, BTK96_KN)
    exact = False


class TestDotGeneralPallasInterpret(DotGeneralSpec):
    implementation = resolve("pallas", interpret=True)
    recipes = ("mxfp4", QUARTET_NEAREST)  # MX kernels in all three GEMMs; fused Hadamard
    cases = (MK_KN, BTK96_KN)  # (flattened tokens: 2 x 96, blocks of 32 within a sequence)
    exact = False


@cpu_only
def test_dot_general_pallas_falls_back_for_other_dimension_numbers():
    x = jax.random.normal(jax.random.key(0), (2, 64, 128))
    w = jax.random.normal(jax.random.key(1), (2, 128, 32))
    dn = (((2,), (1,)), ((0,), (0,)))  # batched: not a plain x @ w, so the emulation
    f = lambda impl: lb.dot_general(x, w, dn, recipe="mxfp4", implementation=impl)  # noqa: E731
    with pytest.warns(UserWarning, match=r"emulation instead of the kernels.*no batch dims"):
        y = f("pallas")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(f("xla")))
    with pytest.raises(ValueError, match="implementation"):
        f("triton")


@cpu_only
def test_dot_general_pallas_fallback_names_the_token_constraint():
    """Leading axes whose token axis is no multiple of the recipe's blocks along it (MXFP4:
    32) would split blocks when flattened: an explicit "pallas" says so; None (the best
    available) falls back without a word."""
    x = jax.random.normal(jax.random.key(0), (2, 48, 64))
    w = jax.random.normal(jax.random.key(1), (64, 32))
    dn = (((2,), (0,)), ((), ()))
    msg = r"token axis \(48\) must be a multiple of 32 \(recipe mxfp4"
    with pytest.warns(UserWarning, match=msg):
        y = lb.dot_general(x, w, dn, recipe="mxfp4", implementation="pallas")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = lb.dot_general(x, w, dn, recipe="mxfp4", implementation=None)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))


def test_dot_general_pallas_lowers_the_kernels_for_cuda():
    """The training step's forward and backward GEMMs all lower to Triton kernels for CUDA:
    3 GEMMs x (2 quantize kernels + 1 matmul) for mxfp4; none for CPU."""

    def step(x, w, key):
        def loss(x, w):
            y = lb.dot_general(x, w, _DN3, recipe="mxfp4", key=key, implementation="pallas")
            return jnp.sum(y * y)

        return jax.grad(loss, (0, 1))(x, w)

    specs = (
        jax.ShapeDtypeStruct((2, 256, 128), jnp.float32),
        jax.ShapeDtypeStruct((128, 64), jnp.float32),
        jax.ShapeDtypeStruct((2,), jnp.uint32),
    )
    exported = export_for_cuda(step, *specs)
    assert _triton_calls(exported.mlir_module()) == 9
    cpu = jax.export.export(jax.jit(step), platforms=["cpu"])(*specs)
    assert _triton_calls(cpu.mlir_module()) == 0
