"""INT4 and ternary (BitNet b1.58) bit for bit against tests/reference.py, their packing, the
int8 per-token quantizer of ``QuantSpec("int8", granularity="row")``, the ``bitnet`` recipe,
and the errors of each.

The references do not call lowbit: INT4 is the NVFP4 reference with the grid -7..7 in place of
E2M1's (``reference.nvfp4_quantize(..., elem="int4")``), ternary and the int8 activations are
BitNet's published ``weight_quant`` / ``activation_quant`` in float32 numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.gemm.operand import quantize_operand, unpack_operand
from lowbit.gemm.recipes import QuantSpec
from tests import reference as ref
from tests.quantizer_base import assert_bits_equal, assert_codes_equal

DN = (((1,), (0,)), ((), ()))


def _wide(shape, seed):
    """float32 normals times log-uniform magnitudes (2**-8..2**8), with one all-zero row of
    blocks and one exact tie: blocks whose scales span the E4M3 range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-8, 8, shape[:-1] + (1,)))
    x = x.astype(np.float32)
    x.reshape(-1, shape[-1])[0] = 0.0
    return x


def _dyadic(shape, seed, frac_bits=6):
    """Multiples of 2**-frac_bits below 8 in magnitude: every sum of |x| is exact in float32,
    so the mean |x| is the same number in every implementation."""
    rng = np.random.default_rng(seed)
    k = rng.integers(-8 * 2**frac_bits, 8 * 2**frac_bits, size=shape)
    return (k * 2.0**-frac_bits).astype(np.float32)


# --------------------------------------------------------------------------------------------
# INT4: NVFP4's scaling on the grid -7..7


@pytest.mark.parametrize(
    "shape,axis,block_shape",
    [
        ((6, 64), -1, None),
        ((48, 24), 0, None),
        ((2, 3, 40), -1, None),
        ((32, 48), (0, 1), (16, 16)),
    ],
)
def test_int4_bit_exact_against_reference(shape, axis, block_shape):
    x = _wide(shape, 0)
    q = lb.quantize(jnp.asarray(x), "int4", axis, block_shape=block_shape)
    r = ref.nvfp4_quantize(x, axis, block_shape=block_shape, elem="int4")
    assert_bits_equal(np.asarray(lb.dequantize(q)), r.values, "int4 values")
    assert_bits_equal(np.asarray(q.tensor_scale), r.tensor_scale, "int4 tensor scale")
    assert_codes_equal(np.asarray(q.scales), r.scale_codes, "int4 E4M3 block scales")
    assert_codes_equal(ref.unpack_codes(q.codes, 4), r.codes, "int4 codes")
    fq = lb.fake_quantize(jnp.asarray(x), "int4", axis, block_shape=block_shape)
    assert_bits_equal(np.asarray(fq), r.values, "int4 fake_quantize")
    grid = np.unique(np.asarray(r.elems)[np.isfinite(r.elems)])
    assert set(grid.tolist()) <= set(range(-7, 8))


def test_int4_tensor_amax_nan_block_and_saturation():
    x = _wide((4, 32), 1)
    x[1, 3] = np.nan
    ta = float(np.nanmax(np.abs(x))) / 4  # blocks above it saturate at the code 7
    q = lb.quantize(jnp.asarray(x), "int4", tensor_amax=ta)
    r = ref.nvfp4_quantize(x, tensor_amax=ta, elem="int4")
    assert_bits_equal(np.asarray(lb.dequantize(q)), r.values, "int4 with tensor_amax")
    assert np.all(np.isnan(np.asarray(lb.dequantize(q))[1, :16]))
    assert np.all(np.isfinite(np.asarray(lb.dequantize(q))[1, 16:]))
    assert np.max(np.abs(ref.unpack_codes(q.codes, 4).view(np.int8) << 4 >> 4)) == 7


