"""Smoke tests of benchmarks/bench_step.py: tiny GPT and MLP stack, a few recipes, sane JSON.

Timings are not asserted (the machine is shared and noisy): only that every row is there,
positive and consistent, and that every step's loss and the trained parameters are finite.
"""

import json
import math

import jax
import numpy as np
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
        assert row["bound"] == bench_step.bound(name, "gpt")
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


def test_bench_step_mlp_quick_trains_the_stack_with_pallas_gemms(tmp_path, capsys):
    out = tmp_path / "bench_step_mlp.json"
    # The MLP stack's GEMMs are 2-D: implementation="pallas" takes lowbit.dot_general's
    # quantized_gemm path (on CPU its emulation branch).
    payload = bench_step.main(
        ["--model", "mlp", "--quick", "--recipes", "mxfp4", "--implementation", "pallas",
         "--out", str(out)]
    )  # fmt: skip
    written = json.loads(out.read_text())
    cfg = written["config"]
    assert cfg["model"] == "mlp" and cfg["implementation"] == "pallas"
    assert (cfg["d_model"], cfg["d_ff"], cfg["blocks"], cfg["tokens"]) == (64, 256, 2, 256)
    assert cfg["optimizer"].startswith("sgd")
    rows = {r["recipe"]: r for r in written["rows"]}
    assert list(rows) == ["none", "mxfp4"]
    assert rows["none"]["x_none"] == pytest.approx(1.0)
    for name, row in rows.items():
        assert row["ms"] > 0 and len(row["samples_ms"]) == bench_step.QUICK_RUNS
        assert row["bound"] == bench_step.bound(name, "mlp")
        assert row["loss_finite"] and row["params_finite"]
        assert row["loss_last"] < row["loss_first"]  # SGD lowers the mean square
    assert rows["mxfp4"]["bound"] == 1.15
    # Quantization changes the first step's loss, but only a little (d 64, MXFP4).
    first = rows["mxfp4"]["loss_first"] / rows["none"]["loss_first"]
    assert 0.9 < first < 1.1 and first != 1.0
    assert payload["all_finite"] is True
    table = capsys.readouterr().out
    assert "MLP stack 2 x (x + W2 gelu(W1 x))" in table and "implementation pallas" in table


def test_bench_step_mlp_loss_is_the_same_under_xla_and_pallas_on_cpu():
    # 2-D GEMMs and a nearest-rounding recipe: the same quantized values on both paths.
    wl = bench_step.workload("mlp", quick=True)
    params, x = wl.params(), wl.batch()
    key = jax.random.key(3)
    a = jax.jit(wl.loss("mxfp4", "xla"))(params, x, key)
    b = jax.jit(wl.loss("mxfp4", "pallas"))(params, x, key)
    np.testing.assert_allclose(float(b), float(a), rtol=1e-5)


def test_bench_step_bounds_and_arguments():
    assert bench_step.bound("qat_mxfp8") == 1.15
    assert bench_step.bound("mxfp4") == bench_step.bound("nvfp4") == 1.6
    assert bench_step.bound("quartet") == 1.8
    assert bench_step.bound("mxfp8") is None and bench_step.bound("none") is None
    mlp = {r: bench_step.bound(r, "mlp") for r in bench_step.DEFAULT_RECIPES}
    assert mlp == {
        "none": None,
        "qat_mxfp8": 1.15,
        "qat_mxfp4": 1.15,
        "qat_nvfp4": 1.15,
        "fp8": None,
        "mxfp8": 1.15,
        "mxfp6": 1.15,
        "mxfp4": 1.15,
        "nvfp4": 1.4,
        "quartet": 1.5,
        "mxfp4_bwd": 1.4,
    }
    assert [bench_step.bound(r, "mlp") for r in ("four_over_six", "quartet2", "tetrajet2")] == [
        1.3, 1.5, 1.5]
    assert bench_step.bound("four_over_six") is None  # the GPT: reported only
    with pytest.raises(ValueError, match="model must be one of"):
        bench_step.bound("mxfp4", "cnn")
    assert bench_step._kind(lb.recipes.get("qat_mxfp4")) == "QAT"
    args = bench_step.parse_args([])
    assert args.recipes == list(bench_step.DEFAULT_RECIPES) and args.runs == 10
    assert args.cfg == bench_step.FULL and args.model == "gpt" and args.implementation is None
    assert args.out == bench_step.DEFAULT_OUT["gpt"]
    args = bench_step.parse_args(["--recipes", "MXFP4, mxfp4,none", "--runs", "3"])
    assert args.recipes == ["none", "mxfp4"] and args.runs == 3
    args = bench_step.parse_args(["--model", "mlp", "--implementation", "xla"])
    assert args.cfg == bench_step.MLP_FULL and args.implementation == "xla"
    assert args.out == bench_step.DEFAULT_OUT["mlp"]
    assert bench_step.MLP_FULL == bench_step.MLPConfig(256, 1024, 4, 4096)
    assert bench_step.parse_args(["--implementation", "none"]).implementation is None
    for bad in (["--recipes", "mxfp3"], ["--model", "cnn"], ["--implementation", "triton"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(bad)
