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
