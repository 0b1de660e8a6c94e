"""Smoke tests of pallas_kernels/gpu_check.py's code paths on CPU, on tiny shapes.

The GPU mode cannot run here; with the shapes and case lists patched down it still executes
end to end (every ``implementation="pallas"`` call falls back to the XLA reference with a
warning), so a typo in the script shows up before it reaches a GPU. The dry run (CUDA export
plus interpret-mode checks) runs on one format; the full dry run is
``python -m pallas_kernels.gpu_check --dry-run``.
"""

from __future__ import annotations

import doctest
import functools
import importlib

import pytest

from pallas_kernels import _common, gpu_check
from pallas_kernels.grouped_matmul import check as grouped_check

cpu_only = pytest.mark.skipif(
    _common.on_gpu(), reason="checks the fallback on a machine without a GPU"
)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(gpu_check, "PREFILL", (64, 128, 64))
    monkeypatch.setattr(gpu_check, "DECODE", (16, 128, 64))
    monkeypatch.setattr(gpu_check, "FORMATS", ["nvfp4"])
    monkeypatch.setattr(gpu_check, "HADAMARD_CASES", [("mxfp4", "stochastic", 32, 0.75)])
    monkeypatch.setattr(gpu_check, "MATMUL_PAIRS", [(None, "mxfp6_e2m3")])
    monkeypatch.setattr(gpu_check, "GEMM", (32, 64, 32))
    monkeypatch.setattr(gpu_check, "GEMM_RECIPES", ["nvfp4"])  # its wgrad (dgrad: 16x16 tiles)
    monkeypatch.setattr(grouped_check, "PAIRS", [("nvfp4", "nvfp4")])
    monkeypatch.setattr(grouped_check, "SHAPE", (4, 16, 128, 64, 3))
    fast = functools.partial(_common.time_fn, batches=1, calls=1, warmup=1)
    monkeypatch.setattr(gpu_check, "time_fn", fast)


@pytest.mark.filterwarnings("ignore:.*falling back to the XLA reference")
def test_gpu_mode_runs_end_to_end(tiny, capsys):
    assert gpu_check.run_gpu(budget_s=600) == 0
    out = capsys.readouterr().out
    assert "0 failed, 0 skipped" in out and "bit-exact" in out and "speed-up" in out
    assert "grouped nvfp4      x nvfp4      tiles=4x16 K=128 N=64 G=3: ok" in out
    assert out.count("quantized_gemm nvfp4") == 1 and "XLA emulation" in out


def test_dry_run(tiny, capsys):
    assert gpu_check.run_dry() == 0
    out = capsys.readouterr().out
    # 4 quantize (2 axes x 2 roundings) + 1 decode-shape quantize + 2 fused Hadamard and gain
    # (2 axes) + 1 pair x 2 GEMM shapes + 1 grouped pair + nvfp4's weight-gradient GEMM end to
    # end, and the 2026 NVFP4 options: Four Over Six and two double-block cases on 2 axes,
    # MS-EDEN along the axis its Hadamard of 128 divides in the small shapes
    assert out.count("lowers for CUDA") == 18 and "0 failed" in out
    assert out.count("grouped nvfp4") == 1
    assert out.count("scale_mode=4over6") == 2 and out.count("tensor_block=128") == 4
    assert out.count(" eden ") == 1
    assert out.count("quantized_gemm nvfp4") == 1
    assert out.count("hadamard=32 prescale=0.75") == 2


@cpu_only
def test_without_gpu_main_asks_for_dry_run(capsys):
    assert gpu_check.main([]) == 2
    assert "--dry-run" in capsys.readouterr().out


@pytest.mark.parametrize(
    "module",
    [
        "pallas_kernels.quantize.api",
        "pallas_kernels.quantize.config",
        "pallas_kernels.block_scaled_matmul.api",
        "pallas_kernels.block_scaled_matmul.config",
    ],
)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
