"""experiments/ptq_vs_qat.py end to end on a tiny digits model: PTQ rows, QAT from the float
checkpoint, the written table, JSON and chart."""

from __future__ import annotations

import json

import pytest

from configs import ptq_vs_qat as study_config
from experiments import ptq_vs_qat
from experiments.configlib import ConfigError


def _quiet(*_):
    pass


def test_a_tiny_study_and_qat_recovers_what_ptq_lost(tmp_path):
    c = study_config.get_config("family=digits,size=tiny")
    c.workdir = c.base.workdir = str(tmp_path)
    c.base.train.steps, c.base.train.eval_every, c.base.train.progress = 30, 0, False
    c.formats, c.methods = "mxfp4,w4a16_nvfp4", "max"
    # smoothing, SVDQuant and GPTQ are pinned by tests/test_ptq*.py; here the study's plumbing
    c.smooth, c.svd_rank, c.qat_steps, c.float_control = False, 0, 10, False
    c.lock()  # as the CLI's config is: the fine-tunes' configs may set only declared fields
    result = ptq_vs_qat.run_study(c, log=_quiet)
    rows = {r["row"]: r for r in result["rows"] if r["format"] == "mxfp4"}
    assert list(rows) == ["cast", "cal-max", "cal-mse+w-mse", "gptq", "mr-gptq", "qat", "qad"]
    nv = [r["row"] for r in result["rows"] if r["format"] == "w4a16_nvfp4"]
    assert nv == ["cast", "w-mse", "gptq", "mr-gptq", "gptq+4over6", "qat", "qad"]
    # GPTQ packs the same bits; MR-GPTQ adds its rotation's signs, 32 float32s per MXFP4 site
    # (0.08 bit per weight on this tiny model's few weights)
    assert rows["gptq"]["bits_weights"] == 4.25 < rows["mr-gptq"]["bits_weights"] < 4.4
    assert result["float"]["val_loss"] > 0 and 0 <= result["float"]["val_accuracy"] <= 1
    # the PTQ'd model loses to float; QAT from the same float checkpoint lowers its loss
    assert rows["cast"]["val_loss"] > result["float"]["val_loss"]
    assert rows["qat"]["val_loss"] < rows["cast"]["val_loss"]
    assert rows["cast"]["bits_weights"] == rows["qat"]["bits_weights"] == 4.25
    js, md, png = ptq_vs_qat.write(result, tmp_path / "out", "cmd")
    back = json.loads(js.read_text())
    assert [r["row"] for r in back["rows"]] == [r["row"] for r in result["rows"]]
    assert md.read_text().count("| mxfp4 |") == 7 and png.stat().st_size > 0


def test_unknown_format_and_method_are_named():
    c = study_config.get_config("family=digits,size=tiny")
    c.formats = "mxfp3"
    with pytest.raises(ConfigError, match="unknown format 'mxfp3'"):
        ptq_vs_qat.run_study(c, log=_quiet)
    c.formats, c.methods = "mxfp4", "median"
    with pytest.raises(ConfigError, match="unknown method 'median'"):
        ptq_vs_qat.run_study(c, log=_quiet)
    with pytest.raises(ValueError, match="family='bert'"):
        study_config.get_config("family=bert")
