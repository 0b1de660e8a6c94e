"""Linen: the shared Flax integration tests (``tests/flax_base.py``) through a Linen adapter,
and what only Linen has: rules applied by interception (also inside ``@nn.compact`` and nested
modules), keys drawn from ``apply(..., rngs={"quant": key})``, the ``nn.Einsum`` stand-in,
packed modules that take packed params, ``implementation`` as a static (hashable) field.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import lowbit.flax as lbf
from lowbit.flax import linen as lbl
from lowbit.gemm.implementation import resolve
from tests.flax_base import (
    BAD_IMPLEMENTATION,
    FWD_RULES,
    NET_MODULES,
    Adapter,
    D,
    FlaxIntegrationBase,
    assert_trees_equal,
    example_x,
)


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


HAND = (  # Net's lowbit ops by hand, as RULES say
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


@functools.cache
def _net_params():
    return jax.jit(Net().init)(jax.random.key(1), example_x())["params"]


@functools.cache
def _mlp_params():
    return jax.jit(MLP().init)(jax.random.key(3), example_x())["params"]


@dataclasses.dataclass(frozen=True, eq=False)
class LinenModel:
    """A Linen model for the shared tests: the module, its params, the quant key's seed
    (None: ``apply`` gets no ``"quant"`` stream)."""

    module: nn.Module
    params: Any
    seed: int | None = None

    def rngs(self) -> dict:
        return {} if self.seed is None else {"quant": jax.random.key(self.seed)}


@functools.cache
def _vg(module):
    """jit(value_and_grad) of ``sum(module(x) * ct)`` w.r.t. params and x; rngs an argument."""

    def loss(p, x, ct, rngs):
        y = module.apply({"params": p}, x, rngs=rngs)
        return jnp.sum(y * ct), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@functools.cache
def _fwd(module):
    return jax.jit(lambda p, x, rngs: module.apply({"params": p}, x, rngs=rngs))


@functools.cache
def _outputs(module):
    def run(p, x):
        return module.apply({"params": p}, x, capture_intermediates=True)[1]["intermediates"]

    return jax.jit(run)


class LinenAdapter(Adapter):
    dense, dense_general, einsum = "Dense", "DenseGeneral", "Einsum"
    missing_stream = r"module 'up' uses recipe 'nvfp4'.*'quant' rng stream"
    op_types = (lbl.DotGeneral, lbl.Einsum)

    def net(self):
        return LinenModel(Net(), _net_params())

    def hand(self, seed):
        return LinenModel(Net(ops=HAND), _net_params(), seed)

    def mlp(self):
        return LinenModel(MLP(), _mlp_params())

    def quantize(self, model, rules, *, seed=None, **kwargs):
        return LinenModel(lbf.quantize(model.module, rules, **kwargs), model.params, seed)

    def step(self, model, x, ct):
        (_, y), (g, gx) = _vg(model.module)(model.params, x, ct, model.rngs())
        return y, g, gx

    def forward(self, model, x):
        return _fwd(model.module)(model.params, x, model.rngs())

    def forward_shape(self, model, x):
        return jax.eval_shape(
            lambda p, x: model.module.apply({"params": p}, x, rngs=model.rngs()), model.params, x
        )

    def outputs(self, model, x):
        inter = _outputs(model.module)(model.params, x)
        return {name: inter[name] for name in NET_MODULES}

    def params(self, model):
        return model.params

    def init_params(self, model, x):
        return jax.eval_shape(model.module.init, jax.random.key(1), x)["params"]

    def sites(self, model, rules, x, **kwargs):
        return lbf.sites(model.module, rules, x, **kwargs)

    def describe(self, model, rules, x, **kwargs):
        return lbf.describe(model.module, rules, x, **kwargs)

    def pack(self, model, rules, x, abstract=False):
        sites = lbf.sites(model.module, rules, x)
        pack = lambda p: lbf.pack(p, rules, sites=sites)  # noqa: E731
        return jax.eval_shape(pack, model.params) if abstract else jax.jit(pack)(model.params)

    def serve(self, model, rules, packed, **kwargs):
        return LinenModel(lbf.quantize(model.module, rules, packed=True, **kwargs), packed)

    def shard(self, model, mesh, spec):
        place = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        return dataclasses.replace(model, params=jax.tree.map(place, model.params, spec))


class TestLinen(FlaxIntegrationBase):
    adapter = LinenAdapter()

    def check_packed(self, model, packed, sites, x, y_fake):
        # unpack right before a plain apply, under the serving interceptor: the same computation
        def unpacked_apply(p, x):
            with lbl.intercept(FWD_RULES, packed=True):
                return Net().apply({"params": lbf.unpack(p)}, x)

        np.testing.assert_array_equal(jax.jit(unpacked_apply)(packed, x), y_fake)


# --------------------------------------------------------------------------------------------
# Linen only


def test_missing_quant_stream_init_and_outside_a_module():
    x = example_x()
    q = lbf.quantize(MLP(), [(r"up", "nvfp4")])
    # init needs no quant stream and gives the float model's parameters
    assert_trees_equal(jax.jit(q.init)(jax.random.key(3), x)["params"], _mlp_params())
    # by hand, outside any module
    dg = lbl.DotGeneral("nvfp4")
    with pytest.raises(ValueError, match="outside a bound Flax Linen module"):
        dg(jnp.ones((16, 32)), jnp.ones((32, 8)), (((1,), (0,)), ((), ())))


def test_linen_einsum_equivalent_is_nn_einsum():
    """The interceptor's stand-in for nn.Einsum.__call__ is nn.Einsum (bit for bit)."""
    x = example_x()
    layer = nn.Einsum((D, 2, D), "btd,dkf->btkf")
    v = layer.init(jax.random.key(0), x)

    def interceptor(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.Einsum) and context.method_name == "__call__":
            return lbl._einsum_call(context.module, jnp.einsum, *args, **kwargs)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        y = layer.apply(v, x)
    np.testing.assert_array_equal(y, layer.apply(v, x))


