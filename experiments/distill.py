"""Quantization-aware distillation (QAD): a quantized student trained toward its float teacher's
output distribution.

``--config.train.distill_from=<run>`` (``TrainConfig.distill_from``): the student starts from
that run's checkpoint (``init_from`` defaults to it: the teacher is the float checkpoint the
student starts from) and trains under its recipe with the loss

    weight * T**2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - weight) * data loss

(``distill_weight``, default 1: distillation alone; ``distill_temperature`` T, default 1), the
teacher run as the float model of the same architecture, its logits held constant
(``stop_gradient``). The KL term is NVIDIA ModelOpt's ``LogitsDistillationLoss``
(NVIDIA/TensorRT-Model-Optimizer @ 2da2db9, ``modelopt/torch/distill/losses.py:30-69``):
``kl_div(log_softmax(s / T), softmax(t / T), reduction="batchmean")`` over the logits flattened
to ``[positions, classes]``, i.e. the mean over positions of ``sum_c p_t (log p_t - log p_s)``,
times ``T**2``; ModelOpt's QAD recipe for NVFP4 checkpoints trains with it alone (weight 1).
The data loss is the family's own (``loss_fn``: next-token cross-entropy and the MoE
balancing loss for the GPT); with ``distill_weight=1`` it is not computed, so an MoE student
then gets no balancing loss.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["kd_loss", "distill_objective"]


def kd_loss(student_logits: jax.Array, teacher_logits: jax.Array,
            temperature: float = 1.0) -> jax.Array:
    """``T**2`` times the mean over positions of ``KL(softmax(t / T) || softmax(s / T))``
    (float32; classes on the last axis, every other axis a position).

    >>> s = jnp.array([[0.0, 1.0], [2.0, 0.0]])
    >>> float(kd_loss(s, s))
    0.0
    """
    t = jnp.float32(temperature)
    log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / t, axis=-1)
    log_t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / t, axis=-1)
    p_t = jnp.exp(log_t)
    # kl_div's target * (log target - input), 0 where the target probability is 0
    kl = jnp.sum(jnp.where(p_t > 0, p_t * (log_t - log_s), 0.0), axis=-1)
    return jnp.mean(kl) * t * t


def distill_objective(loss_fn: Callable, model, teacher, batch: dict, temperature: float,
                      weight: float):
    """``(loss, metrics)`` of the student ``model`` distilled from ``teacher`` on ``batch``
    (module docstring): ``metrics["kd"]`` the distillation term, ``metrics["loss"]`` the
    objective (with ``weight < 1`` the family's metrics too, its cross-entropy as
    ``"data_loss"``)."""
    logits_s = model(batch["inputs"])[0]
    logits_t = jax.lax.stop_gradient(teacher(batch["inputs"])[0])
    kd = kd_loss(logits_s, logits_t, temperature)
    if weight >= 1.0:
        return kd, {"loss": kd, "kd": kd}
    data, metrics = loss_fn(model, batch)
    loss = weight * kd + (1.0 - weight) * data
    return loss, {**metrics, "data_loss": metrics["loss"], "loss": loss, "kd": kd}
