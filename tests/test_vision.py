"""The vision family (experiments/vision.py, configs/digits.py) in the training loop: the ViT's
shapes and quantization sites, the fixed digits split and resumable batches, one tiny run
(loss down, accuracy above chance, exact resume), load_trained + evaluate reproducing its final
metrics, calibration inputs from the training split, and init_from across families refused.

One tiny training run (30 steps of 32 images, d_model 64, 1 layer) serves every test that needs
a trained model; everything else is abstract (``nnx.eval_shape``) or NumPy: the file's budget
is ~20 s on 2 cores, most of it XLA compiling the init and the step once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit.flax as lbf
from experiments import metrics, runs, trainer, vision
from experiments.config import QuantConfig, RunConfig, quant_rules
from experiments.configlib import ConfigError, load_config
from experiments.data import DataError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = f"{ROOT / 'configs/digits.py'}"
STEPS = 30
LABEL_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]  # load_digits(), 1,797 images


def quiet(*_):
    pass


def tiny(tmp_path: Path, recipe: str = "none", **train):
    c = load_config(f"{DIGITS}:size=tiny,recipe={recipe}")
    c.workdir = str(tmp_path / "runs")
    c.train.update(
        steps=STEPS,
        batch_size=32,
        lr=1e-2,
        warmup_steps=2,
        log_every=1,
        eval_every=15,
        checkpoint_every=0,  # at the end (and at stop_at) only
        progress=False,
    )
    c.train.update(train)
    c.mesh.data, c.mesh.fsdp = 1, 1
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A float tiny digits run of 30 steps: (its RunConfig, its RunResult)."""
    cfg = RunConfig.from_config(tiny(tmp_path_factory.mktemp("digits")))
    return cfg, trainer.train(cfg, log=quiet)


# --------------------------------------------------------------------------------------------
# Model and config


def test_vit_shapes_and_quantization_sites():
    cfg = vision.ViTConfig(d_model=32, layers=2, heads=2)
    model = nnx.eval_shape(lambda: vision.ViT(cfg, rngs=nnx.Rngs(0)))  # abstract: no compile
    graphdef, state = nnx.split(model)
    call = lambda x: jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    for shape in ((3, 8, 8), (3, 8, 8, 1)):
        logits, aux = call(jax.ShapeDtypeStruct(shape, jnp.float32))
        assert (logits.shape, logits.dtype, aux.shape, aux.dtype) == (
            (3, 10),
            jnp.float32,
            (),
            jnp.float32,
        )
    with pytest.raises(ValueError, match=r"images must be \[batch, 8, 8, 1\].*got \(3, 8, 4\)"):
        call(jax.ShapeDtypeStruct((3, 8, 4), jnp.float32))

    rules = quant_rules(
        QuantConfig(recipe="mxfp4", high_precision=r"embed|pos_embed|head")
    )
    sites = lbf.sites(model, rules)
    got = {s.path: (s.kind, s.shape, s.recipe.name if s.recipe else None) for s in sites}
    want = {"embed": ("dot_general", (4, 32), "none"), "head": ("dot_general", (32, 10), "none")}
    for i in range(2):
        for name, shape in (("attn/qkv", (32, 96)), ("attn/out", (32, 32)),
                            ("mlp/up", (32, 128)), ("mlp/down", (128, 32))):  # fmt: skip
            want[f"blocks/{i}/{name}"] = ("dot_general", shape, "mxfp4")
    assert len(sites) == len(want) and got == want
    n = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == vision.n_params(cfg)


def test_vit_config_errors_name_the_field():
    for kwargs, match in (
        (dict(image_size=9), r"image_size=9 must be a multiple of patch=2"),
        (dict(d_model=30), r"d_model=30 must be a multiple of heads=4"),
        (dict(layers=0), r"layers must be a positive int, got 0"),
        (dict(classes=1), r"classes must be >= 2"),
        (dict(dtype="float16"), r"dtype must be one of .*'float16'"),
    ):
        with pytest.raises(ValueError, match=match):
            vision.ViTConfig(**kwargs)
    c = load_config(DIGITS)
    c.model.patch = 3
    with pytest.raises(ConfigError, match=r"config\.model: image_size=8 must be a multiple of"):
        RunConfig.from_config(c)


