"""experiments/autoquant.py end to end on a tiny GPT, and ``--config.quant.plan`` in the training
configs.

The fast study runs two methods (``isolated`` and ``shapley``: each method is one compiled
scoring program, and ``lowbit.autoquant``'s own tests check all four against direct
computations) at one budget; the slow one (``make test-slow``) runs every method, two budgets
and a QAT run trained under a saved plan."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

import lowbit as lb
import lowbit.autoquant as aq
import lowbit.flax as lbf
from configs import autoquant as study_config
from experiments import autoquant, trainer
from experiments.config import RunConfig, config_diff, quant_rules
from experiments.configlib import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _quiet(*_):
    pass


def tiny_study(tmp: Path, mlp: str = "dense", *, full: bool = False):
    corpus = tmp / "corpus.txt"
    corpus.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    c = study_config.get_config(f"mlp={mlp},size=tiny")
    c.workdir = c.base.workdir = str(tmp / "runs")
    b = c.base
    b.data.path, b.data.cache_dir = str(corpus), str(tmp / "cache")
    b.model.d_model, b.model.layers, b.model.heads, b.model.seq_len = 32, 1, 2, 32
    b.train.update(steps=10, batch_size=4, eval_batches=2, eval_every=0, checkpoint_every=0,
                   progress=False)
    b.mesh.data = 1
    c.calib_batches, c.eval_batches, c.shapley_steps = 1, 2, 2
    c.heuristic_low, c.heuristic_high, c.matched = "qat_mxfp4", "qat_mxfp8", False
    c.candidates = "qat_mxfp8,qat_mxfp4"
    c.random_recipes = 4 if full else 3  # each a new quantized program to compile
    if full:
        c.budgets, c.qat_steps, c.qat_budgets = "4.5,6", 2, "4.5"
    else:
        c.methods, c.budgets, c.qat_steps = "isolated,shapley", "4.5", 0
        c.shapley_rule = "gauss"
    return c


def run(tmp: Path, full: bool):
    c = tiny_study(tmp, full=full)
    result = autoquant.run_study(c, log=_quiet)
    files = autoquant.write(result, tmp / "out", "cmd")
    return c, result, files


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return run(tmp_path_factory.mktemp("autoquant"), full=False)


@pytest.fixture(scope="module")
def full_study(tmp_path_factory):
    return run(tmp_path_factory.mktemp("autoquant-full"), full=True)


def check_study(study, methods, budgets):
    c, result, (js, md, png) = study
    assert json.loads(js.read_text())["methods"] == list(methods)
    assert png.stat().st_size > 0
    assert set(result["score_seconds"]) == set(methods)
    budget = [p for p in result["plans"] if p["kind"] == "budget"]
    assert {(p["method"], p["budget"]) for p in budget} == {
        (m, b) for m in methods for b in budgets
    }
    for p in result["plans"]:  # matched points included
        assert p["bits"] <= p["budget"] + 1e-12
        assert p["val_loss"] > 0 and p["counts"]
    # the all-"none" plan is the float model, through the same rules and evaluation
    assert result["none_plan"]["bits"] == 16.0
    assert result["none_plan"]["val_loss"] == result["float"]["val_loss"]
    assert result["none_plan"]["calib_loss"] == result["float"]["calib_loss"]
    assert {h["preset"] for h in result["heuristics"]} == {"all", "mlp_only"}
    # completeness ratios per candidate, for shapley and isolated
    assert [r["recipe"] for r in result["completeness"]] == result["candidates"]
    assert all("ratio_shapley" in r and "ratio_isolated" in r for r in result["completeness"])
    # the random recipes: measured on the calibration batches, predicted by every method
    n = c.random_recipes
    pts = result["random_recipes"]
    assert len(pts) == n == result["validation"]["recipes"]
    fl = result["float"]["calib_loss"]
    for p in pts:
        assert p["delta_calib"] == pytest.approx(p["calib_loss"] - fl)
        assert set(p["predicted"]) == set(methods) and set(p["choices"].values()) <= {
            "none", *result["candidates"]}
    v = result["validation"]["methods"]
    assert set(v) == set(methods)
    for m in methods:
        assert v[m]["spearman"] is None or -1 <= v[m]["spearman"] <= 1
        assert ("mae" in v[m]) == (m in ("isolated", "shapley"))
    if "shapley" in methods:  # the configured quadrature is the one scored and recorded
        sh = json.loads(js.read_text())["scores"]["shapley"]
        assert (sh["steps"], sh["rule"]) == (c.shapley_steps, c.shapley_rule)
    if "shapley" in methods:  # the MAE is that of the recorded predictions
        mae = np.mean([abs(p["predicted"]["shapley"] - p["delta_calib"]) for p in pts])
        assert v["shapley"]["mae"] == pytest.approx(mae)
    text = md.read_text()
    assert f"Validation: {n} random mixed-precision recipes" in text
    for m in methods:
        assert f"| {m} |" in text
    assert "mlp_only" in text and "Pareto" in text
    for name, front in result["pareto"].items():
        assert [b for b, _ in front] == sorted(b for b, _ in front), name


def test_the_study_measures_its_methods_budgets_and_heuristics(study):
    check_study(study, ("isolated", "shapley"), (4.5,))
    _, result, _ = study
    assert result["cost"] == "stored"  # the default; a dense GPT's active parameters: all
    assert result["model"]["active_params"] == result["model"]["scored_params"]


def test_a_moe_study_under_the_active_cost_budgets_active_parameters(tmp_path):
    """``--config.cost=active`` on the MoE GPT: the experts' fraction comes from the config
    (top_k / experts), every plan is solved and saved under it, and its bits are those of the
    scores' active cost table."""
    c = tiny_study(tmp_path, "moe")
    c.cost, c.methods, c.budgets, c.random_recipes = "active", "gradient", "6", 0
    c.base.model.experts, c.base.model.top_k = 4, 1
    result = autoquant.run_study(c, log=_quiet)
    assert result["cost"] == "active"
    s = aq.Scores.from_json(result["scores"]["gradient"])
    assert set(s.fraction.values()) == {1.0, 0.25}
    assert all(s.fraction[p] == 0.25 for p in s.fraction if "/moe/" in p)
    d, f = c.base.model.d_model, 4 * c.base.model.d_model  # one block
    assert result["model"]["scored_params"] == 4 * d * d + 2 * 4 * d * f
    assert result["model"]["active_params"] == 4 * d * d + 2 * d * f
    assert result["none_plan"]["bits"] == 16.0
    (p,) = result["plans"]
    plan = aq.Plan.load(p["plan_file"])
    assert plan.cost == "active" and p["bits"] == plan.bits <= 6.0
    assert plan.bits == s.bits(plan.choices, cost="active") != s.bits(plan.choices)
    for h in result["heuristics"]:  # the presets at their active bits too
        assert h["bits"] == s.bits({g: _recipe_of(h, g) for g in s.sites}, cost="active")
    text = autoquant.render_markdown(result)
    assert "Bits per active parameter" in text


