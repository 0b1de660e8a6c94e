"""How to quantize a tensor, checked once: the :class:`Plan` that every implementation takes.

A plan holds the block format, the blocking of the tensor (quantized axes, block shape, the
permutation to storage order, the padded extents) and the quantizer's options, resolved:
the scale rule (:func:`scale_mode_of`, the one place a scale mode is checked and
defaulted), the rounding and the prescale. :func:`make_plan` is its only maker; lowbit's XLA
path (``lowbit.core.qarray``), the compiled CPU kernel (``lowbit.core.native`` derives its FFI
attributes from the plan) and the Pallas quantize kernel (``pallas_kernels.quantize``) all
take a plan and none checks or defaults an option again: a new quantizer option is a field
here and a branch in the implementations that compute it.

>>> from lowbit.core.plan import make_plan
>>> p = make_plan((4, 64), "mxfp4", -1, None, None, "nearest", None, None)
>>> p.block_shape, p.padded, p.scale_mode
((32,), (64,), 'floor')
>>> make_plan((4, 64), "nvfp4", -1, None, None, "nearest", None, None).scale_mode
'nvfp4'
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import sys
import warnings

import jax
import numpy as np

from lowbit.core import formats as _formats
from lowbit.core.formats import BlockFormat
from lowbit.core.scales import FOUR_OVER_SIX_METRICS

__all__ = [
    "Plan", "make_plan", "scale_mode_of", "check_prescale", "check_tensor_block", "check_eden",
    "check_block_shape", "PaddingWarning", "SCALE_MODES",
    "NVFP4_SCALE_MODES", "ROUNDINGS",
]

SCALE_MODES = ("floor", "ceil", "even", "rceil", "oas")
"""The MX shared-exponent rules (OCP MX v1.0's is ``"floor"``; ``"oas"`` is OAS, arXiv
2603.08713, as qwix computes it: ``lowbit.core.scales.mx_scale_exponent``)."""
NVFP4_SCALE_MODES = ("nvfp4", *FOUR_OVER_SIX_METRICS)
"""NVFP4's block-scale rules: ``"nvfp4"`` (the block amax to 6, E4M3 bound 448) and Four Over
Six (``"4over6"``, ``"4over6_mae"``, ``"4over6_max"``: the candidate scaling the block amax to
4 or to 6 with the smaller summed squared, summed absolute or largest error;
``lowbit.core.scales.four_over_six``)."""
ROUNDINGS = ("nearest", "stochastic", "eden")
"""Element rounding: nearest-even, stochastic, or (NVFP4) MS-EDEN: nearest-even elements under
a block scale that an EDEN factor corrects and stochastic rounding puts on the E4M3 grid
(Quartet II; ``lowbit.core.scales.ms_eden``)."""




@dataclasses.dataclass(frozen=True)
class Plan:
    """The one validated description of how to quantize a tensor (made by :func:`make_plan`):
    the XLA path, the compiled CPU kernel (``lowbit.core.native`` derives its FFI attributes from
    it) and the Pallas quantize kernel (``pallas_kernels.quantize``) all take it, and none
    checks or defaults an option again.

    Attributes:
      fmt: the block format.
      shape: the tensor's shape.
      axes: the quantized axes, non-negative, in block order.
      block_shape: the block extent along each of ``axes``.
      perm: the permutation that moves ``axes`` to the end.
      padded: the padded extent of each quantized axis (a block multiple).
      scale_mode: resolved (:func:`scale_mode_of`): one of :data:`SCALE_MODES` (MX),
        ``"nvfp4"`` (E4M3 block scales, NVFP4 and INT4), a Four Over Six mode of
        :data:`NVFP4_SCALE_MODES` (NVFP4) or ``"absmean"``.
      stochastic: stochastic rounding (the caller passes the key) instead of nearest-even.
      prescale: the scaled elements are multiplied by this before rounding, the values
        divided by it after (:func:`undo_prescale`); a recipe's ``QuantSpec.prescale``.
      eden: MS-EDEN (``rounding="eden"``, NVFP4): the block scales are EDEN-corrected and
        rounded stochastically (the caller passes the key), the elements to nearest.
      tensor_block: NVFP4 only, None or a multiple of the block: TetraJet-v2's double-block
        scaling, a float32 outer scale per ``tensor_block`` elements along the axis (in
        place of the tensor scale) above the E4M3 block scales.
    """

    fmt: BlockFormat
    shape: tuple[int, ...]
    axes: tuple[int, ...]
    block_shape: tuple[int, ...]
    perm: tuple[int, ...]
    padded: tuple[int, ...]
    scale_mode: str
    stochastic: bool
    prescale: float = 1.0
    tensor_block: int | None = None
    eden: bool = False

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The tensor's shape with each quantized axis zero-padded to a block multiple."""
        pad = dict(zip(self.axes, self.padded, strict=True))
        return tuple(pad.get(i, d) for i, d in enumerate(self.shape))

    @property
    def blocked_shape(self) -> tuple[int, ...]:
        """The padded shape with each quantized axis split in place into (blocks, block):
        blocks are formed where they lie, with no transpose."""
        blk = dict(zip(self.axes, self.block_shape, strict=True))
        dims: tuple[int, ...] = ()
        for i, d in enumerate(self.padded_shape):
            dims += (d // blk[i], blk[i]) if i in blk else (d,)
        return dims

    @property
    def block_axes(self) -> tuple[int, ...]:
        """Positions of the in-block dims in :attr:`blocked_shape`."""
        out, pos = [], 0
        for i in range(len(self.shape)):
            if i in self.axes:
                out.append(pos + 1)
                pos += 2
            else:
                pos += 1
        return tuple(out)

    @property
    def moves_axes(self) -> bool:
        return self.perm != tuple(range(len(self.shape)))


class PaddingWarning(UserWarning):
    """A quantized axis is zero-padded to a multiple of its block (see :func:`make_plan`).
    Silence it with ``warnings.filterwarnings("ignore", category=PaddingWarning)``."""


_PADDING_SEEN: set[tuple[str, int, int]] = set()


def _caller_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, from :func:`_warn_padding`, of the first frame outside
    lowbit and the libraries it traces through (jax, flax): the line that asked for the
    quantization rather than tracing code."""
    quiet = tuple(
        os.path.dirname(m.__file__) + os.sep
        for m in (sys.modules.get(n) for n in ("lowbit", "jax", "flax"))
        if getattr(m, "__file__", None)
    )
    frame, level = sys._getframe(2), 2  # make_plan: stacklevel 2 from _warn_padding
    while frame is not None and frame.f_code.co_filename.startswith(quiet):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _warn_padding(fmt: BlockFormat, length: int, block: int) -> None:
    """One :class:`PaddingWarning` per (format, axis length, block) in a process: a model's
    GEMMs trace the same cases at every jit and every layer, and one line says it all."""
    case = (fmt.name, int(length), int(block))
    if case in _PADDING_SEEN:
        return
    _PADDING_SEEN.add(case)
    padded = -(-length // block) * block
    last = length - (padded - block)
    unit = "packing group" if fmt.is_absmean else "block size"
    warnings.warn(
        f"{fmt.name} quantizes along an axis of length {length}, not a multiple of its {unit} "
        f"{block}: the axis is zero-padded to {padded} (the last block holds {last} values and "
        f"{block - last} zeros). Zeros never change a block's scale (nor a tensor scale), and "
        f"the QArray keeps the axis length {length} (dequantize returns it), but codes and "
        f"scales are stored for {padded} elements ({padded / length:.2f}x the bits along this "
        f"axis). Said once per format, length and block (lowbit.core.plan.PaddingWarning).",
        PaddingWarning,
        stacklevel=_caller_stacklevel(),
    )


def check_block_shape(fmt: BlockFormat, block_shape) -> tuple[int, ...]:
    """``block_shape`` as a tuple of ints (None: ``(fmt.block_size,)``), or a ValueError
    naming what was given and what ``fmt`` accepts: one or two positive ints, the last a
    multiple of the format's packing group (the codes of a block fill whole bytes).

    Why other blocks than the specification's are allowed: the format's own block (32 for
    MX, 16 for NVFP4 and INT4) is the one its specification defines and the default; any
    other size, a power of two or not (``(24,)``, ``(48,)``), is a research option for block
    size studies, computed with the same scale rule per block by the XLA emulation and the
    compiled CPU kernel (tests pin non-power-of-two blocks there). Block-scaled hardware and
    the Pallas kernels take powers of two of at least 16: other blocks run the emulation, with
    a warning that says so.

    >>> check_block_shape(_formats.get("mxfp4"), None), check_block_shape(
    ...     _formats.get("nvfp4"), (16, 16))
    ((32,), (16, 16))
    """
    if block_shape is None:
        return (fmt.block_size,)
    given = block_shape
    if isinstance(block_shape, (int, np.integer)) and not isinstance(block_shape, bool):
        block_shape = (block_shape,)
    ok = isinstance(block_shape, (tuple, list)) and len(block_shape) in (1, 2) and all(
        isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1
        for b in block_shape)
    if not ok:
        raise ValueError(
            f"block_shape must be None, (b,) or (b0, b1) with positive int entries, got {given!r}"
        )
    block_shape = tuple(int(b) for b in block_shape)
    n_pack, _ = fmt.elem.pack_group
    if block_shape[-1] % n_pack:
        raise ValueError(
            f"block_shape={block_shape}: the last block extent must be a multiple of {n_pack} "
            f"to pack {fmt.name} codes into bytes ({n_pack} codes per packing group)"
        )
    return block_shape


def _normalize_axes(axis, ndim: int, nblock: int) -> tuple[int, ...]:
    if isinstance(axis, (int, np.integer)):
        axis = int(axis)
        if nblock == 2:
            if axis not in (-1, ndim - 1):
                raise ValueError(
                    f"a 2-D block_shape needs axis=(a0, a1) naming the two tiled axes, got "
                    f"axis={axis}; the default tiles the last two axes"
                )
            axes: tuple[int, ...] = (-2, -1)
        else:
            axes = (axis,)
    else:
        ok = isinstance(axis, (tuple, list)) and all(
            isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axis)
        if not ok:
            raise TypeError(f"axis must be an int or a tuple of ints (the quantized axes), got "
                            f"{axis!r}")
        axes = tuple(int(a) for a in axis)
    if len(axes) != nblock:
        raise ValueError(
            f"axis={axis} names {len(axes)} axes but block_shape has {nblock} entries"
        )
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for an array of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"axis={axis} repeats an axis")
    return tuple(out)


def scale_mode_of(fmt: BlockFormat, scale_mode: str | None) -> str:
    """The scale rule of ``fmt`` that ``scale_mode`` asks for (None: the format's default),
    or a ValueError: MX formats take :data:`SCALE_MODES` (default ``"floor"``, OCP MX v1.0);
    NVFP4 and INT4 only their E4M3 rule (``"nvfp4"``); ternary only its mean |x|
    (``"absmean"``). The one place a scale mode is checked and defaulted."""
    if fmt.is_absmean:
        if scale_mode not in (None, "absmean"):
            raise ValueError(
                f"scale_mode={scale_mode!r} does not apply to {fmt.name}: its one scale is the "
                "tensor's mean |x|"
            )
        return "absmean"
    if fmt.tensor_scale:
        if scale_mode in FOUR_OVER_SIX_METRICS and not fmt.is_nvfp4:
            raise ValueError(
                f"scale_mode={scale_mode!r} (Four Over Six) does not apply to {fmt.name}: it "
                "chooses between scaling a block's amax to 4 or to 6 on the FP4 (E2M1) grid, "
                f"whose step doubles between 4 and 6; {fmt.name}'s grid is uniform (the "
                "reference allows only its plain scale for NVINT4 too). Use scale_mode=None"
            )
        if scale_mode is not None and scale_mode not in NVFP4_SCALE_MODES:
            hint = (" (MX scale modes apply to MX formats only)" if scale_mode in SCALE_MODES
                    else "")
            raise ValueError(
                f"scale_mode={scale_mode!r} does not apply to {fmt.name}: its block scales are "
                f"E4M3 values; scale_mode must be None or one of {NVFP4_SCALE_MODES}{hint}"
            )
        return "nvfp4" if scale_mode is None else scale_mode
    scale_mode = "floor" if scale_mode is None else scale_mode
    if scale_mode in NVFP4_SCALE_MODES:
        raise ValueError(
            f"scale_mode={scale_mode!r} does not apply to {fmt.name}: "
            + ("Four Over Six chooses between E4M3 block scales of NVFP4; an MX block scale is "
               "a power of two (E8M0)" if scale_mode in FOUR_OVER_SIX_METRICS
               else "MX block scales are powers of two (E8M0)")
            + f"; scale_mode must be one of {SCALE_MODES}"
        )
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    return scale_mode


def check_prescale(prescale, name: str = "prescale") -> float:
    """``prescale`` as a float if it is a static finite positive number, else an error."""
    if isinstance(prescale, (jax.Array, bool, np.ndarray)) or not isinstance(
        prescale, numbers.Real
    ):
        raise TypeError(f"{name} must be a Python float (static), got {prescale!r}")
    if not (math.isfinite(prescale) and prescale > 0):
        raise ValueError(f"{name} must be a finite positive float, got {prescale}")
    return float(prescale)


def check_tensor_block(fmt: BlockFormat, tensor_block, block_shape=None, scale_mode=None,
                       tensor_amax=None) -> int | None:
    """``tensor_block`` as an int if it is None or a valid outer block for ``fmt`` (NVFP4,
    1-D blocks, a positive multiple of the block, the plain scale rule, no calibrated tensor
    amax), else an error naming what is wrong."""
    if tensor_block is None:
        return None
    if isinstance(tensor_block, bool) or not isinstance(tensor_block, (int, np.integer)):
        raise TypeError(f"tensor_block must be None or an int, got {tensor_block!r}")
    tensor_block = int(tensor_block)
    if not fmt.is_nvfp4:
        raise ValueError(
            f"tensor_block applies to NVFP4 (an FP32 outer scale above its E4M3 block scales, "
            f"TetraJet-v2), not to {fmt.name}"
        )
    block = fmt.block_size if block_shape is None else tuple(block_shape)
    if isinstance(block, tuple):
        if len(block) != 1:
            raise ValueError(
                f"tensor_block needs 1-D blocks along one axis, got block_shape {block}"
            )
        (block,) = block
    if tensor_block < block or tensor_block % block:
        raise ValueError(
            f"tensor_block={tensor_block} must be a positive multiple of the block ({block})"
        )
    if scale_mode not in (None, "nvfp4"):
        raise ValueError(
            f"tensor_block takes NVFP4's plain block scales, not scale_mode={scale_mode!r}"
        )
    if tensor_amax is not None:
        raise ValueError(
            "tensor_block replaces the tensor scale by one per outer block: a calibrated "
            "tensor_amax does not apply"
        )
    return tensor_block


def check_eden(fmt: BlockFormat, scale_mode=None, tensor_block=None, tensor_amax=None,
               prescale: float = 1.0) -> None:
    """An error naming what does not combine with ``rounding="eden"`` (MS-EDEN), if anything."""
    clash = [n for n, bad in (
        (f"format {fmt.name} (MS-EDEN is NVFP4's)", not fmt.is_nvfp4),
        (f"scale_mode={scale_mode!r}", scale_mode not in (None, "nvfp4")),
        (f"tensor_block={tensor_block}", tensor_block is not None),
        ("a calibrated tensor_amax (its tensor scale comes from the corrected block scales)",
         tensor_amax is not None),
        (f"prescale={prescale} (its scale override, 0.988125, is built in)", prescale != 1.0),
    ) if bad]
    if clash:
        raise ValueError(f"rounding='eden' does not combine with {', '.join(clash)}")


def _check_tensor_amax(fmt: BlockFormat, tensor_amax) -> None:
    if fmt.is_absmean:
        if tensor_amax is not None:
            raise ValueError(
                f"tensor_amax applies to amax-scaled tensor scales (NVFP4, INT4), not to "
                f"{fmt.name}, whose scale is the tensor's mean |x|"
            )
    elif fmt.tensor_scale:
        if tensor_amax is not None and not isinstance(tensor_amax, jax.core.Tracer):
            ta = np.asarray(tensor_amax)
            if ta.shape != () or not np.isfinite(ta) or ta < 0:
                raise ValueError(
                    f"tensor_amax must be a finite non-negative scalar, got {tensor_amax}"
                )
    elif tensor_amax is not None:
        raise ValueError(
            f"tensor_amax applies only to formats with an amax tensor scale (NVFP4, INT4), "
            f"not to {fmt.name}"
        )


def make_plan(
    shape, fmt, axis, block_shape, scale_mode, rounding, key, tensor_amax,
    prescale: float = 1.0, tensor_block: int | None = None, *, warn_padding: bool = True,
) -> Plan:
    """The checked :class:`Plan` for quantizing an array of ``shape`` to ``fmt`` along
    ``axis`` (a pair of axes for a 2-D ``block_shape``); the other arguments as in
    :func:`quantize` (``key`` and ``tensor_amax`` are checked, not kept), ``prescale`` and
    ``tensor_block`` as in :class:`Plan`. A quantized axis whose length is not a multiple of
    its block is zero-padded (:attr:`Plan.padded`): a :class:`PaddingWarning` says so once per
    format, length and block (``warn_padding=False``: not here, e.g. for a plan rebuilt from a
    QArray that was quantized already)."""
    fmt = _formats.get(fmt)
    ndim = len(shape)
    block_shape = check_block_shape(fmt, block_shape)
    if len(block_shape) > ndim:
        raise ValueError(
            f"block_shape={block_shape} is a {len(block_shape)}-D tile but x has rank {ndim}"
        )
    axes = _normalize_axes(axis, ndim, len(block_shape))
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    stochastic = rounding == "stochastic"
    if rounding != "nearest" and key is None:
        raise ValueError(f"rounding={rounding!r} needs a PRNG key: pass key=jax.random.key(...)")
    scale_mode = scale_mode_of(fmt, scale_mode)
    _check_tensor_amax(fmt, tensor_amax)
    prescale = check_prescale(prescale)
    tensor_block = check_tensor_block(fmt, tensor_block, block_shape, scale_mode, tensor_amax)
    if rounding == "eden":
        check_eden(fmt, scale_mode, tensor_block, tensor_amax, prescale)
    other = tuple(i for i in range(ndim) if i not in axes)
    padded = tuple(-(-shape[a] // b) * b for a, b in zip(axes, block_shape, strict=True))
    if warn_padding:
        for a, b, p in zip(axes, block_shape, padded, strict=True):
            if p != shape[a]:
                _warn_padding(fmt, shape[a], b)
    return Plan(fmt, tuple(shape), axes, block_shape, other + axes, padded, scale_mode,
                stochastic, prescale, tensor_block, rounding == "eden")
