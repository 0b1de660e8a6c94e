"""The training loop of the experiments: sharded, checkpointed, resumable, logged.

:func:`train` takes a :class:`RunConfig` (built from a config file by
:meth:`RunConfig.from_config`) and writes, under ``<workdir>/<name>/``::

    config.json      the resolved config (what ran; compared on --resume)
    plan.json        with ``quant.plan``: a copy of the plan the run trains under (compared on
                     --resume, so an edited plan file does not change a run half-way)
    metrics.jsonl    {"kind": "train", step, tokens, loss, <the loss function's other
                      metrics>, grad_norm, nonfinite_params, lr, step_s, tokens_per_s} every
                      log_every steps; {"kind": "eval", step, tokens, val_loss[,
                      val_accuracy]} every eval_every steps and at the end
    summary.json     final validation metrics (final_val_loss[, final_val_accuracy]), median
                     step time, tokens/s
    checkpoints/     orbax: the train state (parameters, optimizer, quantizer rng state,
                     step) and the data position, every checkpoint_every steps and at the end

``init_from`` (a run directory; "" = the random init) starts a run from another run's trained
parameters, e.g. a short QAT or FQT fine-tune from the float model that post-training
quantization uses::

    python -m experiments.train --config configs/gpt.py:size=tiny,recipe=qat_mxfp4 \
        --config.init_from=runs/gpt-tiny/none-s0

Only the parameters are read, from that run's latest checkpoint; the optimizer state, the
quantizer rng state and the step start fresh (step 0), and the data order follows the new run's
own seed. Everything else (recipe, lr, steps, ...) is the new config's: the model section must
match the source's (``model.dtype``, the compute dtype, may differ: parameters are float32 in
both), the quantization recipe may differ. ``init_from`` is recorded (as an absolute path) in
config.json and is part of the config a ``--resume`` must match; a resumed run continues from its
own checkpoint and does not read ``init_from`` again. The source run is only read.

Model families (``config.family``; a config without the key is ``"gpt"``):

=========  ================================  ==========================================
family     model, loss (``model`` section)   data (``data`` section), validation metrics
=========  ================================  ==========================================
``gpt``    :class:`experiments.model.GPT`    :mod:`experiments.data` byte-level text;
           (``configs/gpt.py``)              ``val_loss`` (nats per byte)
``vit``    :class:`experiments.vision.ViT`   :mod:`experiments.vision` scikit-learn
           (``configs/digits.py``)           digits; ``val_loss``, ``val_accuracy``
=========  ================================  ==========================================

"Tokens" are what the transformer reads: bytes for GPT, patches for the ViT (16 an image).
Every linear layer not matched by ``quant.high_precision`` runs under ``quant.recipe``
through :func:`lowbit.flax.quantize`.
The step is one ``jax.jit`` with ``NamedSharding``s on a ``Mesh(("data", "fsdp"))``: the batch
splits over both axes, parameters and optimizer moments split their largest divisible axis over
``fsdp`` (one device is the degenerate case). Metrics are fetched one step late so the device
never waits on the host; a non-finite loss or gradient norm, or a non-finite parameter, stops
the run with its step number, and only checkpoints whose step was verified finite are written.

For analyses of trained runs (post-training quantization versus QAT, ...):
:func:`load_trained` reads a run's config and its float model with the latest checkpoint's
parameters, :func:`evaluate` computes the validation metrics of any model with the
``(logits, aux) = model(inputs)`` convention on the batches the loop's final eval uses, and
:func:`calibration_batches` draws model inputs from the training split.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import lowbit as lb
import lowbit.flax as lbf
from experiments import data as data_lib
from experiments import distributed, vision
from experiments.configlib import ConfigError, to_dataclass, to_plain
from experiments.model import GPT, GPTConfig
from experiments.model import loss_fn as gpt_loss_fn
from lowbit import autoquant
from lowbit.implementation import validate

__all__ = [
    "TrainConfig",
    "QuantConfig",
    "MeshConfig",
    "RunConfig",
    "RunResult",
    "TrainingDiverged",
    "RunExists",
    "train",
    "make_mesh",
    "quant_rules",
    "read_metrics",
    "config_diff",
    "FAMILIES",
    "build_model",
    "build_float_model",
    "load_trained",
    "runs_started_from",
    "remove_run",
    "evaluate",
    "calibration_batches",
    "train_or_reuse",
    "fine_tune_config",
    "split_list",
]

AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule and loop cadence (AdamW, linear warmup then cosine decay)."""

    steps: int = 100
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    log_every: int = 10
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 8
    checkpoint_every: int = 50  # 0: only at the end
    keep_checkpoints: int = 2
    stop_at: int = 0  # > 0: stop (with a checkpoint) after this step, as an interruption would
    progress: bool = True

    def __post_init__(self):
        for f in ("steps", "batch_size", "log_every", "eval_batches", "keep_checkpoints"):
            if getattr(self, f) < 1:
                raise ValueError(f"train.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("eval_every", "checkpoint_every"):
            if getattr(self, f) < 0:
                raise ValueError(
                    f"train.{f} must be >= 0 (0: only at the end), got {getattr(self, f)}"
                )
        if not 0 <= self.warmup_steps < self.steps:  # the cosine decay needs a step
            raise ValueError(
                f"train.warmup_steps must be in [0, steps - 1], got {self.warmup_steps} with "
                f"steps={self.steps}"
            )
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if not 0 <= self.stop_at <= self.steps:
            raise ValueError(f"train.stop_at must be in [0, steps], got {self.stop_at}")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Which recipe the model's linear layers train under, which modules stay float, and how
    the quantized GEMMs run: ``implementation`` is ``lowbit.dot_general``'s (None: the best
    for the backend, ``"xla"``: the pure-XLA emulation, ``"pallas"``: the Pallas kernels when
    lowered for CUDA), passed to :func:`lowbit.flax.quantize`."""

    recipe: str = "none"
    high_precision: str = r"embed|pos_embed|head|.*/router"
    implementation: str | None = None
    # A saved lowbit.autoquant.Plan (JSON; None: no plan): its sites get their planned recipes
    # ("none" included) before high_precision and recipe apply. Stored as an absolute path.
    plan: str | None = None
    # The recipe's definition version (lowbit.recipes.Recipe.version), filled in: recorded in
    # config.json, so a run of an older definition of a recipe is not reused or resumed as one
    # of the current definition (runs written before the field existed read as version 1).
    recipe_version: int | None = None

    def __post_init__(self):
        try:
            r = lb.recipes.get(self.recipe)
        except (ValueError, KeyError) as e:
            raise ValueError(f"quant.recipe: {e}") from None
        if self.recipe_version is None:
            object.__setattr__(self, "recipe_version", r.version)
        validate(self.implementation, "quant.implementation")
        if self.plan is not None:
            if not isinstance(self.plan, str | os.PathLike) or not str(self.plan):
                raise ValueError(f"quant.plan: expected a plan file (a path) or None, got "
                                 f"{self.plan!r}")
            path = str(Path(self.plan).expanduser().resolve())
            try:
                autoquant.Plan.load(path)
            except (OSError, ValueError) as e:
                raise ValueError(f"quant.plan={str(self.plan)!r}: {e}") from None
            object.__setattr__(self, "plan", path)  # resolved once, as init_from is

    def recipes(self) -> list:
        """Every recipe the rules use: ``recipe`` and the plan's."""
        out = [lb.recipes.get(self.recipe)]
        if self.plan is not None:
            out += list(autoquant.Plan.load(self.plan).recipes.values())
        return out


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape: ``data`` x ``fsdp`` (``data=-1``: the devices left over)."""

    data: int = -1
    fsdp: int = 1


# --------------------------------------------------------------------------------------------
# Model families: what the loop needs of a model, its data and its metrics


class _Family:
    """One model family: its config sections, model, loss, data, evaluation and GEMM shapes.
    The loop calls only these methods; the instances are :data:`FAMILIES`."""

    name: str
    model_config: type  # the dataclass of the ``model`` section
    data_config: type  # the dataclass of the ``data`` section
    model_cls: type  # model_cls(cfg.model, rngs=...) -> nnx.Module, (logits, aux) = m(inputs)
    loss_fn: Callable  # (model, batch) -> (loss, metrics with "loss")

    def load(self, cfg: RunConfig, log: Callable[[str], None]):
        """The data set (both splits and a ``fingerprint``)."""
        raise NotImplementedError

    def batches(self, cfg: RunConfig, dataset, state: dict | None = None):
        """The training batch stream (``next()``, ``state()``), restored from ``state``."""
        raise NotImplementedError

    def eval_batches(self, cfg: RunConfig, dataset, max_batches: int) -> list[dict]:
        raise NotImplementedError

    def eval_batch(self, model: nnx.Module, batch: dict) -> dict[str, jax.Array]:
        """Per-batch validation outputs (jittable), with the batch's mean loss as "loss"."""
        raise NotImplementedError

    def reduce(self, outs: list[dict]) -> dict[str, float]:
        """The validation metrics (``val_loss``, ...) from the outputs of every eval batch."""
        raise NotImplementedError

    def tokens_per_example(self, m) -> int:
        raise NotImplementedError

    def contraction_axes(self, cfg: RunConfig) -> tuple[list, list]:
        """``(features, tokens)``: ``(name, length)`` of the axes that the quantized GEMMs
        contract, in the forward and input gradient (features) and in the weight gradient
        (tokens)."""
        raise NotImplementedError


