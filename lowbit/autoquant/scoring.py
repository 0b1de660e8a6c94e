"""Per-site sensitivity scores: what quantizing each site to each candidate costs the model.

Every method runs the model's own ``loss_fn`` on a copy of the model whose sites hold float
lowbit ops (``lowbit.flax.quantize(..., observe=True)``) and rewrites site outputs through
:func:`lowbit.flax.substituting`: a site's output ``y`` (its float GEMM) can be replaced by
``Q(y)``, the same GEMM under a candidate recipe's forward, or moved along ``y + t (Q(y) - y)``.

- ``"isolated"``: the loss with one site at one candidate and every other site float, minus the
  float loss (one forward per site and candidate; a ``lax.switch`` per site picks the GEMM, so
  one compiled program serves all of them).
- ``"gradient"`` (NVIDIA ModelOpt's ``auto_quantize`` score): ``sum((dL/dy * (Q(y) - y))^2)``
  over output elements and batches, ``dL/dy`` at the float model; every site and candidate from
  one forward and one backward per batch (a custom VJP computes the candidates' ``Q(y)`` in
  the backward, next to ``dL/dy``, so nothing per candidate is held between the two).
- ``"kl"``: ``KL(p_float || p_quantized)`` of the output distributions (``output_fn`` gives the
  logits), one site quantized at a time.
- ``"shapley"`` (Aumann-Shapley): for each candidate, every site moves together along
  ``y + t (Q(y) - y)``; a site's credit is the path integral of ``<dL/dy, Q(y) - y>``, by the
  midpoint rule over ``steps`` points (a gate per site, so all credits of a point are one
  ``jax.grad``). The credits add up to the loss change of quantizing all sites at once (exactly
  so as ``steps`` grows when the path is smooth, i.e. for weight-only candidates), saturation
  included, which summed isolated scores are not. ``rule="gauss"`` takes Gauss-Legendre
  points and weights instead: on a smooth path its error falls far faster with ``steps`` (on
  the trained ``xs`` GPT, 3 Gauss points are more complete than 16 midpoints), so the same
  credits cost fewer points; on a W+A path, whose loss jumps where an activation's rounding
  flips, or through MoE routing, which flips experts, neither rule converges.

:func:`scoring_flops` gives XLA's flop count of one batch's scoring next to a float
forward+backward of the same loss: the cost of a method without timing noise.

Damage is in loss units (mean over batches) for ``"isolated"`` and ``"shapley"``, so sums of
it predict loss changes; ``"gradient"`` and ``"kl"`` are scores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.autoquant.costs import check_cost, compile_pattern, parse_fractions, site_fractions
from lowbit.autoquant.heuristic import classify
from lowbit.autoquant.programs import NONE, needs_key, program, scalar
from lowbit.autoquant.solver import recipe_from_json, recipe_to_json
from lowbit.bits import FLOAT_BITS, storage_bits
from lowbit.flax._core import ATTN_SCORES, ATTN_VALUES, Rules
from lowbit.flax.adapters import Probe, adapter_for
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.recipes import Recipe

__all__ = ["METHODS", "RULES", "FLOAT_BITS", "Scores", "score", "scoring_flops", "path_points",
           "weight_bits"]

METHODS = ("isolated", "gradient", "kl", "shapley")
RULES = ("midpoint", "gauss")  # "shapley": the quadrature of the path integral
# any recipe that quantizes: with observe=True the sites it reaches run float ops
_PROBE = _recipes.get("qat_mxfp8")
_ATTN_SUFFIXES = ("/" + ATTN_SCORES, "/" + ATTN_VALUES)


def weight_bits(recipe: Recipe, params: int) -> float:
    """Storage bits of a weight of ``params`` elements under ``recipe``'s forward: elements
    plus block scales (and a float32 tensor scale where the format has one); a weight the
    forward keeps in high precision counts :data:`FLOAT_BITS` per element. (The ``nvfp4``
    recipe's weights are 16x16 tiles: one E4M3 scale per 256 elements.) The autoquant
    convention of :func:`lowbit.bits.storage_bits`.

    >>> weight_bits(_recipes.get("mxfp4"), 1024), weight_bits(_recipes.get("nvfp4"), 1024)
    (4352.0, 4160.0)
    """
    return storage_bits(recipe.fwd.rhs, (params,), float_bits=FLOAT_BITS, tensor_scale=True)


# --------------------------------------------------------------------------------------------
# Scores


@dataclasses.dataclass(frozen=True)
class Scores:
    """Damage and cost of every candidate at every site (or group of sites).

    Attributes:
      sites: site (or group) names, in the order the forward reaches them.
      candidates: candidate recipe names, ``"none"`` first.
      damage: ``float64[sites, candidates]``; 0 for ``"none"``.
      cost: ``float64[sites, candidates]``: weight bits (parameters x bits per element, scales
        included; float = 16).
      method: how damage was measured (:data:`METHODS`).
      params: site (or group) -> number of weight parameters.
      members: group -> the site paths it holds (a lone site: itself).
      recipes: candidate name -> :class:`lowbit.Recipe`.
      batches: batches scored; steps: path points and rule: their quadrature (``"shapley"``);
      loss: the mean float loss.
      fraction: site path -> the fraction of the tokens its weights serve (``score``'s
        ``active_fraction``; 1 for a site no regex matched); None: not given, and the
        ``"active"`` cost model (:mod:`lowbit.autoquant.costs`) is not available.
      active_cost: ``float64[sites, candidates]``: ``cost`` under the ``"active"`` model, each
        member's weight bits times its fraction, summed over the group (None: not given).
      active_params: site (or group) -> its active parameters (parameters times fraction).
    """

    sites: tuple[str, ...]
    candidates: tuple[str, ...]
    damage: np.ndarray
    cost: np.ndarray
    method: str
    params: dict[str, int]
    members: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    recipes: dict[str, Recipe] = dataclasses.field(default_factory=dict)
    batches: int = 0
    steps: int | None = None
    loss: float | None = None
    rule: str | None = None
    fraction: dict[str, float] | None = None
    active_cost: np.ndarray | None = None
    active_params: dict[str, float] = dataclasses.field(default_factory=dict)

    def recipe(self, name: str) -> Recipe:
        """The candidate called ``name``."""
        if name in self.recipes:
            return self.recipes[name]
        return _recipes.get(name)

    def cost_table(
        self, cost: str = "stored", where: str = "Scores"
    ) -> tuple[np.ndarray, dict[str, float]]:
        """The costs ``[sites, candidates]`` and the parameters per site (or group) of the cost
        model ``cost`` (:data:`lowbit.autoquant.COSTS`): ``cost`` and ``params``, or
        ``active_cost`` and ``active_params``."""
        if check_cost(cost, where) == "stored":
            return self.cost, self.params
        if self.active_cost is None:
            raise ValueError(
                f"{where}: cost='active' needs scores with active fractions: "
                "score(..., active_fraction={path regex: top_k / experts}) (an empty mapping "
                "for a model without experts)"
            )
        return self.active_cost, self.active_params

    def bits(self, choices: dict[str, str], cost: str = "stored") -> float:
        """Bits per parameter of an assignment site -> candidate name (per active parameter
        with ``cost="active"``)."""
        table, params = self.cost_table(cost, "Scores.bits")
        total = sum(params[s] for s in self.sites)
        c = sum(table[i, self.candidates.index(choices[s])] for i, s in enumerate(self.sites))
        return float(c) / total

    def uniform(self, candidate: str) -> dict[str, str]:
        """Every site at ``candidate``."""
        return {s: candidate for s in self.sites}

    def predicted(self, choices: dict[str, str]) -> float:
        """The summed damage of an assignment."""
        return float(
            sum(self.damage[i, self.candidates.index(choices[s])] for i, s in enumerate(self.sites))
        )

    def to_json(self) -> dict:
        return {
            "sites": list(self.sites),
            "candidates": list(self.candidates),
            "damage": self.damage.tolist(),
            "cost": self.cost.tolist(),
            "method": self.method,
            "params": dict(self.params),
            "members": {k: list(v) for k, v in self.members.items()},
            "recipes": {k: recipe_to_json(v) for k, v in self.recipes.items()},
            "batches": self.batches,
            "steps": self.steps,
            "loss": self.loss,
            "rule": self.rule,
            "fraction": self.fraction,
            "active_cost": None if self.active_cost is None else self.active_cost.tolist(),
            "active_params": dict(self.active_params),
        }

    @classmethod
    def from_json(cls, d: dict) -> Scores:
        return cls(
            sites=tuple(d["sites"]),
            candidates=tuple(d["candidates"]),
            damage=np.asarray(d["damage"], np.float64),
            cost=np.asarray(d["cost"], np.float64),
            method=d["method"],
            params={k: int(v) for k, v in d["params"].items()},
            members={k: tuple(v) for k, v in d["members"].items()},
            recipes={k: recipe_from_json(v) for k, v in d["recipes"].items()},
            batches=int(d["batches"]),
            steps=d.get("steps"),
            loss=d.get("loss"),
            # written before the rule was recorded: the midpoint rule, the only one then
            rule=d.get("rule", "midpoint" if d.get("steps") is not None else None),
            # written before the active cost model: none
            fraction=d.get("fraction"),
            active_cost=(
                None if d.get("active_cost") is None else np.asarray(d["active_cost"], np.float64)
            ),
            active_params={k: float(v) for k, v in d.get("active_params", {}).items()},
        )

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        path = pathlib.Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Scores:
        return cls.from_json(json.loads(pathlib.Path(path).read_text()))


# --------------------------------------------------------------------------------------------
# The model under hooks


def _runner(model, variables) -> Probe:
    """The probe copy of the model (its sites hold float ops the hooks reach), through the
    model's adapter (chosen here, once)."""
    return adapter_for(model).probe(model, variables, _PROBE)


# --------------------------------------------------------------------------------------------
# Sites, groups, candidates


@dataclasses.dataclass(frozen=True)
class _Site:
    path: str
    params: int


def _discover(run: Probe, loss_fn, batch) -> list[_Site]:
    """The weight sites ``loss_fn`` reaches, in forward order (traced, not run)."""
    seen: dict[str, _Site] = {}

    def hook(site, gemm, lhs, rhs):
        if site not in seen and not site.endswith(_ATTN_SUFFIXES):
            seen[site] = _Site(site, int(math.prod(rhs.shape)))
        return gemm(lhs, rhs, NONE)

    jax.eval_shape(lambda st, b: scalar(run(loss_fn, st, b, hook)), run.state, batch)
    return list(seen.values())


def _select(sites: list[_Site], rules) -> list[_Site]:
    if rules is None:
        chosen = [s for s in sites if classify(s.path) not in ("embedding", "head", "router")]
    else:
        rules = Rules.of(rules)
        for rule in rules.rules:
            if not any(rule.regex.fullmatch(s.path) for s in sites):
                raise ValueError(
                    f"score: rule {rule.pattern!r} reaches no weight site that loss_fn runs "
                    f"(sites: {[s.path for s in sites]})"
                )
        chosen = [s for s in sites if rules.active(s.path) is not None]
    if not chosen:
        raise ValueError(
            f"score: no site to score (weight sites that loss_fn runs: {[s.path for s in sites]})"
        )
    return chosen


def _group_name(paths: Sequence[str]) -> str:
    """``blocks/0/moe/up``, ``blocks/0/moe/down`` -> ``blocks/0/moe/{up,down}``."""
    if len(paths) == 1:
        return paths[0]
    split = [p.split("/") for p in paths]
    n = 0
    while all(len(s) > n + 1 for s in split) and len({s[n] for s in split}) == 1:
        n += 1
    head = "/".join(split[0][:n])
    tails = ",".join("/".join(s[n:]) for s in split)
    return f"{head}/{{{tails}}}" if head else f"{{{tails}}}"


def _groups(sites: list[_Site], groups) -> dict[str, tuple[str, ...]]:
    """Group name -> member paths (in forward order); ungrouped sites stand alone."""
    if groups is None:
        groups = ()
    if isinstance(groups, (str, re.Pattern)):
        groups = (groups,)
    keyed: dict[tuple, list[str]] = {}
    owner: dict[str, str] = {}
    for gi, pattern in enumerate(groups):
        rx = compile_pattern(pattern, f"score: groups[{gi}]")
        pat = rx.pattern
        hit = False
        for s in sites:
            m = rx.fullmatch(s.path)
            if m is None:
                continue
            hit = True
            if s.path in owner:
                raise ValueError(
                    f"score: site {s.path!r} matches two grouping regexes ({owner[s.path]!r} "
                    f"and {pat!r})"
                )
            owner[s.path] = pat
            keyed.setdefault((gi, m.groups()), []).append(s.path)
        if not hit:
            raise ValueError(
                f"score: grouping regex {pat!r} matches no scored site (sites: "
                f"{[s.path for s in sites]})"
            )
    out: dict[str, tuple[str, ...]] = {}
    done: set[tuple] = set()
    for s in sites:  # forward order: a group stands where its first member does
        if s.path not in owner:
            out[s.path] = (s.path,)
            continue
        key = next(k for k, v in keyed.items() if s.path in v)
        if key not in done:
            done.add(key)
            out[_group_name(keyed[key])] = tuple(keyed[key])
    return out


def _candidates(candidates) -> list[Recipe]:
    if isinstance(candidates, (str, Recipe)):
        candidates = [candidates]
    try:
        items = list(candidates)
    except TypeError:
        raise TypeError(
            f"score: candidates must be a list of recipe names or Recipes, got {candidates!r}"
        ) from None
    out: list[Recipe] = []
    for i, c in enumerate(items):
        try:
            r = _recipes.get(c)
        except (ValueError, TypeError) as e:
            raise type(e)(f"score: candidates[{i}]: {e}") from None
        if r.name in [o.name for o in out]:
            raise ValueError(f"score: candidates[{i}]: {r.name!r} is listed twice")
        if r.is_identity and r.name != "none":
            raise ValueError(
                f"score: candidates[{i}]: {r.name!r} quantizes nothing; 'none' is always a "
                "candidate"
            )
        out.append(r)
    out = [r for r in out if r.name != "none"]
    if not out:
        raise ValueError("score: candidates holds no recipe that quantizes")
    return [NONE, *out]


def path_points(steps: int, rule: str = "midpoint") -> tuple[np.ndarray, np.ndarray]:
    """The ``"shapley"`` path points ``t`` in (0, 1) and their weights (which sum to 1).

    ``"midpoint"``: the midpoints of ``steps`` equal intervals, each weighing ``1 / steps``.
    ``"gauss"``: the Gauss-Legendre nodes and weights mapped to [0, 1], exact for polynomials
    of degree ``2 steps - 1``.

    >>> path_points(2)
    (array([0.25, 0.75], dtype=float32), array([0.5, 0.5]))
    >>> t, w = path_points(2, "gauss")
    >>> [round(float(v), 4) for v in t], w.tolist()  # 1/2 -+ 1/(2 sqrt(3))
    ([0.2113, 0.7887], [0.5, 0.5])
    """
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"score: steps must be a positive int, got {steps!r}")
    if rule == "midpoint":
        t = (np.arange(steps) + 0.5) / steps
        w = np.full(steps, 1.0 / steps)
    elif rule == "gauss":
        x, w = np.polynomial.legendre.leggauss(int(steps))
        t, w = (x + 1.0) / 2.0, w / 2.0
    else:
        raise ValueError(f"score: unknown rule={rule!r}; valid rules: {RULES}")
    return t.astype(np.float32), w


