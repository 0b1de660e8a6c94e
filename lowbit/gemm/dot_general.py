"""Quantized ``dot_general`` with a custom VJP: forward and both backward GEMMs per recipe.

Emulation: every operand is quantized along its GEMM's contraction axis (block-scaled,
dequantized to float32), then multiplied by ``lax.dot_general`` with float32 accumulation:
numerically what a block-scaled GEMM computes. The quantizer's input passes through
``lax.optimization_barrier`` so that XLA does not recompute the producer of an operand (a GELU,
a layer-norm backward) inside each quantizer that reads it.

>>> import jax, jax.numpy as jnp, lowbit as lb
>>> x = jax.random.normal(jax.random.key(0), (8, 64))
>>> w = jax.random.normal(jax.random.key(1), (64, 16))
>>> y = lb.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="mxfp8")
>>> y.shape, float(jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w)) < 0.06
((8, 16), True)
"""

from __future__ import annotations

import dataclasses
import functools
import string
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.core import formats as _formats
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.implementation import Implementation, kernel, resolve
from lowbit.gemm.operand import (
    barrier,
    fold_key,
    gemm_signs,
    prepare_operand,
    through_forward,
    unpack_operand,
    unrotated,
)
from lowbit.gemm.recipes import GemmSpec, Recipe

__all__ = [
    "dot_general",
    "einsum",
    "forward_operands",
    "einsum_operands",
]

# fold_in tags: one stream per (GEMM, operand) for rounding and one per GEMM for signs.
_FWD, _DLHS, _DRHS = 0, 1, 2


# --------------------------------------------------------------------------------------------
# Axis bookkeeping


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Axes of a ``dot_general`` and of its output, by role."""

    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    rhs_free: tuple[int, ...]

    @classmethod
    def of(cls, dn, lhs_ndim: int, rhs_ndim: int) -> _Dims:
        (lc, rc), (lb, rb) = dn
        lc, rc, lb, rb = (tuple(int(a) for a in t) for t in (lc, rc, lb, rb))
        lf = tuple(i for i in range(lhs_ndim) if i not in lc and i not in lb)
        rf = tuple(i for i in range(rhs_ndim) if i not in rc and i not in rb)
        return cls(lc, rc, lb, rb, lf, rf)

    # Output layout of lax.dot_general: batch, lhs free, rhs free.
    @property
    def out_lhs_free(self) -> tuple[int, ...]:
        b = len(self.lhs_batch)
        return tuple(range(b, b + len(self.lhs_free)))

    @property
    def out_rhs_free(self) -> tuple[int, ...]:
        b = len(self.lhs_batch) + len(self.lhs_free)
        return tuple(range(b, b + len(self.rhs_free)))


def _last(t: Sequence[int]) -> int | None:
    return t[-1] if t else None


def _normalize_dn(dn, lhs_ndim, rhs_ndim):
    (lc, rc), (lb, rb) = dn

    def norm(axes, nd, name):
        out = []
        for a in axes:
            a = int(a)
            if not -nd <= a < nd:
                raise ValueError(f"dimension_numbers: {name} axis {a} out of range for rank {nd}")
            out.append(a % nd)
        return tuple(out)

    return (
        (norm(lc, lhs_ndim, "lhs contracting"), norm(rc, rhs_ndim, "rhs contracting")),
        (norm(lb, lhs_ndim, "lhs batch"), norm(rb, rhs_ndim, "rhs batch")),
    )


# --------------------------------------------------------------------------------------------
# The three GEMMs


def _prepare(x, spec, gemm: GemmSpec, axis, other_axis, key, signs, use_barrier: bool,
             packed: bool = False, *, native: bool):
    return prepare_operand(x, spec, gemm, axis, other_axis, key, signs,
                           use_barrier=use_barrier, packed=packed, native=native)


def _fwd_operands(lhs, rhs, dims: _Dims, recipe: Recipe, key, native: bool,
                  masks: bool = False):
    """The forward GEMM's operands (in its Hadamard basis) and signs; with ``masks``, also
    the two operands' trust masks (None where a spec has none)."""
    g = recipe.fwd
    signs = gemm_signs(g, key, _FWD)
    lk, rk = (fold_key(key, _FWD, i) if key is not None else None for i in (0, 1))
    lq = prepare_operand(lhs, g.lhs, g, _last(dims.lhs_contract), _last(dims.lhs_free), lk,
                         signs, native=native, with_mask=masks)
    rq = prepare_operand(rhs, g.rhs, g, _last(dims.rhs_contract), _last(dims.rhs_free), rk,
                         signs, native=native, with_mask=masks)
    if masks:
        (lq, ml), (rq, mr) = lq, rq
        return lq, rq, signs, ml, mr
    return lq, rq, signs


