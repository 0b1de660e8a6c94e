"""Calibration: choosing the static scales of post-training quantization from data.

What is calibrated, and what is not:

- NVFP4 activations: the per-tensor scale, through a static ``tensor_amax`` (see
  :func:`lowbit.quantize`). Their E4M3 block scales stay dynamic, computed from each block as
  the hardware computes them.
- Per-tensor FP8 activations (``"e4m3"`` / ``"e5m2"`` elements, the ``fp8`` recipe): the
  tensor's one float32 scale, ``elem_max / amax``.
- Weights: their block scales, searched per block by :func:`block_scales`.
- MX activations: nothing. Their E8M0 block scales are dynamic by definition; an amax found
  here for an MX format is a clip applied before block quantization.

:func:`amax` turns an array, or a :class:`Histogram` gathered over many batches, into an amax
by ``"max"``, ``"percentile"``, ``"mse"`` (least squared error of quantizing in the target
format) or ``"entropy"`` (TensorRT's KL-divergence calibration).

>>> import jax, jax.numpy as jnp, lowbit as lb
>>> x = jax.random.t(jax.random.key(0), 3.0, (64, 256))  # heavy-tailed activations
>>> h = lb.calibrate.Histogram.of(x[:32]).update(x[32:])  # batch by batch
>>> bool(lb.calibrate.amax(h, "max") == jnp.abs(x).max()), int(h.count)
(True, 16384)
>>> a = lb.calibrate.amax(x, "mse", format="nvfp4")  # a static NVFP4 tensor amax
>>> y = lb.fake_quantize(x, "nvfp4", tensor_amax=a)
>>> bool(jnp.mean((y - x) ** 2) <= jnp.mean((lb.fake_quantize(x, "nvfp4") - x) ** 2))
True
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.core import formats as _formats
from lowbit.core import qarray as _qa
from lowbit.core.formats import E4M3, BlockFormat, ElementFormat
from lowbit.core.numerics import exponent, ieee_div, pow2, round_to_grid
from lowbit.core.requantize import round_on_scales
from lowbit.gemm.operand import scaled_fake_quantize
from lowbit.gemm.recipes import TENSOR_ELEMENTS
from lowbit.gptq import gptq, mr_gptq, rotate_hessian

__all__ = [
    "Histogram",
    "amax",
    "block_scales",
    "gptq",
    "kl_divergences",
    "mr_gptq",
    "rotate_hessian",
    "METHODS",
    "BLOCK_METHODS",
    "NUM_BINS",
    "MSE_MULTIPLIERS",
    "NVFP4_SCALE_OFFSETS",
]

METHODS = ("max", "percentile", "mse", "entropy")
BLOCK_METHODS = ("max", "mse")
NUM_BINS = 2048
# The "mse" sweep: these multiples of the max, then a 0.1% refinement around the best one.
MSE_MULTIPLIERS = tuple(k / 100 for k in range(25, 101))
_MSE_REFINE = tuple(k / 1000 for k in range(-10, 11))
# block_scales(..., "nvfp4", "mse"): E4M3 codes tried, relative to the standard block scale's.
NVFP4_SCALE_OFFSETS = (-4, -3, -2, -1, 1, 2, 3, 4)

# Bin widths are powers of two, 2**width_exp: data whose max lies in [2**E, 2**(E + 1)) get
# width 2**(E - 10), so the max falls in one of bins 1024..2047. The exponent is kept in
# [-126, 117] so that the width and its reciprocal are normal float32 numbers (2048 * 2**117 =
# 2**128 is above every finite float32).
_LOG2_BINS = 11
_MIN_WIDTH_EXP = -126
_MAX_WIDTH_EXP = 128 - _LOG2_BINS
_E4M3_MAX_CODE = 0x7E  # 448 = 1.75 * 2**8: S.1111.110


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _as_data(x, where: str) -> jax.Array:
    """``x`` as a float32 array, checked: floating, non-empty, and (when concrete) finite."""
    if isinstance(x, Histogram):
        raise TypeError(f"{where}: expected an array, got a Histogram")
    if not _is_traced(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{where}: x must be a floating-point array, got {x.dtype}")
    if x.size == 0:
        raise ValueError(f"{where}: x is empty (shape {x.shape}); there is nothing to calibrate")
    x = jnp.asarray(x, jnp.float32)
    if not _is_traced(x):
        bad = int(_count_nonfinite(x))  # on the device: one scalar comes back
        if bad:
            raise ValueError(
                f"{where}: x holds NaN or Inf ({bad} of {x.size} values); calibration data "
                "must be finite"
            )
    return x


@jax.jit
def _count_nonfinite(x: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)


# --------------------------------------------------------------------------------------------
# The histogram


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["counts", "width_exp", "max", "nonfinite"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Histogram:
    """A histogram of ``|x|`` over ``NUM_BINS`` bins that widens as larger values arrive.

    Bin ``i`` holds the values in ``[i * width, (i + 1) * width)``, with ``width = 2**width_exp``.
    The first data set the width: the smallest power of two (at least 2**-126) whose
    ``NUM_BINS`` bins hold the data's max (so the data fill between half and all of the
    bins). When a larger value arrives, same-width bins are appended past the end and the
    histogram is brought back to ``NUM_BINS`` bins by merging adjacent bins pairwise
    (doubling the width) as many times as needed. Because widths are powers of two and bins
    start at zero, a value's bin at a coarser width is its bin at a finer one shifted right,
    so counts are only ever summed: ``merge`` is exact, associative and commutative, and
    updating batch by batch gives the histogram of the concatenation bit for bit.

    Attributes:
      counts: int32 ``[NUM_BINS]`` (so at most 2**31 - 1 values in all).
      width_exp: int32 scalar, the bin width's exponent (-126 for an empty or all-zero
        histogram, the identity of ``merge``).
      max: float32 scalar, the exact running max of ``|x|``.
      nonfinite: int32 scalar, the NaN and Inf values seen under tracing (concrete data with
        any raise ``ValueError`` instead). They are left out of ``counts`` and ``max``, and
        :func:`amax` of a histogram that has any is NaN (under tracing) or raises.

    >>> import jax, jax.numpy as jnp
    >>> h = jax.jit(Histogram.of)(jnp.array([0.5, 3.0, -1.0]))
    >>> int(h.count), float(h.max), float(h.width) * NUM_BINS
    (3, 3.0, 4.0)
    """

    counts: jax.Array
    width_exp: jax.Array
    max: jax.Array
    nonfinite: jax.Array

    @classmethod
    def empty(cls) -> Histogram:
        return cls(
            counts=jnp.zeros(NUM_BINS, jnp.int32),
            width_exp=jnp.int32(_MIN_WIDTH_EXP),
            max=jnp.float32(0.0),
            nonfinite=jnp.int32(0),
        )

    @classmethod
    def of(cls, x: jax.Array, where: jax.Array | None = None) -> Histogram:
        """The histogram of ``|x|`` (any shape); with ``where`` (booleans broadcasting to
        ``x``), of the values where it is true only. Concrete data holding NaN or Inf raise
        ``ValueError``; under tracing such values are counted in ``nonfinite``."""
        x = _as_data(x, "Histogram.of")
        if where is None:
            return _histogram(x)
        try:
            where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
        except ValueError:
            raise ValueError(f"Histogram.of: where of shape {jnp.shape(where)} does not "
                             f"broadcast to x of shape {x.shape}") from None
        return _histogram(x, where)

    def update(self, x: jax.Array) -> Histogram:
        """A new histogram holding this one's values and those of ``x``."""
        return self.merge(Histogram.of(x))

    def merge(self, other: Histogram) -> Histogram:
        """The histogram of both histograms' values (exact: see the class docstring)."""
        if not isinstance(other, Histogram):
            raise TypeError(f"can only merge a Histogram, got {type(other).__name__}")
        return _merge(self, other)

    def merge_across(self, axis_name) -> Histogram:
        """Merge the histograms of every device (or ``vmap`` index) along ``axis_name``, inside
        ``shard_map``, ``pmap`` or a ``vmap`` with that axis name; each gets the result."""
        e = lax.pmax(self.width_exp, axis_name)
        return Histogram(
            counts=lax.psum(_coarsen(self.counts, e - self.width_exp), axis_name),
            width_exp=e,
            max=lax.pmax(self.max, axis_name),
            nonfinite=lax.psum(self.nonfinite, axis_name),
        )

    @property
    def count(self) -> jax.Array:
        """The number of (finite) values seen, int32."""
        return jnp.sum(self.counts, dtype=jnp.int32)

    @property
    def width(self) -> jax.Array:
        """The bin width, float32."""
        return pow2(self.width_exp)

    @property
    def edges(self) -> jax.Array:
        """The ``NUM_BINS + 1`` bin edges, float32."""
        return jnp.arange(NUM_BINS + 1, dtype=jnp.float32) * self.width

    @property
    def centers(self) -> jax.Array:
        """The ``NUM_BINS`` bin centres, float32."""
        return (jnp.arange(NUM_BINS, dtype=jnp.float32) + 0.5) * self.width


