"""lowbit.ptq: calibration hooks, static scales, smoothing, SVDQuant, packed == simulated."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit as lb
import lowbit.flax as lbf
import lowbit.ptq as ptq

D, H, O = 64, 128, 32


class MLP(nnx.Module):
    def __init__(self, rngs, d=D):
        self.up = nnx.Linear(d, H, rngs=rngs)
        self.down = nnx.Linear(H, O, rngs=rngs)
        self.head = nnx.Linear(O, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(self.down(nnx.gelu(self.up(x))))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(H, name="up")(x))
        return nn.Dense(8, name="head")(nn.Dense(O, name="down")(x))


def _batches(n=3, rows=32, d=D, outliers=True, seed=0):
    out = []
    for i in range(n):
        x = jax.random.normal(jax.random.key(seed + i), (rows, d))
        if outliers:  # a few activation channels far larger than the rest (LLM-like)
            x = x.at[:, :3].multiply(20.0)
        out.append(x)
    return out


RULES = [("head", "none"), (r"up", "qat_nvfp4"), (r"down", "qat_mxfp4")]


def _call(m, x):
    return nnx.jit(lambda m, x: m(x))(m, x)


@pytest.fixture(scope="module")
def model():
    return MLP(nnx.Rngs(0))


@pytest.fixture(scope="module")
def cal(model):
    return ptq.calibrate(model, RULES, _batches(), "mse")


# --------------------------------------------------------------------------------------------
# calibration


def test_hooks_see_each_site_input_exactly(model, cal):
    """The first site's activation is the model input: its histogram over the batches is
    the histogram of their concatenation, its channel max the inputs' own; the second site's
    is the GELU output the float model computes."""
    xs = _batches()
    want = lb.calibrate.Histogram.of(jnp.concatenate(xs))
    got = cal.histograms["up"]
    np.testing.assert_array_equal(got.counts, want.counts)
    assert int(got.width_exp) == int(want.width_exp) and float(got.max) == float(want.max)
    np.testing.assert_array_equal(cal.channel_amax["up"], np.max(np.abs(np.concatenate(xs)), 0))
    h = np.concatenate([np.asarray(nnx.gelu(model.up(x))) for x in xs])
    assert float(cal.histograms["down"].max) == float(np.max(np.abs(h)))
    assert sorted(cal.amax) == ["down", "up"]  # "head" is not quantized
    assert cal.formats == {"up": "nvfp4", "down": "mxfp4"} and cal.batches == 3
    p99 = cal.with_method("percentile", percentile=99.0)
    for site in cal.amax:  # percentile 99 and mse: below the max
        assert 0 < p99.amax[site] < float(cal.histograms[site].max)
        assert 0 < cal.amax[site] <= float(cal.histograms[site].max)


def test_methods_and_json_round_trip(cal, tmp_path):
    by_max = cal.with_method("max")
    assert by_max.amax["up"] == float(cal.histograms["up"].max)
    assert cal.with_method("mse").amax == cal.amax
    back = ptq.Calibration.load(cal.save(tmp_path / "cal.json"))
    assert back.amax == cal.amax and back.method == "mse" and back.batches == 3
    assert json.loads((tmp_path / "cal.json").read_text())["formats"] == cal.formats
    np.testing.assert_array_equal(back.histograms["down"].counts, cal.histograms["down"].counts)
    assert back.with_method("entropy").amax == cal.with_method("entropy").amax
    with pytest.raises(ValueError, match="samples"):
        back.with_method("mse")
    assert not ptq.calibrate(MLP(nnx.Rngs(0)), RULES, _batches(1)).samples["up"].size


def test_static_amax_reaches_the_quantizer(model, cal):
    """The simulated model quantizes each site's activation with the calibrated amax: NVFP4
    as its tensor amax, MX as a clip (checked against lb.fake_quantize by hand)."""
    x = _batches(1, seed=7)[0]
    sim = ptq.simulate(model, RULES, cal)
    a_up, a_dn = np.float32(cal.amax["up"]), np.float32(cal.amax["down"])
    hp = jax.lax.Precision.HIGHEST

    @nnx.jit  # one program (op by op, the small ops' compiles would dominate the test)
    def by_hand(model, x):
        xq = lb.fake_quantize(x, "nvfp4", tensor_amax=a_up)
        wq = lb.fake_quantize(model.up.kernel.get_value(), "nvfp4", 0)
        h = nnx.gelu(jnp.matmul(xq, wq, precision=hp) + model.up.bias.get_value()[None])
        hq = lb.fake_quantize(jnp.clip(h, -a_dn, a_dn), "mxfp4")
        w2 = lb.fake_quantize(model.down.kernel.get_value(), "mxfp4", 0)
        return model.head(jnp.matmul(hq, w2, precision=hp) + model.down.bias.get_value()[None])

    np.testing.assert_allclose(_call(sim, x), by_hand(model, x), rtol=2e-6, atol=2e-6)
    assert not np.array_equal(_call(sim, x), _call(ptq.simulate(model, RULES), x))


# --------------------------------------------------------------------------------------------
# packed == simulated


def _svd(model):
    return ptq.svdquant(model, RULES, _batches(), rank=4, iterations=1, smoothing=True)


@pytest.mark.parametrize("variant", ["plain", "mse", "svd"])
def test_nnx_packed_equals_simulated_bit_for_bit(model, cal, variant, tmp_path):
    kw = {"weights": "mse"} if variant == "mse" else {}
    if variant == "svd":
        kw["smoothing"] = _svd(model)
    x = _batches(1, seed=9)[0]
    served = ptq.quantize(model, RULES, cal, **kw)
    y = _call(served, x)
    np.testing.assert_array_equal(y, _call(ptq.simulate(model, RULES, cal, **kw), x))
    assert type(served.params["up"]["kernel"].get_value()).__name__ == "QArray"
    # saved and restored into a fresh copy of the structure: the same outputs
    lbf.save(tmp_path / "ckpt", nnx.state(served))
    fresh = ptq.quantize(model, RULES, cal, **kw)
    nnx.update(fresh, lbf.restore(tmp_path / "ckpt", nnx.state(fresh)))
    np.testing.assert_array_equal(_call(fresh, x), y)


def test_linen_packed_equals_simulated_bit_for_bit():
    x0 = _batches(1)[0]
    mdl = LinenMLP()
    bound = mdl.bind(mdl.init(jax.random.key(0), x0))
    cal = ptq.calibrate(bound, RULES, _batches(), "mse")
    sm = ptq.svdquant(bound, RULES, _batches(), rank=4, example=x0, smoothing=True)
    cal_s = ptq.calibrate(bound, RULES, _batches(), "max", smoothing=sm)
    x = _batches(1, seed=5)[0]
    for c, kw in ((cal, {}), (cal_s, {"smoothing": sm})):
        served = ptq.quantize(bound, RULES, c, example=x0, **kw)
        sim = ptq.simulate(bound, RULES, c, example=x0, **kw)
        module, variables = served.unbind()
        y = jax.jit(module.apply)(variables, x)
        s_mod, s_vars = sim.unbind()
        np.testing.assert_array_equal(y, jax.jit(s_mod.apply)(s_vars, x))
        assert isinstance(variables["params"]["up"]["kernel"], lb.QArray)
    assert "lowbit_lowrank_a" in variables["params"]["up"]


def test_weight_mse_never_raises_a_block_error(model):
    served = {w: ptq.quantize(model, RULES, weights=w) for w in ("max", "mse")}
    for site in ("up", "down"):
        w = np.asarray(model.__getattribute__(site).kernel.get_value())
        errs = {}
        for k, pm in served.items():
            d = np.asarray(lb.dequantize(pm.params[site]["kernel"].get_value())) - w
            b = 16 if site == "up" else 32  # nvfp4 / mxfp4 1-D blocks along K (axis 0)
            errs[k] = (d**2).reshape(w.shape[0] // b, b, -1).sum(1)
        assert np.all(errs["mse"] <= errs["max"])
        if site == "up":  # NVFP4's finer scale grid finds better scales for some tiles
            assert np.sum(errs["mse"]) < np.sum(errs["max"])


# --------------------------------------------------------------------------------------------
# smoothing and SVDQuant


def test_unit_smoothing_and_rank_zero_are_plain_ptq(model, cal):
    x = _batches(1, seed=3)[0]
    plain = _call(ptq.quantize(model, RULES, cal), x)
    ones = ptq.Smoothing({"up": np.ones(D, np.float32), "down": np.ones(H, np.float32)})
    np.testing.assert_array_equal(_call(ptq.quantize(model, RULES, cal, smoothing=ones), x), plain)
    r0 = ptq.svdquant(model, RULES, _batches(), rank=0)  # no smoothing unless asked
    assert all(np.all(s == 1) for s in r0.scales.values()) and not r0.lowrank
    np.testing.assert_array_equal(_call(ptq.quantize(model, RULES, cal, smoothing=r0), x), plain)
    sm = ptq.smooth(model, RULES, _batches(), alpha=0.5)
    r0s = ptq.svdquant(model, RULES, _batches(), rank=0, smoothing=True, alpha=0.5)
    given = ptq.svdquant(model, RULES, _batches(), rank=2, smoothing=sm)
    for site in sm.scales:
        np.testing.assert_array_equal(sm.scales[site], r0s.scales[site])
        np.testing.assert_array_equal(sm.scales[site], given.scales[site])
        assert given.lowrank[site][0].shape == (sm.scales[site].shape[0], 2)


def test_svdquant_beats_plain_and_smoothing_on_outlier_channels():
    """Weights with planted outlier input channels and activations with outlier channels:
    the relative output error of one NVFP4 site, plain PTQ > smoothing > SVDQuant (rank 4);
    at equal bits, SVDQuant's 5.75 bits per weight beat a plain MXFP6 cast's 6.25."""
    m = nnx.Linear(128, 128, use_bias=False, rngs=nnx.Rngs(1))
    w = np.asarray(m.kernel.get_value()).copy()
    w[[5, 40, 77], :] *= 30.0
    m.kernel.set_value(jnp.asarray(w))
    rules = [(".*", "qat_nvfp4")]
    batches = _batches(4, rows=64, d=128)
    x = _batches(1, rows=64, d=128, seed=11)[0]
    ref = np.asarray(x @ w)

    def err(rules=rules, **kw):
        y = np.asarray(_call(ptq.quantize(m, rules, **kw), x))
        return float(np.sum((y - ref) ** 2) / np.sum(ref**2))

    e_plain = err()
    e_smooth = err(smoothing=ptq.smooth(m, rules, batches))
    svd = ptq.svdquant(m, rules, batches, rank=4, iterations=2, smoothing=True)
    e_svd = err(smoothing=svd)
    assert e_svd < e_smooth < e_plain and e_svd < 0.5 * e_plain
    bits = ptq.bits_per_param(ptq.quantize(m, rules, smoothing=svd))["weights"]
    # NVFP4 (4.5 bits and the tensor scale), a bf16 rank-4 branch, the float32 vector s
    assert bits == 4.5 + 32 / 128**2 + 16 * 4 * 256 / 128**2 + 32 / 128
    assert bits < 6.25 and e_svd < err([(".*", "qat_mxfp6")])


# --------------------------------------------------------------------------------------------
# errors


def test_clear_errors(model, cal):
    with pytest.raises(ValueError, match="batches is empty"):
        ptq.calibrate(model, RULES, [])
    with pytest.raises(ValueError, match=r"rule 'nope' reaches no site"):
        ptq.calibrate(model, [("nope", "qat_mxfp4"), *RULES], _batches(1))
    with pytest.raises(ValueError, match="unknown method='best'"):
        ptq.calibrate(model, RULES, _batches(1), "best")
    bad = _batches(2)
    bad[1] = bad[1].at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match=r"site 'up' holds NaN or Inf in batch 1"):
        ptq.calibrate(model, RULES, bad)
    with pytest.raises(ValueError, match=r"\['down'\] were never reached"):
        ptq.calibrate(model, RULES, _batches(1), forward=lambda m, x: m.up(x))
    other = MLP(nnx.Rngs(1), d=96)  # same sites, other shapes
    with pytest.raises(ValueError, match=r"site 'up' has a weight of shape \(96, 128\)"):
        ptq.quantize(other, RULES, cal)
    with pytest.raises(ValueError, match=r"sites \['head'\] are not calibrated"):
        ptq.quantize(model, [("head", "qat_mxfp8"), *RULES[1:]], cal)
    with pytest.raises(ValueError, match="unknown weights='min'"):
        ptq.quantize(model, RULES, cal, weights="min")
    with pytest.raises(ValueError, match=r"smoothing site 'up'.*\(64,\)"):
        ptq.quantize(model, RULES, smoothing=ptq.Smoothing({"up": np.ones(3, np.float32)}))
    with pytest.raises(ValueError, match="rank=999 exceeds"):
        ptq.svdquant(model, RULES, _batches(1), rank=999)
