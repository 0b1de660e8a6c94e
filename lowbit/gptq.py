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
from lowbit.core import qarray as _qa
from lowbit.core import requantize as _rq

__all__ = ["gptq", "damped_inverse_factor"]

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
    if isinstance(fmt, str) and fmt.lower() in ("e4m3", "e5m2", "int8"):
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
         act_order: bool = False, **quantizer_options) -> _qa.QArray:
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
    wt = (w.T if axis == 0 else w).astype(jnp.float32)  # [N, K]: rows outputs, columns inputs
    tamax = jnp.max(jnp.where(jnp.isfinite(wt), jnp.abs(wt), 0.0))
    # the layout, and NVFP4's / INT4's tensor scale of the original weights
    template = _qa.quantize(w, fmt, axis, scale_mode=scale_mode)
    values, elems, scales, ok = _gptq(wt, h.astype(jnp.float32), tamax, template.tensor_scale,
                                      fmt=fmt.name, scale_mode=scale_mode,
                                      block_size=int(block_size), damp=float(damp),
                                      act_order=bool(act_order))
    try:
        concrete_ok = bool(ok)
    except jax.errors.ConcretizationTypeError:  # traced: cannot be checked here
        concrete_ok = True
    if not concrete_ok:
        raise ValueError(_not_positive_definite(h, damp))
    return _rq.with_elements(template, elems, scales)


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


def _group_scales(wg, fmt, scale_mode, tamax):
    """The scale codes ``[N]`` lowbit's quantizer chooses for the block ``wg [N, b]``."""
    kw = {} if _formats.get(fmt).is_mx else {"tensor_amax": tamax}
    return _qa.quantize(wg, fmt, -1, scale_mode=scale_mode, **kw).scales[:, 0]


@functools.partial(jax.jit, static_argnames=("fmt", "scale_mode", "block_size", "damp",
                                             "act_order"))
def _gptq(wt, h, tamax, t, *, fmt, scale_mode, block_size, damp, act_order):
    """GPTQ on ``wt [N, K]``: ``(values [N, K], elements [N, Kb], scale codes [N, Kb / b],
    ok)`` with ``Kb`` = K rounded up to the format's block ``b``."""
    f = _formats.get(fmt)
    bs, big = f.block_size, block_size
    n, k = wt.shape
    kp = -(-k // big) * big  # whole lazy batches: padded inputs are dead (zero Hessian)
    kb = -(-k // bs) * bs
    w = jnp.pad(wt, ((0, 0), (0, kp - k)))
    h = jnp.pad(h, ((0, kp - k), (0, kp - k)))
    dead = jnp.diagonal(h) == 0
    w = jnp.where(dead[None, :], 0.0, w)
    static = _static_scales(w, f, scale_mode, tamax) if act_order else None
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
            if act_order:
                codes = jnp.take(static, perm[i1 + i] // bs, axis=1)
            else:
                fresh = lax.cond(
                    i % bs == 0,
                    lambda: _group_scales(lax.dynamic_slice(w1, (0, i), (n, bs)), fmt,
                                          scale_mode, tamax),
                    lambda: codes)
                codes = fresh
                scales = lax.dynamic_update_slice(scales, codes[:, None], (0, (i1 + i) // bs))
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
        vals, elems, scales = vals[:, inv], elems[:, inv], static
    return vals[:, :k], elems[:, :kb], scales[:, : kb // bs], ok


def _static_scales(w, f, scale_mode, tamax):
    """Every block's scale codes ``[N, K / b]`` from the weights ``w [N, K]`` as they are."""
    kw = {} if f.is_mx else {"tensor_amax": tamax}
    return _qa.quantize(w, f, -1, scale_mode=scale_mode, **kw).scales
