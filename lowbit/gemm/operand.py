"""One GEMM operand: Hadamard transform and quantization along the GEMM's contraction axis.

The layer between the quantizers (``lowbit.core.qarray``) and the GEMM implementations
(``lowbit.dot_general``'s XLA emulation, ``pallas_kernels.quantized_gemm``): every GEMM of a
recipe prepares each operand here, so the emulation and the kernels quantize from the same
definition. ``native`` (default True) lets the compiled CPU kernel (``lowbit.core.native``) run the
quantizer, with the Hadamard transform fused into it, where it applies; ``native=False`` is the
pure-XLA reference (``implementation="xla"``).

>>> import jax.numpy as jnp
>>> from lowbit.gemm.operand import quantize_operand
>>> from lowbit.gemm.recipes import QuantSpec
>>> quantize_operand(jnp.array([[0.3, -1.7, 5.0, 100.0] * 8]), QuantSpec("mxfp4"), 1, 0,
...                  None)[0, :4].tolist()
[0.0, -0.0, 8.0, 96.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.core import formats as _formats
from lowbit.core import hadamard as _hadamard
from lowbit.core import qarray as _qa
from lowbit.core.numerics import exponent, ieee_div, materialize, pow2, round_to_grid, uniform_bits
from lowbit.core.plan import Plan, make_plan
from lowbit.core.scales import pow2_tensor_amax
from lowbit.gemm.recipes import GEMMS, GemmSpec, QuantSpec

__all__ = [
    "quantize_operand",
    "spec_plan",
    "unpack_operand",
    "prepare_operand",
    "hadamard_along",
    "gemm_signs",
    "fold_key",
    "barrier",
    "clip_to_rms",
    "apply_static_amax",
    "std_scaled_quantize",
    "scaled_fake_quantize",
    "through_forward",
    "unrotated",
]

_TENSOR_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2, "int8": jnp.int8}


def fold_key(key, *tags):
    """uint32[2] key data folded with ``tags`` (None stays None): one stream per use."""
    if key is None:
        return None
    k = jax.random.wrap_key_data(key)
    for t in tags:
        k = jax.random.fold_in(k, t)
    return jax.random.key_data(k)


def gemm_signs(gemm: GemmSpec, key, tag: int):
    """The random Hadamard signs of one GEMM (None: no Hadamard, or fixed +1 signs), drawn from
    ``key`` folded with ``1000 + tag`` (a fixed key when the call has none); ``tag`` is the
    GEMM's index in ``recipes.GEMMS``, or that of the GEMM named by ``gemm.signs_of``."""
    if not gemm.hadamard or not gemm.random_signs:
        return None
    if gemm.signs_of is not None:
        tag = GEMMS.index(gemm.signs_of)
    k = fold_key(key, 1000 + tag) if key is not None else jax.random.key_data(jax.random.key(0))
    return _hadamard.random_signs(jax.random.wrap_key_data(k), gemm.hadamard)


def barrier(x):
    """Make XLA compute ``x`` once, before the quantizers that read it (without this, XLA
    fuses the producer of an operand, a GELU or a layer-norm backward, into every quantizer
    fusion that reads it and recomputes it there; measured on the bench_step FQT step on CPU:
    mxfp4 1.29x -> 1.02x of the unquantized step in CPU time, identical losses)."""
    return materialize(x)[0]


def _check_hadamard_length(x, axis: int, block: int) -> None:
    if x.shape[axis] % block:
        raise ValueError(
            f"a Hadamard transform of block {block} along an axis of length {x.shape[axis]}: "
            f"the length must be a multiple of {block}"
        )


def hadamard_along(x, axis: int, block: int, signs, *, inverse: bool = False):
    """``hadamard_transform`` of ``x`` along ``axis`` with a clear error for a bad length."""
    _check_hadamard_length(x, axis, block)
    return _hadamard.hadamard_transform(x, block, signs=signs, axis=axis, inverse=inverse)


