"""Speed of one training step per recipe, against the unquantized step, for two models.

    .venv/bin/python benchmarks/bench_step.py                    # the GPT, 10 rounds
    .venv/bin/python benchmarks/bench_step.py --model mlp        # the GEMM-dominated MLP stack
    .venv/bin/python benchmarks/bench_step.py --quick            # tiny smoke run (either model)
    .venv/bin/python benchmarks/bench_step.py --recipes none,mxfp4,nvfp4 --runs 20 \
        --implementation xla

``--model gpt`` (default): a decoder-only transformer in Flax Linen: byte-level vocabulary
(256), learned positions, ``layers`` pre-LayerNorm blocks of causal multi-head attention and a
4x GELU MLP, a final LayerNorm and an LM head. Every linear layer inside the blocks (qkv,
attention output, MLP in and out) multiplies through ``lowbit.dot_general(x, w, dims,
recipe=..., key=...)``; the embeddings, the LM head and the attention score / value einsums stay
in float32. One step is ``value_and_grad`` of the next-token cross-entropy and one optax AdamW
update. Full size: d_model 256, 4 layers, 4 heads, batch 16, sequence 256. ``--quick``: d_model
64, 1 layer, batch 2, sequence 64.

``--model mlp``: the GEMM-dominated stack, where the quantized GEMMs are nearly the whole step:
4 residual blocks ``x + W2 gelu(W1 x)`` on ``x [4096, 256]`` (4096 tokens, d 256, FFN 1024:
``W1 [256, 1024]``, ``W2 [1024, 256]``), every ``W`` through ``lowbit.dot_general``, one SGD
step of the mean square of the output. ``--quick``: 2 blocks, d 64, FFN 256, 256 tokens.

Both: float32 (the ``none`` recipe is the model's own dtype); the key of the quantizers is new
every step (folded from the step counter) and per layer (folded with the block and the linear's
index); the step is one ``jax.jit`` with the train state donated. ``--implementation``
(``xla`` | ``pallas``; omitted: None, the best for the backend) is ``lowbit.dot_general``'s
``implementation=`` for every quantized GEMM.

Every recipe starts from the same initial parameters and batch, and all are timed in one
process, interleaved round-robin (``common.py``): the table gives each median step time over
the ``none`` recipe's. Bounds the project holds itself to (:func:`bound`), GPT: QAT recipes
(``qat_*``) <= 1.15x, FQT ``mxfp4`` and ``nvfp4`` <= 1.6x, ``quartet`` <= 1.8x; MLP stack: MX
recipes (``mxfp8``, ``mxfp6``, ``mxfp4``) and ``qat_*`` <= 1.15x, ``nvfp4`` and ``mxfp4_bwd``
<= 1.4x, ``quartet`` <= 1.5x, ``four_over_six`` <= 1.3x, ``quartet2`` and ``tetrajet2`` <=
1.5x; the others are reported only. Each row also says whether the loss
of every step and the parameters after the last one are finite.

Results go to ``--out`` (default ``benchmarks/results/bench_step.json``, or
``bench_step_mlp.json`` for the MLP stack).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowbit as lb
from lowbit.gemm.implementation import validate

try:  # imported as benchmarks.bench_step (tests, python -m)
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import common

BASELINE = "none"
DEFAULT_RECIPES = (
    "none",
    "qat_mxfp8",
    "qat_mxfp4",
    "qat_nvfp4",
    "fp8",
    "mxfp8",
    "mxfp6",
    "mxfp4",
    "nvfp4",
    "quartet",
    "mxfp4_bwd",
)
MODELS = ("gpt", "mlp")
DEFAULT_OUT = {
    "gpt": common.RESULTS_DIR / "bench_step.json",
    "mlp": common.RESULTS_DIR / "bench_step_mlp.json",
}
QUICK_RUNS = 2
VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the benchmarked transformer and of its batch."""

    d_model: int = 256
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    batch: int = 16
    seq: int = 256
    vocab: int = VOCAB


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Shape of the MLP stack: ``blocks`` residual blocks ``x + W2 gelu(W1 x)`` on
    ``x [tokens, d_model]``, ``W1 [d_model, d_ff]``, ``W2 [d_ff, d_model]``."""

    d_model: int = 256
    d_ff: int = 1024
    blocks: int = 4
    tokens: int = 4096


FULL = ModelConfig()
QUICK = ModelConfig(d_model=64, layers=1, batch=2, seq=64)
MLP_FULL = MLPConfig()
MLP_QUICK = MLPConfig(d_model=64, d_ff=256, blocks=2, tokens=256)
MLP_LR = 0.05  # SGD: the mean square of the output falls steadily (0.2 diverges at full size)

_MX = ("mxfp8", "mxfp6", "mxfp4")


def bound(recipe: str, model: str = "gpt") -> float | None:
    """The most a recipe's step may cost, in multiples of the ``none`` step (None: no bound)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if recipe.startswith("qat_"):
        return 1.15
    if model == "mlp":
        return {
            "nvfp4": 1.4,
            "quartet": 1.5,
            "mxfp4_bwd": 1.4,
            # issue 25's bounds for the 2026 recipes
            "four_over_six": 1.3,
            "quartet2": 1.5,
            "tetrajet2": 1.5,
            **dict.fromkeys(_MX, 1.15),
        }.get(recipe)
    if recipe in ("mxfp4", "nvfp4"):
        return 1.6
    if recipe == "quartet":
        return 1.8
    return None


