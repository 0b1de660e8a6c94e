"""Element, scale and block formats, and the registry of format names.

A format is data: frozen dataclasses that describe an encoding. The operations that use them
(quantize, dequantize, rounding) are free functions in :mod:`lowbit.core.numerics` and
:mod:`lowbit.core.qarray`.

>>> import lowbit as lb
>>> f = lb.formats.get("mxfp4")
>>> f.elem.name, f.block_size, f.bits_per_element
('e2m1', 32, 4.25)
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = [
    "ElementFormat",
    "ScaleFormat",
    "BlockFormat",
    "E4M3",
    "E5M2",
    "E3M2",
    "E2M3",
    "E2M1",
    "INT8",
    "INT4",
    "TERNARY",
    "INT8_SYM",
    "E8M0",
    "ABSMEAN",
    "UE4M3",
    "FP32",
    "get",
    "names",
    "register",
    "tensor_element",
    "ALIASES",
]


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """A sign-magnitude element encoding, as used inside a block.

    Floating-point elements have ``ebits`` exponent bits and ``mbits`` mantissa bits, keep
    subnormals and saturate at ``max``. Integer elements (``is_int``) are symmetric
    fixed-point grids with a uniform step ``2**(emin - mbits)`` up to ``max``, modelled as one
    binade (``emin == emax == floor(log2(max))``) of ``mbits`` mantissa bits: ``INT8`` (MX
    semantics) is codes -127..127 times ``2**-6``; ``INT4`` codes -7..7; ``TERNARY`` codes
    -1, 0, 1; ``INT8_SYM`` (per-token / per-tensor int8) codes -127..127.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    has_inf: bool = False
    is_int: bool = False

    @property
    def bits(self) -> int:
        """Width of one code: sign, exponent and mantissa; for an integer grid of ``2**k - 1``
        levels (codes ``-(2**(k-1) - 1)..2**(k-1) - 1``), ``k`` (ternary: 2)."""
        return self.mbits + 2 if self.is_int else 1 + self.ebits + self.mbits

    @property
    def pack_group(self) -> tuple[int, int]:
        """``(codes, bytes)`` of one packing group: two FP4/INT4 codes a byte, four FP6 codes
        in three bytes, five ternary codes a byte (base 3: ``3**5 = 243 <= 256``), else one
        code a byte."""
        if self.name == "ternary":
            return (5, 1)
        return {4: (2, 1), 6: (4, 3)}.get(self.bits, (1, 1))

    @property
    def packed_bits(self) -> float:
        """Storage bits per code after packing (ternary: 8 / 5 = 1.6)."""
        n, nb = self.pack_group
        return 8.0 * nb / n

    @property
    def emax(self) -> int:
        """Exponent of the largest binade (``floor(log2(max))``); 0 for MX INT8."""
        return int(np.floor(np.log2(self.max)))

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade; the grid step below ``2**emin`` is
        ``2**(emin - mbits)``. Integer grids are one binade, ``emin == emax``: MX INT8 is
        ``emin = 0, mbits = 6`` (step ``2**-6`` everywhere below its max of 127/64), INT4
        ``emin = 2, mbits = 2`` (step 1 up to 7)."""
        return self.emax if self.is_int else 1 - self.bias

    @property
    def int_shift(self) -> int:
        """Integer grids: ``code = value * 2**int_shift`` (MX INT8: 6; INT4, ternary: 0)."""
        return self.mbits - self.emin

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def ml_dtype(self):
        """The matching ml_dtypes type, or None (INT8 has none; MX INT8 is not an integer)."""
        import ml_dtypes

        return {
            "e4m3": ml_dtypes.float8_e4m3fn,
            "e5m2": ml_dtypes.float8_e5m2,
            "e3m2": ml_dtypes.float6_e3m2fn,
            "e2m3": ml_dtypes.float6_e2m3fn,
            "e2m1": ml_dtypes.float4_e2m1fn,
        }.get(self.name)

    @functools.cached_property
    def positive_grid(self) -> np.ndarray:
        """Every non-negative finite value of the format, ascending (float64)."""
        if self.is_int:
            step = 2.0 ** (self.emin - self.mbits)
            return np.arange(round(self.max / step) + 1, dtype=np.float64) * step
        sub = np.arange(2**self.mbits, dtype=np.float64) * self.min_subnormal
        vals = [sub]
        e = self.emin
        while True:
            binade = (1.0 + np.arange(2**self.mbits) / 2**self.mbits) * 2.0**e
            binade = binade[binade <= self.max]
            if binade.size == 0:
                break
            vals.append(binade)
            e += 1
        return np.concatenate(vals)

    def __repr__(self) -> str:
        return f"ElementFormat({self.name}, max={self.max})"


@dataclasses.dataclass(frozen=True)
class ScaleFormat:
    """Encoding of a block (or tensor) scale.

    ``e8m0``: a biased power-of-two exponent byte (bias 127, 0xFF = NaN, no zero, no Inf).
    ``ue4m3``: an unsigned E4M3 byte (NVFP4 and INT4 block scales). ``fp32``: a float32
    tensor scale. ``absmean``: no block scale (0 bits); the float32 tensor scale is the
    tensor's mean absolute value (BitNet b1.58's ternary weights).
    """

    name: str
    bits: int

    def __repr__(self) -> str:
        return f"ScaleFormat({self.name})"


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: element format, block scale, block size, optional tensor scale.

    ``bits_per_element`` counts the packed element bits plus the block scale's share; the
    single float32 tensor scale of NVFP4, INT4 and ternary is amortised over the whole tensor
    and not counted. Scale rules by ``scale``: ``e8m0``, OCP MX (a power of two per block);
    ``ue4m3``, NVFP4's (an E4M3 block scale ``amax_block / elem_max`` relative to the float32
    tensor scale ``amax / (448 * elem_max)``); ``absmean``, BitNet b1.58's (no block scale, the
    tensor scale ``mean |x|``; ``block_size`` is then only the packing group).
    """

    name: str
    elem: ElementFormat
    scale: ScaleFormat
    block_size: int
    tensor_scale: bool = False
    description: str = ""

    @property
    def bits_per_element(self) -> float:
        return self.elem.packed_bits + self.scale.bits / self.block_size

    @property
    def is_mx(self) -> bool:
        return self.scale.name == "e8m0"

    @property
    def is_e4m3_scaled(self) -> bool:
        """NVFP4's scaling: an unsigned-E4M3 scale per block and a float32 tensor scale (the
        scaling of NVFP4 and of INT4)."""
        return self.scale.name == "ue4m3"

    @property
    def is_nvfp4(self) -> bool:
        """NVFP4 itself: E2M1 elements under NVFP4's scaling."""
        return self.is_e4m3_scaled and self.elem.name == "e2m1"

    @property
    def is_absmean(self) -> bool:
        """BitNet b1.58's scaling: one float32 ``mean |x|`` per tensor, no block scales."""
        return self.scale.name == "absmean"

    def __repr__(self) -> str:
        return (
            f"BlockFormat({self.name}: {self.elem.name} x {self.block_size}, "
            f"{self.scale.name} scale, {self.bits_per_element} bits/elem)"
        )


