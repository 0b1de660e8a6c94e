"""Post-training quantization of Flax models: calibration, smoothing, SVDQuant, packing.

The question this answers: what does a trained float model lose when cast to MXFP8 / MXFP6 /
MXFP4 / NVFP4 / MXINT8 (or to 4-bit weights only), and how much of it do calibration,
SmoothQuant / AWQ-style smoothing and SVDQuant's low-rank branch give back.

- :func:`calibrate` runs the float model over calibration batches and records, at every site
  the rules quantize, statistics of the site's activation operand (a :class:`Histogram` of
  ``|x|``, the per-channel max, a sample of rows), through hooks in the ``lowbit.flax`` ops
  (the model's own GEMMs report their operands; there is no second model). It returns a
  :class:`Calibration`: a static amax per site by ``"max"``, ``"percentile"``, ``"mse"`` or
  ``"entropy"`` (see :func:`lowbit.calibrate.amax`), JSON-serialisable.
- :func:`smooth` finds SmoothQuant / AWQ per-channel scales ``s_j = max|X_j|^a /
  max|W_j|^(1-a)`` (``a`` searched per site on the calibration data, minimizing the site's
  output error); :func:`svdquant` adds SVDQuant's high-precision low-rank branch. Both return
  a :class:`Smoothing`.
- :func:`quantize` builds the packed model (weights as :class:`lowbit.QArray`, through the
  same quantizers as :func:`lowbit.flax.pack`) with the calibrated static activation scales,
  the smoothing vectors and low-rank branches as parameters; :func:`simulate` the same model
  fake-quantized (float weights, quantized in every call), equal to it bit for bit.

What a calibrated amax does to an activation (``QuantSpec.amax``): NVFP4 takes it as its
static per-tensor scale (the E4M3 block scales stay dynamic, as hardware computes them);
per-tensor FP8 scales by ``elem_max / amax``; an MX format, whose E8M0 block scales are dynamic
by definition, clips to ``+-amax`` before block quantization (a no-op for ``"max"`` on the
calibration data). Attention score / value products (``attn_scores`` / ``attn_values``,
both operands activations) keep their dynamic scales and are not calibrated.

Grouped sites (``lb.ragged_dot``, an MoE's expert stack: ``lowbit.flax.nnx.GroupedLinear``,
Linen ``GroupedDense``) are calibrated over the rows in their groups, one static amax per
stack; GPTQ quantizes each expert from the Hessian of the tokens routed to it, each expert
packed as its own tensor. Smoothing, SVDQuant and rotations apply to dense sites only.

Models: an NNX module, or a Linen module bound to its variables (``module.bind(variables)``).
``forward(model, batch)`` runs the model when that is not simply ``model(batch)``.

>>> import jax, jax.numpy as jnp, lowbit.flax as lbf, lowbit.ptq as ptq
>>> from flax import nnx
>>> model = nnx.Sequential(nnx.Linear(64, 128, rngs=nnx.Rngs(0)), nnx.relu,
...                        nnx.Linear(128, 32, rngs=nnx.Rngs(1)))
>>> batches = [jax.random.normal(jax.random.key(i), (16, 64)) for i in range(4)]
>>> rules = [(".*", "qat_nvfp4")]
>>> cal = ptq.calibrate(model, rules, batches, "mse")
>>> sorted(cal.amax), cal.method, cal.batches
(['layers/0', 'layers/2'], 'mse', 4)
>>> served = ptq.quantize(model, rules, cal)  # packed weights, static activation scales
>>> y = nnx.jit(lambda m, x: m(x))(served, batches[0])
>>> bool(jnp.all(y == nnx.jit(lambda m, x: m(x))(ptq.simulate(model, rules, cal), batches[0])))
True
"""

from __future__ import annotations

from lowbit.ptq.build import bits_per_param, quantize, simulate
from lowbit.ptq.calibration import Calibration, calibrate, site_rules
from lowbit.ptq.sites import ALPHAS, MAX_ROWS, WEIGHT_METHODS
from lowbit.ptq.smoothing import smooth, svdquant
from lowbit.ptq.transforms import Smoothing, rotation

__all__ = [
    "Calibration",
    "Smoothing",
    "calibrate",
    "rotation",
    "smooth",
    "svdquant",
    "quantize",
    "simulate",
    "site_rules",
    "bits_per_param",
    "ALPHAS",
    "WEIGHT_METHODS",
    "MAX_ROWS",
]
