"""lowbit.autoquant: the exact solver, every scoring method against a direct computation,
Aumann-Shapley completeness, the presets on the GPTs, plans, and the errors."""

from __future__ import annotations

import itertools
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit as lb
import lowbit.autoquant as aq
import lowbit.flax as lbf
from experiments.model import GPT, GPTConfig
from lowbit.autoquant import solver as solver_mod

# --------------------------------------------------------------------------------------------
# The solver


def brute_force(costs, damages, budget):
    best, best_cost = np.inf, np.inf
    rows, choices = costs.shape
    for pick in itertools.product(range(choices), repeat=rows):
        c = sum(costs[r, j] for r, j in enumerate(pick))
        d = sum(damages[r, j] for r, j in enumerate(pick))
        if c <= budget and (d < best or (d == best and c < best_cost)):
            best, best_cost = d, c
    return best


def _instance(rng, rows, choices, dyadic=True):
    if dyadic:  # parameters x bits: integers times multiples of 1/16, as score() gives
        params = rng.integers(1, 200, size=(rows, 1))
        bits = rng.choice([16.0, 8.25, 6.25, 4.5, 4.25, 4.03125, 2.0], size=(rows, choices))
        costs = params * bits
    else:
        costs = rng.uniform(0.1, 10.0, size=(rows, choices))
    damages = rng.normal(size=(rows, choices))
    lo, hi = costs.min(axis=1).sum(), costs.max(axis=1).sum()
    budget = rng.uniform(lo, hi)
    return costs, damages, budget


@pytest.mark.parametrize("dyadic", [True, False], ids=["grid-dp", "milp"])
def test_knapsack_equals_brute_force(dyadic):
    rng = np.random.default_rng(0 if dyadic else 1)
    for _ in range(60):
        rows, choices = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        costs, damages, budget = _instance(rng, rows, choices, dyadic)
        pick = aq.knapsack(costs, damages, budget)
        assert pick.shape == (rows,)
        got_cost = costs[np.arange(rows), pick].sum()
        assert got_cost <= budget
        np.testing.assert_allclose(
            damages[np.arange(rows), pick].sum(),
            brute_force(costs, damages, budget),
            rtol=0,
            atol=1e-12,
        )


def test_knapsack_milp_fallback_equals_dp(monkeypatch):
    rng = np.random.default_rng(2)
    cases = [_instance(rng, 6, 4) for _ in range(10)]
    dp = [aq.knapsack(*c) for c in cases]
    monkeypatch.setattr(solver_mod, "MAX_GRID", 0)  # every case through scipy's milp
    for (costs, damages, budget), p in zip(cases, dp, strict=True):
        q = aq.knapsack(costs, damages, budget)
        r = np.arange(len(p))
        np.testing.assert_allclose(damages[r, q].sum(), damages[r, p].sum(), atol=1e-12)
        assert costs[r, q].sum() <= budget


def test_knapsack_budget_at_a_combination_and_ties():
    costs = np.array([[16.0, 4.25], [16.0, 4.25]]) * 64
    # a budget equal to one combination's cost is feasible for that combination
    assert aq.knapsack(costs, [[0, 1], [0, 2]], 64 * (16 + 4.25)).tolist() == [1, 0]
    # equal damage: the cheaper choice
    assert aq.knapsack(costs, [[0, 0], [0, 0]], 1e9).tolist() == [1, 1]


def test_knapsack_errors():
    with pytest.raises(ValueError, match=r"infeasible: the smallest feasible budget is 8"):
        aq.knapsack([[16, 4], [16, 4]], [[0, 1], [0, 1]], 7)
    with pytest.raises(ValueError, match="one shape"):
        aq.knapsack([[1, 2]], [[1, 2, 3]], 5)
    with pytest.raises(ValueError, match="NaN"):
        aq.knapsack([[1, 2]], [[np.nan, 1]], 5)
    with pytest.raises(ValueError, match="non-negative"):
        aq.knapsack([[-1, 2]], [[0, 1]], 5)


# --------------------------------------------------------------------------------------------
# A small model and its hand-written twin

D_IN, D_H, D_OUT = 32, 64, 16


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D_IN, D_H, rngs=rngs)
        self.mid = nnx.Linear(D_H, D_H, rngs=rngs)
        self.down = nnx.Linear(D_H, D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.mid(jnp.tanh(self.up(x)))))


