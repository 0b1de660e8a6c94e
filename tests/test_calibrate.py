"""lowbit.calibrate: histograms, amax methods, weight block-scale search.

References are independent of the code under test: numpy binning, numpy / scipy percentiles,
ml_dtypes casts for per-tensor FP8, a direct numpy transcription of TensorRT's KL loop, and
errors measured on ``lowbit.dequantize`` of the returned QArray.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from scipy import stats

import lowbit as lb
from lowbit.calibrate import NUM_BINS, Histogram, amax, block_scales, kl_divergences

# jitted once per static configuration: eager calls compile every operation separately
quantize = jax.jit(lb.quantize, static_argnums=(1, 2), static_argnames=("block_shape",))
dequantize = jax.jit(lb.dequantize)
block_scales_jit = jax.jit(block_scales, static_argnums=(1, 2),
                           static_argnames=("axis", "block_shape"))


def rng(seed=0):
    return np.random.default_rng(seed)


def numpy_histogram(x):
    """NUM_BINS bins of |x| with the power-of-two width rule of Histogram's docstring."""
    a = np.abs(np.asarray(x, np.float64)).ravel()
    width = 2.0 ** max(math.floor(math.log2(a.max())) - 10, -126)
    return np.bincount(np.floor(a / width).astype(np.int64), minlength=NUM_BINS), width


def assert_same_histogram(h, g):
    np.testing.assert_array_equal(h.counts, g.counts)
    assert int(h.width_exp) == int(g.width_exp)
    assert float(h.max) == float(g.max)
    assert int(h.nonfinite) == int(g.nonfinite)


# --------------------------------------------------------------------------------------------
# Histogram


def test_histogram_matches_numpy_binning():
    x = rng().standard_normal(5000).astype(np.float32) * 3.0
    h = Histogram.of(x)
    counts, width = numpy_histogram(x)
    np.testing.assert_array_equal(h.counts, counts)
    assert float(h.width) == width and int(h.count) == x.size
    assert float(h.max) == np.abs(x).max()
    # the data fill between half and all of the bins
    assert NUM_BINS // 2 <= np.flatnonzero(counts).max() < NUM_BINS


def test_histogram_merge_and_update_equal_the_histogram_of_the_concatenation():
    g = rng(1)
    # ranges growing by 10**4 (the width doubles ~13 times), shrinking, and all-zero batches
    batches = [g.standard_normal(700).astype(np.float32) * s for s in (1e-2, 1.0, 1e2, 3e-3)]
    batches.insert(1, np.zeros(50, np.float32))
    whole = Histogram.of(np.concatenate(batches))
    h = Histogram.of(batches[0])
    for b in batches[1:]:
        h = h.update(b)
    assert_same_histogram(h, whole)
    assert int(Histogram.of(batches[0]).width_exp) < int(whole.width_exp)
    # merge in another order and grouping (exact: commutative and associative)
    hs = [Histogram.of(b) for b in batches]
    m = hs[3].merge(hs[0]).merge(hs[4].merge(hs[2])).merge(hs[1])
    assert_same_histogram(m, whole)
    assert_same_histogram(Histogram.empty().merge(whole), whole)
    np.testing.assert_array_equal(whole.counts, numpy_histogram(np.concatenate(batches))[0])


def test_histogram_merged_across_a_mapped_axis():
    x = rng(2).standard_t(3, size=(4, 500)).astype(np.float32) * np.array([[1], [10], [0.1], [3]])
    x = x.astype(np.float32)
    whole = Histogram.of(x)
    per_row = jax.jit(jax.vmap(lambda b: Histogram.of(b).merge_across("rows"), axis_name="rows"))(x)
    for r in range(4):
        assert_same_histogram(jax.tree.map(lambda a, r=r: a[r], per_row), whole)


def test_nonfinite_data():
    x = np.array([1.0, np.nan, 2.0, np.inf], np.float32)
    for f in (Histogram.of, lambda x: amax(x, "max"), lambda x: block_scales(x, "mxfp4")):
        with pytest.raises(ValueError, match="NaN or Inf"):
            f(x)
    # under jit they cannot raise: counted, left out of the bins, and amax is NaN
    h = jax.jit(Histogram.of)(x)
    assert int(h.nonfinite) == 2 and int(h.count) == 2 and float(h.max) == 2.0
    assert np.isnan(jax.jit(lambda h: amax(h, "max"))(h))
    assert np.isnan(jax.jit(lambda x: amax(x, "percentile"))(x))
    with pytest.raises(ValueError, match="NaN or Inf"):
        amax(h, "percentile")


# --------------------------------------------------------------------------------------------
# max and percentile


