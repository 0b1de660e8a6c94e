"""Shared helpers for the benchmark scripts: interleaved timing, tables, JSON results.

Every benchmark here reports ratios measured side by side in one process. The machines it runs
on are shared and noisy, so candidates are timed round-robin: each round calls every candidate
once (the starting point rotating from round to round), and a slow spell of the machine lands on
all of them alike rather than on whichever happened to run during it. A candidate's time is the
median over rounds, each call ending in ``jax.block_until_ready``, after warm-up calls that
compile it and touch its buffers.

>>> import jax.numpy as jnp
>>> x = jnp.ones((8, 8))
>>> t = time_interleaved({"add": lambda: x + 1, "mul": lambda: x * 2}, runs=3)
>>> sorted(t), len(t["add"].samples_s)
(['add', 'mul'], 3)
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "RESULTS_DIR",
    "Timing",
    "time_call",
    "time_interleaved",
    "format_table",
    "environment",
    "write_json",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock samples of one candidate, in seconds, in the order they were taken."""

    name: str
    samples_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def median_ms(self) -> float:
        return 1e3 * self.median_s

    @property
    def min_ms(self) -> float:
        return 1e3 * min(self.samples_s)

    @property
    def spread(self) -> float | None:
        """Interquartile range over the median: how noisy the samples were (0 = steady);
        None with fewer than 4 samples."""
        if len(self.samples_s) < 4:
            return None
        q1, _, q3 = statistics.quantiles(self.samples_s, n=4)
        return (q3 - q1) / self.median_s

    def to_json(self) -> dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "spread": self.spread,
            "samples_ms": [1e3 * s for s in self.samples_s],
        }


def time_call(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes, waiting for every array it returns."""
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    del out
    return dt


def time_interleaved(
    candidates: Mapping[str, Callable[[], Any]],
    *,
    runs: int,
    warmup: int = 1,
) -> dict[str, Timing]:
    """Time zero-argument callables round-robin: ``runs`` rounds, one call of each per round.

    Each candidate is first called ``warmup`` times (at least once: the first call of a
    jitted function compiles it). Round ``r`` visits the candidates starting from the
    ``r``-th, so none always runs right after the same neighbour. The garbage collector is
    paused while measuring.

    Returns:
      ``{name: Timing}`` in the order of ``candidates``.
    """
    if runs < 1:
        raise ValueError(f"{runs=} must be at least 1")
    names = list(candidates)
    if not names:
        return {}
    for name in names:
        for _ in range(max(1, warmup)):
            time_call(candidates[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(runs):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                samples[name].append(time_call(candidates[name]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: Timing(name, tuple(samples[name])) for name in names}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str] | tuple[str, str, str]],
    *,
    floatfmt: str = "{:.2f}",
) -> str:
    """A plain-text table of ``rows`` (mappings), one line each.

    ``columns`` are ``(key, header)`` or ``(key, header, template)``: numbers are written with
    the template (``floatfmt`` for floats by default) and right-aligned, ``None`` as ``-``,
    anything else (a status, a name) with ``str`` and left-aligned.

    >>> rows = [{"a": "x", "b": 1.5}, {"a": "yy", "b": None}]
    >>> print(format_table(rows, [("a", "A"), ("b", "B", "{:.1f}x")]))
    A      B
    --  ----
    x   1.5x
    yy     -
    """
    cells: list[list[tuple[str, bool | None]]] = []
    for row in rows:
        line = []
        for key, _, *template in columns:
            value = row.get(key)
            if value is None:
                line.append(("-", None))  # aligned with the column
            elif _is_number(value):
                fmt = template[0] if template else (floatfmt if isinstance(value, float) else "{}")
                line.append((fmt.format(value), True))
            else:
                line.append((str(value), False))
        cells.append(line)
    widths = [max([len(c[1])] + [len(line[i][0]) for line in cells]) for i, c in enumerate(columns)]
    # Headers and "-" sit over a column's numbers: right-aligned where the column holds any.
    numeric = [any(line[i][1] for line in cells) for i in range(len(columns))]
    headers = [(c[1], numeric[i]) for i, c in enumerate(columns)]
    cells = [[(s, numeric[i] if r is None else r) for i, (s, r) in enumerate(ln)] for ln in cells]

    def join(items: Sequence[tuple[str, bool | None]]) -> str:
        parts = [
            s.rjust(w) if right else s.ljust(w) for (s, right), w in zip(items, widths, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [join(headers), join([("-" * w, False) for w in widths])]
    out += [join(line) for line in cells]
    return "\n".join(out)


def environment() -> dict[str, Any]:
    """What the numbers were measured on: versions, devices, CPU count, load, time."""
    try:
        load = list(os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        load = None
    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "loadavg": load,
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "argv": sys.argv,
    }


def _json_safe(value: Any) -> Any:
    """NaN and Inf are not JSON: store them as null."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(payload), indent=2, allow_nan=False) + "\n")
    return path
