"""experiments/recipe_league.py: entries and their overrides, the claims on constructed numbers
(one that held, one that did not, one within noise, one not tested), bad configs as one-line
errors naming the field, and a tiny league end to end (a trained entry with an override, an
entry not applicable at the size, the page, the figure, reuse, the step-cost column)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from configs import recipe_league as league_config
from experiments import recipe_league as league
from experiments import studylib
from experiments.configlib import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _quiet(*_):
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    return path


def _league(tmp_path: Path, corpus: Path, entries: str, definitions: str = ""):
    """configs/recipe_league.py at the nano size shrunk to 4 steps, one seed."""
    c = league_config.get_config("sizes=nano,seeds=0,tokens_per_param=0")
    c.workdir = c.base.workdir = str(tmp_path / "runs")
    c.results_dir = str(tmp_path / "results")
    c.entries, c.definitions = entries, definitions
    c.step_cost = str(tmp_path / "bench_step.json")
    b = c.base
    b.data.path, b.data.cache_dir = str(corpus), str(tmp_path / "cache")
    b.train.update(eval_every=0, checkpoint_every=0, eval_batches=2, log_every=2, progress=False)
    b.mesh.data, b.mesh.fsdp = 1, 1
    c.sizes.nano.model.update(d_model=32, layers=1, heads=2, seq_len=32)
    c.sizes.nano.train.update(steps=4, batch_size=4)
    return c


# --------------------------------------------------------------------------------------------
# Entries


def test_the_default_config_defines_tetrajets_ablation_at_its_released_values_at_tiny():
    c = league_config.get_config()
    assert c.entries.split(",")[:8] == [
        "none", "mxfp4", "nvfp4", "quartet", "four_over_six", "quartet2", "tetrajet2",
        "fp4_all_the_way",
    ]  # fmt: skip
    c.entries = "none,tetrajet2+osci,tetrajet2+outctl,tetrajet2+both"  # registered recipes only
    entries = {e.label: e for e in league.parse_entries(c)}
    assert {e.recipe for e in entries.values()} == {"none", "tetrajet2"}
    both = entries["tetrajet2+both"]
    steps = league_config.TINY_STEPS  # tiny at 25 tokens per parameter
    values = {k: league.resolve_value(v, steps) for k, v in both.overrides}
    assert values == {
        "quant.osci_period": 200,
        "quant.osci_window": 50,
        "quant.osci_threshold": 8.0,
        "quant.out_control": 0.1,
        "quant.out_control_start": 501,
        "quant.out_control_steps": 50,
        "quant.out_control_multiple": 32,
    }
    # scaled with the run length at another size (xs: about 2.5x the steps)
    assert league.resolve_value("0.0623441*steps", 8010) == 499


def test_resolve_value_types_after_the_field_and_scales_with_steps():
    assert league.resolve_value("0.5*steps", 4) == 2
    assert league.resolve_value("0.01*steps", 4) == 1  # at least 1
    assert league.resolve_value("3", 10, 1.0) == 3.0 and league.resolve_value("3", 10, 1) == 3
    assert league.resolve_value("false", 10, True) is False
    assert league.resolve_value("1e-3", 10) == 1e-3 and league.resolve_value("embed", 10) == "embed"
    with pytest.raises(ValueError):
        league.resolve_value("x", 10, 1)


# --------------------------------------------------------------------------------------------
# Claims


def _row(label: str, losses: list[float] | None, reason: str | None = None, floor=None) -> dict:
    if losses is None:
        return {"label": label, "applicable": False, "reason": reason}
    return {
        "label": label,
        "applicable": True,
        "reason": None,
        "seed_list": list(range(len(losses))),
        "final_val": losses,
        "noise_floor_pct": floor,
    }


def test_claims_on_constructed_numbers():
    base = [2.00, 2.02, 1.98]
    xs = [
        _row("none", base),
        _row("nvfp4", [2.10, 2.12, 2.08]),  # +5% every seed
        _row("quartet", [2.04, 2.06, 2.02]),  # +2%
        _row("quartet2", [2.12, 2.14, 2.10]),  # worse than both: the claim did not hold
        _row("four_over_six", [2.06, 2.08, 2.04]),  # -1.9% against nvfp4 every seed: held
        _row("tetrajet2", [2.05, 2.07, 2.03]),
        _row("tetrajet2+osci", [2.06, 2.06, 2.03]),  # -> within noise (differences of both signs)
    ]
    tiny = [
        _row("none", [2.5]),
        _row("nvfp4", [2.6]),
        _row("quartet", [2.55]),
        _row("quartet2", None, reason="model.d_model=64 must be a multiple of 128"),
        _row("four_over_six", [2.7]),  # one seed, one baseline seed: noise unknown
    ]
    names = ["Quartet II", "Four Over Six", "OsciReset", "OutControl", "both"]
    out = dict(zip(names, league.claims({"tiny": tiny, "xs": xs}), strict=True))
    q2 = out["Quartet II"]
    assert q2["by_size"]["tiny"]["verdict"] == "not tested"
    assert (
        "quartet2: not applicable (model.d_model=64"
        in q2["by_size"]["tiny"]["comparisons"][0]["why"]
    )
    assert q2["by_size"]["xs"]["verdict"] == "did not hold" and q2["verdict"] == "did not hold"
    fos = out["Four Over Six"]
    assert fos["by_size"]["xs"]["verdict"] == "held" and fos["verdict"] == "held"
    c = fos["by_size"]["xs"]["comparisons"][0]
    assert c["diff_pct"] == pytest.approx(100 * (2.06 / 2.10 - 1), abs=0.02) and c["seeds"] == 3
    assert fos["by_size"]["tiny"]["verdict"] == "noise unknown"
    assert out["OsciReset"]["verdict"] == "within noise"
    # an entry left out of the league: the claim is not tested anywhere
    assert out["OutControl"]["verdict"] == "not tested"
    assert (
        "tetrajet2+outctl: not in the league"
        in (out["OutControl"]["by_size"]["xs"]["comparisons"][0]["why"])
    )
    # one seed judged against the baseline's seed spread
    one = league.judge({0: 2.0}, {0: 2.2}, floor_pct=1.0)
    assert one["noise_basis"] == "baseline seed spread" and one["verdict"] == "held"
    assert league.judge({0: 2.0}, {0: 2.01}, floor_pct=1.0)["verdict"] == "within noise"


# --------------------------------------------------------------------------------------------
# Bad configs


@pytest.mark.parametrize(
    "entries, definitions, message",
    [
        ("none,nofp", "", "config.entries: 'nofp' is neither a definition"),
        ("nvfp4,mxfp4", "", "config.entries: needs 'none'"),
        ("none,x", "x=nvfp4 quant.osci", "config.definitions: x: override 'quant.osci'"),
        ("none,x", "x nvfp4", "config.definitions: 'x nvfp4': expected 'label=recipe"),
        ("none,x", "x=nvfp4 model.nope.deeper=1", "config.definitions: x: 'model.nope.deeper' is"),
        ("none,x", "x=nvfp4 quant.bogus=1", "config.entries: x at nano: config.quant: unknown"),
        ("none,x", "x=nvfp4 train.lr=fast", "config.definitions: x: train.lr='fast'"),
        ("none,x", "x=nvfp4 train.steps=0", "config.entries: x at nano: config.train:"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_field(
    tmp_path, corpus, capsys, entries, definitions, message
):
    c = _league(tmp_path, corpus, entries, definitions)
    with pytest.raises(ConfigError, match=None) as e:
        league.run_study(c, log=_quiet)
    assert message in str(e.value)
    with pytest.raises(SystemExit) as done:
        studylib.run_or_exit(league.run_study, c, log=_quiet)
    assert done.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_a_bad_step_cost_file_names_the_field(tmp_path, corpus):
    c = _league(tmp_path, corpus, "none")
    Path(c.step_cost).write_text(json.dumps({"benchmark": "bench_quantize"}))
    with pytest.raises(ConfigError, match=r"config.step_cost=.*bench_step.py --model gpt"):
        league.run_study(c, log=_quiet)


# --------------------------------------------------------------------------------------------
# End to end


def test_a_tiny_league_end_to_end(tmp_path, corpus):
    defs = "mxfp4+warm=mxfp4 train.warmup_steps=0.5*steps"
    c = _league(tmp_path, corpus, "none,mxfp4+warm,quartet2", defs)
    result = league.run_study(c, log=_quiet)
    assert result["sizes"] == ["nano"] and result["steps"]["nano"]["steps"] == 4
    rows = {r["label"]: r for r in result["tables"]["nano"]}
    assert list(rows) == ["none", "mxfp4+warm", "quartet2"]
    # the override reached the run (a run of its own, named by the label)
    group = Path(c.workdir) / "pareto-gpt-nano-4"
    saved = json.loads((group / "mxfp4+warm-s0" / "config.json").read_text())
    assert saved["train"]["warmup_steps"] == 2 and saved["quant"]["recipe"] == "mxfp4"
    assert rows["mxfp4+warm"]["overrides"] == {"train.warmup_steps": 2}
    # quartet2's Hadamard of 128 does not fit d_model 32: reported, not trained
    q2 = rows["quartet2"]
    assert q2["applicable"] is False and "multiple of 128" in q2["reason"]
    assert not (group / "quartet2-s0").exists()
    for label in ("none", "mxfp4+warm"):
        r = rows[label]
        assert r["applicable"] and r["seeds"] == 1 and r["val_loss"] > 0
    assert rows["none"]["paired_gap_pct"] == 0 and rows["mxfp4+warm"]["paired_gap_pct"] != 0
    assert rows["none"]["bench_x_none"] is None  # no bench_step file yet
    by_paper = {c["paper"]: c["verdict"] for c in result["claims"]}
    assert set(by_paper.values()) == {"not tested"}

    js, md, png = league.write(result, tmp_path / "out", "python -m x", results_dir=c.results_dir)
    assert json.loads(js.read_text())["stem"] == "recipe_league_gpt-nano"
    page = md.read_text()
    assert "| quartet2 | quartet2 | - | not applicable at this size (" in page
    assert "| mxfp4+warm | mxfp4 (train.warmup_steps=2) | 1 |" in page
    assert (
        "Step cost: not measured" in page and "bench_step.py --recipes none,mxfp4,quartet2" in page
    )
    assert "## Claims" in page and "**not tested** at this scale" in page
    assert png.stat().st_size > 0 and (Path(c.results_dir) / md.name).exists()

    # again, with a bench_step result: the runs are reused, the step-cost column is filled
    Path(c.step_cost).write_text(
        json.dumps(
            {
                "benchmark": "bench_step",
                "config": {"model": "gpt", "d_model": 64, "layers": 1, "batch": 2, "seq": 64},
                "environment": {"backend": "cpu"},
                "rows": [
                    {"recipe": "none", "x_none": 1.0, "ms": 10.0},
                    {"recipe": "mxfp4", "x_none": 1.31, "ms": 13.1},
                ],
            }
        )
    )
    logs: list[str] = []
    again = league.run_study(c, log=logs.append)
    assert sum("reused" in line for line in logs) == 2
    rows2 = {r["label"]: r for r in again["tables"]["nano"]}
    assert rows2["mxfp4+warm"]["val_loss"] == rows["mxfp4+warm"]["val_loss"]
    assert rows2["mxfp4+warm"]["bench_x_none"] == 1.31 and rows2["quartet2"]["bench_x_none"] is None
    page = league.render_markdown(again)
    assert "GPT d_model 64 x 1 layers" in page and "| 1.31x |" in page
