"""A byte-level GPT on the complete works of Shakespeare, trained under one lowbit recipe.

    python -m experiments.train --config configs/gpt.py:size=tiny,recipe=mxfp4
    python -m experiments.train --config configs/gpt.py:size=s,recipe=nvfp4 \
        --config.train.steps=2000
    python -m experiments.compare --config configs/gpt.py:size=xs \
        --recipes none,mxfp8,mxfp6,mxfp4,nvfp4,quartet --seeds 0,1,2

Arguments (after the colon, comma-separated): ``size`` (nano | tiny | xs | s | m | l, about
0.04M / 0.1M / 0.6M / 3.2M / 11M / 19M parameters), ``recipe`` (any
``lowbit.gemm.recipes.names()``), ``mlp`` (dense | moe), ``moe`` (capacity | dropless: the
MoE's ``model.moe_impl``; dropless runs are named ``gpt-<size>-moe-dropless``), ``seed``.
Every other field is a flag
override, e.g. ``--config.model.positions=learned``, ``--config.data.path=my_corpus/``,
``--config.mesh.fsdp=4``, ``--config.quant.high_precision='embed|head'``.

``quant.implementation`` chooses how the quantized GEMMs run (``lowbit.flax.quantize(...,
implementation=...)``, down to ``lowbit.dot_general``): unset (None, the default) takes the
best for the backend (the Pallas kernels on a GPU; the XLA emulation with lowbit's compiled CPU
kernel on CPU); ``xla`` the pure-XLA emulation, the reference; ``pallas`` sends every plain
``x @ w`` layer through the Pallas kernels when lowered for CUDA and the emulation elsewhere
(a 3-D activation needs ``model.seq_len`` to be a multiple of 256 for it; other layers use the
emulation). It is part of the run's config (``config.json``): a finished run is not reused, nor
resumed, under another implementation::

    python -m experiments.train --config configs/gpt.py:size=m,recipe=mxfp4 \
        --config.quant.implementation=pallas

``init_from`` starts from another run's trained parameters ("" = the random init): a short QAT
or FQT fine-tune of the float model that post-training quantization uses, e.g. after the float
run ``runs/gpt-tiny/none-s0`` (same model section; only the parameters are read, from its
latest checkpoint; optimizer, step and data order start fresh)::

    python -m experiments.train --config configs/gpt.py:size=tiny,recipe=qat_mxfp4 \
        --config.init_from=runs/gpt-tiny/none-s0

The sizes are the MX whitepaper's and Quartet's GPT setting scaled to a 2-core CPU: the same
architecture and recipes run unchanged on GPUs (``dtype='auto'`` computes in bfloat16 there and
float32 on CPU, where the ``none`` recipe is then the float32 baseline). Only ``train.steps`` and
``train.batch_size`` need to grow with the hardware.
"""

from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from experiments.configlib import parse_arg
from experiments.model import LLAMA_FIELDS, GPTConfig

GPT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig)}

