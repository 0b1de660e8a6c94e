"""The training loop of the experiments: sharded, checkpointed, resumable, logged.

:func:`train` takes a :class:`experiments.config.RunConfig` (built from a config file by
:meth:`~experiments.config.RunConfig.from_config`) and writes, under ``<workdir>/<name>/``::

    config.json      the resolved config (what ran; compared on --resume; :mod:`.extend`)
    plan.json        with ``quant.plan``: a copy of the plan the run trains under (compared on
                     --resume, so an edited plan file does not change a run half-way)
    metrics.jsonl    train and eval records (:mod:`experiments.metrics`)
    summary.json     what it trained (recipe: a plan's name under quant.plan, plan, ...),
                     final validation metrics, median step time, tokens/s
    checkpoints/     orbax: the train state (parameters, optimizer, quantizer rng state,
                     step) and the data position, every checkpoint_every steps and at the end
                     (:mod:`experiments.checkpoints`)

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

``init_from_hf`` (a Hugging Face directory, :mod:`experiments.hf`) starts from its weights.
The model, data, loss and metrics are the family's (:mod:`experiments.families`); every linear
layer not matched by ``quant.high_precision`` runs under ``quant.recipe`` through
:func:`lowbit.flax.quantize` (:func:`build_model`).
The step is one ``jax.jit`` with ``NamedSharding``s on a ``Mesh(("data", "fsdp"))``: the batch
splits over both axes, parameters and optimizer moments split their largest divisible axis over
``fsdp`` (one device is the degenerate case) (:class:`Trainer`). Metrics are fetched one step
late so the device never waits on the host; a non-finite loss or gradient norm, or a non-finite
parameter, stops the run with its step number, and only checkpoints whose step was verified
finite are written.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit.flax as lbf
from experiments import checkpoints, distributed, hf
from experiments.config import (
    INIT_FROM_FREE,
    MeshConfig,
    RunConfig,
    TrainConfig,
    check_run_dir,
    config_diff,
    family_of,
    quant_rules,
    read_run_config,
    run_identity,
)
from experiments.configlib import ConfigError
from experiments.distill import distill_objective
from experiments.extend import resumed_config, write_record
from experiments.families import DEFAULT_FAMILY
from experiments.metrics import finite, progress_bar, truncate_metrics, write_json
from lowbit import autoquant
from lowbit.flax import training as lbt

__all__ = [
    "AXES",
    "Trainer",
    "RunResult",
    "TrainingDiverged",
    "RunExists",
    "train",
    "make_mesh",
    "build_model",
    "build_float_model",
    "check_init_from",
]

AXES = ("data", "fsdp")


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
# Model, mesh, shardings, optimizer


def build_float_model(cfg: RunConfig) -> nnx.Module:
    """The family's model (GPT or ViT) of ``cfg.model``, unquantized, its parameters the
    random init seeded by ``cfg.seed`` (the init of a run of ``cfg``)."""
    return family_of(cfg).model_cls(cfg.model, rngs=nnx.Rngs(params=cfg.seed))


def build_model(cfg: RunConfig) -> nnx.Module:
    """The family's model with its linear layers quantized by :func:`quant_rules` (seeded by
    cfg.seed): the model a run of ``cfg`` trains."""
    model = lbf.quantize(
        build_float_model(cfg),
        quant_rules(cfg.quant),
        rngs=nnx.Rngs(quant=cfg.seed + 1),
        implementation=cfg.quant.implementation,
    )
    q = cfg.quant
    if q.out_control:
        lbt.out_control(model, ratio=q.out_control, multiple=q.out_control_multiple)
    return model


def _switched(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the recipe its precision schedule switches to (``quant.switch_to``)."""
    quant = dataclasses.replace(
        cfg.quant, recipe=cfg.quant.switch_to, recipe_version=None, switch_to=None,
        switch_step=0, switch_fraction=0.0, switch_criterion="", osci_period=0,
    )
    return dataclasses.replace(cfg, quant=quant)


def switch_step(cfg: RunConfig) -> int | None:
    """The step after which a scheduled switch happens (None: by criterion or never)."""
    q = cfg.quant
    if q.switch_to is None or q.switch_criterion:
        return None
    return q.switch_step or max(1, round(q.switch_fraction * cfg.train.schedule_steps))


