"""The MoE study: the capacity MoE against the dropless one (``lb.ragged_dot``), per recipe.

    python -m experiments.compare --config configs/gpt.py:size=xs,mlp=moe,moe=dropless \
        --recipes none,mxfp8,nvfp4 --seeds 0 --noise_seeds 1
    python -m experiments.compare --config configs/gpt.py:size=xs,mlp=moe \
        --recipes none,mxfp8,nvfp4 --seeds 0 --noise_seeds 1
    python -m experiments.moe_study --size xs --out experiments/results/moe_dropless.md

The two ``compare`` runs train the ``xs`` MoE GPT (4 experts, top-2, capacity factor 1.25 for
the capacity path) under each recipe; this module reads their runs (``runs/gpt-<size>-moe`` and
``runs/gpt-<size>-moe-dropless``) and writes one page: per (path, recipe) the final validation
loss, its gap to the same path's float run and to the capacity float run (each judged against
the float runs' seed spread, as ``compare`` judges them), the fraction of expert assignments
the capacity path dropped (mean over the logged steps; 0 for dropless by construction) and the
median step time over the capacity float run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from experiments import compare

__all__ = ["load", "render", "main"]

PATHS = (("capacity", "-moe"), ("dropless", "-moe-dropless"))


def _dropped(run_dir: Path) -> float | None:
    """Mean ``moe_dropped`` over the run's logged training steps."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    vals = [r["moe_dropped"] for r in map(json.loads, path.read_text().splitlines())
            if r.get("kind") == "train" and "moe_dropped" in r]
    return statistics.fmean(vals) if vals else None


def load(runs_dir: Path, size: str) -> list[dict]:
    """One row per (path, recipe) from ``runs/gpt-<size>-moe[-dropless]/compare/summary.json``
    and the runs' metrics."""
    rows = []
    for path, suffix in PATHS:
        group = runs_dir / f"gpt-{size}{suffix}"
        summary = group / "compare" / "summary.json"
        if not summary.exists():
            raise FileNotFoundError(
                f"{summary} is missing: run python -m experiments.compare --config "
                f"configs/gpt.py:size={size},mlp=moe,moe={path} first")
        for r in json.loads(summary.read_text()):
            drops = [d for d in (_dropped(p) for p in sorted(group.glob(f"{r['recipe']}-s*")))
                     if d is not None]
            rows.append({**r, "path": path,
                         "dropped": statistics.fmean(drops) if drops else None})
    return rows


def _pct(x):
    return "-" if x is None else f"{x:+.2f}%"


def render(rows: list[dict], command: str) -> str:
    base = {r["path"]: r for r in rows if r["recipe"] == compare.BASELINE}
    cap = base["capacity"]
    lines = [
        "# The MoE GPT: capacity against dropless (lb.ragged_dot), per recipe",
        "",
        f"Commands: {command}",
        "",
        "| path | recipe | seeds | final val loss | gap to the path's none | gap to capacity "
        "none | noise (1 seed, 95%) | dropped assignments | step time / capacity none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        own = base[r["path"]]
        gap_own = 100 * (r["val_loss"] / own["val_loss"] - 1)
        gap_cap = 100 * (r["val_loss"] / cap["val_loss"] - 1)
        noise = r.get("noise_pct") or own.get("noise_pct") or cap.get("noise_pct")
        drop = "-" if r["dropped"] is None else f"{100 * r['dropped']:.2f}%"
        lines.append(
            f"| {r['path']} | {r['recipe']} | {r['seeds']} | {r['val_loss']:.4f} | "
            f"{_pct(gap_own)} | {_pct(gap_cap)} | {'-' if noise is None else f'±{noise:.2f}%'}"
            f" | {drop} | {r['step_s'] / cap['step_s']:.2f}x |")
    lines += [
        "",
        "Gaps are of the final validation loss (nats per byte), relative. Noise: the 95% "
        "interval of a one-seed difference from the float runs' seed spread (`compare`'s "
        "`noise_pct`); a gap inside it is not a measured difference. Dropped assignments: the "
        "capacity path's fraction of (token, expert) assignments past the capacity, averaged "
        "over the logged steps (the dropless path drops none by construction). Step times "
        "are medians of runs timed one after another on the same shared CPU, not interleaved "
        "(`benchmarks/bench_moe.py` measures them side by side).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="xs")
    p.add_argument("--runs", default="runs")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = load(Path(a.runs), a.size)
    def recipes(path):
        return ",".join(r["recipe"] for r in rows if r["path"] == path)

    cmd = (f"`python -m experiments.compare --config configs/gpt.py:size={a.size},mlp=moe "
           f"--recipes {recipes('capacity')} --seeds 0 --noise_seeds 1`, `python -m "
           f"experiments.compare --config configs/gpt.py:size={a.size},mlp=moe,moe=dropless "
           f"--recipes {recipes('dropless')} --seeds 0 --noise_seeds 1`, then `python -m "
           f"experiments.moe_study --size {a.size}`")
    text = render(rows, cmd)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
