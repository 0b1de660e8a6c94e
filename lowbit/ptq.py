"""Post-training quantization of Flax models: calibration, smoothing, SVDQuant, packing.

The question this answers: what does a trained float model lose when cast to MXFP8 / MXFP6 /
MXFP4 / NVFP4 / MXINT8 (or to 4-bit weights only), and how much of it do calibration,
SmoothQuant / AWQ-style smoothing and SVDQuant's low-rank branch give back.

- :func:`calibrate` runs the float model over calibration batches and records, at every site
  the rules quantize, statistics of the site's activation operand (a :class:`Histogram` of
  ``|x|``, the per-channel max, a sample of rows), through hooks in the ``lowbit.flax`` ops
  (the model's own GEMMs report their operands; there is no second model). It returns a
  :class:`Calibration`: a static amax per site by ``"max"``, ``"percentile"``, ``"mse"`` or
  ``"entropy"`` (see :func:`lowbit.calibrate.amax`), JSON-serialisable.
- :func:`smooth` finds SmoothQuant / AWQ per-channel scales ``s_j = max|X_j|^a /
  max|W_j|^(1-a)`` (``a`` searched per site on the calibration data, minimizing the site's
  output error); :func:`svdquant` adds SVDQuant's high-precision low-rank branch. Both return
  a :class:`Smoothing`.
- :func:`quantize` builds the packed model (weights as :class:`lowbit.QArray`, through the
  same quantizers as :func:`lowbit.flax.pack`) with the calibrated static activation scales,
  the smoothing vectors and low-rank branches as parameters; :func:`simulate` the same model
  fake-quantized (float weights, quantized in every call), equal to it bit for bit.

What a calibrated amax does to an activation (``QuantSpec.amax``): NVFP4 takes it as its
static per-tensor scale (the E4M3 block scales stay dynamic, as hardware computes them);
per-tensor FP8 scales by ``elem_max / amax``; an MX format, whose E8M0 block scales are dynamic
by definition, clips to ``+-amax`` before block quantization (a no-op for ``"max"`` on the
calibration data). Attention score / value products (``attn_scores`` / ``attn_values``,
both operands activations) keep their dynamic scales and are not calibrated.

Models: an NNX module, or a Linen module bound to its variables (``module.bind(variables)``).
``forward(model, batch)`` runs the model when that is not simply ``model(batch)``.

>>> import jax, jax.numpy as jnp, lowbit.flax as lbf, lowbit.ptq as ptq
>>> from flax import nnx
>>> model = nnx.Sequential(nnx.Linear(64, 128, rngs=nnx.Rngs(0)), nnx.relu,
...                        nnx.Linear(128, 32, rngs=nnx.Rngs(1)))
>>> batches = [jax.random.normal(jax.random.key(i), (16, 64)) for i in range(4)]
>>> rules = [(".*", "qat_nvfp4")]
>>> cal = ptq.calibrate(model, rules, batches, "mse")
>>> sorted(cal.amax), cal.method, cal.batches
(['layers/0', 'layers/2'], 'mse', 4)
>>> served = ptq.quantize(model, rules, cal)  # packed weights, static activation scales
>>> y = nnx.jit(lambda m, x: m(x))(served, batches[0])
>>> bool(jnp.all(y == nnx.jit(lambda m, x: m(x))(ptq.simulate(model, rules, cal), batches[0])))
True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import lowbit.flax as lbf
from lowbit import calibrate as _cal
from lowbit.core.qarray import QArray, dequantize
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.operand import quantize_operand
from lowbit.gemm.recipes import QuantSpec, Recipe

__all__ = [
    "Calibration",
    "Smoothing",
    "calibrate",
    "smooth",
    "svdquant",
    "quantize",
    "simulate",
    "site_rules",
    "bits_per_param",
    "ALPHAS",
    "WEIGHT_METHODS",
]

ALPHAS = tuple(i / 20 for i in range(21))  # the smoothing exponent grid, 0 .. 1
WEIGHT_METHODS = ("max", "mse")
MAX_ROWS = 2048  # activation rows kept per site for "mse" and the smoothing search
_ATTN = (lbf.ATTN_SCORES, lbf.ATTN_VALUES)


# --------------------------------------------------------------------------------------------
# Models (NNX, or a bound Linen module) and their sites


@dataclasses.dataclass
class _Model:
    fw: str  # "nnx" | "linen"
    model: Any  # the NNX model, or the unbound Linen module
    variables: Any = None  # Linen only

    @property
    def name(self) -> str:
        return type(self.model).__name__


def _as_model(model) -> _Model:
    fw = lbf.framework(model)
    if fw == "nnx":
        return _Model("nnx", model)
    if model.scope is None:
        raise TypeError(
            f"a Linen model must be bound to its variables: pass {type(model).__name__}"
            "(...).bind(variables) (module.bind returns a module that holds its parameters)"
        )
    module, variables = model.unbind()
    return _Model("linen", module, variables)


def _sites(m: _Model, rules: lbf.Rules, example) -> list[lbf.Site]:
    if m.fw == "nnx":
        return lbf.sites(m.model, rules)
    return lbf.sites(m.model, rules, example)


def _quantized_sites(site_list: list[lbf.Site], rules: lbf.Rules) -> list[lbf.Site]:
    """The sites whose activations PTQ calibrates: quantized, weight GEMMs (not attention)."""
    for rule in rules.rules:
        if not any(rule.regex.fullmatch(s.path) for s in site_list):
            known = ", ".join(repr(s.path) for s in site_list) or "none"
            raise ValueError(
                f"rules: rule {rule.pattern!r} reaches no site of the model (its sites: {known})"
            )
    return [
        s
        for s in site_list
        if s.kind not in _ATTN and rules.active(s.path) is not None and s.kernel is not None
    ]


def _activation_format(recipe: Recipe) -> str | None:
    spec = recipe.fwd.lhs
    if spec is None:
        return None
    return spec.format


def _check_packable(site: lbf.Site, recipe: Recipe) -> QuantSpec | None:
    spec = lbf.weight_spec(recipe, site.path)
    if recipe.fwd.lhs is not None and recipe.fwd.lhs.stochastic:
        raise ValueError(
            f"site {site.path!r}: recipe {recipe.name!r} rounds its activations stochastically "
            "in the forward; post-training quantization needs a deterministic forward (use a "
            "qat_* recipe or a Recipe of your own)"
        )
    return spec


# --------------------------------------------------------------------------------------------
# Calibration


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Calibrated static activation scales of a model's quantized sites.

    Attributes:
      amax: site path -> float32 amax of the site's activation input (by ``method``).
      method: ``"max"``, ``"percentile"``, ``"mse"`` or ``"entropy"``.
      batches: the number of calibration batches.
      percentile: the percentile of ``"percentile"``.
      formats: site path -> the activation's target format (None: the recipe keeps the
        activation in high precision, a weight-only site).
      weights: site path -> the shape of the site's weight (checked by :func:`quantize`).
      histograms: site path -> :class:`lowbit.calibrate.Histogram` of ``|x|``.
      channel_amax: site path -> float32 ``[K]``, the per-input-channel max of ``|x|``.
      samples: site path -> float32 ``[rows, K]``, the first activation rows seen (kept by
        ``calibrate(..., "mse")`` only, for ``"mse"``; not serialised).
    """

    amax: dict[str, float]
    method: str
    batches: int
    percentile: float = 99.99
    formats: dict[str, str | None] = dataclasses.field(default_factory=dict)
    weights: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    histograms: dict[str, _cal.Histogram] = dataclasses.field(default_factory=dict, repr=False)
    channel_amax: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)
    samples: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)
    model: str = ""

    def with_method(self, method: str, *, percentile: float | None = None) -> Calibration:
        """The same statistics with amaxes chosen by another method (``"mse"`` needs the
        activation samples, which only ``calibrate(..., "mse")`` keeps, and a calibration read
        back from JSON does not hold)."""
        p = self.percentile if percentile is None else percentile
        amax = {s: _site_amax(self, s, method, p) for s in self.formats}
        return dataclasses.replace(self, amax=amax, method=method, percentile=p)

    def rules(self, rules) -> list[tuple[str, Recipe]]:
        """``rules`` with, in front, one rule per calibrated site whose recipe quantizes the
        activation with the site's static amax: ``lowbit.flax.quantize(model,
        cal.rules(rules))`` is the fake-quantized model with these scales."""
        return site_rules(rules, self)

    def to_json(self) -> dict:
        """A JSON-serialisable dict (``json.dumps`` it); :meth:`from_json` reads it back."""
        return {
            "method": self.method,
            "batches": self.batches,
            "percentile": self.percentile,
            "model": self.model,
            "amax": {k: float(v) for k, v in self.amax.items()},
            "formats": dict(self.formats),
            "weights": {k: list(v) for k, v in self.weights.items()},
            "channel_amax": {k: np.asarray(v, np.float32).tolist()
                             for k, v in self.channel_amax.items()},
            "histograms": {
                k: {"counts": np.asarray(h.counts).tolist(), "width_exp": int(h.width_exp),
                    "max": float(h.max), "nonfinite": int(h.nonfinite)}
                for k, h in self.histograms.items()
            },
        }

    @classmethod
    def from_json(cls, d: dict) -> Calibration:
        missing = {"method", "batches", "amax"} - set(d)
        if missing:
            raise ValueError(f"Calibration.from_json: missing keys {sorted(missing)}")
        hists = {
            k: _cal.Histogram(
                counts=jnp.asarray(h["counts"], jnp.int32),
                width_exp=jnp.int32(h["width_exp"]),
                max=jnp.float32(h["max"]),
                nonfinite=jnp.int32(h.get("nonfinite", 0)),
            )
            for k, h in d.get("histograms", {}).items()
        }
        return cls(
            amax={k: float(np.float32(v)) for k, v in d["amax"].items()},
            method=d["method"],
            batches=int(d["batches"]),
            percentile=float(d.get("percentile", 99.99)),
            formats=dict(d.get("formats", {})),
            weights={k: tuple(v) for k, v in d.get("weights", {}).items()},
            histograms=hists,
            channel_amax={k: np.asarray(v, np.float32)
                          for k, v in d.get("channel_amax", {}).items()},
            model=d.get("model", ""),
        )

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write :meth:`to_json` to ``path`` (a ``.json`` file)."""
        path = pathlib.Path(path)
        path.write_text(json.dumps(self.to_json()) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        return cls.from_json(json.loads(pathlib.Path(path).read_text()))


def _site_amax(cal: Calibration, site: str, method: str, percentile: float) -> float:
    fmt = cal.formats.get(site)
    if method not in _cal.METHODS:
        raise ValueError(f"unknown method={method!r}; valid methods: {_cal.METHODS}")
    if method in ("mse", "entropy") and fmt is None:
        method = "max"  # a weight-only site: no activation quantizer to fit
    if method == "mse":
        if site not in cal.samples or cal.samples[site].shape[0] == 0:
            raise ValueError(
                f"site {site!r}: method='mse' needs the activation samples, which this "
                "calibration does not hold (read from JSON): calibrate again"
            )
        return float(_cal.amax(cal.samples[site], "mse", format=fmt, axis=-1))
    return float(_cal.amax(cal.histograms[site], method, format=fmt, percentile=percentile))


def _stats_of(lhs, axes: tuple[int, ...], max_rows: int) -> dict:
    """One call's statistics of a site's activation ``lhs`` contracted over ``axes``."""
    x = jnp.moveaxis(lhs, axes, tuple(range(lhs.ndim - len(axes), lhs.ndim)))
    k = math.prod(x.shape[lhs.ndim - len(axes):])
    x = x.reshape(-1, k).astype(jnp.float32)
    return {
        "hist": _cal.Histogram.of(x),
        "chan": jnp.max(jnp.abs(x), axis=0),
        "rows": x[:max_rows],
    }


def _merge_stats(a: dict | None, b: dict, max_rows: int) -> dict:
    if a is None:
        return {"hist": b["hist"], "chan": np.asarray(b["chan"]), "rows": np.asarray(b["rows"])}
    rows = a["rows"]
    if rows.shape[0] < max_rows:
        rows = np.concatenate([rows, np.asarray(b["rows"])[: max_rows - rows.shape[0]]])
    return {
        "hist": a["hist"].merge(b["hist"]),
        "chan": np.maximum(a["chan"], np.asarray(b["chan"])),
        "rows": rows,
    }


def _observe_batches(m: _Model, rules: lbf.Rules, batches, forward, smoothing, max_rows: int,
                     example=None):
    """Run the float model (with ``smoothing`` applied) over ``batches``; per-site stats."""
    batches = iter(batches) if not isinstance(batches, (list, tuple)) else iter(list(batches))
    first = next(batches, None)
    if first is None:
        raise ValueError("calibrate: batches is empty; calibration needs at least one batch")
    if m.fw == "linen" and example is None:
        if forward is not None:
            raise TypeError(
                "a Linen model run by forward= needs example= (the inputs its sites are "
                "traced with, e.g. the first batch's model input)"
            )
        example = first
    site_list = _sites(m, rules, example)
    sites = _quantized_sites(site_list, rules)
    if smoothing is not None:
        smoothing.check(sites, rules)
    run = _observer_fn(m, rules, sites, forward, smoothing, max_rows)
    stats: dict[str, dict] = {}
    n = 0
    for batch in _chain(first, batches):
        for site, s in run(batch):  # in the order the forward reaches them
            bad = int(s["hist"].nonfinite)
            if bad:
                raise ValueError(
                    f"calibrate: the activation of site {site!r} holds NaN or Inf in batch "
                    f"{n} ({bad} values); calibration data must give finite activations"
                )
            stats[site] = _merge_stats(stats.get(site), s, max_rows)
        n += 1
    missing = [s.path for s in sites if s.path not in stats]
    if missing:
        raise ValueError(
            f"calibrate: site(s) {missing} were never reached while running the model on the "
            "calibration batches (does forward= call the model's method that uses them?)"
        )
    return sites, stats, n


def _chain(first, rest):
    yield first
    yield from rest


def _call_model(model, batch):
    return model(batch)


def _collect(fn, wanted: frozenset, max_rows: int) -> dict[str, dict]:
    """Run ``fn`` observing the ``wanted`` sites: ``{"<call index>|<site>": stats}`` (the
    keys sort in the order the forward reaches the sites; a site called twice has two)."""
    rec: dict[str, dict] = {}

    def obs(site, lhs, axes):
        if site in wanted:
            rec[f"{len(rec):06d}|{site}"] = _stats_of(lhs, axes, max_rows)

    with lbf.observing(obs):
        fn()
    return rec


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _observe_nnx(graphdef, call, wanted, max_rows, state, batch):
    from flax import nnx

    model = nnx.merge(graphdef, state)
    return _collect(lambda: call(model, batch), wanted, max_rows)


def _observer_fn(m: _Model, rules, sites, forward, smoothing, max_rows):
    """A function batch -> ``[(site, stats), ...]`` in the order the forward reaches the sites
    (one entry per call of a site), jitted (NNX: compiled once per model structure, forward
    and batch shape, across calls of :func:`calibrate`)."""
    wanted = frozenset(s.path for s in sites)
    call = forward or _call_model

    def ordered(rec):
        return [(k.split("|", 1)[1], v) for k, v in sorted(rec.items())]

    if m.fw == "nnx":
        from flax import nnx

        obs_model = _transformed_nnx(m.model, sites, rules, smoothing, mode="observe")
        graphdef, state = nnx.split(obs_model)
        return lambda batch: ordered(_observe_nnx(graphdef, call, wanted, max_rows, state, batch))

    module = lbf.linen.Quantized(m.model, lbf.Rules.of(rules), observe=True)
    variables = _transformed_linen_vars(m.variables, sites, smoothing)

    @jax.jit
    def run_linen(variables, batch):
        return _collect(lambda: call(module.bind(variables), batch), wanted, max_rows)

    return lambda batch: ordered(run_linen(variables, batch))


def calibrate(
    model,
    rules,
    batches: Iterable,
    method: str = "max",
    *,
    forward: Callable | None = None,
    percentile: float = 99.99,
    smoothing: Smoothing | None = None,
    max_rows: int = MAX_ROWS,
    example=None,
) -> Calibration:
    """Run the float ``model`` over ``batches`` and calibrate every site ``rules`` quantize.

    Args:
      model: an NNX model, or a Linen module bound to its variables.
      rules: ``lowbit.flax`` rules (``[(path_regex, recipe), ...]``): the sites and formats
        of the post-training quantization. Every rule must reach a site.
      batches: an iterable of model inputs (at least one); ``forward(model, batch)`` runs
        the model on one (default ``model(batch)``).
      method: how each site's amax is chosen (:data:`lowbit.calibrate.METHODS`), in its
        recipe's activation format.
      percentile: for ``"percentile"``.
      smoothing: a :class:`Smoothing` (from :func:`smooth` / :func:`svdquant`): calibrate the
        smoothed activations ``x / s`` that the quantizer will see.
      max_rows: activation rows kept per site for ``"mse"`` (other methods keep none).
      example: Linen with ``forward=`` only: inputs to trace the module's sites with.

    Raises ``ValueError`` naming the problem: no batches, a rule that reaches no site, a site
    never reached, NaN or Inf in a site's activations, an unknown method.
    """
    if method not in _cal.METHODS:
        raise ValueError(f"calibrate: unknown method={method!r}; valid methods: {_cal.METHODS}")
    if method == "percentile":
        _cal.amax(jnp.ones(1), "percentile", percentile=percentile)  # checks the percentile
    m = _as_model(model)
    rules = lbf.Rules.of(rules)
    if method != "mse":  # the samples serve "mse" only: not copied out for the others
        max_rows = 0
    sites, stats, n = _observe_batches(m, rules, batches, forward, smoothing, max_rows, example)
    base = Calibration(
        amax={},
        method=method,
        batches=n,
        percentile=float(percentile),
        formats={s.path: _activation_format(rules.active(s.path)) for s in sites},
        weights={s.path: tuple(s.shape) for s in sites},
        histograms={s.path: stats[s.path]["hist"] for s in sites},
        channel_amax={s.path: np.asarray(stats[s.path]["chan"], np.float32) for s in sites},
        samples={s.path: np.asarray(stats[s.path]["rows"], np.float32) for s in sites},
        model=m.name,
    )
    return base.with_method(method, percentile=percentile)


def _with_amax(recipe: Recipe, amax: float | None) -> Recipe:
    if amax is None or recipe.fwd.lhs is None:
        return recipe
    a = float(amax) if amax > 0 else float(np.finfo(np.float32).tiny)
    lhs = dataclasses.replace(recipe.fwd.lhs, amax=a)
    return dataclasses.replace(
        recipe,
        name=f"{recipe.name}+amax",
        fwd=dataclasses.replace(recipe.fwd, lhs=lhs),
        description=f"{recipe.name} with a static (calibrated) activation amax {a:.6g}",
    )


def site_rules(rules, calibration: Calibration | None) -> list[tuple[str, Recipe]]:
    """``rules`` preceded by one exact-path rule per calibrated site, whose recipe holds the
    site's static activation amax (:func:`lowbit.calibrate` methods; ``QuantSpec.amax``)."""
    rules = lbf.Rules.of(rules)
    out: list[tuple[str, Recipe]] = []
    if calibration is not None:
        for site, a in calibration.amax.items():
            r = rules.active(site)
            if r is None:
                raise ValueError(
                    f"calibration site {site!r} is not quantized by these rules (a calibration "
                    "of another model or other rules?)"
                )
            out.append((re.escape(site), _with_amax(r, a)))
    return out + [(r.pattern, r.recipe) for r in rules.rules]


