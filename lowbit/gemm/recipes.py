"""Training recipes: how each operand of the three GEMMs of a linear layer is quantized.

For ``y = x @ w`` with ``x [M, K]`` and ``w [K, N]`` (any ``lax.dot_general`` dimension numbers
generalise this): ``fwd`` computes ``y`` (contracts K), ``dlhs`` the input gradient
``dx = dy @ w.T`` (contracts N; operands ``(dy, w)``), ``drhs`` the weight gradient
``dw = x.T @ dy`` (contracts M; operands ``(x, dy)``). Each GEMM holds one :class:`QuantSpec`
per operand, quantized along that GEMM's own contraction axis, and an optional Hadamard
transform along that axis applied to both operands.

An operand spec of ``None`` in a backward GEMM means *straight-through*: the operand enters as
the forward GEMM saw it (its forward-quantized value, or the high-precision tensor when the
forward kept it), so a recipe whose backward specs are all None computes exactly the STE
gradient of its forward. ``dy`` has no forward value: None keeps it in high precision.

Recipes compose: build new ones from QuantSpecs without touching the library.

>>> import lowbit as lb
>>> r = lb.recipes.get("nvfp4")
>>> r.fwd.rhs.block_shape, r.drhs.hadamard, r.dlhs.lhs.rounding
((16, 16), 16, 'stochastic')
>>> my = lb.recipes.Recipe(
...     "w4a8", fwd=lb.recipes.GemmSpec(lb.recipes.QuantSpec("mxfp8"),
...                                     lb.recipes.QuantSpec("mxfp4")))
>>> my.is_fqt
False
"""

from __future__ import annotations

import dataclasses

from lowbit.core import formats as _formats
from lowbit.core.plan import (
    ROUNDINGS,
    check_eden,
    check_prescale,
    check_tensor_block,
    scale_mode_of,
)

__all__ = [
    "QuantSpec",
    "GemmSpec",
    "Recipe",
    "get",
    "names",
    "register",
    "TENSOR_ELEMENTS",
    "GRANULARITIES",
    "GEMMS",
    "BACKWARD_OPERANDS",
]

