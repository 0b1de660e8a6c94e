"""Linen: injectable quantized ``dot_general`` / einsum, and rules applied by interception.

Keys for stochastic rounding and random Hadamard signs come from the ``"quant"`` rng stream of
the module that runs the GEMM (``self.make_rng("quant")`` of the ``Dense`` / attention module),
so ``model.apply(variables, x, rngs={"quant": key})`` drives them; a new key per step. ``init``
needs no ``"quant"`` stream (Flax falls back to ``"params"``); ``apply`` without one raises.

How rules reach modules written without lowbit: :func:`intercept` registers a
``nn.intercept_methods`` interceptor. When a module whose path matches a rule runs, the
interceptor swaps, for that call only, its injection point for a quantized one: the
``dot_general`` field of ``Dense`` / ``DenseGeneral`` (and of any module with such a field), the
``qk_attn_weights_einsum_cls`` / ``attn_weights_value_einsum_cls`` fields of
``MultiHeadDotProductAttention``, the ``ragged_dot`` field of :class:`GroupedDense` (lowbit's
expert stack, a grouped GEMM: site kind ``"ragged_dot"``); ``nn.Einsum`` has no injection
point, so its ``__call__`` is run by an equivalent that calls the quantized einsum.
Interception (rather than cloning modules with new fields) also reaches submodules created
inside ``@nn.compact`` methods and ``setup``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import module as _module

from lowbit.flax import _core
from lowbit.flax._core import ATTN_SCORES, ATTN_VALUES, Recipe, Rules
from lowbit.flax.packing import unpack
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.implementation import Implementation, resolve
from lowbit.gemm.ragged import ragged_dot
from lowbit.io.tree import is_qarray, path_str

__all__ = ["DotGeneral", "Einsum", "RaggedDot", "GroupedDense", "Quantized", "intercept",
           "quantize", "sites"]

# Records sites while tracing (sites(), describe()): a list, or None.
_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "lowbit_linen_recorder", default=None
)


def _current_module() -> nn.Module | None:
    stack = _module._context.module_stack
    for m in reversed(stack):
        if m is not None:
            return m
    return None


def _key(recipe: Recipe):
    """A key from the ``"quant"`` stream of the Linen module running the GEMM."""
    if not recipe.needs_key:
        return None
    m = _current_module()
    if m is None or m.scope is None:
        raise _core.missing_stream_error(
            recipe,
            "a lowbit dot_general called outside a bound Flax Linen module",
            "call it inside a module's method, or use lowbit.dot_general(..., key=...)",
        )
    if not m.scope.has_rng(_core.QUANT_STREAM) and not m.is_initializing():
        where = f"module {path_str(m.path) or type(m).__name__!r}"
        raise _core.missing_stream_error(
            recipe,
            where,
            "pass rngs={'quant': key} to apply() (a new key per step)",
        )
    return m.make_rng(_core.QUANT_STREAM)


@dataclasses.dataclass(frozen=True)
class DotGeneral:
    """A quantized ``dot_general`` for ``nn.Dense(dot_general=...)`` and ``nn.DenseGeneral``.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, lowbit.flax as lbf
    >>> layer = nn.Dense(8, dot_general=lbf.linen.DotGeneral("mxfp4"))
    >>> x = jnp.ones((4, 32))
    >>> v = jax.jit(layer.init)(jax.random.key(0), x)
    >>> jax.jit(layer.apply)(v, x).shape
    (4, 8)
    """

    recipe: Recipe | str
    site: str | None = None  # the site's path, for the layout recorder and calibration hooks
    implementation: Implementation | str | None = None  # resolved; passed to lb.dot_general
    packed: bool = False  # the weight enters pre-quantized (a packed module's site)
    transform: _core.SiteTransform | None = None  # post-training state of a dense site

    def __post_init__(self):
        object.__setattr__(self, "recipe", _recipes.get(self.recipe))
        object.__setattr__(self, "implementation", resolve(self.implementation))

    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        rec = _RECORDER.get()
        if rec is not None and self.site is not None:
            rec.append(("dot_general", self.site, dimension_numbers, rhs.shape, rhs.dtype))
        return _core.qdot_general(
            lhs,
            rhs,
            dimension_numbers,
            self.recipe,
            _key(self.recipe),
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
            implementation=self.implementation,
            site=self.site,
            packed=self.packed,
            transform=self.transform,
        )


@dataclasses.dataclass(frozen=True)
class Einsum:
    """A quantized two-operand einsum: ``Einsum(recipe)(subscripts, a, b)``.

    For ``nn.MultiHeadDotProductAttention(qk_attn_weights_einsum_cls=...,
    attn_weights_value_einsum_cls=...)`` pass ``functools.partial(lbf.linen.Einsum, recipe)``.

    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, lowbit.flax as lbf
    >>> attn = nn.MultiHeadDotProductAttention(
    ...     num_heads=2,
    ...     qk_attn_weights_einsum_cls=functools.partial(lbf.linen.Einsum, "mxfp8"),
    ...     attn_weights_value_einsum_cls=functools.partial(lbf.linen.Einsum, "mxfp8"))
    >>> x = jnp.ones((1, 32, 64))
    >>> jax.jit(attn.apply)(jax.jit(attn.init)(jax.random.key(0), x), x).shape
    (1, 32, 64)
    """

    recipe: Recipe | str
    site: str | None = None
    implementation: Implementation | str | None = None  # resolved; passed to lowbit.einsum

    def __post_init__(self):
        object.__setattr__(self, "recipe", _recipes.get(self.recipe))
        object.__setattr__(self, "implementation", resolve(self.implementation))

    def __call__(self, subscripts, lhs, rhs, precision=None, preferred_element_type=None, **kwargs):
        rec = _RECORDER.get()
        if rec is not None and self.site is not None:
            rec.append(("einsum", self.site, subscripts, lhs.ndim, rhs.shape, rhs.dtype))
        return _core.qeinsum(
            subscripts,
            lhs,
            rhs,
            self.recipe,
            _key(self.recipe),
            precision=precision,
            preferred_element_type=preferred_element_type,
            implementation=self.implementation,
            site=self.site,
            **kwargs,
        )


@dataclasses.dataclass(frozen=True)
class RaggedDot:
    """A quantized grouped GEMM (``lb.ragged_dot``) for ``GroupedDense(ragged_dot=...)``;
    keys from the ``"quant"`` stream of the module that runs it."""

    recipe: Recipe | str
    site: str | None = None
    implementation: Implementation | str | None = None

    def __post_init__(self):
        object.__setattr__(self, "recipe", _recipes.get(self.recipe))
        object.__setattr__(self, "implementation", resolve(self.implementation))

    def __call__(self, lhs, rhs, group_sizes):
        rec = _RECORDER.get()
        if rec is not None and self.site is not None:
            rec.append(("ragged_dot", self.site, rhs.shape, rhs.dtype))
        return _core.qragged_dot(lhs, rhs, group_sizes, self.recipe, _key(self.recipe),
                                 self.implementation, site=self.site)


class GroupedDense(nn.Module):
    """A stack of ``groups`` dense maps applied to row groups: ``kernel [G, in, features]``,
    ``y[rows of g] = x[rows of g] @ kernel[g]`` (rows sorted by group; ``lb.ragged_dot``).
    ``ragged_dot`` is the injection point the rules set (None: the float grouped GEMM).

    >>> import jax, jax.numpy as jnp, lowbit.flax as lbf
    >>> layer = lbf.linen.GroupedDense(2, 8, ragged_dot=lbf.linen.RaggedDot("mxfp8"))
    >>> x, sizes = jnp.ones((5, 32)), jnp.array([2, 3])
    >>> layer.apply(layer.init(jax.random.key(0), x, sizes), x, sizes).shape
    (5, 8)
    """

    groups: int
    features: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    ragged_dot: Any = None

    @nn.compact
    def __call__(self, x, group_sizes):
        kernel = self.param("kernel", self.kernel_init,
                            (self.groups, x.shape[-1], self.features), self.param_dtype)
        if self.dtype is not None:
            x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        op = self.ragged_dot if self.ragged_dot is not None else ragged_dot
        return op(x, kernel, group_sizes)


# --------------------------------------------------------------------------------------------
# Interception


def _fields(m: nn.Module) -> set[str]:
    return {f.name for f in dataclasses.fields(m)}


@contextlib.contextmanager
def _override(m: nn.Module, **values):
    """Set dataclass fields of a (frozen) module for the duration of one call."""
    old = {k: getattr(m, k) for k in values}
    for k, v in values.items():
        object.__setattr__(m, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            object.__setattr__(m, k, v)


def _einsum_call(m: nn.Einsum, op, inputs, einsum_str=None):
    """``nn.Einsum.__call__`` with ``jnp.einsum`` replaced by ``op`` (flax 0.12 semantics;
    tests pin it against ``nn.Einsum`` bit for bit)."""
    einsum_str = _module.merge_param("einsum_str", m.einsum_str, einsum_str)
    einsum_str = einsum_str.replace(" ", "")
    if "->" not in einsum_str:
        raise ValueError('`einsum_str` equation must be explicit and include "->".')
    if einsum_str.count(",") != 1:
        raise ValueError(
            "`einsum_str` equation must have exactly two operands and therefore, exactly one "
            f"comma character, instead of {einsum_str.count(',')}"
        )
    kernel = m.param("kernel", m.kernel_init, m.shape, m.param_dtype)
    if m.use_bias:
        bias_shape, broadcasted_bias_shape = m._get_bias_shape(einsum_str, inputs, kernel)
        bias = m.param("bias", m.bias_init, bias_shape, m.param_dtype)
    else:
        bias = None
    inputs, kernel, bias = m.promote_dtype(inputs, kernel, bias, dtype=m.dtype)
    y = op(
        einsum_str,
        inputs,
        kernel,
        precision=m.precision,
        preferred_element_type=m.preferred_element_type,
    )
    if bias is not None:
        y += jnp.reshape(bias, broadcasted_bias_shape)
    return y


# Post-training state of a dense site (lowbit.ptq) in a Linen params tree: leaves next to the
# site's ``kernel`` that the interceptor hands to the site's op.
SMOOTH_PARAM = "lowbit_smooth"
LOWRANK_PARAMS = ("lowbit_lowrank_a", "lowbit_lowrank_b")
ROTATE_PARAM = "lowbit_rotate"  # the [b] signs of a block-wise Hadamard rotation (MR-GPTQ)


def _site_transform(m: nn.Module) -> _core.SiteTransform | None:
    """The post-training state of a site, read from its module's params (None: none)."""
    smooth = lowrank = rotate = None
    if m.has_variable("params", SMOOTH_PARAM):
        smooth = m.get_variable("params", SMOOTH_PARAM)
    if m.has_variable("params", LOWRANK_PARAMS[0]):
        lowrank = tuple(m.get_variable("params", n) for n in LOWRANK_PARAMS)
    if m.has_variable("params", ROTATE_PARAM):
        rotate = m.get_variable("params", ROTATE_PARAM)
    if smooth is None and lowrank is None and rotate is None:
        return None
    return _core.SiteTransform(smooth, lowrank, rotate)


