"""Notebooks run end to end on tiny inputs and are committed without outputs; the format demo
reports one sensible row per format.

Each ``notebooks/*.ipynb`` must have a first code cell tagged ``parameters`` (problem sizes);
the test injects :data:`SMALL_PARAMETERS` right after it, as papermill does, and runs the
notebook in a fresh kernel of *this* interpreter (a kernelspec written to a temporary folder,
so no ``jupyter kernelspec install`` is needed and a user-level ``python3`` kernel pointing at
another Python is never picked up), with matplotlib's Agg backend, in a temporary working dir.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

import lowbit as lb  # noqa: E402
from experiments import format_demo  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL_NAME = "lowbit-test-python"
CELL_TIMEOUT_S = 120

# Injected after the "parameters" cell. Names a notebook does not use are harmless.
SMALL_PARAMETERS = """\
# Injected by tests/test_notebooks.py: tiny inputs, and the test suite's strict rank promotion.
N = 1 << 12
KEYS = 64
RUNS = "runs"  # 02_training_curves: no runs in the temporary folder, so it trains a tiny demo
DEMO_STEPS = 6
DEMO_RECIPES = ["none", "mxfp4"]  # the float baseline and one quantized run: every plot drawn
DEMO_MODEL = dict(d_model=32, layers=1, heads=2, seq_len=32)  # 02: the smallest GPT
BLOCKS = [16, 32, 256]  # 01: the block-size sweep's ends and the MX block
RULE_RECIPES = ["qat_mxfp8", "qat_nvfp4"]  # 03: two one-format rules
GRAD_KEYS = 2  # 03: two stochastic-rounding keys (the cell checks that they differ)
PTQ_STUDY_TINY = True  # 04_ptq_vs_qat: a tiny digits study, whatever runs/ holds
CALIB_BATCHES = 2
TINY_METHODS = "entropy"
HIST_SITES = 2
import pathlib, lowbit
DATA_PATH = str(pathlib.Path(lowbit.__file__).parents[1] / "README.md")
import jax
import matplotlib

