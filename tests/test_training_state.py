"""TetraJet-v2's OsciReset and OutControl (lowbit.flax.training) and the trainer's precision
schedule: the reset against a transcription of TetraJet-v2's schedule, a constructed
oscillating weight, the outlier channels' GEMM checked on its operands, and exact resume."""

from __future__ import annotations

import gzip
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import lowbit as lb
import lowbit.flax as lbf
from experiments import metrics, trainer
from experiments.config import RunConfig
from experiments.configlib import load_config
from lowbit.flax import training as lbt

ROOT = Path(__file__).resolve().parents[1]
DN = (((1,), (0,)), ((), ()))


def half_grid(tree):
    """A quantizer for the schedule tests: values rounded to multiples of 0.5."""
    return jax.tree.map(lambda w: jnp.round(w * 2) / 2, tree)


def transcribe_osci_reset(w0, steps_updates, period, window, threshold, start=0):
    """TetraJet-v2's distance-ratio OsciReset (olmo/quantization_real/calibrate.py:55-74 and
    oscillation_reset.py:66-160 @ ca5953f6) around plain SGD with lr 1, in float64 numpy:
    after the optimizer step with iter_num i, snapshot / track / reset."""
    w = np.asarray(w0, np.float64)
    q = lambda a: np.round(a * 2) / 2
    prev = dq = dw = None
    for i, g in enumerate(steps_updates):
        w = w - g
        if i < start:
            continue
        if i % period == 0:
            prev, dq, dw = w.copy(), np.zeros_like(w), np.zeros_like(w)
        elif i % period <= window:
            dq += np.abs(q(w) - q(prev))
            dw += np.abs(w - prev)
            prev = w.copy()
        elif i % period == window + 1:
            ratio = np.where(dw == 0, 0, dq / np.where(dw == 0, 1, dw))
            mask = ratio >= threshold
            w = np.where(mask, q(w), w)
    return w


