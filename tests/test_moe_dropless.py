"""The dropless MoE GPT (``model.moe_impl="dropless"``): every assignment kept, one grouped
GEMM (``lb.ragged_dot``) per expert projection; the capacity path's numbers when nothing is
dropped; sites the rules reach by path; it trains and resumes exactly."""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit.flax as lbf
from experiments import trainer
from experiments.config import RunConfig
from experiments.configlib import load_config
from experiments.model import GPT, GPTConfig, MoE

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(d_model=64, layers=1, heads=2, seq_len=32)


def _experts_ref(moe: MoE, x_ND):
    """Every expert's MLP on every token: [E, N, D] (float64)."""
    up, down = (np.asarray(k[...], np.float64) for k in (moe.up.kernel, moe.down.kernel))
    x = np.asarray(x_ND, np.float64)
    h = np.einsum("nd,edf->enf", x, up)
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))  # tanh GELU
    return np.einsum("enf,efd->end", h, down)


def test_dropless_keeps_every_assignment_of_a_skewed_router():
    """Against an explicit loop in float64: with a router that sends most tokens to one
    expert (the capacity path drops there), every token gets all its top-k experts."""
    cfg = GPTConfig(**TINY, mlp="moe", experts=4, top_k=2, moe_impl="dropless")
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.router.kernel[...] = moe.router.kernel[...] * 50 + jnp.array([[3.0, 1.0, 0.0, 0.0]])
    x = jax.random.normal(jax.random.key(2), (2, 32, 64)) + 0.5
    y, aux, dropped = nnx.jit(lambda m, x: m(x))(moe, x)
    assert float(dropped) == 0 and float(aux) > 1.2  # skewed: the balance loss says so
    xn = np.asarray(x).reshape(64, 64)
    logits = xn.astype(np.float64) @ np.asarray(moe.router.kernel[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
    gates = np.take_along_axis(probs, idx, -1)
    gates /= gates.sum(-1, keepdims=True)
    h = _experts_ref(moe, xn)
    want = np.einsum("nk,nkd->nd", gates, h[idx, np.arange(64)[:, None]])
    assert np.bincount(idx.ravel(), minlength=4).max() > 64 * 2 // 4 * 1.25  # would drop
    np.testing.assert_allclose(np.asarray(y).reshape(64, 64), want, rtol=2e-4, atol=2e-6)


def test_dropless_equals_the_capacity_path_when_nothing_is_dropped():
    cfg = GPTConfig(**TINY, mlp="moe", experts=4, top_k=2, capacity_factor=4.0)
    cap = GPT(cfg, rngs=nnx.Rngs(0))
    drop = GPT(dataclasses.replace(cfg, moe_impl="dropless"), rngs=nnx.Rngs(0))
    s_cap = nnx.state(cap, nnx.Param)
    assert jax.tree.structure(s_cap) == jax.tree.structure(nnx.state(drop, nnx.Param))
    nnx.update(drop, s_cap)  # checkpoints move between the two
    tokens = jax.random.randint(jax.random.key(1), (3, 32), 0, 256)

    def loss(m):
        logits, aux = m(tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux, (logits, aux)

    (lc, (yc, ac)), gc = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(cap)
    (ld, (yd, ad)), gd = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(drop)
    np.testing.assert_allclose(yd, yc, rtol=1e-5, atol=1e-5)
    assert float(ad) == pytest.approx(float(ac), rel=1e-6)
    for a, b in zip(jax.tree.leaves(gd), jax.tree.leaves(gc), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_rules_reach_the_expert_stacks_as_grouped_sites():
    cfg = GPTConfig(**TINY, mlp="moe", experts=4, top_k=2, moe_impl="dropless")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    rules = [(r".*/router|head|embed", "none"), (r".*moe/.*", "nvfp4"), (".*", "mxfp8")]
    kinds = {s.path: (s.kind, s.recipe.name if s.recipe else None)
             for s in lbf.sites(model, rules)}
    assert kinds["blocks/0/moe/up"] == ("ragged_dot", "nvfp4")
    assert kinds["blocks/0/moe/down"] == ("ragged_dot", "nvfp4")
    q = lbf.quantize(model, rules, rngs=nnx.Rngs(quant=0))
    assert q.blocks[0].moe.up.ragged_dot_op.recipe.name == "nvfp4"
    assert model.blocks[0].moe.up.ragged_dot_op is None  # the input model is left alone
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
    lq, _ = nnx.jit(lambda m, t: m(t))(q, tokens)
    lf, _ = nnx.jit(lambda m, t: m(t))(model, tokens)
    err = float(jnp.linalg.norm(lq - lf) / jnp.linalg.norm(lf))
    assert 0 < err < 0.2
    # a packed expert stack serves: the packed GPT computes the quantized GPT's logits
    served = lbf.nnx.PackedModel(model, rules, rngs=nnx.Rngs(quant=0))
    ls, _ = nnx.jit(lambda m, t: m(t))(served, tokens)
    np.testing.assert_array_equal(ls, lq)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    return path


def _tiny(tmp_path, corpus, recipe, **train):
    c = load_config(f"{ROOT / 'configs/gpt.py'}:size=tiny,recipe={recipe},mlp=moe")
    c.workdir = str(tmp_path / "runs")
    c.data.path, c.data.cache_dir = str(corpus), str(tmp_path / "cache")
    c.model.d_model, c.model.layers, c.model.heads, c.model.seq_len = 64, 1, 2, 64
    c.model.moe_impl = "dropless"
    c.train.update(steps=12, batch_size=4, lr=1e-2, warmup_steps=2, log_every=1,
                   eval_every=6, eval_batches=1, checkpoint_every=4, progress=False)
    c.train.update(train)
    c.mesh.data, c.mesh.fsdp = 1, 1
    return c


def test_dropless_nvfp4_trains_and_resumes_exactly(tmp_path, corpus):
    """nvfp4 draws stochastic-rounding keys and random Hadamard signs per group from the
    quantizer's rng stream: the resumed run matches the uninterrupted one bit for bit."""
    quiet = lambda *_: None  # noqa: E731
    full = trainer.train(RunConfig.from_config(_tiny(tmp_path / "a", corpus, "nvfp4")),
                         log=quiet)
    losses = [full.losses[s] for s in sorted(full.losses)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses
    cfg = _tiny(tmp_path / "b", corpus, "nvfp4")
    cfg.train.stop_at = 6
    first = trainer.train(RunConfig.from_config(cfg), log=quiet)
    cfg.train.stop_at = 0
    rest = trainer.train(RunConfig.from_config(cfg), resume=True, log=quiet)
    for s in range(1, 13):
        got = first.losses[s] if s <= 6 else rest.losses[s]
        assert got == full.losses[s], (s, got, full.losses[s])


def test_dropless_one_and_four_devices_give_the_same_losses(tmp_path, corpus):
    """The experts' kernels FSDP-sharded like every other weight (data 2 x fsdp 2 against one
    device): the same losses up to float32 reduction order."""
    quiet = lambda *_: None  # noqa: E731
    runs = {}
    for data, fsdp in ((1, 1), (2, 2)):
        c = _tiny(tmp_path / f"{data}x{fsdp}", corpus, "mxfp8", steps=6, checkpoint_every=0)
        c.mesh.data, c.mesh.fsdp = data, fsdp
        runs[data * fsdp] = trainer.train(RunConfig.from_config(c), log=quiet)
    a = np.array([runs[1].losses[s] for s in range(1, 7)])
    b = np.array([runs[4].losses[s] for s in range(1, 7)])
    np.testing.assert_allclose(b, a, rtol=2e-4)


def test_ptq_of_the_dropless_gpt_serves_its_experts_packed():
    """Calibrated, sequentially GPTQ'd (each expert from the tokens routed to it) and packed:
    the served GPT's logits are the fake-quantized GPT's, bit for bit, and closer to the
    float logits than round-to-nearest's."""
    import warnings

    import lowbit as lb

    cfg = GPTConfig(**TINY, mlp="moe", experts=4, top_k=2, moe_impl="dropless")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    toks = [jax.random.randint(jax.random.key(i), (2, 32), 0, 256) for i in range(2)]
    rules = [(r".*/router|head|embed", None), (".*", "qat_nvfp4")]
    cal = lb.ptq.calibrate(model, rules, toks, "percentile", hessians=True)
    assert sum(cal.group_tokens["blocks/0/moe/up"]) == 2 * 2 * 32 * 2  # every assignment
    assert cal.hessians["blocks/0/moe/down"].shape == (4, 256, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an expert with no token would warn)
        gptq = lb.ptq.quantize(model, rules, cal, weights="gptq", sequential=True, batches=toks)
    rtn = lb.ptq.quantize(model, rules, cal)
    sim = lb.ptq.simulate(model, rules, cal)
    np.testing.assert_array_equal(rtn(toks[0])[0], sim(toks[0])[0])
    up = gptq.params["blocks"][0]["moe"]["up"]["kernel"].get_value()
    assert isinstance(up, lb.QArray) and up.codes.shape[0] == 4  # one tensor per expert
    err = {name: sum(float(jnp.mean((m(t)[0] - model(t)[0]) ** 2)) for t in toks)
           for name, m in (("gptq", gptq), ("rtn", rtn))}
    assert err["gptq"] < err["rtn"], err


def test_autoquant_scores_the_grouped_sites():
    """The grouped sites reach autoquant's hooks (lowbit.flax.substituting): an isolated score
    is the loss change of quantizing that site alone."""
    import lowbit as lb
    from experiments.model import loss_fn

    cfg = GPTConfig(**TINY, mlp="moe", experts=4, top_k=2, moe_impl="dropless")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss(m, b):
        return loss_fn(m, b)[0]

    s = lb.autoquant.score(model, loss, [batch], ["mxfp8"], method="isolated")
    assert "blocks/0/moe/up" in s.sites and "blocks/0/moe/down" in s.sites
    i = s.sites.index("blocks/0/moe/down")
    assert s.params["blocks/0/moe/down"] == 4 * 256 * 64
    direct = float(loss(lbf.quantize(model, [("blocks/0/moe/down", "mxfp8")]), batch)
                   - loss(model, batch))
    assert direct != 0
    assert s.damage[i, s.candidates.index("mxfp8")] == pytest.approx(direct, rel=1e-3, abs=1e-6)


def test_moe_study_page_reads_both_paths_gaps_and_drops(tmp_path):
    import json

    from experiments import moe_study

    def run(group, recipe, loss, step_s, drops):
        d = tmp_path / group / f"{recipe}-s0"
        d.mkdir(parents=True)
        lines = [json.dumps({"kind": "train", "step": i, "moe_dropped": x})
                 for i, x in enumerate(drops)]
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return {"recipe": recipe, "seeds": 1, "val_loss": loss, "step_s": step_s,
                "noise_pct": 1.0}

    for group, rows in (("gpt-xs-moe", [run("gpt-xs-moe", "none", 2.0, 0.3, [0.1, 0.3]),
                                        run("gpt-xs-moe", "nvfp4", 2.02, 0.3, [0.2])]),
                        ("gpt-xs-moe-dropless", [run("gpt-xs-moe-dropless", "none", 1.98, 0.2,
                                                     [0.0]),
                                                 run("gpt-xs-moe-dropless", "nvfp4", 1.99,
                                                     0.25, [0.0])])):
        (tmp_path / group / "compare").mkdir()
        (tmp_path / group / "compare" / "summary.json").write_text(json.dumps(rows))
    text = moe_study.main(["--runs", str(tmp_path), "--size", "xs"])
    assert "| capacity | none | 1 | 2.0000 | +0.00% | +0.00% | ±1.00% | 20.00% | 1.00x |" in text
    assert "| capacity | nvfp4 | 1 | 2.0200 | +1.00% | +1.00% | ±1.00% | 20.00% | 1.00x |" in text
    assert "| dropless | nvfp4 | 1 | 1.9900 | +0.51% | -0.50% | ±1.00% | 0.00% | 0.83x |" in text
    with pytest.raises(FileNotFoundError, match="mlp=moe,moe=capacity first"):
        moe_study.load(tmp_path / "nothing", "xs")


def test_the_capacity_multiple_binds_the_capacity_path_only():
    """A Hadamard of 128 along the tokens (quartet2) needs the capacity axis in multiples of
    128; the dropless path pads each expert's rows itself, so the same config passes."""
    from experiments.configlib import ConfigError

    def cfg(moe):
        return load_config(f"{ROOT / 'configs/gpt.py'}:size=xs,mlp=moe,moe={moe},"
                           "recipe=quartet2")

    with pytest.raises(ConfigError, match=r"model\.capacity_multiple=32 must be a multiple"):
        RunConfig.from_config(cfg("capacity"))
    assert RunConfig.from_config(cfg("dropless")).model.moe_impl == "dropless"