# Element formats usable with granularity="tensor" or "row" (float32 scales).
TENSOR_ELEMENTS = ("e4m3", "e5m2", "int8")
GRANULARITIES = ("block", "tensor", "row")
GEMMS = ("fwd", "dlhs", "drhs")  # the three GEMMs of a recipe, in fold_in tag order
BACKWARD_OPERANDS = ("high", "forward")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized.

    Attributes:
      format: a block format name (``lb.formats.names()``), or with ``granularity="tensor"``
        or ``"row"`` an element format (``"e4m3"``, ``"e5m2"``, ``"int8"``) with float32
        scales.
      rounding: ``"nearest"`` or ``"stochastic"`` (keys come from the dot_general's ``key``).
      scale_mode: the block-scale rule (None: the format's default): an MX rule
        (``lowbit.core.plan.SCALE_MODES``, default ``"floor"``, ``"oas"`` for OAS) or an
        NVFP4 one (``"nvfp4"``, Four Over Six's ``"4over6"``, ``"4over6_mae"``,
        ``"4over6_max"``).
      block_shape: None (1-D blocks along the contraction axis) or a 2-D tile
        ``(along contraction, along the operand's last free axis)``, e.g. ``(16, 16)``, so one
        quantized weight serves both the forward and the input-gradient GEMM.
      granularity: ``"block"``; ``"tensor"`` (one float32 scale per tensor); ``"row"`` (one
        float32 scale per slice along the contraction axis: per token for an activation, per
        output channel for a weight). FP8 elements take Transformer Engine's current scaling
        (``s = elem_max / amax``, values ``elements * (1 / s)``); ``"int8"`` takes BitNet
        b1.58's ``activation_quant`` (``s = 127 / max(amax, 1e-5)``, elements
        ``round(x * s)`` in -127..127, values ``elements / s``).
      prescale: a gain on the elements: the scale is chosen from the operand as usual, the
        scaled elements are multiplied by ``prescale`` before rounding, and the dequantized
        values divided by it (3/4 keeps stochastic rounding of FP4 from clipping: the largest
        scaled element of an MX block is below 8, and 8 * 3/4 = 6; Tseng et al. 2025).
      clip_rms: clip to +-clip_rms * RMS (over the contraction axis) before quantizing
        (QuEST / Quartet forward); None: no clipping.
      amax: a static (calibrated, :mod:`lowbit.ptq`) absolute max of the operand, or None
        (dynamic: each call's own). NVFP4 takes it as its ``tensor_amax`` (the E4M3 block
        scales stay dynamic, blocks above it saturate); per-tensor FP8 scales by
        ``elem_max / amax`` (values beyond it saturate); an MX format clips the operand to
        ``+-amax`` before its (dynamic, by definition) block scales.
      scale_std: QuEST's scale rule instead of the format's amax rule (MX formats only): each
        block's power-of-two scale is ``2**floor(log2(scale_std / elem_max * std + 1e-8))``,
        ``std`` the block's standard deviation (population, mean removed), so that
        ``+-scale_std`` standard deviations span the element grid; elements beyond the grid
        saturate. Quartet's forward uses 2.92247856 (the MSE-optimal clip of a Gaussian for
        FP4). None: the format's own rule.
      tensor_block: NVFP4 only: TetraJet-v2's double-block scaling, a float32 outer scale per
        ``tensor_block`` elements along the contraction axis (e.g. 128) in place of the
        per-tensor scale (``lowbit.quantize``'s ``tensor_block``).
      pow2_tensor_scale: NVFP4 / INT4: round the tensor amax up to ``448 * elem_max * 2**k``
        (:func:`lowbit.core.scales.pow2_tensor_amax`), so that the tensor scale is a power of
        two. Its reciprocal is then exact, and every engine's arithmetic gives lowbit's values:
        compressed-tensors / vLLM store ``1 / t`` as the global scale (``lowbit.io``'s
        compressed-tensors export needs it to be exact). The block scales use at least half
        of E4M3's range.
      trust_mask: for a forward operand, QuEST's trust estimator: the backward zeroes the
        gradient of every element whose scaled magnitude reached the element grid's max
        (``|x / scale| >= elem_max``), in the basis the forward quantized it (inside the
        forward's Hadamard transform). Needs ``scale_std``.
    """

    format: str
    rounding: str = "nearest"
    scale_mode: str | None = None
    block_shape: tuple[int, ...] | None = None
    granularity: str = "block"
    prescale: float = 1.0
    clip_rms: float | None = None
    amax: float | None = None
    scale_std: float | None = None
    trust_mask: bool = False
    tensor_block: int | None = None
    pow2_tensor_scale: bool = False

    def __post_init__(self):
        if self.granularity in ("tensor", "row"):
            if self.format not in TENSOR_ELEMENTS:
                raise ValueError(
                    f"granularity={self.granularity!r} needs format in {TENSOR_ELEMENTS}, got "
                    f"{self.format!r}"
                )
            if self.block_shape is not None:
                raise ValueError(
                    f"granularity={self.granularity!r} has no blocks: block_shape must be None, "
                    f"got {self.block_shape}"
                )
        elif self.granularity == "block":
            fmt = _formats.get(self.format)
            object.__setattr__(self, "format", fmt.name)
            scale_mode_of(fmt, self.scale_mode)  # the one check of a scale mode
            object.__setattr__(self, "tensor_block", check_tensor_block(
                fmt, self.tensor_block, self.block_shape, self.scale_mode, self.amax))
            if self.rounding == "eden":
                check_eden(fmt, self.scale_mode, self.tensor_block, self.amax,
                           check_prescale(self.prescale))
                if self.block_shape not in (None, (fmt.block_size,)):
                    raise ValueError(
                        f"rounding='eden' takes NVFP4's 1-D blocks of 16, got block_shape "
                        f"{self.block_shape}"
                    )
        else:
            raise ValueError(
                f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}"
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.rounding == "eden" and self.granularity != "block":
            raise ValueError("rounding='eden' (MS-EDEN) is NVFP4's: granularity must be 'block'")
        if self.granularity != "block" and self.scale_mode is not None:
            raise ValueError(
                f"scale_mode={self.scale_mode!r} does not apply to granularity="
                f"{self.granularity!r}: its float32 scales are amax-based"
            )
        if self.block_shape is not None:
            object.__setattr__(self, "block_shape", tuple(int(b) for b in self.block_shape))
        object.__setattr__(self, "prescale", check_prescale(self.prescale))
        if self.amax is not None:
            a = float(self.amax)
            if not (a > 0 and a < float("inf")):
                raise ValueError(f"amax must be a finite positive number or None, got {self.amax}")
            object.__setattr__(self, "amax", a)
            if self.granularity == "row":
                raise ValueError(
                    "amax (a static per-tensor amax) does not apply to granularity='row', "
                    "whose scales are each row's own"
                )
            if self.granularity == "block" and _formats.get(self.format).is_absmean:
                raise ValueError(
                    f"amax does not apply to {self.format}: its scale is the tensor's mean |x|"
                )
        if self.scale_std is not None:
            self._check_scale_std()
        if self.pow2_tensor_scale:
            self._check_pow2()
        if self.trust_mask and self.scale_std is None:
            raise ValueError(
                "trust_mask=True needs scale_std (the mask marks the elements that QuEST's "
                "std-scaled quantizer saturates)"
            )

    def _check_pow2(self) -> None:
        fmt = None if self.granularity != "block" else _formats.get(self.format)
        clash = [n for n, bad in (
            (f"{self.format} (no tensor scale)", fmt is None or not fmt.tensor_scale
             or fmt.is_absmean),
            (f"tensor_block={self.tensor_block}", self.tensor_block is not None),
            (f"scale_mode={self.scale_mode!r}", self.scale_mode not in (None, "nvfp4")),
            ("rounding='eden'", self.rounding == "eden"),
        ) if bad]
        if clash:
            raise ValueError(f"pow2_tensor_scale=True needs one NVFP4 / INT4 tensor scale of "
                             f"the plain rule; got {', '.join(clash)}")

    def _check_scale_std(self) -> None:
        c = float(self.scale_std)
        if not (c > 0 and c < float("inf")):
            raise ValueError(f"scale_std must be a finite positive number, got {self.scale_std}")
        object.__setattr__(self, "scale_std", c)
        fmt = None if self.granularity != "block" else _formats.get(self.format)
        clash = [
            n for n, bad in (
                (f"granularity={self.granularity!r}", fmt is None),
                (f"{self.format} (its scales are not powers of two)",
                 fmt is not None and fmt.tensor_scale),
                (f"block_shape={self.block_shape}", self.block_shape is not None),
                ("scale_mode", self.scale_mode is not None),
                ("clip_rms", self.clip_rms is not None),
                ("amax", self.amax is not None),
            ) if bad
        ]
        if clash:
            raise ValueError(
                f"scale_std sets the block scales of an MX format along the contraction axis "
                f"(blocks of the format's own size); it does not combine with {', '.join(clash)}"
            )

    @property
    def stochastic(self) -> bool:
        """Whether quantizing draws random bits (stochastic rounding, or MS-EDEN's scales)."""
        return self.rounding in ("stochastic", "eden")

    @property
    def bits_per_element(self) -> float:
        """Stored bits per element: packed codes plus the block scales' share (per-tensor
        and per-row float32 scales are not counted)."""
        if self.granularity != "block":
            return 8.0
        fmt = _formats.get(self.format)
        if self.block_shape is not None:
            n = 1
            for b in self.block_shape:
                n *= b
            return fmt.elem.packed_bits + fmt.scale.bits / n
        if self.tensor_block is not None:  # plus a float32 outer scale per tensor_block
            return fmt.bits_per_element + 32.0 / self.tensor_block
        return fmt.bits_per_element


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """Quantization of one GEMM: a spec per operand and an optional Hadamard transform.

    ``hadamard`` is a block size (16..256) of a Walsh-Hadamard transform applied along the
    GEMM's contraction axis to both operands before quantization (it cancels in exact
    arithmetic). ``random_signs``: a random +-1 diagonal drawn from the call's key first
    (a fixed key when the call has none); False: the plain (Sylvester) transform.
    ``signs_of``: draw the signs of another GEMM of the recipe (``"fwd"``, ``"dlhs"`` or
    ``"drhs"``) instead of this one's own, so that both share one sign vector per call (as
    Quartet's backward does); None: this GEMM's own.
    """

    lhs: QuantSpec | None = None
    rhs: QuantSpec | None = None
    hadamard: int | None = None
    random_signs: bool = True
    signs_of: str | None = None

    def __post_init__(self):
        if self.signs_of is not None and self.signs_of not in GEMMS:
            raise ValueError(f"signs_of must be one of {GEMMS} or None, got {self.signs_of!r}")
        eden = [s for s in (self.lhs, self.rhs) if s is not None and s.rounding == "eden"]
        if eden and (self.hadamard != 128 or not self.random_signs):
            raise ValueError(
                "rounding='eden' (MS-EDEN) is unbiased only after a random Hadamard transform "
                f"of 128 along the GEMM's contraction axis: this GEMM has hadamard="
                f"{self.hadamard}, random_signs={self.random_signs}"
            )

    @property
    def active(self) -> bool:
        return self.lhs is not None or self.rhs is not None or self.hadamard is not None

    @property
    def stochastic(self) -> bool:
        return any(s is not None and s.stochastic for s in (self.lhs, self.rhs))


_NONE = GemmSpec()


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named low-bit training recipe: specs for the forward and both backward GEMMs.

    ``residuals``: what the forward saves for the backward. ``"high"`` saves the
    high-precision operands and quantizes again in the backward (least memory traffic in
    the forward); ``"quantized"`` quantizes the backward operands in the forward and saves
    them packed (QArray), which is what a memory-bound real deployment does.

    ``backward_operands``: where the backward GEMMs' x (wgrad) and w (dgrad) come from.
    ``"high"``: the high-precision tensors (a None spec: the forward-quantized value,
    straight-through). ``"forward"``: the forward-quantized values in the basis the forward
    multiplied them (inside its Hadamard transform), quantized again by the backward specs
    (None: as they are); the gradients the backward GEMMs produce are gradients of those
    values, and return through the forward quantizers: their trust masks, then the inverse of
    the forward's transform. So the backward is the chain rule through the forward's own
    quantized GEMM (Quartet's ``Q(E)Q(Wt)t_Q(Et)Q(Xt)t`` scheme).

    ``version``: raised whenever a registered recipe's definition changes, so that a run of
    the old definition is not taken for one of the new (experiments record it with each run).
    """

    name: str
    fwd: GemmSpec = _NONE
    dlhs: GemmSpec = _NONE
    drhs: GemmSpec = _NONE
    residuals: str = "high"
    description: str = ""
    source: str = ""
    backward_operands: str = "high"
    version: int = 1

    def __post_init__(self):
        if self.residuals not in ("high", "quantized"):
            raise ValueError(f"residuals must be 'high' or 'quantized', got {self.residuals!r}")
        if self.backward_operands not in BACKWARD_OPERANDS:
            raise ValueError(
                f"backward_operands must be one of {BACKWARD_OPERANDS}, got "
                f"{self.backward_operands!r}"
            )
        if self.through_forward and self.residuals != "high":
            raise ValueError(
                "residuals='quantized' does not combine with backward_operands='forward' or a "
                "trust_mask: the backward recomputes the forward's quantized operands and masks"
            )
        gemms = dict(zip(GEMMS, (self.fwd, self.dlhs, self.drhs), strict=True))
        for name, g in gemms.items():
            if g.signs_of is not None and g.hadamard != gemms[g.signs_of].hadamard:
                raise ValueError(
                    f"{name}.signs_of={g.signs_of!r}: both GEMMs need the same Hadamard block, "
                    f"got {g.hadamard} and {gemms[g.signs_of].hadamard}"
                )
        for name in ("dlhs", "drhs"):
            for side in ("lhs", "rhs"):
                spec = getattr(gemms[name], side)
                if spec is not None and spec.trust_mask:
                    raise ValueError(f"{name}.{side}: trust_mask applies to forward operands")

    @property
    def through_forward(self) -> bool:
        """Whether the backward runs through the forward's quantizers (``backward_operands
        ="forward"`` or a forward trust mask)."""
        masks = any(s is not None and s.trust_mask for s in (self.fwd.lhs, self.fwd.rhs))
        return self.backward_operands == "forward" or masks

    @property
    def is_identity(self) -> bool:
        return not (self.fwd.active or self.dlhs.active or self.drhs.active)

    @property
    def is_fqt(self) -> bool:
        """True when a backward GEMM quantizes something (fully quantized training)."""
        return self.dlhs.active or self.drhs.active

    @property
    def needs_key(self) -> bool:
        gemms = (self.fwd, self.dlhs, self.drhs)
        return any(g.stochastic or (g.hadamard and g.random_signs) for g in gemms)

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)


_RECIPES: dict[str, Recipe] = {}


def register(recipe: Recipe, *, overwrite: bool = False) -> Recipe:
    """Make ``recipe`` available by name to ``get`` and to everything taking ``recipe=``."""
    if not overwrite and recipe.name in _RECIPES:
        raise ValueError(f"recipe {recipe.name!r} is already registered")
    _RECIPES[recipe.name] = recipe
    return recipe


def names() -> list[str]:
    return sorted(_RECIPES)


def get(recipe: str | Recipe | None) -> Recipe:
    """A Recipe by name (``None`` means ``"none"``); a Recipe passes through."""
    if recipe is None:
        return _RECIPES["none"]
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a name or a Recipe, got {type(recipe).__name__}")
    try:
        return _RECIPES[recipe.lower()]
    except KeyError:
        raise ValueError(
            f"unknown recipe {recipe!r}; known recipes: {', '.join(names())}"
        ) from None


def _all(spec: QuantSpec, grad: QuantSpec | None = None) -> tuple[GemmSpec, GemmSpec, GemmSpec]:
    g = spec if grad is None else grad
    return GemmSpec(spec, spec), GemmSpec(g, spec), GemmSpec(spec, g)


register(Recipe("none", description="No quantization: the model's own dtype (the baseline)."))

_fwd, _dl, _dr = _all(
    QuantSpec("e4m3", granularity="tensor"), QuantSpec("e5m2", granularity="tensor")
)
register(
    Recipe(
        "fp8",
        _fwd,
        _dl,
        _dr,
        description="Per-tensor scaled FP8: E4M3 weights and activations, E5M2 gradients.",
        source="Micikevicius et al. 2022, 'FP8 Formats for Deep Learning' (arXiv:2209.05433)",
    )
)

_fwd, _dl, _dr = _all(QuantSpec("mxfp8_e4m3", scale_mode="rceil"))
register(
    Recipe(
        "mxfp8",
        _fwd,
        _dl,
        _dr,
        description="MXFP8 E4M3 for every operand of all three GEMMs, scales rounded up.",
        source="OCP MX v1.0 (2023); Mishra et al. 2025, 'Recipes for Pre-training LLMs with "
        "MXFP8' (arXiv:2506.08027): E4M3 everywhere with round-up (rceil) E8M0 scales",
    )
)

_fwd, _dl, _dr = _all(QuantSpec("mxfp6_e2m3"), QuantSpec("mxfp6_e3m2"))
register(
    Recipe(
        "mxfp6",
        _fwd,
        _dl,
        _dr,
        description="MXFP6: E2M3 weights and activations, E3M2 gradients, all three GEMMs.",
        source="Rouhani et al. 2023, 'Microscaling Data Formats for Deep Learning' "
        "(arXiv:2310.10537): MXFP6 training within a small gap of FP32",
    )
)

_fwd, _dl, _dr = _all(QuantSpec("mxfp4"))
register(
    Recipe(
        "mxfp4",
        _fwd,
        _dl,
        _dr,
        description="Naive MXFP4 for every operand of all three GEMMs (nearest rounding).",
        source="Rouhani et al. 2023 (arXiv:2310.10537): MXFP4 training degrades without "
        "further measures",
    )
)

_a = QuantSpec("nvfp4")
_w = QuantSpec("nvfp4", block_shape=(16, 16))
_g = QuantSpec("nvfp4", rounding="stochastic")
register(
    Recipe(
        "nvfp4",
        fwd=GemmSpec(_a, _w),
        dlhs=GemmSpec(_g, _w),
        drhs=GemmSpec(_a, _g, hadamard=16),
        description="NVFP4 with 16x16 weight tiles (one quantized weight serves fprop and "
        "dgrad), a 16-point random Hadamard transform on the wgrad operands, stochastic "
        "rounding of gradients.",
        source="NVIDIA 2025, 'Pretraining Large Language Models with NVFP4' (arXiv:2509.25149)",
    )
)

# Four Over Six as its public training code runs it (mit-han-lab/fouroversix @ dadfad69):
# ModuleQuantizationConfig (src/fouroversix/model/config.py:73-95) gives the activation, the
# weight and the gradient the same scale rule, "mse" (4/6 with the squared error) by default
# and in the shipped configs (scripts/train/configs/transformer_340M_nvfp4_fouroversix.json);
# FourOverSixLinearFunction (src/fouroversix/model/modules/linear.py:61-282) quantizes all six
# GEMM operands with it: x and w in fprop, dy (stochastic) and w^T in dgrad, dy^T and x^T with
# a 16-point Hadamard in wgrad; flame trains with weight_scale_2d=True (16x16 weight tiles,
# one 4-or-6 choice per tile). Its gradients round "stochastic_unbiased": stochastic rounding
# with the element grid shrunk by 16/17 so that nothing clips, which lowbit's prescale=16/17
# does (the reference folds 16/17 into its encode constant instead of dividing it out of the
# values: the same grid, roundings placed differently). Its wgrad Hadamard has fixed signs
# (quantize/utils.py:19-30); lowbit's nvfp4 recipe draws random signs, and so does this one.
_a6 = QuantSpec("nvfp4", scale_mode="4over6")
_w6 = QuantSpec("nvfp4", scale_mode="4over6", block_shape=(16, 16))
_g6 = QuantSpec("nvfp4", scale_mode="4over6", rounding="stochastic", prescale=16 / 17)
register(
    Recipe(
        "four_over_six",
        fwd=GemmSpec(_a6, _w6),
        dlhs=GemmSpec(_g6, _w6),
        drhs=GemmSpec(_a6, _g6, hadamard=16),
        description="NVFP4 with Four Over Six block scales on every operand (each block "
        "scaled to 4 or to 6, whichever has the smaller squared error; E4M3 bound 256): 16x16 "
        "weight tiles, a 16-point random Hadamard on the wgrad operands, stochastic rounding "
        "of gradients on a grid shrunk by 16/17.",
        source="Four Over Six (arXiv:2512.02010) and its code "
        "(mit-han-lab/fouroversix @ dadfad69)",
    )
)

# Quartet II as its released kernels run it (IST-DASLab/Quartet-II @ 8776a90b,
# kernels/python/quartet2/linear.py, Quartet_II_fn): the forward quantizes both operands to
# NVFP4 with Four Over Six and round-to-nearest (round_four_six.cu, `four_over_six=True` by
# default, linear.py:232-234) and saves the forward-quantized operands (183-184); each
# backward call re-draws the signs of one random Hadamard of 128 (rerotate_hadamard, 205)
# shared by both backward GEMMs, each along its contraction axis, and quantizes the gradient
# and the forward-quantized operand with MS-EDEN (rht128_quant_eden / rht128_requant,
# 217-227). Differences: lowbit's 4/6 follows mit-han-lab/fouroversix's arithmetic (Quartet
# II's kernel computes the tensor scale as amax * (1/256) * (1/6) and treats a zero block
# scale as 1); its Hadamard groups the outputs by swizzle_hadamard (rht.py:65-82) where
# lowbit's groups are contiguous, and it rounds the re-quantized operands to bfloat16 first.
# The backward contraction axes (tokens, output features) must be multiples of 128.
_q2f = QuantSpec("nvfp4", scale_mode="4over6")
_q2b = QuantSpec("nvfp4", rounding="eden")
register(
    Recipe(
        "quartet2",
        fwd=GemmSpec(_q2f, _q2f),
        dlhs=GemmSpec(_q2b, _q2b, hadamard=128),
        drhs=GemmSpec(_q2b, _q2b, hadamard=128, signs_of="dlhs"),
        backward_operands="forward",
        description="Quartet II: NVFP4 forward with Four Over Six scales; both backward GEMMs "
        "on the forward-quantized operands, quantized with MS-EDEN (EDEN-corrected, "
        "stochastically rounded block scales) after one random Hadamard of 128 per step "
        "shared by both.",
        source="Quartet II (arXiv:2601.22813) and its released kernels (IST-DASLab/Quartet-II "
        "@ 8776a90b)",
    )
)

# TetraJet-v2's NVFP4 linear layer as its code runs it (thu-ml/TetraJet-v2-NVFP4Training @
# ca5953f6, olmo2-training/olmo/quantization_real/linear.py:64-148,
# NVFP4_TetraJetv2_MatMulFunc_BwdAllRHT16SQ_Padding128): the forward quantizes x and w along K
# with double-block scales (an FP32 outer scale per 128, E4M3 inner scales per 16;
# kernels/csrc/quant_fp4.cu:257-328) and round-to-nearest; the backward GEMMs take the
# forward-quantized x and w (the fused kernel dequantizes, transposes and re-quantizes them,
# quant_fp4.cu:613-713) and dy, every operand after a 16-point random Hadamard along the GEMM's
# contraction axis (one sign draw per GEMM, shared by its two operands: seed_dx, seed_dw) and
# double-block stochastic rounding. Its Hadamard signs depend only on the position in the
# 16-group, as lowbit's per-block signs do; its kernels divide with fast-math, lowbit exactly.
# OsciReset and OutControl, the paper's two training-state methods, are trainer features.
_tjf = QuantSpec("nvfp4", tensor_block=128)
_tjb = QuantSpec("nvfp4", rounding="stochastic", tensor_block=128)
register(
    Recipe(
        "tetrajet2",
        fwd=GemmSpec(_tjf, _tjf),
        dlhs=GemmSpec(_tjb, _tjb, hadamard=16),
        drhs=GemmSpec(_tjb, _tjb, hadamard=16),
        backward_operands="forward",
        description="TetraJet-v2: NVFP4 with double-block scales (FP32 per 128, E4M3 per 16), "
        "round-to-nearest forward; both backward GEMMs on the forward-quantized operands "
        "after a random 16-point Hadamard, stochastic rounding.",
        source="TetraJet-v2 (arXiv:2510.27527) and its code (thu-ml/TetraJet-v2-NVFP4Training "
        "@ ca5953f6)",
    )
)

# TetraJet-v2's OutControl (olmo2-training/olmo/quantization_real/linear_mix.py:115-250 @
# ca5953f6, NVFP4_mix_MXFP8_TetraJetv2_MatMulFunc_BwdAllRHT16SQ_Padding128) runs the input
# channels with the largest recorded activation norms in MXFP8: x and w of those channels
# quantized along K by quant_fp8 (kernels/csrc/quant_fp8.cu:30-75: blocks of 32, E4M3
# elements, the E8M0 scale of amax / 448 rounded up: lowbit's "rceil"), round-to-nearest; the
# weight gradient of those channels an MXFP8 GEMM of dy^T and the forward-quantized x^T
# (quant_fp8_dequant_trans_requant_fused), and the input gradient one NVFP4 GEMM over all
# channels, whose w^T holds these channels' MXFP8-dequantized values (re-quantized with the
# 16-point random Hadamard and stochastic rounding like the rest). lowbit.flax's channel split
# (lowbit.flax.training.out_control) runs this recipe on the outlier channels and tetrajet2
# on the others; the two halves' dy quantizations are drawn independently (TetraJet-v2
# quantizes dy once for the whole dgrad), each unbiased.
_tj8 = QuantSpec("mxfp8", scale_mode="rceil")
register(
    Recipe(
        "tetrajet2_fp8",
        fwd=GemmSpec(_tj8, _tj8),
        dlhs=GemmSpec(_tjb, _tjb, hadamard=16),
        drhs=GemmSpec(_tj8, _tj8),
        backward_operands="forward",
        description="TetraJet-v2's outlier channels (OutControl): MXFP8 (E4M3, rceil scales) "
        "forward and weight gradient, the input gradient NVFP4 as tetrajet2's.",
        source="TetraJet-v2 (arXiv:2510.27527) and its code (thu-ml/TetraJet-v2-NVFP4Training "
        "@ ca5953f6)",
    )
)

# FP4 All the Way (Chmiel et al. 2025, arXiv:2505.19115v2; its reference implementation,
# github.com/Anonymous1252022/fp4-all-the-way, could not be fetched here, so this follows the
# paper): NVFP4 (blocks of 16, E4M3 scales, the FP32 tensor scale) on every GEMM operand,
# round-to-nearest in the forward (activations and weights) and stochastic rounding for the
# neural gradients of the backward and update GEMMs, whose other operands are quantized as in
# the forward; no Hadamard transforms, 1-D blocks along each GEMM's contraction axis. The
# paper's end of training, QAF (quantization-aware fine-tuning: the forward stays FP4, the
# backward runs in high precision), is lowbit's qat_nvfp4, switched to by the trainer's
# precision schedule (experiments/config.py, quant.switch_*; configs/gpt.py sets it for this
# recipe) when the gradient norm falls below sqrt(3) times the backward's quantization noise.
_fa = QuantSpec("nvfp4")
_fg = QuantSpec("nvfp4", rounding="stochastic")
register(
    Recipe(
        "fp4_all_the_way",
        fwd=GemmSpec(_fa, _fa),
        dlhs=GemmSpec(_fg, _fa),
        drhs=GemmSpec(_fa, _fg),
        description="FP4 All the Way: NVFP4 everywhere, round-to-nearest forward, stochastic "
        "rounding of the gradients; the trainer switches to qat_nvfp4 (QAF) by its criterion.",
        source="Chmiel, Fishman, Banner and Soudry 2025, 'FP4 All the Way: Fully Quantized "
        "Training of LLMs' (arXiv:2505.19115)",
    )
)

# Quartet as its public code runs it (IST-DASLab/Quartet; files under src/models/quantization/):
# - forward, QuestMXFP4Quantizer (quantizers/mxfp4.py, kernel in quantizers/mxfp4_triton.py)
#   on both x and w: a fixed orthonormal Sylvester Hadamard matrix of 32 along the contraction
#   axis (built once from the identity, `rerotate=None`, so never re-drawn), each block of 32's
#   power-of-two scale 2**floor(log2(2.92247856 / 6 * std + 1e-8)) from the block's own
#   standard deviation (`quest=True`), rounding to the E2M1 grid with saturation at 6, and the
#   trust mask `|x / scale| < 6` applied to the gradient in the rotated basis before the
#   transpose of the Hadamard (QuestMXFP4QuantizerFn.backward); the GEMM multiplies the rotated
#   values, whose Hadamards cancel;
# - backward, scheme "Q(E)Q(Wt)t_Q(Et)Q(Xt)t" (quantization/__init__.py's QEQWtt_QEtQXttFn):
#   the saved x and w are the forward-quantized (rotated) values, quantized again by the
#   gradient quantizer together with E (dgrad along N, wgrad along the tokens), and the
#   gradients return through the forward quantizers;
# - the gradient quantizer, AlbertTsengQuantizer with hadamard_dim 32, rerotate "signs",
#   stochastic (its launch scripts' G_QUANT_KWARGS): a random-sign Hadamard of 32 re-drawn once
#   per backward call (re_randomize) and shared by all four quantizations of that call, the
#   floor scale of the block's amax with the 3/4 gain (`gaussian_scale=3/4`, `quest=False`),
#   stochastic rounding.
_qf = QuantSpec("mxfp4", scale_std=2.92247856, trust_mask=True)
_qb = QuantSpec("mxfp4", rounding="stochastic", prescale=0.75)
register(
    Recipe(
        "quartet",
        fwd=GemmSpec(_qf, _qf, hadamard=32, random_signs=False),
        dlhs=GemmSpec(_qb, _qb, hadamard=32),
        drhs=GemmSpec(_qb, _qb, hadamard=32, signs_of="dlhs"),
        backward_operands="forward",
        version=2,  # 1: an RMS clip and floor scales, re-quantized high-precision operands
        description="Quartet: QuEST MXFP4 forward (fixed Hadamard of 32, per-block scales "
        "from each block's standard deviation, trust mask in the backward); MXFP4 backward "
        "GEMMs on the forward-quantized operands after a random-sign Hadamard shared by both "
        "backward GEMMs, stochastic rounding with the 3/4 gain.",
        source="Castro et al. 2025, 'Quartet: Native FP4 Training Can Be Optimal for Large "
        "Language Models' (arXiv:2505.14669) and its code (IST-DASLab/Quartet); Panferov et "
        "al. 2025, QuEST (arXiv:2502.05003)",
    )
)

_sb = QuantSpec("mxfp4", rounding="stochastic", prescale=0.75)
register(
    Recipe(
        "mxfp4_bwd",
        dlhs=GemmSpec(_sb, _sb, hadamard=64),
        drhs=GemmSpec(_sb, _sb, hadamard=64),
        description="High-precision forward; MXFP4 backward GEMMs with a random Hadamard "
        "transform and stochastic rounding (scaled by 3/4 so nothing clips).",
        source="Tseng, Yu and Park 2025, 'Training LLMs with MXFP4' (arXiv:2502.20586)",
    )
)

for _name in _formats.names() + list(_formats.ALIASES):
    _spec = QuantSpec(_name)
    register(
        Recipe(
            f"qat_{_name}",
            fwd=GemmSpec(_spec, _spec),
            description=f"QAT: {_spec.format} fake-quantized weights and activations in the "
            "forward, straight-through gradients in high precision.",
            source="straight-through estimator (Bengio et al. 2013); formats per OCP MX v1.0, "
            "NVIDIA NVFP4, INT4 with NVFP4's scaling, BitNet b1.58's ternary",
        )
    )

# BitNet b1.58 as its published code quantizes (Ma et al. 2024, "The Era of 1-bit LLMs:
# Training Tips, Code and FAQ", the BitLinear `weight_quant` / `activation_quant`):
# - weights: scale = 1 / mean|w| (the mean clamped at 1e-5), codes round(w * scale) clipped to
#   -1..1, values codes / scale: lowbit's "ternary" format (per tensor);
# - activations: per token, scale = 127 / max|x| (clamped at 1e-5), codes round(x * scale)
#   clipped to -128..127, values codes / scale: QuantSpec("int8", granularity="row");
# - backward: straight-through (`x + (quant(x) - x).detach()`), the GEMMs of the backward on
#   the quantized operands in high precision: None backward specs.
# BitLinear also RMS-normalises its input before quantizing it; that is a layer of the model,
# not of the quantizer, and is not added here.
_A8 = QuantSpec("int8", granularity="row")
register(
    Recipe(
        "bitnet",
        fwd=GemmSpec(_A8, QuantSpec("ternary")),
        description="BitNet b1.58: ternary weights (-1, 0, 1 times the tensor's mean |w|), "
        "8-bit per-token absmax activations, straight-through gradients.",
        source="Ma et al. 2024, 'The Era of 1-bit LLMs: All Large Language Models are in 1.58 "
        "Bits' (arXiv:2402.17764), and its 'Training Tips, Code and FAQ' (weight_quant, "
        "activation_quant)",
    )
)

# Weight formats with BitNet's 8-bit per-token activations: the weight-memory Pareto study
# (experiments/pareto.py) compares them with `bitnet` at equal activations.
register(
    Recipe(
        "w16a8",
        fwd=GemmSpec(_A8, None),
        description="High-precision weights, 8-bit per-token absmax activations (BitNet's), "
        "straight-through gradients.",
        source="the activation quantizer of BitNet b1.58 (arXiv:2402.17764)",
    )
)
for _bits, _name in ((8, "mxfp8"), (6, "mxfp6"), (4, "mxfp4"), (4, "nvfp4"), (4, "int4")):
    _w = QuantSpec(_name)
    register(
        Recipe(
            f"w{_bits}a8_{_name}",
            fwd=GemmSpec(_A8, _w),
            description=f"QAT: {_w.format} weights (1-D blocks along the contraction axis), "
            "8-bit per-token absmax activations (BitNet's), straight-through gradients.",
            source="W4A8-style QAT; activations as BitNet b1.58 (arXiv:2402.17764); weights "
            "per OCP MX v1.0, NVIDIA NVFP4, or INT4 with NVFP4's scaling",
        )
    )

for _name in ("mxfp4", "nvfp4"):
    register(
        Recipe(
            f"w4a16_{_name}",
            fwd=GemmSpec(None, QuantSpec(_name)),
            description=f"Weight-only: {_name} weights (1-D blocks along the contraction axis), "
            "activations and the backward in high precision (straight-through).",
            source="weight-only 4-bit serving (W4A16) as in AWQ (Lin et al. 2024, "
            "arXiv:2306.00978) and SVDQuant's W4A16 baselines, in block-scaled FP4",
        )
    )

# NVFP4 with a power-of-two tensor scale (QuantSpec.pow2_tensor_scale): what every serving
# engine's arithmetic reproduces exactly, compressed-tensors' reciprocal global scale included.
_P2 = QuantSpec("nvfp4", pow2_tensor_scale=True)
register(
    Recipe(
        "qat_nvfp4_pow2",
        fwd=GemmSpec(_P2, _P2),
        description="QAT: NVFP4 weights and activations in the forward, each tensor scale "
        "rounded up to a power of two (exportable bit for bit to compressed-tensors / vLLM), "
        "straight-through gradients in high precision.",
        source="NVIDIA NVFP4; the global scale as compressed-tensors stores it (1 / t)",
    )
)
register(
    Recipe(
        "w4a16_nvfp4_pow2",
        fwd=GemmSpec(None, _P2),
        description="Weight-only: NVFP4 weights with a power-of-two tensor scale (exportable "
        "bit for bit to compressed-tensors / vLLM), activations and the backward in high "
        "precision (straight-through).",
        source="weight-only 4-bit serving (W4A16), NVIDIA NVFP4; the global scale as "
        "compressed-tensors stores it (1 / t)",
    )
)