class _GPTFamily(_Family):
    name = "gpt"
    model_config = GPTConfig
    data_config = data_lib.DataConfig
    model_cls = GPT
    loss_fn = staticmethod(gpt_loss_fn)

    def load(self, cfg, log):
        return data_lib.load(cfg.data, log=log)

    def batches(self, cfg, dataset, state=None):
        kw = dict(batch_size=cfg.train.batch_size, seq_len=cfg.model.seq_len, seed=cfg.seed)
        if state is None:
            return data_lib.Batches(dataset.train, **kw)
        return data_lib.Batches.restore(dataset.train, state, **kw)

    def eval_batches(self, cfg, dataset, max_batches):
        return data_lib.eval_batches(
            dataset.val,
            batch_size=cfg.train.batch_size,
            seq_len=cfg.model.seq_len,
            max_batches=max_batches,
        )

    def eval_batch(self, model, batch):
        logits_BTV, _ = model(batch["inputs"])
        ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
        return {"loss": jnp.mean(ce_BT)}

    def reduce(self, outs):
        # (full batches of one size: the mean of the batch means)
        return {"val_loss": float(np.mean([float(o["loss"]) for o in outs]))}

    def tokens_per_example(self, m):
        return m.seq_len

    def contraction_axes(self, cfg):
        m = cfg.model
        features = [("model.d_model", m.d_model), ("model.d_model * model.mlp_ratio", m.d_ff)]
        tokens = [("model.seq_len", m.seq_len)]
        if m.mlp == "moe":  # experts' weight gradients contract the capacity axis
            tokens.append(("model.capacity_multiple", m.capacity_multiple))
        return features, tokens


class _ViTFamily(_Family):
    name = "vit"
    model_config = vision.ViTConfig
    data_config = vision.DigitsDataConfig
    model_cls = vision.ViT
    loss_fn = staticmethod(vision.loss_fn)

    def load(self, cfg, log):
        return vision.load(cfg.data, log=log)

    def batches(self, cfg, dataset, state=None):
        kw = dict(batch_size=cfg.train.batch_size, seed=cfg.seed)
        if state is None:
            return vision.Batches(dataset.train, **kw)
        return vision.Batches.restore(dataset.train, state, **kw)

    def eval_batches(self, cfg, dataset, max_batches):
        return vision.eval_batches(
            dataset.val, batch_size=cfg.train.batch_size, max_batches=max_batches
        )

    def eval_batch(self, model, batch):
        logits_BC, _ = model(batch["inputs"])
        sums = vision.batch_sums(logits_BC, batch)
        return {"loss": sums["loss_sum"] / sums["count"], **sums}

    def reduce(self, outs):
        # Sums over examples (the last batch is padded, its padding weighted 0), in float64.
        total = {k: math.fsum(float(o[k]) for o in outs) for k in ("loss_sum", "correct", "count")}
        return {
            "val_loss": total["loss_sum"] / total["count"],
            "val_accuracy": total["correct"] / total["count"],
        }

    def tokens_per_example(self, m):
        return m.num_patches

    def contraction_axes(self, cfg):
        m, q = cfg.model, cfg.quant
        features = [("model.d_model", m.d_model), ("model.d_model * model.mlp_ratio", m.d_ff)]
        if not (q.high_precision and re.fullmatch(q.high_precision, "embed")):
            features.append(("model.patch ** 2 * model.channels", m.patch_dim))
        # The linear layers see [batch * patches, features]: a weight gradient contracts all
        # the patch tokens of a batch.
        tokens = [
            ("train.batch_size * model.num_patches", cfg.train.batch_size * m.num_patches)
        ]
        return features, tokens


