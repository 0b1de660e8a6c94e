"""What a trained float model loses under post-training quantization, and what calibration,
smoothing, SVDQuant and a short QAT give back.

    python -m experiments.ptq_vs_qat --config configs/ptq_vs_qat.py:family=gpt,size=xs
    python -m experiments.ptq_vs_qat --config configs/ptq_vs_qat.py:family=digits,size=s

For the float baseline of ``config.base`` (trained here, or reused when it finished with the same
config: an ordinary run, ``runs/<group>/none-s<seed>/``), and for each of ``config.formats``:

=================  ==========================================================================
row                what it is
=================  ==========================================================================
``cast``           direct cast: weights packed with standard scales, activations with their
                   dynamic scales (``lowbit.ptq.quantize`` without calibration)
``cal-<method>``   activations with the static amax of each calibration method (NVFP4: the
                   tensor scale; MX: a clip before the dynamic block scales)
``cal-mse+w-mse``  the ``mse`` calibration and MSE-searched weight block scales
``smooth``         SmoothQuant / AWQ smoothing (alpha searched per site), then ``mse``
                   calibration of the smoothed activations and MSE weight scales
``svdquant``       SVDQuant: smoothing and a rank-``svd_rank`` bf16 branch, the residual
                   quantized (calibrated and MSE-scaled as above)
``gptq``           GPTQ weights (``lb.calibrate.gptq`` from each site's recorded input
                   Hessian) with the ``mse`` calibration (``config.gptq``)
``mr-gptq``        MR-GPTQ: the same in a block-wise Hadamard-rotated basis (``ptq.rotation``,
                   calibrated rotated) with FP-Quant's scale search (``config.gptq``)
``gptq+4over6``    NVFP4 formats: GPTQ with Four Over Six weight block scales (``config.gptq``)
``qad``            the QAT fine-tune distilled from the float checkpoint (``config.qad``:
                   ``train.distill_from``, ``experiments/distill.py``), then packed
``qat``            the float checkpoint fine-tuned ``qat_steps`` under the format's
                   ``qat_<format>`` (or ``w4a16_*``) recipe (``init_from``), then packed
=================  ==========================================================================

Weight-only formats have no activation quantizer: their ``cal-*`` rows equal ``cast`` and are
left out. With ``float_control`` the float model is fine-tuned the same ``qat_steps`` in float
(``float+ft``), the yardstick for QAT: what more training alone gives.

Every row is a packed model (``lowbit.ptq.quantize``) evaluated on the validation batches of
the float run (``experiments.runs.evaluate``): validation loss (and accuracy for digits),
the gap to float, and bits per parameter of the quantized weights (codes, scales, smoothing
vectors and low-rank branches) and of the whole model. Written to ``runs/<name>/``:
``ptq_vs_qat.json``, ``ptq_vs_qat.md`` and ``ptq_vs_qat.png`` (the gap per format and row).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import lowbit as lb
import lowbit.ptq as ptq
from experiments import compare, runs, studylib
from experiments.config import RunConfig, fine_tune_config, quant_rules, split_list
from experiments.configlib import ConfigError, parse_flags_or_exit

__all__ = ["FORMATS", "recipe_of", "run_study", "render_markdown", "plot", "main"]

# format -> the recipe whose forward the PTQ model runs (and the QAT fine-tune trains)
FORMATS = {
    "mxfp8": "qat_mxfp8",
    "mxfp6": "qat_mxfp6",
    "mxfp4": "qat_mxfp4",
    "nvfp4": "qat_nvfp4",
    "mxint8": "qat_mxint8",
    "w4a16_mxfp4": "w4a16_mxfp4",
    "w4a16_nvfp4": "w4a16_nvfp4",
}


def recipe_of(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ConfigError(
            f"config.formats: unknown format {fmt!r}; expected some of {list(FORMATS)}"
        )
    return FORMATS[fmt]


def _metrics(cfg, model, n_eval) -> dict:
    return runs.evaluate(cfg, model, max_batches=n_eval)


def run_study(c, *, log: Callable[[str], None] = print) -> dict:
    """Run the study of the ConfigDict ``c`` (``configs/ptq_vs_qat.py``); returns the results
    written to ``ptq_vs_qat.json``."""
    formats = split_list(c.formats)
    methods = split_list(c.methods)
    for f in formats:
        recipe_of(f)
    for m in methods:
        if m not in lb.calibrate.METHODS:
            raise ConfigError(
                f"config.methods: unknown method {m!r}; expected some of {lb.calibrate.METHODS}"
            )
    base = c.base
    base_cfg = RunConfig.from_config(base)
    out_dir = Path(c.workdir) / c.name
    out_dir.mkdir(parents=True, exist_ok=True)
    group = compare.group_of(base_cfg.name)
    t0 = time.perf_counter()
    float_dir = runs.train_or_reuse(base_cfg, log)
    cfg, model = runs.load_trained(float_dir)
    n_eval = int(c.eval_batches) or None
    float_m = _metrics(cfg, model, n_eval)
    log(f"float: {float_m}")
    batches = runs.calibration_batches(cfg, int(c.calib_batches))
    metric = "val_accuracy" if "val_accuracy" in float_m else "val_loss"

    rows: list[dict] = []

    def add(fmt: str, row: str, served, extra=None):
        m = _metrics(cfg, served, n_eval)
        bits = ptq.bits_per_param(served)
        rec = {
            "format": fmt,
            "row": row,
            **m,
            "gap_pct": 100.0 * (m["val_loss"] - float_m["val_loss"]) / float_m["val_loss"],
            "bits_weights": bits["weights"],
            "bits_model": bits["model"],
            **(extra or {}),
        }
        if "val_accuracy" in m:
            rec["acc_drop"] = float_m["val_accuracy"] - m["val_accuracy"]
        rows.append(rec)
        log(f"{fmt:12s} {row:14s} val_loss {m['val_loss']:.4f} ({rec['gap_pct']:+.2f}%)"
            + (f" acc {m['val_accuracy']:.4f}" if "val_accuracy" in m else "")
            + f" bits {bits['weights']:.3f}")

    for fmt in formats:
        recipe = recipe_of(fmt)
        rules = quant_rules(dataclasses.replace(cfg.quant, recipe=recipe))
        weight_only = fmt.startswith("w4a16_")
        add(fmt, "cast", ptq.quantize(model, rules))
        cal = ptq.calibrate(model, rules, batches, "mse", percentile=float(c.percentile))
        if not weight_only:
            for m in methods:
                add(fmt, f"cal-{m}", ptq.quantize(model, rules, cal.with_method(m)),
                    {"amax": cal.with_method(m).amax})
        add(fmt, "cal-mse+w-mse" if not weight_only else "w-mse",
            ptq.quantize(model, rules, cal, weights="mse"))
        if c.smooth:
            sm = ptq.smooth(model, rules, batches)
            cal_s = ptq.calibrate(model, rules, batches, "mse", smoothing=sm)
            add(fmt, "smooth", ptq.quantize(model, rules, cal_s, weights="mse", smoothing=sm),
                {"alpha": sm.alpha})
        if int(c.svd_rank) > 0:
            sv = ptq.svdquant(model, rules, batches, rank=int(c.svd_rank),
                              iterations=int(c.svd_iterations), smoothing=True)
            cal_v = ptq.calibrate(model, rules, batches, "mse", smoothing=sv)
            add(fmt, "svdquant", ptq.quantize(model, rules, cal_v, weights="mse", smoothing=sv),
                {"alpha": sv.alpha, "rank": sv.rank})
        if c.get("gptq", False):
            _gptq_rows(model, rules, batches, c, fmt, add)
        if int(c.qat_steps) > 0:
            qc = fine_tune_config(
                base, recipe=recipe, name=f"{group}/qat-{recipe}-s{cfg.seed}",
                steps=int(c.qat_steps), lr=float(c.qat_lr), init_from=str(float_dir))
            qdir = runs.train_or_reuse(RunConfig.from_config(qc), log)
            _, qmodel = runs.load_trained(qdir)
            add(fmt, "qat", ptq.quantize(qmodel, rules), {"qat_steps": int(c.qat_steps)})
            _qad_row(base, recipe, group, cfg, float_dir, c, rules, add, log)
    control = None
    if c.float_control and int(c.qat_steps) > 0:
        fc = fine_tune_config(
            base, recipe="none", name=f"{group}/float-ft-s{cfg.seed}",
            steps=int(c.qat_steps), lr=float(c.qat_lr), init_from=str(float_dir))
        fdir = runs.train_or_reuse(RunConfig.from_config(fc), log)
        _, fmodel = runs.load_trained(fdir)
        control = _metrics(cfg, fmodel, n_eval)
        log(f"float+ft: {control}")
    result = {
        "name": c.name,
        "float_run": str(float_dir),
        "float": float_m,
        "float_ft": control,
        "metric": metric,
        "rows": rows,
        "config": c.to_dict() if hasattr(c, "to_dict") else dict(c),
        "seconds": time.perf_counter() - t0,
    }
    return result


def _qad_row(base, recipe, group, cfg, float_dir, c, rules, add, log) -> None:
    """``qad``: the QAT fine-tune with the float checkpoint as its distillation teacher
    (``train.distill_from``, the KL term alone), then packed (``config.qad``; else none)."""
    if not c.get("qad", False):
        return
    qc = fine_tune_config(
        base, recipe=recipe, name=f"{group}/qad-{recipe}-s{cfg.seed}",
        steps=int(c.qat_steps), lr=float(c.qat_lr), init_from=str(float_dir))
    qc.train.distill_from = str(float_dir)
    _, qmodel = runs.load_trained(runs.train_or_reuse(RunConfig.from_config(qc), log))
    add(fmt_of(recipe), "qad", ptq.quantize(qmodel, rules), {"qat_steps": int(c.qat_steps)})


def fmt_of(recipe: str) -> str:
    """The format a recipe of :data:`FORMATS` stands for."""
    return next(f for f, r in FORMATS.items() if r == recipe)


def four_over_six_weights(recipe) -> lb.Recipe:
    """``recipe`` with Four Over Six block scales for its NVFP4 forward weight (the
    activation as it was)."""
    r = lb.recipes.get(recipe)
    rhs = dataclasses.replace(r.fwd.rhs, scale_mode="4over6")
    return r.replace(name=f"{r.name}+w4over6", fwd=dataclasses.replace(r.fwd, rhs=rhs))


def _gptq_rows(model, rules, batches, c, fmt: str, add) -> None:
    """The GPTQ rows of one format: ``gptq`` (``mse`` calibration, GPTQ weights), ``mr-gptq``
    (the same under MR-GPTQ's block-wise Hadamard rotation, calibrated rotated) and, for the
    NVFP4 formats, ``gptq+4over6`` (GPTQ with Four Over Six weight scales)."""
    p = float(c.percentile)
    cal = ptq.calibrate(model, rules, batches, "mse", percentile=p, hessians=True)
    add(fmt, "gptq", ptq.quantize(model, rules, cal, weights="gptq"))
    rot = ptq.rotation(model, rules)
    cal_r = ptq.calibrate(model, rules, batches, "mse", percentile=p, hessians=True,
                          smoothing=rot)
    add(fmt, "mr-gptq", ptq.quantize(model, rules, cal_r, weights="mr-gptq", smoothing=rot))
    if "nvfp4" in fmt:
        rules46 = [(pat, four_over_six_weights(r) if r != "none" else r) for pat, r in rules]
        cal46 = ptq.calibrate(model, rules46, batches, "mse", percentile=p, hessians=True)
        add(fmt, "gptq+4over6", ptq.quantize(model, rules46, cal46, weights="gptq"))


def render_markdown(result: dict, command: str = "") -> str:
    """The table: one line per (format, row); the float model and its fine-tuned control."""
    fl = result["float"]
    acc = "val_accuracy" in fl
    lines = [f"# {result['name']}: post-training quantization against QAT", ""]
    if command:
        lines += ["```", command, "```", ""]
    head = "| format | row | val loss | gap to float | " + ("val acc | " if acc else "")
    head += "bits/weight | bits/param (model) |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    lines.append(f"| float | - | {fl['val_loss']:.4f} | - | "
                 + (f"{fl['val_accuracy']:.4f} | " if acc else "") + "32 | 32 |")
    if result.get("float_ft"):
        ft = result["float_ft"]
        gap = 100 * (ft["val_loss"] - fl["val_loss"]) / fl["val_loss"]
        lines.append(
            f"| float+ft | float fine-tuned like QAT | {ft['val_loss']:.4f} | {gap:+.2f}% | "
            + (f"{ft['val_accuracy']:.4f} | " if acc else "") + "32 | 32 |"
        )
    for r in result["rows"]:
        lines.append(
            f"| {r['format']} | {r['row']} | {r['val_loss']:.4f} | {r['gap_pct']:+.2f}% | "
            + (f"{r['val_accuracy']:.4f} | " if acc else "")
            + f"{r['bits_weights']:.3f} | {r['bits_model']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> Path:
    """Grouped bars: the validation-loss gap to float (%) per format, one bar per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    formats = list(dict.fromkeys(r["format"] for r in rows))
    kinds = list(dict.fromkeys(r["row"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(formats)), 4))
    width = 0.8 / max(1, len(kinds))
    for j, k in enumerate(kinds):
        xs, ys = [], []
        for i, f in enumerate(formats):
            v = [r["gap_pct"] for r in rows if r["format"] == f and r["row"] == k]
            if v:
                xs.append(i + (j - (len(kinds) - 1) / 2) * width)
                ys.append(v[0])
        ax.bar(xs, ys, width, label=k)
    if result.get("float_ft"):
        fl, ft = result["float"]["val_loss"], result["float_ft"]["val_loss"]
        ax.axhline(100 * (ft - fl) / fl, color="k", ls="--", lw=1, label="float+ft")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(formats)), formats)
    ax.set_ylabel("validation loss gap to float (%)")
    ax.set_title(f"{result['name']}: PTQ and QAT")
    ax.legend(fontsize=7, ncol=2)
    return studylib.save_figure(fig, path)


def write(result: dict, out_dir, command: str = "") -> tuple[Path, Path, Path]:
    """``ptq_vs_qat.json``, ``ptq_vs_qat.md`` and ``ptq_vs_qat.png`` under ``out_dir``."""
    return studylib.write(result, out_dir, "ptq_vs_qat", render_markdown, plot, command)


def main(argv: list[str]) -> None:
    studylib.main(argv, _CONFIG.value, "experiments.ptq_vs_qat", run_study, write)


if __name__ == "__main__":
    from absl import app
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "configs/ptq_vs_qat.py:...")
    app.run(main, flags_parser=parse_flags_or_exit)
