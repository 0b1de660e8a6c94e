"""Tests for ``lb.ragged_dot``: the quantized grouped GEMM equals per-group ``lb.dot_general``.

The spec (lowbit/gemm/ragged.py): group ``g``'s outputs and both gradients are those of
``lb.dot_general(lhs[rows of g], rhs[g], recipe, key=fold_in(key, g))`` with the group's rows
zero-padded to a multiple of the recipe's blocks along the tokens. The reference here calls
``lb.dot_general`` group by group on concrete slices (a different program: the ragged op sees
only traced sizes and lays the groups out in its own padded layout).

Exactness. The quantized values must agree bit for bit; the float32 sums of the GEMMs may be
summed in another order. ``test_bit_exact_*`` makes every output and gradient a single product
(each weight a signed selection matrix: one nonzero per row and column; each column of the
output gradient nonzero in one row per group), so any summation order gives the same bits and
any difference is a quantization difference. The other comparisons bound the summation-order
difference by ``2 gamma_n |A| |B|`` (Higham, 3.1), ``n`` the contraction length, computed from
the magnitudes of the unquantized operands times 1.5 (no quantizer here grows a value by more
than 1.5x: a block's largest element maps onto the grid's largest value, the rest round by at
most half a step of it).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.gemm import recipes as R

DN = (((1,), (0,)), ((), ()))
U = 2.0**-24

# Deterministic block recipes that exercise the per-group machinery: the NVFP4 tensor amax
# (given to each tile), 2-D weight tiles, a Hadamard along the tokens, per-tensor FP8.
NV_DET = R.Recipe(
    "nvfp4_rne_test",
    fwd=R.GemmSpec(R.QuantSpec("nvfp4"), R.QuantSpec("nvfp4", block_shape=(16, 16))),
    dlhs=R.GemmSpec(R.QuantSpec("nvfp4"), R.QuantSpec("nvfp4", block_shape=(16, 16))),
    drhs=R.GemmSpec(R.QuantSpec("nvfp4"), R.QuantSpec("nvfp4")),
)
NV_DET_H = R.Recipe(
    "nvfp4_rne_hadamard_test",
    fwd=NV_DET.fwd, dlhs=NV_DET.dlhs,
    drhs=R.GemmSpec(R.QuantSpec("nvfp4"), R.QuantSpec("nvfp4"), hadamard=16),
)
SIZES = (5, 0, 1, 33, 17)  # not block multiples, an empty group, a group of one


def _data(sizes, k=64, n=48, extra=3, seed=0):
    m = sum(sizes) + extra
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k)) * 2.0
    w = jax.random.normal(kw, (len(sizes), k, n))
    return x, w, jnp.array(sizes, jnp.int32)


@functools.partial(jax.jit, static_argnums=(3,))
def _group_vjp(xg, wg, dyg, r, kg):
    yg, vjp = jax.vjp(lambda a, b: lb.dot_general(a, b, DN, recipe=r, key=kg), xg, wg)
    return (yg, *vjp(dyg))


def _reference(x, w, sizes, dy, recipe, key):
    """Per-group lb.dot_general (outputs, dx, dw) on concrete slices, groups zero-padded to
    the recipe's row multiple."""
    r = R.get(recipe)
    pad = lb.gemm.ragged.row_multiple(r)
    y, dx = np.zeros((x.shape[0], w.shape[2]), np.float32), np.zeros(x.shape, np.float32)
    dw = np.zeros(w.shape, np.float32)
    off = 0
    for g, s in enumerate(sizes):
        s = int(s)
        if s == 0:
            continue
        kg = None if key is None else jax.random.key_data(jax.random.fold_in(key, g))
        p = -(-s // pad) * pad
        xg = jnp.zeros((p, x.shape[1])).at[:s].set(x[off:off + s])
        dyg = jnp.zeros((p, w.shape[2])).at[:s].set(dy[off:off + s])
        yg, dxg, dwg = _group_vjp(xg, w[g], dyg, r, kg)
        y[off:off + s], dx[off:off + s], dw[g] = yg[:s], dxg[:s], dwg
        off += s
    return y, dx, dw


@functools.partial(jax.jit, static_argnums=(4,))
def _ragged_vjp(x, w, sizes, dy, recipe, key):
    y, vjp = jax.vjp(lambda a, b: lb.ragged_dot(a, b, sizes, recipe=recipe, key=key), x, w)
    return (y, *vjp(dy))


def _ragged(x, w, sizes, dy, recipe, key):
    return tuple(np.asarray(a) for a in _ragged_vjp(x, w, sizes, dy, R.get(recipe), key))


def _selection(g, k, n, seed):
    """Signed selection matrices [G, K, N]: one nonzero (+-2**e) per row and column."""
    rng = np.random.default_rng(seed)
    w = np.zeros((g, k, n), np.float32)
    for i in range(g):
        rows = rng.permutation(k)[:n]
        w[i, rows, np.arange(n)] = rng.choice([-1, 1], n) * 2.0 ** rng.integers(-2, 3, n)
    return jnp.asarray(w)


def _sparse_dy(sizes, m, n, seed):
    """An output gradient with one nonzero per column within each group's rows."""
    rng = np.random.default_rng(seed)
    dy = np.zeros((m, n), np.float32)
    off = 0
    for s in sizes:
        if s:
            dy[off + rng.integers(0, s, n), np.arange(n)] = rng.normal(size=n)
        off += s
    return jnp.asarray(dy)


@pytest.mark.parametrize("recipe", ["mxfp8", NV_DET, "w4a16_nvfp4", "fp8",
                                    pytest.param("mxfp4", marks=pytest.mark.slow),
                                    pytest.param("qat_mxfp6", marks=pytest.mark.slow)])
def test_bit_exact_against_per_group_dot_general(recipe):
    x, _, sizes = _data(SIZES, k=64, n=32)
    w = _selection(len(SIZES), 64, 32, seed=1)
    dy = _sparse_dy(SIZES, x.shape[0], 32, seed=2)
    want = _reference(x, w, sizes, dy, recipe, None)
    got = _ragged(x, w, sizes, dy, recipe, None)
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} differs")
    assert np.count_nonzero(got[2]) > 0 and np.count_nonzero(got[0]) > 0


