"""Block-scale rules: the MX shared exponent (OCP's rules and OAS) and NVFP4's scales (the
E4M3 rule and Four Over Six).

Everything here is float32 / int32 arithmetic on per-block values (the block maxima), except
:func:`four_over_six`, which quantizes each block twice and keeps the better candidate. The
rules are chosen by :attr:`lowbit.core.plan.Plan.scale_mode` (checked once, in
``lowbit.core.plan.scale_mode_of``); ``lowbit.core.qarray`` applies them and the Pallas quantize
kernel calls the same functions inside its kernel body.

>>> import jax.numpy as jnp
>>> from lowbit.core.formats import get
>>> e2m1 = get("mxfp4").elem
>>> [int(mx_scale_exponent(jnp.float32(a), e2m1, "oas")) for a in (6.5, 7.5)]
[0, 1]
>>> [int(mx_scale_exponent(jnp.float32(a), e2m1, "floor")) for a in (6.5, 7.5)]
[0, 0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.core.formats import E4M3, ElementFormat
from lowbit.core.numerics import exponent, fmix32, ieee_div, pow2, round_to_grid

__all__ = [
    "mx_scale_exponent",
    "oas_constant",
    "nvfp4_tensor_scale",
    "pow2_tensor_amax",
    "four_over_six",
    "four_over_six_tensor_scales",
    "FOUR_OVER_SIX_METRICS",
    "FOUR_OVER_SIX_E4M3_BOUND",
    "ms_eden",
    "ms_eden_blocks",
    "ms_eden_scales",
    "EDEN_SCALE_OVERRIDE",
    "block_sum",
]

FOUR_OVER_SIX_METRICS = {"4over6": "mse", "4over6_mae": "mae", "4over6_max": "max"}
"""Four Over Six's scale modes and the block error each one minimises."""

FOUR_OVER_SIX_E4M3_BOUND = 256.0
"""The E4M3 bound of Four Over Six's tensor scale (448 for plain NVFP4): with the block amax
scaled to 4 the block scale grows by 1.5, and 1.5 * 256 = 384 still fits E4M3."""

_OAS_TINY = np.float32(2.0**-63)  # sqrt(float32 tiny): below it qwix takes a scale of 1


def oas_constant(elem: ElementFormat) -> float:
    """OAS's multiplier ``C`` of ``amax / elem.max`` for an MX element format (float64).

    qwix (google/qwix @ aa623acb, ``qwix/_src/core/qarray.py:557-581``) writes the rule as
    ``C = 2 / r`` with ``r`` the ratio of the rounding boundary above the largest mantissa
    to that mantissa: ``r = 7/6`` for E2M1 (``C = 12/7``) and ``r = 31/30`` for E4M3
    (``C = 60/31``). The largest mantissa of a full binade with ``m`` mantissa bits is
    ``2 - 2**-m`` and the boundary is half an ulp above it, so for every float element
    format ``C = (2**(m+3) - 4) / (2**(m+2) - 1)``: 12/7 for E2M1, 28/15 for E3M2 and E5M2,
    60/31 for E2M3 and E4M3 (qwix's value: it counts E4M3's top code, which is NaN, as a
    mantissa, so a block whose amax lies in [462.9, 464) * 2**k takes the larger scale).
    MX INT8 (values ``k / 64``, largest 127 / 64): ``r = 127.5 / 127``, ``C = 508 / 255``.
    qwix has only E2M1 and E4M3; the other formats follow the same derivation.
    """
    if elem.is_int:
        return 2.0 * elem.max / (elem.max + 2.0 ** -(elem.int_shift + 1))
    m = elem.mbits
    return (2.0 ** (m + 3) - 4.0) / (2.0 ** (m + 2) - 1.0)


def _bf16_round_bits(s: jax.Array) -> jax.Array:
    """The int32 bit pattern of float32 ``s`` (finite, positive) rounded to bfloat16, nearest
    even (``astype(bfloat16)``'s rounding), as a float32 bit pattern."""
    bits = lax.bitcast_convert_type(s, jnp.int32)
    return bits + 0x7FFF + ((bits >> 16) & 1)


