"""Linen: rules applied by interception equal the same model written with lowbit by hand (outputs
and gradients, bit for bit); unmatched modules equal the float model; the "quant" stream
drives stochastic rounding; packed inference equals fake-quantized inference; jit and sharding.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit as lb
import lowbit.flax as lbf
from lowbit.flax import linen as lbl

B, T, D = 2, 16, 32  # T = 16: NVFP4's wgrad Hadamard runs along the token axis


class HandEinsum(nn.Module):
    """nn.Einsum's parameters, computed with lowbit's einsum (what a user would write)."""

    recipe: str

    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.lecun_normal(), (2, D, D))
        b = self.param("bias", nn.initializers.zeros_init(), (D,))
        return lbl.Einsum(self.recipe)("btkd,kdf->btf", x, k) + jnp.reshape(b, (1, 1, D))


class Net(nn.Module):
    """A small transformer-ish block. ``ops``: hand-written lowbit ops by module name."""

    ops: tuple = ()

    @nn.compact
    def __call__(self, x):
        o = dict(self.ops)
        h = nn.LayerNorm(name="norm")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=2,
            name="attn",
            deterministic=True,
            qk_attn_weights_einsum_cls=o.get("qk"),
            attn_weights_value_einsum_cls=o.get("pv"),
        )(h)
        x = x + h
        h = nn.DenseGeneral((2, D), name="proj", dot_general=o.get("proj"))(x)
        h = (
            HandEinsum(o["mix"], name="mix")(h)
            if "mix" in o
            else nn.Einsum((2, D, D), "btkd,kdf->btf", name="mix")(h)
        )
        h = nn.Dense(64, name="up", dot_general=o.get("up"))(nn.gelu(h))
        return x + nn.Dense(D, name="down", dot_general=o.get("down"))(h)


RULES = [
    (r"attn/attn_scores", "mxfp8"),
    (r"attn/attn_values", "qat_mxfp6"),
    (r"attn/.*", "none"),  # query/key/value/out projections stay in float
    (r"proj", "qat_mxfp4"),
    (r"mix", "qat_mxfp8"),
    (r"up", "nvfp4"),  # stochastic rounding of gradients: needs the quant stream
]
HAND = (
    ("qk", functools.partial(lbl.Einsum, "mxfp8")),
    ("pv", functools.partial(lbl.Einsum, "qat_mxfp6")),
    ("proj", lbl.DotGeneral("qat_mxfp4")),
    ("mix", "qat_mxfp8"),
    ("up", lbl.DotGeneral("nvfp4")),
)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D, name="down")(nn.gelu(nn.Dense(64, name="up")(x)))


@pytest.fixture(scope="module")
def data():
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    params = jax.jit(Net().init)(jax.random.key(1), x)["params"]
    ct = jax.random.normal(jax.random.key(2), (B, T, D))
    return x, params, ct


@pytest.fixture(scope="module")
def mlp_params(data):
    return jax.jit(MLP().init)(jax.random.key(3), data[0])["params"]


@functools.cache
def _vg(model):
    """jit(value_and_grad) of ``sum(model(x) * ct)`` w.r.t. params and x; key an argument."""

    def loss(p, x, ct, key):
        y = model.apply({"params": p}, x, rngs={"quant": key})
        return jnp.sum(y * ct), y

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    def run(params, x, ct, key):
        (_, y), g = f(params, x, ct, key)
        return y, g

    return run


@functools.cache
def _fwd(model):
    return jax.jit(lambda p, x: model.apply({"params": p}, x))


def _assert_trees_equal(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def test_rules_equal_hand_written(data):
    x, params, ct = data
    key = jax.random.key(7)
    y_rules, g_rules = _vg(lbf.quantize(Net(), RULES))(params, x, ct, key)
    y_hand, g_hand = _vg(Net(ops=HAND))(params, x, ct, key)
    _assert_trees_equal(y_rules, y_hand)
    _assert_trees_equal(g_rules, g_hand)
    assert not np.array_equal(y_rules, _fwd(Net())(params, x))  # something was quantized
    # The wrapper keeps the parameter tree (nn.share_scope).
    shapes = jax.eval_shape(lbf.quantize(Net(), RULES).init, jax.random.key(1), x)["params"]
    assert jax.tree.structure(shapes) == jax.tree.structure(params)


def test_unmatched_modules_are_the_float_model(data):
    x, params, ct = data
    key = jax.random.key(7)
    y_float, g_float = _vg(Net())(params, x, ct, key)
    y, g = _vg(lbf.quantize(Net(), [(r"nothing", "mxfp4"), (r".*", "none")]))(params, x, ct, key)
    _assert_trees_equal(y, y_float)
    _assert_trees_equal(g, g_float)

    # Only the last layer quantized: every module before it computes the float values.
    def inter(model):
        return jax.jit(lambda p, x: model.apply({"params": p}, x, capture_intermediates=True))(
            params, x
        )[1]["intermediates"]

    inter_q, inter_f = inter(lbf.quantize(Net(), [(r"down", "mxfp4")])), inter(Net())
    for name in ("norm", "attn", "proj", "mix", "up"):
        _assert_trees_equal(inter_q[name], inter_f[name])
    assert not np.array_equal(inter_q["down"]["__call__"][0], inter_f["down"]["__call__"][0])


def test_quant_stream_drives_stochastic_rounding(data, mlp_params):
    x, _, ct = data
    run = _vg(lbf.quantize(MLP(), [(r"up|down", "nvfp4")]))
    y1, g1 = run(mlp_params, x, ct, jax.random.key(1))
    y1b, g1b = run(mlp_params, x, ct, jax.random.key(1))
    y2, g2 = run(mlp_params, x, ct, jax.random.key(2))
    _assert_trees_equal(g1, g1b)
    np.testing.assert_array_equal(y1, y2)  # NVFP4's forward rounds to nearest
    assert not np.array_equal(g1[0]["up"]["kernel"], g2[0]["up"]["kernel"])
    assert not np.array_equal(g1[1], g2[1])


def test_missing_quant_stream(data, mlp_params):
    x, _, _ = data
    q = lbf.quantize(MLP(), [(r"up", "nvfp4")])
    with pytest.raises(ValueError, match=r"module 'up' uses recipe 'nvfp4'.*'quant' rng stream"):
        jax.eval_shape(lambda p: q.apply({"params": p}, x), mlp_params)
    # init needs no quant stream and gives the float model's parameters
    _assert_trees_equal(jax.jit(q.init)(jax.random.key(3), x)["params"], mlp_params)
    # recipes that need no key need no stream
    q = lbf.quantize(MLP(), [(r"up", "qat_nvfp4"), (r"down", "mxfp8")])
    assert jax.eval_shape(lambda p: q.apply({"params": p}, x), mlp_params).shape == x.shape
    # by hand, outside any module
    dg = lbl.DotGeneral("nvfp4")
    with pytest.raises(ValueError, match="outside a bound Flax Linen module"):
        dg(jnp.ones((16, 32)), jnp.ones((32, 8)), (((1,), (0,)), ((), ())))


def test_linen_einsum_equivalent_is_nn_einsum(data):
    """The interceptor's stand-in for nn.Einsum.__call__ is nn.Einsum (bit for bit)."""
    x, _, _ = data
    layer = nn.Einsum((D, 2, D), "btd,dkf->btkf")
    v = layer.init(jax.random.key(0), x)

    def interceptor(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.Einsum) and context.method_name == "__call__":
            return lbl._einsum_call(context.module, jnp.einsum, *args, **kwargs)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        y = layer.apply(v, x)
    np.testing.assert_array_equal(y, layer.apply(v, x))