def test_int4_stochastic_rounding_is_unbiased_on_the_grid():
    x = jnp.asarray(np.random.default_rng(2).uniform(-1, 1, (64, 16)).astype(np.float32))
    keys = jax.random.split(jax.random.key(0), 256)
    f = jax.jit(jax.vmap(lambda k: lb.fake_quantize(x, "int4", rounding="stochastic", key=k)))
    ys = np.asarray(f(keys))
    q = lb.quantize(x, "int4")
    step = np.asarray(q.tensor_scale) * ref.code_values(ref.ELEMS["e4m3"])[np.asarray(q.scales)]
    units = ys / np.repeat(step, 16, axis=-1)  # every sample on the integer grid
    np.testing.assert_allclose(units, np.round(units), atol=1e-4)
    err = ys.mean(0) - np.asarray(x)
    assert np.abs(err).max() < 4 * np.repeat(step, 16, axis=-1).max() / np.sqrt(256)


# --------------------------------------------------------------------------------------------
# Ternary: BitNet b1.58's weight_quant, packed five codes a byte


@pytest.mark.parametrize("shape,axis", [((16, 40), -1), ((37, 8), 0), ((2, 3, 12), -1)])
def test_ternary_bit_exact_against_bitnet(shape, axis):
    x = _dyadic(shape, 3)
    vals, codes, _ = ref.bitnet_weight_quant(x)
    q = lb.quantize(jnp.asarray(x), "ternary", axis)
    assert_bits_equal(np.asarray(lb.dequantize(q)), vals, "ternary values")
    assert_bits_equal(
        np.asarray(lb.fake_quantize(jnp.asarray(x), "ternary", axis)), vals, "ternary fake_quantize"
    )
    # storage: the quantized axis last, zero-padded to five, base-3 bytes
    moved = np.moveaxis(codes, axis, -1)
    pad = -moved.shape[-1] % 5
    moved = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
    assert_codes_equal(np.asarray(q.codes), ref.pack_trits(moved), "ternary packed codes")
    assert q.scales.size == 0
    assert q.nbytes == q.codes.size + 4
    assert q.bits_per_element <= 1.6 + 8 * 4 / x.size + 8 * 5 / x.size


def test_ternary_all_zero_clamped_mean_and_nonfinite():
    z = jnp.zeros((4, 10))
    assert np.all(np.asarray(lb.dequantize(lb.quantize(z, "ternary"))) == 0)
    # mean |x| below 1e-5 is clamped (BitNet): small weights round to 0
    tiny = jnp.full((2, 10), 2.0**-18)  # mean 3.8e-6: clamped to 1e-5, codes 0
    vals, _, _ = ref.bitnet_weight_quant(np.asarray(tiny))
    assert_bits_equal(np.asarray(lb.fake_quantize(tiny, "ternary")), vals, "clamped mean")
    x = np.asarray(_dyadic((4, 10), 4))
    x[2, 2] = np.inf
    assert np.all(np.isnan(np.asarray(lb.dequantize(lb.quantize(jnp.asarray(x), "ternary")))))
    assert np.all(np.isnan(np.asarray(lb.fake_quantize(jnp.asarray(x), "ternary"))))


def test_ternary_stochastic_rounding_stays_ternary_and_is_unbiased():
    x = jnp.asarray(_dyadic((32, 20), 5))
    gamma = float(jnp.mean(jnp.abs(x)))
    keys = jax.random.split(jax.random.key(1), 512)
    f = jax.jit(jax.vmap(lambda k: lb.fake_quantize(x, "ternary", rounding="stochastic", key=k)))
    ys = np.asarray(f(keys))
    assert set(np.unique(np.round(ys / gamma, 3)).tolist()) <= {-1.0, 0.0, 1.0}
    inside = np.abs(np.asarray(x)) < gamma
    err = (ys.mean(0) - np.asarray(x))[inside]
    assert np.abs(err).max() < 5 * gamma / np.sqrt(512)


