"""NNX: quantized ``dot_general`` / einsum / attention modules, and rules by graph traversal.

Keys come from an ``nnx.Rngs`` stream named ``"quant"`` given when the quantized op is built
(``DotGeneral("nvfp4", rngs=nnx.Rngs(quant=0))``): every call that needs a key draws the next
one from the stream, whose counter is model state (it advances under ``nnx.jit`` and is
split / merged with the model). Ops whose recipe needs no key hold no stream.

:func:`quantize` walks the model graph (``nnx.iter_modules``) and sets, on each module whose
path matches a rule, its injection point: ``dot_general`` (``Linear``, ``LinearGeneral`` and
any module with such an attribute), ``einsum_op`` (``Einsum``), ``attention_fn``
(``MultiHeadAttention``; its score and value einsums are the sites ``<path>/attn_scores``
and ``<path>/attn_values``), ``ragged_dot_op`` (:class:`GroupedLinear`, lowbit's expert
stack: a grouped GEMM, ``lb.ragged_dot``; site kind ``"ragged_dot"``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import attention as _linen_attention
from flax.nnx.nn import dtypes as _dtypes

from lowbit.flax import _core
from lowbit.flax._core import ATTN_SCORES, ATTN_VALUES, Recipe, Rules
from lowbit.flax.packing import layouts_of, pack_params, unpack
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.implementation import Implementation, resolve
from lowbit.gemm.ragged import ragged_dot
from lowbit.io.tree import path_str

__all__ = [
    "DotGeneral",
    "OutControlState",
    "Einsum",
    "Attention",
    "RaggedDot",
    "GroupedLinear",
    "PackedModel",
    "quantize",
    "sites",
]


def _stream(rngs, recipes: tuple[Recipe, ...], where: str):
    """The ``"quant"`` RngStream of ``rngs`` when some recipe needs keys, else None."""
    needing = [r for r in recipes if r.needs_key]
    if not needing:
        return None
    fix = "pass rngs=nnx.Rngs(quant=seed)"
    if isinstance(rngs, nnx.RngStream):
        return rngs
    if rngs is None:
        raise _core.missing_stream_error(needing[0], where, fix)
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs (with a 'quant' stream), got {type(rngs)}")
    if _core.QUANT_STREAM not in rngs:
        raise _core.missing_stream_error(
            needing[0], where, fix + f" (these rngs have streams {sorted(_names(rngs))})"
        )
    return rngs[_core.QUANT_STREAM]


def _names(rngs: nnx.Rngs) -> list[str]:
    return [k for k, v in vars(rngs).items() if isinstance(v, nnx.RngStream)]


def _draw(stream, recipe: Recipe):
    return stream() if recipe.needs_key else None


def _site_op(op, recipe, rngs, implementation, site) -> None:
    """What every single-recipe op holds: its recipe, resolved implementation, site path and
    the ``"quant"`` stream its recipe draws keys from (None when it draws none)."""
    op.recipe = _recipes.get(recipe)
    op.implementation = resolve(implementation)
    op.site = site
    where = f"{type(op).__name__}({op.recipe.name!r})"
    op.stream = nnx.data(_stream(rngs, (op.recipe,), where))


class OutControlState(nnx.Variable):
    """OutControl's state of a site (:mod:`lowbit.flax.training`; not trained): recorded
    channel norms, the chosen channels and the two switches."""


class DotGeneral(nnx.Module):
    """A quantized ``dot_general`` for ``nnx.Linear(dot_general=...)`` / ``LinearGeneral``.

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> from flax import nnx
    >>> layer = nnx.Linear(32, 8, dot_general=lbf.nnx.DotGeneral("mxfp4"), rngs=nnx.Rngs(0))
    >>> nnx.jit(layer)(jnp.ones((4, 32))).shape
    (4, 8)

    ``site``: the site's path (set by :func:`quantize`; calibration hooks report it).
    ``smooth`` (``[K]``) and ``lowrank`` (``(a [K, r], b [r, N])``): the post-training state
    of a dense site (:mod:`lowbit.ptq`), held as ``nnx.Param`` s ``smooth``, ``lowrank_a``,
    ``lowrank_b`` (so they are packed, saved and restored with the weights): the activation
    is divided by ``smooth`` and ``(x / smooth) @ a @ b`` added to the output; ``rotate``
    (``[b]`` signs, the ``nnx.Param`` ``rotate``): the activation is then rotated by the
    block-wise Hadamard transform of ``b`` (:class:`lowbit.flax._core.SiteTransform`).
    """

    def __init__(
        self,
        recipe: Recipe | str,
        *,
        rngs: nnx.Rngs | None = None,
        implementation: str | Implementation | None = None,
        site: str | None = None,
        packed: bool = False,
        smooth=None,
        lowrank=None,
        rotate=None,
    ):
        _site_op(self, recipe, rngs, implementation, site)
        self.packed = packed  # the weight enters pre-quantized (a PackedModel's site)
        self.smooth = nnx.Param(jnp.asarray(smooth, jnp.float32)) if smooth is not None else None
        self.rotate = nnx.Param(jnp.asarray(rotate, jnp.float32)) if rotate is not None else None
        if lowrank is not None:
            a, b = lowrank
            self.lowrank_a, self.lowrank_b = nnx.Param(jnp.asarray(a)), nnx.Param(jnp.asarray(b))
        else:
            self.lowrank_a = self.lowrank_b = None
        # OutControl (lowbit.flax.training.out_control): the outlier channels' recipe name,
        # and OutControlState variables oc_norms, oc_recording, oc_active, oc_outliers,
        # oc_inliers; None: off.
        self.out_control = None

    def channels(self, lhs) -> _core.ChannelSplit | None:
        """The op's OutControl split for this call (None: off), after adding ``lhs``'s
        per-channel L2 norms to the recorded norms where recording is on."""
        if self.out_control is None:
            return None
        x = jax.lax.stop_gradient(lhs).astype(jnp.float32)
        norms = jnp.sqrt(jnp.sum(jnp.square(x.reshape(-1, x.shape[-1])), axis=0))
        rec = self.oc_recording.get_value()
        self.oc_norms.set_value(self.oc_norms.get_value() + jnp.where(rec, norms, 0.0))
        return _core.ChannelSplit(
            self.oc_outliers.get_value(), self.oc_inliers.get_value(),
            self.oc_active.get_value(), _recipes.get(self.out_control),
        )

    def transform(self) -> _core.SiteTransform | None:
        """The site's post-training state as the op applies it (None: none)."""
        if self.smooth is None and self.lowrank_a is None and self.rotate is None:
            return None
        lowrank = None
        if self.lowrank_a is not None:
            lowrank = (self.lowrank_a.get_value(), self.lowrank_b.get_value())
        smooth = self.smooth.get_value() if self.smooth is not None else None
        rotate = self.rotate.get_value() if self.rotate is not None else None
        return _core.SiteTransform(smooth, lowrank, rotate)

    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        return _core.qdot_general(
            lhs,
            rhs,
            dimension_numbers,
            self.recipe,
            _draw(self.stream, self.recipe),
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
            implementation=self.implementation,
            site=self.site,
            packed=self.packed,
            transform=self.transform(),
            channels=self.channels(lhs),
        )


