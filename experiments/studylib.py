"""What every study CLI shares (``experiments.ptq_vs_qat``, ``experiments.autoquant``): writing
its result as JSON, a markdown table and a figure, and the body of its ``main``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from experiments import trainer
from experiments.configlib import ConfigError

__all__ = ["json_default", "save_figure", "write", "main"]


def json_default(x):
    """``json.dumps(default=...)`` for NumPy scalars."""
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


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
) -> tuple[Path, Path, Path]:
    """``<out_dir>/<stem>.json``, ``.md`` (``render_markdown(result, command)``) and ``.png``
    (``plot``); returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / f"{stem}.json"
    js.write_text(json.dumps(result, indent=1, default=json_default) + "\n")
    md = out_dir / f"{stem}.md"
    md.write_text(render_markdown(result, command))
    png = plot(result, out_dir / f"{stem}.png")
    return js, md, png


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
    command = " ".join([f"python -m {module}", *sys.argv[1:]])
    try:
        result = run_study(config)
    except (ConfigError, ValueError, trainer.TrainingDiverged) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    js, md, png = write_result(result, Path(config.workdir) / config.name, command)
    print(md.read_text())
    print(f"table: {md}\nfigure: {png}\nresults: {js}")