@pytest.mark.parametrize("fmt", ["int4", "ternary"])
def test_pack_round_trip_and_jit(fmt):
    x = jnp.asarray(_dyadic((20, 30), 6))
    q = jax.jit(lambda x: lb.quantize(x, fmt))(x)
    leaves, tree = jax.tree_util.tree_flatten(q)
    q2 = jax.tree_util.tree_unflatten(tree, leaves)
    assert_bits_equal(np.asarray(lb.dequantize(q2)), np.asarray(lb.fake_quantize(x, fmt)), fmt)
    assert lb.dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


def test_ternary_and_int4_errors():
    x = jnp.ones((4, 10))
    with pytest.raises(ValueError, match="scale_mode.*mean"):
        lb.quantize(x, "ternary", scale_mode="floor")
    with pytest.raises(ValueError, match="tensor_amax.*ternary"):
        lb.quantize(x, "ternary", tensor_amax=1.0)
    with pytest.raises(ValueError, match="block_shape.*multiple of 5"):
        lb.quantize(x, "ternary", block_shape=(8,))
    with pytest.raises(ValueError, match="scale_mode.*int4"):
        lb.quantize(jnp.ones((4, 16)), "int4", scale_mode="floor")
    with pytest.raises(ValueError, match="amax does not apply to ternary"):
        QuantSpec("ternary", amax=1.0)
    with pytest.raises(ValueError, match="block_scales.*ternary"):
        lb.calibrate.block_scales(x, "ternary", "mse")


def test_int4_mse_block_scales_never_worse():
    w = jnp.asarray(_wide((8, 64), 7))
    std, mse = (lb.calibrate.block_scales(w, "int4", m) for m in ("max", "mse"))
    err = lambda q: float(jnp.sum((lb.dequantize(q) - w) ** 2))  # noqa: E731
    assert err(mse) < err(std)
    assert np.all(np.abs(ref.unpack_codes(mse.codes, 4).view(np.int8) << 4 >> 4) <= 7)


# --------------------------------------------------------------------------------------------
# int8 per token (granularity="row") and the bitnet recipe


def test_int8_rows_bit_exact_against_bitnet_activation_quant():
    x = _wide((12, 48), 8)
    x[3] = 3e-6  # a row below the 1e-5 clamp
    vals, codes = ref.bitnet_activation_quant(x)
    spec = QuantSpec("int8", granularity="row")
    got = quantize_operand(jnp.asarray(x), spec, 1, 0, None)
    assert_bits_equal(np.asarray(got), vals, "int8 rows")
    packed = quantize_operand(jnp.asarray(x), spec, 1, 0, None, packed=True)
    assert packed[0].dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(packed[0]), codes)
    assert_bits_equal(np.asarray(unpack_operand(packed, spec)), vals, "int8 rows unpacked")
    # along axis 0 (a weight's output channel): the transpose's rows
    got0 = quantize_operand(jnp.asarray(x.T), spec, 0, 1, None)
    assert_bits_equal(np.asarray(got0), vals.T, "int8 rows along axis 0")


def test_row_granularity_errors():
    with pytest.raises(ValueError, match="granularity='row' needs format in"):
        QuantSpec("mxfp4", granularity="row")
    with pytest.raises(ValueError, match="amax.*granularity='row'"):
        QuantSpec("int8", granularity="row", amax=2.0)
    with pytest.raises(ValueError, match="granularity must be one of"):
        QuantSpec("int8", granularity="token")


