"""A run's orbax checkpoints: the train state (parameters, optimizer, quantizer rng state,
step) and the data position, under ``<run dir>/checkpoints/``.

:func:`run_manager` opens a run's own checkpoints (the oldest deleted past
``train.keep_checkpoints``), :func:`manager` any ``checkpoints/`` directory (``read_only``:
another run's, for ``init_from``); :func:`save` writes a step, :func:`restore` reads one onto
a train state's shardings (:attr:`experiments.trainer.Trainer.abstract` and
:attr:`~experiments.trainer.Trainer.state_sharding`), :func:`restore_params` its parameters
alone, and :func:`latest_checkpoint` finds a run's newest step. Typed PRNG keys are saved as
their raw key data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from experiments.configlib import ConfigError

__all__ = ["run_manager", "manager", "save", "restore", "restore_params", "latest_checkpoint"]


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _unkey(tree):
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _unkey_abstract(tree):
    return jax.tree.map(lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x, tree)


def _rekey(tree, like):
    return jax.tree.map(lambda x, l: jax.random.wrap_key_data(x) if _is_key(l) else x, tree, like)


def run_manager(cfg):
    """The checkpoints of the run of ``cfg`` (a RunConfig), the manager the training loop
    writes them with (created on first use; the oldest deleted past
    ``train.keep_checkpoints``)."""
    return manager(cfg.run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)


def manager(directory: Path, *, keep: int | None = None, read_only: bool = False):
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


def save(mngr, step: int, state, batches, fingerprint: str) -> None:
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


def restore(mngr, step: int, abstract, shardings, *, params_only: bool = False):
    """Checkpoint ``step`` as ``(train state, data state)``: the state a tree like
    ``abstract`` (a train state's ``jax.eval_shape``, typed keys included) placed on
    ``shardings`` (a tree of shardings like it), e.g. a trainer's
    ``restore(mngr, step, trainer.abstract, trainer.state_sharding)``.

    ``params_only``: ``(parameters, None)``, read alone from the saved train state (its
    optimizer, quantizer rng state and step, and the data position, are not read: a checkpoint
    of another recipe or optimizer serves), after checking that the saved parameter tree has
    this model's paths, shapes and dtypes (a mismatch names the first parameter that differs).
    """
    import orbax.checkpoint as ocp

    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        _unkey_abstract(abstract),
        shardings,
    )
    if params_only:
        return restore_params(mngr, step, target["params"]), None
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
    got = _restoring(mngr, step, lambda: mngr.restore(step, args=args))
    return _rekey(got["state"], abstract), dict(got["data"])


def restore_newest(mngr, abstract, shardings, *, log: Callable = print, set_aside: bool = True):
    """``(step, train state, data state)`` of the newest checkpoint that reads.

    A newer checkpoint that does not read (a damaged file, an interrupted write) is skipped
    with a line saying which and why, and kept: renamed ``<step>.damaged`` (``set_aside``;
    only the writing process renames) so that the run can save that step again. Nothing is
    deleted, and nothing is renamed unless an older checkpoint reads. When none reads: a
    ConfigError naming the directory and each step's reason."""
    skipped: list[tuple[int, str]] = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            state, data = restore(mngr, step, abstract, shardings)
        except ConfigError as e:
            skipped.append((step, str(e)))
            continue
        for s, why in skipped:
            kept = Path(mngr.directory) / f"{s}.damaged"
            if set_aside:
                (Path(mngr.directory) / str(s)).rename(kept)
            log(f"checkpoint step {s} does not read ({why[:300]}); kept as {kept}; resuming "
                f"from step {step}")
        if skipped:
            mngr.reload()
        return step, state, data
    why = "; ".join(f"step {s}: {w[:200]}" for s, w in skipped) or "no checkpoints"
    raise ConfigError(f"no checkpoint in {mngr.directory} reads ({why})")


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


def restore_params(mngr, step: int, target):
    """The parameters alone of checkpoint ``step``'s train state, onto ``target`` (a tree of
    ``jax.ShapeDtypeStruct`` with shardings), after checking that the saved tree has its
    paths, shapes and dtypes (see :func:`restore`)."""
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


def latest_checkpoint(src: Path, what: str) -> tuple[Path, int]:
    """``src/checkpoints`` and its latest step (read only); a ConfigError naming ``what=src``
    when it has none."""
    ckpt_dir = src / "checkpoints"
    step = None
    if ckpt_dir.is_dir():
        mngr = manager(ckpt_dir, read_only=True)
        step = mngr.latest_step()
        mngr.close()
    if step is None:
        raise ConfigError(
            f"{what}={str(src)!r} has no checkpoint (nothing saved under {ckpt_dir}); "
            "expected a run that wrote one (runs save at the end and every "
            "train.checkpoint_every steps)"
        )
    return ckpt_dir, int(step)