# --------------------------------------------------------------------------------------------
# Smoothing and SVDQuant


@dataclasses.dataclass(frozen=True)
class Smoothing:
    """Per-site smoothing scales and (SVDQuant) low-rank branches of dense sites.

    Attributes:
      scales: site path -> float32 ``[K]``: the activation is divided by ``s``, the weight's
        input channel ``j`` multiplied by ``s_j`` (``x W = (x / s) (diag(s) W)``).
      alpha: site path -> the exponent ``a`` of ``s_j = max|X_j|^a / max|W_j|^(1 - a)``
        (None: the scales were given).
      lowrank: site path -> ``(L1 [K, r], L2 [r, N])`` (their dtype is what is stored), the
        high-precision branch; the quantized weight is the residual
        ``diag(s) W - L1 @ L2``.
      errors: site path -> the relative output error ``|y_q - y|^2 / |y|^2`` on the
        calibration rows with the chosen scales (and branch).
    """

    scales: dict[str, np.ndarray]
    alpha: dict[str, float | None] = dataclasses.field(default_factory=dict)
    lowrank: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    errors: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((a.shape[1] for a, _ in self.lowrank.values()), default=0)

    def check(self, sites: list[lbf.Site], rules: lbf.Rules) -> None:
        """Every smoothed site must be a dense quantized site with a matching ``[K]``."""
        by_path = {s.path: s for s in sites}
        for path, s in self.scales.items():
            site = by_path.get(path)
            if site is None:
                raise ValueError(
                    f"smoothing site {path!r} is not a quantized site of this model under these "
                    f"rules (its sites: {sorted(by_path)})"
                )
            dense = site.layout == lbf.Layout(0, 1) and len(site.shape) == 2
            if site.kind != "dot_general" or not dense:
                raise ValueError(
                    f"smoothing site {path!r} ({site.module}): smoothing needs a dense [K, N] "
                    f"weight (Linear / Dense), got kind {site.kind!r}, shape {site.shape}"
                )
            if np.shape(s) != (site.shape[0],):
                raise ValueError(
                    f"smoothing site {path!r}: scales of shape {np.shape(s)}, expected "
                    f"({site.shape[0]},) (the weight {site.shape} of another model?)"
                )
            if path in self.lowrank:
                a, b = self.lowrank[path]
                if a.shape[0] != site.shape[0] or b.shape[1] != site.shape[1]:
                    raise ValueError(
                        f"smoothing site {path!r}: low-rank factors {a.shape} x {b.shape} do not "
                        f"fit the weight {site.shape}"
                    )