jax.config.update("jax_numpy_rank_promotion", "raise")
assert matplotlib.get_backend().lower() == "agg", matplotlib.get_backend()
"""


def _kernel_manager(tmp_path: pathlib.Path) -> KernelManager:
    """A kernel manager that starts ``sys.executable -m ipykernel_launcher``."""
    spec_dir = tmp_path / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    pythonpath = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lowbit test kernel",
        "language": "python",
        "env": {"MPLBACKEND": "Agg", "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)


def _inject_parameters(nb) -> None:
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    assert code, "the notebook has no code cell"
    first = nb.cells[code[0]]
    assert "parameters" in first.metadata.get("tags", []), (
        "the first code cell must be tagged 'parameters' (problem sizes the test can shrink)"
    )
    injected = nbformat.v4.new_code_cell(SMALL_PARAMETERS)
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(code[0] + 1, injected)


def test_notebooks_found():
    assert NOTEBOOKS, f"no notebooks under {ROOT / 'notebooks'}"


# 04_ptq_vs_qat trains a tiny float model and its QAT fine-tune (~100 s of compiling on the
# 2-core CI machine, with an empty compile cache): `make test-slow` runs it; the study code it
# calls is tests/test_ptq_vs_qat.py's.
EXECUTED = [pytest.param(p, marks=pytest.mark.slow) if p.name.startswith("04_") else p
            for p in NOTEBOOKS]


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.name)
def test_notebook_executes(path: pathlib.Path, tmp_path: pathlib.Path):
    nb = nbformat.read(path, as_version=4)
    _inject_parameters(nb)
    workdir = tmp_path / "work"
    workdir.mkdir()
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,  # any cell error raises CellExecutionError
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "some code cells did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_stripped(path: pathlib.Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs or execution counts; strip them"


# ---------------------------------------------------------------------------------------------
# experiments/format_demo.py


@pytest.fixture(scope="module")
def weight():
    return format_demo.weight_like((128, 512), seed=0)


def test_weight_like_is_seeded_and_heavy_tailed(weight):
    np.testing.assert_array_equal(weight, format_demo.weight_like((128, 512), seed=0))
    assert weight.dtype == np.float32
    w = weight.astype(np.float64)
    assert np.sqrt(np.mean(w**2)) == pytest.approx(0.02, rel=1e-3)
    kurtosis = np.mean(w**4) / np.mean(w**2) ** 2
    assert kurtosis > 6.0  # a Gaussian has 3


def test_format_demo_one_row_per_format(weight):
    rows = format_demo.format_error_rows(weight)
    assert [r.format for r in rows] == lb.formats.names()
    n = weight.size
    for r in rows:
        fmt = lb.formats.get(r.format)
        assert r.bits_per_element == fmt.bits_per_element
        # Packed codes (whole packing groups per row of 512: five ternary codes a byte pad
        # the row to 515), the block scales' bytes, 4 bytes of float32 tensor scale.
        nrows, cols = weight.shape
        group, group_bytes = (5, 1) if r.format == "ternary" else {4: (2, 1), 6: (4, 3)}.get(
            fmt.elem.bits, (1, 1))
        expected = (nrows * -(-cols // group) * group_bytes + n // fmt.block_size * fmt.scale.bits
                    // 8 + (4 if fmt.tensor_scale else 0))
        assert r.qarray_bytes == expected, r
        assert r.float32_bytes == 4 * n
        assert r.rel_rms_error == pytest.approx(10 ** (-r.sqnr_db / 20), rel=1e-6)
        assert 0.0 < r.max_abs_error < np.abs(weight).max()
        if r.format == "ternary":  # three levels, the mean |w| as the step: a quarter clips
            assert 0.5 < r.sqnr_db < 3.0 and 0.15 < r.saturated < 0.4, r
            continue
        assert np.isfinite(r.sqnr_db) and r.sqnr_db > 10.0, r
        assert 0.0 <= r.saturated < 0.05, r
    by_name = {r.format: r for r in rows}
    # Under the OCP floor rule, E2M1 and E4M3 clip block maxima (E4M3 those in (448, 512)).
    assert by_name["mxfp4"].saturated > 0 and by_name["mxfp8_e4m3"].saturated > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_format_demo_sqnr_grows_with_bits(seed):
    """MXFP4 < MXFP6 < MXFP8 (the aliases: E2M1, E2M3, E4M3) on one weight-like tensor.

    Compared with scale_mode="rceil" (no element clips), where the error is element rounding
    only: on [128, 512] tensors, seeds 0-7, MXFP6 - MXFP4 measured 11.0-12.1 dB and
    MXFP8 - MXFP6 3.0-4.0 dB, so the margins below (8 and 2 dB) hold with room to spare.
    Under the OCP default "floor" rule, E4M3 clips block maxima in (448, 512) * 2**e (up to
    12.5 % error on the largest element of a block). That costs it 3-5 dB and puts MXFP8 level
    with MXFP6 (E2M3: the same 3 mantissa bits, and a clipping band half as wide); measured
    within 1.5 dB, with either one ahead depending on the seed. So under floor the 6 -> 8
    step is only checked as "level"; the notebook's block-size and scale-mode sections show why.
    """
    w = format_demo.weight_like((128, 512), seed=seed)
    names = ["mxfp4", "mxfp6", "mxfp8", "mxint8"]
    rceil = {r.format: r.sqnr_db for r in format_demo.format_error_rows(w, names, "rceil")}
    assert rceil["mxfp4"] + 8.0 < rceil["mxfp6"], rceil
    assert rceil["mxfp6"] + 2.0 < rceil["mxfp8"], rceil
    floor = {r.format: r.sqnr_db for r in format_demo.format_error_rows(w, names)}
    assert floor["mxfp4"] + 8.0 < floor["mxfp6"], floor
    assert floor["mxfp4"] + 8.0 < floor["mxfp8"], floor
    assert abs(floor["mxfp8"] - floor["mxfp6"]) < 2.0, floor
    assert floor["mxfp8"] < rceil["mxfp8"] - 1.0, (floor, rceil)
    # INT8 (7 magnitude bits, uniform) beats every 8-bit float on block-scaled Gaussian-ish data.
    assert floor["mxint8"] > floor["mxfp8"] + 4.0, floor


def test_format_demo_main_prints_table(capsys):
    format_demo.main(["--size", "64", "256"])
    out = capsys.readouterr().out
    for name in lb.formats.names():
        assert name in out
    assert "SQNR" in out and "saturated" in out
