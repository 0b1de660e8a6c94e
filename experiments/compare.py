"""Train one config under several recipes (and seeds), then plot and tabulate the comparison.

    python -m experiments.compare --config configs/gpt.py:size=tiny \
        --recipes none,mxfp8,mxfp6,mxfp4,nvfp4,quartet            # what `make demo` runs
    python -m experiments.compare --config configs/gpt.py:size=xs --seeds 0,1,2 \
        --recipes none,mxfp8,mxfp6,mxfp4,nvfp4,quartet
    python -m experiments.compare --config configs/digits.py:size=s --seeds 0,1,2 \
        --recipes none,mxfp8,mxfp6,mxfp4,nvfp4

Each (recipe, seed) is an ordinary run, ``runs/<group>/<recipe>-s<seed>/`` (``<group>`` is
the part of ``config.name`` before its slash), trained by :func:`experiments.trainer.train`
from the same initial parameters and batches for a given seed. A run that already finished with
the same config is reused (``--rerun`` trains it again). Results go to ``runs/<group>/compare/``:

* ``curves.png``: train loss (smoothed) and validation loss versus tokens, one line per recipe
  (mean over seeds, shaded min..max), and the validation-loss gap to ``none`` in % versus tokens;
* ``summary.md``: final validation loss (mean +- std over seeds), gap to ``none`` in % (the
  paired gap printed only where it stands out of seed noise, else "within noise": see
  :func:`gap_noise`; ``--noise_seeds 1,2`` trains extra ``none`` seeds to measure the noise
  floor a single-seed comparison is judged against), and the
  median step time as a ratio to ``none``'s (runs are timed one after another on the same
  machine, not interleaved, so small ratios are within the machine's noise); for a family
  whose runs record a validation accuracy (``configs/digits.py``), its mean too;
* ``summary.json``: the same numbers, for notebooks.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from experiments import distributed, metrics, runs, runsets, studylib
from experiments.config import RunConfig
from experiments.configlib import ConfigError, parse_flags_or_exit

__all__ = [
    "RecipeResult",
    "group_of",
    "run_all",
    "load_runs",
    "summarize",
    "noise_marked",
    "render_markdown",
    "plot_curves",
    "compare",
]

BASELINE = "none"


def group_of(name: str) -> str:
    """``"gpt-tiny/mxfp4-s0"`` -> ``"gpt-tiny"``."""
    return name.split("/", 1)[0]


def _variant(base, recipe: str, seed: int):
    c = copy.deepcopy(base)
    c.quant.recipe = recipe
    c.seed = seed
    c.name = f"{group_of(base.name)}/{recipe}-s{seed}"
    return c


def run_all(
    base,
    recipes: Sequence[str],
    seeds: Sequence[int],
    *,
    rerun: bool = False,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Train every (recipe, seed) variant of the ConfigDict ``base``, or reuse it
    (:func:`experiments.runs.train_or_reuse`); ``rerun``: delete each run first
    (:func:`experiments.runs.remove_run`). Returns their run dirs."""
    cfgs = [RunConfig.from_config(_variant(base, r, s)) for s in seeds for r in recipes]
    dirs = []
    for cfg in cfgs:  # all configs are validated (recipe names included) before any training
        if rerun:
            runs.remove_run(cfg.run_dir, workdir=cfg.workdir)
        try:
            dirs.append(runs.train_or_reuse(cfg, log=log))
        except ConfigError as e:
            raise ConfigError(f"{e}; pass --rerun to train {cfg.name} again") from e
    return dirs


@dataclasses.dataclass
class RecipeResult:
    recipe: str
    seeds: list[int]
    final_val: list[float]
    step_s: list[float]
    # per seed: (tokens, value) curves
    train: list[tuple[np.ndarray, np.ndarray]]
    val: list[tuple[np.ndarray, np.ndarray]]
    params: int
    final_accuracy: list[float] = dataclasses.field(default_factory=list)  # where recorded
    plan: dict | None = None  # a plan run's experiments.config.plan_identity (its bits, ...)
    quant_recipe: str = ""  # the config's quant.recipe (the key can be a plan's name, or longer)

    @property
    def val_mean(self) -> float:
        return statistics.fmean(self.final_val)

    @property
    def val_std(self) -> float:
        return statistics.stdev(self.final_val) if len(self.final_val) > 1 else 0.0


