"""Speed of ``lowbit.core.hadamard``'s two forms per block size and axis, against a memory pass.

    .venv/bin/python benchmarks/bench_hadamard.py                 # 4096 x 1024 float32
    .venv/bin/python benchmarks/bench_hadamard.py --quick         # tiny smoke run

For each block size b in 16..256 and each axis (the last one, as for the forward GEMM's
operands, and the leading one, as for the weight-gradient GEMM's, blocked along tokens) this
times the jitted randomised transform in both forms (``method="dense"``: each block times the
signed b x b matrix; ``method="butterfly"``: log2 b stages of sums and differences) and divides
each median by that of a jitted ``x * 2 + 1`` on the same array (one read and one write: a
memory pass). Column ``default`` is the form ``hadamard.default_method`` picks for this
backend, and ``default is fastest`` says whether the table agrees with the measurement. All
candidates of a row run in one process, interleaved round-robin (``common.py``).

Results go to ``--out`` (default ``benchmarks/results/bench_hadamard.json``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.core import hadamard

try:  # imported as benchmarks.bench_hadamard (tests, python -m)
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import common

DEFAULT_OUT = common.RESULTS_DIR / "bench_hadamard.json"
QUICK_RUNS = 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096, help="rows of the float32 array")
    p.add_argument("--cols", type=int, default=1024, help="columns of the float32 array")
    p.add_argument("--runs", type=int, default=None, help="timed rounds (default 10)")
    p.add_argument("--blocks", default=",".join(map(str, hadamard.BLOCK_SIZES)),
                   help="comma-separated block sizes")
    p.add_argument("--quick", action="store_true", help="256 x 256, 2 rounds, b = 16 and 256")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.cols, args.blocks = 256, 256, "16,256"
    args.runs = args.runs or (QUICK_RUNS if args.quick else 10)
    try:
        args.blocks = [int(b) for b in args.blocks.split(",") if b.strip()]
    except ValueError:
        p.error(f"--blocks must be comma-separated integers, got {args.blocks!r}")
    for b in args.blocks:
        if b not in hadamard.BLOCK_SIZES:
            p.error(f"--blocks: {b} is not one of {hadamard.BLOCK_SIZES}")
        if args.rows % b or args.cols % b:
            p.error(f"--rows {args.rows} and --cols {args.cols} must be multiples of {b}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; returns what was written."""
    args = parse_args(argv)
    x = jax.random.normal(jax.random.key(0), (args.rows, args.cols), jnp.float32)
    base = jax.jit(lambda x: x * 2 + 1)
    rows = []
    for b in args.blocks:
        signs = hadamard.random_signs(jax.random.key(1), b)
        for axis, where in ((-1, "last"), (0, "leading")):
            fns = {
                m: jax.jit(lambda x, s, m=m, b=b, axis=axis: hadamard.hadamard_transform(
                    x, b, signs=s, axis=axis, method=m))
                for m in hadamard.METHODS
            }
            candidates = {"memory pass": lambda: base(x)}
            candidates |= {m: (lambda f=f, s=signs: f(x, s)) for m, f in fns.items()}
            t = common.time_interleaved(candidates, runs=args.runs)
            ratios = {m: t[m].median_s / t["memory pass"].median_s for m in hadamard.METHODS}
            default = hadamard.default_method(b, axis == -1)
            rows.append({
                "block": b,
                "axis": where,
                "dense": ratios["dense"],
                "butterfly": ratios["butterfly"],
                "default": default,
                "default_is_fastest": ratios[default] <= min(ratios.values()),
                "memory_pass_ms": t["memory pass"].median_ms,
            })
            print(f"  b={b} {where}: dense {ratios['dense']:.2f}x butterfly "
                  f"{ratios['butterfly']:.2f}x", file=sys.stderr)
    env = common.environment()
    print(f"Hadamard transform of a {args.rows} x {args.cols} float32 array on "
          f"{env['backend']} ({env['cpu_count']} CPUs), in multiples of x * 2 + 1; median of "
          f"{args.runs} interleaved rounds")
    print(common.format_table(rows, [
        ("block", "b"), ("axis", "axis"), ("dense", "dense", "{:.2f}x"),
        ("butterfly", "butterfly", "{:.2f}x"), ("default", "default"),
        ("default_is_fastest", "default is fastest"),
    ]))
    payload = {
        "benchmark": "bench_hadamard",
        "config": {"shape": [args.rows, args.cols], "runs": args.runs, "blocks": args.blocks},
        "environment": env,
        "rows": rows,
    }
    path = common.write_json(args.out, payload)
    print(f"wrote {path}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
