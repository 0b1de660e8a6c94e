"""How complete Aumann-Shapley credits are, by quadrature rule and number of path points.

For each candidate, the credits of every site summed (``lowbit.autoquant.score(...,
method="shapley", steps=n, rule=r)``) are set against the measured loss change of quantizing
every site with that candidate, on the same calibration batches: the completeness ratio
(1 is exact) for the midpoint and the Gauss-Legendre rule at several step counts. Weight-only
candidates have a smooth path, on which both rules converge; W+A candidates a path on which
the loss jumps where an activation's rounding flips.

    .venv/bin/python -m experiments.shapley_rules --run runs/aq-gpt-tiny-2000/none-s0

``--run``: a finished float run (``experiments/autoquant.py`` trains them under
``runs/aq-gpt-<size>-<steps>/none-s<seed>``). Writes
``experiments/results/shapley_rules_<run's parent folder>.json`` (or ``--out``) and prints the
table (with the command that made it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax.numpy as jnp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowbit as lb  # noqa: E402
import lowbit.autoquant as aq  # noqa: E402
import lowbit.ptq as ptq  # noqa: E402
from experiments import runs, studylib  # noqa: E402
from experiments.autoquant import cross_entropy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WEIGHT_ONLY = ("w4a16_mxfp4", "w4a16_nvfp4")
WA = ("qat_mxfp8", "qat_mxfp4")


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise SystemExit(
            f"--{what}: expected comma-separated positive ints, got {text!r}"
        ) from None
    if not out or min(out) < 1:
        raise SystemExit(f"--{what}: expected comma-separated positive ints, got {text!r}")
    return out


def _parse_args(argv: list[str] | None):
    """The command line: the namespace, the candidates and the (rule, points) settings."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", required=True, help="a finished float GPT run directory")
    p.add_argument("--batches", type=int, default=4, help="calibration batches")
    p.add_argument("--candidates", default=",".join(WEIGHT_ONLY + WA))
    p.add_argument("--midpoint", default="2,4,8,16", help="midpoint-rule step counts")
    p.add_argument("--gauss", default="2,3,4", help="Gauss-Legendre step counts")
    p.add_argument("--out", default=None, help="output JSON (default: experiments/results/...)")
    a = p.parse_args(argv)
    if a.batches < 1:
        p.error("--batches must be at least 1")
    cands = [c for c in a.candidates.split(",") if c]
    for c in cands:
        try:
            lb.recipes.get(c)
        except ValueError as e:
            p.error(f"--candidates: {e}")
    settings = [("midpoint", n) for n in _ints(a.midpoint, "midpoint")]
    settings += [("gauss", n) for n in _ints(a.gauss, "gauss")]
    return a, cands, settings


def run_study(run: str, *, batches: int, candidates: list[str], settings: list) -> dict:
    """Score ``candidates`` on the float run ``run`` under every ``(rule, points)`` of
    ``settings`` and set each candidate's summed credits against its measured loss change."""
    cfg, model = runs.load_trained(run)
    calib = [
        {k: jnp.asarray(v) for k, v in b.items()}
        for b in runs.calibration_batches(cfg, batches, full=True)
    ]
    scores, secs = {}, {}
    for rule, n in settings:
        t = time.perf_counter()
        scores[rule, n] = aq.score(
            model, cross_entropy, calib, candidates, method="shapley", steps=n, rule=rule
        )
        secs[rule, n] = time.perf_counter() - t
    sites = scores[settings[0]].sites  # no groups: the scored site paths
    base = runs.evaluate(cfg, model, batches=calib)["val_loss"]
    measured = {}
    for c in candidates:
        m = ptq.simulate(model, [(s, c) for s in sites])
        measured[c] = runs.evaluate(cfg, m, batches=calib)["val_loss"] - base
    rows = []
    for (rule, n), s in scores.items():
        for j, c in enumerate(candidates, 1):
            total = float(s.damage[:, j].sum())
            rows.append(
                {
                    "rule": rule,
                    "steps": n,
                    "candidate": c,
                    "sum_credits": total,
                    "measured": measured[c],
                    "ratio": total / measured[c],
                    "score_seconds": secs[rule, n],
                }
            )
    return {
        "run": str(run),
        "sites": list(sites),
        "batches": batches,
        "float_loss": base,
        "measured": measured,
        "rows": rows,
    }


def render_markdown(result: dict, command: str) -> str:
    """The command, then the completeness ratio per rule and points (rows) and candidate."""
    rows, measured = result["rows"], result["measured"]
    settings = list(dict.fromkeys((x["rule"], x["steps"]) for x in rows))
    cands = list(dict.fromkeys(x["candidate"] for x in rows))
    lines = [
        f"`{command}`",
        "",
        f"{len(result['sites'])} sites, {result['batches']} calibration batches; "
        "completeness ratio = summed credits / measured loss change",
        "",
        "| rule | steps | " + " | ".join(cands) + " |",
        "|---|---|" + "---|" * len(cands),
    ]
    for rule, n in settings:
        r = {x["candidate"]: x for x in rows if (x["rule"], x["steps"]) == (rule, n)}
        lines.append(
            f"| {rule} | {n} | " + " | ".join(f"{r[c]['ratio']:.5f}" for c in cands) + " |"
        )
    lines.append("| measured change | | " + " | ".join(f"{measured[c]:+.4f}" for c in cands) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """The study's CLI (the :mod:`experiments.studylib` convention): prints the table and
    writes the JSON (``--out``, by default ``experiments/results/shapley_rules_<run's parent
    folder>.json``); returns what was written."""
    a, cands, settings = _parse_args(argv)
    cmd = studylib.command_line("experiments.shapley_rules", argv)
    result = studylib.run_or_exit(
        run_study, a.run, batches=a.batches, candidates=cands, settings=settings
    )
    text = render_markdown(result, cmd)
    print(text)
    default = RESULTS / f"shapley_rules_{Path(a.run).resolve().parent.name}.json"
    out = Path(a.out) if a.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    payload = {
        "command": cmd,
        **result,
        "table": text,
        "completeness_error": {
            f"{x['rule']}-{x['steps']}-{x['candidate']}": abs(x["ratio"] - 1) for x in rows
        },
    }
    studylib.write_json(out, payload)
    return payload


if __name__ == "__main__":
    main()
