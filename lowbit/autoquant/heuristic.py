"""Architecture heuristics: which sites a preset puts in low precision, by their paths.

A site's role is read from its path (module names as models spell them: ``attn``, ``mlp``,
``moe`` / ``experts``, ``router`` / ``gate``, ``embed``, ``head`` / ``lm_head``), so the presets
work on models written without lowbit:

- ``"all"``: every weight GEMM low.
- ``"mlp_only"``: MLP and expert GEMMs low, attention projections (and anything unclassified)
  high; the choice of most MX / NVFP4 deployment recipes, since attention projections are the
  more sensitive.
- ``"experts_only"``: only the experts of mixture-of-experts layers low (a MoE model's weights
  are mostly experts); everything else high.

Embeddings, the LM head / classifier and MoE routers are excluded by every preset: they stay as
the model has them.
"""

from __future__ import annotations

import re

from lowbit.flax._core import Site
from lowbit.flax.adapters import adapter_for
from lowbit.gemm import recipes as _recipes

__all__ = ["PRESETS", "ROLES", "classify", "heuristic", "weight_sites"]

PRESETS = ("all", "mlp_only", "experts_only")
ROLES = ("embedding", "head", "router", "expert", "attention", "mlp", "other")

_ROUTER = re.compile(r"router|gate|gating|wg")
_EMBED = re.compile(
    r"(tok_|pos_|patch_|word_|position_)?embed(ding)?s?|pos_embed|wte|wpe|"
    r"tok_embeddings|embed_tokens|patch_embed(ding)?"
)
_HEAD = re.compile(r"(lm_)?head|classifier|logits|output|unembed(ding)?|output_projection")
_EXPERT = re.compile(r"moe|experts?|block_sparse_moe|sparse_moe|mixture")
_ATTN = re.compile(r".*(attn|attention|mha).*")
_ATTN_LEAF = re.compile(
    r"q|k|v|o|qkv|query|key|value|wq|wk|wv|wo_attn|q_proj|k_proj|v_proj|"
    r"o_proj|out_proj|c_attn|qkv_proj"
)
_MLP = re.compile(r".*mlp.*|ffn.*|feed_?forward.*|ff(_?\d+)?|fc(_?\d+)?")
_MLP_LEAF = re.compile(
    r"up|down|gate_proj|up_proj|down_proj|fc\d|wi(_\d)?|wo|w[123]|c_fc|"
    r"c_proj|dense_h_to_4h|dense_4h_to_h|intermediate"
)


def classify(path: str) -> str:
    """The role of the site at ``path`` (one of :data:`ROLES`).

    >>> [classify(p) for p in ("blocks/0/attn/qkv", "blocks/0/mlp/up", "blocks/1/moe/down",
    ...                        "blocks/1/moe/router", "head", "embed")]
    ['attention', 'mlp', 'expert', 'router', 'head', 'embedding']
    """
    parts = [p for p in path.split("/") if p]
    leaf = parts[-1] if parts else ""
    if _ROUTER.fullmatch(leaf):
        return "router"
    if _EMBED.fullmatch(leaf):
        return "embedding"
    if _HEAD.fullmatch(leaf) and len(parts) == 1:
        return "head"
    if _HEAD.fullmatch(leaf) and not any(_ATTN.fullmatch(p) or _MLP.fullmatch(p) for p in parts):
        return "head"
    if any(_EXPERT.fullmatch(p) for p in parts[:-1]) or _EXPERT.fullmatch(leaf):
        return "expert"
    if any(_ATTN.fullmatch(p) for p in parts) or _ATTN_LEAF.fullmatch(leaf):
        return "attention"
    if any(_MLP.fullmatch(p) for p in parts) or _MLP_LEAF.fullmatch(leaf):
        return "mlp"
    return "other"


def weight_sites(model, *example) -> list[Site]:
    """The sites of ``model`` that hold a weight (attention score / value products excluded):
    an NNX model is read from its graph; a Linen module is traced on ``example`` inputs (bound
    modules are unbound first)."""
    found = adapter_for(model).weight_sites(model, tuple(example))
    return [s for s in found if s.kernel is not None]


def heuristic(
    model,
    preset: str,
    *,
    low="mxfp4",
    high="none",
    example: tuple = (),
) -> list[tuple[str, object]]:
    """``lowbit.flax`` rules for ``preset`` (:data:`PRESETS`): the preset's low-precision
    sites get ``low``, the other sites it classifies (attention, dense MLP, unclassified)
    ``high`` (``"none"``: left float, no rule); embeddings, LM head and routers get no rule.

    Rules name each site by its escaped path, so they feed :func:`lowbit.flax.quantize`,
    :func:`lowbit.ptq.quantize` and :func:`lowbit.autoquant.score` (``rules=``) alike.

    Args:
      model: an NNX model or a Linen module (then ``example``: inputs to trace it on).
      preset: ``"all"``, ``"mlp_only"`` or ``"experts_only"``.
      low, high: recipe names or :class:`lowbit.Recipe` objects (a rule holds what was given:
        a name, or the Recipe).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.attn_proj = nnx.Linear(8, 8, rngs=rngs)
    ...         self.mlp = nnx.Linear(8, 8, rngs=rngs)
    ...         self.head = nnx.Linear(8, 2, rngs=rngs)
    >>> heuristic(Net(nnx.Rngs(0)), "mlp_only", high="mxfp8")
    [('attn_proj', 'mxfp8'), ('mlp', 'mxfp4')]
    """
    if preset not in PRESETS:
        raise ValueError(f"heuristic: unknown preset={preset!r}; valid presets: {PRESETS}")
    low_r = _recipe(low, "low")
    high_r = _recipe(high, "high")
    sites = weight_sites(model, *example)
    roles = {s.path: classify(s.path) for s in sites}
    if preset == "experts_only" and "expert" not in roles.values():
        raise ValueError(
            "heuristic: preset 'experts_only' needs a mixture-of-experts model, but no site is "
            f"an expert (sites: {sorted(roles)})"
        )
    lows = {
        "all": ("expert", "attention", "mlp", "other"),
        "mlp_only": ("expert", "mlp"),
        "experts_only": ("expert",),
    }[preset]
    rules = []
    for s in sites:
        role = roles[s.path]
        if role in ("embedding", "head", "router"):
            continue
        low_site = role in lows
        r = low_r if low_site else high_r
        if not r.is_identity:  # a recipe asked for by name stays a name (printed rules read)
            given = low if low_site else high
            rules.append((re.escape(s.path), r.name if isinstance(given, str) else r))
    return rules


def _recipe(r, name: str):
    try:
        return _recipes.get(r)
    except (ValueError, TypeError) as e:
        raise type(e)(f"heuristic: {name}: {e}") from None
