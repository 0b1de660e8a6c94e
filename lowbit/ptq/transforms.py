"""Smoothing scales and low-rank branches, and what they change at a site (an Edit the
model's adapter applies): the transform its op applies and the folded weight it holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from lowbit.core import formats as _formats
from lowbit.core.hadamard import hadamard_transform
from lowbit.flax._core import Layout, Rules, Site, SiteTransform, weight_spec
from lowbit.flax.adapters import Edit
from lowbit.gemm.recipes import Recipe
from lowbit.ptq.sites import Model, as_model, kernel_leaf, model_sites, quantized_sites


@dataclasses.dataclass(frozen=True)
class Smoothing:
    """Per-site smoothing scales and (SVDQuant) low-rank branches of dense sites.

    Attributes:
      scales: site path -> float32 ``[K]``: the activation is divided by ``s``, the weight's
        input channel ``j`` multiplied by ``s_j`` (``x W = (x / s) (diag(s) W)``).
      alpha: site path -> the exponent ``a`` of ``s_j = max|X_j|^a / max|W_j|^(1 - a)``
        (None: the scales were given).
      lowrank: site path -> ``(L1 [K, r], L2 [r, N])`` (their dtype is what is stored), the
        high-precision branch; the quantized weight is the residual
        ``diag(s) W - L1 @ L2``.
      errors: site path -> the relative output error ``|y_q - y|^2 / |y|^2`` on the
        calibration rows with the chosen scales (and branch).
      rotations: site path -> float32 ``[b]`` signs of a block-wise Hadamard rotation of the
        (smoothed) activation: each block ``v`` of ``b`` inputs becomes ``H diag(signs) v``
        and the weight's input blocks likewise (MR-GPTQ; :func:`lowbit.ptq.rotation`). A
        site may be rotated without smoothing scales; not with a low-rank branch.
    """

    scales: dict[str, np.ndarray]
    alpha: dict[str, float | None] = dataclasses.field(default_factory=dict)
    lowrank: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    rotations: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def sites(self) -> list[str]:
        """Every site this transforms (smoothed, rotated or both)."""
        return sorted(set(self.scales) | set(self.rotations))

    @property
    def rank(self) -> int:
        return max((a.shape[1] for a, _ in self.lowrank.values()), default=0)

    def check(self, sites: list[Site], rules: Rules) -> None:
        """Every smoothed site must be a dense quantized site with a matching ``[K]``."""
        by_path = {s.path: s for s in sites}
        for path in self.sites():
            s = self.scales.get(path)
            site = by_path.get(path)
            if site is None:
                raise ValueError(
                    f"smoothing site {path!r} is not a quantized site of this model under these "
                    f"rules (its sites: {sorted(by_path)})"
                )
            dense = site.layout == Layout(0, 1) and len(site.shape) == 2
            if site.kind != "dot_general" or not dense:
                raise ValueError(
                    f"smoothing site {path!r} ({site.module}): smoothing needs a dense [K, N] "
                    f"weight (Linear / Dense), got kind {site.kind!r}, shape {site.shape}"
                )
            if s is not None and np.shape(s) != (site.shape[0],):
                raise ValueError(
                    f"smoothing site {path!r}: scales of shape {np.shape(s)}, expected "
                    f"({site.shape[0]},) (the weight {site.shape} of another model?)"
                )
            if path in self.rotations:
                b = np.shape(self.rotations[path])[0]
                if b not in (16, 32, 64, 128, 256) or site.shape[0] % b:
                    raise ValueError(
                        f"smoothing site {path!r}: a rotation of block {b} needs a power of two "
                        f"in 16..256 dividing the weight's {site.shape[0]} inputs"
                    )
                if path in self.lowrank:
                    raise ValueError(f"smoothing site {path!r}: a rotation and a low-rank "
                                     "branch at one site are not supported")
            if path in self.lowrank:
                a, b = self.lowrank[path]
                if a.shape[0] != site.shape[0] or b.shape[1] != site.shape[1]:
                    raise ValueError(
                        f"smoothing site {path!r}: low-rank factors {a.shape} x {b.shape} do not "
                        f"fit the weight {site.shape}"
                    )


def site_kernel(w: np.ndarray, path: str, smoothing: Smoothing | None, dtype) -> Any:
    """The weight a site holds: ``diag(s) W - L1 L2`` (as float32 math), its input blocks
    rotated where the site is, in ``dtype`` (None: the site is not transformed)."""
    if smoothing is None or path not in smoothing.sites():
        return None
    ws = np.asarray(w, np.float32)
    if path in smoothing.scales:
        ws = np.asarray(smoothing.scales[path], np.float32)[:, None] * ws
    if path in smoothing.lowrank:
        a, b = smoothing.lowrank[path]
        ws = ws - np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    ws = jnp.asarray(ws)
    if path in smoothing.rotations:
        signs = jnp.asarray(smoothing.rotations[path], jnp.float32)
        ws = hadamard_transform(ws, signs.shape[0], signs=signs, axis=0, method="butterfly")
    return ws.astype(dtype)


def site_transform(path: str, smoothing: Smoothing | None) -> SiteTransform | None:
    """The transform a smoothed (or rotated) site's op applies (None: none)."""
    if smoothing is None or path not in smoothing.sites():
        return None
    lowrank = smooth = rotate = None
    if path in smoothing.lowrank:
        lowrank = tuple(jnp.asarray(v) for v in smoothing.lowrank[path])
    if path in smoothing.scales:
        smooth = jnp.asarray(smoothing.scales[path], jnp.float32)
    if path in smoothing.rotations:
        rotate = jnp.asarray(smoothing.rotations[path], jnp.float32)
    return SiteTransform(smooth, lowrank, rotate)