# Element formats (OCP MX v1.0, section 5.3; E4M3 and E5M2 as in OFP8).
E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max=448.0)
E5M2 = ElementFormat("e5m2", ebits=5, mbits=2, bias=15, max=57344.0, has_inf=True)
E3M2 = ElementFormat("e3m2", ebits=3, mbits=2, bias=3, max=28.0)
E2M3 = ElementFormat("e2m3", ebits=2, mbits=3, bias=1, max=7.5)
E2M1 = ElementFormat("e2m1", ebits=2, mbits=1, bias=1, max=6.0)
INT8 = ElementFormat("int8", ebits=0, mbits=6, bias=0, max=127.0 / 64.0, is_int=True)
INT4 = ElementFormat("int4", ebits=0, mbits=2, bias=0, max=7.0, is_int=True)
TERNARY = ElementFormat("ternary", ebits=0, mbits=0, bias=0, max=1.0, is_int=True)
# Plain symmetric int8 (codes -127..127, step 1) for per-token and per-tensor float32 scales
# (``QuantSpec(granularity="row" | "tensor")``); MX INT8 above is its block-scaled cousin.
INT8_SYM = ElementFormat("int8_sym", ebits=0, mbits=6, bias=0, max=127.0, is_int=True)

# Scale formats.
E8M0 = ScaleFormat("e8m0", 8)
UE4M3 = ScaleFormat("ue4m3", 8)
FP32 = ScaleFormat("fp32", 32)
ABSMEAN = ScaleFormat("absmean", 0)