# d_model, layers, heads, seq_len, batch, steps, peak lr
SIZES = {
    "nano": (32, 2, 2, 64, 16, 400, 3e-3),
    "tiny": (64, 2, 4, 64, 16, 400, 3e-3),
    "xs": (128, 3, 4, 128, 16, 600, 2e-3),
    "s": (256, 4, 4, 128, 16, 600, 1e-3),
    "m": (384, 6, 6, 256, 32, 2000, 6e-4),
    "l": (512, 6, 8, 256, 32, 4000, 6e-4),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = parse_arg(arg, size="tiny", recipe="none", mlp="dense", moe="capacity", seed=0)
    if a.size not in SIZES:
        raise ValueError(f"config argument size={a.size!r}: expected one of {sorted(SIZES)}")
    if a.moe not in ("capacity", "dropless"):
        raise ValueError(f"config argument moe={a.moe!r}: expected capacity or dropless")
    d_model, layers, heads, seq_len, batch, steps, lr = SIZES[a.size]

    c = ml_collections.ConfigDict()
    moe = ("-moe" + ("-dropless" if a.moe == "dropless" else "")) if a.mlp == "moe" else ""
    c.name = f"gpt-{a.size}{moe}/{a.recipe}-s{a.seed}"
    c.workdir = "runs"
    c.seed = a.seed
    # "" = the random init; or a run directory (runs/<name>/) whose latest checkpoint's
    # parameters this run starts from (see the module docstring).
    c.init_from = ""
    # "" = none; or a Hugging Face directory of a Llama / Mistral / Qwen2 / Qwen3 checkpoint
    # (experiments/hf.py): its config.json replaces the model section, its weights the init.
    c.init_from_hf = ""

    c.model = ml_collections.ConfigDict()
    c.model.vocab = 256
    c.model.d_model = d_model
    c.model.layers = layers
    c.model.heads = heads
    c.model.mlp_ratio = 4
    c.model.seq_len = seq_len
    c.model.positions = "rope"
    c.model.tie_embeddings = False
    c.model.mlp = a.mlp
    c.model.experts = 4
    c.model.top_k = 2
    c.model.capacity_factor = 1.25
    c.model.moe_aux_weight = 0.01
    # "capacity" (expert buffers, drops past the capacity) | "dropless" (lb.ragged_dot over the
    # assignments sorted by expert: no capacity, no drops)
    c.model.moe_impl = a.moe
    c.model.dtype = "auto"
    # The Llama family (experiments/model.py's GPTConfig): the defaults keep the GPT above;
    # e.g. --config.model.mlp_act=swiglu --config.model.kv_heads=1 is a small Llama, which
    # python -m experiments.export writes for llama.cpp, vLLM and TensorRT-LLM.
    for field in LLAMA_FIELDS:
        setattr(c.model, field, GPT_DEFAULTS[field])

    c.quant = ml_collections.ConfigDict()
    c.quant.recipe = a.recipe
    # Modules kept in high precision (a regex over module paths, fullmatch): embeddings, the LM
    # head and the MoE router, as in the MX and NVFP4 training recipes. "" keeps nothing.
    c.quant.high_precision = r"embed|pos_embed|head|.*/router"
    # None (the best for the backend) | "xla" | "pallas": see the module docstring.
    c.quant.implementation = config_dict.placeholder(str)
    # A saved lowbit.autoquant.Plan (experiments/autoquant.py writes them): its sites get their
    # planned recipes, before high_precision and recipe apply. None: no plan.
    c.quant.plan = config_dict.placeholder(str)
    # TetraJet-v2's OsciReset (period 0: off) and OutControl (ratio 0: off); see
    # experiments/config.py's QuantConfig and lowbit.flax.training.
    c.quant.osci_period = 0
    c.quant.osci_window = 50
    c.quant.osci_threshold = 16.0
    c.quant.osci_start = 0
    c.quant.out_control = 0.0
    c.quant.out_control_start = 1
    c.quant.out_control_steps = 10
    c.quant.out_control_multiple = 128
    # A precision schedule: switch to switch_to at switch_step, at switch_fraction of the
    # steps, or by switch_criterion ("grad_noise"). recipe=fp4_all_the_way sets FP4 All the
    # Way's: QAF (qat_nvfp4) once the gradient norm falls below sqrt(3) times the backward's
    # quantization noise.
    fp4atw = a.recipe == "fp4_all_the_way"
    c.quant.switch_to = "qat_nvfp4" if fp4atw else config_dict.placeholder(str)
    c.quant.switch_step = 0
    c.quant.switch_fraction = 0.0
    c.quant.switch_criterion = "grad_noise" if fp4atw else ""
    c.quant.switch_check_every = 10

    c.data = ml_collections.ConfigDict()
    c.data.path = ""  # "" = Shakespeare (fetched once into cache_dir); or a text file / folder
    c.data.cache_dir = "data_cache"
    c.data.val_fraction = 0.1

    c.train = ml_collections.ConfigDict()
    c.train.steps = steps
    c.train.batch_size = batch
    c.train.lr = lr
    # Cadences follow train.steps when it is overridden (field references).
    c.train.warmup_steps = c.train.get_ref("steps") // 20
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.grad_clip = 1.0
    c.train.log_every = 10
    c.train.eval_every = c.train.get_ref("steps") // 10  # 0: only at the end
    c.train.eval_batches = 8
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
