"""Tests for lowbit.dot_general: the three quantized GEMMs of every recipe, against references.

The reference (``reference`` in tests/dot_general_base.py, with the spec that every other
implementation's subclass runs) is written from the semantics in lowbit/gemm/recipes.py, not
from dot_general.py's internals: each of the three GEMMs (``fwd``: lhs, rhs; ``dlhs``: dy, rhs;
``drhs``: lhs, dy) transforms its operands along its own contraction axis with its Hadamard
block (signs ``_signs(gemm, key, tag)``), fake-quantizes each operand along that axis with
``quantize_operand`` (2-D tiles spanning that axis and the operand's last other axis, rounding
keys ``_fold(key, tag, operand)``) and multiplies with ``lax.dot_general`` at HIGHEST precision
and float32 accumulation. The backward GEMMs' dimension numbers are written out by hand for
each case (2-D, batched, two contracting dims). A None backward spec is straight-through: the
forward-quantized operand with the forward Hadamard undone (dy: high precision).

Sections: 1. every recipe against the reference, both residual modes; 2. QAT recipes against
``jax.vjp`` of a fake-quantized forward; 3. "none" is ``lax.dot_general``; 4. stochastic
rounding (key dependence, unbiasedness over keys); 5. Hadamard transforms; 6. NVFP4 keeps
tiny gradients; 7. jit, vmap, remat, sharding; 8. einsum; 9. argument errors.

Tolerances. Where the library and the reference run the same float32 operations the results
are compared for exact equality. Where a transformation may change the order in which a GEMM
sums its products (sharding splits the contraction across devices) two float32 evaluations of
``sum_i a_i b_i`` each lie within ``gamma_n * sum_i |a_i b_i|`` of the exact sum
(``gamma_n = n u / (1 - n u)``, ``u = 2**-24``, Higham, Accuracy and Stability, 3.1), so they
differ by at most ``2 gamma_n (|A| |B|)``, computed per element from the quantized operands
(``gemm_tol``). Statistical tests state their bounds where they are made.

Run time: compiling dominates, so programs are shared between tests (see ``checked``); the
batched and two-contracting-dims cases of recipes that differ from others only in element
format are marked slow (``make test-slow``).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit as lb
from lowbit.gemm import recipes
from lowbit.gemm.operand import gemm_signs as _signs
from lowbit.gemm.operand import quantize_operand
from lowbit.gemm.recipes import GemmSpec, QuantSpec, Recipe
from tests.dot_general_base import (
    CASE,
    CASES,
    DN,
    HIGHEST,
    KEY,
    MIXED,
    MK_KN,
    TAGS,
    U32,
    K,
    M,
    N,
    assert_equal,
    assert_within,
    gemm_tol,
    inputs,
    reference,
    rel_err,
    value_and_grads,
)
from tests.dot_general_base import dot as _dot
from tests.dot_general_base import hadamard as _hadamard
from tests.dot_general_base import normal as _normal

# The weight-only recipes share one GEMM path: one of them stands for both (each recipe here
# costs ~13 s of suite time). So do the 8-bit-activation recipes (int8 rows times a block
# format): w4a8_int4 and w16a8 stand for them; qat_ternary's weight is bitnet's.
_SAME_PATH = ("w4a16_", "w8a8_", "w6a8_", "w4a8_mxfp4", "w4a8_nvfp4", "qat_ternary")
# quartet2's backward Hadamard of 128 needs contraction axes that are multiples of 128 (these
# cases contract over 64): tests/test_scale_rules.py tests it on its own shapes.
_OWN_SHAPES = ("quartet2",)
ALL = [n for n in recipes.names() if not n.startswith(_SAME_PATH + _OWN_SHAPES)]
ALL += ["w4a16_nvfp4"]
QAT = [n for n in ALL if n.startswith("qat_")]

# Compiling dominates the run time (each program runs in microseconds), so a recipe's
# reference checks, vmap and remat share one cached program; the "plain call" of the
# transformation tests is the output that test_matches_reference checks. Recipes that differ
# only in name (format aliases) share it. The batched and two-contracting-dims cases run by
# default for recipes that together take every path of dot_general (per-tensor scales,
# NVFP4 tiles, Hadamard transforms in all three GEMMs, stochastic rounding, RMS clipping,
# straight-through operands with the forward Hadamard undone); for the others, which differ
# from these only in element formats, they are marked slow (make test-slow).
FULL = ("none", "nvfp4", "mixed")
ALL_IDS = tuple(c.id for c in CASES)


def _canonical(name: str | Recipe) -> Recipe:
    return recipes.get(name).replace(name="", description="", source="")


def _group(name: str | Recipe, case_id: str) -> tuple[str, ...]:
    """The cases compiled in one program with ``case_id`` for this recipe."""
    if recipes.get(name).name in FULL:
        return ALL_IDS
    return (MK_KN.id,) if case_id == MK_KN.id else ALL_IDS[1:]


@functools.cache
def case_inputs():
    return {c.id: inputs(c) for c in CASES}


def _batch(x, dy):
    """The batch for the vmap test: three different examples built from x and dy."""
    return jnp.stack([x, -0.5 * x, x[::-1]]), jnp.stack([dy, dy[::-1], 2.0 * dy])


@functools.cache
def checked_program(recipe: Recipe, case_ids: tuple[str, ...]):
    """jit: for each case ``(lowbit with residuals="high", with "quantized", the reference's
    outputs and quantized operands)``; and, with the 2-D case, vmap over a batch of x and dy
    and jax.checkpoint."""

    def run(ins, key):
        out = {}
        for case_id in case_ids:
            case, (x, w, dy) = CASE[case_id], ins[case_id]
            high = value_and_grads(x, w, dy, key, case.dn, recipe.replace(residuals="high"))
            # (a backward through the forward's quantizers recomputes them: no packed residuals)
            quantized = high if recipe.through_forward else value_and_grads(
                x, w, dy, key, case.dn, recipe.replace(residuals="quantized"))
            out[case_id] = (high, quantized, *reference(x, w, dy, key, case, recipe))
        if MK_KN.id in case_ids:
            x, w, dy = ins[MK_KN.id]
            xb, dyb = _batch(x, dy)
            vg = functools.partial(value_and_grads, dn=DN, recipe=recipe)
            out["vmap"] = jax.vmap(vg, in_axes=(0, None, 0, None))(xb, w, dyb, key)
            g = jax.checkpoint(lambda a, b: lb.dot_general(a, b, DN, recipe=recipe, key=key))
            y, vjp = jax.vjp(g, x, w)
            out["remat"] = (y, *vjp(dy))
        return out

    return jax.jit(run)


@functools.cache
def _checked(recipe: Recipe, case_ids: tuple[str, ...]):
    return checked_program(recipe, case_ids)({i: case_inputs()[i] for i in case_ids}, KEY)


def checked(name: str | Recipe, what: str = MK_KN.id):
    """A case's ``(high, quantized, reference outputs, reference operands)``, or "vmap" or
    "remat" (2-D case)."""
    ids = _group(name, what if what in CASE else MK_KN.id)
    return _checked(_canonical(name), ids)[what]


def plain_call(name, x, w, dy, key=KEY):
    """``(y, dx, dw)`` of the plain (jitted) call on the 2-D case, for any x, w, dy, key."""
    ids = _group(name, MK_KN.id)
    ins = {i: case_inputs()[i] for i in ids} | {MK_KN.id: (x, w, dy)}
    return checked_program(_canonical(name), ids)(ins, key)[MK_KN.id][0]


# ------------------------------------------------------------------------------------------
# 1. Every recipe against the reference


def _reference_params():
    params = []
    for name in [*ALL, MIXED]:
        n = recipes.get(name).name
        for case in CASES:
            slow = case is not MK_KN and n not in FULL
            params.append(
                pytest.param(
                    name, case, id=f"{n}-{case.id}", marks=[pytest.mark.slow] if slow else []
                )
            )
    return params


@pytest.mark.parametrize("name,case", _reference_params())
def test_matches_reference(name, case):
    """Outputs and gradients equal the hand-quantized reference bit for bit (both run the
    same float32 operations), with high-precision and with quantized residuals."""
    high, quantized, ref, _ = checked(name, case.id)
    assert_equal(high, ref)
    assert_equal(quantized, ref)
    # Not vacuous: the output changes exactly when the recipe quantizes the forward, and
    # every recipe but "none" changes something.
    x, w, dy = case_inputs()[case.id]
    y, vjp = jax.vjp(lambda a, b: _dot(a, b, case.dn), x, w)
    # (changed beyond a float32 GEMM's rounding: eager and jitted GEMMs may sum differently)
    tols = [gemm_tol(x, w, case.dn), gemm_tol(dy, w, case.dlhs_dn), gemm_tol(x, dy, case.drhs_dn)]
    changed = [
        bool(np.any(np.abs(np.asarray(a) - np.asarray(b)) > np.asarray(t)))
        for a, b, t in zip(ref, (y, *vjp(dy)), tols, strict=True)
    ]
    recipe = recipes.get(name)
    assert changed[0] == recipe.fwd.active and any(changed) != recipe.is_identity


# ------------------------------------------------------------------------------------------
# 2. QAT recipes: straight-through gradients of the fake-quantized forward


@pytest.mark.parametrize("name", QAT)
def test_qat_gradients_are_straight_through(name):
    spec = recipes.get(name).fwd.lhs
    fmt = spec.format
    x, w, dy = case_inputs()[MK_KN.id]

    def pow2_amax(v):  # a pow2_tensor_scale spec: the amax 2688 * 2**k (float64 search)
        a, k = float(np.max(np.abs(np.asarray(v)))), 0
        while 2688.0 * 2.0**k < a:
            k += 1
        while 2688.0 * 2.0 ** (k - 1) >= a:
            k -= 1
        return np.float32(2688.0 * 2.0**k)

    amax = {1: pow2_amax(x), 0: pow2_amax(w)} if spec.pow2_tensor_scale else {1: None, 0: None}

    def fq(v, axis):
        return lb.fake_quantize(v, fmt, axis=axis, tensor_amax=amax[axis])

    @jax.jit
    def ste(x, w, dy):  # K is axis 1 of x and axis 0 of w
        y, vjp = jax.vjp(
            lambda x, w: lax.dot_general(
                fq(x, 1),
                fq(w, 0),
                DN,
                precision=HIGHEST,
                preferred_element_type=jnp.float32,
            ),
            x,
            w,
        )
        return (y, *vjp(dy))

    assert_equal(checked(name)[0], ste(x, w, dy))


# ------------------------------------------------------------------------------------------
# 3. "none" is lax.dot_general


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_none_is_lax_dot_general(case):
    x, w, dy = case_inputs()[case.id]
    y, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, case.dn), x, w)
    expected = (y, *vjp(dy))
    for recipe in ("none", None, recipes.get("none")):
        got = value_and_grads(x, w, dy, None, case.dn, recipe)
        assert_equal(got, expected)


def test_output_dtype_follows_lax_dot_general():
    x, w, dy = (a.astype(jnp.bfloat16) for a in case_inputs()[MK_KN.id])
    for name in ("none", "mxfp8", "nvfp4"):
        out = jax.eval_shape(functools.partial(value_and_grads, dn=DN, recipe=name), x, w, dy, KEY)
        assert [a.dtype for a in out] == [jnp.bfloat16] * 3
        y32 = jax.eval_shape(
            lambda x, w, n=name: lb.dot_general(
                x, w, DN, recipe=n, key=KEY, preferred_element_type=jnp.float32
            ),
            x,
            w,
        )
        assert y32.dtype == jnp.float32


# ------------------------------------------------------------------------------------------
# 4. Stochastic rounding


@pytest.mark.parametrize("name", ["mxfp4_bwd", "nvfp4", "quartet"])
def test_stochastic_gradients_depend_on_the_key(name):
    x, w, dy = case_inputs()[MK_KN.id]
    y1, dx1, dw1 = plain_call(name, x, w, dy, jax.random.key(1))
    y2, dx2, dw2 = plain_call(name, x, w, dy, jax.random.key(2))
    assert not np.array_equal(dx1, dx2) and not np.array_equal(dw1, dw2)
    assert_equal((y1, dx1, dw1), plain_call(name, x, w, dy, jax.random.key(1)))


def test_uint32_key_data_is_the_typed_key():
    sr = QuantSpec("mxfp4", rounding="stochastic")
    recipe = Recipe("sr_fwd", fwd=GemmSpec(sr, sr, hadamard=32))
    x, w, _ = case_inputs()[MK_KN.id]
    typed, data = jax.jit(
        lambda x, w: [
            lb.dot_general(x, w, DN, recipe=recipe, key=k) for k in (KEY, jax.random.key_data(KEY))
        ]
    )(x, w)
    assert_equal(typed, data)


def _sr_variance(v, spec: QuantSpec):
    """Per-element variance of stochastic rounding of ``v [..., C, P]`` to an MX format in
    blocks along ``C``: ``(a - lo)(hi - a)`` for ``a`` between the grid neighbours ``lo`` and
    ``hi`` (at most ``step**2 / 4``), in units of the block scale, which the scale rule
    (floor or rceil) takes from the block's absolute max after ``spec.prescale``. A clipped
    element is deterministic (variance 0)."""
    fmt = lb.formats.get(spec.format)
    elem, bs = fmt.elem, fmt.block_size
    v = np.asarray(v, np.float64) * spec.prescale
    *lead, c, p = v.shape
    blocks = np.abs(v).reshape(*lead, c // bs, bs, p)
    amax = blocks.max(axis=-2, keepdims=True)
    e = np.floor(np.log2(amax)) - elem.emax
    if spec.scale_mode == "rceil":  # the smallest power of two with amax <= elem.max * 2**e
        e = e + (amax > elem.max * 2.0**e)
    else:
        assert spec.scale_mode in (None, "floor")
    scale = 2.0**e
    a = np.minimum(blocks / scale, elem.max)
    grid = elem.positive_grid
    i = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    var = (a - grid[i - 1]) * (grid[i] - a) * (scale / spec.prescale) ** 2
    return var.reshape(v.shape)


# mxfp4_bwd (stochastic rounding and random Hadamard transforms in the backward, no forward
# quantization) with scales that cannot clip ("rceil": the smallest power of two with
# amax <= 6 * scale), and the registered floor-rule mxfp4_bwd, whose 3/4 gain keeps the
# scaled elements below 6: both unbiased.
_SR_BWD = dataclasses.replace(recipes.get("mxfp4_bwd").dlhs.lhs, scale_mode="rceil")
MXFP4_BWD_RCEIL = recipes.get("mxfp4_bwd").replace(
    name="mxfp4_bwd_rceil",
    dlhs=GemmSpec(_SR_BWD, _SR_BWD, hadamard=64),
    drhs=GemmSpec(_SR_BWD, _SR_BWD, hadamard=64),
)


@pytest.mark.parametrize(
    "recipe",
    [
        MXFP4_BWD_RCEIL,
        recipes.get("mxfp4_bwd"),
    ],
    ids=lambda r: r.name,
)
def test_stochastic_rounding_is_unbiased_over_keys(recipe):
    """The means over 256 keys of the weight and input gradients converge to the exact ones.

    Bound. With no forward quantization, ``dw[k, n] = sum_m Q(x~)[m, k] Q(dy~)[m, n]`` where
    ``~`` is the GEMM's Hadamard transform along M, if any (random signs from the key; it
    cancels in exact arithmetic) and Q rounds independently and without bias (``E Q(v) = v``,
    ``Var Q(v) = (v - lo)(hi - v) <= step**2 / 4``: ``_sr_variance``). For independent a, b:
    ``Var(ab) = Va Vb + Va E[b]**2 + Vb E[a]**2``; summing over m gives the variance of one
    key's gradient given its signs, and the mean over ``n`` independent keys has
    ``sigma**2 = sum_keys Var_key / n**2``. A mean of 256 sums of 64 independent terms is
    close to normal, so ``|mean - exact| <= z sigma`` with z for a two-sided false-failure
    probability of 1e-6 over all elements (Bonferroni: ``1e-6 / (2 * n_elements)`` each),
    plus the float32 error of the GEMMs (``2 gamma_n (|A||B|)``, tiny next to sigma).
    The same holds for ``dx`` (contracting N).
    """
    x, w, dy = case_inputs()[MK_KN.id]
    n_keys = 256
    keys = jax.random.split(jax.random.key(99), n_keys)

    @jax.jit
    def sample(keys):
        grads = jax.vmap(
            functools.partial(value_and_grads, dn=DN, recipe=recipe), in_axes=(None, None, None, 0)
        )(x, w, dy, keys)

        def transformed(k, gemm_name, a, b):  # both operands of a GEMM, C (axis 0) first
            gemm = getattr(recipe, gemm_name)
            s = _signs(gemm, jax.random.key_data(k), TAGS[gemm_name])
            return _hadamard(a, 0, gemm, s), _hadamard(b, 0, gemm, s)

        ops = {
            g: jax.vmap(functools.partial(transformed, gemm_name=g, a=a, b=b))(keys)
            for g, a, b in (("drhs", x, dy), ("dlhs", dy.T, w.T))
        }
        return grads, ops

    (y, dx, dw), ops = sample(keys)
    # no forward quantization (vmap batches the GEMM: its summation order may change)
    assert_within(y[0], _dot(x, w, DN), gemm_tol(x, w, DN))
    assert not np.array_equal(dw[0], dw[1])

    def check(samples, gemm_name, a, b):
        """``samples[key] = sum_c Q(a~)[c, :, None] Q(b~)[c, None, :]``, C contracted."""
        gemm = getattr(recipe, gemm_name)
        at, bt = (np.asarray(t, np.float64) for t in ops[gemm_name])
        va, vb = _sr_variance(at, gemm.lhs), _sr_variance(bt, gemm.rhs)
        var = sum(
            np.einsum("kcp,kcq->pq", u, v, optimize=True)
            for u, v in ((va, vb), (va, bt**2), (at**2, vb))
        )
        sigma = np.sqrt(var) / n_keys
        dn = (((0,), (0,)), ((), ()))
        exact = _dot(a, b, dn)
        fp32 = gemm_tol(a, b, dn)
        z = statistics.NormalDist().inv_cdf(1 - 1e-6 / (2 * exact.size))
        mean = np.asarray(samples, np.float64).mean(axis=0)
        assert_within(mean, exact, z * sigma + fp32)
        # The bound is not vacuous: one key alone is much further off than the mean may be.
        assert np.max(np.abs(samples[0] - exact) / (sigma + fp32)) > 4 * z

    check(dw, "drhs", x, dy)  # dw = x.T dy: x [M, K] and dy [M, N], blocks along M
    check(dx, "dlhs", dy.T, w.T)  # dx = dy w.T: dy.T [N, M] and w.T [N, K], blocks along N


def test_prescale_keeps_stochastic_rounding_from_clipping():
    """One MXFP4 block holding 1.2 (everything else 0): the floor-rule scale is
    2**(floor(log2 1.2) - 2) = 1/4, and 1.2 / (1/4) * 3/4 = 3.6 does not clip: it rounds to
    3 or 4, i.e. 1.0 or 4/3 after the gain is divided out (mean 1.2). (Prescaling before the
    scale is chosen gave 0.9 / (1/8) = 7.2, clipped to 6: always 1.0.)"""
    spec = recipes.get("mxfp4_bwd").dlhs.lhs
    v = jnp.zeros((1, 32)).at[0, 0].set(1.2)
    keys = jax.random.split(jax.random.key(0), 64)
    q = jax.jit(jax.vmap(lambda k: quantize_operand(v, spec, 1, 0, jax.random.key_data(k))))(keys)
    assert float(jnp.max(q[:, 0, 0])) > 1.2  # rounds up sometimes, as unbiased SR must


# ------------------------------------------------------------------------------------------
# 5. Hadamard transforms

HAD32 = Recipe(
    "had32", fwd=GemmSpec(hadamard=32), dlhs=GemmSpec(hadamard=32), drhs=GemmSpec(hadamard=32)
)


def test_hadamard_alone_leaves_the_product_unchanged():
    """With fixed signs (no key) and random signs. Bound: each operand's transform is off by
    at most ``(L + 3) u`` times its block's L2 norm (L = log2(32); tests/test_hadamard.py),
    and a float32 GEMM adds at most ``gamma_n sum |a_i b_i| <= gamma_n ||a|| ||b||``; so per
    output element ``|y - x w| <= (2 (L + 3) u + 2 gamma_n) ||x_row|| ||w_col||`` (first
    order, so 0.1% on top; the exact product's own float32 error counted too)."""
    x, w, dy = case_inputs()[MK_KN.id]
    got = jax.jit(lambda *a: [value_and_grads(*a, k, DN, HAD32) for k in (None, KEY)])(x, w, dy)
    exact = (_dot(x, w, DN), _dot(dy, w.T, DN), _dot(x.T, dy, DN))

    def tol(a, b):  # rows of a times columns of b
        n = a.shape[1]
        gamma = n * U32 / (1 - n * U32)
        na = np.linalg.norm(np.asarray(a, np.float64), axis=1)
        nb = np.linalg.norm(np.asarray(b, np.float64), axis=0)
        return (2 * 8 * U32 + 2 * gamma) * (1 + 1e-3) * na[:, None] * nb[None, :]

    tols = (tol(x, w), tol(dy, w.T), tol(x.T, dy))
    for signs in got:
        for g, e, t in zip(signs, exact, tols, strict=True):
            assert_within(g, e, t)
            assert not np.array_equal(g, e)  # the transform did run
    assert not np.array_equal(got[0][0], got[1][0])  # and the signs did change it


def test_hadamard_reduces_mxfp4_error_on_outliers():
    """Four channels of K (one in each block of 32) scaled by 100 set the MX scale of their
    blocks ~2**7 higher: the other 31 elements of each block flush to zero or to the coarsest
    FP4 levels. A 32-point Hadamard transform along K spreads each outlier over its block,
    which becomes close to Gaussian, so x keeps FP4's relative error of Gaussian data.

    Quantizing x alone (activations, where outliers live), the error of ``x @ w`` drops on
    every one of 8 independent draws. Quantizing w too, its FP4 error (~0.1, the same with or
    without the transform) is amplified by the outlier channels and dominates ``y``'s error:
    the gain is then smaller and shows on the mean over the draws."""
    mx = QuantSpec("mxfp4")
    pairs = {  # (without, with) the transform
        "x": (GemmSpec(mx, None), GemmSpec(mx, None, hadamard=32)),
        "x and w": (GemmSpec(mx, mx), GemmSpec(mx, mx, hadamard=32)),
    }
    outliers = jnp.zeros(K).at[jnp.array([5, 40, 77, 100])].set(99.0) + 1.0
    xs = jnp.stack([_normal(100 + i, (M, K)) * outliers[None, :] for i in range(8)])
    ws = jnp.stack([_normal(200 + i, (K, N)) for i in range(8)])

    @jax.jit
    def errors(xs, ws):
        def one(x, w):
            exact = _dot(x, w, DN)
            return {
                k: [
                    jnp.linalg.norm(
                        lb.dot_general(x, w, DN, recipe=Recipe(k, fwd=g), key=KEY) - exact
                    )
                    / jnp.linalg.norm(exact)
                    for g in gs
                ]
                for k, gs in pairs.items()
            }

        return jax.vmap(one)(xs, ws)

    errs = errors(xs, ws)
    plain_x, had_x = errs["x"]
    assert np.all(had_x < plain_x), (had_x, plain_x)
    plain_xw, had_xw = errs["x and w"]
    assert np.mean(had_xw) < np.mean(plain_xw), (had_xw, plain_xw)


# ------------------------------------------------------------------------------------------
# 6. NVFP4's per-tensor scale keeps tiny gradients


def test_nvfp4_keeps_tiny_gradients_of_a_mean_reduced_loss():
    """``loss = mean((x @ w)**2)`` over 4096 x 64 outputs: ``dy = 2 y / 262144``, ~3e-5 at most.

    NVFP4 block scales are E4M3 values times a float32 tensor scale ``amax / (6 * 448)``.
    Without it (tensor scale 1) a block scale ``RNE_e4m3(amax_b / 6)`` is 0 whenever
    ``amax_b / 6`` is below half of E4M3's smallest subnormal ``2**-9``, i.e.
    ``amax_b < 6 * 2**-10``: all of this dy flushes to zero. MXFP4's E8M0 scales reach
    2**-127 and keep dy as well.

    Accuracy. The weight gradient sums 4096 products: the FP4 rounding errors of x and dy in
    the wgrad GEMM are independent of the signal and average out, but the forward's error on
    w is coherent (``dw = 2 x.T Q(x) Q(w) / (M N) ~ 2 Q(w) / N``), so the relative error is
    about that of one NVFP4 quantization of a Gaussian tensor, ~0.1 (E2M1 keeps 2 significand
    bits: half a step is 1/8 to 1/4 of a value, averaged over the block's shape). 0.3 leaves
    room for the other roundings, which add in quadrature.
    """
    x = _normal(19, (4096, 64))
    w = _normal(20, (64, 64), 0.1)

    @jax.jit
    def run(x, w):
        def loss(w, recipe):
            return jnp.mean(jnp.square(lb.dot_general(x, w, DN, recipe=recipe, key=KEY)))

        dw_nv, dw_32 = (jax.grad(loss)(w, r) for r in ("nvfp4", "none"))
        dy = jax.grad(lambda y: jnp.mean(jnp.square(y)))(_dot(x, w, DN))
        quantized = (
            lb.fake_quantize(dy, "nvfp4"),
            lb.fake_quantize(dy, "mxfp4"),
            lb.fake_quantize(dy, "nvfp4", tensor_amax=6.0 * 448.0),
        )  # t = 1
        return dw_nv, dw_32, dy, quantized

    dw_nv, dw_32, dy, (nv, mx, block_only) = run(x, w)
    assert np.count_nonzero(dw_nv) == dw_nv.size and rel_err(dw_nv, dw_32) < 0.3
    assert float(jnp.max(jnp.abs(dy))) < 6 * 2.0**-10  # tiny: E4M3 alone cannot scale it
    for kept in (nv, mx):
        assert np.count_nonzero(kept) > 0.5 * kept.size and rel_err(kept, dy) < 0.3
    assert not np.any(block_only)


# ------------------------------------------------------------------------------------------
# 7. Transformations: jit, vmap, remat, sharding


@pytest.mark.parametrize("name", ALL)
def test_jit_matches_eager(name):
    """The jitted forward (the program test_matches_reference checks) equals the eager one,
    op by op, bit for bit."""
    x, w, _ = case_inputs()[MK_KN.id]
    eager = lb.dot_general(x, w, DN, recipe=name, key=KEY)
    assert_equal(checked(name)[0][0], eager)


@pytest.mark.parametrize("name,divisor", [("fp8", 448.0), ("nvfp4", 6.0 * 448.0)])
def test_tensor_scales_are_the_same_under_jit(name, divisor):
    """Per-tensor scales must not divide by a constant: under jax.jit XLA rewrites ``x / c``
    into ``x * (1 / c)``, one ulp off for many x. A tensor whose amax ``a`` has
    ``fl(a / c) != fl(a * fl(1 / c))`` would quantize differently in eager and jitted code.
    (The shape is the forward's x, so that the eager ops are already compiled.)"""
    div = np.float32(divisor)
    a = next(
        a
        for a in np.float32(1.0) + np.arange(1, 64, dtype=np.float32) / 64
        if a / div != a * (np.float32(1.0) / div)
    )
    x, _, _ = case_inputs()[MK_KN.id]
    x = x / jnp.max(jnp.abs(x))
    x = x.at[3, 5].set(a)
    spec = recipes.get(name).fwd.lhs

    def q(x):
        return quantize_operand(x, spec, 1, 0, None)

    np.testing.assert_array_equal(jax.jit(q)(x), q(x))


@pytest.mark.parametrize("name", ALL)
def test_vmap_matches_a_loop_of_plain_calls(name):
    """vmap over a leading batch of x (and dy), w and key shared: bit for bit."""
    x, w, dy = case_inputs()[MK_KN.id]
    xb, dyb = _batch(x, dy)
    loop = [plain_call(name, xb[i], w, dyb[i]) for i in range(xb.shape[0])]
    assert_equal(checked(name, "vmap"), [jnp.stack(t) for t in zip(*loop, strict=True)])


@pytest.mark.parametrize("name", ALL)
def test_remat_matches_the_plain_call(name):
    """jax.checkpoint (the forward recomputed in the backward): bit for bit."""
    assert_equal(checked(name, "remat"), checked(name)[0])


def _sharded(name, mesh):
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    x, w, dy = case_inputs()[MK_KN.id]
    f = jax.jit(
        functools.partial(value_and_grads, dn=DN, recipe=_canonical(name)),
        in_shardings=(rows, rep, rows, rep),
        out_shardings=(rows, rows, rep),
    )
    got = f(jax.device_put(x, rows), jax.device_put(w, rep), jax.device_put(dy, rows), KEY)
    assert got[0].sharding.is_equivalent_to(rows, 2) and got[2].sharding.is_equivalent_to(rep, 2)
    return got


def _mesh(axis_type):
    assert len(jax.devices()) >= 4, "conftest sets --xla_force_host_platform_device_count=4"
    return jax.make_mesh((4,), ("data",), axis_types=(axis_type,))


@pytest.mark.parametrize("name", ALL)
def test_sharded_matches_the_plain_call(name):
    """x (and dy) sharded on M over 4 devices, w replicated (GSPMD, Auto axes). Quantization
    is elementwise given the block scales (max reductions, exact in any order), so only the
    GEMMs' summation order may change: within ``2 gamma_n (|A||B|)`` of the plain call,
    with ``A``, ``B`` the quantized operands of the reference."""
    got = _sharded(name, _mesh(AxisType.Auto))
    want, _, _, ops = checked(name)
    dns = (MK_KN.dn, MK_KN.dlhs_dn, MK_KN.drhs_dn)
    for g, e, (a, b), dn in zip(got, want, ops, dns, strict=True):
        assert_within(g, e, gemm_tol(a, b, dn))


@pytest.mark.xfail(
    strict=True,
    reason="lowbit bug: with jax.make_mesh's default Explicit axis types (sharding in types) "
    "quantized recipes fail to trace: the reshapes into blocks and the Hadamard butterflies "
    "of a sharded axis need out_sharding (ShardingTypeError), and the backward's "
    "linear_transpose is given an unsharded ShapeDtypeStruct for a sharded cotangent",
)
def test_sharded_with_explicit_axes():
    got = _sharded("mxfp4", _mesh(AxisType.Explicit))
    want, _, _, ops = checked("mxfp4")
    for g, e, (a, b), dn in zip(
        got, want, ops, (MK_KN.dn, MK_KN.dlhs_dn, MK_KN.drhs_dn), strict=True
    ):
        assert_within(g, e, gemm_tol(a, b, dn))


# ------------------------------------------------------------------------------------------
# 8. einsum


# Stochastic rounding in the forward (the key must reach it) and 2-D weight tiles (their
# second axis depends on the dimension numbers).
EINSUM_RECIPE = Recipe(
    "einsum",
    fwd=GemmSpec(
        QuantSpec("mxfp4", rounding="stochastic"), QuantSpec("nvfp4", block_shape=(16, 16))
    ),
)


def test_einsum_matches_dot_general():
    """Outputs and gradients of einsum equal those of the dot_general it stands for, on the
    two layouts of a transformer, and with a permuted output."""
    cases = [  # subscripts, lhs shape, rhs shape, dimension numbers, output permutation, recipe
        ("btd,df->btf", (2, 16, 64), (64, 32), (((2,), (0,)), ((), ())), (0, 1, 2), EINSUM_RECIPE),
        (
            "bhqd,bhkd->bhqk",
            (2, 2, 16, 64),
            (2, 2, 32, 64),
            (((3,), (3,)), ((0, 1), (0, 1))),
            (0, 1, 2, 3),
            EINSUM_RECIPE,
        ),
        ("btd,df->fbt", (2, 16, 64), (64, 32), (((2,), (0,)), ((), ())), (2, 0, 1), "none"),
    ]
    args = [(_normal(i, c[1]), _normal(i + 10, c[2])) for i, c in enumerate(cases)]

    @jax.jit
    def run(args):
        out = []
        for (spec, _, _, dn, perm, name), (a, b) in zip(cases, args, strict=True):

            def via_einsum(a, b, spec=spec, name=name):
                return lb.einsum(spec, a, b, recipe=name, key=KEY)

            def via_dot(a, b, dn=dn, perm=perm, name=name):
                return jnp.transpose(lb.dot_general(a, b, dn, recipe=name, key=KEY), perm)

            ys = [jax.vjp(f, a, b) for f in (via_einsum, via_dot)]
            cot = jnp.cos(jnp.arange(ys[0][0].size, dtype=jnp.float32)).reshape(ys[0][0].shape)
            out.append([(y, *vjp(cot)) for y, vjp in ys])
        return out

    for via_einsum, via_dot in run(args):
        assert_equal(via_einsum, via_dot)


def test_einsum_sums_labels_missing_from_the_output():
    """t appears only in x and not in the output: summed out first, then contracted. Both
    that and jnp.einsum compute ``sum_{t,d} x[b,t,d] w[d,f]`` in float32, each within
    ``gamma_{T+D} sum |x| |w|`` of the exact value (T + D roundings on any path)."""
    x, w = _normal(46, (2, 8, 64)), _normal(47, (64, 32))
    n = 8 + 64
    gamma = n * U32 / (1 - n * U32)
    bound = 2 * gamma * (1 + gamma) * (jnp.sum(jnp.abs(x), axis=1) @ jnp.abs(w))
    assert_within(lb.einsum("btd,df->bf", x, w), jnp.einsum("btd,df->bf", x, w), bound)


@pytest.mark.parametrize(
    "spec",
    [
        "btd,df",
        "btd,df,fg->btg",
        "bt...,df->btf",
        "btd,d->bt",
        "bbd,df->bbf",
        "btd,df->btg",
        "bt1,1f->btf",
        "btd,df->btff",
    ],
)
def test_einsum_bad_subscripts_raise(spec):
    with pytest.raises(ValueError, match="subscripts|'...'"):
        lb.einsum(spec, jnp.ones((2, 3, 32)), jnp.ones((32, 4)))


# ------------------------------------------------------------------------------------------
# 9. Errors


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown recipe 'mxfp3'") as e:
        lb.dot_general(jnp.ones((4, 32)), jnp.ones((32, 4)), DN, recipe="mxfp3")
    assert all(n in str(e.value) for n in ALL)


# The argument checks run when tracing: jax.eval_shape compiles nothing.
F32_64 = jax.ShapeDtypeStruct((64, 64), jnp.float32)


def _trace(recipe="mxfp4", key=None, dn=DN, lhs=F32_64, rhs=F32_64, grad=False):
    def f(x, w):
        return lb.dot_general(x, w, dn, recipe=recipe, key=key)

    if grad:
        return jax.eval_shape(jax.grad(lambda x, w: f(x, w).sum()), lhs, rhs)
    return jax.eval_shape(f, lhs, rhs)


def test_integer_operands_raise():
    for dtype, which in ((jnp.int32, "lhs"), (jnp.int8, "rhs")):
        ints = jax.ShapeDtypeStruct((64, 64), dtype)
        with pytest.raises(TypeError, match=f"{which} must be floating point"):
            _trace(**{which: ints})


def test_stochastic_rounding_without_key_raises():
    sr_fwd = Recipe("sr_fwd", fwd=GemmSpec(QuantSpec("mxfp4", rounding="stochastic"), None))
    with pytest.raises(ValueError, match="pass key"):
        _trace(sr_fwd)
    for residuals in ("high", "quantized"):  # a stochastic backward needs the key too
        with pytest.raises(ValueError, match="pass key"):
            _trace(recipes.get("mxfp4_bwd").replace(residuals=residuals), grad=True)


@pytest.mark.parametrize(
    "bad",
    [
        jnp.zeros(2, jnp.int32),
        jnp.zeros(3, jnp.uint32),
        jnp.zeros((2, 2), jnp.uint32),
        jnp.zeros(2, jnp.float32),
    ],
    ids=["int32", "uint32[3]", "uint32[2,2]", "float32"],
)
def test_bad_key_raises(bad):
    with pytest.raises(TypeError, match="key must be"):
        _trace("nvfp4", key=bad)


def test_quest_options_are_checked():
    """scale_std, trust_mask, signs_of and backward_operands name what does not fit."""
    with pytest.raises(ValueError, match="scale_std must be a finite positive"):
        QuantSpec("mxfp4", scale_std=0.0)
    with pytest.raises(ValueError, match=r"does not combine with nvfp4 \(its scales"):
        QuantSpec("nvfp4", scale_std=2.9)
    with pytest.raises(ValueError, match=r"does not combine with block_shape=\(16, 16\), clip_rms"):
        QuantSpec("mxfp4", scale_std=2.9, block_shape=(16, 16), clip_rms=2.0)
    with pytest.raises(ValueError, match="trust_mask=True needs scale_std"):
        QuantSpec("mxfp4", trust_mask=True)
    with pytest.raises(ValueError, match="signs_of must be one of"):
        GemmSpec(hadamard=32, signs_of="bwd")
    with pytest.raises(ValueError, match=r"drhs.signs_of='dlhs'.*same Hadamard block.*64 and 32"):
        Recipe("r", dlhs=GemmSpec(hadamard=32), drhs=GemmSpec(hadamard=64, signs_of="dlhs"))
    masked = QuantSpec("mxfp4", scale_std=2.9, trust_mask=True)
    with pytest.raises(ValueError, match="dlhs.lhs: trust_mask applies to forward operands"):
        Recipe("r", dlhs=GemmSpec(masked, None))
    with pytest.raises(ValueError, match="backward_operands must be one of"):
        Recipe("r", backward_operands="low")
    with pytest.raises(ValueError, match="residuals='quantized' does not combine"):
        recipes.get("quartet").replace(residuals="quantized")
    odd = jax.ShapeDtypeStruct((64, 48), jnp.float32)  # K = 48: no whole blocks of 32
    with pytest.raises(ValueError, match="scale_std quantizes blocks of 32.*length 48"):
        _trace(Recipe("q", fwd=GemmSpec(masked, None)), lhs=odd,
               rhs=jax.ShapeDtypeStruct((48, 64), jnp.float32))


def test_hadamard_block_must_divide_the_axis():
    odd = jax.ShapeDtypeStruct((96, 96), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 64"):  # K = 96 in the forward
        _trace(Recipe("h64", fwd=GemmSpec(hadamard=64)), lhs=odd, rhs=odd)
    with pytest.raises(ValueError, match="multiple of 64"):  # M = 96 in the weight gradient
        _trace("mxfp4_bwd", key=KEY, lhs=odd, rhs=odd, grad=True)
    with pytest.raises(ValueError, match="power of two"):
        _trace(Recipe("h24", fwd=GemmSpec(hadamard=24)))


@pytest.mark.parametrize(
    "dn", [(((2,), (0,)), ((), ())), (((1,), (-3,)), ((), ())), (((1,), (0,)), ((5,), ()))], ids=str
)
def test_dimension_numbers_out_of_range_raise(dn):
    with pytest.raises(ValueError, match="out of range"):
        _trace(dn=dn)


# ------------------------------------------------------------------------------------------
# Implementations: the same recipe through each path of dot_general


@pytest.mark.skipif(not lb.native.available(), reason="no compiled CPU kernel")
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4", "qat_mxfp6", "quartet", "mxfp4_bwd"])
def test_implementations_agree(name):
    """implementation="xla" (pure XLA) against None with the compiled CPU kernel forced on:
    bit for bit where no Hadamard transform runs before a quantizer; with one, the kernel's
    fused transform follows the butterfly's arithmetic while XLA runs the dense form, so a
    rare element rounds the other way: outputs and gradients agree to 2 % of their norm
    (measured: below 0.5 %; a wrong transform or axis errs by O(1))."""
    x, w, dy = case_inputs()[MK_KN.id]
    recipe = recipes.get(name)

    def run(impl, mode):
        def f(x, w, dy):
            y, vjp = jax.vjp(
                lambda a, b: lb.dot_general(a, b, DN, recipe=recipe, key=KEY, implementation=impl),
                x, w,
            )
            return (y, *vjp(dy))

        with lb.native.mode(mode):
            return jax.jit(f)(x, w, dy)

    xla = run("xla", "on")  # "xla" never takes the kernel, whatever the mode
    native = run(None, "on")
    rotated = any(g.hadamard for g in (recipe.fwd, recipe.dlhs, recipe.drhs))
    for a, b in zip(native, xla, strict=True):
        if rotated:
            assert rel_err(a, b) < 0.02
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # "xla" under mode "on" is the pure-XLA program, None runs the kernel
    def lowered(impl):
        with lb.native.mode("on"):
            return jax.jit(lambda a, b: lb.dot_general(a, b, DN, recipe=recipe, key=KEY,
                                                       implementation=impl)).lower(x, w)

    assert "lowbit_fake_quantize" not in lowered("xla").as_text()
    # (QuEST's std-scaled quantizer, quartet's forward, has no kernel: it runs in XLA ops)
    kernel_specs = [s for s in (recipe.fwd.lhs, recipe.fwd.rhs)
                    if s is not None and s.scale_std is None]
    assert ("lowbit_fake_quantize" in lowered(None).as_text()) == bool(kernel_specs)


@pytest.mark.parametrize("name", ["qat_mxfp4", "w4a16_nvfp4", "quartet", "mxfp8"])
def test_forward_operands_multiply_to_the_forward_output(name):
    """The operands as the forward GEMM multiplies them, in the original basis (a forward
    Hadamard undone): their float32 product is the quantized output, and they are quantized
    (not the inputs) wherever the recipe's forward quantizes."""
    from lowbit.gemm.dot_general import einsum_operands, forward_operands

    x = jax.random.normal(jax.random.key(3), (2, 8, 64))
    w = jax.random.normal(jax.random.key(4), (64, 32))
    dn = (((2,), (0,)), ((), ()))
    r = recipes.get(name)
    lq, rq = jax.jit(lambda x, w: forward_operands(x, w, dn, r, KEY))(x, w)
    y = jax.jit(lambda x, w: lb.dot_general(x, w, dn, recipe=r, key=KEY))(x, w)
    np.testing.assert_allclose(_dot_f32(lq, rq, dn), y, rtol=2e-5, atol=2e-5)
    assert (lq.shape, rq.shape) == (x.shape, w.shape)
    assert (not np.array_equal(lq, x)) == (r.fwd.lhs is not None)
    assert not np.array_equal(rq, w)
    le, re_ = einsum_operands("btk,kn->btn", x, w, recipe=r, key=KEY)
    np.testing.assert_array_equal(le, lq)
    np.testing.assert_array_equal(re_, rq)
    with pytest.raises(ValueError, match="sums a label out of one operand alone"):
        einsum_operands("btk,kn->bn", x, w, recipe=r, key=KEY)


def _dot_f32(a, b, dn):
    return np.asarray(lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST,
                                      preferred_element_type=jnp.float32))
