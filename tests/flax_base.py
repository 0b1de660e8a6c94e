"""The Flax integration tests, written once and run for NNX and for Linen.

:class:`FlaxIntegrationBase` holds the behaviours both Flax APIs share. ``tests/test_flax_nnx.py``
and ``tests/test_flax_linen.py`` subclass it with an :class:`Adapter` that says how their
framework builds the test models, runs, quantizes, packs, serves and shards them; what only one
framework has is tested by plain tests in those files, and a subclass may add checks to a shared
test through the ``check_*`` hooks. What the shared tests assert:

1. Rules applied to a model written without lowbit equal the same model written with lowbit's
   ops by hand: outputs and gradients (parameters and input) bit for bit; the quantized model
   keeps the float model's parameter tree.
2. Modules no rule quantizes (or whose rule says ``"none"``) compute the float model's values.
3. The ``"quant"`` stream drives stochastic rounding: the same seed gives the same gradients,
   another seed other gradients, and NVFP4's nearest-rounding forward does not depend on it; a
   recipe that needs keys without a stream raises an error naming the module.
4. Packed inference equals fake-quantized inference bit for bit, from a fraction of the bytes.
5. Megatron-style sharded parameters on a 2x2 GSPMD mesh give the unsharded forward bit for bit.
6. ``describe()``: bits per weight per recipe, module kinds and names, totals, implementations.
7. ``implementation=``: validated with an error naming the argument; it reaches every
   ``lowbit.dot_general`` / ``lowbit.einsum`` call of the quantized sites (training and packed
   serving); on CPU ``"xla"`` equals the default bit for bit (outputs and gradients).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import lowbit as lb
import lowbit.flax as lbf
from lowbit.gemm.implementation import resolve

B, T, D = 2, 16, 32  # T = 16: NVFP4's wgrad Hadamard runs along the token axis

RULES = [
    (r"attn/attn_scores", "mxfp8"),
    (r"attn/attn_values", "qat_mxfp6"),
    (r"attn/.*", "none"),  # query/key/value/out projections stay in float
    (r"proj", "qat_mxfp4"),
    (r"mix", "qat_mxfp8"),
    (r"up", "nvfp4"),  # stochastic rounding of gradients: needs the quant stream
]

FWD_RULES = [
    (r"attn/attn_scores", "mxfp8"),
    (r"attn/(query|key|value)", "qat_mxfp8"),
    (r"attn/out", "qat_nvfp4"),  # a dense layer over (heads, head_dim): a rank-3 weight
    (r"proj", "qat_mxfp4"),
    (r"mix", "qat_mxfp6"),
    (r"up", "nvfp4"),  # training recipe: 16x16 NVFP4 weight tiles in the forward
    (r"down", "mxfp4_bwd"),  # high-precision forward: the weight stays float
]

SR_RULES = [(r"up|down", "nvfp4")]  # stochastic rounding and random Hadamard signs
QAT_RULES = [(r"up|down", "qat_mxfp4")]

# Megatron-style sharding of the MLP: up by output features, down by input features.
MLP_SHARDING = {
    "up": {"kernel": P(None, "model"), "bias": P("model")},
    "down": {"kernel": P("model", None), "bias": P()},
}

NET_MODULES = ("norm", "attn", "proj", "mix", "up", "down")  # in the order they run

BAD_IMPLEMENTATION = r"implementation must be one of \(None, 'xla', 'pallas'\) .*got 'cuda'"


@functools.cache
def example_x() -> jax.Array:
    return jax.random.normal(jax.random.key(0), (B, T, D))


@functools.cache
def batch4_x() -> jax.Array:
    """A batch of 4: divisible by the mesh's 'data' axis."""
    return jax.random.normal(jax.random.key(5), (4, T, D))