@jax.jit
def _histogram(x: jax.Array, where: jax.Array | None = None) -> Histogram:
    a = jnp.abs(x).reshape(-1)
    if where is not None:  # values outside ``where``: zeros, and not counted
        a = jnp.where(where.reshape(-1), a, 0.0)
    finite = jnp.isfinite(a)
    a = jnp.where(finite, a, 0.0)
    m = jnp.max(a)
    width_exp = jnp.clip(exponent(m) - (_LOG2_BINS - 1), _MIN_WIDTH_EXP, _MAX_WIDTH_EXP)
    # |x| / width is exact (a power of two) and below NUM_BINS; truncation is the floor.
    idx = jnp.minimum((a * pow2(-width_exp)).astype(jnp.int32), NUM_BINS - 1)
    # segment_sum rather than .at[idx].add: the same int32 counts, 3x faster on XLA:CPU
    # (measured on 2M values: 3.8 ms against 12.5 ms; bench_calibrate.py).
    counted = finite if where is None else finite & where.reshape(-1)
    counts = jax.ops.segment_sum(counted.astype(jnp.int32), idx, NUM_BINS)
    nonfinite = jnp.sum(~finite, dtype=jnp.int32)
    return Histogram(counts=counts, width_exp=width_exp, max=m, nonfinite=nonfinite)


