"""Per-layer precision under a bit budget: which sensitivity score picks the best plan?

    python -m experiments.autoquant --config configs/autoquant.py:mlp=dense,size=xs
    python -m experiments.autoquant --config configs/autoquant.py:mlp=moe,size=xs

For the float GPT of ``config.base`` (trained here, or reused when it finished with the same
config) this study

1. scores every weight site (attention ``qkv`` / ``out``, MLP ``up`` / ``down`` or the MoE
   experts; embeddings, LM head and router stay float) at every candidate (``none`` and the
   forward-only ``qat_mxfp8``, ``qat_mxfp6``, ``qat_nvfp4``, ``qat_mxfp4``) with every method of
   :func:`lowbit.autoquant.score` on ``calib_batches`` training batches: the loss is the GPT's
   cross-entropy (the MoE balancing loss left out: it is not what validation measures), the
   ``"kl"`` outputs its logits. Each method's scoring is timed (compilation included).
   A MoE layer's experts are two ``Einsum`` sites (``moe/up``, ``moe/down``, every expert in
   one kernel); they are grouped per layer (``blocks/(\\d+)/moe/(?:up|down)``) so that a
   layer's experts run one format: a grouped expert GEMM takes one operand format for the whole
   layer, and the two halves of an expert interact through the routing and the capacity drops,
   which a per-site score would split arbitrarily;
2. solves (:func:`lowbit.autoquant.solve`, the exact knapsack) each method's scores for every
   budget in ``budgets`` (bits per parameter over the scored weights, scales included, float
   = 16; with ``cost=active`` bits per active parameter, each expert weight counted at the
   ``top_k / experts`` of the tokens it serves: :func:`active_fraction`), saves the plans
   (``plans/<method>-<bits>.json``, loadable by ``--config.quant.plan``) and measures each by
   post-training quantization (:func:`lowbit.ptq.simulate` with the plan's rules: weights and
   activations fake-quantized with dynamic scales) on the validation batches
   (:func:`experiments.runs.evaluate`, as the PTQ study evaluates), and on the calibration
   batches;
3. measures the architecture presets (:func:`lowbit.autoquant.heuristic`: ``all``,
   ``mlp_only``, ``experts_only`` for MoE) for every ``heuristic_low`` x ``heuristic_high``,
   each at the bits the same cost function gives it (``Scores.bits``), and (``matched``) every
   method's plan solved at exactly those bits;
4. checks the additivity of the scores in loss units: per candidate, the summed Shapley
   credits (and the summed isolated damages) over the measured calibration-loss change of
   quantizing every site with it (Aumann-Shapley completeness: near 1; isolated: reported,
   it ignores interactions);
5. validates the predictions (:func:`validate`): ``random_recipes`` mixed-precision recipes,
   each site (group) drawing uniformly from ``none`` and the candidates, are measured on the
   calibration batches the scores were computed on, and each method's summed scores are set
   against the measured loss changes: Spearman's rank correlation for every method, the mean
   absolute error for the methods in loss units (isolated, Shapley).

``qat_steps > 0`` adds a short QAT of each budget's best plan from the float checkpoint
(``init_from`` + ``quant.plan``), measured the same way. Written to ``runs/<name>/``:
``autoquant.json`` (scores, plans, measured losses, timings), ``autoquant.md`` (tables) and
``autoquant.png`` (validation loss against bits per parameter, one series per method and the
heuristics, with each series' Pareto front).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import lowbit as lb
import lowbit.autoquant as aq
import lowbit.ptq as ptq
from experiments import compare, runs, studylib
from experiments.config import RunConfig, fine_tune_config, split_list
from experiments.configlib import ConfigError, parse_flags_or_exit
from experiments.model import loss_fn as gpt_loss_fn

__all__ = [
    "MOE_GROUPS",
    "MOE_EXPERTS",
    "active_fraction",
    "cross_entropy",
    "logits",
    "pareto",
    "validate",
    "run_study",
    "render_markdown",
    "plot",
    "write",
    "main",
]

# One group per MoE layer: its experts' up and down GEMMs share a format (module docstring).
MOE_GROUPS = (r"blocks/(\d+)/moe/(?:up|down)",)
# The GPT's stacked expert kernels ([E, d, f] and [E, f, d]): each token reads top_k of E.
MOE_EXPERTS = r"blocks/\d+/moe/(?:up|down)"


def active_fraction(model_cfg) -> dict[str, float]:
    """``lowbit.autoquant.score``'s ``active_fraction`` for a GPT of ``model_cfg`` (a
    :class:`experiments.model.GPTConfig`): its experts serve ``top_k / experts`` of the tokens
    each; a dense GPT has none (every site 1).

    >>> from experiments.model import GPTConfig
    >>> active_fraction(GPTConfig(mlp="moe", experts=8, top_k=2)), active_fraction(GPTConfig())
    ({'blocks/\\\\d+/moe/(?:up|down)': 0.25}, {})
    """
    if model_cfg.mlp != "moe":
        return {}
    return {MOE_EXPERTS: model_cfg.top_k / model_cfg.experts}


def cross_entropy(model, batch) -> jax.Array:
    """The GPT's mean next-token cross-entropy (what ``val_loss`` measures; no MoE aux)."""
    return gpt_loss_fn(model, batch)[1]["loss"]


