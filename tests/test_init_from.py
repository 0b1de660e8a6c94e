"""``init_from``: a run that starts from another run's trained parameters (a QAT fine-tune of
a float run): the parameters arrive bit for bit, a QAT run starts near the float loss, resume
reads the run's own checkpoint, and bad sources are refused before anything is written."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import checkpoints, runs, trainer
from experiments import data as data_lib
from experiments.config import RunConfig, config_diff
from experiments.configlib import ConfigError, load_config
from tests.test_train import ROOT, quiet, tiny

SOURCE_STEPS = 8  # checkpoints at 4 and 8: init_from must take the latest
SEED = 1  # the init_from runs' seed (the source's is 0): their own data order


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """tests/test_train's frozen corpus (lowbit's sources as of 2026-12-01, gzipped)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    return path


def _float(tmp_path: Path, corpus: Path, **train):
    """The tiny config of tests/test_train with one eval batch and checkpoints at the end."""
    base = dict(eval_every=0, eval_batches=1, checkpoint_every=0, warmup_steps=1)
    return tiny(tmp_path, corpus, **{**base, **train})


def _from(tmp_path: Path, corpus: Path, src: Path, recipe: str = "none", **train):
    c = _float(tmp_path, corpus, **train)
    c.quant.recipe = recipe
    c.seed = SEED
    c.init_from = str(src)
    return c


def _digest(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _params(cfg: RunConfig, step: int):
    """The parameters of ``cfg``'s checkpoint ``step`` (as numpy, by path), read as --resume
    reads a whole train state (not init_from's params-only path)."""
    tr = trainer.Trainer(cfg, trainer.make_mesh(cfg.mesh))
    mngr = checkpoints.run_manager(cfg)
    state, _ = checkpoints.restore(mngr, step, tr.abstract, tr.state_sharding)
    mngr.close()
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree.leaves_with_path(state["params"])
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus):
    """A float ("none") run of 8 steps: (its RunConfig, its RunResult, its files' digests)."""
    c = _float(tmp_path_factory.mktemp("source"), corpus, steps=SOURCE_STEPS, checkpoint_every=4)
    cfg = RunConfig.from_config(c)
    r = trainer.train(cfg, log=quiet)
    return cfg, r, _digest(cfg.run_dir)


@pytest.fixture(scope="module")
def float_loss(source):
    """The source model's loss on the first batch of a seed-``SEED`` run."""
    cfg = source[0]
    tr = trainer.Trainer(cfg, trainer.make_mesh(cfg.mesh))
    mngr = checkpoints.run_manager(cfg)
    state, _ = checkpoints.restore(mngr, SOURCE_STEPS, tr.abstract, tr.state_sharding)
    mngr.close()
    dataset = data_lib.load(cfg.data, log=quiet)
    batch = next(
        data_lib.Batches(
            dataset.train, batch_size=cfg.train.batch_size, seq_len=cfg.model.seq_len, seed=SEED
        )
    )
    return float(tr.eval(state, tr.put_batch(batch)))


def test_an_init_from_run_starts_from_the_source_parameters_and_resumes_from_its_own(
    tmp_path, corpus, source, float_loss
):
    src_cfg, _, _ = source
    copy = tmp_path / "source-copy"  # removed before the resume: it must not be read again
    shutil.copytree(src_cfg.run_dir, copy)
    # Step 1 runs at lr 0 (the warmup starts at 0) and stops with a checkpoint: the parameters
    # it holds are the loaded ones. A state taken from the source whole (its step 8, its
    # optimizer) would have moved them; a random init would differ everywhere.
    c = _from(tmp_path, corpus, copy, steps=4, stop_at=1)
    cfg = RunConfig.from_config(c)
    first = trainer.train(cfg, log=quiet)
    assert sorted(first.losses) == [1]
    got, want = _params(cfg, 1), _params(src_cfg, SOURCE_STEPS)
    assert got.keys() == want.keys() and got
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    earlier = _params(src_cfg, 4)
    assert any(not np.array_equal(earlier[k], want[k]) for k in want)  # "latest" is a real check
    # The first loss is the source model's on the new run's own first batch (seed 1); the
    # step's forward (under value_and_grad) and eval's can differ in float32 summation order.
    np.testing.assert_allclose(first.losses[1], float_loss, rtol=1e-6)
    saved = json.loads((cfg.run_dir / "config.json").read_text())
    assert saved["init_from"] == str(copy.resolve())
    assert json.loads((cfg.run_dir / "summary.json").read_text())["init_from"] == str(
        copy.resolve()
    )

    # --resume with another init_from is refused like any config change.
    c.init_from = str(src_cfg.run_dir)
    with pytest.raises(ConfigError, match=r"--resume with a config that differs.*init_from: '"):
        trainer.train(RunConfig.from_config(c), resume=True, log=quiet)
    # Resuming continues from the run's own checkpoint: the source is not needed any more.
    c.init_from = str(copy)
    shutil.rmtree(copy)
    c.train.stop_at = 0
    rest = trainer.train(RunConfig.from_config(c), resume=True, log=quiet)
    assert sorted(rest.losses) == [2, 3, 4] and np.isfinite(list(rest.losses.values())).all()