GRAD_NOISE_RATIO = 3**0.5
"""FP4 All the Way's threshold (arXiv:2505.19115, section 5): quantized training stops paying
once the gradient norm falls below sqrt(3) times the norm of the backward's quantization
noise; the precision schedule's ``grad_noise`` criterion switches there."""


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
        decay_steps=t.schedule_steps,  # an extended run's lr holds its final value after it
        end_value=t.lr * t.min_lr_ratio,
    )


def _optimizer(t: TrainConfig, cfg: RunConfig | None = None) -> optax.GradientTransformation:
    """AdamW with clipping; with ``quant.osci_period``, inside TetraJet-v2's OsciReset
    (:func:`lowbit.flax.training.osci_reset`, the quantizer of the run's recipe)."""
    tx = _adamw(t)
    if cfg is None or not cfg.quant.osci_period:
        return tx
    q = cfg.quant
    model = nnx.eval_shape(lambda: build_model(cfg))
    quantizer = lbt.weight_quantizer(model, quant_rules(q))
    return lbt.osci_reset(tx, quantizer, period=q.osci_period, window=q.osci_window,
                          threshold=q.osci_threshold, start=q.osci_start)


def _adamw(t: TrainConfig) -> optax.GradientTransformation:
    # Weight decay on matrices only (not norms' scales).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(
        _schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask
    )
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip else adamw


# --------------------------------------------------------------------------------------------
# The train state and its jitted step