def test_bitnet_recipe_forward_and_straight_through_gradients():
    x = _wide((8, 40), 9)
    w = _dyadic((40, 24), 10)
    xq, _ = ref.bitnet_activation_quant(x)
    wq, _, _ = ref.bitnet_weight_quant(w.T)  # per tensor: the transpose has the same mean
    wq = wq.T
    dy = np.random.default_rng(11).standard_normal((8, 24)).astype(np.float32)

    def f(x, w):
        return lb.dot_general(x, w, DN, recipe="bitnet")

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    y64 = xq.astype(np.float64) @ wq.astype(np.float64)
    np.testing.assert_allclose(np.asarray(y), y64, rtol=1e-5, atol=1e-5 * np.abs(y64).max())
    # straight-through (BitNet's x + (q(x) - x).detach()): the backward GEMMs take the
    # quantized operands, the gradients pass the quantizers unchanged
    dx64, dw64 = dy.astype(np.float64) @ wq.T.astype(np.float64), xq.T.astype(np.float64) @ dy
    np.testing.assert_allclose(np.asarray(dx), dx64, rtol=1e-5, atol=1e-5 * np.abs(dx64).max())
    np.testing.assert_allclose(np.asarray(dw), dw64, rtol=1e-5, atol=1e-5 * np.abs(dw64).max())


def test_pareto_recipes_quantize_weights_and_8_bit_activations():
    expected = {
        "w16a8": None,
        "w8a8_mxfp8": "mxfp8_e4m3",
        "w6a8_mxfp6": "mxfp6_e2m3",
        "w4a8_mxfp4": "mxfp4",
        "w4a8_nvfp4": "nvfp4",
        "w4a8_int4": "int4",
        "bitnet": "ternary",
    }
    for name, fmt in expected.items():
        r = lb.recipes.get(name)
        assert r.fwd.lhs == QuantSpec("int8", granularity="row"), name
        assert (r.fwd.rhs.format if r.fwd.rhs else None) == fmt, name
        assert not r.is_fqt
    assert {"qat_int4", "qat_ternary"} <= set(lb.recipes.names())


def test_kernels_decline_int4_and_ternary_with_a_reason():
    from pallas_kernels.quantized_gemm import kernel_supports

    for fmt in ("int4", "ternary"):
        ok, why = kernel_supports(QuantSpec("int8", granularity="row"), QuantSpec(fmt))
        assert not ok and "granularity='row'" in why
        ok, why = kernel_supports(QuantSpec("mxfp8"), QuantSpec(fmt))
        assert not ok and fmt in why
    plan = lb.core.plan.make_plan((8, 32), "int4", -1, None, None, "nearest", None, None)
    assert not lb.native.supports(plan)
    import pallas_kernels.quantize as pq

    x = jnp.asarray(_wide((16, 64), 12))
    with pytest.warns(UserWarning, match="int4"):
        q = pq.quantize(x, "int4", implementation="pallas")
    assert_bits_equal(
        np.asarray(lb.dequantize(q)),
        np.asarray(lb.fake_quantize(x, "int4")),
        "int4 through the kernel's fallback",
    )


def test_bitnet_model_packs_serves_and_checkpoints(tmp_path):
    """lowbit.flax: a bitnet model packs to ternary QArrays (no block scales), serves the same
    outputs as its fake-quantized form, and survives a checkpoint round trip."""
    from flax import nnx

    import lowbit.flax as lbf

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(40, 64, rngs=rngs)
            self.b = nnx.Linear(64, 8, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.gelu(self.a(x)))

    model, rules = Net(nnx.Rngs(0)), [(".*", "bitnet")]
    x = jax.random.normal(jax.random.key(1), (4, 40))
    state = nnx.state(model, nnx.Param)
    packed = lbf.pack(state, rules)
    q = packed["a"]["kernel"].value
    assert q.format_name == "ternary" and q.scales.size == 0
    served = lbf.nnx.PackedModel(model, rules, packed)(x)
    fake = lbf.nnx.quantize(model, rules, implementation="xla")(x)
    assert_bits_equal(np.asarray(served), np.asarray(fake), "packed bitnet model")
    back = lbf.checkpoint.restore(lbf.checkpoint.save(tmp_path / "ck", packed), packed)
    jax.tree.map(np.testing.assert_array_equal, back, packed)
    assert 8 * lbf.packed_nbytes(packed) < 0.2 * 32 * (40 * 64 + 64 * 8) + 32 * 72
