"""Post-training quantization of grouped (``lb.ragged_dot``) sites, the experts of an MoE:
calibration sees each group's rows only (one static amax over every group's tokens, a
Hessian per group), GPTQ quantizes each expert from its own Hessian as its own tensor, and
the packed model serves what the fake-quantized one computes, bit for bit."""

from __future__ import annotations

import dataclasses
import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit as lb
import lowbit.flax as lbf
import lowbit.ptq as ptq

SIZES = jnp.array([20, 0, 5, 30], jnp.int32)  # an empty group; rows 55.. are in none
ROWS, K, N = 64, 64, 32


class _Experts(nnx.Module):
    def __init__(self):
        self.experts = lbf.nnx.GroupedLinear(4, K, N, rngs=nnx.Rngs(0))

    def __call__(self, batch):
        x, sizes = batch
        return self.experts(x, sizes)


def _batches(n=3):
    out = []
    for i in range(n):
        x = jax.random.normal(jax.random.key(i), (ROWS, K))
        x = x.at[int(jnp.sum(SIZES)):].set(1e3)  # rows in no group: must not be seen
        out.append((x, SIZES))
    return out


def _rows(batches, g):
    """The rows of group ``g`` over the batches (float64)."""
    ends = np.cumsum(np.asarray(SIZES))
    lo = 0 if g == 0 else ends[g - 1]
    return np.concatenate([np.asarray(x, np.float64)[lo:ends[g]] for x, _ in batches])


def test_calibration_sees_each_groups_rows_only():
    model, batches = _Experts(), _batches()
    cal = ptq.calibrate(model, [(".*", "qat_nvfp4")], batches, "max", hessians=True)
    valid = np.concatenate([_rows(batches, g) for g in range(4)])
    assert cal.amax["experts"] == pytest.approx(np.abs(valid).max(), rel=0)  # not 1e3
    assert int(cal.histograms["experts"].count) == valid.size
    np.testing.assert_array_equal(cal.channel_amax["experts"], np.abs(valid).max(0))
    assert cal.group_tokens["experts"] == (60, 0, 15, 90)
    h = cal.hessians["experts"]
    assert h.shape == (4, K, K)
    for g in range(4):
        xg = _rows(batches, g)
        np.testing.assert_allclose(h[g], xg.T @ xg, rtol=2e-5, atol=2e-4)
    assert not np.any(h[1])  # the empty group
    back = ptq.Calibration.from_json(json.loads(json.dumps(cal.to_json())))
    assert back.group_tokens == cal.group_tokens and back.amax == cal.amax
    mse = ptq.calibrate(model, [(".*", "qat_nvfp4")], batches, "mse")
    assert mse.samples["experts"].shape[0] == 3 * 55  # rows in no group are not sampled
    assert 0 < mse.amax["experts"] <= cal.amax["experts"]


def test_served_experts_use_the_static_amax_and_equal_the_simulated_model():
    """The packed model serves what ``simulate`` computes, and both are the QAT model with the
    calibrated amax as the activation's static scale (``cal.rules``), bit for bit."""
    model, batches = _Experts(), _batches()
    rules = [(".*", "qat_nvfp4")]
    cal = ptq.calibrate(model, rules, batches, "percentile", percentile=99.0)
    assert cal.amax["experts"] < float(jnp.max(jnp.abs(batches[0][0][:55])))
    served, sim = ptq.quantize(model, rules, cal), ptq.simulate(model, rules, cal)
    qat = lbf.quantize(model, cal.rules(rules))
    dynamic = lbf.quantize(model, rules)
    for b in batches:
        y = served(b)
        np.testing.assert_array_equal(y, sim(b))
        np.testing.assert_array_equal(y, qat(b))
        assert not np.array_equal(y[:55], dynamic(b)[:55])  # the static scale changed it
        np.testing.assert_array_equal(y[55:], 0.0)


def test_grouped_gptq_is_each_experts_own_gptq_and_an_idle_expert_rounds_to_nearest():
    model, batches = _Experts(), _batches()
    rules = [(".*", "qat_nvfp4")]
    cal = ptq.calibrate(model, rules, batches, "max", hessians=True)
    with pytest.warns(UserWarning, match=r"site 'experts': experts \[1\] got no calibration "
                                         r"token; their weights are rounded to nearest"):
        served = ptq.quantize(model, rules, cal, weights="gptq")
    w = np.asarray(model.experts.kernel[...])
    x = batches[0][0]
    r = lb.recipes.get("qat_nvfp4")  # as served: the activation at the static amax, the
    serve = dataclasses.replace(r, fwd=dataclasses.replace(  # weight entering as it is
        r.fwd, lhs=dataclasses.replace(r.fwd.lhs, amax=cal.amax["experts"]), rhs=None))
    for g in range(4):
        if g == 1:  # no token: the standard (round-to-nearest) quantization of that expert
            want = np.asarray(lb.dequantize(lb.quantize(w[g], "nvfp4", axis=0), jnp.float32))
        else:
            q = lb.calibrate.gptq(w[g], cal.hessians["experts"][g], "nvfp4", axis=0)
            want = np.asarray(lb.dequantize(q, jnp.float32))
            rtn = lb.dequantize(lb.quantize(w[g], "nvfp4", axis=0), jnp.float32)
            assert not np.array_equal(want, np.asarray(rtn))
        lo = int(jnp.sum(SIZES[:g]))
        xs = x[lo:lo + int(SIZES[g])]
        # the served expert g computes with that weight (float32 sums in another order)
        got = served(batches[0])[lo:lo + int(SIZES[g])]
        ref = lb.dot_general(xs, jnp.asarray(want), (((1,), (0,)), ((), ())), recipe=serve)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = ptq.simulate(model, rules, cal, weights="gptq")
    np.testing.assert_array_equal(served(batches[1]), sim(batches[1]))
    err = {}
    for name, m in (("gptq", served), ("rtn", ptq.quantize(model, rules, cal))):
        err[name] = sum(float(jnp.sum((m(b) - model(b))[:55] ** 2)) for b in batches)
    assert err["gptq"] < 0.9 * err["rtn"], err


def test_smoothing_a_grouped_site_is_refused():
    model, batches = _Experts(), _batches(1)
    rules = [(".*", "qat_nvfp4")]
    bad = ptq.Smoothing(scales={"experts": np.ones(K, np.float32)})
    with pytest.raises(ValueError, match=r"smoothing site 'experts' .*needs a dense \[K, N\] "
                                         r"weight .*got kind 'ragged_dot'"):
        ptq.calibrate(model, rules, batches, smoothing=bad)


class _LinenExperts(nn.Module):
    @nn.compact
    def __call__(self, batch):
        return lbf.linen.GroupedDense(4, N, name="experts")(*batch)


def test_linen_grouped_gptq_serves_what_it_simulates():
    batches = _batches(2)
    module = _LinenExperts()
    bound = module.bind(module.init(jax.random.key(1), batches[0]))
    rules = [(".*", "qat_mxfp4")]
    cal = ptq.calibrate(bound, rules, batches, hessians=True)
    assert cal.group_tokens == {"experts": (40, 0, 10, 60)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = ptq.quantize(bound, rules, cal, weights="gptq", example=batches[0])
        sim = ptq.simulate(bound, rules, cal, weights="gptq", example=batches[0])
    np.testing.assert_array_equal(served(batches[1]), sim(batches[1]))
    assert isinstance(served.variables["params"]["experts"]["kernel"], lb.QArray)
