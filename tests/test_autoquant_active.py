"""lowbit.autoquant's ``"active"`` cost model (issue 27): a MoE GPT's expert weights cost the
``top_k / experts`` of the tokens they serve, and ``bits`` is a budget per active parameter.

Every number below is written out by hand from the GPT's shapes, so the cost arithmetic is
checked against the shapes rather than against itself."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit.autoquant as aq
from experiments.autoquant import MOE_EXPERTS, MOE_GROUPS, active_fraction, cross_entropy
from experiments.model import GPT, GPTConfig

# One block, d = 32, f = 4 d = 128, 4 experts, each token routed to 1 of them.
CFG = GPTConfig(d_model=32, layers=1, heads=2, seq_len=8, mlp="moe", experts=4, top_k=1)
ATTN, EXPERTS = r"blocks/(\d+)/attn/.*", MOE_GROUPS[0]
SITES = ("blocks/0/attn/qkv", "blocks/0/attn/out", "blocks/0/moe/up", "blocks/0/moe/down")
# parameters: qkv [32, 96], out [32, 32], up [4, 32, 128], down [4, 128, 32]
PARAMS = {"attn": 3072 + 1024, "experts": 2 * 4 * 32 * 128}  # 4096, 32768
# bits per element: none 16; qat_mxfp4 4 + 8 / 32 (one E8M0 scale per 32; MX: no tensor scale)
STORED = {"attn": [16 * 4096, 4.25 * 4096], "experts": [16 * 32768, 4.25 * 32768]}
# active: the experts at top_k / experts = 1/4 of the tokens, attention at all of them
ACTIVE_PARAMS = {"attn": 4096.0, "experts": 32768 / 4}  # 4096, 8192
ACTIVE = {"attn": [65536.0, 17408.0], "experts": [131072.0, 34816.0]}


def _batch():
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, CFG.vocab)
    return {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}


@pytest.fixture(scope="module")
def model():
    return GPT(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def scores(model):
    """The GPT scored with its attention and its experts as one group each."""
    return aq.score(model, cross_entropy, [_batch()], ["qat_mxfp4"], method="gradient",
                    groups=[ATTN, EXPERTS], active_fraction=active_fraction(CFG))


def test_active_costs_are_the_stored_costs_times_top_k_over_experts(scores):
    assert active_fraction(CFG) == {MOE_EXPERTS: 0.25}
    assert scores.sites == ("blocks/0/attn/{qkv,out}", "blocks/0/moe/{up,down}")
    assert scores.fraction == dict(zip(SITES, (1.0, 1.0, 0.25, 0.25), strict=True))
    names = dict(zip(("attn", "experts"), scores.sites, strict=True))
    for k, g in names.items():
        i = scores.sites.index(g)
        assert scores.params[g] == PARAMS[k]
        assert scores.active_params[g] == ACTIVE_PARAMS[k]
        assert scores.cost[i].tolist() == STORED[k]
        assert scores.active_cost[i].tolist() == ACTIVE[k]
    # bits per (active) parameter of one assignment: attention float, experts MXFP4
    ch = {names["attn"]: "none", names["experts"]: "qat_mxfp4"}
    assert scores.bits(ch) == (65536 + 139264) / 36864  # 5.56: the experts are most weights
    assert scores.bits(ch, cost="active") == (65536 + 34816) / 12288  # 8.17
    assert scores.bits(scores.uniform("none"), cost="active") == 16.0
    assert scores.bits(scores.uniform("qat_mxfp4"), cost="active") == 4.25


def test_the_active_plan_keeps_the_experts_that_the_stored_plan_quantizes(scores):
    """At ``bits=12.5`` with damages attention 0.2 and experts 0.3 (MXFP4 against float):

    stored, budget 12.5 x 36864 = 460800 bits: attention MXFP4 + experts float costs
    17408 + 524288 = 541696 (too much), so the experts go to MXFP4 and attention stays float:
    65536 + 139264 = 204800 bits, damage 0.3.
    active, budget 12.5 x 12288 = 153600: attention MXFP4 + experts float costs 17408 + 131072
    = 148480 (fits; 12.08 bits per active parameter), damage 0.2 < 0.3: the experts, cheap
    per token, stay float and attention takes MXFP4."""
    s = dataclasses.replace(scores, damage=np.array([[0.0, 0.2], [0.0, 0.3]]))
    attn, experts = s.sites
    stored = aq.solve(s, bits=12.5)
    assert stored.choices == {attn: "none", experts: "qat_mxfp4"}
    assert stored.bits == 204800 / 36864 and stored.cost == "stored"
    assert stored.predicted == pytest.approx(0.3, abs=1e-15)
    active = aq.solve(s, bits=12.5, cost="active")
    assert active.choices == {attn: "qat_mxfp4", experts: "none"}
    assert active.bits == 148480 / 12288 == s.bits(active.choices, cost="active")
    assert active.cost == "active" and active.predicted == pytest.approx(0.2, abs=1e-15)
    assert active.params == stored.params == {attn: 4096, experts: 32768}
    # the plan's rules keep every expert float
    rules = dict(active.rules())
    assert [rules[p].name for p in (r"blocks/0/moe/up", r"blocks/0/moe/down")] == ["none"] * 2
    # below every site at MXFP4, no plan: the message names the active bound
    with pytest.raises(ValueError, match="smallest feasible budget is 4.25 bits per active"):
        aq.solve(s, bits=4.0, cost="active")


def test_scores_and_plans_keep_the_cost_model_through_json(scores, tmp_path):
    loaded = aq.Scores.load(scores.save(tmp_path / "scores.json"))
    assert loaded.fraction == scores.fraction
    assert loaded.active_params == scores.active_params
    np.testing.assert_array_equal(loaded.active_cost, scores.active_cost)
    plan = aq.solve(loaded, bits=6.0, cost="active")
    assert aq.PrecisionPlan.load(plan.save(tmp_path / "plan.json")) == plan
    # written before the cost models: scores carry none, plans were stored ones
    old = scores.to_json()
    for k in ("fraction", "active_cost", "active_params"):
        del old[k]
    assert aq.Scores.from_json(old).active_cost is None
    d = plan.to_json()
    del d["cost"]
    assert aq.PrecisionPlan.from_json(d).cost == "stored"
    d["cost"] = "latency"
    with pytest.raises(ValueError, match="unknown cost='latency'"):
        aq.PrecisionPlan.from_json(d)


def test_a_group_mixing_experts_and_dense_sites_adds_its_members(model):
    s = aq.score(model, cross_entropy, [_batch()], ["qat_mxfp4"], method="gradient",
                 groups=[r"blocks/(\d+)/.*"], active_fraction={r".*moe/up": 0.5, ".*moe/.*": 0.25})
    (g,) = s.sites
    assert s.fraction["blocks/0/moe/up"] == 0.5  # the first regex that matches wins
    assert s.fraction["blocks/0/moe/down"] == 0.25
    assert s.active_params[g] == 4096 + 16384 / 2 + 16384 / 4
    assert s.active_cost[0].tolist() == [16 * 16384.0, 4.25 * 16384]
    assert s.cost[0].tolist() == [16 * 36864.0, 4.25 * 36864]


def _scores(**kw):
    return aq.Scores(sites=("a",), candidates=("none", "mxfp4"), damage=np.zeros((1, 2)),
                     cost=np.array([[16.0 * 64, 4.25 * 64]]), method="isolated",
                     params={"a": 64}, **kw)


def test_cost_model_errors(model):
    with pytest.raises(ValueError, match=r"unknown cost='memory'; valid costs: \('stored', "
                                         r"'active'\)"):
        aq.solve(_scores(), bits=8.0, cost="memory")
    with pytest.raises(ValueError, match="unknown cost='memory'"):
        _scores().bits({"a": "none"}, cost="memory")
    with pytest.raises(ValueError, match=r"cost='active' needs scores with active fractions"):
        aq.solve(_scores(), bits=8.0, cost="active")
    assert aq.solve(_scores(), bits=8.0).cost == "stored"  # the default is unchanged
    batch = [_batch()]

    def score(fractions):
        return aq.score(model, cross_entropy, batch, ["qat_mxfp4"], method="gradient",
                        active_fraction=fractions)

    for bad in (0, 0.0, -0.5, 1.5, math.nan, math.inf, True, "1/4", None):
        with pytest.raises(ValueError, match=r"active_fraction\['moe'\]=.* must be a number in "
                                             r"\(0, 1\]"):
            score({"moe": bad})
    with pytest.raises(ValueError, match="active_fraction: bad regex"):
        score({"moe/(up": 0.5})
    with pytest.raises(TypeError, match="active_fraction must be a mapping"):
        score([(".*moe/up", 0.5)])
    # the router is not scored by default, so a regex for it reaches nothing
    with pytest.raises(ValueError, match=r"regex '\.\*router' matches no scored site"):
        score({".*router": 0.5})


def _modelopt_effective_bits(modules, bits, ratio):
    """A transcription of NVIDIA/Model-Optimizer @ 51c4623e,
    modelopt/torch/quantization/_auto_quantize_cost.py: ``is_routed_moe_module_name``
    (lines 92-94), ``ActiveMoECostModel.module_cost_weight`` (197-205) and
    ``AutoQuantizeCostModel.total_weight_size`` (147-158): effective bits = sum over modules
    of numel x bits x weight, over sum of numel x weight, weight = ratio for routed experts."""
    import re

    routed = re.compile(r"(^|\.)experts(\.|$)")

    def weight(name):
        return ratio if "shared_expert" not in name and routed.search(name) else 1.0

    num = sum(n * bits[name] * weight(name) for name, n in modules.items())
    den = sum(n * weight(name) for name, n in modules.items())
    return num / den


def test_active_bits_equal_modelopts_active_moe_effective_bits(scores):
    """ModelOpt's module names for the GPT's sites (its experts live under ``.experts.``); the
    per-element bits are lowbit's stored ones on both sides (ModelOpt would use a format's
    nominal bits), so what is compared is the weighting."""
    names = {"blocks.0.attn.qkv": 3072, "blocks.0.attn.out": 1024,
             "blocks.0.moe.experts.up": 16384, "blocks.0.moe.experts.down": 16384}
    for attn, experts in (("none", "qat_mxfp4"), ("qat_mxfp4", "none"),
                          ("qat_mxfp4", "qat_mxfp4")):
        b = {"none": 16.0, "qat_mxfp4": 4.25}
        bits = {n: b[experts if "experts" in n else attn] for n in names}
        want = _modelopt_effective_bits(names, bits, ratio=CFG.top_k / CFG.experts)
        ch = dict(zip(scores.sites, (attn, experts), strict=True))
        assert scores.bits(ch, cost="active") == pytest.approx(want, rel=1e-12)
