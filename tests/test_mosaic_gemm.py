"""quantized_gemm's Mosaic GPU path (``pallas_kernels.quantized_gemm.mosaic``) and the choice
of kernels by the GPU compiled for (``lowbit.gemm.implementation``).

Mosaic GPU has no interpret mode for TMEM, ``tcgen05`` or ``wgmma`` and no CPU lowering, so
on a CPU this file checks what can run here:

1. The wrapper around the kernels (the XLA quantization with the emulation's plans and keys,
   the padding of M, N and K to the kernels' tiles, the operands in the kernels' layout,
   NVFP4's tensor scales, the prescales undone) with each kernel's XLA ``reference`` in place
   of the kernel: the spec tests of ``tests/gemm_base.py`` (against the independent NumPy
   quantizer, and against the emulation for every recipe pair the family takes, stochastic
   rounding and Hadamard transforms included), to float32 accumulation tolerance, on shapes
   no tile divides.
2. The dispatch, by exporting for CUDA under an abstract GPU (``export_for_cuda``'s
   ``device_kind``): a B200 or an H100 lowers one Mosaic GPU call and no Triton kernel for the
   pairs its family takes, Triton for the others (weight-only, mixed formats, MXFP6 on
   Blackwell); an L40 (no Mosaic kernel) lowers Triton; ``gpu_kernels="triton"`` pins Triton
   and ``"mosaic"`` warns where it falls back; ``lb.dot_general``'s three GEMMs go the same
   way.
3. The kernels themselves compiled from ``lb.dot_general`` for a device-less B200 and H100
   (the PTX holds the block-scaled ``tcgen05.mma`` / FP8 ``wgmma``, no spills): run where the
   CUDA plugin is installed (``.venv-gpu``), one fresh process per target.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import lowbit as lb
from lowbit.gemm.implementation import GPU_KERNELS, gpu_arch, resolve
from lowbit.gemm.recipes import QuantSpec
from pallas_kernels._common import (
    MOSAIC_CUSTOM_CALL_TARGETS,
    TRITON_CUSTOM_CALL_TARGETS,
    abstract_gpu_mesh,
    export_for_cuda,
)
from pallas_kernels.quantized_gemm import kernel_supports, quantized_gemm
from pallas_kernels.quantized_gemm.mosaic import (
    family,
    kernel,
    module,
    mosaic_supports,
    quantized_gemm_mosaic,
    tile_multiples,
)
from tests.gemm_base import (
    HADAMARD_PAIRS,
    NUMPY_PAIRS,
    SUPPORTED,
    QuantizedGemmSpec,
    parametrize_gemm_spec,
)
from tests.mosaic_base import compile_reports, needs_plugin

B200, H100, L40 = "NVIDIA B200", "NVIDIA H100 80GB HBM3", "NVIDIA L40"


def pytest_generate_tests(metafunc):
    parametrize_gemm_spec(metafunc)


def taken(fam, pairs):
    return [p for p in pairs if kernel_supports(*p)[0] and mosaic_supports(fam, *p)[0]]


# --------------------------------------------------------------------------------------------
# 1. The wrapper, with the kernel's XLA reference in the kernel's place


class _Wrapper(QuantizedGemmSpec):
    fam: str
    exact = False
    shape = (24, 96, 40)  # M, N off every tile; K = 96 pads to 128 (and NVFP4's to 128 / 96)

    def gemm(self, pair, hadamard=None):
        reference = module(self.fam).reference
        fn = jax.jit(functools.partial(quantized_gemm_mosaic, spec_a=pair[0], spec_b=pair[1],
                                       fam=self.fam, hadamard=hadamard, matmul=reference))
        return lambda a, b, key_a, key_b, signs: fn(a, b, key_a, key_b, signs=signs)


class TestBlackwellWrapper(_Wrapper):
    fam = "blackwell"
    pairs = taken("blackwell", SUPPORTED)
    numpy_pairs = taken("blackwell", NUMPY_PAIRS)
    hadamard_pairs = taken("blackwell", HADAMARD_PAIRS)


class TestHopperWrapper(_Wrapper):
    fam = "hopper"
    pairs = taken("hopper", SUPPORTED)
    numpy_pairs = taken("hopper", NUMPY_PAIRS) + [(QuantSpec("mxfp6_e3m2"),) * 2]
    hadamard_pairs = taken("hopper", HADAMARD_PAIRS)


def test_each_family_serves_the_recipes_gemms():
    """The wrapper tests above are not vacuous: each family takes recipe pairs of every
    format it offers, stochastic rounding and prescales among them."""
    for fam, formats in (("blackwell", {"mxfp8_e4m3", "mxfp4", "nvfp4"}),
                         ("hopper", {"mxfp8_e4m3", "mxfp4", "nvfp4"})):
        pairs = taken(fam, SUPPORTED)
        assert {p[0].format for p in pairs} >= formats, fam
        assert any(p[0].stochastic for p in pairs) and any(p[0].prescale != 1 for p in pairs)
        assert len(taken(fam, HADAMARD_PAIRS)) >= 2


@pytest.mark.parametrize("fam,fmt,expected", [
    ("blackwell", "mxfp8_e4m3", (128, 128, 128)), ("blackwell", "mxfp4", (128, 128, 128)),
    ("blackwell", "nvfp4", (128, 128, 64)), ("hopper", "mxfp6_e2m3", (64, 128, 32)),
    ("hopper", "mxfp4", (64, 128, 64)), ("hopper", "nvfp4", (64, 128, 32)),
])
def test_tile_multiples_fit_the_kernels(fam, fmt, expected):
    """What the wrapper pads to is what the kernel's own checks accept: the kernel traces on
    operands of exactly those sizes (its ValueError otherwise), and not on half the K."""
    from pallas_kernels.mosaic_common import operand_shapes, positional_matmul

    assert tile_multiples(fam, fmt) == expected
    mod = module(fam)
    m, n, k = expected
    fn = positional_matmul(kernel(fam), fmt=fmt)
    specs = lambda k: [jax.ShapeDtypeStruct(s, d)  # noqa: E731
                       for s, d in operand_shapes(mod.FORMATS[fmt], m, n, k)]
    assert jax.eval_shape(fn, *specs(k)).shape == (m, n)
    if k // 2 % (16 if fmt == "nvfp4" else 32) == 0:  # half the K is still whole blocks
        with pytest.raises(ValueError, match=r"must be a multiple of"):
            jax.eval_shape(fn, *specs(k // 2))


def test_the_wrapper_pads_with_exact_zeros():
    """Zero codes and zero scales add nothing: the padded product equals the unpadded
    reference on the operands' own shape, for NaN-free data with blocks of huge range."""
    a = jnp.concatenate([jnp.full((3, 32), 2.0**100), jnp.full((3, 32), 2.0**-100)], axis=1)
    b = jnp.ones((64, 5))
    spec = QuantSpec("mxfp8_e4m3")
    ref = module("blackwell").reference
    c = quantized_gemm_mosaic(a, b, None, None, spec_a=spec, spec_b=spec, fam="blackwell",
                              matmul=ref)
    assert c.shape == (3, 5)
    assert float(c[0, 0]) == 32 * 2.0**100 + 32 * 2.0**-100


