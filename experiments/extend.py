"""Resuming a run under the config it started with, and extending it to more steps.

``--resume`` continues a run from its newest checkpoint: :func:`resumed_config` refuses a
config that differs from the run's ``config.json`` (:func:`experiments.config.config_diff`,
except the fields any resume may change, ``RESUMABLE``) and a plan file edited since the run
started, naming what changed; nothing is written before.

``--extend`` (with ``--resume``; ``trainer.train(..., extend=True)``) trains a finished or
stopped run on to a larger ``train.steps``::

    python -m experiments.train --config configs/gpt.py:size=tiny --resume --extend \\
        --config.train.steps=800

- The learning-rate schedule is the run's own: its warmup and cosine decay over the original
  ``train.steps``, after which the lr holds its final value ``lr * min_lr_ratio`` for the
  steps added. It is not rebuilt for the new length: a cosine laid over the new total would
  jump back up from the decayed value the run ended at, mid-run. ``train.warmup_steps``
  keeps the run's value (the config files derive it from ``train.steps``), and a
  ``quant.switch_fraction`` stays a fraction of the original length.
- The cadences the config files derive from ``train.steps`` (``eval_every``,
  ``checkpoint_every``) and ``log_every`` take the new config's values from the resumed step.
- config.json records the original length in ``train.extended_from`` (one entry per
  extension; :attr:`experiments.config.TrainConfig.schedule_steps` is the first), summary.json
  says ``extended_from`` too, and metrics.jsonl holds an ``{"kind": "extend", ...}`` record at
  the step the extension resumed from, among steps 1..N of one run.
- Every other field must match, as for any resume; a shorter ``train.steps`` is refused.
  An extended run that was interrupted resumes with ``--resume`` and its new ``train.steps``
  (with or without ``--extend``).

The exact-resume guarantee holds for the extension too: the steps it trains equal those of an
uninterrupted run whose config has the same ``train.extended_from``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from experiments.config import RunConfig, config_diff
from experiments.configlib import ConfigError
from lowbit import autoquant

__all__ = ["EXTEND_FREE", "Extension", "resumed_config", "write_record"]

# The fields an --extend may change (besides RESUMABLE): the length, the cadences derived from
# it, and the record of the extension; warmup_steps is taken from the run (see the docstring).
EXTEND_FREE = frozenset({("train", "steps"), ("train", "eval_every"),
                         ("train", "checkpoint_every"), ("train", "log_every"),
                         ("train", "extended_from")})


@dataclasses.dataclass(frozen=True)
class Extension:
    """One ``--extend``: from ``from_steps`` to ``to_steps``, the lr schedule laid over
    ``schedule_steps`` and holding ``final_lr`` after them."""

    from_steps: int
    to_steps: int
    schedule_steps: int
    final_lr: float

    def describe(self, name: str) -> str:
        return (f"--extend: {name} from {self.from_steps} to {self.to_steps} steps; the "
                f"learning rate follows the run's schedule over its first "
                f"{self.schedule_steps} steps, then holds its final value {self.final_lr:.3g} "
                "(lr * min_lr_ratio); recorded as train.extended_from in config.json")

    def record(self, step: int) -> dict:
        """The metrics.jsonl record of the extension, at the step it resumed from."""
        return {"kind": "extend", "step": step, "from_steps": self.from_steps,
                "to_steps": self.to_steps, "schedule_steps": self.schedule_steps,
                "lr_after_schedule": self.final_lr,
                "lr_rule": "the run's schedule, then its final value"}


def resumed_config(
    cfg: RunConfig, *, extend: bool = False, log: Callable[[str], None] = print
) -> tuple[RunConfig, Extension | None]:
    """The config a ``--resume`` of ``cfg`` runs, and the :class:`Extension` when ``extend``
    lengthens the run. A run directory without config.json: ``(cfg, None)``. Raises
    ConfigError for a config that differs from the run's beyond what the resume may change
    (the message names the fields), a plan file changed since the start, or a shorter
    ``train.steps`` under ``extend``."""
    run_dir = cfg.run_dir
    if not (run_dir / "config.json").exists():
        return cfg, None
    saved = json.loads((run_dir / "config.json").read_text())
    cfg, ext = _extended(cfg, saved, extend, log)
    diff = config_diff(saved, cfg.to_json(), free=EXTEND_FREE if ext else frozenset())
    if diff:
        hint = ("; to train the run on to more steps, pass --extend"
                if not extend and any(d.startswith("train.steps:") for d in diff) else "")
        raise ConfigError(f"--resume with a config that differs from {run_dir}: {diff}{hint}")
    plan_copy = run_dir / "plan.json"  # the plan the run trains under, as it was at its start
    if cfg.quant.plan is not None and plan_copy.exists():
        if autoquant.Plan.load(plan_copy) != autoquant.Plan.load(cfg.quant.plan):
            raise ConfigError(
                f"--resume: the plan file quant.plan={cfg.quant.plan!r} changed since {run_dir} "
                f"started (the run trains under its copy {plan_copy}); nothing was changed"
            )
    return cfg, ext


def _extended(cfg: RunConfig, saved: dict, extend: bool, log) -> tuple[RunConfig, Extension | None]:
    """``cfg`` with the run's schedule (warmup, ``extended_from``) when it extends the run or
    resumes an extended one at its length; the :class:`Extension` when it lengthens it."""
    t_saved = saved.get("train") or {}
    old, new = int(t_saved.get("steps", cfg.train.steps)), cfg.train.steps
    before = [int(n) for n in t_saved.get("extended_from") or []]
    if not extend:  # an extended run resumed at its length: as it was extended
        if before and new == old and not cfg.train.extended_from:
            return _with_schedule(cfg, t_saved, before, None), None
        return cfg, None
    if new < old:
        raise ConfigError(
            f"--extend: train.steps={new} is below the {old} steps of {cfg.run_dir}; a run is "
            "not shortened (nothing was changed)"
        )
    cfg = _with_schedule(cfg, t_saved, before + ([old] if new > old else []), log)
    if new == old:
        log(f"--extend: train.steps={new} is the run's own length; resumed as it is")
        return cfg, None
    t = cfg.train
    ext = Extension(old, new, t.schedule_steps, t.lr * t.min_lr_ratio)
    log(ext.describe(cfg.name))
    return cfg, ext


def _with_schedule(cfg: RunConfig, t_saved: dict, history: list[int], log) -> RunConfig:
    warmup = int(t_saved.get("warmup_steps", cfg.train.warmup_steps))
    if log is not None and warmup != cfg.train.warmup_steps:
        log(f"--extend: train.warmup_steps={cfg.train.warmup_steps} (derived from train.steps) "
            f"kept at the run's {warmup}: the schedule is the run's own")
    try:
        train = dataclasses.replace(cfg.train, warmup_steps=warmup, extended_from=tuple(history))
    except ValueError as e:
        raise ConfigError(f"--extend: {e}") from None
    return dataclasses.replace(cfg, train=train)


def write_record(metrics_path: Path, ext: Extension, step: int) -> None:
    """Append ``ext``'s record at ``step`` to metrics.jsonl."""
    with open(metrics_path, "a") as f:
        f.write(json.dumps(ext.record(step)) + "\n")