def test_osci_reset_follows_tetrajet_v2s_schedule_and_resets_only_oscillating_weights():
    # element 0 straddles the 0.25 boundary and flips Q between 0 and 0.5 with tiny moves;
    # element 1 moves steadily inside (0.5, 0.75); element 2 never moves.
    eps = np.float32(2.0**-10)
    w0 = np.array([0.25 + eps / 2, 0.55, 1.0], np.float32)
    updates = []
    for i in range(30):
        sign = 1 if i % 2 == 0 else -1
        updates.append(np.array([sign * eps, -0.001 * (1 + (i % 3)), 0.0], np.float32))
    tx = lbt.osci_reset(optax.sgd(1.0), half_grid, period=7, window=3, threshold=4.0)
    params = {"w": jnp.asarray(w0)}
    state = tx.init(params)
    resets = []
    for i, g in enumerate(updates):
        u, state = tx.update({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, u)
        if i % 7 == 4:
            resets.append(int(state.last_reset))
        ref = transcribe_osci_reset(w0, updates[: i + 1], 7, 3, 4.0)
        np.testing.assert_allclose(np.asarray(params["w"]), ref, rtol=0, atol=1e-6)
    w = np.asarray(params["w"])
    # the first reset takes the oscillating element alone onto the grid; from there its
    # moves of 2**-10 no longer flip its quantized value, and nothing resets again
    assert resets == [1, 0, 0, 0], resets
    assert abs(w[0] - 0.5) <= eps or abs(w[0]) <= eps
    assert w[2] == 1.0 and w[1] != np.round(w[1] * 2) / 2


def test_osci_reset_sets_the_reset_weights_to_the_recipes_quantized_value_exactly():
    model = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
    rules = [(".*", "tetrajet2")]
    qmodel = lbf.quantize(model, rules, rngs=nnx.Rngs(quant=0))
    quantizer = lbt.weight_quantizer(qmodel, rules)
    params = nnx.state(qmodel, nnx.Param)
    w = params["kernel"].get_value()
    # the weight quantizer is the recipe's forward weight quantizer along K (axis 0)
    spec = lb.recipes.get("tetrajet2").fwd.rhs
    np.testing.assert_array_equal(
        quantizer(params)["kernel"].get_value(),
        lb.fake_quantize(w, spec.format, axis=0, tensor_block=spec.tensor_block),
    )
    # threshold tiny: every weight whose Q moved in the window resets
    tx = lbt.osci_reset(optax.sgd(1e-2), quantizer, period=4, window=1, threshold=1e-30)
    state = tx.init(params)
    key = jax.random.key(1)
    for i in range(3):
        k_i = jax.random.fold_in(key, i)
        g = jax.tree.map(lambda p, k=k_i: jax.random.normal(k, p.shape), params)
        new = jax.tree.map(lambda p, d: p - 1e-2 * d, params, g)  # the plain SGD step
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    # the third update was the reset (i % 4 == window + 1): each kernel weight is either the
    # plain step's value or, where reset, exactly Q of the plain step's weights
    k, kn = np.asarray(params["kernel"].get_value()), np.asarray(new["kernel"].get_value())
    qn = np.asarray(quantizer(new)["kernel"].get_value())
    assert np.all((k == kn) | (k == qn))
    n_reset = int(np.sum((k == qn) & (qn != kn)))
    # last_reset counts the weights the rule selected, some already on their grid point
    assert 0 < n_reset <= int(state.last_reset) <= n_reset + int(np.sum(qn == kn))
    # the bias is not quantized: never reset
    np.testing.assert_array_equal(params["bias"].get_value(), new["bias"].get_value())


def test_osci_reset_works_on_linen_parameters():
    import flax.linen as nn

    rules = [(".*", "tetrajet2")]
    x = jnp.ones((16, 32))
    qmodel = lbf.quantize(nn.Dense(16), rules)
    variables = qmodel.init({"params": jax.random.key(0), "quant": jax.random.key(1)}, x)
    quantizer = lbt.weight_quantizer(nn.Dense(16), rules, x)
    q = quantizer(variables)["params"]
    spec = lb.recipes.get("tetrajet2").fwd.rhs
    w = variables["params"]["kernel"]
    np.testing.assert_array_equal(q["kernel"], lb.fake_quantize(w, spec.format, axis=0,
                                                                tensor_block=spec.tensor_block))
    np.testing.assert_array_equal(q["bias"], variables["params"]["bias"])
    tx = lbt.osci_reset(optax.sgd(0.1), quantizer, period=4, window=1, threshold=1e-30)
    state = tx.init(variables)
    for _ in range(3):
        u, state = jax.jit(tx.update)(variables, state, variables)
        variables = optax.apply_updates(variables, u)
    assert int(state.count) == 3 and int(state.last_reset) > 0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"window": 0}, "window must be >= 1"),
        ({"period": 5, "window": 4}, "period must be >= window"),
        ({"threshold": 0.0}, "threshold must be > 0"),
        ({"start": 3}, "start must be a multiple"),
    ],
)
def test_osci_reset_errors_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        lbt.osci_reset(optax.sgd(1.0), half_grid, **kw)


def mxfp8_rceil_reference(a: np.ndarray) -> np.ndarray:
    """MXFP8 E4M3 along the last axis in blocks of 32, the scale 2**ceil(log2(amax / 448))
    (TetraJet-v2's quant_fp8.cu:54-60), elements rounded to E4M3 by ml_dtypes (nearest even)."""
    b = a.reshape(*a.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(b).max(-1, keepdims=True)
    e = np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 448.0))
    s = np.exp2(e)
    q = (b / s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * s).reshape(a.shape)


def out_control_model():
    model = nnx.Sequential(nnx.Linear(128, 16, rngs=nnx.Rngs(0)))
    qmodel = lbf.quantize(model, [(".*", "tetrajet2")], rngs=nnx.Rngs(quant=0))
    scale = np.ones(128, np.float32)
    big = np.array([5, 17, 40, 77, 90, 101, 120, 127])
    scale[big] = 30.0
    x = jax.random.normal(jax.random.key(0), (16, 128)) * jnp.asarray(scale)[None]
    return qmodel, x, big