def _dot(a, b, dn):
    return lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _transpose_lhs(dy, rhs_op, dn, lhs_shape):
    f = functools.partial(lambda a, b: _dot(a, b, dn), b=rhs_op)
    return jax.linear_transpose(f, jax.ShapeDtypeStruct(lhs_shape, jnp.float32))(dy)[0]


def _transpose_rhs(dy, lhs_op, dn, rhs_shape):
    f = functools.partial(lambda a, b: _dot(a, b, dn), lhs_op)
    return jax.linear_transpose(f, jax.ShapeDtypeStruct(rhs_shape, jnp.float32))(dy)[0]


@dataclasses.dataclass(frozen=True)
class _Call:
    """What the custom VJP keeps static about one call: dimension numbers, recipe, dtypes,
    shapes and the resolved implementation."""

    dn: tuple
    recipe: Recipe
    out_dtype: np.dtype
    lhs_shape: tuple[int, ...]
    lhs_dtype: np.dtype
    rhs_shape: tuple[int, ...]
    rhs_dtype: np.dtype
    impl: Implementation

    @property
    def native(self) -> bool:
        """Whether the emulation may use the compiled CPU kernel (not for "xla")."""
        return self.impl.cpu_kernel

    @property
    def pallas(self) -> bool:
        """Whether the GEMMs go through the kernel op: asked for, and the call is one the
        kernel takes (:func:`_kernel_constraint`)."""
        return self.impl.gemm == "pallas" and _kernel_constraint(self) is None


def _token_multiple(recipe: Recipe) -> int:
    """The token count that flattening ``x [..., T, K]`` to ``[.. * T, K]`` must keep whole:
    the longest block or transform of any of the recipe's GEMMs that can lie along the token
    axis (the weight gradient's 1-D blocks and Hadamard transform run along it, a 2-D tile
    spans it in every GEMM). With ``T`` a multiple of it, no block holds two sequences' tokens
    and the flattened GEMMs quantize what the emulation quantizes."""
    m = 1
    for g in (recipe.fwd, recipe.dlhs, recipe.drhs):
        m = max(m, g.hadamard or 1)
        for spec in (g.lhs, g.rhs):
            if spec is None or spec.granularity != "block":
                continue
            m = max(m, *(spec.block_shape or (_formats.get(spec.format).block_size,)))
            m = max(m, spec.tensor_block or 1)
    return m


def _kernel_constraint(st: _Call) -> str | None:
    """Why the kernel op cannot take this call (None if it can): it takes a plain
    ``x [..., K] @ w [K, N]`` (or ``w [N, K]``) with no batch dims, whose flattened token axis
    keeps the emulation's blocks (with leading axes, tokens a multiple of
    :func:`_token_multiple`: 32 for MXFP4, 16 for NVFP4, the Hadamard block where a GEMM
    transforms along tokens)."""
    (lc, rc), (lb_, rb) = st.dn
    nl = len(st.lhs_shape)
    if lb_ or rb or lc != (nl - 1,) or len(st.rhs_shape) != 2 or rc not in ((0,), (1,)):
        return (
            f"dimension_numbers {st.dn} on lhs {st.lhs_shape} and rhs {st.rhs_shape}: the "
            "kernels take a plain x [..., K] @ w [K, N] or w [N, K] with no batch dims"
        )
    m = _token_multiple(st.recipe)
    if nl > 2 and st.lhs_shape[-2] % m:
        return (
            f"lhs {st.lhs_shape}: with leading axes the token axis ({st.lhs_shape[-2]}) must "
            f"be a multiple of {m} (recipe {st.recipe.name}'s longest block or transform "
            "along tokens) so that flattening them splits no block"
        )
    return None