# --------------------------------------------------------------------------------------------
# score


def _prepare(model, loss_fn, batch, candidates, method, rules, output_fn, variables):
    """Checks the arguments and builds what scoring needs: (runner, sites, recipes, program)."""
    if method not in METHODS:
        raise ValueError(f"score: unknown method={method!r}; valid methods: {METHODS}")
    if not callable(loss_fn):
        raise TypeError(f"score: loss_fn must be callable, got {type(loss_fn).__name__}")
    if method == "kl" and output_fn is None:
        raise ValueError(
            "score: method='kl' needs output_fn(model, batch) -> logits (the distributions "
            "whose divergence is measured)"
        )
    recipes = _candidates(candidates)
    run = _runner(model, variables)
    if batch is None:
        raise ValueError("score: batches is empty; scoring needs at least one batch")
    reached = _discover(run, loss_fn, batch)
    if method == "kl":
        jax.eval_shape(
            lambda st, b: run(output_fn, st, b, lambda s, g, lhs, rhs: g(lhs, rhs, NONE)),
            run.state,
            batch,
        )
    chosen = _select(reached, rules)
    prog = program(run, loss_fn, output_fn, [s.path for s in chosen], recipes)
    return run, chosen, recipes, prog


def _flops(jitted, *args) -> float:
    """XLA's flop count of ``jitted(*args)`` as compiled for this backend."""
    cost = jitted.lower(*args).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0]
    return float(cost["flops"])


