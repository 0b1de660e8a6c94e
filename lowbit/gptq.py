"""GPTQ for lowbit's block formats: quantize a weight column by column, each column's rounding
error spread over the columns not yet quantized through the inverse Hessian of the layer's inputs.

``lb.calibrate.gptq(w, hessian, "nvfp4")`` (this module's :func:`gptq`) follows the reference
implementation, IST-DASLab/gptq @ 2d65066, ``gptq.py:60-160`` (``GPTQ.fasterquant``):

- dead inputs (zero Hessian diagonal) get diagonal 1 and zero weights (``gptq.py:77-79``);
- the Hessian is damped by ``damp`` times its mean diagonal, and GPTQ runs on the upper
  Cholesky factor of its inverse (``gptq.py:98-104``);
- columns are quantized in order, each one's error ``(w - q) / d`` subtracted from the columns
  after it along the factor's row, within a lazy batch of ``block_size`` columns, and from the
  columns after the batch once it is done (``gptq.py:106-143``);
- the format's blocks along the contraction axis are the reference's ``groupsize``: a block's
  scale is chosen when the loop reaches its first column, by lowbit's own quantizer (every
  scale rule: MX's, NVFP4's, Four Over Six) on that block's weights as updated so far; every
  column of the block is then rounded to nearest on that scale
  (:func:`lowbit.core.qarray.round_on_scales`). NVFP4's and INT4's tensor scale comes from the
  original weights, as ``lb.quantize`` computes it.

Where this differs from the reference's code: its ``find_params`` reads the block's columns
from ``W``, which does not yet hold the updates of the lazy batch in progress
(``gptq.py:123``: ``W[:, i1+i : ...]``, while the batch's updates go to ``W1``), so with a
group smaller than the batch the scale of every group but the batch's first is chosen from
partly stale weights. Here the scale is chosen from the weights as updated (``W1``), which is
what the algorithm without lazy batching computes: the result does not depend on
``block_size`` (up to float rounding).

``act_order=True`` quantizes columns in order of decreasing Hessian diagonal
(``gptq.py:89-93``) with the reference's static groups (``static_groups=True``,
``gptq.py:81-87, 124-128``): every block's scale is chosen before the loop from the original
weights (dead inputs zeroed), so a block's scale still covers the same contiguous original
columns that ``lb.quantize`` lays out, whatever order its columns are visited in.

The result is an ordinary :class:`lowbit.QArray`, laid out as ``lb.quantize(w, format,
axis=axis)`` lays it out (codes, scale codes, tensor scale): ``lb.dequantize`` reads it and
``lowbit.io`` packs it.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.core import formats as _formats
from lowbit.core import hadamard as _hadamard
from lowbit.core import qarray as _qa
from lowbit.core import requantize as _rq
from lowbit.core.formats import E4M3
from lowbit.core.numerics import ieee_div, round_to_grid
from lowbit.gemm.recipes import TENSOR_ELEMENTS

__all__ = ["gptq", "mr_gptq", "rotate_hessian", "damped_inverse_factor"]

_HIGHEST = lax.Precision.HIGHEST
QUANTIZER_OPTIONS = ("scale_mode", "rounding", "block_shape")


def _check_args(w, hessian, fmt, axis, block_size, damp, options):
    """The checked ``(w, H, format, axis)``; clear errors for everything else."""
    w = jnp.asarray(w)
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w must be a 2-D floating-point weight, got {w.dtype}{list(w.shape)}")
    if axis not in (0, 1, -1, -2):
        raise ValueError(f"axis must be 0 or 1 (w's contraction axis), got {axis!r}")
    axis %= 2
    k = w.shape[axis]
    h = jnp.asarray(hessian)
    if h.shape != (k, k):
        raise ValueError(
            f"hessian must be [{k}, {k}] (w's contraction axis {axis} has {k} inputs), got "
            f"shape {tuple(h.shape)}"
        )
    if isinstance(fmt, str) and fmt.lower() in TENSOR_ELEMENTS:
        raise ValueError(f"gptq needs a block format, got the per-tensor element format {fmt!r}")
    f = _formats.get(fmt)
    if f.is_absmean:
        raise ValueError(f"gptq needs block scales; {f.name} has one scale per tensor (mean |w|)")
    unknown = sorted(set(options) - set(QUANTIZER_OPTIONS))
    if unknown:
        raise TypeError(f"gptq got unknown quantizer options {unknown}; it takes "
                        f"{list(QUANTIZER_OPTIONS)} (tensor_block and stochastic rounding "
                        "are not GPTQ's)")
    if options.get("rounding", "nearest") != "nearest":
        raise ValueError(f"rounding={options['rounding']!r}: GPTQ rounds to nearest")
    if options.get("block_shape") not in (None, (f.block_size,)):
        raise ValueError(f"block_shape={options['block_shape']}: gptq takes {f.name}'s 1-D "
                         f"blocks ({f.block_size},) along the contraction axis")
    _qa.scale_mode_of(f, options.get("scale_mode"))  # the one check of a scale mode
    if not isinstance(block_size, numbers.Integral) or block_size < f.block_size or (
            block_size % f.block_size):
        raise ValueError(f"block_size={block_size!r} must be a positive multiple of "
                         f"{f.name}'s block size {f.block_size} (a lazy batch holds whole blocks)")
    if not isinstance(damp, numbers.Real) or not (0 <= damp < np.inf):
        raise ValueError(f"damp must be a finite non-negative number, got {damp!r}")
    return w, h, f, axis


def damped_inverse_factor(hessian, damp: float = 0.01):
    """``(U, dead)``: the upper Cholesky factor of the inverse of the damped Hessian (dead
    inputs, with a zero diagonal, set to 1 first) and the dead-input mask; ``U`` is NaN where
    the damped Hessian is not positive definite (``gptq.py:77-78, 98-104``)."""
    h = jnp.asarray(hessian, jnp.float32)
    d = jnp.diagonal(h)
    dead = d == 0
    eye = jnp.eye(h.shape[0], dtype=bool)
    h = jnp.where(eye & dead[:, None], 1.0, h)
    h = h + jnp.eye(h.shape[0], dtype=jnp.float32) * (np.float32(damp) * jnp.mean(
        jnp.diagonal(h)))
    lower = jnp.linalg.cholesky(h)
    hinv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(h.shape[0], dtype=jnp.float32))
    hinv = (hinv + hinv.T) / 2  # symmetric to the last bit before the second factorisation
    return jnp.linalg.cholesky(hinv).T, dead


def gptq(w, hessian, format, *, axis: int = 0, block_size: int = 128, damp: float = 0.01,
         act_order: bool = False, scale_search: bool = False,
         **quantizer_options) -> _qa.QArray:
    """GPTQ of the weight ``w`` (2-D) in ``format``, along its contraction axis ``axis``.

    Args:
      w: the weight, ``[K, N]`` with ``axis=0`` (``y = x @ w``) or ``[N, K]`` with ``axis=1``.
      hessian: ``[K, K]``, the layer's input second moment ``sum x^T x`` over calibration
        tokens (``lb.ptq.calibrate(..., hessians=True)`` records it); its scale is irrelevant.
      format: a block format: MXFP8 / MXFP6 / MXFP4, MXINT8, NVFP4, INT4.
      block_size: the lazy batch (columns updated together; a multiple of the format's
        block); the result does not depend on it beyond float rounding.
      damp: added to the Hessian's diagonal, as a fraction of its mean diagonal.
      act_order: visit columns by decreasing Hessian diagonal, with every block's scale fixed
        beforehand from the original weights (module docstring).
      scale_search: fix every block's scale before the loop by FP-Quant's MSE observer (see
        :func:`mr_gptq`) instead of choosing it as the loop reaches the block.
      quantizer_options: ``scale_mode`` (the format's scale rules; ``rounding="nearest"`` and
        the format's own ``block_shape`` are accepted).

    Returns the :class:`lowbit.QArray` that ``lb.quantize(w, format, axis=axis)`` would lay
    out, holding GPTQ's codes and scales.

    Raises ValueError when the damped Hessian is not positive definite, naming the damp that
    would make it so (a traced Hessian cannot be checked: the result is then NaN).

    >>> import jax, jax.numpy as jnp, lowbit as lb
    >>> x = jax.random.normal(jax.random.key(0), (256, 64))
    >>> x = x + jnp.roll(x, 1, axis=1)  # correlated inputs
    >>> w = jax.random.normal(jax.random.key(1), (64, 32))
    >>> q = lb.calibrate.gptq(w, x.T @ x, "mxfp4")
    >>> err = lambda v: float(jnp.sum((x @ (v - w)) ** 2))
    >>> err(lb.dequantize(q)) < 0.8 * err(lb.dequantize(lb.quantize(w, "mxfp4", axis=0)))
    True
    """
    w, h, fmt, axis = _check_args(w, hessian, format, axis, block_size, damp, quantizer_options)
    scale_mode = quantizer_options.get("scale_mode")
    if scale_search and scale_mode in _FOUR_OVER_SIX:
        raise ValueError(f"scale_mode={scale_mode!r} chooses each block's scale itself; pass "
                         "scale_search=False to keep it")
    return _run(w, h, fmt, axis, block_size, damp, act_order, scale_mode, search=scale_search)


def mr_gptq(w, hessian, format, *, axis: int = 0, hadamard: int | None = None,
            block_size: int = 128, damp: float = 0.01, act_order: bool = False,
            scale_search: bool = True, **quantizer_options) -> _qa.QArray:
    """MR-GPTQ (IST-DASLab/FP-Quant): GPTQ of the weight rotated by block-wise Hadamard
    transforms, with every block's scale chosen beforehand by a search.

    The rotation: ``w_r = H_b w`` along the contraction axis, ``H_b`` the orthonormal
    (Sylvester) Hadamard matrix in blocks of ``hadamard`` (default: the format's block, as
    FP-Quant pairs ``--hadamard_group_size`` with the format's group), and the Hessian
    ``H_b hessian H_b``: the layer computes ``(x H_b) w_r = x w`` exactly in float, so the
    served model applies the same transform to its activations (the GEMM's ``hadamard``
    option, no random signs). FP-Quant @ d2e3092 ``src/transforms/transforms.py:74-84``
    (``HadamardTransform``, ``fast_hadamard_transform`` with scale ``1/sqrt(b)``).

    The scale search (``scale_search=True``): FP-Quant's MSE observer
    (``src/quantization/quantizer.py:87-135``), run once on the whole rotated weight before
    the GPTQ loop (``gptq.py:142``, scales fixed for the loop): per block, the float scales
    ``c * amax / elem_max`` for ``c = 1 - 0.8 i / 100``, ``i = 0..99``, each scored by
    ``sum |x - Q(x)|**2.4`` with the float scale, the first best kept; the chosen amax
    ``c * amax`` then gets the format's scale code (NVFP4 / INT4: ``E4M3(c * amax / elem_max
    / t)``, which is FP-Quant's cast; MX: lowbit's E8M0 rule ``scale_mode``, default
    ``"floor"``, where FP-Quant's MXFP4 cast divides the power of two by 3/4, a scale no
    E8M0 byte holds). FP-Quant supports FP4 only; the search here runs on every element grid.

    Returns the :class:`lowbit.QArray` of ``w_r`` (laid out as ``lb.quantize(w_r, format,
    axis=axis)``): ``lb.dequantize`` gives the rotated weight; ``hadamard_transform(...,
    hadamard, axis=axis)`` of it is the quantized weight in the original basis. Arguments and
    errors as :func:`gptq`; ``hadamard`` a power of two in 16..256 dividing the contraction
    length.
    """
    w, h, fmt, axis = _check_args(w, hessian, format, axis, block_size, damp, quantizer_options)
    b = fmt.block_size if hadamard is None else hadamard
    k = w.shape[axis]
    if b not in (16, 32, 64, 128, 256) or k % b:
        raise ValueError(f"hadamard={hadamard!r} must be a power of two in 16..256 dividing "
                         f"the contraction length {k}")
    w = _hadamard.hadamard_transform(w.astype(jnp.float32), b, axis=axis, method="butterfly")
    return gptq(w, rotate_hessian(h, b), fmt, axis=axis, block_size=block_size, damp=damp,
                act_order=act_order, scale_search=scale_search, **quantizer_options)


def rotate_hessian(hessian, block: int, signs=None):
    """The Hessian of activations rotated by :func:`lowbit.core.hadamard.hadamard_transform`
    in blocks of ``block`` (with ``signs``): ``T hessian T^T`` for ``T`` the transform, the
    input Hessian of ``x -> hadamard_transform(x, block, signs=signs)``, made exactly
    symmetric."""
    h = jnp.asarray(hessian, jnp.float32)
    h = _hadamard.hadamard_transform(h, block, signs=signs, axis=0, method="butterfly")
    h = _hadamard.hadamard_transform(h, block, signs=signs, axis=1, method="butterfly")
    return (h + h.T) / 2


_FOUR_OVER_SIX = ("4over6", "4over6_mae", "4over6_max")


def _run(w, h, fmt, axis, block_size, damp, act_order, scale_mode, *, search: bool):
    wt = (w.T if axis == 0 else w).astype(jnp.float32)  # [N, K]: rows outputs, columns inputs
    tamax = jnp.max(jnp.where(jnp.isfinite(wt), jnp.abs(wt), 0.0))
    # the layout, and NVFP4's / INT4's tensor scale of the original weights
    template = _qa.quantize(w, fmt, axis, scale_mode=scale_mode)
    static = (_searched_scales(wt, template.tensor_scale, fmt=fmt.name, scale_mode=scale_mode)
              if search else None)
    values, elems, scales, ok = _gptq(wt, h.astype(jnp.float32), tamax, template.tensor_scale,
                                      static, fmt=fmt.name, scale_mode=scale_mode,
                                      block_size=int(block_size), damp=float(damp),
                                      act_order=bool(act_order))
    try:
        concrete_ok = bool(ok)
    except jax.errors.ConcretizationTypeError:  # traced: cannot be checked here
        concrete_ok = True
    if not concrete_ok:
        raise ValueError(_not_positive_definite(h, damp))
    return _rq.with_elements(template, elems, scales)


# FP-Quant's MSE scale observer (src/quantization/quantizer.py:87-135): 100 float scales from
# the block's max scale down to 0.2 of it, scored by the summed |error| ** 2.4
SEARCH_STEPS = 100
SEARCH_SHRINK = 0.80
SEARCH_NORM = 2.4


@functools.partial(jax.jit, static_argnames=("fmt", "scale_mode"))
def _searched_scales(wt, t, *, fmt, scale_mode):
    """Scale codes ``[N, Kb / b]`` of ``wt [N, K]`` chosen by FP-Quant's MSE observer."""
    f = _formats.get(fmt)
    elem, bs = f.elem, f.block_size
    n, k = wt.shape
    kb = -(-k // bs) * bs
    xb = jnp.pad(wt, ((0, 0), (0, kb - k))).reshape(n, kb // bs, bs)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    base = amax / np.float32(elem.max)

    def candidate(carry, i):
        best_err, best_c = carry
        c = np.float32(1.0) - i.astype(jnp.float32) * np.float32(SEARCH_SHRINK / SEARCH_STEPS)
        sc = c * base
        safe = jnp.where(sc > 0, sc, 1.0)
        v = jnp.clip(xb / safe, -elem.max, elem.max)
        deq = round_to_grid(v, elem, saturate=True) * safe
        err = jnp.sum(jnp.abs(xb - deq) ** np.float32(SEARCH_NORM), axis=-1, keepdims=True)
        better = err < best_err
        return (jnp.where(better, err, best_err), jnp.where(better, c, best_c)), None

    init = (jnp.full_like(amax, np.inf), jnp.ones_like(amax))
    (_, c), _ = lax.scan(candidate, init, jnp.arange(SEARCH_STEPS))
    chosen = (c * amax)[..., 0]
    if f.is_mx:
        e = _qa.mx_scale_exponent(chosen, elem, scale_mode or "floor")
        return (e + 127).astype(jnp.uint8)
    s_raw = jnp.minimum(ieee_div(ieee_div(chosen, np.float32(elem.max)), t),
                        np.float32(E4M3.max))
    s = round_to_grid(jnp.where(t > 0, s_raw, 0.0), E4M3)
    return _qa.encode_elements(s, E4M3)


def _not_positive_definite(h, damp) -> str:
    h = np.asarray(h, np.float64)
    d = np.diagonal(h).copy()
    d[d == 0] = 1.0
    h = h.copy()
    np.fill_diagonal(h, d)
    mean = float(np.mean(d))
    lam = float(np.linalg.eigvalsh(h)[0])
    need = -lam / mean if mean > 0 else float("inf")
    return (
        f"hessian is not positive definite after damping: damp={damp} adds {damp * mean:.4g} "
        f"(damp x its mean diagonal {mean:.4g}) to a smallest eigenvalue of {lam:.4g}; "
        f"damp > {need:.3g} would make it so (a Hessian recorded from too few tokens, or "
        "from non-finite inputs, can also cause this)"
    )


@functools.partial(jax.jit, static_argnames=("fmt", "scale_mode", "block_size", "damp",
                                             "act_order"))
def _gptq(wt, h, tamax, t, static, *, fmt, scale_mode, block_size, damp, act_order):
    """GPTQ on ``wt [N, K]``: ``(values [N, K], elements [N, Kb], scale codes [N, Kb / b],
    ok)`` with ``Kb`` = K rounded up to the format's block ``b``. ``static``: every block's
    scale codes ``[N, Kb / b]`` fixed beforehand (None: chosen as the loop reaches each block,
    or, with ``act_order``, from the original weights)."""
    f = _formats.get(fmt)
    bs, big = f.block_size, block_size
    n, k = wt.shape
    kp = -(-k // big) * big  # whole lazy batches: padded inputs are dead (zero Hessian)
    kb = -(-k // bs) * bs
    w = jnp.pad(wt, ((0, 0), (0, kp - k)))
    h = jnp.pad(h, ((0, kp - k), (0, kp - k)))
    dead = jnp.diagonal(h) == 0
    w = jnp.where(dead[None, :], 0.0, w)
    if static is not None:
        static = jnp.pad(static, ((0, 0), (0, kp // bs - static.shape[1])))
    elif act_order:
        static = _static_scales(w, f, scale_mode, tamax)
    fixed = static is not None
    perm = jnp.argsort(-jnp.diagonal(jnp.where(jnp.eye(kp, dtype=bool) & dead[:, None], 1.0, h)),
                       stable=True) if act_order else jnp.arange(kp)
    if act_order:
        w, h = w[:, perm], h[perm][:, perm]
    u, _ = damped_inverse_factor(h, damp)
    ok = jnp.all(jnp.isfinite(u))

    def batch(bi, carry):
        w, vals, elems, scales = carry
        i1 = bi * big
        w1 = lax.dynamic_slice(w, (0, i1), (n, big))
        u1 = lax.dynamic_slice(u, (i1, i1), (big, big))

        def column(i, c):
            w1, v1, e1, err1, codes, scales = c
            if fixed:
                codes = jnp.take(static, perm[i1 + i] // bs, axis=1)
            else:  # a block's first column: its scale, from the block as updated so far

                def fresh():
                    block = lax.dynamic_slice(w1, (0, i), (n, bs))
                    new = _static_scales(block, f, scale_mode, tamax)  # [N, 1]
                    return new[:, 0], lax.dynamic_update_slice(scales, new, (0, (i1 + i) // bs))

                codes, scales = lax.cond(i % bs == 0, fresh, lambda: (codes, scales))
            col = w1[:, i]
            e, q = _rq.round_on_scales(col, codes, t, fmt, scale_mode)
            err = (col - q) / u1[i, i]
            w1 = w1 - err[:, None] * u1[i][None, :]  # u1 is upper triangular: columns >= i
            v1, e1, err1 = (a.at[:, i].set(b) for a, b in ((v1, q), (e1, e), (err1, err)))
            return w1, v1, e1, err1, codes, scales

        z = jnp.zeros((n, big), jnp.float32)
        init = (w1, z, z, z, jnp.zeros((n,), jnp.uint8), scales)
        _, v1, e1, err1, _, scales = lax.fori_loop(0, big, column, init)
        rows = lax.dynamic_slice(u, (i1, 0), (big, kp))
        later = jnp.arange(kp) >= i1 + big
        w = w - jnp.where(later[None, :], jnp.dot(err1, rows, precision=_HIGHEST), 0.0)
        vals = lax.dynamic_update_slice(vals, v1, (0, i1))
        elems = lax.dynamic_update_slice(elems, e1, (0, i1))
        return w, vals, elems, scales

    zeros = jnp.zeros((n, kp), jnp.float32)
    scales0 = jnp.zeros((n, kp // bs), jnp.uint8)
    _, vals, elems, scales = lax.fori_loop(0, kp // big, batch, (w, zeros, zeros, scales0))
    if act_order:
        inv = jnp.argsort(perm)
        vals, elems = vals[:, inv], elems[:, inv]
    if fixed:
        scales = static
    return vals[:, :k], elems[:, :kb], scales[:, : kb // bs], ok


def _static_scales(w, f, scale_mode, tamax):
    """Every block's scale codes ``[N, K / b]`` that lowbit's quantizer chooses for the
    weights ``w [N, K]`` as they are (the tensor scale from ``tamax``)."""
    kw = {} if f.is_mx else {"tensor_amax": tamax}
    return _qa.quantize(w, f, -1, scale_mode=scale_mode, **kw).scales