FAMILIES: dict[str, _Family] = {f.name: f for f in (_GPTFamily(), _ViTFamily())}
"""The model families by ``config.family`` name (see the module docstring)."""

DEFAULT_FAMILY = "gpt"  # what a config (or an older run's config.json) without "family" is


def _family(cfg: RunConfig) -> _Family:
    return FAMILIES[cfg.family]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str
    model: GPTConfig | vision.ViTConfig  # the family's model config
    data: data_lib.DataConfig | vision.DigitsDataConfig  # the family's data config
    train: TrainConfig
    quant: QuantConfig
    mesh: MeshConfig = MeshConfig()
    seed: int = 0
    workdir: str = "runs"
    # A run directory whose latest checkpoint's parameters this run starts from ("" = the
    # random init); stored resolved to an absolute path. See the module docstring.
    init_from: str = ""
    # The model family, a key of FAMILIES: which model, data, loss and metrics.
    family: str = DEFAULT_FAMILY

    @classmethod
    def from_config(cls, c) -> RunConfig:
        """From a ConfigDict such as ``configs/gpt.py``'s or ``configs/digits.py``'s, or the
        dict of a run's config.json (dtype ``auto`` resolved here)."""
        c = to_plain(c)
        known = {"name", "model", "data", "train", "quant", "mesh", "seed", "workdir"}
        known |= {"init_from", "family"}
        unknown = sorted(set(c) - known)
        if unknown:
            raise ConfigError(f"config: unknown key(s) {unknown}; expected {sorted(known)}")
        family = c.get("family") or DEFAULT_FAMILY
        if family not in FAMILIES:
            raise ConfigError(f"config.family={family!r}: expected one of {sorted(FAMILIES)}")
        fam = FAMILIES[family]
        model = dict(c.get("model", {}))
        if model.get("dtype", "float32") == "auto":
            model["dtype"] = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        return cls(
            name=str(c.get("name", "run")),
            model=to_dataclass(fam.model_config, model, "model"),
            data=to_dataclass(fam.data_config, c.get("data"), "data"),
            train=to_dataclass(TrainConfig, c.get("train"), "train"),
            quant=to_dataclass(QuantConfig, c.get("quant"), "quant"),
            mesh=to_dataclass(MeshConfig, c.get("mesh"), "mesh"),
            seed=int(c.get("seed", 0)),
            workdir=str(c.get("workdir", "runs")),
            init_from=c.get("init_from") or "",
            family=family,
        )

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"config.family={self.family!r}: expected one of {sorted(FAMILIES)}")
        fam = FAMILIES[self.family]
        for section, want in (("model", fam.model_config), ("data", fam.data_config)):
            if not isinstance(getattr(self, section), want):
                raise ConfigError(
                    f"config.{section}: family {self.family!r} takes a {want.__name__}, got "
                    f"{type(getattr(self, section)).__name__}"
                )
        _check_hadamard_fits(self)
        if not isinstance(self.init_from, str | os.PathLike):
            raise ConfigError(
                f'config.init_from: expected a run directory (a path) or "", got {self.init_from!r}'
            )
        if self.init_from:  # resolved once, so config.json and --resume compare one path
            object.__setattr__(self, "init_from", str(Path(self.init_from).expanduser().resolve()))

    @property
    def run_dir(self) -> Path:
        return Path(self.workdir) / self.name

    def to_json(self) -> dict:
        return to_plain(self)


def _check_hadamard_fits(cfg: RunConfig) -> None:
    """A recipe's Hadamard blocks must divide the contraction axes they run along: features
    (forward, input gradient) and the tokens (weight gradient): the sequence of a GPT
    (``model.seq_len``), the patch tokens of a ViT's batch (``train.batch_size *
    model.num_patches``, its linear layers seeing ``[batch * patches, features]``)."""
    q = cfg.quant
    feature_axes, token_axes = _family(cfg).contraction_axes(cfg)
    for r in q.recipes():
        feats = [g.hadamard for g in (r.fwd, r.dlhs) if g.hadamard]
        tokens = r.drhs.hadamard
        checks = [(h, name, n) for name, n in feature_axes for h in feats]
        if tokens:
            checks += [(tokens, name, n) for name, n in token_axes]
        where = "quant.recipe" if r.name == q.recipe else "quant.plan's recipe"
        for h, name, n in checks:
            if n % h:
                raise ConfigError(
                    f"{where}={r.name!r} applies Hadamard transforms of {h} along GEMM "
                    f"contraction axes: {name}={n} must be a multiple of {h}"
                )


# Fields that may differ between a run and its resumption (they do not change the numbers).
_RESUMABLE = {("train", "stop_at"), ("train", "progress"), ("train", "keep_checkpoints")}
# Fields added after runs were written with no value for them, and the value those runs had in
# effect (config_diff reads a missing key as this instead of None).
_ADDED = {("init_from",): "", ("family",): DEFAULT_FAMILY, ("quant", "recipe_version"): 1}
# Model fields an init_from run may change: they do not change the parameters.
_INIT_FROM_FREE = {"dtype"}


class TrainingDiverged(RuntimeError):
    """A non-finite loss, gradient norm or parameter: the run stopped; earlier checkpoints
    are kept."""


class RunExists(RuntimeError):
    """The run directory already holds checkpoints and ``resume`` was not asked for."""


@dataclasses.dataclass(frozen=True)
class RunResult:
    run_dir: Path
    step: int
    final_val_loss: float | None
    losses: dict[int, float]  # train loss per logged step (this invocation's and earlier ones)
    step_time_s: float | None  # median over the logged intervals of this invocation
    # Every final validation metric: {"val_loss": ...} (+ "val_accuracy" for the ViT)
    final_val: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"


# --------------------------------------------------------------------------------------------
# Model, rules, mesh, shardings


def quant_rules(q: QuantConfig) -> list[tuple[str, str | lb.Recipe]]:
    """``lowbit.flax`` rules: the plan's sites first (``quant.plan``: each its planned recipe),
    then the high-precision modules, everything else under the recipe."""
    rules: list = []
    if q.plan is not None:
        rules += autoquant.Plan.load(q.plan).rules()
    if q.high_precision:
        rules.append((q.high_precision, "none"))
    rules.append((r".*", q.recipe))
    return rules