def _recipe_of(h, group):
    """The recipe a heuristic point's counts give ``group`` (every site of one role agrees)."""
    role = "expert" if "/moe/" in group else "attention"
    low = {"all": ("expert", "attention"), "mlp_only": ("expert",),
           "experts_only": ("expert",)}[h["preset"]]
    return h["low"] if role in low else h["high"]


@pytest.mark.slow
def test_the_full_study_and_a_run_trained_with_a_plan(full_study):
    check_study(full_study, aq.METHODS, (4.5, 6.0))
    c, result, _ = full_study
    (q,) = [q for q in result["qat"] if q["budget"] == 4.5][:1]
    cfg = RunConfig.from_config(json.loads((Path(q["run"]) / "config.json").read_text()))
    check_planned_sites(cfg)
    assert aq.Plan.load(Path(q["run"]) / "plan.json") == aq.Plan.load(cfg.quant.plan)


def test_a_config_with_a_plan_quantizes_exactly_the_planned_sites(study):
    c, result, _ = study
    base = c.base.copy_and_resolve_references()
    base.quant.plan = result["plans"][0]["plan_file"]
    check_planned_sites(RunConfig.from_config(base), init_from=False)


def check_planned_sites(cfg, init_from: bool = True):
    plan = aq.Plan.load(cfg.quant.plan)
    assert plan.bits <= 4.5 and cfg.quant.recipe == "none" and bool(cfg.init_from) == init_from
    want = {p: plan.choices[g] for g, ps in plan.members.items() for p in ps}
    model = trainer.build_model(cfg)
    got = {s.path: (s.recipe.name if s.recipe is not None else "none")
           for s in lbf.sites(model, quant_rules(cfg.quant)) if s.kernel is not None}
    assert {p: r for p, r in got.items() if p in want} == want
    assert set(got) - set(want) == {"head"}  # not planned: high_precision (embed: no GEMM)
    assert {got[p] for p in set(got) - set(want)} == {"none"}
    # and the float model with the plan's rules runs them too
    sites = lbf.sites(trainer.build_float_model(cfg), plan.rules())
    assert {s.path: s.recipe.name for s in sites if s.recipe is not None} == {
        p: r for p, r in want.items() if r != "none"
    }


