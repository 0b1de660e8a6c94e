"""Framework-independent pieces of the Flax integration: rules, sites, the quantized ops.

A *site* is one GEMM of a model that a rule can quantize: the ``dot_general`` of a dense layer
(Linen ``Dense`` / ``DenseGeneral``, NNX ``Linear`` / ``LinearGeneral``, any module with a
``dot_general`` attribute), the einsum of an ``Einsum`` layer, and the two activation-by-
activation einsums of an attention module, which are named by the attention module's path plus
``/attn_scores`` (``q @ k^T``) and ``/attn_values`` (``softmax(...) @ v``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
import string
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import lowbit as lb
from lowbit.core import hadamard as _hadamard
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.dot_general import einsum_operands, forward_operands
from lowbit.gemm.implementation import Implementation
from lowbit.gemm.ragged import ragged_dot, ragged_operands
from lowbit.gemm.recipes import GemmSpec, QuantSpec, Recipe

ATTN_SCORES = "attn_scores"
ATTN_VALUES = "attn_values"
QUANT_STREAM = "quant"


# --------------------------------------------------------------------------------------------
# Rules


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule: modules whose path ``re.fullmatch``-es ``pattern`` get ``recipe``."""

    pattern: str
    recipe: Recipe

    @property
    def regex(self) -> re.Pattern:
        return re.compile(self.pattern)


@dataclasses.dataclass(frozen=True)
class Rules:
    """An ordered, validated list of :class:`Rule`; the first rule that matches wins.

    >>> from lowbit.flax import Rules
    >>> r = Rules.of([(r".*mlp.*", "mxfp4"), (r".*", "mxfp8")])
    >>> r.match("block_0/mlp/up").name, r.match("block_0/attn/query").name
    ('mxfp4', 'mxfp8')
    """

    rules: tuple[Rule, ...]

    @classmethod
    def of(cls, rules: Any) -> Rules:
        """Validate ``rules``: a list of ``(path_regex, recipe)`` pairs (or a Rules)."""
        if isinstance(rules, Rules):
            return rules
        shape_hint = (
            "rules must be a list of (path_regex, recipe) pairs, e.g. "
            "[(r'.*mlp.*', 'mxfp4'), (r'.*', 'mxfp8')]"
        )
        if isinstance(rules, (str, bytes, re.Pattern)) or not isinstance(rules, Iterable):
            raise TypeError(f"{shape_hint}; got {type(rules).__name__} {rules!r}")
        if isinstance(rules, dict):
            raise TypeError(f"{shape_hint}; got a dict (rule order matters: use a list)")
        items = list(rules)
        if (
            len(items) == 2
            and isinstance(items[0], (str, re.Pattern))
            and isinstance(items[1], (str, Recipe))
            and isinstance(rules, tuple)
        ):
            raise TypeError(f"{shape_hint}; got a single pair {rules!r}: wrap it in a list")
        out = []
        for i, item in enumerate(items):
            if isinstance(item, Rule):
                out.append(item)
                continue
            if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
                raise TypeError(f"{shape_hint}; rule {i} is {item!r}")
            pattern, recipe = item
            if isinstance(pattern, re.Pattern):
                pattern = pattern.pattern
            if not isinstance(pattern, str):
                raise TypeError(
                    f"rule {i}: the path regex must be a str, got {type(pattern).__name__}"
                )
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"rule {i}: bad path regex {pattern!r}: {e}") from None
            try:
                recipe = _recipes.get(recipe)
            except (ValueError, TypeError) as e:
                raise type(e)(f"rule {i} ({pattern!r}): {e}") from None
            out.append(Rule(pattern, recipe))
        return cls(tuple(out))

    def match(self, path: str) -> Recipe | None:
        """The recipe of the first rule whose regex fullmatches ``path``; None if none does."""
        for rule in self.rules:
            if rule.regex.fullmatch(path):
                return rule.recipe
        return None

    def active(self, path: str) -> Recipe | None:
        """Like :meth:`match`, but None also for the identity recipe (``"none"``)."""
        r = self.match(path)
        return None if r is None or r.is_identity else r


# --------------------------------------------------------------------------------------------
# Keys


def why_key(recipe: Recipe) -> str:
    parts = []
    if any(g.stochastic for g in (recipe.fwd, recipe.dlhs, recipe.drhs)):
        parts.append("stochastic rounding")
    if any(g.hadamard and g.random_signs for g in (recipe.fwd, recipe.dlhs, recipe.drhs)):
        parts.append("random Hadamard signs")
    return " and ".join(parts) or "random numbers"