FWD_RULES = [
    (r"attn/attn_scores", "mxfp8"),
    (r"attn/(query|key|value)", "qat_mxfp8"),
    (r"attn/out", "qat_nvfp4"),  # DenseGeneral over (heads, head_dim): rank-3 weight
    (r"proj", "qat_mxfp4"),
    (r"mix", "qat_mxfp6"),
    (r"up", "nvfp4"),  # training recipe: 16x16 NVFP4 weight tiles in the forward
    (r"down", "mxfp4_bwd"),  # high-precision forward: the weight stays float
]


def test_packed_inference_equals_fake_quant(data):
    x, params, _ = data
    sites = lbf.sites(Net(), FWD_RULES, x)
    by_path = {s.path: s for s in sites}
    assert by_path["attn/out"].layout == lbf.Layout(1, 2)
    assert by_path["mix"].kind == "einsum" and by_path["attn/attn_values"].recipe is None
    packed = jax.jit(lambda p: lbf.pack(p, FWD_RULES, sites=sites))(params)
    assert isinstance(packed["up"]["kernel"], lb.QArray)
    assert packed["up"]["kernel"].block_shape == (16, 16)
    assert not isinstance(packed["down"]["kernel"], lb.QArray)
    assert lbf.packed_nbytes(packed) < lbf.packed_nbytes(params) / 2
    fake = lbf.quantize(Net(), FWD_RULES)
    serve = lbf.quantize(Net(), FWD_RULES, packed=True)
    key = jax.random.key(0)  # the training recipe 'nvfp4' asks for a quant stream
    y_fake = jax.jit(lambda p, x: fake.apply({"params": p}, x, rngs={"quant": key}))(params, x)
    y_packed = jax.jit(lambda p, x: serve.apply({"params": p}, x))(packed, x)
    np.testing.assert_array_equal(y_packed, y_fake)
    # unpack right before a plain apply, under the serving interceptor: the same computation

    def unpacked_apply(p, x):
        with lbl.intercept(FWD_RULES, packed=True):
            return Net().apply({"params": lbf.unpack(p)}, x)

    np.testing.assert_array_equal(jax.jit(unpacked_apply)(packed, x), y_fake)


