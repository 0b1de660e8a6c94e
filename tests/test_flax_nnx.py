"""NNX: the shared Flax integration tests (``tests/flax_base.py``) through an NNX adapter, and
what only NNX has: rules set ops on a clone of the model graph, the ``"quant"`` stream is model
state (drawn when quantizing, advanced by every step, split / merged with the model), the ops
hold ``implementation`` as static graph data, packing an ``nnx.State`` needs the sites.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding

import lowbit.flax as lbf
from lowbit.gemm.implementation import resolve
from tests.flax_base import (
    FWD_RULES,
    SR_RULES,
    Adapter,
    D,
    FlaxIntegrationBase,
    example_x,
)


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

    def outputs(self, x) -> dict:
        """What each submodule computes, by name; ``"out"``: the block's output."""
        o = {"norm": self.norm(x)}
        o["attn"] = self.attn(o["norm"])
        x = x + o["attn"]
        o["proj"] = self.proj(x)
        o["mix"] = self.mix(o["proj"])
        o["up"] = self.up(o["mix"])
        o["down"] = self.down(nnx.gelu(o["up"]))
        o["out"] = x + o["down"]
        return o

    def __call__(self, x):
        return self.outputs(x)["out"]


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, 64, rngs=rngs)
        self.down = nnx.Linear(64, D, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def _hand(seed: int) -> dict:
    """Net's lowbit ops by hand, as RULES say."""
    qr = nnx.Rngs(quant=seed)
    return {
        "attn": lbf.nnx.Attention("mxfp8", "qat_mxfp6", rngs=qr),
        "proj": lbf.nnx.DotGeneral("qat_mxfp4"),
        "mix": lbf.nnx.Einsum("qat_mxfp8"),
        "up": lbf.nnx.DotGeneral("nvfp4", rngs=qr),
    }


def _step_fn(model, x, ct):
    """Output and gradients (w.r.t. the parameters and x) of ``sum(model(x) * ct)``."""

    def loss(model, x):
        y = model(x)
        return jnp.sum(y * ct), y

    (_, y), (g_model, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
    return y, nnx.state(g_model, nnx.Param), g_x


_step = nnx.jit(_step_fn)
_forward = nnx.jit(lambda m, x: m(x))
_outputs = nnx.jit(lambda m, x: m.outputs(x))


class NNXAdapter(Adapter):
    dense, dense_general, einsum = "Linear", "LinearGeneral", "Einsum"
    missing_stream = r"module 'up' \(Linear\) uses recipe 'nvfp4'.*'quant'"
    op_types = (lbf.nnx.DotGeneral, lbf.nnx.Einsum, lbf.nnx.Attention)

    def net(self):
        return Net(nnx.Rngs(1))

    def hand(self, seed):
        return Net(nnx.Rngs(1), ops=_hand(seed))

    def mlp(self):
        return MLP(nnx.Rngs(1))

    def quantize(self, model, rules, *, seed=None, **kwargs):
        rngs = nnx.Rngs(quant=seed) if seed is not None else None
        return lbf.quantize(model, rules, rngs=rngs, **kwargs)

    def step(self, model, x, ct):
        y, g, gx = _step(model, x, ct)
        return y, nnx.to_pure_dict(g), gx

    def forward(self, model, x):
        return _forward(model, x)

    def forward_shape(self, model, x):
        return nnx.eval_shape(lambda m, x: m(x), model, x)

    def outputs(self, model, x):
        return _outputs(model, x)

    def params(self, model):
        return nnx.state(model, nnx.Param)

    def init_params(self, model, x):
        return nnx.state(model, nnx.Param)

    def sites(self, model, rules, x, **kwargs):
        return lbf.sites(model, rules, **kwargs)

    def describe(self, model, rules, x, **kwargs):
        return lbf.describe(model, rules, **kwargs)

    def pack(self, model, rules, x, abstract=False):
        if abstract:
            return nnx.eval_shape(lambda m: lbf.pack(m, rules), model)
        return lbf.pack(model, rules)

    def serve(self, model, rules, packed, **kwargs):
        return lbf.nnx.PackedModel(model, rules, packed, **kwargs)

    def shard(self, model, mesh, spec):
        model = nnx.clone(model)
        sharded = jax.tree_util.tree_map_with_path(
            lambda path, a: jax.device_put(a, NamedSharding(mesh, spec[path[0].key][path[1].key])),
            nnx.state(model, nnx.Param),
        )
        nnx.update(model, sharded)
        return model


class TestNNX(FlaxIntegrationBase):
    adapter = NNXAdapter()

    def check_rules_applied(self, model, qmodel, hand):
        # the stream advanced by the same draws in both (one NVFP4 GEMM per call)
        assert int(qmodel.up.dot_general.stream.count[...]) == 1
        assert int(hand.up.dot_general.stream.count[...]) == 1
        # quantize() returned a new model; the float model is untouched
        assert model.up.dot_general is lax.dot_general
        assert model.attn.attention_fn is nnx.dot_product_attention
        assert isinstance(qmodel.mix.einsum_op, lbf.nnx.Einsum)

    def check_stream_advances(self, qmodel, grads, x, ct):
        # the stream is model state: the next step draws new keys
        _, g_next, _ = self.adapter.step(qmodel, x, ct)
        assert not np.array_equal(grads["up"]["kernel"], g_next["up"]["kernel"])

    def check_packed(self, model, packed, sites, x, y_fake):
        # an NNX state packs the same, given the sites (rank-3 kernels need their layouts)
        state = nnx.state(model, nnx.Param)
        with pytest.raises(ValueError, match="contraction axis of 'attn/key/kernel'"):
            lbf.pack(state, FWD_RULES)
        same = lbf.pack(state, FWD_RULES, sites=sites)
        assert jax.tree.structure(same) == jax.tree.structure(packed)
        jax.tree.map(np.testing.assert_array_equal, same, packed)
        # what the packed model holds: QArrays, a fraction of the float bytes
        pm = lbf.nnx.PackedModel(model, FWD_RULES, packed)
        assert lbf.packed_nbytes(nnx.state(pm)) < 0.5 * lbf.packed_nbytes(state)


# --------------------------------------------------------------------------------------------
# NNX only


def test_quantize_sets_only_the_matched_ops():
    model = Net(nnx.Rngs(1))
    q = lbf.quantize(model, [(r"down", "qat_mxfp4")])
    assert isinstance(q.down.dot_general, lbf.nnx.DotGeneral)
    assert q.up.dot_general is lax.dot_general and q.proj.dot_general is None
    assert q.mix.einsum_op is jnp.einsum and q.attn.attention_fn is nnx.dot_product_attention


def test_missing_quant_stream_errors():
    model = MLP(nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"streams \['default'\]"):
        lbf.quantize(model, [(r"up", "nvfp4")], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs PRNG keys.*nnx.Rngs\\(quant="):
        lbf.nnx.DotGeneral("quartet")
    with pytest.raises(ValueError, match="'quant' rng stream"):
        lbf.quantize(Net(nnx.Rngs(0)), [(r".*attn_values", "nvfp4")])
    # recipes that need no key hold no stream
    q = lbf.quantize(model, [(r"up|down", "qat_nvfp4")])
    assert q.up.dot_general.stream is None
    with pytest.raises(TypeError, match="rngs= is for NNX"):
        import flax.linen as nn

        lbf.quantize(nn.Dense(3), [(".*", "mxfp4")], rngs=nnx.Rngs(quant=0))


def test_jax_jit_split_merge_equals_nnx_jit():
    x = example_x()
    q = lbf.quantize(MLP(nnx.Rngs(1)), SR_RULES, rngs=nnx.Rngs(quant=3))
    q2 = nnx.clone(q)
    y_nnx, _, _ = _step(q, x, jnp.ones_like(x))
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


def test_implementation_is_static_graph_data():
    """The ops keep ``implementation`` through clone / split / merge; it is part of the
    graphdef (so nnx.jit traces each implementation apart) and not of the state."""
    model = Net(nnx.Rngs(1))
    rules = [(r".*attn_scores", "mxfp8"), (r"mix|up", "qat_mxfp4")]
    q = lbf.quantize(model, rules, implementation="pallas")
    ops = lambda m: (m.attn.attention_fn, m.mix.einsum_op, m.up.dot_general)  # noqa: E731
    graphdef, state = nnx.split(q)
    for m in (q, nnx.clone(q), nnx.merge(graphdef, state)):
        assert [op.implementation for op in ops(m)] == [resolve("pallas")] * 3
    assert "pallas" not in str(jax.tree.leaves(state))
    assert nnx.graphdef(lbf.quantize(model, rules, implementation="xla")) != graphdef
    assert nnx.graphdef(lbf.quantize(model, rules, implementation="pallas")) == graphdef
    assert all(op.implementation == resolve(None) for op in ops(lbf.quantize(model, rules)))
    # the serving structure PackedModel splits (its graphdef) holds it too
    serving = lbf.nnx.quantize(model, rules, packed=True, implementation="xla")
    assert [op.implementation for op in ops(serving)] == [resolve("xla")] * 3
    assert serving.down.dot_general is lax.dot_general
