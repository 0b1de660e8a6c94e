"""The device-less GPU report (``make gpu-aot``) and the rooflines, without the CUDA plugin.

``pallas_kernels/aot_report.json`` is written by ``benchmarks/gpu_aot.py`` on a machine with
the CUDA plugin; these tests read it: its configurations must be exactly those ``gpu_check``
runs with the blocks ``get_default`` picks today (change a default, and this fails until the
report is made again), on both targets, with nothing spilling and nothing failing. The
rooflines are checked against sizes written out here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import gpu_aot
from pallas_kernels import aot, gpu_check, roofline

ROOT = Path(__file__).resolve().parents[1]
REPORT = json.loads((ROOT / "pallas_kernels" / "aot_report.json").read_text())


@pytest.mark.parametrize("target", sorted(aot.TARGETS))
def test_report_holds_exactly_the_configurations_gpu_check_runs(target):
    got = {(r["case"], r["config"]) for r in REPORT["rows"]
           if r["target"] == target and r["section"] != "step"}
    want = gpu_aot.configurations()
    assert got - want == set(), "in the report but not run by gpu_check: make gpu-aot again"
    assert want - got == set(), "run by gpu_check but not in the report: make gpu-aot again"


def test_report_covers_every_kernel_kind_and_step_on_both_targets():
    assert sorted(REPORT["targets"]) == sorted(aot.TARGETS)
    for target in aot.TARGETS:
        rows = [r for r in REPORT["rows"] if r["target"] == target]
        kinds = {r["kernel"].split("_")[0] for r in rows}
        assert {"quantize", "block", "grouped"} <= kinds
        steps = {d["recipe"] for d in REPORT["steps"] if d["target"] == target}
        assert steps == set(gpu_aot.STEP_RECIPES)
    # the FP4 steps run their weight gradients through the kernels
    for d in REPORT["steps"]:
        assert (d["pallas_launches"] > 0) == (d["recipe"] != "none"), d["recipe"]


def test_report_has_no_spill_and_no_failure():
    assert REPORT["failures"] == []
    spilling = [(r["target"], r["case"], r["kernel"]) for r in REPORT["rows"]
                if r["spill_stores"] or r["spill_loads"]]
    assert spilling == []
    assert all(0 < r["registers"] <= 255 for r in REPORT["rows"])


def test_report_markdown_matches_its_json():
    md = (ROOT / "pallas_kernels" / "aot_report.md").read_text()
    n = len(REPORT["rows"])
    nm = len(REPORT["mosaic"])
    assert f"{n} Pallas kernel launches, {nm} Mosaic GPU matmuls, 0 spilling, 0 compile " \
        "failures." in md
    assert md.count("\n| mosaic gemm ") == nm
    assert md.count("\n| quantize |") + md.count("\n| matmul |") + md.count(
        "\n| grouped |") + md.count("\n| gemm |") + md.count("\n| step |") == n


@pytest.mark.parametrize("target", sorted(gpu_aot.MOSAIC_FAMILY))
def test_report_compiles_each_mosaic_kernel_to_its_native_mma(target):
    """Every format of the target's Mosaic GPU family, at both shapes, reached through
    quantized_gemm's dispatch: the PTX holds the MMA its format needs (Blackwell: the
    block-scaled tcgen05 kind; Hopper: FP8 wgmma), nothing spills, no Triton kernel runs
    beside it, and the blocks are those get_default picks today."""
    rows = {r["case"]: r for r in REPORT["mosaic"] if r["target"] == target}
    cases = gpu_aot.mosaic_cases(target)
    assert len(cases) == len(rows) >= 8
    for fmt, m, k, n in cases:
        r = rows[f"mosaic gemm {fmt} MKN={(m, k, n)}"]
        assert [x for x in r["mma"] if not x.startswith(gpu_aot.expected_mma(target, fmt))] == []
        assert r["mma"], r["case"]
        assert r["spill_stores"] == r["spill_loads"] == 0 and 0 < r["registers"] <= 255
        assert r["triton_kernels"] == 0
        assert r["config"] == str(gpu_aot.mosaic_config(target, fmt, m, k, n))
    if target == "b200":  # the three block-scaled kinds, one per format family
        kinds = {x.split(".kind::")[1].split(".")[0] for r in rows.values() for x in r["mma"]}
        assert kinds == {"mxf8f6f4", "mxf4", "mxf4nvf4"}


def test_session_without_the_cuda_plugin_says_what_to_install():
    ok, why = aot.available()
    if ok:
        pytest.skip("the CUDA plugin is installed here")
    assert "jax[cuda12]" in why or "nvcc" in why
    with pytest.raises(RuntimeError, match="needs XLA's GPU compiler"):
        with aot.session("h100"):
            pass


def test_session_rejects_an_unknown_target():
    if not aot.available()[0]:
        pytest.skip("needs the CUDA plugin")
    with pytest.raises(ValueError, match="target='a100'"):
        with aot.session("a100"):
            pass


def test_ptxas_and_thunk_parsers_read_real_output_shapes():
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a' for 'sm_100a'
ptxas info    : Function properties for a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 34 registers, used 1 barriers
ptxas info    : Compiling entry function 'b' for 'sm_100a'
ptxas info    : Function properties for b
    40 bytes stack frame, 28 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers"""
    r = aot.parse_ptxas(text)
    assert r["a"] == dict(stack=0, spill_stores=0, spill_loads=0, registers=34)
    assert r["b"] == dict(stack=40, spill_stores=28, spill_loads=36, registers=255)
    t = aot.parse_thunks(
        "000: kKernel [source] loop_add_fusion grid: [4, 1, 1] threads: [128, 1, 1]\n"
        "001: kCustomKernel [source | sink] quantize_nvfp4_axis0 grid: [128, 128, 1] "
        "threads: [128, 1, 1]  shared_memory: 2048 bytes\n"
        "002: kGemm cublas ...\n")
    assert [(d["name"], d["grid"], d["shared_memory"]) for d in t] == [
        ("loop_add_fusion", (4, 1, 1), 0), ("quantize_nvfp4_axis0", (128, 128, 1), 2048)]