@jax.jit
def _merge(h: Histogram, other: Histogram) -> Histogram:
    e = jnp.maximum(h.width_exp, other.width_exp)
    counts = _coarsen(h.counts, e - h.width_exp) + _coarsen(other.counts, e - other.width_exp)
    return Histogram(counts=counts, width_exp=e, max=jnp.maximum(h.max, other.max),
                     nonfinite=h.nonfinite + other.nonfinite)


def _coarsen(counts: jax.Array, shift: jax.Array) -> jax.Array:
    """``counts`` at a width ``2**shift`` times larger: bin ``i`` moves to ``i >> shift``."""
    shift = jnp.clip(shift, 0, 31)
    idx = jnp.right_shift(jnp.arange(NUM_BINS, dtype=jnp.int32), shift)
    return jnp.zeros_like(counts).at[idx].add(counts)


def _checked_histogram(h: Histogram, where: str) -> None:
    if _is_traced(h.nonfinite) or _is_traced(h.counts):
        return
    if int(h.nonfinite):
        raise ValueError(
            f"{where}: the histogram saw {int(h.nonfinite)} NaN or Inf values (under tracing); "
            "calibration data must be finite"
        )
    if int(h.count) == 0:
        raise ValueError(f"{where}: the histogram is empty; there is nothing to calibrate")


# --------------------------------------------------------------------------------------------
# Target formats


@dataclasses.dataclass(frozen=True)
class _Target:
    """What an amax is for: a block format (MX: a clip; NVFP4: the tensor amax) or a per-tensor
    FP8 element format (the tensor scale's amax)."""

    block: BlockFormat | None
    tensor_elem: ElementFormat | None
    tensor_name: str | None = None  # the per-tensor element format's name

    @property
    def elem(self) -> ElementFormat:
        return self.tensor_elem if self.block is None else self.block.elem

    @property
    def levels(self) -> int:
        """The distinct non-negative magnitudes of the element grid (8 for E2M1)."""
        return len(self.elem.positive_grid)