def mx_scale_exponent(amax: jax.Array, elem: ElementFormat, mode: str) -> jax.Array:
    """Shared exponent (int32, clamped to [-127, 127]) of MX blocks with absolute max amax.

    ``"floor"``: OCP MX v1.0, ``floor(log2(amax)) - emax``; ``"ceil"``: ``ceil(log2(amax)) -
    emax``; ``"even"``: amax rounded to the element precision first; ``"rceil"``: the smallest
    scale that does not clip; ``"oas"``: OAS (arXiv 2603.08713) as qwix computes it
    (``qwix/_src/core/qarray.py:557-581`` @ aa623acb): ``s = amax / elem.max`` (a float32
    division), ``s = 1`` where ``s < 2**-63``, then ``s * C`` (:func:`oas_constant`) rounded
    to bfloat16 and truncated to its power of two. A scale ``2**k`` is chosen for amax in
    ``[3.5, 7) * 2**k`` (E2M1) instead of OCP's ``[4, 8) * 2**k``: neither the range waste of
    ``ceil`` nor the clipping of ``floor`` (the bfloat16 step moves each boundary down by a
    factor 1 - 2**-9, as in qwix).
    """
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    mant = bits & 0x7FFFFF
    if mode == "floor":  # OCP MX v1.0: floor(log2(amax)) - emax
        e = exponent(amax) - elem.emax
    elif mode == "ceil":  # ceil(log2(amax)) - emax
        e = exponent(amax) + (mant != 0).astype(jnp.int32) - elem.emax
    elif mode == "even":
        # amax first rounded to the element's precision (ties away from zero), then floor:
        # a block whose largest value would round up into the next binade gets that binade.
        half = 1 << (23 - elem.mbits - 1)
        rounded = (bits + half) & ~((1 << (23 - elem.mbits)) - 1)
        e = ((rounded >> 23) & 0xFF) - 127 - elem.emax
    elif mode == "rceil":  # smallest e with elem.max * 2**e >= amax
        m_bits = int(np.float32(elem.max).view(np.int32))
        e = exponent(amax) - elem.emax + (mant > (m_bits & 0x7FFFFF)).astype(jnp.int32)
    elif mode == "oas":
        s = ieee_div(amax, np.float32(elem.max))
        s = jnp.where(s < _OAS_TINY, np.float32(1.0), s)
        # s * C with C kept out of XLA's constant folding (s * 0 is 0 for finite s)
        sc = s * (np.float32(oas_constant(elem)) + s * np.float32(0))
        e = ((_bf16_round_bits(sc) >> 23) & 0xFF) - 127
        # qwix's scale is 1 (e = 0) for an all-zero block too
        return jnp.clip(e, -127, 127)
    else:  # pragma: no cover - checked in make_plan
        raise ValueError(mode)
    # amax == 0 (and float32 subnormals, flushed on CPU) -> the smallest scale, 2**-127.
    e = jnp.where(amax > 0, e, -127)
    return jnp.clip(e, -127, 127)


def nvfp4_tensor_scale(tensor_amax: jax.Array, elem_max: float = 6.0) -> jax.Array:
    """NVFP4's float32 tensor scale ``t = amax / (448 * elem_max)`` (``elem_max`` 6 for NVFP4,
    7 for INT4), correctly rounded (an IEEE division XLA cannot rewrite into a multiplication
    by a rounded reciprocal)."""
    return ieee_div(jnp.asarray(tensor_amax, jnp.float32), np.float32(E4M3.max * elem_max))


def pow2_tensor_amax(tensor_amax: jax.Array, elem_max: float = 6.0) -> jax.Array:
    """The smallest ``448 * elem_max * 2**k`` at or above ``tensor_amax`` (float32; 0 stays
    0): the tensor amax whose tensor scale (:func:`nvfp4_tensor_scale`) is the power of two
    ``2**k``. A power-of-two tensor scale and its reciprocal are exact, so the
    ``code * block_scale * t`` of lowbit, the ``code * (block_scale / (1 / t))`` of
    compressed-tensors and vLLM, and the ``(code * block_scale) * t`` of ModelOpt and
    llama.cpp are one value (``QuantSpec.pow2_tensor_scale``). The block scales then use at
    least half of E4M3's range.

    >>> [float(pow2_tensor_amax(a)) for a in (3000.0, 2688.0, 0.0)]
    [5376.0, 2688.0, 0.0]
    """
    a = jnp.asarray(tensor_amax, jnp.float32)
    base = np.float32(E4M3.max * elem_max)
    _, e = jnp.frexp(ieee_div(a, base))  # a / base in [2**(e-1), 2**e), up to its rounding
    e = jnp.clip(e, -125, 127)
    up, down = base * pow2(e), base * pow2(e - 1)  # exact: a power of two times 2688
    above = base * pow2(jnp.minimum(e + 1, 127))
    out = jnp.where(down >= a, down, jnp.where(up >= a, up, above))
    return jnp.where(a > 0, out, a)


