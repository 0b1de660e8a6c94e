"""The compiled CPU kernel (``lowbit.core.native``): bit-identical to the XLA path everywhere
``fake_quantize`` can send it (1-D blocks, 2-D tiles, and a fused Hadamard transform, against
``hadamard_transform(method="butterfly")`` then the XLA path); its policy and its build.

Every comparison traces the same function twice, under ``lb.native.mode("off")`` (the XLA
emulation) and ``mode("on")`` (the kernel), checks that the second really contains the custom
call, and requires the same NaN positions and the same bits everywhere else. The conftest's
four host devices make the default policy ("auto") pick the XLA path for the rest of the
suite, so these tests are where the kernel is exercised. The spec tests against the NumPy
reference (tests/reference.py: ties, saturation, special blocks, the NVFP4 division-sensitive
inputs) run for the kernel from the shared base, tests/test_quantizer_native.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.core import native
from lowbit.core import qarray as _qa

needs_kernel = pytest.mark.skipif(
    not native.available(), reason=f"no native CPU kernel: {native.why_unavailable()}"
)
FORMATS = lb.formats.names()
MX = [f for f in FORMATS if not lb.formats.get(f).tensor_scale]
RNG = np.random.default_rng(7)


def hard_values(shape, seed=0) -> np.ndarray:
    """Magnitudes over 2**-60 .. 2**60, zeros, NaN, +-Inf, a block of subnormals, a block
    of tiny normals and one near float32's max: every special case of the block scale."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-60, 61, shape))
    flat = x.reshape(-1)
    n = flat.size
    flat[:: max(1, n // 23)] = 0.0
    flat[n // 9 : n // 9 + 32] = 1e-40  # flushed to zero on CPU
    flat[n // 5 : n // 5 + 40] = rng.standard_normal(40) * 1e-37
    flat[n // 3 : n // 3 + 40] = np.clip(rng.standard_normal(40) * 3e38, -3.4e38, 3.4e38)
    flat[n // 2] = np.nan
    flat[2 * n // 3] = np.inf
    flat[3 * n // 4] = -np.inf
    return x.astype(np.float32)


def _compiled(fn, args):
    """``fn(*args)`` jitted (a fresh function, so no trace is reused across modes), and the
    text of its lowering."""
    lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
    return lowered.compile()(*args), lowered.as_text()


def both(fn, *args):
    """``fn(*args)`` under the XLA path and under the kernel."""
    with native.mode("off"):
        want, text = _compiled(fn, args)
        assert native.TARGET not in text
    with native.mode("on"):
        got, text = _compiled(fn, args)
        assert native.TARGET in text, "the kernel was not used"
    return want, got


def assert_identical(want, got):
    want, got = np.asarray(want), np.asarray(got)
    assert want.shape == got.shape and want.dtype == got.dtype
    nan_w, nan_g = np.isnan(want.astype(np.float32)), np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(nan_w, nan_g, err_msg="NaN positions differ")
    bits = {2: np.uint16, 4: np.uint32}[want.dtype.itemsize]
    w, g = want.view(bits)[~nan_w], got.view(bits)[~nan_g]
    bad = np.nonzero(w != g)[0]
    examples = f"{want[~nan_w][bad[:4]]} vs {got[~nan_g][bad[:4]]}"
    assert bad.size == 0, f"{bad.size} values differ, e.g. {examples}"


def _key(rounding):
    return jax.random.key(11) if rounding == "stochastic" else None


# --------------------------------------------------------------------------------------------
# Numerics: the kernel against the XLA path


@needs_kernel
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(
    "fmt,scale_mode",
    [(f, m) for f in MX for m in _qa.SCALE_MODES] + [("nvfp4", None)],
)
def test_every_format_scale_mode_and_rounding_matches_the_xla_path(fmt, scale_mode, rounding):
    x = jnp.asarray(hard_values((48, 160)))
    key = _key(rounding)
    want, got = both(
        lambda x: lb.fake_quantize(x, fmt, scale_mode=scale_mode, rounding=rounding, key=key), x
    )
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize(
    "shape,axis,block",
    [
        ((40, 70), -1, None),  # padded last axis
        ((70, 40), 0, None),  # blocks down the rows (strided), padded
        ((3, 50, 6), 1, 16),  # middle axis
        ((2, 3, 4, 96), 2, 8),  # short axis padded to one block
        ((130,), 0, 64),  # rank 1
        ((5, 24), -1, 24),  # a block that is neither 16 nor 32
    ],
)
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e3m2", "mxint8", "nvfp4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_axes_blocks_and_padding_match_the_xla_path(shape, axis, block, fmt, rounding):
    if block is not None and block % {4: 2, 6: 4}.get(lb.formats.get(fmt).elem.bits, 1):
        pytest.skip("block does not pack")
    x = jnp.asarray(hard_values(shape, seed=len(shape)))
    bs = None if block is None else (block,)
    key = _key(rounding)
    want, got = both(
        lambda x: lb.fake_quantize(x, fmt, axis, rounding=rounding, key=key, block_shape=bs), x
    )
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("axis", [0, 1])
def test_large_arrays_split_over_threads_match(rounding, axis):
    """Above 2**16 elements the work is split over the XLA thread pool."""
    x = jnp.asarray(hard_values((512, 384), seed=3))
    key = _key(rounding)
    for fmt in ("mxfp8_e4m3", "nvfp4"):
        want, got = both(
            lambda x, fmt=fmt: lb.fake_quantize(x, fmt, axis, rounding=rounding, key=key), x
        )
        assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs_match(dtype):
    x = jnp.asarray(RNG.standard_normal((16, 64)) * 50, dtype)
    for fmt in ("mxfp4", "mxfp8_e5m2", "nvfp4"):
        want, got = both(lambda x, fmt=fmt: lb.fake_quantize(x, fmt), x)
        assert got.dtype == dtype
        assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("fmt", ["mxfp4", "mxint8", "nvfp4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_element_gain_matches(fmt, rounding):
    """Recipes scale elements by 3/4 before rounding (and divide after): plan.prescale."""
    x = jnp.asarray(hard_values((8, 96), seed=5))
    key = None if rounding == "nearest" else jax.random.key_data(jax.random.key(2))
    plan = _qa.make_plan(x.shape, fmt, -1, None, None, rounding, key, None, prescale=0.75)
    want, got = both(lambda x: _qa.fake_quantize_with_plan(x, key, None, plan, False)[0], x)
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("tensor_amax", [0.0, 1e-36, 0.5, 3.0, 1e6])
def test_nvfp4_calibrated_tensor_amax_matches(tensor_amax):
    """A calibrated amax below the data's clips block scales at 448; 0 and tiny values make
    the tensor scale 0 (or subnormal, flushed), zeroing every block."""
    x = jnp.asarray(RNG.standard_normal((16, 64)).astype(np.float32))
    want, got = both(
        lambda x, t: lb.fake_quantize(x, "nvfp4", tensor_amax=t), x, jnp.float32(tensor_amax)
    )
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_blocks_of_zeros_and_tiny_values_match(fmt):
    x = np.zeros((4, 64), np.float32)
    x[1, :32] = 1e-40
    x[2, :] = 2.0**-126
    x[3, :16] = -(2.0**-120)
    want, got = both(lambda x: lb.fake_quantize(x, fmt), jnp.asarray(x))
    assert_identical(want, got)


# --------------------------------------------------------------------------------------------
# The kernel against the independent numpy reference


# --------------------------------------------------------------------------------------------
# Transformations


@needs_kernel
@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "nvfp4"])
def test_vmap_nearest_matches(fmt):
    x = jnp.asarray(hard_values((3, 8, 64), seed=9))
    want, got = both(jax.vmap(lambda x: lb.fake_quantize(x, fmt)), x)
    assert_identical(want, got)
    want, got = both(jax.vmap(jax.vmap(lambda x: lb.fake_quantize(x, fmt, 0))), x)
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_vmap_stochastic_with_batched_and_shared_keys_matches(fmt):
    """A batched key gives each slice its stream; a shared key gives every slice the same
    stream (the index restarts at zero in each slice), on both paths."""
    x = jnp.asarray(RNG.standard_normal((4, 8, 32)).astype(np.float32))
    keys = jax.random.split(jax.random.key(5), 4)

    def sr(x, k):
        return lb.fake_quantize(x, fmt, rounding="stochastic", key=k)

    want, got = both(jax.vmap(sr), x, keys)
    assert_identical(want, got)
    want, got = both(jax.vmap(sr, in_axes=(0, None)), x, keys[0])
    assert_identical(want, got)
    x_same = jnp.broadcast_to(x[:1], x.shape)
    _, got = both(jax.vmap(sr, in_axes=(0, None)), x_same, keys[0])
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(got[3]))


@needs_kernel
def test_vmap_nvfp4_tensor_amax_is_per_slice():
    x = (
        jnp.asarray(RNG.standard_normal((3, 4, 32)).astype(np.float32))
        * jnp.array([1.0, 100.0, 1e-3])[:, None, None]
    )
    t = jnp.array([0.5, 300.0, 2e-3], jnp.float32)
    want, got = both(jax.vmap(lambda x, t: lb.fake_quantize(x, "nvfp4", tensor_amax=t)), x, t)
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_straight_through_gradient_is_unchanged(fmt):
    x = jnp.asarray(RNG.standard_normal((8, 64)).astype(np.float32))
    w = jnp.asarray(RNG.standard_normal((8, 64)).astype(np.float32))

    def loss(x):
        return jnp.sum(lb.fake_quantize(x, fmt) * w)

    want, got = both(jax.value_and_grad(loss), x)
    for a, b in zip(want, got, strict=True):
        assert_identical(a, b)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(w))


@needs_kernel
def test_clip_gradient_keeps_the_xla_path():
    x = jnp.ones((32, 32))
    with native.mode("on"):
        g = jax.grad(lambda x: lb.fake_quantize(x, "mxfp4", clip_gradient=True).sum())
        assert native.TARGET not in jax.jit(g).lower(x).as_text()


@needs_kernel
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "quartet"])
def test_quantized_dot_general_forward_and_backward_match(recipe, monkeypatch):
    """``lowbit.dot_general`` quantizes its operands through the same implementation, so a
    training step is bit-identical on both paths: 16x16 weight tiles, and the Hadamard
    transforms fused into the kernel (nvfp4's wgrad, quartet's backward GEMMs) once the XLA
    path transforms with the butterfly too (its default dense form differs by rounding)."""
    monkeypatch.setattr(lb.hadamard, "default_method", lambda *a, **k: "butterfly")
    x = jnp.asarray(RNG.standard_normal((32, 64)).astype(np.float32))
    w = jnp.asarray(RNG.standard_normal((64, 64)).astype(np.float32))
    key = jax.random.key(3)
    dn = (((1,), (0,)), ((), ()))

    def loss(x, w):
        return jnp.sum(jnp.tanh(lb.dot_general(x, w, dn, recipe=recipe, key=key)))

    want, got = both(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    assert_identical(want[0], got[0])
    for a, b in zip(want[1], got[1], strict=True):
        assert_identical(a, b)


@needs_kernel
def test_lowering_for_cuda_does_not_contain_the_kernel():
    """The choice is a platform_dependent: exporting for GPU lowers the XLA path only."""
    x = jnp.ones((8, 64))
    with native.mode("on"):
        exp = jax.export.export(
            jax.jit(lambda x: lb.fake_quantize(x, "mxfp4")), platforms=["cuda"]
        )(x)
    assert native.TARGET not in exp.mlir_module()


@needs_kernel
def test_exporting_for_cpu_needs_mode_off_or_the_custom_call_allowed():
    x = jnp.ones((8, 64))

    def fq(x):
        return lb.fake_quantize(x, "mxfp4")

    with native.mode("on"):
        with pytest.raises(ValueError, match="custom call"):
            jax.export.export(jax.jit(fq), platforms=["cpu"])(x)
        allowed = [jax.export.DisabledSafetyCheck.custom_call(native.TARGET)]
        exp = jax.export.export(jax.jit(fq), platforms=["cpu"], disabled_checks=allowed)(x)
        np.testing.assert_array_equal(np.asarray(exp.call(x)), np.asarray(jax.jit(fq)(x)))
    with native.mode("off"):  # a new function: JAX reuses a function's trace across jit()s
        exp = jax.export.export(jax.jit(lambda x: fq(x)), platforms=["cpu"])(x)
        assert native.TARGET not in exp.mlir_module()


# --------------------------------------------------------------------------------------------
# 2-D tiles


@needs_kernel
@pytest.mark.parametrize(
    "shape,axes,tile",
    [
        ((48, 80), (0, 1), (16, 16)),  # a weight's tiles, both axes padded
        ((40, 64), (-1, -2), (32, 16)),  # the axes named in reverse order: tile (16 rows, 32)
        ((2, 33, 32), (1, 2), (16, 16)),  # a stack of weights
        ((32, 3, 40), (0, 2), (16, 8)),  # an axis between the tiled ones
        ((20, 48, 5), (0, 1), (8, 16)),  # tiles over leading axes (strided), padded
    ],
)
@pytest.mark.parametrize(
    "fmt,rounding", [("nvfp4", "nearest"), ("mxfp8_e4m3", "nearest"), ("mxfp4", "stochastic")]
)
def test_2d_tiles_match_the_xla_path(shape, axes, tile, fmt, rounding):
    x = jnp.asarray(hard_values(shape, seed=len(shape) + tile[0]))
    key = _key(rounding)
    want, got = both(
        lambda x: lb.fake_quantize(x, fmt, axes, rounding=rounding, key=key, block_shape=tile), x
    )
    assert_identical(want, got)


@needs_kernel
def test_2d_tiles_with_calibrated_tensor_amax_gain_and_vmap_match():
    x = jnp.asarray(RNG.standard_normal((3, 32, 48)).astype(np.float32))
    plan = _qa.make_plan(
        x.shape[1:], "nvfp4", (0, 1), (16, 16), None, "nearest", None, 1.5, prescale=0.75
    )
    want, got = both(
        jax.vmap(lambda x, t: _qa.fake_quantize_with_plan(x, None, t, plan)[0]),
        x,
        jnp.array([1.5, 0.5, 3.0], jnp.float32),
    )
    assert_identical(want, got)


# --------------------------------------------------------------------------------------------
# The fused Hadamard transform: the butterfly, then the XLA path, bit for bit


def hadamard_pair(
    shape,
    fmt,
    axis,
    hb,
    *,
    rounding="nearest",
    block=None,
    gain=1.0,
    scale_mode=None,
    tensor_amax=None,
):
    """``(reference, fused)`` functions of ``(x, signs)``: ``hadamard_transform(method=
    "butterfly")`` then the XLA quantizer, and the kernel's fused transform."""
    key = jax.random.key_data(jax.random.key(4)) if rounding == "stochastic" else None
    bs = None if block is None else (block,)
    plan = _qa.make_plan(shape, fmt, axis, bs, scale_mode, rounding, key, tensor_amax, gain)

    def reference(x, signs, tamax=tensor_amax):
        xh = lb.hadamard.hadamard_transform(
            x, hb, signs=signs, axis=plan.axes[0], method="butterfly"
        )
        return _qa.fake_quantize_with_plan_xla(xh, key, tamax, plan, False)[0]

    def fused(x, signs, tamax=tensor_amax):
        return _qa.fake_quantize_with_plan(x, key, tamax, plan, hadamard=hb, signs=signs)[0]

    return reference, fused


def both_fns(reference, fused, *args):
    """``reference(*args)`` on the XLA path and ``fused(*args)`` with the kernel."""
    with native.mode("off"):
        want, text = _compiled(reference, args)
        assert native.TARGET not in text
    with native.mode("on"):
        got, text = _compiled(fused, args)
        assert native.TARGET in text, "the kernel was not used"
    return want, got


def _signs(hb, seed=0):
    return lb.hadamard.random_signs(jax.random.key(100 + seed), hb)


HADAMARD_CASES = [
    # shape, axis, b_h, format, scale mode, rounding, quantization block, gain, also unsigned
    ((8, 64), -1, 16, "mxfp4", None, "nearest", None, 1.0, True),  # b_h < block
    ((6, 256), -1, 256, "mxfp4", "ceil", "stochastic", None, 0.75, False),  # b_h > block
    ((4, 128), -1, 64, "mxfp8_e4m3", "even", "nearest", 16, 1.0, False),
    ((3, 96), 1, 32, "mxfp6_e3m2", "rceil", "stochastic", 24, 1.0, False),  # lcm(24, 32) = 96
    ((5, 80), -1, 16, "mxint8", None, "nearest", 32, 1.0, False),  # padded 80 -> 96
    ((4, 48), -1, 16, "nvfp4", None, "stochastic", None, 0.75, True),
    ((128, 6), 0, 128, "mxfp8_e5m2", None, "nearest", None, 1.0, False),  # leading (strided)
    ((48, 20), 0, 16, "mxfp4", "floor", "stochastic", 32, 0.75, True),  # strided, 48 -> 64
    ((64, 9), 0, 64, "nvfp4", None, "nearest", None, 1.0, False),
    ((3, 32, 10), 1, 32, "mxfp6_e2m3", None, "nearest", 16, 1.0, False),  # middle axis
    ((2, 256, 3), 1, 256, "nvfp4", None, "stochastic", None, 1.0, False),
]


@needs_kernel
@pytest.mark.parametrize(
    "shape,axis,hb,fmt,scale_mode,rounding,block,gain,unsigned", HADAMARD_CASES
)
def test_fused_hadamard_matches_the_butterfly_then_the_xla_path(
    shape, axis, hb, fmt, scale_mode, rounding, block, gain, unsigned
):
    """Hard values (NaN, +-Inf, magnitudes 2**-60 .. 2**60, subnormals, near float32's max,
    which the transform overflows into Inf and NaN), with signs (and without)."""
    x = jnp.asarray(hard_values(shape, seed=hb + len(shape)))
    reference, fused = hadamard_pair(
        shape, fmt, axis, hb, rounding=rounding, block=block, gain=gain, scale_mode=scale_mode
    )
    for signs in (_signs(hb), None) if unsigned else (_signs(hb),):
        want, got = both_fns(reference, fused, x, signs)
        assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize(
    "axis,fmt,rounding", [(-1, "mxfp4", "stochastic"), (0, "nvfp4", "nearest")]
)
def test_fused_hadamard_on_large_arrays_split_over_threads_matches(axis, fmt, rounding):
    x = jnp.asarray(RNG.standard_normal((256, 320)).astype(np.float32))
    x = x.at[17, 40].set(300.0)  # an outlier, spread over its Hadamard block
    reference, fused = hadamard_pair(x.shape, fmt, axis, 32, rounding=rounding, gain=0.75)
    want, got = both_fns(reference, fused, x, _signs(32))
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("axis,tensor_amax", [(-1, None), (0, None), (-1, 0.0), (0, 2.0)])
def test_fused_hadamard_nvfp4_tensor_amax_is_that_of_the_transformed_tensor(axis, tensor_amax):
    """Its own amax: of the transformed values (finite ones only; one block holds a NaN and
    one an Inf); a calibrated one as given."""
    x = RNG.standard_normal((64, 64)).astype(np.float32) * 4
    x[5, 7] = 40.0
    x[40, 50] = np.nan
    x[20, 3] = np.inf
    reference, fused = hadamard_pair(x.shape, "nvfp4", axis, 16, tensor_amax=tensor_amax)
    want, got = both_fns(reference, fused, jnp.asarray(x), _signs(16))
    assert_identical(want, got)


@needs_kernel
def test_fused_hadamard_of_low_precision_inputs_matches():
    """The XLA path rounds the transform to x's dtype before quantizing it: so does the
    kernel's path (the transform then runs in XLA)."""
    x = jnp.asarray(RNG.standard_normal((8, 64)) * 10, jnp.bfloat16)
    reference, fused = hadamard_pair(x.shape, "mxfp4", -1, 32, rounding="stochastic")
    want, got = both_fns(reference, fused, x, _signs(32))
    assert got.dtype == jnp.bfloat16
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize(
    "axis,fmt,rounding", [(-1, "mxfp4", "stochastic"), (0, "nvfp4", "nearest")]
)
def test_fused_hadamard_under_vmap_with_per_slice_signs_matches(axis, fmt, rounding):
    """Batched signs (one vector per slice), and shared ones (MXFP4); NVFP4's own tensor
    amax per slice."""
    x = jnp.asarray(RNG.standard_normal((3, 32, 64)).astype(np.float32))
    x = x * jnp.array([1.0, 50.0, 1e-3])[:, None, None]
    signs = jnp.stack([_signs(32, seed=k) for k in range(3)])
    reference, fused = hadamard_pair(x.shape[1:], fmt, axis, 32, rounding=rounding)
    want, got = both_fns(jax.vmap(reference), jax.vmap(fused), x, signs)
    assert_identical(want, got)
    if fmt == "nvfp4":
        return
    ref_shared, fused_shared = (jax.vmap(f, in_axes=(0, None)) for f in (reference, fused))
    want, got = both_fns(ref_shared, fused_shared, x, signs[0])
    assert_identical(want, got)


@needs_kernel
def test_fused_hadamard_gradient_is_straight_through():
    """The kernel has no derivative of its own: a straight-through rule around it (as
    lowbit's GEMMs define) gives the incoming cotangent, and the value is the kernel's."""
    x = jnp.asarray(RNG.standard_normal((8, 64)).astype(np.float32))
    w = jnp.asarray(RNG.standard_normal((8, 64)).astype(np.float32))
    reference, fused = hadamard_pair(x.shape, "mxfp4", -1, 16, rounding="stochastic", gain=0.75)

    def ste(f):
        @jax.custom_jvp
        def q(x, s):
            return f(x, s)

        q.defjvp(lambda primals, tangents: (q(*primals), tangents[0]))
        return jax.value_and_grad(lambda x, s: jnp.sum(q(x, s) * w))

    want, got = both_fns(ste(reference), ste(fused), x, _signs(16))
    for a, b in zip(want, got, strict=True):
        assert_identical(a, b)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(w))


# --------------------------------------------------------------------------------------------
# Policy and build


def test_auto_mode_needs_a_single_cpu_device():
    assert len(jax.local_devices(backend="cpu")) > 1, "conftest sets 4 host devices"
    with native.mode("auto"):
        assert not native.active()
    with native.mode("off"):
        assert not native.active()
    with native.mode("on"):
        assert native.active() == native.available()


def test_auto_mode_stays_off_when_the_default_backend_is_not_cpu(monkeypatch):
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: [object()])
    with native.mode("auto"):
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert not native.active()
        monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
        assert native.active() == native.available()


def test_auto_mode_uses_the_kernel_in_a_single_device_process():
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp, lowbit as lb\n"
        "t = jax.jit(lambda x: lb.fake_quantize(x, 'mxfp4')).lower(jnp.ones((4, 32))).as_text()\n"
        "print(lb.native.active(), lb.native.TARGET in t)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    expected = native.available()
    assert out.stdout.split() == [str(expected), str(expected)]


def test_an_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="'fast'"):
        with native.mode("fast"):
            pass


def test_mode_is_restored_after_an_exception():
    with native.mode("off"):
        with pytest.raises(RuntimeError):
            with native.mode("on"):
                raise RuntimeError("boom")
        assert not native.active()


def test_build_without_a_compiler_explains_and_main_does_not_fail(monkeypatch, capsys):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(native.NativeBuildError, match="no C.. compiler"):
        native.build()
    assert native.library_path() is None
    assert native.main([]) == 0
    assert "XLA path" in capsys.readouterr().out


def test_an_unwritable_cache_is_a_build_error_not_a_crash(monkeypatch, tmp_path, capsys):
    if native._compiler() is None:
        pytest.skip("no compiler")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LOWBIT_NATIVE_CACHE", str(blocker / "cache"))
    with pytest.raises(native.NativeBuildError, match="LOWBIT_NATIVE_CACHE"):
        native.build()
    assert native.main([]) == 0
    assert "not built" in capsys.readouterr().out


@needs_kernel
def test_build_is_cached_per_machine(tmp_path):
    path = native.build()
    mtime = path.stat().st_mtime_ns
    assert native.build() == path and path.stat().st_mtime_ns == mtime
    assert path == native.library_path() and path.suffix == ".so"


def test_a_compile_error_is_reported_with_the_compiler_output(monkeypatch, tmp_path):
    if native._compiler() is None:
        pytest.skip("no compiler")
    bad = tmp_path / "broken.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    monkeypatch.setenv("LOWBIT_NATIVE_CACHE", str(tmp_path / "cache"))
    native._build_key.cache_clear()
    try:
        with pytest.raises(native.NativeBuildError, match="broken.cc"):
            native.build()
        assert not list((tmp_path / "cache").glob("*.so")), "no library left behind"
    finally:
        native._build_key.cache_clear()


def test_supports_says_where_the_kernel_serves():
    def plan(shape=(32, 64), axis=-1, block=None):
        return _qa.make_plan(shape, "mxfp4", axis, block, None, "nearest", None, None)

    assert native.supports(plan())
    assert native.supports(plan(axis=(0, 1), block=(16, 16)))
    assert all(native.supports(plan(), b) for b in (16, 32, 64))
    assert native.supports(plan(axis=0), 32) and not native.supports(plan(axis=0), 64)
    assert not native.supports(plan(axis=(0, 1), block=(16, 16)), 16), "Hadamard with 2-D tiles"
    assert not native.supports(plan(), 48) and not native.supports(plan(), 8)
    assert not native.supports(plan(shape=(32, 0)))
    x = jnp.ones((32, 32))
    with pytest.raises(ValueError, match="does not support"):
        native.fake_quantize(
            x, None, None, plan(axis=(0, 1), block=(16, 16)), lambda x: x, hadamard=16
        )
