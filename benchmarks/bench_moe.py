"""The dropless MoE (``lb.ragged_dot``) against the capacity MoE: step time and peak memory.

    .venv/bin/python benchmarks/bench_moe.py                  # xs MoE GPT, E=8, 10 rounds
    .venv/bin/python benchmarks/bench_moe.py --quick          # tiny smoke run
    .venv/bin/python benchmarks/bench_moe.py --recipes none,nvfp4,mxfp8 --runs 20

Workload: the ``xs`` GPT of ``configs/gpt.py`` (d_model 128, 3 layers, 4 heads, sequence 128,
batch 16) with a mixture of ``--experts`` (default 8) GELU experts, top-2, capacity factor
1.25, every block's MLP the MoE. One step is ``nnx.value_and_grad`` of
``experiments.model.loss_fn`` and one AdamW update, jitted; the quantized models are
``lowbit.flax.quantize(model, [(embeddings, head and router: "none"), (".*", recipe)])``, so
both expert projections (``moe/up``, ``moe/down``) and the attention projections run the
recipe. Each candidate (``moe_impl`` x recipe) starts from the same parameters and batch; all
are timed in one process, interleaved round-robin (``common.py``).

Two memory figures per candidate, from XLA's compiled memory analysis (``temp`` buffers plus
arguments and outputs, not double-counting donated or aliased ones): the whole train step,
and ``moe`` -- ``value_and_grad`` of one MoE layer on the step's ``[B, T, d]`` activations,
the part the two paths do differently (the capacity path's ``[B, T, E, C]`` dispatch and
combine tensors and ``[B, E, C, d]`` buffers against the dropless path's sorted
``[B*T*k + E*P, d]`` rows).

Bounds the project holds itself to (issue 27): the dropless nvfp4 step within 1.4x of the
dropless float step; the dropless MoE layer's peak memory at E=8 at most half the capacity
layer's (the float path; the table gives every recipe's).

Results go to ``--out`` (default ``benchmarks/results/bench_moe.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowbit.flax as lbf  # noqa: E402
from benchmarks import common  # noqa: E402
from experiments.model import GPT, GPTConfig, MoE, loss_fn  # noqa: E402

HIGH_PRECISION = r"embed|pos_embed|head|.*/router"
STEP_BOUND = 1.4  # dropless nvfp4 step / dropless none step
MEMORY_BOUND = 0.5  # dropless MoE layer / capacity MoE layer, float, E=8


@dataclasses.dataclass(frozen=True)
class Workload:
    cfg: GPTConfig
    batch: int


def workload(quick: bool, experts: int, seq_len: int = 128, batch: int = 16) -> Workload:
    if quick:
        cfg = GPTConfig(d_model=32, layers=1, heads=2, seq_len=32, mlp="moe", experts=experts,
                        top_k=2)
        return Workload(cfg, 2)
    cfg = GPTConfig(d_model=128, layers=3, heads=4, seq_len=seq_len, mlp="moe",
                    experts=experts, top_k=2, capacity_factor=1.25)
    return Workload(cfg, batch)


def memory_sweep(experts: int, recipes, tokens: int = 2048, seqs=(128, 256, 512, 1024, 2048)):
    """The MoE layer's compiled peak memory, dropless over capacity, at a fixed number of
    tokens per step and growing sequence length: the capacity path's [B, T, E, C] dispatch
    and combine tensors grow with T * C ~ T^2 per sequence, the dropless rows with T."""
    rows = []
    for t in seqs:
        w = workload(False, experts, seq_len=t, batch=max(1, tokens // t))
        for r in recipes:
            d, c = moe_layer_bytes(w, "dropless", r), moe_layer_bytes(w, "capacity", r)
            rows.append({"seq_len": t, "batch": w.batch, "recipe": r,
                         "dropless_MiB": d / 2**20, "capacity_MiB": c / 2**20,
                         "ratio": d / c})
    return rows


def build(w: Workload, impl: str, recipe: str):
    cfg = dataclasses.replace(w.cfg, moe_impl=impl)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    if recipe != "none":
        model = lbf.quantize(model, [(HIGH_PRECISION, "none"), (".*", recipe)],
                             rngs=nnx.Rngs(quant=0))
    return model


def _bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
               - m.alias_size_in_bytes)


def step_fn(model, tx, batch):
    """A jitted train step over the model's split state, and its compiled peak bytes."""
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))

    @jax.jit
    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    nbytes = _bytes(step.lower(state, batch).compile())
    holder = {"state": state}

    def run():
        holder["state"], loss = step(holder["state"], batch)
        return loss

    return run, nbytes