def test_digits_config_selects_the_vit_family(tmp_path):
    cfg = RunConfig.from_config(load_config(f"{DIGITS}:size=s,recipe=mxfp4,seed=2"))
    assert cfg.family == "vit" and cfg.name == "vit-digits-s/mxfp4-s2" and cfg.seed == 2
    assert isinstance(cfg.model, vision.ViTConfig) and cfg.model.dtype == "float32"
    assert cfg.quant.high_precision == "embed|pos_embed|head"
    assert cfg.model.d_model % 32 == 0 and cfg.model.d_ff % 32 == 0
    assert cfg.to_json()["family"] == "vit"
    gpt = RunConfig.from_config(load_config(f"{ROOT}/configs/gpt.py"))
    assert gpt.family == "gpt" and "family" not in load_config(f"{ROOT}/configs/gpt.py")
    with pytest.raises(ValueError, match="size='m'"):
        load_config(f"{DIGITS}:size=m")
    c = load_config(DIGITS)
    c.family = "cnn"
    with pytest.raises(ConfigError, match=r"config\.family='cnn': expected one of \['gpt', 'vit'"):
        RunConfig.from_config(c)
    c.family = "gpt"  # a digits model section is not a GPT's
    with pytest.raises(ConfigError, match=r"config\.model: unknown key\(s\) \['channels'"):
        RunConfig.from_config(c)


def test_hadamard_blocks_must_divide_the_vits_gemm_axes():
    c = load_config(f"{DIGITS}:recipe=mxfp4_bwd")  # 64-point transforms in the backward
    c.train.batch_size = 2  # weight gradients contract 2 * 16 patch tokens
    with pytest.raises(
        ConfigError,
        match=r"Hadamard transforms of 64.*train\.batch_size \* model\.num_patches=32 must be",
    ):
        RunConfig.from_config(c)
    c.train.batch_size = 4
    RunConfig.from_config(c)
    c = load_config(f"{DIGITS}:recipe=quartet")
    RunConfig.from_config(c)  # the 4-feature patch embedding stays in float
    c.quant.high_precision = "head"
    with pytest.raises(ConfigError, match=r"model\.patch \*\* 2 \* model\.channels=4 must be"):
        RunConfig.from_config(c)


# --------------------------------------------------------------------------------------------
# Data


def test_the_digits_split_is_fixed_disjoint_and_scaled():
    a, b = vision.load(log=quiet), vision.load(log=quiet)
    assert (len(a.train), len(a.val)) == (1438, 359)  # round(1797 * 0.2) = 359
    assert a.fingerprint == b.fingerprint
    np.testing.assert_array_equal(a.val.images, b.val.images)
    both = np.concatenate([a.train.indices, a.val.indices])
    assert sorted(both.tolist()) == list(range(1797))  # disjoint, together every image
    labels = np.concatenate([a.train.labels, a.val.labels])
    assert np.bincount(labels).tolist() == LABEL_COUNTS
    images = np.concatenate([a.train.images, a.val.images])
    assert images.dtype == np.float32 and images.shape[1:] == (8, 8)
    assert images.min() == 0.0 and images.max() == 1.0
    assert set(np.unique(images * 16)) <= set(range(17))  # integers 0..16, divided by 16
    other = vision.load(vision.DigitsDataConfig(split_seed=1), log=quiet)
    assert other.fingerprint != a.fingerprint
    assert not np.array_equal(other.val.indices, a.val.indices)
    with pytest.raises(DataError, match=r"data\.val_fraction must be a number in \(0, 1\)"):
        vision.DigitsDataConfig(val_fraction=1.0)


@pytest.mark.slow
def test_the_bundled_csv_is_what_load_digits_returns():
    from sklearn.datasets import load_digits

    d = load_digits()
    images, labels = vision._digits()
    np.testing.assert_array_equal(images, (d.images / 16).astype(np.float32))
    np.testing.assert_array_equal(labels, d.target)