def logits(model, batch) -> jax.Array:
    """The GPT's logits ``[B, T, vocab]`` (the distributions the ``"kl"`` method compares)."""
    return model(batch["inputs"])[0]


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both coordinates (fewer bits, lower loss), by bits.

    >>> pareto([(4.5, 2.0), (5.0, 1.9), (5.0, 2.1), (6.0, 1.95), (8.0, 1.8)])
    [(4.5, 2.0), (5.0, 1.9), (8.0, 1.8)]
    """
    out: list[tuple[float, float]] = []
    for b, v in sorted(points, key=lambda p: (p[0], p[1])):
        if not out or v < out[-1][1]:  # (sorted: a later point at equal bits is worse)
            out.append((b, v))
    return out


# Methods whose damage is in loss units, so that a sum predicts a loss change (the others rank).
LOSS_UNITS = ("isolated", "shapley")


def validate(points: list[dict], methods: list[str]) -> dict:
    """Spearman's rank correlation (every method) and mean absolute error (methods in loss
    units) of the predicted against the measured calibration-loss change of ``points``
    (dicts with ``"predicted"``: method -> summed score, and ``"delta_calib"``).

    >>> pts = [{"predicted": {"shapley": p}, "delta_calib": m}
    ...        for p, m in [(0.1, 0.12), (0.2, 0.18), (0.3, 0.33)]]
    >>> v = validate(pts, ["shapley"])["shapley"]
    >>> round(v["spearman"], 3), round(v["mae"], 4)
    (1.0, 0.0233)
    """
    from scipy import stats

    measured = np.array([p["delta_calib"] for p in points], np.float64)
    out = {}
    for m in methods:
        pred = np.array([p["predicted"][m] for p in points], np.float64)
        rho = stats.spearmanr(pred, measured).statistic if len(points) > 1 else None
        row = {"spearman": None if rho is None or np.isnan(rho) else float(rho)}
        if m in LOSS_UNITS:
            row["mae"] = float(np.mean(np.abs(pred - measured)))
        out[m] = row
    return out


def _floats(s, field: str) -> list[float]:
    try:
        return [float(x) for x in split_list(s)]
    except ValueError:
        raise ConfigError(f"config.{field}: expected comma-separated numbers, got {s!r}") from None


def _recipes(s, field: str) -> list[str]:
    out = []
    for n in split_list(s):
        try:
            out.append(lb.recipes.get(n).name)
        except ValueError as e:
            raise ConfigError(f"config.{field}: {e}") from None
    return out


def _counts(choices: dict[str, str], members: dict[str, tuple[str, ...]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g, r in choices.items():
        out[r] = out.get(r, 0) + len(members[g])
    return out


def _choices_of(rules, scores: aq.Scores) -> dict[str, str]:
    """rules (escaped site paths -> recipe) as a group -> recipe-name assignment; the sites
    of a group must agree."""
    by_path = {}
    for pat, r in rules:
        for members in scores.members.values():
            for p in members:
                if re.fullmatch(pat, p) and p not in by_path:
                    by_path[p] = lb.recipes.get(r).name
    out = {}
    for g, members in scores.members.items():
        names = {by_path.get(p, "none") for p in members}
        if len(names) != 1:
            raise ValueError(f"rules give the members of group {g!r} different recipes: {names}")
        out[g] = names.pop()
    return out


def _rules(choices: dict[str, str], scores: aq.Scores) -> list:
    return [
        (re.escape(p), scores.recipe(r)) for g, r in choices.items() for p in scores.members[g]
    ]


class _Study:
    """The float model of a study, its calibration batches and its measurements (cached per
    quantized site set): what every part of :func:`run_study` measures against."""

    def __init__(self, c, cfg, model, *, log: Callable[[str], None], cost: str = "stored"):
        self.c, self.cfg, self.model, self.log, self.cost = c, cfg, model, log, cost
        self.eval_cfg = cfg
        if int(c.eval_batches):
            self.eval_cfg = dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, eval_batches=int(c.eval_batches))
            )
        self.batches = [
            {k: jnp.asarray(v) for k, v in b.items()}
            for b in runs.calibration_batches(cfg, int(c.calib_batches), full=True)
        ]
        self.measured: dict[tuple, dict] = {}
        self.fl = self.measure([], calib=True)
        log(f"float: val_loss {self.fl['val_loss']:.4f}, calib_loss {self.fl['calib_loss']:.4f}")

    def measure(self, rules, calib: bool) -> dict:
        """Validation loss (and with ``calib`` the calibration-batch loss) of the float model
        under ``rules`` (cached per quantized site set)."""
        key = tuple(sorted((p, lb.recipes.get(r).name) for p, r in rules
                           if not lb.recipes.get(r).is_identity))
        if not key and rules:  # every site "none": measured through the rules all the same
            key = ("none",)
        if key not in self.measured:
            m = ptq.simulate(self.model, rules) if rules else self.model
            self.measured[key] = {
                "model": m, "val_loss": runs.evaluate(self.eval_cfg, m)["val_loss"]
            }
        rec = self.measured[key]
        if calib and "calib_loss" not in rec:
            rec["calib_loss"] = runs.evaluate(self.eval_cfg, rec["model"], batches=self.batches)[
                "val_loss"
            ]
        return {k: v for k, v in rec.items() if k != "model"}

    def point(self, rules, extra, calib: bool = False) -> dict:
        fl = self.fl
        m = self.measure(rules, calib)
        out = {**extra, **m, "delta_val": m["val_loss"] - fl["val_loss"]}
        if calib:
            out["delta_calib"] = m["calib_loss"] - fl["calib_loss"]
        return out

    def score(self, methods, candidates) -> tuple[dict[str, aq.Scores], dict[str, float]]:
        """Every method's scores of the candidates, and the seconds each took."""
        c = self.c
        groups = MOE_GROUPS if self.cfg.model.mlp == "moe" else None
        scores: dict[str, aq.Scores] = {}
        timings: dict[str, float] = {}
        for method in methods:
            t = time.perf_counter()
            s = aq.score(self.model, cross_entropy, self.batches, candidates, method=method,
                         steps=int(c.shapley_steps),
                         rule=str(c.get("shapley_rule", "midpoint")), groups=groups,
                         output_fn=logits if method == "kl" else None, seed=int(c.seed),
                         active_fraction=active_fraction(self.cfg.model))
            jax.block_until_ready(s.damage)
            timings[method] = time.perf_counter() - t
            scores[method] = s
            self.log(f"score {method}: {timings[method]:.1f}s ({len(s.sites)} sites/groups)")
        self.scores, self.ref = scores, scores[methods[0]]
        return scores, timings

    def bits(self, choices: dict[str, str]) -> float:
        """The bits per (active, with ``cost="active"``) parameter of an assignment."""
        return self.ref.bits(choices, cost=self.cost)

    def uniform(self, candidates) -> list[dict]:
        """Every candidate on every site."""
        ref, out = self.ref, []
        for cand in candidates:
            ch = ref.uniform(cand)
            rec = self.point(_rules(ch, ref), {"recipe": cand, "bits": self.bits(ch)}, calib=True)
            rec["predicted"] = {m: s.predicted(ch) for m, s in self.scores.items()}
            out.append(rec)
            self.log(f"uniform {cand}: bits {rec['bits']:.3f} delta_val {rec['delta_val']:+.4f}")
        return out

    def plan_point(self, method: str, bits: float, kind: str, out_dir: Path) -> dict | None:
        """The solver's plan of ``method`` at ``bits``, saved and measured (None: no plan)."""
        s = self.scores[method]
        try:
            plan = aq.solve(s, bits=bits, cost=self.cost)
        except ValueError as e:
            self.log(f"{method} at {bits:g} bits: {e}")
            return None
        suffix = "" if kind == "budget" else f"-{kind}"
        path = out_dir / "plans" / f"{method}-{bits:.4g}{suffix}.json"
        plan.save(path)
        rec = self.point(plan.rules(), {
            "method": method, "kind": kind, "budget": bits, "bits": plan.bits,
            "predicted": plan.predicted, "counts": plan.counts(), "choices": plan.choices,
            "plan_file": str(path),
        })
        self.log(f"{method:9s} budget {bits:6.3f}: bits {plan.bits:.3f} predicted "
                 f"{plan.predicted:+.4g} delta_val {rec['delta_val']:+.4f}")
        return rec

    def heuristics(self, lows, highs) -> list[dict]:
        """Every distinct assignment of the presets (``low`` / ``high`` recipes)."""
        ref, out, seen = self.ref, [], set()
        for preset in aq.PRESETS:
            for low in lows:
                for high in highs:
                    try:
                        rules = aq.heuristic(self.model, preset, low=low, high=high)
                    except ValueError:  # experts_only on a dense model
                        continue
                    ch = _choices_of(rules, ref)
                    key = tuple(sorted(ch.items()))
                    if key in seen:
                        continue
                    seen.add(key)
                    rec = self.point(_rules(ch, ref), {
                        "preset": preset, "low": low, "high": high, "bits": self.bits(ch),
                        "counts": _counts(ch, ref.members),
                        "predicted": {m: s.predicted(ch) for m, s in self.scores.items()},
                    })
                    out.append(rec)
                    self.log(f"heuristic {preset}/{low}/{high}: bits {rec['bits']:.3f} "
                             f"delta_val {rec['delta_val']:+.4f}")
        return out

    def qat(self, base_cfg, float_dir, plans, budgets) -> list[dict]:
        """A short QAT fine-tune under the best plan at each QAT budget."""
        c, fl, out = self.c, self.fl, []
        group = compare.group_of(base_cfg.name)
        for b in _floats(c.qat_budgets, "qat_budgets") or budgets:
            at = [p for p in plans if p["kind"] == "budget" and p["budget"] == b]
            if not at:
                continue
            best = min(at, key=lambda p: p["val_loss"])
            tag = f"{best['method']}-{b:g}"
            qc = fine_tune_config(
                c.base, recipe="none", name=f"{group}/qat-plan-{tag}-s{self.cfg.seed}",
                steps=int(c.qat_steps), lr=float(c.qat_lr), init_from=str(float_dir),
                plan=str(Path(best["plan_file"]).resolve()))
            qdir = runs.train_or_reuse(RunConfig.from_config(qc), self.log)
            _, qmodel = runs.load_trained(qdir)
            plan = aq.Plan.load(best["plan_file"])
            m = ptq.simulate(qmodel, plan.rules())
            val = runs.evaluate(self.eval_cfg, m)["val_loss"]
            out.append({"method": best["method"], "budget": b, "bits": best["bits"],
                        "run": str(qdir), "qat_steps": int(c.qat_steps), "val_loss": val,
                        "delta_val": val - fl["val_loss"], "ptq_delta_val": best["delta_val"]})
            self.log(f"qat {tag}: delta_val {val - fl['val_loss']:+.4f} (PTQ "
                     f"{best['delta_val']:+.4f})")
        return out

    def random_points(self, candidates) -> list[dict]:
        """``config.random_recipes`` random assignments (seeded by ``config.seed``)."""
        ref = self.ref
        rng = np.random.default_rng(int(self.c.seed))
        options = ["none", *candidates]
        out = []
        for i in range(int(self.c.random_recipes)):
            ch = {g: options[int(k)] for g, k in zip(ref.sites, rng.integers(0, len(options),
                                                                              len(ref.sites)),
                                                     strict=True)}
            rec = self.point(_rules(ch, ref), {
                "index": i, "bits": self.bits(ch), "counts": _counts(ch, ref.members),
                "choices": ch, "predicted": {m: s.predicted(ch) for m, s in self.scores.items()},
            }, calib=True)
            out.append(rec)
        return out


