"""Rules: parsing, matching (re.fullmatch, first match wins), clear errors; describe()'s bits."""

from __future__ import annotations

import re

import pytest
from flax import nnx

import lowbit as lb
import lowbit.flax as lbf
from lowbit.flax import _core


def test_fullmatch_first_rule_wins():
    rules = lbf.Rules.of(
        [(r"mlp", "mxfp4"), (r".*mlp.*", "mxfp6"), (r".*", "none"), (r".*", "mxfp8")]
    )
    assert rules.match("mlp").name == "mxfp4"
    assert rules.match("mlp_out").name == "mxfp6"  # fullmatch: "mlp" alone does not match
    assert rules.match("block/0/mlp/up").name == "mxfp6"
    assert rules.match("attn/query").name == "none"  # first match wins, even "none"
    assert rules.active("attn/query") is None
    assert lbf.Rules.of([]).match("anything") is None
    # compiled patterns and Recipe objects are accepted; a Rules passes through
    r = lb.recipes.get("nvfp4")
    rules2 = lbf.Rules.of([(re.compile(r"a|b"), r)])
    assert rules2.match("b") is r and lbf.Rules.of(rules2) is rules2


@pytest.mark.parametrize(
    "rules, exc, match",
    [
        ([(r"mlp(", "mxfp4")], ValueError, r"rule 0: bad path regex 'mlp\(': missing \)"),
        (
            [(r".*", "mxfp4"), (r".*", "mxfp3")],
            ValueError,
            r"rule 1 \('\.\*'\): unknown recipe 'mxfp3'; known recipes: .*mxfp4",
        ),
        ([(r".*", 4)], TypeError, r"rule 0 \('\.\*'\): recipe must be a name or a Recipe"),
        ((r".*", "mxfp4"), TypeError, r"a single pair .*: wrap it in a list"),
        ("mxfp4", TypeError, r"must be a list of \(path_regex, recipe\) pairs.*; got str"),
        ({r".*": "mxfp4"}, TypeError, r"got a dict \(rule order matters"),
        ([(r".*", "mxfp4", "extra")], TypeError, r"rule 0 is \('\.\*', 'mxfp4', 'extra'\)"),
        ([r".*"], TypeError, r"rule 0 is '\.\*'"),
        ([(3, "mxfp4")], TypeError, r"rule 0: the path regex must be a str, got int"),
        (None, TypeError, r"must be a list"),
    ],
)
def test_bad_rules(rules, exc, match):
    with pytest.raises(exc, match=match):
        lbf.Rules.of(rules)
    with pytest.raises(exc, match=match):  # every entry point validates
        lbf.quantize(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), rules)


def test_not_a_model():
    with pytest.raises(TypeError, match="expected a flax.linen Module or a flax.nnx Module"):
        lbf.quantize(lambda x: x, [(".*", "mxfp4")])


def test_attention_sites_are_named_by_suffix():
    mha = nnx.MultiHeadAttention(2, 32, decode=False, rngs=nnx.Rngs(0))
    paths = [s.path for s in lbf.sites(mha, [])]
    assert set(paths) >= {"attn_scores", "attn_values"}
    assert {"query", "key", "value", "out"} <= set(paths)
    q = lbf.quantize(mha, [(r".*attn_scores", "mxfp8")])
    assert isinstance(q.attention_fn, lbf.nnx.Attention)
    assert q.attention_fn.scores.name == "mxfp8" and q.attention_fn.values.name == "none"
    assert q.query.dot_general is None


def test_weight_bits_per_recipe():
    assert lbf.packing.weight_bits(lb.recipes.get("mxfp4"), "float32") == 4.25
    assert lbf.packing.weight_bits(lb.recipes.get("qat_mxfp6"), "float32") == 6.25
    assert lbf.packing.weight_bits(lb.recipes.get("nvfp4"), "float32") == 4 + 8 / 256
    assert lbf.packing.weight_bits(lb.recipes.get("qat_nvfp4"), "float32") == 4.5
    assert lbf.packing.weight_bits(lb.recipes.get("fp8"), "float32") == 8.0
    assert lbf.packing.weight_bits(lb.recipes.get("mxfp4_bwd"), "bfloat16") == 16.0
    assert lbf.packing.weight_bits(None, "float32") == 32.0


def test_describe_totals_and_unused_rules():
    model = nnx.Sequential(
        nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 32, rngs=nnx.Rngs(1))
    )
    lines = []
    rows = lbf.describe(
        model,
        [(r"layers/0", "qat_mxfp4"), (r"layers/1", "qat_mxfp8"), (r"nope", "mxfp4")],
        print_fn=lines.append,
    )
    n0, n1 = 64 * 64, 64 * 32
    total = n0 + 64 + n1 + 32
    assert rows[-1].params == total
    expected = (n0 * 4.25 + n1 * 8.25 + (64 + 32) * 32) / total
    assert rows[-1].bits_per_param == pytest.approx(expected, rel=1e-12)
    assert "rules that match no site: ['nope']" in lines[0]


def test_packable_recipes():
    with pytest.raises(ValueError, match="Hadamard"):
        _core.serving_recipe(lb.recipes.get("quartet"))
    with pytest.raises(ValueError, match="per tensor"):
        _core.weight_spec(lb.recipes.get("fp8"))
    s = _core.serving_recipe(lb.recipes.get("nvfp4"))
    assert s.fwd.rhs is None and s.fwd.lhs == lb.recipes.get("nvfp4").fwd.lhs
    assert not s.is_fqt and not s.needs_key


def test_einsum_ellipsis_and_layouts():
    assert _core.expand_ellipsis("...d,df->...f", 3, 2) == "ABd,df->ABf"
    assert _core.einsum_rhs_layout("btd,dhk->bthk", 3, 3) == lbf.Layout(0, 2)
    assert _core.dot_rhs_layout((((2,), (0,)), ((), ())), 2) == lbf.Layout(0, 1)
    with pytest.raises(ValueError, match="explicit output"):
        _core.expand_ellipsis("...d,df", 3, 2)
