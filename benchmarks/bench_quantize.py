"""Speed of ``lb.fake_quantize`` per format, against a memory-bound baseline and against qwix.

    .venv/bin/python benchmarks/bench_quantize.py                 # 4096x4096 float32, 10 rounds
    .venv/bin/python benchmarks/bench_quantize.py --quick         # tiny smoke run
    .venv/bin/python benchmarks/bench_quantize.py --formats mxfp4,nvfp4 --runs 20

For every registered format and both roundings (``nearest``; ``stochastic`` with a key passed as
an argument) this times jitted ``lb.fake_quantize(x, fmt)`` along the last axis of a square
float32 array, and divides its median by that of a jitted ``x * 2 + 1`` on the same array (one
read and one write of ``x``: the least any out-of-place fake quantizer can cost). Side by side,
when qwix is installed (an optional, benchmark-only dependency), it times qwix's
``dequantize(quantize(x, qtype, tiled_axes={last: block}))`` for the formats qwix has (mxfp4,
mxfp8 = E4M3 elements, nvfp4) with the same blocks (32 for MX, 16 for NVFP4), and reports
lowbit / qwix. All candidates run in one process, interleaved round-robin (``common.py``).

lowbit's time is that of the path a user gets: on a single-device CPU process with a C++
compiler that is the compiled one-pass kernel of ``lowbit.core.native`` (column ``path``); the
column ``xla path`` times the XLA emulation alone (``lb.native.mode("off")``), side by side,
so the table shows both (``--no-xla-path`` skips it). The two give identical numbers.

The two libraries do comparable but not identical work: qwix picks MX scales as
2**ceil(log2(amax / elem_max)) (lowbit's default is OCP's floor rule) and gives NVFP4 no per-tensor
scale, and it has no stochastic rounding for float formats (its noise function applies only to
integer qtypes), so stochastic rows have no qwix time. The bounds the project holds itself to,
reported in the table: MXFP4 and MXFP8 (both element types) nearest <= 1.3x the baseline; NVFP4
and every stochastic row <= 1.6x; and faster than qwix on each format qwix has. Formats without a
stated bound (MXFP6, MXINT8 nearest) show ``-``.

Fused rows (``--no-fused`` skips them): what a recipe's operand quantizer costs with a
randomised Hadamard transform in front (``qarray.fake_quantize_with_plan(..., hadamard=b,
signs=s)``), for b = 16, 32, 64 along the last axis and along axis 0, MXFP4 with stochastic
rounding and prescale 3/4 (the backward recipes) and NVFP4 (its own tensor amax: of the transformed
tensor); and 2-D tiles (16 x 16 over the last two axes: NVFP4 and MXFP8 weights). Each row
gives the path a user gets (the compiled kernel fuses the transform), the XLA path side by side
(its default dense transform, then the quantizer), and the plain kernel's quantization without
the transform, all in multiples of the same baseline, measured in the same interleaved rounds.
Rule rows: NVFP4 under the 2026 recipes' block-scale rules (Four Over Six, TetraJet-v2's
``tensor_block=128``, MS-EDEN), along the last axis and axis 0, against plain NVFP4 and the
XLA path, with issue 25's bound: within 1.3x of the baseline.

Results go to ``--out`` (default ``benchmarks/results/bench_quantize.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import lowbit as lb
from lowbit.core import qarray

try:  # imported as benchmarks.bench_quantize (tests, python -m)
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import common

ROUNDINGS = ("nearest", "stochastic")
BASELINE = "baseline"
DEFAULT_OUT = common.RESULTS_DIR / "bench_quantize.json"
QUICK_SIZE = 128
QUICK_RUNS = 2

# Format -> the qtype qwix calls it (qwix's "mxfp8" has E4M3 elements).
QWIX_QTYPES = {"mxfp4": "mxfp4", "mxfp8_e4m3": "mxfp8", "nvfp4": "nvfp4"}

# Fused rows: (format, rounding, prescale) with a Hadamard transform, its blocks and axes; tiles.
FUSED_QUANTIZERS = (("mxfp4", "stochastic", 0.75), ("nvfp4", "nearest", 1.0))
FUSED_HADAMARD = (16, 32, 64)
FUSED_AXES = (-1, 0)
QUICK_HADAMARD = (16,)
TILES = (("nvfp4", (16, 16)), ("mxfp8_e4m3", (16, 16)))
# Rule rows: NVFP4 under the block-scale rules of the 2026 recipes (name, quantizer options),
# along FUSED_AXES, against RULE_BOUND (issue 25: within 1.3x of a memory pass).
RULES = (
    ("4over6", {"scale_mode": "4over6", "rounding": "nearest"}),
    ("tensor_block=128", {"tensor_block": 128, "rounding": "nearest"}),
    ("eden", {"rounding": "eden"}),
)
RULE_BOUND = 1.3


def bound(fmt: str, rounding: str) -> float | None:
    """The most a format may cost, in multiples of the ``x * 2 + 1`` baseline (None: no bound)."""
    if rounding == "stochastic" or fmt == "nvfp4":
        return 1.6
    if fmt in ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"):
        return 1.3
    return None


def load_qwix() -> tuple[Any | None, str | None]:
    """``(qwix module, None)``, or ``(None, why not)`` when it cannot be imported."""
    try:
        import qwix
    except Exception as e:  # ImportError, or a broken install of an optional dependency
        return None, f"{type(e).__name__}: {e}"
    return qwix, None


def _lowbit_fn(
    fmt: str, rounding: str, x: jax.Array, key: jax.Array, native: str | None = None
) -> Callable[[], jax.Array]:
    """A compiled ``fake_quantize`` call; ``native``: the ``lb.native.mode`` to compile it
    under (None: the default policy, i.e. what a user gets)."""
    with lb.native.mode(native) if native else contextlib.nullcontext():
        if rounding == "stochastic":
            f = jax.jit(lambda x, key: lb.fake_quantize(x, fmt, rounding="stochastic", key=key))
            compiled = f.lower(x, key).compile()
            return lambda: compiled(x, key)
        compiled = jax.jit(lambda x: lb.fake_quantize(x, fmt)).lower(x).compile()
        return lambda: compiled(x)


def _operand_fn(
    fmt: str,
    rounding: str,
    x: jax.Array,
    key: jax.Array,
    *,
    axis: int | tuple[int, int] = -1,
    prescale: float = 1.0,
    hadamard: int | None = None,
    block_shape: tuple[int, ...] | None = None,
    scale_mode: str | None = None,
    tensor_block: int | None = None,
    native: str | None = None,
) -> Callable[[], jax.Array]:
    """A compiled operand quantizer (``qarray.fake_quantize_with_plan``), with a Hadamard
    transform of block ``hadamard`` (random signs, an argument) in front when not None."""
    kd = jax.random.key_data(key) if rounding in ("stochastic", "eden") else None
    plan = qarray.make_plan(x.shape, fmt, axis, block_shape, scale_mode, rounding, kd, None,
                            prescale, tensor_block=tensor_block)
    signs = None if hadamard is None else lb.hadamard.random_signs(jax.random.key(2), hadamard)

    def fq(x, signs):
        return qarray.fake_quantize_with_plan(x, kd, None, plan, hadamard=hadamard, signs=signs)[0]

    with lb.native.mode(native) if native else contextlib.nullcontext():
        compiled = jax.jit(fq).lower(x, signs).compile()
    return lambda: compiled(x, signs)


def _fused_candidates(
    x: jax.Array, key: jax.Array, quick: bool, native: bool
) -> tuple[dict[str, Callable[[], Any]], list[dict[str, Any]]]:
    """The fused rows' candidates and, per row, the names of its three timings.

    The XLA path's candidates come after all of the kernel's: the rounds keep the candidates'
    cyclic order, so each call always follows the same neighbour, and a call right after one
    of the XLA path's (which allocates and frees several arrays of x's size) measured up to
    30 % slower; this way each kernel row follows a kernel row.
    """
    kernel: dict[str, Callable[[], Any]] = {}
    xla_path: dict[str, Callable[[], Any]] = {}
    specs: list[dict[str, Any]] = []

    def add(name: str, **kw: Any) -> str:
        into = xla_path if kw.get("native") == "off" else kernel
        if name not in into:
            into[name] = _operand_fn(x=x, key=key, **kw)
        return name

    for fmt, rounding, prescale in FUSED_QUANTIZERS:
        for axis in FUSED_AXES:
            q = {"fmt": fmt, "rounding": rounding, "prescale": prescale, "axis": axis}
            plain = add(f"plain/{fmt}/{axis}", **q)
            for b in QUICK_HADAMARD if quick else FUSED_HADAMARD:
                if x.shape[axis] % b:
                    continue
                fused = add(f"fused/{fmt}/{axis}/h{b}", hadamard=b, **q)
                xla = add(f"fused-xla/{fmt}/{axis}/h{b}", hadamard=b, native="off", **q)
                specs.append(
                    {
                        "kind": "hadamard",
                        "hadamard": b,
                        "block_shape": None,
                        **q,
                        "names": (fused, xla, plain),
                    }
                )
    for fmt, tile in TILES[:1] if quick else TILES:
        q = {"fmt": fmt, "rounding": "nearest", "prescale": 1.0, "axis": (-2, -1)}
        if any(d < t for d, t in zip(x.shape, tile, strict=True)):
            continue
        tiled = add(f"tile/{fmt}", block_shape=tile, **q)
        xla = add(f"tile-xla/{fmt}", block_shape=tile, native="off", **q)
        specs.append(
            {
                "kind": "tiles",
                "hadamard": None,
                "block_shape": tile,
                **q,
                "names": (tiled, xla, None),
            }
        )
    for rule, opts in RULES:
        for axis in FUSED_AXES[:1] if quick else FUSED_AXES:
            q = {"fmt": "nvfp4", "prescale": 1.0, "axis": axis, **opts}
            plain = add(f"plain/nvfp4/{axis}", fmt="nvfp4", rounding="nearest", axis=axis)
            ruled = add(f"rule/{rule}/{axis}", **q)
            xla = add(f"rule-xla/{rule}/{axis}", native="off", **q)
            specs.append(
                {
                    "kind": "rule",
                    "rule": rule,
                    "hadamard": None,
                    "block_shape": None,
                    "fmt": "nvfp4",
                    "rounding": opts["rounding"],
                    "prescale": 1.0,
                    "axis": axis,
                    "names": (ruled, xla, plain),
                }
            )
    return {**kernel, **xla_path}, specs


def _fused_rows(specs, timings, t_base: common.Timing, native: bool) -> list[dict[str, Any]]:
    rows = []
    for spec in specs:
        fused, xla, plain = (timings.get(n) if n else None for n in spec["names"])
        ratio = fused.median_s / t_base.median_s
        axis = spec["axis"]
        rows.append(
            {
                "kind": spec["kind"],
                "rule": spec.get("rule"),
                "bound": RULE_BOUND if spec["kind"] == "rule" else None,
                "within_bound": ratio <= RULE_BOUND if spec["kind"] == "rule" else None,
                "format": spec["fmt"],
                "rounding": spec["rounding"],
                "prescale": spec["prescale"],
                "axis": list(axis) if isinstance(axis, tuple) else axis,
                "hadamard": spec["hadamard"],
                "block_shape": None if spec["block_shape"] is None else list(spec["block_shape"]),
                "path": "native" if native else "xla",
                "ms": fused.median_ms,
                "x_baseline": ratio,
                "x_baseline_min": min(fused.samples_s) / min(t_base.samples_s),
                "xla_x_baseline": xla.median_s / t_base.median_s,
                "xla_over_path": xla.median_s / fused.median_s,
                "plain_x_baseline": None if plain is None else plain.median_s / t_base.median_s,
                "spread": fused.spread,
                "samples_ms": [1e3 * s for s in fused.samples_s],
                "xla_samples_ms": [1e3 * s for s in xla.samples_s],
            }
        )
    return rows


def _qwix_fn(qwix: Any, qtype: str, block: int) -> Callable[[jax.Array], jax.Array]:
    def fake_quantize(x: jax.Array) -> jax.Array:
        return qwix.dequantize(qwix.quantize(x, qtype, tiled_axes={x.ndim - 1: block}))

    return jax.jit(fake_quantize)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--size",
        type=int,
        default=None,
        help=f"side of the square float32 input (default 4096; {QUICK_SIZE} with --quick)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=None,
        help=f"timed rounds per candidate (default 10; {QUICK_RUNS} with --quick)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed calls per candidate before timing (default 2; 1 with --quick)",
    )
    p.add_argument(
        "--formats",
        default=None,
        help="comma-separated format names or aliases (default: all registered)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_SIZE}x{QUICK_SIZE}, {QUICK_RUNS} rounds",
    )
    p.add_argument("--no-qwix", action="store_true", help="skip the qwix comparison")
    p.add_argument(
        "--no-xla-path",
        action="store_true",
        help="do not also time the XLA emulation when the native CPU kernel is active",
    )
    p.add_argument(
        "--no-fused",
        action="store_true",
        help="skip the fused rows (Hadamard transform + quantization, 2-D tiles)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args = p.parse_args(argv)
    args.size = args.size or (QUICK_SIZE if args.quick else 4096)
    args.runs = args.runs or (QUICK_RUNS if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.size < 1 or args.runs < 1:
        p.error(f"--size and --runs must be positive, got {args.size} and {args.runs}")
    if args.formats:
        try:
            names = [lb.formats.get(n.strip()).name for n in args.formats.split(",") if n.strip()]
        except ValueError as e:
            p.error(str(e))
        args.formats = list(dict.fromkeys(names))  # aliases resolved, duplicates dropped
    else:
        args.formats = lb.formats.names()
    return args


def _add_qwix(candidates: dict[str, Callable[[], Any]], qwix, args, x) -> dict[str, str]:
    """Add qwix's quantizer of each format that it has and that compiles to
    ``candidates``; returns each format's qwix status."""
    qwix_status: dict[str, str] = {}
    for fmt in args.formats:
        qtype = QWIX_QTYPES.get(fmt)
        if qwix is None:
            qwix_status[fmt] = "not installed" if not args.no_qwix else "skipped"
        elif qtype is None:
            qwix_status[fmt] = "no such format"
        else:
            fn = _qwix_fn(qwix, qtype, lb.formats.get(fmt).block_size)
            try:  # compiles; an unsupported qtype or tiling fails here
                y = jax.block_until_ready(fn(x))
                if y.shape != x.shape:
                    raise ValueError(f"returned shape {y.shape}, expected {x.shape}")
            except Exception as e:
                qwix_status[fmt] = f"failed: {_error(e)}"
                continue
            qwix_status[fmt] = "ok"
            candidates[f"qwix/{fmt}"] = lambda fn=fn: fn(x)
    return qwix_status