def _completeness(uniform: list[dict], scores) -> list[dict]:
    completeness = []
    for rec in uniform:
        row = {"recipe": rec["recipe"], "delta_calib": rec["delta_calib"]}
        for m in ("shapley", "isolated"):
            if m in scores:
                row[f"sum_{m}"] = rec["predicted"][m]
                row[f"ratio_{m}"] = (rec["predicted"][m] / rec["delta_calib"]
                                     if rec["delta_calib"] else None)
        completeness.append(row)
    return completeness


def run_study(c, *, log: Callable[[str], None] = print) -> dict:
    """Run the study of the ConfigDict ``c`` (``configs/autoquant.py``); returns the results
    written to ``autoquant.json``."""
    candidates = _recipes(c.candidates, "candidates")
    methods = split_list(c.methods)
    for m in methods:
        if m not in aq.METHODS:
            raise ConfigError(f"config.methods: unknown method {m!r}; expected some of "
                              f"{aq.METHODS}")
    budgets = _floats(c.budgets, "budgets")
    cost = str(c.get("cost", "stored"))
    if cost not in aq.COSTS:
        raise ConfigError(f"config.cost: unknown cost {cost!r}; expected one of {aq.COSTS}")
    lows = _recipes(c.heuristic_low, "heuristic_low")
    highs = _recipes(c.heuristic_high, "heuristic_high")
    base_cfg = RunConfig.from_config(c.base)
    out_dir = Path(c.workdir) / c.name
    (out_dir / "plans").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    float_dir = runs.train_or_reuse(base_cfg, log)
    cfg, model = runs.load_trained(float_dir)
    study = _Study(c, cfg, model, log=log, cost=cost)
    fl = study.fl
    scores, timings = study.score(methods, candidates)
    ref = study.ref
    none_choices = ref.uniform("none")
    none_plan = study.point(
        _rules(none_choices, ref), {"bits": study.bits(none_choices)}, calib=True
    )
    uniform = study.uniform(candidates)
    completeness = _completeness(uniform, scores)
    plans = [
        p for m in methods for b in budgets if (p := study.plan_point(m, b, "budget", out_dir))
    ]
    heuristics = study.heuristics(lows, highs)
    if c.matched:
        for h in heuristics:
            for m in methods:
                p = study.plan_point(m, h["bits"], "matched", out_dir)
                if p is not None:
                    p["heuristic"] = f"{h['preset']}/{h['low']}/{h['high']}"
                    plans.append(p)
    qat = study.qat(base_cfg, float_dir, plans, budgets) if int(c.qat_steps) > 0 else []
    random_points = study.random_points(candidates)
    validation = {"recipes": len(random_points), "measured": "delta_calib",
                  "methods": validate(random_points, methods) if random_points else {}}
    for m, v in validation["methods"].items():
        log(f"validation {m}: spearman {v['spearman']}, mae {v.get('mae')}")

    fronts = {m: pareto([(p["bits"], p["val_loss"]) for p in plans if p["method"] == m])
              for m in methods}
    fronts["heuristics"] = pareto([(h["bits"], h["val_loss"]) for h in heuristics])
    return {
        "name": c.name,
        "float_run": str(float_dir),
        "model": {"mlp": cfg.model.mlp, "d_model": cfg.model.d_model,
                  "layers": cfg.model.layers, "scored_params": int(sum(ref.params.values())),
                  "active_params": float(sum(ref.active_params.values()))},
        "float": fl,
        "none_plan": none_plan,
        "candidates": candidates,
        "methods": methods,
        "budgets": budgets,
        "cost": cost,
        "score_seconds": timings,
        "scores": {m: s.to_json() for m, s in scores.items()},
        "uniform": uniform,
        "completeness": completeness,
        "plans": plans,
        "heuristics": heuristics,
        "qat": qat,
        "random_recipes": random_points,
        "validation": validation,
        "pareto": fronts,
        "config": c.to_dict() if hasattr(c, "to_dict") else dict(c),
        "seconds": time.perf_counter() - t0,
    }