def _target(fmt, method: str) -> _Target:
    if fmt is None:
        raise ValueError(
            f"method={method!r} needs format=: a block format ({', '.join(_formats.names())}) "
            f"or a per-tensor FP8 element format {TENSOR_ELEMENTS}"
        )
    if isinstance(fmt, str) and fmt.lower() in TENSOR_ELEMENTS:
        return _Target(None, _formats.tensor_element(fmt), fmt.lower())
    return _Target(_formats.get(fmt), None)


def _fake_quantize(x: jax.Array, a: jax.Array, target: _Target, axis: int) -> jax.Array:
    """``x`` quantized in ``target`` with amax ``a``, back in float32."""
    if target.block is None:  # per-tensor FP8 / int8 as lowbit's recipes compute it
        return scaled_fake_quantize(x, target.tensor_name, a)
    if target.block.is_absmean:
        raise ValueError(
            f"{target.block.name} has no amax to calibrate: its scale is the tensor's mean |x|"
        )
    if target.block.tensor_scale:  # NVFP4: the amax is the tensor amax; blocks above it clip
        return _qa.fake_quantize(x, target.block, axis, tensor_amax=a)
    return _qa.fake_quantize(jnp.clip(x, -a, a), target.block, axis)  # MX: clip, then blocks


def _sweep(x, weights, amaxes, target: _Target, axis: int):
    """The (weighted) sum of squared errors of quantizing ``x`` with each of ``amaxes``."""

    def err(a):
        d = jnp.square(_fake_quantize(x, a, target, axis) - x)
        return jnp.sum(d if weights is None else d * weights)

    return lax.map(err, amaxes)


def _argmin_last(errs: jax.Array) -> jax.Array:
    """Index of the least value, the last one on ties (the largest amax of a sweep)."""
    return errs.shape[0] - 1 - jnp.argmin(errs[::-1])


@functools.partial(jax.jit, static_argnames=("target", "axis"))
def _amax_mse(x, weights, m, target: _Target, axis: int) -> jax.Array:
    coarse = m * jnp.asarray(MSE_MULTIPLIERS, jnp.float32)
    errs = _sweep(x, weights, coarse, target, axis)
    best = jnp.asarray(MSE_MULTIPLIERS, jnp.float32)[_argmin_last(errs)]
    fine = m * jnp.clip(best + jnp.asarray(_MSE_REFINE, jnp.float32), MSE_MULTIPLIERS[0], 1.0)
    errs = jnp.concatenate([errs, _sweep(x, weights, fine, target, axis)])
    cands = jnp.concatenate([coarse, fine])
    # least error; among equal errors the largest amax (clip least)
    order = jnp.argsort(cands)
    return cands[order][_argmin_last(errs[order])]


# --------------------------------------------------------------------------------------------
# Entropy (KL divergence) calibration


def kl_divergences(counts: jax.Array, levels: int) -> tuple[jax.Array, jax.Array]:
    """TensorRT's KL divergence for each clip point of a histogram.

    For each ``i`` in ``levels .. len(counts)`` (clipping at the upper edge of bin ``i - 1``):
    the reference ``P`` is ``counts[:i]`` with the outliers ``sum(counts[i:])`` added to its
    last bin; the candidate ``Q`` merges ``counts[:i]`` (without the outliers) into ``levels``
    groups, bin ``j`` going to group ``floor(j * levels / i)``, then expands each group's sum
    evenly over the group's non-empty bins (empty bins stay empty). Both are normalised and
    the result is ``KL(P || Q) = sum_j P_j log(P_j / Q_j)`` in nats, Inf where ``P_j > 0``
    with ``Q_j = 0`` (an empty bin ``i - 1`` receiving outliers).

    Returns ``(i, kl)``, int32 and float32 arrays of ``len(counts) - levels + 1`` entries.

    >>> i, kl = kl_divergences(jnp.array([2, 2, 0, 4]), 2)
    >>> i.tolist(), [round(float(v), 4) for v in kl]
    ([2, 3, 4], [0.1308, inf, 0.0])
    """
    c = jnp.asarray(counts)
    if c.ndim != 1 or not 1 <= levels <= c.shape[0]:
        raise ValueError(f"need 1-D counts with at least levels={levels} bins, got {c.shape}")
    return _kl_divergences(c.astype(jnp.int32), int(levels))


