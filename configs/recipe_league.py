"""The FP4 recipe league (``experiments/recipe_league.py``): every FP4 training recipe on the GPT
at 25 tokens per parameter, its gap to float with seed spread, its step cost, and whether each
paper's headline claim held at this scale.

    python -m experiments.recipe_league --config configs/recipe_league.py:sizes=tiny,seeds=0+1+2
    python -m experiments.recipe_league \
        --config configs/recipe_league.py:sizes=tiny+xs,seeds=0+1+2 --config.size_seeds.xs=0
    python -m experiments.recipe_league --config configs/recipe_league.py:sizes=tiny \
        --config.entries=none,nvfp4,four_over_six

Step cost comes from ``benchmarks/bench_step.py``'s JSON (``step_cost``), measured first with

    python benchmarks/bench_step.py --recipes none,mxfp4,nvfp4,quartet,four_over_six,quartet2,\
tetrajet2,fp4_all_the_way --out benchmarks/results/bench_step_league.json

Arguments (after the colon, comma-separated; lists joined by ``+``): ``sizes``
(``configs/gpt.py``'s), ``seeds``, ``tokens_per_param`` (25: the regime of the Quartet study at
tiny). The sizes, seeds, steps and runs are those of ``configs/pareto.py`` (``base``,
``sizes.<size>``, ``size_seeds``, ``steps_scale``, ``tokens_per_param``, ``rerun``, ``workdir``,
``results_dir``): a run that study finished with the same config is reused. Fields of the league:

- ``entries``: comma-separated labels, in the order of the table. A label is a recipe name
  (``lowbit.recipes.names()``) or one of ``definitions``. ``none`` (the float baseline every gap
  is measured against) must be one of them.
- ``definitions``: ``;``-separated ``label=recipe key=value key=value ...``: an entry that runs
  ``recipe`` with the dotted keys of the GPT run config overridden (``quant.osci_period=200``,
  ``train.lr=1e-3``). A value ``<f>*steps`` is ``f`` times the size's training steps, rounded,
  at least 1: periods and windows that scale with the run length.
- ``step_cost``: the ``bench_step.py`` JSON (``--model gpt``) whose ``x none`` ratios fill the
  step-cost column (a missing file: "not measured", and the page says how to measure it).

TetraJet-v2's ablation (``tetrajet2+osci``, ``+outctl``, ``+both``): its released config
(OsciReset: period 200, window 50, threshold 8; OutControl: outlier ratio 0.1 of the channels
recorded from step 501 for 50 steps, rounded up to a multiple of 128) at tiny's 3,208 steps (25
tokens per parameter), periods, windows and start scaled with the run length at other sizes
(``<f>*steps``). The multiple is 32 at every size: at tiny (d_model 64, MLP hidden 256) 128 would
make all of d_model's channels and half the hidden ones FP8, at xs (128, 512) all of d_model's.
"""

from __future__ import annotations

import ml_collections

from configs import pareto
from experiments.configlib import parse_arg

ENTRIES = (
    "none",
    "mxfp4",
    "nvfp4",
    "quartet",
    "four_over_six",
    "quartet2",
    "tetrajet2",
    "fp4_all_the_way",
    "tetrajet2+osci",
    "tetrajet2+outctl",
    "tetrajet2+both",
)
# tiny's training steps at 25 tokens per parameter: TetraJet-v2's released step counts are kept
# there and scaled with the run length elsewhere.
TINY_STEPS = 3208


def _steps(n: int) -> str:
    return f"{n / TINY_STEPS:.6g}*steps"


OSCI = f"quant.osci_period={_steps(200)} quant.osci_window={_steps(50)} quant.osci_threshold=8.0"
OUTCTL = (
    f"quant.out_control=0.1 quant.out_control_start={_steps(501)} "
    f"quant.out_control_steps={_steps(50)} quant.out_control_multiple=32"
)
# FP4 All the Way is its recipe plus its schedule (configs/gpt.py adds the same for
# recipe=fp4_all_the_way; the league builds runs from the base config, so it says it here): QAF
# (qat_nvfp4) once the gradient norm falls below sqrt(3) times the backward's quantization noise.
FP4ATW = "quant.switch_to=qat_nvfp4 quant.switch_criterion=grad_noise"
DEFINITIONS = (
    f"fp4_all_the_way=fp4_all_the_way {FP4ATW}",
    f"tetrajet2+osci=tetrajet2 {OSCI}",
    f"tetrajet2+outctl=tetrajet2 {OUTCTL}",
    f"tetrajet2+both=tetrajet2 {OSCI} {OUTCTL}",
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = parse_arg(arg, sizes="tiny+xs", seeds="0+1+2", tokens_per_param=25.0)
    c = pareto.get_config(f"sizes={a.sizes},seeds={a.seeds},tokens_per_param={a.tokens_per_param}")
    del c["recipes"]  # the league's entries replace the Pareto study's recipes
    c.name = "recipe_league"
    c.entries = ",".join(ENTRIES)
    c.definitions = "; ".join(DEFINITIONS)
    c.step_cost = "benchmarks/results/bench_step_league.json"
    return c