def mse(model, batch):
    x, t = batch
    return jnp.mean((model(x) - t) ** 2)


@pytest.fixture(scope="module")
def mlp():
    return MLP(nnx.Rngs(0))


@pytest.fixture(scope="module")
def batches():
    ks = jax.random.split(jax.random.key(1), 4)
    return [
        (jax.random.normal(ks[i], (32, D_IN)), jax.random.normal(ks[i + 2], (32, D_OUT)))
        for i in range(2)
    ]


def quantized_loss(model, rules, batch):
    q = lbf.quantize(model, rules)
    return float(nnx.jit(mse)(q, batch))


SITES = ("up", "mid", "down")


def test_isolated_equals_the_single_rule_model(mlp, batches):
    s = aq.score(mlp, mse, batches, ["qat_mxfp8", "qat_mxfp4"], method="isolated")
    assert s.sites == SITES and s.candidates == ("none", "qat_mxfp8", "qat_mxfp4")
    float_loss = np.mean([float(nnx.jit(mse)(mlp, b)) for b in batches])
    assert s.loss == pytest.approx(float_loss, rel=1e-12)
    for i, site in enumerate(SITES):
        assert s.damage[i, 0] == 0
        for j, rec in enumerate(s.candidates[1:], 1):
            want = np.mean([quantized_loss(mlp, [(site, rec)], b) for b in batches]) - float_loss
            # the same float32 losses (bit for bit); only the float64 averaging order differs
            np.testing.assert_allclose(s.damage[i, j], want, rtol=1e-12, atol=1e-15)
    assert (np.abs(s.damage[:, 2]) > np.abs(s.damage[:, 1])).all()  # FP4 hurts more than FP8


def _hand_forward(params, x, perturb):
    """The MLP written out; ``perturb[i](y)`` rewrites site i's GEMM output."""
    h = x
    for i, name in enumerate(SITES):
        w, b = params[name]
        y = perturb[i](h, w)
        h = y + b[None]
        if i < 2:
            h = jnp.tanh(h)
    return h


def _params(model):
    return {
        n: (getattr(model, n).kernel.get_value(), getattr(model, n).bias.get_value()) for n in SITES
    }


def _fq_gemm(h, w, fmt):
    """A W+A site quantized by hand: both operands fake-quantized along K, float32 GEMM."""
    return lb.fake_quantize(h, fmt, axis=-1) @ lb.fake_quantize(w, fmt, axis=0)


def test_gradient_equals_a_direct_computation(mlp, batches):
    s = aq.score(mlp, mse, batches, ["qat_mxfp6", "qat_mxfp4"], method="gradient")
    p = _params(mlp)
    fmts = {"qat_mxfp6": "mxfp6", "qat_mxfp4": "mxfp4"}

    @jax.jit
    def direct(x, t):
        def loss(deltas):
            ys = [lambda h, w, i=i: h @ w + deltas[i] for i in range(3)]
            return jnp.mean((_hand_forward(p, x, ys) - t) ** 2)

        hs, h = [], x  # the inputs of each site in the float model
        for i, n in enumerate(SITES):
            hs.append(h)
            h = h @ p[n][0] + p[n][1][None]
            h = jnp.tanh(h) if i < 2 else h
        g = jax.grad(loss)([jnp.zeros((x.shape[0], p[n][0].shape[1])) for n in SITES])
        return jnp.stack(
            [
                jnp.stack(
                    [
                        jnp.sum((g[i] * (_fq_gemm(hs[i], p[n][0], fmts[r]) - hs[i] @ p[n][0])) ** 2)
                        for r in ("qat_mxfp6", "qat_mxfp4")
                    ]
                )
                for i, n in enumerate(SITES)
            ]
        )

    want = sum(np.asarray(direct(x, t), np.float64) for x, t in batches)
    np.testing.assert_allclose(s.damage[:, 1:], want, rtol=2e-4)
    assert (s.damage[:, 2] > s.damage[:, 1]).all()


