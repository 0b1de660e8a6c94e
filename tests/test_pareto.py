"""experiments/pareto.py: weight memory against a hand count, the Pareto front on hand-made
points (ties included), and a tiny study end to end (table, JSON, figure, reuse)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import lowbit as lb
from configs import pareto as study_config
from experiments import pareto, trainer
from experiments.config import RunConfig, quant_rules
from experiments.configlib import ConfigError

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256


def _quiet(*_):
    pass


def _counts(d: int, layers: int) -> tuple[int, int, int]:
    """(block kernels, head kernel, everything else) of the GPT by hand: per block qkv d x 3d,
    out d x d, up d x 4d, down 4d x d; the embedding and head vocab x d; two norms a block
    and a final one, d each (RoPE: no position table, no biases)."""
    blocks = layers * (3 * d * d + d * d + 4 * d * d + 4 * d * d)
    return blocks, VOCAB * d, VOCAB * d + (2 * layers + 1) * d


def _needs(recipe: str):
    return pytest.mark.skipif(
        recipe not in lb.recipes.names(), reason=f"recipe {recipe!r} not registered"
    )


def _tiny_model(recipe: str, high_precision: str | None = None):
    c = study_config.get_config("sizes=tiny")
    b = c.base
    b.quant.recipe = recipe
    if high_precision is not None:
        b.quant.high_precision = high_precision
    cfg = RunConfig.from_config(b)
    return trainer.build_float_model(cfg), quant_rules(cfg.quant)


@pytest.mark.parametrize(
    "recipe, high_precision, bits, tensor_scale",
    [
        ("qat_mxfp4", None, 4.25, False),  # E2M1 + one E8M0 per 32
        ("w4a16_nvfp4", None, 4.5, True),  # E2M1 + one E4M3 per 16, + a float32 per tensor
        ("qat_mxfp4", "", 4.25, False),  # nothing kept high: the head kernel is quantized too
        ("none", None, None, False),
        # the study's own recipes, where registered: ternary packs 5 codes a byte and has an
        # absmean (float32) scale per tensor; INT4 has NVFP4's scales
        pytest.param("bitnet", None, 8 / 5, True, marks=_needs("bitnet")),
        pytest.param("w4a8_int4", None, 4.5, True, marks=_needs("w4a8_int4")),
        pytest.param("w16a8", None, 16.0, False, marks=_needs("w16a8")),
    ],
)
def test_weight_memory_matches_a_hand_count(recipe, high_precision, bits, tensor_scale):
    model, rules = _tiny_model(recipe, high_precision)
    blocks, head, rest = _counts(d=64, layers=2)  # configs/gpt.py's tiny
    m = pareto.weight_memory(model, rules)
    assert m.params == blocks + head + rest == 131_392
    if bits is None:
        assert (m.quantized_params, m.quantized_bits, m.bits) == (0, 0.0, 16.0 * m.params)
        assert m.bits_per_quantized_param is None
        return
    q = blocks + (head if high_precision == "" else 0)
    kernels = 2 * 4 + (1 if high_precision == "" else 0)
    q_bits = q * bits + (32 * kernels if tensor_scale else 0)
    assert m.quantized_params == q
    assert m.quantized_bits == q_bits
    assert m.bits == q_bits + 16 * (m.params - q)
    assert m.mib == m.bits / (8 * 2**20)
    assert m.bits_per_quantized_param == q_bits / q


def test_pareto_front_on_hand_made_points_with_ties():
    #           A    B    C    D    E    F    G    H
    memory = [1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 1.0, 0.5]
    loss = [3.0, 2.0, 2.5, 2.0, 1.0, 1.0, 3.0, 5.0]
    # C: B has as much memory and less loss; D: B has the same loss in less memory;
    # E and F, A and G are identical (neither dominates the other); H: least memory
    assert pareto.pareto_front(memory, loss) == [True, True, False, False, True, True, True, True]
    # a lower loss at more memory never dominates
    assert pareto.pareto_front([1.0, 2.0], [2.0, 1.0]) == [True, True]
    assert pareto.pareto_front([], []) == []
    with pytest.raises(ValueError, match="must match"):
        pareto.pareto_front([1.0], [1.0, 2.0])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    return path


def _study(tmp_path: Path, corpus: Path, recipes: str = "none,w4a16_mxfp4"):
    c = study_config.get_config("sizes=tiny")
    c.workdir = c.base.workdir = str(tmp_path / "runs")
    c.results_dir = str(tmp_path / "results")
    c.recipes = recipes
    b = c.base
    b.data.path, b.data.cache_dir = str(corpus), str(tmp_path / "cache")
    b.train.update(eval_every=0, checkpoint_every=0, eval_batches=2, log_every=2, progress=False)
    b.mesh.data, b.mesh.fsdp = 1, 1
    # two small sizes, so that the front and the figure span models
    c.sizes.tiny.model.update(d_model=32, layers=1, heads=2, seq_len=32)
    c.sizes.tiny.train.update(steps=4, batch_size=4)
    c.sizes.wide = c.sizes.tiny.copy_and_resolve_references()
    c.sizes.wide.model.d_model = 64
    return c


def test_a_tiny_study_writes_the_table_front_and_figure(tmp_path, corpus):
    c = _study(tmp_path, corpus)
    result = pareto.run_study(c, log=_quiet)
    assert result["sizes"] == ["tiny", "wide"]  # by parameter count
    pts = {(p["size"], p["recipe"]): p for p in result["points"]}
    assert list(pts) == [
        ("tiny", "none"),
        ("tiny", "w4a16_mxfp4"),
        ("wide", "none"),
        ("wide", "w4a16_mxfp4"),
    ]
    for (size, recipe), p in pts.items():
        d = 32 if size == "tiny" else 64
        blocks, head, rest = _counts(d, layers=1)
        assert p["params"] == blocks + head + rest  # the run's own count (summary.json)
        q_bits = 4.25 * blocks if recipe != "none" else 16.0 * blocks
        assert p["memory_bits"] == q_bits + 16.0 * (head + rest)
        assert p["quantized_params"] == (blocks if recipe != "none" else 0)
        assert p["steps"] == 4 and p["seeds"] == 1 and p["val_loss"] > 0
        assert p["weight_format"] == ("float" if recipe == "none" else "mxfp4")
        assert p["gap_pct"] is not None and (recipe != "none") == (p["gap_pct"] != 0)
    # the front agrees with the definition on these points
    ps = list(pts.values())
    for p in ps:
        dominated = any(
            q["memory_bits"] <= p["memory_bits"]
            and q["val_loss"] <= p["val_loss"]
            and (q["memory_bits"], q["val_loss"]) != (p["memory_bits"], p["val_loss"])
            for q in ps
        )
        assert p["on_front"] == (not dominated)
        assert (p["dominated_by"] is None) == p["on_front"]
    assert pts[("tiny", "w4a16_mxfp4")]["on_front"]  # the least memory: always on the front
    assert result["ternary_on_front"] is None  # no ternary recipe here
    assert result["front"] == [
        {"size": p["size"], "recipe": p["recipe"]}
        for p in sorted(ps, key=lambda p: p["memory_bits"])
        if p["on_front"]
    ]

    js, md, png = pareto.write(result, tmp_path / "out", "cmd --x", results_dir=c.results_dir)
    assert js.name == "pareto_gpt-tiny-wide.json"
    back = json.loads(js.read_text())
    assert [(p["size"], p["recipe"]) for p in back["points"]] == list(pts)
    text = md.read_text()
    assert "Command: `cmd --x`" in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    rows += [line for line in text.splitlines() if line.startswith("| wide |")]
    assert len(rows) == 4 and sum("**on**" in r for r in rows) == len(result["front"])
    assert "## Pareto front" in text and "no ternary recipe" in text
    assert png.stat().st_size > 0
    for p in (js, md, png):  # the copies
        assert (Path(c.results_dir) / p.name).read_bytes() == p.read_bytes()

    # finished runs are reused, not trained again
    seen = []
    again = pareto.run_study(c, log=seen.append)
    assert sum("reused" in s for s in seen) == 4
    assert [p["val_loss"] for p in again["points"]] == [p["val_loss"] for p in ps]


def test_bad_configs_name_the_argument():
    with pytest.raises(ValueError, match=r"sizes='tiny\+huge'.*'huge'"):
        study_config.get_config("sizes=tiny+huge")
    with pytest.raises(ValueError, match="seeds=''"):
        study_config.get_config("seeds=")
    with pytest.raises(ValueError, match="seeds='0\\+x'"):
        study_config.get_config("seeds=0+x")
    c = study_config.get_config("sizes=tiny")
    c.recipes = "none,w3a8_nope"
    with pytest.raises(ConfigError, match=r"config.recipes: unknown recipe\(s\) \['w3a8_nope'\]"):
        pareto.run_study(c, log=_quiet)
    c.recipes, c.seeds = "none", ""
    with pytest.raises(ConfigError, match="config.seeds: empty"):
        pareto.run_study(c, log=_quiet)
    c.seeds, c.steps_scale, c.tokens_per_param = "0", 2.0, 25.0
    with pytest.raises(ConfigError, match="tokens_per_param and config.steps_scale"):
        pareto.run_study(c, log=_quiet)


def test_steps_follow_the_scale_or_the_tokens_per_parameter():
    c = study_config.get_config("sizes=tiny+xs,steps_scale=0.5")
    sized = pareto.size_configs(c)
    assert {k: s["steps"] for k, s in sized.items()} == {"tiny": 200, "xs": 300}
    assert sized["xs"]["config"].train.eval_every == 30  # cadences follow the steps
    assert sized["xs"]["config"].name == "pareto-gpt-xs-300/none-s0"
    c = study_config.get_config("sizes=tiny,tokens_per_param=25")
    (s,) = pareto.size_configs(c).values()
    # 131,392 parameters x 25 tokens / (16 sequences x 64 bytes a step), rounded up
    assert s["params"] == 131_392 and s["steps"] == 3208 and s["tokens"] >= 25 * s["params"]