def test_packed_module_rejects_float_params(data, mlp_params):
    x, _, _ = data
    serve = lbf.quantize(MLP(), [(r"up", "qat_mxfp4")], packed=True)
    with pytest.raises(ValueError, match="params without any QArray: pack them first"):
        jax.eval_shape(lambda p: serve.apply({"params": p}, x), mlp_params)
    with pytest.raises(TypeError, match="pass example inputs"):
        lbf.describe(MLP(), [(r"up", "qat_mxfp4")])


def test_pack_needs_layouts_for_rank3_kernels(data):
    _, params, _ = data
    with pytest.raises(ValueError, match=r"contraction axis of 'attn/out/kernel'"):
        lbf.pack(params, [(r"attn/out", "qat_mxfp4")])
    with pytest.raises(ValueError, match="Hadamard"):
        lbf.pack(params, [(r"up", "quartet")])


def test_sharded_params_under_jit(mlp_params):
    """Megatron-style sharding over 4 devices (up: output features, down: input features)
    and a batch-sharded input; GSPMD (Auto) mesh. The forward equals the unsharded one bit
    for bit (blocks run along unsharded axes or whole shards); gradients to rounding."""
    x = jax.random.normal(jax.random.key(5), (4, T, D))
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    spec = {
        "up": {"kernel": P(None, "model"), "bias": P("model")},
        "down": {"kernel": P("model", None), "bias": P()},
    }
    sharded = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), mlp_params, spec)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert len(sharded["up"]["kernel"].sharding.device_set) == 4
    q = lbf.quantize(MLP(), [(r"up|down", "qat_mxfp4")])
    f = _fwd(q)
    y = f(sharded, xs)
    assert y.sharding.spec[0] == "data"
    np.testing.assert_array_equal(y, f(mlp_params, x))
    ct = jnp.ones_like(x)
    _, g_sharded = _vg(q)(sharded, xs, ct, jax.random.key(0))
    _, g = _vg(q)(mlp_params, x, ct, jax.random.key(0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g_sharded, g)


def test_describe_linen(data, capsys):
    x, _, _ = data
    rows = lbf.describe(Net(), FWD_RULES, x)
    out = capsys.readouterr().out
    by = {r.path: r for r in rows}
    assert by["proj"].bits_per_param == 4.25 and by["proj"].recipe == "qat_mxfp4"
    assert by["up"].bits_per_param == 4 + 8 / 256  # NVFP4 16x16 tiles
    assert by["down"].bits_per_param == 32.0  # mxfp4_bwd keeps the forward weight
    assert by["attn/attn_scores"].kind == "attn_scores" and by["attn/attn_scores"].params == 0
    assert by["mix"].module == "Einsum" and by["up"].module == "Dense"
    total = rows[-1]
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(data[1]))
    assert total.path == "total" and total.params == n
    assert 4.0 < total.bits_per_param < 32.0
    assert "up" in out and "bits/param" in out and "total" in out


def test_nesting(data, mlp_params):
    """A quantized module nested in a larger model: paths are relative to the wrapped one."""
    x, _, _ = data
    rules = [(r"up", "qat_mxfp4")]

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return lbl.Quantized(MLP(), lbf.Rules.of(rules), name="mlp")(x) * 2.0

    shapes = jax.eval_shape(Outer().init, jax.random.key(1), x)["params"]
    (name,) = shapes  # one child holding the MLP's parameters
    assert jax.tree.structure(shapes[name]) == jax.tree.structure(mlp_params)
    y = _fwd(Outer())({name: mlp_params}, x)
    np.testing.assert_array_equal(y, _fwd(lbf.quantize(MLP(), rules))(mlp_params, x) * 2.0)
