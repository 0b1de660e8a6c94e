"""Train one run from a config file (the logic lives in :mod:`experiments.trainer`): a GPT
on text (``configs/gpt.py``) or a ViT on handwritten digits (``configs/digits.py``).

    python -m experiments.train --config configs/gpt.py:size=tiny,recipe=mxfp4
    python -m experiments.train --config configs/gpt.py:size=xs,recipe=nvfp4 \
        --config.train.steps=1000 --config.mesh.fsdp=2
    python -m experiments.train --config configs/gpt.py:size=tiny,recipe=mxfp4 --resume
    python -m experiments.train --config configs/gpt.py:size=tiny,recipe=mxfp4 --resume \
        --extend --config.train.steps=800      # a finished 400-step run trained on to 800
    python -m experiments.train --config configs/gpt.py:size=tiny,recipe=qat_mxfp4 \
        --config.init_from=runs/gpt-tiny/none-s0
    python -m experiments.train --config configs/digits.py:size=s,recipe=mxfp8
    python -m experiments.train --config configs/gpt.py:size=s --coordinator=10.0.0.1:12355 \
        --num_processes=2 --process_id=0     # and --process_id=1 on the second host

Several processes (``--coordinator``, ``--num_processes``, ``--process_id``, or a SLURM / Open
MPI launcher): :mod:`experiments.distributed`.

Writes ``runs/<config.name>/`` (config.json, metrics.jsonl, summary.json, checkpoints/); a run
under ``--config.quant.plan=plan.json`` is named for the plan (``gpt-tiny/plan-<bits>b-<hash>-s0``,
:func:`experiments.config.run_label`). ``--extend`` keeps the run's learning-rate schedule over
its original steps and holds its final value after them (:mod:`experiments.extend`).
``--config.init_from=<run dir>`` starts from that run's trained parameters instead of the
random init (the last line: a QAT fine-tune of the float run ``runs/gpt-tiny/none-s0``).
Exit status 1 with a one-line reason for a bad config or data, an existing run without
``--resume``, or a diverged run (its last good checkpoint is kept).
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import data as data_lib
from experiments import distributed, trainer
from experiments.config import RunConfig
from experiments.configlib import ConfigError, parse_flags_or_exit

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "a config file and its argument, e.g. configs/gpt.py:size=tiny,recipe=mxfp4"
)
_RESUME = flags.DEFINE_bool("resume", False, "continue the run from its last checkpoint")
_EXTEND = flags.DEFINE_bool(
    "extend", False, "with --resume: train a finished or stopped run on to a larger "
    "--config.train.steps (the lr holds the schedule's final value; experiments/extend.py)")
flags.mark_flags_as_required(["config"])
# --coordinator, --num_processes, --process_id, --distributed_timeout
start_processes = distributed.define_flags()

EXPECTED_ERRORS = (
    ConfigError,
    data_lib.DataError,
    trainer.TrainingDiverged,
    trainer.RunExists,
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    start_processes()
    try:
        cfg = RunConfig.from_config(_CONFIG.value)
        result = trainer.train(cfg, resume=_RESUME.value, extend=_EXTEND.value)
    except (*EXPECTED_ERRORS, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if not distributed.is_writer():
        return
    accuracy = result.final_val.get("val_accuracy")
    print(
        f"{cfg.name}: step {result.step}, final validation loss {result.final_val_loss:.4f}"
        + (f", accuracy {accuracy:.4f}" if accuracy is not None else "")
        + f"; metrics in {result.metrics_path}"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags_or_exit)