# --------------------------------------------------------------------------------------------
# 2. The dispatch


def test_gpu_arch_reads_the_abstract_device():
    for kind, arch in ((H100, (9, 0)), ("NVIDIA H200", (9, 0)), (B200, (10, 0)),
                       ("NVIDIA GB300", (10, 3)), (L40, None)):
        with jax.sharding.use_abstract_mesh(abstract_gpu_mesh(kind)):
            assert gpu_arch() == arch, kind
    assert gpu_arch() is None  # this CPU


def test_family_by_compute_capability():
    assert [family(a) for a in ((10, 0), (10, 3), (9, 0), (12, 0), (8, 9), (9, 1), None)] == \
        ["blackwell", "blackwell", "hopper", None, None, None, None]


def test_gpu_kernels_is_checked():
    assert resolve("pallas").gpu_kernels == "auto" and GPU_KERNELS == ("auto", "mosaic",
                                                                       "triton")
    with pytest.raises(ValueError, match=r"gpu_kernels must be one of .* got 'cuda'"):
        resolve("pallas", gpu_kernels="cuda")
    with pytest.raises(ValueError, match=r"fam must be one of"):
        mosaic_supports("ampere", QuantSpec("mxfp4"), QuantSpec("mxfp4"))


def _calls(text: str, targets) -> int:
    return sum(text.count(f"custom_call @{t}(") + text.count(f'call_target_name = "{t}"')
               for t in targets)