# --------------------------------------------------------------------------------------------
# The GPT


class QDense(nn.Module):
    """A bias-free linear layer whose matmul is ``lowbit.dot_general`` under ``recipe``."""

    features: int
    recipe: str
    implementation: str | None = None

    @nn.compact
    def __call__(self, x_BTD: jax.Array, key: jax.Array) -> jax.Array:
        w_DF = self.param(
            "kernel", nn.initializers.lecun_normal(), (x_BTD.shape[-1], self.features)
        )
        dims = (((x_BTD.ndim - 1,), (0,)), ((), ()))
        return lb.dot_general(
            x_BTD, w_DF, dims, recipe=self.recipe, key=key, implementation=self.implementation
        )


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    cfg: ModelConfig
    recipe: str
    implementation: str | None = None

    @nn.compact
    def __call__(self, x_BTD: jax.Array, key: jax.Array) -> jax.Array:
        cfg = self.cfg
        B, T, D = x_BTD.shape
        H = cfg.heads
        K = D // H
        keys = [jax.random.fold_in(key, i) for i in range(4)]  # one per linear layer
        dense = functools.partial(QDense, recipe=self.recipe, implementation=self.implementation)

        h_BTD = nn.LayerNorm(name="ln_attn")(x_BTD)
        qkv_BT3D = dense(3 * D, name="qkv")(h_BTD, keys[0])
        q_BTHK, k_BTHK, v_BTHK = (a.reshape(B, T, H, K) for a in jnp.split(qkv_BT3D, 3, axis=-1))
        s_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BTHK) / np.float32(math.sqrt(K))
        causal_11TS = jnp.tril(jnp.ones((T, T), dtype=bool))[None, None]
        s_BHTS = jnp.where(causal_11TS, s_BHTS, np.float32(-1e30))
        p_BHTS = jax.nn.softmax(s_BHTS, axis=-1)
        o_BTD = jnp.einsum("bhts,bshk->bthk", p_BHTS, v_BTHK).reshape(B, T, D)
        x_BTD = x_BTD + dense(D, name="attn_out")(o_BTD, keys[1])

        h_BTD = nn.LayerNorm(name="ln_mlp")(x_BTD)
        h_BTF = dense(cfg.mlp_ratio * D, name="mlp_in")(h_BTD, keys[2])
        h_BTF = nn.gelu(h_BTF)
        return x_BTD + dense(D, name="mlp_out")(h_BTF, keys[3])


