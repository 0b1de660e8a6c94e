"""The PTQ-versus-QAT study (``experiments/ptq_vs_qat.py``): a float baseline, then per format
post-training quantization (direct cast, each calibration method, MSE weight scales,
smoothing, SVDQuant) against a short QAT from the same float checkpoint.

    python -m experiments.ptq_vs_qat --config configs/ptq_vs_qat.py:family=gpt,size=xs
    python -m experiments.ptq_vs_qat --config configs/ptq_vs_qat.py:family=digits,size=s
    python -m experiments.ptq_vs_qat --config configs/ptq_vs_qat.py:family=gpt,size=tiny \
        --config.formats=mxfp4,nvfp4 --config.qat_steps=50

Arguments: ``family`` (gpt | digits), ``size`` (the family config's sizes), ``seed``. The
``base`` section is the family's training config (``configs/gpt.py`` / ``configs/digits.py``)
for the float baseline; at ``size=xs`` the GPT trains 3,000 steps (the baseline must be worth
quantizing). Fields:

- ``formats``: which quantizations: ``mxfp8``, ``mxfp6``, ``mxfp4``, ``nvfp4``, ``mxint8``
  (weights and activations: the ``qat_<format>`` recipes' forward), ``w4a16_mxfp4``,
  ``w4a16_nvfp4`` (weights only).
- ``methods``: the activation calibration methods (``lowbit.calibrate.METHODS``);
  ``percentile`` uses ``percentile``; ``calib_batches`` training batches calibrate.
- ``smooth`` / ``svd_rank`` (0: no SVDQuant row) / ``svd_iterations``.
- ``gptq``: the GPTQ, MR-GPTQ and (NVFP4) GPTQ + Four Over Six rows; ``qad``: the QAD row
  (``qat_steps`` of quantization-aware distillation from the float checkpoint).
- ``qat_steps`` (0: no QAT), ``qat_lr``: the QAT fine-tune from the float checkpoint
  (``init_from``), fresh AdamW with a ``qat_steps // 10`` warmup; ``float_control``: the same
  fine-tune in float, so that what QAT recovers is told apart from what more training gives.
- ``eval_batches``: validation batches per evaluation (0: the base config's).
"""

from __future__ import annotations

import ml_collections

from configs import digits, gpt
from experiments.configlib import parse_arg

FAMILIES = {"gpt": gpt, "digits": digits}
# size -> (float steps, QAT steps, SVDQuant rank): the rank scales with d_model as the paper's
# 32 of 4096 would not (d_model 64..256 here: ranks of 2..8 keep the branch under ~1 bit).
PLAN = {
    ("gpt", "tiny"): (400, 40, 2),
    ("gpt", "xs"): (3000, 300, 4),
    ("gpt", "s"): (3000, 300, 8),
    ("digits", "tiny"): (100, 20, 2),
    ("digits", "s"): (1000, 100, 2),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = parse_arg(arg, family="gpt", size="xs", seed=0)
    if a.family not in FAMILIES:
        raise ValueError(f"config argument family={a.family!r}: expected one of {sorted(FAMILIES)}")
    if (a.family, a.size) not in PLAN:
        sizes = sorted(s for f, s in PLAN if f == a.family)
        raise ValueError(f"config argument size={a.size!r}: expected one of {sizes}")
    steps, qat_steps, rank = PLAN[(a.family, a.size)]
    base = FAMILIES[a.family].get_config(f"size={a.size},recipe=none,seed={a.seed}")
    base.train.steps = steps

    c = ml_collections.ConfigDict()
    c.name = f"ptq-{a.family}-{a.size}-s{a.seed}"
    c.workdir = "runs"
    c.base = base
    c.formats = "mxfp8,mxfp6,mxfp4,nvfp4,mxint8,w4a16_mxfp4,w4a16_nvfp4"
    c.methods = "max,percentile,mse,entropy"
    c.percentile = 99.99
    c.calib_batches = 16
    c.smooth = True
    c.svd_rank = rank
    c.svd_iterations = 1
    c.gptq = True
    c.qad = True
    c.qat_steps = qat_steps
    c.qat_lr = base.train.lr / 5
    c.float_control = True
    c.eval_batches = 0
    return c