def test_kl_equals_a_direct_computation(mlp, batches):
    def logits(model, batch):
        return model(batch[0])

    s = aq.score(mlp, mse, batches, ["qat_mxfp4"], method="kl", output_fn=logits)
    for i, site in enumerate(SITES):
        want = []
        for b in batches:
            p = jax.nn.log_softmax(nnx.jit(logits)(mlp, b))
            q = jax.nn.log_softmax(nnx.jit(logits)(lbf.quantize(mlp, [(site, "qat_mxfp4")]), b))
            want.append(float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1))))
        np.testing.assert_allclose(s.damage[i, 1], np.mean(want), rtol=1e-3, atol=1e-9)
        assert s.damage[i, 1] > 0


def test_shapley_completeness_weight_only(mlp, batches):
    """Weight-only candidates: the path is smooth in t, so the credits add up to the loss
    change of quantizing every site, more closely as steps grows (midpoint rule)."""
    cands = ["w4a16_mxfp4", "w4a16_nvfp4"]
    full = {
        c: np.mean([quantized_loss(mlp, [(".*", c)], b) for b in batches])
        - np.mean([float(nnx.jit(mse)(mlp, b)) for b in batches])
        for c in cands
    }
    errs, damage = {}, {}
    for rule, steps in [("midpoint", 1), ("midpoint", 4), ("midpoint", 16), ("gauss", 1),
                        ("gauss", 2), ("gauss", 3)]:
        s = aq.score(mlp, mse, batches, cands, method="shapley", steps=steps, rule=rule)
        assert (s.steps, s.rule) == (steps, rule)
        damage[rule, steps] = s.damage
        errs[rule, steps] = [
            abs(s.damage[:, j].sum() - full[c]) / abs(full[c]) for j, c in enumerate(cands, 1)
        ]
    # one point: both rules take t = 1/2 with weight 1
    np.testing.assert_array_equal(damage["gauss", 1], damage["midpoint", 1])
    mid = {n: errs["midpoint", n] for n in (1, 4, 16)}
    for j in range(2):
        assert mid[16][j] < mid[4][j] < mid[1][j], errs
        assert mid[16][j] < 1e-3, errs
        # Gauss-Legendre on the smooth path: 2 points beat 4 midpoints, and 3 reach the
        # float32 floor of the measured change (a few 1e-5), as 16 midpoints do
        assert errs["gauss", 2][j] < mid[4][j], errs
        assert errs["gauss", 3][j] < 1e-4, errs


@pytest.mark.parametrize(
    "rule, points",
    [
        ("midpoint", [(0.25, 0.5), (0.75, 0.5)]),
        ("gauss", [(0.5 - 0.5 / np.sqrt(3), 0.5), (0.5 + 0.5 / np.sqrt(3), 0.5)]),
    ],
)
def test_shapley_credit_is_the_path_integral_of_the_hand_model(mlp, batches, rule, points):
    """One site's credit at steps=2 equals the rule's two points written out by hand."""
    s = aq.score(mlp, mse, batches[:1], ["qat_mxfp4"], method="shapley", steps=2, rule=rule)
    p = _params(mlp)
    x, t = batches[0]

    def loss(gates):
        ys = [
            lambda h, w, i=i: h @ w + gates[i] * (_fq_gemm(h, w, "mxfp4") - h @ w) for i in range(3)
        ]
        return jnp.mean((_hand_forward(p, x, ys) - t) ** 2)

    grad = jax.jit(jax.grad(loss))
    want = sum(w * np.asarray(grad(jnp.full(3, np.float32(tt)))) for tt, w in points)
    np.testing.assert_allclose(s.damage[:, 1], want, rtol=2e-3, atol=1e-8)


def test_scoring_flops_counts_the_float_step_and_the_path_points(mlp, batches):
    """The float step is the gradient of the loss in every parameter; a Shapley path point
    costs at least its GEMMs (both forward GEMMs of every site and the backward GEMM of each
    site after the first), and the count scales with steps."""
    b = batches[0]
    gd, params, rest = nnx.split(mlp, nnx.Param, ...)
    grad = jax.jit(jax.grad(lambda p: mse(nnx.merge(gd, p, rest), b)))
    cost = grad.lower(params).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    two = aq.scoring_flops(mlp, mse, b, ["qat_mxfp4", "qat_mxfp8"], method="shapley", steps=2)
    four = aq.scoring_flops(mlp, mse, b, ["qat_mxfp4", "qat_mxfp8"], method="shapley", steps=4)
    assert two["float"] == four["float"] == cost["flops"]
    assert four["method"] == 2 * two["method"] and four["per_point"] == two["per_point"]
    m, dims = 32, [(D_IN, D_H), (D_H, D_H), (D_H, D_OUT)]
    gemms = sum(2 * 2 * m * k * n for k, n in dims) + sum(2 * m * k * n for k, n in dims[1:])
    assert two["method"] >= 2 * 2 * gemms  # 2 candidates x 2 points
    iso = aq.scoring_flops(mlp, mse, b, ["qat_mxfp4"], method="isolated")
    fwd = sum(2 * m * k * n for k, n in dims)
    assert iso["method"] >= (1 + 3) * fwd and iso["x_float"] == iso["method"] / iso["float"]
    with pytest.raises(ValueError, match="batch is None"):
        aq.scoring_flops(mlp, mse, None, ["qat_mxfp4"], method="gradient")
    with pytest.raises(ValueError, match="unknown method='hessian'"):
        aq.scoring_flops(mlp, mse, b, ["qat_mxfp4"], method="hessian")


