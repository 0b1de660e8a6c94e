"""Input Hessians recorded by ``lb.ptq.calibrate(..., hessians=True)`` and GPTQ weights in
``lb.ptq.quantize(..., weights="gptq")``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit as lb
import lowbit.ptq as ptq


def _model():
    return nnx.Sequential(nnx.Linear(64, 96, rngs=nnx.Rngs(0)), nnx.relu,
                          nnx.Linear(96, 32, rngs=nnx.Rngs(1)))


def _batches(n=3, rows=48, seed=0):
    rng = np.random.default_rng(seed)
    mix = np.eye(64) + 0.7 * rng.standard_normal((64, 64)) / 8  # correlated inputs
    return [jnp.asarray(rng.standard_normal((rows, 64)) @ mix, jnp.float32) for _ in range(n)]


def _by_hand(model, batches):
    """Each site's sum of x^T x over every token, in float64 from the float model's layers."""
    x = np.concatenate([np.asarray(b, np.float64) for b in batches])
    k0, b0 = (np.asarray(v[...], np.float64) for v in (model.layers[0].kernel,
                                                        model.layers[0].bias))
    h = np.maximum(x @ k0 + b0, 0.0)
    return {"layers/0": x.T @ x, "layers/2": h.T @ h}


def _calibrated(model, recipe, batches):
    """``(rules, calibration with Hessians, every batch's rows, the float model's output)``."""
    rules = [(".*", recipe)]
    x = jnp.concatenate(batches)
    return rules, ptq.calibrate(model, rules, batches, hessians=True), x, model(x)


def _close(got, want):
    return np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_hessians_are_x_transpose_x_of_every_token_at_every_site():
    model, batches = _model(), _batches()
    cal = ptq.calibrate(model, [(".*", "w4a16_mxfp4")], batches, hessians=True)
    want = _by_hand(model, batches)
    assert sorted(cal.hessians) == sorted(want)
    for site, h in want.items():
        assert cal.hessians[site].dtype == np.float32 and cal.hessians[site].shape == h.shape
        assert _close(cal.hessians[site], h), site
    assert ptq.calibrate(model, [(".*", "w4a16_mxfp4")], batches).hessians == {}


def test_hessians_under_a_data_fsdp_mesh_sum_every_devices_tokens():
    devices = np.asarray(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("data", "fsdp"))
    model, batches = _model(), _batches(n=2, rows=64)
    sharded = [jax.device_put(b, NamedSharding(mesh, P(("data", "fsdp")))) for b in batches]
    assert sharded[0].sharding.num_devices == 4  # the batch is split over the mesh
    cal = ptq.calibrate(model, [(".*", "w4a16_mxfp4")], sharded, hessians=True)
    for site, h in _by_hand(model, batches).items():
        assert _close(cal.hessians[site], h), site


@pytest.mark.parametrize("recipe", ["w4a16_mxfp4", "w4a16_nvfp4", "qat_mxfp4"])
def test_gptq_weights_lower_the_output_error_and_serve_as_simulated(recipe):
    model, batches = _model(), _batches()
    rules, cal, x, ref = _calibrated(model, recipe, batches)
    err = {}
    for weights in ("max", "gptq"):
        y = ptq.quantize(model, rules, cal, weights=weights)(x)
        err[weights] = float(jnp.mean((y - ref) ** 2))
        if weights == "gptq":
            sim = ptq.simulate(model, rules, cal, weights="gptq")(x)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(sim))
    assert err["gptq"] < 0.85 * err["max"], err


def test_gptq_without_recorded_hessians_says_how_to_record_them():
    model, batches = _model(), _batches(n=1)
    rules = [(".*", "w4a16_mxfp4")]
    cal = ptq.calibrate(model, rules, batches)
    with pytest.raises(ValueError, match=r"hessians=True"):
        ptq.quantize(model, rules, cal, weights="gptq")
    with pytest.raises(ValueError, match=r"hessians=True"):
        ptq.quantize(model, rules, None, weights="gptq")
    with pytest.raises(ValueError, match="unknown weights='gtpq'"):
        ptq.quantize(model, rules, cal, weights="gtpq")


# --------------------------------------------------------------------------------------------
# MR-GPTQ: a block-wise Hadamard rotation of each site (ptq.rotation), GPTQ with the scale search


def _outlier_batches(n=3, rows=48, seed=0):
    rng = np.random.default_rng(seed)
    mix = np.eye(64) + 0.7 * rng.standard_normal((64, 64)) / 8
    out = []
    for _ in range(n):
        x = rng.standard_normal((rows, 64)) @ mix
        x[:, [3, 40]] *= 20.0  # outlier inputs
        out.append(jnp.asarray(x, jnp.float32))
    return out


def test_rotation_leaves_the_float_layer_unchanged():
    from lowbit.flax._core import SiteTransform
    from lowbit.ptq.transforms import site_kernel

    model = _model()
    rot = ptq.rotation(model, [(".*", "w4a16_nvfp4")])
    assert {p: v.shape for p, v in rot.rotations.items()} == {"layers/0": (16,),
                                                             "layers/2": (16,)}
    x = _batches(n=1)[0]
    w = np.asarray(model.layers[0].kernel[...])
    t = SiteTransform(rotate=rot.rotations["layers/0"])
    y = t.lhs(x) @ site_kernel(w, "layers/0", rot, jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("recipe", ["w4a16_nvfp4", "w4a16_mxfp4"])
def test_mr_gptq_beats_gptq_with_outliers_and_serves_as_simulated(recipe):
    model, batches = _model(), _outlier_batches()
    rules, cal, x, ref = _calibrated(model, recipe, batches)
    err = {w: float(jnp.mean((ptq.quantize(model, rules, cal, weights=w)(x) - ref) ** 2))
           for w in ("max", "gptq")}
    served = ptq.quantize(model, rules, cal, weights="mr-gptq")  # rotation added, Hessian rotated
    y = served(x)
    np.testing.assert_array_equal(
        np.asarray(y), np.asarray(ptq.simulate(model, rules, cal, weights="mr-gptq")(x)))
    err["mr-gptq"] = float(jnp.mean((y - ref) ** 2))
    assert err["mr-gptq"] < 0.6 * err["gptq"] < 0.6 * err["max"], err
    # calibrated under the rotation: the Hessian recorded rotated equals the one rotated here
    rot = ptq.rotation(model, rules)
    cal_r = ptq.calibrate(model, rules, batches, hessians=True, smoothing=rot)
    assert cal_r.rotations == {p: v.shape[0] for p, v in rot.rotations.items()}
    y_r = ptq.quantize(model, rules, cal_r, weights="mr-gptq", smoothing=rot)(x)
    assert float(jnp.mean((y_r - ref) ** 2)) == pytest.approx(err["mr-gptq"], rel=0.05)


def test_mr_gptq_needs_activation_scales_calibrated_under_the_rotation():
    model, batches = _model(), _outlier_batches(n=1)
    rules = [(".*", "qat_nvfp4")]  # static activation scales
    cal = ptq.calibrate(model, rules, batches, hessians=True)
    with pytest.raises(ValueError, match=r"calibrated with rotation None but is quantized with "
                                         r"rotation 16"):
        ptq.quantize(model, rules, cal, weights="mr-gptq")
    rot = ptq.rotation(model, rules)
    cal_r = ptq.calibrate(model, rules, batches, hessians=True, smoothing=rot)
    served = ptq.quantize(model, rules, cal_r, weights="mr-gptq", smoothing=rot)
    assert np.all(np.isfinite(np.asarray(served(batches[0]))))
    back = ptq.Calibration.from_json(cal_r.to_json())
    assert back.rotations == cal_r.rotations


def test_mr_gptq_on_a_linen_model_packs_the_rotation_with_the_weights():
    import flax.linen as nn

    import lowbit as lb

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32, name="down")(nn.relu(nn.Dense(96, name="up")(x)))

    batches = _outlier_batches()
    mdl = Mlp()
    bound = mdl.bind(mdl.init(jax.random.key(0), batches[0]))
    rules = [(".*", "w4a16_nvfp4")]
    cal = ptq.calibrate(bound, rules, batches, hessians=True)
    served = ptq.quantize(bound, rules, cal, weights="mr-gptq", example=batches[0])
    sim = ptq.simulate(bound, rules, cal, weights="mr-gptq", example=batches[0])
    module, variables = served.unbind()
    x = jnp.concatenate(batches)
    y = jax.jit(module.apply)(variables, x)
    s_mod, s_vars = sim.unbind()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(s_mod.apply)(s_vars, x)))
    assert isinstance(variables["params"]["up"]["kernel"], lb.QArray)
    assert variables["params"]["up"]["lowbit_rotate"].shape == (16,)
    ref = bound(x)
    g = ptq.quantize(bound, rules, cal, weights="gptq", example=batches[0]).unbind()
    y_g = jax.jit(g[0].apply)(g[1], x)
    assert float(jnp.mean((y - ref) ** 2)) < 0.6 * float(jnp.mean((y_g - ref) ** 2))


def test_sequential_gptq_takes_each_sites_inputs_from_the_quantized_sites_before_it():
    model, batches = _model(), _outlier_batches()
    rules = [(".*", "w4a16_mxfp4")]
    cal = ptq.calibrate(model, rules, batches, hessians=True)
    seq = ptq.quantize(model, rules, cal, weights="gptq", sequential=True, batches=batches)
    one = ptq.quantize(model, rules, cal, weights="gptq")
    q0 = seq.params["layers"][0]["kernel"].get_value()
    q1 = seq.params["layers"][2]["kernel"].get_value()
    # the first site as without sequential; the second from the inputs the quantized first
    # site gives: relu(x @ Q0 + b0), its x^T x written out here
    np.testing.assert_array_equal(np.asarray(q0.codes),
                                  np.asarray(one.params["layers"][0]["kernel"].get_value().codes))
    x = np.concatenate([np.asarray(b, np.float64) for b in batches])
    b0 = np.asarray(model.layers[0].bias[...], np.float64)
    h = np.maximum(x @ np.asarray(q0.dequantize(jnp.float32), np.float64) + b0, 0.0)
    want = lb.calibrate.gptq(np.asarray(model.layers[2].kernel[...]),
                             (h.T @ h).astype(np.float32), "mxfp4")
    assert np.mean(np.asarray(q1.codes) == np.asarray(want.codes)) > 0.9
    with pytest.raises(ValueError, match="pass batches="):
        ptq.quantize(model, rules, cal, weights="gptq", sequential=True)
    with pytest.raises(ValueError, match="sequential=True is GPTQ's"):
        ptq.quantize(model, rules, cal, weights="max", sequential=True, batches=batches)
