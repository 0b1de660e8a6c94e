"""GPTQ (``lb.calibrate.gptq``) against a float64 transcription of the reference algorithm.

The transcription below follows IST-DASLab/gptq's ``GPTQ.fasterquant`` without lazy batching
(one column at a time, every later column updated at once), with the block-scale convention of
``lowbit.gptq``: a block's scale is chosen, by the independent quantizers of
``tests/reference.py``, from its weights as updated when the loop reaches its first column; the
tensor scale (NVFP4, INT4) from the original weights. Everything here is numpy float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.core.hadamard import hadamard_transform
from lowbit.core.requantize import round_on_scales
from tests import reference as ref

FORMATS = ["mxfp4", "nvfp4", "int4", "mxfp8_e4m3"]


def _scale_and_round(fmt: str, tamax: float):
    """(block scale of a block [N, b] as float64 [N, 1], rounding of a column on it)."""
    if fmt.startswith("mx"):
        elem = ref.ELEMS[ref.MX_ELEM[fmt]]

        def scale(block):
            return ref.mx_quantize(block.astype(np.float32), fmt, axis=-1).scale

        def round_col(col, s):
            v = np.clip(col / s[:, 0], -elem.max, elem.max)
            return ref.round_to_grid(v, elem)[0] * s[:, 0]

        return scale, round_col
    name = "e2m1" if fmt == "nvfp4" else "int4"
    elem = ref.ELEMS[name]

    def scale(block):
        r = ref.nvfp4_quantize(block.astype(np.float32), axis=-1, tensor_amax=tamax, elem=name)
        return np.stack([r.scale, np.broadcast_to(r.tensor_scale, r.scale.shape)], -1)

    def round_col(col, st):
        s, t = st[:, 0, 0], st[:, 0, 1]
        live = s > 0
        v = np.where(live, col * (1.0 / t) / np.where(live, s, 1.0), 0.0)
        v = np.clip(v, -elem.max, elem.max)
        return ref.round_to_grid(v, elem)[0] * s * t

    return scale, round_col


def reference_gptq(w, h, fmt, damp=0.01):
    """Float64 GPTQ of ``w [K, N]`` (contraction axis 0): the dequantized weight ``[K, N]``."""
    wt = np.asarray(w, np.float64).T.copy()  # [N, K]
    h = np.asarray(h, np.float64).copy()
    n, k = wt.shape
    b = lb.formats.get(fmt).block_size
    tamax = float(np.max(np.abs(np.asarray(w, np.float32))))
    scale, round_col = _scale_and_round(fmt, tamax)
    dead = np.diagonal(h) == 0
    h[dead, dead] = 1
    wt[:, dead] = 0
    h[np.diag_indices(k)] += damp * np.mean(np.diagonal(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper factor of the inverse
    q = np.zeros_like(wt)
    s = None
    for i in range(k):
        if i % b == 0:
            s = scale(wt[:, i: i + b])
        q[:, i] = round_col(wt[:, i], s)
        err = (wt[:, i] - q[:, i]) / u[i, i]
        wt[:, i:] -= np.outer(err, u[i, i:])
    return q.T


def _layer(seed=0, k=128, n=48, tokens=512, outliers=False):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((tokens, k))
    mix = np.eye(k) + 0.6 * rng.standard_normal((k, k)) / np.sqrt(k)
    x = z @ mix + 0.8 * np.roll(z, 1, axis=1)  # correlated inputs
    if outliers:
        x[:, rng.choice(k, 4, replace=False)] *= 20.0
    w = rng.standard_normal((k, n)) * 0.05
    return x.astype(np.float32), w.astype(np.float32)


def _out_err(x, v, w):
    d = np.asarray(x, np.float64) @ (np.asarray(v, np.float64) - np.asarray(w, np.float64))
    return float(np.sum(d * d))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gptq_matches_the_float64_reference_and_halves_rtn_error(fmt):
    x, w = _layer()
    h = x.T.astype(np.float64) @ x
    got = np.asarray(lb.dequantize(lb.calibrate.gptq(w, h.astype(np.float32), fmt)))
    want = reference_gptq(w, h, fmt)
    same = np.mean(got == want.astype(np.float32))
    assert same > 0.9, f"only {same:.1%} of the weights equal the reference's"
    e_got, e_ref = _out_err(x, got, w), _out_err(x, want, w)
    e_rtn = _out_err(x, lb.dequantize(lb.quantize(w, fmt, axis=0)), w)
    assert e_got <= 1.02 * e_ref, (e_got, e_ref)
    assert e_got < 0.65 * e_rtn, (e_got, e_rtn)


@pytest.mark.parametrize("fmt,mode", [("mxfp4", None), ("mxfp4", "rceil"), ("mxfp8_e5m2", None),
                                      ("mxint8", None), ("mxfp6_e3m2", "even"), ("nvfp4", None),
                                      ("nvfp4", "4over6"), ("int4", None)])
def test_round_on_scales_is_lb_quantize_once_the_scales_are_chosen(fmt, mode):
    x = jax.random.normal(jax.random.key(8), (16, 64)) * jnp.exp(
        2 * jax.random.normal(jax.random.key(9), (16, 64)))
    q = lb.quantize(x, fmt, axis=-1, scale_mode=mode)
    codes = jnp.repeat(q.scales, lb.formats.get(fmt).block_size, axis=1)
    _, v = round_on_scales(x, codes, q.tensor_scale, fmt, mode)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(lb.dequantize(q)))


def test_lazy_batch_size_does_not_change_the_result():
    x, w = _layer(1)
    h = x.T @ x
    a = lb.dequantize(lb.calibrate.gptq(w, h, "nvfp4", block_size=16))
    b = lb.dequantize(lb.calibrate.gptq(w, h, "nvfp4", block_size=128))
    assert np.mean(np.asarray(a) == np.asarray(b)) > 0.97


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_result_is_laid_out_as_lb_quantize_and_each_block_on_its_scale(fmt):
    x, w = _layer(2, k=64, n=16)
    q = lb.calibrate.gptq(w.T, x.T @ x, fmt, axis=1)  # w [N, K]: contraction axis 1
    std = lb.quantize(w.T, fmt, axis=1)
    assert (q.codes.shape, q.scales.shape, q.axes, q.shape) == (
        std.codes.shape, std.scales.shape, std.axes, std.shape)
    if q.tensor_scale is not None:  # NVFP4's tensor scale: the original weights'
        assert float(q.tensor_scale) == float(std.tensor_scale)
    v = lb.dequantize(q)
    b = lb.formats.get(fmt).block_size
    codes = jnp.repeat(q.scales, b, axis=1)
    _, again = round_on_scales(v, codes, q.tensor_scale, fmt)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(v))


def test_act_order_keeps_blocks_contiguous_with_static_scales():
    x, w = _layer(3, k=64, n=16)
    x[:, 40:44] *= 8.0  # a few strong inputs late in the order
    h = x.T @ x
    q = lb.calibrate.gptq(w, h, "mxfp4", act_order=True)
    # static groups: every block's scale from the original weights, as lb.quantize chose it
    np.testing.assert_array_equal(np.asarray(q.scales),
                                  np.asarray(lb.quantize(w, "mxfp4", axis=0).scales))
    e_act = _out_err(x, lb.dequantize(q), w)
    e_rtn = _out_err(x, lb.dequantize(lb.quantize(w, "mxfp4", axis=0)), w)
    assert e_act < 0.8 * e_rtn


def test_dead_inputs_get_zero_weights():
    x, w = _layer(4, k=64, n=8)
    x[:, [3, 17]] = 0.0
    q = lb.dequantize(lb.calibrate.gptq(w, x.T @ x, "nvfp4"))
    assert np.all(np.asarray(q)[[3, 17]] == 0)
    assert np.any(np.asarray(q)[[2, 4]] != 0)


def test_scale_mode_four_over_six_runs_through_gptq():
    x, w = _layer(5, k=64, n=16)
    h = x.T @ x
    q = lb.calibrate.gptq(w, h, "nvfp4", scale_mode="4over6")
    e = _out_err(x, lb.dequantize(q), w)
    e_rtn = _out_err(x, lb.dequantize(lb.quantize(w, "nvfp4", axis=0, scale_mode="4over6")), w)
    assert e < 0.7 * e_rtn


def test_clear_errors():
    x, w = _layer(6, k=32, n=8)
    h = x.T @ x
    with pytest.raises(ValueError, match=r"hessian must be \[32, 32\]"):
        lb.calibrate.gptq(w, h[:16, :16], "mxfp4")
    with pytest.raises(ValueError, match="block_size=48 must be a positive multiple of"):
        lb.calibrate.gptq(w, h, "mxfp4", block_size=48)
    with pytest.raises(TypeError, match="tensor_block"):
        lb.calibrate.gptq(w, h, "nvfp4", tensor_block=128)
    with pytest.raises(ValueError, match="GPTQ rounds to nearest"):
        lb.calibrate.gptq(w, h, "nvfp4", rounding="stochastic")
    with pytest.raises(ValueError, match="per-tensor element format"):
        lb.calibrate.gptq(w, h, "e4m3")
    bad = -np.eye(32, dtype=np.float32)  # negative definite: no small damp helps
    with pytest.raises(ValueError, match=r"not positive definite.*damp > "):
        lb.calibrate.gptq(w, bad, "mxfp4", damp=0.0)


def test_traced_gptq_runs_under_jit():
    x, w = _layer(7, k=32, n=8)
    h = jnp.asarray(x.T @ x)
    f = jax.jit(lambda w, h: lb.dequantize(lb.calibrate.gptq(w, h, "mxfp4")))
    np.testing.assert_array_equal(np.asarray(f(w, h)),
                                  np.asarray(lb.dequantize(lb.calibrate.gptq(w, h, "mxfp4"))))


# --------------------------------------------------------------------------------------------
# MR-GPTQ


def _fp_quant_mse_amax(wt, elem_name, elem_max):
    """FP-Quant's MSE observer (quantizer.py:87-135) in float64: per block of ``wt [N, K/b,
    b]`` the chosen amax ``c * amax`` (first best of c = 1 - 0.8 i / 100, |err| ** 2.4)."""
    elem = ref.ELEMS[elem_name]
    amax = np.max(np.abs(wt), axis=-1)
    best, chosen = np.full(amax.shape, np.inf), amax.copy()
    for i in range(100):
        c = 1 - i * 0.8 / 100
        sc = np.where(amax > 0, c * amax / elem_max, 1.0)[..., None]
        deq = ref.round_to_grid(np.clip(wt / sc, -elem_max, elem_max), elem)[0] * sc
        err = np.sum(np.abs(wt - deq) ** 2.4, axis=-1)
        better = err < best
        best, chosen = np.where(better, err, best), np.where(better, c * amax, chosen)
    return chosen


def test_mr_gptq_scale_search_is_fp_quants_observer():
    """With an identity Hessian GPTQ is round-to-nearest on the fixed scales: the scales are
    the search's alone. NVFP4's code is E4M3(amax' / 6 / t), FP-Quant's own cast."""
    x, w = _layer(9, k=64, n=32)
    q = lb.calibrate.mr_gptq(w, np.eye(64, dtype=np.float32), "nvfp4")
    wr = np.asarray(hadamard_transform(jnp.asarray(w), 16, axis=0), np.float64)
    blocks = wr.T.reshape(32, 4, 16)
    amax = _fp_quant_mse_amax(blocks, "e2m1", 6.0)
    t = np.float32(np.max(np.abs(wr.astype(np.float32))) / np.float32(2688.0))
    _, codes = ref.round_to_grid(np.minimum(amax / 6.0 / t, 448.0), ref.ELEMS["e4m3"])
    assert np.mean(np.asarray(q.scales) == codes) > 0.95
    assert np.mean(amax < np.max(np.abs(blocks), -1)) > 0.3  # the search shrinks many blocks


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_mr_gptq_rotation_cancels_and_beats_gptq_on_outliers(fmt):
    x, w = _layer(10, k=256, n=64, outliers=True)
    h = x.T @ x
    b = lb.formats.get(fmt).block_size
    q = lb.calibrate.mr_gptq(w, h, fmt)
    wr = lb.dequantize(q)  # the rotated weight, quantized
    # the served layer (x H_b) w_r equals x (H_b w_r): the rotation and its inverse cancel
    served = hadamard_transform(jnp.asarray(x), b, axis=-1) @ wr
    direct = jnp.asarray(x) @ hadamard_transform(wr, b, axis=0)
    np.testing.assert_allclose(np.asarray(served), np.asarray(direct), rtol=1e-4, atol=1e-3)
    wf = hadamard_transform(jnp.asarray(w), b, axis=0)  # float: exact up to rounding
    np.testing.assert_allclose(np.asarray(hadamard_transform(jnp.asarray(x), b, axis=-1) @ wf),
                               np.asarray(x @ w), rtol=1e-4, atol=1e-4)
    e_mr = _out_err(x, hadamard_transform(wr, b, axis=0), w)
    e_gptq = _out_err(x, lb.dequantize(lb.calibrate.gptq(w, h, fmt)), w)
    assert e_mr < 0.5 * e_gptq, (e_mr, e_gptq)


def test_mr_gptq_clear_errors():
    x, w = _layer(11, k=64, n=8)
    h = x.T @ x
    with pytest.raises(ValueError, match="hadamard=48 must be a power of two"):
        lb.calibrate.mr_gptq(w, h, "mxfp4", hadamard=48)
    with pytest.raises(ValueError, match="scale_search=False"):
        lb.calibrate.mr_gptq(w, h, "nvfp4", scale_mode="4over6")
