"""What a new user hits (issue 29), one test per point fixed: ``--resume`` of a run that does
not exist says so; CLI mistakes exit 1 with one line; progress in a piped log is plain lines;
the package metadata installs without setuptools' deprecation."""

from __future__ import annotations

import io
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from experiments import trainer
from experiments.config import RunConfig
from experiments.configlib import ConfigError
from experiments.metrics import LineProgress, NoBar, progress_bar
from tests.test_train import corpus, tiny  # noqa: F401 (corpus: a fixture)

ROOT = Path(__file__).resolve().parents[1]


def test_resume_of_a_run_that_does_not_exist_says_it_starts_from_scratch(
        tmp_path, corpus):  # noqa: F811
    said = []
    cfg = RunConfig.from_config(tiny(tmp_path, corpus, steps=4, warmup_steps=1, eval_every=0,
                                     checkpoint_every=0))
    trainer.train(cfg, resume=True, log=said.append)
    assert any("--resume: no checkpoint under" in s and "from step 0" in s for s in said), said
    said.clear()
    trainer.train(cfg, resume=True, log=said.append)  # now it has one: resumed, not restarted
    assert not any("no checkpoint" in s for s in said) and any("resumed" in s for s in said)


def test_progress_in_a_pipe_is_plain_lines_without_carriage_returns():
    out = io.StringIO()  # not a terminal
    bar = progress_bar(True, 0, 40, "gpt-tiny/mxfp4-s0", stream=out)
    assert isinstance(bar, LineProgress)
    with bar:
        for s in range(40):
            bar.set_postfix(loss=f"{1 / (s + 1):.3f}")
            bar.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 20 and lines[-1] == "gpt-tiny/mxfp4-s0: step 40/40 loss=0.025"
    assert isinstance(progress_bar(False, 0, 40, "x"), NoBar)


def test_license_is_an_spdx_string():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # not the deprecated { text = ... }
    assert any(r.startswith("setuptools>=") and int(r.split(">=")[1].split(".")[0]) >= 77
               for r in meta["build-system"]["requires"])


@pytest.mark.parametrize("args,said", [
    (["--config", "configs/gpt.py:size=tinyy"], "config argument size='tinyy': expected one of"),
    (["--config", "configs/gpt.py:recpie=mxfp4"], "config argument 'recpie': unknown"),
    (["--config", "configs/gpt.py:size=tiny", "--config.train.stesp=50"],
     "unknown config field 'stesp': Did you mean \"steps\""),
])
def test_cli_mistakes_exit_1_with_one_line(args, said):
    res = subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and len(err) == 1, res.stderr[-2000:]
    assert err[0].startswith("error: ") and said in err[0], err


def test_axis_that_is_not_an_int_names_what_axis_must_be():
    import jax.numpy as jnp

    import lowbit as lb

    with pytest.raises(TypeError, match=r"axis must be an int or a tuple of ints.*'last'"):
        lb.quantize(jnp.ones((4, 64)), "mxfp4", axis="last")
    with pytest.raises(TypeError, match="axis must be an int or a tuple of ints"):
        lb.quantize(jnp.ones((4, 64)), "mxfp4", axis=(0.5,))


def test_readme_says_how_to_run_the_notebooks_with_a_command_the_venv_has():
    readme = (ROOT / "README.md").read_text()
    assert "jupyter execute --inplace notebooks/01_formats.ipynb" in readme
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert nb.stem in readme, f"README's notebook section does not name {nb.name}"
    res = subprocess.run([sys.executable, "-m", "jupyter", "execute", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--inplace" in res.stdout + res.stderr


def test_demo_figure_ticks_do_not_overlap_and_the_gap_panel_draws_the_noise_band():
    import numpy as np

    from experiments import compare

    x = np.linspace(0, 13_107_200, 400)  # the demo's token counts: 3,208 steps x 4,096

    def result(name, shift):
        curve = (x, 2.0 + shift + np.exp(-x / 2e6))
        return compare.RecipeResult(name, [0], [1.8 + shift], [0.1], [curve], [curve], 1)

    results = {"none": result("none", 0.0), "mxfp4": result("mxfp4", 0.05)}
    fig = compare.curves_figure(results, noise_pct=0.9)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()
                 if t.get_visible() and t.get_text()]
        assert len(boxes) >= 3
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:], strict=False)), [
            t.get_text() for t in ax.get_xticklabels()]
        assert all(t.get_text().endswith(("M", "k", "0")) for t in ax.get_xticklabels()
                   if t.get_text())
    gap = fig.axes[2]
    band = [p for p in gap.patches if "seed noise" in str(p.get_label())]
    assert len(band) == 1
    y0, y1 = band[0].get_extents().y0, band[0].get_extents().y1
    assert y1 > y0  # drawn, with height