def _dense_sites(sites: list[lbf.Site], where: str) -> list[lbf.Site]:
    out = []
    for s in sites:
        if s.kind == "dot_general" and s.layout == lbf.Layout(0, 1) and len(s.shape) == 2:
            out.append(s)
    if not out:
        raise ValueError(f"{where}: the rules quantize no dense [K, N] site (Linear / Dense)")
    return out


def _kernel_value(m: _Model, site: lbf.Site) -> np.ndarray:
    """The float32 value of a site's weight."""
    if m.fw == "nnx":
        from flax import nnx

        tree = nnx.state(m.model, nnx.Param)
    else:
        tree = m.variables["params"]
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if lbf.path_str(lbf.keypath_str(keypath)) == site.kernel:
            return np.asarray(leaf, np.float32)
    raise KeyError(f"site {site.path!r}: no parameter {site.kernel!r}")


@jax.jit
def _rel_err(y, ref):
    return jnp.sum(jnp.square(y - ref)) / jnp.maximum(jnp.sum(jnp.square(ref)), 1e-30)


def _quant_w(w, spec: QuantSpec | None):
    return w if spec is None else _fake_w(w, spec)


def _fake_w(w, spec):
    return _jit_operand(jnp.asarray(w, jnp.float32), spec, 0, 1)


