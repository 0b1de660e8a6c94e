"""What a run trained, as its readers see it (issue 29, points 1, 2 and 4): a run under a
precision plan is named and summarized for its plan, never as a float run; runs are pooled as
seeds only when they differ in nothing but their seed (notebook 02 included, which says what it
skipped); and a finished run extended to more steps trains the steps added as one run, its
config saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lowbit as lb
import lowbit.autoquant as aq
from experiments import compare, metrics, runsets, trainer
from experiments.config import RunConfig, plan_identity
from experiments.configlib import ConfigError
from tests.test_train import corpus, quiet, tiny  # noqa: F401 (corpus: a fixture)

SHORT = dict(steps=2, warmup_steps=0, eval_every=0, checkpoint_every=0)


def save_plan(path: Path, mlp: str = "mxfp4") -> Path:
    """A plan over the sites of tests/test_train.py's one-block tiny GPT: the MLP in ``mlp``,
    attention float."""
    plan = aq.PrecisionPlan(
        choices={"mlp": mlp, "attn": "none"},
        members={"mlp": ("blocks/0/mlp/up", "blocks/0/mlp/down"),
                 "attn": ("blocks/0/attn/qkv", "blocks/0/attn/out")},
        recipes={mlp: lb.recipes.get(mlp), "none": lb.recipes.get("none")},
        bits=10.125, budget=10.5, predicted=0.0, method="isolated")
    return plan.save(path)


# --------------------------------------------------------------------------------------------
# Point 1: a plan run says what it trained


def test_a_plan_run_is_named_and_summarized_for_its_plan(tmp_path, corpus):  # noqa: F811
    plan_file = save_plan(tmp_path / "plan.json")
    ident = plan_identity(aq.Plan.load(plan_file))
    c = tiny(tmp_path, corpus, **SHORT)
    c.quant.plan = str(plan_file)
    cfg = RunConfig.from_config(c)
    assert ident["name"].startswith("plan-10.12b-") and len(ident["hash"]) == 8
    assert cfg.name == f"gpt-tiny/{ident['name']}-s0"  # not gpt-tiny/none-s0
    planned = trainer.train(cfg, log=quiet)
    summary = json.loads((planned.run_dir / "summary.json").read_text())
    assert summary["recipe"] == ident["name"] and summary["recipe_version"] == 1
    assert summary["plan"]["counts"] == {"mxfp4": 2, "none": 2}
    assert summary["plan"]["bits"] == 10.125 and summary["plan"]["hash"] == ident["hash"]
    # the run's name is the plan's content: another plan, another name; a recipe for the
    # sites it leaves out is named too; runs without a plan keep their names
    other = plan_identity(aq.Plan.load(save_plan(tmp_path / "other.json", "mxfp8")))
    assert other["hash"] != ident["hash"]
    c8 = tiny(tmp_path, corpus, "mxfp8", **SHORT)
    c8.quant.plan = str(plan_file)
    assert RunConfig.from_config(c8).name == f"gpt-tiny/{ident['name']}+mxfp8-s0"
    float_cfg = RunConfig.from_config(tiny(tmp_path, corpus, **SHORT))
    assert float_cfg.name == "gpt-tiny/none-s0"
    # a saved config.json keeps the name it was written under
    assert RunConfig.from_config(json.loads((planned.run_dir / "config.json").read_text())
                                 ).name == cfg.name
    # readers: the plan run is its own entry, not a seed of the float run
    plain = trainer.train(float_cfg, log=quiet)
    res = compare.load_runs([plain.run_dir, planned.run_dir])
    assert set(res) == {"none", ident["name"]} and res["none"].seeds == [0]
    assert res[ident["name"]].plan["bits"] == 10.125
    # a plan run written before runs said so (named none-s1, summary "none", no plan field)
    # is read by its plan copy
    old = planned.run_dir.parent / "none-s1"
    planned.run_dir.rename(old)
    s = {k: v for k, v in summary.items() if k not in ("plan", "recipe_version")}
    (old / "summary.json").write_text(json.dumps({**s, "recipe": "none", "seed": 1}))
    res = compare.load_runs([plain.run_dir, old])
    assert set(res) == {"none", ident["name"]} and res["none"].seeds == [0]


# --------------------------------------------------------------------------------------------
# Point 2: seeds are runs that differ in nothing but the seed


def fake_run(root: Path, folder: str, name: str, *, seed: int, steps: int = 400,
             recipe: str = "none", loss: float = 2.0, step: int | None = None, **train) -> Path:
    """A run directory as experiments.train writes it (config.json, summary.json and a few
    metrics records), by hand."""
    d = root / folder / name
    d.mkdir(parents=True)
    config = {"name": f"{folder}/{name}", "model": {"d_model": 32}, "data": {"path": ""},
              "train": {"steps": steps, "lr": 1e-3, **train},
              "quant": {"recipe": recipe, "plan": None, "recipe_version": 1},
              "seed": seed, "workdir": str(root), "init_from": "", "family": "gpt"}
    step = steps if step is None else step
    summary = {"name": config["name"], "recipe": recipe, "seed": seed, "step": step,
               "steps": steps, "final_val_loss": loss, "params": 1000}
    (d / "config.json").write_text(json.dumps(config))
    (d / "summary.json").write_text(json.dumps(summary))
    recs = [{"kind": "train", "step": s, "tokens": 64 * s, "loss": loss} for s in (1, step)]
    recs.append({"kind": "eval", "step": step, "tokens": 64 * step, "val_loss": loss})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def edit_config(d: Path, **quant) -> None:
    c = json.loads((d / "config.json").read_text())
    c["quant"].update(quant)
    (d / "config.json").write_text(json.dumps(c))


def test_runs_of_different_lengths_are_never_pooled_as_seeds(tmp_path):
    r = tmp_path / "runs"
    a = fake_run(r, "gpt-nano", "nvfp4-s0", seed=0, recipe="nvfp4", loss=2.0)
    b = fake_run(r, "gpt-nano", "nvfp4-s1", seed=1, recipe="nvfp4", loss=2.1)
    long = fake_run(r, "gpt-nano", "nvfp4-long-s2", seed=2, recipe="nvfp4", steps=800, loss=1.5)
    base = fake_run(r, "gpt-nano", "none-s0", seed=0, loss=1.9)
    # the old reader pooled all three nvfp4 runs: a spread from their lengths, not their seeds
    res = compare.load_runs([a, b, long, base])
    nv = [k for k in res if k.startswith("nvfp4")]
    assert len(nv) == 2 and "none" in res
    assert sorted(len(res[k].seeds) for k in nv) == [1, 2]
    assert next(k for k in nv if len(res[k].seeds) == 2) == "nvfp4 [train.steps=400]"
    groups, skipped = runsets.group_seeds(runsets.read_run(d) for d in (a, b, long, base))
    assert [(g.label, [x.seed for x in g.runs]) for g in groups] == [
        ("nvfp4 [train.steps=400]", [0, 1]), ("nvfp4 [train.steps=800]", [2]), ("none", [0])]
    assert skipped == []
    # notebook 02's split: one comparison per folder and setting, titled by what differs
    found, skipped = runsets.read_runs(r)
    comps = runsets.comparisons(found)
    assert {k: sorted(x.run_dir.name for x in v) for k, v in comps.items()} == {
        "gpt-nano [train.steps=400]": ["none-s0", "nvfp4-s0", "nvfp4-s1"],
        "gpt-nano [train.steps=800]": ["nvfp4-long-s2"]}


def test_grouping_keeps_apart_versions_plans_and_starts_and_says_what_it_skipped(tmp_path):
    r = tmp_path / "runs"
    v1 = fake_run(r, "g", "mxfp4-s0", seed=0, recipe="mxfp4")
    v2 = fake_run(r, "g", "mxfp4-v2-s1", seed=1, recipe="mxfp4")
    edit_config(v2, recipe_version=2)
    twin = fake_run(r, "g", "mxfp4-copy-s0", seed=0, recipe="mxfp4")  # v1's identity and seed
    stopped = fake_run(r, "g", "mxfp4-s3", seed=3, recipe="mxfp4", step=200)
    (r / "g" / "running-s4").mkdir()
    (r / "g" / "running-s4" / "config.json").write_text("{}")
    found, skipped = runsets.read_runs(r)
    assert sorted(x.run_dir.name for x in found) == ["mxfp4-copy-s0", "mxfp4-s0", "mxfp4-v2-s1"]
    assert any("mxfp4-s3: stopped at step 200 of 400" in s for s in skipped), skipped
    assert any("running-s4: no summary.json" in s for s in skipped), skipped
    groups, left = runsets.group_seeds(runsets.read_run(d) for d in (v1, v2, twin))
    assert [(g.label, len(g.runs)) for g in groups] == [
        ("mxfp4 [quant.recipe_version=1]", 1), ("mxfp4 [quant.recipe_version=2]", 1)]
    assert left == [f"{twin}: the same run and seed as {v1}"]
    # a stopped run is not a seed of the finished ones
    assert len(runsets.group_seeds(runsets.read_run(d) for d in (v1, stopped))[0]) == 2
    # fine-tunes of the float run of their own seed are seeds of one fine-tune
    fts = [fake_run(r, "f", f"qat-s{s}", seed=s, recipe="qat_mxfp4") for s in (0, 1)]
    for s, d in enumerate(fts):
        c = json.loads((d / "config.json").read_text())
        c["init_from"] = str(r / "f" / f"none-s{s}")
        (d / "config.json").write_text(json.dumps(c))
    (g,), _ = runsets.group_seeds(runsets.read_run(d) for d in fts)
    assert g.label == "qat_mxfp4" and [x.seed for x in g.runs] == [0, 1]


def test_notebook_02_splits_what_differs_says_what_it_skipped_and_draws_no_empty_panel(
        tmp_path):
    """Notebook 02 on hand-made runs: two lengths of one folder are two comparisons, the
    stopped run is named as skipped, and a comparison without a ``none`` run says so on its
    gap panel instead of an empty panel with matplotlib's legend warning."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from tests.test_notebooks import ROOT, _inject_parameters, _kernel_manager

    r = tmp_path / "runs"
    for s in (0, 1):
        fake_run(r, "gpt-nano", f"none-s{s}", seed=s, loss=2.0 + s / 100)
        fake_run(r, "gpt-nano", f"nvfp4-s{s}", seed=s, recipe="nvfp4", loss=2.1 + s / 100)
    fake_run(r, "gpt-nano", "nvfp4-long-s0", seed=0, recipe="nvfp4", steps=800, loss=1.5)
    fake_run(r, "gpt-nano", "mxfp4-s5", seed=5, recipe="mxfp4", step=100)
    nb = nbformat.read(ROOT / "notebooks/02_training_curves.ipynb", as_version=4)
    _inject_parameters(nb)
    at = next(i for i, c in enumerate(nb.cells) if "injected-parameters" in c.metadata.get(
        "tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(f"RUNS = {str(r)!r}\nDEMO_STEPS = 0"))
    nbclient.NotebookClient(nb, km=_kernel_manager(tmp_path), timeout=120,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                  for o in c.outputs)
    assert "gpt-nano [train.steps=400] {'none': 2, 'nvfp4': 2}" in out, out
    assert "gpt-nano [train.steps=800] {'nvfp4': 1}" in out, out
    assert "skipped: " in out and "mxfp4-s5: stopped at step 100 of 400" in out, out
    assert "No artists with labels" not in out, out


# --------------------------------------------------------------------------------------------
# Point 4: extending a run


def test_a_finished_run_extended_trains_the_added_steps_as_one_run(tmp_path, corpus):  # noqa: F811
    t = dict(warmup_steps=1, eval_every=3, checkpoint_every=3)
    c = tiny(tmp_path / "a", corpus, steps=6, **t)
    first = trainer.train(RunConfig.from_config(c), log=quiet)
    c.train.steps = 10
    with pytest.raises(ConfigError, match=r"train\.steps: 6 -> 10.*pass --extend"):
        trainer.train(RunConfig.from_config(c), resume=True, log=quiet)
    c.train.warmup_steps = 2  # as a config file's steps // 20 would move it: the run's is kept
    said = []
    ext = trainer.train(RunConfig.from_config(c), resume=True, extend=True, log=said.append)
    assert sorted(ext.losses) == [7, 8, 9, 10] and ext.step == 10
    assert any("from 6 to 10 steps" in s and "holds its final value 0.001" in s for s in said)
    assert any("warmup_steps=2" in s and "kept at the run's 1" in s for s in said), said
    # one run: steps 1..10 once each, the first six as trained, the lr held after step 6
    recs = metrics.read_metrics(ext.metrics_path)
    train = {x["step"]: x for x in recs if x["kind"] == "train"}
    assert [x["step"] for x in recs if x["kind"] == "train"] == list(range(1, 11))
    assert {s: train[s]["loss"] for s in range(1, 7)} == first.losses
    assert train[6]["lr"] > 1e-3 and all(train[s]["lr"] == pytest.approx(1e-3)
                                         for s in range(7, 11))
    (rec,) = [x for x in recs if x["kind"] == "extend"]
    assert rec["step"] == 6 and (rec["from_steps"], rec["to_steps"]) == (6, 10)
    saved = json.loads((ext.run_dir / "config.json").read_text())["train"]
    assert (saved["steps"], saved["extended_from"], saved["warmup_steps"]) == (10, [6], 1)
    summary = json.loads((ext.run_dir / "summary.json").read_text())
    assert summary["extended_from"] == [6] and summary["step"] == summary["steps"] == 10
    # exact: an uninterrupted run with the same schedule trains the same ten steps
    u = tiny(tmp_path / "b", corpus, steps=10, **t)
    u.train.extended_from = [6]
    whole = trainer.train(RunConfig.from_config(u), log=quiet)
    assert {s: train[s]["loss"] for s in range(1, 11)} == whole.losses
    assert ext.final_val_loss == whole.final_val_loss
    # it resumes as it was extended; it is not shortened; an extended run is not a seed of a
    # run trained to 10 steps in one go
    trainer.train(RunConfig.from_config(c), resume=True, log=quiet)
    c.train.steps = 8
    with pytest.raises(ConfigError, match="below the 10 steps"):
        trainer.train(RunConfig.from_config(c), resume=True, extend=True, log=quiet)
    fresh = trainer.train(RunConfig.from_config(tiny(tmp_path / "c", corpus, steps=10, **t)),
                          log=quiet)
    assert len(runsets.group_seeds(runsets.read_run(d) for d in (ext.run_dir, fresh.run_dir))[0]
               ) == 2