def test_a_damaged_newest_checkpoint_falls_back_to_an_older_one_and_is_kept(
        tmp_path, corpus):  # noqa: F811
    import json

    c = tiny(tmp_path, corpus, steps=6, warmup_steps=1, eval_every=0, checkpoint_every=2,
             keep_checkpoints=3, stop_at=4)
    cfg = RunConfig.from_config(c)
    trainer.train(cfg, log=lambda *_: None)  # checkpoints 2 and 4, then stopped
    ckpt = cfg.run_dir / "checkpoints"
    (ckpt / "4" / "data" / "metadata").write_text("{ not json")  # damaged
    c.train.stop_at = 0
    said = []
    result = trainer.train(RunConfig.from_config(c), resume=True, log=said.append)
    assert any("checkpoint step 4 does not read" in s and "resuming from step 2" in s
               for s in said), said
    assert (ckpt / "4.damaged" / "data" / "metadata").read_text() == "{ not json"  # kept
    assert result.step == 6 and (ckpt / "6").exists()
    steps = [json.loads(ln)["step"] for ln in (cfg.run_dir / "metrics.jsonl").read_text()
             .splitlines() if json.loads(ln)["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 6  # steps 3, 4 retrained once


def test_when_no_checkpoint_reads_resume_stops_with_one_line_naming_the_directory(
        tmp_path, corpus):  # noqa: F811
    c = tiny(tmp_path, corpus, steps=4, warmup_steps=1, eval_every=0, checkpoint_every=2,
             stop_at=2)
    cfg = RunConfig.from_config(c)
    trainer.train(cfg, log=lambda *_: None)
    (cfg.run_dir / "checkpoints" / "2" / "data" / "metadata").write_text("{ not json")
    c.train.stop_at = 0
    with pytest.raises(ConfigError, match=r"no checkpoint in .*checkpoints reads \(step 2: "):
        trainer.train(RunConfig.from_config(c), resume=True, log=lambda *_: None)
    assert (cfg.run_dir / "checkpoints" / "2").exists()  # not renamed, not deleted


def test_heuristic_rules_print_recipe_names():
    from flax import nnx

    import lowbit as lb
    from lowbit import autoquant as aq

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.attn_proj = nnx.Linear(8, 8, rngs=rngs)
            self.mlp = nnx.Linear(8, 8, rngs=rngs)

    rules = aq.heuristic(Net(nnx.Rngs(0)), "all", low="nvfp4")
    assert repr(rules) == "[('attn_proj', 'nvfp4'), ('mlp', 'nvfp4')]"
    custom = lb.recipes.get("nvfp4").replace(name="mine")
    assert aq.heuristic(Net(nnx.Rngs(0)), "all", low=custom)[0][1] is custom  # kept as given


def test_padding_is_documented_and_warned_once_per_format_length_and_block():
    import warnings

    import jax
    import jax.numpy as jnp

    import lowbit as lb
    from lowbit.core.plan import PaddingWarning

    for fn in (lb.quantize, lb.fake_quantize):
        assert "zero-padded" in fn.__doc__ and "PaddingWarning" in fn.__doc__
    x = jnp.ones((3, 3001))  # lengths no other test uses: the warning is once per process
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        q = lb.quantize(x, "mxfp4")
        step = jax.jit(lambda x: lb.fake_quantize(x, "mxfp4"))
        for _ in range(3):  # a training loop: traced again for a new dtype, same case
            step(x), step(x.astype(jnp.bfloat16)), lb.dequantize(q)
        lb.fake_quantize(x, "mxfp4", block_shape=(64,))  # another block: said again
        lb.fake_quantize(jnp.ones((3001, 3)), "nvfp4", axis=0)  # another format
    said = [w for w in seen if issubclass(w.category, PaddingWarning)]
    assert len(said) == 3, [str(w.message) for w in said]
    msg = str(said[0].message)
    assert "mxfp4" in msg and "length 3001" in msg and "block size 32" in msg
    assert "zero-padded to 3008" in msg and "never change a block's scale" in msg
    assert said[0].filename == __file__  # points at the caller, not into lowbit
    assert "block size 64" in str(said[1].message) and "nvfp4" in str(said[2].message)
    assert q.shape == (3, 3001) and q.scales.shape == (3, 94)  # the QArray keeps x's shape
    assert lb.dequantize(q).shape == (3, 3001)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # padding to a block multiple: nothing to say
        lb.quantize(jnp.ones((3, 64)), "mxfp4")


def test_block_shapes_that_cannot_pack_or_are_not_ints_name_what_is_accepted():
    """Other blocks than the specification's are a documented research option (see
    ``lowbit.core.plan.check_block_shape``); what cannot be stored is refused by name."""
    import jax.numpy as jnp

    import lowbit as lb

    x = jnp.ones((96, 96))
    for fn in (lb.quantize, lb.fake_quantize):
        with pytest.raises(ValueError, match=r"block_shape=\(33,\): the last block extent must "
                                             r"be a multiple of 2 to pack"):
            fn(x, "mxfp4", -1, block_shape=(33,))
    with pytest.raises(ValueError, match=r"block_shape must be None, \(b,\) or \(b0, b1\) "
                                         r"with positive int entries, got 32\.0"):
        lb.quantize(x, "mxfp4", block_shape=32.0)
    with pytest.raises(ValueError, match=r"positive int entries, got \(0,\)"):
        lb.quantize(x, "mxfp4", block_shape=(0,))
    from lowbit.core import plan
    assert "research option" in plan.check_block_shape.__doc__


@pytest.mark.parametrize("fmt,block_shape", [
    ("mxfp4", (16,)), ("mxfp4", (64,)), ("mxfp6", (8,)), ("nvfp4", (16, 16)), ("mxint8", (32, 8)),
    ("mxfp4", (24,)), ("mxfp8", (48,)),
])
def test_other_blocks_are_accepted(fmt, block_shape):
    import jax.numpy as jnp

    import lowbit as lb

    axis = (0, 1) if len(block_shape) == 2 else -1
    q = lb.quantize(jnp.ones((64, 64)), fmt, axis, block_shape=block_shape)
    assert q.block_shape == block_shape
