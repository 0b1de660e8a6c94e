"""Model families: what the training loop needs of a model, its data and its metrics.

Model families (``config.family``; a config without the key is ``"gpt"``):

=========  ================================  ==========================================
family     model, loss (``model`` section)   data (``data`` section), validation metrics
=========  ================================  ==========================================
``gpt``    :class:`experiments.model.GPT`    :mod:`experiments.data` byte-level text;
           (``configs/gpt.py``)              ``val_loss`` (nats per byte)
``vit``    :class:`experiments.vision.ViT`   :mod:`experiments.vision` scikit-learn
           (``configs/digits.py``)           digits; ``val_loss``, ``val_accuracy``
=========  ================================  ==========================================

"Tokens" are what the transformer reads: bytes for GPT, patches for the ViT (16 an image).
Each method takes the run's :class:`experiments.config.RunConfig` as ``cfg``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments import data as data_lib
from experiments import vision
from experiments.model import GPT, GPTConfig
from experiments.model import loss_fn as gpt_loss_fn

__all__ = ["Family", "GPTFamily", "ViTFamily", "FAMILIES", "DEFAULT_FAMILY"]


class Family:
    """One model family: its config sections, model, loss, data, evaluation and GEMM shapes.
    The loop calls only these methods; the instances are :data:`FAMILIES`."""

    name: str
    model_config: type  # the dataclass of the ``model`` section
    data_config: type  # the dataclass of the ``data`` section
    model_cls: type  # model_cls(cfg.model, rngs=...) -> nnx.Module, (logits, aux) = m(inputs)
    loss_fn: Callable  # (model, batch) -> (loss, metrics with "loss")

    def load(self, cfg, log: Callable[[str], None]):
        """The data set (both splits and a ``fingerprint``)."""
        raise NotImplementedError

    def batches(self, cfg, dataset, state: dict | None = None):
        """The training batch stream (``next()``, ``state()``), restored from ``state``."""
        raise NotImplementedError

    def eval_batches(self, cfg, dataset, max_batches: int) -> list[dict]:
        raise NotImplementedError

    def eval_batch(self, model: nnx.Module, batch: dict) -> dict[str, jax.Array]:
        """Per-batch validation outputs (jittable), with the batch's mean loss as "loss"."""
        raise NotImplementedError

    def reduce(self, outs: list[dict]) -> dict[str, float]:
        """The validation metrics (``val_loss``, ...) from the outputs of every eval batch."""
        raise NotImplementedError

    def tokens_per_example(self, m) -> int:
        raise NotImplementedError

    def contraction_axes(self, cfg) -> tuple[list, list]:
        """``(features, tokens)``: ``(name, length)`` of the axes that the quantized GEMMs
        contract, in the forward and input gradient (features) and in the weight gradient
        (tokens)."""
        raise NotImplementedError


class GPTFamily(Family):
    name = "gpt"
    model_config = GPTConfig
    data_config = data_lib.DataConfig
    model_cls = GPT
    loss_fn = staticmethod(gpt_loss_fn)

    def load(self, cfg, log):
        return data_lib.load(cfg.data, log=log)

    def batches(self, cfg, dataset, state=None):
        kw = dict(batch_size=cfg.train.batch_size, seq_len=cfg.model.seq_len, seed=cfg.seed)
        if state is None:
            return data_lib.Batches(dataset.train, **kw)
        return data_lib.Batches.restore(dataset.train, state, **kw)

    def eval_batches(self, cfg, dataset, max_batches):
        return data_lib.eval_batches(
            dataset.val,
            batch_size=cfg.train.batch_size,
            seq_len=cfg.model.seq_len,
            max_batches=max_batches,
        )

    def eval_batch(self, model, batch):
        logits_BTV, _ = model(batch["inputs"])
        ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
        return {"loss": jnp.mean(ce_BT)}

    def reduce(self, outs):
        # (full batches of one size: the mean of the batch means)
        return {"val_loss": float(np.mean([float(o["loss"]) for o in outs]))}

    def tokens_per_example(self, m):
        return m.seq_len

    def contraction_axes(self, cfg):
        m = cfg.model
        features = [("model.d_model", m.d_model), ("model.d_model * model.mlp_ratio", m.d_ff)]
        tokens = [("model.seq_len", m.seq_len)]
        # capacity experts' weight gradients contract the capacity axis (lb.ragged_dot pads
        # each dropless expert's rows to its blocks itself)
        if m.mlp == "moe" and m.moe_impl == "capacity":
            tokens.append(("model.capacity_multiple", m.capacity_multiple))
        return features, tokens


class ViTFamily(Family):
    name = "vit"
    model_config = vision.ViTConfig
    data_config = vision.DigitsDataConfig
    model_cls = vision.ViT
    loss_fn = staticmethod(vision.loss_fn)

    def load(self, cfg, log):
        return vision.load(cfg.data, log=log)

    def batches(self, cfg, dataset, state=None):
        kw = dict(batch_size=cfg.train.batch_size, seed=cfg.seed)
        if state is None:
            return vision.Batches(dataset.train, **kw)
        return vision.Batches.restore(dataset.train, state, **kw)

    def eval_batches(self, cfg, dataset, max_batches):
        return vision.eval_batches(
            dataset.val, batch_size=cfg.train.batch_size, max_batches=max_batches
        )

    def eval_batch(self, model, batch):
        logits_BC, _ = model(batch["inputs"])
        sums = vision.batch_sums(logits_BC, batch)
        return {"loss": sums["loss_sum"] / sums["count"], **sums}

    def reduce(self, outs):
        # Sums over examples (the last batch is padded, its padding weighted 0), in float64.
        total = {k: math.fsum(float(o[k]) for o in outs) for k in ("loss_sum", "correct", "count")}
        return {
            "val_loss": total["loss_sum"] / total["count"],
            "val_accuracy": total["correct"] / total["count"],
        }

    def tokens_per_example(self, m):
        return m.num_patches

    def contraction_axes(self, cfg):
        m, q = cfg.model, cfg.quant
        features = [("model.d_model", m.d_model), ("model.d_model * model.mlp_ratio", m.d_ff)]
        if not (q.high_precision and re.fullmatch(q.high_precision, "embed")):
            features.append(("model.patch ** 2 * model.channels", m.patch_dim))
        # The linear layers see [batch * patches, features]: a weight gradient contracts all
        # the patch tokens of a batch.
        tokens = [("train.batch_size * model.num_patches", cfg.train.batch_size * m.num_patches)]
        return features, tokens


FAMILIES: dict[str, Family] = {f.name: f for f in (GPTFamily(), ViTFamily())}
"""The model families by ``config.family`` name (see the module docstring)."""

DEFAULT_FAMILY = "gpt"  # what a config (or an older run's config.json) without "family" is