class Einsum(nnx.Module):
    """A quantized two-operand einsum, for ``nnx.Einsum(einsum_op=...)``.

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> from flax import nnx
    >>> layer = nnx.Einsum("btd,dhk->bthk", (32, 2, 8), einsum_op=lbf.nnx.Einsum("mxfp8"),
    ...                    rngs=nnx.Rngs(0))
    >>> nnx.jit(layer)(jnp.ones((1, 4, 32))).shape
    (1, 4, 2, 8)
    """

    def __init__(
        self,
        recipe: Recipe | str,
        *,
        rngs: nnx.Rngs | None = None,
        implementation: str | Implementation | None = None,
        site: str | None = None,
    ):
        _site_op(self, recipe, rngs, implementation, site)

    def __call__(
        self, subscripts, lhs, rhs, precision=None, preferred_element_type=None, out_sharding=None
    ):
        return _core.qeinsum(
            subscripts,
            lhs,
            rhs,
            self.recipe,
            _draw(self.stream, self.recipe),
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
            implementation=self.implementation,
            site=self.site,
        )


class Attention(nnx.Module):
    """Dot-product attention whose ``q k^T`` and ``p v`` einsums are quantized, for
    ``nnx.MultiHeadAttention(attention_fn=...)``. ``scores`` / ``values``: their recipes.

    It is Flax's ``dot_product_attention`` (masking, softmax, dropout) with the two einsums
    injected; grouped-query attention repeats key / value heads first. Attention weights are
    not sown.

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> from flax import nnx
    >>> mha = nnx.MultiHeadAttention(2, 64, attention_fn=lbf.nnx.Attention("mxfp8", "mxfp8"),
    ...                              decode=False, rngs=nnx.Rngs(0))
    >>> nnx.jit(mha)(jnp.ones((1, 32, 64))).shape
    (1, 32, 64)
    """

    def __init__(
        self,
        scores: Recipe | str | None = None,
        values: Recipe | str | None = None,
        *,
        rngs: nnx.Rngs | None = None,
        implementation: str | Implementation | None = None,
    ):
        self.scores = _recipes.get(scores)
        self.values = _recipes.get(values)
        self.implementation = resolve(implementation)
        where = f"Attention({self.scores.name!r}, {self.values.name!r})"
        self.stream = nnx.data(_stream(rngs, (self.scores, self.values), where))

    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        promote_dtype=_dtypes.promote_dtype,
        is_causal=False,
    ):
        del precision, module  # quantized GEMMs accumulate in float32; nothing is sown
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
        if query.shape[-2] != key.shape[-2]:  # grouped-query attention
            rep = query.shape[-2] // key.shape[-2]
            key = jnp.repeat(key, rep, axis=-2)
            value = jnp.repeat(value, rep, axis=-2)
        if is_causal:
            causal = nnx.make_causal_mask(jnp.ones(query.shape[:-2]), dtype=jnp.bool_)
            mask = causal if mask is None else nnx.combine_masks(mask, causal)
        ks = _draw(self.stream, self.scores)
        kv = _draw(self.stream, self.values)
        return _linen_attention.dot_product_attention(
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            qk_attn_weights_einsum=functools.partial(
                _core.qeinsum, recipe=self.scores, key=ks, implementation=self.implementation
            ),
            attn_weights_value_einsum=functools.partial(
                _core.qeinsum, recipe=self.values, key=kv, implementation=self.implementation
            ),
        )


