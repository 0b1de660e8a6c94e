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
    rules = [(".*", recipe)]
    cal = ptq.calibrate(model, rules, batches, hessians=True)
    x = jnp.concatenate(batches)
    ref = model(x)
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