_REGISTRY: dict[str, BlockFormat] = {}
ALIASES: dict[str, str] = {"mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e2m3"}


def register(fmt: BlockFormat, *, overwrite: bool = False) -> BlockFormat:
    """Add a block format to the registry so that ``get(fmt.name)`` finds it."""
    if not overwrite and fmt.name in _REGISTRY:
        raise ValueError(f"format {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


for _name, _elem in [
    ("mxfp8_e4m3", E4M3),
    ("mxfp8_e5m2", E5M2),
    ("mxfp6_e2m3", E2M3),
    ("mxfp6_e3m2", E3M2),
    ("mxfp4", E2M1),
    ("mxint8", INT8),
]:
    register(BlockFormat(_name, _elem, E8M0, 32, description="OCP Microscaling (MX) v1.0"))
register(
    BlockFormat(
        "nvfp4",
        E2M1,
        UE4M3,
        16,
        tensor_scale=True,
        description="NVIDIA NVFP4: E2M1 x 16, unsigned E4M3 block scale, float32 tensor scale",
    )
)
# INT4 with NVFP4's scaling. An integer grid is uniform, so its error depends on where a
# block's amax lands on it: an E8M0 power of two leaves the amax anywhere in (3.5, 7] (up to
# a bit of the 4 wasted), E4M3's three mantissa bits put it within 1/16 of the top code 7.
# Measured (relative MSE, Gaussian blocks of 16): 7.5e-3 with the E4M3 scale, 13.7e-3 with
# E8M0 (floor) and 17.2e-3 (rceil); NVFP4 9.0e-3. Blocks of 16 with the float32 tensor scale,
# as NVFP4, so that int4 and nvfp4 differ only in the element grid, at the same 4.5 bits.
register(
    BlockFormat(
        "int4",
        INT4,
        UE4M3,
        16,
        tensor_scale=True,
        description="Symmetric INT4 (codes -7..7) x 16, unsigned E4M3 block scale "
        "(amax / 7), float32 tensor scale (amax / (448 * 7)): NVFP4's scaling",
    )
)
# BitNet b1.58 (Ma et al. 2024, arXiv:2402.17764): weights in {-1, 0, 1} times one float32
# scale, the tensor's mean |w|; codes packed five a byte (1.6 bits; the information is
# log2(3) = 1.58 bits). The block is the packing group only.
register(
    BlockFormat(
        "ternary",
        TERNARY,
        ABSMEAN,
        5,
        tensor_scale=True,
        description="BitNet b1.58 ternary: codes -1, 0, 1 times the tensor's mean |x| "
        "(float32), five codes a byte",
    )
)


def names() -> list[str]:
    """Registered format names (aliases not included)."""
    return sorted(_REGISTRY)


def get(name: str | BlockFormat) -> BlockFormat:
    """Look up a block format by name (or alias); a BlockFormat passes through.

    >>> get("mxfp8").name
    'mxfp8_e4m3'
    """
    if isinstance(name, BlockFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"format must be a name or a BlockFormat, got {type(name).__name__}")
    key = ALIASES.get(name.lower(), name.lower())
    try:
        return _REGISTRY[key]
    except KeyError:
        known = ", ".join(names() + [f"{a} (= {t})" for a, t in ALIASES.items()])
        raise ValueError(f"unknown format {name!r}; known formats: {known}") from None


_TENSOR_ELEMENTS = {"e4m3": E4M3, "e5m2": E5M2, "int8": INT8_SYM}


def tensor_element(name: str) -> ElementFormat:
    """The element format of a float32-scaled tensor or row (``QuantSpec(...,
    granularity="tensor" | "row")``): ``"e4m3"``, ``"e5m2"`` or ``"int8"`` (symmetric,
    codes -127..127).

    >>> tensor_element("e4m3").max
    448.0
    """
    try:
        return _TENSOR_ELEMENTS[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"unknown per-tensor element format {name!r}; expected one of "
            f"{sorted(_TENSOR_ELEMENTS)}"
        ) from None
