"""Flax integration: quantize NNX and Linen models by path rules, pack, checkpoint.

Rules are a list of ``(path_regex, recipe)`` pairs. A module's path is its attribute / name
path joined by ``/`` (NNX: ``"blocks/0/mlp/up"``, Linen: ``"Block_0/mlp/Dense_0"``, the
``params`` tree keys without ``kernel``; the root module is ``""``), and a rule applies when
``re.fullmatch(path_regex, path)`` succeeds (so ``r".*mlp.*"`` matches anywhere and ``r"mlp"``
only the top-level ``mlp``). The first matching rule wins; a module no rule matches, or whose
rule says ``"none"``, is not touched and computes exactly what the float model computes.

What a rule reaches (*sites*): dense layers (Linen ``Dense`` / ``DenseGeneral``, NNX
``Linear`` / ``LinearGeneral``, any module with a ``dot_general`` attribute), ``Einsum``
layers, and the two einsums of attention modules (Linen ``MultiHeadDotProductAttention``, NNX
``MultiHeadAttention``), named by the attention module's path plus ``/attn_scores``
(``q k^T``) or ``/attn_values`` (``softmax(.) v``). A catch-all rule also quantizes the
attention einsums; put ``(r".*/attn_(scores|values)", "none")`` first to keep them in float.

Keys: stochastic rounding and random Hadamard signs draw from an rng stream named ``"quant"``
(Linen: ``apply(..., rngs={"quant": key})``; NNX: ``quantize(model, rules,
rngs=nnx.Rngs(quant=seed))``). Recipes that need no key need no stream.

Implementations: ``quantize(..., implementation="xla" | "pallas" | None)`` reaches every
:func:`lowbit.dot_general` / :func:`lowbit.einsum` call of the quantized sites (the op modules
hold it as a static attribute); :func:`describe` shows it per site.

>>> import jax, jax.numpy as jnp, lowbit.flax as lbf
>>> from flax import nnx
>>> model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu,
...                        nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
>>> qmodel = lbf.quantize(model, [(r"layers/0", "mxfp4")])
>>> type(qmodel.layers[0].dot_general).__name__, qmodel.layers[2].dot_general is jax.lax.dot_general
('DotGeneral', True)
>>> nnx.jit(qmodel)(jnp.ones((4, 64))).shape
(4, 8)
"""

from __future__ import annotations

from lowbit.flax import checkpoint, linen, nnx
from lowbit.flax._core import (
    ATTN_SCORES,
    ATTN_VALUES,
    Layout,
    Rule,
    Rules,
    Site,
    SiteGemm,
    framework,
    is_qarray,
    keypath_str,
    observing,
    pack_weight,
    path_str,
    serving_recipe,
    substituting,
    weight_spec,
)
from lowbit.flax.checkpoint import CheckpointError, restore, save
from lowbit.flax.packing import Row, describe, pack, packed_nbytes, sites, unpack
from lowbit.gemm.implementation import IMPLEMENTATIONS, validate

__all__ = [
    "quantize",
    "describe",
    "sites",
    "pack",
    "unpack",
    "save",
    "restore",
    "packed_nbytes",
    "Rules",
    "Rule",
    "Site",
    "SiteGemm",
    "Layout",
    "Row",
    "CheckpointError",
    "ATTN_SCORES",
    "ATTN_VALUES",
    "IMPLEMENTATIONS",
    "framework",
    "observing",
    "substituting",
    "weight_spec",
    "serving_recipe",
    "pack_weight",
    "path_str",
    "keypath_str",
    "is_qarray",
    "linen",
    "nnx",
    "checkpoint",
]


def quantize(
    model,
    rules,
    *,
    rngs=None,
    packed: bool = False,
    method: str = "__call__",
    implementation: str | None = None,
    observe: bool = False,
):
    """Apply ``rules`` to a Linen module or an NNX model whose code knows nothing of lowbit.

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      rules: ``[(path_regex, recipe), ...]``; recipe: a name (``lb.recipes.names()``) or a
        :class:`lowbit.Recipe`. See the module docstring for paths and matching.
      rngs: NNX only: an ``nnx.Rngs`` with a ``"quant"`` stream, needed when a matched recipe
        needs keys. (Linen modules draw from ``apply(..., rngs={"quant": key})``.)
      packed: serve packed weights (:func:`pack`): weights enter their GEMMs as packed,
        without being quantized again. Linen: the returned module's ``apply`` takes the packed
        params directly. NNX: use :class:`lowbit.flax.nnx.PackedModel` instead.
      method: Linen only: the method ``__call__`` of the returned module runs.
      implementation: what every quantized GEMM runs, passed on to each
        :func:`lowbit.dot_general` / :func:`lowbit.einsum` call: ``"xla"`` (the emulation,
        the reference), ``"pallas"`` (the Pallas kernels when lowered for CUDA, the emulation
        elsewhere) or None (the best available for the backend).
      observe: the sites the rules quantize compute in float instead, with ops that know
        their site path, so that :func:`observing` and :func:`substituting` hooks reach them
        (calibration, sensitivity scores); the recipes themselves are not applied.

    Returns:
      Linen: a :class:`lowbit.flax.linen.Quantized` module with the same parameter tree
      (``init`` / ``apply`` as usual). NNX: a new model (``nnx.clone``) whose matched modules
      hold quantized ops; ``model`` itself is unchanged.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, lowbit.flax as lbf
    >>> model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(8)])
    >>> x = jnp.ones((4, 32))
    >>> variables = jax.jit(model.init)(jax.random.key(0), x)
    >>> qmodel = lbf.quantize(model, [(r"layers_0", "nvfp4")])
    >>> jax.jit(qmodel.apply)(variables, x, rngs={"quant": jax.random.key(1)}).shape
    (4, 8)
    """
    fw = framework(model)
    validate(implementation)
    if fw == "nnx":
        return nnx.quantize(
            model, rules, rngs=rngs, packed=packed, implementation=implementation, observe=observe
        )
    if rngs is not None:
        raise TypeError(
            "rngs= is for NNX models; a Linen module takes its keys from "
            "apply(..., rngs={'quant': key})"
        )
    return linen.quantize(
        model, rules, packed=packed, method=method, implementation=implementation, observe=observe
    )
