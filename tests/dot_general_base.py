"""The independent reference of ``lowbit.dot_general``'s three GEMMs, and the spec tests written
once against it and run for every implementation.

The reference (:func:`reference`) is written from the semantics in lowbit/gemm/recipes.py, not from
dot_general.py's internals: each of the three GEMMs (``fwd``: lhs, rhs; ``dlhs``: dy, rhs;
``drhs``: lhs, dy) transforms its operands along its own contraction axis with its Hadamard
block (signs ``gemm_signs(gemm, key, tag)``), fake-quantizes each operand along that axis with
``quantize_operand`` (2-D tiles spanning that axis and the operand's last other axis, rounding
keys ``fold_key(key, tag, operand)``) and multiplies with ``lax.dot_general`` at HIGHEST
precision and float32 accumulation. The backward GEMMs' dimension numbers are written out by
hand for each case (2-D, batched, two contracting dims). A None backward spec is
straight-through: the forward-quantized operand with the forward Hadamard undone (dy: high
precision).

:class:`DotGeneralSpec` holds the tests; each subclass says which implementation runs
(``implementation=``: a name or a resolved ``lowbit.gemm.implementation.Implementation``, Pallas
interpret mode included), on which recipes, and whether it must equal the reference bit for
bit (the emulation runs the same float32 operations) or to float32 accumulation tolerance
(the kernels: the same quantized operands, other orders of the float32 sums). The default
implementation's exhaustive matrix (every recipe, three layouts, both residual modes, vmap,
remat, sharding) is tests/test_dot_general.py's, which shares one compiled program per recipe.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lowbit as lb
from lowbit.core.hadamard import hadamard_transform
from lowbit.gemm.operand import fold_key, gemm_signs, quantize_operand, std_scaled_quantize
from lowbit.gemm.recipes import GemmSpec, QuantSpec, Recipe

U32 = 2.0**-24  # float32 unit roundoff

KEY = jax.random.key(1234)
HIGHEST = lax.Precision.HIGHEST
TAGS = {"fwd": 0, "dlhs": 1, "drhs": 2}  # fold_in tags of the three GEMMs


def normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def dot(a, b, dn):
    return lax.dot_general(a, b, dn, precision=HIGHEST, preferred_element_type=jnp.float32)


def gemm_tol(a, b, dn):
    """Largest difference between two float32 summation orders of ``dot_general(a, b, dn)``:
    ``2 gamma_n (|A| |B|)``; the extra ``(1 + gamma_n)`` covers the rounding of ``|A| |B|``
    itself (a sum of non-negative terms), ``n * 2**-126`` the CPU's flush of subnormals."""
    (lc, _), _ = dn
    n = math.prod(a.shape[i] for i in lc)
    gamma = n * U32 / (1 - n * U32)
    return 2 * gamma * (1 + gamma) * dot(jnp.abs(a), jnp.abs(b), dn) + n * 2.0**-126


def assert_within(actual, expected, tol):
    err = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    tol = np.asarray(tol, np.float64)
    bad = err > tol
    assert not np.any(bad), f"{np.sum(bad)} elements off, worst err / tol {np.max(err / tol)}"