def _numbered(n: int) -> vision.ImageSplit:
    """A split whose example i is the image filled with i and labelled i."""
    i = np.arange(n)
    images = np.broadcast_to(i[:, None, None], (n, 8, 8)).astype(np.float32)
    return vision.ImageSplit(images, i.astype(np.int32), i)


def test_batches_are_seeded_epochs_and_resume_exactly():
    split = _numbered(10)
    stream = vision.Batches(split, batch_size=4, seed=3)
    drawn = np.concatenate([next(stream)["targets"] for _ in range(5)])  # 20 = two epochs
    assert sorted(drawn[:10]) == list(range(10)) and sorted(drawn[10:]) == list(range(10))
    assert drawn[:10].tolist() != drawn[10:].tolist()  # a new permutation each epoch
    assert stream.state() == {"position": 20, "seed": 3, "batch_size": 4}
    other = vision.Batches(split, batch_size=4, seed=4)
    assert next(other)["targets"].tolist() != drawn[:4].tolist()

    stream = vision.Batches(split, batch_size=4, seed=3)
    for _ in range(2):
        next(stream)
    resumed = vision.Batches.restore(split, stream.state(), batch_size=4, seed=3)
    for _ in range(4):  # across the epoch boundary
        a, b = next(stream), next(resumed)
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
    np.testing.assert_array_equal(a["inputs"][:, 0, 0], a["targets"])  # images match labels
    with pytest.raises(DataError, match=r"saved with seed=3 but seed=4 is requested"):
        vision.Batches.restore(split, stream.state(), batch_size=4, seed=4)
    with pytest.raises(DataError, match="batch_size must be a positive integer"):
        vision.Batches(split, batch_size=0, seed=0)