def build_float_model(cfg: RunConfig) -> nnx.Module:
    """The family's model (GPT or ViT) of ``cfg.model``, unquantized, its parameters the
    random init seeded by ``cfg.seed`` (the init of a run of ``cfg``)."""
    return _family(cfg).model_cls(cfg.model, rngs=nnx.Rngs(params=cfg.seed))


def build_model(cfg: RunConfig) -> nnx.Module:
    """The family's model with its linear layers quantized by :func:`quant_rules` (seeded by
    cfg.seed): the model a run of ``cfg`` trains."""
    model = build_float_model(cfg)
    return lbf.quantize(
        model,
        quant_rules(cfg.quant),
        rngs=nnx.Rngs(quant=cfg.seed + 1),
        implementation=cfg.quant.implementation,
    )


def make_mesh(m: MeshConfig, devices=None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over the first ``data * fsdp`` devices."""
    devices = list(jax.devices() if devices is None else devices)
    if m.fsdp < 1 or m.data == 0 or m.data < -1:
        raise ConfigError(f"config.mesh: data must be -1 or >= 1 and fsdp >= 1, got {m}")
    data = len(devices) // m.fsdp if m.data == -1 else m.data
    if data < 1 or data * m.fsdp > len(devices):
        raise ConfigError(
            f"config.mesh: data={m.data} x fsdp={m.fsdp} needs more than the "
            f"{len(devices)} available devices"
        )
    grid = np.array(devices[: data * m.fsdp], dtype=object).reshape(data, m.fsdp)
    return Mesh(grid, AXES)


def _param_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """Shard the largest axis divisible by ``fsdp`` over "fsdp" (ties: the first such axis)."""
    if fsdp == 1 or len(shape) == 0:
        return P()
    axes = [a for a in range(len(shape)) if shape[a] % fsdp == 0 and shape[a] >= fsdp]
    if not axes:
        return P()
    a = max(axes, key=lambda i: (shape[i], -i))
    return P(*(("fsdp" if i == a else None) for i in range(len(shape))))


def _shardings(tree, mesh: Mesh):
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, _param_spec(tuple(x.shape), fsdp)), tree)


def _schedule(t: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=t.warmup_steps,
        decay_steps=t.steps,
        end_value=t.lr * t.min_lr_ratio,
    )


def _optimizer(t: TrainConfig) -> optax.GradientTransformation:
    # Weight decay on matrices only (not norms' scales).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(
        _schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask
    )
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip else adamw


# --------------------------------------------------------------------------------------------
# Keys in checkpoints: typed PRNG keys are saved as their raw key data.


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _unkey(tree):
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _unkey_abstract(tree):
    return jax.tree.map(lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x, tree)


def _rekey(tree, like):
    return jax.tree.map(lambda x, l: jax.random.wrap_key_data(x) if _is_key(l) else x, tree, like)


# --------------------------------------------------------------------------------------------
# The loop


class _Trainer:
    def __init__(self, cfg: RunConfig, mesh: Mesh):
        self.cfg = cfg
        self.mesh = mesh
        family = _family(cfg)
        self.tx = _optimizer(cfg.train)
        self.schedule = _schedule(cfg.train)

        def init(params=None):
            model = build_model(cfg)
            _, own, rest = nnx.split(model, nnx.Param, ...)
            params = own if params is None else params  # (the unused random init is dropped)
            return {
                "step": jnp.zeros((), jnp.int32),
                "params": params,
                "rest": rest,
                "opt": self.tx.init(params),
            }

        self.graphdef = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param, ...)[0]
        self.abstract = jax.eval_shape(init)
        self.state_sharding = _shardings(self.abstract, mesh)
        self._init = jax.jit(init, out_shardings=self.state_sharding)
        self._init_with = jax.jit(
            init,
            in_shardings=(self.state_sharding["params"],),
            out_shardings=self.state_sharding,
        )
        # The leading (batch) axis of every batch array over both mesh axes.
        self.batch_sharding = NamedSharding(mesh, P(AXES))
        graphdef = self.graphdef

        def step_fn(state, batch):
            def objective(params):
                model = nnx.merge(graphdef, params, state["rest"], copy=True)
                loss, metrics = family.loss_fn(model, batch)
                _, _, rest = nnx.split(model, nnx.Param, ...)
                return loss, (metrics, rest)

            (loss, (metrics, rest)), grads = jax.value_and_grad(objective, has_aux=True)(
                state["params"]
            )
            updates, opt = self.tx.update(grads, state["opt"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            metrics = dict(metrics)
            metrics["grad_norm"] = optax.tree.norm(grads)
            # A finite loss and gradient can still give non-finite parameters (a huge lr):
            # checked before a checkpoint is written. (A count, not a norm: a norm of large
            # finite parameters can overflow.)
            metrics["nonfinite_params"] = sum(
                jnp.sum(~jnp.isfinite(p)).astype(jnp.float32) for p in jax.tree.leaves(params)
            )
            metrics["lr"] = self.schedule(state["step"])
            new = {"step": state["step"] + 1, "params": params, "rest": rest, "opt": opt}
            return new, metrics

        def eval_fn(state, batch):
            model = nnx.merge(graphdef, state["params"], state["rest"], copy=True)
            return family.eval_batch(model, batch)

        # The step unjitted (for jax.export, e.g. lowering it for CUDA on any machine).
        self.step_fn = step_fn
        self.step = jax.jit(
            step_fn,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, None),
            donate_argnums=0,
        )
        # Per eval batch: every output of the family's eval (reduced by family.reduce) ...
        self.eval_outputs = jax.jit(
            eval_fn, in_shardings=(self.state_sharding, self.batch_sharding)
        )
        # ... and the batch's mean loss alone.
        self.eval = jax.jit(
            lambda state, batch: eval_fn(state, batch)["loss"],
            in_shardings=(self.state_sharding, self.batch_sharding),
        )

    def init_state(self, params=None):
        """A fresh train state (step 0, a fresh optimizer and quantizer rng state), with the
        random init's parameters or ``params`` (a tree like ``abstract["params"]``)."""
        return self._init() if params is None else self._init_with(params)

    def put_batch(self, batch: dict[str, np.ndarray]):
        """The global batch (every process draws the same one) as a sharded array: each
        process places the slices its own devices hold, whatever the mesh's layout."""
        return {
            k: jax.make_array_from_callback(v.shape, self.batch_sharding, lambda i, v=v: v[i])
            for k, v in batch.items()
        }


def _ckpt_manager(cfg: RunConfig):
    """The run's own checkpoints (created on first use; the oldest deleted past
    ``train.keep_checkpoints``)."""
    return _checkpoints(cfg.run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)


def _checkpoints(directory: Path, *, keep: int | None = None, read_only: bool = False):
    """An orbax manager of a run's ``checkpoints/`` directory; ``read_only``: one that never
    creates, writes or deletes anything there (another run's checkpoints, for init_from)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if read_only:  # the handlers named: a manager that has not saved can read the metadata
        options = ocp.CheckpointManagerOptions(
            read_only=True, create=False, save_interval_steps=0, enable_async_checkpointing=False
        )
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
        # orbax warns that the directory is read only: what was asked; not shown.
        notice = lambda record: "directory is read only" not in record.getMessage()
        absl_log = logging.getLogger("absl")
        absl_log.addFilter(notice)
        try:
            return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
        finally:
            absl_log.removeFilter(notice)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=False, create=True
    )
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))


def _save(mngr, step: int, state, batches, fingerprint: str) -> None:
    """Checkpoint ``step``: the train state and the data position (``batches.state()``)."""
    import orbax.checkpoint as ocp

    data_state = dict(batches.state(), fingerprint=fingerprint)
    mngr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(_unkey(state)), data=ocp.args.JsonSave(data_state)
        ),
        force=True,
    )
    mngr.wait_until_finished()


def _restore(mngr, trainer: _Trainer, step: int, *, params_only: bool = False):
    """Checkpoint ``step`` onto ``trainer``'s state shardings: ``(train state, data state)``.

    ``params_only``: ``(parameters, None)``, read alone from the saved train state (its
    optimizer, quantizer rng state and step, and the data position, are not read: a checkpoint
    of another recipe or optimizer serves), after checking that the saved parameter tree has
    this model's paths, shapes and dtypes (a mismatch names the first parameter that differs).
    """
    import orbax.checkpoint as ocp

    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        _unkey_abstract(trainer.abstract),
        trainer.state_sharding,
    )
    if params_only:
        return _restore_params(mngr, step, target["params"]), None
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
    got = _restoring(mngr, step, lambda: mngr.restore(step, args=args))
    return _rekey(got["state"], trainer.abstract), dict(got["data"])


def _restoring(mngr, step: int, restore: Callable):
    """``restore()``, with orbax / tensorstore errors (they vary) as a ConfigError naming the
    checkpoint."""
    try:
        return restore()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(
            f"cannot restore checkpoint step {step} in {mngr.directory}: {type(e).__name__}: {e}"
        ) from e


def _restore_params(mngr, step: int, target):
    """The parameters alone of checkpoint ``step``'s train state, onto ``target`` (a tree of
    ``jax.ShapeDtypeStruct`` with shardings), after checking that the saved tree has its
    paths, shapes and dtypes (see :func:`_restore`)."""
    import orbax.checkpoint as ocp

    target = {"params": target}
    args = ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        )
    )

    def restore():
        _check_saved_params(mngr, step, target["params"])
        return mngr.restore(step, args=args)

    return _restoring(mngr, step, restore)["state"]["params"]


def _flat_paths(tree) -> dict[str, tuple]:
    """``{"blocks/0/attn/qkv/kernel": (shape, dtype)}`` for the arrays of a (metadata) tree."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for keypath, leaf in flat:
        names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keypath]
        if names and names[-1] == "value":  # an nnx.Variable's array
            names.pop()
        out["/".join(names)] = (tuple(leaf.shape), np.dtype(leaf.dtype).name)
    return out