def assert_equal(tree_a, tree_b):
    for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def rel_err(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(a - ref) / np.linalg.norm(ref)


# ------------------------------------------------------------------------------------------
# The reference


@dataclasses.dataclass(frozen=True)
class Case:
    """A dot_general and, written out by hand, the layout of its three GEMMs.

    Each operand entry is ``(block axis, the tile's other axis)``: the GEMM's last contracting
    axis of that operand, and the operand's last other (free) axis. ``dlhs_dn`` contracts the
    rhs's free dims of ``(dy, rhs)``, ``drhs_dn`` the lhs's free dims of ``(lhs, dy)``.
    """

    id: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    dn: tuple
    fwd_lhs: tuple[int, int]
    fwd_rhs: tuple[int, int]
    dlhs_dy: tuple[int, int]
    dlhs_rhs: tuple[int, int]
    dlhs_dn: tuple
    drhs_lhs: tuple[int, int]
    drhs_dy: tuple[int, int]
    drhs_dn: tuple


# fmt: off
M, K, N, B = 64, 128, 64, 2
MK_KN = Case(  # y[m,n] = x[m,k] w[k,n]; dy [M, N]
    "mk,kn->mn", (M, K), (K, N), (((1,), (0,)), ((), ())),
    fwd_lhs=(1, 0), fwd_rhs=(0, 1),
    dlhs_dy=(1, 0), dlhs_rhs=(1, 0), dlhs_dn=(((1,), (1,)), ((), ())),  # dx[m,k] = dy[m,n] w[k,n]
    drhs_lhs=(0, 1), drhs_dy=(0, 1), drhs_dn=(((0,), (0,)), ((), ())),  # dw[k,n] = x[m,k] dy[m,n]
)
BMK_BKN = Case(  # batched; dy [B, M, N]
    "bmk,bkn->bmn", (B, M, K), (B, K, N), (((2,), (1,)), ((0,), (0,))),
    fwd_lhs=(2, 1), fwd_rhs=(1, 2),
    dlhs_dy=(2, 1), dlhs_rhs=(2, 1), dlhs_dn=(((2,), (2,)), ((0,), (0,))),  # dx[b,m,k]
    drhs_lhs=(1, 2), drhs_dy=(1, 2), drhs_dn=(((1,), (1,)), ((0,), (0,))),  # dw[b,k,n]
)
MAB_ABN = Case(  # two contracting dims (a, b); blocks run along the last one, b; dy [M, N]
    "mab,abn->mn", (M, B, 64), (B, 64, N), (((1, 2), (0, 1)), ((), ())),
    fwd_lhs=(2, 0), fwd_rhs=(1, 2),
    dlhs_dy=(1, 0), dlhs_rhs=(2, 1), dlhs_dn=(((1,), (2,)), ((), ())),  # dx[m,a,b]
    drhs_lhs=(0, 2), drhs_dy=(0, 1), drhs_dn=(((0,), (0,)), ((), ())),  # dw[a,b,n]
)
# fmt: on
CASES = [MK_KN, BMK_BKN, MAB_ABN]
CASE = {c.id: c for c in CASES}
DN = MK_KN.dn


def hadamard(x, axis, gemm: GemmSpec, signs, inverse=False):
    if not gemm.hadamard:
        return x
    # Along ``axis`` itself, as the library transforms (no transpose: a transposed dense
    # transform is another GEMM layout, whose float32 sums XLA:CPU may order differently).
    return hadamard_transform(x, gemm.hadamard, signs=signs, axis=axis, inverse=inverse)


def operand(x, spec, gemm, axes, key, signs):
    axis, other = axes
    x = x.astype(jnp.float32)
    if spec is not None or gemm.hadamard:
        # An identity: keeps XLA from fusing the operand's producer into the quantizer, as
        # the library does, so that one program holding both compiles faster.
        x = lax.optimization_barrier(x)
    x = hadamard(x, axis, gemm, signs)
    return quantize_operand(x, spec, axis, other, key)


def trust_mask(x, spec, gemm, axes, signs):
    """A forward operand's trust mask (None without one), in the forward's Hadamard basis."""
    if spec is None or not spec.trust_mask:
        return None
    x = hadamard(lax.optimization_barrier(x.astype(jnp.float32)), axes[0], gemm, signs)
    return std_scaled_quantize(x, spec, axes[0])[1]


def through_forward(g, mask, gemm, axis, signs, rotated):
    """The gradient of a forward operand's value (in the forward's basis when ``rotated``)
    back to the high-precision operand: into the basis, the trust mask, out of it."""
    if mask is None and not rotated:
        return g
    if not rotated:
        g = hadamard(g, axis, gemm, signs)
    if mask is not None:
        g = jnp.where(mask, g, 0.0)
    return hadamard(g, axis, gemm, signs, inverse=True)


def reference(x, w, dy, key, case: Case, recipe: Recipe):
    """``(y, dx, dw)`` and the quantized operands of each GEMM, quantized by hand."""
    kd = None if key is None else jax.random.key_data(key)
    f, dl, dr = recipe.fwd, recipe.dlhs, recipe.drhs
    s_f, s_dl, s_dr = (
        gemm_signs(g, kd, TAGS[t]) for g, t in ((f, "fwd"), (dl, "dlhs"), (dr, "drhs"))
    )
    x_f = operand(x, f.lhs, f, case.fwd_lhs, fold_key(kd, 0, 0), s_f)
    w_f = operand(w, f.rhs, f, case.fwd_rhs, fold_key(kd, 0, 1), s_f)
    # Straight-through: the operand as the forward saw it, forward Hadamard undone.
    w_ste = hadamard(w_f, case.fwd_rhs[0], f, s_f, inverse=True)
    x_ste = hadamard(x_f, case.fwd_lhs[0], f, s_f, inverse=True)
    # backward_operands="forward": the backward starts from the forward's values, its basis.
    fwd_basis = recipe.backward_operands == "forward"
    w_src = w_f if fwd_basis else (w if dl.rhs is not None else w_ste)
    x_src = x_f if fwd_basis else (x if dr.lhs is not None else x_ste)
    dy_dl = operand(dy, dl.lhs, dl, case.dlhs_dy, fold_key(kd, 1, 0), s_dl)
    w_dl = operand(w_src, dl.rhs, dl, case.dlhs_rhs, fold_key(kd, 1, 1), s_dl)
    x_dr = operand(x_src, dr.lhs, dr, case.drhs_lhs, fold_key(kd, 2, 0), s_dr)
    dy_dr = operand(dy, dr.rhs, dr, case.drhs_dy, fold_key(kd, 2, 1), s_dr)
    dx = dot(dy_dl, w_dl, case.dlhs_dn)
    dw = dot(x_dr, dy_dr, case.drhs_dn)
    if recipe.through_forward:
        mx = trust_mask(x, f.lhs, f, case.fwd_lhs, s_f)
        mw = trust_mask(w, f.rhs, f, case.fwd_rhs, s_f)
        dx = through_forward(dx, mx, f, case.fwd_lhs[0], s_f, fwd_basis)
        dw = through_forward(dw, mw, f, case.fwd_rhs[0], s_f, fwd_basis)
    out = (dot(x_f, w_f, case.dn), dx, dw)
    ops = ((x_f, w_f), (dy_dl, w_dl), (x_dr, dy_dr))
    return out, ops


def value_and_grads(x, w, dy, key, dn, recipe):
    """``(y, dx, dw)`` of lowbit's dot_general, gradients by ``jax.vjp`` with cotangent dy."""
    y, vjp = jax.vjp(lambda a, b: lb.dot_general(a, b, dn, recipe=recipe, key=key), x, w)
    return (y, *vjp(dy))


def inputs(case: Case, seed=0):
    x = normal(seed, case.lhs_shape)
    w = normal(seed + 1, case.rhs_shape, 0.1)
    y_shape = jax.eval_shape(functools.partial(dot, dn=case.dn), x, w).shape
    return x, w, normal(seed + 2, y_shape, 0.01)


# No registered recipe combines a forward Hadamard transform with straight-through backward
# operands, or mixes None and quantized specs in one backward GEMM: this one does. Forward:
# x clipped to 2.5 RMS and MXFP8, w in NVFP4 16x16 tiles, after a 32-point Hadamard
# transform. dgrad: w straight-through (forward Hadamard undone, then dgrad's own 16-point
# transform), dy stochastically rounded to MXFP6. wgrad: x straight-through, dy in FP8 with a
# tensor scale, after a 16-point transform.
MIXED = Recipe(
    "mixed",
    fwd=GemmSpec(
        QuantSpec("mxfp8", clip_rms=2.5), QuantSpec("nvfp4", block_shape=(16, 16)), hadamard=32
    ),
    dlhs=GemmSpec(QuantSpec("mxfp6_e3m2", rounding="stochastic"), None, hadamard=16),
    drhs=GemmSpec(None, QuantSpec("e5m2", granularity="tensor"), hadamard=16),
)


# ------------------------------------------------------------------------------------------
# The spec, once for every implementation


def call(x, w, dy, key, dn, recipe, implementation):
    """``(y, dx, dw)`` of one jitted ``lb.dot_general`` call with ``implementation``."""

    def f(x, w, dy):
        y, vjp = jax.vjp(
            lambda a, b: lb.dot_general(a, b, dn, recipe=recipe, key=key,
                                        implementation=implementation), x, w)
        return (y, *vjp(dy))

    return jax.jit(f)(x, w, dy)


# x [B, T, K] . w [K, N] with T a multiple of 256: the layout the kernels take with leading axes
BTK_KN = Case(
    "btk,kn->btn", (2, 256, 64), (64, 32), (((2,), (0,)), ((), ())),
    fwd_lhs=(2, 1), fwd_rhs=(0, 1),
    dlhs_dy=(2, 1), dlhs_rhs=(1, 0), dlhs_dn=(((2,), (1,)), ((), ())),  # dx[b,t,k]
    drhs_lhs=(1, 2), drhs_dy=(1, 2), drhs_dn=(((0, 1), (0, 1)), ((), ())),  # dw[k,n]
)
# ... with T = 96: a multiple of every block and transform along tokens of the recipes the
# kernel tests run (16, 32), not of 64 or 256: blocks of 32 along T stay within a sequence
BTK96_KN = dataclasses.replace(BTK_KN, id="btk,kn->btn (T=96)", lhs_shape=(2, 96, 64))


class DotGeneralSpec:
    """Outputs and both gradients of ``lb.dot_general`` against :func:`reference`.

    Subclasses set ``implementation``, ``recipes`` (names or Recipes), ``cases`` and
    ``exact``: bit for bit, or within ``8 n u`` of the norm of ``|A_q| |B_q|`` (``n`` the
    GEMM's contraction length, ``A_q``, ``B_q`` the reference's quantized operands: two
    float32 summation orders of the same products; a backward through the forward's
    quantizers adds masks, which shrink the error, and orthogonal transforms, which keep its
    norm)."""

    implementation = None
    recipes: tuple = ()
    cases: tuple = (MK_KN,)
    exact = True

    def compare(self, got, want, operands, case: Case):
        dns = (case.dn, case.dlhs_dn, case.drhs_dn)
        for g, r, (a, b), dn, what in zip(got, want, operands, dns, ("y", "dx", "dw"),
                                         strict=True):
            assert g.shape == r.shape and g.dtype == r.dtype, what
            if self.exact:
                np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=what)
                continue
            (lc, _), _ = dn
            n = math.prod(a.shape[i] for i in lc)
            bound = 8 * n * U32 * float(jnp.linalg.norm(dot(jnp.abs(a), jnp.abs(b), dn)))
            err = float(jnp.linalg.norm(g.astype(jnp.float32) - r.astype(jnp.float32)))
            assert err <= bound, f"{what}: |got - reference| = {err} > {bound}"

    def test_matches_reference(self, recipe, case):
        recipe = lb.recipes.get(recipe)
        x, w, dy = inputs(case)
        want, operands = jax.jit(reference, static_argnums=(4, 5))(x, w, dy, KEY, case, recipe)
        got = call(x, w, dy, KEY, case.dn, recipe, self.implementation)
        self.compare(got, want, operands, case)


def parametrize_spec(metafunc):
    """Parametrize a :class:`DotGeneralSpec` subclass's tests by its own recipes and cases
    (a module that subclasses it sets ``pytest_generate_tests = parametrize_spec``)."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, DotGeneralSpec):
        return
    if "recipe" in metafunc.fixturenames:
        ids = [lb.recipes.get(r).name for r in cls.recipes]
        metafunc.parametrize("recipe", list(cls.recipes), ids=ids)
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", list(cls.cases), ids=[c.id for c in cls.cases])