def test_out_control_runs_the_largest_norm_channels_in_mxfp8():
    qmodel, x, big = out_control_model()
    before = qmodel(x)
    assert lbt.out_control(qmodel, ratio=0.1, multiple=32) == [("layers/0", 128, 32)]
    np.testing.assert_array_equal(qmodel(x), before)  # unchanged until channels are chosen
    assert lbt.start_recording(qmodel) == 1
    qmodel(x)
    qmodel(2 * x)
    op = qmodel.layers[0].dot_general
    xs = np.asarray(x, np.float64)
    np.testing.assert_allclose(op.oc_norms.get_value(), 3 * np.sqrt((xs**2).sum(0)), rtol=1e-5)
    chosen = lbt.select_channels(qmodel)["layers/0/dot_general"]
    norms = np.sqrt((xs**2).sum(0))
    np.testing.assert_array_equal(np.asarray(chosen), np.argsort(-norms, kind="stable")[:32])
    assert set(big) <= set(np.asarray(chosen).tolist())
    y = qmodel(x)
    w = qmodel.layers[0].kernel.get_value()
    b = qmodel.layers[0].bias.get_value()
    inl = np.asarray(op.oc_inliers.get_value())
    assert sorted(np.concatenate([np.asarray(chosen), inl]).tolist()) == list(range(128))
    # the forward of both recipes rounds to nearest: no key enters the values
    y4 = lb.dot_general(x[:, inl], w[inl], DN, recipe="tetrajet2", key=jax.random.key(9))
    y8 = lb.dot_general(x[:, chosen], w[chosen], DN, recipe="tetrajet2_fp8",
                        key=jax.random.key(9))
    np.testing.assert_array_equal(y, (y4 + y8) + b[None])
    # the outlier GEMM's operands are MXFP8 (E4M3, rceil scales) along K
    xq = mxfp8_rceil_reference(np.asarray(x)[:, np.asarray(chosen)])
    wq = mxfp8_rceil_reference(np.asarray(w)[np.asarray(chosen)].T).T
    np.testing.assert_allclose(np.asarray(y8), xq @ wq, rtol=1e-5, atol=1e-4)
    # and not what NVFP4 would make of them
    assert np.abs(np.asarray(y8) - np.asarray(
        lb.dot_general(x[:, chosen], w[chosen], DN, recipe="tetrajet2"))).max() > 1e-2
    # gradients flow through the split
    g = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(qmodel)
    assert np.all(np.isfinite(np.asarray(g.layers[0].kernel.get_value())))


def test_out_control_errors_and_small_sites():
    qmodel, _, _ = out_control_model()
    with pytest.raises(ValueError, match="ratio must be in"):
        lbt.out_control(qmodel, ratio=1.5)
    import flax.linen as nn

    with pytest.raises(TypeError, match="out_control: expected an NNX model"):
        lbt.out_control(nn.Dense(8), ratio=0.1)
    with pytest.raises(ValueError, match="multiple must be a positive multiple of 32"):
        lbt.out_control(qmodel, ratio=0.1, multiple=48)
    # K = 128 below the multiple 256: the site keeps its recipe alone
    assert lbt.out_control(qmodel, ratio=0.1, multiple=256) == [("layers/0", 128, 0)]
    assert qmodel.layers[0].dot_general.out_control is None
    assert lbt.outlier_width(4096, 0.02) == 128 and lbt.outlier_width(4096, 0.1) == 512
    assert lbt.outlier_width(100, 0.5) == 0


# --------------------------------------------------------------------------------------------
# In the trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    return path


def nano(tmp_path: Path, corpus: Path, recipe: str, **quant):
    c = load_config(f"{ROOT / 'configs/gpt.py'}:size=nano,recipe={recipe}")
    c.workdir = str(tmp_path / "runs")
    c.data.path = str(corpus)
    c.data.cache_dir = str(tmp_path / "cache")
    c.model.layers, c.model.seq_len = 1, 32
    c.train.update(steps=16, batch_size=4, warmup_steps=2, log_every=1, eval_every=8,
                   eval_batches=1, checkpoint_every=8, progress=False)
    c.quant.update(quant)
    c.mesh.data, c.mesh.fsdp = 1, 1
    return c