def block_sum(e: jax.Array, block_axes, *, halves: str = "slice") -> jax.Array:
    """The float32 sum over the in-block dims ``block_axes`` (keepdims) in one fixed order,
    which every implementation of a rule that compares or divides block sums follows, so
    that they agree bit for bit (``jnp.sum`` leaves the order to the compiler).

    The dims are reduced last first; along one dim of even length ``n`` the two halves are
    added element-wise (``e[i] + e[i + n/2]``) until one element is left (an odd length adds
    its elements left to right). A block of 16 is thus ``((e0+e8) + (e4+e12)) + ...``: the
    pairwise tree of a vectorised loop over half-blocks.

    ``halves``: how the halves are taken, ``"slice"`` (XLA: a reduce over a length-2 dim
    would be merged by XLA's simplifier into one reduce of unspecified order) or
    ``"reshape"`` (Pallas' Triton lowering has no slices; it lowers a jaxpr as written).
    Both add the same pairs.
    """
    for ax in sorted((a % e.ndim for a in block_axes), reverse=True):
        while e.shape[ax] > 1:
            n = e.shape[ax]
            if halves == "reshape" and n % 2 == 0:
                e = e.reshape(*e.shape[:ax], 2, n // 2, *e.shape[ax + 1:])
                e = jnp.sum(e, axis=ax)  # two terms: the order cannot matter
                continue
            if n % 2:
                acc = lax.slice_in_dim(e, 0, 1, axis=ax)
                for i in range(1, n):
                    acc = acc + lax.slice_in_dim(e, i, i + 1, axis=ax)
                e = acc
                break
            h = n // 2
            e = lax.slice_in_dim(e, 0, h, axis=ax) + lax.slice_in_dim(e, h, n, axis=ax)
    return e


def _block_error(d: jax.Array, metric: str, block_axes, sum_=block_sum) -> jax.Array:
    if metric == "max":
        return jnp.max(jnp.abs(d), axis=block_axes, keepdims=True)
    e = jnp.abs(d) if metric == "mae" else d * d
    return sum_(e, block_axes)


def four_over_six_tensor_scales(tamax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Four Over Six's ``(encode, decode)`` of a tensor amax: ``encode = 1536 / tamax`` and
    ``decode = 1 / encode`` (fouroversix ``reference.py:204-234``), both 0 where ``tamax`` is 0
    or ``encode`` overflows (the tensor quantizes to zeros, REF:197-202)."""
    big = np.float32(6.0 * FOUR_OVER_SIX_E4M3_BOUND)
    tamax = jnp.asarray(tamax, jnp.float32)
    live = tamax > 0
    encode = ieee_div(big, jnp.where(live, tamax, np.float32(1.0)))
    live = live & jnp.isfinite(encode)
    decode = jnp.where(live, ieee_div(np.float32(1.0), encode), np.float32(0.0))
    return jnp.where(live, encode, np.float32(0.0)), decode


def four_over_six(xb, amax, tamax, block_axes, elem: ElementFormat, metric: str, *,
                  rbits=None, prescale: float = 1.0, scales=None, div=ieee_div,
                  rnd=round_to_grid, sum_=block_sum):
    """Four Over Six (arXiv 2512.02010): each NVFP4 block quantized with its scale taking the
    block amax to 6 and to 4, keeping the candidate with the smaller error.

    ``xb`` float32 in a plan's blocked layout, ``amax`` its block maxima (keepdims), ``tamax``
    the tensor amax (scalar float32), ``block_axes`` the in-block dims. Returns
    ``(q, s, t, v)``: the chosen elements on the E2M1 grid, the chosen E4M3 block scales
    (keepdims), the float32 tensor scale and the chosen scaled elements before rounding (for
    ``clip_gradient``); the values are ``(q * s) * t``.

    The arithmetic of mit-han-lab/fouroversix @ dadfad69,
    ``src/fouroversix/quantize/pytorch/reference.py``: ``encode = 1536 / tamax`` (6 times the
    E4M3 bound 256, :data:`FOUR_OVER_SIX_E4M3_BOUND`; lines 204-211, ``utils.py:301-307``),
    ``decode = 1 / encode`` (227-234); the 6-candidate's unrounded scale ``hp6 = (amax / 6) *
    encode`` (212-220) and the 4-candidate's ``hp4 = hp6 * 1.5`` (222-223), each rounded to
    E4M3 (nearest even, subnormals kept); elements ``x * (1 / (decode * s))``, zero where
    ``s == 0`` (235-239), rounded to nearest-even E2M1 with saturation at 6 (the released
    Triton and CUDA kernels' ``cvt.rn.satfinite``; the PyTorch reference does not saturate, so
    for a subnormal 6-scale it can produce 8, which its packer stores as -0); candidate values
    ``((q * s) * tamax) / 1536`` compared with ``x`` by the summed squared error (``mse``),
    summed absolute error (``mae``) or the largest absolute error (``max``), 4 kept only where
    its error is strictly smaller, so ties keep 6 (303-325). A tensor amax of 0 zeroes the
    tensor (197-202). lowbit stores ``t = decode``, so its values ``(q * s) * decode`` can
    differ from the reference's ``((q * s) * tamax) / 1536`` by one float32 rounding; the
    codes and scales are the reference's. Stochastic rounding (gradients in the paper's
    recipe) draws each candidate's bits independently, as ``torch.rand_like`` twice does:
    the 6-candidate from ``rbits``, the 4-candidate from ``fmix32`` of them. ``prescale``
    multiplies the scaled elements before rounding (lowbit's :attr:`Plan.prescale`, divided
    out of the values by the caller); the reference instead folds its stochastic 16/17 into
    the encode constant.

    ``scales``: ``(encode, decode)`` when the caller has them (:func:`four_over_six_tensor_scales`
    of ``tamax``; the Pallas kernel computes them before its grid), ``div`` and ``rnd`` the
    correctly rounded division and the grid rounding (the Pallas kernel passes its own,
    ``pallas_kernels._numerics``, which compute the same values), ``sum_`` the block sum of the
    errors (:func:`block_sum`'s fixed order by default; a kernel whose compiler has no slices
    passes a reduction of its own, and may then break a near-tie differently).
    """
    big = np.float32(elem.max * FOUR_OVER_SIX_E4M3_BOUND)  # 1536
    encode, decode = four_over_six_tensor_scales(tamax) if scales is None else scales
    hp6 = div(amax, np.float32(elem.max)) * encode  # 0 for a tensor that quantizes to zeros
    hp4 = hp6 * (np.float32(1.5) + hp6 * np.float32(0))
    rbits4 = None if rbits is None else fmix32(rbits ^ jnp.uint32(0x5BD1E995))
    cands = []
    for hp, rb in ((hp6, rbits), (hp4, rbits4)):
        s = rnd(hp, E4M3, saturate=True)
        nz = s > 0
        r = jnp.where(nz, div(jnp.ones_like(s), decode * jnp.where(nz, s, 1.0)), 0.0)
        v = xb * r
        if prescale != 1.0:
            v = v * np.float32(prescale)
        q = rnd(jnp.where(nz, v, 0.0), elem, rbits=rb, saturate=True)
        deq = div((q * s) * tamax, big)
        if prescale != 1.0:
            deq = div(deq, np.float32(prescale))
        cands.append((q, s, v, _block_error(deq - xb, metric, block_axes, sum_)))
    (q6, s6, v6, err6), (q4, s4, v4, err4) = cands
    pick4 = err4 < err6
    return (jnp.where(pick4, q4, q6), jnp.where(pick4, s4, s6), decode,
            jnp.where(pick4, v4, v6))


EDEN_SCALE_OVERRIDE = (17 / 16) * 0.93
"""Quartet II's backward scale override (``kernels/python/quartet2/linear.py:198``): the block
scale is ``amax * override / 6``, so a block's largest element lands near 6.07 and
saturates to 6."""

# quant.py:390-391 passes fp4_max = 6.0 / override (a Python float), the launchers
# inv_fp4_max = 1.f / fp4_max (float32, rht128_eden.cu:159) and inv_fp8_max = 1.f / 256.
_EDEN_INV_FP4_MAX = np.float32(1.0) / np.float32(6.0 / EDEN_SCALE_OVERRIDE)
_EDEN_FP8_MAX = 256.0


def _bf16(v: jax.Array) -> jax.Array:
    """float32 ``v`` rounded to bfloat16 (nearest even), as float32."""
    b = _bf16_round_bits(v) & ~0xFFFF
    return lax.bitcast_convert_type(b, jnp.float32)


def _e4m3_stochastic(v: jax.Array, noise16: jax.Array) -> jax.Array:
    """Quartet II's stochastic rounding of non-negative float32 ``v`` onto the E4M3 grid
    (``kernels/csrc/utils.cuh:365-382``): inside E4M3's normal range [2**-6, 448] the 20
    mantissa bits that E4M3 drops are compared with ``(noise16 << 4)``; above the threshold
    they are all set (the nearest-even cast then rounds up), else cleared (exact); outside
    that range, nearest-even with saturation. ``noise16``: uint32 holding 16 random bits."""
    bits = lax.bitcast_convert_type(v, jnp.uint32)
    mask = jnp.uint32(0xFFFFF)
    up = (bits & mask) > ((noise16 << 4) & mask)
    dithered = lax.bitcast_convert_type(jnp.where(up, bits | mask, bits & ~mask), jnp.float32)
    inside = (v <= np.float32(E4M3.max)) & (v >= np.float32(2.0**-6))
    return round_to_grid(jnp.where(inside, dithered, v), E4M3, saturate=True)


def ms_eden(xb, amax, finite, block_axes, elem: ElementFormat, noise16, *, sum_=block_sum):
    """MS-EDEN (Quartet II, arXiv 2601.22813), the unbiased NVFP4 quantizer of its backward, as
    the released kernels compute it (IST-DASLab/Quartet-II @ 8776a90b,
    ``kernels/csrc/had128_utils.cuh:181-226`` and ``group_transform_and_eden.cu:210-266``).

    ``xb`` float32 in a plan's blocked layout (blocks of 16, already rotated by the GEMM's random
    Hadamard of 128), ``amax`` its block maxima (keepdims), ``finite`` the finite blocks,
    ``noise16`` uint32 per block holding 16 random bits. Per block:

    - ``s0 = amax * (1 / (6 / override))`` truncated to 4 mantissa bits (a mask of the float32
      bits, not an E4M3 rounding), ``override = (17/16) * 0.93``;
    - elements ``q = E2M1(x * (1 / s0))``, nearest-even, saturating (the largest lands at
      6.07..6.45 and becomes 6); these codes are final;
    - the EDEN factor ``c = sum(u**2) / sum(u * q)`` with ``u = x / s0`` (1 where the
      denominator is 0), and the corrected scale ``s1 = bfloat16(s0 * c)``;
    - the tensor scale ``ts = max(s1) / 256`` (over the finite blocks), and the block scale
      ``s1 / ts`` rounded stochastically onto the E4M3 grid (:func:`_e4m3_stochastic`).

    Returns ``(q, s, ts)``: values ``(q * s) * ts``, whose mean over the noise is ``q * s1``.
    The kernels take reciprocals with ``rcp.approx.ftz``; lowbit's are exact. The research
    scheme (``src/models/quantization/schemes/quartet_2.py``) differs: one EDEN factor per
    128-element chunk, E4M3 block scales relative to a tensor scale from the rotated amax
    before the correction, ties away from zero, and ``tl.rand`` for the scale's rounding.

    The two halves are :func:`ms_eden_blocks` (per block: codes and corrected scales; a
    kernel computes them tile by tile) and :func:`ms_eden_scales` (needs every block's
    corrected scale for the tensor scale). ``sum_``: the block sums' order (:func:`block_sum`).
    """
    q, s1 = ms_eden_blocks(xb, amax, finite, block_axes, elem, sum_=sum_)
    s, ts = ms_eden_scales(s1, noise16)
    return q, s, ts


def ms_eden_blocks(xb, amax, finite, block_axes, elem: ElementFormat, *, sum_=block_sum,
                   div=ieee_div, rnd=round_to_grid):
    """:func:`ms_eden`'s per-block half: ``(q, s1)``, the final E2M1 codes and the corrected
    float32 block scales ``s1 = bfloat16(s0 * c)`` (0 for non-finite blocks). ``div``,
    ``rnd``, ``sum_``: as :func:`four_over_six`'s."""
    s = amax * _EDEN_INV_FP4_MAX
    s0 = lax.bitcast_convert_type(
        lax.bitcast_convert_type(s, jnp.uint32) & jnp.uint32(0xFFF80000), jnp.float32)
    live = s0 > 0
    u = xb * jnp.where(live, div(jnp.ones_like(s0), jnp.where(live, s0, 1.0)), 0.0)
    q = rnd(u, elem, saturate=True)
    xx = sum_(u * u, block_axes)
    xy = sum_(u * q, block_axes)
    nz = xy != 0
    c = jnp.where(nz, xx * div(jnp.ones_like(xy), jnp.where(nz, xy, 1.0)), 1.0)
    return q, jnp.where(finite, _bf16(s0 * c), 0.0)


def ms_eden_scales(s1: jax.Array, noise16: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`ms_eden`'s tensor-wide half: from every block's corrected scale ``s1`` and its 16
    random bits, ``(s, ts)``: the stochastically rounded E4M3 block scales and the float32
    tensor scale ``max(s1) / 256``."""
    ts = jnp.max(s1) * np.float32(1.0 / _EDEN_FP8_MAX)
    inv = jnp.where(ts > 0, ieee_div(np.float32(1.0), jnp.where(ts > 0, ts, 1.0)), 0.0)
    return _e4m3_stochastic(s1 * inv, noise16), ts
