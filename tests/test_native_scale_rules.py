"""The compiled CPU kernel's NVFP4 block-scale rules against the XLA path, bit for bit: Four
Over Six (``lowbit.core.scales.four_over_six``, arXiv 2512.02010), TetraJet-v2's double-block
scales (``tensor_block``, ``qarray._double_block``) and MS-EDEN (``rounding="eden"``,
``lowbit.core.scales.ms_eden``, Quartet II, arXiv 2601.22813); and the one order of block sums
(``lowbit.core.scales.block_sum``) that lets two implementations agree on them.

Each comparison traces one function under ``lb.native.mode("off")`` and ``mode("on")``
(tests/test_native.py's ``both``: the second must contain the kernel's custom call) and
requires the same bits. The kernel computes ``fake_quantize`` only (``lb.quantize`` has no
kernel), so values are what it can be compared on; the XLA path's QArray of these rules is
tested where the XLA path is (tests/test_quantizer_xla.py, tests/test_recipes_2026*.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.core import native
from lowbit.core import qarray as _qa
from lowbit.core.scales import block_sum, four_over_six
from tests.test_native import assert_identical, both, both_fns, needs_kernel

KEY = jax.random.key_data(jax.random.key(21))


def inputs(kind: str, shape, seed: int = 0) -> np.ndarray:
    """float32 test tensors: Gaussian, heavy-tailed (Student t, df = 2), rows scaled over
    2**-20 .. 2**20, all zeros, and ``special`` (Gaussian with NaN, +-Inf and an all-zero
    block planted)."""
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "student_t":
        return rng.standard_t(2, shape).astype(np.float32)
    x = rng.standard_normal(shape)
    if kind == "rows":
        x = x * np.exp2(rng.integers(-20, 21, shape[:-1] + (1,)))
    if kind == "special":
        flat = x.reshape(-1)
        flat[7] = np.nan
        flat[flat.size // 2] = np.inf
        flat[-3] = -np.inf
        flat[32:48] = 0.0
    return x.astype(np.float32)


KINDS = ["gaussian", "student_t", "rows", "zeros", "special"]


def plan_pair(x, plan, key=None, tensor_amax=None, hadamard=None, signs=None):
    """``fake_quantize_with_plan`` on both paths (the XLA path with the butterfly transform
    when ``hadamard``, as the kernel fuses it)."""
    def reference(x):
        if hadamard is not None:
            x = lb.hadamard.hadamard_transform(x, hadamard, signs=signs, axis=plan.axes[0],
                                               method="butterfly")
        return _qa.fake_quantize_with_plan_xla(x, key, tensor_amax, plan, False)[0]

    def kernel(x):
        return _qa.fake_quantize_with_plan(x, key, tensor_amax, plan, hadamard=hadamard,
                                           signs=signs)[0]

    return both_fns(reference, kernel, jnp.asarray(x))


# --------------------------------------------------------------------------------------------
# block_sum's order, pinned


def _numpy_tree(e: np.ndarray) -> np.float32:
    """An independent float32 halving tree over a 1-D array: e[i] + e[i + n/2] while n is
    even, then left to right."""
    e = e.astype(np.float32)
    while e.size > 1:
        if e.size % 2:
            acc = e[0]
            for v in e[1:]:
                acc = np.float32(acc + v)
            return acc
        h = e.size // 2
        e = (e[:h] + e[h:]).astype(np.float32)
    return e[0]


def _order_sensitive(n: int, seed: int) -> np.ndarray:
    """n float32 values whose sum depends on the order of additions (large values that
    cancel, small ones that survive only in some orders)."""
    rng = np.random.default_rng(seed)
    big = rng.choice([-1.0, 1.0], n) * np.float32(2.0**24) * rng.integers(1, 4, n)
    return np.where(rng.random(n) < 0.5, big, rng.random(n) * 3).astype(np.float32)


@pytest.mark.parametrize("n", [16, 32, 12, 24])
def test_block_sum_is_the_halving_tree(n):
    """block_sum over the last dim equals the numpy halving tree on every row, and on these
    values another order (left to right, numpy's pairwise sum) gives a different result, so
    the test would see an order change."""
    e = np.stack([_order_sensitive(n, seed) for seed in range(64)])
    got = np.asarray(jax.jit(lambda e: block_sum(e, (1,)))(jnp.asarray(e)))[:, 0]
    want = np.array([_numpy_tree(r) for r in e], np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    left_to_right = np.array([np.float32(sum(np.float32(v) for v in r)) for r in e])
    seq = np.zeros(len(e), np.float32)
    for j in range(n):
        seq = (seq + e[:, j]).astype(np.float32)
    assert np.any(seq != want) or np.any(left_to_right != want), "values are order-insensitive"


def test_block_sum_of_a_tile_reduces_the_last_dim_first():
    """A (4, 8) tile: each row's tree first, then the tree of the row sums; reducing the
    rows first gives another result on these values."""
    rng = np.random.default_rng(3)
    tiles = np.stack([_order_sensitive(32, s).reshape(4, 8) for s in range(64)])
    tiles = tiles * rng.choice([1.0, 1e-3], (64, 1, 8)).astype(np.float32)
    got = np.asarray(jax.jit(lambda e: block_sum(e, (1, 2)))(jnp.asarray(tiles)))[:, 0, 0]
    want = np.array([_numpy_tree(np.array([_numpy_tree(r) for r in t])) for t in tiles])
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    cols_first = np.array([_numpy_tree(np.array([_numpy_tree(c) for c in t.T])) for t in tiles])
    assert np.any(cols_first.astype(np.float32) != want.astype(np.float32))


# --------------------------------------------------------------------------------------------
# Four Over Six


@needs_kernel
@pytest.mark.parametrize("scale_mode", ["4over6", "4over6_mae", "4over6_max"])
@pytest.mark.parametrize("rounding,prescale", [("nearest", 1.0), ("stochastic", 16 / 17)])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("kind", KINDS)
def test_four_over_six_matches_the_xla_path(scale_mode, rounding, prescale, axis, kind):
    x = inputs(kind, (40, 72), seed=axis)  # both axes padded to a multiple of 16
    key = KEY if rounding == "stochastic" else None
    plan = _qa.make_plan(x.shape, "nvfp4", axis, None, scale_mode, rounding, key, None,
                         prescale)
    want, got = plan_pair(x, plan, key)
    assert_identical(want, got)


@needs_kernel
def test_four_over_six_picks_both_candidates_and_the_kernel_follows():
    """The comparison means something: on Gaussian blocks both scales get picked (values
    differ from plain NVFP4 and from a 4-everywhere rule), and the kernel agrees."""
    x = inputs("gaussian", (64, 64), seed=5)
    want, got = both(lambda x: lb.fake_quantize(x, "nvfp4", scale_mode="4over6"), jnp.asarray(x))
    assert_identical(want, got)
    plain = np.asarray(lb.fake_quantize(jnp.asarray(x), "nvfp4"))
    assert np.any(np.asarray(got) != plain)


@needs_kernel
@pytest.mark.parametrize("scale_mode", ["4over6", "4over6_max"])
@pytest.mark.parametrize(
    "shape,axes,tile", [((48, 40), (0, 1), (16, 16)), ((20, 48, 5), (0, 1), (8, 16))]
)
def test_four_over_six_tiles_match(scale_mode, shape, axes, tile):
    """2-D tiles (the recipe's weights): the error sums run over the last in-tile dim first;
    the second case walks tiles strided (an axis after the tiled ones), both padded."""
    x = inputs("student_t", shape, seed=len(shape))
    plan = _qa.make_plan(shape, "nvfp4", axes, tile, scale_mode, "nearest", None, None)
    want, got = plan_pair(x, plan)
    assert_identical(want, got)


def _sequential_sum(e, block_axes):
    """A block sum in another order: the in-block elements left to right."""
    e = jnp.moveaxis(e, block_axes, range(e.ndim - len(block_axes), e.ndim))
    flat = e.reshape(*e.shape[: e.ndim - len(block_axes)], -1)
    acc = flat[..., 0]
    for i in range(1, flat.shape[-1]):
        acc = acc + flat[..., i]
    for ax in sorted(block_axes):
        acc = jnp.expand_dims(acc, ax)
    return acc


@needs_kernel
@pytest.mark.parametrize("scale_mode", ["4over6", "4over6_mae"])
@pytest.mark.parametrize("block", [(16,), (32,), (4, 8)])
def test_four_over_six_near_ties_follow_block_sums_order(scale_mode, block, monkeypatch):
    """Blocks whose 4-vs-6 choice depends on the order of the error sums: found among
    integer-valued blocks (many near-ties) by running the XLA path with its errors summed
    left to right; on them the kernel must make block_sum's choice, which differs from the
    left-to-right one (so a kernel adding in another order fails here)."""
    rng = np.random.default_rng(1)
    ba = block[0] if len(block) == 2 else 1
    n = 16384 if block == (32,) else 4096 * ba
    pool = rng.integers(-40, 41, (n, 32)).astype(np.float32) * np.float32(0.37)
    pool[:, 0] = rng.choice(np.float32([5.9, 11.1, 14.8]), len(pool))
    tamax = jnp.float32(np.abs(pool).max())
    axes = -1 if len(block) == 1 else (0, 1)

    def fq(x):
        plan = _qa.make_plan(x.shape, "nvfp4", axes, block, scale_mode, "nearest", None, tamax)
        return _qa.fake_quantize_with_plan(x, None, tamax, plan)[0]

    with native.mode("off"):
        tree = np.asarray(jax.jit(fq)(jnp.asarray(pool)))
        with monkeypatch.context() as m:
            m.setattr(_qa, "four_over_six",
                      functools.partial(four_over_six, sum_=_sequential_sum))
            seq = np.asarray(jax.jit(lambda x: fq(x))(jnp.asarray(pool)))
    groups = np.nonzero(np.any((tree != seq).reshape(-1, ba * 32), axis=1))[0][:32]
    assert groups.size >= 2, "no order-sensitive blocks in the pool"
    rows = (groups[:, None] * ba + np.arange(ba)).reshape(-1)
    x = jnp.asarray(pool[rows])
    want, got = both(fq, x)
    assert_identical(want, got)
    assert_identical(want, tree[rows])
    assert np.any(np.asarray(got) != seq[rows])


@needs_kernel
@pytest.mark.parametrize("tensor_amax", [0.0, 1e-30, 0.5, 3.0])
def test_four_over_six_calibrated_tensor_amax_matches(tensor_amax):
    """0 and a tiny amax zero the tensor (encode overflows); below the data's amax the
    scales saturate."""
    x = inputs("student_t", (16, 64), seed=2)
    want, got = both(
        lambda x, t: lb.fake_quantize(x, "nvfp4", scale_mode="4over6_mae", tensor_amax=t),
        jnp.asarray(x), jnp.float32(tensor_amax))
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("axis,rounding", [(-1, "stochastic"), (0, "nearest")])
def test_four_over_six_with_a_fused_hadamard_and_large_arrays_match(axis, rounding):
    """A fused Hadamard transform (its tensor amax is the transformed one's), and above 2**16
    elements (work split over threads)."""
    x = inputs("student_t", (256, 320), seed=9)
    key = KEY if rounding == "stochastic" else None
    plan = _qa.make_plan(x.shape, "nvfp4", axis, None, "4over6", rounding, key, None)
    signs = lb.hadamard.random_signs(jax.random.key(4), 32)
    want, got = plan_pair(x, plan, key, hadamard=32, signs=signs)
    assert_identical(want, got)
    want, got = plan_pair(x, plan, key)
    assert_identical(want, got)


# --------------------------------------------------------------------------------------------
# Double-block scales (TetraJet-v2)


@needs_kernel
@pytest.mark.parametrize("tensor_block", [128, 64, 16])
@pytest.mark.parametrize("rounding,prescale", [("nearest", 1.0), ("stochastic", 0.75)])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("kind", KINDS)
def test_double_block_matches_the_xla_path(tensor_block, rounding, prescale, axis, kind):
    """Axis lengths 200 (a ragged last outer block: 208 = 128 + 80, or 3 * 64 + 16) and 48."""
    shape = (48, 200) if axis == 1 else (200, 48)
    x = inputs(kind, shape, seed=tensor_block)
    key = KEY if rounding == "stochastic" else None
    plan = _qa.make_plan(shape, "nvfp4", axis, None, None, rounding, key, None, prescale,
                         tensor_block=tensor_block)
    want, got = plan_pair(x, plan, key)
    assert_identical(want, got)


@needs_kernel
def test_double_block_zero_block_scales_keep_the_sign_of_zero():
    """A block far below its outer block's amax gets block scale 0; its negative elements
    come out -0 on the XLA path (x * 0), and so in the kernel."""
    x = np.full((4, 128), -1e-6, np.float32)
    x[:, 0] = 1e3
    want, got = both(lambda x: lb.fake_quantize(x, "nvfp4", tensor_block=128), jnp.asarray(x))
    assert np.any(np.signbit(np.asarray(want)) & (np.asarray(want) == 0))
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("axis", [-1, 0])
def test_double_block_fused_hadamard_large_and_3d_match(axis):
    x = inputs("rows", (256, 384), seed=4)
    plan = _qa.make_plan(x.shape, "nvfp4", axis, None, None, "stochastic", KEY, None,
                         tensor_block=128)
    signs = lb.hadamard.random_signs(jax.random.key(6), 128)
    want, got = plan_pair(x, plan, KEY, hadamard=128, signs=signs)
    assert_identical(want, got)
    want, got = plan_pair(x, plan, KEY)
    assert_identical(want, got)
    x3 = inputs("special", (3, 80, 6), seed=1)
    want, got = both(lambda x: lb.fake_quantize(x, "nvfp4", 1, tensor_block=32), jnp.asarray(x3))
    assert_identical(want, got)


# --------------------------------------------------------------------------------------------
# MS-EDEN


@needs_kernel
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("kind", KINDS)
def test_eden_matches_the_xla_path(axis, kind):
    x = inputs(kind, (40, 72), seed=axis + 7)
    want, got = both(
        lambda x, k: lb.fake_quantize(x, "nvfp4", axis, rounding="eden", key=k),
        jnp.asarray(x), KEY)
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize(
    "shape,axes,block", [((48, 40), (0, 1), (16, 16)), ((3, 50, 6), 1, (16,)),
                         ((4, 96), -1, (32,)), ((2, 24, 40), (0, 2), (8, 8))]
)
def test_eden_blocks_and_tiles_match(shape, axes, block):
    """Other blocks (the block sums of 32, 8 x 8 tiles with an axis between) and a middle
    axis walked strided."""
    x = inputs("student_t", shape, seed=len(shape))
    plan = _qa.make_plan(shape, "nvfp4", axes, block, None, "eden", KEY, None)
    want, got = plan_pair(x, plan, KEY)
    assert_identical(want, got)


@needs_kernel
@pytest.mark.parametrize("axis", [-1, 0])
def test_eden_after_a_fused_hadamard_on_large_arrays_matches(axis):
    """Quartet II's backward: a random Hadamard of 128, then MS-EDEN, split over threads
    (the tensor scale is the largest corrected scale over every thread's blocks)."""
    x = inputs("student_t", (256, 384), seed=11)
    x[100, 200] = 5e3
    plan = _qa.make_plan(x.shape, "nvfp4", axis, None, None, "eden", KEY, None)
    signs = lb.hadamard.random_signs(jax.random.key(8), 128)
    want, got = plan_pair(x, plan, KEY, hadamard=128, signs=signs)
    assert_identical(want, got)


@needs_kernel
def test_eden_under_vmap_and_other_keys_matches():
    """One tensor scale per slice; the key changes the scales' rounding."""
    x = jnp.asarray(inputs("rows", (3, 16, 64), seed=2))
    keys = jnp.stack([jax.random.key_data(jax.random.key(s)) for s in range(3)])
    f = jax.vmap(lambda x, k: lb.fake_quantize(x, "nvfp4", rounding="eden", key=k))
    want, got = both(f, x, keys)
    assert_identical(want, got)
    other, _ = both(f, x, keys[::-1])
    assert np.any(np.asarray(other) != np.asarray(got))


def test_supports_takes_the_rules():
    def plan(**kw):
        return _qa.make_plan((32, 64), "nvfp4", -1, kw.pop("block", None), kw.pop("mode", None),
                             kw.pop("rounding", "nearest"), KEY, None, **kw)

    for p in (plan(mode="4over6"), plan(mode="4over6_max", block=(16, 16)),
              plan(tensor_block=128), plan(rounding="eden")):
        assert native.supports(p) and native.supports(p, 64) is (len(p.axes) == 1)
    attrs = native.plan_attributes(plan(mode="4over6_mae"))
    assert (int(attrs["rule"]), int(attrs["metric"])) == (1, 1)
    assert int(native.plan_attributes(plan(tensor_block=64))["tensor_block"]) == 64
    eden = native.plan_attributes(plan(rounding="eden"))
    assert int(eden["rule"]) == 3 and float(eden["eden_inv_fp4_max"]) > 0


@needs_kernel
@pytest.mark.parametrize("mag", [1e-30, 1e-33, 3e-34])
def test_a_subnormal_double_block_product_quantizes_to_zero_everywhere(mag):
    # an outer block of values near 1e-33 has S ~ 1e-36; an all-zero block in it gets
    # s = 2**-9, and S * s is a float32 subnormal: counted as 0 (XLA:CPU would flush it and
    # 1 / 0 made the elements NaN), so those elements are 0 and nothing is NaN
    x = np.zeros((4, 256), np.float32)
    x[0] = np.random.default_rng(0).standard_normal(256).astype(np.float32) * np.float32(mag)
    x[0, 16:32] = 0
    x[1] = np.random.default_rng(1).standard_normal(256)
    want, got = both(lambda a: lb.fake_quantize(a, "nvfp4", tensor_block=128), jnp.asarray(x))
    assert_identical(want, got)
    assert not np.isnan(np.asarray(want)).any()
    np.testing.assert_array_equal(np.asarray(want)[0, 16:32], 0)
    deq = lb.dequantize(lb.quantize(jnp.asarray(x), "nvfp4", tensor_block=128))
    assert_identical(want, deq)