def _gemm(a, b, gemm: GemmSpec, key, tag: int, signs, st: _Call):
    """One 2-D GEMM ``a [M, K] @ b [K, N]`` of the recipe through the kernel op."""
    if not gemm.active:  # nothing to quantize or transform: the plain float32 GEMM
        return _dot(a.astype(jnp.float32), b.astype(jnp.float32), (((1,), (0,)), ((), ())))
    return kernel("pallas")(barrier(a.astype(jnp.float32)), barrier(b.astype(jnp.float32)),
                          gemm.lhs, gemm.rhs, fold_key(key, tag, 0), fold_key(key, tag, 1),
                          hadamard=gemm.hadamard or None, signs=signs,
                          implementation=st.impl, interpret=st.impl.interpret)


def _pallas_fwd(lhs, rhs, st: _Call, key):
    g, rc = st.recipe.fwd, st.dn[0][1][0]
    k = lhs.shape[-1]
    y = _gemm(lhs.reshape(-1, k), rhs if rc == 0 else rhs.T, g, key, _FWD,
              gemm_signs(g, key, _FWD), st)
    return y.reshape(*lhs.shape[:-1], y.shape[-1])


def _pallas_bwd(lhs, rhs, dy, st: _Call, key):
    """dlhs = dy . w^T and drhs = x^T . dy as [M, N] x [N, K] and [K, M] x [M, N] GEMMs."""
    recipe, rc = st.recipe, st.dn[0][1][0]
    dl, dr = recipe.dlhs, recipe.drhs
    k, n = lhs.shape[-1], dy.shape[-1]
    lq = rq = fwd_signs = None
    if dl.rhs is None or dr.lhs is None:  # straight-through operands: the forward's values
        dims = _Dims.of(st.dn, lhs.ndim, rhs.ndim)
        lq, rq, fwd_signs = _fwd_operands(lhs, rhs, dims, recipe, key, st.native)
    s_dl, s_dr = gemm_signs(dl, key, _DLHS), gemm_signs(dr, key, _DRHS)
    w = rhs if dl.rhs is not None else unrotated(rq, recipe.fwd, rc, fwd_signs)
    dlhs = _gemm(dy.reshape(-1, n), w.T if rc == 0 else w, dl, key, _DLHS, s_dl, st)
    x = lhs if dr.lhs is not None else unrotated(lq, recipe.fwd, lhs.ndim - 1, fwd_signs)
    drhs = _gemm(x.reshape(-1, k).T, dy.reshape(-1, n), dr, key, _DRHS, s_dr, st)
    return dlhs.reshape(lhs.shape), (drhs if rc == 0 else drhs.T)


