"""The FP4 recipe league: which FP4 training recipe comes closest to float on the GPT at 25
tokens per parameter, at what step cost, and did each paper's headline claim hold at this scale?

    python -m experiments.recipe_league --config configs/recipe_league.py:sizes=tiny,seeds=0+1+2
    python -m experiments.recipe_league \
        --config configs/recipe_league.py:sizes=tiny+xs,seeds=0+1+2 --config.size_seeds.xs=0

Every entry (a label, a recipe, optional overrides of the run config: ``configs/recipe_league.py``)
is trained from scratch at every size and seed, each an ordinary run under
``<base.workdir>/<group>/<label>-s<seed>/``, where ``<group>`` is the one
:func:`experiments.pareto.size_configs` gives the size (``pareto-gpt-<size>-<steps>``): runs that
the Pareto study or an earlier league finished with the same config are reused
(:func:`experiments.runs.train_or_reuse`). An entry whose recipe's Hadamard blocks do not divide
the size's contraction axes (``quartet2``'s 128 at tiny's d_model 64:
:func:`experiments.config.check_hadamard_fits`) is reported "not applicable at this size", with
the reason, and not trained.

Per size and entry: final validation loss (mean ± standard deviation over seeds), the gap to
``none`` judged against seed noise (:func:`experiments.compare.summarize`), the step-cost ratio
to the float step from ``benchmarks/bench_step.py``'s JSON (``config.step_cost``). That file is
an input, not a call: experiments sit below benchmarks in the layer table (``tests/
test_layering.py``), the benchmark times every recipe interleaved in one process (so it is run
once, on a quiet machine, not each time the league is tabulated), and it times its own GPT
(d_model 256 at full size), the cost of the recipe's GEMMs rather than of a size's run. An entry
with overrides takes its recipe's ratio (the ratio does not include what the overrides add).

Claims (:data:`CLAIMS`), computed from the runs: each is one or more comparisons "``a`` reaches
a lower final validation loss than ``b``" (the same as a smaller gap to float), paired by seed,
judged with :func:`experiments.compare.gap_noise`: "held" when every comparison goes the claimed
way and stands out of the noise, "did not hold" when one goes the other way out of the noise,
"within noise" otherwise, "noise unknown" with one seed and no baseline spread, "not tested"
where an entry is missing or not applicable. Written to ``<workdir>/<name>/`` and copied to
``results_dir``: ``recipe_league_gpt-<sizes>[-tpp<n>].json``, ``.md`` (one table per size, the
claims, the command) and ``.png`` (gap to float per entry, one panel per size).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
import statistics
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import lowbit as lb
from experiments import compare, pareto, runs, studylib
from experiments.config import RunConfig, check_hadamard_fits, split_list
from experiments.configlib import ConfigError, parse_flags_or_exit

__all__ = [
    "Entry",
    "Claim",
    "CLAIMS",
    "parse_entries",
    "resolve_value",
    "entry_config",
    "not_applicable",
    "load_step_costs",
    "judge",
    "claims",
    "run_study",
    "render_markdown",
    "plot",
    "write",
    "main",
]

BASELINE = compare.BASELINE
_STEPS_VALUE = re.compile(r"^\s*([0-9.eE+-]+)\s*\*\s*steps\s*$")


# --------------------------------------------------------------------------------------------
# Entries


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the league: ``label`` trains ``recipe`` with ``overrides`` (dotted keys of
    the GPT run config and their values as written, ``<f>*steps`` unresolved)."""

    label: str
    recipe: str
    overrides: tuple[tuple[str, str], ...] = ()


def _parse_definition(text: str) -> Entry:
    head, *rest = text.split()
    if "=" not in head:
        raise ConfigError(f"config.definitions: {text!r}: expected 'label=recipe key=value ...'")
    label, recipe = (s.strip() for s in head.split("=", 1))
    if not label or not recipe:
        raise ConfigError(f"config.definitions: {text!r}: empty label or recipe")
    overrides = []
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"config.definitions: {label}: override {item!r}: expected key=value")
        overrides.append((key, value))
    return Entry(label, recipe, tuple(overrides))