class GPT(nn.Module):
    """Decoder-only byte-level transformer; returns logits ``[B, T, vocab]``."""

    cfg: ModelConfig
    recipe: str
    implementation: str | None = None

    @nn.compact
    def __call__(self, tokens_BT: jax.Array, key: jax.Array) -> jax.Array:
        cfg = self.cfg
        T = tokens_BT.shape[1]
        x_BTD = nn.Embed(cfg.vocab, cfg.d_model, name="embed")(tokens_BT)
        pos_TD = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.seq, cfg.d_model))
        x_BTD = x_BTD + pos_TD[None, :T]
        for layer in range(cfg.layers):
            x_BTD = Block(cfg, self.recipe, self.implementation, name=f"block_{layer}")(
                x_BTD, jax.random.fold_in(key, layer)
            )
        x_BTD = nn.LayerNorm(name="ln_final")(x_BTD)
        return nn.Dense(cfg.vocab, use_bias=False, name="lm_head")(x_BTD)


def gpt_loss(cfg: ModelConfig, recipe: str, implementation: str | None = None):
    """``loss(params, tokens_BT1, key)``: the next-token cross-entropy of :class:`GPT`."""
    model = GPT(cfg, recipe, implementation)

    def loss_fn(params, tokens_BT1, key):
        logits_BTV = model.apply({"params": params}, tokens_BT1[:, :-1], key)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT1[:, 1:]).mean()

    return loss_fn


def gpt_params(cfg: ModelConfig, seed: int = 0):
    """Initial parameters (the same for every recipe: they do not depend on it)."""
    tokens_BT = jnp.zeros((1, cfg.seq), jnp.int32)
    params = GPT(cfg, BASELINE).init(jax.random.key(seed), tokens_BT, jax.random.key(0))
    return params["params"]


def make_batch(cfg: ModelConfig, seed: int = 1) -> jax.Array:
    """Random bytes ``[batch, seq + 1]``: timing does not depend on the text."""
    return jax.random.randint(jax.random.key(seed), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)


# --------------------------------------------------------------------------------------------
# The MLP stack


def mlp_params(cfg: MLPConfig, seed: int = 0) -> list[dict[str, jax.Array]]:
    """``[{"w1": [d, f], "w2": [f, d]}] * blocks``, LeCun-normal (the same for every recipe)."""
    params = []
    for i in range(cfg.blocks):
        k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(seed), i))
        d, f = cfg.d_model, cfg.d_ff
        w1_DF = jax.random.normal(k1, (d, f)) / np.float32(math.sqrt(d))
        w2_FD = jax.random.normal(k2, (f, d)) / np.float32(math.sqrt(f))
        params.append({"w1": w1_DF, "w2": w2_FD})
    return params


def mlp_loss(recipe: str, implementation: str | None = None):
    """``loss(params, x_MD, key)``: the mean square of ``x`` after the residual blocks
    ``x + W2 gelu(W1 x)``, every ``W`` through ``lowbit.dot_general`` with its own key."""
    dims = (((1,), (0,)), ((), ()))
    dot = functools.partial(lb.dot_general, recipe=recipe, implementation=implementation)

    def loss_fn(params, x_MD, key):
        for i, p in enumerate(params):
            h_MF = dot(x_MD, p["w1"], dims, key=jax.random.fold_in(key, 2 * i))
            y_MD = dot(jax.nn.gelu(h_MF), p["w2"], dims, key=jax.random.fold_in(key, 2 * i + 1))
            x_MD = x_MD + y_MD
        return jnp.mean(jnp.square(x_MD))

    return loss_fn


def make_mlp_input(cfg: MLPConfig, seed: int = 1) -> jax.Array:
    """Standard-normal activations ``[tokens, d_model]``."""
    return jax.random.normal(jax.random.key(seed), (cfg.tokens, cfg.d_model))


