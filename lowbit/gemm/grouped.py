"""The grouped GEMM's building blocks: row layouts, per-group quantization, chunked GEMMs.

What :func:`lowbit.gemm.ragged.ragged_dot` is made of (see its module for the semantics): the
layouts of a grouped GEMM's rows (the caller's order, and the token layout where each group
starts at a multiple of ``q`` rows), the quantization of its row-side operands with each
group's Hadamard signs, rounding stream and tensor amax, of its weight stack per group, and the
float32 grouped GEMMs of the emulation. Shared by the custom VJP and the Pallas path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.core import formats as _formats
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.implementation import Implementation
from lowbit.gemm.operand import (
    apply_static_amax,
    clip_to_rms,
    fold_key,
    gemm_signs,
    hadamard_along,
    prepare_operand,
    through_forward,
    unrotated,
)
from lowbit.gemm.recipes import GemmSpec, QuantSpec, Recipe

__all__ = [
    "FWD", "DLHS", "DRHS", "CHUNK_ROWS", "row_side", "two_d", "row_multiple", "group_stat",
    "ungroupable", "Shape", "Layout", "group_keys", "group_signs", "vmap_axis", "features",
    "tokens", "quantize_weights", "unrotate_rows", "unrotate_weights", "through_fn",
    "per_row_masked", "grouped_mm", "grouped_wgrad", "poison",
]

# fold_in tags, as lowbit.dot_general uses them: one stream per (GEMM, operand).
FWD, DLHS, DRHS = 0, 1, 2

CHUNK_ROWS = 256
"""Rows per step of the emulation's grouped GEMM (a ``lax.scan``): each step multiplies its
rows by the weight of every group among them (masked). Measured on a 4096 x 128 x 512 grouped
GEMM on CPU: 128-row steps ran 3.0x the dense GEMM's time, 256-row steps 2.0x."""


# --------------------------------------------------------------------------------------------
# What a recipe needs of the row layout


def row_side(recipe: Recipe):
    """(gemm name, gemm, spec, along the tokens) of every operand that holds tokens: fwd's
    and dlhs' lhs (x, dy; quantized along their features) and both of drhs (x, dy; along the
    tokens)."""
    out = [("fwd", recipe.fwd, recipe.fwd.lhs, False),
           ("dlhs", recipe.dlhs, recipe.dlhs.lhs, False)]
    out += [("drhs", recipe.drhs, spec, True) for spec in (recipe.drhs.lhs, recipe.drhs.rhs)]
    return out


def two_d(spec: QuantSpec | None) -> bool:
    return spec is not None and spec.block_shape is not None and len(spec.block_shape) == 2


def row_multiple(recipe: Recipe) -> int:
    """``q``: the longest run along the tokens of any block, 2-D tile, Hadamard block or
    TetraJet-v2 outer block of the recipe (1 when none); in the emulation's token layout each
    group starts at a multiple of it, so no block holds two groups' rows."""
    m = recipe.drhs.hadamard or 1
    for _, _, spec, along in row_side(recipe):
        if spec is None or spec.granularity != "block":
            continue
        if along:
            m = max(m, (spec.block_shape or (_formats.get(spec.format).block_size,))[0],
                    spec.tensor_block or 1)
        elif two_d(spec):
            m = max(m, spec.block_shape[1])
    return int(m)


def group_stat(spec: QuantSpec | None, along_rows: bool) -> str | None:
    """How a row-side operand's tensor-wide quantity is taken per group: None (it has none),
    ``"amax"`` (a tensor amax, given to each row or tile), ``"masked"`` (quantize each group
    as one tensor with the other groups' rows zeroed)."""
    if spec is None:
        return None
    if spec.granularity == "tensor":
        return None if spec.amax is not None else "amax"
    if spec.granularity == "row":
        return "masked" if along_rows else None
    if spec.rounding == "eden":
        return "masked"
    fmt = _formats.get(spec.format)
    if fmt.tensor_scale and not fmt.is_absmean and spec.tensor_block is None \
            and spec.amax is None:
        return "amax"
    return None