@dataclasses.dataclass(frozen=True)
class _Interceptor:
    rules: Rules
    packed: bool
    root: tuple[str, ...] = ()
    implementation: Implementation | None = None
    observe: bool = False  # calibration: the rules' sites compute in float and are observed

    def recipe(self, path: str, weight: bool = True) -> Recipe | None:
        """The recipe a site runs: the rule's, or with ``packed`` for a weight site, its
        serving form (the weight enters pre-quantized). None: leave the module alone.
        Observing: the identity recipe for every site a rule quantizes."""
        r = self.rules.active(path)
        if r is not None and self.observe:
            return _recipes.get("none")
        if r is None or not (self.packed and weight):
            return r
        _core.weight_spec(r, path)
        s = _core.serving_recipe(r)
        if s.is_identity and r.fwd.rhs is None:
            return None  # neither operand quantized in the forward: the float module
        return s

    def __call__(self, next_fun, args, kwargs, context):
        m = context.module
        if context.method_name == "setup" or m.scope is None:
            return next_fun(*args, **kwargs)
        mpath = tuple(m.path)
        if mpath[: len(self.root)] != self.root:
            return next_fun(*args, **kwargs)
        path = path_str(mpath[len(self.root) :])
        fields = _fields(m)
        rec = _RECORDER.get()
        if rec is not None:
            rec.append(("module", path, type(m).__name__))
        if "ragged_dot" in fields:
            r = self.recipe(path)
            if r is None:
                return next_fun(*args, **kwargs)
            with _override(m, ragged_dot=RaggedDot(r, site=path,
                                                   implementation=self.implementation)):
                return next_fun(*args, **kwargs)
        if isinstance(m, nn.Einsum):
            r = self.recipe(path)
            if r is None or context.method_name != "__call__":
                return next_fun(*args, **kwargs)
            op = Einsum(r, site=path, implementation=self.implementation)
            return _einsum_call(m, op, *args, **kwargs)
        if "dot_general" in fields or "dot_general_cls" in fields:
            r = self.recipe(path)
            if r is None:
                return next_fun(*args, **kwargs)
            op = DotGeneral(r, site=path, implementation=self.implementation,
                            packed=self.packed and not self.observe, transform=_site_transform(m))
            values: dict[str, Any] = {"dot_general": op}
            if "dot_general_cls" in fields:
                values["dot_general_cls"] = None
            with _override(m, **values):
                return next_fun(*args, **kwargs)
        if "qk_attn_weights_einsum_cls" in fields:
            ps = f"{path}/{ATTN_SCORES}" if path else ATTN_SCORES
            pv = f"{path}/{ATTN_VALUES}" if path else ATTN_VALUES
            rs, rv = self.recipe(ps, weight=False), self.recipe(pv, weight=False)
            if rs is None and rv is None:
                return next_fun(*args, **kwargs)
            params = inspect.signature(m.attention_fn).parameters
            if "qk_attn_weights_einsum" not in params:
                raise ValueError(
                    f"attention module {path!r} matches a rule for its score/value einsums, "
                    "but its attention_fn takes no qk_attn_weights_einsum / "
                    "attn_weights_value_einsum arguments to inject them into"
                )
            none, impl = _recipes.get("none"), self.implementation
            values = {
                "qk_attn_weights_einsum_cls": functools.partial(
                    Einsum, rs or none, site=ps, implementation=impl
                ),
                "attn_weights_value_einsum_cls": functools.partial(
                    Einsum, rv or none, site=pv, implementation=impl
                ),
            }
            with _override(m, **values):
                return next_fun(*args, **kwargs)
        return next_fun(*args, **kwargs)