# --------------------------------------------------------------------------------------------
# The training step


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array


def make_train_step(
    loss_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    tx: optax.GradientTransformation,
    seed: int = 0,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, jax.Array]]:
    """``step(state, batch) -> (state, loss)``: one optimizer step of ``loss_fn(params, batch,
    key)``, jitted, state donated. The key is ``fold_in(key(seed), state.step)``: new every
    step."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, jax.Array]:
        key = jax.random.fold_in(jax.random.key(seed), state.step)
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, key)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), loss

    return step


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int = 0) -> TrainState:
    """The GPT's initial train state (the same for every recipe)."""
    params = gpt_params(cfg, seed)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one benchmark run trains: a model's shape, optimizer, loss per recipe, batch."""

    model: str
    cfg: ModelConfig | MLPConfig
    optimizer: str
    tx: optax.GradientTransformation
    loss: Callable[[str, str | None], Callable]  # (recipe, implementation) -> loss_fn
    params: Callable[[], Any]
    batch: Callable[[], jax.Array]

    def describe(self) -> str:
        c = self.cfg
        if self.model == "mlp":
            return (
                f"MLP stack {c.blocks} x (x + W2 gelu(W1 x)), d {c.d_model}, FFN {c.d_ff}, "
                f"{c.tokens} tokens"
            )
        return f"GPT d_model {c.d_model} x {c.layers} layer(s), batch {c.batch} x seq {c.seq}"


def workload(model: str, quick: bool = False) -> Workload:
    """The GPT (AdamW) or the MLP stack (SGD), full size or ``quick``."""
    if model == "gpt":
        cfg = QUICK if quick else FULL
        return Workload(
            "gpt",
            cfg,
            "adamw(1e-3, weight_decay=0.1)",
            optax.adamw(1e-3, weight_decay=0.1),
            lambda recipe, impl: gpt_loss(cfg, recipe, impl),
            lambda: gpt_params(cfg),
            lambda: make_batch(cfg),
        )
    if model == "mlp":
        cfg = MLP_QUICK if quick else MLP_FULL
        return Workload(
            "mlp",
            cfg,
            f"sgd({MLP_LR})",
            optax.sgd(MLP_LR),
            mlp_loss,
            lambda: mlp_params(cfg),
            lambda: make_mlp_input(cfg),
        )
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def count_params(params) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def _copy(tree):
    """Fresh buffers of ``tree`` (each recipe's step donates its own)."""
    return jax.tree.map(jnp.copy, tree)


def _all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(tree))


def _kind(recipe: lb.recipes.Recipe) -> str:
    if recipe.is_identity:
        return "baseline"
    return "FQT" if recipe.is_fqt else "QAT"


# --------------------------------------------------------------------------------------------
# The benchmark


