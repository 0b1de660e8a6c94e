"""The bit-budget solver: an exact multiple-choice knapsack, and the :class:`PrecisionPlan` it
yields.

Choosing one candidate per site so that the summed damage is least while the summed cost stays
within a budget is the multiple-choice knapsack problem. :func:`knapsack` solves it exactly:
by dynamic programming over an integer cost grid when the costs are (after scaling by a power
of two and dividing by their greatest common divisor) integers on a grid of manageable size,
which is the case for every cost :func:`lowbit.autoquant.score` produces (parameters x bits
per element, bits that are multiples of 1/16); otherwise as an integer program solved to
optimality by ``scipy.optimize.milp`` (HiGHS, zero gap).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from fractions import Fraction
from typing import Any

import numpy as np

from lowbit.autoquant.costs import check_cost
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.recipes import GemmSpec, QuantSpec, Recipe

__all__ = ["knapsack", "solve", "PrecisionPlan", "Plan", "MAX_GRID", "recipe_to_json",
           "recipe_from_json"]

# Largest number of cost-grid states the dynamic program visits (rows x choices x states);
# beyond it the exact integer program takes over.
MAX_GRID = 60_000_000


def _as_table(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(
            f"knapsack: {name} must be a 2-D array of numbers [rows, choices]"
        ) from None
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(
            f"knapsack: {name} must be a non-empty 2-D array [rows, choices], got shape {a.shape}"
        )
    return a


def _integer_costs(costs: np.ndarray, budget: float) -> tuple[np.ndarray, int] | None:
    """Costs as integers on a common grid and the budget in grid units (rounded down, exactly),
    or None when no power-of-two scaling up to 2^30 makes every finite cost an integer."""
    finite = costs[np.isfinite(costs)]
    for k in range(31):
        scaled = finite * float(2**k)
        if np.all(scaled == np.round(scaled)) and np.all(np.abs(scaled) < 2**62):
            ints = np.round(scaled).astype(np.int64)
            g = int(np.gcd.reduce(ints)) if ints.size and np.any(ints) else 1
            g = max(g, 1)
            grid = np.full(costs.shape, -1, dtype=np.int64)  # -1: not allowed
            grid[np.isfinite(costs)] = (
                np.round(costs[np.isfinite(costs)] * 2**k).astype(np.int64) // g
            )
            units = math.floor(Fraction(budget) * 2**k / g)
            return grid, units
    return None


def knapsack(costs, damages, budget: float) -> np.ndarray:
    """One choice per row minimizing the summed damage with the summed cost within ``budget``.

    Args:
      costs: ``[rows, choices]`` non-negative costs (``inf``: the choice is not allowed).
      damages: ``[rows, choices]`` damages (any sign; ``inf``: not allowed).
      budget: the largest total cost allowed.

    Returns:
      ``int64[rows]``, the chosen column of each row: an exact optimum (ties between equally
      damaging solutions go to the cheaper one).

    Raises ``ValueError`` for an infeasible budget (naming the smallest feasible one), NaN,
    negative costs or mismatched shapes.

    >>> knapsack([[16, 8, 4], [16, 8, 4]], [[0, 1, 5], [0, 2, 3]], budget=16).tolist()
    [1, 1]
    >>> knapsack([[16, 8, 4], [16, 8, 4]], [[0, 1, 5], [0, 2, 3]], budget=12).tolist()
    [1, 2]
    """
    c = _as_table(costs, "costs")
    d = _as_table(damages, "damages")
    if c.shape != d.shape:
        raise ValueError(f"knapsack: costs {c.shape} and damages {d.shape} must have one shape")
    if np.isnan(c).any() or np.isnan(d).any():
        raise ValueError("knapsack: costs and damages must not hold NaN")
    if (c < 0).any():
        raise ValueError("knapsack: costs must be non-negative")
    allowed = np.isfinite(c) & np.isfinite(d)
    if not allowed.any(axis=1).all():
        row = int(np.argmin(allowed.any(axis=1)))
        raise ValueError(f"knapsack: row {row} has no allowed choice (every cost or damage inf)")
    try:
        budget = float(budget)
    except (TypeError, ValueError):
        raise TypeError(f"knapsack: budget must be a number, got {budget!r}") from None
    if math.isnan(budget):
        raise ValueError("knapsack: budget is NaN")
    cheapest = float(np.sum(np.min(np.where(allowed, c, np.inf), axis=1)))
    if cheapest > budget:
        raise ValueError(
            f"knapsack: budget {budget:g} is infeasible: the smallest feasible budget is "
            f"{cheapest:g} (every row at its cheapest choice)"
        )
    c = np.where(allowed, c, np.inf)
    d = np.where(allowed, d, np.inf)
    grid = _integer_costs(c, min(budget, float(np.sum(np.max(np.where(allowed, c, 0), axis=1)))))
    if grid is not None:
        gc, units = grid
        if c.shape[0] * c.shape[1] * (units + 1) <= MAX_GRID:
            return _dp(gc, d, units)
    return _milp(c, d, budget)


def _dp(costs: np.ndarray, damages: np.ndarray, units: int) -> np.ndarray:
    """Exact DP: ``best[b]`` = least damage of the rows so far with total cost <= b; ties go
    to the smaller total cost (a second, lexicographic key)."""
    rows, choices = costs.shape
    n = units + 1
    best = np.zeros(n)  # with zero rows, any budget costs nothing
    spent = np.zeros(n, dtype=np.int64)  # the cost of the solution behind best[b]
    picks = np.zeros((rows, n), dtype=np.int16 if choices < 2**15 else np.int64)
    for r in range(rows):
        new_best = np.full(n, np.inf)
        new_spent = np.zeros(n, dtype=np.int64)
        new_pick = np.zeros(n, dtype=picks.dtype)
        for j in range(choices):
            cj = int(costs[r, j])
            if cj < 0 or cj >= n or not np.isfinite(damages[r, j]):
                continue
            cand = np.full(n, np.inf)
            cand[cj:] = best[: n - cj] + damages[r, j]
            cand_spent = np.zeros(n, dtype=np.int64)
            cand_spent[cj:] = spent[: n - cj] + cj
            better = (cand < new_best) | ((cand == new_best) & (cand_spent < new_spent))
            new_best = np.where(better, cand, new_best)
            new_spent = np.where(better, cand_spent, new_spent)
            new_pick = np.where(better, j, new_pick)
        best, spent, picks[r] = new_best, new_spent, new_pick
    out = np.zeros(rows, dtype=np.int64)
    b = units
    for r in range(rows - 1, -1, -1):
        j = int(picks[r, b])
        out[r] = j
        b -= int(costs[r, j])
    return out


def _milp(costs: np.ndarray, damages: np.ndarray, budget: float) -> np.ndarray:
    """The same problem as a 0/1 integer program, solved to optimality (zero MIP gap)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    rows, choices = costs.shape
    ok = np.isfinite(costs) & np.isfinite(damages)
    cf = np.where(ok, costs, 0.0).ravel()
    df = np.where(ok, damages, 0.0).ravel()
    one = np.zeros((rows, rows * choices))
    for r in range(rows):
        one[r, r * choices : (r + 1) * choices] = 1.0
    cons = [LinearConstraint(one, 1, 1), LinearConstraint(cf[None], -np.inf, budget)]
    res = milp(
        df,
        constraints=cons,
        integrality=np.ones_like(df),
        bounds=Bounds(0, np.where(ok.ravel(), 1.0, 0.0)),
        options={"mip_rel_gap": 0.0},
    )
    if res.x is None:
        raise ValueError(f"knapsack: the integer program found no solution ({res.message})")
    out = np.argmax(res.x.reshape(rows, choices), axis=1).astype(np.int64)
    if float(np.sum(costs[np.arange(rows), out])) > budget:  # a tolerance of the solver
        raise ValueError("knapsack: the integer program's solution exceeds the budget")
    return out


