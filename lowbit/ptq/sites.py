"""PTQ's view of a model: its adapter, its parameters, the sites the rules quantize."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from lowbit.flax._core import ATTN_SCORES, ATTN_VALUES, Layout, Rules, Site, weight_spec
from lowbit.flax.adapters import Adapter, Bound, adapter_for
from lowbit.gemm.recipes import QuantSpec, Recipe
from lowbit.io.tree import keypath_str, path_str

ALPHAS = tuple(i / 20 for i in range(21))  # the smoothing exponent grid, 0 .. 1
WEIGHT_METHODS = ("max", "mse", "gptq", "mr-gptq")
MAX_ROWS = 2048  # activation rows kept per site for "mse" and the smoothing search
ATTN = (ATTN_SCORES, ATTN_VALUES)


# --------------------------------------------------------------------------------------------
# Models (NNX, or a bound Linen module) and their sites


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as PTQ holds it: its framework's adapter (chosen once, where the model
    enters) and the model with its parameters."""

    adapter: Adapter
    bound: Bound

    @property
    def name(self) -> str:
        return self.bound.name


def as_model(model) -> Model:
    adapter = adapter_for(model)
    return Model(adapter, adapter.bound(model, "ptq"))


def model_sites(m: Model, rules: Rules, example) -> list[Site]:
    args = (example,) if m.adapter.needs_example() else ()
    return m.adapter.sites(m.bound.model, rules, args)


def quantized_sites(site_list: list[Site], rules: Rules) -> list[Site]:
    """The sites whose activations PTQ calibrates: quantized, weight GEMMs (not attention)."""
    for rule in rules.rules:
        if not any(rule.regex.fullmatch(s.path) for s in site_list):
            known = ", ".join(repr(s.path) for s in site_list) or "none"
            raise ValueError(
                f"rules: rule {rule.pattern!r} reaches no site of the model (its sites: {known})"
            )
    out = [
        s
        for s in site_list
        if s.kind not in ATTN and rules.active(s.path) is not None and s.kernel is not None
    ]
    return out


def activation_format(recipe: Recipe) -> str | None:
    spec = recipe.fwd.lhs
    if spec is None:
        return None
    return spec.format


def check_packable(site: Site, recipe: Recipe) -> QuantSpec | None:
    spec = weight_spec(recipe, site.path)
    if recipe.fwd.lhs is not None and recipe.fwd.lhs.stochastic:
        raise ValueError(
            f"site {site.path!r}: recipe {recipe.name!r} rounds its activations stochastically "
            "in the forward; post-training quantization needs a deterministic forward (use a "
            "qat_* recipe or a Recipe of your own)"
        )
    return spec



def dense_sites(sites: list[Site], where: str) -> list[Site]:
    out = []
    for s in sites:
        if s.kind == "dot_general" and s.layout == Layout(0, 1) and len(s.shape) == 2:
            out.append(s)
    if not out:
        raise ValueError(f"{where}: the rules quantize no dense [K, N] site (Linear / Dense)")
    return out


def kernel_value(m: Model, site: Site) -> np.ndarray:
    """The float32 value of a site's weight."""
    return np.asarray(kernel_leaf(m, site), np.float32)


def kernel_leaf(m: Model, site: Site):
    """A site's weight as the model holds it."""
    tree = m.adapter.params(m.bound)
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if path_str(keypath_str(keypath)) == site.kernel:
            return leaf
    raise KeyError(f"site {site.path!r}: no parameter {site.kernel!r}")



def chain(first, rest):
    yield first
    yield from rest
