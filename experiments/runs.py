"""Runs on disk: reusing a finished run, deleting one, and reading a trained one back.

A run is the directory ``<workdir>/<name>/`` that :func:`experiments.trainer.train` writes.
:func:`train_or_reuse` is the one rule every study applies to its runs: a run that finished
with the same config is reused, any other run directory is resumed (a run whose config
differs is never overwritten: the ConfigError names the fields), a missing one is trained.
:func:`remove_run` deletes one (``compare --rerun``) unless another run started from it
(:func:`runs_started_from`).

For analyses of trained runs (post-training quantization versus QAT, ...):
:func:`load_trained` reads a run's config and its float model with the latest checkpoint's
parameters, :func:`evaluate` computes the validation metrics of any model with the
``(logits, aux) = model(inputs)`` convention on the batches the loop's final eval uses, and
:func:`calibration_batches` draws model inputs from the training split.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from experiments import checkpoints, trainer
from experiments.config import RunConfig, check_run_dir, config_diff, family_of, read_run_config
from experiments.configlib import ConfigError
from experiments.families import FAMILIES

__all__ = [
    "finished",
    "train_or_reuse",
    "runs_started_from",
    "remove_run",
    "load_trained",
    "evaluate",
    "calibration_batches",
]


def finished(cfg: RunConfig) -> bool:
    """Whether the run of ``cfg`` finished (its summary.json at ``train.steps``) with the
    same config (:func:`experiments.config.config_diff` finds no difference)."""
    d = cfg.run_dir
    try:
        summary = json.loads((d / "summary.json").read_text())
        saved = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return summary.get("step") == cfg.train.steps and not config_diff(saved, cfg.to_json())


def train_or_reuse(cfg: RunConfig, log: Callable[[str], None] = print) -> Path:
    """Train ``cfg`` unless its run finished earlier with the same config (then reuse it); a
    run directory left unfinished continues from its last checkpoint (``resume``: a config
    that differs from the one it started with is a ConfigError, nothing is overwritten).
    Returns the run directory."""
    if finished(cfg):
        log(f"{cfg.name}: finished earlier with this config, reused")
        return cfg.run_dir
    r = trainer.train(cfg, resume=cfg.run_dir.exists(), log=log)
    log(f"{cfg.name}: final validation loss {r.final_val_loss:.4f}")
    return cfg.run_dir


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


def _quiet(*_) -> None:
    pass


def load_trained(run_dir: str | os.PathLike) -> tuple[RunConfig, nnx.Module]:
    """The config of the run in ``run_dir`` (from its config.json) and its float model: the
    family's model class (:func:`experiments.trainer.build_float_model`: no quantization whatever the run's recipe,
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
    check_run_dir(src, "run_dir")
    try:
        cfg = RunConfig.from_config(read_run_config(src, "run_dir"))
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"run_dir={str(src)!r}: its config.json: {e}") from e
    ckpt_dir, step = checkpoints.latest_checkpoint(src, "run_dir")
    # Abstract (no random init is computed): the parameters come from the checkpoint.
    graphdef, abstract, rest = nnx.split(
        nnx.eval_shape(lambda: trainer.build_float_model(cfg)), nnx.Param, ...
    )
    if jax.tree.leaves(rest):  # state besides parameters (none today): the model's own init
        _, _, rest = nnx.split(trainer.build_float_model(cfg), nnx.Param, ...)
    device = SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    mngr = checkpoints.manager(ckpt_dir, read_only=True)
    try:
        params = checkpoints.restore_params(mngr, step, target)
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
    family = family_of(cfg)
    n = cfg.train.eval_batches
    if max_batches is not None:
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"max_batches must be a positive int or None, got {max_batches!r}")
        n = min(n, max_batches)
    if batches is None:
        batches = family.eval_batches(cfg, family.load(cfg, log=log), n)
    outs = [
        _eval_outputs(model, {k: jnp.asarray(v) for k, v in b.items()}, cfg.family) for b in batches
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
    family = family_of(cfg)
    stream = family.batches(cfg, family.load(cfg, log=log))
    return [(dict(b) if full else b["inputs"]) for b in (next(stream) for _ in range(n))]