def ungroupable(recipe: str | Recipe) -> str | None:
    """Why ``recipe`` cannot run as a grouped GEMM (None if it can): a row-side operand (the
    activations, the output gradient) whose scale is a mean over the tensor (absmean) or that
    is clipped to an RMS taken along the rows."""
    r = _recipes.get(recipe)
    for name, _, spec, along in row_side(r):
        if spec is None:
            continue
        side = "lhs" if spec is (r.fwd.lhs, r.dlhs.lhs, r.drhs.lhs)[
            ("fwd", "dlhs", "drhs").index(name)] else "rhs"
        if spec.granularity == "block" and _formats.get(spec.format).is_absmean:
            return (f"recipe {r.name!r}: its {name} {side} spec ({spec.format}) scales by "
                    "a mean over the whole tensor, which a group's tiles cannot give")
        if along and spec.clip_rms is not None:
            return (f"recipe {r.name!r}: its {name} {side} spec clips to an RMS over a "
                    "group's rows, which the group's tiles cannot give")
    return None


# --------------------------------------------------------------------------------------------
# The row layouts


@dataclasses.dataclass(frozen=True)
class Shape:
    """Static facts of one call: sizes, recipe, dtypes, implementation."""

    m: int
    k: int
    n: int
    groups: int
    q: int  # rows per tile of the token layout
    recipe: Recipe
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    impl: Implementation

    @property
    def tiles(self) -> int:
        """Tiles of the token layout: enough for any group sizes summing to at most M, and a
        whole number of :data:`CHUNK_ROWS` chunks (no copy to pad it for the GEMM's scan)."""
        t = -(-self.m // self.q) + self.groups
        per = max(1, CHUNK_ROWS // self.q)
        return -(-t // per) * per

    @property
    def padded(self) -> int:
        return self.tiles * self.q


class Layout:
    """Where each row goes. Caller's order: ``row_group [M]`` (G past the groups),
    ``row_index [M]`` (the row's index in its group). Token layout (each group from a multiple
    of q, zero rows between): ``pad_group [Mp]`` (the group a padded row belongs to, its zero
    padding included; G past the groups), ``tile_group`` / ``tile_index [Mp/q]``, ``src``
    (the caller's row of each padded row, M for padding) and ``dst`` (the padded row of each
    caller's row, Mp past the groups)."""

    def __init__(self, sizes, st: Shape):
        q, g = st.q, st.groups
        n = jnp.maximum(sizes.astype(jnp.int32), 0)
        ends = jnp.cumsum(n)
        starts = ends - n
        i = jnp.arange(st.m, dtype=jnp.int32)
        self.row_group = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
        gc = jnp.minimum(self.row_group, g - 1)
        self.row_index = (i - starts[gc]).astype(jnp.uint32)
        pn = -(-n // q) * q
        pends = jnp.cumsum(pn)
        pstarts = pends - pn
        r = jnp.arange(st.padded, dtype=jnp.int32)
        self.pad_group = jnp.searchsorted(pends, r, side="right").astype(jnp.int32)
        pgc = jnp.minimum(self.pad_group, g - 1)
        off = r - pstarts[pgc]
        valid = (self.pad_group < g) & (off < n[pgc])
        self.src = jnp.where(valid, starts[pgc] + off, st.m)
        self.dst = jnp.where(self.row_group < g, pstarts[gc] + i - starts[gc], st.padded)
        t0 = jnp.arange(st.tiles, dtype=jnp.int32) * q
        self.tile_group = jnp.searchsorted(pends, t0, side="right").astype(jnp.int32)
        self.tile_index = ((t0 - pstarts[jnp.minimum(self.tile_group, g - 1)]) // q
                           ).astype(jnp.uint32)

    def spread(self, x):
        """``[M, D] -> [Mp, D]`` in the token layout (zero rows between groups)."""
        x = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
        return x[self.src]

    def gather(self, y):
        """``[Mp, D] -> [M, D]``: each caller's row, zeros past the groups."""
        y = jnp.concatenate([y, jnp.zeros((1, y.shape[1]), y.dtype)])
        return y[self.dst]


# --------------------------------------------------------------------------------------------
# Per-group keys, signs and quantization


def group_keys(key, groups: int):
    """uint32[G, 2]: ``fold_in(key, g)`` per group (None without a key)."""
    if key is None:
        return None
    return jax.vmap(lambda g: fold_key(key, g))(jnp.arange(groups, dtype=jnp.uint32))


def group_signs(gemm: GemmSpec, gkeys, tag: int, groups: int):
    """Per-group Hadamard signs ``[G, h]`` of one GEMM (None: none or fixed)."""
    if not gemm.hadamard or not gemm.random_signs:
        return None
    if gkeys is None:
        return jnp.broadcast_to(gemm_signs(gemm, None, tag), (groups, gemm.hadamard))
    return jax.vmap(lambda k: gemm_signs(gemm, k, tag))(gkeys)


def _needs_key(spec: QuantSpec | None) -> bool:
    return spec is not None and (spec.stochastic or spec.rounding == "eden")


def _unit_keys(gkeys, tags, group, index, groups: int, spec):
    """Rounding keys per row or tile: its group's key folded with ``tags`` and its index in
    the group (so a group's bits depend on its own rows alone); None when ``spec`` draws
    none."""
    if gkeys is None or not _needs_key(spec):
        return None
    g = jnp.minimum(group, groups - 1)
    return jax.vmap(lambda k, i: fold_key(k, *tags, i))(gkeys[g], index)


def vmap_axis(a):
    return None if a is None else 0


def _group_amax(xs, axes, group, groups: int):
    """Each unit's group amax (finite values): units ``xs [U, ...]`` with groups ``group``."""
    finite = jnp.where(jnp.isfinite(xs), jnp.abs(xs), 0.0)
    gmax = jax.ops.segment_max(jnp.max(finite, axis=axes), group, groups + 1)
    return jnp.maximum(gmax, 0.0)[group]


def _quantize_units(xu, spec, gemm: GemmSpec, axis, other, keys, signs, group, st, with_mask,
                    *, along_rows: bool, packed: bool = False):
    """Quantize units ``xu [U, ...]`` (rows or tiles) of one group each, vmapped: the group's
    Hadamard signs ``signs [U, h]``, keys ``[U, 2]``, and its amax where the spec has one;
    ``packed``: a QArray stacked per unit (one tensor each)."""
    native = st.impl.cpu_kernel
    h = gemm.hadamard
    amax = None
    if group_stat(spec, along_rows) == "amax":
        if h:  # transform here, so the group's amax is the rotated tensor's
            xu = jax.vmap(lambda xt, s: hadamard_along(xt, axis, h, s),
                          in_axes=(0, vmap_axis(signs)))(xu, signs)
            gemm, h = dataclasses.replace(gemm, hadamard=None), None
        xs = jax.vmap(lambda xt: apply_static_amax(clip_to_rms(xt, spec, axis), spec)[0])(xu)
        amax = _group_amax(xs, tuple(range(1, xu.ndim)), group, st.groups)

    def one(xt, k, s, a):
        return prepare_operand(xt, spec, gemm, axis, other, k, s, use_barrier=False,
                               native=native, with_mask=with_mask, tensor_amax=a,
                               packed=packed)

    s = signs if h else None
    axes = (0, vmap_axis(keys), vmap_axis(s), vmap_axis(amax))
    return jax.vmap(one, in_axes=axes)(xu, keys, s, amax)


def _quantize_masked(x, spec, gemm, axis, other, tags, gkeys, signs, groups_of_rows, st,
                     *, with_mask):
    """Each group quantized as one tensor (``x`` with the other groups' rows zeroed: a zero
    changes no maximum), G passes; each row keeps its own group's values."""
    native = st.impl.cpu_kernel

    def body(g, acc):
        k = None if gkeys is None else fold_key(gkeys[g], *tags)
        s = None if signs is None else signs[g]
        mine = (groups_of_rows == g)[:, None]
        q = prepare_operand(jnp.where(mine, x, 0.0), spec, gemm, axis, other, k, s,
                            use_barrier=False, native=native, with_mask=with_mask)
        if with_mask:
            q, m = q
            m = jnp.zeros(x.shape, bool) if m is None else m
            return jnp.where(mine, q, acc[0]), jnp.where(mine, m, acc[1])
        return jnp.where(mine, q, acc)

    init = jnp.zeros(x.shape, jnp.float32)
    if with_mask:
        v, m = lax.fori_loop(0, st.groups, body, (init, jnp.zeros(x.shape, bool)))
        return v, (m if spec.trust_mask else None)
    return lax.fori_loop(0, st.groups, body, init)


def tokens(xp, spec, gemm: GemmSpec, axis, tags, gkeys, signs, lay: Layout, st: Shape,
           *, with_mask=False, packed=False):
    """An operand in the token layout ``[Mp, D]`` quantized ``q`` rows at a time: along the
    tokens (``axis`` 0, a weight-gradient operand) or along its features (``axis`` 1: a 2-D
    tile spanning the tokens, or the grouped kernel's row tiles). ``packed``: the tiles as a
    QArray stacked per tile (``[Mp/q]`` tensors of ``[q, D]``; a spec without a tensor-wide
    rule other than the amax)."""
    other = 1 - axis
    if group_stat(spec, axis == 0) == "masked":
        return _quantize_masked(xp, spec, gemm, axis, other, tags, gkeys, signs,
                                lay.pad_group, st, with_mask=with_mask)
    xt = xp.reshape(st.tiles, st.q, xp.shape[1])
    tg = jnp.minimum(lay.tile_group, st.groups - 1)
    keys = _unit_keys(gkeys, tags, lay.tile_group, lay.tile_index, st.groups, spec)
    out = _quantize_units(xt, spec, gemm, axis, other, keys,
                          None if signs is None else signs[tg], lay.tile_group, st, with_mask,
                          along_rows=axis == 0, packed=packed)
    if packed:
        return out
    if with_mask:
        v, m = out
        return v.reshape(xp.shape), (None if m is None else m.reshape(xp.shape))
    return out.reshape(xp.shape)


def features(x, spec, gemm: GemmSpec, tags, gkeys, signs, lay: Layout, st: Shape,
              *, with_mask=False):
    """A row-side operand ``[M, D]`` in the caller's order quantized along its features
    (the forward's x, the input gradient's dy), row by row with its group's signs, keys and
    amax; a 2-D tile spanning the tokens goes through the token layout."""
    if two_d(spec):
        out = tokens(lay.spread(x), spec, gemm, 1, tags, gkeys, signs, lay, st,
                      with_mask=with_mask)
        if with_mask:
            v, m = out
            return lay.gather(v), (None if m is None else lay.gather(m.astype(jnp.float32)) > 0)
        return lay.gather(out)
    if group_stat(spec, False) == "masked":
        return _quantize_masked(x, spec, gemm, 1, 0, tags, gkeys, signs, lay.row_group, st,
                                with_mask=with_mask)
    rg = jnp.minimum(lay.row_group, st.groups - 1)
    keys = _unit_keys(gkeys, tags, lay.row_group, lay.row_index, st.groups, spec)
    return _quantize_units(x, spec, gemm, 0, None, keys,
                           None if signs is None else signs[rg], lay.row_group, st, with_mask,
                           along_rows=False)


def quantize_weights(w, spec, gemm: GemmSpec, axis, other, tags, gkeys, signs, st,
                     *, with_mask=False, packed=False):
    """The weight stack ``[G, K, N]``, each group's weight as :func:`lowbit.dot_general`
    quantizes a weight (vmapped over groups); ``packed``: a QArray stacked per group."""
    native = st.impl.cpu_kernel

    def one(wg, k, s):
        kk = None if k is None else fold_key(k, *tags)
        return prepare_operand(wg, spec, gemm, axis, other, kk, s, use_barrier=False,
                               native=native, with_mask=with_mask, packed=packed)

    return jax.vmap(one, in_axes=(0, vmap_axis(gkeys), vmap_axis(signs)))(w, gkeys, signs)


def unrotate_rows(x, gemm: GemmSpec, signs, lay, st):
    """Undo ``gemm``'s Hadamard along the features of a row-side operand (per group)."""
    if not gemm.hadamard:
        return x
    return per_row_masked(lambda xr, _, s: unrotated(xr, gemm, 0, s), x, None, signs, lay, st)


def unrotate_weights(w, gemm: GemmSpec, signs, axis):
    if not gemm.hadamard:
        return w
    return jax.vmap(lambda wg, s: unrotated(wg, gemm, axis, s),
                    in_axes=(0, vmap_axis(signs)))(w, signs)


def through_fn(gemm: GemmSpec, axis: int, rotated: bool):
    """:func:`lowbit.gemm.operand.through_forward` for one row or one weight (to vmap)."""
    return lambda gx, m, s: through_forward(gx, m, gemm, axis, s, rotated)


# --------------------------------------------------------------------------------------------
# The grouped GEMMs (float32 values)


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _chunks(groups_of_rows, st: Shape, *arrays):
    """Rows in chunks of :data:`CHUNK_ROWS` (the last padded, its rows in no group):
    ``(group [C, R], arrays [C, R, D]...)``."""
    rows = groups_of_rows.shape[0]
    r = min(CHUNK_ROWS, rows)
    c = -(-rows // r)
    pad = c * r - rows
    if pad:
        groups_of_rows = jnp.concatenate([groups_of_rows, jnp.full((pad,), st.groups,
                                                                   jnp.int32)])
        arrays = [jnp.concatenate([a, jnp.zeros((pad, a.shape[1]), a.dtype)]) for a in arrays]
    return groups_of_rows.reshape(c, r), [a.reshape(c, r, -1) for a in arrays]


def _span(gc, st: Shape):
    """The first and last group among a chunk's rows (sorted by group; G: none)."""
    lo = gc[0]
    hi = jnp.max(jnp.where(gc < st.groups, gc, -1))
    return lo, hi


def grouped_mm(a, b, groups_of_rows, st: Shape, *, transpose_b: bool = False, ok=True):
    """``a [R, K]`` (rows sorted by group, ``groups_of_rows [R]``) times ``b [G, K, N]``
    (each group's matrix, transposed with ``transpose_b``) -> ``[R, N]``; rows in no group
    give zeros; every row NaN where ``ok`` is False (applied per chunk, so no copy)."""
    rows, nout = a.shape[0], (b.shape[1] if transpose_b else b.shape[2])
    gcs, (acs,) = _chunks(groups_of_rows, st, a)

    def step(_, xs):
        gc, ac = xs
        lo, hi = _span(gc, st)

        def one(g, acc):
            bg = lax.dynamic_index_in_dim(b, g, 0, keepdims=False)
            y = _dot(ac, bg.T if transpose_b else bg)
            return jnp.where((gc == g)[:, None], y, acc)

        y = lax.fori_loop(lo, hi + 1, one, jnp.zeros((ac.shape[0], nout), jnp.float32))
        return None, poison(y, ok)

    _, y = lax.scan(step, None, (gcs, acs))
    return y.reshape(-1, nout)[:rows]


def grouped_wgrad(a, d, groups_of_rows, st: Shape):
    """``sum over each group's rows of a^T d``: ``[R, K], [R, N] -> [G, K, N]`` (zero for an
    empty group)."""
    gcs, (acs, dcs) = _chunks(groups_of_rows, st, a, d)

    def step(acc, xs):
        gc, ac, dc = xs
        lo, hi = _span(gc, st)

        def one(g, acc):
            cur = lax.dynamic_index_in_dim(acc, g, 0, keepdims=False)
            part = _dot(jnp.where((gc == g)[:, None], ac, 0.0).T, dc)
            return lax.dynamic_update_index_in_dim(acc, cur + part, g, 0)

        return lax.fori_loop(lo, hi + 1, one, acc), None

    init = jnp.zeros((st.groups, a.shape[1], d.shape[1]), jnp.float32)
    acc, _ = lax.scan(step, init, (gcs, acs, dcs))
    return acc



def poison(y, ok):
    return jnp.where(ok, y, np.float32(np.nan))

def per_row_masked(fn, dx, mask, signs, lay: Layout, st: Shape):
    """``fn(row, its mask, its group's signs)`` over the caller's rows (None stays None)."""
    rg = jnp.minimum(lay.row_group, st.groups - 1)
    s = None if signs is None else signs[rg]
    return jax.vmap(fn, in_axes=(0, vmap_axis(mask), vmap_axis(s)))(dx, mask, s)