def _counts_str(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {r.removeprefix('qat_')}" for r, n in sorted(counts.items()))


def render_markdown(result: dict, command: str = "") -> str:
    """The tables: scoring time, completeness, plans per method and budget, heuristics
    against the plans at their bits, and the Pareto fronts."""
    fl = result["float"]
    mo = result["model"]
    lines = [f"# {result['name']}: per-layer precision under a bit budget", ""]
    if command:
        lines += ["```", command, "```", ""]
    per = "parameter over the scored weights"
    if result.get("cost", "stored") == "active":  # (results written before: stored)
        per = (f"active parameter over the scored weights ({mo['active_params']:,.0f}: each "
               "expert weight counted at the top_k / experts of the tokens it serves)")
    lines += [
        f"GPT ({mo['mlp']}, d_model {mo['d_model']}, {mo['layers']} layers; "
        f"{mo['scored_params']:,} scored weight parameters). Float: val loss "
        f"{fl['val_loss']:.4f}, calibration loss {fl['calib_loss']:.4f}. Bits per {per} "
        "(scales included, float = 16); deltas are measured loss changes against float.",
        "",
        "## Scoring time",
        "",
        "| method | seconds |",
        "|---|---|",
    ]
    lines += [f"| {m} | {t:.1f} |" for m, t in result["score_seconds"].items()]
    lines += ["", "## Additivity: summed scores over the measured change (calibration batches)",
              "", "| every site at | measured delta | sum shapley | ratio | sum isolated | "
              "ratio |", "|---|---|---|---|---|---|"]

    def f(x, spec="+.4f"):
        return "-" if x is None else format(x, spec)

    for r in result["completeness"]:
        lines.append(
            f"| {r['recipe']} | {r['delta_calib']:+.4f} | {f(r.get('sum_shapley'))} | "
            f"{f(r.get('ratio_shapley'), '.2f')} | {f(r.get('sum_isolated'))} | "
            f"{f(r.get('ratio_isolated'), '.2f')} |"
        )
    val = result.get("validation") or {}
    if val.get("methods"):
        lines += ["", f"## Validation: {val['recipes']} random mixed-precision recipes", "",
                  "Summed scores of each recipe's sites against its measured calibration-loss "
                  "change (the batches the scores were computed on). MAE in loss units, for "
                  "the methods whose scores are in loss units.", "",
                  "| method | Spearman | MAE |", "|---|---|---|"]
        for m, v in val["methods"].items():
            lines.append(f"| {m} | {f(v['spearman'], '.3f')} | {f(v.get('mae'), '.4f')} |")
    lines += ["", "## Plans per method and budget", "",
              "| method | budget | bits | predicted | delta val | sites |",
              "|---|---|---|---|---|---|"]
    for p in result["plans"]:
        if p["kind"] == "budget":
            lines.append(
                f"| {p['method']} | {p['budget']:g} | {p['bits']:.3f} | {p['predicted']:+.4g} | "
                f"{p['delta_val']:+.4f} | {_counts_str(p['counts'])} |"
            )
    lines += ["", "## Uniform recipes", "", "| recipe | bits | delta val | delta calib |",
              "|---|---|---|---|"]
    for u in result["uniform"]:
        lines.append(f"| {u['recipe']} | {u['bits']:.3f} | {u['delta_val']:+.4f} | "
                     f"{u['delta_calib']:+.4f} |")
    methods = result["methods"]
    lines += ["", "## Heuristics against the plans at matched bits (delta val)", "",
              "| preset | low | high | bits | heuristic | " + " | ".join(methods) + " |",
              "|" + "---|" * (5 + len(methods))]
    for h in result["heuristics"]:
        tag = f"{h['preset']}/{h['low']}/{h['high']}"
        cells = []
        for m in methods:
            v = [p for p in result["plans"] if p.get("heuristic") == tag and p["method"] == m]
            cells.append(f"{v[0]['delta_val']:+.4f}" if v else "-")
        lines.append(f"| {h['preset']} | {h['low']} | {h['high']} | {h['bits']:.3f} | "
                     f"{h['delta_val']:+.4f} | " + " | ".join(cells) + " |")
    lines += ["", "## Pareto fronts (bits, val loss)", ""]
    for name, pts in result["pareto"].items():
        lines.append(f"- {name}: " + ", ".join(f"({b:.3f}, {v:.4f})" for b, v in pts))
    if result.get("qat"):
        lines += ["", "## QAT of the best plan per budget", "",
                  "| method | budget | bits | steps | delta val (PTQ) | delta val (QAT) |",
                  "|---|---|---|---|---|---|"]
        for q in result["qat"]:
            lines.append(f"| {q['method']} | {q['budget']:g} | {q['bits']:.3f} | "
                         f"{q['qat_steps']} | {q['ptq_delta_val']:+.4f} | "
                         f"{q['delta_val']:+.4f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> Path:
    """Validation loss against bits per parameter: one series per method (every plan,
    budgets and matched points), the heuristics, and each series' Pareto front as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result.get("random_recipes") or []
    if pts:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
        measured = [p["delta_calib"] for p in pts]
        for i, m in enumerate(result["methods"]):
            if m in LOSS_UNITS:
                ax2.scatter(measured, [p["predicted"][m] for p in pts], s=14, alpha=0.7,
                            color=f"C{i}", label=m)
        lo, hi = min(measured), max(measured)
        ax2.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
        ax2.set_xlabel("measured loss change (calibration batches)")
        ax2.set_ylabel("predicted (summed scores)")
        ax2.set_title(f"{len(pts)} random mixed-precision recipes")
        ax2.legend(fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {m: [(p["bits"], p["val_loss"]) for p in result["plans"] if p["method"] == m]
              for m in result["methods"]}
    series["heuristics"] = [(h["bits"], h["val_loss"]) for h in result["heuristics"]]
    for i, (name, pts) in enumerate(series.items()):
        color = f"C{i}"
        if pts:
            b, v = zip(*pts, strict=True)
            ax.scatter(b, v, color=color, alpha=0.35, s=18,
                       marker="x" if name == "heuristics" else "o")
        front = result["pareto"].get(name) or []
        if front:
            b, v = zip(*front, strict=True)
            ax.plot(b, v, color=color, marker="x" if name == "heuristics" else "o", ms=4,
                    label=name)
    ax.axhline(result["float"]["val_loss"], color="k", ls="--", lw=1, label="float")
    active = result.get("cost", "stored") == "active"
    ax.set_xlabel(f"bits per {'active ' if active else ''}parameter (scored weights, scales "
                  "included)")
    ax.set_ylabel("validation loss (PTQ)")
    ax.set_title(f"{result['name']}: plans and heuristics (lines: Pareto fronts)")
    ax.legend(fontsize=8)
    return studylib.save_figure(fig, path)


def write(result: dict, out_dir, command: str = "") -> tuple[Path, Path, Path]:
    """``autoquant.json``, ``autoquant.md`` and ``autoquant.png`` under ``out_dir``."""
    return studylib.write(result, out_dir, "autoquant", render_markdown, plot, command)


def main(argv: list[str]) -> None:
    studylib.main(argv, _CONFIG.value, "experiments.autoquant", run_study, write)


if __name__ == "__main__":
    from absl import app
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "configs/autoquant.py:...")
    app.run(main, flags_parser=parse_flags_or_exit)
