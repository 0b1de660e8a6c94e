"""A small vision transformer on scikit-learn's handwritten digits, trained under one lowbit
recipe (the ``vit`` family of :mod:`experiments.families`; model and data in
:mod:`experiments.vision`).

    python -m experiments.train --config configs/digits.py:size=tiny,recipe=mxfp4
    python -m experiments.train --config configs/digits.py:size=s,recipe=nvfp4
    python -m experiments.compare --config configs/digits.py:size=s \
        --recipes none,mxfp8,mxfp6,mxfp4,nvfp4 --seeds 0,1,2

Arguments (after the colon, comma-separated): ``size`` (tiny | s: about 55K / 0.1M
parameters; tiny trains in seconds on a CPU, s to over 90% validation accuracy in about a
minute), ``recipe`` (any ``lowbit.gemm.recipes.names()``), ``seed``. Every other field is a flag
override, e.g. ``--config.train.steps=2000``, ``--config.model.patch=4``,
``--config.quant.high_precision='embed|head'``.

``family = "vit"`` selects the model, data, loss and evaluation of this family (a config
without ``family``, such as ``configs/gpt.py``'s, is a GPT run). The 8x8 images are cut into
2x2 patches: 16 patch tokens per image, embedded to ``d_model`` (a multiple of 32, as is the
MLP's ``4 d_model``, so MX blocks of 32 and NVFP4 blocks of 16 tile every hidden GEMM). The
linear layers see ``[batch * 16, features]`` activations, so the weight gradients contract
``train.batch_size * 16`` tokens (a multiple of 64 for every recipe's Hadamard transforms with
the batch sizes here). The patch embedding, the position embedding and the classifier stay in
high precision. Validation (``data.val_fraction`` of the 1,797 images, a fixed split) is
evaluated whole at every eval and logs ``val_loss`` and ``val_accuracy``.

``init_from`` starts from another digits run's trained parameters (same model section), e.g.
a QAT fine-tune of a float run::

    python -m experiments.train --config configs/digits.py:size=s,recipe=qat_mxfp4 \
        --config.init_from=runs/vit-digits-s/none-s0 --config.train.steps=100
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from experiments.configlib import parse_arg

# d_model, layers, heads, batch, steps, peak lr
SIZES = {
    "tiny": (64, 1, 2, 32, 100, 1e-2),
    "s": (64, 2, 4, 64, 1000, 3e-3),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = parse_arg(arg, size="tiny", recipe="none", seed=0)
    if a.size not in SIZES:
        raise ValueError(f"config argument size={a.size!r}: expected one of {sorted(SIZES)}")
    d_model, layers, heads, batch, steps, lr = SIZES[a.size]

    c = ml_collections.ConfigDict()
    c.family = "vit"
    c.name = f"vit-digits-{a.size}/{a.recipe}-s{a.seed}"
    c.workdir = "runs"
    c.seed = a.seed
    # "" = the random init; or a run directory (runs/<name>/) of the same family and model
    # whose latest checkpoint's parameters this run starts from.
    c.init_from = ""

    c.model = ml_collections.ConfigDict()
    c.model.image_size = 8
    c.model.patch = 2
    c.model.channels = 1
    c.model.classes = 10
    c.model.d_model = d_model
    c.model.layers = layers
    c.model.heads = heads
    c.model.mlp_ratio = 4
    c.model.dtype = "auto"

    c.quant = ml_collections.ConfigDict()
    c.quant.recipe = a.recipe
    # Modules kept in high precision (a regex over module paths, fullmatch): the patch
    # embedding (a 4-feature contraction), the position embedding and the classifier.
    c.quant.high_precision = r"embed|pos_embed|head"
    # None (the best for the backend) | "xla" | "pallas": see configs/gpt.py.
    c.quant.implementation = config_dict.placeholder(str)

    c.data = ml_collections.ConfigDict()
    c.data.val_fraction = 0.2
    c.data.split_seed = 0  # the train / validation split (fixed across runs and seeds)

    c.train = ml_collections.ConfigDict()
    c.train.steps = steps
    c.train.batch_size = batch
    c.train.lr = lr
    c.train.warmup_steps = c.train.get_ref("steps") // 20
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 0.05
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.grad_clip = 1.0
    c.train.log_every = 10
    c.train.eval_every = c.train.get_ref("steps") // 10  # 0: only at the end
    # At most this many validation batches: more than the split holds, so all of it.
    c.train.eval_batches = 1000
    c.train.checkpoint_every = c.train.get_ref("steps") // 2  # 0: only at the end
    c.train.keep_checkpoints = 2
    c.train.stop_at = 0  # > 0: stop after this step (checkpointed), as an interruption would
    c.train.progress = True
    # QAD (experiments/distill.py): --config.train.distill_from=<float run> distils from it
    c.train.distill_from = ""
    c.train.distill_temperature = 1.0
    c.train.distill_weight = 1.0

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: all devices not used by fsdp
    c.mesh.fsdp = 1
    return c
