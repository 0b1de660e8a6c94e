"""Per-layer precision under a bit budget (``experiments/autoquant.py``): a float GPT, every
sensitivity method of ``lowbit.autoquant.score``, the exact solver at several budgets, each
plan measured by post-training quantization against the architecture heuristics.

    python -m experiments.autoquant --config configs/autoquant.py:mlp=dense,size=xs
    python -m experiments.autoquant --config configs/autoquant.py:mlp=moe,size=xs
    python -m experiments.autoquant --config configs/autoquant.py:mlp=moe,size=xs \
        --config.cost=active
    python -m experiments.autoquant --config configs/autoquant.py:mlp=dense,size=tiny \
        --config.methods=isolated,shapley --config.budgets=4.5,6 --config.qat_steps=100

Arguments: ``mlp`` (dense | moe), ``size`` (tiny | xs | s: ``configs/gpt.py``'s), ``seed``.
The ``base`` section is ``configs/gpt.py`` for the float baseline (``recipe=none``), trained
``PLAN[size]`` steps under its own name (``aq-gpt-<size>[-moe]-<steps>/none-s<seed>``), or
reused when that run finished with the same config. Fields:

- ``candidates``: the recipes each site may take besides ``none`` (only their forward counts:
  the forward-only ``qat_*`` recipes, weights and activations quantized).
- ``methods``: ``lowbit.autoquant.METHODS`` to compare; ``shapley_steps`` path points and
  ``shapley_rule`` their quadrature (``midpoint`` or ``gauss``).
- ``calib_batches``: training batches the scores are measured on; ``eval_batches``:
  validation batches every plan is evaluated on (0: the base config's ``train.eval_batches``).
- ``budgets``: bits per parameter (scales included, float = 16) to solve for.
- ``cost``: what the budgets count (``lowbit.autoquant.COSTS``): ``stored`` (bits per stored
  parameter) or ``active`` (bits per active parameter: each expert weight counted at the
  ``top_k / experts`` of the tokens it serves, from ``base.model``; NVIDIA ModelOpt's
  ``active_moe``). A dense GPT gets the same plans either way.
- ``heuristic_low`` / ``heuristic_high``: the recipes of the presets' low and high sites;
  ``matched``: also solve every method at each heuristic point's own bits.
- ``random_recipes``: mixed-precision recipes drawn at random (each site uniform over ``none``
  and the candidates; ``seed``) whose measured calibration-loss change validates every
  method's summed scores (Spearman; mean absolute error for isolated and Shapley).
- ``qat_steps`` (0: off), ``qat_lr``: a short QAT of the best plan per budget from the float
  checkpoint (``--config.init_from`` + ``--config.quant.plan``); ``qat_budgets``: which
  budgets ("": all).
"""

from __future__ import annotations

import ml_collections

from configs import gpt
from experiments.configlib import parse_arg

# size -> float steps (2 shared CPU cores: tiny ~2 min, xs ~10 min a model)
PLAN = {"tiny": 2000, "xs": 2000, "s": 3000}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = parse_arg(arg, mlp="dense", size="xs", seed=0)
    if a.size not in PLAN:
        raise ValueError(f"config argument size={a.size!r}: expected one of {sorted(PLAN)}")
    if a.mlp not in ("dense", "moe"):
        raise ValueError(f"config argument mlp={a.mlp!r}: expected dense or moe")
    steps = PLAN[a.size]
    base = gpt.get_config(f"size={a.size},recipe=none,mlp={a.mlp},seed={a.seed}")
    moe = "-moe" if a.mlp == "moe" else ""
    base.train.steps = steps
    base.name = f"aq-gpt-{a.size}{moe}-{steps}/none-s{a.seed}"

    c = ml_collections.ConfigDict()
    c.name = f"autoquant-gpt-{a.size}{moe}-s{a.seed}"
    c.workdir = "runs"
    c.base = base
    c.candidates = "qat_mxfp8,qat_mxfp6,qat_nvfp4,qat_mxfp4"
    c.methods = "isolated,gradient,kl,shapley"
    c.shapley_steps = 8
    c.shapley_rule = "midpoint"  # or "gauss" (lowbit.autoquant.path_points)
    c.calib_batches = 8
    c.eval_batches = 32
    c.budgets = "4.5,5,6,8"
    c.cost = "stored"  # or "active": bits per active parameter (MoE experts at top_k / experts)
    c.heuristic_low = "qat_mxfp4,qat_nvfp4,qat_mxfp6"
    c.heuristic_high = "none,qat_mxfp8"
    c.matched = True
    c.qat_steps = 0
    c.qat_budgets = ""  # which budgets' best plans the QAT trains ("": every budget)
    c.qat_lr = base.train.lr / 5
    c.random_recipes = 32  # random mixed-precision recipes that validate the predictions
    c.seed = 0  # keys of candidates that draw random numbers while scored; the random recipes
    return c