def scoring_flops(
    model,
    loss_fn: Callable,
    batch,
    candidates,
    *,
    method: str,
    steps: int = 8,
    rules=None,
    output_fn: Callable | None = None,
    variables=None,
) -> dict[str, float]:
    """XLA's flop count of scoring one batch, next to a float forward+backward of the loss.

    The arguments are :func:`score`'s (``batch``: one batch). The float forward+backward is
    the gradient of ``loss_fn`` with respect to every parameter, as a training step computes
    it. Per batch, a method runs: ``"isolated"`` one forward per site and candidate plus the
    float one; ``"kl"`` the same of ``output_fn``; ``"gradient"`` one forward and backward with
    the candidates' GEMMs; ``"shapley"`` one forward and backward per path point and candidate
    (the once-per-call weight quantization not counted). Flops are what the compiled programs
    do (GEMMs and elementwise work alike), free of the timing noise of a shared machine, but
    blind to how fast each op runs: ``benchmarks/bench_autoquant.py`` gives both.

    Returns ``{"float": flops, "method": flops per batch, "x_float": their ratio, "per_point":
    the ratio per path point ("shapley")}``.
    """
    if method == "shapley":
        path_points(steps)  # the check
    if batch is None:
        raise ValueError("scoring_flops: batch is None; pass one batch of what loss_fn takes")
    run, chosen, recipes, prog = _prepare(
        model, loss_fn, batch, candidates, method, rules, output_fn, variables
    )
    n_s, n_c = len(chosen), len(recipes)
    key = jax.random.key(0)
    loss, params = run.adapter.float_loss(model, run, loss_fn)

    def float_loss(params, batch):
        return scalar(loss(params, batch))

    f = _flops(jax.jit(jax.grad(float_loss)), params, batch)
    sel = jnp.zeros((n_s,), jnp.int32)
    if method == "isolated":
        m = (1 + n_s * (n_c - 1)) * _flops(jax.jit(prog.loss_at), run.state, batch, key, sel)
    elif method == "kl":
        m = (1 + n_s * (n_c - 1)) * _flops(jax.jit(prog.logp_at), run.state, batch, key, sel)
    elif method == "gradient":
        m = _flops(prog.gradient, run.state, batch, key)
    else:  # one program serves every candidate and point (the candidate is an argument)
        rqs = jax.eval_shape(lambda st, b, k: prog.weights(st, b, k, 1), run.state, batch, key)
        point = _flops(prog.path, run.state, batch, key, np.float32(0.5), np.int32(1), rqs)
        m = (n_c - 1) * steps * point
    out = {"float": f, "method": m, "x_float": m / f}
    if method == "shapley":
        out["per_point"] = m / f / steps
    return out


