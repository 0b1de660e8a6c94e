"""The weight-memory Pareto study (``experiments/pareto.py``): QAT from scratch at several GPT
sizes, one recipe per weight format (all with 8-bit activations), validation loss against the
memory the trained model's weights take.

    python -m experiments.pareto --config configs/pareto.py:sizes=tiny+xs+s,seeds=0+1+2
    python -m experiments.pareto --config configs/pareto.py:sizes=tiny+xs,tokens_per_param=25
    python -m experiments.pareto --config configs/pareto.py:sizes=tiny,steps_scale=0.5 \
        --config.recipes=none,w4a8_mxfp4,bitnet

Arguments (after the colon, comma-separated; lists joined by ``+``): ``sizes``
(``configs/gpt.py``'s: tiny | xs | s | m | l), ``seeds``, ``recipes``, ``steps_scale``,
``tokens_per_param``. Fields:

- ``recipes``, ``seeds``: comma-separated lists. ``recipes`` are ``lowbit.gemm.recipes.names()``;
  ``none``, the float baseline every gap is measured against, comes first.
- ``base``: the ``configs/gpt.py`` config every size shares (data, quantization, schedule,
  cadences): ``--config.base.train.eval_every=0`` or
  ``--config.base.quant.high_precision='embed|head'`` reach every size; runs are written under
  ``base.workdir``.
- ``sizes.<size>``: what differs by size, from ``configs/gpt.py`` (model width, depth, heads,
  sequence length; batch size, steps, peak lr), applied on top of ``base``:
  ``--config.sizes.xs.train.steps=1000``.
- steps per size: ``sizes.<size>.train.steps`` times ``steps_scale``; or, with
  ``tokens_per_param`` > 0, as many steps as give that many training tokens per model parameter
  (embeddings and head included; 25 is the regime of the Quartet study at tiny,
  experiments/results/recipes.md).
- ``size_seeds.<size>``: that size's seeds when they are not ``seeds`` (``""``: ``seeds``):
  ``--config.size_seeds.xs=0`` where a larger model costs too much to train three times.
- ``rerun``: train every run again even when it finished with the same config.
- ``workdir`` / ``name``: the study's table, JSON and figure go to ``<workdir>/<name>/``, a copy
  to ``results_dir`` (``""``: no copy); its runs to
  ``<base.workdir>/pareto-gpt-<size>-<steps>/<recipe>-s<seed>/``.
"""

from __future__ import annotations

import copy

import ml_collections

from configs import gpt
from experiments.configlib import flatten, parse_arg

# The weight formats compared, all with int8 per-token activations; "none" is the float
# baseline. A weight stored in float counts as bf16 (16 bits).
RECIPES = (
    "none",
    "w16a8",
    "w8a8_mxfp8",
    "w6a8_mxfp6",
    "w4a8_mxfp4",
    "w4a8_nvfp4",
    "w4a8_int4",
    "bitnet",
)
# The configs/gpt.py size that `base` is built from; each size's own fields override it.
BASE_SIZE = "tiny"
# Fields of configs/gpt.py that depend on the size (any other field that differs between sizes
# is added to the size sections too).
SIZE_FIELDS = {
    "model": ("d_model", "layers", "heads", "seq_len"),
    "train": ("batch_size", "steps", "lr"),
}


def _items(key: str, value: str) -> list[str]:
    items = list(dict.fromkeys(s.strip() for s in value.replace("+", ",").split(",")))
    items = [s for s in items if s]
    if not items:
        raise ValueError(f"config argument {key}={value!r}: expected at least one item")
    return items


def size_section(size: str, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The fields of ``configs/gpt.py:size=<size>`` that differ by size: ``SIZE_FIELDS``, and
    any other field whose value still differs from ``base``'s once those are set (fields that
    follow others, such as ``train.eval_every``, keep following them)."""
    own_cfg = gpt.get_config(f"size={size},recipe=none,seed=0")
    own = flatten(own_cfg.to_dict())
    keys = [(sec, k) for sec, ks in SIZE_FIELDS.items() for k in ks]
    ref = copy.deepcopy(base)
    for sec, k in keys:
        ref[sec][k] = own_cfg[sec][k]
    ref = flatten(ref.to_dict())
    keys += [p for p, v in own.items() if p[0] != "name" and p not in keys and ref.get(p) != v]
    s = ml_collections.ConfigDict()
    for path in keys:
        node = s
        for part in path[:-1]:
            if part not in node:
                node[part] = ml_collections.ConfigDict()
            node = node[part]
        node[path[-1]] = own[path]
    return s


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = parse_arg(
        arg,
        sizes="tiny+xs+s",
        seeds="0",
        recipes="+".join(RECIPES),
        steps_scale=1.0,
        tokens_per_param=0.0,
    )
    sizes = _items("sizes", a.sizes)
    unknown = [s for s in sizes if s not in gpt.SIZES]
    if unknown:
        raise ValueError(
            f"config argument sizes={a.sizes!r}: unknown size(s) {unknown}; expected some of "
            f"{list(gpt.SIZES)}"
        )
    seeds = _items("seeds", a.seeds)
    bad = [s for s in seeds if not s.lstrip("-").isdigit()]
    if bad:
        raise ValueError(f"config argument seeds={a.seeds!r}: {bad} are not integers")

    c = ml_collections.ConfigDict()
    c.name = "pareto"
    c.workdir = "runs"
    c.results_dir = "experiments/results"
    c.seeds = ",".join(seeds)
    c.recipes = ",".join(_items("recipes", a.recipes))
    c.steps_scale = a.steps_scale
    c.tokens_per_param = a.tokens_per_param
    c.rerun = False
    c.base = gpt.get_config(f"size={BASE_SIZE},recipe=none,seed=0")
    c.sizes = ml_collections.ConfigDict()
    # Per size, the seeds when they differ from ``seeds`` ("" = ``seeds``): e.g.
    # ``--config.size_seeds.xs=0`` trains the largest size once where the small ones take three.
    c.size_seeds = ml_collections.ConfigDict()
    for s in sizes:
        c.sizes[s] = size_section(s, c.base)
        c.size_seeds[s] = ""
    return c