def _bound(a, b, n):
    gamma = n * U / (1 - n * U)
    return 2 * gamma * (np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64)))


@pytest.mark.parametrize("recipe", [NV_DET_H, "quartet", "bitnet",
                                    pytest.param("mxfp8", marks=pytest.mark.slow),
                                    pytest.param("tetrajet2", marks=pytest.mark.slow),
                                    pytest.param("four_over_six", marks=pytest.mark.slow)])
def test_dense_inputs_against_per_group_dot_general(recipe):
    """Random dense operands: outputs and gradients within the summation-order bound;
    recipes with stochastic rounding compare only their deterministic forward."""
    x, w, sizes = _data(SIZES, k=64, n=32, seed=3)
    dy = jax.random.normal(jax.random.key(4), (x.shape[0], 32))
    key = jax.random.key(5)
    want = _reference(x, w, sizes, dy, recipe, key)
    got = _ragged(x, w, sizes, dy, recipe, key)
    k = x.shape[1]
    ws = 1.5 * np.abs(np.asarray(w))
    xs = 1.5 * np.abs(np.asarray(x))
    off, ys = 0, np.zeros(want[0].shape)
    for g, s in enumerate(SIZES):
        ys[off:off + s] = _bound(xs[off:off + s], ws[g], k)
        off += s
    assert np.all(np.abs(got[0] - want[0]) <= ys), "forward outside the summation bound"
    assert np.all(got[0][sum(SIZES):] == 0)
    r = R.get(recipe)
    if not any(s is not None and s.stochastic for gm in (r.dlhs, r.drhs)
               for s in (gm.lhs, gm.rhs)):
        scale = np.abs(want[2]).max()
        np.testing.assert_allclose(got[2], want[2], rtol=0, atol=1e-5 * scale)
        np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-5 * np.abs(want[1]).max())


