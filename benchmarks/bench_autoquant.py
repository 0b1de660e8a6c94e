"""Cost of sensitivity scoring (``lowbit.autoquant.score``) against a float forward+backward.

    .venv/bin/python benchmarks/bench_autoquant.py            # the GPT "s" shape, 5 rounds
    .venv/bin/python benchmarks/bench_autoquant.py --quick    # tiny smoke run
    .venv/bin/python benchmarks/bench_autoquant.py --methods gradient,shapley,isolated

The model is ``experiments.model.GPT`` at the ``s`` size of ``configs/gpt.py`` (d_model 256, 4
layers, 4 heads, sequence 128, batch 16; float32); its 16 block linear layers are the scored
sites (embedding and head excluded, the default of ``score``), with the four candidates of the
per-layer precision study: ``qat_mxfp8``, ``qat_mxfp6``, ``qat_nvfp4``, ``qat_mxfp4``.

Timed round-robin in one process (``common.py``): ``float`` runs the jitted float
forward+backward (the gradient of the loss with respect to every parameter, as a training step
computes it) on ``--batches`` batches; ``<method>_k`` calls ``score`` on the same batches and
``<method>_1`` on one (everything a call does, warm: ``score`` reuses its compiled programs
across calls on the same model). The per-batch cost of a method is ``(<method>_k - <method>_1)
/ (k - 1)``, set against ``float / k``. Bounds the project holds the methods to: ``gradient``
at most 3x a float forward+backward; ``shapley`` at most ``steps`` times that, so its figure is
also given per path point (``x float / steps``). Next to each time ratio, the flop ratio of the
same work as XLA compiles it (``lowbit.autoquant.scoring_flops``): noise-free, and the floor
that no schedule of the same arithmetic can beat where the GEMMs run at the float step's speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowbit.autoquant as aq  # noqa: E402
from benchmarks import common  # noqa: E402
from experiments.model import GPT, GPTConfig, loss_fn  # noqa: E402

GRADIENT_BOUND = 3.0
CANDIDATES = ["qat_mxfp8", "qat_mxfp6", "qat_nvfp4", "qat_mxfp4"]
FULL = dict(d_model=256, layers=4, heads=4, seq_len=128, batch=16)
QUICK = dict(d_model=64, layers=1, heads=2, seq_len=32, batch=2)


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The command line and its methods, checked."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    p.add_argument("--runs", type=int, default=None, help="rounds (default 5, quick 2)")
    p.add_argument("--batches", type=int, default=3, help="k: batches per timed call (>= 2)")
    p.add_argument("--methods", default="gradient,shapley", help="comma-separated methods")
    p.add_argument("--steps", type=int, default=2, help="shapley path points")
    p.add_argument("--out", default=None, help="JSON results path")
    a = p.parse_args(argv)
    if a.batches < 2:
        p.error("--batches must be at least 2")
    methods = [m for m in a.methods.split(",") if m]
    if not methods:
        p.error("--methods: name at least one method")
    for m in methods:
        if m not in aq.METHODS:
            p.error(f"--methods: unknown method {m!r}; valid: {aq.METHODS}")
    return a, methods


def _rows(a, methods, t, model, batches, output_fn, n_sites: int) -> list[dict]:
    """The float step's row and one per method: time per batch over the float step's, and
    XLA's flop ratio."""
    k = a.batches
    f = t["float"].median_s / k
    rows = [{"what": "float forward+backward", "per_batch_ms": 1e3 * f, "x_float": 1.0}]
    for m in methods:
        per = (t[f"{m}_k"].median_s - t[f"{m}_1"].median_s) / (k - 1)
        fl = aq.scoring_flops(
            model,
            loss_fn,
            batches[0],
            CANDIDATES,
            method=m,
            steps=a.steps,
            output_fn=output_fn if m == "kl" else None,
        )
        row = {"what": m, "per_batch_ms": 1e3 * per, "x_float": per / f, "flops_x": fl["x_float"]}
        if m == "gradient":
            row.update(bound=GRADIENT_BOUND, ok=bool(per / f <= GRADIENT_BOUND))
        if m == "shapley":
            row.update(
                per_point=per / f / a.steps,
                flops_per_point=fl["per_point"],
                bound=GRADIENT_BOUND,
                ok=bool(per / f / a.steps <= GRADIENT_BOUND),
            )
        if m in ("isolated", "kl"):
            n = n_sites * len(CANDIDATES)
            row.update(per_point=per / f / n, flops_per_point=fl["x_float"] / n)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    a, methods = _parse_args(argv)
    shape = QUICK if a.quick else FULL
    runs = a.runs or (2 if a.quick else 5)
    cfg = GPTConfig(
        d_model=shape["d_model"],
        layers=shape["layers"],
        heads=shape["heads"],
        seq_len=shape["seq_len"],
        dtype="float32",
        tie_embeddings=False,
    )
    model = GPT(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)

    def batch():
        t = jnp.asarray(rng.integers(0, 256, (shape["batch"], shape["seq_len"] + 1)), jnp.int32)
        return {"inputs": t[:, :-1], "targets": t[:, 1:]}

    batches = [batch() for _ in range(a.batches)]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def float_grad(params, b):
        def loss(params):
            return loss_fn(nnx.merge(graphdef, params, rest), b)[0]

        return jax.grad(loss)(params)

    def run_float():
        return [float_grad(params, b) for b in batches]

    def output_fn(m, b):
        return m(b["inputs"])[0]

    def scorer(method, bs):
        def f():
            return aq.score(
                model,
                loss_fn,
                bs,
                CANDIDATES,
                method=method,
                steps=a.steps,
                output_fn=output_fn if method == "kl" else None,
            ).damage

        return f

    fns = {"float": run_float}
    for m in methods:
        fns[f"{m}_k"] = scorer(m, batches)
        fns[f"{m}_1"] = scorer(m, batches[:1])
    t = common.time_interleaved(fns, runs=runs, warmup=1)
    k = a.batches
    n_sites = fns[f"{methods[0]}_1"]().shape[0]  # a warm call: its program is compiled
    rows = _rows(a, methods, t, model, batches, output_fn, n_sites)
    print(
        f"GPT d_model {cfg.d_model}, {cfg.layers} layers, batch {shape['batch']} x "
        f"{cfg.seq_len} tokens, {n_sites} sites, {len(CANDIDATES)} candidates, shapley steps "
        f"{a.steps}, k = {k} batches, {runs} rounds, backend {jax.default_backend()}"
    )
    cols = [
        ("what", ""),
        ("per_batch_ms", "per batch ms", "{:.1f}"),
        ("x_float", "x float", "{:.2f}x"),
        ("per_point", "x float per point", "{:.2f}x"),
        ("flops_x", "flops x float", "{:.2f}x"),
        ("flops_per_point", "flops per point", "{:.2f}x"),
        ("bound", "bound", "{:.2f}x"),
        ("ok", "ok"),
    ]
    print(common.format_table(rows, cols))
    print(
        "(per point: shapley per path point; isolated / kl per site and candidate. flops: XLA's\n"
        " count of the compiled programs, lowbit.autoquant.scoring_flops; ok judges the time)"
    )
    payload = {
        "config": {
            **shape,
            "methods": methods,
            "batches": k,
            "runs": runs,
            "sites": n_sites,
            "candidates": CANDIDATES,
            "steps": a.steps,
        },
        "environment": common.environment(),
        "timings": {n: v.to_json() for n, v in t.items()},
        "rows": rows,
    }
    out = a.out or str(
        common.RESULTS_DIR / ("bench_autoquant_quick.json" if a.quick else "bench_autoquant.json")
    )
    common.write_json(out, payload)
    return payload


if __name__ == "__main__":
    main()