def _scaled_quantize(x, spec: QuantSpec, key, axis: int, tensor_amax=None):
    """Float32-scaled elements (``granularity="tensor"``: one scale; ``"row"``: one per slice
    along ``axis``). FP8: current scaling as in Transformer Engine, ``s = elem_max / amax``
    (1 for an all-zero tensor). ``"int8"``: BitNet b1.58's ``activation_quant``,
    ``s = 127 / max(amax, 1e-5)``. Elements ``round(clip(x * s))``. Returns the elements and
    ``s`` (float32, keepdims along ``axis`` for rows); :func:`_scaled_values` dequantizes.
    ``tensor_amax``: a given per-tensor amax in place of ``x``'s own (a static ``spec.amax``
    still wins)."""
    elem = _formats.tensor_element(spec.format)
    if spec.granularity == "row":
        amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    elif spec.amax is not None:
        amax = jnp.float32(spec.amax)
    elif tensor_amax is not None:
        amax = jnp.asarray(tensor_amax, jnp.float32)
    else:
        amax = jnp.max(jnp.abs(x))
    s = _scale_of(amax, elem)
    v = x * s
    if spec.prescale != 1.0:
        v = v * np.float32(spec.prescale)
    v = jnp.clip(v, -elem.max, elem.max)
    rbits = uniform_bits(key, x.shape) if spec.stochastic else None
    return round_to_grid(v, elem, rbits=rbits), s


def _scale_of(amax, elem):
    if elem.is_int:
        return ieee_div(np.float32(elem.max), jnp.maximum(amax, np.float32(_qa.ABSMEAN_FLOOR)))
    return jnp.where(amax > 0, np.float32(elem.max) / amax, np.float32(1.0))


def scaled_fake_quantize(x, fmt: str, amax) -> jax.Array:
    """``x`` (float32) quantized with one float32 scale from the given ``amax`` (a scalar, or
    an array that broadcasts against ``x``), as ``granularity="tensor"`` specs of element
    format ``fmt`` (``"e4m3"``, ``"e5m2"``, ``"int8"``) compute it; calibration
    (:mod:`lowbit.calibrate`) evaluates candidate amaxes with it."""
    elem = _formats.tensor_element(fmt)
    s = _scale_of(amax, elem)
    v = round_to_grid(jnp.clip(x * s, -elem.max, elem.max), elem)
    return _scaled_values(v, s, fmt)


def _scaled_values(v, s, fmt: str):
    """float32 values of :func:`_scaled_quantize`'s elements ``v`` and scale ``s`` for
    element format ``fmt``: ``v / s`` for int8 (BitNet's division), ``v * (1 / s)`` for FP8."""
    if _formats.tensor_element(fmt).is_int:
        return ieee_div(v.astype(jnp.float32), s)
    return v.astype(jnp.float32) * (np.float32(1.0) / s)


def apply_static_amax(x, spec: QuantSpec):
    """A block spec's static amax (``QuantSpec.amax``): ``(x, tensor_amax)`` for the
    quantizer. NVFP4 takes it as its tensor amax (``x`` unchanged); an MX format clips ``x`` to
    ``+-amax`` (tensor_amax None). Per-tensor specs and specs without one: ``(x, None)``."""
    if spec.amax is None or spec.granularity != "block":
        return x, None
    a = np.float32(spec.amax)
    if _formats.get(spec.format).tensor_scale:
        return x, a
    return jnp.clip(x, -a, a), None


def clip_to_rms(x, spec: QuantSpec, axis: int):
    """``x`` clipped to ``+-spec.clip_rms * RMS`` along ``axis`` (QuEST); unchanged when the
    spec has no ``clip_rms``. The kernels' path runs the same operations (the same bits)."""
    if spec.clip_rms is None:
        return x
    rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=axis, keepdims=True))
    bound = np.float32(spec.clip_rms) * rms
    return jnp.clip(x, -bound, bound)


