"""GPTQ's time and output error on one layer: lowbit against qwix's GPTQ and round-to-nearest.

    .venv/bin/python benchmarks/bench_gptq.py                 # K 512 x N 512, 4096 tokens
    .venv/bin/python benchmarks/bench_gptq.py --quick         # K 128 x N 64, 512 tokens
    .venv/bin/python benchmarks/bench_gptq.py --gpt xs        # + every site of the xs GPT

The layer: ``y = x @ w`` with ``x [tokens, K]`` correlated Gaussian inputs (a random mixing
plus a neighbour term) with 8 outlier channels scaled by 20, ``w [K, N]`` Gaussian, the
Hessian ``x^T x``. Output error: ``||x (W_q - W)||^2 / ||x W||^2``.

Rows: round-to-nearest (``lb.quantize``), ``lb.calibrate.gptq``, ``lb.calibrate.mr_gptq``, in
INT4, NVFP4 and MXFP4; and qwix's GPTQ (``qwix.contrib.gptq_core.quantize_weight``, its
JAX port of the reference) in the nearest format both express: qwix has no MX or NVFP4
GPTQ (its ``HowToQuantize`` takes the ``"nvfp4"`` / ``"mxfp4"`` names, its GPTQ's ``qarray``
calls do not), so qwix's int4 with a float32 scale per 16 inputs of every output row
(``channelwise_axes=(0,), tiled_axes={1: 16}``) stands beside lowbit's INT4 (grid -7..7, an
E4M3 scale per 16 and a float32 tensor scale). Times: the first call (tracing and compiling
included, which is what a PTQ run pays once per layer shape) and the median of later calls;
qwix's ``quantize_weight`` is a Python loop over columns run eagerly (no ``jit``), lowbit's a
jitted loop. Both lowbit and qwix are timed in this one process, interleaved.

``--gpt xs``: ``lb.ptq.calibrate(..., hessians=True)`` then ``lb.ptq.quantize(...,
weights="gptq")`` of every site of the xs GPT (its initial parameters, batches of its data),
against ``weights="max"``: the time PTQ with GPTQ takes on a whole model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowbit as lb  # noqa: E402
from benchmarks.common import environment, format_table, time_interleaved, write_json  # noqa: E402
from lowbit.core.hadamard import hadamard_transform  # noqa: E402

FORMATS = ("int4", "nvfp4", "mxfp4")


def layer(k: int, n: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((tokens, k))
    x = z @ (np.eye(k) + 0.6 * rng.standard_normal((k, k)) / np.sqrt(k))
    x = x + 0.8 * np.roll(z, 1, axis=1)
    x[:, rng.choice(k, 8, replace=False)] *= 20.0
    w = rng.standard_normal((k, n)) * 0.05
    return x.astype(np.float32), w.astype(np.float32)


def rel_err(x, wq, w) -> float:
    x64 = np.asarray(x, np.float64)
    d = x64 @ (np.asarray(wq, np.float64) - np.asarray(w, np.float64))
    return float(np.sum(d * d) / np.sum((x64 @ np.asarray(w, np.float64)) ** 2))


def _qwix_gptq(w, h):
    """qwix's GPTQ of ``w [K, N]`` (its layout: ``W [N, K]``): the dequantized ``[K, N]``."""
    from qwix._src.core import qarray
    from qwix.contrib import gptq_core

    how = qarray.HowToQuantize(qtype=jnp.int4, channelwise_axes=(0,), tiled_axes={1: 16})
    q, _ = gptq_core.quantize_weight(jnp.asarray(w).T, jnp.asarray(h), how)
    return qarray.dequantize(q).T