def load_runs(
    run_dirs: Sequence[str | Path], *, skipped: list[str] | None = None
) -> dict[str, RecipeResult]:
    """Read runs (config.json, metrics.jsonl, summary.json) into one result per experiment:
    the runs that differ in nothing but their seed (:func:`experiments.runsets.group_seeds`:
    not in length, data, recipe version, plan, ...), keyed by what they trained (the recipe,
    a plan's name, with the fields that tell apart two experiments of one recipe).
    ``skipped``: a list that receives the runs left out, with why (a second run of one
    experiment and seed)."""
    groups, left = runsets.group_seeds(runsets.read_run(d) for d in run_dirs)
    if skipped is not None:
        skipped += left
    out: dict[str, RecipeResult] = {}
    for g in groups:
        first = g.runs[0]
        res = out[g.label] = RecipeResult(
            g.label, [], [], [], [], [], first.summary["params"], plan=first.plan,
            quant_recipe=(first.config.get("quant") or {}).get("recipe", ""))
        for r in g.runs:
            _add_run(res, r)
    return out


def _add_run(res: RecipeResult, run: runsets.RunRecord) -> None:
    """Append one seed's numbers and curves to ``res``."""
    summary = run.summary
    recs = metrics.read_metrics(run.run_dir / "metrics.jsonl")
    tr = [r for r in recs if r["kind"] == "train"]
    ev = [r for r in recs if r["kind"] == "eval"]
    res.seeds.append(summary["seed"])
    res.final_val.append(summary["final_val_loss"])
    if summary.get("final_val_accuracy") is not None:
        res.final_accuracy.append(summary["final_val_accuracy"])
    if summary.get("step_s"):
        res.step_s.append(summary["step_s"])
    res.train.append((np.array([r["tokens"] for r in tr]), np.array([r["loss"] for r in tr])))
    res.val.append((np.array([r["tokens"] for r in ev]), np.array([r["val_loss"] for r in ev])))


CONFIDENCE = 0.95  # of the noise intervals below


def noise_floor(final_val: Sequence[float]) -> float | None:
    """The seed-to-seed spread of one recipe's final validation loss, in % of its mean
    (sample standard deviation); None with fewer than 2 seeds."""
    if len(final_val) < 2:
        return None
    return 100 * statistics.stdev(final_val) / statistics.fmean(final_val)


def gap_noise(paired: Sequence[float], floor_pct: float | None) -> tuple[float | None, str]:
    """Half-width (percentage points) of the ``CONFIDENCE`` interval of a paired gap around
    zero, and what it was measured from:

    - several seeds: the paired gaps' own spread, Student's t with n - 1 degrees of freedom
      (``t * sd / sqrt(n)``);
    - one seed: the baseline's seed-to-seed spread ``floor_pct`` (:func:`noise_floor`), as the
      difference of two runs (``z * sqrt(2) * floor``): a conservative bound, since the paired
      gap shares the initial parameters and batches;
    - neither: ``(None, "none")``: the gap's noise is unknown.

    >>> half, basis = gap_noise([1.0, 1.2, 0.8], None)
    >>> round(half, 3), basis
    (0.497, 'paired t over 3 seeds')
    """
    from scipy import stats

    n = len(paired)
    if n >= 2:
        sd = statistics.stdev(paired)
        t = stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)
        return float(t * sd / np.sqrt(n)), f"paired t over {n} seeds"
    if floor_pct is not None:
        z = stats.norm.ppf(0.5 + CONFIDENCE / 2)
        return float(z * np.sqrt(2) * floor_pct), "baseline seed spread"
    return None, "none"


