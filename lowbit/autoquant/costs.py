"""The cost models of :func:`lowbit.autoquant.solve`: what a site's weights cost a plan.

- ``"stored"`` (the default): the bits the weights take in storage (elements plus scales,
  float = 16; :func:`lowbit.autoquant.weight_bits`), and the budget ``bits`` is an average over
  the stored parameters. A model's memory footprint.
- ``"active"``: each site's stored bits times the fraction of the tokens its weights serve,
  and the budget an average over the *active* parameters (each site's parameter count times
  the same fraction). The stacked experts of a token-choice mixture of experts serve
  ``top_k / experts`` of the tokens each, so a token reads that fraction of their weights: a
  plan under ``bits=4.5`` averages 4.5 bits per weight read per token, the memory traffic of
  decoding, rather than per weight stored. Experts weigh ``top_k / experts`` as much as under
  ``"stored"``, so for one budget the solver spends relatively more of it on them.

The fractions are the caller's: ``score(..., active_fraction={path regex: fraction})``
(fullmatch, first regex wins, every other site 1), e.g. ``{r"blocks/\\d+/moe/(?:up|down)":
top_k / experts}`` for ``experiments.model.GPT`` (``experiments.autoquant.active_fraction``
builds it from the GPT config). A site's active cost is its fraction times its stored bits; a
group adds its members', so a group that mixes experts and dense sites is counted exactly.

This mirrors NVIDIA ModelOpt's ``active_moe`` cost model of ``auto_quantize``
(NVIDIA/Model-Optimizer @ 51c4623e, ``modelopt/torch/quantization/_auto_quantize_cost.py``:
``ActiveMoECostModel.module_cost_weight`` at lines 197-205 gives a routed-expert module the
ratio and every other module 1, ``AutoQuantizeCostModel.total_weight_size`` at 147-158 weights
the effective-bits denominator the same way, ``infer_active_moe_expert_ratio`` at 78-89 reads
``top_k / num_experts``; tests/test_autoquant_active.py holds lowbit to a transcription of
those lines; ``constraints={"effective_bits": ..., "cost_model": "active_moe",
"cost": {"active_moe_expert_ratio": r}}``, the default cost model being ``"weight"``): the
weight size of a routed-expert group is multiplied by ``r = top_k / num_experts`` (read from the
Hugging Face config when not given; ``r`` must lie in (0, 1]), and the effective-bits target is
taken over the so-weighted, uncompressed cost. ModelOpt finds routed experts by module name
(``.experts.``, shared experts excluded) and gives a whole group one ratio; here the caller
names the sites by regex, each with its own fraction, and costs count scales as stored
(:mod:`lowbit.bits`) where ModelOpt counts a format's nominal effective bits. ModelOpt also
gives vision-tower and MTP modules a weight of 0 by name (lines 137-144); lowbit's models have
none, and a caller excludes a site from the rules instead.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence

__all__ = ["COSTS", "check_cost", "compile_pattern", "parse_fractions", "site_fractions"]

COSTS = ("stored", "active")


def check_cost(cost, where: str) -> str:
    """``cost`` if it names a cost model (:data:`COSTS`); a ``ValueError`` listing them if not."""
    if not isinstance(cost, str) or cost not in COSTS:
        raise ValueError(f"{where}: unknown cost={cost!r}; valid costs: {COSTS}")
    return cost


def compile_pattern(pattern, what: str) -> re.Pattern:
    """``pattern`` (a regex string or a compiled one) compiled, or an error naming ``what``
    (``"score: groups[0]"``) and the bad value."""
    pat = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
    if not isinstance(pat, str):
        raise TypeError(f"{what} must be a regex string, got {pattern!r}")
    try:
        return re.compile(pat)
    except re.error as e:
        raise ValueError(f"{what}: bad regex {pat!r}: {e}") from None


def parse_fractions(active_fraction, where: str = "score") -> list[tuple[re.Pattern, float]]:
    """``{path regex: fraction}`` checked: compiled regexes and fractions in (0, 1], in order.

    >>> [(p.pattern, f) for p, f in parse_fractions({r".*moe/(up|down)": 0.25})]
    [('.*moe/(up|down)', 0.25)]
    """
    if not isinstance(active_fraction, Mapping):
        raise TypeError(
            f"{where}: active_fraction must be a mapping {{path regex: fraction}}, got "
            f"{type(active_fraction).__name__}"
        )
    out = []
    for pattern, f in active_fraction.items():
        rx = compile_pattern(pattern, f"{where}: active_fraction")
        pat = rx.pattern
        ok = isinstance(f, numbers.Real) and not isinstance(f, bool) and math.isfinite(f)
        if not ok or not 0.0 < float(f) <= 1.0:
            raise ValueError(
                f"{where}: active_fraction[{pat!r}]={f!r} must be a number in (0, 1]: the "
                "fraction of the tokens the site's weights serve (top_k / experts for experts)"
            )
        out.append((rx, float(f)))
    return out


def site_fractions(
    paths: Sequence[str], fractions: list[tuple[re.Pattern, float]], where: str = "score"
) -> dict[str, float]:
    """Each path's fraction: that of the first regex it fullmatches, else 1. Every regex must
    match one of ``paths``.

    >>> site_fractions(["attn/qkv", "moe/up"], parse_fractions({"moe/.*": 0.5}))
    {'attn/qkv': 1.0, 'moe/up': 0.5}
    """
    for rx, _ in fractions:
        if not any(rx.fullmatch(p) for p in paths):
            raise ValueError(
                f"{where}: active_fraction regex {rx.pattern!r} matches no scored site "
                f"(sites: {list(paths)})"
            )
    return {p: next((f for rx, f in fractions if rx.fullmatch(p)), 1.0) for p in paths}
