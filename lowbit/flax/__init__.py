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

NNX and Linen differ in how sites are found, ops swapped and parameters held: one adapter per
API (:mod:`lowbit.flax.adapters`), picked once where a model enters, answers those questions
for the whole library (this package, :mod:`lowbit.ptq`, :mod:`lowbit.autoquant`).

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

from lowbit.flax import adapters, linen, nnx
from lowbit.flax._core import (
    ATTN_SCORES,
    ATTN_VALUES,
    Layout,
    Rule,
    Rules,
    Site,
    SiteGemm,
    observing,
    substituting,
)
from lowbit.flax.api import describe, pack, quantize, sites
from lowbit.flax.packing import Row, packed_nbytes, unpack
from lowbit.gemm.implementation import IMPLEMENTATIONS
from lowbit.io import CheckpointError, checkpoint, restore, save

__all__ = [
    "quantize",
    "describe",
    "sites",
    "pack",
    "unpack",
    "save",
    "restore",
    "packed_nbytes",
    "observing",
    "substituting",
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
    "adapters",
    "linen",
    "nnx",
    "checkpoint",
]