def assert_trees_equal(a, b):
    """Same structure, every leaf equal bit for bit."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


class Adapter:
    """How one Flax API does what the shared tests need.

    A *model* is the framework's own handle: an NNX module (parameters and rng streams
    inside), or for Linen a (module, params, key seed) triple. The test models, defined per
    framework: ``Net`` (layer norm, attention, a rank-3 dense layer ``proj``, an ``Einsum``
    ``mix``, dense ``up`` and ``down``; paths as in :data:`RULES`) and ``MLP`` (dense ``up``
    and ``down``), inputs ``[B, T, D]``.
    """

    dense: str  # class names describe() reports for the dense, rank-3 dense, einsum layers
    dense_general: str
    einsum: str
    missing_stream: str  # regex of the error for SR_RULES' 'up' without a quant stream
    op_types: tuple[type, ...]  # lowbit's injectable ops; each takes (recipe, implementation=)

    def net(self) -> Any:
        """The float ``Net`` (always the same parameters)."""
        raise NotImplementedError

    def hand(self, seed: int) -> Any:
        """``Net`` written with lowbit's ops by hand as :data:`RULES` say, the same
        parameters, keys from ``seed``."""
        raise NotImplementedError

    def mlp(self) -> Any:
        raise NotImplementedError

    def quantize(self, model, rules, *, seed: int | None = None, **kwargs) -> Any:
        """``lbf.quantize(model, rules, **kwargs)``, keys from ``seed`` (None: no stream)."""
        raise NotImplementedError

    def step(self, model, x, ct) -> tuple[jax.Array, Any, jax.Array]:
        """Jitted: ``y = model(x)``, and the gradients of ``sum(y * ct)`` with respect to the
        parameters (a plain nested dict) and to ``x``."""
        raise NotImplementedError

    def forward(self, model, x) -> jax.Array:
        raise NotImplementedError

    def forward_shape(self, model, x) -> jax.ShapeDtypeStruct:
        """:meth:`forward` traced only (``eval_shape``: nothing is compiled)."""
        raise NotImplementedError

    def outputs(self, model, x) -> dict[str, Any]:
        """What each module of ``Net`` computes (:data:`NET_MODULES`), by name."""
        raise NotImplementedError

    def params(self, model) -> Any:
        """The parameter tree of ``model`` (NNX: its ``nnx.Param`` state)."""
        raise NotImplementedError

    def init_params(self, model, x) -> Any:
        """The parameter tree ``model`` creates, abstractly (NNX: the one it holds)."""
        raise NotImplementedError

    def sites(self, model, rules, x, **kwargs) -> list[lbf.Site]:
        raise NotImplementedError

    def describe(self, model, rules, x, **kwargs) -> list[lbf.Row]:
        raise NotImplementedError

    def pack(self, model, rules, x, abstract: bool = False) -> Any:
        """``model``'s weights packed per ``rules`` (the tree :meth:`serve` takes);
        ``abstract``: shapes only, for a model that is only traced."""
        raise NotImplementedError

    def serve(self, model, rules, packed, **kwargs) -> Any:
        """A model of ``model``'s structure that runs from the ``packed`` weights."""
        raise NotImplementedError

    def shard(self, model, mesh, spec) -> Any:
        """A copy of ``model`` whose parameters are placed per ``spec`` (a PartitionSpec
        tree like :data:`MLP_SHARDING`) on ``mesh``."""
        raise NotImplementedError

    @staticmethod
    def leaf(tree, path: str):
        """``tree["a"]["b"]`` for ``"a/b"``, an NNX Variable's value unwrapped."""
        for k in path.split("/"):
            tree = tree[k]
        return tree.get_value() if hasattr(tree, "get_value") else tree