def _check_saved_params(mngr, step: int, target) -> None:
    """ConfigError naming the first parameter whose path, shape or dtype differs between
    checkpoint ``step`` and ``target``."""
    meta = mngr.item_metadata(step)["state"]
    saved = _flat_paths(meta.tree["params"] if hasattr(meta, "tree") else meta["params"])
    want = _flat_paths(target)
    for path, (shape, dtype) in want.items():
        if path not in saved:
            raise ConfigError(
                f"parameter {path!r} (shape {shape}) is missing from checkpoint step {step} in "
                f"{mngr.directory}"
            )
        if saved[path] != (shape, dtype):
            raise ConfigError(
                f"parameter {path!r} is {saved[path][1]}{list(saved[path][0])} in checkpoint "
                f"step {step} in {mngr.directory}; this model's is {dtype}{list(shape)}"
            )
    extra = sorted(set(saved) - set(want))
    if extra:
        raise ConfigError(
            f"parameter {extra[0]!r} of checkpoint step {step} in {mngr.directory} is not in "
            f"this model ({len(extra)} such)"
        )


_EXPECTED_RUN = "expected a run directory written by experiments.train (config.json, checkpoints/)"


def _check_run_dir(src: Path, what: str) -> None:
    """ConfigError naming ``what=src`` unless ``src`` is a directory with a config.json."""
    if not src.exists():
        raise ConfigError(f"{what}={str(src)!r} does not exist; {_EXPECTED_RUN}")
    if not (src / "config.json").is_file():
        raise ConfigError(
            f"{what}={str(src)!r} is not a run directory (no config.json); {_EXPECTED_RUN}"
        )


def _read_run_config(src: Path, what: str) -> dict:
    """The dict of ``src/config.json`` (a ConfigError naming ``what=src`` when unreadable)."""
    try:
        saved = json.loads((src / "config.json").read_text())
        if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
            raise ValueError("no model section")
        return saved
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{what}={str(src)!r}: cannot read the model section of its config.json "
            f"({type(e).__name__}: {e}); {_EXPECTED_RUN}"
        ) from None


def _latest_checkpoint(src: Path, what: str) -> tuple[Path, int]:
    """``src/checkpoints`` and its latest step (read only); a ConfigError naming ``what=src``
    when it has none."""
    ckpt_dir = src / "checkpoints"
    step = None
    if ckpt_dir.is_dir():
        mngr = _checkpoints(ckpt_dir, read_only=True)
        step = mngr.latest_step()
        mngr.close()
    if step is None:
        raise ConfigError(
            f"{what}={str(src)!r} has no checkpoint (nothing saved under {ckpt_dir}); "
            "expected a run that wrote one (runs save at the end and every "
            "train.checkpoint_every steps)"
        )
    return ckpt_dir, int(step)