def test_a_qat_run_from_a_float_checkpoint_starts_near_the_float_loss(
    tmp_path, corpus, source, float_loss
):
    src_cfg, src, digests = source
    cfg = RunConfig.from_config(
        _from(tmp_path, corpus, src_cfg.run_dir, "qat_mxfp4", steps=2)
    )
    r = trainer.train(cfg, log=quiet)
    # A random init starts at ~ln(256) = 5.55 nats; the float source, after 8 steps, is well
    # below (its last train loss is asserted to be, so the check below has room to fail).
    assert src.losses[SOURCE_STEPS] < math.log(256) - 1.5, src.losses
    assert r.losses[1] < math.log(256) - 1.5, r.losses
    # The same parameters under MXFP4 weights and activations: within 0.1 nat of the float
    # model's loss on the same batch (measured: 5e-4 nat; after 8 steps the float embedding and
    # head carry most of what the model knows). A random init would be ~2 nats off.
    assert abs(r.losses[1] - float_loss) < 0.1, (r.losses[1], float_loss)
    assert r.losses[1] != float_loss  # ... and the weights and activations were quantized
    # Near the source's own last loss too (on another batch: measured 0.19 nat apart).
    assert abs(r.losses[1] - src.losses[SOURCE_STEPS]) < 0.5, (r.losses, src.losses)
    assert json.loads((cfg.run_dir / "summary.json").read_text())["recipe"] == "qat_mxfp4"
    assert _digest(src_cfg.run_dir) == digests  # the source was only read


def test_bad_init_from_sources_are_refused_before_anything_is_written(tmp_path, corpus, source):
    src_cfg, _, digests = source

    def refused(init_from, match, **model):
        c = _from(tmp_path / "new", corpus, init_from)
        c.model.update(model)
        with pytest.raises(ConfigError, match=match):
            trainer.train(RunConfig.from_config(c), log=quiet)

    expected = r"expected a run directory written by experiments\.train"
    refused(tmp_path / "nowhere", rf"init_from='.*nowhere' does not exist; {expected}")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", r"init_from='.*empty' is not a run directory \(no config\.json\)")
    (tmp_path / "unsaved").mkdir()
    shutil.copy(src_cfg.run_dir / "config.json", tmp_path / "unsaved")
    refused(tmp_path / "unsaved", r"init_from='.*unsaved' has no checkpoint")
    refused(
        src_cfg.run_dir,
        r"init_from='.*': the source run's model differs .*"
        r"model\.d_model: 64 -> 128, model\.layers: 1 -> 2",
        d_model=128,
        layers=2,
    )
    # A source whose config.json matches but whose checkpoint does not: the parameter tree is
    # checked when restoring, naming the first parameter that differs.
    lying = tmp_path / "lying"
    shutil.copytree(src_cfg.run_dir, lying)
    saved = json.loads((lying / "config.json").read_text())
    saved["model"]["d_model"] = 128
    (lying / "config.json").write_text(json.dumps(saved))
    refused(
        lying,
        r"init_from='.*lying': parameter 'blocks/0/[\w/]+' is float32\[\d+, \d+\] in checkpoint "
        r"step 8 .*; this model's is float32\[128, \d+\]",
        d_model=128,
    )
    assert not (tmp_path / "new/runs").exists()  # refused before the run wrote anything
    assert _digest(src_cfg.run_dir) == digests

    # A run cannot start from its own directory.
    c = _from(tmp_path / "own", corpus, "")
    c.init_from = str(Path(c.workdir) / c.name)
    cfg = RunConfig.from_config(c)
    cfg.run_dir.mkdir(parents=True)
    shutil.copy(src_cfg.run_dir / "config.json", cfg.run_dir)
    with pytest.raises(ConfigError, match=r"is this run's own directory; pass --resume"):
        trainer.train(cfg, log=quiet)


