"""The post-training-quantized models: packed (quantize), fake-quantized (simulate), their bits."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import calibrate as _cal
from lowbit.bits import leaf_nbytes
from lowbit.core.qarray import QArray
from lowbit.flax._core import Layout, Rules, pack_weight, serving_recipe, weight_spec
from lowbit.flax.adapters import adapter_for
from lowbit.flax.packing import unpack
from lowbit.gemm.implementation import resolve
from lowbit.io.tree import is_qarray, keypath_str
from lowbit.ptq.calibration import Calibration, observe_batches, site_rules, with_amax
from lowbit.ptq.sites import (
    WEIGHT_METHODS,
    as_model,
    check_packable,
    kernel_value,
    model_sites,
    quantized_sites,
)
from lowbit.ptq.transforms import Smoothing, edits, rotation, site_kernel


def prepare(model, rules, calibration, smoothing, weights, example, where):
    if weights not in WEIGHT_METHODS:
        raise ValueError(f"{where}: unknown weights={weights!r}; valid: {WEIGHT_METHODS}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"{where}: calibration must be a Calibration, got {type(calibration)}")
    if smoothing is not None and not isinstance(smoothing, Smoothing):
        raise TypeError(f"{where}: smoothing must be a Smoothing, got {type(smoothing)}")
    m = as_model(model)
    rules = Rules.of(rules)
    if m.adapter.needs_example() and example is None:
        raise TypeError(
            f"{where}: a Linen model needs example= (inputs to trace its sites with, e.g. one "
            "calibration batch)"
        )
    sites = quantized_sites(model_sites(m, rules, example), rules)
    for s in sites:
        check_packable(s, rules.active(s.path))
    if calibration is not None:
        have = {s.path: s for s in sites}
        extra = sorted(set(calibration.amax) - set(have))
        missing = sorted(set(have) - set(calibration.amax))
        if extra or missing:
            of = f" ({calibration.model})" if calibration.model else ""
            raise ValueError(
                f"{where}: the calibration does not match this model and rules: sites "
                f"{missing} are not calibrated, calibrated sites {extra} are not in the model "
                f"(a calibration of another model{of}?)"
            )
        for p, s in have.items():
            shape = calibration.weights.get(p)
            if shape is not None and tuple(shape) != tuple(s.shape):
                raise ValueError(
                    f"{where}: site {p!r} has a weight of shape {tuple(s.shape)}, the calibration "
                    f"was made with {tuple(shape)} (a calibration of another model?)"
                )
    if smoothing is not None:
        smoothing.check(sites, rules)
    return m, rules, sites


def _site_hessians(calibration, smoothing, sites) -> dict[str, Any]:
    """site path -> the Hessian of the activation as the site's GEMM sees it: recorded under
    the same rotation, or rotated here (exact: the Hessian of ``x -> T x`` is ``T H T^T``)
    when only the weight is rotated and the calibration holds no static activation scale
    that the rotation would change."""
    rot = {} if smoothing is None else smoothing.rotations
    out = {}
    for site in sites:
        p = site.path
        h = calibration.hessians.get(p)
        had, want = calibration.rotations.get(p), (np.shape(rot[p])[0] if p in rot else None)
        if h is None or had == want:
            out[p] = h
            continue
        if had is not None or calibration.formats.get(p) is not None:
            raise ValueError(
                f"quantize: site {p!r} was calibrated with rotation {had} but is quantized with "
                f"rotation {want}: calibrate with the same transform (ptq.calibrate(..., "
                "smoothing=ptq.rotation(model, rules), hessians=True)) so that its static "
                "activation scale and Hessian are the rotated activation's"
            )
        signs = jnp.asarray(rot[p], jnp.float32)
        out[p] = _cal.rotate_hessian(h, want, signs) if want else h
    return out


def _gptq_weight(w, spec, layout: Layout, hessian, path: str, search=False) -> QArray:
    """GPTQ of a site's weight from its recorded Hessian, in the layout ``pack_weight`` gives
    (the weight's other axes flattened for GPTQ's columns, then put back)."""
    where = f"quantize: site {path!r}"
    if hessian is None:
        raise ValueError(f"{where} has no recorded Hessian: weights='gptq' needs "
                         "ptq.calibrate(..., hessians=True)")
    if spec.block_shape is not None and len(spec.block_shape) != 1:
        raise ValueError(f"{where}: weights='gptq' takes 1-D blocks along the contraction "
                         f"axis; its recipe tiles the weight {spec.block_shape}")
    w = jnp.asarray(w)
    k = w.shape[layout.axis]
    w2 = jnp.moveaxis(w, layout.axis, 0).reshape(k, -1)
    opts = {} if spec.scale_mode is None else {"scale_mode": spec.scale_mode}
    if spec.tensor_block is not None:
        opts["tensor_block"] = spec.tensor_block  # (gptq says it does not take it)
    try:
        q = _cal.gptq(w2, hessian, spec.format, axis=0, scale_search=search, **opts)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None
    std = pack_weight(w, spec, layout)
    return dataclasses.replace(std, codes=q.codes.reshape(std.codes.shape),
                               scales=q.scales.reshape(std.scales.shape))


def _packed_weight(w, spec, layout: Layout, weights: str, hessian=None, path="") -> QArray:
    if layout.stacked and weights != "max":
        return _stacked_weight(w, spec, layout, weights, hessian, path)
    if weights == "max":
        return pack_weight(w, spec, layout)
    if weights in ("gptq", "mr-gptq"):
        return _gptq_weight(w, spec, layout, hessian, path, search=weights == "mr-gptq")
    two_d = spec.block_shape is not None and len(spec.block_shape) == 2
    axis = (layout.axis, layout.other_axis) if two_d else layout.axis
    return _cal.block_scales(w, spec.format, "mse", axis=axis, block_shape=spec.block_shape)


def _stacked_weight(w, spec, layout: Layout, weights: str, hessian, path: str) -> QArray:
    """A stacked (grouped) weight ``[G, ...]``, each expert quantized as its own tensor (its
    own NVFP4 tensor scale, as ``lb.ragged_dot`` takes it) by ``weights``; GPTQ from the
    expert's own Hessian ``hessian[g]`` (the tokens routed to it). An expert that got no
    calibration token has a zero Hessian, which would zero its weight (GPTQ's dead inputs):
    it is rounded to nearest with the standard scales instead, with a warning."""
    if weights in ("gptq", "mr-gptq") and hessian is None:
        raise ValueError(f"quantize: site {path!r} has no recorded Hessian: weights='gptq' "
                         "needs ptq.calibrate(..., hessians=True)")
    if hessian is not None and np.shape(hessian)[0] != w.shape[0]:
        raise ValueError(f"quantize: site {path!r} holds {w.shape[0]} experts, its Hessian "
                         f"{np.shape(hessian)} (a calibration of another model?)")
    one = Layout(layout.axis - 1, None if layout.other_axis is None else layout.other_axis - 1)
    w = jnp.asarray(w)
    out, idle = [], []
    for g in range(w.shape[0]):
        h = None if hessian is None else hessian[g]
        if weights in ("gptq", "mr-gptq") and not np.any(np.diagonal(np.asarray(h))):
            idle.append(g)
            out.append(pack_weight(w[g], spec, one))
        else:
            out.append(_packed_weight(w[g], spec, one, weights, h, f"{path}[{g}]"))
    if idle:
        warnings.warn(f"quantize: site {path!r}: experts {idle} got no calibration token; "
                      f"their weights are rounded to nearest (weights={weights!r} needs the "
                      "tokens routed to an expert)", stacklevel=4)
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *out)


def _weights(m, sites, rules, smoothing, weights, hessians=None) -> dict[str, Any]:
    """site path -> the packed weight (QArray) of the transformed model; a weight-only
    recipe that keeps the weight in float too (then the float weight). ``hessians``: site
    path -> recorded input Hessian (``weights="gptq"``)."""
    out = {}
    for site in sites:
        spec = weight_spec(rules.active(site.path), site.path)
        w = kernel_value(m, site)
        folded = site_kernel(w, site.path, smoothing, jnp.float32)
        w = jnp.asarray(w) if folded is None else folded
        h = (hessians or {}).get(site.path)
        out[site.path] = w if spec is None else _packed_weight(w, spec, site.layout, weights,
                                                               h, site.path)
    return out


def quantize(
    model,
    rules,
    calibration: Calibration | None = None,
    *,
    weights: str = "max",
    smoothing: Smoothing | None = None,
    implementation: str | None = None,
    example=None,
    sequential: bool = False,
    batches=None,
    forward=None,
):
    """The post-training-quantized model: packed weights, static activation scales.

    Each site ``rules`` quantize gets its weight quantized once, as its recipe's forward
    quantizes it (the format, blocks along the contraction axis, 2-D tiles), into a
    :class:`lowbit.QArray` (``weights="max"``: the standard scales; ``"mse"``: per-block
    scale search, :func:`lowbit.calibrate.block_scales`; ``"gptq"``: GPTQ,
    :func:`lowbit.calibrate.gptq`, from the site's input Hessian that ``calibration`` recorded
    with ``hessians=True``; with ``smoothing``, calibrate with the same smoothing so that the
    Hessian is the smoothed activations'; ``"mr-gptq"``: MR-GPTQ, GPTQ with FP-Quant's scale
    search in a basis rotated by block-wise Hadamard transforms, :func:`lowbit.ptq.rotation`
    added to ``smoothing`` when it has none: the served sites rotate their activations
    online, and a recipe that quantizes activations with calibrated scales needs the
    calibration made under that rotation), and its activation quantized in
    every call with the calibrated static amax (``calibration``; None: dynamic scales, a
    direct cast). ``smoothing`` (:func:`smooth` / :func:`svdquant`): smoothed sites hold the
    folded weight ``diag(s) W - L1 L2`` (packed), the vector ``s`` and the branch as
    parameters. Sites no rule quantizes stay as they are.

    ``sequential=True`` (``"gptq"`` / ``"mr-gptq"``, QEP-style): the sites are quantized in
    the order the forward reaches them, each from the Hessian of its inputs as the model
    produces them with the sites before it already quantized (their quantized weights, float
    arithmetic), recorded again over ``batches`` (``forward(model, batch)`` runs the model,
    as for :func:`calibrate`; one pass over them per site).

    Returns, for an NNX model, a :class:`lowbit.flax.nnx.PackedModel` (call it like the
    model; ``nnx.state`` of it saves with :func:`lowbit.flax.save`); for a bound Linen module,
    the serving module bound to its packed variables (``module, variables = out.unbind()``;
    ``example=`` is then needed to trace the sites).

    Raises ``ValueError`` for a calibration or smoothing of another model (sites or shapes
    that do not match), an unknown ``weights`` method, or a recipe that cannot be packed.
    """
    smoothing = _mr_basis(model, rules, smoothing, weights, example)
    m, rules, sites = prepare(model, rules, calibration, smoothing, weights, example,
                              "quantize")
    hessians = _hessians(calibration, smoothing, sites, weights)
    if sequential:
        packed_w = _sequential_weights(m, sites, rules, smoothing, weights, hessians, batches,
                                       forward, example)
    else:
        packed_w = _weights(m, sites, rules, smoothing, weights, hessians)
    serving = _rebuild(m, sites, rules, calibration, smoothing, "serve", implementation)
    return m.adapter.served(serving, sites, packed_w)


def _sequential_weights(m, sites, rules, smoothing, weights, hessians, batches, forward,
                        example) -> dict[str, Any]:
    """:func:`_weights` site by site in model order, each site's Hessian recorded again with
    the sites before it holding their quantized weights."""
    if weights not in ("gptq", "mr-gptq"):
        raise ValueError(f"quantize: sequential=True is GPTQ's (weights='gptq' or 'mr-gptq'), "
                         f"got weights={weights!r}")
    if batches is None:
        raise ValueError("quantize: sequential=True records each site's Hessian again as the "
                         "quantized sites before it change its inputs: pass batches=")
    del hessians  # (checked by the caller) every Hessian is recorded again here
    batches = list(batches)
    out: dict[str, Any] = {}
    held: dict[str, Any] = {}  # site path -> the (dequantized) weight it holds now
    _, stats, _ = observe_batches(m, rules, batches, forward, smoothing, 0, example,
                                  hessians=True)
    order = {p: i for i, p in enumerate(stats)}  # the order the forward reaches the sites
    for i, site in enumerate(sorted(sites, key=lambda s: order[s.path])):
        if i:
            _, stats, _ = observe_batches(m, rules, batches, forward, smoothing, 0, example,
                                          hessians=True, kernels=held)
        h = {site.path: stats[site.path]["hess"]}
        w = _weights(m, [site], rules, smoothing, weights, h)[site.path]
        out[site.path] = w
        held[site.path] = unpack(w, jnp.float32) if isinstance(w, QArray) else w
    return out


def _mr_basis(model, rules, smoothing, weights, example):
    """``weights="mr-gptq"`` quantizes in MR-GPTQ's rotated basis: ``smoothing`` with
    :func:`lowbit.ptq.rotation`'s rotations added where it has none."""
    if weights != "mr-gptq" or (smoothing is not None and smoothing.rotations):
        return smoothing
    return rotation(model, rules, smoothing=smoothing, example=example)


def _hessians(calibration, smoothing, sites, weights):
    if weights not in ("gptq", "mr-gptq"):
        return None
    if calibration is None or not calibration.hessians:
        raise ValueError(f"quantize: weights={weights!r} needs a calibration with the sites' "
                         "input Hessians: ptq.calibrate(model, rules, batches, hessians=True)")
    return _site_hessians(calibration, smoothing, sites)


def _recipe_of(rules: Rules, calibration, mode: str):
    """site path -> the recipe its op runs: the rule's with the site's calibrated amax,
    in its serving form (``mode="serve"``: the weight enters pre-quantized)."""

    def recipe(path):
        amax = calibration.amax.get(path) if calibration is not None else None
        r = with_amax(rules.active(path), amax)
        return serving_recipe(r) if mode == "serve" else r

    return recipe


def _rebuild(m, sites, rules, calibration, smoothing, mode, implementation, kernels=None):
    """The transformed model (its adapter's :class:`~lowbit.flax.adapters.Bound`): the
    sites hold lowbit ops with their static amaxes and transforms, fake-quantizing
    (``mode="simulate"``) or serving (``"serve"``)."""
    return m.adapter.rebuild(
        m.bound,
        edits(m, sites, smoothing, _recipe_of(rules, calibration, mode), kernels),
        Rules.of(site_rules(rules, calibration)),
        packed=(mode == "serve"),
        observe=False,
        implementation=resolve(implementation),
    )


def simulate(
    model,
    rules,
    calibration: Calibration | None = None,
    *,
    weights: str = "max",
    smoothing: Smoothing | None = None,
    implementation: str | None = None,
    example=None,
):
    """The fake-quantized counterpart of :func:`quantize`: float (folded) weights quantized in
    every call by the sites' recipes with the calibrated static amaxes. Its outputs equal the
    packed model's bit for bit. With ``weights="mse"`` or ``"gptq"`` the weights it holds are
    the searched (or GPTQ's) QArrays dequantized, entering their GEMMs as they are (a
    standard-scale requantization would undo the search). Returns an NNX model, or a bound
    Linen module."""
    smoothing = _mr_basis(model, rules, smoothing, weights, example)
    m, rules, sites = prepare(model, rules, calibration, smoothing, weights, example,
                              "simulate")
    kernels = None
    searched = weights in ("mse", "gptq", "mr-gptq")
    if searched:
        kernels = m.adapter.simulated_weights(_weights(
            m, sites, rules, smoothing, weights, _hessians(calibration, smoothing, sites,
                                                           weights)))
    mode = "serve" if searched else "simulate"
    return m.adapter.finish(
        _rebuild(m, sites, rules, calibration, smoothing, mode, implementation, kernels)
    )


# --------------------------------------------------------------------------------------------
# Bits


def bits_per_param(packed) -> dict[str, float]:
    """Storage of a :func:`quantize`'d model, in bits per parameter.

    Returns ``{"weights": ..., "model": ...}``: ``"weights"`` over the quantized sites'
    weights (QArray codes and scales, plus any smoothing vectors and low-rank branches,
    divided by the number of weight elements), ``"model"`` over every parameter (other
    leaves in their dtype's bits), divided by the float model's parameter count."""
    adapter = adapter_for(packed)
    tree = adapter.packed_params(packed)
    q_bits = q_n = extra = total_bits = total_n = 0.0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_qarray)[0]:
        names = keypath_str(keypath)
        bits = 8.0 * leaf_nbytes(leaf)  # what the leaf holds: measured, not a spec's count
        if is_qarray(leaf):
            n = math.prod(leaf.shape)
            q_bits, q_n = q_bits + bits, q_n + n
        else:
            n = math.prod(np.shape(leaf))
            last = names[-1] if names else ""
            if last in adapter.transform_params:
                extra += bits
                total_bits += bits
                continue
        total_bits, total_n = total_bits + bits, total_n + n
    return {
        "weights": (q_bits + extra) / q_n if q_n else float("nan"),
        "model": total_bits / total_n if total_n else float("nan"),
    }