def test_max():
    x = rng(3).standard_normal((8, 33)).astype(np.float32)
    assert float(amax(x, "max")) == np.abs(x).max()
    assert float(amax(Histogram.of(x[:4]).update(x[4:]), "max")) == np.abs(x).max()
    assert amax(x, "max").dtype == jnp.float32 and amax(x, "max").shape == ()


def test_percentile_of_a_half_normal_sample():
    n = 1_000_000
    a = np.abs(rng(4).standard_normal(n)).astype(np.float32)
    h = Histogram.of(a)
    w = float(h.width)
    for p in (50.0, 99.0, 99.99):
        sample_q = np.percentile(a, p)
        # from the raw array: numpy's percentile
        assert float(amax(a, "percentile", percentile=p)) == np.float32(sample_q)
        # from the histogram: in the sample percentile's bin
        est = float(amax(h, "percentile", percentile=p))
        assert abs(est - sample_q) <= w, (p, est, sample_q, w)
        # and near the true quantile: one bin plus 4 standard deviations of a sample quantile,
        # sqrt(q (1 - q) / n) / pdf(x_q)
        true = stats.halfnorm.ppf(p / 100)
        sd = math.sqrt(p / 100 * (1 - p / 100) / n) / stats.halfnorm.pdf(true)
        assert abs(est - true) <= w + 4 * sd, (p, est, true, w, sd)


# --------------------------------------------------------------------------------------------
# mse


def e4m3_tensor_reference(x, a):
    """Per-tensor E4M3 with amax ``a`` through ml_dtypes (round to nearest even)."""
    s = np.float32(448.0) / np.float32(a)
    v = np.clip(x * s, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return v / s


def sweep_errors(x, fmt, amaxes):
    """Mean squared error of quantizing ``x`` with each amax, through lowbit's public API."""
    if fmt == "e4m3":
        return np.array([np.mean((e4m3_tensor_reference(x, a) - x) ** 2) for a in amaxes])
    if fmt == "nvfp4":
        q = lambda a: lb.fake_quantize(x, fmt, tensor_amax=a)
    else:
        q = lambda a: lb.fake_quantize(jnp.clip(x, -a, a), fmt)
    return np.asarray(jax.jit(jax.vmap(lambda a: jnp.mean((q(a) - x) ** 2)))(amaxes))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "mxint8", "e4m3"])
def test_mse_is_least_error_on_a_fine_grid(fmt):
    x = rng(5).standard_t(2, size=(64, 256)).astype(np.float32)
    m = np.abs(x).max()
    a = float(amax(x, "mse", format=fmt))
    grid = (m * np.linspace(0.2, 1.0, 321)).astype(np.float32)
    errs = sweep_errors(x, fmt, np.concatenate([grid, [np.float32(a)]]))
    assert errs[-1] <= 1.01 * errs[:-1].min(), (a, m, errs[-1], errs[:-1].min())
    assert 0.25 * m <= a <= m
    if fmt in ("nvfp4", "e4m3"):  # heavy tails: the optimum clips the largest values
        assert a < m


def test_mse_clips_for_mx_when_it_frees_a_binade():
    # MX block scales are powers of two and float elements keep their relative precision in
    # every binade, so clipping rarely pays; it does for MX INT8 (fixed point) when each
    # block's max sits just above a power of two: clipping under it halves every block's step.
    x = rng(6).uniform(-0.9, 0.9, size=(32, 256)).astype(np.float32)
    x[:, ::32] = 1.01
    a = float(amax(x, "mse", format="mxint8"))
    assert a < 1.0
    errs = sweep_errors(x, "mxint8", np.float32([a, 1.01]))
    assert errs[0] < errs[1]


def test_mse_from_a_histogram_weights_bin_centres():
    x = rng(7).standard_t(3, size=(16, 256)).astype(np.float32)
    h = Histogram.of(x)
    for fmt in ("e4m3", "nvfp4"):
        a = float(amax(h, "mse", format=fmt))
        assert 0.25 * float(h.max) <= a <= float(h.max)
    # per-tensor FP8 is elementwise, so the histogram's estimate is the data's error at bin
    # resolution: its choice is near-optimal for the data too
    a = float(amax(h, "mse", format="e4m3"))
    m = float(h.max)
    errs = sweep_errors(x, "e4m3", (m * np.float32([a / m] + list(np.linspace(0.25, 1, 76)))))
    assert errs[0] <= 1.05 * errs[1:].min()


# --------------------------------------------------------------------------------------------
# entropy