# --------------------------------------------------------------------------------------------
# Rooflines: sizes written out by hand

H200 = roofline.H200


def test_quantize_roofline_counts_input_codes_scales_and_nvfp4s_second_read():
    n = 8192 * 8192
    mx = roofline.quantize_roofline((8192, 8192), "mxfp4", -1)
    assert mx.bytes == 2 * n + n // 2 + n // 32  # bf16 in, 4-bit codes, a byte per 32
    nv = roofline.quantize_roofline((8192, 8192), "nvfp4", 0)
    assert nv.bytes == 2 * (2 * n) + n // 2 + n // 16 + 4  # amax pass, codes, E4M3, tensor
    tb = roofline.quantize_roofline((8192, 8192), "nvfp4", 0, tensor_block=128)
    assert tb.bytes == 2 * n + n // 2 + n // 16 + 4 * (n // 128)  # one read, outer scales
    assert mx.bound == "memory" and mx.seconds == pytest.approx(mx.bytes / 4.8e12)


def test_matmul_roofline_is_compute_bound_at_prefill_and_bytes_bound_at_decode():
    m = k = n = 8192
    pre = roofline.matmul_roofline(m, k, n, "mxfp4", "mxfp4")
    bf = roofline.bf16_gemm_roofline(m, k, n)
    assert pre.bound == bf.bound == "compute"
    assert pre.seconds == pytest.approx(2 * m * n * k / 989e12)
    assert bf.seconds / pre.seconds == pytest.approx(1.0)  # BF16 MMA either way on Hopper
    m = 16
    dec = roofline.matmul_roofline(m, k, n, "mxfp4", "mxfp4")
    q = (m * k + k * n) * (1 / 2 + 1 / 32)  # codes and scales of both operands
    assert dec.bytes == q + 2 * m * n and dec.bound == "memory"
    speedup = roofline.bf16_gemm_roofline(m, k, n).seconds / dec.seconds
    assert speedup == pytest.approx(2 * (m * k + k * n + m * n) / (q + 2 * m * n))
    assert 3.5 < speedup < 3.9


def test_sequential_kernels_add_their_bounds():
    a, b = roofline.roof(4.8e6, 0, 1.0), roofline.roof(0, 989e9, 989e12)
    s = a + b
    assert (s.bytes, s.flops, s.bound) == (4_800_000, 989_000_000_000, "mixed")
    assert s.seconds == pytest.approx(1e-6 + 1e-3)


def test_readme_roofline_table_is_the_one_gpu_check_prints():
    readme = (ROOT / "README.md").read_text()
    table = gpu_check.roofline_table()
    assert table in readme, "README's roofline table is stale: paste gpu_check --roofline"
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    n = len(gpu_check.quantize_cases()) + len(gpu_check.matmul_cases()) + len(
        gpu_check.gemm_cases())
    assert len(rows) == n
    assert all(re.search(r"\| (memory|compute|mixed) \|", r) for r in rows)


def test_mosaic_rooflines_count_packed_operands_at_the_native_peaks():
    m = k = n = 8192
    fp4 = m * k // 2 + m * k // 32  # codes + one E8M0 byte per 32
    bw = roofline.blackwell_matmul_roofline(m, k, n, "mxfp4")
    assert bw.bytes == 2 * fp4 + 4 * m * n and bw.flops == 2 * m * n * k
    assert bw.bound == "compute" and bw.seconds == pytest.approx(2 * m * n * k / 9000e12)
    fp8 = roofline.blackwell_matmul_roofline(m, k, n, "mxfp8_e4m3")
    assert fp8.seconds == pytest.approx(2 * m * n * k / 4500e12)  # FP8's peak, not FP4's
    hop = roofline.hopper_matmul_roofline(m, k, n, "nvfp4")  # blocks of 16 padded to 32
    assert hop.flops == 2 * m * n * (2 * k)  # packed FP4: half a byte a code of the padded K
    assert hop.bytes == 2 * (m * 2 * k // 2) + 4 * 2 * m * (2 * k // 32) + 4 * m * n
    fp6 = roofline.hopper_matmul_roofline(m, k, n, "mxfp6_e2m3")  # decoded to a byte a code
    assert fp6.bytes == 2 * m * k + 4 * 2 * m * (k // 32) + 4 * m * n
    with pytest.raises(ValueError, match="no native rate for mxfp4"):
        roofline.blackwell_matmul_roofline(m, k, n, "mxfp4", device=roofline.H200)


def test_readme_mosaic_roofline_table_is_the_one_gpu_check_prints():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert gpu_check.mosaic_roofline_table() in readme, "README's Mosaic roofline table is stale"
