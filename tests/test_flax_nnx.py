"""NNX: rules applied by graph traversal equal the same model written with lowbit by hand
(outputs and gradients, bit for bit); unmatched modules equal the float model; the "quant"
stream drives stochastic rounding; packed inference equals fake-quantized inference; nnx.jit,
jax.jit and sharded parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit as lb
import lowbit.flax as lbf

B, T, D = 2, 16, 32  # T = 16: NVFP4's wgrad Hadamard runs along the token axis


class Net(nnx.Module):
    """A small transformer-ish block; ``ops``: hand-written lowbit ops by attribute name."""

    def __init__(self, rngs: nnx.Rngs, ops: dict | None = None):
        o = ops or {}
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            2,
            D,
            decode=False,
            rngs=rngs,
            attention_fn=o.get("attn", nnx.dot_product_attention),
        )
        self.proj = nnx.LinearGeneral(D, (2, D), dot_general=o.get("proj"), rngs=rngs)
        self.mix = nnx.Einsum(
            "btkd,kdf->btf", (2, D, D), (D,), rngs=rngs, einsum_op=o.get("mix", jnp.einsum)
        )
        self.up = nnx.Linear(D, 64, dot_general=o.get("up", lax.dot_general), rngs=rngs)
        self.down = nnx.Linear(64, D, dot_general=o.get("down", lax.dot_general), rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        h = self.mix(self.proj(x))
        return x + self.down(nnx.gelu(self.up(h)))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, 64, rngs=rngs)
        self.down = nnx.Linear(64, D, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


RULES = [
    (r"attn/attn_scores", "mxfp8"),
    (r"attn/attn_values", "qat_mxfp6"),
    (r"attn/.*", "none"),  # query/key/value/out projections stay in float
    (r"proj", "qat_mxfp4"),
    (r"mix", "qat_mxfp8"),
    (r"up", "nvfp4"),  # stochastic rounding of gradients: needs the quant stream
]


def _hand(seed: int) -> dict:
    qr = nnx.Rngs(quant=seed)
    return {
        "attn": lbf.nnx.Attention("mxfp8", "qat_mxfp6", rngs=qr),
        "proj": lbf.nnx.DotGeneral("qat_mxfp4"),
        "mix": lbf.nnx.Einsum("qat_mxfp8"),
        "up": lbf.nnx.DotGeneral("nvfp4", rngs=qr),
    }


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(0), (B, T, D))


@pytest.fixture(scope="module")
def ct():
    return jax.random.normal(jax.random.key(2), (B, T, D))


@nnx.jit
def _step(model, x, ct):
    """Output and gradients (w.r.t. the parameters and x) of ``sum(model(x) * ct)``."""

    def loss(model, x):
        y = model(x)
        return jnp.sum(y * ct), y

    (_, y), (g_model, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
    return y, nnx.state(g_model, nnx.Param), g_x


def _assert_trees_equal(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def test_rules_equal_hand_written(x, ct):
    model = Net(nnx.Rngs(1))
    hand = Net(nnx.Rngs(1), ops=_hand(5))
    _assert_trees_equal(nnx.state(hand, nnx.Param), nnx.state(model, nnx.Param))
    qmodel = lbf.quantize(model, RULES, rngs=nnx.Rngs(quant=5))
    y_rules, g_rules, gx_rules = _step(qmodel, x, ct)
    y_hand, g_hand, gx_hand = _step(hand, x, ct)
    _assert_trees_equal(y_rules, y_hand)
    _assert_trees_equal(g_rules, g_hand)
    _assert_trees_equal(gx_rules, gx_hand)
    # the stream advanced by the same draws in both (one NVFP4 GEMM per call)
    assert int(qmodel.up.dot_general.stream.count[...]) == 1
    assert int(hand.up.dot_general.stream.count[...]) == 1
    # quantize() returned a new model; the float model is untouched
    assert (
        model.up.dot_general is lax.dot_general
        and model.attn.attention_fn is nnx.dot_product_attention
    )
    assert isinstance(qmodel.mix.einsum_op, lbf.nnx.Einsum)


def test_unmatched_modules_are_the_float_model(x, ct):
    model = Net(nnx.Rngs(1))
    y_f, g_f, gx_f = _step(model, x, ct)
    y, g, gx = _step(lbf.quantize(model, [(r"nothing", "mxfp4"), (r".*", "none")]), x, ct)
    _assert_trees_equal((y, g, gx), (y_f, g_f, gx_f))
    # Only the last layer quantized: every other module is the float module.
    q = lbf.quantize(model, [(r"down", "qat_mxfp4")])
    assert isinstance(q.down.dot_general, lbf.nnx.DotGeneral)
    assert q.up.dot_general is lax.dot_general and q.proj.dot_general is None
    assert q.mix.einsum_op is jnp.einsum and q.attn.attention_fn is nnx.dot_product_attention
    h = jax.random.normal(jax.random.key(3), (B, T, 64))
    f = nnx.jit(lambda m, h: m.up(h[..., :D]))
    np.testing.assert_array_equal(f(q, h), f(model, h))
    g = nnx.jit(lambda m, h: m.down(h))
    assert not np.array_equal(g(q, h), g(model, h))


def test_quant_stream_drives_stochastic_rounding(x, ct):
    model = MLP(nnx.Rngs(1))
    rules = [(r"up|down", "nvfp4")]
    r1, r1b, r2 = (lbf.quantize(model, rules, rngs=nnx.Rngs(quant=s)) for s in (1, 1, 2))
    y1, g1, gx1 = _step(r1, x, ct)
    y1b, g1b, gx1b = _step(r1b, x, ct)
    y2, g2, gx2 = _step(r2, x, ct)
    _assert_trees_equal((g1, gx1), (g1b, gx1b))
    np.testing.assert_array_equal(y1, y2)  # NVFP4's forward rounds to nearest
    assert not np.array_equal(g1["up"]["kernel"][...], g2["up"]["kernel"][...])
    assert not np.array_equal(gx1, gx2)
    # the stream is model state: the next step draws new keys
    _, g1_next, _ = _step(r1, x, ct)
    assert not np.array_equal(g1["up"]["kernel"][...], g1_next["up"]["kernel"][...])


def test_missing_quant_stream():
    model = MLP(nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"module 'up' \(Linear\) uses recipe 'nvfp4'.*'quant'"):
        lbf.quantize(model, [(r"up", "nvfp4")])
    with pytest.raises(ValueError, match=r"streams \['default'\]"):
        lbf.quantize(model, [(r"up", "nvfp4")], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs PRNG keys.*nnx.Rngs\\(quant="):
        lbf.nnx.DotGeneral("quartet")
    with pytest.raises(ValueError, match="'quant' rng stream"):
        lbf.quantize(Net(nnx.Rngs(0)), [(r".*attn_values", "nvfp4")])
    # recipes that need no key need no stream
    q = lbf.quantize(model, [(r"up|down", "qat_nvfp4")])
    assert q.up.dot_general.stream is None
    with pytest.raises(TypeError, match="rngs= is for NNX"):
        import flax.linen as nn

        lbf.quantize(nn.Dense(3), [(".*", "mxfp4")], rngs=nnx.Rngs(quant=0))


def test_jax_jit_split_merge_equals_nnx_jit(x, ct):
    q = lbf.quantize(MLP(nnx.Rngs(1)), [(r"up|down", "nvfp4")], rngs=nnx.Rngs(quant=3))
    q2 = nnx.clone(q)
    y_nnx, _, _ = _step(q, x, ct)
    graphdef, state = nnx.split(q2)

    @jax.jit
    def f(state, x):
        m = nnx.merge(graphdef, state)
        return m(x), nnx.state(m)

    y_jax, new_state = f(state, x)
    np.testing.assert_array_equal(y_jax, y_nnx)
    # up and down share one stream (stored once, under the first path)
    counts = [v[...] for k, v in nnx.to_flat_state(new_state) if k[-1] == "count"]
    assert [int(c) for c in counts] == [2]


FWD_RULES = [
    (r"attn/attn_scores", "mxfp8"),
    (r"attn/(query|key|value)", "qat_mxfp8"),
    (r"attn/out", "qat_nvfp4"),  # LinearGeneral over (heads, head_dim): a rank-3 weight
    (r"proj", "qat_mxfp4"),
    (r"mix", "qat_mxfp6"),
    (r"up", "nvfp4"),  # training recipe: 16x16 NVFP4 weight tiles in the forward
    (r"down", "mxfp4_bwd"),  # high-precision forward: the weight stays float
]


def test_packed_inference_equals_fake_quant(x):
    model = Net(nnx.Rngs(1))
    sites = {s.path: s for s in lbf.sites(model, FWD_RULES)}
    assert sites["attn/out"].layout == lbf.Layout(1, 2)
    assert sites["mix"].layout == lbf.Layout(1, 2)
    packed = lbf.pack(model, FWD_RULES)
    # an NNX state packs the same, given the sites (rank-3 kernels need their layouts)
    state = nnx.state(model, nnx.Param)
    with pytest.raises(ValueError, match="contraction axis of 'attn/key/kernel'"):
        lbf.pack(state, FWD_RULES)
    same = lbf.pack(state, FWD_RULES, sites=list(sites.values()))
    assert jax.tree.structure(same) == jax.tree.structure(packed)
    jax.tree.map(np.testing.assert_array_equal, same, packed)
    up = packed["up"]["kernel"].get_value()
    assert isinstance(up, lb.QArray) and up.block_shape == (16, 16)
    assert not isinstance(packed["down"]["kernel"].get_value(), lb.QArray)
    assert isinstance(packed["attn"]["out"]["kernel"].get_value(), lb.QArray)
    fake = lbf.quantize(model, FWD_RULES, rngs=nnx.Rngs(quant=0))
    pm = lbf.nnx.PackedModel(model, FWD_RULES, packed)
    run = nnx.jit(lambda m, x: m(x))
    y_fake, y_packed = run(fake, x), run(pm, x)
    np.testing.assert_array_equal(y_packed, y_fake)
    # what the packed model holds: QArrays, a fraction of the float bytes
    assert lbf.packed_nbytes(nnx.state(pm)) < 0.5 * lbf.packed_nbytes(nnx.state(model))


def test_sharded_params_under_nnx_jit(x, ct):
    """Megatron-style sharding (up: output features, down: input features) over a 2x2 GSPMD
    mesh with a batch-sharded input: the forward equals the unsharded one bit for bit."""
    model = lbf.quantize(MLP(nnx.Rngs(1)), [(r"up|down", "qat_mxfp4")])
    ref = nnx.clone(model)
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    spec = {
        "up": {"kernel": P(None, "model"), "bias": P("model")},
        "down": {"kernel": P("model", None), "bias": P()},
    }
    state = nnx.state(model, nnx.Param)
    sharded = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, NamedSharding(mesh, spec[path[0].key][path[1].key])),
        state,
    )
    nnx.update(model, sharded)
    assert len(model.up.kernel[...].sharding.device_set) == 4
    xb = jnp.concatenate([x, x[::-1]])  # batch 4: divisible by the data axis
    xs = jax.device_put(xb, NamedSharding(mesh, P("data")))
    run = nnx.jit(lambda m, x: m(x))
    np.testing.assert_array_equal(run(model, xs), run(ref, xb))
    _, g, _ = _step(model, xs, jnp.ones_like(xb))
    _, g_ref, _ = _step(ref, xb, jnp.ones_like(xb))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g, g_ref)


def test_describe_nnx(capsys):
    model = Net(nnx.Rngs(1))
    rows = lbf.describe(model, FWD_RULES)
    by = {r.path: r for r in rows}
    assert by["up"].bits_per_param == 4 + 8 / 256 and by["up"].module == "Linear"
    assert by["proj"].bits_per_param == 4.25 and by["mix"].bits_per_param == 6.25
    assert by["down"].bits_per_param == 32.0
    assert by["attn/out"].module == "LinearGeneral" and by["attn/attn_values"].recipe == "-"
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert rows[-1].params == n
    out = capsys.readouterr().out
    assert "attn/attn_scores" in out and "bits/param" in out