def score(
    model,
    loss_fn: Callable,
    batches: Iterable,
    candidates,
    *,
    method: str,
    steps: int = 8,
    rules=None,
    groups=None,
    output_fn: Callable | None = None,
    variables=None,
    seed: int = 0,
    rule: str = "midpoint",
    active_fraction: Mapping[str, float] | None = None,
) -> Scores:
    """Score every site of ``model`` at every candidate recipe.

    Args:
      model: an NNX model, or a Linen module (bound, or with ``variables=``).
      loss_fn: NNX: ``loss_fn(model, batch) -> scalar``; Linen: ``loss_fn(variables, batch)``
        calling the module's ``apply`` (a ``(loss, aux)`` pair is also accepted). It must be
        deterministic (no dropout).
      batches: an iterable of batches (at least one), read once.
      candidates: recipe names or :class:`lowbit.Recipe` objects (weight-only and W+A
        alike); only their forward GEMM matters. ``"none"`` is always a candidate, first.
      method: ``"isolated"``, ``"gradient"``, ``"kl"`` or ``"shapley"`` (module docstring).
      steps: ``"shapley"``: path points (the midpoints of ``steps`` intervals of [0, 1]).
      rule: ``"shapley"``: ``"midpoint"`` or ``"gauss"`` (Gauss-Legendre points and weights;
        :func:`path_points`).
      rules: which sites to score: those a ``lowbit.flax`` rule quantizes (e.g. the output
        of :func:`lowbit.autoquant.heuristic`; the rules' recipes are not used). Default:
        every weight site but embeddings, the LM head and MoE routers.
      groups: regexes of sites that must share a recipe (q/k/v of one attention, the experts
        of one MoE layer); sites that fullmatch one regex with equal capture groups form a
        group (``r"blocks/(\\d+)/moe/.*"``: one group per layer) whose damage and cost add.
      output_fn: ``"kl"``: ``output_fn(model_or_variables, batch) -> logits`` (classes on the
        last axis).
      variables: Linen: the module's variables (when ``model`` is not bound).
      seed: keys of candidates whose forward draws random numbers (stochastic rounding,
        random Hadamard signs): fixed per batch, site and candidate.
      active_fraction: ``{path regex: fraction}``, the fraction of the tokens a site's weights
        serve (in (0, 1]; ``top_k / experts`` for stacked experts; first fullmatch wins, other
        sites 1): the scores then also carry the ``"active"`` cost model that
        ``solve(..., cost="active")`` budgets over (:mod:`lowbit.autoquant.costs`; NVIDIA
        ModelOpt's ``active_moe``). Each regex must match a scored site.

    Returns:
      :class:`Scores` (costs in weight bits; damage as the method measures it).

    Raises ``ValueError`` naming the problem: an unknown method, a loss that is not a scalar, a
    candidate that names no recipe, a grouping regex that matches nothing, empty batches.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
    >>> batches = [jax.random.normal(jax.random.key(i), (16, 32)) for i in range(2)]
    >>> loss = lambda m, x: jnp.mean(m(x) ** 2)
    >>> s = score(model, loss, batches, ["mxfp8", "mxfp4"], method="isolated")
    >>> s.sites, s.candidates, s.damage.shape, s.cost[0].tolist()
    (('layers/0', 'layers/2'), ('none', 'mxfp8', 'mxfp4'), (2, 3), [32768.0, 16896.0, 8704.0])
    """
    ts, ws = path_points(steps, rule) if method == "shapley" else (None, None)
    fractions = None if active_fraction is None else parse_fractions(active_fraction)
    it = iter(batches)
    first = next(it, None)
    run, chosen, recipes, prog = _prepare(
        model, loss_fn, first, candidates, method, rules, output_fn, variables
    )
    paths = [s.path for s in chosen]
    fraction = None if fractions is None else site_fractions(paths, fractions)
    n_s, n_c = len(paths), len(recipes)
    damage, losses, n = _damage(method, prog, run, _chain(first, it), seed, ts, ws, n_s, n_c)
    if method in ("isolated", "kl", "shapley"):
        damage /= n
    members = _groups(chosen, groups)
    g_damage, g_cost, g_params = _grouped(damage, chosen, members, recipes)
    active_cost, active_params = None, {}
    if fraction is not None:
        active_cost, active_params = _active(chosen, members, recipes, fraction)
    return Scores(
        sites=tuple(members),
        candidates=tuple(r.name for r in recipes),
        damage=g_damage,
        cost=g_cost,
        method=method,
        params=g_params,
        members=members,
        recipes={r.name: r for r in recipes},
        batches=n,
        steps=steps if method == "shapley" else None,
        loss=float(np.mean(losses)) if losses else None,
        rule=rule if method == "shapley" else None,
        fraction=fraction,
        active_cost=active_cost,
        active_params=active_params,
    )