@contextlib.contextmanager
def intercept(
    rules,
    *,
    packed: bool = False,
    root: tuple[str, ...] = (),
    implementation: str | None = None,
    observe: bool = False,
):
    """Quantize, per ``rules``, every Linen module called inside this context.

    Paths are module paths relative to ``root`` joined by ``/`` (``"mlp/Dense_0"``); see
    :func:`lowbit.flax.quantize` (also for ``implementation`` and ``observe``). Prefer
    :func:`quantize`, which returns a Module.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, lowbit.flax as lbf
    >>> model = nn.Dense(8)
    >>> x = jnp.ones((2, 32))
    >>> v = model.init(jax.random.key(0), x)
    >>> with lbf.linen.intercept([(r".*", "qat_mxfp4")]):
    ...     y = jax.jit(lambda v, x: model.apply(v, x))(v, x)
    >>> bool(jnp.all(y == model.apply(v, x)))
    False
    """
    impl = resolve(implementation)
    interceptor = _Interceptor(Rules.of(rules), packed, tuple(root), impl, observe)
    with nn.intercept_methods(interceptor):
        yield


class Quantized(nn.Module):
    """``module`` with ``rules`` applied; the same parameters (``nn.share_scope``).

    With ``packed=True`` the weights that rules quantize are expected as QArrays
    (:func:`lowbit.flax.pack`): they are dequantized inside the computation (XLA) and the
    activations quantized as the rule's recipe says; weights are not quantized again.
    ``method``: the name of the wrapped module's method that ``__call__`` runs.
    ``implementation``: what the quantized GEMMs run (see :func:`lowbit.flax.quantize`).

    Built inside a parent's compact method, the wrapper is a new submodule of the parent
    (auto-named ``Quantized_0`` unless given ``name=``) holding the module's parameters;
    rule paths stay relative to the wrapped module.
    """

    module: nn.Module
    rules: Rules
    packed: bool = False
    method: str = "__call__"
    implementation: Implementation | str | None = None  # resolved when the module is built
    observe: bool = False  # lowbit.ptq.calibrate: float GEMMs whose activations are observed

    def __post_init__(self):
        object.__setattr__(self, "implementation", resolve(self.implementation))
        super().__post_init__()

    def setup(self):
        nn.share_scope(self, self.module)

    def __call__(self, *args, **kwargs):
        interceptor = _Interceptor(
            self.rules, self.packed, tuple(self.path), self.implementation, self.observe
        )

        def run(mdl, *args, **kwargs):
            return getattr(mdl.module, mdl.method)(*args, **kwargs)

        with nn.intercept_methods(interceptor):
            if not self.packed:
                return run(self, *args, **kwargs)
            unpack_ = unpack if self.is_initializing() else _unpack_checked
            f = nn.map_variables(run, "params", trans_in_fn=unpack_, init=self.is_initializing())
            return f(self, *args, **kwargs)


