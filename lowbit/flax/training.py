"""Training-state methods of low-bit training that act across steps, for any model quantized
through :mod:`lowbit.flax`: TetraJet-v2's OsciReset and OutControl (arXiv:2510.27527, code:
thu-ml/TetraJet-v2-NVFP4Training @ ca5953f6, ``olmo2-training/olmo/quantization_real/``).

- :func:`osci_reset` wraps an optax optimizer. Every ``period`` updates it snapshots the latent
  weights, sums over the next ``window`` updates how far each weight's quantized value moved
  (``sum |dQ(w)|``) and how far the weight moved (``sum |dw|``), and one update later sets
  every weight whose ratio reaches ``threshold`` to its quantized value: a weight that sits
  on a rounding boundary flips its quantized value back and forth while barely moving
  (oscillation), and the reset takes it off the boundary. Its state is optax state: saved,
  restored and sharded with the optimizer's. Parameters only (NNX ``State`` or Linen
  dicts); :func:`weight_quantizer` gives the ``Q`` of a model's quantized kernels.
- OutControl (:func:`out_control`, NNX models): a dense site records the L2 norm of each input
  channel of its activation over a window of steps, then runs the channels with the largest
  recorded norms (a ``ratio`` of them, rounded up to a ``multiple``) under a second recipe
  (``tetrajet2_fp8``: MXFP8) and the rest under its own. The state (recorded norms, chosen
  channels, switches) is NNX state of the site's op, held beside the quantizer's rng stream,
  so it is saved and restored with the model; :func:`start_recording` and
  :func:`select_channels` are the trainer's two hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lowbit.flax._core import Rules
from lowbit.flax.api import sites as _sites
from lowbit.flax.nnx import DotGeneral, OutControlState
from lowbit.flax.packing import layouts_of, pack_params, unpack
from lowbit.gemm import recipes as _recipes
from lowbit.io.tree import path_str

__all__ = [
    "OsciResetState",
    "osci_reset",
    "weight_quantizer",
    "OutControlState",
    "out_control",
    "start_recording",
    "select_channels",
    "outlier_width",
]


# --------------------------------------------------------------------------------------------
# OsciReset


def weight_quantizer(model, rules, *example_inputs) -> Callable[[Any], Any]:
    """``Q(params)``: every kernel that ``rules`` quantize replaced by its forward-quantized
    value (the weight spec of its site's recipe, along its site's contraction axis, as
    :func:`lowbit.flax.pack` lays it out), every other leaf as it is. ``model`` and
    ``example_inputs`` as :func:`lowbit.flax.sites` takes them (NNX: the model; Linen: the
    float module and example inputs); the function takes a parameter tree of the model (an
    NNX ``State`` of its ``Param`` s, or Linen variables ``{"params": ...}``) and is
    jittable. TetraJet-v2's oscillation tracking quantizes the weights this way
    (``oscillation_reset.py:95-107``: ``quant_fp4(w, 0)``, the forward's NVFP4 quantizer,
    round-to-nearest)."""
    rules = Rules.of(rules)
    layouts = layouts_of(_sites(model, rules, *example_inputs))

    def quantize(params):
        return unpack(pack_params(params, rules, layouts))

    return quantize


class OsciResetState(NamedTuple):
    """:func:`osci_reset`'s optimizer state: the inner optimizer's, the number of updates so
    far, the latent weights at the last tracked update, the two running distances, and the
    number of weights the last reset set to their quantized value."""

    inner: Any
    count: jax.Array
    prev: Any
    dist_q: Any
    dist_w: Any
    last_reset: jax.Array


def osci_reset(
    inner: optax.GradientTransformation,
    quantizer: Callable[[Any], Any],
    *,
    period: int = 1000,
    window: int = 50,
    threshold: float = 16.0,
    start: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """TetraJet-v2's OsciReset around the optimizer ``inner``; ``update`` needs ``params``.

    With ``i`` the number of updates before the current one (TetraJet-v2's ``iter_num``,
    ``global_step - 1`` after the step, ``train.py:1243-1252``), once ``i >= start``
    (``calibrate.py:55-74``, ``detect_type="distance_ratio"``):

    - ``i % period == 0``: the updated weights become the snapshot ``w_prev`` and both
      distances restart at 0 (``quant_weight_dist_init_snapshots``);
    - ``1 <= i % period <= window``: ``dist_q += |Q(w) - Q(w_prev)|``,
      ``dist_w += |w - w_prev|`` and ``w_prev = w`` (``quant_weight_dist_track``);
    - ``i % period == window + 1``: where ``dist_q / dist_w >= threshold`` (the ratio is 0
      where ``dist_w == 0``) the updated weight is replaced by ``Q(w)``
      (``fp4_elements_centralize_DistRatio``, ``oscillation_reset.py:130-160``).

    ``w`` is always the weight after the current update, ``Q`` is ``quantizer`` (e.g.
    :func:`weight_quantizer`); leaves it leaves unchanged never reset (their ``dist_q`` is 0).
    The reset is returned as an update, ``Q(w) - p``, which ``optax.apply_updates`` turns
    back into ``Q(w)`` exactly wherever ``Q(w)`` lies within a factor 2 of ``p`` (Sterbenz)
    or is 0, i.e. for every FP4 or FP8 rounding of a weight. Defaults are TetraJet-v2's
    (``olmo/config.py:960-975``: period 1000, window 50, threshold 16); its released
    configs use period 200, window 50, threshold 8 from step 15000 of 25500.
    """
    if window < 1:
        raise ValueError(f"osci_reset: window must be >= 1, got {window}")
    if period < window + 2:
        raise ValueError(
            f"osci_reset: period must be >= window + 2 (a snapshot, {window} tracked updates "
            f"and the reset), got period={period} with window={window}"
        )
    if not threshold > 0:
        raise ValueError(f"osci_reset: threshold must be > 0, got {threshold}")
    if start < 0 or start % period:
        raise ValueError(
            f"osci_reset: start must be a multiple of period={period} (the first snapshot), "
            f"got {start}"
        )

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return OsciResetState(
            inner.init(params), jnp.zeros((), jnp.int32), params, zeros, zeros,
            jnp.zeros((), jnp.int32),
        )

    def update(updates, state: OsciResetState, params=None, **extra):
        if params is None:
            raise ValueError("osci_reset: update needs params (tx.update(grads, state, params))")
        u, inner_state = inner.update(updates, state.inner, params, **extra)
        new = optax.apply_updates(params, u)
        i = state.count
        phase = i % period
        on = i >= start
        branch = jnp.where(
            on & (phase == 0), 1,
            jnp.where(on & (phase >= 1) & (phase <= window), 2,
                      jnp.where(on & (phase == window + 1), 3, 0)),
        )
        branches = _osci_branches(u, state, params, new, quantizer, threshold)
        u, prev, dq, dw, last = jax.lax.switch(branch, branches)
        return u, OsciResetState(inner_state, i + 1, prev, dq, dw, last)

    return optax.GradientTransformationExtraArgs(init, update)


def _osci_branches(u, state: OsciResetState, params, new, quantizer, threshold: float):
    """:func:`osci_reset`'s four cases after an update ``u`` (``new = params + u``): idle,
    snapshot, track, reset; each returns ``(update, prev, dist_q, dist_w, last_reset)``."""
    zeros = jax.tree.map(jnp.zeros_like, params)

    def idle():
        return u, state.prev, state.dist_q, state.dist_w, state.last_reset

    def snapshot():
        return u, new, zeros, zeros, state.last_reset

    def track():
        q_new, q_prev = quantizer(new), quantizer(state.prev)
        dq = jax.tree.map(lambda d, a, b: d + jnp.abs(a - b), state.dist_q, q_new, q_prev)
        dw = jax.tree.map(lambda d, a, b: d + jnp.abs(a - b), state.dist_w, new, state.prev)
        return u, new, dq, dw, state.last_reset

    def reset():
        q_new = quantizer(new)

        def one(p, w, q, dq, dw):
            ratio = jnp.where(dw == 0, 0.0, dq / jnp.where(dw == 0, 1.0, dw))
            mask = ratio >= threshold
            # a leaf Q leaves as it is (not quantized) is not counted
            n = jnp.where(jnp.any(q != w), jnp.sum(mask, dtype=jnp.int32), 0)
            return jnp.where(mask, q - p, w - p), n

        pairs = jax.tree.map(one, params, new, q_new, state.dist_q, state.dist_w)
        treedef = jax.tree.structure(params)
        flat = treedef.flatten_up_to(pairs)
        u2 = treedef.unflatten([a for a, _ in flat])
        count = sum((n for _, n in flat), jnp.zeros((), jnp.int32))
        return u2, state.prev, zeros, zeros, count

    return idle, snapshot, track, reset


# --------------------------------------------------------------------------------------------
# OutControl


def outlier_width(k: int, ratio: float, multiple: int = 128) -> int:
    """How many of ``k`` input channels OutControl runs in FP8: ``ratio * k`` rounded up to a
    ``multiple``, at most ``k`` rounded down to one (``linear_mix.py:62-65``:
    ``min(k // 128 * 128, (int(k * ratio) + 127) // 128 * 128)``; TetraJet-v2 notes that its
    paper's simulated results used ``round(ratio * k)`` instead)."""
    return min(k // multiple * multiple, (int(k * ratio) + multiple - 1) // multiple * multiple)


def _dense_ops(model: nnx.Module):
    """``(path, module, op, K)`` of every dense layer whose ``dot_general`` is lowbit's."""
    for path, m in nnx.iter_modules(model):
        op = getattr(m, "dot_general", None)
        kernel = getattr(m, "kernel", None)
        if not isinstance(op, DotGeneral) or op.recipe.is_identity or kernel is None:
            continue
        if kernel.ndim != 2:
            continue
        yield path_str(path), m, op, int(kernel.shape[0])


def out_control(
    model: nnx.Module,
    *,
    ratio: float = 0.02,
    multiple: int = 128,
    recipe: str | _recipes.Recipe = "tetrajet2_fp8",
    paths: str | None = None,
) -> list[tuple[str, int, int]]:
    """Give every quantized dense site of ``model`` (NNX; ``paths``: a regex the site path
    must fullmatch, None: all) OutControl's state: ``outlier_width(K, ratio, multiple)`` of
    its ``K`` input channels will run under ``recipe`` once :func:`select_channels` has
    chosen them, the others under the site's own recipe. Until then the site computes what
    it computed before. Returns ``(path, K, width)`` per site; a site whose width is 0 (``K``
    below ``multiple``) or ``K`` keeps its recipe alone and is listed with its width.

    TetraJet-v2 (``linear_mix.py:115-250``): the outlier channels' GEMMs run in MXFP8, the
    others in its NVFP4; the channels of each part are gathered in the order of their
    recorded norms (largest first), so the NVFP4 blocks group channels of similar norm.
    Defaults are its code's (ratio 0.02, record from step 1 for 10 steps,
    ``olmo/config.py:946-957``); its released configs use ratio 0.1, recorded from step 501
    for 50 steps."""
    import re

    if not isinstance(model, nnx.Module):
        raise TypeError(
            "out_control: expected an NNX model quantized by lowbit.flax.quantize, got "
            f"{type(model).__name__} (Linen sites hold no OutControl state; osci_reset works "
            "on Linen parameters)"
        )
    fp8 = _recipes.get(recipe)
    if not 0 < ratio < 1:
        raise ValueError(f"out_control: ratio must be in (0, 1), got {ratio}")
    if multiple < 1 or multiple % 32:
        raise ValueError(
            f"out_control: multiple must be a positive multiple of 32 (MX blocks), got {multiple}"
        )
    out = []
    for path, _, op, k in _dense_ops(model):
        if paths is not None and not re.fullmatch(paths, path):
            continue
        width = outlier_width(k, ratio, multiple)
        out.append((path, k, width))
        if width in (0, k):
            continue
        if fp8.needs_key and op.stream is None:
            raise ValueError(
                f"out_control: recipe {fp8.name!r} needs keys but site {path!r} (recipe "
                f"{op.recipe.name!r}) has no 'quant' rng stream"
            )
        op.out_control = fp8.name
        op.oc_norms = OutControlState(jnp.zeros((k,), jnp.float32))
        op.oc_recording = OutControlState(jnp.zeros((), bool))
        op.oc_active = OutControlState(jnp.zeros((), bool))
        op.oc_outliers = OutControlState(jnp.arange(width, dtype=jnp.int32))
        op.oc_inliers = OutControlState(jnp.arange(width, k, dtype=jnp.int32))
    return out


def _ops(model: nnx.Module):
    for path, m in nnx.iter_modules(model):
        if isinstance(m, DotGeneral) and m.out_control is not None:
            yield path_str(path), m


def start_recording(model: nnx.Module) -> int:
    """From the next call on, every OutControl site adds the L2 norm of each input channel of
    its activation (over all tokens of the call) to its recorded norms, which restart at 0
    (``start_channel_outlier_accumulate``). Returns the number of sites."""
    n = 0
    for _, op in _ops(model):
        op.oc_norms.set_value(jnp.zeros_like(op.oc_norms.get_value()))
        op.oc_recording.set_value(jnp.ones((), bool))
        n += 1
    return n


def select_channels(model: nnx.Module) -> dict[str, jax.Array]:
    """Stop recording; on each OutControl site choose the channels with the largest recorded
    norms as its outliers (``sync_channel_accumulate_and_update_idx``: a descending sort,
    the first ``width`` outliers, the rest in that order) and switch the split on. Returns
    ``{op path: outlier channel indices}``."""
    chosen = {}
    for path, op in _ops(model):
        width = op.oc_outliers.get_value().shape[0]
        order = jnp.argsort(-op.oc_norms.get_value(), stable=True).astype(jnp.int32)
        op.oc_outliers.set_value(order[:width])
        op.oc_inliers.set_value(order[width:])
        op.oc_recording.set_value(jnp.zeros((), bool))
        op.oc_active.set_value(jnp.ones((), bool))
        chosen[path] = order[:width]
    return chosen
