"""Smoke tests of the benchmark scripts: they run end to end on tiny inputs and write sane JSON.

Timings are not asserted (the CI machine is shared and noisy); only that every row is there,
positive and consistent.
"""

import json
import sys

import pytest

import lowbit as lb
from benchmarks import bench_quantize, common


def _rows(payload):
    return {(r["format"], r["rounding"]): r for r in payload["rows"]}


def test_bench_quantize_quick_writes_one_row_per_format_and_rounding(tmp_path, capsys):
    out = tmp_path / "bench_quantize.json"
    payload = bench_quantize.main(["--quick", "--size", "64", "--out", str(out)])

    written = json.loads(out.read_text())
    assert written["config"]["shape"] == [64, 64]
    assert written["config"]["runs"] == bench_quantize.QUICK_RUNS
    rows = _rows(written)
    expected = {(f, r) for f in lb.formats.names() for r in bench_quantize.ROUNDINGS}
    assert set(rows) == expected
    assert len(written["rows"]) == len(expected)  # no duplicates
    assert written["baseline"]["median_ms"] > 0
    for row in rows.values():
        assert row["ms"] > 0 and row["x_baseline"] > 0
        assert len(row["samples_ms"]) == bench_quantize.QUICK_RUNS
        assert all(t > 0 for t in row["samples_ms"])
        assert row["bound"] == bench_quantize.bound(row["format"], row["rounding"])
    assert rows[("mxfp4", "nearest")]["bound"] == 1.3
    assert rows[("nvfp4", "nearest")]["bound"] == 1.6
    assert rows[("mxint8", "stochastic")]["bound"] == 1.6
    assert rows[("mxint8", "nearest")]["bound"] is None

    # qwix side by side for the formats it has, nearest rounding only, when it is installed.
    for fmt in bench_quantize.QWIX_QTYPES:
        nearest, stochastic = rows[(fmt, "nearest")], rows[(fmt, "stochastic")]
        if nearest["qwix_status"] == "ok":
            assert nearest["qwix_ms"] > 0 and nearest["lowbit_over_qwix"] > 0
        else:
            assert nearest["qwix_ms"] is None
        assert stochastic["qwix_ms"] is None
    assert rows[("mxint8", "nearest")]["qwix_ms"] is None
    assert payload["rows"][0]["format"] == written["rows"][0]["format"]

    # Fused rows: a Hadamard transform of each quick block size along both axes per quantizer,
    # and one 2-D tile, each with the XLA path side by side.
    fused = written["fused_rows"]
    hadamard = {(r["format"], r["axis"], r["hadamard"]) for r in fused if r["kind"] == "hadamard"}
    assert hadamard == {
        (fmt, axis, b)
        for fmt, _, _ in bench_quantize.FUSED_QUANTIZERS
        for axis in bench_quantize.FUSED_AXES
        for b in bench_quantize.QUICK_HADAMARD
    }
    assert [r["format"] for r in fused if r["kind"] == "tiles"] == [bench_quantize.TILES[0][0]]
    # NVFP4 scale rules (Four Over Six, tensor_block=128, MS-EDEN), against their bound.
    rules = [r for r in fused if r["kind"] == "rule"]
    assert [r["rule"] for r in rules] == [name for name, _ in bench_quantize.RULES]
    assert all(r["bound"] == bench_quantize.RULE_BOUND for r in rules)
    for row in fused:
        assert row["ms"] > 0 and row["x_baseline"] > 0 and row["xla_x_baseline"] > 0
        assert len(row["samples_ms"]) == len(row["xla_samples_ms"]) == bench_quantize.QUICK_RUNS
        assert (row["plain_x_baseline"] is None) == (row["kind"] == "tiles")

    table = capsys.readouterr().out
    for fmt in lb.formats.names():
        assert fmt in table


def test_bench_quantize_runs_without_qwix(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "qwix", None)  # `import qwix` now raises ImportError
    out = tmp_path / "no_qwix.json"
    bench_quantize.main(
        ["--quick", "--size", "32", "--formats", "mxfp8,nvfp4", "--no-fused", "--out", str(out)]
    )
    written = json.loads(out.read_text())
    assert written["fused_rows"] == []
    assert written["qwix"]["available"] is False
    rows = _rows(written)
    assert set(rows) == {(f, r) for f in ("mxfp8_e4m3", "nvfp4") for r in bench_quantize.ROUNDINGS}
    for row in rows.values():
        assert row["ms"] > 0
        assert row["qwix_ms"] is None and row["qwix_status"] == "not installed"
    assert "not installed" in capsys.readouterr().out


def test_bench_quantize_rejects_unknown_format(tmp_path):
    with pytest.raises(SystemExit):
        bench_quantize.parse_args(["--formats", "mxfp3"])


def test_time_interleaved_round_robin():
    calls = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = common.time_interleaved(candidates, runs=3, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    assert calls[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # rotating rounds
    assert all(len(t.samples_s) == 3 and t.median_s >= 0 for t in timings.values())


def test_bench_calibrate_quick_reports_the_per_batch_ratio(tmp_path):
    from benchmarks import bench_calibrate

    out = tmp_path / "bench_calibrate.json"
    payload = bench_calibrate.main(["--quick", "--runs", "1", "--batches", "2", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["config"]["sites"] == 4 and written["config"]["batches"] == 2
    rows = {r["what"]: r for r in payload["rows"]}
    per = rows["calibrate (per batch)"]
    assert per["bound"] == bench_calibrate.BOUND and per["ok"] == (per["x_forward"] <= 1.5)
    assert all(r["k_batches_ms"] > 0 for r in rows.values())


def test_bench_gptq_quick_orders_rtn_gptq_mr_gptq(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_qwix(name, *args, **kwargs):  # the row without qwix: left out, said so
        if name == "qwix" or name.startswith("qwix."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_qwix)
    from benchmarks import bench_gptq

    rows = bench_gptq.bench_layer(64, 32, 256, runs=1)
    err = {r["method"]: r["rel_err"] for r in rows}
    assert not any("qwix" in m for m in err)
    for fmt in bench_gptq.FORMATS:
        assert err[f"lowbit mr-gptq {fmt}"] < err[f"lowbit gptq {fmt}"] < err[f"rtn {fmt}"]
    assert all(r["median_s"] > 0 and r["first_s"] > 0 for r in rows)