def _implementation(value: str) -> str | None:
    v = value.strip()
    if v.lower() in ("", "none", "default"):
        return None
    try:
        return validate(v, "--implementation")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        choices=MODELS,
        default="gpt",
        help="gpt: the transformer (default); mlp: the GEMM-dominated MLP stack",
    )
    p.add_argument(
        "--recipes",
        default=None,
        help="comma-separated recipe names (default: " + ",".join(DEFAULT_RECIPES) + "); "
        f"{BASELINE!r} is always added as the baseline",
    )
    p.add_argument(
        "--implementation",
        type=_implementation,
        default=None,
        help="lowbit.dot_general's implementation= for every quantized GEMM: xla | pallas "
        "(default: None, the best for the backend)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=None,
        help=f"timed rounds per recipe (default 10; {QUICK_RUNS} with --quick)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps per recipe after the compiling one (default 1, at least 1)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run, {QUICK_RUNS} rounds: GPT d_model {QUICK.d_model}, {QUICK.layers} "
        f"layer, batch {QUICK.batch}, sequence {QUICK.seq}; MLP {MLP_QUICK.blocks} blocks, d "
        f"{MLP_QUICK.d_model}, FFN {MLP_QUICK.d_ff}, {MLP_QUICK.tokens} tokens",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON results file (default: benchmarks/results/bench_step.json, "
        "bench_step_mlp.json for --model mlp)",
    )
    args = p.parse_args(argv)
    if args.runs is None:
        args.runs = QUICK_RUNS if args.quick else 10
    args.warmup = args.warmup if args.warmup is not None else 1
    if args.runs < 1 or args.warmup < 1:
        p.error(f"--runs and --warmup must be positive, got {args.runs} and {args.warmup}")
    names = DEFAULT_RECIPES if args.recipes is None else args.recipes.split(",")
    try:
        names = [lb.recipes.get(n.strip()).name for n in names if n.strip()]
    except ValueError as e:
        p.error(str(e))
    # The baseline first, then the rest in the order given, duplicates dropped.
    args.recipes = list(dict.fromkeys([BASELINE, *names]))
    args.workload = workload(args.model, args.quick)
    args.cfg = args.workload.cfg
    if args.out is None:
        args.out = DEFAULT_OUT[args.model]
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; returns what was written."""
    args = parse_args(argv)
    wl: Workload = args.workload
    params0 = wl.params()
    state0 = TrainState(params0, wl.tx.init(params0), jnp.zeros((), jnp.int32))
    batch = wl.batch()
    jax.block_until_ready((state0, batch))
    n_params = count_params(state0.params)
    print(
        f"bench_step: {wl.describe()}, {n_params / 1e6:.2f} M parameters; implementation "
        f"{args.implementation}; {len(args.recipes)} recipes, {args.runs} rounds interleaved",
        file=sys.stderr,
    )

    env = common.environment()
    # Each recipe: its own copy of the state (donated every step), a first step that compiles.
    states: dict[str, TrainState] = {}
    # Every step's loss stays on the device until timing is over (no host syncs in between).
    losses: dict[str, list[jax.Array]] = {}
    compile_s: dict[str, float] = {}
    # CPU time of this process per step (all its threads): what the step itself costs, less
    # sensitive than wall time to other processes on a shared machine.
    cpu_s: dict[str, list[float]] = {name: [] for name in args.recipes}
    candidates: dict[str, Callable[[], Any]] = {}
    for name in args.recipes:
        step = make_train_step(wl.loss(name, args.implementation), wl.tx)
        states[name] = _copy(state0)
        t0 = time.perf_counter()
        states[name], loss = step(states[name], batch)
        losses[name] = [loss]
        compile_s[name] = time.perf_counter() - t0
        print(
            f"  {name}: first step {compile_s[name]:.1f} s, loss {float(loss):.4f}", file=sys.stderr
        )

        def run(name=name, step=step):
            c0 = time.process_time()
            states[name], loss = step(states[name], batch)
            jax.block_until_ready((states[name], loss))
            cpu_s[name].append(time.process_time() - c0)
            losses[name].append(loss)
            return states[name], loss

        candidates[name] = run

    timings = common.time_interleaved(candidates, runs=args.runs, warmup=args.warmup)
    env["loadavg_after"] = common.environment()["loadavg"]
    t_base = timings[BASELINE]
    rows = _rows(args, timings, losses, states, compile_s, cpu_s)

    _print_table(rows, t_base, args, env)
    checked = [r["within_bound"] for r in rows if r["within_bound"] is not None]
    payload = {
        "benchmark": "bench_step",
        "config": {
            "model": args.model,
            **dataclasses.asdict(wl.cfg),
            "params": n_params,
            "dtype": "float32",
            "optimizer": wl.optimizer,
            "implementation": args.implementation,
            "runs": args.runs,
            "warmup": args.warmup,
            "quick": args.quick,
            "recipes": args.recipes,
        },
        "environment": env,
        "baseline": {"recipe": BASELINE, **t_base.to_json()},
        "rows": rows,
        "all_within_bound": all(checked) if checked else None,
        "all_finite": all(r["loss_finite"] and r["params_finite"] for r in rows),
    }
    path = common.write_json(args.out, payload)
    print(f"wrote {path}", file=sys.stderr)
    return payload


def _rows(args, timings, losses, states, compile_s, cpu_s) -> list[dict[str, Any]]:
    """One result row per recipe: its timings against the baseline's, its losses, finiteness."""
    t_base = timings[BASELINE]
    cpu_median = {name: statistics.median(cpu_s[name][-args.runs :]) for name in args.recipes}

    rows = []
    for name in args.recipes:
        t = timings[name]
        recipe = lb.recipes.get(name)
        step_losses = [float(v) for v in losses[name]]
        loss_finite = all(math.isfinite(v) for v in step_losses)
        params_finite = _all_finite(states[name].params)
        ratio = t.median_s / t_base.median_s
        limit = bound(name, args.model)
        rows.append(
            {
                "recipe": name,
                "kind": _kind(recipe),
                "ms": t.median_ms,
                "x_none": ratio,
                # Fastest over fastest: a cross-check on a loaded machine, not the verdict.
                "x_none_min": min(t.samples_s) / min(t_base.samples_s),
                "cpu_ms": 1e3 * cpu_median[name],
                # Process CPU time over the baseline's: a cross-check on a loaded machine.
                "cpu_x_none": cpu_median[name] / cpu_median[BASELINE],
                "bound": limit,
                "within_bound": None if limit is None else ratio <= limit,
                "loss_first": step_losses[0],
                "loss_last": step_losses[-1],
                "loss_finite": loss_finite,
                "params_finite": params_finite,
                "steps": len(step_losses),
                "first_step_s": compile_s[name],
                "spread": t.spread,
                "samples_ms": [1e3 * s for s in t.samples_s],
            }
        )
    return rows


def _print_table(rows: list[dict[str, Any]], t_base: common.Timing, args, env) -> None:
    def verdict(r):
        if r["within_bound"] is None:
            return "-"
        return "pass" if r["within_bound"] else "FAIL"

    shown = [
        {
            **r,
            "spread": None if r["spread"] is None else 100 * r["spread"],
            "pass": verdict(r),
            "finite": "yes" if r["loss_finite"] and r["params_finite"] else "NO",
        }
        for r in rows
    ]
    columns = [
        ("recipe", "recipe"),
        ("kind", "kind"),
        ("ms", "ms", "{:.0f}"),
        ("spread", "iqr", "{:.0f}%"),
        ("x_none", "x none", "{:.2f}x"),
        ("x_none_min", "(of mins)", "{:.2f}x"),
        ("cpu_x_none", "cpu x none", "{:.2f}x"),
        ("bound", "bound", "<={:.2f}x"),
        ("pass", "pass"),
        ("loss_last", "loss", "{:.4f}"),
        ("finite", "finite"),
    ]
    wl: Workload = args.workload
    load = env.get("loadavg")
    load_after = env.get("loadavg_after")
    fmt_load = lambda la: "n/a" if la is None else " ".join(f"{v:.2f}" for v in la)
    opt = "SGD" if wl.model == "mlp" else "AdamW"
    print(
        f"train step ({opt}), {wl.describe()}, float32 on {env['backend']} "
        f"({env['cpu_count']} CPUs), implementation {args.implementation}: median of "
        f"{args.runs} interleaved rounds; none = {t_base.median_ms:.1f} ms"
        + ("" if t_base.spread is None else f" (iqr {100 * t_base.spread:.0f}%)")
    )
    print(f"load average (1/5/15 min) before {fmt_load(load)}, after {fmt_load(load_after)}")
    print(common.format_table(shown, columns))


if __name__ == "__main__":
    main()
