"""experiments/model.py: parameter counts, shapes and dtypes, causality, RoPE against rotation
matrices, MoE routing against an explicit loop (capacity, priority, dropped tokens), the
load-balancing loss, module paths for lowbit rules, training steps with and without lowbit,
config validation, bfloat16 compute."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lowbit.flax as lbf
from experiments.model import (
    GPT,
    GPTConfig,
    MoE,
    loss_fn,
    moe_capacity,
    n_params,
    rope,
    route,
)

B, T = 2, 32  # T = 32: quartet's wgrad Hadamard (32) runs along the token axis
TINY = dict(d_model=64, layers=1, heads=2, seq_len=T)
RULES = [(r"embed|pos_embed|head|.*/router", "none"), (r".*", "mxfp4")]


def _tokens(seed: int = 0, shape=(B, T)) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, 256, dtype=jnp.int32)


def _count(model: nnx.Module) -> int:
    return sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


# --------------------------------------------------------------------------------------------
# Structure


@pytest.mark.parametrize("mlp", ["dense", "moe"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_n_params_matches_model(mlp, tie, positions):
    cfg = GPTConfig(
        d_model=32,
        layers=2,
        heads=2,
        seq_len=24,
        mlp=mlp,
        tie_embeddings=tie,
        positions=positions,
        experts=3,
        top_k=1,
        mlp_ratio=3,
    )
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    assert n_params(cfg) == _count(model)


def test_module_paths():
    for mlp in ("dense", "moe"):
        for positions, tie in (("rope", False), ("learned", True)):
            cfg = GPTConfig(
                **{**TINY, "layers": 2}, mlp=mlp, positions=positions, tie_embeddings=tie
            )
            model = nnx.eval_shape(lambda cfg=cfg: GPT(cfg, rngs=nnx.Rngs(0)))
            modules = {"/".join(map(str, p)): type(m).__name__ for p, m in nnx.iter_modules(model)}
            sites = {s.path: (s.module, s.shape) for s in lbf.sites(model, [(".*", "mxfp4")])}
            d, f, e = 64, 256, cfg.experts
            want = {}
            for i in range(2):
                want[f"blocks/{i}/attn/qkv"] = ("Linear", (d, 3 * d))
                want[f"blocks/{i}/attn/out"] = ("Linear", (d, d))
                if mlp == "dense":
                    want[f"blocks/{i}/mlp/up"] = ("Linear", (d, f))
                    want[f"blocks/{i}/mlp/down"] = ("Linear", (f, d))
                else:
                    want[f"blocks/{i}/moe/router"] = ("Linear", (d, e))
                    want[f"blocks/{i}/moe/up"] = ("Einsum", (e, d, f))
                    want[f"blocks/{i}/moe/down"] = ("Einsum", (e, f, d))
            if not tie:
                want["head"] = ("Linear", (d, 256))
            assert sites == want
            norms = {f"blocks/{i}/norm{j}" for i in range(2) for j in (1, 2)} | {"norm_f"}
            embeds = {"embed", "pos_embed"} if positions == "learned" else {"embed"}
            assert {p for p, n in modules.items() if n == "RMSNorm"} == norms
            assert {p for p, n in modules.items() if n == "Embed"} == embeds


# --------------------------------------------------------------------------------------------
# Forward


@pytest.fixture(scope="module")
def models() -> dict[tuple[str, str, str], GPT]:
    """Tiny models by (positions, mlp, dtype). MoE: capacity_factor = experts / top_k gives
    every assignment a slot (with drops, a token's second choice can lose its slot to a later
    token's first choice, so capacity-limited routing is not causal)."""
    out = {}
    for key in [
        ("rope", "dense", "float32"),
        ("learned", "dense", "float32"),
        ("rope", "moe", "float32"),
        ("rope", "moe", "bfloat16"),
    ]:
        positions, mlp, dtype = key
        cfg = GPTConfig(
            **{**TINY, "layers": 2, "seq_len": 40},
            positions=positions,
            mlp=mlp,
            dtype=dtype,
            capacity_factor=4.0 / 2,  # experts / top_k
        )
        out[key] = GPT(cfg, rngs=nnx.Rngs(0))
    return out


def test_init_scales(models):
    model = models["rope", "moe", "float32"]
    resid = 0.02 / math.sqrt(2 * model.cfg.layers)
    blk = model.blocks[1]
    for w, std in [
        (model.embed.embedding, 0.02),
        (model.head.kernel, 0.02),
        (blk.attn.qkv.kernel, 0.02),
        (blk.attn.out.kernel, resid),
        (blk.moe.up.kernel, 0.02),
        (blk.moe.down.kernel, resid),
        (blk.moe.router.kernel, 0.02),
        (models["learned", "dense", "float32"].pos_embed.embedding, 0.02),
        (models["learned", "dense", "float32"].blocks[0].mlp.down.kernel, resid),
    ]:
        assert w[...].dtype == jnp.float32
        # the sample std of n normal draws has relative standard error 1 / sqrt(2 n): 4 sigma
        np.testing.assert_allclose(float(jnp.std(w[...])), std, rtol=4 / math.sqrt(2 * w.size))


@pytest.mark.parametrize("mlp, dtype", [("dense", "float32"), ("moe", "bfloat16")])
def test_forward_shapes_dtypes(models, mlp, dtype):
    logits, aux = _forward(models["rope", mlp, dtype], _tokens())
    assert logits.shape == (B, T, 256) and logits.dtype == jnp.float32
    assert aux.shape == () and aux.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert (float(aux) > 0) == (mlp == "moe")


@pytest.mark.parametrize(
    "positions, mlp", [("rope", "dense"), ("learned", "dense"), ("rope", "moe")]
)
def test_causal(models, positions, mlp):
    model = models[positions, mlp, "float32"]
    a = _tokens(1)
    t = 11
    b = a.at[:, t + 1 :].set(_tokens(2)[:, t + 1 :])
    la, _ = _forward(model, a)
    lb, _ = _forward(model, b)
    np.testing.assert_allclose(la[:, : t + 1], lb[:, : t + 1], rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(la[:, t + 1 :] - lb[:, t + 1 :]))) > 1e-3