def edits(m: Model, sites: list[Site], smoothing: Smoothing | None,
          recipe_of: Callable[[str], Recipe], kernels: dict[str, Any] | None = None) -> list[Edit]:
    """What a transformed model changes at each site: the recipe ``recipe_of(path)``, the
    smoothing transform, and the weight: ``kernels[path]`` when given, else the folded
    ``diag(s) W - L1 L2`` of a smoothed site, else its own."""
    out = []
    for site in sites:
        t = site_transform(site.path, smoothing)
        w = kernels.get(site.path) if kernels is not None else None
        if w is None and t is not None:
            k = kernel_leaf(m, site)
            w = site_kernel(k, site.path, smoothing, jnp.asarray(k).dtype)
        out.append(Edit(site, recipe_of(site.path), t, w))
    return out


def rotation(model, rules, *, block: int | None = None, smoothing: Smoothing | None = None,
             example=None) -> Smoothing:
    """Block-wise Hadamard rotations of every dense site ``rules`` quantize (MR-GPTQ's basis):
    ``smoothing`` (or no smoothing) with, per site, the signs (all +1: FP-Quant's plain
    Hadamard) of a rotation in blocks of ``block`` (default: the block of the site's weight
    format, 16 for NVFP4 and 32 for MX, as FP-Quant pairs them). The float model is unchanged
    (the activation and the weight's input blocks are rotated alike); calibrate with it
    (``calibrate(..., smoothing=rot, hessians=True)``) so that the static scales and the
    Hessians are the rotated activations'. Sites whose weight stays in high precision are
    not rotated."""
    m = as_model(model)
    rules = Rules.of(rules)
    sites = quantized_sites(model_sites(m, rules, example), rules)
    rotations = {}
    for site in sites:
        dense = site.kind == "dot_general" and site.layout == Layout(0, 1) and len(
            site.shape) == 2
        spec = weight_spec(rules.active(site.path), site.path)
        if not dense or spec is None:
            continue
        b = block or _formats.get(spec.format).block_size
        rotations[site.path] = np.ones(b, np.float32)
    base = smoothing or Smoothing(scales={})
    out = dataclasses.replace(base, rotations={**base.rotations, **rotations})
    out.check(sites, rules)
    return out

