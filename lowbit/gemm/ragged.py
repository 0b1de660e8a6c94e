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

The emulation (the reference). Operands quantized along their features (the forward's x,
the input gradient's dy) stay in the caller's row order and are quantized row by row
(vmapped), each row with its group's tensor amax where the format has a tensor scale, its
group's Hadamard signs and rounding stream. Operands quantized along the tokens (the weight
gradient's x and dy, and a 2-D tile spanning the tokens) are laid out group by group, each
group starting at a multiple of ``q`` rows (:func:`row_multiple`: the recipe's longest block
or transform along the tokens) with zero rows between, and quantized ``q`` rows at a time.
MS-EDEN, whose tensor scale is a maximum of corrected block scales, quantizes each group as
one masked tensor (G passes). The dequantized operands are multiplied in float32 by a
``lax.scan`` over chunks of :data:`CHUNK_ROWS` rows, each chunk against the weights of the
groups it holds. Memory grows with ``M + G * q`` rows, never with ``G * M``
(``jax.lax.ragged_dot`` on CPU expands the rows per group).

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

from lowbit.core import formats as _formats
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.grouped import (
    CHUNK_ROWS,
    DLHS,
    DRHS,
    FWD,
    Layout,
    Shape,
    features,
    group_keys,
    group_signs,
    grouped_mm,
    grouped_wgrad,
    per_row_masked,
    poison,
    quantize_weights,
    row_multiple,
    through_fn,
    tokens,
    ungroupable,
    unrotate_rows,
    unrotate_weights,
    vmap_axis,
)
from lowbit.gemm.implementation import kernel, resolve
from lowbit.gemm.operand import barrier
from lowbit.gemm.recipes import GemmSpec, Recipe

__all__ = ["ragged_dot", "ragged_operands", "row_multiple", "ungroupable", "CHUNK_ROWS"]

# --------------------------------------------------------------------------------------------
# The custom VJP


def _forward(x, w, gkeys, lay, st: Shape, masks: bool):
    """The forward GEMM's operands per group, in its Hadamard basis: ``(xq, wq, signs, mx,
    mw)`` (masks None unless asked for and the specs have them)."""
    f = st.recipe.fwd
    signs = group_signs(f, gkeys, FWD, st.groups)
    xq = features(x, f.lhs, f, (FWD, 0), gkeys, signs, lay, st, with_mask=masks)
    wq = quantize_weights(w, f.rhs, f, 0, 1, (FWD, 1), gkeys, signs, st, with_mask=masks)
    if masks:
        (xq, mx), (wq, mw) = xq, wq
        return xq, wq, signs, mx, mw
    return xq, wq, signs, None, None


# --------------------------------------------------------------------------------------------
# The grouped kernel (implementation="pallas")

KERNEL_ROWS = 64
"""Rows per tile of the grouped kernel's token layout (at least; the recipe's ``q`` if larger):
each tile is one kernel program's row block, all of one group."""


def _kernel_reason(gemm: GemmSpec, st: Shape) -> str | None:
    """Why the grouped kernel cannot run this GEMM (None: it can)."""
    if st.recipe.through_forward:
        return (f"recipe {st.recipe.name!r} carries gradients back through the forward's "
                "quantizers (trust masks, backward_operands='forward')")
    if gemm.lhs is None and gemm.rhs is None:
        return "neither operand is quantized"
    for spec in (gemm.lhs, gemm.rhs):
        if spec is None:
            continue
        fmt = _formats.get(spec.format) if spec.granularity == "block" else None
        if fmt is None or not (fmt.is_mx or fmt.is_nvfp4):
            return f"{spec.format} ({spec.granularity}): the kernel decodes MX and NVFP4 blocks"
        b = spec.block_shape or (fmt.block_size,)
        if len(b) != 1 or b[0] < 16 or b[0] & (b[0] - 1):
            return (f"{spec.format} with block_shape {spec.block_shape}: the kernel takes 1-D "
                    "blocks of a power of two >= 16 along K")
        if spec.tensor_block or spec.rounding == "eden" or spec.scale_std is not None \
                or spec.pow2_tensor_scale:
            return (f"{spec.format}: outer block scales, MS-EDEN, a QuEST scale or a "
                    "power-of-two tensor scale")
    return None


def _kernel_gemm(a_rows, b_stack, gemm: GemmSpec, tag: int, gkeys, signs, sizes, st: Shape):
    """``a_rows [M, K] . b_stack[g] [K, N]`` per group through the grouped kernel: the rows
    spread into the kernel's tile layout and quantized a tile at a time (each tile one tensor
    with its group's amax, signs and a rounding stream per tile), each weight quantized along
    K as its own tensor, both packed."""
    stk = dataclasses.replace(st, q=max(st.q, KERNEL_ROWS))
    lay = Layout(sizes, stk)
    a = tokens(lay.spread(a_rows), gemm.lhs, gemm, 1, (tag, 0), gkeys, signs, lay, stk,
               packed=True)
    b = quantize_weights(b_stack, gemm.rhs, gemm, 0, 1, (tag, 1), gkeys, signs, stk,
                         packed=True)
    y = kernel("pallas_grouped")(a, b, lay.tile_group, interpret=st.impl.interpret)
    return lay.gather(y.reshape(stk.padded, -1))


def _gemm(a_rows, b_stack, gemm: GemmSpec, tag: int, gkeys, signs, sizes, st: Shape,
          emulated, ok=True, *, b_transposed: bool = False):
    """One of the forward / input-gradient GEMMs: ``emulated(a_rows, b_stack)`` (which
    poisons its rows where ``ok`` is False itself), or with ``implementation="pallas"`` the
    grouped kernel where it can take the GEMM (lowered for CUDA; the emulation on other
    platforms, or everywhere in interpret mode the kernel). ``b_transposed``: the kernel
    takes ``b_stack`` ``[G, K, N]`` transposed, ``[G, N, K]`` quantized along N (the input
    gradient's weight; the emulation quantizes it in place, along its axis 1)."""
    if st.impl.gemm != "pallas":
        return emulated(a_rows, b_stack)
    why = _kernel_reason(gemm, st)
    if why is not None:
        if st.impl.warns and gemm.active:
            warnings.warn(f"lowbit.ragged_dot: the XLA emulation instead of the grouped "
                          f"kernel: {why}", stacklevel=4)
        return emulated(a_rows, b_stack)

    def pallas(a, b):
        b = jnp.swapaxes(b, 1, 2) if b_transposed else b
        return poison(_kernel_gemm(a, b, gemm, tag, gkeys, signs, sizes, st), ok)

    if st.impl.interpret:
        return pallas(a_rows, b_stack)
    return jax.lax.platform_dependent(a_rows, b_stack, cuda=pallas, default=emulated)


def _check_sizes(sizes, m):
    """True where the sizes are valid (a traced check: invalid sizes poison the result)."""
    return jnp.all(sizes >= 0) & (jnp.sum(sizes) <= m)




@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rdot(lhs, rhs, sizes, key, st: Shape):
    return _rdot_fwd(lhs, rhs, sizes, key, st)[0]


def _rdot_fwd(lhs, rhs, sizes, key, st: Shape):
    lay = Layout(sizes, st)
    gkeys = group_keys(key, st.groups)
    x = barrier(lhs.astype(jnp.float32))
    w = barrier(rhs.astype(jnp.float32))
    ok = _check_sizes(sizes, st.m)

    def emulated(x, w):
        xq, wq, _, _, _ = _forward(x, w, gkeys, lay, st, masks=False)
        return grouped_mm(xq, wq, lay.row_group, st, ok=ok)

    f = st.recipe.fwd
    signs = group_signs(f, gkeys, FWD, st.groups)
    y = _gemm(x, w, f, FWD, gkeys, signs, sizes, st, emulated, ok)
    return y.astype(st.out_dtype), (lhs, rhs, sizes, key)


def _rdot_bwd(st: Shape, res, dy):
    lhs, rhs, sizes, key = res
    r = st.recipe
    dl, dr, f = r.dlhs, r.drhs, r.fwd
    lay = Layout(sizes, st)
    gkeys = group_keys(key, st.groups)
    x = lhs.astype(jnp.float32)
    w = rhs.astype(jnp.float32)
    g = barrier(dy.astype(jnp.float32))
    rotated = r.backward_operands == "forward"
    xq, wq, fsigns, mx, mw = _forward(x, w, gkeys, lay, st, masks=r.through_forward)
    s_dl = group_signs(dl, gkeys, DLHS, st.groups)
    s_dr = group_signs(dr, gkeys, DRHS, st.groups)
    # dlhs = dy . w^T per group: dy along N, the weight along N (axis 1 of its [K, N]);
    # drhs = x^T . dy per group: both along the group's tokens, in the token layout.
    if rotated:  # the forward's quantized operands, in its basis, quantized again
        w_src, x_src = wq, xq
    else:
        w_src = w if dl.rhs is not None else unrotate_weights(wq, f, fsigns, 0)
        x_src = x if dr.lhs is not None else unrotate_rows(xq, f, fsigns, lay, st)
    if dr.active:
        x_dr = tokens(lay.spread(x_src), dr.lhs, dr, 0, (DRHS, 0), gkeys, s_dr, lay, st)
        g_dr = tokens(lay.spread(g), dr.rhs, dr, 0, (DRHS, 1), gkeys, s_dr, lay, st)
        dw = grouped_wgrad(x_dr, g_dr, lay.pad_group, st)
    else:  # nothing to quantize or transform along the tokens: the caller's rows serve
        dw = grouped_wgrad(x_src, g, lay.row_group, st)
    ok = _check_sizes(sizes, st.m)

    def emulated(g, w_kn):
        g_dl = features(g, dl.lhs, dl, (DLHS, 0), gkeys, s_dl, lay, st)
        w_dl = quantize_weights(w_kn, dl.rhs, dl, 1, 0, (DLHS, 1), gkeys, s_dl, st)
        return grouped_mm(g_dl, w_dl, lay.row_group, st, transpose_b=True,
                          ok=ok if not r.through_forward else True)

    # the weight [G, K, N] quantized along N (its contraction; 2-D tiles spanning N x K); the
    # kernel takes it as [G, N, K] quantized along its axis 0: the same blocks
    dx = _gemm(g, w_src, dl, DLHS, gkeys, s_dl, sizes, st, emulated,
               ok if not r.through_forward else True, b_transposed=True)
    if r.through_forward:
        if mx is not None or rotated:
            dx = per_row_masked(through_fn(f, 0, rotated), dx, mx, fsigns, lay, st)
        if mw is not None or rotated:
            axes = (0, vmap_axis(mw), vmap_axis(fsigns))
            dw = jax.vmap(through_fn(f, 0, rotated), in_axes=axes)(dw, mw, fsigns)
    if r.through_forward:
        dx = poison(dx, ok)
    return dx.astype(st.lhs_dtype), poison(dw, ok).astype(st.rhs_dtype), None, None




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


def _setup(lhs, rhs, group_sizes, recipe, key, implementation, preferred_element_type=None):
    r = _recipes.get(recipe)
    impl = resolve(implementation)
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    _check(lhs, rhs, group_sizes)
    if (why := ungroupable(r)) is not None:
        raise ValueError(f"ragged_dot: {why}")
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs.dtype, rhs.dtype))
    key = _key_data(key, r)
    st = Shape(lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0], row_multiple(r), r,
                out_dtype, lhs.dtype, rhs.dtype, impl)
    return lhs, rhs, group_sizes.astype(jnp.int32), key, st