def _damage(method, prog, run, batches, seed, ts, ws, n_s, n_c):
    """Each site's damage at each candidate summed over ``batches`` (with the float losses of
    ``"isolated"`` and the number of batches)."""
    base = jax.random.key(seed)
    damage = np.zeros((n_s, n_c))
    losses = []
    rqs: dict[int, list] = {}  # shapley: each candidate's quantized weights (see Program.weights)
    n = 0
    for b, batch in enumerate(batches):
        key = jax.random.fold_in(base, b)
        if method in ("isolated", "kl"):
            sels = np.zeros((1 + n_s * (n_c - 1), n_s), np.int32)
            for i in range(n_s):
                for j in range(1, n_c):
                    sels[1 + i * (n_c - 1) + (j - 1), i] = j
            if method == "isolated":
                out = np.asarray(prog.losses(run.state, batch, jnp.asarray(sels), key), np.float64)
                losses.append(out[0])
                damage[:, 1:] += (out[1:] - out[0]).reshape(n_s, n_c - 1)
            else:
                out = np.asarray(prog.kls(run.state, batch, jnp.asarray(sels[1:]), key), np.float64)
                damage[:, 1:] += out.reshape(n_s, n_c - 1)
        elif method == "gradient":
            damage[:, 1:] += np.asarray(prog.gradient(run.state, batch, key), np.float64)
        else:
            for j in range(1, n_c):  # the quadrature of candidate j's path integral
                if j not in rqs or needs_key(prog.quant[j - 1]):
                    rqs[j] = prog.weights(run.state, batch, key, j)
                for t, w in zip(ts, ws, strict=True):
                    g = prog.path(run.state, batch, key, t, np.int32(j), rqs[j])
                    damage[:, j] += np.asarray(g, np.float64) * w
        n += 1
    return damage, losses, n