def _pallas_bwd_through_forward(lhs, rhs, dy, st: _Call, key):
    """:func:`_pallas_bwd` for a backward through the forward's quantizers: the forward's
    operands and trust masks from the emulation, the two backward GEMMs through the kernels
    (on the forward-quantized operands in its basis when ``backward_operands="forward"``),
    then the masks and the inverse of the forward's transform."""
    recipe, rc = st.recipe, st.dn[0][1][0]
    dims = _Dims.of(st.dn, lhs.ndim, rhs.ndim)
    lq, rq, signs, ml, mr = _fwd_operands(lhs, rhs, dims, recipe, key, st.native, masks=True)
    rotated = recipe.backward_operands == "forward"
    if rotated:
        dl, dr = recipe.dlhs, recipe.drhs
        k, n = lhs.shape[-1], dy.shape[-1]
        dlhs = _gemm(dy.reshape(-1, n), rq.T if rc == 0 else rq, dl, key, _DLHS,
                     gemm_signs(dl, key, _DLHS), st).reshape(lhs.shape)
        drhs = _gemm(lq.reshape(-1, k).T, dy.reshape(-1, n), dr, key, _DRHS,
                     gemm_signs(dr, key, _DRHS), st)
        drhs = drhs if rc == 0 else drhs.T
    else:  # trust masks only: the usual backward, then the masks
        dlhs, drhs = _pallas_bwd(lhs, rhs, dy, st, key)
    f = recipe.fwd
    dlhs = through_forward(dlhs, ml, f, lhs.ndim - 1, signs, rotated=rotated)
    drhs = through_forward(drhs, mr, f, rc, signs, rotated=rotated)
    return dlhs, drhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _qdot(lhs, rhs, key, st: _Call):
    if st.pallas:
        return _pallas_fwd(lhs, rhs, st, key).astype(st.out_dtype)
    dims = _Dims.of(st.dn, lhs.ndim, rhs.ndim)
    lq, rq, _ = _fwd_operands(lhs, rhs, dims, st.recipe, key, st.native)
    return _dot(lq, rq, st.dn).astype(st.out_dtype)


def _qdot_fwd(lhs, rhs, key, st: _Call):
    recipe = st.recipe
    if st.pallas:  # the backward quantizes again from the high-precision operands
        return _pallas_fwd(lhs, rhs, st, key).astype(st.out_dtype), (None, lhs, rhs, key)
    dims = _Dims.of(st.dn, lhs.ndim, rhs.ndim)
    lq, rq, signs = _fwd_operands(lhs, rhs, dims, recipe, key, st.native)
    y = _dot(lq, rq, st.dn).astype(st.out_dtype)
    if recipe.residuals == "quantized":
        # Quantize now what the backward GEMMs need and save it packed.
        w_dl, x_dr, _, _ = _bwd_static_operands(
            lhs, rhs, lq, rq, signs, dims, recipe, key, packed=True, native=st.native
        )
        return y, ((w_dl, x_dr), None, None, key)
    return y, (None, lhs, rhs, key)


def _bwd_static_operands(lhs, rhs, lq, rq, fwd_signs, dims: _Dims, recipe: Recipe, key,
                         packed: bool = False, *, native: bool):
    """The rhs of dgrad and the lhs of wgrad (they do not depend on dy); with ``packed``,
    the quantized ones in packed form (see :func:`quantize_operand`)."""
    dl, dr = recipe.dlhs, recipe.drhs
    s_dl, s_dr = gemm_signs(dl, key, _DLHS), gemm_signs(dr, key, _DRHS)
    r_axis, r_other = _last(dims.rhs_free), _last(dims.rhs_contract)
    l_axis, l_other = _last(dims.lhs_free), _last(dims.lhs_contract)
    if dl.rhs is None:  # straight-through: the forward's operand, original basis
        w = unrotated(rq, recipe.fwd, _last(dims.rhs_contract), fwd_signs)
        w_dl = _prepare(w, None, dl, r_axis, r_other, None, s_dl, False, native=native)
    else:
        w_dl = _prepare(rhs, dl.rhs, dl, r_axis, r_other, fold_key(key, _DLHS, 1), s_dl, True,
                        packed, native=native)
    if dr.lhs is None:
        x = unrotated(lq, recipe.fwd, _last(dims.lhs_contract), fwd_signs)
        x_dr = _prepare(x, None, dr, l_axis, l_other, None, s_dr, False, native=native)
    else:
        x_dr = _prepare(lhs, dr.lhs, dr, l_axis, l_other, fold_key(key, _DRHS, 0), s_dr, True,
                        packed, native=native)
    return w_dl, x_dr, s_dl, s_dr


