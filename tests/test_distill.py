"""Quantization-aware distillation (``--config.train.distill_from``): the loss against a KL
divergence written out here, and a short QAD run moving a quantized student toward its float
teacher."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import checkpoints, trainer
from experiments.config import RunConfig
from experiments.configlib import ConfigError
from experiments.distill import distill_objective, kd_loss
from experiments.model import GPT, GPTConfig
from experiments.model import loss_fn as gpt_loss_fn
from tests.test_train import corpus, quiet, tiny  # noqa: F401 (corpus: a fixture)


def _kl_by_hand(s, t, temp):
    """T^2 * mean over positions of sum_c p_t (log p_t - log p_s), float64."""
    s = np.asarray(s, np.float64) / temp
    t = np.asarray(t, np.float64) / temp
    log_s = s - np.log(np.sum(np.exp(s - s.max(-1, keepdims=True)), -1, keepdims=True)) - s.max(
        -1, keepdims=True)
    log_t = t - np.log(np.sum(np.exp(t - t.max(-1, keepdims=True)), -1, keepdims=True)) - t.max(
        -1, keepdims=True)
    kl = np.sum(np.exp(log_t) * (log_t - log_s), -1)
    return float(np.mean(kl) * temp * temp)


@pytest.mark.parametrize("temp", [1.0, 2.0])
def test_kd_loss_is_the_kl_divergence_written_out(temp):
    s = jax.random.normal(jax.random.key(0), (2, 5, 256)) * 3
    t = jax.random.normal(jax.random.key(1), (2, 5, 256)) * 3
    assert float(kd_loss(s, t, temp)) == pytest.approx(_kl_by_hand(s, t, temp), rel=1e-5)
    assert float(kd_loss(t, t, temp)) == pytest.approx(0.0, abs=1e-6)


def test_distillation_objective_on_a_tiny_gpt_equals_the_kl_by_hand():
    cfg = GPTConfig(d_model=32, layers=1, heads=2, seq_len=8)
    student, teacher = GPT(cfg, rngs=nnx.Rngs(0)), GPT(cfg, rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(2), (3, 8), 0, 256)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    loss, m = distill_objective(gpt_loss_fn, student, teacher, batch, 2.0, 1.0)
    want = _kl_by_hand(student(tokens)[0], teacher(tokens)[0], 2.0)
    assert float(loss) == float(m["kd"]) == pytest.approx(want, rel=1e-5)
    mixed, mm = distill_objective(gpt_loss_fn, student, teacher, batch, 2.0, 0.25)
    ce, _ = gpt_loss_fn(student, batch)
    assert float(mixed) == pytest.approx(0.25 * want + 0.75 * float(ce), rel=1e-5)
    assert float(mm["data_loss"]) == pytest.approx(float(ce), rel=1e-6)


def _teacher_kl(run_dir, teacher_dir, batch):
    """KL(teacher || student) of the two runs' latest checkpoints on ``batch``, the student
    under its recipe."""
    out = []
    for d in (teacher_dir, run_dir):
        cfg = RunConfig.from_config(json.loads((d / "config.json").read_text()))
        mesh = trainer.make_mesh(cfg.mesh)
        t = trainer.Trainer(cfg, mesh)
        mngr = checkpoints.manager(d / "checkpoints", read_only=True)
        params, _ = checkpoints.restore(mngr, mngr.latest_step(), t.abstract,
                                        t.state_sharding, params_only=True)
        mngr.close()
        model = nnx.merge(t.graphdef, params, t.init_state()["rest"])
        out.append(model(batch["inputs"])[0])
    return float(kd_loss(out[1], out[0]))


def test_a_short_qad_run_moves_the_student_toward_the_teacher(tmp_path, corpus):  # noqa: F811
    """From the same float checkpoint, the same steps under MXFP4: QAD ends nearer the
    teacher's output distribution than QAT on the data loss, and its distillation loss falls
    while it trains."""
    teacher_cfg = RunConfig.from_config(tiny(tmp_path, corpus, steps=40))
    trainer.train(teacher_cfg, log=quiet)
    runs = {}
    for name, extra in (("qad", {"distill_from": str(teacher_cfg.run_dir)}), ("qat", {})):
        c = tiny(tmp_path, corpus, recipe="mxfp4", steps=20, lr=1e-3, **extra)
        c.name = name
        if name == "qat":
            c.init_from = str(teacher_cfg.run_dir)
        runs[name] = RunConfig.from_config(c)
        trainer.train(runs[name], log=quiet)
    assert runs["qad"].init_from == str(teacher_cfg.run_dir.resolve())  # starts from its teacher
    tokens = np.frombuffer(corpus.read_bytes()[1000:1000 + 8 * 64], np.uint8).reshape(8, 64)
    batch = {"inputs": jnp.asarray(tokens, jnp.int32)}
    kl = {n: _teacher_kl(r.run_dir, teacher_cfg.run_dir, batch) for n, r in runs.items()}
    assert 0 < kl["qad"] < 0.7 * kl["qat"], kl
    lines = (runs["qad"].run_dir / "metrics.jsonl").read_text().splitlines()
    rec = [json.loads(ln) for ln in lines]
    kd = [r["kd"] for r in rec if r.get("kind") == "train" and "kd" in r]
    assert len(kd) >= 10 and np.median(kd[-5:]) < np.median(kd[:5]), kd


def test_the_cli_config_takes_distill_from():
    """The family configs declare the QAD fields, so a locked ConfigDict (as the CLI's
    ``--config.train.distill_from=...`` override sets it) accepts them."""
    from experiments.configlib import load_config

    for spec in ("configs/gpt.py:size=tiny", "configs/digits.py:size=tiny"):
        c = load_config(spec)
        c.lock()
        c.train.distill_from, c.train.distill_weight = "runs/x", 0.5
        assert RunConfig.from_config(c).train.distill_weight == 0.5


def test_distill_config_errors(tmp_path, corpus):  # noqa: F811
    c = tiny(tmp_path, corpus, distill_from=str(tmp_path / "a"))
    c.init_from = str(tmp_path / "b")
    with pytest.raises(ConfigError, match="the student starts from its teacher"):
        RunConfig.from_config(c)
    for field, value, msg in (("distill_temperature", 0.0, "must be > 0"),
                              ("distill_weight", 1.5, r"must be in \[0, 1\]")):
        c = tiny(tmp_path, corpus, **{field: value})
        with pytest.raises(ValueError, match=msg):
            RunConfig.from_config(c)
    c = tiny(tmp_path, corpus, distill_from=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="init_from"):
        trainer.train(RunConfig.from_config(c), log=quiet)
    assert dataclasses.fields(trainer.TrainConfig)  # (the config class the CLI fills)