# --------------------------------------------------------------------------------------------
# Recipes as JSON (custom candidates travel with a plan)


def recipe_to_json(recipe: Recipe) -> dict:
    """A JSON-able dict of ``recipe`` (:func:`recipe_from_json` rebuilds it)."""
    return dataclasses.asdict(recipe)


def recipe_from_json(d: dict) -> Recipe:
    def spec(x):
        if x is None:
            return None
        x = dict(x)
        if x.get("block_shape") is not None:
            x["block_shape"] = tuple(x["block_shape"])
        return QuantSpec(**x)

    def gemm(x):
        x = dict(x)
        return GemmSpec(spec(x.pop("lhs")), spec(x.pop("rhs")), **x)

    d = dict(d)
    return Recipe(d.pop("name"), **{k: gemm(d.pop(k)) for k in ("fwd", "dlhs", "drhs")}, **d)


def _registered(recipe: Recipe) -> bool:
    try:
        return _recipes.get(recipe.name) == recipe
    except ValueError:
        return False


# --------------------------------------------------------------------------------------------
# Plans


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """A recipe per site (or group of sites) chosen under a bit budget by :func:`solve`.

    Attributes:
      choices: site (or group) name -> recipe name, in the order of the scores.
      members: site (or group) name -> the site paths it stands for.
      recipes: recipe name -> :class:`lowbit.Recipe`, for every recipe the plan uses.
      bits: the achieved bits per parameter over the scored sites' weights (scales included,
        float = 16); per active parameter when ``cost`` is ``"active"``.
      budget: the bits per parameter the plan was solved for.
      predicted: the summed damage of the choices: a predicted loss change for damages in
        loss units (methods ``"isolated"`` and ``"shapley"``), a score otherwise.
      method: the scoring method.
      params: site (or group) name -> its number of weight parameters.
      cost: the cost model ``bits`` and ``budget`` are in (:mod:`lowbit.autoquant.costs`):
        ``"stored"`` or ``"active"``.
    """

    choices: dict[str, str]
    members: dict[str, tuple[str, ...]]
    recipes: dict[str, Recipe]
    bits: float
    budget: float
    predicted: float
    method: str
    params: dict[str, int] = dataclasses.field(default_factory=dict)
    cost: str = "stored"

    def rules(self) -> list[tuple[str, Recipe]]:
        """``lowbit.flax`` rules that give every planned site its recipe (``"none"`` sites
        included, so they stay float even behind a catch-all rule that follows)."""
        out = []
        for name, recipe in self.choices.items():
            for path in self.members[name]:
                out.append((re.escape(path), self.recipes[recipe]))
        return out

    def counts(self) -> dict[str, int]:
        """How many sites each recipe got."""
        out: dict[str, int] = {}
        for name, r in self.choices.items():
            out[r] = out.get(r, 0) + len(self.members[name])
        return out

    def to_json(self) -> dict:
        return {
            "choices": dict(self.choices),
            "members": {k: list(v) for k, v in self.members.items()},
            "recipes": {
                k: (k if _registered(r) else recipe_to_json(r)) for k, r in self.recipes.items()
            },
            "bits": self.bits,
            "budget": self.budget,
            "predicted": self.predicted,
            "method": self.method,
            "params": dict(self.params),
            "cost": self.cost,
        }

    @classmethod
    def from_json(cls, d: dict) -> PrecisionPlan:
        try:
            recipes = {
                k: (_recipes.get(v) if isinstance(v, str) else recipe_from_json(v))
                for k, v in d["recipes"].items()
            }
            choices = dict(d["choices"])
            members = {k: tuple(v) for k, v in d["members"].items()}
        except (KeyError, TypeError) as e:
            raise ValueError(f"PrecisionPlan.from_json: not a saved plan ({e!r})") from None
        missing = sorted(set(choices.values()) - set(recipes))
        if missing or set(members) != set(choices):
            raise ValueError(
                f"PrecisionPlan.from_json: inconsistent plan (recipes missing: {missing}; "
                "members and choices must name the same sites)"
            )
        return cls(
            choices=choices,
            members=members,
            recipes=recipes,
            bits=float(d["bits"]),
            budget=float(d["budget"]),
            predicted=float(d["predicted"]),
            method=str(d["method"]),
            params={k: int(v) for k, v in d.get("params", {}).items()},
            # saved before the active cost model: stored
            cost=check_cost(d.get("cost", "stored"), "PrecisionPlan.from_json"),
        )

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write the plan as JSON (written to a temporary file, then renamed into place)."""
        path = pathlib.Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> PrecisionPlan:
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"PrecisionPlan.load: no plan file at {str(path)!r}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"PrecisionPlan.load: {str(path)!r} is not JSON ({e})") from None
        return cls.from_json(d)


Plan = PrecisionPlan
"""The former name of :class:`PrecisionPlan` (``lowbit.core.qarray.Plan`` is the blocking plan of a
quantized tensor), kept for the experiments that load plans by it."""


def solve(scores: Any, bits: float = 4.5, *, cost: str = "stored") -> PrecisionPlan:
    """The plan of least predicted damage whose weights take at most ``bits`` bits per
    parameter on average over the scored sites (scales included; float counts 16).

    ``scores``: a :class:`lowbit.autoquant.Scores`. ``cost``: the cost model
    (:mod:`lowbit.autoquant.costs`): ``"stored"`` (bits per stored parameter) or
    ``"active"`` (each site weighted by the fraction of the tokens it serves, ``top_k /
    experts`` for experts, and ``bits`` per active parameter: the scores must come from
    ``score(..., active_fraction=...)``). Raises ``ValueError`` when no plan fits (the message
    gives the smallest feasible ``bits``) and for an unknown ``cost``.

    >>> import numpy as np
    >>> from lowbit.autoquant import Scores
    >>> s = Scores(sites=("a", "b"), candidates=("none", "mxfp4"),
    ...            damage=np.array([[0.0, 0.3], [0.0, 0.1]]),
    ...            cost=np.array([[16.0 * 64, 4.25 * 64], [16.0 * 64, 4.25 * 64]]),
    ...            method="isolated", params={"a": 64, "b": 64})
    >>> p = solve(s, bits=10.125)
    >>> p.choices, p.bits, round(p.predicted, 3)
    ({'a': 'none', 'b': 'mxfp4'}, 10.125, 0.1)
    """
    check_cost(cost, "solve")
    try:
        bits = float(bits)
    except (TypeError, ValueError):
        raise TypeError(f"solve: bits must be a number, got {bits!r}") from None
    table, params = scores.cost_table(cost, "solve")
    total = float(sum(params[s] for s in scores.sites))
    if total <= 0:
        raise ValueError("solve: the scored sites hold no weight parameters")
    try:
        pick = knapsack(table, scores.damage, bits * total)
    except ValueError as e:
        if "infeasible" not in str(e):
            raise
        least = float(np.sum(np.min(table, axis=1))) / total
        per = "active parameter" if cost == "active" else "parameter"
        raise ValueError(
            f"solve: bits={bits:g} is infeasible for these sites: the smallest feasible "
            f"budget is {least:.6g} bits per {per} (every site at its cheapest candidate)"
        ) from None
    rows = np.arange(len(scores.sites))
    choices = {s: scores.candidates[int(j)] for s, j in zip(scores.sites, pick, strict=True)}
    used = set(choices.values())
    return PrecisionPlan(
        choices=choices,
        members={s: tuple(scores.members.get(s, (s,))) for s in scores.sites},
        recipes={n: scores.recipe(n) for n in scores.candidates if n in used},
        bits=float(np.sum(table[rows, pick])) / total,
        budget=bits,
        predicted=float(np.sum(scores.damage[rows, pick])),
        method=scores.method,
        params={s: int(scores.params[s]) for s in scores.sites},
        cost=cost,
    )