@functools.partial(jax.jit, static_argnames=("levels",))
def _kl_divergences(c: jax.Array, levels: int) -> tuple[jax.Array, jax.Array]:
    n = c.shape[0]
    csum = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(c)])
    nzsum = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum((c > 0).astype(jnp.int32))])
    total = csum[-1].astype(jnp.float32)
    j = jnp.arange(n, dtype=jnp.int32)
    g = jnp.arange(levels + 1, dtype=jnp.int32)

    def one(i):
        inside = j < i
        # group g spans bins [ceil(g * i / levels), ceil((g + 1) * i / levels))
        starts = (g * i + levels - 1) // levels
        gsum = (csum[starts[1:]] - csum[starts[:-1]]).astype(jnp.float32)
        gnz = (nzsum[starts[1:]] - nzsum[starts[:-1]]).astype(jnp.float32)
        grp = jnp.minimum((j * levels) // i, levels - 1)
        q = jnp.where(inside & (c > 0), gsum[grp] / jnp.maximum(gnz[grp], 1.0), 0.0)
        outliers = (csum[-1] - csum[i]).astype(jnp.float32)
        p = jnp.where(inside, c.astype(jnp.float32), 0.0)
        p = p + jnp.where(j == i - 1, outliers, 0.0)
        p = p / total
        q = q / jnp.maximum(jnp.sum(q), np.float32(1e-30))
        terms = jnp.where(p > 0, p * (jnp.log(p) - jnp.log(jnp.where(q > 0, q, 1.0))), 0.0)
        infinite = jnp.any((p > 0) & (q == 0))
        return jnp.where(infinite, np.float32(np.inf), jnp.sum(terms))

    i = jnp.arange(levels, n + 1, dtype=jnp.int32)
    return i, jax.vmap(one)(i)


def _amax_entropy(h: Histogram, target: _Target) -> jax.Array:
    i, kl = kl_divergences(h.counts, min(target.levels, NUM_BINS))
    k = _argmin_last(kl)
    a = jnp.minimum(i[k].astype(jnp.float32) * h.width, h.max)
    return jnp.where(jnp.isfinite(kl[k]), a, h.max)  # every clip point infinite: the max


# --------------------------------------------------------------------------------------------
# amax


def _check_percentile(percentile) -> float:
    if isinstance(percentile, bool) or not isinstance(percentile, numbers.Real):
        raise ValueError(f"percentile must be a number in (0, 100], got {percentile!r}")
    p = float(percentile)
    if not 0.0 < p <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
    return p


def _percentile_of_histogram(h: Histogram, p: float) -> jax.Array:
    """Linear interpolation inside the bin where the cumulative count reaches ``p``%, so the
    result lies in the same bin as the data's own percentile (within one bin width)."""
    target = (p / 100.0) * h.count.astype(jnp.float32)
    cum = jnp.cumsum(h.counts)
    i = jnp.minimum(jnp.searchsorted(cum.astype(jnp.float32), target, side="left"),
                    NUM_BINS - 1)
    below = (cum[i] - h.counts[i]).astype(jnp.float32)
    frac = jnp.clip((target - below) / jnp.maximum(h.counts[i], 1).astype(jnp.float32), 0, 1)
    return jnp.minimum((i.astype(jnp.float32) + frac) * h.width, h.max)


def amax(
    x: jax.Array | Histogram,
    method: str,
    *,
    format: str | BlockFormat | None = None,
    percentile: float = 99.99,
    axis: int = -1,
) -> jax.Array:
    """A calibrated amax (float32 scalar) of an array or a :class:`Histogram`.

    Methods:
      ``"max"``: the absolute max (exact, from a histogram too).
      ``"percentile"``: that percentile of ``|x|``; from an array exactly (``np.percentile``,
        or ``jnp.percentile`` under tracing), from a histogram within one bin.
      ``"mse"``: the amax among multiples of the max (``MSE_MULTIPLIERS``: 0.25 to 1 in 1%
        steps, then 0.1% steps around the best) that least squared error of quantizing the data
        in ``format`` (ties: the largest). The quantizer is the format's own: NVFP4 with the
        amax as its ``tensor_amax`` (E4M3 block scales, E2M1 grid, blocks above the amax
        clip); per-tensor ``"e4m3"`` / ``"e5m2"``, the fp8 recipe's ``elem_max / amax`` scale;
        MX formats, a clip to ``+-amax`` then MX block quantization. An array is quantized in
        its own blocks along ``axis``; a histogram's data are its bin centres (capped at its
        max) weighted by the counts, quantized as one ascending vector: a histogram does not
        record which values shared a block, so for block formats this is an estimate (blocks
        of like magnitudes), and calibrating on arrays is the more faithful choice.
      ``"entropy"``: TensorRT's KL-divergence calibration on the histogram (of the array, or
        given): see :func:`kl_divergences`, with ``levels`` the number of non-negative
        magnitudes of the format's element grid (8 for E2M1, 127 for E4M3); the amax is the
        clip point of least divergence (ties: the largest), capped at the max. Unlike
        TensorRT, bin 0 is kept as it is (no smoothing of a spike of zeros).

    Args:
      x: an array (any shape) or a :class:`Histogram`.
      method: one of ``METHODS``.
      format: the target format, needed for ``"mse"`` and ``"entropy"``: a block format name
        or :class:`BlockFormat`, or ``"e4m3"`` / ``"e5m2"`` for per-tensor FP8.
      percentile: for ``"percentile"``, in (0, 100].
      axis: for ``"mse"`` on an array in a block format, the axis its blocks run along.

    Data holding NaN or Inf raise ``ValueError`` when concrete; under ``jit`` the result is
    NaN instead.

    >>> import jax.numpy as jnp
    >>> float(amax(jnp.array([0.5, -3.0, 1.0]), "max"))
    3.0
    """
    if method not in METHODS:
        raise ValueError(f"unknown method={method!r}; valid methods: {METHODS}")
    where = f"amax(method={method!r})"
    p = _check_percentile(percentile) if method == "percentile" else None
    target = _target(format, method) if method in ("mse", "entropy") else None
    if isinstance(x, Histogram):
        _checked_histogram(x, where)
        return _amax_of_histogram(x, method, p, target)
    data = _as_data(x, where)
    if data.ndim == 0:
        data = data.reshape(1)
    if method == "percentile" and not _is_traced(data):  # numpy's, exactly (and no jnp sort)
        return jnp.asarray(np.percentile(np.abs(np.asarray(data)), p), jnp.float32)
    if method == "mse" and target.block is not None:  # check the blocking before tracing
        _qa.make_plan(data.shape, target.block, axis, None, None, "nearest", None, None)
    return _amax_of_array(data, method, p, target, axis)


@functools.partial(jax.jit, static_argnames=("method", "target"))
def _amax_of_histogram(h: Histogram, method: str, p, target) -> jax.Array:
    if method == "max":
        out = h.max
    elif method == "percentile":
        out = _percentile_of_histogram(h, p)
    elif method == "mse":
        data = jnp.minimum(h.centers, h.max)
        out = _amax_mse(data, h.counts.astype(jnp.float32), h.max, target, -1)
    else:
        out = _amax_entropy(h, target)
    return jnp.where(h.nonfinite > 0, np.float32(np.nan), out).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("method", "target", "axis"))