def std_scaled_quantize(x, spec: QuantSpec, axis: int, key=None):
    """QuEST's quantizer (``spec.scale_std``): fake-quantized float32 values and the trust
    mask (True where ``|x / scale| < elem_max``), both shaped like ``x``.

    Blocks of the format's size run along ``axis``. Per block: ``std`` over its elements
    (population, ``sqrt(E[x^2] - E[x]^2)``, 1 where rounding makes that negative), scale
    ``2**floor(log2(scale_std / elem_max * std + 1e-8))`` (the exponent read from the float32
    bits, exact), elements ``x / scale`` (exact for a power of two) times ``spec.prescale``,
    rounded onto the grid (nearest-even, or stochastic from ``key``) with saturation at the
    grid's max, values ``elements * scale / prescale``. The QuEST code rounds ties towards zero;
    ties have probability zero for real-valued data.
    """
    fmt = _formats.get(spec.format)
    elem, b = fmt.elem, fmt.block_size
    n = x.shape[axis]
    if n % b:
        raise ValueError(
            f"scale_std quantizes blocks of {b} along an axis of length {n}: the length must "
            f"be a multiple of {b}"
        )
    v = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    shape = v.shape
    vb = v.reshape(*shape[:-1], n // b, b)
    mean = jnp.mean(vb, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(vb), axis=-1, keepdims=True) - jnp.square(mean)
    std = jnp.where(var >= 0, jnp.sqrt(jnp.maximum(var, 0)), np.float32(1.0))
    target = np.float32(spec.scale_std / elem.max) * std + np.float32(1e-8)
    scale = pow2(jnp.clip(exponent(target), -126, 126))
    scaled = ieee_div(vb, scale)
    mask = jnp.abs(scaled) < np.float32(elem.max)
    if spec.prescale != 1.0:
        scaled = scaled * np.float32(spec.prescale)
    rbits = uniform_bits(key, scaled.shape) if spec.stochastic else None
    q = round_to_grid(scaled, elem, rbits=rbits, saturate=True) * scale
    q = _qa.undo_prescale(q, spec.prescale)
    back = lambda a: jnp.moveaxis(a.reshape(shape), -1, axis)  # noqa: E731
    return back(q), back(mask)


def spec_plan(spec: QuantSpec, shape, axes, key, tensor_amax=None) -> Plan:
    """The checked ``lowbit.core.plan.Plan`` of a block-granularity ``spec`` for an operand of
    ``shape`` quantized along ``axes`` (an axis, or the pair a 2-D tile spans): what the XLA
    path, the compiled CPU kernel and the Pallas quantize kernel all take."""
    return make_plan(shape, spec.format, axes, spec.block_shape, spec.scale_mode,
                     spec.rounding, key if spec.stochastic else None, tensor_amax,
                     prescale=spec.prescale, tensor_block=spec.tensor_block)


def quantize_operand(
    x: jax.Array,
    spec: QuantSpec | None,
    axis: int,
    other_axis: int | None,
    key: jax.Array | None,
    *,
    packed: bool = False,
    hadamard: int | None = None,
    signs: jax.Array | None = None,
    native: bool = True,
    tensor_amax: jax.Array | None = None,
):
    """Fake-quantize (float32 out) one GEMM operand along ``axis`` per ``spec``.

    ``other_axis`` is the operand's free axis that a 2-D tile spans together with ``axis``.
    ``key`` (uint32[2] key data) drives stochastic rounding. ``hadamard`` (a block size) and
    ``signs``: transform along ``axis`` first (fused into the compiled CPU kernel where it
    runs). None spec: ``x`` as float32 (transformed when asked). With ``packed=True`` the
    result is the packed form (a QArray, or FP8 codes and a float32 scale) that
    :func:`unpack_operand` turns into the same float32 values.

    ``tensor_amax`` (a float32 scalar, may be traced): the amax of the tensor this operand is
    a part of, in place of the operand's own, for the specs with a tensor-wide amax (NVFP4 and
    INT4 tensor scales, per-tensor FP8); a static ``spec.amax`` still wins. A grouped GEMM
    (:mod:`lowbit.gemm.ragged`) passes each group's amax so that a tile of the group's rows
    quantizes as the whole group would.
    """
    x = x.astype(jnp.float32)
    if spec is None:
        return x if hadamard is None else hadamard_along(x, axis, hadamard, signs)
    if spec.stochastic and key is None:
        raise ValueError(
            f"the recipe rounds an operand stochastically ({spec.format}): pass key= to "
            "lowbit.dot_general (or a 'quant' rng stream in Flax)"
        )
    if spec.scale_std is not None:
        if packed:
            raise ValueError(
                f"a scale_std spec ({spec.format}, QuEST's scale rule) has no packed form yet"
            )
        if hadamard is not None:
            x = hadamard_along(x, axis, hadamard, signs)
        return std_scaled_quantize(x, spec, axis, key if spec.stochastic else None)[0]
    two_d = spec.block_shape is not None and len(spec.block_shape) == 2
    fuse = (hadamard is not None and spec.clip_rms is None and spec.granularity == "block"
            and not two_d and not packed and spec.amax is None and not spec.pow2_tensor_scale)
    if hadamard is not None and not fuse:
        x = hadamard_along(x, axis, hadamard, signs)
    x = clip_to_rms(x, spec, axis)
    given_amax = tensor_amax
    x, tensor_amax = apply_static_amax(x, spec)
    if tensor_amax is None and given_amax is not None and spec.granularity == "block" \
            and _formats.get(spec.format).tensor_scale:
        tensor_amax = given_amax
    if spec.pow2_tensor_scale:  # the tensor amax (finite values) rounded to a power-of-two scale
        if tensor_amax is None:
            tensor_amax = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), np.float32(0)))
        tensor_amax = pow2_tensor_amax(tensor_amax, _formats.get(spec.format).elem.max)
    rounding_key = key if spec.stochastic else None
    if spec.granularity != "block":
        v, scale = _scaled_quantize(x, spec, rounding_key, axis, given_amax)
        if packed:
            return v.astype(_TENSOR_DTYPES[spec.format]), scale
        return _qa.undo_prescale(_scaled_values(v, scale, spec.format), spec.prescale)
    if two_d:
        if other_axis is None:
            raise ValueError(
                f"a 2-D tile {spec.block_shape} needs the operand to have a free axis"
            )
        axes: int | tuple[int, int] = (axis, other_axis)
    else:
        axes = axis
    plan = spec_plan(spec, x.shape, axes, key, tensor_amax)
    if packed:
        return _qa.quantize_with_plan(x, plan, rounding_key, tensor_amax)
    if fuse:
        _check_hadamard_length(x, axis, hadamard)
        return _qa.fake_quantize_with_plan(x, rounding_key, tensor_amax, plan, hadamard=hadamard,
                                           signs=signs, native=native)[0]
    return _qa.fake_quantize_with_plan(x, rounding_key, tensor_amax, plan, native=native)[0]