def _check_init_from(cfg: RunConfig) -> tuple[Path, int]:
    """The checkpoint directory of the run ``cfg.init_from`` names and its latest step, after
    checking that it is a run directory with a checkpoint, of the family and the model of
    ``cfg`` (read only). Raises ConfigError naming ``init_from`` and what was expected."""
    src = Path(cfg.init_from)
    _check_run_dir(src, "init_from")
    if src == cfg.run_dir.resolve():
        raise ConfigError(
            f"init_from={str(src)!r} is this run's own directory; pass --resume to continue it, or "
            "name another run"
        )
    saved = _read_run_config(src, "init_from")
    saved_family = saved.get("family") or DEFAULT_FAMILY
    if saved_family != cfg.family:
        raise ConfigError(
            f"init_from={str(src)!r}: the source run is of model family {saved_family!r}, this "
            f"config's is {cfg.family!r}; expected a run of the same family and architecture "
            "(only the quantization recipe, the training settings and model.dtype may change)"
        )
    saved_model = dict(saved["model"])
    model = cfg.to_json()["model"]
    for k in _INIT_FROM_FREE:
        saved_model.pop(k, None)
        model.pop(k, None)
    diff = config_diff({"model": saved_model}, {"model": model})
    if diff:
        raise ConfigError(
            f"init_from={str(src)!r}: the source run's model differs from this config's "
            f"(source -> this run): {', '.join(diff)}; expected the same architecture (only "
            "the quantization recipe, the training settings and model.dtype may change)"
        )
    return _latest_checkpoint(src, "init_from")


