"""Per-layer precision under a bit budget: heuristics, sensitivity scores, an exact solver.

Which layers can run in 4 bits and which need 6, 8 or 16 is the practical question of
low-bit deployment. Three ways to answer it, on the same models:

1. :func:`heuristic`: presets by architecture (``"all"``, ``"mlp_only"``, ``"experts_only"``).
2. :func:`score` with an isolated-layer method: ``"isolated"`` (measured loss change, one site
   at a time), ``"gradient"`` (NVIDIA ModelOpt's ``(dL/dy * (Q(y) - y))^2``) or ``"kl"``.
3. :func:`score` with ``method="shapley"``: Aumann-Shapley joint attribution along the path
   on which every site is quantized together; the credits add up to the loss change of the
   full recipe (saturation included).

:func:`solve` picks one candidate per site (or group) under a budget in bits per parameter by
the exact multiple-choice knapsack (:func:`knapsack`); ``plan.rules()`` feeds
:func:`lowbit.flax.quantize`, :func:`lowbit.ptq.quantize` and the experiment configs
(``--config.quant.plan=plan.json``). The budget counts stored bits (``cost="stored"``, the
default) or, for a mixture of experts, bits per *active* parameter (``cost="active"``: each
expert weighted by the ``top_k / experts`` of the tokens it serves, given to :func:`score` as
``active_fraction``; NVIDIA ModelOpt's ``active_moe``; :mod:`lowbit.autoquant.costs`).

>>> import jax, jax.numpy as jnp, lowbit.autoquant as aq
>>> from flax import nnx
>>> model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.relu,
...                        nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
>>> batches = [jax.random.normal(jax.random.key(i), (16, 32)) for i in range(2)]
>>> s = aq.score(model, lambda m, x: jnp.mean(m(x) ** 2), batches, ["mxfp8", "mxfp4"],
...              method="shapley", steps=4)
>>> plan = aq.solve(s, bits=6.0)
>>> plan.bits <= 6.0, sorted(plan.choices)
(True, ['layers/0', 'layers/2'])
"""

from lowbit.autoquant.costs import COSTS
from lowbit.autoquant.heuristic import PRESETS, ROLES, classify, heuristic, weight_sites
from lowbit.autoquant.scoring import (
    FLOAT_BITS,
    METHODS,
    RULES,
    Scores,
    path_points,
    score,
    scoring_flops,
    weight_bits,
)
from lowbit.autoquant.solver import (
    Plan,
    PrecisionPlan,
    knapsack,
    recipe_from_json,
    recipe_to_json,
    solve,
)

__all__ = [
    "PRESETS",
    "ROLES",
    "METHODS",
    "RULES",
    "FLOAT_BITS",
    "COSTS",
    "classify",
    "heuristic",
    "weight_sites",
    "score",
    "Scores",
    "path_points",
    "scoring_flops",
    "weight_bits",
    "knapsack",
    "solve",
    "PrecisionPlan",
    "Plan",
    "recipe_to_json",
    "recipe_from_json",
]