def test_groups_add_and_plans_feed_quantize(mlp, batches, tmp_path):
    s1 = aq.score(mlp, mse, batches, ["qat_mxfp8", "qat_mxfp4"], method="isolated")
    s = aq.score(
        mlp, mse, batches, ["qat_mxfp8", "qat_mxfp4"], method="isolated", groups=[r"up|mid"]
    )
    assert s.sites == ("{up,mid}", "down")
    assert s.members["{up,mid}"] == ("up", "mid")
    np.testing.assert_allclose(s.damage[0], s1.damage[0] + s1.damage[1])
    np.testing.assert_allclose(s.cost[0], s1.cost[0] + s1.cost[1])
    assert s.params["{up,mid}"] == D_IN * D_H + D_H * D_H
    plan = aq.solve(s, bits=6.0)
    assert plan.bits <= 6.0
    assert plan.choices["{up,mid}"] in s.candidates
    want = aq.knapsack(s.cost, s.damage, 6.0 * sum(s.params.values()))
    assert [plan.choices[n] for n in s.sites] == [s.candidates[j] for j in want]
    # rules: every member of a group gets the group's recipe
    rules = plan.rules()
    assert {re.sub(r"\\", "", p) for p, _ in rules} == set(SITES)
    assert lbf.Rules.of(rules).match("mid").name == plan.choices["{up,mid}"]
    # saved and loaded, the plan quantizes the model the same way
    loaded = aq.PrecisionPlan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan
    y1 = nnx.jit(mse)(lbf.quantize(mlp, plan.rules()), batches[0])
    y2 = nnx.jit(mse)(lbf.quantize(mlp, loaded.rules()), batches[0])
    assert float(y1) == float(y2)
    # a custom recipe travels with the plan
    custom = lb.Recipe("w6a16", fwd=lb.GemmSpec(None, lb.QuantSpec("mxfp6")))
    sc = aq.score(mlp, mse, batches[:1], [custom], method="gradient")
    pc = aq.solve(sc, bits=7.0)
    assert "w6a16" in pc.choices.values()
    assert aq.PrecisionPlan.load(pc.save(tmp_path / "c.json")).recipes["w6a16"] == custom
    with pytest.raises(ValueError, match="smallest feasible budget is 6.25"):
        aq.solve(sc, bits=4.0)


def test_linen_isolated_equals_the_single_rule_module(batches):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D_OUT, name="down")(jnp.tanh(nn.Dense(D_H, name="up")(x)))

    module = Net()
    variables = module.init(jax.random.key(0), batches[0][0])

    def loss(v, batch):
        return jnp.mean((module.apply(v, batch[0]) - batch[1]) ** 2)

    s = aq.score(module.bind(variables), loss, batches[:1], ["qat_mxfp4"], method="isolated")
    assert s.sites == ("up", "down")
    base = float(jax.jit(loss)(variables, batches[0]))
    for i, site in enumerate(s.sites):
        q = lbf.quantize(module, [(site, "qat_mxfp4")])
        got = jax.jit(lambda v, b, q=q: jnp.mean((q.apply(v, b[0]) - b[1]) ** 2))(
            variables, batches[0]
        )
        assert s.damage[i, 1] == float(got) - base  # the same float32 losses, bit for bit