def _qdot_bwd(st: _Call, res, dy):
    saved, lhs, rhs, key = res
    recipe, dn = st.recipe, st.dn
    if st.pallas:
        bwd = _pallas_bwd_through_forward if recipe.through_forward else _pallas_bwd
        dlhs, drhs = bwd(lhs, rhs, dy, st, key)
        return dlhs.astype(st.lhs_dtype), drhs.astype(st.rhs_dtype), None
    dims = _Dims.of(dn, len(st.lhs_shape), len(st.rhs_shape))
    # backward_operands="forward": the backward GEMMs take the forward's quantized operands in
    # its Hadamard basis (quantized again per their specs); the gradients they give are of
    # those values and return through the forward's quantizers (trust masks, inverse transform)
    rotated = recipe.backward_operands == "forward"
    ml = mr = None
    if saved is None:
        if recipe.through_forward:
            lq, rq, signs, ml, mr = _fwd_operands(lhs, rhs, dims, recipe, key, st.native,
                                                  masks=True)
        else:
            lq, rq, signs = _fwd_operands(lhs, rhs, dims, recipe, key, st.native)
        if rotated:
            dl, dr = recipe.dlhs, recipe.drhs
            s_dl, s_dr = gemm_signs(dl, key, _DLHS), gemm_signs(dr, key, _DRHS)
            w_dl = _prepare(rq, dl.rhs, dl, _last(dims.rhs_free), _last(dims.rhs_contract),
                            fold_key(key, _DLHS, 1), s_dl, True, native=st.native)
            x_dr = _prepare(lq, dr.lhs, dr, _last(dims.lhs_free), _last(dims.lhs_contract),
                            fold_key(key, _DRHS, 0), s_dr, True, native=st.native)
        else:
            w_dl, x_dr, s_dl, s_dr = _bwd_static_operands(
                lhs, rhs, lq, rq, signs, dims, recipe, key, native=st.native
            )
    else:
        w_dl = unpack_operand(saved[0], recipe.dlhs.rhs)
        x_dr = unpack_operand(saved[1], recipe.drhs.lhs)
        s_dl, s_dr = gemm_signs(recipe.dlhs, key, _DLHS), gemm_signs(recipe.drhs, key, _DRHS)
    dl, dr = recipe.dlhs, recipe.drhs
    dy_dl = _prepare(dy, dl.lhs, dl, _last(dims.out_rhs_free), _last(dims.out_lhs_free),
                     fold_key(key, _DLHS, 0), s_dl, True, native=st.native)
    dy_dr = _prepare(dy, dr.rhs, dr, _last(dims.out_lhs_free), _last(dims.out_rhs_free),
                     fold_key(key, _DRHS, 1), s_dr, True, native=st.native)
    dlhs = _transpose_lhs(dy_dl, w_dl, dn, st.lhs_shape)
    drhs = _transpose_rhs(dy_dr, x_dr, dn, st.rhs_shape)
    if recipe.through_forward:
        f = recipe.fwd
        dlhs = through_forward(dlhs, ml, f, _last(dims.lhs_contract), signs, rotated=rotated)
        drhs = through_forward(drhs, mr, f, _last(dims.rhs_contract), signs, rotated=rotated)
    return dlhs.astype(st.lhs_dtype), drhs.astype(st.rhs_dtype), None


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _key_data(key, r: Recipe):
    """``key`` as uint32[2] key data (None stays None, unless the forward needs one)."""
    if key is not None:
        key = jnp.asarray(key)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        elif key.dtype != jnp.uint32 or key.shape != (2,):
            raise TypeError(
                f"key must be a jax.random.key(...) or a uint32[2] PRNGKey, got "
                f"{key.dtype}{key.shape}"
            )
    elif r.fwd.stochastic:
        raise ValueError(
            f"recipe {r.name!r} rounds stochastically in the forward: pass key= "
            "(a new key per step)"
        )
    return key