def parse_entries(c) -> list[Entry]:
    """The entries of the study config ``c``, in the order of ``c.entries``: each label is a
    definition of ``c.definitions`` or a recipe name; recipes must be registered and ``none``
    (the plain float recipe) must be among them.

    >>> import ml_collections
    >>> c = ml_collections.ConfigDict({"entries": "none,a",
    ...                                "definitions": "a=nvfp4 train.lr=1e-3"})
    >>> [(e.label, e.recipe, e.overrides) for e in parse_entries(c)]
    [('none', 'none', ()), ('a', 'nvfp4', (('train.lr', '1e-3'),))]
    """
    defs: dict[str, Entry] = {}
    for text in filter(None, (s.strip() for s in str(c.definitions or "").split(";"))):
        e = _parse_definition(text)
        if e.label in defs:
            raise ConfigError(f"config.definitions: {e.label!r} is defined twice")
        defs[e.label] = e
    labels = list(dict.fromkeys(split_list(c.entries)))
    if not labels:
        raise ConfigError("config.entries: empty; expected a comma-separated list of labels")
    names = lb.recipes.names()
    entries = []
    for label in labels:
        e = defs.get(label) or Entry(label, label)
        if e.recipe not in names:
            what = f"{label!r}" if e.label == e.recipe else f"{label!r} (recipe {e.recipe!r})"
            raise ConfigError(
                f"config.entries: {what} is neither a definition of config.definitions nor a "
                f"registered recipe; recipes: {names} (leave it out with --config.entries=...)"
            )
        entries.append(e)
    base = next((e for e in entries if e.label == BASELINE), None)
    if base is None or base.recipe != BASELINE or base.overrides:
        raise ConfigError(
            f"config.entries: needs {BASELINE!r}, the float baseline every gap is measured "
            "against (the plain recipe, no overrides)"
        )
    return entries


def resolve_value(text: str, steps: int, current=None):
    """An override's value: ``<f>*steps`` is ``round(f * steps)`` (at least 1); otherwise typed
    as ``current`` (the field's present value) when it is a bool, int or float, else a number
    where it reads as one, else the string.

    >>> resolve_value("0.0625*steps", 3208), resolve_value("8", 10, 1.0), resolve_value("x", 1)
    (200, 8.0, 'x')
    """
    m = _STEPS_VALUE.match(text)
    if m:
        return max(1, round(float(m.group(1)) * steps))
    if isinstance(current, bool):
        if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return text.lower() in ("1", "true", "yes", "on")
        raise ValueError(f"expected a boolean, got {text!r}")
    if isinstance(current, int | float):
        return type(current)(float(text) if isinstance(current, float) else int(text))
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def entry_config(base, entry: Entry, seed: int, steps: int):
    """The ConfigDict of ``entry``'s run of ``seed``: ``base`` (a size's config from
    :func:`experiments.pareto.size_configs`) under the entry's recipe and overrides, named
    ``<group>/<label>-s<seed>``. A ConfigError names the override that does not fit."""
    c = copy.deepcopy(base)
    c.quant.recipe = entry.recipe
    c.seed = seed
    c.name = f"{compare.group_of(base.name)}/{entry.label}-s{seed}"
    for key, text in entry.overrides:
        *path, leaf = key.split(".")
        node = c
        try:
            for part in path:
                node = node[part]
            if not hasattr(node, "items"):
                raise KeyError(key)
            node[leaf] = resolve_value(text, steps, node.get(leaf))
        except (KeyError, AttributeError):
            raise ConfigError(
                f"config.definitions: {entry.label}: {key!r} is not a field of the run config"
            ) from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"config.definitions: {entry.label}: {key}={text!r}: {e}") from None
    return c


def not_applicable(cfg: RunConfig, recipe: str) -> str | None:
    """Why ``recipe`` cannot train the model of ``cfg`` (its Hadamard blocks do not divide the
    contraction axes: :func:`experiments.config.check_hadamard_fits`), or None when it can."""
    quant = dataclasses.replace(cfg.quant, recipe=recipe, recipe_version=None)
    probe = types.SimpleNamespace(family=cfg.family, model=cfg.model, train=cfg.train, quant=quant)
    try:
        check_hadamard_fits(probe)
    except ConfigError as e:
        return str(e)
    return None