def moe_layer_bytes(w: Workload, impl: str, recipe: str) -> int:
    """Compiled peak bytes of value_and_grad of one MoE layer on [B, T, d] activations."""
    cfg = dataclasses.replace(w.cfg, moe_impl=impl)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    if recipe != "none":
        moe = lbf.quantize(moe, [(r"router", "none"), (".*", recipe)], rngs=nnx.Rngs(quant=0))
    x = jax.ShapeDtypeStruct((w.batch, cfg.seq_len, cfg.d_model), jnp.float32)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    def f(params, rest, x):
        def loss(m, x):
            y, aux, _ = m(x)
            return jnp.sum(y * y) + aux
        m = nnx.merge(graphdef, params, rest)
        return nnx.value_and_grad(loss, argnums=(0, 1))(m, x)

    return _bytes(jax.jit(f).lower(params, rest, x).compile())


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default="none,nvfp4,mxfp8")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--memory-sweep", action="store_true",
                   help="only the MoE layer's memory at sequence 128..2048, 2048 tokens")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "bench_moe.json"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    if "none" not in recipes:
        recipes.insert(0, "none")
    if args.memory_sweep:
        rows = memory_sweep(args.experts, recipes)
        print(common.format_table(rows, [
            ("seq_len", "T", "{:d}"), ("batch", "B", "{:d}"), ("recipe", "recipe"),
            ("dropless_MiB", "dropless MiB"), ("capacity_MiB", "capacity MiB"),
            ("ratio", "dropless / capacity", "{:.3f}")]))
        payload = {"config": {"experts": args.experts, "memory_sweep": True},
                   "environment": common.environment(), "rows": rows}
        common.write_json(args.out.replace(".json", "_memory.json"), payload)
        return payload
    w = workload(args.quick, args.experts)
    tokens = jax.random.randint(jax.random.key(1), (w.batch, w.cfg.seq_len + 1), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    tx = optax.adamw(1e-3)
    cands, step_bytes, layer_bytes = {}, {}, {}
    for impl in ("dropless", "capacity"):
        for r in recipes:
            name = f"{impl}/{r}"
            cands[name], step_bytes[name] = step_fn(build(w, impl, r), tx, batch)
            layer_bytes[name] = moe_layer_bytes(w, impl, r)
    runs = 2 if args.quick else args.runs
    t = common.time_interleaved(cands, runs=runs)
    base = t["dropless/none"].median_s
    rows = []
    for name, timing in t.items():
        impl, r = name.split("/")
        cap = f"capacity/{r}"
        rows.append({
            "candidate": name, "ms": timing.median_s * 1e3,
            "x_dropless_none": timing.median_s / base,
            "step_MiB": step_bytes[name] / 2**20,
            "moe_MiB": layer_bytes[name] / 2**20,
            "moe_x_capacity": layer_bytes[name] / layer_bytes[cap],
        })
    print(common.format_table(rows, [
        ("candidate", "candidate"), ("ms", "step ms"), ("x_dropless_none", "x dropless none"),
        ("step_MiB", "step MiB"), ("moe_MiB", "MoE layer MiB"),
        ("moe_x_capacity", "MoE MiB x capacity")]))
    nv = t.get("dropless/nvfp4")
    checks = {
        "nvfp4_step_over_none": None if nv is None else nv.median_s / base,
        "moe_memory_dropless_over_capacity": layer_bytes["dropless/none"]
        / layer_bytes["capacity/none"],
    }
    print(f"dropless nvfp4 / dropless none step: {checks['nvfp4_step_over_none']} "
          f"(bound {STEP_BOUND}); dropless / capacity MoE-layer memory, float: "
          f"{checks['moe_memory_dropless_over_capacity']:.3f} (bound {MEMORY_BOUND})")
    payload = {"config": {"quick": args.quick, "experts": args.experts, "runs": runs,
                          "batch": w.batch, "model": dataclasses.asdict(w.cfg)},
               "environment": common.environment(), "rows": rows, "checks": checks}
    common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
