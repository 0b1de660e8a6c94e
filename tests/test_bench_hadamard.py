"""Smoke test of benchmarks/bench_hadamard.py: it runs end to end and writes sane JSON
(timings are not asserted: the CI machine is shared and noisy)."""

import json

from benchmarks import bench_hadamard
from lowbit.core import hadamard


def test_bench_hadamard_quick_writes_one_row_per_block_and_axis(tmp_path):
    out = tmp_path / "bench_hadamard.json"
    bench_hadamard.main(["--quick", "--out", str(out)])
    written = json.loads(out.read_text())
    rows = {(r["block"], r["axis"]): r for r in written["rows"]}
    assert set(rows) == {(b, a) for b in (16, 256) for a in ("last", "leading")}
    for (b, axis), r in rows.items():
        assert r["dense"] > 0 and r["butterfly"] > 0 and r["memory_pass_ms"] > 0
        assert r["default"] == hadamard.default_method(b, axis == "last")
        fastest = min(r["dense"], r["butterfly"])
        assert r["default_is_fastest"] == (r[r["default"]] <= fastest)
