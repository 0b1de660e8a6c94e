"""SmoothQuant / AWQ-lite smoothing scales and SVDQuant low-rank branches, searched per dense
site."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.flax._core import Rules, weight_spec
from lowbit.gemm.operand import quantize_operand
from lowbit.gemm.recipes import QuantSpec, Recipe
from lowbit.ptq.calibration import observe_batches
from lowbit.ptq.sites import ALPHAS, MAX_ROWS, as_model, check_packable, dense_sites, kernel_value
from lowbit.ptq.transforms import Smoothing


@jax.jit
def _rel_err(y, ref):
    return jnp.sum(jnp.square(y - ref)) / jnp.maximum(jnp.sum(jnp.square(ref)), 1e-30)


def _quant_w(w, spec: QuantSpec | None):
    return w if spec is None else _fake_w(w, spec)


def _fake_w(w, spec):
    return _jit_operand(jnp.asarray(w, jnp.float32), spec, 0, 1)


def _fake_x(x, spec: QuantSpec | None):
    if spec is None:
        return jnp.asarray(x, jnp.float32)
    return _jit_operand(jnp.asarray(x, jnp.float32), spec, 1, 0)


_jit_operand = jax.jit(
    lambda x, spec, axis, other: quantize_operand(x, spec, axis, other, None),
    static_argnums=(1, 2, 3),
)


def _svd(w: np.ndarray, rank: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    u, sv, vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
    r = np.sqrt(sv[:rank])
    a = (u[:, :rank] * r).astype(np.float32)
    b = (r[:, None] * vt[:rank]).astype(np.float32)
    return np.asarray(jnp.asarray(a, dtype)), np.asarray(jnp.asarray(b, dtype))


def _branch(ws: np.ndarray, spec, rank: int, iterations: int, dtype):
    """SVDQuant's branch of the smoothed weight ``ws``: ``L = SVD_r(ws)``, then ``iterations``
    refinements ``L <- SVD_r(ws - Q(ws - L))``. Returns the factors and the residual."""
    a, b = _svd(ws, rank, dtype)
    for _ in range(iterations):
        low = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
        q = np.asarray(_quant_w(ws - low, spec))
        a, b = _svd(ws - q, rank, dtype)
    low = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    return (a, b), ws - low


def _scales(xmax: np.ndarray, wmax: np.ndarray, alpha: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.power(xmax.astype(np.float64), alpha) / np.power(wmax.astype(np.float64),
                                                                1.0 - alpha)
    ok = np.isfinite(s) & (s > 0) & (xmax > 0) & (wmax > 0)
    return np.where(ok, np.clip(s, 1e-6, 1e6), 1.0).astype(np.float32)


def _search(x, w, xmax, recipe: Recipe, alphas, rank, iterations, dtype, smoothing: bool,
            fixed=None):
    """The scales (and branch) of least output error on the calibration rows ``x``; ``fixed``:
    ``(alpha, s)`` given, not searched."""
    spec_x, spec_w = recipe.fwd.lhs, weight_spec(recipe)
    ref = jnp.asarray(x) @ jnp.asarray(w)
    wmax = np.max(np.abs(w), axis=1)
    best = None
    for a in (alphas if smoothing and fixed is None else (None,)):
        if fixed is not None:
            a, s = fixed
            s = np.asarray(s, np.float32)
        else:
            s = _scales(xmax, wmax, a) if a is not None else np.ones(w.shape[0], np.float32)
        xs = np.asarray(jnp.asarray(x) / s[None, :])
        ws = np.asarray(s[:, None] * w, np.float32)
        lowrank, resid = (None, ws) if rank == 0 else _branch(ws, spec_w, rank, iterations, dtype)
        y = _fake_x(xs, spec_x) @ _quant_w(resid, spec_w)
        if lowrank is not None:
            y = y + (jnp.asarray(xs) @ np.asarray(lowrank[0], np.float32)) @ np.asarray(
                lowrank[1], np.float32
            )
        err = float(_rel_err(y, ref))
        if best is None or err < best[0]:
            best = (err, a, s, lowrank)
    return best


def _smoothing(model, rules, batches, alpha, rank, iterations, *, forward, example, dtype,
               smoothing, max_rows: int, where: str) -> Smoothing:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{where}: rank must be a non-negative int, got {rank!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"{where}: iterations must be a non-negative int, got {iterations!r}")
    if alpha is None:
        alphas = ALPHAS
    else:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"{where}: alpha must be None (searched) or in [0, 1], got {alpha!r}")
        alphas = (float(alpha),)
    given = smoothing if isinstance(smoothing, Smoothing) else None
    if not (isinstance(smoothing, bool) or smoothing is None or given is not None):
        raise TypeError(
            f"{where}: smoothing must be None / False (s = 1), True (searched) or a Smoothing "
            f"(from smooth()), got {type(smoothing).__name__}"
        )
    m = as_model(model)
    rules = Rules.of(rules)
    sites, stats, _ = observe_batches(m, rules, batches, forward, None, max_rows, example)
    if given is not None:
        given.check(sites, rules)
    scales, alpha_of, lowrank, errors = {}, {}, {}, {}
    for site in dense_sites(sites, where):
        recipe = rules.active(site.path)
        check_packable(site, recipe)
        if rank > min(site.shape):
            raise ValueError(
                f"{where}: rank={rank} exceeds the weight {site.shape} of site {site.path!r}"
            )
        w = kernel_value(m, site)
        st = stats[site.path]
        fixed = None
        if given is not None and site.path in given.scales:
            fixed = (given.alpha.get(site.path), given.scales[site.path])
        err, a, s, lr = _search(st["rows"], w, st["chan"], recipe, alphas, rank, iterations,
                                dtype, smoothing is True, fixed)
        scales[site.path], alpha_of[site.path], errors[site.path] = s, a, err
        if lr is not None:
            lowrank[site.path] = lr
    return Smoothing(scales, alpha_of, lowrank, errors)


def smooth(
    model,
    rules,
    batches: Iterable,
    alpha: float | None = None,
    *,
    forward: Callable | None = None,
    example=None,
    max_rows: int = MAX_ROWS,
) -> Smoothing:
    """SmoothQuant / AWQ-lite smoothing of every dense site ``rules`` quantize.

    Per input channel ``j``, ``s_j = max|X_j|^a / max|W_j|^(1-a)`` (``max|X_j|`` over the
    calibration batches, ``max|W_j|`` over the weight's row ``j``; channels where either is 0
    keep ``s_j = 1``). The activation is divided by ``s`` at the site and the weight's row ``j``
    multiplied by ``s_j``: exact in real arithmetic, it moves activation outliers into the
    weights (SmoothQuant, Xiao et al. 2023) and, for weight-only recipes, protects the
    weight channels that large activations read (AWQ, Lin et al. 2024). ``alpha`` None:
    ``a`` is searched per site over :data:`ALPHAS`, minimizing the site's relative output
    error ``|Q(X/s) Q(diag(s) W) - X W|^2 / |X W|^2`` on the calibration rows (activations
    with their dynamic scales, weights as packed).

    Returns a :class:`Smoothing` for :func:`calibrate` / :func:`quantize` (``smoothing=``).
    """
    return _smoothing(model, rules, batches, alpha, 0, 0, forward=forward, example=example,
                      dtype=jnp.float32, smoothing=True, max_rows=max_rows, where="smooth")


def svdquant(
    model,
    rules,
    batches: Iterable,
    rank: int = 32,
    *,
    smoothing: Smoothing | bool | None = None,
    alpha: float | None = None,
    iterations: int = 0,
    branch_dtype=jnp.bfloat16,
    forward: Callable | None = None,
    example=None,
    max_rows: int = MAX_ROWS,
) -> Smoothing:
    """SVDQuant (Li et al. 2025): a high-precision low-rank branch after smoothing.

    Per dense site, the smoothed weight ``W' = diag(s) W`` is split into ``L1 @ L2`` from its
    rank-``rank`` SVD (``L1 = U_r sqrt(S_r)``, ``L2 = sqrt(S_r) V_r^T``, stored in
    ``branch_dtype``, 16-bit as in the paper) and the residual ``W' - L1 L2``, which is
    quantized to the site's format. ``iterations`` refinements ``L <- SVD_r(W' - Q(W' - L))``
    fit the branch to what quantization loses. The branch runs in float32 on the smoothed
    activation ``x / s``.

    ``smoothing``: the scales ``s``: a :class:`Smoothing` from :func:`smooth` (the paper's
    order: smooth, then decompose), True (``a`` searched as in :func:`smooth` but with the
    branch in place, or ``alpha`` if given), or None / False (``s = 1``: no smoothing, so
    ``rank=0`` is plain post-training quantization exactly).

    Returns a :class:`Smoothing` holding the scales and the branches. Its bits count in
    :func:`bits_per_param`.
    """
    return _smoothing(model, rules, batches, alpha, rank, iterations, forward=forward,
                      example=example, dtype=branch_dtype, smoothing=smoothing,
                      max_rows=max_rows, where="svdquant")