class RaggedDot(nnx.Module):
    """A quantized grouped GEMM (``lb.ragged_dot``), for ``GroupedLinear(ragged_dot_op=...)``.

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> from flax import nnx
    >>> layer = lbf.nnx.GroupedLinear(2, 32, 8, ragged_dot_op=lbf.nnx.RaggedDot("mxfp8"),
    ...                               rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((5, 32)), jnp.array([2, 3])).shape
    (5, 8)
    """

    def __init__(
        self,
        recipe: Recipe | str,
        *,
        rngs: nnx.Rngs | None = None,
        implementation: str | Implementation | None = None,
        site: str | None = None,
    ):
        _site_op(self, recipe, rngs, implementation, site)

    def __call__(self, lhs, rhs, group_sizes):
        return _core.qragged_dot(lhs, rhs, group_sizes, self.recipe,
                                 _draw(self.stream, self.recipe), self.implementation,
                                 site=self.site)


class GroupedLinear(nnx.Module):
    """A stack of ``groups`` linear maps applied to row groups: ``kernel [G, in, out]``,
    ``y[rows of g] = x[rows of g] @ kernel[g]`` (rows sorted by group, ``group_sizes [G]``;
    rows past their sum give zeros). The mixture-of-experts layer of a dropless MoE.

    ``ragged_dot_op`` is the injection point :func:`quantize` sets (default None:
    ``lb.ragged_dot(..., recipe="none")``, whose memory grows with the rows, not with rows
    times groups as ``jax.lax.ragged_dot``'s does on CPU).
    """

    def __init__(self, groups: int, in_features: int, out_features: int, *, dtype=None,
                 param_dtype=jnp.float32, kernel_init=None, ragged_dot_op=None,
                 rngs: nnx.Rngs):
        init = kernel_init or nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (groups, in_features, out_features),
                                     param_dtype))
        self.dtype = dtype
        self.ragged_dot_op = nnx.data(ragged_dot_op)

    def __call__(self, x, group_sizes):
        kernel = self.kernel.get_value()
        if self.dtype is not None:
            x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        if self.ragged_dot_op is None:
            return ragged_dot(x, kernel, group_sizes)
        return self.ragged_dot_op(x, kernel, group_sizes)


_OURS = (DotGeneral, Einsum, Attention, RaggedDot)


def pack(model: nnx.Module, rules, site_list=None) -> nnx.State:
    """:func:`lowbit.flax.pack` of an NNX model: its ``nnx.Param`` state, weights packed;
    ``site_list``: its sites or ``{kernel path: Layout}`` (default: read from the model)."""
    rules = Rules.of(rules)
    site_list = site_list if site_list is not None else sites(model, rules)
    return pack_params(nnx.state(model, nnx.Param), rules, layouts_of(site_list))