def test_eval_batches_cover_the_split_once_in_one_shape():
    split = _numbered(10)
    batches = vision.eval_batches(split, batch_size=4, max_batches=100)
    assert [b["inputs"].shape for b in batches] == [(4, 8, 8)] * 3
    weights = np.concatenate([b["weights"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])
    assert weights.tolist() == [1.0] * 10 + [0.0] * 2  # the last batch padded, weighted 0
    assert targets[:10].tolist() == list(range(10))
    assert len(vision.eval_batches(split, batch_size=4, max_batches=2)) == 2


# --------------------------------------------------------------------------------------------
# Training and evaluation


def test_a_tiny_digits_run_lowers_the_loss_and_beats_chance(run):
    cfg, r = run
    losses = [r.losses[s] for s in sorted(r.losses)]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    # From ~ln(10) = 2.30 nats at init; measured: the mean of the first and last three train
    # losses 2.30 -> 1.72 nats in 30 steps, validation 1.71 nats.
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
    assert r.final_val["val_loss"] < math.log(10) - 0.3, r.final_val
    # Chance is 10% (a model that learns nothing stays near it: 11% at step 6); measured 33%
    # after 30 steps of 32 images.
    assert r.final_val["val_accuracy"] > 0.2, r.final_val
    recs = metrics.read_metrics(r.metrics_path)
    evals = [x for x in recs if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == [15, 30]
    assert evals[-1]["val_accuracy"] == r.final_val["val_accuracy"]
    assert evals[-1]["tokens"] == STEPS * 32 * 16  # patch tokens
    assert all("accuracy" in x for x in recs if x["kind"] == "train")
    summary = json.loads((r.run_dir / "summary.json").read_text())
    assert summary["final_val_loss"] == r.final_val_loss == r.final_val["val_loss"]
    assert summary["final_val_accuracy"] == r.final_val["val_accuracy"]
    assert summary["family"] == "vit"
    assert json.loads((r.run_dir / "config.json").read_text())["family"] == "vit"


def test_a_stopped_and_resumed_digits_run_reproduces_the_uninterrupted_one(tmp_path, run):
    _, full = run
    c = tiny(tmp_path, stop_at=15)
    first = trainer.train(RunConfig.from_config(c), log=quiet)
    c.train.stop_at = 0
    rest = trainer.train(RunConfig.from_config(c), resume=True, log=quiet)
    assert first.step == 15 and sorted(first.losses) == list(range(1, 16))
    assert sorted(rest.losses) == list(range(16, STEPS + 1))  # from the checkpoint at 15
    for s in range(1, STEPS + 1):
        assert (first.losses if s <= 15 else rest.losses)[s] == full.losses[s], s
    assert rest.final_val == full.final_val


def test_load_trained_and_evaluate_reproduce_the_final_metrics(tmp_path, run):
    cfg, r = run
    loaded_cfg, model = runs.load_trained(r.run_dir)
    assert loaded_cfg == cfg
    assert isinstance(model, vision.ViT)
    assert model.blocks[0].mlp.up.dot_general is jax.lax.dot_general  # the float model
    summary = json.loads((r.run_dir / "summary.json").read_text())
    got = runs.evaluate(loaded_cfg, model)
    want = {"val_loss": summary["final_val_loss"], "val_accuracy": summary["final_val_accuracy"]}
    assert got == want  # bit for bit: the same batches, program and reduction as the loop's
    first = runs.evaluate(loaded_cfg, model, max_batches=1)
    assert first != got and 0 <= first["val_accuracy"] <= 1

    with pytest.raises(ConfigError, match=r"run_dir='.*nowhere' does not exist"):
        runs.load_trained(tmp_path / "nowhere")
    (tmp_path / "unsaved").mkdir()
    (tmp_path / "unsaved/config.json").write_text((r.run_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"run_dir='.*unsaved' has no checkpoint"):
        runs.load_trained(tmp_path / "unsaved")


def test_calibration_batches_are_deterministic_training_images(run):
    cfg, _ = run
    a, b = runs.calibration_batches(cfg, 3), runs.calibration_batches(cfg, 3)
    assert len(a) == 3 and all(x.shape == (32, 8, 8) and x.dtype == np.float32 for x in a)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    ds = vision.load(cfg.data, log=quiet)
    stream = vision.Batches(ds.train, batch_size=32, seed=cfg.seed)
    for x in a:
        np.testing.assert_array_equal(x, next(stream)["inputs"])
    train = {img.tobytes() for img in ds.train.images}
    val_only = {img.tobytes() for img in ds.val.images} - train
    drawn = {img.tobytes() for x in a for img in x}
    assert drawn <= train and not drawn & val_only


def test_init_from_across_families_or_architectures_is_refused(tmp_path, run):
    _, r = run
    gpt = load_config(f"{ROOT}/configs/gpt.py:size=tiny")
    gpt.workdir = str(tmp_path / "runs")
    gpt.init_from = str(r.run_dir)
    with pytest.raises(
        ConfigError,
        match=r"init_from='.*': the source run is of model family 'vit', this config's is 'gpt'",
    ):
        trainer.train(RunConfig.from_config(gpt), log=quiet)
    # A GPT run's directory (its config.json is enough: refused before the checkpoint is read)
    src = tmp_path / "gpt-run"
    src.mkdir()
    gpt.init_from = ""
    saved = RunConfig.from_config(gpt).to_json()
    del saved["family"]  # as runs written before the vision family have it
    (src / "config.json").write_text(json.dumps(saved))
    c = tiny(tmp_path)
    c.init_from = str(src)
    with pytest.raises(
        ConfigError,
        match=r"init_from='.*gpt-run': the source run is of model family 'gpt', this config's "
        r"is 'vit'; expected a run of the same family and architecture",
    ):
        trainer.train(RunConfig.from_config(c), log=quiet)
    c.init_from = str(r.run_dir)
    c.model.d_model = 128
    with pytest.raises(ConfigError, match=r"model differs .*model\.d_model: 64 -> 128"):
        trainer.train(RunConfig.from_config(c), log=quiet)
    assert not (tmp_path / "runs").exists()  # nothing was written