def summarize(
    results: dict[str, RecipeResult], noise: Sequence[float] | None = None
) -> list[dict]:
    """One row per recipe: final validation loss, gap to ``none`` (%), whether the gap stands
    out of seed noise (:func:`gap_noise`), step-time ratio. ``noise``: final validation losses
    of extra baseline seeds (``compare --noise_seeds``), pooled with the baseline's own seeds
    into the noise floor."""
    base = results.get(BASELINE)
    base_t = statistics.median(base.step_s) if base and base.step_s else None
    base_by_seed = dict(zip(base.seeds, base.final_val, strict=True)) if base else {}
    floor = noise_floor([*(base.final_val if base else []), *(noise or [])])
    rows = []
    for r in results.values():
        t = statistics.median(r.step_s) if r.step_s else None
        # Paired by seed (same initial parameters and batches): the gap without the spread
        # that seeds add to both sides.
        paired = [
            100 * (v / base_by_seed[s] - 1)
            for s, v in zip(r.seeds, r.final_val, strict=True)
            if s in base_by_seed
        ]
        is_base = r.recipe == BASELINE
        half, basis = gap_noise(paired, floor) if paired and not is_base else (None, "none")
        mean = statistics.fmean(paired) if paired else None
        rows.append(
            {
                "recipe": r.recipe,
                "seeds": len(r.seeds),
                "params": r.params,
                "plan_bits": r.plan["bits"] if r.plan else None,  # a plan's bits per parameter
                "val_loss": r.val_mean,
                "val_loss_std": r.val_std,
                "gap_pct": 100 * (r.val_mean / base.val_mean - 1) if base else None,
                "paired_gap_pct": mean,
                "paired_gap_std": statistics.stdev(paired) if len(paired) > 1 else None,
                # CONFIDENCE half-width of the paired gap's noise, its basis, and whether the
                # gap lies outside it (None: the baseline itself, or no noise estimate)
                "noise_pct": half,
                "noise_basis": basis,
                "distinguishable": None if half is None else bool(abs(mean) > half),
                "noise_floor_pct": floor,
                "step_s": t,
                "step_ratio": t / base_t if t and base_t else None,
                "val_accuracy": statistics.fmean(r.final_accuracy) if r.final_accuracy else None,
            }
        )
    return rows


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def _paired_cell(r: dict) -> str:
    """The paired gap as the table shows it: signed only where it stands out of the noise."""
    if r["paired_gap_pct"] is None:
        return "-"
    if r["recipe"] == BASELINE:
        return "baseline"
    gap = f"{r['paired_gap_pct']:+.2f}%"
    if r["paired_gap_std"] is not None:
        gap += f" ± {r['paired_gap_std']:.2f}"
    return noise_marked(gap, r)


def noise_marked(gap: str, r: dict) -> str:
    """A gap's cell: ``gap`` with the half-width of its noise interval, or "within noise"
    where it does not stand out of it (``r``: a :func:`summarize` row, its ``noise_pct`` and
    ``distinguishable``)."""
    half = r.get("noise_pct")
    if half is None:
        return f"{gap} (noise unknown)"
    if not r["distinguishable"]:
        return f"within noise (±{half:.2f}%)"
    return f"{gap} (noise ±{half:.2f}%)"


