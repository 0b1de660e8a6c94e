"""One adapter per Flax API (NNX, Linen), chosen once where a model enters the library.

An adapter answers the questions the rest of lowbit asks of a model: which sites it has, how
its GEMMs are swapped for lowbit ops (:func:`lowbit.flax.quantize`), how its parameters are read
and written, how it runs under observation or substitution hooks, and how it serves packed
weights. :func:`adapter_for` picks one from the model's type; :mod:`lowbit.flax`,
:mod:`lowbit.ptq` and :mod:`lowbit.autoquant` call its methods and never branch on the
framework themselves.

>>> from flax import nnx
>>> from lowbit.flax.adapters import adapter_for
>>> adapter_for(nnx.Linear(4, 4, rngs=nnx.Rngs(0))).name
'nnx'
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx as fnnx

from lowbit.core.qarray import QArray
from lowbit.flax import _core, linen, nnx
from lowbit.flax._core import Recipe, Rules, Site, SiteTransform
from lowbit.flax.packing import unpack
from lowbit.gemm.implementation import Implementation
from lowbit.io.tree import is_qarray, keypath_str, path_str

__all__ = ["Adapter", "NnxAdapter", "LinenAdapter", "Bound", "Edit", "Probe", "adapter_for"]


@dataclasses.dataclass(frozen=True)
class Bound:
    """A model with its parameters: NNX, the model (``variables`` None); Linen, the unbound
    module and its variables."""

    model: Any
    variables: Any = None

    @property
    def name(self) -> str:
        return type(self.model).__name__


@dataclasses.dataclass(frozen=True, eq=False)
class Edit:
    """What a post-training transformation does to one site: the recipe its op runs, its
    :class:`~lowbit.flax._core.SiteTransform` (None: none) and the weight it holds (None:
    its own)."""

    site: Site
    recipe: Recipe
    transform: SiteTransform | None = None
    kernel: Any = None


@dataclasses.dataclass
class Probe:
    """A copy of a model whose sites hold float ops that hooks reach (``observe=True``):
    ``adapter.run(probe, fn, state, batch, hook)`` runs ``fn(model_or_variables, batch)``
    with ``state`` under a :func:`~lowbit.flax.substituting` hook; ``structure`` is the
    hashable part a compiled program can be cached by."""

    adapter: Adapter
    structure: Any
    state: Any
    recipe: Recipe

    def __call__(self, fn, state, batch, hook):
        return self.adapter.run(self, fn, state, batch, hook)


class Adapter:
    """The questions lowbit asks of a model (see the module docstring); one subclass per
    Flax API, one instance each (:data:`NNX`, :data:`LINEN`)."""

    name: str
    transform_params: tuple[str, ...]  # names of the parameters a SiteTransform is kept in

    # lowbit.flax: sites, rules, packing
    def sites(self, model, rules: Rules, args=(), kwargs=None, *,
              implementation: Implementation | None = None) -> list[Site]:
        """The model's sites (Linen: traced on example inputs ``args``, ``kwargs``)."""
        raise NotImplementedError

    def sites_and_params(self, model, rules: Rules, args=(), kwargs=None, *,
                         implementation: Implementation | None = None) -> tuple[list[Site], Any]:
        """The sites and the (possibly abstract) parameter tree."""
        raise NotImplementedError

    def quantize(self, model, rules: Rules, *, rngs, packed: bool, method: str,
                 implementation: Implementation, observe: bool):
        """The model with the rules' sites swapped for lowbit ops."""
        raise NotImplementedError

    def pack(self, model, rules: Rules, site_list):
        """The model's parameters with the rules' weights packed."""
        raise NotImplementedError

    # lowbit.ptq: a model with its parameters, transformed and run under observation
    def bound(self, model, where: str) -> Bound:
        raise NotImplementedError

    def needs_example(self) -> bool:
        """Whether finding the sites needs example inputs."""
        raise NotImplementedError

    def params(self, b: Bound):
        raise NotImplementedError

    def rebuild(self, b: Bound, edits: list[Edit], rules: Rules, *, packed: bool,
                observe: bool, implementation: Implementation | None) -> Bound:
        raise NotImplementedError

    def observer(self, b: Bound, call, collect, static) -> Callable:
        raise NotImplementedError

    def simulated_weights(self, weights: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def served(self, b: Bound, sites: list[Site], weights: dict[str, Any]):
        raise NotImplementedError

    def finish(self, b: Bound):
        """The runnable model of ``b``."""
        raise NotImplementedError

    def packed_params(self, packed):
        """The parameter tree of a packed (served) model."""
        raise NotImplementedError

    # lowbit.autoquant: probes under substitution hooks
    def probe(self, model, variables, recipe: Recipe) -> Probe:
        raise NotImplementedError

    def run(self, probe: Probe, fn, state, batch, hook):
        raise NotImplementedError

    def float_loss(self, model, probe: Probe, loss: Callable) -> tuple[Callable, Any]:
        raise NotImplementedError

    def weight_sites(self, model, example: tuple) -> list[Site]:
        raise NotImplementedError


def adapter_for(model, *, strict: bool = True) -> Adapter | None:
    """The adapter of ``model``'s Flax API; a TypeError for anything else (None when not
    ``strict``)."""
    if isinstance(model, fnnx.Module):
        return NNX
    if isinstance(model, nn.Module):
        return LINEN
    if not strict:
        return None
    raise TypeError(
        f"expected a flax.linen Module or a flax.nnx Module, got {type(model).__name__}"
    )


def _kernel_parts(site: Site) -> list[str]:
    return site.kernel.split("/")


# --------------------------------------------------------------------------------------------
# NNX


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _observe_nnx(graphdef, call, collect, static, state, batch):
    model = fnnx.merge(graphdef, state)
    return collect(lambda: call(model, batch), *static)


class NnxAdapter(Adapter):
    """NNX: sites read from the module graph, ops set as module attributes (static graph
    data), parameters in ``nnx.Param`` state."""

    name = "nnx"
    transform_params = ("smooth", "lowrank_a", "lowrank_b", "rotate")

    def sites(self, model, rules, args=(), kwargs=None, *, implementation=None):
        if args or kwargs:
            raise TypeError("an NNX model needs no example inputs")
        return nnx.sites(model, rules, implementation=implementation)

    def sites_and_params(self, model, rules, args=(), kwargs=None, *, implementation=None):
        site_list = self.sites(model, rules, args, kwargs, implementation=implementation)
        return site_list, fnnx.state(model, fnnx.Param)

    def quantize(self, model, rules, *, rngs, packed, method, implementation, observe):
        del method  # an NNX model is called as it is
        return nnx.quantize(model, rules, rngs=rngs, packed=packed,
                            implementation=implementation, observe=observe)

    def pack(self, model, rules, site_list):
        return nnx.pack(model, rules, site_list)

    # models with their parameters (lowbit.ptq)

    def bound(self, model, where: str) -> Bound:
        del where
        return Bound(model)

    def needs_example(self) -> bool:
        return False

    def params(self, b: Bound):
        return fnnx.state(b.model, fnnx.Param)

    def rebuild(self, b: Bound, edits: list[Edit], rules: Rules, *, packed: bool,
                observe: bool, implementation: Implementation | None) -> Bound:
        """A clone of the model whose edited sites hold lowbit ops with their recipe and
        transform (``rules``: Linen's; NNX sets each edited site)."""
        del rules, observe
        new = fnnx.clone(b.model)
        modules = {path_str(p): m for p, m in fnnx.iter_modules(new)}
        plan = []
        for e in edits:
            m = modules[e.site.path]
            if e.site.kind == "einsum":
                op = nnx.Einsum(e.recipe, implementation=implementation, site=e.site.path)
                plan.append((m, "einsum_op", op, e.kernel))
            elif e.site.kind == "ragged_dot":
                if e.transform is not None:
                    raise ValueError(f"site {e.site.path!r}: a grouped (ragged_dot) site takes "
                                     "no smoothing, rotation or low-rank branch")
                op = nnx.RaggedDot(e.recipe, implementation=implementation, site=e.site.path)
                plan.append((m, "ragged_dot_op", op, e.kernel))
            else:
                t = e.transform or SiteTransform()
                op = nnx.DotGeneral(e.recipe, implementation=implementation, site=e.site.path,
                                    packed=packed, smooth=t.smooth, lowrank=t.lowrank,
                                    rotate=t.rotate)
                plan.append((m, "dot_general", op, e.kernel))
        for m, attr, op, w in plan:
            setattr(m, attr, fnnx.data(op))
            if attr == "dot_general" and getattr(m, "dot_general_cls", None) is not None:
                m.dot_general_cls = None
            if w is not None:
                m.kernel.set_value(w)
        return Bound(new)

    def observer(self, b: Bound, call, collect, static) -> Callable:
        """``batch -> collect(lambda: call(model, batch), *static)``, jitted (compiled once
        per model structure, ``call`` and batch shape)."""
        graphdef, state = fnnx.split(b.model)
        return lambda batch: _observe_nnx(graphdef, call, collect, static, state, batch)

    def simulated_weights(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The weights a serving model built by :meth:`rebuild` holds: NNX ops take them
        dequantized."""
        return {p: (unpack(w, jax.numpy.float32) if isinstance(w, QArray) else w)
                for p, w in weights.items()}

    def served(self, b: Bound, sites: list[Site], weights: dict[str, Any]):
        """The packed model: a :class:`lowbit.flax.nnx.PackedModel` whose site kernels are
        ``weights`` (site path -> QArray)."""
        state = fnnx.state(b.model, fnnx.Param)
        by_kernel = {s.kernel: weights[s.path] for s in sites}

        def put(keypath, leaf):
            return by_kernel.get(path_str(keypath_str(keypath)), leaf)

        packed = jax.tree_util.tree_map_with_path(put, state, is_leaf=is_qarray)
        return nnx.PackedModel(b.model, None, packed)

    def finish(self, b: Bound):
        return b.model

    def packed_params(self, packed):
        return packed.params

    # probes (lowbit.autoquant)

    def probe(self, model, variables, recipe: Recipe) -> Probe:
        if variables is not None:
            raise TypeError("score: variables= is for Linen modules; an NNX model holds its own")
        probe = nnx.quantize(model, [(".*", recipe)], observe=True)
        graphdef, state = fnnx.split(probe)
        return Probe(self, graphdef, state, recipe)

    def run(self, probe: Probe, fn, state, batch, hook):
        model = fnnx.merge(probe.structure, state)
        with _core.substituting(hook):
            return fn(model, batch)

    def float_loss(self, model, probe: Probe, loss: Callable) -> tuple[Callable, Any]:
        """``(f, params)``: ``f(params, batch)`` is ``loss(model, batch)`` of the float model
        as a function of its parameters."""
        del probe
        graphdef, params, rest = fnnx.split(model, fnnx.Param, ...)

        def f(params, batch):
            return loss(fnnx.merge(graphdef, params, rest), batch)

        return f, params

    def weight_sites(self, model, example: tuple) -> list[Site]:
        if example:
            raise TypeError("an NNX model needs no example inputs")
        return nnx.sites(model, Rules.of([]))


# --------------------------------------------------------------------------------------------
# Linen


def _set(tree, parts, value):
    """A copy of nested dict ``tree`` with ``value`` at ``parts`` (dicts copied on the path)."""
    out = dict(tree)
    if len(parts) == 1:
        out[parts[0]] = value
    else:
        out[parts[0]] = _set(tree.get(parts[0], {}), parts[1:], value)
    return out


class LinenAdapter(Adapter):
    """Linen: sites found by tracing on example inputs, ops swapped by method interception,
    parameters in the ``params`` collection (a site's transform as leaves next to its
    kernel)."""

    name = "linen"
    transform_params = (linen.SMOOTH_PARAM, *linen.LOWRANK_PARAMS, linen.ROTATE_PARAM)

    def sites(self, model, rules, args=(), kwargs=None, *, implementation=None):
        return self.sites_and_params(model, rules, args, kwargs,
                                     implementation=implementation)[0]

    def sites_and_params(self, model, rules, args=(), kwargs=None, *, implementation=None):
        return linen.sites(model, rules, *args, implementation=implementation, **(kwargs or {}))

    def quantize(self, model, rules, *, rngs, packed, method, implementation, observe):
        if rngs is not None:
            raise TypeError(
                "rngs= is for NNX models; a Linen module takes its keys from "
                "apply(..., rngs={'quant': key})"
            )
        return linen.quantize(model, rules, packed=packed, method=method,
                              implementation=implementation, observe=observe)

    def pack(self, model, rules, site_list):
        raise TypeError(
            "pack a Linen module's params (variables['params'] or the variables), not the "
            "module: lowbit.flax.pack(variables, rules, sites=lowbit.flax.sites(module, rules, "
            "*example_inputs))"
        )

    # models with their parameters (lowbit.ptq)

    def bound(self, model, where: str) -> Bound:
        if model.scope is None:
            raise TypeError(
                f"a Linen model must be bound to its variables: pass {type(model).__name__}"
                "(...).bind(variables) (module.bind returns a module that holds its parameters)"
            )
        module, variables = model.unbind()
        return Bound(module, variables)

    def needs_example(self) -> bool:
        return True

    def params(self, b: Bound):
        return b.variables["params"]

    def rebuild(self, b: Bound, edits: list[Edit], rules: Rules, *, packed: bool,
                observe: bool, implementation: Implementation | None) -> Bound:
        """The module quantized by ``rules`` (Linen applies the rules by interception; each
        edit's recipe is one of them) and variables whose edited sites hold their weight and
        transform."""
        params = b.variables["params"]
        for e in edits:
            kparts = _kernel_parts(e.site)
            if e.kernel is not None:
                params = _set(params, kparts, e.kernel)
            t = e.transform
            if t is not None and t.smooth is not None:
                params = _set(params, kparts[:-1] + [linen.SMOOTH_PARAM], t.smooth)
            if t is not None and t.lowrank is not None:
                for name, v in zip(linen.LOWRANK_PARAMS, t.lowrank, strict=True):
                    params = _set(params, kparts[:-1] + [name], v)
            if t is not None and t.rotate is not None:
                params = _set(params, kparts[:-1] + [linen.ROTATE_PARAM], t.rotate)
        variables = {**b.variables, "params": params}
        if observe:
            module = linen.Quantized(b.model, rules, observe=True)
        else:
            module = linen.quantize(b.model, rules, packed=packed, implementation=implementation)
        return Bound(module, variables)

    def observer(self, b: Bound, call, collect, static) -> Callable:
        module = b.model

        @jax.jit
        def run(variables, batch):
            return collect(lambda: call(module.bind(variables), batch), *static)

        return lambda batch: run(b.variables, batch)

    def simulated_weights(self, weights: dict[str, Any]) -> dict[str, Any]:
        """A packed Linen module reads QArrays: the weights as they are."""
        return dict(weights)

    def served(self, b: Bound, sites: list[Site], weights: dict[str, Any]):
        params = b.variables["params"]
        for s in sites:
            params = _set(params, _kernel_parts(s), weights[s.path])
        return b.model.bind({**b.variables, "params": params})

    def finish(self, b: Bound):
        return b.model.bind(b.variables)

    def packed_params(self, packed):
        return packed.unbind()[1]["params"]

    # probes (lowbit.autoquant)

    def probe(self, model, variables, recipe: Recipe) -> Probe:
        if variables is None:
            if model.scope is None:
                raise TypeError(
                    f"score: a Linen module needs its variables: pass {type(model).__name__}"
                    "(...).bind(variables) or variables=..."
                )
            model, variables = model.unbind()
        return Probe(self, model, variables, recipe)

    def run(self, probe: Probe, fn, state, batch, hook):
        with linen.intercept([(".*", probe.recipe)], observe=True), _core.substituting(hook):
            return fn(state, batch)

    def float_loss(self, model, probe: Probe, loss: Callable) -> tuple[Callable, Any]:
        del model
        variables = probe.state

        def f(params, batch):
            return loss({**variables, "params": params}, batch)

        return f, variables["params"]

    def weight_sites(self, model, example: tuple) -> list[Site]:
        if model.scope is not None:
            model = model.clone(parent=None)
        if not example:
            raise TypeError(
                "a Linen module needs example inputs to find its sites: pass example=(x, ...)"
            )
        return linen.sites(model, Rules.of([]), *example)[0]


NNX = NnxAdapter()
LINEN = LinenAdapter()