@pytest.mark.parametrize("recipe", ["nvfp4", "quartet2",
                                    pytest.param("mxfp4_bwd", marks=pytest.mark.slow)])
def test_one_groups_gradient_moves_no_other_groups_weight_gradient(recipe):
    """Blocks, tensor scales, Hadamard signs and rounding streams are confined to a group:
    changing group 0's output gradient leaves every other group's weight gradient unchanged,
    bit for bit (stochastic rounding included)."""
    x, w, sizes = _data((7, 20, 3, 40), k=128, n=128, seed=6)
    dy = jax.random.normal(jax.random.key(7), (x.shape[0], 128))
    key = jax.random.key(8)
    _, _, dw = _ragged(x, w, sizes, dy, recipe, key)
    dy2 = dy.at[:7].mul(-3.0).at[:7, 0].set(1e4)
    _, dx2, dw2 = _ragged(x, w, sizes, dy2, recipe, key)
    np.testing.assert_array_equal(dw[1:], dw2[1:])
    assert not np.array_equal(dw[0], dw2[0])
    assert np.all(np.isfinite(dx2))


def _q64(x, fmt):
    """An independent float64 MX / NVFP4 fake-quantizer along the last axis (tests/reference)."""
    from tests import reference as ref

    if fmt == "nvfp4":
        return ref.nvfp4_quantize(np.asarray(x, np.float32), axis=-1).values.astype(np.float64)
    return ref.mx_quantize(np.asarray(x, np.float32), fmt, axis=-1).values.astype(np.float64)


@pytest.mark.parametrize("recipe,wfmt,xfmt", [("w4a16_mxfp4", "mxfp4", None),
                                               ("qat_mxfp8", "mxfp8_e4m3", "mxfp8_e4m3")])
def test_gradients_against_a_float64_reference(recipe, wfmt, xfmt):
    """Straight-through gradients of a weight-only and a W+A recipe, per group in float64:
    dx = dy Q(W_g)^T, dW_g = Q(x_g)^T dy."""
    sizes = (9, 0, 30, 1)
    x, w, gs = _data(sizes, k=64, n=32, seed=9)
    dy = jax.random.normal(jax.random.key(10), (x.shape[0], 32))
    _, dx, dw = _ragged(x, w, gs, dy, recipe, None)
    xn, dyn = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    off = 0
    for g, s in enumerate(sizes):
        wq = np.swapaxes(_q64(np.swapaxes(np.asarray(w[g]), 0, 1), wfmt), 0, 1)
        xg = xn[off:off + s]
        xq = xg if xfmt is None else _q64(xg, xfmt)
        want_dx = dyn[off:off + s] @ wq.T
        want_dw = xq.T @ dyn[off:off + s]
        np.testing.assert_allclose(dx[off:off + s], want_dx, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(dw[g], want_dw, rtol=2e-5, atol=2e-5)
        off += s
    assert np.all(dw[1] == 0) and np.all(dx[sum(sizes):] == 0)


def test_none_equals_lax_ragged_dot_and_jit_with_traced_sizes():
    x, w, sizes = _data(SIZES, seed=11)
    want = jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)
    got = jax.jit(lambda a, b, s: lb.ragged_dot(a, b, s))(x, w, sizes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    g_want = jax.grad(lambda b: jnp.sum(jax.lax.ragged_dot(x, b, sizes) ** 2))(w)
    g_got = jax.grad(lambda b: jnp.sum(lb.ragged_dot(x, b, sizes) ** 2))(w)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-4, atol=1e-3)
    bad = jax.jit(lambda s: lb.ragged_dot(x, w, s))(sizes.at[0].set(-1))
    assert np.all(np.isnan(bad))


