"""Quantized grouped GEMM (``ragged_dot``): one custom VJP, the recipe's three GEMMs per group.

``lhs [M, K]`` holds the rows of ``G`` groups one after another (``group_sizes [G]``, rows
past their sum give zeros, as in ``jax.lax.ragged_dot``); ``rhs [G, K, N]`` one weight per
group. Group ``g`` computes ``lhs[rows of g] @ rhs[g]`` as its own tensor: every quantity that
:func:`lowbit.dot_general` takes over a whole tensor (NVFP4's and INT4's tensor amax, a
per-tensor FP8 scale, MS-EDEN's tensor scale, a row scale along the tokens) is taken over the
group's rows alone; the random Hadamard signs and the stochastic-rounding streams come from
``fold_in(key, g)``, as if :func:`lowbit.dot_general` had been called on the group with that
key. The weight-gradient GEMM contracts each group's rows, so its blocks (32 for MX, 16 for
NVFP4, a 2-D tile, a Hadamard block, a TetraJet-v2 outer block) run along that ragged axis:
they start at the group's first row and never hold another group's row, and a group whose
size is not a block multiple is padded with zero rows (a zero never changes a block's scale,
and adds nothing to any sum).

The emulation (the reference): rows are laid out group by group, each group starting at a
multiple of ``P`` rows (:func:`row_multiple`: the recipe's longest block or transform along
the tokens, at least 128) with zero rows between; operands are quantized ``P`` rows at a time
(vmapped, with the group's amax given to each tile where the format has a tensor scale;
MS-EDEN, whose tensor scale is a maximum of corrected block scales, quantizes each group as
one masked tensor, G passes), then dequantized and multiplied in float32, one ``P``-row chunk
at a time against its group's weight (a ``lax.scan`` whose empty chunks skip their GEMM).
Memory grows with ``M + G * P`` rows, never with ``G * M`` (``jax.lax.ragged_dot`` on CPU
expands the rows per group).

What cannot be grouped raises: an absmean (ternary) scale or a QuEST RMS clip over the rows
of a group (a mean over a group's rows is not a maximum: tiles cannot give it), see
:func:`ungroupable`.

>>> import jax.numpy as jnp, lowbit as lb
>>> x, w = jnp.ones((5, 32)), jnp.ones((2, 32, 4))
>>> y = lb.ragged_dot(x, w, jnp.array([3, 1]), recipe="mxfp8")
>>> y[:, 0].tolist()
[32.0, 32.0, 32.0, 32.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.core import formats as _formats
from lowbit.core import hadamard as _hadamard
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.implementation import Implementation, resolve
from lowbit.gemm.operand import (
    apply_static_amax,
    barrier,
    clip_to_rms,
    fold_key,
    gemm_signs,
    hadamard_along,
    prepare_operand,
)
from lowbit.gemm.recipes import GemmSpec, QuantSpec, Recipe

__all__ = ["ragged_dot", "row_multiple", "ungroupable", "MIN_ROWS"]

# fold_in tags, as lowbit.dot_general uses them: one stream per (GEMM, operand).
_FWD, _DLHS, _DRHS = 0, 1, 2

MIN_ROWS = 128
"""The least number of rows per chunk of the emulation's grouped GEMM (a ``lax.scan`` step):
fewer, smaller GEMMs cost more per row on CPU (measured: 128-row chunks of a 4096 x 128 x 512
grouped GEMM ran 3.0x the dense GEMM's time, 256-row chunks 2.0x)."""


# --------------------------------------------------------------------------------------------
# What a recipe needs of the row layout


def row_multiple(recipe: Recipe) -> int:
    """Rows per tile of the emulation (:data:`MIN_ROWS` or more): a multiple of every block,
    2-D tile, Hadamard block and TetraJet-v2 outer block that runs along the tokens in any of
    the recipe's GEMMs, so a tile never splits one; every group starts at a multiple of it."""
    m = MIN_ROWS
    for g in (recipe.fwd, recipe.dlhs, recipe.drhs):
        m = max(m, g.hadamard or 1)
        for spec in (g.lhs, g.rhs):
            if spec is None or spec.granularity != "block":
                continue
            m = max(m, *(spec.block_shape or (_formats.get(spec.format).block_size,)))
            m = max(m, spec.tensor_block or 1)
    return int(m)


def _stat(spec: QuantSpec | None, along_rows: bool) -> str | None:
    """How a row-side operand's tensor-wide quantity is taken per group: None (it has none),
    ``"amax"`` (a tensor amax, given to each tile), ``"masked"`` (quantize each group as one
    tensor with the other groups' rows zeroed)."""
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
    for name, gemm in (("fwd", r.fwd), ("dlhs", r.dlhs), ("drhs", r.drhs)):
        # row-side operands: fwd's and dlhs' lhs (x, dy), both of drhs (x, dy along rows)
        sides = (("lhs", gemm.lhs), ("rhs", gemm.rhs)) if name == "drhs" else (
            ("lhs", gemm.lhs),)
        for side, spec in sides:
            if spec is None:
                continue
            if spec.granularity == "block" and _formats.get(spec.format).is_absmean:
                return (f"recipe {r.name!r}: its {name} {side} spec ({spec.format}) scales by "
                        "a mean over the whole tensor, which a group's tiles cannot give")
            if name == "drhs" and spec.clip_rms is not None:
                return (f"recipe {r.name!r}: its {name} {side} spec clips to an RMS over a "
                        "group's rows, which the group's tiles cannot give")
    return None


# --------------------------------------------------------------------------------------------
# The row layout


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Static facts of one call: sizes, recipe, dtypes, implementation."""

    m: int
    k: int
    n: int
    groups: int
    rows: int  # P: rows per tile and chunk
    recipe: Recipe
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    impl: Implementation

    @property
    def chunks(self) -> int:
        """Chunks of the padded layout: enough for any group sizes summing to at most M."""
        return -(-self.m // self.rows) + self.groups

    @property
    def padded(self) -> int:
        return self.chunks * self.rows


class _Layout:
    """Where each row goes: ``chunk_group [C]`` (G for an empty chunk), ``chunk_index [C]``
    (its index within its group), ``row_group [C*P]`` (G for padding), ``src [C*P]`` (the
    lhs row of each padded row, M for padding), ``dst [M]`` (the padded row of each lhs row,
    C*P for rows past the groups)."""

    def __init__(self, sizes, st: _Shape):
        p, g = st.rows, st.groups
        n = jnp.maximum(sizes.astype(jnp.int32), 0)
        ends = jnp.cumsum(n)
        starts = ends - n
        pn = -(-n // p) * p
        pends = jnp.cumsum(pn)
        pstarts = pends - pn
        r = jnp.arange(st.padded, dtype=jnp.int32)
        grp = jnp.searchsorted(pends, r, side="right").astype(jnp.int32)  # G past the end
        gc = jnp.minimum(grp, g - 1)
        off = r - pstarts[gc]
        valid = (grp < g) & (off < n[gc])
        self.row_group = jnp.where(valid, grp, g)
        self.src = jnp.where(valid, starts[gc] + off, st.m)
        c0 = jnp.arange(st.chunks, dtype=jnp.int32) * p
        self.chunk_group = jnp.searchsorted(pends, c0, side="right").astype(jnp.int32)
        # a chunk's index within its group: its rounding stream depends on nothing else
        self.chunk_index = ((c0 - pstarts[jnp.minimum(self.chunk_group, g - 1)]) // p
                            ).astype(jnp.uint32)
        i = jnp.arange(st.m, dtype=jnp.int32)
        gi = jnp.minimum(jnp.searchsorted(ends, i, side="right").astype(jnp.int32), g - 1)
        self.dst = jnp.where(i < ends[-1], pstarts[gi] + i - starts[gi], st.padded)

    def spread(self, x):
        """``[M, D] -> [C*P, D]`` in the padded layout (zero rows between groups)."""
        x = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
        return x[self.src]

    def gather(self, y):
        """``[C*P, D] -> [M, D]``: each lhs row's result, zeros past the groups."""
        y = jnp.concatenate([y, jnp.zeros((1, y.shape[1]), y.dtype)])
        return y[self.dst]


# --------------------------------------------------------------------------------------------
# Per-group keys, signs and quantization


def _group_keys(key, groups: int):
    """uint32[G, 2]: ``fold_in(key, g)`` per group (None without a key)."""
    if key is None:
        return None
    return jax.vmap(lambda g: fold_key(key, g))(jnp.arange(groups, dtype=jnp.uint32))


def _signs(gemm: GemmSpec, gkeys, tag: int, groups: int):
    """Per-group Hadamard signs ``[G, h]`` of one GEMM (None: none or fixed)."""
    if not gemm.hadamard or not gemm.random_signs:
        return None
    if gkeys is None:
        return jnp.broadcast_to(gemm_signs(gemm, None, tag), (groups, gemm.hadamard))
    return jax.vmap(lambda k: gemm_signs(gemm, k, tag))(gkeys)


def _chunk_keys(gkeys, tags, lay: _Layout, st: _Shape):
    """Per-chunk rounding keys: the group's key folded with ``tags`` and the chunk's index
    within its group (so a group's bits depend on its own rows alone)."""
    if gkeys is None:
        return None
    g = jnp.minimum(lay.chunk_group, st.groups - 1)
    return jax.vmap(lambda k, i: fold_key(k, *tags, i))(gkeys[g], lay.chunk_index)


def _per_chunk(a, lay: _Layout, st: _Shape):
    """A per-group array ``[G, ...]`` (or None) indexed per chunk."""
    if a is None:
        return None
    return a[jnp.minimum(lay.chunk_group, st.groups - 1)]


def _quantize_rows(x, spec, gemm: GemmSpec, along_rows: bool, tags, gkeys, signs, lay, st,
                   *, with_mask=False, transform=True):
    """One row-side operand ``x [C*P, D]`` of ``gemm``, quantized per group: along its
    features (``along_rows`` False: the forward's x, dlhs' dy) or along the rows (the weight
    gradient's x and dy). ``signs [G, h]`` (or None); ``transform``: apply ``gemm``'s
    Hadamard (False: ``x`` is in its basis already). Returns values (and the trust mask or
    None with ``with_mask``), ``[C*P, D]``."""
    p, d = st.rows, x.shape[1]
    axis, other = (0, 1) if along_rows else (1, 0)
    h = gemm.hadamard if transform else None
    g1 = dataclasses.replace(gemm, hadamard=h)
    kind = _stat(spec, along_rows)
    native = st.impl.cpu_kernel
    xc = x.reshape(st.chunks, p, d)
    ck = _chunk_keys(gkeys, tags, lay, st)
    cs = _per_chunk(signs, lay, st)
    if kind == "masked":
        return _quantize_masked(x, spec, g1, axis, other, tags, gkeys, signs, lay, st,
                                with_mask=with_mask)

    def one(xt, k, s, amax):
        return prepare_operand(xt, spec, g1, axis, other, k, s, use_barrier=False,
                               native=native, with_mask=with_mask, tensor_amax=amax)

    amax = None
    if kind == "amax":
        if h:  # transform here, so the group's amax is the rotated tensor's
            xc = jax.vmap(lambda xt, s: hadamard_along(xt, axis, h, s),
                          in_axes=(0, None if cs is None else 0))(xc, cs)
            g1 = dataclasses.replace(gemm, hadamard=None)
        xs = jax.vmap(lambda xt: apply_static_amax(clip_to_rms(xt, spec, axis), spec)[0])(xc)
        finite = jnp.where(jnp.isfinite(xs), jnp.abs(xs), 0.0)
        chunk_amax = jnp.max(finite, axis=(1, 2))
        gmax = jax.ops.segment_max(chunk_amax, lay.chunk_group, st.groups + 1)
        amax = jnp.maximum(gmax, 0.0)[lay.chunk_group]
    out = jax.vmap(one, in_axes=(0, None if ck is None else 0,
                                 None if cs is None or not g1.hadamard else 0,
                                 None if amax is None else 0))(
        xc, ck, cs if g1.hadamard else None, amax)
    if with_mask:
        v, m = out
        return v.reshape(x.shape), (None if m is None else m.reshape(x.shape))
    return out.reshape(x.shape)


def _quantize_masked(x, spec, gemm, axis, other, tags, gkeys, signs, lay, st, *, with_mask):
    """Each group quantized as one tensor (the whole padded layout with the other groups'
    rows zeroed: a zero changes no maximum), G passes; each row keeps its own group's."""
    native = st.impl.cpu_kernel

    def body(g, acc):
        k = None if gkeys is None else fold_key(gkeys[g], *tags)
        s = None if signs is None else signs[g]
        mine = (lay.row_group == g)[:, None]
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


def _quantize_weights(w, spec, gemm: GemmSpec, axis, other, tags, gkeys, signs, st,
                      *, with_mask=False):
    """The weight stack ``[G, K, N]`` (or its gradient-side view), each group's weight as
    :func:`lowbit.dot_general` quantizes a weight (vmapped over groups)."""
    native = st.impl.cpu_kernel

    def one(wg, k, s):
        kk = None if k is None else fold_key(k, *tags)
        return prepare_operand(wg, spec, gemm, axis, other, kk, s, use_barrier=False,
                               native=native, with_mask=with_mask)

    return jax.vmap(one, in_axes=(0, None if gkeys is None else 0,
                                  None if signs is None else 0))(w, gkeys, signs)


def _unrotate_rows(x, gemm: GemmSpec, signs, lay, st):
    """Undo ``gemm``'s Hadamard along the features of a row-side operand (per group)."""
    if not gemm.hadamard:
        return x
    cs = _per_chunk(signs, lay, st)
    xc = x.reshape(st.chunks, st.rows, x.shape[1])
    f = lambda xt, s: _hadamard.hadamard_transform(  # noqa: E731
        xt, gemm.hadamard, signs=s, inverse=True, axis=1)
    return jax.vmap(f, in_axes=(0, None if cs is None else 0))(xc, cs).reshape(x.shape)


def _unrotate_weights(w, gemm: GemmSpec, signs, axis):
    if not gemm.hadamard:
        return w
    f = lambda wg, s: _hadamard.hadamard_transform(  # noqa: E731
        wg, gemm.hadamard, signs=s, inverse=True, axis=axis)
    return jax.vmap(f, in_axes=(0, None if signs is None else 0))(w, signs)


def _through(g, mask, gemm: GemmSpec, signs, axis, rotated: bool, vmapped):
    """The gradient of a forward operand carried back through the forward's quantizer (trust
    mask, Hadamard basis), as :func:`lowbit.dot_general` does, per group."""
    if mask is None and not rotated:
        return g
    h = gemm.hadamard

    def one(gx, m, s):
        if h and not rotated:
            gx = _hadamard.hadamard_transform(gx, h, signs=s, axis=axis)
        if m is not None:
            gx = jnp.where(m, gx, np.float32(0))
        if h:
            gx = _hadamard.hadamard_transform(gx, h, signs=s, axis=axis, inverse=True)
        return gx

    return vmapped(one, g, mask, signs)


# --------------------------------------------------------------------------------------------
# The grouped GEMMs (float32 values)


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _grouped_mm(a, b, lay: _Layout, st: _Shape, *, transpose_b: bool = False):
    """``[C*P, K] x [G, K, N] -> [C*P, N]``, each chunk against its group's matrix (``b``
    transposed per group with ``transpose_b``); empty chunks give zeros."""
    nout = b.shape[1] if transpose_b else b.shape[2]
    ac = a.reshape(st.chunks, st.rows, a.shape[1])

    def step(_, xs):
        at, g = xs

        def live():
            bg = lax.dynamic_index_in_dim(b, jnp.minimum(g, st.groups - 1), 0, keepdims=False)
            return _dot(at, bg.T if transpose_b else bg)

        return None, lax.cond(g < st.groups, live,
                              lambda: jnp.zeros((st.rows, nout), jnp.float32))

    _, y = lax.scan(step, None, (ac, lay.chunk_group))
    return y.reshape(st.padded, nout)


def _grouped_wgrad(a, d, lay: _Layout, st: _Shape):
    """``sum over each group's rows of a^T d``: ``[C*P, K], [C*P, N] -> [G, K, N]`` (zero
    for an empty group)."""
    ac = a.reshape(st.chunks, st.rows, a.shape[1])
    dc = d.reshape(st.chunks, st.rows, d.shape[1])

    def step(acc, xs):
        at, dt, g = xs

        def live(acc):
            gi = jnp.minimum(g, st.groups - 1)
            cur = lax.dynamic_index_in_dim(acc, gi, 0, keepdims=False)
            return lax.dynamic_update_index_in_dim(acc, cur + _dot(at.T, dt), gi, 0)

        return lax.cond(g < st.groups, live, lambda acc: acc, acc), None

    init = jnp.zeros((st.groups, a.shape[1], d.shape[1]), jnp.float32)
    acc, _ = lax.scan(step, init, (ac, dc, lay.chunk_group))
    return acc


# --------------------------------------------------------------------------------------------
# The custom VJP


def _forward(x, w, gkeys, lay, st: _Shape, masks: bool):
    """The forward GEMM's operands per group, in its Hadamard basis: ``(xq, wq, signs, mx,
    mw)`` (masks None unless asked for and the specs have them)."""
    f = st.recipe.fwd
    signs = _signs(f, gkeys, _FWD, st.groups)
    xq = _quantize_rows(x, f.lhs, f, False, (_FWD, 0), gkeys, signs, lay, st, with_mask=masks)
    wq = _quantize_weights(w, f.rhs, f, 0, 1, (_FWD, 1), gkeys, signs, st, with_mask=masks)
    if masks:
        (xq, mx), (wq, mw) = xq, wq
        return xq, wq, signs, mx, mw
    return xq, wq, signs, None, None


def _check_sizes(sizes, m):
    """True where the sizes are valid (a traced check: invalid sizes poison the result)."""
    return jnp.all(sizes >= 0) & (jnp.sum(sizes) <= m)


def _poison(y, ok):
    return jnp.where(ok, y, np.float32(np.nan))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rdot(lhs, rhs, sizes, key, st: _Shape):
    return _rdot_fwd(lhs, rhs, sizes, key, st)[0]


def _rdot_fwd(lhs, rhs, sizes, key, st: _Shape):
    lay = _Layout(sizes, st)
    gkeys = _group_keys(key, st.groups)
    x = lay.spread(barrier(lhs.astype(jnp.float32)))
    w = barrier(rhs.astype(jnp.float32))
    xq, wq, _, _, _ = _forward(x, w, gkeys, lay, st, masks=False)
    y = lay.gather(_grouped_mm(xq, wq, lay, st))
    y = _poison(y, _check_sizes(sizes, st.m))
    return y.astype(st.out_dtype), (lhs, rhs, sizes, key)


def _rdot_bwd(st: _Shape, res, dy):
    lhs, rhs, sizes, key = res
    r = st.recipe
    dl, dr, f = r.dlhs, r.drhs, r.fwd
    lay = _Layout(sizes, st)
    gkeys = _group_keys(key, st.groups)
    x = lay.spread(lhs.astype(jnp.float32))
    w = rhs.astype(jnp.float32)
    g = lay.spread(barrier(dy.astype(jnp.float32)))
    rotated = r.backward_operands == "forward"
    xq, wq, fsigns, mx, mw = _forward(x, w, gkeys, lay, st, masks=r.through_forward)
    s_dl = _signs(dl, gkeys, _DLHS, st.groups)
    s_dr = _signs(dr, gkeys, _DRHS, st.groups)
    # dlhs = dy . w^T per group: dy along N, the weight along N (its axis 1 of [K, N]).
    if rotated:
        w_dl = _quantize_weights(wq, dl.rhs, dl, 1, 0, (_DLHS, 1), gkeys, s_dl, st)
        x_dr = _quantize_rows(xq, dr.lhs, dr, True, (_DRHS, 0), gkeys, s_dr, lay, st)
    else:
        w_src = w if dl.rhs is not None else _unrotate_weights(wq, f, fsigns, 0)
        w_dl = _quantize_weights(w_src, dl.rhs, dl, 1, 0, (_DLHS, 1), gkeys, s_dl, st)
        x_src = x if dr.lhs is not None else _unrotate_rows(xq, f, fsigns, lay, st)
        x_dr = _quantize_rows(x_src, dr.lhs, dr, True, (_DRHS, 0), gkeys, s_dr, lay, st)
    g_dl = _quantize_rows(g, dl.lhs, dl, False, (_DLHS, 0), gkeys, s_dl, lay, st)
    g_dr = _quantize_rows(g, dr.rhs, dr, True, (_DRHS, 1), gkeys, s_dr, lay, st)
    dx = _grouped_mm(g_dl, w_dl, lay, st, transpose_b=True)
    dw = _grouped_wgrad(x_dr, g_dr, lay, st)
    if r.through_forward:
        def rows(fn, gx, m, s):
            cs = _per_chunk(s, lay, st)
            shp = (st.chunks, st.rows, gx.shape[1])
            out = jax.vmap(fn, in_axes=(0, None if m is None else 0, None if cs is None else 0))(
                gx.reshape(shp), None if m is None else m.reshape(shp), cs)
            return out.reshape(gx.shape)

        def stack(fn, gw, m, s):
            return jax.vmap(fn, in_axes=(0, None if m is None else 0,
                                         None if s is None else 0))(gw, m, s)

        dx = _through(dx, mx, f, fsigns, 1, rotated, rows)
        dw = _through(dw, mw, f, fsigns, 0, rotated, stack)
    ok = _check_sizes(sizes, st.m)
    dlhs = _poison(lay.gather(dx), ok).astype(st.lhs_dtype)
    return dlhs, _poison(dw, ok).astype(st.rhs_dtype), None, None


_rdot.defvjp(_rdot_fwd, _rdot_bwd)


# --------------------------------------------------------------------------------------------
# The public op


def _key_data(key, r: Recipe):
    if key is None:
        if r.fwd.stochastic:
            raise ValueError(f"recipe {r.name!r} rounds stochastically in the forward: pass "
                             "key= (a new key per step)")
        return None
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise TypeError(f"key must be a jax.random.key(...) or a uint32[2] PRNGKey, got "
                        f"{key.dtype}{key.shape}")
    return key


def _check(lhs, rhs, group_sizes):
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"ragged_dot: {name} must be floating point, got {a.dtype}")
    if lhs.ndim != 2:
        raise ValueError(f"ragged_dot: lhs must be [M, K] (rows sorted by group), got shape "
                         f"{lhs.shape}")
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"ragged_dot: rhs must be [G, K, N] with K = lhs.shape[1] = "
                         f"{lhs.shape[1]}, got shape {rhs.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"ragged_dot: group_sizes must be a 1-D integer array [G], got "
                         f"{group_sizes.dtype}{group_sizes.shape}")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"ragged_dot: group_sizes has {group_sizes.shape[0]} groups but rhs "
                         f"{rhs.shape} has {rhs.shape[0]} (its leading axis is the group)")
    if rhs.shape[0] == 0:
        raise ValueError("ragged_dot: rhs has no groups (G = 0)")
    if not isinstance(group_sizes, jax.core.Tracer):
        gs = np.asarray(group_sizes)
        if (gs < 0).any():
            raise ValueError(f"ragged_dot: group_sizes must be >= 0, got {gs.tolist()}")
        if int(gs.sum()) > lhs.shape[0]:
            raise ValueError(f"ragged_dot: group_sizes sum to {int(gs.sum())}, more than lhs's "
                             f"{lhs.shape[0]} rows")


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: str | Recipe | None = "none",
    key: jax.Array | None = None,
    implementation: str | None = None,
    preferred_element_type=None,
    precision=None,
) -> jax.Array:
    """``jax.lax.ragged_dot`` whose forward and backward GEMMs are quantized per ``recipe``,
    each group as its own tensor.

    Args:
      lhs: ``[M, K]``, the rows of group 0, then group 1, ...; rows past
        ``sum(group_sizes)`` give zero outputs and zero gradients.
      rhs: ``[G, K, N]``, one weight per group.
      group_sizes: int ``[G]``, each >= 0, summing to at most M. Checked when concrete; under
        ``jit`` invalid sizes make the outputs (and gradients) NaN.
      recipe: a name from ``lb.recipes.names()`` or a Recipe. Group ``g``'s rows, outputs and
        gradients are those of ``lb.dot_general(lhs[rows of g], rhs[g], recipe=recipe,
        key=fold_in(key, g))``, with the group's rows zero-padded to a multiple of the
        recipe's blocks along the tokens (bit for bit where the recipe is deterministic and
        the float32 sums are exact; otherwise up to float32 summation order, and stochastic
        rounding draws other, identically distributed, bits).
      key: PRNG key (stochastic rounding, random Hadamard signs); a new one per step.
      implementation: ``None``, ``"xla"`` or ``"pallas"`` (:mod:`lowbit.gemm.implementation`).
        The grouped Pallas kernel is not built yet: ``"pallas"`` runs the emulation, with a
        warning when asked for by name.
      preferred_element_type: output dtype (default: the operands' result type).
      precision: accepted for compatibility with ``jax.lax.ragged_dot``; the GEMMs
        accumulate in float32.

    >>> import jax.numpy as jnp, lowbit as lb
    >>> y = lb.ragged_dot(jnp.ones((4, 16)), jnp.ones((3, 16, 2)), jnp.array([1, 0, 3]),
    ...                   recipe="nvfp4")
    >>> y.tolist()
    [[16.0, 16.0], [16.0, 16.0], [16.0, 16.0], [16.0, 16.0]]
    """
    del precision
    r = _recipes.get(recipe)
    impl = resolve(implementation)
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    _check(lhs, rhs, group_sizes)
    if (why := ungroupable(r)) is not None:
        raise ValueError(f"ragged_dot: {why}")
    if impl.gemm == "pallas" and impl.warns:
        warnings.warn("lowbit.ragged_dot: the grouped Pallas kernel is not built yet; the XLA "
                      "emulation runs instead", stacklevel=2)
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs.dtype, rhs.dtype))
    key = _key_data(key, r)
    st = _Shape(lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0], row_multiple(r), r,
                out_dtype, lhs.dtype, rhs.dtype, impl)
    return _rdot(lhs, rhs, group_sizes.astype(jnp.int32), key, st)