def _lowered(pair, device_kind, implementation="pallas", m=200, k=256, n=100):
    f32, key = jax.ShapeDtypeStruct, jax.ShapeDtypeStruct((2,), jnp.uint32)
    fn = lambda a, b, ka, kb: quantized_gemm(a, b, *pair, ka, kb,  # noqa: E731
                                             implementation=implementation)
    text = export_for_cuda(fn, f32((m, k), jnp.float32), f32((k, n), jnp.float32), key, key,
                           device_kind=device_kind).mlir_module()
    return _calls(text, MOSAIC_CUSTOM_CALL_TARGETS), _calls(text, TRITON_CUSTOM_CALL_TARGETS)


MX4, NV4, MX8 = QuantSpec("mxfp4"), QuantSpec("nvfp4"), QuantSpec("mxfp8_e4m3")
SR_NV4 = QuantSpec("nvfp4", rounding="stochastic")


@pytest.mark.parametrize("kind,pair,expected", [
    (B200, (MX4, MX4), (1, 0)),
    (B200, (NV4, SR_NV4), (1, 0)),
    (H100, (MX8, MX8), (1, 0)),
    (H100, (QuantSpec("mxfp6_e2m3"),) * 2, (1, 0)),
    (B200, (QuantSpec("mxfp6_e2m3"),) * 2, (0, 3)),  # no FP6 tcgen05 in Mosaic GPU
    (B200, (None, MX4), (0, 2)),  # weight-only: Triton's float32 operand
    (H100, (MX8, MX4), (0, 3)),  # mixed formats
    (L40, (MX4, MX4), (0, 3)),  # no Mosaic kernel for sm_89
], ids=lambda v: v if isinstance(v, str) else None)
def test_the_gpu_exported_for_picks_the_kernels(kind, pair, expected):
    assert _lowered(pair, kind) == expected