def test_kl_divergences_by_hand():
    # counts [1, 3, 2, 2, 1], 2 levels; clip point i keeps bins 0..i-1
    i, kl = kl_divergences(jnp.array([1, 3, 2, 2, 1]), 2)
    assert i.tolist() == [2, 3, 4, 5]
    # i=2: P = [1, 3+2+2+1] / 9; Q: one bin per level, [1, 3] / 4
    kl2 = 1 / 9 * math.log((1 / 9) / (1 / 4)) + 8 / 9 * math.log((8 / 9) / (3 / 4))
    # i=3: P = [1, 3, 2+3] / 9; groups floor(j*2/3) = [0, 0, 1]: Q = [2, 2, 2] / 6
    kl3 = 1 / 9 * math.log(3 / 9) + 3 / 9 * math.log(9 / 9) + 5 / 9 * math.log(15 / 9)
    # i=4: P = [1, 3, 2, 2+1] / 9; groups [0, 0, 1, 1]: Q = [2, 2, 2, 2] / 8
    kl4 = 1 / 9 * math.log(4 / 9) + 3 / 9 * math.log(12 / 9) + 2 / 9 * math.log(8 / 9) + (
        3 / 9 * math.log(12 / 9))
    # i=5: P = counts / 9; groups floor(j*2/5) = [0, 0, 0, 1, 1]: Q = [2, 2, 2, 1.5, 1.5] / 9
    kl5 = (1 * math.log(1 / 2) + 3 * math.log(3 / 2) + 2 * math.log(1) + 2 * math.log(2 / 1.5)
           + 1 * math.log(1 / 1.5)) / 9
    np.testing.assert_allclose(kl, [kl2, kl3, kl4, kl5], rtol=1e-5)
    # [2, 2, 0, 4, 0]: i=2: P = [2, 6] / 8, Q = [1, 1] / 2; i=3: the empty bin 2 receives the
    # outliers (P > 0 where Q = 0); i=4, 5: every group has one value or two equal ones: Q = P
    _, kl = kl_divergences(jnp.array([2, 2, 0, 4, 0]), 2)
    kl2 = 2 / 8 * math.log((2 / 8) / (1 / 2)) + 6 / 8 * math.log((6 / 8) / (1 / 2))
    np.testing.assert_allclose(kl, [kl2, np.inf, 0.0, 0.0], rtol=1e-5, atol=1e-7)


def tensorrt_kl(counts, levels):
    """TensorRT's loop, float64: {i: KL} for i in levels..len(counts)."""
    counts = np.asarray(counts, np.float64)
    out = {}
    for i in range(levels, len(counts) + 1):
        p = counts[:i].copy()
        p[-1] += counts[i:].sum()
        c = counts[:i]
        groups = np.arange(i) * levels // i
        total = np.bincount(groups, weights=c, minlength=levels)
        nonempty = np.bincount(groups, weights=c > 0, minlength=levels)
        q = np.where(c > 0, total[groups] / np.maximum(nonempty[groups], 1), 0.0)
        p, q = p / p.sum(), q / q.sum()
        if np.any((p > 0) & (q == 0)):
            out[i] = np.inf
            continue
        nz = p > 0
        out[i] = float(np.sum(p[nz] * np.log(p[nz] / q[nz])))
    return out


def test_entropy_amax_is_the_clip_of_least_divergence():
    x = rng(8).laplace(size=20_000).astype(np.float32)
    h = Histogram.of(x)
    ref = tensorrt_kl(np.asarray(h.counts), 8)  # E2M1: 8 magnitudes
    best = min(ref.values())
    a = float(amax(h, "entropy", format="mxfp4"))
    assert a < float(h.max)
    i = round(a / float(h.width))
    assert a == i * float(h.width) and ref[i] <= best + 1e-5, (i, ref[i], best)
    # from the array (its histogram), and the per-tensor format's levels (127 for E4M3)
    assert float(amax(x, "entropy", format="mxfp4")) == a
    kl_e4m3 = tensorrt_kl(np.asarray(h.counts), 127)
    i = round(float(amax(h, "entropy", format="e4m3")) / float(h.width))
    assert kl_e4m3[i] <= min(kl_e4m3.values()) + 1e-5


# --------------------------------------------------------------------------------------------
# block_scales