def _amax_of_array(x: jax.Array, method: str, p, target, axis) -> jax.Array:
    a = jnp.abs(x)
    finite = jnp.isfinite(a)
    m = jnp.max(jnp.where(finite, a, 0.0))
    if method == "max":
        out = m
    elif method == "percentile":
        out = jnp.percentile(a.reshape(-1), p)
    elif method == "mse":
        out = _amax_mse(jnp.where(finite, x, 0.0), None, m, target, axis)
    else:
        out = _amax_entropy(_histogram(x), target)
    return jnp.where(jnp.all(finite), out, np.float32(np.nan)).astype(jnp.float32)


# --------------------------------------------------------------------------------------------
# Weight block scales


def _blocked(x: jax.Array, plan: _qa.Plan) -> jax.Array:
    if plan.padded_shape != x.shape:
        x = jnp.pad(x, [(0, p - d) for p, d in zip(plan.padded_shape, x.shape, strict=True)])
    return x.reshape(plan.blocked_shape)


def _unblocked(y: jax.Array, plan: _qa.Plan) -> jax.Array:
    y = y.reshape(plan.padded_shape)
    return y[tuple(slice(0, d) for d in plan.shape)]


def _storage(a: jax.Array, plan: _qa.Plan) -> jax.Array:
    """An array of the padded tensor's layout in the QArray's storage order."""
    return jnp.transpose(a, plan.perm) if plan.moves_axes else a