# --------------------------------------------------------------------------------------------
# Sites and rules


def _kernel(m) -> nnx.Param | None:
    k = getattr(m, "kernel", None)
    return k if isinstance(k, nnx.Variable) else None


def _layout(m, kernel_shape) -> _core.Layout | None:
    if isinstance(m, nnx.Linear):
        return _core.Layout(0, 1)
    if isinstance(m, nnx.LinearGeneral):
        nb, ni = len(m.batch_axis), len(m.in_features)
        return _core.Layout(nb + ni - 1, len(kernel_shape) - 1 if m.out_features else None)
    if isinstance(m, nnx.Einsum) and m.einsum_str is not None:
        eq = m.einsum_str.replace(" ", "")
        a, rest = eq.split(",", 1)
        b = rest.split("->")[0]
        nb = len(kernel_shape) - (len(b) - 3) if "..." in b else 0
        lhs_ndim = len(a.replace("...", "")) + (max(nb, 1) if "..." in a else 0)
        return _core.einsum_rhs_layout(eq, lhs_ndim, len(kernel_shape))
    return None


def sites(
    model: nnx.Module, rules, *, implementation: Implementation | str | None = None
) -> list[_core.Site]:
    """The quantizable sites of an NNX model (no tracing: read from the module graph);
    ``implementation`` (resolved) is recorded on the sites that a rule quantizes."""
    rules = Rules.of(rules)
    implementation = resolve(implementation)

    def site(path, kind, name, *rest):
        impl = implementation if rules.active(path) is not None else None
        return _core.Site(path, kind, name, rules.match(path), *rest, implementation=impl)

    out = []
    for path, m in nnx.iter_modules(model):
        if isinstance(m, _OURS):
            continue
        p = path_str(path)
        name = type(m).__name__
        kernel = _kernel(m)
        kpath = (f"{p}/kernel" if p else "kernel") if kernel is not None else None
        shape = tuple(kernel.shape) if kernel is not None else None
        dtype = kernel.dtype if kernel is not None else None
        if hasattr(m, "ragged_dot_op"):  # [G, K, N]: each expert its own tensor
            out.append(site(p, "ragged_dot", name, kpath, shape, dtype,
                            _core.Layout(1, 2, stacked=True)))
        elif hasattr(m, "einsum_op"):
            layout = _layout(m, shape) if kernel is not None else None
            out.append(site(p, "einsum", name, kpath, shape, dtype, layout))
        elif hasattr(m, "dot_general"):
            layout = _layout(m, shape) if kernel is not None else None
            out.append(site(p, "dot_general", name, kpath, shape, dtype, layout))
        elif hasattr(m, "attention_fn"):
            for kind in (ATTN_SCORES, ATTN_VALUES):
                sp = f"{p}/{kind}" if p else kind
                out.append(site(sp, kind, name))
    return out