def missing_stream_error(recipe: Recipe, where: str, fix: str) -> ValueError:
    return ValueError(
        f"{where} uses recipe {recipe.name!r}, which needs PRNG keys ({why_key(recipe)}), but "
        f"there is no {QUANT_STREAM!r} rng stream: {fix}"
    )


# --------------------------------------------------------------------------------------------
# The quantized ops (what every injected callable ends in)


def _hp_dot(lhs, rhs, dn, out_dtype):
    """The emulated GEMM with both operands kept: float32 in, float32 accumulation (exactly
    what :func:`lowbit.dot_general` does after quantizing its operands)."""
    y = lax.dot_general(
        lhs.astype(jnp.float32),
        rhs.astype(jnp.float32),
        dn,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)


# --------------------------------------------------------------------------------------------
# Observation (calibration hooks) and post-training site state

# A callable ``observer(site, lhs, contracting_axes, group_sizes)`` that the ops call with the
# activation operand of every site they run under a path (see :func:`observing`); None: not
# observing.
_OBSERVER: contextvars.ContextVar = contextvars.ContextVar("lowbit_observer", default=None)


@contextlib.contextmanager
def observing(observer):
    """Within this context every lowbit Flax op that knows its site path (``site=``) calls
    ``observer(site, lhs, contracting_axes, group_sizes)`` with its activation operand as the
    GEMM sees it (after a smoothing division), while tracing; ``group_sizes`` is a grouped
    site's (``lb.ragged_dot``: ``lhs [M, K]``, rows sorted by group, rows past the sum not
    in any group), None for the others. ``lowbit.ptq.calibrate`` gathers statistics this way:
    from the model's own ops, not from a second model."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


# A callable ``hook(site, gemm, lhs, rhs)`` that computes, in place of its GEMM, the output of
# every site op that knows its path (see :func:`substituting`); None: GEMMs run as they are.
_SUBSTITUTE: contextvars.ContextVar = contextvars.ContextVar("lowbit_substitute", default=None)


@dataclasses.dataclass(frozen=True)
class SiteGemm:
    """One site's GEMM, as :func:`substituting` hooks get it: ``gemm(lhs, rhs, recipe,
    key=None)`` runs it (its dimension numbers or einsum, its implementation) under any recipe
    on any operands; ``gemm.operands(lhs, rhs, recipe, key=None)`` gives the two operands as
    that recipe's forward GEMM multiplies them, in the original basis
    (:func:`lowbit.dot_general.forward_operands`), so ``gemm(lq, rq, "none")`` is the
    quantized output up to float32 summation order."""

    run: Any
    fwd_operands: Any

    def __call__(self, lhs, rhs, recipe, key=None):
        return self.run(lhs, rhs, recipe, key)

    def operands(self, lhs, rhs, recipe, key=None):
        return self.fwd_operands(lhs, rhs, recipe, key)


@contextlib.contextmanager
def substituting(hook):
    """Within this context every lowbit Flax op that knows its site path (``site=``) returns
    ``hook(site, gemm, lhs, rhs)`` instead of its GEMM's output, while tracing; ``gemm`` is a
    :class:`SiteGemm`: ``gemm(lhs, rhs, recipe, key=None)`` is the site's GEMM (its dimension
    numbers or einsum, its implementation) under any recipe. A smoothing division comes
    before and a low-rank branch is added after, as without the hook. :mod:`lowbit.autoquant`
    perturbs and gates site outputs this way (on a model whose sites hold float ops:
    ``quantize(..., observe=True)``).

    >>> import jax.numpy as jnp, lowbit as lb, lowbit.flax as lbf
    >>> from flax import nnx
    >>> probe = lbf.quantize(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), [(".*", "qat_mxfp4")],
    ...                      observe=True)
    >>> def hook(site, gemm, lhs, rhs):  # the site as if it ran 'qat_mxfp4'
    ...     return gemm(lhs, rhs, lb.recipes.get("qat_mxfp4"))
    >>> with lbf.substituting(hook):
    ...     y = probe(jnp.ones((4, 32)))
    >>> bool(jnp.all(y == lbf.quantize(probe, [(".*", "qat_mxfp4")])(jnp.ones((4, 32)))))
    True
    """
    token = _SUBSTITUTE.set(hook)
    try:
        yield
    finally:
        _SUBSTITUTE.reset(token)


def _substitute(site, gemm, lhs, rhs, recipe, key):
    hook = _SUBSTITUTE.get()
    if hook is None or site is None:
        return gemm(lhs, rhs, recipe, key)
    return hook(site, gemm, lhs, rhs)


def _observe(site, lhs, axes, group_sizes=None) -> None:
    obs = _OBSERVER.get()
    if obs is not None and site is not None:
        obs(site, lhs, tuple(int(a) % lhs.ndim for a in axes), group_sizes)


def check_dense(dimension_numbers, lhs_ndim: int, rhs_ndim: int, where: str) -> None:
    """Smoothing and low-rank branches apply to dense sites: ``x [..., K] @ w [K, N]``."""
    (lc, rc), (lb_, rb) = dimension_numbers
    ok = (
        rhs_ndim == 2
        and tuple(int(a) % lhs_ndim for a in lc) == (lhs_ndim - 1,)
        and tuple(int(a) % rhs_ndim for a in rc) == (0,)
        and not tuple(lb_)
        and not tuple(rb)
    )
    if not ok:
        raise ValueError(
            f"{where}: a smoothing vector or low-rank branch needs a dense GEMM x[..., K] @ "
            f"w[K, N] (Linear / Dense), got dimension numbers {dimension_numbers} with a "
            f"rank-{rhs_ndim} weight"
        )


def smooth_lhs(lhs, smooth):
    """``lhs / smooth`` along its last axis (float32 division, back in ``lhs``'s dtype)."""
    s = jnp.asarray(smooth, jnp.float32).reshape((1,) * (lhs.ndim - 1) + (-1,))
    return (lhs.astype(jnp.float32) / s).astype(lhs.dtype)


def lowrank_branch(lhs, a, b, out_dtype):
    """The high-precision low-rank branch ``(x @ a) @ b`` (float32, HIGHEST precision)."""
    hi = lax.Precision.HIGHEST
    t = jnp.matmul(lhs.astype(jnp.float32), jnp.asarray(a, jnp.float32), precision=hi)
    return jnp.matmul(t, jnp.asarray(b, jnp.float32), precision=hi).astype(out_dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class SiteTransform:
    """The post-training state of a dense site (``lowbit.ptq``), which the site's op applies
    around its GEMM: ``smooth``, a ``[K]`` vector the activation is divided by first
    (SmoothQuant; the weight holds ``diag(smooth) @ W``), ``lowrank = (a [K, r],
    b [r, N])``, a high-precision branch ``(x / smooth) @ a @ b`` added to the output
    (SVDQuant), and ``rotate``, the ``[b]`` signs of a block-wise Hadamard rotation of the
    activation after smoothing (MR-GPTQ: each block ``v`` of ``b`` inputs becomes
    ``H diag(signs) v``, :func:`lowbit.core.hadamard.hadamard_transform`; the weight holds
    ``H diag(signs)`` applied to its input blocks, so the float GEMM is unchanged). Each
    framework's adapter holds the arrays as parameters of the site (NNX: ``nnx.Param`` s of
    the op; Linen: ``params`` leaves next to the kernel) and hands the op this object when it
    runs."""

    smooth: Any = None
    lowrank: tuple[Any, Any] | None = None
    rotate: Any = None

    def check(self, dimension_numbers, lhs_ndim: int, rhs_ndim: int, where: str) -> None:
        check_dense(dimension_numbers, lhs_ndim, rhs_ndim, where)

    def lhs(self, lhs):
        """The activation as the GEMM sees it."""
        if self.smooth is not None:
            lhs = smooth_lhs(lhs, self.smooth)
        if self.rotate is not None:
            signs = jnp.asarray(self.rotate, jnp.float32)
            lhs = _hadamard.hadamard_transform(lhs, signs.shape[0], signs=signs, axis=-1)
        return lhs

    def output(self, y, lhs):
        """The site's output: the GEMM's ``y`` plus the branch on the GEMM's ``lhs``."""
        if self.lowrank is None:
            return y
        return y + lowrank_branch(lhs, self.lowrank[0], self.lowrank[1], y.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class ChannelSplit:
    """A dense site's input channels split in two (TetraJet-v2's OutControl,
    :func:`lowbit.flax.training.out_control`): while ``active`` (a traced bool), the GEMM is
    the sum of the site's recipe on the ``inliers`` channels and ``recipe`` on the
    ``outliers`` channels (each operand gathered along its contraction axis, in the order
    given), with the key split between the two; otherwise the site's GEMM as it is."""

    outliers: Any
    inliers: Any
    active: Any
    recipe: Recipe

    def run(self, gemm, lhs, rhs, recipe, key):
        def split():
            k_in = k_out = None
            if key is not None:
                k_in, k_out = jax.random.split(key)
            y = gemm(jnp.take(lhs, self.inliers, axis=-1), jnp.take(rhs, self.inliers, axis=0),
                     recipe, k_in)
            y8 = gemm(jnp.take(lhs, self.outliers, axis=-1),
                      jnp.take(rhs, self.outliers, axis=0), self.recipe,
                      k_out if self.recipe.needs_key else None)
            return y + y8

        return jax.lax.cond(self.active, split, lambda: gemm(lhs, rhs, recipe, key))


def qdot_general(
    lhs,
    rhs,
    dimension_numbers,
    recipe: Recipe,
    key=None,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    implementation: Implementation | None = None,
    *,
    site: str | None = None,
    packed: bool = False,
    transform: SiteTransform | None = None,
    channels: ChannelSplit | None = None,
):
    """:func:`lowbit.dot_general` with Flax's keyword arguments (``out_sharding``) and the
    ``implementation`` of its GEMMs (resolved where the op was built).

    ``packed``: the weight enters pre-quantized (a packed model's dequantized QArray) and
    ``recipe`` is its serving form (:func:`serving_recipe`): an identity serving recipe runs
    the emulated GEMM on both operands as they are. ``transform``: the site's post-training
    state (:class:`SiteTransform`), applied around the GEMM. ``site``: the site's path, for
    :func:`observing` and :func:`substituting`. ``channels``: the site's channel split
    (:class:`ChannelSplit`; a dense site, under no :func:`substituting` hook)."""
    if transform is not None:
        transform.check(dimension_numbers, lhs.ndim, rhs.ndim, f"site {site!r}")
        lhs = transform.lhs(lhs)
    _observe(site, lhs, dimension_numbers[0][0])

    def run(lhs, rhs, recipe, key=None):
        return _qdot_general(
            lhs,
            rhs,
            dimension_numbers,
            recipe,
            key,
            precision,
            preferred_element_type,
            implementation,
            packed,
        )

    def operands(lhs, rhs, recipe, key=None):
        return forward_operands(lhs, rhs, dimension_numbers, recipe, key, implementation)

    gemm = SiteGemm(run, operands)
    if channels is not None and _SUBSTITUTE.get() is None:
        check_dense(dimension_numbers, lhs.ndim, rhs.ndim, f"site {site!r} (channel split)")
        y = channels.run(gemm, lhs, rhs, recipe, key)
    else:
        y = _substitute(site, gemm, lhs, rhs, recipe, key)
    if transform is not None:
        y = transform.output(y, lhs)
    if out_sharding is not None:
        y = jax.lax.with_sharding_constraint(y, out_sharding)
    return y


def qragged_dot(lhs, rhs, group_sizes, recipe, key, implementation=None, *,
                site: str | None = None, packed: bool = False):
    """:func:`lowbit.ragged_dot` as a site op: under :func:`substituting` the hook gets a
    :class:`SiteGemm` that runs the grouped GEMM on these ``group_sizes`` under any recipe
    (its ``operands``: :func:`lowbit.gemm.ragged.ragged_operands`). ``packed``: the experts
    enter pre-quantized and ``recipe`` is the serving form."""
    del packed  # the serving recipe leaves the weight as it is
    _observe(site, lhs, (1,), group_sizes)

    def run(lhs, rhs, recipe, key=None):
        return ragged_dot(lhs, rhs, group_sizes, recipe=recipe, key=key,
                          implementation=implementation)

    def operands(lhs, rhs, recipe, key=None):
        return ragged_operands(lhs, rhs, group_sizes, recipe=recipe, key=key,
                               implementation=implementation)

    return _substitute(site, SiteGemm(run, operands), lhs, rhs, recipe, key)


def _qdot_general(
    lhs, rhs, dimension_numbers, recipe, key, precision, preferred_element_type, implementation,
    packed=False,
):
    if packed and recipe.is_identity:
        # A pre-quantized weight and a float activation: the GEMM lowbit would run.
        out = jnp.dtype(
            preferred_element_type
            if preferred_element_type is not None
            else jnp.result_type(lhs.dtype, rhs.dtype)
        )
        (lc, rc), (lb_, rb) = dimension_numbers
        dn = ((tuple(lc), tuple(rc)), (tuple(lb_), tuple(rb)))
        y = _hp_dot(lhs, rhs, dn, out)
    else:
        y = lb.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            recipe=recipe,
            key=key,
            preferred_element_type=preferred_element_type,
            precision=precision,
            implementation=implementation,
        )
    return y


def expand_ellipsis(subscripts: str, lhs_ndim: int, rhs_ndim: int) -> str:
    """Name the axes an einsum's ``...`` stands for (``lowbit.einsum`` names every axis).

    >>> expand_ellipsis("...qhd,...khd->...hqk", 4, 4)
    'Aqhd,Akhd->Ahqk'
    """
    s = subscripts.replace(" ", "")
    if "..." not in s:
        return s
    if "->" not in s:
        raise ValueError(f"einsum {subscripts!r}: an explicit output ('->') is needed")
    ins, out = s.split("->")
    try:
        a, b = ins.split(",")
    except ValueError:
        raise ValueError(f"einsum {subscripts!r}: two operands expected") from None
    free = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in s]

    def n_ell(t, nd):
        return nd - (len(t) - 3) if "..." in t else 0

    na, nb = n_ell(a, lhs_ndim), n_ell(b, rhs_ndim)
    if na < 0 or nb < 0:
        raise ValueError(f"einsum {subscripts!r}: more labels than operand dimensions")
    n = max(na, nb)
    ell = "".join(free[:n])
    a = a.replace("...", ell[n - na :])
    b = b.replace("...", ell[n - nb :])
    out = out.replace("...", ell)
    return f"{a},{b}->{out}"


def qeinsum(
    subscripts: str,
    lhs,
    rhs,
    recipe: Recipe,
    key=None,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    implementation: Implementation | None = None,
    *,
    site: str | None = None,
    **unused,
):
    """:func:`lowbit.einsum` for Flax call sites (``...`` allowed, Flax's keyword arguments).
    ``site``: the site's path, for :func:`observing` (its ``lhs`` is the activation)."""
    del precision, unused  # quantized GEMMs accumulate in float32
    eq = expand_ellipsis(subscripts, lhs.ndim, rhs.ndim)
    if _OBSERVER.get() is not None and site is not None:
        a, b = eq.split("->")[0].split(",")
        _observe(site, lhs, [i for i, c in enumerate(a) if c in b and c not in eq.split("->")[1]])

    def run(lhs, rhs, recipe, key=None):
        return lb.einsum(
            eq,
            lhs,
            rhs,
            recipe=recipe,
            key=key,
            preferred_element_type=preferred_element_type,
            implementation=implementation,
        )

    def operands(lhs, rhs, recipe, key=None):
        return einsum_operands(
            eq, lhs, rhs, recipe=recipe, key=key, implementation=implementation
        )

    gemm = SiteGemm(run, operands)
    y = _substitute(site, gemm, lhs, rhs, recipe, key)
    if out_sharding is not None:
        y = jax.lax.with_sharding_constraint(y, out_sharding)
    return y


def einsum_rhs_layout(subscripts: str, lhs_ndim: int, rhs_ndim: int) -> Layout | None:
    """Where :func:`lowbit.einsum` puts the weight's blocks: the rhs's last contracting axis
    (in lhs label order) and its last free axis. None when an axis is summed out first."""
    eq = expand_ellipsis(subscripts, lhs_ndim, rhs_ndim)
    ins, out = eq.split("->")
    a, b = ins.split(",")
    if any(c not in a and c not in out for c in b):
        return None
    contract = [c for c in a if c in b and c not in out]
    if not contract:
        return None
    free = [i for i, c in enumerate(b) if c not in a]
    return Layout(b.index(contract[-1]), free[-1] if free else None)


def dot_rhs_layout(dimension_numbers, rhs_ndim: int) -> Layout | None:
    """The rhs's last contracting axis and last free axis of a ``dot_general``."""
    (_, rc), (_, rb) = dimension_numbers
    rc = [int(a) % rhs_ndim for a in rc]
    rb = [int(a) % rhs_ndim for a in rb]
    if not rc:
        return None
    free = [i for i in range(rhs_ndim) if i not in rc and i not in rb]
    return Layout(rc[-1], free[-1] if free else None)


# --------------------------------------------------------------------------------------------
# Sites, layouts, packed weights


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a weight enters its GEMM: the axis its blocks run along (the contraction axis) and
    the free axis a 2-D tile also spans. ``stacked``: the leading axis stacks independent
    weights (a grouped GEMM's experts, ``[G, K, N]``), each packed as its own tensor (its own
    NVFP4 tensor scale): the packed QArray's leaves carry that leading axis, its metadata
    describes one weight (:func:`is_stacked`)."""

    axis: int
    other_axis: int | None
    stacked: bool = dataclasses.field(default=False, repr=False)


def is_stacked(q) -> bool:
    """Whether a QArray holds a stack of weights (packed with a ``stacked`` Layout): its codes
    have one more axis than its metadata's shape."""
    return q.codes.ndim == len(q.shape) + 1


@dataclasses.dataclass(frozen=True)
class Site:
    """One quantizable GEMM of a model."""

    path: str  # module path ("mlp/up"), or attention path + "/attn_scores"
    kind: str  # "dot_general", "einsum", "attn_scores", "attn_values"
    module: str  # module class name
    recipe: Recipe | None  # None: no rule matched (or "none")
    kernel: str | None = None  # param path of the weight ("mlp/up/kernel"); None: no weight
    shape: tuple[int, ...] | None = None
    dtype: Any = None
    layout: Layout | None = None
    implementation: Implementation | None = None  # what its GEMMs run (None: unquantized)


def weight_spec(recipe: Recipe, where: str = "") -> QuantSpec | None:
    """The forward weight spec of ``recipe``, checked for packing (None: the forward keeps
    the weight in high precision)."""
    spec = recipe.fwd.rhs
    at = f" (at {where!r})" if where else ""
    if recipe.fwd.hadamard:
        raise ValueError(
            f"recipe {recipe.name!r}{at} applies a Hadamard transform in the forward GEMM, so "
            "its quantized weight lives in the rotated basis; pack() supports recipes whose "
            "forward quantizes the weight directly (e.g. 'qat_mxfp4', 'nvfp4', 'mxfp8')"
        )
    if spec is None:
        return None
    if spec.granularity != "block":
        raise ValueError(
            f"recipe {recipe.name!r}{at} scales the weight per tensor ({spec.format}); pack() "
            "stores block formats (QArray)"
        )
    if spec.stochastic:
        raise ValueError(
            f"recipe {recipe.name!r}{at} rounds the weight stochastically in the forward; "
            "a packed weight must be deterministic"
        )
    if spec.prescale != 1.0:
        raise ValueError(f"recipe {recipe.name!r}{at}: a forward weight prescale is not packable")
    if spec.scale_std is not None:
        raise ValueError(
            f"recipe {recipe.name!r}{at} scales the weight by its blocks' spread (scale_std, "
            "QuEST); pack() stores the formats' own amax-scaled blocks"
        )
    return spec


def serving_recipe(recipe: Recipe) -> Recipe:
    """The forward of ``recipe`` for a weight that :func:`pack` already quantized: the
    activation is quantized as in ``recipe``, the weight enters as it is (no backward). It
    keeps ``recipe``'s name: serving is a property of the site (its op's ``packed``), not of
    the recipe's name."""
    weight_spec(recipe)
    return Recipe(
        recipe.name,
        fwd=GemmSpec(recipe.fwd.lhs, None, random_signs=recipe.fwd.random_signs),
        description=f"forward of {recipe.name!r} on a pre-quantized (packed) weight",
        source=recipe.source,
    )


def pack_weight(w: jax.Array, spec: QuantSpec, layout: Layout) -> lb.QArray:
    """Quantize a weight exactly as the forward GEMM does (bit for bit), packed; a stacked
    layout packs each weight of the stack as its own tensor (as ``lb.ragged_dot`` does)."""
    if layout.stacked:
        other = None if layout.other_axis is None else layout.other_axis - 1
        return jax.vmap(lambda wg: _pack_weight(wg, spec, layout.axis - 1, other))(w)
    return _pack_weight(w, spec, layout.axis, layout.other_axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _pack_weight(w, spec: QuantSpec, axis: int, other_axis: int | None) -> lb.QArray:
    # One compiled computation per (shape, spec) rather than op by op.
    from lowbit.gemm.operand import quantize_operand

    return quantize_operand(w, spec, axis, other_axis, None, packed=True)