def config_diff(saved: dict, now: dict, prefix=()) -> list[str]:
    """The fields that differ between two ``RunConfig.to_json()`` dicts, as ``"a.b: x -> y"``,
    leaving out those a run may change when resumed (the name, the workdir, ``_RESUMABLE``).
    A key missing on one side reads as None (a field added since the run was written), or as
    the value older runs had in effect for the fields ``_ADDED`` lists."""
    out = []
    for k in sorted(set(saved) | set(now)):
        key = (*prefix, k)
        a, b = saved.get(k, _ADDED.get(key)), now.get(k, _ADDED.get(key))
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, key)
        elif a != b and key not in _RESUMABLE and key != ("name",) and key != ("workdir",):
            out.append(f"{'.'.join(key)}: {a!r} -> {b!r}")
    return out


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl`` (a torn last line from a crash is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _truncate_metrics(path: Path, after_step: int) -> None:
    if not path.exists():
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= after_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


def _write_json(path: Path, obj) -> None:
    """``path`` as indented JSON, written under a temporary name and renamed into place (other
    processes, or a reader, never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _finite(metrics: dict) -> bool:
    finite = all(math.isfinite(float(metrics[k])) for k in ("loss", "grad_norm"))
    return finite and metrics["nonfinite_params"] == 0


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    devices=None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Train ``cfg`` (see the module docstring); ``resume`` continues from the last checkpoint.
    A run that starts afresh with ``cfg.init_from`` set takes its parameters from that run's
    latest checkpoint (checked before anything is written).

    Raises :class:`TrainingDiverged` on a non-finite loss (naming the step and the last good
    checkpoint), :class:`RunExists` when the run directory holds checkpoints and ``resume`` is
    False, :class:`experiments.data.DataError` for bad data, ConfigError for a bad config (an
    ``init_from`` that is not a run with a checkpoint of the same model included).
    """
    t = cfg.train
    run_dir = cfg.run_dir
    ckpt_dir = run_dir / "checkpoints"
    has_ckpt = ckpt_dir.exists() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
    if has_ckpt and not resume:
        raise RunExists(
            f"{run_dir} already holds checkpoints: pass --resume to continue it, or choose "
            "another config.name (nothing was changed)"
        )
    if resume and (run_dir / "config.json").exists():
        saved = json.loads((run_dir / "config.json").read_text())
        diff = config_diff(saved, cfg.to_json())
        if diff:
            raise ConfigError(f"--resume with a config that differs from {run_dir}: {diff}")
    plan_copy = run_dir / "plan.json"  # the plan the run trains under, as it was at its start
    if resume and cfg.quant.plan is not None and plan_copy.exists():
        if autoquant.Plan.load(plan_copy) != autoquant.Plan.load(cfg.quant.plan):
            raise ConfigError(
                f"--resume: the plan file quant.plan={cfg.quant.plan!r} changed since {run_dir} "
                f"started (the run trains under its copy {plan_copy}); nothing was changed"
            )
    # A resumed run continues from its own checkpoint: init_from is read only by a fresh start.
    source = _check_init_from(cfg) if cfg.init_from and not (resume and has_ckpt) else None

    family = _family(cfg)
    writer = distributed.is_writer()  # process 0 writes the run's files (one process: it)
    if writer:  # builds the tokenized cache when missing; the others read it when it is there
        dataset = family.load(cfg, log=log)
    distributed.barrier("lowbit-data")
    if not writer:
        dataset = family.load(cfg, log=_quiet)
    mesh = make_mesh(cfg.mesh, devices)
    n_dev = mesh.size
    if t.batch_size % n_dev:
        raise ConfigError(
            f"config.train.batch_size={t.batch_size} must be a multiple of the {n_dev} devices "
            "of the mesh"
        )
    trainer = _Trainer(cfg, mesh)
    init_params = None
    if source is not None:  # read before this run writes anything
        src_dir, src_step = source
        src_mngr = _checkpoints(src_dir, read_only=True)
        try:
            init_params, _ = _restore(src_mngr, trainer, src_step, params_only=True)
        except ConfigError as e:
            raise ConfigError(f"init_from={cfg.init_from!r}: {e}") from e
        finally:
            src_mngr.close()
    # Every process has read what it checks above before process 0 writes anything.
    distributed.barrier("lowbit-checked")
    mngr = _ckpt_manager(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if writer:
        _write_json(run_dir / "config.json", cfg.to_json())
        if cfg.quant.plan is not None and not (resume and has_ckpt and plan_copy.exists()):
            autoquant.Plan.load(cfg.quant.plan).save(plan_copy)
    metrics_path = run_dir / "metrics.jsonl"

    start = 0
    if resume and mngr.latest_step() is not None:
        start = int(mngr.latest_step())
        state, data_state = _restore(mngr, trainer, start)
        if data_state.get("fingerprint") != dataset.fingerprint:
            raise ConfigError(
                f"--resume: the data changed since the checkpoint (fingerprint "
                f"{data_state.get('fingerprint')} -> {dataset.fingerprint})"
            )
        data_state.pop("fingerprint")
        batches = family.batches(cfg, dataset, data_state)
        if writer:
            _truncate_metrics(metrics_path, start)
        log(f"resumed {run_dir} at step {start}")
    else:
        if writer and metrics_path.exists():
            metrics_path.unlink()
        state = trainer.init_state(init_params)
        if init_params is not None:
            log(f"{cfg.name}: parameters from {cfg.init_from} (checkpoint step {src_step})")
        batches = family.batches(cfg, dataset)
    evals = family.eval_batches(cfg, dataset, t.eval_batches)
    evals = [trainer.put_batch(b) for b in evals]
    stop = t.stop_at or t.steps
    tokens_per_step = t.batch_size * family.tokens_per_example(cfg.model)

    losses: dict[int, float] = {}
    intervals: list[float] = []
    last_good = start or None  # the step of the newest checkpoint known to be finite
    final_val = None  # {"val_loss": ..., ...}

    def evaluate(state) -> dict[str, float]:
        return family.reduce([trainer.eval_outputs(state, b) for b in evals])

    bar = _progress(t, start, stop, cfg.name) if writer else _NoBar()
    with open(metrics_path if writer else os.devnull, "a") as mf, bar:

        def write(rec: dict) -> None:
            mf.write(json.dumps(rec) + "\n")
            mf.flush()

        pending = None  # (step, device metrics) of the step before
        t_last, step_last = None, start

        def drain(p) -> dict:
            nonlocal t_last, step_last
            s, m = p
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            if not _finite(m):
                where = f"step {last_good} in {ckpt_dir}" if last_good else "none was written"
                raise TrainingDiverged(
                    f"{cfg.name}: loss {m['loss']}, grad norm {m['grad_norm']}, "
                    f"{m['nonfinite_params']:.0f} non-finite parameters at step {s}; stopped. "
                    f"Last good checkpoint: {where}"
                )
            losses[s] = m["loss"]
            now = time.perf_counter()
            if s % t.log_every == 0 or s == stop:
                rec = {"kind": "train", "step": s, "tokens": s * tokens_per_step, **m}
                if t_last is not None and s > step_last:
                    dt = (now - t_last) / (s - step_last)
                    intervals.append(dt)
                    rec["step_s"] = dt
                    rec["tokens_per_s"] = tokens_per_step / dt
                    bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tokens_per_step / dt:.0f}")
                write(rec)
                t_last, step_last = now, s
            bar.update(1)
            return m

        for s in range(start + 1, stop + 1):
            batch = trainer.put_batch(next(batches))
            state, metrics = trainer.step(state, batch)
            if pending is not None:
                drain(pending)
            pending = (s, metrics)
            if s == start + 1:  # the first step includes compilation: time from the next one
                jax.block_until_ready(metrics)
                t_last, step_last = time.perf_counter(), s
            if (t.eval_every and s % t.eval_every == 0) or s == stop:
                drain(pending)
                pending = None
                final_val = evaluate(state)
                write({"kind": "eval", "step": s, "tokens": s * tokens_per_step, **final_val})
                t_last, step_last = time.perf_counter(), s
            if (t.checkpoint_every and s % t.checkpoint_every == 0) or s == stop:
                if pending is not None:
                    drain(pending)
                    pending = None
                _save(mngr, s, state, batches, dataset.fingerprint)
                last_good = s
                t_last, step_last = time.perf_counter(), s
        if pending is not None:
            drain(pending)
        if final_val is None:  # resumed at its last step: nothing trained, still evaluated
            final_val = evaluate(state)
    mngr.close()

    step_time = statistics.median(intervals) if intervals else None
    summary = {
        "name": cfg.name,
        "recipe": cfg.quant.recipe,
        "seed": cfg.seed,
        "init_from": cfg.init_from or None,
        "step": stop,
        "steps": t.steps,
        "tokens": stop * tokens_per_step,
        **{f"final_{k}": v for k, v in final_val.items()},  # final_val_loss[, _accuracy]
        "final_train_loss": losses.get(stop),
        "step_s": step_time,
        "tokens_per_s": tokens_per_step / step_time if step_time else None,
        "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.abstract["params"])),
        "devices": n_dev,
        "processes": jax.process_count(),
        "backend": jax.default_backend(),
        "family": cfg.family,
    }
    if writer:
        _write_json(run_dir / "summary.json", summary)
    distributed.barrier("lowbit-done")  # the files are there when any process returns
    return RunResult(run_dir, stop, final_val["val_loss"], losses, step_time, final_val)


# --------------------------------------------------------------------------------------------
# Trained runs: the float model, validation metrics, calibration inputs


def _quiet(*_) -> None:
    pass


def load_trained(run_dir: str | os.PathLike) -> tuple[RunConfig, nnx.Module]:
    """The config of the run in ``run_dir`` (from its config.json) and its float model: the
    family's model class (:func:`build_float_model`: no quantization whatever the run's recipe,
    computing in the stored ``model.dtype``) holding the parameters of the run's latest
    checkpoint, on the first device. The run is only read.

    Raises ConfigError naming ``run_dir`` when it does not exist, is not a run directory (no
    config.json), has no checkpoint, or its checkpoint's parameters are not its model's.

    >>> load_trained("no/such/run")
    Traceback (most recent call last):
    ...
    experiments.configlib.ConfigError: run_dir='no/such/run' does not exist; expected a run directory written by experiments.train (config.json, checkpoints/)
    """  # noqa: E501
    src = Path(run_dir)
    _check_run_dir(src, "run_dir")
    try:
        cfg = RunConfig.from_config(_read_run_config(src, "run_dir"))
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"run_dir={str(src)!r}: its config.json: {e}") from e
    ckpt_dir, step = _latest_checkpoint(src, "run_dir")
    # Abstract (no random init is computed): the parameters come from the checkpoint.
    graphdef, abstract, rest = nnx.split(
        nnx.eval_shape(lambda: build_float_model(cfg)), nnx.Param, ...
    )
    if jax.tree.leaves(rest):  # state besides parameters (none today): the model's own init
        _, _, rest = nnx.split(build_float_model(cfg), nnx.Param, ...)
    device = SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    mngr = _checkpoints(ckpt_dir, read_only=True)
    try:
        params = _restore_params(mngr, step, target)
    except ConfigError as e:
        raise ConfigError(f"run_dir={str(src)!r}: {e}") from e
    finally:
        mngr.close()
    return cfg, nnx.merge(graphdef, params, rest)