class Trainer:
    """The train state of a run of ``cfg`` on ``mesh`` and its jitted functions.

    The train state is a dict ``{"step", "params", "rest", "opt"}`` (the model's parameters,
    its other NNX state such as the quantizers' rng streams, the optimizer state).

    - ``abstract``: the state's ``jax.eval_shape`` (shapes, dtypes, typed keys);
      ``state_sharding``: its shardings (parameters and optimizer moments over ``fsdp``);
      ``batch_sharding``: a batch's (its leading axis over both mesh axes); ``graphdef``: the
      model's NNX graph definition. :func:`experiments.checkpoints.restore` takes
      ``abstract`` and ``state_sharding``.
    - :meth:`init_state` a fresh state; :meth:`put_batch` a host batch as a sharded array.
    - ``step(state, batch) -> (state, metrics)``: one jitted optimizer step (``state``
      donated); ``step_fn``: the same unjitted (for ``jax.export``).
    - ``eval_outputs(state, batch)``: the family's per-batch validation outputs (reduced by
      ``Family.reduce``); ``eval(state, batch)``: the batch's mean loss alone.
    - ``tx``, ``schedule``: the optimizer (AdamW, clipping) and its learning-rate schedule.
    """

    def __init__(self, cfg: RunConfig, mesh: Mesh):
        self.cfg = cfg
        self.mesh = mesh
        family = family_of(cfg)
        self.tx = _optimizer(cfg.train, cfg)
        self.schedule = _schedule(cfg.train)
        # A precision schedule's second recipe: its own model graph and non-parameter state
        # ("rest2"), and the step after which the run switched (0: not yet) in the state.
        second = _switched(cfg) if cfg.quant.switch_to is not None else None

        def init(params=None):
            model = build_model(cfg)
            _, own, rest = nnx.split(model, nnx.Param, ...)
            params = own if params is None else params  # (the unused random init is dropped)
            state = {
                "step": jnp.zeros((), jnp.int32),
                "params": params,
                "rest": rest,
                "opt": self.tx.init(params),
            }
            if second is not None:
                state["rest2"] = nnx.split(build_model(second), nnx.Param, ...)[2]
                state["switched_at"] = jnp.zeros((), jnp.int32)  # the step after which it did
            return state

        self.graphdef = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param, ...)[0]
        self.graphdef2 = None if second is None else nnx.split(
            nnx.eval_shape(lambda: build_model(second)), nnx.Param, ...)[0]
        self.abstract = jax.eval_shape(init)
        self.state_sharding = _shardings(self.abstract, mesh)
        self._init = jax.jit(init, out_shardings=self.state_sharding)
        self._init_with = jax.jit(
            init,
            in_shardings=(self.state_sharding["params"],),
            out_shardings=self.state_sharding,
        )
        self.batch_sharding = NamedSharding(mesh, P(AXES))  # a batch's leading axis: all
        graphdef = self.graphdef
        self._teacher(cfg)

        def grads_of(state, batch, phase: int = 0, teacher=None):  # phase 1: after a switch
            g, key = (graphdef, "rest") if phase == 0 else (self.graphdef2, "rest2")

            def objective(params):
                model = nnx.merge(g, params, state[key], copy=True)
                loss, metrics = self._loss(family, model, batch, teacher)
                _, _, rest = nnx.split(model, nnx.Param, ...)
                return loss, (metrics, rest)

            (_, (metrics, rest)), grads = jax.value_and_grad(objective, has_aux=True)(
                state["params"]
            )
            return grads, metrics, rest

        def step_fn(state, batch, phase: int = 0, teacher=None):
            grads, metrics, rest = grads_of(state, batch, phase, teacher)
            updates, opt = self.tx.update(grads, state["opt"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            metrics = dict(metrics)
            metrics["grad_norm"] = optax.tree.norm(grads)
            # A finite loss and gradient can still give non-finite parameters (a huge lr):
            # checked before a checkpoint is written (a count: a norm can overflow).
            metrics["nonfinite_params"] = sum(
                jnp.sum(~jnp.isfinite(p)).astype(jnp.float32) for p in jax.tree.leaves(params)
            )
            metrics["lr"] = self.schedule(state["step"])
            new = {**state, "step": state["step"] + 1, "params": params, "opt": opt}
            new["rest" if phase == 0 else "rest2"] = rest
            return new, metrics

        def eval_fn(state, batch):
            def under(g, key):
                return family.eval_batch(nnx.merge(g, state["params"], state[key], copy=True),
                                         batch)

            if self.graphdef2 is None:
                return under(graphdef, "rest")
            return jax.lax.cond(state["switched_at"] > 0, lambda: under(self.graphdef2, "rest2"),
                                lambda: under(graphdef, "rest"))

        # The step unjitted (for jax.export, e.g. lowering it for CUDA on any machine).
        self.step_fn = step_fn
        self.step = jax.jit(
            step_fn,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, None),
            donate_argnums=0,
        )
        self._distill_fns(step_fn)
        if second is not None:
            self._schedule_fns(step_fn, grads_of)
        self._out_control_fns()
        # Per eval batch: every output of the family's eval (reduced by family.reduce) ...
        self.eval_outputs = jax.jit(eval_fn, in_shardings=(self.state_sharding,
                                                           self.batch_sharding))  # ... and
        # the batch's mean loss alone:
        self.eval = jax.jit(
            lambda state, batch: eval_fn(state, batch)["loss"],
            in_shardings=(self.state_sharding, self.batch_sharding),
        )

    def _teacher(self, cfg: RunConfig) -> None:
        """QAD (experiments/distill.py): the float teacher's graph and non-parameter state; its
        parameters (``teacher_params``, which train() loads) enter the step as an argument."""
        self.teacher_params = None
        if cfg.train.distill_from:
            self._teacher_def, _, self._teacher_rest = nnx.split(build_float_model(cfg),
                                                                 nnx.Param, ...)

    def _loss(self, family, model, batch, teacher):
        """The family's loss, or with a teacher's parameters the distillation objective."""
        if teacher is None:
            return family.loss_fn(model, batch)
        t = self.cfg.train
        tm = nnx.merge(self._teacher_def, teacher, self._teacher_rest, copy=True)
        return distill_objective(family.loss_fn, model, tm, batch, t.distill_temperature,
                                 t.distill_weight)

    def _distill_fns(self, step_fn) -> None:
        """Under QAD, ``step(state, batch)`` passes the teacher's parameters to the step."""
        if not self.cfg.train.distill_from:
            return
        distilled = jax.jit(
            lambda state, batch, teacher: step_fn(state, batch, 0, teacher),
            in_shardings=(self.state_sharding, self.batch_sharding,
                          self.state_sharding["params"]),
            out_shardings=(self.state_sharding, None),
            donate_argnums=0,
        )
        self.step = lambda state, batch: distilled(state, batch, self.teacher_params)

    def _schedule_fns(self, step_fn, grads_of) -> None:
        """A precision schedule's jitted functions: ``step2`` (the step after the switch) and
        ``grad_noise`` (the ``grad_noise`` criterion's measurement)."""
        self.step2 = jax.jit(
            functools.partial(step_fn, phase=1),
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, None),
            donate_argnums=0,
        )

        def grad_noise(state, batch):
            """FP4 All the Way's criterion on ``batch``: the norm of the gradient under
            the recipe switched to (its reference), and of the current recipe's
            gradient's deviation from it (the backward's quantization noise). The
            model state is not advanced (the current recipe's keys are drawn from a
            copy)."""
            g1, _, _ = grads_of(state, batch, 0)
            g2, _, _ = grads_of(state, batch, 1)
            noise = jax.tree.map(lambda a, b: a - b, g1, g2)
            return {"grad_norm": optax.tree.norm(g2), "noise_norm": optax.tree.norm(noise)}

        self.grad_noise = jax.jit(
            grad_noise, in_shardings=(self.state_sharding, self.batch_sharding)
        )

    def _out_control_fns(self) -> None:
        """OutControl's two hooks as jitted ``state -> state`` functions:
        ``start_recording`` and ``select_channels``."""
        graphdef = self.graphdef

        def edit_model(fn):
            """A jitted ``state -> state`` applying ``fn`` to the model (OutControl's hooks)."""

            def run(state):
                model = nnx.merge(graphdef, state["params"], state["rest"], copy=True)
                fn(model)
                return {**state, "rest": nnx.split(model, nnx.Param, ...)[2]}

            return jax.jit(run, in_shardings=(self.state_sharding,),
                           out_shardings=self.state_sharding, donate_argnums=0)

        self.start_recording = edit_model(lbt.start_recording)
        self.select_channels = edit_model(lbt.select_channels)

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