def _rows(args, timings, t_base, native: bool, qwix_status: dict[str, str]) -> list[dict]:
    """One result row per (format, rounding): lowbit against the baseline and qwix."""
    rows = []
    for fmt in args.formats:
        for rounding in ROUNDINGS:
            t = timings[f"lowbit/{fmt}/{rounding}"]
            ratio = t.median_s / t_base.median_s
            t_xla = timings.get(f"lowbit-xla/{fmt}/{rounding}", t if not native else None)
            limit = bound(fmt, rounding)
            t_qwix = timings.get(f"qwix/{fmt}") if rounding == "nearest" else None
            if rounding == "stochastic" and qwix_status[fmt] == "ok":
                status = "no stochastic rounding"
            else:
                status = qwix_status[fmt]
            vs_qwix = t.median_s / t_qwix.median_s if t_qwix is not None else None
            checks = []
            if limit is not None:
                checks.append(ratio <= limit)
            if vs_qwix is not None:
                checks.append(vs_qwix < 1.0)
            rows.append(
                {
                    "format": fmt,
                    "rounding": rounding,
                    "ms": t.median_ms,
                    "x_baseline": ratio,
                    # Fastest over fastest: a cross-check on a loaded machine, not the verdict.
                    "x_baseline_min": min(t.samples_s) / min(t_base.samples_s),
                    "path": "native" if native else "xla",
                    "xla_x_baseline": None if t_xla is None else t_xla.median_s / t_base.median_s,
                    "bound": limit,
                    "within_bound": None if limit is None else ratio <= limit,
                    "qwix_qtype": QWIX_QTYPES.get(fmt),
                    "qwix_status": status,
                    "qwix_ms": t_qwix.median_ms if t_qwix is not None else None,
                    "lowbit_over_qwix": vs_qwix,
                    "lowbit_over_qwix_min": (
                        None if t_qwix is None else min(t.samples_s) / min(t_qwix.samples_s)
                    ),
                    "faster_than_qwix": None if vs_qwix is None else vs_qwix < 1.0,
                    "pass": all(checks) if checks else None,
                    "spread": t.spread,
                    "samples_ms": [1e3 * s for s in t.samples_s],
                    "qwix_samples_ms": None
                    if t_qwix is None
                    else [1e3 * s for s in t_qwix.samples_s],
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; returns what was written."""
    args = parse_args(argv)
    n = args.size
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    key = jax.random.key(1)
    jax.block_until_ready(x)

    candidates: dict[str, Callable[[], Any]] = {}
    base = jax.jit(lambda x: x * 2 + 1)
    candidates[BASELINE] = lambda: base(x)
    # What a user gets (the compiled CPU kernel when lowbit.core.native is active), and side by
    # side the XLA emulation alone.
    native = lb.native.active()
    for fmt in args.formats:
        for rounding in ROUNDINGS:
            candidates[f"lowbit/{fmt}/{rounding}"] = _lowbit_fn(fmt, rounding, x, key)
            if native and not args.no_xla_path:
                candidates[f"lowbit-xla/{fmt}/{rounding}"] = _lowbit_fn(
                    fmt, rounding, x, key, native="off"
                )

    fused_specs: list[dict[str, Any]] = []
    if not args.no_fused:
        fused, fused_specs = _fused_candidates(x, key, args.quick, native)
        candidates.update(fused)

    # qwix: optional; a missing package, format or a failure becomes a status, not a crash.
    qwix, qwix_missing = (None, "disabled (--no-qwix)") if args.no_qwix else load_qwix()
    qwix_status = _add_qwix(candidates, qwix, args, x)

    print(
        f"bench_quantize: {n}x{n} float32, {len(candidates)} candidates, {args.runs} rounds "
        f"interleaved, {args.warmup} warm-up calls each",
        file=sys.stderr,
    )
    env = common.environment()
    timings = common.time_interleaved(candidates, runs=args.runs, warmup=args.warmup)
    env["loadavg_after"] = common.environment()["loadavg"]
    t_base = timings[BASELINE]

    rows = _rows(args, timings, t_base, native, qwix_status)

    fused_rows = _fused_rows(fused_specs, timings, t_base, native)

    _print_table(rows, t_base, args)
    if fused_rows:
        _print_fused_table(fused_rows, args)
    checked = [r["pass"] for r in rows if r["pass"] is not None]
    payload = {
        "benchmark": "bench_quantize",
        "config": {
            "shape": [n, n],
            "dtype": "float32",
            "axis": -1,
            "runs": args.runs,
            "warmup": args.warmup,
            "quick": args.quick,
            "formats": args.formats,
        },
        "environment": env,
        "baseline": {"op": "x * 2 + 1", **t_base.to_json()},
        "native": {
            "active": native,
            "available": lb.native.available(),
            "why_unavailable": lb.native.why_unavailable(),
        },
        "qwix": {
            "available": qwix is not None,
            "version": getattr(qwix, "__version__", None),
            "error": qwix_missing,
            "status": qwix_status,
        },
        "rows": rows,
        "fused_rows": fused_rows,
        "all_pass": all(checked) if checked else None,
    }
    path = common.write_json(args.out, payload)
    print(f"wrote {path}", file=sys.stderr)
    return payload


def _print_table(rows: list[dict[str, Any]], t_base: common.Timing, args) -> None:
    shown = []
    for r in rows:
        status = r["qwix_status"]
        shown.append(
            {
                **r,
                "spread": None if r["spread"] is None else 100 * r["spread"],
                # qwix's time, or why there is none (a long error is in the JSON in full).
                "qwix_ms": r["qwix_ms"] if r["qwix_ms"] is not None else status[:40],
                "pass": {True: "pass", False: "FAIL", None: "-"}[r["pass"]],
            }
        )
    columns = [
        ("format", "format"),
        ("rounding", "rounding"),
        ("ms", "ms"),
        ("spread", "iqr", "{:.0f}%"),
        ("x_baseline", "x baseline", "{:.2f}x"),
        ("x_baseline_min", "(of mins)", "{:.2f}x"),
        ("bound", "bound", "<={:.1f}x"),
        ("path", "path"),
        ("xla_x_baseline", "xla path", "{:.2f}x"),
        ("qwix_ms", "qwix ms"),
        ("lowbit_over_qwix", "lowbit/qwix"),
        ("lowbit_over_qwix_min", "(of mins)"),
        ("pass", "pass"),
    ]
    print(
        f"fake_quantize, {args.size}x{args.size} float32, axis -1: median of {args.runs} "
        f"interleaved rounds; baseline x * 2 + 1 = {t_base.median_ms:.2f} ms"
        + ("" if t_base.spread is None else f" (iqr {100 * t_base.spread:.0f}%)")
    )
    print(common.format_table(shown, columns))


def _print_fused_table(rows: list[dict[str, Any]], args) -> None:
    shown = []
    for r in rows:
        if r["kind"] == "hadamard":
            what = f"hadamard {r['hadamard']}"
        elif r["kind"] == "rule":
            what = r["rule"]
        else:
            what = "tile {}x{}".format(*r["block_shape"])
        axis = r["axis"]
        shown.append(
            {
                **r,
                "what": what,
                "axis": axis if isinstance(axis, int) else ",".join(map(str, axis)),
                "spread": None if r["spread"] is None else 100 * r["spread"],
            }
        )
    columns = [
        ("what", "fused"),
        ("format", "format"),
        ("rounding", "rounding"),
        ("prescale", "prescale"),
        ("axis", "axis"),
        ("ms", "ms"),
        ("spread", "iqr", "{:.0f}%"),
        ("x_baseline", "x baseline", "{:.2f}x"),
        ("x_baseline_min", "(of mins)", "{:.2f}x"),
        ("bound", "bound", "<={:.1f}x"),
        ("path", "path"),
        ("xla_x_baseline", "xla path", "{:.2f}x"),
        ("xla_over_path", "xla/path", "{:.2f}x"),
        ("plain_x_baseline", "plain", "{:.2f}x"),
    ]
    print(
        f"\nfused operand quantizers and NVFP4 scale rules, {args.size}x{args.size} float32, in "
        "multiples of the same baseline (xla path: dense hadamard_transform, then the XLA "
        "quantizer; plain: the kernel without the transform, or plain NVFP4 for a rule)"
    )
    print(common.format_table(shown, columns))


if __name__ == "__main__":
    main()
