"""An independent numpy reference for lowbit's numerics, written from DESIGN.md ("Numerics").

Nothing here imports lowbit. Element grids come from enumerating every code of a format
(sign, exponent field, mantissa field); rounding to nearest-even searches the two grid
neighbours of a value and breaks a tie towards the neighbour whose code has an even least
significant bit. MX block arithmetic is done in float64, where every step is exact (block
scales are powers of two and elements carry at most 4 significant bits). NVFP4 is done in
float32 numpy arithmetic, step by step in the order DESIGN.md gives, because its scales are
not powers of two and the float32 rounding of each step is part of the result. numpy keeps
float32 subnormals (XLA on CPU flushes them), so callers choose inputs whose results are
normal floats, or compare FTZ-sensitive results with that in mind.

>>> import numpy as np
>>> v, c = round_to_grid(np.array([0.25, 0.75, 5.0, -0.2]), ELEMS["e2m1"])
>>> v.tolist(), c.tolist()
([0.0, 1.0, 4.0, -0.0], [0, 2, 6, 8])
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = [
    "Elem",
    "ELEMS",
    "MX_ELEM",
    "MX_FORMATS",
    "SCALE_MODES",
    "code_values",
    "positive_grid",
    "round_to_grid",
    "mx_exponent",
    "mx_quantize",
    "nvfp4_quantize",
    "bitnet_weight_quant",
    "bitnet_activation_quant",
    "pack_trits",
    "unpack_codes",
    "to_blocks",
    "Quantized",
]

SCALE_MODES = ("floor", "ceil", "even", "rceil")


@dataclasses.dataclass(frozen=True)
class Elem:
    """An element format as DESIGN.md's table describes it.

    ``specials``: ``"none"``, ``"nan"`` (only S.1111.111 is NaN, E4M3) or ``"ieee"`` (the
    all-ones exponent holds Inf and NaN, E5M2). ``is_int``: ``width``-bit two's-complement
    codes times ``2**-mbits``, the most negative code unused (symmetric): MX INT8 (width 8,
    ``mbits`` = 6 fraction bits, used by the "even" scale mode), INT4 (-7..7), ternary
    (-1, 0, 1 in two bits).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int
    specials: str = "none"
    is_int: bool = False
    width: int = 8

    @property
    def bits(self) -> int:
        return self.width if self.is_int else 1 + self.ebits + self.mbits

    @property
    def max(self) -> float:
        return float(positive_grid(self)[0][-1])


ELEMS = {
    "e4m3": Elem("e4m3", 4, 3, 7, emax=8, specials="nan"),
    "e5m2": Elem("e5m2", 5, 2, 15, emax=15, specials="ieee"),
    "e3m2": Elem("e3m2", 3, 2, 3, emax=4),
    "e2m3": Elem("e2m3", 2, 3, 1, emax=2),
    "e2m1": Elem("e2m1", 2, 1, 1, emax=2),
    "int8": Elem("int8", 0, 6, 0, emax=0, is_int=True),
    "int4": Elem("int4", 0, 0, 0, emax=2, is_int=True, width=4),
    "ternary": Elem("ternary", 0, 0, 0, emax=0, is_int=True, width=2),
}

# MX format name -> element format name (DESIGN.md "Format names"; MX blocks hold 32).
MX_ELEM = {
    "mxfp8_e4m3": "e4m3",
    "mxfp8_e5m2": "e5m2",
    "mxfp6_e2m3": "e2m3",
    "mxfp6_e3m2": "e3m2",
    "mxfp4": "e2m1",
    "mxint8": "int8",
}
MX_FORMATS = tuple(MX_ELEM)
MX_BLOCK = 32
NVFP4_BLOCK = 16
E8M0_NAN = 0xFF
UE4M3_NAN = 0x7F


