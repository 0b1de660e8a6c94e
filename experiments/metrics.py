"""A run's logged metrics: ``metrics.jsonl`` (one JSON record a line) and its JSON files.

``metrics.jsonl`` holds ``{"kind": "train", step, tokens, loss, <the loss function's other
metrics>, grad_norm, nonfinite_params, lr, step_s, tokens_per_s}`` every ``train.log_every``
steps and ``{"kind": "eval", step, tokens, val_loss[, val_accuracy]}`` every
``train.eval_every`` steps and at the end; a resumed run first drops the records past its
checkpoint (:func:`truncate_metrics`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

__all__ = ["read_metrics", "truncate_metrics", "write_json", "finite", "progress_bar", "NoBar",
           "LineProgress"]


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


def truncate_metrics(path: Path, after_step: int) -> None:
    """Drop the records of ``path`` past ``after_step`` (a resumed run rewrites them)."""
    if not path.exists():
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= after_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    """``path`` as indented JSON, written under a temporary name and renamed into place (other
    processes, or a reader, never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def finite(metrics: dict) -> bool:
    """Whether a step's metrics are finite: its loss and gradient norm, and no non-finite
    parameter (``nonfinite_params``, a count)."""
    ok = all(math.isfinite(float(metrics[k])) for k in ("loss", "grad_norm"))
    return ok and metrics["nonfinite_params"] == 0


class NoBar:
    """A progress display that shows nothing (``tqdm``'s methods the loop calls)."""

    def set_postfix(self, **_):
        pass

    def update(self, _):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class LineProgress(NoBar):
    """Progress for a log that is not a terminal (a pipe, a file): one plain line every
    ``every`` steps and at the last, never a carriage return."""

    def __init__(self, start: int, stop: int, name: str, stream, every: int = 0):
        self.step, self.stop, self.name, self.stream = start, stop, name, stream
        self.every = every or max(1, (stop - start) // 20)
        self.postfix: dict = {}

    def set_postfix(self, **kw):
        self.postfix = kw

    def update(self, n):
        self.step += n
        if self.step % self.every == 0 or self.step >= self.stop:
            extra = "".join(f" {k}={v}" for k, v in self.postfix.items())
            print(f"{self.name}: step {self.step}/{self.stop}{extra}", file=self.stream,
                  flush=True)


def progress_bar(enabled: bool, start: int, stop: int, name: str, stream=None):
    """A ``tqdm`` bar from ``start`` to ``stop`` steps on ``stream`` (stderr) when it is a
    terminal, a :class:`LineProgress` when it is not, or :class:`NoBar`."""
    if not enabled:
        return NoBar()
    stream = sys.stderr if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return LineProgress(start, stop, name, stream)
    from tqdm.auto import tqdm

    return tqdm(
        total=stop, initial=start, desc=name, unit="step", file=stream, dynamic_ncols=True
    )
