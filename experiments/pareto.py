"""At a fixed weight-memory budget, which weight bit width gives the lowest validation loss?

    python -m experiments.pareto --config configs/pareto.py:sizes=tiny+xs+s,seeds=0+1+2
    python -m experiments.pareto --config configs/pareto.py:sizes=tiny+xs,tokens_per_param=25

QAT from scratch of the GPT of every size of ``config.sizes`` under every recipe of
``config.recipes`` (by default one per weight format, all with int8 per-token activations:
``w16a8``, ``w8a8_mxfp8``, ``w6a8_mxfp6``, ``w4a8_mxfp4``, ``w4a8_nvfp4``, ``w4a8_int4``,
``bitnet`` (ternary), and the float baseline ``none``), each (size, recipe, seed) an ordinary
run trained and reused by :func:`experiments.compare.run_all` under
``<base.workdir>/pareto-gpt-<size>-<steps>/<recipe>-s<seed>/``. Every (size, recipe) is a point:
its weight memory (:func:`weight_memory`) and final validation loss (mean over seeds). Is
ternary (BitNet b1.58) on the Pareto front, or does a smaller model with 4, 6 or 8-bit weights
reach a lower loss in less memory?

Weight memory counts every parameter of the trained model as deployed: each linear kernel the
recipe quantizes (a Dense / Einsum site not matched by ``quant.high_precision``) at the recipe's
forward weight format, :func:`lowbit.autoquant.weight_bits` (elements and block scales, plus 32
bits per tensor for a format with a float32 tensor scale: NVFP4, ternary's absmean scale);
everything else (embeddings, LM head, norms, router, and every kernel of ``w16a8`` / ``none``)
at 16 bits, as bf16.

The Pareto front: a point is on it when no other point is at least as good on both axes and
better on one (less or equal memory and lower or equal loss, not both equal); identical points
are both on it. Written to ``<workdir>/<name>/`` and copied to ``results_dir``:
``pareto_gpt-<sizes>.json`` (every point, the front), ``.md`` (the table, the front, the launch
command) and ``.png`` (loss against memory, log scale, one colour per recipe, sizes connected,
seed spread as error bars, the front as a step line).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
from flax import nnx

import lowbit as lb
import lowbit.flax as lbf
from experiments import compare, studylib, trainer
from experiments.config import RunConfig, quant_rules, split_list
from experiments.configlib import ConfigError, parse_flags_or_exit
from lowbit import autoquant
from lowbit.bits import storage_bits
from lowbit.io.tree import keypath_str, path_str

__all__ = [
    "WeightMemory",
    "weight_memory",
    "run_weight_memory",
    "pareto_front",
    "interpolated_loss",
    "size_configs",
    "study_seeds",
    "run_study",
    "render_markdown",
    "plot",
    "write",
    "main",
]

BASELINE = compare.BASELINE
MIB = 8 * 2**20  # bits in a MiB


# --------------------------------------------------------------------------------------------
# Weight memory


@dataclasses.dataclass(frozen=True)
class WeightMemory:
    """The storage of a model's parameters: in all (``params``, ``bits``) and of the kernels
    its recipe quantizes (``quantized_params``, ``quantized_bits``)."""

    params: int
    bits: float
    quantized_params: int
    quantized_bits: float

    @property
    def mib(self) -> float:
        return self.bits / MIB

    @property
    def bits_per_param(self) -> float:
        return self.bits / self.params

    @property
    def bits_per_quantized_param(self) -> float | None:
        """Bits per element of the quantized kernels (scales included); None when none is."""
        return self.quantized_bits / self.quantized_params if self.quantized_params else None


def weight_memory(model: nnx.Module, rules) -> WeightMemory:
    """The weight memory of the NNX ``model`` (concrete or ``nnx.eval_shape``'d) under the
    ``lowbit.flax`` ``rules``: the kernel of every site a rule gives a quantizing recipe at
    :func:`lowbit.bits.storage_bits` of the recipe's forward weight spec, tensor scale counted
    (a recipe whose forward keeps the weight in float counts 16 bits), every other parameter at
    16 bits (bf16): the convention of ``lowbit.bits``'s table for this study.

    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
    >>> m = weight_memory(model, [("layers/0", "qat_mxfp4")])
    >>> m.quantized_params, m.quantized_bits, m.params, m.bits  # 4096 * 4.25 + 584 * 16
    (4096, 17408.0, 4680, 26752.0)
    """
    quantized: dict[str, tuple[int, float]] = {}
    for s in lbf.sites(model, rules):
        if s.kernel is None or s.recipe is None or s.recipe.is_identity:
            continue
        n = math.prod(s.shape)
        quantized[s.kernel] = (n, storage_bits(s.recipe.fwd.rhs, s.shape))
    params = bits = q_params = q_bits = 0
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    for keypath, leaf in leaves:
        name = path_str(keypath_str(keypath))
        n = math.prod(leaf.shape)
        if name in quantized:
            b = quantized.pop(name)[1]
            q_params, q_bits = q_params + n, q_bits + b
        else:
            b = storage_bits(None, leaf.shape)
        params, bits = params + n, bits + b
    if quantized:  # pragma: no cover - a site whose kernel is not a parameter of the model
        raise ValueError(f"quantized kernels not found among the parameters: {sorted(quantized)}")
    return WeightMemory(params, float(bits), q_params, float(q_bits))


def _abstract_model(cfg: RunConfig) -> nnx.Module:
    return nnx.eval_shape(lambda: trainer.build_float_model(cfg))


def run_weight_memory(run_dir: str | Path) -> WeightMemory:
    """:func:`weight_memory` of the model a run trained (its ``config.json``: model, recipe,
    ``quant.high_precision``, plan), from shapes alone."""
    cfg = RunConfig.from_config(json.loads((Path(run_dir) / "config.json").read_text()))
    return weight_memory(_abstract_model(cfg), quant_rules(cfg.quant))


# --------------------------------------------------------------------------------------------
# Pareto front


def _dominates(m1: float, l1: float, m2: float, l2: float) -> bool:
    return m1 <= m2 and l1 <= l2 and (m1 < m2 or l1 < l2)


def pareto_front(memory: Sequence[float], loss: Sequence[float]) -> list[bool]:
    """Which points (``memory[i]``, ``loss[i]``) are on the Pareto front of low memory and low
    loss: no other point has less or equal memory and lower or equal loss, one of them
    strictly (identical points are both on the front).

    >>> pareto_front([1, 2, 2, 3, 4], [3.0, 2.0, 2.5, 2.0, 1.0])
    [True, True, False, False, True]
    """
    if len(memory) != len(loss):
        raise ValueError(f"{len(memory)=} and {len(loss)=} must match")
    pts = list(zip(memory, loss, strict=True))
    return [not any(_dominates(*q, *p) for q in pts) for p in pts]


def interpolated_loss(memory: float, curve: Sequence[tuple[float, float]]) -> float | None:
    """The loss a recipe would reach at ``memory`` by its ``curve`` of (memory, loss) points
    across model sizes, linear in log memory between the two points that bracket it; None
    outside the curve. The front is a set of points, and the sizes are a factor 3-5 apart in
    parameters: this says whether a point beats the other recipes at its own memory, not only
    whether some point happens to lie next to it.

    >>> interpolated_loss(2.0, [(1.0, 3.0), (4.0, 2.0)])
    2.5
    """
    pts = sorted(curve)
    for (m0, l0), (m1, l1) in zip(pts, pts[1:], strict=False):
        if m0 <= memory <= m1:
            if m1 == m0:
                return min(l0, l1)
            f = math.log(memory / m0) / math.log(m1 / m0)
            return l0 + f * (l1 - l0)
    return None


def _best_dominator(i: int, memory: Sequence[float], loss: Sequence[float]) -> int | None:
    """The point that dominates point ``i`` with the lowest loss (then the least memory)."""
    js = [j for j in range(len(loss)) if _dominates(memory[j], loss[j], memory[i], loss[i])]
    return min(js, key=lambda j: (loss[j], memory[j])) if js else None


# --------------------------------------------------------------------------------------------
# The study


def _list(c, key: str) -> list[str]:
    items = list(dict.fromkeys(split_list(c[key])))
    if not items:
        raise ConfigError(f"config.{key}: empty; expected a comma-separated list")
    return items


def study_seeds(c, size: str | None = None) -> list[int]:
    """The study's seeds (``config.seeds``), or ``size``'s own (``config.size_seeds.<size>``,
    when set); a clear error for an empty or non-integer list."""
    key, value = "seeds", c.seeds
    per_size = c.get("size_seeds") or {}
    if size is not None and per_size.get(size):
        key, value = f"size_seeds.{size}", per_size[size]
    items = list(dict.fromkeys(split_list(value)))
    if not items:
        raise ConfigError(f"config.{key}: empty; expected a comma-separated list")
    try:
        return [int(s) for s in items]
    except ValueError:
        raise ConfigError(f"config.{key}={value!r}: expected comma-separated integers") from None


def _recipes(c) -> list[str]:
    recipes = _list(c, "recipes")
    names = lb.recipes.names()
    unknown = [r for r in recipes if r not in names]
    if unknown:
        raise ConfigError(f"config.recipes: unknown recipe(s) {unknown}; expected some of {names}")
    return recipes


def _merge(dst, src) -> None:
    """Set every leaf of the ConfigDict ``src`` in ``dst`` (nested sections merged)."""
    for k, v in src.items():
        if hasattr(v, "items") and k in dst and hasattr(dst[k], "items"):
            _merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def size_configs(c) -> dict[str, dict]:
    """Per size of the study config ``c``, smallest model first: ``{"config": <ConfigDict of
    its none-s0 run>, "steps", "params", "tokens"}`` (``base`` with the size's section on top,
    steps from ``steps_scale`` or ``tokens_per_param``), every config validated."""
    sizes = list(c.sizes.keys()) if c.sizes is not None else []
    if not sizes:
        raise ConfigError("config.sizes: empty; expected at least one size section")
    scale, tpp = float(c.steps_scale), float(c.tokens_per_param)
    if not scale > 0:
        raise ConfigError(f"config.steps_scale={c.steps_scale!r}: expected a positive number")
    if tpp < 0:
        raise ConfigError(f"config.tokens_per_param={tpp!r}: expected >= 0 (0: off)")
    if tpp > 0 and scale != 1.0:
        raise ConfigError(
            "config.tokens_per_param and config.steps_scale both set the steps; keep one "
            f"(got {tpp} and {scale})"
        )
    out = {}
    for size in sizes:
        b = copy.deepcopy(c.base)
        _merge(b, c.sizes[size])
        try:
            cfg = RunConfig.from_config(b)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"config.sizes.{size}: {e}") from None
        params = weight_memory(_abstract_model(cfg), []).params
        per_step = cfg.train.batch_size * cfg.model.seq_len
        if tpp > 0:
            steps = max(1, math.ceil(tpp * params / per_step))
        else:
            steps = max(1, round(cfg.train.steps * scale))
        b.train.steps = steps
        b.name = f"pareto-gpt-{size}-{steps}/{BASELINE}-s0"
        RunConfig.from_config(b)
        out[size] = {"config": b, "steps": steps, "params": params, "tokens": steps * per_step}
    return dict(sorted(out.items(), key=lambda kv: (kv[1]["params"], kv[0])))


def _stem(c, sizes: Sequence[str]) -> str:
    stem = "pareto_gpt-" + "-".join(sizes)
    if float(c.tokens_per_param) > 0:
        stem += f"-tpp{float(c.tokens_per_param):g}"
    elif float(c.steps_scale) != 1.0:
        stem += f"-x{float(c.steps_scale):g}"
    return stem


def _weight_format(recipe: str) -> tuple[str, float]:
    spec = lb.recipes.get(recipe).fwd.rhs
    if spec is None:
        return "float", autoquant.FLOAT_BITS
    return spec.format, spec.bits_per_element


def run_study(c, *, log: Callable[[str], None] = print) -> dict:
    """Train (or reuse) every run of the ConfigDict ``c`` (``configs/pareto.py``) and measure
    the points and the front; returns the results written to ``pareto_*.json``."""
    seeds, recipes = study_seeds(c), _recipes(c)
    sized = size_configs(c)  # everything validated before any training
    unknown = sorted(set(c.get("size_seeds") or {}) - set(sized))
    if unknown:
        raise ConfigError(f"config.size_seeds: {unknown} are not sizes of the study")
    seeds_of = {size: study_seeds(c, size) for size in sized}
    if BASELINE not in recipes:
        log(f"note: {BASELINE!r} is not among the recipes; gaps are left blank")
    t0 = time.perf_counter()
    points: list[dict] = []
    for size, s in sized.items():
        dirs = compare.run_all(s["config"], recipes, seeds_of[size], rerun=bool(c.rerun), log=log)
        results = compare.load_runs(dirs)
        rows = {r["recipe"]: r for r in compare.summarize(results)}
        for recipe in recipes:
            # the memory of any seed's run: every seed trains the same model under the recipe
            run = next(Path(d) for d in dirs if Path(d).name == f"{recipe}-s{seeds_of[size][0]}")
            mem = run_weight_memory(run)
            if mem.params != rows[recipe]["params"]:
                raise ValueError(
                    f"{run}: {mem.params:,} parameters counted from its config, "
                    f"{rows[recipe]['params']:,} in its summary.json"
                )
            fmt, elem_bits = _weight_format(recipe)
            points.append(
                {
                    "size": size,
                    **rows[recipe],
                    "final_val": results[recipe].final_val,  # one per seed, in the order of seeds
                    "steps": s["steps"],
                    "tokens": s["tokens"],
                    "tokens_per_param": s["tokens"] / mem.params,
                    "weight_format": fmt,
                    "weight_bits_per_element": elem_bits,
                    "memory_bits": mem.bits,
                    "memory_mib": mem.mib,
                    "quantized_params": mem.quantized_params,
                    "bits_per_quantized_param": mem.bits_per_quantized_param,
                    "bits_per_param": mem.bits_per_param,
                }
            )
    memory = [p["memory_bits"] for p in points]
    loss = [p["val_loss"] for p in points]
    for i, (p, on) in enumerate(zip(points, pareto_front(memory, loss), strict=True)):
        p["on_front"] = on
        j = None if on else _best_dominator(i, memory, loss)
        p["dominated_by"] = (
            None
            if j is None
            else {
                "size": points[j]["size"],
                "recipe": points[j]["recipe"],
                "memory_ratio": memory[j] / memory[i],
                "loss_gap_pct": 100 * (loss[j] / loss[i] - 1),
            }
        )
    # each point against every other recipe's curve across sizes, at the point's own memory
    for p in points:
        rivals = {}
        for r in recipes:
            if r == p["recipe"]:
                continue
            curve = [(q["memory_bits"], q["val_loss"]) for q in points if q["recipe"] == r]
            at = interpolated_loss(p["memory_bits"], curve)
            if at is not None:
                rivals[r] = at
        best = min(rivals, key=rivals.get) if rivals else None
        p["interpolated_rival"] = (
            None
            if best is None
            else {
                "recipe": best,
                "loss": rivals[best],
                "gap_pct": 100 * (p["val_loss"] / rivals[best] - 1),
            }
        )
    front = sorted((p for p in points if p["on_front"]), key=lambda p: p["memory_bits"])
    ternary = [p for p in points if p["weight_format"] == "ternary"]
    return {
        "name": c.name,
        "stem": _stem(c, list(sized)),
        "sizes": list(sized),
        "seeds": seeds,
        "seeds_by_size": seeds_of,
        "recipes": recipes,
        "steps": {k: {kk: v for kk, v in s.items() if kk != "config"} for k, s in sized.items()},
        "points": points,
        "front": [{"size": p["size"], "recipe": p["recipe"]} for p in front],
        "ternary_on_front": any(p["on_front"] for p in ternary) if ternary else None,
        "config": c.to_dict() if hasattr(c, "to_dict") else dict(c),
        "seconds": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------------------------
# Table, front, figure


def _gap_cell(p: dict) -> str:
    """The gap of the means to ``none``, or "within noise" where the paired gap cannot be
    told from seed noise (:func:`experiments.compare.gap_noise`)."""
    if p["recipe"] == BASELINE:
        return "baseline"
    if p["gap_pct"] is None:
        return "-"
    return compare.noise_marked(f"{p['gap_pct']:+.2f}%", p)


def _loss_cell(p: dict) -> str:
    s = f"{p['val_loss']:.4f}"
    return s + (f" ± {p['val_loss_std']:.4f}" if p["seeds"] > 1 else "")


def _bits(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _where(p: dict) -> str:
    return f"{p['recipe']} @ {p['size']}"


def _seed_text(result: dict) -> str:
    by_size = result.get("seeds_by_size") or {}
    if all(v == result["seeds"] for v in by_size.values()):
        return ", ".join(map(str, result["seeds"]))
    return "; ".join(f"{k}: {', '.join(map(str, v))}" for k, v in by_size.items())


def _ternary_lines(pts: list[dict]) -> list[str]:
    """What the study says about ternary weights: on the front or not, and against what."""
    lines: list[str] = []
    ternary = [p for p in pts if p["weight_format"] == "ternary"]
    if not ternary:
        lines.append("Ternary weights: no ternary recipe in this study.")
    else:
        on = [p for p in ternary if p["on_front"]]
        lines.append(
            "Ternary weights (BitNet b1.58): "
            + (
                f"**on the front** at {', '.join(p['size'] for p in on)}."
                if on
                else "**not on the front**: Pareto-suboptimal at every size."
            )
        )
        for p in ternary:
            rv = p.get("interpolated_rival")
            if rv is not None:
                lines.append(
                    f"- {_where(p)} ({_loss_cell(p)}, {p['memory_mib']:.4f} MiB) against the "
                    f"best other recipe at the same memory, interpolated between its sizes "
                    f"(linear in log memory): {rv['recipe']} {rv['loss']:.4f}, ternary "
                    f"{rv['gap_pct']:+.2f}%."
                )
            else:
                lines.append(
                    f"- {_where(p)}: no other recipe's sizes bracket its memory "
                    f"({p['memory_mib']:.4f} MiB), so nothing to set it against there."
                )
        for p in ternary:
            d = p["dominated_by"]
            if d is not None:
                rival = next(
                    q for q in pts if q["size"] == d["size"] and q["recipe"] == d["recipe"]
                )
                lines.append(
                    f"- {_where(p)} ({_loss_cell(p)}, {p['memory_mib']:.4f} MiB) is dominated by "
                    f"{_where(rival)} ({_loss_cell(rival)}, {rival['memory_mib']:.4f} MiB): "
                    f"{d['memory_ratio']:.2f}x the memory, {d['loss_gap_pct']:+.2f}% loss."
                )
    return lines


def render_markdown(result: dict, command: str = "") -> str:
    """The table of every (size, recipe), the front, and what it says about ternary."""
    pts = result["points"]
    lines = [f"# Weight memory against validation loss: GPT {', '.join(result['sizes'])}", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    steps = "; ".join(
        f"{k}: {s['params']:,} parameters, {s['steps']} steps, {s['tokens']:,} tokens "
        f"({s['tokens'] / s['params']:.3g} per parameter)"
        for k, s in result["steps"].items()
    )
    lines += [
        f"QAT from scratch, seeds {_seed_text(result)}. {steps}.",
        "",
        "| size | recipe | weight format | params | weight memory (MiB) | bits / quantized "
        "weight | bits / param | seeds | final val loss | gap to none | Pareto front |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pts:
        d = p["dominated_by"]
        front = (
            "**on**"
            if p["on_front"]
            else f"dominated by {d['recipe']} @ {d['size']} ({d['memory_ratio']:.2f}x memory, "
            f"{d['loss_gap_pct']:+.2f}% loss)"
        )
        lines.append(
            f"| {p['size']} | {p['recipe']} | {p['weight_format']} "
            f"({_bits(p['weight_bits_per_element'])} b) | {p['params']:,} | "
            f"{p['memory_mib']:.4f} | {_bits(p['bits_per_quantized_param'])} | "
            f"{p['bits_per_param']:.3f} | {p['seeds']} | {_loss_cell(p)} | {_gap_cell(p)} | "
            f"{front} |"
        )
    front = [p for p in pts if p["on_front"]]
    front.sort(key=lambda p: p["memory_bits"])
    lines += ["", "## Pareto front", "", "From the least memory to the most:", ""]
    lines += [
        f"{i}. {_where(p)}: {p['memory_mib']:.4f} MiB, val loss {_loss_cell(p)} "
        f"({p['weight_format']}, {_bits(p['bits_per_quantized_param'])} bits per quantized "
        "weight)"
        for i, p in enumerate(front, 1)
    ]
    widths: dict[tuple, set] = {}
    for p in front:
        key = (p["weight_format"], p["weight_bits_per_element"])
        widths.setdefault(key, set()).add(p["recipe"])
    lines += [
        "",
        "Weight bit widths on the front: "
        + ", ".join(
            f"{f} {_bits(b)} bits ({', '.join(sorted(r))})"
            for (f, b), r in sorted(widths.items(), key=lambda kv: kv[0][1])
        )
        + ".",
        "",
    ]
    lines += _ternary_lines(pts)
    lines += [
        "",
        "Weight memory: every parameter as deployed: each linear kernel that the recipe "
        "quantizes (not matched by `quant.high_precision`) in the recipe's forward weight "
        "format, block scales included, plus 32 bits per tensor for a format with a float32 "
        "tensor scale (NVFP4, ternary); every other parameter (embeddings, LM head, norms, "
        "router, and the kernels of recipes whose weights stay float) at 16 bits (bf16). "
        "Final val loss: mean (± standard deviation over seeds) of the validation loss "
        "(nats per byte) at the last step. Gap: of the means to `none` of the same size, "
        f'"within noise" where the paired (same seed) gap lies inside the '
        f"{compare.CONFIDENCE:.0%} noise interval around zero (`experiments.compare.gap_noise`)."
        " Pareto front: on the means; a point is off it when another has less or equal memory "
        "and lower or equal loss, one of them strictly. A dominated point names the point that "
        "dominates it with the lowest loss.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path) -> Path:
    """Validation loss against weight memory (log scale): one colour and marker per recipe,
    its sizes connected, seed spread (standard deviation) as error bars, the front as a
    step line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    pts = result["points"]
    order = {s: i for i, s in enumerate(result["sizes"])}
    markers = "os^vDP*Xph<>"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for k, recipe in enumerate(result["recipes"]):
        rp = sorted((p for p in pts if p["recipe"] == recipe), key=lambda p: order[p["size"]])
        x = [p["memory_mib"] for p in rp]
        y = [p["val_loss"] for p in rp]
        yerr = [p["val_loss_std"] for p in rp]
        base = recipe == BASELINE
        ax.errorbar(
            x,
            y,
            yerr=yerr,
            marker=markers[k % len(markers)],
            capsize=3,
            ms=6,
            lw=1.2,
            label=recipe,
            color="black" if base else f"C{k % 10}",
            zorder=3,
        )
    for p in pts:
        ax.annotate(
            p["size"],
            (p["memory_mib"], p["val_loss"]),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
            alpha=0.7,
        )
    front = sorted((p for p in pts if p["on_front"]), key=lambda p: p["memory_bits"])
    if front:
        fx = [p["memory_mib"] for p in front]
        fy = [p["val_loss"] for p in front]
        xmax = max(p["memory_mib"] for p in pts) * 1.15
        ax.step(
            [*fx, xmax],
            [*fy, fy[-1]],
            where="post",
            color="grey",
            ls="--",
            lw=1.5,
            label="Pareto front",
            zorder=2,
        )
        ax.scatter(fx, fy, s=160, facecolors="none", edgecolors="grey", zorder=4)
    ax.set_xscale("log")
    ticks = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(ticks)
    ax.xaxis.set_minor_formatter(ticks)
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("weight memory (MiB; quantized kernels at their format, the rest bf16)")
    ax.set_ylabel("final validation loss (nats per byte)")
    ax.set_title(f"GPT {', '.join(result['sizes'])}: validation loss against weight memory")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return studylib.save_figure(fig, path)


def write(
    result: dict, out_dir, command: str = "", *, results_dir: str | Path | None = None
) -> tuple[Path, Path, Path]:
    """``<stem>.json``, ``.md`` and ``.png`` under ``out_dir`` (``stem``: the result's,
    ``pareto_gpt-<sizes>``), copied to ``results_dir`` when given."""
    return studylib.write(result, out_dir, result["stem"], render_markdown, plot, command,
                          results_dir)


def main(argv: list[str]) -> None:
    config = _CONFIG.value
    studylib.main(
        argv,
        config,
        "experiments.pareto",
        run_study,
        functools.partial(write, results_dir=config.results_dir or None),
    )


if __name__ == "__main__":
    from absl import app
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "configs/pareto.py:...")
    app.run(main, flags_parser=parse_flags_or_exit)