def test_quant_plan_is_validated_and_recorded(study, tmp_path):
    c, result, _ = study
    plan_file = result["plans"][0]["plan_file"]
    base = c.base
    base.quant.plan = plan_file
    cfg = RunConfig.from_config(base)
    assert cfg.quant.plan == str(Path(plan_file).resolve())
    assert cfg.to_json()["quant"]["plan"] == cfg.quant.plan
    # a run written before the field existed compares equal to plan=None
    old = RunConfig.from_config(c.base.to_dict() | {"quant": {"recipe": "none"}})
    saved = old.to_json()
    del saved["quant"]["plan"]
    assert not [d for d in config_diff(saved, old.to_json()) if "plan" in d]
    base.quant.plan = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"quant\.plan=.*missing\.json"):
        RunConfig.from_config(base)
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    base.quant.plan = str(tmp_path / "other.json")
    with pytest.raises(ConfigError, match=r"quant\.plan=.*not a saved plan"):
        RunConfig.from_config(base)
    base.quant.plan = None


def test_unknown_method_and_candidate_are_named():
    c = study_config.get_config("mlp=dense,size=tiny")
    assert c.cost == "stored"
    c.cost = "memory"
    with pytest.raises(ConfigError, match=r"config\.cost: unknown cost 'memory'"):
        autoquant.run_study(c, log=_quiet)
    c.cost = "stored"
    c.methods = "fisher"
    with pytest.raises(ConfigError, match="unknown method 'fisher'"):
        autoquant.run_study(c, log=_quiet)
    c.methods, c.candidates = "isolated", "qat_mxfp3"
    with pytest.raises(ConfigError, match=r"config\.candidates"):
        autoquant.run_study(c, log=_quiet)
    with pytest.raises(ValueError, match="mlp='sparse'"):
        study_config.get_config("mlp=sparse")


def test_pareto_keeps_the_lower_envelope():
    assert autoquant.pareto([(6, 1.0), (4.5, 2.0), (4.5, 1.5), (8, 1.0)]) == [(4.5, 1.5), (6, 1.0)]
    assert re.fullmatch(autoquant.MOE_GROUPS[0], "blocks/3/moe/down")


def test_resume_refuses_a_plan_file_that_changed(study, tmp_path):
    c, result, _ = study
    base = c.base.copy_and_resolve_references()
    plan_file = tmp_path / "plan.json"
    plan = aq.Plan.load(result["plans"][0]["plan_file"])
    plan.save(plan_file)
    base.quant.plan = str(plan_file)
    base.workdir = str(tmp_path / "runs")
    cfg = RunConfig.from_config(base)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.json").write_text(json.dumps(cfg.to_json()))
    none = {"none": lb.recipes.get("none")}
    changed = dataclasses.replace(plan, choices={k: "none" for k in plan.choices}, recipes=none)
    changed.save(cfg.run_dir / "plan.json")  # the copy a run made at its start
    with pytest.raises(ConfigError, match=r"plan file quant\.plan=.* changed since"):
        trainer.train(cfg, resume=True, log=_quiet)
    assert aq.Plan.load(cfg.run_dir / "plan.json") == changed  # nothing was overwritten


def test_shapley_rules_compares_the_rules_on_a_trained_run(study, tmp_path):
    """experiments.shapley_rules on the study's float run: one point is t = 1/2 for both rules,
    and each ratio is the summed credits over the change measured by quantizing every site."""
    from experiments import shapley_rules

    _, result, _ = study
    out = tmp_path / "rules.json"
    args = ["--run", result["float_run"], "--batches", "1", "--candidates", "w4a16_mxfp4",
            "--midpoint", "1", "--gauss", "1,2", "--out", str(out)]
    payload = shapley_rules.main(args)
    assert json.loads(out.read_text())["rows"] == payload["rows"]
    rows = {(r["rule"], r["steps"]): r for r in payload["rows"]}
    assert set(rows) == {("midpoint", 1), ("gauss", 1), ("gauss", 2)}
    assert rows["midpoint", 1]["sum_credits"] == rows["gauss", 1]["sum_credits"]
    for r in rows.values():
        assert r["measured"] == payload["measured"]["w4a16_mxfp4"] != 0
        assert r["ratio"] == pytest.approx(r["sum_credits"] / r["measured"], rel=1e-12)
    assert "| gauss | 2 |" in payload["table"]
    with pytest.raises(SystemExit):
        shapley_rules.main(["--run", result["float_run"], "--gauss", "0"])