class FlaxIntegrationBase:
    """The shared tests; a subclass sets ``adapter``."""

    adapter: Adapter

    @pytest.fixture(scope="class")
    @classmethod
    def x(cls):
        return example_x()

    @pytest.fixture(scope="class")
    @classmethod
    def ct(cls):
        return jax.random.normal(jax.random.key(2), (B, T, D))

    # Hooks: framework-specific checks on what a shared test built (default: none).

    def check_rules_applied(self, model, qmodel, hand):
        """After :meth:`test_rules_equal_hand_written` ran one step of each."""

    def check_stream_advances(self, qmodel, grads, x, ct):
        """After :meth:`test_quant_stream_drives_stochastic_rounding` ran one step."""

    def check_packed(self, model, packed, sites, x, y_fake):
        """After :meth:`test_packed_inference_equals_fake_quant` compared the outputs."""

    # 1. Rules equal the hand-written model

    def test_rules_equal_hand_written(self, x, ct):
        a = self.adapter
        model, hand = a.net(), a.hand(seed=5)
        assert_trees_equal(a.params(hand), a.params(model))
        qmodel = a.quantize(model, RULES, seed=5)
        y_rules, g_rules, gx_rules = a.step(qmodel, x, ct)
        y_hand, g_hand, gx_hand = a.step(hand, x, ct)
        assert_trees_equal(y_rules, y_hand)
        assert_trees_equal(g_rules, g_hand)
        assert_trees_equal(gx_rules, gx_hand)
        assert not np.array_equal(y_rules, a.forward(model, x))  # something was quantized
        # the quantized model keeps the float model's parameter tree
        shapes = a.init_params(qmodel, x)
        assert jax.tree.structure(shapes) == jax.tree.structure(a.params(model))
        self.check_rules_applied(model, qmodel, hand)

    # 2. What no rule quantizes is the float model

    def test_unmatched_modules_are_the_float_model(self, x, ct):
        a = self.adapter
        model = a.net()
        float_step = a.step(model, x, ct)
        q = a.quantize(model, [(r"nothing", "mxfp4"), (r".*", "none")])
        assert_trees_equal(a.step(q, x, ct), float_step)
        # Only the last layer quantized: every module before it computes the float values.
        out_q = a.outputs(a.quantize(model, [(r"down", "mxfp4")]), x)
        out_f = a.outputs(model, x)
        *before, last = NET_MODULES
        for name in before:
            assert_trees_equal(out_q[name], out_f[name])
        assert not np.array_equal(jax.tree.leaves(out_q[last])[0], jax.tree.leaves(out_f[last])[0])

    # 3. Keys

    def test_quant_stream_drives_stochastic_rounding(self, x, ct):
        a = self.adapter
        mlp = a.mlp()
        r1, r1b, r2 = (a.quantize(mlp, SR_RULES, seed=s) for s in (1, 1, 2))
        y1, g1, gx1 = a.step(r1, x, ct)
        y1b, g1b, gx1b = a.step(r1b, x, ct)
        y2, g2, gx2 = a.step(r2, x, ct)
        assert_trees_equal((g1, gx1), (g1b, gx1b))
        self.check_stream_advances(r1, g1, x, ct)

    def test_missing_quant_stream(self, x):
        a = self.adapter
        with pytest.raises(ValueError, match=a.missing_stream):
            a.forward_shape(a.quantize(a.mlp(), [(r"up", "nvfp4")]), x)
        # recipes that need no key need no stream
        q = a.quantize(a.mlp(), [(r"up", "qat_nvfp4"), (r"down", "mxfp8")])
        assert a.forward_shape(q, x).shape == x.shape

    # 4. Packed inference

    def test_packed_inference_equals_fake_quant(self, x):
        a = self.adapter
        model = a.net()
        sites = a.sites(model, FWD_RULES, x)
        by = {s.path: s for s in sites}
        assert by["attn/out"].layout == lbf.Layout(1, 2)
        assert by["mix"].layout == lbf.Layout(1, 2) and by["mix"].kind == "einsum"
        assert by["attn/attn_values"].recipe is None
        packed = a.pack(model, FWD_RULES, x)
        up = a.leaf(packed, "up/kernel")
        assert isinstance(up, lb.QArray) and up.block_shape == (16, 16)
        assert not isinstance(a.leaf(packed, "down/kernel"), lb.QArray)
        assert isinstance(a.leaf(packed, "attn/out/kernel"), lb.QArray)
        assert lbf.packed_nbytes(packed) < 0.5 * lbf.packed_nbytes(a.params(model))
        fake = a.quantize(model, FWD_RULES, seed=0)  # 'nvfp4' asks for a quant stream
        y_fake = a.forward(fake, x)
        y_packed = a.forward(a.serve(model, FWD_RULES, packed), x)
        np.testing.assert_array_equal(y_packed, y_fake)
        self.check_packed(model, packed, sites, x, y_fake)

    # 5. Sharding

    def test_sharded_params(self):
        """Megatron-style sharding over 4 devices and a batch-sharded input, GSPMD (Auto)
        mesh: the forward equals the unsharded one bit for bit (blocks run along unsharded
        axes or whole shards); gradients to rounding."""
        a = self.adapter
        x = batch4_x()
        mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        q = a.quantize(a.mlp(), QAT_RULES)
        sharded = a.shard(q, mesh, MLP_SHARDING)
        assert len(a.leaf(a.params(sharded), "up/kernel").sharding.device_set) == 4
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        ct = jnp.ones_like(x)
        y_sharded, g_sharded, _ = a.step(sharded, xs, ct)  # the forward is the step's output
        y, g, _ = a.step(q, x, ct)
        assert y_sharded.sharding.spec[0] == "data"
        np.testing.assert_array_equal(y_sharded, y)
        jax.tree.map(
            lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5), g_sharded, g
        )

    # 6. describe

    def test_describe(self, x, capsys):
        a = self.adapter
        model = a.net()
        rows = a.describe(model, FWD_RULES, x)
        out = capsys.readouterr().out
        by = {r.path: r for r in rows}
        assert by["up"].bits_per_param == 4 + 8 / 256 and by["up"].module == a.dense  # 16x16
        assert by["proj"].bits_per_param == 4.25 and by["proj"].recipe == "qat_mxfp4"
        assert by["mix"].bits_per_param == 6.25 and by["mix"].module == a.einsum
        assert by["down"].bits_per_param == 32.0  # mxfp4_bwd keeps the forward weight
        assert by["attn/out"].module == a.dense_general and by["attn/attn_values"].recipe == "-"
        assert by["attn/attn_scores"].kind == "attn_scores" and by["attn/attn_scores"].params == 0
        total = rows[-1]
        n = sum(int(np.prod(np.shape(p))) for p in jax.tree.leaves(a.params(model)))
        assert total.path == "total" and total.params == n
        assert 4.0 < total.bits_per_param < 32.0
        for word in ("attn/attn_scores", "up", "bits/param", "total", "impl", "auto"):
            assert word in out
        # the implementation the quantized sites would run (resolved where describe starts)
        assert all(r.implementation == (resolve(None) if r.recipe not in ("-", "") else None)
                   for r in rows)
        mlp, rules = a.mlp(), [(r"up", "qat_mxfp4")]
        rows = a.describe(mlp, rules, x, implementation="pallas", print_fn=None)
        assert {r.path: r.implementation for r in rows} == {
            "up": resolve("pallas"),
            "down": None,
            "total": None,
        }
        sites = a.sites(mlp, rules, x, implementation="xla")
        assert {s.path: s.implementation for s in sites} == {"up": resolve("xla"), "down": None}

    # 7. implementation=

    def test_implementation_xla_equals_default(self):
        """On CPU, implementation="xla" (the pure-XLA reference) computes what the default
        computes, outputs and gradients bit for bit. (The same model and input as the
        unsharded step of :meth:`test_sharded_params`.)"""
        a = self.adapter
        x = batch4_x()
        ct = jnp.ones_like(x)
        mlp = a.mlp()
        xla = a.step(a.quantize(mlp, QAT_RULES, implementation="xla"), x, ct)
        assert_trees_equal(xla, a.step(a.quantize(mlp, QAT_RULES), x, ct))

    def test_implementation_reaches_every_gemm(self, x, monkeypatch):
        a = self.adapter
        model, mlp = a.net(), a.mlp()
        mlp_rules = [(r".*", "qat_mxfp4")]
        packed = a.pack(mlp, mlp_rules, x, abstract=True)
        calls = []

        def spy(f):
            def record(*args, **kwargs):
                calls.append(kwargs.get("implementation"))
                return f(*args, **kwargs)

            return record

        monkeypatch.setattr(lb, "dot_general", spy(lb.dot_general))
        monkeypatch.setattr(lb, "einsum", spy(lb.einsum))
        # every site of Net: 4 attention projections, its 2 einsums, proj, mix, up, down
        a.forward_shape(a.quantize(model, [(r".*", "mxfp8")], implementation="pallas"), x)
        assert calls == [resolve("pallas")] * 10
        calls.clear()
        a.forward_shape(a.quantize(mlp, mlp_rules), x)
        assert calls == [resolve(None)] * 2
        calls.clear()  # packed serving
        a.forward_shape(a.serve(mlp, mlp_rules, packed, implementation="pallas"), x)
        assert calls == [resolve("pallas")] * 2

    def test_implementation_is_validated(self, x):
        a = self.adapter
        mlp = a.mlp()
        rules = [(r"up", "qat_mxfp4")]
        with pytest.raises(ValueError, match=BAD_IMPLEMENTATION):
            a.quantize(mlp, rules, implementation="cuda")
        with pytest.raises(ValueError, match=BAD_IMPLEMENTATION):
            a.serve(mlp, rules, None, implementation="cuda")
        with pytest.raises(ValueError, match=BAD_IMPLEMENTATION):
            a.describe(mlp, rules, x, implementation="cuda", print_fn=None)
        for op in a.op_types:
            with pytest.raises(ValueError, match=BAD_IMPLEMENTATION):
                op("mxfp4", implementation="cuda")
            assert op("mxfp4", implementation="pallas").implementation == resolve("pallas")
        for bad in ("XLA", "triton", 3, ("xla",)):
            with pytest.raises(ValueError, match="implementation must be one of"):
                a.quantize(mlp, rules, implementation=bad)