@functools.cache
def code_values(elem: Elem) -> np.ndarray:
    """float64 value of every code 0 .. 2**bits - 1 (NaN/Inf for special codes; for INT8
    the unused code -128 is NaN here)."""
    codes = np.arange(2**elem.bits)
    if elem.is_int:
        half = 2 ** (elem.bits - 1)
        k = np.where(codes >= half, codes - 2 * half, codes).astype(np.float64)
        vals = k * 2.0**-elem.mbits
        vals[codes == half] = np.nan
        vals.setflags(write=False)
        return vals
    sign = codes >> (elem.ebits + elem.mbits)
    e_field = (codes >> elem.mbits) & ((1 << elem.ebits) - 1)
    mant = codes & ((1 << elem.mbits) - 1)
    frac = mant / 2.0**elem.mbits
    normal = np.ldexp(1.0 + frac, e_field - elem.bias)  # exact
    subnormal = np.ldexp(frac, 1 - elem.bias)
    mag = np.where(e_field == 0, subnormal, normal)
    top = e_field == (1 << elem.ebits) - 1
    if elem.specials == "ieee":
        mag = np.where(top, np.where(mant == 0, np.inf, np.nan), mag)
    elif elem.specials == "nan":
        mag = np.where(top & (mant == (1 << elem.mbits) - 1), np.nan, mag)
    vals = np.where(sign == 1, -mag, mag)
    vals.setflags(write=False)
    return vals


@functools.cache
def positive_grid(elem: Elem) -> tuple[np.ndarray, np.ndarray]:
    """(values, codes): every non-negative finite value of ``elem`` ascending (+0 once),
    and the code of each."""
    vals = code_values(elem)
    codes = np.arange(vals.size)
    keep = np.isfinite(vals) & (vals >= 0) & ~np.signbit(vals)
    order = np.argsort(vals[keep], kind="stable")
    v, c = vals[keep][order], codes[keep][order]
    assert np.all(np.diff(v) > 0), f"{elem.name}: grid values are not distinct"
    return v, c


def round_to_grid(v, elem: Elem) -> tuple[np.ndarray, np.ndarray]:
    """Round finite ``v`` (``|v| <= elem.max``) to nearest, ties to the even code.

    Returns (float64 values, uint8 codes). The sign is kept (-0.0 for a negative value that
    rounds to zero) except for INT8, which has no negative zero.
    """
    v = np.asarray(v, np.float64)
    grid, gcodes = positive_grid(elem)
    a = np.abs(v)
    if not np.all(np.isfinite(a) & (a <= grid[-1])):
        raise ValueError(f"round_to_grid needs finite |v| <= {grid[-1]} for {elem.name}")
    hi = np.minimum(np.searchsorted(grid, a, side="left"), grid.size - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (gcodes[hi] % 2 == 0))
    idx = np.where(take_hi, hi, lo)
    mag, mcode = grid[idx], gcodes[idx]
    neg = np.signbit(v)
    if elem.is_int:
        neg = neg & (mag > 0)
        vals = np.where(neg, -mag, mag)
        codes = np.where(neg, (2**elem.bits - mcode) % 2**elem.bits, mcode)
    else:
        vals = np.copysign(mag, v)
        codes = mcode | (neg.astype(np.int64) << (elem.ebits + elem.mbits))
    return vals, codes.astype(np.uint8)


# --------------------------------------------------------------------------------------------
# Blocks


def _floor_log2(a: np.ndarray) -> np.ndarray:
    """Exact floor(log2(a)) of positive float64 (frexp: a = m * 2**k with m in [0.5, 1))."""
    m, k = np.frexp(a)
    return (k - 1).astype(np.int64)


def mx_exponent(amax, elem: Elem, mode: str) -> np.ndarray:
    """Shared exponent e (int64, in [-127, 127]) of MX blocks whose finite absolute max is
    ``amax``, for each scale mode of DESIGN.md."""
    amax = np.asarray(amax, np.float64)
    pos = amax > 0
    a = np.where(pos, amax, 1.0)
    if mode == "floor":
        e = _floor_log2(a) - elem.emax
    elif mode == "ceil":
        m, k = np.frexp(a)
        e = np.where(m == 0.5, k - 1, k) - elem.emax
    elif mode == "even":
        # amax rounded to mbits mantissa bits, ties away from zero: add half an ulp, truncate.
        m, k = np.frexp(a)  # a = m * 2**k, m in [0.5, 1): 1 + mbits significant bits
        sig = np.floor(m * 2.0 ** (elem.mbits + 1) + 0.5)
        r = np.ldexp(sig, k - elem.mbits - 1)
        e = _floor_log2(r) - elem.emax
    elif mode == "rceil":
        # The smallest e with elem.max * 2**e >= amax (products of powers of two are exact).
        e = _floor_log2(a) - elem.emax - 1
        for _ in range(3):
            e = np.where(np.ldexp(elem.max, e) < a, e + 1, e)
        assert np.all(np.ldexp(elem.max, e) >= a) and np.all(np.ldexp(elem.max, e - 1) < a)
    else:
        raise ValueError(mode)
    e = np.where(pos, e, -127)
    return np.clip(e, -127, 127).astype(np.int64)