def unpack_operand(packed, spec: QuantSpec | None) -> jax.Array:
    """float32 values of :func:`quantize_operand`'s packed form (bit-identical)."""
    if spec is None:
        return packed
    if spec.granularity != "block":
        y = _scaled_values(*packed, spec.format)
    else:
        y = _qa.dequantize(packed, jnp.float32)
    return _qa.undo_prescale(y, spec.prescale)


def prepare_operand(x, spec: QuantSpec | None, gemm: GemmSpec, axis, other_axis, key, signs,
                    *, use_barrier: bool = True, packed: bool = False, native: bool = True,
                    with_mask: bool = False, tensor_amax=None):
    """One operand of a GEMM of a recipe: the barrier (see :func:`barrier`), ``gemm``'s
    Hadamard transform along ``axis``, then :func:`quantize_operand`; float32, or packed.
    ``axis`` None (nothing contracted): the operand as it is. ``with_mask``: also the trust
    mask of a ``trust_mask`` spec (:func:`std_scaled_quantize`; None for other specs), as
    ``(values, mask)``. ``tensor_amax``: as for :func:`quantize_operand`."""
    x = x.astype(jnp.float32)
    if use_barrier and (spec is not None or gemm.hadamard):
        x = barrier(x)
    if with_mask:
        if spec is None or not spec.trust_mask or axis is None:
            return prepare_operand(x, spec, gemm, axis, other_axis, key, signs,
                                   use_barrier=False, native=native,
                                   tensor_amax=tensor_amax), None
        if gemm.hadamard:
            x = hadamard_along(x, axis, gemm.hadamard, signs)
        return std_scaled_quantize(x, spec, axis, key if spec.stochastic else None)
    if axis is None:
        return x
    return quantize_operand(x, spec, axis, other_axis, key, packed=packed,
                            hadamard=gemm.hadamard or None, signs=signs, native=native,
                            tensor_amax=tensor_amax)


def through_forward(g, mask, gemm: GemmSpec, axis, signs, rotated: bool):
    """The gradient ``g`` of a forward operand carried back through the forward's quantizer:
    into the forward's Hadamard basis (unless ``rotated``: ``g`` is already the gradient of
    the operand's value inside it), the trust mask, and out of the basis again. Shared by
    ``lowbit.dot_general`` and the grouped GEMM (per row and per group weight)."""
    if mask is None and not rotated:
        return g
    h = gemm.hadamard if axis is not None else None
    if h and not rotated:
        g = _hadamard.hadamard_transform(g, h, signs=signs, axis=axis)
    if mask is not None:
        g = jnp.where(mask, g, np.float32(0))
    if h:
        g = _hadamard.hadamard_transform(g, h, signs=signs, axis=axis, inverse=True)
    return g


def unrotated(xq, gemm: GemmSpec, axis, signs):
    """A forward operand in the original basis (undo ``gemm``'s Hadamard along ``axis``)."""
    if not gemm.hadamard or axis is None:
        return xq
    return _hadamard.hadamard_transform(xq, gemm.hadamard, signs=signs, inverse=True, axis=axis)