def quantize(
    model: nnx.Module,
    rules,
    *,
    rngs: nnx.Rngs | None = None,
    packed: bool = False,
    implementation: Implementation | str | None = None,
    observe: bool = False,
) -> nnx.Module:
    """See :func:`lowbit.flax.quantize`. Returns a new model (``nnx.clone``: new Variables
    sharing the arrays); ``model`` is left as it was. The ops it sets hold ``implementation``
    (a static attribute: it is part of the graphdef).

    ``packed=True`` builds the serving structure :class:`PackedModel` uses: its weights must
    then be ``unpack(pack(...))``; with float weights they would enter unquantized."""
    rules = Rules.of(rules)
    impl = resolve(implementation)
    new = nnx.clone(model)
    plan: list[tuple[Any, str, Any]] = []
    for path, m in nnx.iter_modules(new):
        if isinstance(m, _OURS):
            continue
        p = path_str(path)
        where = f"module {p!r} ({type(m).__name__})"
        if hasattr(m, "ragged_dot_op"):
            r = rules.active(p)
            if r is None:
                continue
            if observe:
                r = _recipes.get("none")
            elif packed:  # the experts enter pre-quantized (unpack of the packed stack)
                _core.weight_spec(r, p)
                r = _core.serving_recipe(r)
            plan.append((m, "ragged_dot_op", RaggedDot(r, rngs=_rngs_for(rngs, r, where),
                                                       implementation=impl, site=p)))
        elif hasattr(m, "einsum_op") or hasattr(m, "dot_general"):
            r = rules.active(p)
            if r is None:
                continue
            if observe:  # float GEMMs that know their site (hooks reach them)
                r = _recipes.get("none")
            elif packed:
                _core.weight_spec(r, p)
                s = _core.serving_recipe(r)
                if s.is_identity and r.fwd.rhs is None:
                    continue
                r = s
            rs_ = _rngs_for(rngs, r, where)
            if hasattr(m, "einsum_op"):
                plan.append((m, "einsum_op", Einsum(r, rngs=rs_, implementation=impl, site=p)))
            else:
                op = DotGeneral(r, rngs=rs_, implementation=impl, site=p,
                                packed=packed and not observe)
                plan.append((m, "dot_general", op))
                if getattr(m, "dot_general_cls", None) is not None:
                    plan.append((m, "dot_general_cls", None))
        elif hasattr(m, "attention_fn") and not observe:
            ps = f"{p}/{ATTN_SCORES}" if p else ATTN_SCORES
            pv = f"{p}/{ATTN_VALUES}" if p else ATTN_VALUES
            rs, rv = rules.active(ps), rules.active(pv)
            if rs is None and rv is None:
                continue
            none = _recipes.get("none")
            rs, rv = rs or none, rv or none
            _stream(rngs, (rs, rv), where)
            plan.append((m, "attention_fn", Attention(rs, rv, rngs=rngs, implementation=impl)))
    for m, attr, value in plan:
        setattr(m, attr, nnx.data(value) if isinstance(value, nnx.Module) else value)
    return new


def _rngs_for(rngs, recipe: Recipe, where: str):
    """Validate ``rngs`` for ``recipe`` with an error that names the module."""
    _stream(rngs, (recipe,), where)
    return rngs


# --------------------------------------------------------------------------------------------
# Packed inference


class PackedModel(nnx.Module):
    """An NNX model for inference from packed weights: QArrays that are dequantized inside the
    computation (XLA) at every call, with activations quantized as the rules' recipes say.
    Outputs equal, bit for bit, those of ``lowbit.flax.quantize(model, rules)`` (forward-only
    recipes) with the float weights that were packed.

    ``model`` gives the structure (its float weights are dropped); ``packed`` is the output of
    :func:`lowbit.flax.pack` (default: pack ``model``'s own weights). With ``rules=None``,
    ``model`` is already the serving structure (its sites hold serving ops, as
    :func:`lowbit.ptq.quantize` builds it) and ``packed`` its parameters. ``method``: the method of
    the model that ``__call__`` runs. ``implementation``: what the serving GEMMs run (as for
    :func:`lowbit.flax.quantize`).

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> from flax import nnx
    >>> model = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
    >>> served = lbf.nnx.PackedModel(model, [(".*", "qat_mxfp4")])
    >>> type(served.params["kernel"].get_value()).__name__
    'QArray'
    >>> y = nnx.jit(served)(jnp.ones((2, 64)))
    >>> bool(jnp.all(y == nnx.jit(lbf.quantize(model, [(".*", "qat_mxfp4")]))(jnp.ones((2, 64)))))
    True
    """

    def __init__(
        self,
        model: nnx.Module,
        rules,
        packed=None,
        *,
        method: str = "__call__",
        rngs: nnx.Rngs | None = None,
        implementation: Implementation | str | None = None,
    ):
        impl = resolve(implementation)
        if rules is None:  # ``model`` is the serving structure itself (lowbit.ptq builds it)
            if packed is None:
                raise TypeError("PackedModel(serving_model, None, packed): packed is required")
            serving = model
        else:
            rules = Rules.of(rules)
            if packed is None:
                packed = pack(model, rules)
            serving = quantize(model, rules, rngs=rngs, packed=True, implementation=impl)
        graphdef, _, rest = nnx.split(serving, nnx.Param, ...)
        self.graphdef = graphdef
        self.method = method
        self.params = nnx.data(packed)
        self.rest = nnx.data(rest)

    def model(self) -> nnx.Module:
        """The serving model with its weights dequantized (call inside a jitted function)."""
        return nnx.merge(self.graphdef, unpack(self.params), self.rest)

    def __call__(self, *args, **kwargs):
        # merge() reuses the Variables of ``rest`` (rng streams): their updates persist
        return getattr(self.model(), self.method)(*args, **kwargs)