def test_score_errors(mlp, batches):
    with pytest.raises(ValueError, match="scalar float loss.*shape \\(32, 16\\)"):
        aq.score(mlp, lambda m, b: m(b[0]), batches, ["mxfp4"], method="gradient")
    with pytest.raises(ValueError, match=r"candidates\[1\]: unknown recipe 'mxfp3'"):
        aq.score(mlp, mse, batches, ["mxfp4", "mxfp3"], method="gradient")
    with pytest.raises(ValueError, match="grouping regex 'attn.*' matches no scored site"):
        aq.score(mlp, mse, batches, ["mxfp4"], method="gradient", groups=["attn.*"])
    with pytest.raises(ValueError, match="batches is empty"):
        aq.score(mlp, mse, iter([]), ["mxfp4"], method="gradient")
    with pytest.raises(ValueError, match="unknown method='hessian'"):
        aq.score(mlp, mse, batches, ["mxfp4"], method="hessian")
    with pytest.raises(ValueError, match="needs output_fn"):
        aq.score(mlp, mse, batches, ["mxfp4"], method="kl")
    with pytest.raises(ValueError, match="rule 'attn' reaches no weight site"):
        aq.score(mlp, mse, batches, ["mxfp4"], method="gradient", rules=[("attn", "mxfp4")])
    with pytest.raises(ValueError, match="unknown rule='simpson'; valid rules"):
        aq.score(mlp, mse, batches, ["mxfp4"], method="shapley", rule="simpson")
    for steps in (0, 2.5, True):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            aq.score(mlp, mse, batches, ["mxfp4"], method="shapley", steps=steps)


# --------------------------------------------------------------------------------------------
# Presets on the GPTs


def _gpt(mlp):
    cfg = GPTConfig(
        d_model=32, layers=2, heads=2, seq_len=16, mlp=mlp, experts=4, tie_embeddings=False
    )
    return GPT(cfg, rngs=nnx.Rngs(0))


PRESET_SITES = {
    ("dense", "all"): {
        f"blocks/{i}/{m}" for i in (0, 1) for m in ("attn/qkv", "attn/out", "mlp/up", "mlp/down")
    },
    ("dense", "mlp_only"): {f"blocks/{i}/mlp/{m}" for i in (0, 1) for m in ("up", "down")},
    ("moe", "all"): {
        f"blocks/{i}/{m}" for i in (0, 1) for m in ("attn/qkv", "attn/out", "moe/up", "moe/down")
    },
    ("moe", "mlp_only"): {f"blocks/{i}/moe/{m}" for i in (0, 1) for m in ("up", "down")},
    ("moe", "experts_only"): {f"blocks/{i}/moe/{m}" for i in (0, 1) for m in ("up", "down")},
}


@pytest.mark.parametrize("mlp_kind,preset", sorted(PRESET_SITES))
def test_presets_select_the_intended_gpt_modules(mlp_kind, preset):
    model = _gpt(mlp_kind)
    rules = aq.heuristic(model, preset, low="mxfp4", high="mxfp8")
    low = {re.sub(r"\\", "", p) for p, r in rules if r == "mxfp4"}  # names, as given
    high = {re.sub(r"\\", "", p) for p, r in rules if r == "mxfp8"}
    assert low == PRESET_SITES[(mlp_kind, preset)]
    every = PRESET_SITES[(mlp_kind, "all")]
    assert high == every - low  # never the embedding, the head or the router
    q = lbf.quantize(model, rules)  # the rules reach exactly those sites
    quantized = {s.path for s in lbf.sites(q, rules) if s.recipe is not None}
    assert quantized == every


def test_experts_only_needs_experts():
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        aq.heuristic(_gpt("dense"), "experts_only")
    with pytest.raises(ValueError, match="unknown preset='attn_only'"):
        aq.heuristic(_gpt("dense"), "attn_only")


def test_bench_autoquant_quick_reports_the_ratios(tmp_path):
    from benchmarks import bench_autoquant

    out = tmp_path / "bench_autoquant.json"
    args = ["--quick", "--runs", "1", "--batches", "2", "--methods", "gradient"]
    payload = bench_autoquant.main([*args, "--out", str(out)])
    assert json.loads(out.read_text())["config"]["sites"] == 4
    rows = {r["what"]: r for r in payload["rows"]}
    assert rows["gradient"]["ok"] == (rows["gradient"]["x_float"] <= 3.0)
    assert rows["float forward+backward"]["per_batch_ms"] > 0