def test_learned_positions_reject_long_inputs(models):
    model = models["learned", "dense", "float32"]
    with pytest.raises(ValueError, match=r"41 tokens .* seq_len=40"):
        _forward(model, _tokens(0, (1, 41)))
    # (test_causal ran it on 32 < 40 tokens); rope has no table and takes any length
    assert _forward(models["rope", "dense", "float32"], _tokens(0, (1, 41)))[0].shape[1] == 41


def test_rope_is_rotation_by_position():
    base, k = 100.0, 8
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, k))
    pos = jnp.array([0, 1, 3, 7, 20])
    got = np.asarray(rope(x, pos, base))
    xn = np.asarray(x, np.float64)
    want = np.empty_like(xn)
    for ti, p in enumerate(np.asarray(pos)):
        for i in range(k // 2):
            th = p * base ** (-2 * i / k)
            r = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
            pair = xn[0, ti, :, [i, i + k // 2]]  # [2, heads]
            want[0, ti, :, [i, i + k // 2]] = r @ pair
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_rope_scores_depend_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 6, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 6, 1, 16))
    pos = jnp.arange(6)

    def scores(shift):
        qr, kr = rope(q, pos + shift, 1e4), rope(k, pos + shift, 1e4)
        return jnp.einsum("bthk,bshk->bhts", qr, kr)

    s0 = scores(0)
    np.testing.assert_allclose(scores(37), s0, atol=1e-3)
    np.testing.assert_allclose(scores(1000), s0, atol=1e-3)
    # and it is not the unrotated product
    assert float(jnp.max(jnp.abs(s0 - jnp.einsum("bthk,bshk->bhts", q, k)))) > 0.1


def test_bfloat16_compute_close_to_float32(models):
    f32, bf16 = models["rope", "moe", "float32"], models["rope", "moe", "bfloat16"]
    tokens = _tokens(3)
    l32, a32 = _forward(f32, tokens)
    l16, a16 = _forward(bf16, tokens)
    assert l16.dtype == jnp.float32
    err = float(jnp.max(jnp.abs(l16 - l32)))
    scale = float(jnp.max(jnp.abs(l32)))
    # bfloat16 keeps 8 significant bits (relative 2^-9 per rounding); a few roundings deep
    assert 0 < err < 0.03 * scale, (err, scale)
    np.testing.assert_allclose(a16, a32, rtol=1e-2)


# --------------------------------------------------------------------------------------------
# Mixture of experts


def _experts_ref(moe: MoE, x_ND: np.ndarray) -> np.ndarray:
    """Every expert's MLP on every token: [E, N, D] (float32, highest precision)."""
    hi = jax.lax.Precision.HIGHEST
    up, down = moe.up.kernel[...], moe.down.kernel[...]
    h = jax.nn.gelu(jnp.einsum("nd,edf->enf", x_ND, up, precision=hi))
    return np.asarray(jnp.einsum("enf,efd->end", h, down, precision=hi))


def _router_probs(moe: MoE, x_ND) -> np.ndarray:
    logits = jnp.dot(x_ND, moe.router.kernel[...], precision=jax.lax.Precision.HIGHEST)
    return np.asarray(jax.nn.softmax(logits, axis=-1))


def test_moe_equals_weighted_experts_without_drops():
    cfg = GPTConfig(**TINY, mlp="moe", experts=3, top_k=3, capacity_factor=3.0)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, 64))
    y, aux, dropped = nnx.jit(lambda m, x: m(x))(moe, x)
    assert float(dropped) == 0
    for b in range(B):
        probs = _router_probs(moe, x[b])  # [T, E]: all experts chosen, gates = probs
        want = np.einsum("te,etd->td", probs, _experts_ref(moe, x[b]))
        np.testing.assert_allclose(y[b], want, rtol=1e-4, atol=1e-6)


def test_moe_capacity_priority_and_drops():
    """Against an explicit loop: first choices (token order), then second choices; an
    assignment past the capacity is dropped; a token with every choice dropped gets 0."""
    cfg = GPTConfig(**{**TINY, "seq_len": 64}, mlp="moe", experts=4, top_k=2, capacity_factor=0.5)
    t, e, k = 64, 4, 2
    c = moe_capacity(cfg, t)
    assert c == 32  # ceil(0.5 * 64 * 2 / 4) = 16, rounded up to 32
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    # a skewed router, so some experts overflow
    moe.router.kernel[...] = moe.router.kernel[...] * 100 + jnp.array([[2.0, 1.0, 0.0, 0.0]])
    x = jax.random.normal(jax.random.key(2), (B, t, 64)) + 0.5
    y, _, dropped = nnx.jit(lambda m, x: m(x))(moe, x)
    n_dropped, n_zero, n_partial = 0, 0, 0
    for b in range(B):
        probs = _router_probs(moe, x[b])
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        gates = np.take_along_axis(probs, idx, -1)
        gates = gates / gates.sum(-1, keepdims=True)
        fill = np.zeros(e, int)
        kept = np.zeros((t, k), bool)
        for j in range(k):
            for i in range(t):
                if fill[idx[i, j]] < c:
                    kept[i, j] = True
                    fill[idx[i, j]] += 1
        h = _experts_ref(moe, x[b])  # [E, T, D]
        want = np.zeros((t, 64), np.float32)
        for i in range(t):
            for j in range(k):
                if kept[i, j]:
                    want[i] += gates[i, j] * h[idx[i, j], i]
        np.testing.assert_allclose(y[b], want, rtol=1e-4, atol=1e-6)
        none_kept = ~kept.any(-1)
        assert np.all(np.asarray(y[b])[none_kept] == 0)
        n_dropped += (~kept).sum()
        n_zero += none_kept.sum()
        n_partial += (kept.any(-1) & ~kept.all(-1)).sum()
    assert n_zero > 0 and n_partial > 0  # the case is not trivial
    np.testing.assert_allclose(float(dropped), n_dropped / (B * t * k), rtol=1e-6)


def test_load_balancing_loss(models):
    e = 4
    aux = jax.jit(lambda logits, k: route(logits, k, 32)[2], static_argnums=1)
    uniform = jnp.zeros((2, 8, e))
    collapsed = jnp.tile(jnp.array([30.0, 0, 0, 0]), (2, 8, 1))
    half = jnp.tile(jnp.array([[30.0, 0, 0, 0], [0, 30.0, 0, 0]]), (2, 4, 1))  # 2 experts used
    assert float(aux(uniform, 2)) == pytest.approx(1.0)
    assert float(aux(collapsed, 1)) == pytest.approx(e, rel=1e-6)
    assert float(aux(half, 1)) == pytest.approx(e / 2, rel=1e-6)
    # only first choices count: every first choice on expert 0, second choices on expert 1
    first0 = jnp.tile(jnp.array([30.0, 20.0, 0, 0]), (2, 8, 1))
    assert float(aux(first0, 2)) == pytest.approx(e, rel=1e-4)
    # in the model: a zero router is uniform, so aux = weight * layers
    model = nnx.clone(models["rope", "moe", "float32"])
    weight, layers = model.cfg.moe_aux_weight, model.cfg.layers
    random_router = float(_forward(model, _tokens())[1])
    assert random_router != pytest.approx(weight * layers, rel=1e-3)  # not exactly balanced
    for blk in model.blocks:
        blk.moe.router.kernel[...] = jnp.zeros_like(blk.moe.router.kernel[...])
    assert float(_forward(model, _tokens())[1]) == pytest.approx(weight * layers, rel=1e-6)


def test_capacity_rounding():
    moe = GPTConfig(mlp="moe", experts=4, top_k=2, capacity_factor=1.25)
    assert moe_capacity(moe, 128) == 96  # ceil(80) -> 96
    assert moe_capacity(moe, 512) == 320
    assert moe_capacity(GPTConfig(mlp="moe", capacity_factor=100.0), 40) == 64  # <= T -> 64
    assert moe_capacity(GPTConfig(mlp="moe", capacity_multiple=64), 128) == 128


# --------------------------------------------------------------------------------------------
# Training, with and without lowbit


@nnx.jit
def _train_step(model, opt, batch):
    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    opt.update(model, grads)
    return loss, metrics


# The dense GPT under mxfp4 trains in tests/test_train.py (the experiment loop around this same
# model): here it runs with make test-slow.
@pytest.mark.parametrize(
    "mlp, recipe",
    [
        ("dense", "none"),
        pytest.param("dense", "mxfp4", marks=pytest.mark.slow),
        ("moe", "none"),
        ("moe", "mxfp4"),
    ],
)
def test_training_lowers_loss(mlp, recipe):
    model = GPT(GPTConfig(**TINY, mlp=mlp), rngs=nnx.Rngs(0))
    model = lbf.quantize(model, [(RULES[0][0], "none"), (".*", recipe)], rngs=nnx.Rngs(quant=0))
    if recipe != "none":
        assert isinstance(model.blocks[0].attn.qkv.dot_general, lbf.nnx.DotGeneral)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    tokens = _tokens(5, (B, T + 1))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    losses = []
    for _ in range(8):
        loss, metrics = _train_step(model, opt, batch)
        losses.append(float(metrics["loss"]))
        assert math.isfinite(float(loss))
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.slow  # about 12 s each on 2 CPU cores (compiling quantized backward passes)
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "quartet"])
def test_lowbit_recipes_give_gradients(recipe):
    cfg = GPTConfig(**TINY, mlp="moe", dtype="bfloat16")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    qmodel = lbf.quantize(model, [RULES[0], (".*", recipe)], rngs=nnx.Rngs(quant=1))
    tokens = _tokens(6)
    batch = {"inputs": tokens, "targets": tokens}
    grad = nnx.jit(lambda m, b: nnx.grad(lambda m: loss_fn(m, b)[0])(m))
    g, gq = grad(model, batch), grad(qmodel, batch)
    g, gq = nnx.state(g, nnx.Param), nnx.state(gq, nnx.Param)
    for path in (("moe", "up"), ("attn", "qkv")):
        a = g["blocks"][0][path[0]][path[1]]["kernel"][...]
        aq = gq["blocks"][0][path[0]][path[1]]["kernel"][...]
        cos = float(jnp.vdot(a, aq) / (jnp.linalg.norm(a) * jnp.linalg.norm(aq)))
        assert 0.5 < cos < 1.0, (path, cos)  # quantized, yet pointing the same way


# --------------------------------------------------------------------------------------------
# Config validation


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("d_model", dict(d_model=100, heads=3)),
        ("positions", dict(positions="alibi")),
        ("mlp", dict(mlp="glu")),
        ("dtype", dict(dtype="float16")),
        ("top_k", dict(top_k=5, experts=4)),
        ("top_k", dict(top_k=0)),
        ("positions='rope' needs an even head dim", dict(d_model=24, heads=8)),
        ("capacity_factor", dict(capacity_factor=0.0)),
        ("moe_aux_weight", dict(moe_aux_weight=-1.0)),
        ("layers", dict(layers=0)),
        ("vocab", dict(vocab=2.5)),
        ("rope_base", dict(rope_base=0.0)),
        ("capacity_multiple", dict(capacity_multiple=0)),
    ],
)
def test_bad_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_odd_head_dim_is_fine_with_learned_positions():
    GPTConfig(d_model=24, heads=8, positions="learned")