def test_bfloat16_operands_keep_their_dtype():
    x, w, sizes = _data((4, 12), seed=12)
    f = jax.jit(lambda a, b: lb.ragged_dot(a, b, sizes, recipe="mxfp8"))
    y = f(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    dw = jax.jit(jax.grad(lambda b: jnp.sum(f(x, b))))(w.astype(jnp.bfloat16))
    assert dw.dtype == jnp.bfloat16


@pytest.mark.parametrize("sizes,match", [
    ((30, 20), "sum to 50, more than lhs's 40 rows"),
    ((-1, 3), "must be >= 0"),
    ((3, 3, 3), "has 3 groups but rhs"),
])
def test_bad_group_sizes_are_named(sizes, match):
    x, w, _ = _data((20, 17), seed=13)
    with pytest.raises(ValueError, match=match):
        lb.ragged_dot(x, w, jnp.array(sizes, jnp.int32))


def test_bad_operands_and_ungroupable_recipes_are_named():
    x, w, sizes = _data((4, 4), seed=14)
    with pytest.raises(ValueError, match=r"rhs must be \[G, K, N\]"):
        lb.ragged_dot(x, w[0], sizes)
    with pytest.raises(ValueError, match="1-D integer"):
        lb.ragged_dot(x, w, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="qat_ternary.*mean over the whole tensor"):
        lb.ragged_dot(x, w, sizes, recipe="qat_ternary")
    clipped = R.Recipe("rms_rows", fwd=R.GemmSpec(None, None),
                       drhs=R.GemmSpec(R.QuantSpec("mxfp4", clip_rms=2.0), None))
    with pytest.raises(ValueError, match="RMS over a group's rows"):
        lb.ragged_dot(x, w, sizes, recipe=clipped)
    with pytest.raises(ValueError, match="pass key="):
        lb.ragged_dot(x, w, sizes, recipe=R.Recipe(
            "sr_fwd", fwd=R.GemmSpec(R.QuantSpec("mxfp4", rounding="stochastic"), None)))


@pytest.mark.parametrize("recipe", ["qat_nvfp4", pytest.param("mxfp8", marks=pytest.mark.slow),
                                    pytest.param("w4a16_mxfp4", marks=pytest.mark.slow)])
def test_the_grouped_kernel_in_interpret_mode_equals_the_emulation(recipe):
    """implementation="pallas" (interpret mode): the forward and input-gradient GEMMs through
    pallas_kernels.grouped_matmul, the weight gradient emulated; the same numbers up to
    float32 summation order (every GEMM's relative error under 1e-5)."""
    from lowbit.gemm.implementation import resolve

    x, w, sizes = _data((20, 0, 1, 60), k=128, n=64, seed=15)
    dy = jax.random.normal(jax.random.key(16), (x.shape[0], 64))

    def run(impl):
        y, vjp = jax.vjp(lambda a, b: lb.ragged_dot(a, b, sizes, recipe=recipe,
                                                    implementation=impl), x, w)
        return (y, *vjp(dy))

    got = run(resolve("pallas", interpret=True))
    want = run("xla")
    for a, b in zip(got, want, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b)))


def test_the_grouped_kernel_lowers_for_cuda_and_names_what_it_cannot_take():
    from pallas_kernels._common import export_for_cuda

    x, w, sizes = _data((20, 0, 1, 60), k=128, n=64, seed=17)

    def step(x, w, s):
        return jax.value_and_grad(
            lambda a, b: jnp.sum(lb.ragged_dot(a, b, s, recipe="mxfp8",
                                               implementation="pallas") ** 2),
            argnums=(0, 1))(x, w)

    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    text = export_for_cuda(step, spec(x), spec(w), spec(sizes)).mlir_module()
    assert text.count("grouped_matmul_mxfp8_e4m3_mxfp8_e4m3") >= 2  # forward and dx
    with pytest.warns(UserWarning, match="instead of the grouped kernel: nvfp4 with "
                                         r"block_shape \(16, 16\)"):
        lb.ragged_dot(x, w, sizes, recipe="nvfp4", implementation="pallas")
