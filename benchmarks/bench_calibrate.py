"""Cost of calibration statistics (``lowbit.ptq.calibrate``) against a plain forward, per batch.

    .venv/bin/python benchmarks/bench_calibrate.py            # the GPT "s" shape, 10 rounds
    .venv/bin/python benchmarks/bench_calibrate.py --quick    # tiny smoke run
    .venv/bin/python benchmarks/bench_calibrate.py --method percentile --batches 9

The model is ``experiments.model.GPT`` at the ``s`` size of ``configs/gpt.py`` (d_model 256, 4
layers, 4 heads, sequence 128, batch 16; float32), its 16 block linear layers the calibrated
sites (``embed|head`` kept float, as the experiments do), recipe ``qat_nvfp4``. Per batch,
calibration runs the float model once with the hooks of the ``lowbit.flax`` ops recording, at
every site, the histogram of ``|x|`` (2048 bins), the per-channel max and the first rows of the
activation, and merges them into the running statistics on the host.

Timed round-robin in one process (``common.py``): ``forward`` runs the jitted float forward on
``--batches`` batches; ``calibrate_k`` calls ``ptq.calibrate`` on the same batches and
``calibrate_1`` on one (everything a call does, warm: the jitted observer is compiled once and
reused across calls). The per-batch cost of calibration is ``(calibrate_k - calibrate_1) / (k -
1)``, set against ``forward / k``; the bound the project holds it to is 1.5x. The end-to-end
ratio ``calibrate_k / forward`` (per-call overhead included: listing the sites, building the
observing model, choosing the amaxes) is reported too.
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

import lowbit.ptq as ptq  # noqa: E402
from benchmarks import common  # noqa: E402
from experiments.model import GPT, GPTConfig  # noqa: E402

BOUND = 1.5
RULES = [(r"embed|head", "none"), (r".*", "qat_nvfp4")]
FULL = dict(d_model=256, layers=4, heads=4, seq_len=128, batch=16)
QUICK = dict(d_model=64, layers=1, heads=2, seq_len=32, batch=2)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 rounds")
    p.add_argument("--runs", type=int, default=None, help="rounds (default 10, quick 3)")
    p.add_argument("--batches", type=int, default=5, help="k: batches per timed call (>= 2)")
    p.add_argument("--method", default="max", help="calibration method")
    p.add_argument("--out", default=None, help="JSON results path")
    a = p.parse_args(argv)
    if a.batches < 2:
        p.error("--batches must be at least 2")
    shape = QUICK if a.quick else FULL
    runs = a.runs or (3 if a.quick else 10)
    cfg = GPTConfig(d_model=shape["d_model"], layers=shape["layers"], heads=shape["heads"],
                    seq_len=shape["seq_len"], dtype="float32")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.integers(0, 256, (shape["batch"], shape["seq_len"])), jnp.int32)
               for _ in range(a.batches)]
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens):
        return nnx.merge(graphdef, state)(tokens)[0]

    def forward():
        return [fwd(state, b) for b in batches]

    def cal_k():
        return ptq.calibrate(model, RULES, batches, a.method).amax

    def cal_1():
        return ptq.calibrate(model, RULES, batches[:1], a.method).amax

    t = common.time_interleaved(
        {"forward": forward, "calibrate_k": cal_k, "calibrate_1": cal_1}, runs=runs, warmup=2
    )
    k = a.batches
    f, ck, c1 = (t[n].median_s for n in ("forward", "calibrate_k", "calibrate_1"))
    per_batch = (ck - c1) / (k - 1) / (f / k)
    end_to_end = ck / f
    rows = [
        {"what": "forward", "k_batches_ms": 1e3 * f, "per_batch_ms": 1e3 * f / k, "x_forward": 1.0},
        {"what": "calibrate (per batch)", "k_batches_ms": 1e3 * ck,
         "per_batch_ms": 1e3 * (ck - c1) / (k - 1), "x_forward": per_batch, "bound": BOUND,
         "ok": bool(per_batch <= BOUND)},
        {"what": "calibrate (end to end)", "k_batches_ms": 1e3 * ck, "per_batch_ms": 1e3 * ck / k,
         "x_forward": end_to_end},
    ]
    n_sites = len(ptq.calibrate(model, RULES, batches[:1]).amax)
    print(f"GPT d_model {cfg.d_model}, {cfg.layers} layers, batch {shape['batch']} x "
          f"{cfg.seq_len} tokens, {n_sites} sites, method {a.method!r}, k = {k} batches, "
          f"{runs} rounds, backend {jax.default_backend()}")
    cols = [("what", ""), ("k_batches_ms", "k batches ms", "{:.1f}"),
            ("per_batch_ms", "per batch ms", "{:.1f}"), ("x_forward", "x forward", "{:.2f}x"),
            ("bound", "bound", "{:.2f}x"), ("ok", "ok")]
    print(common.format_table(rows, cols))
    payload = {
        "config": {**shape, "method": a.method, "batches": k, "runs": runs, "sites": n_sites},
        "environment": common.environment(),
        "timings": {n: v.to_json() for n, v in t.items()},
        "rows": rows,
    }
    out = a.out or str(common.RESULTS_DIR / ("bench_calibrate_quick.json" if a.quick
                                              else "bench_calibrate.json"))
    common.write_json(out, payload)
    return payload


if __name__ == "__main__":
    main()
