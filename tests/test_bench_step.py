"""Smoke test of benchmarks/bench_step.py: a tiny model, a few recipes, sane JSON.

Timings are not asserted (the machine is shared and noisy): only that every row is there,
positive and consistent, and that every step's loss and the trained parameters are finite.
"""

import json
import math

import pytest

import lowbit as lb
from benchmarks import bench_step


def test_bench_step_quick_writes_one_row_per_recipe(tmp_path, capsys):
    out = tmp_path / "bench_step.json"
    # "none" is added as the baseline; one FQT recipe (compiling dominates: keep it to two).
    payload = bench_step.main(["--quick", "--recipes", "mxfp4", "--out", str(out)])

    written = json.loads(out.read_text())
    assert written["config"]["d_model"] == bench_step.QUICK.d_model
    assert written["config"]["runs"] == bench_step.QUICK_RUNS
    assert written["config"]["quick"] is True
    rows = {r["recipe"]: r for r in written["rows"]}
    assert list(rows) == ["none", "mxfp4"]  # baseline first, no duplicates
    assert written["baseline"]["median_ms"] > 0
    assert rows["none"]["x_none"] == pytest.approx(1.0)
    assert rows["none"]["kind"] == "baseline"
    assert rows["mxfp4"]["kind"] == "FQT"
    steps = 1 + 1 + bench_step.QUICK_RUNS  # compiling step, warm-up, timed rounds
    for name, row in rows.items():
        assert row["ms"] > 0 and row["x_none"] > 0 and row["x_none_min"] > 0
        assert row["cpu_ms"] > 0 and row["cpu_x_none"] > 0
        assert len(row["samples_ms"]) == bench_step.QUICK_RUNS
        assert all(t > 0 for t in row["samples_ms"])
        assert row["bound"] == bench_step.bound(name)
        assert row["within_bound"] == (
            None if row["bound"] is None else row["x_none"] <= row["bound"]
        )
        assert row["steps"] == steps
        assert row["loss_finite"] and row["params_finite"]
        assert math.isfinite(row["loss_first"]) and math.isfinite(row["loss_last"])
        # Random bytes: the first loss is near log(256); training on one batch lowers it.
        assert abs(row["loss_first"] - math.log(bench_step.VOCAB)) < 1.0
        assert row["loss_last"] < row["loss_first"]
    assert written["all_finite"] is True
    assert payload["rows"][0]["recipe"] == "none"

    table = capsys.readouterr().out
    for name in rows:
        assert name in table
    assert "load average" in table


def test_bench_step_bounds_and_arguments():
    assert bench_step.bound("qat_mxfp8") == 1.15
    assert bench_step.bound("mxfp4") == bench_step.bound("nvfp4") == 1.6
    assert bench_step.bound("quartet") == 1.8
    assert bench_step.bound("mxfp8") is None and bench_step.bound("none") is None
    assert bench_step._kind(lb.recipes.get("qat_mxfp4")) == "QAT"
    args = bench_step.parse_args([])
    assert args.recipes == list(bench_step.DEFAULT_RECIPES) and args.runs == 10
    assert args.cfg == bench_step.FULL
    args = bench_step.parse_args(["--recipes", "MXFP4, mxfp4,none", "--runs", "3"])
    assert args.recipes == ["none", "mxfp4"] and args.runs == 3
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--recipes", "mxfp3"])