def _unpack_checked(tree):
    if not any(is_qarray(x) for x in jax.tree.leaves(tree, is_leaf=is_qarray)):
        raise ValueError(
            "a packed=True module got params without any QArray: pack them first with "
            "lowbit.flax.pack(params, rules) (float weights would enter unquantized)"
        )
    return unpack(tree)


def quantize(
    module: nn.Module,
    rules,
    *,
    packed: bool = False,
    method: str = "__call__",
    implementation: Implementation | str | None = None,
    observe: bool = False,
) -> Quantized:
    """See :func:`lowbit.flax.quantize`."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a flax.linen Module, got {type(module).__name__}")
    impl = resolve(implementation)
    if module.scope is not None:
        module = module.clone(parent=None)
    return Quantized(
        module,
        Rules.of(rules),
        packed=packed,
        method=method,
        implementation=impl,
        observe=observe,
    )


def sites(
    module: nn.Module,
    rules,
    *args,
    method: str = "__call__",
    implementation: Implementation | str | None = None,
    **kwargs,
) -> tuple[list[_core.Site], Any]:
    """Trace ``module`` on example inputs (shapes only: ``jax.eval_shape``) and return its
    quantizable sites and the abstract params. Sites no rule quantizes are listed too, with
    recipe None, when they are Dense / DenseGeneral / Einsum / attention modules;
    ``implementation`` is recorded on those a rule quantizes."""
    rules = Rules.of(rules)
    implementation = resolve(implementation)
    if not args and not kwargs:
        raise TypeError(
            "a Linen module creates its submodules when called: pass example inputs "
            "(arrays or jax.ShapeDtypeStruct), e.g. describe(model, rules, x)"
        )
    # A catch-all rule finds every site; the real rules are applied afterwards.
    probe = Quantized(
        module.clone(parent=None) if module.scope is not None else module,
        Rules.of([(".*", "qat_mxfp8")]),
        method=method,
    )
    rec: list = []
    token = _RECORDER.set(rec)
    try:
        variables = jax.eval_shape(lambda: probe.init(jax.random.key(0), *args, **kwargs))
    finally:
        _RECORDER.reset(token)
    params = variables.get("params", {})
    out: dict[str, _core.Site] = {}
    types = {e[1]: e[2] for e in rec if e[0] == "module"}
    for entry in rec:
        if entry[0] == "module":
            continue
        if entry[0] == "dot_general":
            _, path, dn, shape, dtype = entry
            layout = _core.dot_rhs_layout(dn, len(shape))
            kind, kernel = "dot_general", f"{path}/kernel" if path else "kernel"
        elif entry[0] == "ragged_dot":  # [G, K, N]: each expert its own tensor
            _, path, shape, dtype = entry
            kind, kernel = "ragged_dot", f"{path}/kernel" if path else "kernel"
            layout = _core.Layout(1, 2, stacked=True)
        else:
            _, path, subscripts, lhs_ndim, shape, dtype = entry
            parts = path.split("/")
            if parts[-1] in (ATTN_SCORES, ATTN_VALUES):
                kind, kernel, layout, shape, dtype = parts[-1], None, None, None, None
            else:
                layout = _core.einsum_rhs_layout(subscripts, lhs_ndim, len(shape))
                kind, kernel = "einsum", f"{path}/kernel" if path else "kernel"
        if kernel is not None and not _has_param(params, kernel):
            kernel = None  # the rhs is not a parameter of this module
        if path not in out:
            owner = path.rsplit("/", 1)[0] if kind.startswith("attn_") else path
            if kind.startswith("attn_") and "/" not in path:
                owner = ""
            out[path] = _core.Site(
                path,
                kind,
                types.get(owner, ""),
                rules.match(path),
                kernel,
                tuple(shape) if shape is not None else None,
                dtype,
                layout,
                implementation if rules.active(path) is not None else None,
            )
    return list(out.values()), params


def _has_param(params, path: str) -> bool:
    node = params
    for k in path.split("/"):
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True
