"""Grouped-GEMM sites in Flax: NNX ``GroupedLinear`` and Linen ``GroupedDense`` reached by
rules like any other site, computing exactly ``lb.ragged_dot`` with the rule's recipe."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lowbit as lb
import lowbit.flax as lbf

SIZES = jnp.array([5, 0, 12], jnp.int32)


def _x():
    return jax.random.normal(jax.random.key(0), (20, 32))


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, sizes):
        h = lbf.linen.GroupedDense(3, 64, name="up")(x, sizes)
        return nn.Dense(8, name="out")(jax.nn.gelu(h))


def test_linen_rules_reach_a_grouped_site_and_compute_ragged_dot():
    m, x = _LinenNet(), _x()
    v = m.init(jax.random.key(1), x, SIZES)
    rules = [("up", "mxfp8"), (".*", "none")]
    sites, _ = lbf.linen.sites(m, rules, x, SIZES)
    got = {s.path: (s.kind, s.recipe.name, s.kernel, s.shape) for s in sites}
    assert got["up"] == ("ragged_dot", "mxfp8", "up/kernel", (3, 32, 64))
    y = lbf.quantize(m, rules).apply(v, x, SIZES)
    p = v["params"]
    h = lb.ragged_dot(x, p["up"]["kernel"], SIZES, recipe="mxfp8")
    want = jax.nn.gelu(h) @ p["out"]["kernel"] + p["out"]["bias"][None]
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(y, m.apply(v, x, SIZES), rtol=1e-3)  # the float net differs


def test_nnx_grouped_linear_under_a_rule_is_ragged_dot_bit_for_bit():
    layer = lbf.nnx.GroupedLinear(3, 32, 64, rngs=nnx.Rngs(0))
    q = lbf.quantize(layer, [(".*", "mxfp4")])
    x = _x()
    y = nnx.jit(lambda m, x: m(x, SIZES))(q, x)
    want = jax.jit(lambda x, w: lb.ragged_dot(x, w, SIZES, recipe="mxfp4"))(
        x, layer.kernel.get_value())
    np.testing.assert_array_equal(y, want)
    assert np.all(np.asarray(y)[17:] == 0)  # rows past the groups
    f = nnx.jit(lambda m, x: m(x, SIZES))(layer, x)  # unquantized: the float grouped GEMM
    w = np.asarray(layer.kernel.get_value(), np.float64)
    ref = np.concatenate([np.asarray(x[:5], np.float64) @ w[0],
                          np.asarray(x[5:17], np.float64) @ w[2], np.zeros((3, 64))])
    np.testing.assert_allclose(f, ref, rtol=1e-5, atol=1e-5)


def test_a_packed_expert_stack_serves_what_training_computed():
    """pack() stores each expert as its own tensor (NVFP4: one tensor scale per expert) and the
    packed model's output equals the quantized model's, bit for bit (nvfp4's forward is
    deterministic); the Linen path packs the same way."""
    layer = lbf.nnx.GroupedLinear(3, 32, 64, rngs=nnx.Rngs(0))
    w = layer.kernel.get_value() * jnp.array([1.0, 10.0, 0.1])[:, None, None]
    layer.kernel.set_value(w)
    rules = [(".*", "nvfp4")]
    x = _x()
    want = nnx.jit(lambda m, x: m(x, SIZES))(lbf.quantize(layer, rules, rngs=nnx.Rngs(quant=0)),
                                             x)
    packed = lbf.pack(layer, rules)
    q = packed["kernel"].get_value() if hasattr(packed["kernel"], "get_value") else \
        packed["kernel"]
    assert q.tensor_scale.shape == (3,) and q.shape == (32, 64)
    amax = np.abs(np.asarray(w)).reshape(3, -1).max(1)  # per expert, not per stack
    np.testing.assert_allclose(np.asarray(q.tensor_scale), amax / (448 * 6), rtol=1e-6)
    served = lbf.nnx.PackedModel(layer, rules, packed, rngs=nnx.Rngs(quant=0))
    got = nnx.jit(lambda m, x: m(x, SIZES))(served, x)
    np.testing.assert_array_equal(got, want)

    m = _LinenNet()
    v = m.init(jax.random.key(1), x, SIZES)
    lrules = [("up", "mxfp8"), (".*", "none")]
    lp = lbf.pack(v, lrules, sites=lbf.linen.sites(m, lrules, x, SIZES)[0])
    assert lp["params"]["up"]["kernel"].codes.shape[0] == 3
    served = lbf.quantize(m, lrules, packed=True).apply(lp, x, SIZES)
    np.testing.assert_array_equal(served, lbf.quantize(m, lrules).apply(v, x, SIZES))