def test_packed_module_rejects_float_params():
    serve = lbf.quantize(MLP(), [(r"up", "qat_mxfp4")], packed=True)
    with pytest.raises(ValueError, match="params without any QArray: pack them first"):
        jax.eval_shape(lambda p: serve.apply({"params": p}, example_x()), _mlp_params())
    with pytest.raises(TypeError, match="pass example inputs"):
        lbf.describe(MLP(), [(r"up", "qat_mxfp4")])


def test_pack_needs_layouts_for_rank3_kernels():
    params = _net_params()
    with pytest.raises(ValueError, match=r"contraction axis of 'attn/out/kernel'"):
        lbf.pack(params, [(r"attn/out", "qat_mxfp4")])
    with pytest.raises(ValueError, match="Hadamard"):
        lbf.pack(params, [(r"up", "quartet")])


def test_nesting():
    """A quantized module nested in a larger model: paths are relative to the wrapped one."""
    x, mlp_params = example_x(), _mlp_params()
    rules = [(r"up", "qat_mxfp4")]

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return lbl.Quantized(MLP(), lbf.Rules.of(rules), name="mlp")(x) * 2.0

    shapes = jax.eval_shape(Outer().init, jax.random.key(1), x)["params"]
    (name,) = shapes  # one child holding the MLP's parameters
    assert jax.tree.structure(shapes[name]) == jax.tree.structure(mlp_params)
    y = _fwd(Outer())({name: mlp_params}, x, {})
    np.testing.assert_array_equal(y, _fwd(lbf.quantize(MLP(), rules))(mlp_params, x, {}) * 2.0)


def test_implementation_is_a_static_field():
    """``implementation`` is a hashable dataclass field of the module and of the ops it
    injects: jit caches (and Linen's module identity) tell implementations apart; clone()
    keeps it; intercept() validates it."""
    rules = [(r"up", "qat_mxfp4")]
    q = lbf.quantize(MLP(), rules, implementation="pallas")
    pallas = resolve("pallas")
    assert q.implementation == pallas and q.clone().implementation == pallas
    assert hash(q) == hash(lbf.quantize(MLP(), rules, implementation="pallas"))
    assert q != lbf.quantize(MLP(), rules, implementation="xla")
    assert lbf.quantize(MLP(), rules).implementation == resolve(None)
    op = lbl.DotGeneral("qat_mxfp4", implementation="xla")
    assert hash(op) == hash(lbl.DotGeneral("qat_mxfp4", implementation="xla"))
    assert op != lbl.DotGeneral("qat_mxfp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.implementation = "pallas"
    with pytest.raises(ValueError, match=BAD_IMPLEMENTATION):
        with lbl.intercept(rules, implementation="cuda"):
            pass
    with pytest.raises(ValueError, match=BAD_IMPLEMENTATION):
        lbl.Quantized(MLP(), lbf.Rules.of(rules), implementation="cuda")