def block_errors(y, w, axis, block_shape):
    """Squared error per block of the [R, C] weight."""
    d = np.square(np.asarray(y, np.float64) - np.asarray(w, np.float64))
    if block_shape is not None:  # 2-D tiles over (0, 1)
        b0, b1 = block_shape
        return d.reshape(d.shape[0] // b0, b0, d.shape[1] // b1, b1).sum(axis=(1, 3))
    d = d if axis in (-1, 1) else d.T
    b = 16 if d.shape[1] % 32 else 32
    return d.reshape(d.shape[0], -1, b).sum(-1)


CASES = [  # (format, axis, block_shape, dtype): 1-D blocks along either axis, 16 x 16 tiles
    ("nvfp4", -1, None, np.float32),
    ("nvfp4", (0, 1), (16, 16), np.float32),
    ("mxfp4", -1, None, np.float32),
    ("mxfp6_e3m2", 0, None, jnp.bfloat16),
]


@pytest.mark.parametrize("fmt,axis,block_shape,dtype", CASES)
def test_block_scales(fmt, axis, block_shape, dtype):
    w = rng(9).standard_normal((64, 128)).astype(np.float32)
    w[3, 5] = 40.0  # an outlier: a small tensor scale relative to most NVFP4 blocks
    w = jnp.asarray(w, dtype)
    std = quantize(w, fmt, axis, block_shape=block_shape)
    mx = block_scales(w, fmt, "max", axis=axis, block_shape=block_shape)
    for a, b in zip(jax.tree.leaves(std), jax.tree.leaves(mx), strict=True):
        np.testing.assert_array_equal(a, b)
    if fmt == "mxfp4":  # under jit too
        q = block_scales_jit(w, fmt, "mse", axis=axis, block_shape=block_shape)
    else:
        q = block_scales(w, fmt, "mse", axis=axis, block_shape=block_shape)
    # an ordinary QArray: same pytree, shapes, dtypes, metadata and storage
    assert jax.tree.structure(q) == jax.tree.structure(std)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(std), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert q.nbytes == std.nbytes and q.dtype == w.dtype
    y_std, y = dequantize(std), dequantize(q)
    assert y.dtype == w.dtype
    w = np.asarray(w, np.float32)
    e_std = block_errors(y_std, w, axis, block_shape)
    e_mse = block_errors(y, w, axis, block_shape)
    assert np.all(e_mse <= e_std)
    assert e_mse.sum() < e_std.sum()
    if fmt == "mxfp4":  # each block's error is the least over exponents e - 1, e, e + 1
        blocks = w.reshape(64, -1, 32).astype(np.float64)
        e = np.floor(np.log2(np.abs(blocks).max(-1, keepdims=True))) - 2  # OCP floor rule
        errs = []
        for d in (-1, 0, 1):
            s = 2.0 ** (e + d)
            v = np.clip(blocks / s, -6, 6).astype(np.float32).astype(ml_dtypes.float4_e2m1fn)
            errs.append(((v.astype(np.float64) * s - blocks) ** 2).sum(-1))
        np.testing.assert_allclose(e_mse, np.min(errs, axis=0), rtol=1e-9)
    # some blocks keep the standard scale, some change
    same = np.asarray(q.scales == std.scales)
    assert same.any() and not same.all()


# --------------------------------------------------------------------------------------------
# Errors


def test_clear_errors():
    x = rng(11).standard_normal(64).astype(np.float32)
    with pytest.raises(ValueError, match=r"method='kl'.*'max', 'percentile', 'mse', 'entropy'"):
        amax(x, "kl")
    for method in ("mse", "entropy"):
        with pytest.raises(ValueError, match="needs format="):
            amax(x, method)
    with pytest.raises(ValueError, match="unknown format"):
        amax(x, "mse", format="fp5")
    for p in (0, -1, 100.5, "99", True):
        with pytest.raises(ValueError, match="percentile"):
            amax(x, "percentile", percentile=p)
    for f in (lambda e: amax(e, "max"), Histogram.of, lambda e: block_scales(e, "nvfp4")):
        with pytest.raises(ValueError, match="empty"):
            f(np.zeros((0, 4), np.float32))
    with pytest.raises(ValueError, match="empty"):
        amax(Histogram.empty(), "max")
    with pytest.raises(ValueError, match=r"method='entropy'.*'max', 'mse'"):
        block_scales(x, "mxfp4", "entropy")
    with pytest.raises(ValueError, match="block format"):
        block_scales(x, "e4m3", "mse")
    with pytest.raises(TypeError, match="floating"):
        amax(np.arange(4), "max")


def test_exported():
    assert lb.calibrate.amax is amax and "calibrate" in lb.__all__


def test_histogram_where_counts_only_the_selected_values():
    x = jax.random.normal(jax.random.key(3), (40, 16)) * 3
    keep = jnp.arange(40)[:, None] < 25
    h = Histogram.of(x.at[25:].set(1e30), where=keep)  # unselected: not seen
    ref = Histogram.of(x[:25])
    np.testing.assert_array_equal(h.counts, ref.counts)
    assert float(h.max) == float(ref.max) and int(h.nonfinite) == 0
    with pytest.raises(ValueError, match=r"Histogram.of: where of shape \(3,\) does not "
                                         r"broadcast to x of shape \(40, 16\)"):
        Histogram.of(x, where=jnp.ones(3, bool))
