"""What every study CLI shares (``experiments.compare``, ``experiments.ptq_vs_qat``,
``experiments.autoquant``, ``experiments.pareto``, ``experiments.shapley_rules``): the command
line it records, running the study with its expected errors as one line and exit status 1,
writing its result as JSON (:func:`write_json`), a markdown table and a figure (:func:`write`),
and the body of a config-file study's ``main`` (:func:`main`)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from experiments import trainer
from experiments.configlib import ConfigError

__all__ = [
    "EXPECTED_ERRORS",
    "json_default",
    "write_json",
    "save_figure",
    "write",
    "command_line",
    "run_or_exit",
    "main",
]

# What a study reports as one line (exit status 1) rather than a traceback.
EXPECTED_ERRORS = (ConfigError, ValueError, trainer.TrainingDiverged)


def json_default(x):
    """``json.dumps(default=...)`` for NumPy scalars."""
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def write_json(path, result) -> Path:
    """``result`` as JSON (indent 1, NumPy scalars as numbers) at ``path``."""
    path = Path(path)
    path.write_text(json.dumps(result, indent=1, default=json_default) + "\n")
    return path


def save_figure(fig, path) -> Path:
    """Lay out ``fig``, save it as ``path`` (120 dpi) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(
    result: dict,
    out_dir,
    stem: str,
    render_markdown: Callable[[dict, str], str],
    plot: Callable[[dict, Path], Path],
    command: str = "",
    results_dir=None,
) -> tuple[Path, Path, Path]:
    """``<out_dir>/<stem>.json``, ``.md`` (``render_markdown(result, command)``) and ``.png``
    (``plot``), copied to ``results_dir`` when given; returns their paths (under
    ``out_dir``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js = write_json(out_dir / f"{stem}.json", result)
    md = out_dir / f"{stem}.md"
    md.write_text(render_markdown(result, command))
    png = plot(result, out_dir / f"{stem}.png")
    if results_dir:
        dst = Path(results_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for p in (js, md, png):
            shutil.copyfile(p, dst / p.name)
    return js, md, png


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that ran: ``python -m <module>`` and its arguments (``argv``: the process's
    own by default)."""
    return " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])


def run_or_exit(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``; an expected error (:data:`EXPECTED_ERRORS`: a bad config, a
    diverged run) is printed as one line and exits with status 1."""
    try:
        return fn(*args, **kwargs)
    except EXPECTED_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def main(
    argv: list[str],
    config,
    module: str,
    run_study: Callable,
    write_result: Callable,
) -> None:
    """Run a study from its parsed ``config`` and print its table and where its files are; a
    bad config or a diverged run exits 1 with the error (absl ``app.run`` entry point)."""
    if len(argv) > 1:
        from absl import app

        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    command = command_line(module)
    result = run_or_exit(run_study, config)
    js, md, png = write_result(result, Path(config.workdir) / config.name, command)
    print(md.read_text())
    print(f"table: {md}\nfigure: {png}\nresults: {js}")
