"""Calibration: the float model run over batches with hooks at its sites, a static amax per site."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import calibrate as _cal
from lowbit.flax._core import Rules, observing
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.recipes import Recipe
from lowbit.ptq.sites import (
    MAX_ROWS,
    Model,
    activation_format,
    as_model,
    chain,
    model_sites,
    quantized_sites,
)
from lowbit.ptq.transforms import Smoothing, edits


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
      hessians: site path -> float32 ``[K, K]``, ``sum x^T x`` of the site's activation over
        every calibration token (``calibrate(..., hessians=True)`` only; not serialised); a
        grouped site's (``lb.ragged_dot``, the experts of an MoE): ``[G, K, K]``, each
        group's over the tokens routed to it.
      group_tokens: grouped site path -> the calibration tokens each group (expert) got; a
        group with none has no Hessian (GPTQ falls back to round-to-nearest for it) and its
        activation statistics are the other groups'.
      rotations: site path -> the block of the Hadamard rotation the activation had when it
        was calibrated (``calibrate(..., smoothing=ptq.rotation(...))``); its statistics and
        Hessian are the rotated activation's.
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
    hessians: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)
    rotations: dict[str, int] = dataclasses.field(default_factory=dict)
    model: str = ""
    group_tokens: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

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
            "rotations": dict(self.rotations),
            "group_tokens": {k: [int(n) for n in v] for k, v in self.group_tokens.items()},
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
            rotations={k: int(v) for k, v in d.get("rotations", {}).items()},
            histograms=hists,
            channel_amax={k: np.asarray(v, np.float32)
                          for k, v in d.get("channel_amax", {}).items()},
            model=d.get("model", ""),
            group_tokens={k: tuple(int(n) for n in v)
                          for k, v in d.get("group_tokens", {}).items()},
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


def _stats_of(lhs, axes: tuple[int, ...], max_rows: int, hessians: bool = False,
              group_sizes=None) -> dict:
    """One call's statistics of a site's activation ``lhs`` contracted over ``axes``; with
    ``hessians``, also ``x^T x`` over the call's tokens (float32 products, float32 sums).
    A grouped site (``group_sizes``, ``lhs [M, K]`` with rows sorted by group): the rows in
    a group only, a Hessian per group ``[G, K, K]`` and the rows each group got."""
    x = jnp.moveaxis(lhs, axes, tuple(range(lhs.ndim - len(axes), lhs.ndim)))
    k = math.prod(x.shape[lhs.ndim - len(axes):])
    x = x.reshape(-1, k).astype(jnp.float32)
    if group_sizes is None:
        out = {"hist": _cal.Histogram.of(x), "chan": jnp.max(jnp.abs(x), axis=0),
               "rows": x[:max_rows]}
        if hessians:
            out["hess"] = jnp.dot(x.T, x, precision=jax.lax.Precision.HIGHEST)
        return out
    sizes = jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)
    ends = jnp.cumsum(sizes)
    group = jnp.searchsorted(ends, jnp.arange(x.shape[0], dtype=jnp.int32), side="right")
    valid = (group < sizes.shape[0])[:, None]  # rows past the groups' sum are in none
    out = {
        "hist": _cal.Histogram.of(x, where=valid),
        "chan": jnp.max(jnp.where(valid, jnp.abs(x), 0.0), axis=0),
        "rows": x[:max_rows],  # the valid rows come first; trimmed to "valid" on the host
        "valid": jnp.minimum(ends[-1], x.shape[0]),
        "tokens": sizes,
    }
    if hessians:
        def one(g):
            xg = jnp.where((group == g)[:, None], x, 0.0)
            return jnp.dot(xg.T, xg, precision=jax.lax.Precision.HIGHEST)

        out["hess"] = jax.lax.map(one, jnp.arange(sizes.shape[0], dtype=jnp.int32))
    return out


def _merge_stats(a: dict | None, b: dict, max_rows: int) -> dict:
    hb = None if "hess" not in b else np.asarray(b["hess"], np.float64)
    rows_b = np.asarray(b["rows"])
    if "valid" in b:
        rows_b = rows_b[: int(b["valid"])]
    if a is None:
        out = {"hist": b["hist"], "chan": np.asarray(b["chan"]), "rows": rows_b}
        if hb is not None:
            out["hess"] = hb
        if "tokens" in b:
            out["tokens"] = np.asarray(b["tokens"], np.int64)
        return out
    rows = a["rows"]
    if rows.shape[0] < max_rows:
        rows = np.concatenate([rows, rows_b[: max_rows - rows.shape[0]]])
    out = {
        "hist": a["hist"].merge(b["hist"]),
        "chan": np.maximum(a["chan"], np.asarray(b["chan"])),
        "rows": rows,
    }
    if hb is not None:  # batches' (and calls') sums accumulate in float64 on the host
        out["hess"] = a["hess"] + hb
    if "tokens" in b:
        out["tokens"] = a["tokens"] + np.asarray(b["tokens"], np.int64)
    return out


def observe_batches(m: Model, rules: Rules, batches, forward, smoothing, max_rows: int,
                     example=None, hessians: bool = False, kernels=None):
    """Run the float model (with ``smoothing`` applied) over ``batches``; per-site stats."""
    batches = iter(batches) if not isinstance(batches, (list, tuple)) else iter(list(batches))
    first = next(batches, None)
    if first is None:
        raise ValueError("calibrate: batches is empty; calibration needs at least one batch")
    if m.adapter.needs_example() and example is None:
        if forward is not None:
            raise TypeError(
                "a Linen model run by forward= needs example= (the inputs its sites are "
                "traced with, e.g. the first batch's model input)"
            )
        example = first
    site_list = model_sites(m, rules, example)
    sites = quantized_sites(site_list, rules)
    if smoothing is not None:
        smoothing.check(sites, rules)
    run = observer_fn(m, rules, sites, forward, smoothing, max_rows, hessians, kernels)
    stats: dict[str, dict] = {}
    n = 0
    for batch in chain(first, batches):
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



def _call_model(model, batch):
    return model(batch)


def collect(fn, wanted: frozenset, max_rows: int, hessians: bool = False) -> dict[str, dict]:
    """Run ``fn`` observing the ``wanted`` sites: ``{"<call index>|<site>": stats}`` (the
    keys sort in the order the forward reaches the sites; a site called twice has two)."""
    rec: dict[str, dict] = {}

    def obs(site, lhs, axes, group_sizes=None):
        if site in wanted:
            rec[f"{len(rec):06d}|{site}"] = _stats_of(lhs, axes, max_rows, hessians,
                                                      group_sizes)

    with observing(obs):
        fn()
    return rec



def _ordered(rec):
    return [(k.split("|", 1)[1], v) for k, v in sorted(rec.items())]


def observer_fn(m: Model, rules, sites, forward, smoothing, max_rows, hessians=False,
                kernels=None):
    """A function batch -> ``[(site, stats), ...]`` in the order the forward reaches the sites
    (one entry per call of a site), jitted (NNX: compiled once per model structure, forward
    and batch shape, across calls of :func:`calibrate`). ``kernels``: site path -> the weight
    a site holds instead of its own (sequential GPTQ: the sites quantized so far)."""
    wanted = frozenset(s.path for s in sites)
    call = forward or _call_model
    none = _recipes.get("none")
    b = m.adapter.rebuild(m.bound, edits(m, sites, smoothing, lambda p: none, kernels),
                          Rules.of(rules), packed=False, observe=True, implementation=None)
    run = m.adapter.observer(b, call, collect, (wanted, max_rows, hessians))
    return lambda batch: _ordered(run(batch))


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
    hessians: bool = False,
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
      hessians: also record each site's input Hessian ``sum x^T x`` over every calibration
        token (``x`` the activation as the site's GEMM contracts it, ``[tokens, K]``; float32
        products, summed in float64 over calls and batches): what GPTQ needs
        (``quantize(..., weights="gptq")``). Under a sharded mesh the site sees the global
        activation, so the sum is over every device's tokens.

    Grouped sites (``lb.ragged_dot``: an MoE's experts) get one static amax over the tokens
    of every group, as ModelOpt syncs its experts' input amaxes after calibration
    (NVIDIA/Model-Optimizer @ a2fbac7b, ``modelopt/torch/quantization/model_calib.py``
    366-368 calling ``layer_sync_moe_local_experts_amax``, ``plugins/huggingface.py``
    738-750): one input scale per expert stack, which fused-MoE kernels take. Rows past the
    groups' sum are in no group and not seen; each group's Hessian is its own tokens', and
    :attr:`Calibration.group_tokens` says how many each got.

    Raises ``ValueError`` naming the problem: no batches, a rule that reaches no site, a site
    never reached, NaN or Inf in a site's activations, an unknown method.
    """
    if method not in _cal.METHODS:
        raise ValueError(f"calibrate: unknown method={method!r}; valid methods: {_cal.METHODS}")
    if method == "percentile":
        _cal.amax(jnp.ones(1), "percentile", percentile=percentile)  # checks the percentile
    m = as_model(model)
    rules = Rules.of(rules)
    if method != "mse":  # the samples serve "mse" only: not copied out for the others
        max_rows = 0
    sites, stats, n = observe_batches(m, rules, batches, forward, smoothing, max_rows, example,
                                      hessians)
    base = Calibration(
        amax={},
        method=method,
        batches=n,
        percentile=float(percentile),
        formats={s.path: activation_format(rules.active(s.path)) for s in sites},
        weights={s.path: tuple(s.shape) for s in sites},
        histograms={s.path: stats[s.path]["hist"] for s in sites},
        channel_amax={s.path: np.asarray(stats[s.path]["chan"], np.float32) for s in sites},
        samples={s.path: np.asarray(stats[s.path]["rows"], np.float32) for s in sites},
        hessians={s.path: np.asarray(stats[s.path]["hess"], np.float32) for s in sites}
        if hessians else {},
        rotations={} if smoothing is None else {
            p: int(np.shape(v)[0]) for p, v in smoothing.rotations.items()},
        model=m.name,
        group_tokens={s.path: tuple(int(n) for n in stats[s.path]["tokens"]) for s in sites
                      if "tokens" in stats[s.path]},
    )
    return base.with_method(method, percentile=percentile)


def with_amax(recipe: Recipe, amax: float | None) -> Recipe:
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
    rules = Rules.of(rules)
    out: list[tuple[str, Recipe]] = []
    if calibration is not None:
        for site, a in calibration.amax.items():
            r = rules.active(site)
            if r is None:
                raise ValueError(
                    f"calibration site {site!r} is not quantized by these rules (a calibration "
                    "of another model or other rules?)"
                )
            out.append((re.escape(site), with_amax(r, a)))
    return out + [(r.pattern, r.recipe) for r in rules.rules]