def _fake_x(x, spec: QuantSpec | None):
    if spec is None:
        return jnp.asarray(x, jnp.float32)
    return _jit_operand(jnp.asarray(x, jnp.float32), spec, 1, 0)


_jit_operand = jax.jit(
    lambda x, spec, axis, other: quantize_operand(x, spec, axis, other, None),
    static_argnums=(1, 2, 3),
)


def _svd(w: np.ndarray, rank: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    u, sv, vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
    r = np.sqrt(sv[:rank])
    a = (u[:, :rank] * r).astype(np.float32)
    b = (r[:, None] * vt[:rank]).astype(np.float32)
    return np.asarray(jnp.asarray(a, dtype)), np.asarray(jnp.asarray(b, dtype))


def _branch(ws: np.ndarray, spec, rank: int, iterations: int, dtype):
    """SVDQuant's branch of the smoothed weight ``ws``: ``L = SVD_r(ws)``, then ``iterations``
    refinements ``L <- SVD_r(ws - Q(ws - L))``. Returns the factors and the residual."""
    a, b = _svd(ws, rank, dtype)
    for _ in range(iterations):
        low = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
        q = np.asarray(_quant_w(ws - low, spec))
        a, b = _svd(ws - q, rank, dtype)
    low = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    return (a, b), ws - low


def _scales(xmax: np.ndarray, wmax: np.ndarray, alpha: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.power(xmax.astype(np.float64), alpha) / np.power(wmax.astype(np.float64),
                                                                1.0 - alpha)
    ok = np.isfinite(s) & (s > 0) & (xmax > 0) & (wmax > 0)
    return np.where(ok, np.clip(s, 1e-6, 1e6), 1.0).astype(np.float32)


def _search(x, w, xmax, recipe: Recipe, alphas, rank, iterations, dtype, smoothing: bool,
            fixed=None):
    """The scales (and branch) of least output error on the calibration rows ``x``; ``fixed``:
    ``(alpha, s)`` given, not searched."""
    spec_x, spec_w = recipe.fwd.lhs, lbf.weight_spec(recipe)
    ref = jnp.asarray(x) @ jnp.asarray(w)
    wmax = np.max(np.abs(w), axis=1)
    best = None
    for a in (alphas if smoothing and fixed is None else (None,)):
        if fixed is not None:
            a, s = fixed
            s = np.asarray(s, np.float32)
        else:
            s = _scales(xmax, wmax, a) if a is not None else np.ones(w.shape[0], np.float32)
        xs = np.asarray(jnp.asarray(x) / s[None, :])
        ws = np.asarray(s[:, None] * w, np.float32)
        lowrank, resid = (None, ws) if rank == 0 else _branch(ws, spec_w, rank, iterations, dtype)
        y = _fake_x(xs, spec_x) @ _quant_w(resid, spec_w)
        if lowrank is not None:
            y = y + (jnp.asarray(xs) @ np.asarray(lowrank[0], np.float32)) @ np.asarray(
                lowrank[1], np.float32
            )
        err = float(_rel_err(y, ref))
        if best is None or err < best[0]:
            best = (err, a, s, lowrank)
    return best


def _smoothing(model, rules, batches, alpha, rank, iterations, *, forward, example, dtype,
               smoothing, max_rows: int, where: str) -> Smoothing:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{where}: rank must be a non-negative int, got {rank!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"{where}: iterations must be a non-negative int, got {iterations!r}")
    if alpha is None:
        alphas = ALPHAS
    else:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"{where}: alpha must be None (searched) or in [0, 1], got {alpha!r}")
        alphas = (float(alpha),)
    given = smoothing if isinstance(smoothing, Smoothing) else None
    if not (isinstance(smoothing, bool) or smoothing is None or given is not None):
        raise TypeError(
            f"{where}: smoothing must be None / False (s = 1), True (searched) or a Smoothing "
            f"(from smooth()), got {type(smoothing).__name__}"
        )
    m = _as_model(model)
    rules = lbf.Rules.of(rules)
    sites, stats, _ = _observe_batches(m, rules, batches, forward, None, max_rows, example)
    if given is not None:
        given.check(sites, rules)
    scales, alpha_of, lowrank, errors = {}, {}, {}, {}
    for site in _dense_sites(sites, where):
        recipe = rules.active(site.path)
        _check_packable(site, recipe)
        if rank > min(site.shape):
            raise ValueError(
                f"{where}: rank={rank} exceeds the weight {site.shape} of site {site.path!r}"
            )
        w = _kernel_value(m, site)
        st = stats[site.path]
        fixed = None
        if given is not None and site.path in given.scales:
            fixed = (given.alpha.get(site.path), given.scales[site.path])
        err, a, s, lr = _search(st["rows"], w, st["chan"], recipe, alphas, rank, iterations,
                                dtype, smoothing is True, fixed)
        scales[site.path], alpha_of[site.path], errors[site.path] = s, a, err
        if lr is not None:
            lowrank[site.path] = lr
    return Smoothing(scales, alpha_of, lowrank, errors)


def smooth(
    model,
    rules,
    batches: Iterable,
    alpha: float | None = None,
    *,
    forward: Callable | None = None,
    example=None,
    max_rows: int = MAX_ROWS,
) -> Smoothing:
    """SmoothQuant / AWQ-lite smoothing of every dense site ``rules`` quantize.

    Per input channel ``j``, ``s_j = max|X_j|^a / max|W_j|^(1-a)`` (``max|X_j|`` over the
    calibration batches, ``max|W_j|`` over the weight's row ``j``; channels where either is 0
    keep ``s_j = 1``). The activation is divided by ``s`` at the site and the weight's row ``j``
    multiplied by ``s_j``: exact in real arithmetic, it moves activation outliers into the
    weights (SmoothQuant, Xiao et al. 2023) and, for weight-only recipes, protects the
    weight channels that large activations read (AWQ, Lin et al. 2024). ``alpha`` None:
    ``a`` is searched per site over :data:`ALPHAS`, minimizing the site's relative output
    error ``|Q(X/s) Q(diag(s) W) - X W|^2 / |X W|^2`` on the calibration rows (activations
    with their dynamic scales, weights as packed).

    Returns a :class:`Smoothing` for :func:`calibrate` / :func:`quantize` (``smoothing=``).
    """
    return _smoothing(model, rules, batches, alpha, 0, 0, forward=forward, example=example,
                      dtype=jnp.float32, smoothing=True, max_rows=max_rows, where="smooth")


def svdquant(
    model,
    rules,
    batches: Iterable,
    rank: int = 32,
    *,
    smoothing: Smoothing | bool | None = None,
    alpha: float | None = None,
    iterations: int = 0,
    branch_dtype=jnp.bfloat16,
    forward: Callable | None = None,
    example=None,
    max_rows: int = MAX_ROWS,
) -> Smoothing:
    """SVDQuant (Li et al. 2025): a high-precision low-rank branch after smoothing.

    Per dense site, the smoothed weight ``W' = diag(s) W`` is split into ``L1 @ L2`` from its
    rank-``rank`` SVD (``L1 = U_r sqrt(S_r)``, ``L2 = sqrt(S_r) V_r^T``, stored in
    ``branch_dtype``, 16-bit as in the paper) and the residual ``W' - L1 L2``, which is
    quantized to the site's format. ``iterations`` refinements ``L <- SVD_r(W' - Q(W' - L))``
    fit the branch to what quantization loses. The branch runs in float32 on the smoothed
    activation ``x / s``.

    ``smoothing``: the scales ``s``: a :class:`Smoothing` from :func:`smooth` (the paper's
    order: smooth, then decompose), True (``a`` searched as in :func:`smooth` but with the
    branch in place, or ``alpha`` if given), or None / False (``s = 1``: no smoothing, so
    ``rank=0`` is plain post-training quantization exactly).

    Returns a :class:`Smoothing` holding the scales and the branches. Its bits count in
    :func:`bits_per_param`.
    """
    return _smoothing(model, rules, batches, alpha, rank, iterations, forward=forward,
                      example=example, dtype=branch_dtype, smoothing=smoothing,
                      max_rows=max_rows, where="svdquant")


# --------------------------------------------------------------------------------------------
# Building the transformed models


def _site_kernel(w: np.ndarray, path: str, smoothing: Smoothing | None, dtype) -> Any:
    """The weight a site holds: ``diag(s) W - L1 L2`` (as float32 math), in ``dtype``."""
    if smoothing is None or path not in smoothing.scales:
        return None
    ws = np.asarray(smoothing.scales[path], np.float32)[:, None] * np.asarray(w, np.float32)
    if path in smoothing.lowrank:
        a, b = smoothing.lowrank[path]
        ws = ws - np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    return jnp.asarray(ws, dtype)


def _site_state(path: str, smoothing: Smoothing | None) -> dict:
    if smoothing is None or path not in smoothing.scales:
        return {}
    out = {"smooth": jnp.asarray(smoothing.scales[path], jnp.float32)}
    if path in smoothing.lowrank:
        out["lowrank"] = tuple(jnp.asarray(v) for v in smoothing.lowrank[path])
    return out


def _transformed_nnx(model, sites, rules: lbf.Rules, smoothing, *, mode: str,
                     calibration=None, implementation=None, kernels=None):
    """A clone of ``model`` whose quantized sites hold lowbit ops with their PTQ state.

    mode: ``"observe"`` (float GEMMs, observed), ``"simulate"`` (fake-quantized, static
    amaxes) or ``"serve"`` (serving recipes: weights enter as they are, pre-quantized)."""
    from flax import nnx

    new = nnx.clone(model)
    modules = {lbf.path_str(p): m for p, m in nnx.iter_modules(new)}
    plan = []
    for site in sites:
        m = modules[site.path]
        r = rules.active(site.path)
        if mode == "observe":
            recipe = _recipes.get("none")
        else:
            amax = calibration.amax.get(site.path) if calibration is not None else None
            recipe = _with_amax(r, amax)
            if mode == "serve":
                recipe = lbf.serving_recipe(recipe)
        state = _site_state(site.path, smoothing)
        w = None
        if kernels is not None and site.path in kernels:
            w = kernels[site.path]
        elif state:
            w = _site_kernel(m.kernel.get_value(), site.path, smoothing, m.kernel.dtype)
        if site.kind == "einsum":
            op = lbf.nnx.Einsum(recipe, implementation=implementation, site=site.path)
            plan.append((m, "einsum_op", op, w))
        else:
            op = lbf.nnx.DotGeneral(recipe, implementation=implementation, site=site.path,
                                    **state)
            plan.append((m, "dot_general", op, w))
    for m, attr, op, w in plan:
        setattr(m, attr, nnx.data(op))
        if attr == "dot_general" and getattr(m, "dot_general_cls", None) is not None:
            m.dot_general_cls = None
        if w is not None:
            m.kernel.set_value(w)
    return new


def _get(tree, parts):
    for p in parts:
        tree = tree[p]
    return tree


def _set(tree, parts, value):
    """A copy of nested dict ``tree`` with ``value`` at ``parts`` (dicts copied on the path)."""
    out = dict(tree)
    if len(parts) == 1:
        out[parts[0]] = value
    else:
        out[parts[0]] = _set(tree.get(parts[0], {}), parts[1:], value)
    return out


def _transformed_linen_vars(variables, sites, smoothing, kernels=None):
    """Linen variables whose smoothed sites hold the folded weight and their PTQ state."""
    params = variables["params"]
    for site in sites:
        kparts = site.kernel.split("/")
        w = kernels.get(site.path) if kernels is not None else None
        state = _site_state(site.path, smoothing)
        if w is None and state:
            k = _get(params, kparts)
            w = _site_kernel(k, site.path, smoothing, jnp.asarray(k).dtype)
        if w is not None:
            params = _set(params, kparts, w)
        if "smooth" in state:
            params = _set(params, kparts[:-1] + [lbf.linen.SMOOTH_PARAM], state["smooth"])
        if "lowrank" in state:
            for name, v in zip(lbf.linen.LOWRANK_PARAMS, state["lowrank"], strict=True):
                params = _set(params, kparts[:-1] + [name], v)
    return {**variables, "params": params}


# --------------------------------------------------------------------------------------------
# quantize / simulate


def _prepare(model, rules, calibration, smoothing, weights, example, where):
    if weights not in WEIGHT_METHODS:
        raise ValueError(f"{where}: unknown weights={weights!r}; valid: {WEIGHT_METHODS}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"{where}: calibration must be a Calibration, got {type(calibration)}")
    if smoothing is not None and not isinstance(smoothing, Smoothing):
        raise TypeError(f"{where}: smoothing must be a Smoothing, got {type(smoothing)}")
    m = _as_model(model)
    rules = lbf.Rules.of(rules)
    if m.fw == "linen" and example is None:
        raise TypeError(
            f"{where}: a Linen model needs example= (inputs to trace its sites with, e.g. one "
            "calibration batch)"
        )
    sites = _quantized_sites(_sites(m, rules, example), rules)
    for s in sites:
        _check_packable(s, rules.active(s.path))
    if calibration is not None:
        have = {s.path: s for s in sites}
        extra = sorted(set(calibration.amax) - set(have))
        missing = sorted(set(have) - set(calibration.amax))
        if extra or missing:
            of = f" ({calibration.model})" if calibration.model else ""
            raise ValueError(
                f"{where}: the calibration does not match this model and rules: sites "
                f"{missing} are not calibrated, calibrated sites {extra} are not in the model "
                f"(a calibration of another model{of}?)"
            )
        for p, s in have.items():
            shape = calibration.weights.get(p)
            if shape is not None and tuple(shape) != tuple(s.shape):
                raise ValueError(
                    f"{where}: site {p!r} has a weight of shape {tuple(s.shape)}, the calibration "
                    f"was made with {tuple(shape)} (a calibration of another model?)"
                )
    if smoothing is not None:
        smoothing.check(sites, rules)
    return m, rules, sites


def _packed_weight(w, spec: QuantSpec, layout: lbf.Layout, weights: str) -> QArray:
    if weights == "max":
        return lbf.pack_weight(w, spec, layout)
    two_d = spec.block_shape is not None and len(spec.block_shape) == 2
    axis = (layout.axis, layout.other_axis) if two_d else layout.axis
    return _cal.block_scales(w, spec.format, "mse", axis=axis, block_shape=spec.block_shape)


def _weights(m: _Model, sites, rules, smoothing, weights) -> dict[str, Any]:
    """site path -> the packed weight (QArray) of the transformed model; a weight-only
    recipe that keeps the weight in float too (then the float weight)."""
    out = {}
    for site in sites:
        spec = lbf.weight_spec(rules.active(site.path), site.path)
        w = _kernel_value(m, site)
        folded = _site_kernel(w, site.path, smoothing, jnp.float32)
        w = jnp.asarray(w) if folded is None else folded
        out[site.path] = w if spec is None else _packed_weight(w, spec, site.layout, weights)
    return out


def quantize(
    model,
    rules,
    calibration: Calibration | None = None,
    *,
    weights: str = "max",
    smoothing: Smoothing | None = None,
    implementation: str | None = None,
    example=None,
):
    """The post-training-quantized model: packed weights, static activation scales.

    Each site ``rules`` quantize gets its weight quantized once, as its recipe's forward
    quantizes it (the format, blocks along the contraction axis, 2-D tiles), into a
    :class:`lowbit.QArray` (``weights="max"``: the standard scales; ``"mse"``: per-block
    scale search, :func:`lowbit.calibrate.block_scales`), and its activation quantized in
    every call with the calibrated static amax (``calibration``; None: dynamic scales, a
    direct cast). ``smoothing`` (:func:`smooth` / :func:`svdquant`): smoothed sites hold the
    folded weight ``diag(s) W - L1 L2`` (packed), the vector ``s`` and the branch as
    parameters. Sites no rule quantizes stay as they are.

    Returns, for an NNX model, a :class:`lowbit.flax.nnx.PackedModel` (call it like the
    model; ``nnx.state`` of it saves with :func:`lowbit.flax.save`); for a bound Linen module,
    the serving module bound to its packed variables (``module, variables = out.unbind()``;
    ``example=`` is then needed to trace the sites).

    Raises ``ValueError`` for a calibration or smoothing of another model (sites or shapes
    that do not match), an unknown ``weights`` method, or a recipe that cannot be packed.
    """
    m, rules, sites = _prepare(model, rules, calibration, smoothing, weights, example,
                               "quantize")
    packed_w = _weights(m, sites, rules, smoothing, weights)
    if m.fw == "nnx":
        from flax import nnx

        serving = _transformed_nnx(m.model, sites, rules, smoothing, mode="serve",
                                   calibration=calibration, implementation=implementation)
        state = nnx.state(serving, nnx.Param)
        by_kernel = {s.kernel: packed_w[s.path] for s in sites}

        def put(keypath, leaf):
            name = lbf.path_str(lbf.keypath_str(keypath))
            return by_kernel.get(name, leaf)

        packed = jax.tree_util.tree_map_with_path(put, state, is_leaf=lbf.is_qarray)
        return lbf.nnx.PackedModel(serving, None, packed)
    variables = _transformed_linen_vars(m.variables, sites, smoothing, kernels=packed_w)
    module = lbf.linen.quantize(m.model, site_rules(rules, calibration), packed=True,
                                implementation=implementation)
    return module.bind(variables)


def simulate(
    model,
    rules,
    calibration: Calibration | None = None,
    *,
    weights: str = "max",
    smoothing: Smoothing | None = None,
    implementation: str | None = None,
    example=None,
):
    """The fake-quantized counterpart of :func:`quantize`: float (folded) weights quantized in
    every call by the sites' recipes with the calibrated static amaxes. Its outputs equal the
    packed model's bit for bit. With ``weights="mse"`` the weights it holds are the searched
    QArrays dequantized, entering their GEMMs as they are (a standard-scale requantization
    would undo the search). Returns an NNX model, or a bound Linen module."""
    m, rules, sites = _prepare(model, rules, calibration, smoothing, weights, example,
                               "simulate")
    kernels = None
    if weights == "mse":
        kernels = {p: (dequantize(w, jnp.float32) if isinstance(w, QArray) else w)
                   for p, w in _weights(m, sites, rules, smoothing, weights).items()}
    mode = "serve" if weights == "mse" else "simulate"
    if m.fw == "nnx":
        return _transformed_nnx(m.model, sites, rules, smoothing, mode=mode,
                                calibration=calibration, implementation=implementation,
                                kernels=kernels)
    variables = _transformed_linen_vars(m.variables, sites, smoothing, kernels=kernels)
    module = lbf.linen.quantize(m.model, site_rules(rules, calibration),
                                packed=(mode == "serve"), implementation=implementation)
    if mode == "serve":  # the serving module reads QArrays: hand it the searched ones
        variables = _transformed_linen_vars(
            m.variables, sites, smoothing, kernels=_weights(m, sites, rules, smoothing, weights)
        )
    return module.bind(variables)


# --------------------------------------------------------------------------------------------
# Bits


def bits_per_param(packed) -> dict[str, float]:
    """Storage of a :func:`quantize`'d model, in bits per parameter.

    Returns ``{"weights": ..., "model": ...}``: ``"weights"`` over the quantized sites'
    weights (QArray codes and scales, plus any smoothing vectors and low-rank branches,
    divided by the number of weight elements), ``"model"`` over every parameter (other
    leaves in their dtype's bits), divided by the float model's parameter count."""
    if lbf.framework(packed) == "nnx":
        tree = packed.params
    else:
        tree = packed.unbind()[1]["params"]
    q_bits = q_n = extra = total_bits = total_n = 0.0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lbf.is_qarray)[0]:
        names = lbf.keypath_str(keypath)
        if lbf.is_qarray(leaf):
            n = math.prod(leaf.shape)
            bits = 8.0 * leaf.nbytes
            q_bits, q_n = q_bits + bits, q_n + n
        else:
            n = math.prod(np.shape(leaf))
            bits = 8.0 * n * np.dtype(leaf.dtype).itemsize
            last = names[-1] if names else ""
            if last in ("smooth", "lowrank_a", "lowrank_b", lbf.linen.SMOOTH_PARAM,
                        *lbf.linen.LOWRANK_PARAMS):
                extra += bits
                total_bits += bits
                continue
        total_bits, total_n = total_bits + bits, total_n + n
    return {
        "weights": (q_bits + extra) / q_n if q_n else float("nan"),
        "model": total_bits / total_n if total_n else float("nan"),
    }