def candidates(x, w, h) -> dict:
    """name -> a call returning the dequantized weight in the original basis."""
    out = {}
    for fmt in FORMATS:
        b = lb.formats.get(fmt).block_size
        out[f"rtn {fmt}"] = lambda f=fmt: lb.dequantize(lb.quantize(w, f, axis=0))
        out[f"lowbit gptq {fmt}"] = lambda f=fmt: lb.dequantize(lb.calibrate.gptq(w, h, f))
        out[f"lowbit mr-gptq {fmt}"] = lambda f=fmt, b=b: hadamard_transform(
            lb.dequantize(lb.calibrate.mr_gptq(w, h, f)), b, axis=0)
    try:
        import qwix  # noqa: F401

        out["qwix gptq int4 (float32 scale / 16)"] = lambda: _qwix_gptq(w, h)
    except ImportError:
        print("qwix is not installed (pip install -e '.[bench]'): its row is left out")
    return out


def bench_layer(k: int, n: int, tokens: int, runs: int) -> list[dict]:
    x, w = layer(k, n, tokens)
    h = x.T @ x
    cands = candidates(x, w, h)
    rows = {}
    for name, fn in cands.items():  # the first call of each: tracing and compiling included
        t0 = time.perf_counter()
        wq = jax.block_until_ready(fn())
        rows[name] = {"method": name, "first_s": time.perf_counter() - t0,
                      "rel_err": rel_err(x, wq, w)}
    timed = time_interleaved(cands, runs=runs, warmup=0)
    for name, t in timed.items():
        rows[name]["median_s"] = t.median_s
    ref = rows.get("qwix gptq int4 (float32 scale / 16)")
    for r in rows.values():
        if ref is not None:
            r["first_vs_qwix"] = r["first_s"] / ref["first_s"]
            r["median_vs_qwix"] = r["median_s"] / ref["median_s"]
    return list(rows.values())


def bench_gpt(size: str) -> dict:
    """PTQ of every site of the ``size`` GPT with GPTQ weights and with standard scales."""
    import lowbit.ptq as ptq
    from configs import gpt
    from experiments import runs
    from experiments.config import RunConfig
    from experiments.trainer import build_float_model

    cfg = RunConfig.from_config(gpt.get_config(f"size={size},recipe=none"))
    model = build_float_model(cfg)
    batches = runs.calibration_batches(cfg, 4)
    rules = [(".*", "w4a16_nvfp4")]
    out = {"size": size}
    t0 = time.perf_counter()
    cal = ptq.calibrate(model, rules, batches, hessians=True)
    out["calibrate_hessians_s"] = time.perf_counter() - t0
    out["sites"] = len(cal.hessians)
    for weights in ("max", "gptq"):
        t0 = time.perf_counter()
        served = ptq.quantize(model, rules, cal, weights=weights)
        jax.block_until_ready(jax.tree.leaves(served))
        out[f"quantize_{weights}_s"] = time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gpt", default="", help="also PTQ every site of this GPT size (xs)")
    p.add_argument("--out", default="benchmarks/results/bench_gptq.json")
    a = p.parse_args(argv)
    k, n, tokens = (128, 64, 512) if a.quick else (512, 512, 4096)
    rows = bench_layer(k, n, tokens, a.runs)
    print(f"GPTQ on one layer: K {k} x N {n}, {tokens} tokens, 8 outlier inputs x20; "
          f"output error ||x (W_q - W)||^2 / ||x W||^2")
    cols = [("method", "method"), ("rel_err", "output error", "{:.4g}"),
            ("first_s", "first call (s)", "{:.2f}"), ("median_s", "later calls (s)", "{:.3f}")]
    if any("first_vs_qwix" in r for r in rows):
        cols += [("first_vs_qwix", "first / qwix", "{:.3f}x"),
                 ("median_vs_qwix", "later / qwix", "{:.4f}x")]
    print(format_table(rows, cols))
    result = {"environment": environment(), "layer": {"k": k, "n": n, "tokens": tokens},
              "rows": rows}
    if a.gpt:
        result["gpt"] = bench_gpt(a.gpt)
        print(result["gpt"])
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