@dataclasses.dataclass
class Quantized:
    """Reference results. ``values``: float32, x's shape. ``elems`` (float64) and ``codes``
    (uint8): the element grid values / codes in the blocked layout (quantized axes moved
    last in the given order, zero-padded to whole blocks). ``scale_codes``: one byte per
    block, shape ``[*other, *blocks_per_axis]``. ``finite``: per block, like scale_codes.
    ``tensor_scale``: NVFP4's float32 t. ``scale``: float64 per-block multiplier (2**e for MX,
    s for NVFP4). ``elems`` is NaN in a non-finite block (its element codes are unspecified
    and ``codes`` holds 0 there)."""

    values: np.ndarray
    elems: np.ndarray
    codes: np.ndarray
    scale_codes: np.ndarray
    finite: np.ndarray
    scale: np.ndarray
    tensor_scale: np.float32 | None = None


@dataclasses.dataclass(frozen=True)
class _Layout:
    shape: tuple[int, ...]
    axes: tuple[int, ...]
    block: tuple[int, ...]

    @property
    def other(self) -> list[int]:
        return [i for i in range(len(self.shape)) if i not in self.axes]

    @property
    def padded(self) -> tuple[int, ...]:
        return tuple(-(-self.shape[a] // b) * b for a, b in zip(self.axes, self.block, strict=True))

    @property
    def nblocks(self) -> tuple[int, ...]:
        return tuple(p // b for p, b in zip(self.padded, self.block, strict=True))

    def moved_padded(self, x: np.ndarray) -> np.ndarray:
        xm = np.transpose(x, self.other + list(self.axes))
        k = len(self.other)
        pads = [(0, 0)] * k + [(0, p - xm.shape[k + i]) for i, p in enumerate(self.padded)]
        return np.pad(xm, pads)

    def to_blocks(self, xp: np.ndarray) -> np.ndarray:
        """padded moved layout -> [*other, *nblocks, block_elems]."""
        k = len(self.other)
        lead = xp.shape[:k]
        split = []
        for n, b in zip(self.nblocks, self.block, strict=True):
            split += [n, b]
        y = xp.reshape(*lead, *split)
        nb = len(self.block)
        order = list(range(k)) + [k + 2 * i for i in range(nb)] + [k + 2 * i + 1 for i in range(nb)]
        y = np.transpose(y, order)
        return y.reshape(*lead, *self.nblocks, int(np.prod(self.block)))

    def from_blocks(self, yb: np.ndarray) -> np.ndarray:
        """Inverse of to_blocks, into the padded moved layout."""
        k = len(self.other)
        lead = yb.shape[:k]
        nb = len(self.block)
        y = yb.reshape(*lead, *self.nblocks, *self.block)
        order = list(range(k))
        for i in range(nb):
            order += [k + i, k + nb + i]
        y = np.transpose(y, order)
        return y.reshape(*lead, *self.padded)

    def unmove(self, yp: np.ndarray) -> np.ndarray:
        """padded moved layout -> x's shape and axis order."""
        k = len(self.other)
        sl = (slice(None),) * k + tuple(slice(0, self.shape[a]) for a in self.axes)
        y = yp[sl]
        return np.transpose(y, np.argsort(self.other + list(self.axes)))


def _layout(shape, axis, block_shape, default_block: int) -> _Layout:
    ndim = len(shape)
    if block_shape is None:
        block_shape = (default_block,)
    block_shape = tuple(block_shape)
    if isinstance(axis, int):
        axes = (ndim - 2, ndim - 1) if len(block_shape) == 2 else (axis % ndim,)
    else:
        axes = tuple(a % ndim for a in axis)
    return _Layout(tuple(shape), axes, block_shape)


def to_blocks(x, axis=-1, block_shape=None, block: int = MX_BLOCK) -> np.ndarray:
    """``x`` as ``[*other, *blocks_per_axis, block_elems]``: quantized axes moved last,
    zero-padded, each block (or 2-D tile) flattened."""
    x = np.asarray(x)
    lay = _layout(x.shape, axis, block_shape, block)
    return lay.to_blocks(lay.moved_padded(x))


def mx_quantize(x, fmt: str, axis=-1, scale_mode: str = "floor", block_shape=None) -> Quantized:
    """MX (OCP v1.0) quantization of float32 ``x`` along ``axis`` (or 2-D tiles, each tile
    treated as one flattened block), with round-to-nearest-even elements."""
    elem = ELEMS[MX_ELEM[fmt]]
    x = np.asarray(x, np.float32)
    lay = _layout(x.shape, axis, block_shape, MX_BLOCK)
    xb = lay.to_blocks(lay.moved_padded(x)).astype(np.float64)
    finite = np.all(np.isfinite(xb), axis=-1)
    amax = np.max(np.where(np.isfinite(xb), np.abs(xb), 0.0), axis=-1)
    e = mx_exponent(amax, elem, scale_mode)
    scale = np.ldexp(1.0, e)[..., None]
    v = np.where(finite[..., None], xb, 0.0) / scale  # exact: a power of two
    v = np.clip(v, -elem.max, elem.max)
    elems, codes = round_to_grid(v, elem)
    vals = np.where(finite[..., None], elems * scale, np.nan)
    elems = np.where(finite[..., None], elems, np.nan)
    codes = np.where(finite[..., None], codes, 0).astype(np.uint8)
    values = lay.unmove(lay.from_blocks(vals)).astype(np.float32)
    assert np.array_equal(
        values.astype(np.float64), lay.unmove(lay.from_blocks(vals)), equal_nan=True
    ), "MX reference values must be exact in float32"
    scale_codes = np.where(finite, e + 127, E8M0_NAN).astype(np.uint8)
    return Quantized(
        values=values,
        elems=lay.from_blocks(elems),
        codes=lay.from_blocks(codes),
        scale_codes=scale_codes,
        finite=finite,
        scale=scale[..., 0],
    )


def nvfp4_quantize(x, axis=-1, tensor_amax=None, block_shape=None, elem: str = "e2m1"
                   ) -> Quantized:
    """NVFP4 in float32 arithmetic, each step rounded as DESIGN.md writes it:
    t = amax_tensor / 2688; s = RNE_e4m3(min(amax_b / 6 / t, 448));
    elements = RNE_e2m1(clamp(x * ((1 / t) / s), +-6)) (the reciprocal form DESIGN.md allows);
    value = (element * s) * t.
    The tensor amax ignores non-finite values; a block whose s is 0 (or t is 0) gives zeros;
    a block holding NaN or Inf gives NaN. ``elem="int4"``: lowbit's INT4, the same with the
    grid -7..7 in place of E2M1's (6 becomes 7: t = amax / 3136, s from amax_b / 7)."""
    e2m1, e4m3 = ELEMS[elem], ELEMS["e4m3"]
    top = e2m1.max
    f32 = np.float32
    x = np.asarray(x, np.float32)
    lay = _layout(x.shape, axis, block_shape, NVFP4_BLOCK)
    xb = lay.to_blocks(lay.moved_padded(x))
    finite = np.all(np.isfinite(xb), axis=-1)
    if tensor_amax is None:
        tamax = f32(np.max(np.abs(x[np.isfinite(x)]), initial=f32(0)))
    else:
        tamax = f32(tensor_amax)
    t = f32(tamax / f32(448.0 * top))
    amax_b = np.max(np.where(finite[..., None], np.abs(xb), f32(0)), axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        s_raw = np.minimum((amax_b / f32(top)) / t, f32(448))
    assert s_raw.dtype == np.float32
    s_ok = (t > 0) & finite
    s64, s_code = round_to_grid(np.where(s_ok, s_raw, 0.0), e4m3)
    s = s64.astype(np.float32)
    live = (s > 0)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (f32(1) / t) / np.where(s > 0, s, f32(1))[..., None]  # DESIGN.md: x * (1/t / s)
        v = np.where(live, xb * r, f32(0))
    assert v.dtype == np.float32
    v = np.clip(v, f32(-top), f32(top))
    elems64, codes = round_to_grid(v, e2m1)
    elems64 = np.where(live, elems64, 0.0)  # a block whose s is 0 gives zeros (+0.0)
    codes = np.where(live, codes, 0).astype(np.uint8)
    elems = elems64.astype(np.float32)
    vals = (elems * s[..., None]) * t
    assert vals.dtype == np.float32
    vals = np.where(finite[..., None], vals, f32(np.nan))
    elems64 = np.where(finite[..., None], elems64, np.nan)
    return Quantized(
        values=lay.unmove(lay.from_blocks(vals)),
        elems=lay.from_blocks(elems64),
        codes=lay.from_blocks(codes),
        scale_codes=np.where(finite, s_code, UE4M3_NAN).astype(np.uint8),
        finite=finite,
        scale=s.astype(np.float64),
        tensor_scale=t,
    )


def bitnet_weight_quant(w) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """BitNet b1.58's ``weight_quant`` ("The Era of 1-bit LLMs: Training Tips, Code and FAQ")
    in float32 numpy: ``scale = 1 / clamp(mean|w|, 1e-5)``; ``codes = clamp(round(w * scale),
    -1, 1)``; values ``codes / scale``. Returns (values, codes as int8, scale). The mean is
    float64 sum over the float32 count, so callers pass tensors whose sum of ``|w|`` is exact
    in float32 (every implementation's float32 sum then agrees)."""
    f32 = np.float32
    w = np.asarray(w, np.float32)
    total = np.sum(np.abs(w).astype(np.float64))
    assert f32(total) == total, "choose w whose sum of |w| is exact in float32"
    gamma = np.maximum(f32(total) / f32(w.size), f32(1e-5))
    scale = f32(1) / gamma
    codes = np.clip(np.round(w * scale), f32(-1), f32(1))  # numpy rounds half to even
    # + 0: BitNet's float arithmetic gives -0.0 for a small negative weight; an integer code
    # has no sign for zero, so lowbit's value is +0.0 (equal, not the same bits)
    vals = codes / scale + f32(0)
    assert vals.dtype == np.float32
    return vals, codes.astype(np.int8), scale


def bitnet_activation_quant(x) -> tuple[np.ndarray, np.ndarray]:
    """BitNet b1.58's ``activation_quant`` per token (last axis) in float32 numpy:
    ``scale = 127 / clamp(max|x|, 1e-5)``; ``codes = clamp(round(x * scale), -128, 127)``;
    values ``codes / scale``. Returns (values, codes as int8)."""
    f32 = np.float32
    x = np.asarray(x, np.float32)
    scale = f32(127) / np.maximum(np.max(np.abs(x), axis=-1, keepdims=True), f32(1e-5))
    codes = np.clip(np.round(x * scale), f32(-128), f32(127))
    vals = codes / scale + f32(0)  # +0.0 for BitNet's -0.0, as in bitnet_weight_quant
    assert vals.dtype == np.float32
    return vals, codes.astype(np.int8)


def pack_trits(codes) -> np.ndarray:
    """Ternary codes (-1, 0, 1) along the last axis, five a byte in base 3 (first code least
    significant, digit ``code + 1``), as lowbit documents its ternary packing."""
    t = np.asarray(codes, np.int64) + 1
    g = t.reshape(*t.shape[:-1], t.shape[-1] // 5, 5)
    return (g @ (3 ** np.arange(5))).astype(np.uint8)


def unpack_codes(packed, bits: int) -> np.ndarray:
    """Element codes from lowbit's documented packing along the last axis: one byte per
    8-bit code; two FP4 codes a byte, low nibble first; four FP6 codes in three bytes,
    little-endian (code i at bits 6i..6i+5 of the 24-bit word)."""
    p = np.asarray(packed, np.uint8)
    if bits == 8:
        return p
    if bits == 4:
        out = np.stack([p & 0xF, p >> 4], axis=-1)
        return out.reshape(*p.shape[:-1], p.shape[-1] * 2)
    if bits == 6:
        g = p.reshape(*p.shape[:-1], p.shape[-1] // 3, 3).astype(np.uint32)
        w = g[..., 0] | (g[..., 1] << 8) | (g[..., 2] << 16)
        out = np.stack([(w >> (6 * i)) & 0x3F for i in range(4)], axis=-1).astype(np.uint8)
        return out.reshape(*p.shape[:-1], p.shape[-1] // 3 * 4)
    raise ValueError(bits)