@functools.partial(nnx.jit, static_argnums=2)
def _eval_outputs(model: nnx.Module, batch: dict, family: str) -> dict:
    return FAMILIES[family].eval_batch(model, batch)


def evaluate(
    cfg: RunConfig,
    model: nnx.Module,
    *,
    max_batches: int | None = None,
    batches: list[dict] | None = None,
    log: Callable[[str], None] = _quiet,
) -> dict[str, float]:
    """The validation metrics of ``model`` on the batches the final eval of a run of ``cfg``
    uses (the first ``max_batches`` of them when given): ``{"val_loss": ...}``, plus
    ``"val_accuracy"`` for the ``vit`` family, reduced as the training loop reduces them.

    ``model`` is any NNX module whose ``__call__(inputs)`` returns ``(logits, aux)``: a float
    model (:func:`load_trained`), a model quantized by :func:`lowbit.flax.quantize`, or a
    :class:`lowbit.flax.nnx.PackedModel`. Each batch runs through one ``nnx.jit`` (on the
    default device, not sharded); a model with rng streams (stochastic rounding) advances them.
    For a run of recipe ``none`` and its :func:`load_trained` model, the metrics equal the
    run's final ``summary.json`` values (a single-device run).

    ``batches``: evaluate on these batches instead, e.g. ``calibration_batches(cfg, n,
    full=True)`` (the same jitted program and reduction; the keys keep their ``val_`` names)."""
    family = _family(cfg)
    n = cfg.train.eval_batches
    if max_batches is not None:
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"max_batches must be a positive int or None, got {max_batches!r}")
        n = min(n, max_batches)
    if batches is None:
        batches = family.eval_batches(cfg, family.load(cfg, log=log), n)
    outs = [
        _eval_outputs(model, {k: jnp.asarray(v) for k, v in b.items()}, cfg.family)
        for b in batches
    ]
    return family.reduce(outs)


def calibration_batches(
    cfg: RunConfig, n: int, *, full: bool = False, log: Callable[[str], None] = _quiet
) -> list:
    """``n`` batches of model inputs from the training split (never validation), each of
    ``cfg.train.batch_size`` examples: token windows ``int32 [B, seq_len]`` (GPT) or images
    ``float32 [B, 8, 8]`` (ViT); with ``full``, the whole batches as the family's loss takes
    them (dicts with ``"inputs"`` and ``"targets"``, ...). Deterministic: the first ``n``
    training batches of a run of ``cfg`` (its seed's shuffle), the same on every call."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    family = _family(cfg)
    stream = family.batches(cfg, family.load(cfg, log=log))
    return [(dict(b) if full else b["inputs"]) for b in (next(stream) for _ in range(n))]


def train_or_reuse(cfg: RunConfig, log: Callable[[str], None] = print) -> Path:
    """Train ``cfg`` unless its run finished earlier with the same config (then reuse it; an
    unfinished run with checkpoints is resumed). Returns the run directory."""
    d = cfg.run_dir
    try:
        summary = json.loads((d / "summary.json").read_text())
        saved = json.loads((d / "config.json").read_text())
        if summary.get("step") == cfg.train.steps and not config_diff(saved, cfg.to_json()):
            log(f"{cfg.name}: finished earlier with this config, reused")
            return d
    except (OSError, json.JSONDecodeError):
        pass
    train(cfg, resume=(d / "checkpoints").exists(), log=log)
    return d


def split_list(s) -> list[str]:
    """The items of a comma-separated config string (``"mxfp4, nvfp4"`` -> two names)."""
    return [x.strip() for x in str(s).split(",") if x.strip()]


def fine_tune_config(base, *, recipe: str, name: str, steps: int, lr: float, init_from: str,
                     plan: str | None = None):
    """A copy of the ConfigDict ``base`` (``configs/gpt.py``'s, ``configs/digits.py``'s) for a
    short fine-tune from the run ``init_from`` under ``recipe`` (and ``plan``, a saved
    :class:`lowbit.autoquant.Plan`): ``steps`` steps at peak ``lr`` after a ``steps // 10``
    warmup, evaluated and checkpointed only at the end."""
    import copy

    c = copy.deepcopy(base)
    c.quant.recipe = recipe
    if plan is not None:
        c.quant.plan = str(plan)
    c.name = name
    c.init_from = init_from
    c.train.steps = steps
    c.train.lr = lr
    c.train.warmup_steps = max(0, steps // 10)
    c.train.eval_every = 0
    c.train.checkpoint_every = 0
    return c


class _NoBar:
    def set_postfix(self, **_):
        pass

    def update(self, _):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _progress(t: TrainConfig, start: int, stop: int, name: str):
    if not t.progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(
        total=stop, initial=start, desc=name, unit="step", file=sys.stderr, dynamic_ncols=True
    )


def runs_started_from(run_dir: str | os.PathLike, workdir: str | os.PathLike) -> list[Path]:
    """The run directories under ``workdir`` (``<workdir>/<group>/<run>/``) whose config.json
    names ``run_dir`` as their ``init_from`` (their parameters started from it)."""
    src = str(Path(run_dir).expanduser().resolve())
    out = []
    for cfg_path in sorted(Path(workdir).glob("*/*/config.json")):
        try:
            init = json.loads(cfg_path.read_text()).get("init_from") or ""
        except (OSError, json.JSONDecodeError):
            continue
        if init and str(Path(init).expanduser().resolve()) == src:
            out.append(cfg_path.parent)
    return out


def remove_run(run_dir: str | os.PathLike, *, workdir: str | os.PathLike | None = None) -> None:
    """Delete a run directory (used by ``compare --rerun``). With ``workdir``, refuse (a
    ConfigError, nothing deleted) when another run under it started from this one
    (``init_from``): deleting the source would leave that run without its provenance."""
    if workdir is not None:
        dependents = runs_started_from(run_dir, workdir)
        if dependents:
            raise ConfigError(
                f"will not delete {run_dir}: it is the init_from source of "
                f"{[str(d) for d in dependents]}; delete those runs first (or rerun under "
                "another config.name)"
            )
    shutil.rmtree(run_dir, ignore_errors=True)