def forward_operands(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    recipe: str | Recipe | None = "none",
    key: jax.Array | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The two operands as the forward GEMM of :func:`dot_general` multiplies them, in the
    original basis (a forward Hadamard transform undone; H is orthogonal, so the product is
    unchanged): ``lax.dot_general(lq, rq, dn)`` in float32 equals the forward's output up to
    float32 summation order. Quantized operands come back fake-quantized (float32), an operand
    the recipe keeps in high precision as it is (after the transform's round trip).

    What sensitivity analysis needs to move a site along ``x W -> Q(x) Q(W)`` with one GEMM per
    backward (:mod:`lowbit.autoquant`). Values only: the operands carry no gradient rule.

    >>> import jax.numpy as jnp, lowbit as lb
    >>> x, w = jnp.linspace(-1, 1, 64).reshape(2, 32), jnp.ones((32, 8))
    >>> lq, rq = forward_operands(x, w, (((1,), (0,)), ((), ())), "qat_mxfp4")
    >>> bool(jnp.all(lq @ rq == lb.dot_general(x, w, (((1,), (0,)), ((), ())), "qat_mxfp4")))
    True
    """
    r = _recipes.get(recipe)
    impl = resolve(implementation)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dn = _normalize_dn(dimension_numbers, lhs.ndim, rhs.ndim)
    if not r.fwd.active:
        return lhs, rhs
    key = _key_data(key, r)
    dims = _Dims.of(dn, lhs.ndim, rhs.ndim)
    lq, rq, signs = _fwd_operands(lhs, rhs, dims, r, key, impl.cpu_kernel)
    return (
        unrotated(lq, r.fwd, _last(dims.lhs_contract), signs),
        unrotated(rq, r.fwd, _last(dims.rhs_contract), signs),
    )


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    recipe: str | Recipe | None = "none",
    key: jax.Array | None = None,
    preferred_element_type=None,
    precision=None,
    implementation: str | None = None,
) -> jax.Array:
    """``lax.dot_general`` whose forward and backward GEMMs are quantized per ``recipe``.

    Args:
      lhs, rhs: floating-point operands (typically activations and weights).
      dimension_numbers: as for ``lax.dot_general``: ``((lhs_contract, rhs_contract),
        (lhs_batch, rhs_batch))``; any number of contracting and batch dims (blocks run
        along the last contracting dim of each operand, and in the backward GEMMs along the
        last free dim).
      recipe: a name from ``lb.recipes.names()`` or a :class:`~lowbit.gemm.recipes.Recipe`.
      key: PRNG key (stochastic rounding, random Hadamard signs); derive a new one per step.
      preferred_element_type: output dtype (default: the operands' result type).
      precision: accepted for signature compatibility with ``lax.dot_general`` (Flax passes
        it); quantized GEMMs always accumulate in float32.
      implementation: ``None`` (default: the best available for the backend), ``"xla"``,
        ``"pallas"``, or an :class:`~lowbit.gemm.implementation.Implementation` already resolved
        (see :mod:`lowbit.gemm.implementation`).
        ``"xla"`` is the pure-XLA emulation, the reference. ``"pallas"``: the three GEMMs of
        a plain ``x [..., K] @ w`` go through ``pallas_kernels.quantized_gemm``, which lowers
        the Pallas kernels for CUDA and the emulation elsewhere (other dimension numbers, and
        specs the kernels do not take, use the emulation, with a warning that says why). On
        CPU its values equal the emulation's up to float32 summation order, except that
        stochastic rounding of a transposed operand draws other (identically distributed)
        random bits.

    >>> import jax, jax.numpy as jnp, lowbit as lb
    >>> x, w = jnp.ones((4, 32)), jnp.ones((32, 8))
    >>> lb.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="mxfp4")[0, 0].item()
    32.0
    """
    r = _recipes.get(recipe)
    impl = resolve(implementation)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {a.dtype}")
    dn = _normalize_dn(dimension_numbers, lhs.ndim, rhs.ndim)
    out_dtype = jnp.dtype(
        preferred_element_type
        if preferred_element_type is not None
        else jnp.result_type(lhs.dtype, rhs.dtype)
    )
    if r.is_identity:
        return lax.dot_general(
            lhs, rhs, dn, precision=precision, preferred_element_type=preferred_element_type
        )
    key = _key_data(key, r)
    st = _Call(dn, r, out_dtype, tuple(lhs.shape), lhs.dtype, tuple(rhs.shape), rhs.dtype, impl)
    if impl.gemm == "pallas" and impl.warns and (why := _kernel_constraint(st)) is not None:
        warnings.warn(f"lowbit.dot_general: the XLA emulation instead of the kernels: {why}",
                      stacklevel=2)
    return _qdot(lhs, rhs, key, st)


def _einsum_plan(subscripts: str, lhs, rhs):
    """(lhs, rhs, dimension numbers, output labels of the dot_general, output labels): labels
    on one side only and absent from the output are summed out of the operands first."""
    spec = subscripts.replace(" ", "")
    if "..." in spec:
        raise ValueError("lowbit.einsum does not support '...'; name every axis")
    try:
        ins, out = spec.split("->")
        a, b = ins.split(",")
    except ValueError:
        raise ValueError(
            f"subscripts must look like 'ab,bc->ac' with two operands, got {subscripts!r}"
        ) from None
    if len(a) != lhs.ndim or len(b) != rhs.ndim:
        raise ValueError(
            f"subscripts {subscripts!r} name {len(a)} and {len(b)} axes but the operands have "
            f"rank {lhs.ndim} and {rhs.ndim}"
        )
    for s in (a, b, out):
        if len(set(s)) != len(s) or not set(s) <= set(string.ascii_letters):
            raise ValueError(f"subscripts {subscripts!r}: repeated or invalid labels in {s!r}")
    # Labels only on one side and absent from the output are summed out first.
    a_only = [c for c in a if c not in b and c not in out]
    b_only = [c for c in b if c not in a and c not in out]
    if a_only:
        lhs = jnp.sum(lhs, axis=tuple(a.index(c) for c in a_only))
        a = "".join(c for c in a if c not in a_only)
    if b_only:
        rhs = jnp.sum(rhs, axis=tuple(b.index(c) for c in b_only))
        b = "".join(c for c in b if c not in b_only)
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    dn = (
        (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)),
    )
    produced = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    if set(produced) != set(out):
        raise ValueError(f"subscripts {subscripts!r}: output labels do not match the inputs")
    return lhs, rhs, dn, produced, out


def einsum_operands(
    subscripts: str,
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    recipe: str | Recipe | None = "none",
    key: jax.Array | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`forward_operands` of :func:`einsum`: ``einsum(subscripts, lq, rq)`` in float32
    equals the quantized einsum's output up to float32 summation order. Every label must
    appear in the other operand or in the output (none summed out of one operand alone)."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    l2, r2, dn, _, _ = _einsum_plan(subscripts, lhs, rhs)
    if l2.ndim != lhs.ndim or r2.ndim != rhs.ndim:
        raise ValueError(
            f"einsum_operands: {subscripts!r} sums a label out of one operand alone; its "
            "operands would not have the shapes of the einsum's"
        )
    return forward_operands(lhs, rhs, dn, recipe, key, implementation)


def einsum(
    subscripts: str,
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    recipe: str | Recipe | None = "none",
    key: jax.Array | None = None,
    preferred_element_type=None,
    implementation: str | None = None,
) -> jax.Array:
    """Two-operand ``jnp.einsum`` through :func:`dot_general` (quantized per ``recipe``).

    >>> import jax.numpy as jnp, lowbit as lb
    >>> lb.einsum("btd,df->btf", jnp.ones((2, 3, 32)), jnp.ones((32, 4)), recipe="mxfp8").shape
    (2, 3, 4)
    """
    lhs, rhs, dn, produced, out = _einsum_plan(subscripts, lhs, rhs)
    y = dot_general(lhs, rhs, dn, recipe=recipe, key=key,
                    preferred_element_type=preferred_element_type,
                    implementation=implementation)
    return jnp.transpose(y, [produced.index(c) for c in out])