# --------------------------------------------------------------------------------------------
# The loop


def check_init_from(cfg: RunConfig) -> tuple[Path, int]:
    """The checkpoint directory of the run ``cfg.init_from`` names and its latest step, after
    checking that it is a run directory with a checkpoint, of the family and the model of
    ``cfg`` (read only). Raises ConfigError naming ``init_from`` and what was expected."""
    src = Path(cfg.init_from)
    check_run_dir(src, "init_from")
    if src == cfg.run_dir.resolve():
        raise ConfigError(
            f"init_from={str(src)!r} is this run's own directory; pass --resume to continue it, or "
            "name another run"
        )
    saved = read_run_config(src, "init_from")
    saved_family = saved.get("family") or DEFAULT_FAMILY
    if saved_family != cfg.family:
        raise ConfigError(
            f"init_from={str(src)!r}: the source run is of model family {saved_family!r}, this "
            f"config's is {cfg.family!r}; expected a run of the same family and architecture "
            "(only the quantization recipe, the training settings and model.dtype may change)"
        )
    saved_model = dict(saved["model"])
    model = cfg.to_json()["model"]
    for k in INIT_FROM_FREE:
        saved_model.pop(k, None)
        model.pop(k, None)
    diff = config_diff({"model": saved_model}, {"model": model})
    if diff:
        raise ConfigError(
            f"init_from={str(src)!r}: the source run's model differs from this config's "
            f"(source -> this run): {', '.join(diff)}; expected the same architecture (only "
            "the quantization recipe, the training settings and model.dtype may change)"
        )
    return checkpoints.latest_checkpoint(src, "init_from")


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    extend: bool = False,
    devices=None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Train ``cfg`` (see the module docstring); ``resume`` continues from the last checkpoint;
    ``extend`` (implies ``resume``) trains a finished or stopped run on to a larger
    ``train.steps`` (:mod:`experiments.extend`: the lr holds the schedule's final value).
    A run that starts afresh with ``cfg.init_from`` set takes its parameters from that run's
    latest checkpoint (checked before anything is written).

    Raises :class:`TrainingDiverged` on a non-finite loss (naming the step and the last good
    checkpoint), :class:`RunExists` when the run directory holds checkpoints and ``resume`` is
    False, :class:`experiments.data.DataError` for bad data, ConfigError for a bad config (an
    ``init_from`` that is not a run with a checkpoint of the same model included).
    """
    cfg, ext, has_ckpt, source = _check_start(cfg, resume or extend, extend, log)
    resume = resume or extend
    if resume and not has_ckpt:  # said, not silent: the run did not exist (or never saved)
        log(f"--resume: no checkpoint under {cfg.run_dir / 'checkpoints'}; starting "
            f"{cfg.name} from step 0")
    family = family_of(cfg)
    writer = distributed.is_writer()  # process 0 writes the run's files (one process: it)
    if writer:  # builds the tokenized cache when missing; the others read it when it is there
        dataset = family.load(cfg, log=log)
    distributed.barrier("lowbit-data")
    if not writer:
        dataset = family.load(cfg, log=_quiet)
    mesh = make_mesh(cfg.mesh, devices)
    if cfg.train.batch_size % mesh.size:
        raise ConfigError(
            f"config.train.batch_size={cfg.train.batch_size} must be a multiple of the "
            f"{mesh.size} devices of the mesh"
        )
    trainer = Trainer(cfg, mesh)
    # Read before this run writes anything.
    init_params = None if source is None else _init_params(cfg, trainer, source)
    if cfg.init_from_hf and not (resume and has_ckpt):
        init_params = hf.load_params(cfg.init_from_hf, cfg.model)
    if cfg.train.distill_from:  # QAD's teacher: the run the student started from
        teacher = source if source is not None else check_init_from(cfg)
        trainer.teacher_params = (init_params if source is not None
                                  else _init_params(cfg, trainer, teacher))
    # Every process has read what it checks above before process 0 writes anything.
    distributed.barrier("lowbit-checked")
    mngr = checkpoints.run_manager(cfg)
    _write_config(cfg, resume=resume and has_ckpt, writer=writer)
    loop = _Loop(cfg, trainer, mngr, dataset, writer=writer)
    if resume and mngr.latest_step() is not None:
        state, batches = loop.resume(log)
        log(f"resumed {cfg.run_dir} at step {loop.start}")
        if ext is not None and writer:
            write_record(loop.metrics_path, ext, loop.start)
    else:
        state, batches = loop.fresh(init_params)
        if init_params is not None:
            log(f"{cfg.name}: parameters from " + (cfg.init_from_hf or f"{cfg.init_from} "
                                                   f"(checkpoint step {source[1]})"))
    final_val = loop.run(state, batches)
    mngr.close()
    return loop.finish(final_val)


def _check_start(cfg: RunConfig, resume: bool, extend_: bool, log):
    """``(cfg, extension, has_ckpt, source)``: the config the run trains (on ``resume``:
    :func:`experiments.extend.resumed_config`, lengthened by ``extend_``), whether the run
    directory holds checkpoints, and the ``init_from`` checkpoint (directory, step) a fresh
    start reads, after the checks that come before anything is read or written
    (:class:`RunExists`, a changed config or plan on ``resume``, a bad ``init_from``)."""
    run_dir = cfg.run_dir
    ckpt_dir = run_dir / "checkpoints"
    has_ckpt = ckpt_dir.exists() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
    if has_ckpt and not resume:
        raise RunExists(
            f"{run_dir} already holds checkpoints: pass --resume to continue it, or choose "
            "another config.name (nothing was changed)"
        )
    ext = None
    if resume:
        cfg, ext = resumed_config(cfg, extend=extend_ and has_ckpt, log=log)
    # A resumed run continues from its own checkpoint: init_from is read only by a fresh start.
    source = check_init_from(cfg) if cfg.init_from and not (resume and has_ckpt) else None
    return cfg, ext, has_ckpt, source


def _init_params(cfg: RunConfig, trainer: Trainer, source: tuple[Path, int]):
    """The parameters of the ``init_from`` checkpoint ``source`` on ``trainer``'s shardings."""
    src_dir, src_step = source
    src_mngr = checkpoints.manager(src_dir, read_only=True)
    try:
        params, _ = checkpoints.restore(
            src_mngr, src_step, trainer.abstract, trainer.state_sharding, params_only=True
        )
    except ConfigError as e:
        raise ConfigError(f"init_from={cfg.init_from!r}: {e}") from e
    finally:
        src_mngr.close()
    return params


def _write_config(cfg: RunConfig, *, resume: bool, writer: bool) -> None:
    """Create the run directory; process 0 writes config.json and the copy of the plan (kept
    when ``resume`` continues a run that has one)."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if writer:
        write_json(run_dir / "config.json", cfg.to_json())
        plan_copy = run_dir / "plan.json"
        if cfg.quant.plan is not None and not (resume and plan_copy.exists()):
            autoquant.Plan.load(cfg.quant.plan).save(plan_copy)


class _Loop:
    """One invocation of the training loop: its start, the steps, the records it writes."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, mngr, dataset, *, writer: bool):
        t = cfg.train
        self.cfg, self.trainer, self.mngr, self.dataset = cfg, trainer, mngr, dataset
        self.family = family_of(cfg)
        self.writer = writer
        self.metrics_path = cfg.run_dir / "metrics.jsonl"
        self.start = 0
        self.stop = t.stop_at or t.steps
        self.tokens_per_step = t.batch_size * self.family.tokens_per_example(cfg.model)
        self.losses: dict[int, float] = {}
        self.intervals: list[float] = []
        self.last_good = None  # the step of the newest checkpoint known to be finite
        self.switched_at = 0  # the step after which the precision schedule switched (0: not)

    def resume(self, log: Callable[[str], None] = print):
        """The train state and batch stream of the newest checkpoint that reads (a damaged
        newer one is skipped, said and kept: :func:`experiments.checkpoints.restore_newest`)."""
        start, state, data_state = checkpoints.restore_newest(
            self.mngr, self.trainer.abstract, self.trainer.state_sharding, log=log,
            set_aside=self.writer)
        self.start = self.last_good = start
        if data_state.get("fingerprint") != self.dataset.fingerprint:
            raise ConfigError(
                f"--resume: the data changed since the checkpoint (fingerprint "
                f"{data_state.get('fingerprint')} -> {self.dataset.fingerprint})"
            )
        data_state.pop("fingerprint")
        if "switched_at" in state:
            self.switched_at = int(jax.device_get(state["switched_at"]))
        batches = self.family.batches(self.cfg, self.dataset, data_state)
        if self.writer:
            truncate_metrics(self.metrics_path, start)
        return state, batches

    def fresh(self, init_params=None):
        """A fresh train state (``init_params`` or the random init) and batch stream."""
        if self.writer and self.metrics_path.exists():
            self.metrics_path.unlink()
        state = self.trainer.init_state(init_params)
        return state, self.family.batches(self.cfg, self.dataset)

    def run(self, state, batches) -> dict[str, float]:
        """Steps ``start + 1 .. stop``, evaluating, logging and checkpointing on the way;
        returns the final validation metrics."""
        t, trainer = self.cfg.train, self.trainer
        evals = self.family.eval_batches(self.cfg, self.dataset, t.eval_batches)
        self.evals = [trainer.put_batch(b) for b in evals]
        final_val = None  # {"val_loss": ..., ...}
        self.bar = progress_bar(t.progress and self.writer, self.start, self.stop, self.cfg.name)
        with open(self.metrics_path if self.writer else os.devnull, "a") as self.mf, self.bar:
            pending = None  # (step, device metrics) of the step before
            self.t_last, self.step_last = None, self.start
            for s in range(self.start + 1, self.stop + 1):
                batch = trainer.put_batch(next(batches))
                step = trainer.step2 if self.switched_at else trainer.step
                state, metrics = step(state, batch)
                if pending is not None:
                    self.drain(pending)
                pending = (s, metrics)
                state = self.after_step(s, state, batch)
                if s == self.start + 1:  # the first step includes compilation: time from the next
                    jax.block_until_ready(metrics)
                    self.mark(s)
                if (t.eval_every and s % t.eval_every == 0) or s == self.stop:
                    self.drain(pending)
                    pending = None
                    final_val = self.evaluate(state)
                    self.write(
                        {"kind": "eval", "step": s, "tokens": s * self.tokens_per_step, **final_val}
                    )
                    self.mark(s)
                if (t.checkpoint_every and s % t.checkpoint_every == 0) or s == self.stop:
                    if pending is not None:
                        self.drain(pending)
                        pending = None
                    checkpoints.save(self.mngr, s, state, batches, self.dataset.fingerprint)
                    self.last_good = s
                    self.mark(s)
            if pending is not None:
                self.drain(pending)
            if final_val is None:  # resumed at its last step: nothing trained, still evaluated
                final_val = self.evaluate(state)
        self.params = sum(
            int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.abstract["params"])
        )
        return final_val

    def after_step(self, s: int, state, batch):
        """The training-state hooks after step ``s`` (TetraJet-v2's, counted as its
        ``iter_num = s - 1``; the precision schedule), each logged as a record."""
        q, tr = self.cfg.quant, self.trainer
        if q.out_control:
            if s - 1 == q.out_control_start:
                state = tr.start_recording(state)
                self.write({"kind": "out_control", "step": s, "event": "record"})
            elif s - 1 == q.out_control_start + q.out_control_steps:
                state = tr.select_channels(state)
                self.write({"kind": "out_control", "step": s, "event": "select"})
        if q.osci_period and s - 1 >= q.osci_start and (s - 1) % q.osci_period == q.osci_window + 1:
            n = int(jax.device_get(state["opt"].last_reset))
            self.write({"kind": "osci_reset", "step": s, "weights": n})
        if q.switch_to is None or self.switched_at:
            return state
        go = s == switch_step(self.cfg)
        if q.switch_criterion and s % q.switch_check_every == 0:
            r = {k: float(v) for k, v in jax.device_get(tr.grad_noise(state, batch)).items()}
            ratio = r["grad_norm"] / r["noise_norm"] if r["noise_norm"] > 0 else float("inf")
            go = ratio < GRAD_NOISE_RATIO
            self.write({"kind": "switch_check", "step": s, **r, "ratio": ratio})
        if go:
            self.switched_at = s
            state = {**state, "switched_at": jax.device_put(
                jnp.asarray(s, jnp.int32), tr.state_sharding["switched_at"])}
            self.write({"kind": "switch", "step": s, "to": q.switch_to})
        return state

    def evaluate(self, state) -> dict[str, float]:
        return self.family.reduce([self.trainer.eval_outputs(state, b) for b in self.evals])

    def write(self, rec: dict) -> None:
        self.mf.write(json.dumps(rec) + "\n")
        self.mf.flush()

    def mark(self, s: int) -> None:
        """Time the next logged interval from now, step ``s``."""
        self.t_last, self.step_last = time.perf_counter(), s

    def drain(self, p) -> dict:
        """Fetch step ``p = (step, device metrics)``'s metrics: stop on a non-finite one, log
        them every ``train.log_every`` steps."""
        s, m = p
        t = self.cfg.train
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        if not finite(m):
            ckpt_dir = self.cfg.run_dir / "checkpoints"
            where = f"step {self.last_good} in {ckpt_dir}" if self.last_good else "none was written"
            raise TrainingDiverged(
                f"{self.cfg.name}: loss {m['loss']}, grad norm {m['grad_norm']}, "
                f"{m['nonfinite_params']:.0f} non-finite parameters at step {s}; stopped. "
                f"Last good checkpoint: {where}"
            )
        self.losses[s] = m["loss"]
        now = time.perf_counter()
        if s % t.log_every == 0 or s == self.stop:
            tps = self.tokens_per_step
            rec = {"kind": "train", "step": s, "tokens": s * tps, **m}
            if self.t_last is not None and s > self.step_last:
                dt = (now - self.t_last) / (s - self.step_last)
                self.intervals.append(dt)
                rec["step_s"] = dt
                rec["tokens_per_s"] = tps / dt
                self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tps / dt:.0f}")
            self.write(rec)
            self.t_last, self.step_last = now, s
        self.bar.update(1)
        return m

    def finish(self, final_val: dict[str, float]) -> RunResult:
        """Write summary.json (process 0) and return the run's result once every process
        is done."""
        cfg, stop = self.cfg, self.stop
        step_time = statistics.median(self.intervals) if self.intervals else None
        summary = {
            "name": cfg.name,
            **run_identity(cfg),  # recipe (a plan's name), recipe_version[, plan, extended_from]
            "seed": cfg.seed,
            "init_from": cfg.init_from or None,
            "step": stop,
            "steps": cfg.train.steps,
            "tokens": stop * self.tokens_per_step,
            **{f"final_{k}": v for k, v in final_val.items()},  # final_val_loss[, _accuracy]
            "final_train_loss": self.losses.get(stop),
            "step_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time if step_time else None,
            "params": self.params,
            "devices": self.trainer.mesh.size,
            "processes": jax.process_count(),
            "backend": jax.default_backend(),
            "family": cfg.family,
        }
        if cfg.quant.switch_to is not None:
            summary["switch_to"] = cfg.quant.switch_to
            summary["switched_at"] = self.switched_at or None
        if self.writer:
            write_json(cfg.run_dir / "summary.json", summary)
        distributed.barrier("lowbit-done")  # the files are there when any process returns
        return RunResult(
            cfg.run_dir, stop, final_val["val_loss"], self.losses, step_time, final_val
        )


def _quiet(*_) -> None:
    pass