def ragged_operands(lhs, rhs, group_sizes, *, recipe="none", key=None, implementation=None):
    """The two operands as :func:`ragged_dot`'s forward multiplies them, in the original basis
    (a forward Hadamard undone): ``(xq [M, K], wq [G, K, N])``, float32, so that
    ``ragged_dot(xq, wq, group_sizes)`` equals the quantized forward up to float32 summation
    order. Values only (no gradient rule): what sensitivity analysis (:mod:`lowbit.autoquant`)
    needs of a grouped site, as :func:`lowbit.gemm.dot_general.forward_operands` of a dense
    one.

    >>> import jax.numpy as jnp
    >>> xq, wq = ragged_operands(jnp.full((3, 32), 0.3), jnp.ones((2, 32, 4)),
    ...                          jnp.array([1, 2]), recipe="mxfp4")
    >>> float(xq[0, 0]), wq.shape
    (0.25, (2, 32, 4))
    """
    lhs, rhs, sizes, key, st = _setup(lhs, rhs, group_sizes, recipe, key, implementation)
    lay = Layout(sizes, st)
    gkeys = group_keys(key, st.groups)
    f = st.recipe.fwd
    xq, wq, signs, _, _ = _forward(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gkeys,
                                   lay, st, masks=False)
    return unrotate_rows(xq, f, signs, lay, st), unrotate_weights(wq, f, signs, 0)


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
        ``"pallas"``: the forward and input-gradient GEMMs go through the grouped Pallas kernel
        (``pallas_kernels.grouped_matmul``; lowered for CUDA, the emulation elsewhere) where it
        takes them: MX / NVFP4 operands with 1-D blocks, recipes that do not carry gradients
        back through the forward's quantizers; elsewhere the emulation, with a warning when
        asked for by name. The weight gradient (a contraction over each group's rows) runs the
        emulation. Stochastic rounding draws its bits per kernel tile (identically
        distributed).
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
    lhs, rhs, sizes, key, st = _setup(lhs, rhs, group_sizes, recipe, key, implementation,
                                      preferred_element_type)
    return _rdot(lhs, rhs, sizes, key, st)