def test_init_from_is_resolved_recorded_and_optional(tmp_path, corpus, monkeypatch):
    c = _float(tmp_path, corpus)
    assert c.init_from == "" and RunConfig.from_config(c).init_from == ""
    monkeypatch.chdir(tmp_path)
    c.init_from = "runs/float"
    cfg = RunConfig.from_config(c)
    assert cfg.init_from == str(tmp_path.resolve() / "runs/float")
    assert cfg.to_json()["init_from"] == cfg.init_from
    # A config.json written before init_from existed resumes as a run without one.
    c.init_from = ""
    now = RunConfig.from_config(c).to_json()
    older = {k: v for k, v in now.items() if k != "init_from"}
    assert config_diff(older, now) == []
    assert config_diff(older, cfg.to_json()) == [f"init_from: '' -> {cfg.init_from!r}"]


# --------------------------------------------------------------------------------------------
# load_trained / evaluate / calibration_batches on the float source run (no training here)


def test_load_trained_and_evaluate_reproduce_the_gpt_runs_final_validation_loss(source):
    src_cfg, src, _ = source
    cfg, model = runs.load_trained(src_cfg.run_dir)
    assert cfg == src_cfg and cfg.family == "gpt"
    assert type(model).__name__ == "GPT"
    assert model.blocks[0].mlp.up.dot_general is jax.lax.dot_general  # not quantized
    want = _params(src_cfg, SOURCE_STEPS)  # the latest checkpoint's parameters
    got = {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree.leaves_with_path(nnx.state(model, nnx.Param))
    }
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    summary = json.loads((src_cfg.run_dir / "summary.json").read_text())
    # Bit for bit: the loop's final eval batches, program and reduction.
    assert runs.evaluate(cfg, model) == {"val_loss": summary["final_val_loss"]}
    assert summary["final_val_loss"] == src.final_val_loss


def test_a_run_written_before_the_family_key_loads_and_resumes_as_gpt(tmp_path, source):
    src_cfg, _, _ = source
    old = tmp_path / "old-run"
    shutil.copytree(src_cfg.run_dir, old)
    saved = json.loads((old / "config.json").read_text())
    assert saved.pop("family") == "gpt"
    (old / "config.json").write_text(json.dumps(saved))
    cfg, _ = runs.load_trained(old)
    assert cfg.family == "gpt"
    assert config_diff(saved, src_cfg.to_json()) == []


def test_calibration_batches_are_the_gpt_runs_first_training_windows(source):
    src_cfg, _, _ = source
    a = runs.calibration_batches(src_cfg, 2)
    assert [x.shape for x in a] == [(src_cfg.train.batch_size, src_cfg.model.seq_len)] * 2
    assert all(x.dtype == np.int32 for x in a)
    dataset = data_lib.load(src_cfg.data, log=quiet)
    stream = data_lib.Batches(
        dataset.train,
        batch_size=src_cfg.train.batch_size,
        seq_len=src_cfg.model.seq_len,
        seed=src_cfg.seed,
    )
    for x, y in zip(a, runs.calibration_batches(src_cfg, 2), strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, next(stream)["inputs"])
    train, val = bytes(dataset.train), bytes(dataset.val)
    rows = [bytes(r.astype(np.uint8)) for x in a for r in x]
    assert all(r in train for r in rows)  # windows of the training split ...
    assert sum(r in val for r in rows) < len(rows) // 2  # ... not validation's (a few repeat)


def test_a_digits_run_cannot_start_from_a_gpt_run(tmp_path, source):
    src_cfg, _, digests = source
    c = load_config(f"{ROOT}/configs/digits.py:size=tiny")
    c.workdir = str(tmp_path / "runs")
    c.init_from = str(src_cfg.run_dir)
    with pytest.raises(
        ConfigError,
        match=r"init_from='.*': the source run is of model family 'gpt', this config's is 'vit'",
    ):
        trainer.train(RunConfig.from_config(c), log=quiet)
    assert not (tmp_path / "runs").exists()
    assert _digest(src_cfg.run_dir) == digests


def test_rerun_will_not_delete_the_source_of_another_run(tmp_path):
    """compare --rerun removes a run's directory first; when another run of the workdir
    started from it (its config.json's init_from), nothing is deleted and the error names
    the dependent run."""
    src = tmp_path / "g" / "none-s0"
    (src / "checkpoints").mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"init_from": ""}))
    dep = tmp_path / "g" / "qat_mxfp4-s0"
    dep.mkdir()
    (dep / "config.json").write_text(json.dumps({"init_from": str(src.resolve())}))
    assert runs.runs_started_from(src, tmp_path) == [dep]
    with pytest.raises(ConfigError, match=r"init_from source of .*qat_mxfp4-s0"):
        runs.remove_run(src, workdir=tmp_path)
    assert (src / "checkpoints").exists()
    runs.remove_run(dep, workdir=tmp_path)  # nothing started from it
    assert not dep.exists()