def render_markdown(rows: list[dict], *, title: str, command: str) -> str:
    accuracy = any(r.get("val_accuracy") is not None for r in rows)
    floor = next((r.get("noise_floor_pct") for r in rows if r["recipe"] == BASELINE), None)
    bases = sorted({r["noise_basis"] for r in rows if r.get("noise_pct") is not None})
    noise_line = (
        f"Noise floor: `none`'s final val loss varies by {floor:.2f}% (standard deviation) "
        "across seeds."
        if floor is not None
        else "Noise floor: not measured (one seed of `none`; `--noise_seeds` measures it)."
    )
    lines = [
        f"# {title}",
        "",
        f"Command: `{command}`",
        "",
        noise_line,
        "",
        "| recipe | seeds | final val loss | gap to none | paired gap | step time / none |"
        + (" final val accuracy |" if accuracy else ""),
        "|---|---|---|---|---|---|" + ("---|" if accuracy else ""),
    ]
    for r in rows:
        loss = f"{r['val_loss']:.4f}"
        if r["seeds"] > 1:
            loss += f" ± {r['val_loss_std']:.4f}"
        gap = _fmt(r["gap_pct"], "+.2f") + ("%" if r["gap_pct"] is not None else "")
        if r.get("distinguishable") is False:  # the mean gap cannot be told from noise either
            gap = "within noise"
        paired = _paired_cell(r)
        lines.append(
            f"| {r['recipe']} | {r['seeds']} | {loss} | {gap} | {paired} | "
            f"{_fmt(r['step_ratio'], '.2f')}x |"
            + (f" {_fmt(r.get('val_accuracy'), '.2%')} |" if accuracy else "")
        )
    lines += [
        "",
        "Final val loss: mean (± standard deviation over seeds) of the validation loss "
        f"({'nats per image' if accuracy else 'nats per byte'}) at the last step. Gap: of the "
        "means, relative to `none` (the float baseline). "
        "Paired gap: the gap seed by seed (the same seed gives every recipe the same initial "
        "parameters and batches), mean ± standard deviation, printed only where it lies "
        f"outside the {CONFIDENCE:.0%} noise interval around zero"
        + (f" ({'; '.join(bases)})" if bases else "")
        + ", else \"within noise\": with several seeds the paired gaps' own spread "
        "(Student's t), with one the baseline's seed-to-seed spread, as the difference of two "
        "runs. Single-seed gaps of about 1% move with the CPU type alone (XLA:CPU's float "
        "arithmetic differs between machines). Step time: median step time over "
        "`none`'s, runs timed one after another on the same machine."
        + (" Final val accuracy: mean over seeds." if accuracy else ""),
        "",
    ]
    return "\n".join(lines)


def _ema(y: np.ndarray, alpha: float = 0.2) -> np.ndarray:
    out = np.empty_like(y, dtype=float)
    acc = y[0]
    for i, v in enumerate(y):
        acc = alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def _band(curves: list[tuple[np.ndarray, np.ndarray]], smooth: bool):
    n = min(len(c[0]) for c in curves)
    x = curves[0][0][:n]
    ys = np.stack([(_ema(c[1][:n]) if smooth else c[1][:n]) for c in curves])
    return x, ys.mean(0), ys.min(0), ys.max(0)