def _grouped(damage, chosen, members, recipes):
    """Damage, cost (weight bits) and parameters per group: the sums over its sites."""
    n_c = len(recipes)
    params_of = {s.path: s.params for s in chosen}
    row = {s.path: i for i, s in enumerate(chosen)}
    g_damage = np.zeros((len(members), n_c))
    g_cost = np.zeros((len(members), n_c))
    g_params = {}
    for gi, (name, ps) in enumerate(members.items()):
        for p in ps:
            g_damage[gi] += damage[row[p]]
            g_cost[gi] += [weight_bits(r, params_of[p]) for r in recipes]
        g_params[name] = sum(params_of[p] for p in ps)
    return g_damage, g_cost, g_params


def _active(chosen, members, recipes, fraction):
    """Cost (weight bits) and parameters per group under the ``"active"`` model: each member's
    times its fraction of the tokens, summed."""
    params_of = {s.path: s.params for s in chosen}
    cost = np.zeros((len(members), len(recipes)))
    params = {}
    for gi, (name, ps) in enumerate(members.items()):
        for p in ps:
            cost[gi] += [fraction[p] * weight_bits(r, params_of[p]) for r in recipes]
        params[name] = float(sum(fraction[p] * params_of[p] for p in ps))
    return cost, params


def _chain(first, rest):
    yield first
    yield from rest