def load_step_costs(path: str | Path) -> dict | None:
    """The ``benchmarks/bench_step.py`` result at ``path`` (``--model gpt``): ``{"recipes":
    {recipe: {"x_none", "ms", "cpu_x_none"}}, "model": ..., "path": ...}``; None when the file
    does not exist; a ConfigError when it is not such a result."""
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
        if d.get("benchmark") != "bench_step" or d["config"].get("model", "gpt") != "gpt":
            raise ValueError("not a result of benchmarks/bench_step.py --model gpt")
        rows = {
            r["recipe"]: {"x_none": r["x_none"], "ms": r["ms"], "cpu_x_none": r.get("cpu_x_none")}
            for r in d["rows"]
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"config.step_cost={str(path)!r}: {e}") from None
    cfg = d["config"]
    model = (
        f"GPT d_model {cfg.get('d_model')} x {cfg.get('layers')} layers, batch "
        f"{cfg.get('batch')} x seq {cfg.get('seq')}, implementation {cfg.get('implementation')}, "
        f"{d.get('environment', {}).get('backend', '?')}"
    )
    return {"path": str(path), "model": model, "recipes": rows}


# --------------------------------------------------------------------------------------------
# Claims


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's headline claim as comparisons ``(a, b)``: entry ``a`` reaches a lower final
    validation loss (a smaller gap to float) than entry ``b``."""

    paper: str
    statement: str
    comparisons: tuple[tuple[str, str], ...]


CLAIMS = (
    Claim(
        "Quartet II (arXiv:2601.22813)",
        "a smaller gap to float than Quartet and than NVFP4",
        (("quartet2", "quartet"), ("quartet2", "nvfp4")),
    ),
    Claim(
        "Four Over Six (arXiv:2512.02010)",
        "a lower loss than NVFP4",
        (("four_over_six", "nvfp4"),),
    ),
    Claim(
        "TetraJet-v2 (arXiv:2510.27527), OsciReset",
        "OsciReset lowers TetraJet-v2's loss",
        (("tetrajet2+osci", "tetrajet2"),),
    ),
    Claim(
        "TetraJet-v2 (arXiv:2510.27527), OutControl",
        "OutControl lowers TetraJet-v2's loss",
        (("tetrajet2+outctl", "tetrajet2"),),
    ),
    Claim(
        "TetraJet-v2 (arXiv:2510.27527), both",
        "OsciReset and OutControl together beat either alone",
        (("tetrajet2+both", "tetrajet2+osci"), ("tetrajet2+both", "tetrajet2+outctl")),
    ),
)


def judge(a: dict[int, float], b: dict[int, float], floor_pct: float | None) -> dict:
    """``a`` against ``b`` (final validation loss by seed): the paired difference in % of
    ``b`` over their common seeds, its noise (:func:`experiments.compare.gap_noise`, the
    baseline's seed spread ``floor_pct`` with one seed) and the verdict on "``a`` is lower":
    ``held``, ``did not hold``, ``within noise`` or ``noise unknown``.

    >>> judge({0: 1.0, 1: 1.1, 2: 0.9}, {0: 1.1, 1: 1.2, 2: 1.0}, None)["verdict"]
    'held'
    """
    seeds = [s for s in a if s in b]
    if not seeds:
        return {"verdict": "not tested", "why": "no common seeds", "seeds": 0}
    diffs = [100 * (a[s] / b[s] - 1) for s in seeds]
    mean = statistics.fmean(diffs)
    half, basis = compare.gap_noise(diffs, floor_pct)
    if half is None:
        verdict = "noise unknown"
    elif abs(mean) <= half:
        verdict = "within noise"
    else:
        verdict = "held" if mean < 0 else "did not hold"
    return {
        "verdict": verdict,
        "diff_pct": mean,
        "diff_std": statistics.stdev(diffs) if len(diffs) > 1 else None,
        "noise_pct": half,
        "noise_basis": basis,
        "seeds": len(seeds),
    }


def _combine(verdicts: list[str]) -> str:
    if "not tested" in verdicts:
        return "not tested"
    if all(v == "held" for v in verdicts):
        return "held"
    if "did not hold" in verdicts:
        return "did not hold"
    return "within noise" if "within noise" in verdicts else "noise unknown"


def claims(sizes: dict[str, list[dict]], which: Sequence[Claim] = CLAIMS) -> list[dict]:
    """Each claim of ``which`` at each size of ``sizes`` (``{size: rows}``, rows as
    :func:`run_study` writes them: ``label``, ``applicable``, ``reason``, ``seed_list``,
    ``final_val``, and ``noise_floor_pct`` on the baseline's), and across sizes:
    ``{"paper", "statement", "by_size": {size: {"verdict", "comparisons"}}, "verdict"}`` (the
    verdict of the largest size where the claim was tested; "not tested" when none was)."""
    out = []
    for claim in which:
        by_size = {}
        for size, rows in sizes.items():
            by = {r["label"]: r for r in rows}
            floor = by.get(BASELINE, {}).get("noise_floor_pct")
            comps = []
            for a, b in claim.comparisons:
                missing = [x for x in (a, b) if x not in by]
                na = [x for x in (a, b) if x in by and not by[x]["applicable"]]
                if missing or na:
                    why = "; ".join(
                        [f"{x}: not in the league" for x in missing]
                        + [f"{x}: not applicable ({by[x]['reason']})" for x in na]
                    )
                    comps.append({"a": a, "b": b, "verdict": "not tested", "why": why})
                    continue
                loss = {
                    x: dict(zip(by[x]["seed_list"], by[x]["final_val"], strict=True))
                    for x in (a, b)
                }
                comps.append({"a": a, "b": b, **judge(loss[a], loss[b], floor)})
            by_size[size] = {
                "verdict": _combine([c["verdict"] for c in comps]),
                "comparisons": comps,
            }
        tested = [s for s, v in by_size.items() if v["verdict"] != "not tested"]
        out.append(
            {
                "paper": claim.paper,
                "statement": claim.statement,
                "by_size": by_size,
                "verdict": by_size[tested[-1]]["verdict"] if tested else "not tested",
            }
        )
    return out


# --------------------------------------------------------------------------------------------
# The study


def _stem(c, sizes: Sequence[str]) -> str:
    stem = "recipe_league_gpt-" + "-".join(sizes)
    if float(c.tokens_per_param) > 0:
        stem += f"-tpp{float(c.tokens_per_param):g}"
    elif float(c.steps_scale) != 1.0:
        stem += f"-x{float(c.steps_scale):g}"
    return stem


def _plan(c, entries: list[Entry]) -> dict[str, dict]:
    """Per size: its steps, seeds and, per entry, the validated RunConfig of every seed or the
    reason it is not applicable; every config is checked before anything trains."""
    sized = pareto.size_configs(c)
    unknown = sorted(set(c.get("size_seeds") or {}) - set(sized))
    if unknown:
        raise ConfigError(f"config.size_seeds: {unknown} are not sizes of the study")
    plan = {}
    for size, s in sized.items():
        seeds = pareto.study_seeds(c, size)
        per_entry = {}
        for e in entries:
            where = f"config.entries: {e.label} at {size}"
            cds = [entry_config(s["config"], e, seed, s["steps"]) for seed in seeds]
            probe = copy.deepcopy(cds[0])
            probe.quant.recipe = BASELINE
            try:
                reason = not_applicable(RunConfig.from_config(probe), e.recipe)
                cfgs = [] if reason else [RunConfig.from_config(cd) for cd in cds]
            except (ConfigError, ValueError) as err:
                raise ConfigError(f"{where}: {err}") from None
            per_entry[e.label] = {"cfgs": cfgs, "reason": reason, "overrides": _resolved(cds[0], e)}
        plan[size] = {
            **{k: v for k, v in s.items() if k != "config"},
            "seeds": seeds,
            "entries": per_entry,
        }
    return plan


def _resolved(cd, e: Entry) -> dict:
    out = {}
    for key, _ in e.overrides:
        node = cd
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


def _train(cfgs: list[RunConfig], rerun: bool, log) -> list[Path]:
    dirs = []
    for cfg in cfgs:
        if rerun:
            runs.remove_run(cfg.run_dir, workdir=cfg.workdir)
        try:
            dirs.append(runs.train_or_reuse(cfg, log=log))
        except ConfigError as e:
            raise ConfigError(f"{e}; pass --config.rerun=True to train {cfg.name} again") from e
    return dirs


def run_study(c, *, log: Callable[[str], None] = print) -> dict:
    """Train (or reuse) every run of the ConfigDict ``c`` (``configs/recipe_league.py``) and
    tabulate the league and the claims; returns the results written to the JSON."""
    entries = parse_entries(c)
    costs = load_step_costs(c.step_cost)
    plan = _plan(c, entries)  # everything validated before any training
    t0 = time.perf_counter()
    tables: dict[str, list[dict]] = {}
    for size, p in plan.items():
        results, na = {}, {}
        for e in entries:
            pe = p["entries"][e.label]
            if pe["reason"]:
                log(f"{e.label} at {size}: not applicable ({pe['reason']})")
                na[e.label] = pe["reason"]
                continue
            (res,) = compare.load_runs(_train(pe["cfgs"], bool(c.rerun), log)).values()
            res.recipe = e.label  # compare's rows are keyed by the entry's label
            results[e.label] = res
        summary = {r["recipe"]: r for r in compare.summarize(results)}
        rows = []
        for e in entries:
            row = {
                "label": e.label,
                "recipe": e.recipe,
                "overrides": p["entries"][e.label]["overrides"],
            }
            if e.label in na:
                row.update(applicable=False, reason=na[e.label])
            else:
                r = summary[e.label]
                row.update(
                    applicable=True, reason=None, **{k: v for k, v in r.items() if k != "recipe"}
                )
                row["seed_list"] = results[e.label].seeds
                row["final_val"] = results[e.label].final_val
            cost = (costs or {}).get("recipes", {}).get(e.recipe)
            row["bench_x_none"] = cost["x_none"] if cost else None
            rows.append(row)
        tables[size] = rows
    return {
        "name": c.name,
        "stem": _stem(c, list(plan)),
        "sizes": list(plan),
        "steps": {k: {kk: v for kk, v in p.items() if kk != "entries"} for k, p in plan.items()},
        "entries": [dataclasses.asdict(e) for e in entries],
        "tables": tables,
        "claims": claims(tables),
        "step_cost": None if costs is None else {k: costs[k] for k in ("path", "model")},
        "step_cost_path": str(c.step_cost or ""),
        "bench_command": _bench_command(entries, c.step_cost),
        "config": c.to_dict() if hasattr(c, "to_dict") else dict(c),
        "seconds": time.perf_counter() - t0,
    }


def _bench_command(entries: list[Entry], out: str) -> str:
    recipes = ",".join(dict.fromkeys(e.recipe for e in entries))
    return f"python benchmarks/bench_step.py --recipes {recipes}" + (f" --out {out}" if out else "")


# --------------------------------------------------------------------------------------------
# Page and figure


def _fmt_value(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _entry_cell(r: dict) -> str:
    if not r["overrides"]:
        return r["recipe"]
    return f"{r['recipe']} ({', '.join(f'{k}={_fmt_value(v)}' for k, v in r['overrides'].items())})"


def _loss_cell(r: dict) -> str:
    s = f"{r['val_loss']:.4f}"
    return s + (f" ± {r['val_loss_std']:.4f}" if r["seeds"] > 1 else "")


def _gap_cell(r: dict) -> str:
    if r["label"] == BASELINE:
        return "baseline"
    if r["paired_gap_pct"] is None:
        return "-"
    gap = f"{r['paired_gap_pct']:+.2f}%"
    if r["paired_gap_std"] is not None:
        gap += f" ± {r['paired_gap_std']:.2f}"
    return compare.noise_marked(gap, r)


def _ratio(v) -> str:
    return "not measured" if v is None else f"{v:.2f}x"


def _comparison_text(cmp: dict) -> str:
    if cmp["verdict"] == "not tested":
        return f"{cmp['a']} vs {cmp['b']}: not tested ({cmp['why']})"
    noise = (
        "noise unknown (one seed, no baseline spread)"
        if cmp["noise_pct"] is None
        else f"noise ±{cmp['noise_pct']:.2f}% ({cmp['noise_basis']})"
    )
    spread = f" ± {cmp['diff_std']:.2f}" if cmp["diff_std"] is not None else ""
    return (
        f"{cmp['a']} vs {cmp['b']}: {cmp['diff_pct']:+.2f}%{spread} loss, {noise}: {cmp['verdict']}"
    )


def render_markdown(result: dict, command: str = "") -> str:
    """One table per size and the claims section."""
    lines = [f"# FP4 recipe league: GPT {', '.join(result['sizes'])}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    sc = result.get("step_cost")
    if sc:
        lines += [f"Step cost: `benchmarks/bench_step.py`, {sc['model']} (`{sc['path']}`).", ""]
    else:
        lines += [
            f"Step cost: not measured (no `{result['step_cost_path']}`); measure it with "
            f"`{result['bench_command']}`.",
            "",
        ]
    for size in result["sizes"]:
        s = result["steps"][size]
        lines += [
            f"## {size}",
            "",
            f"{s['params']:,} parameters, {s['steps']} steps, {s['tokens']:,} tokens "
            f"({s['tokens'] / s['params']:.3g} per parameter), seeds "
            f"{', '.join(map(str, s['seeds']))}.",
            "",
            "| entry | recipe | seeds | final val loss | gap to none | step cost (bench_step) "
            "| step time in the runs / none |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["tables"][size]:
            if not r["applicable"]:
                lines.append(
                    f"| {r['label']} | {_entry_cell(r)} | - | not applicable at this size "
                    f"({r['reason']}) | - | {_ratio(r['bench_x_none'])} | - |"
                )
                continue
            lines.append(
                f"| {r['label']} | {_entry_cell(r)} | {r['seeds']} | {_loss_cell(r)} | "
                f"{_gap_cell(r)} | {_ratio(r['bench_x_none'])} | "
                f"{'-' if r['step_ratio'] is None else format(r['step_ratio'], '.2f') + 'x'} |"
            )
        lines.append("")
    lines += ["## Claims", ""]
    for cl in result["claims"]:
        lines.append(f"- **{cl['paper']}**: {cl['statement']}: **{cl['verdict']}** at this scale.")
        for size, v in cl["by_size"].items():
            comps = "; ".join(_comparison_text(x) for x in v["comparisons"])
            lines.append(f"  - {size}: {v['verdict']}: {comps}.")
    lines += [
        "",
        "Final val loss: mean (± standard deviation over seeds) of the validation loss (nats "
        "per byte) at the last step. Gap to none: paired by seed (the same seed gives every "
        "entry the same initial parameters and batches), mean ± standard deviation, printed "
        f"where it lies outside the {compare.CONFIDENCE:.0%} noise interval around zero, else "
        '"within noise" (`experiments.compare.gap_noise`: with several seeds the paired gaps\' '
        "own spread, with one the baseline's seed-to-seed spread). Step cost: the recipe's "
        "median training step over the float step, timed interleaved in one process by "
        "`benchmarks/bench_step.py` on its own GPT (an entry with overrides: its recipe's). "
        "Step time in the runs: median step time over `none`'s, runs timed one after another "
        "(machine noise included). Claims: each comparison is the paired difference of final "
        "val loss (a against b, in % of b) judged by the same noise interval; a claim holds at "
        "a size when every comparison goes its way out of the noise, and its verdict at this "
        "scale is that of the largest size where it was tested.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path) -> Path:
    """The paired gap to float per entry (bars, seed spread as error bars), one panel per size;
    entries not applicable at a size are marked n/a."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(1 + 5 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        rows = [r for r in result["tables"][size] if r["label"] != BASELINE]
        x = range(len(rows))
        for i, r in enumerate(rows):
            if not r["applicable"]:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8, color="grey")
                continue
            gap = r["paired_gap_pct"] or 0.0
            ax.bar(
                i,
                gap,
                yerr=r["paired_gap_std"] or 0.0,
                capsize=3,
                color=f"C{i % 10}",
                alpha=0.9 if r.get("distinguishable") else 0.45,
            )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(list(x), [r["label"] for r in rows], rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("final val loss gap to none (%)")
        ax.set_title(f"GPT {size}, {result['steps'][size]['steps']} steps")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("FP4 recipe league (faded: within seed noise)")
    return studylib.save_figure(fig, path)


def write(
    result: dict, out_dir, command: str = "", *, results_dir: str | Path | None = None
) -> tuple[Path, Path, Path]:
    """``<stem>.json``, ``.md`` and ``.png`` under ``out_dir``, copied to ``results_dir`` when
    given."""
    return studylib.write(result, out_dir, result["stem"], render_markdown, plot, command,
                          results_dir)


def main(argv: list[str]) -> None:
    config = _CONFIG.value
    studylib.main(
        argv,
        config,
        "experiments.recipe_league",
        run_study,
        functools.partial(write, results_dir=config.results_dir or None),
    )


if __name__ == "__main__":
    from absl import app
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "configs/recipe_league.py:...")
    app.run(main, flags_parser=parse_flags_or_exit)