def test_gpu_kernels_triton_pins_triton_and_mosaic_warns_where_it_falls_back():
    assert _lowered((MX4, MX4), B200, resolve("pallas", gpu_kernels="triton")) == (0, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _lowered((MX4, MX4), B200, resolve("pallas", gpu_kernels="mosaic")) == (1, 0)
    with pytest.warns(UserWarning, match=r"Triton kernels instead of Mosaic GPU: a weight-only"):
        _lowered((None, MX4), B200, resolve("pallas", gpu_kernels="mosaic"))
    with pytest.warns(UserWarning, match=r"compute capability None has no Mosaic GPU kernel"):
        _lowered((MX4, MX4), L40, resolve("pallas", gpu_kernels="mosaic"))


def _gemm_pairs(recipe: str):
    r = lb.recipes.get(recipe)
    return [(g.lhs, g.rhs) for g in (r.fwd, r.dlhs, r.drhs)]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_dot_generals_three_gemms_dispatch_alike(recipe):
    """Forward and both backward GEMMs of ``lb.dot_general``: each on Mosaic GPU on a B200
    where the family takes its pair, on Triton where only Triton does, emulated elsewhere."""
    x = jax.ShapeDtypeStruct((2, 64, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 128), jnp.float32)

    def step(x, w):
        return jax.grad(lambda x, w: jnp.sum(lb.dot_general(
            x, w, (((2,), (0,)), ((), ())), recipe=recipe, key=jax.random.key(0),
            implementation="pallas") ** 2),
            argnums=(0, 1))(x, w)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulated GEMMs say why
        text = export_for_cuda(step, x, w, device_kind=B200).mlir_module()
    pairs = [p for p in _gemm_pairs(recipe) if kernel_supports(*p)[0]]
    mosaic = [p for p in pairs if mosaic_supports("blackwell", *p)[0]]
    triton = sum(sum(s is not None for s in p) + 1 for p in pairs if p not in mosaic)
    assert mosaic, recipe
    assert _calls(text, MOSAIC_CUSTOM_CALL_TARGETS) == len(mosaic)
    assert _calls(text, TRITON_CUSTOM_CALL_TARGETS) == triton


# --------------------------------------------------------------------------------------------
# 3. The kernels compiled from quantized_gemm for a device-less B200 / H100


GEMM_COMPILES = {  # id: compile_gemm_report's (fmt, m, k, n) and keywords
    "b200": {"mxfp8": (("mxfp8_e4m3", 256, 512, 256), {}),
             "mxfp4": (("mxfp4", 200, 512, 100), {}),
             "nvfp4-sr": (("nvfp4", 256, 512, 256), {"stochastic": True})},
    "h100": {"mxfp8": (("mxfp8_e4m3", 256, 512, 256), {}),
             "mxfp4": (("mxfp4", 200, 512, 100), {}),
             "nvfp4": (("nvfp4", 256, 512, 256), {}),
             "mxfp6": (("mxfp6_e3m2", 256, 512, 256), {})},
}
PTX_FORMS = {"b200": r"tcgen05\.mma\.cta_group::1\.kind::(mxf8f6f4|mxf4|mxf4nvf4)\.block_scale",
             "h100": r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e[45]m[23]\.e[45]m[23]"}


@needs_plugin
@pytest.mark.parametrize("target", ["b200", "h100"])
def test_quantized_gemm_compiles_to_the_native_mma(target):
    calls = {name: (args, {**kw, "target": target})
             for name, (args, kw) in GEMM_COMPILES[target].items()}
    reports = compile_reports("pallas_kernels.quantized_gemm.mosaic_report", calls,
                              function="compile_gemm_report")
    for name in GEMM_COMPILES[target]:
        r = reports[name]
        assert re.search(PTX_FORMS[target], "\n".join(r["mma"])), (name, r["mma"])
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        assert r["triton_kernels"] == 0, name


# --------------------------------------------------------------------------------------------
# gpu_check's Mosaic GPU section


def test_gpu_checks_mosaic_section_runs_its_course(monkeypatch, capsys):
    """``mosaic_check.check_gpu`` as on an H100, on this CPU: every quantized_gemm here runs
    the emulation branch and the kernel alone is its XLA reference, so what is checked is the
    section's own flow (operands, tolerance, timing, the line it prints per format), not the
    kernel; and on a GPU without a Mosaic kernel it says both families are compiled only."""
    from pallas_kernels import gpu_check, mosaic_check

    run = gpu_check.GpuRun(budget_s=600)
    mosaic_check.check_gpu(run, [])
    out = capsys.readouterr().out
    assert "blackwell: compiled only" in out and "hopper: compiled only" in out
    shape = (16, 128, 64)
    run.dot_time[shape] = 1e-3
    monkeypatch.setattr(mosaic_check, "kernel",
                        lambda fam: module(fam).reference)
    monkeypatch.setattr(mosaic_check, "family_formats", lambda fam: ["mxfp6_e3m2", "nvfp4"])
    monkeypatch.setattr(mosaic_check, "time_fn",  # one call, not gpu_check's 50 timed ones
                        lambda fn, args: (jax.block_until_ready(fn(*args)), 1e-3)[1])
    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh(H100)):
        mosaic_check.check_gpu(run, [shape])
    out = capsys.readouterr().out
    assert run.failures == [] and "blackwell: compiled only" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("mosaic hopper")]
    assert len(lines) == 2
    assert all(": ok (excess" in ln and "x its roofline" in ln for ln in lines), lines