def run_twice(tmp_path, corpus, recipe, **quant):
    """The run straight, and stopped at step 8 then resumed: their losses and records."""
    full = trainer.train(RunConfig.from_config(nano(tmp_path / "a", corpus, recipe, **quant)),
                         log=lambda *_: None)
    cfg = nano(tmp_path / "b", corpus, recipe, **quant)
    cfg.train.stop_at = 8
    trainer.train(RunConfig.from_config(cfg), log=lambda *_: None)
    cfg.train.stop_at = 0
    rest = trainer.train(RunConfig.from_config(cfg), resume=True, log=lambda *_: None)
    for s in range(9, 17):
        assert rest.losses[s] == full.losses[s], (s, rest.losses[s], full.losses[s])
    assert rest.final_val_loss == full.final_val_loss
    recs = lambda r: [x for x in metrics.read_metrics(r.metrics_path) if x["kind"] != "train"]
    strip = lambda rs: [{k: v for k, v in x.items() if k not in ("step_s", "tokens_per_s")}
                        for x in rs]
    assert strip(recs(rest)) == strip(recs(full))
    return full, recs(full)


def test_osci_reset_and_out_control_in_a_run_resume_exactly(tmp_path, corpus):
    _, recs = run_twice(
        tmp_path, corpus, "tetrajet2", osci_period=6, osci_window=2, osci_threshold=8.0,
        out_control=0.1, out_control_start=2, out_control_steps=3, out_control_multiple=32,
    )
    kinds = [(r["kind"], r["step"]) for r in recs if r["kind"] != "eval"]
    # TetraJet-v2 counts iter_num = step - 1: record after iter 2, select after iter 5,
    # reset at iter % 6 == 3
    assert ("out_control", 3) in kinds and ("out_control", 6) in kinds
    assert [s for k, s in kinds if k == "osci_reset"] == [4, 10, 16]
    # the checkpoint holds the chosen channels
    assert trainer.Trainer  # (the resumed losses above equal the uninterrupted run's)


def test_a_precision_schedule_switches_at_its_step_and_resumes_across_it(tmp_path, corpus):
    full, recs = run_twice(tmp_path, corpus, "nvfp4", switch_to="none", switch_step=6)
    assert [(r["kind"], r["step"]) for r in recs if r["kind"] == "switch"] == [("switch", 6)]
    summary = __import__("json").loads((full.run_dir / "summary.json").read_text())
    assert summary["switched_at"] == 6 and summary["switch_to"] == "none"


def test_the_grad_noise_criterion_measures_and_switches(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(trainer, "GRAD_NOISE_RATIO", 1e9)  # any measured ratio is below it
    cfg = nano(tmp_path, corpus, "fp4_all_the_way", switch_check_every=4)
    assert cfg.quant.switch_to == "qat_nvfp4" and cfg.quant.switch_criterion == "grad_noise"
    res = trainer.train(RunConfig.from_config(cfg), log=lambda *_: None)
    recs = [x for x in metrics.read_metrics(res.metrics_path) if x["kind"].startswith("switch")]
    assert recs[0]["kind"] == "switch_check" and recs[0]["step"] == 4
    assert 0 < recs[0]["noise_norm"] < recs[0]["grad_norm"]
    assert recs[1] == {"kind": "switch", "step": 4, "to": "qat_nvfp4"}
    assert len(recs) == 2  # no checks after the switch


@pytest.mark.parametrize(
    "quant, match",
    [
        ({"osci_period": 5, "osci_window": 4}, r"quant\.osci_window must be in"),
        ({"osci_period": 10, "osci_window": 2, "osci_start": 5}, r"osci_start must be a multiple"),
        ({"out_control": 1.0}, r"quant\.out_control must be a ratio"),
        ({"out_control": 0.1, "out_control_multiple": 16}, r"out_control_multiple"),
        ({"switch_step": 3}, r"need quant\.switch_to"),
        ({"switch_to": "none"}, r"exactly one of"),
        ({"switch_to": "none", "switch_step": 3, "switch_fraction": 0.5}, "exactly one of"),
        ({"switch_to": "nope", "switch_step": 3}, r"quant\.switch_to"),
        ({"switch_to": "none", "switch_criterion": "loss"}, r"expected 'grad_noise'"),
    ],
)
def test_training_state_config_errors_name_the_field(tmp_path, corpus, quant, match):
    with pytest.raises(ValueError, match=match):
        RunConfig.from_config(nano(tmp_path, corpus, "tetrajet2", **quant))