def block_scales(
    w: jax.Array,
    format: str | BlockFormat,
    method: str = "max",
    *,
    axis: int | tuple[int, ...] = -1,
    block_shape: tuple[int, ...] | None = None,
) -> _qa.QArray:
    """Quantize a weight with each block's scale chosen to least its squared error.

    ``method="max"`` is ``lowbit.quantize(w, format, axis, block_shape=block_shape)`` (the
    standard scale, from each block's absolute max). ``"mse"`` tries, per block, the standard
    scale and its neighbours, keeping a neighbour only where it lowers that block's squared
    error (so no block gets worse):

    - MX: the E8M0 exponents ``e - 1, e, e + 1`` around the standard (floor) exponent ``e``
      (neighbours only where all their values are normal float32 numbers);
    - NVFP4: the standard E4M3 block scale (from ``absmax / 6`` and the tensor scale of
      ``w``'s own amax) and the E4M3 values ``NVFP4_SCALE_OFFSETS`` codes away from it.

    The result is an ordinary :class:`lowbit.QArray` with the shapes and dtypes of
    ``lowbit.quantize``'s (a block's scale byte simply holds another value), which
    ``lowbit.dequantize`` reads; blocks that keep the standard scale keep its bytes.

    >>> import jax, jax.numpy as jnp, lowbit as lb
    >>> w = jax.random.normal(jax.random.key(0), (8, 64))
    >>> err = lambda q: float(jnp.sum((lb.dequantize(q) - w) ** 2))
    >>> err(block_scales(w, "nvfp4", "mse")) < err(block_scales(w, "nvfp4"))
    True
    """
    if method not in BLOCK_METHODS:
        raise ValueError(f"unknown method={method!r}; valid methods: {BLOCK_METHODS}")
    if isinstance(format, str) and format.lower() in TENSOR_ELEMENTS:
        raise ValueError(
            f"block_scales needs a block format, got the per-tensor element format {format!r}; "
            "use amax(..., format=...) for its tensor scale"
        )
    fmt = _formats.get(format)
    if fmt.is_absmean:
        raise ValueError(
            f"block_scales needs a format with block scales; {fmt.name} has one scale per "
            "tensor (its mean |x|)"
        )
    _as_data(w, "block_scales")
    w = jnp.asarray(w)
    plan = _qa.make_plan(w.shape, fmt, axis, block_shape, None, "nearest", None, None)
    standard = _quantize(w, fmt, plan.axes, block_shape=plan.block_shape)
    if method == "max":
        return standard
    return _block_scales_mse(w, standard, plan.axes, plan.block_shape)


_quantize = jax.jit(_qa.quantize, static_argnames=("fmt", "axis", "block_shape"))


@functools.partial(jax.jit, static_argnames=("axes", "block_shape"))
def _block_scales_mse(w, standard: _qa.QArray, axes, block_shape) -> _qa.QArray:
    fmt = standard.format
    xf = w.astype(jnp.float32)
    plan = _qa.make_plan(xf.shape, fmt, axes, block_shape, None, "nearest", None, None)
    xb = _blocked(xf, plan)
    y0 = _blocked(_qa.dequantize(standard, jnp.float32), plan)
    finite = jnp.all(jnp.isfinite(xb), axis=plan.block_axes, keepdims=True)
    search = _mx_search if fmt.is_mx else _nvfp4_search
    return search(xb, y0, finite, plan, standard)


def _block_sse(y, xb, plan):
    return jnp.sum(jnp.square(y - xb), axis=plan.block_axes, keepdims=True)