def _tokens(x, _pos=None) -> str:
    """A token count as a short tick label: 950, 12k, 1.5M."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    return f"{x / 1e3:g}k" if abs(x) >= 1e3 else f"{x:g}"


def plot_curves(results: dict[str, RecipeResult], path: str | Path, *, title: str = "",
                noise_pct: float | None = None) -> Path:
    """Train loss, validation loss and gap-to-none versus tokens (see the module docstring);
    ``noise_pct``: the half-width of the seed-noise interval of a one-seed gap, drawn as a band
    around zero on the gap panel (None: not drawn)."""
    fig = curves_figure(results, title=title, noise_pct=noise_pct)
    path = Path(path)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def curves_figure(results: dict[str, RecipeResult], *, title: str = "",
                  noise_pct: float | None = None):
    """The figure :func:`plot_curves` saves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    base = results.get(BASELINE)
    for r in results.values():
        for ax, curves, smooth in ((axes[0], r.train, True), (axes[1], r.val, False)):
            x, m, lo, hi = _band(curves, smooth)
            (line,) = ax.plot(
                x,
                m,
                label=r.recipe,
                lw=1.8 if r.recipe == BASELINE else 1.2,
                color="black" if r.recipe == BASELINE else None,
                zorder=3 if r.recipe == BASELINE else 2,  # the baseline on top
            )
            if len(curves) > 1:
                ax.fill_between(x, lo, hi, alpha=0.15, color=line.get_color())
        if base is not None and r.recipe != BASELINE:
            x, m, _, _ = _band(r.val, False)
            xb, mb, _, _ = _band(base.val, False)
            n = min(len(x), len(xb))
            axes[2].plot(x[:n], 100 * (m[:n] / mb[:n] - 1), label=r.recipe)
    axes[0].set_title("train loss (EMA)")
    axes[1].set_title("validation loss")
    axes[2].set_title("validation loss gap to none (%)")
    axes[2].axhline(0, color="black", lw=0.8)
    if noise_pct is not None:
        axes[2].axhspan(-noise_pct, noise_pct, color="gray", alpha=0.2, zorder=0,
                        label=f"seed noise, one seed ({100 * CONFIDENCE:g}%)")
    for ax in axes:
        ax.set_xlabel("tokens")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("nats (GPT: per byte; ViT: per image)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def compare(
    base,
    recipes: Sequence[str],
    seeds: Sequence[int] = (0,),
    *,
    out: str | Path | None = None,
    rerun: bool = False,
    noise_seeds: Sequence[int] = (),
    command: str = "",
    log: Callable[[str], None] = print,
) -> tuple[Path, Path]:
    """Run, plot and tabulate; returns the paths of ``curves.png`` and ``summary.md``.

    ``noise_seeds``: extra seeds of the baseline alone, trained to measure the noise floor
    (its seed-to-seed spread) that single-seed gaps are judged against; they are not in the
    table or the curves."""
    if BASELINE not in recipes:
        log(f"note: {BASELINE!r} is not among the recipes; gaps are left blank")
    extra = [s for s in dict.fromkeys(noise_seeds) if s not in seeds]
    if extra and BASELINE not in recipes:
        raise ValueError(f"noise_seeds={list(noise_seeds)} needs {BASELINE!r} among the recipes")
    dirs = run_all(base, recipes, seeds, rerun=rerun, log=log)
    noise_dirs = run_all(base, [BASELINE], extra, rerun=rerun, log=log) if extra else []
    group = group_of(base.name)
    out = Path(out) if out else Path(base.workdir) / group / "compare"
    out.mkdir(parents=True, exist_ok=True)
    results = load_runs(dirs)
    noise = [v for r in load_runs(noise_dirs).values() for v in r.final_val]
    rows = summarize(results, noise)
    png, md = out / "curves.png", out / "summary.md"
    if distributed.is_writer():  # process 0 of a multi-process run
        floor = next((r["noise_floor_pct"] for r in rows), None)
        plot_curves(results, png, title=f"{group}: {', '.join(recipes)}",
                    noise_pct=gap_noise([], floor)[0])
        md.write_text(render_markdown(rows, title=f"{group}: recipes compared", command=command))
        (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    distributed.barrier("lowbit-compare")
    return png, md


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        from absl import app

        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    _START()  # joins the other processes of a multi-process run (experiments/distributed.py)
    recipes = [r for r in _RECIPES.value.split(",") if r]
    seeds = [int(s) for s in _SEEDS.value.split(",") if s]
    noise_seeds = [int(s) for s in _NOISE_SEEDS.value.split(",") if s]
    png, md = studylib.run_or_exit(
        compare,
        _CONFIG.value,
        recipes,
        seeds,
        out=_OUT.value,
        rerun=_RERUN.value,
        noise_seeds=noise_seeds,
        command=studylib.command_line("experiments.compare"),
    )
    if distributed.is_writer():
        print(md.read_text())
        print(f"figure: {png}\ntable:  {md}")


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "config file and argument")
    _RECIPES = flags.DEFINE_string(
        "recipes", "none,mxfp8,mxfp6,mxfp4,nvfp4,quartet", "comma-separated recipe names"
    )
    _SEEDS = flags.DEFINE_string("seeds", "0", "comma-separated seeds")
    _NOISE_SEEDS = flags.DEFINE_string(
        "noise_seeds", "", "extra seeds of `none` alone, to measure the noise floor (e.g. 1,2)"
    )
    _OUT = flags.DEFINE_string("out", None, "output folder (default runs/<group>/compare)")
    _RERUN = flags.DEFINE_bool("rerun", False, "train runs again even when they finished")
    _START = distributed.define_flags()
    flags.mark_flags_as_required(["config"])
    app.run(main, flags_parser=parse_flags_or_exit)
