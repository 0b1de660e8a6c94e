"""Element, scale and block formats, and the registry of format names.

A format is data: frozen dataclasses that describe an encoding. The operations that use them
(quantize, dequantize, rounding) are free functions in :mod:`lowbit.numerics` and
:mod:`lowbit.qarray`.

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
    "E8M0",
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
    subnormals and saturate at ``max``. ``INT8`` (MX semantics) is a fixed-point format:
    two's-complement codes -127..127 times ``2**-6`` (``ebits == 0``, ``mbits == 6``).
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
        return 8 if self.is_int else 1 + self.ebits + self.mbits

    @property
    def emax(self) -> int:
        """Exponent of the largest binade (``floor(log2(max))``); 0 for MX INT8."""
        return int(np.floor(np.log2(self.max))) if not self.is_int else 0

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade; the grid step below ``2**emin`` is
        ``2**(emin - mbits)``. MX INT8 is modelled as ``emin = 0, mbits = 6`` (step ``2**-6``
        everywhere below its max of 127/64)."""
        return 0 if self.is_int else 1 - self.bias

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
            return np.arange(128, dtype=np.float64) / 64.0
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
    ``ue4m3``: an unsigned E4M3 byte (NVFP4 block scales). ``fp32``: a float32 tensor scale.
    """

    name: str
    bits: int

    def __repr__(self) -> str:
        return f"ScaleFormat({self.name})"


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: element format, block scale, block size, optional tensor scale.

    ``bits_per_element`` counts the element bits plus the block scale's share; the single
    float32 tensor scale of NVFP4 is amortised over the whole tensor and not counted.
    """

    name: str
    elem: ElementFormat
    scale: ScaleFormat
    block_size: int
    tensor_scale: bool = False
    description: str = ""

    @property
    def bits_per_element(self) -> float:
        return self.elem.bits + self.scale.bits / self.block_size

    @property
    def is_mx(self) -> bool:
        return self.scale.name == "e8m0"

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

# Scale formats.
E8M0 = ScaleFormat("e8m0", 8)
UE4M3 = ScaleFormat("ue4m3", 8)
FP32 = ScaleFormat("fp32", 32)

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


_TENSOR_ELEMENTS = {"e4m3": E4M3, "e5m2": E5M2}


def tensor_element(name: str) -> ElementFormat:
    """The element format of per-tensor scaled FP8 (``QuantSpec(..., granularity="tensor")``):
    ``"e4m3"`` or ``"e5m2"``.

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