def _replace_blocks(standard: _qa.QArray, codes, scales, changed, plan) -> _qa.QArray:
    """``standard`` with the packed ``codes`` and the ``scales`` (storage layout) of the
    blocks where ``changed`` (blocked layout, one per block)."""
    scale_mask = _storage(jnp.squeeze(changed, axis=plan.block_axes), plan)
    elem_mask = jnp.broadcast_to(changed, plan.blocked_shape).reshape(plan.padded_shape)
    elem_mask = _storage(elem_mask, plan)
    # codes pack along the last storage axis, whole groups inside one block: 2 FP4 codes a
    # byte, 4 FP6 codes in 3 bytes, 1 FP8 / INT8 code a byte
    n, nbytes = plan.fmt.elem.pack_group
    byte_mask = jnp.repeat(elem_mask[..., 0::n], nbytes, axis=-1)
    return dataclasses.replace(
        standard,
        codes=jnp.where(byte_mask, codes, standard.codes),
        scales=jnp.where(scale_mask, scales, standard.scales),
    )


def _mx_search(xb, y0, finite, plan, standard):
    elem = plan.fmt.elem
    amax_b = jnp.max(jnp.abs(xb), axis=plan.block_axes, keepdims=True)
    e0 = _qa.mx_scale_exponent(amax_b, elem, "floor")
    # A neighbour e is tried where x * 2**-e, every element times 2**e and elem.max * 2**e
    # are normal float32 numbers, so that its values are exact.
    lo = max(-126 - elem.emin + elem.mbits, -126)
    hi = 126 - elem.emax
    best_y, best_err = y0, _block_sse(y0, xb, plan)
    changed = jnp.zeros_like(best_err, dtype=bool)
    for d in (-1, 1):
        e = e0 + d
        y = round_to_grid(xb * pow2(jnp.clip(-e, -126, 127)), elem, saturate=True)
        y = y * pow2(jnp.clip(e, -126, 127))
        err = _block_sse(y, xb, plan)
        better = finite & (e0 > -127) & (e >= lo) & (e <= hi) & (err < best_err)
        best_y = jnp.where(better, y, best_y)
        best_err = jnp.where(better, err, best_err)
        changed = changed | better
    # A changed block's values lie on its chosen grid, and "rceil" (the smallest exponent
    # whose grid reaches the block's largest value) encodes them exactly: on the chosen
    # exponent, or one below it when they all fit that finer grid (the same values).
    y = _unblocked(jnp.where(changed, best_y, 0.0), plan)
    q = _qa.quantize(y, plan.fmt, plan.axes, scale_mode="rceil", block_shape=plan.block_shape)
    return _replace_blocks(standard, q.codes, q.scales, changed, plan)


def _nvfp4_search(xb, y0, finite, plan, standard):
    elem = plan.fmt.elem
    a = jnp.abs(xb)
    amax_b = jnp.max(a, axis=plan.block_axes, keepdims=True)
    t = _qa.nvfp4_tensor_scale(jnp.max(jnp.where(jnp.isfinite(a), a, 0.0)), elem.max)
    s_raw = jnp.minimum(ieee_div(ieee_div(amax_b, np.float32(elem.max)), t),
                        np.float32(E4M3.max))
    s0 = round_to_grid(jnp.where(t > 0, s_raw, 0.0), E4M3)
    c0 = _qa.encode_elements(s0, E4M3).astype(jnp.int32)
    top = _E4M3_MAX_CODE
    err0 = _block_sse(y0, xb, plan)

    def try_offset(carry, k):  # one candidate scale per step: one compiled body, O(w) memory
        best_err, best_c, best_q = carry
        c = c0 + k
        ok = finite & (t > 0) & (c >= 0) & (c <= top)
        q, y = round_on_scales(xb, jnp.clip(c, 0, top).astype(jnp.uint8), t, plan.fmt)
        err = _block_sse(y, xb, plan)
        better = ok & (err < best_err)
        return (jnp.where(better, err, best_err), jnp.where(better, c, best_c),
                jnp.where(better, q, best_q)), None

    init = (err0, c0, jnp.zeros_like(xb))
    offsets = jnp.asarray(NVFP4_SCALE_OFFSETS, jnp.int32)
    (best_err, best_c, best_q), _ = lax.scan(try_offset, init, offsets)
    changed = best_err < err0
    # E2M1 (INT4) codes two a byte, low nibble first (lowbit.core.qarray's layout)
    codes = _storage(_qa.encode_elements(best_q, elem).reshape(plan.padded_shape), plan)
    codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = _storage(jnp.squeeze(best_c, axis=plan.block_axes).astype(jnp.uint8), plan)
    return _replace_blocks(standard, codes, scales, changed, plan)
