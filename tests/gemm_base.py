"""The spec tests of one quantized GEMM, written once and run for every implementation.

``QuantizedGemmSpec`` holds the tests; each subclass in ``tests/test_pallas_gemm.py`` says how
the GEMM is called (``implementation=``, the compiled CPU kernel on or off, Pallas interpret
mode) and whether its result must equal the XLA emulation bit for bit or to float32
accumulation tolerance. What they assert:

1. Against the independent NumPy quantizer (``tests/reference.py``): for nearest-rounding
   operands, ``C`` equals ``dequant(A) @ dequant(B)`` computed in float64, within the float32
   summation bound ``|C - C_ref| <= (2 K + 8) u (|A_q| @ |B_q|)`` (``u = 2**-24``).
2. Against the XLA emulation (``quantized_gemm_reference`` with ``native=False``), for every
   operand-spec pair a registered recipe uses (stochastic rounding and high-precision
   operands included): bit for bit where the implementation computes the same float32
   operations (``exact``), else within the bound above (the quantized operands are identical,
   only the order of the K additions and where NVFP4's tensor scale is applied differ).
3. With a Hadamard transform along K: on inputs where every form of the transform is exact
   (integers times a power of two, b a power of 4 so ``1/sqrt(b)`` is a power of two), every
   implementation quantizes the same rotated values: the same comparison as 2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lowbit as lb
from lowbit.core.hadamard import random_signs
from lowbit.gemm.recipes import QuantSpec
from pallas_kernels.quantized_gemm import kernel_supports, quantized_gemm, quantized_gemm_reference
from tests import reference as ref

U = 2.0**-24


def recipe_pairs() -> list[tuple[QuantSpec | None, QuantSpec | None]]:
    """(lhs, rhs) of the fwd, dlhs and drhs GEMMs of every registered recipe, deduplicated."""
    pairs = []
    for name in lb.recipes.names():
        r = lb.recipes.get(name)
        for g in (r.fwd, r.dlhs, r.drhs):
            p = (g.lhs, g.rhs)
            if p != (None, None) and p not in pairs:
                pairs.append(p)
    return pairs


SR4 = QuantSpec("mxfp4", rounding="stochastic")
SR4P = QuantSpec("mxfp4", rounding="stochastic", prescale=0.75)
EXTRA_PAIRS = [  # high-precision operands that no recipe holds alone (w4a16_* hold two more)
    (QuantSpec("mxfp8_e4m3"), None),
    (None, QuantSpec("nvfp4", rounding="stochastic")),
    (None, SR4),
    (None, SR4P),
    (None, QuantSpec("nvfp4", block_shape=(16, 16))),
    (QuantSpec("e4m3", granularity="tensor"), QuantSpec("mxfp4")),
]
PAIRS = recipe_pairs() + EXTRA_PAIRS
SUPPORTED = [p for p in PAIRS if kernel_supports(*p)[0]]


def spec_name(spec: QuantSpec | None) -> str:
    if spec is None:
        return "f32"
    s = spec.format
    if spec.granularity == "tensor":
        s += "-tensor"
    if spec.scale_mode:
        s += f"-{spec.scale_mode}"
    if spec.block_shape:
        s += "-" + "x".join(map(str, spec.block_shape))
    if spec.stochastic:
        s += "-sr"
    if spec.prescale != 1.0:
        s += f"-p{spec.prescale}"
    if spec.clip_rms is not None:
        s += f"-clip{spec.clip_rms}"
    return s


def pair_id(pair) -> str:
    return f"{spec_name(pair[0])}_{spec_name(pair[1])}"


KEY_A = jax.random.key_data(jax.random.key(11))
KEY_B = jax.random.key_data(jax.random.key(12))


def data(m, k, n, seed=0):
    """Heavy-tailed operands (a log-normal spread of magnitudes across blocks)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, k)))
    b = rng.standard_normal((k, n)) * np.exp(rng.standard_normal((k, n)))
    return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


def exact_data(m, k, n, seed=0):
    """Operands whose Hadamard transforms are exact in float32 in any summation order:
    integers in [-8, 8] times 2**-3 (sums of at most 256 of them stay far below 2**24)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 9, (m, k)) / 8.0
    b = rng.integers(-8, 9, (k, n)) / 8.0
    return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


@jax.jit
def magnitude(aq, bq):
    return jnp.dot(jnp.abs(aq), jnp.abs(bq), precision=lax.Precision.HIGHEST)


def _numpy_operand(x: np.ndarray, spec: QuantSpec | None, axis: int) -> np.ndarray:
    """tests/reference.py's dequantized operand (nearest rounding, the format's own block)."""
    if spec is None:
        return np.asarray(x, np.float64)
    if spec.format in ("nvfp4", "int4"):
        elem = {"nvfp4": "e2m1"}.get(spec.format, "int4")
        amax = None
        if spec.pow2_tensor_scale:  # the smallest 448 * elem_max * 2**k >= max |x|
            base, a, k = 448.0 * ref.ELEMS[elem].max, float(np.max(np.abs(x))), 0
            while base * 2.0**k < a:
                k += 1
            while base * 2.0 ** (k - 1) >= a:
                k -= 1
            amax = np.float32(base * 2.0**k)
        return ref.nvfp4_quantize(x, axis=axis, elem=elem, tensor_amax=amax
                                  ).values.astype(np.float64)
    return ref.mx_quantize(x, spec.format, axis=axis,
                           scale_mode=spec.scale_mode or "floor").values.astype(np.float64)


def numpy_comparable(pair) -> bool:
    """Pairs the NumPy reference quantizes: nearest rounding, 1-D blocks, no gain or clip."""
    for s in pair:
        if s is None:
            continue
        if (s.stochastic or s.granularity != "block" or s.block_shape is not None
                or s.prescale != 1.0 or s.clip_rms is not None or s.scale_std is not None):
            return False
        if s.format == "ternary":  # its mean |x| needs exact sums: tests/test_int4_ternary.py
            return False
        # Four Over Six and double-block scales: tests/test_scale_rules.py's transcriptions
        if (s.scale_mode or "").startswith("4over6") or s.tensor_block is not None:
            return False
    return True


NUMPY_PAIRS = [p for p in PAIRS if numpy_comparable(p)]
HADAMARD_PAIRS = [
    (QuantSpec("mxfp4"),) * 2,
    (QuantSpec("nvfp4"), QuantSpec("nvfp4", rounding="stochastic")),
    (SR4, None),
    (SR4P, SR4P),  # quartet's backward GEMMs: the kernel path fuses transform and gain
    (QuantSpec("mxfp4", clip_rms=2.92),) * 2,  # an RMS clip: the clip reads the rotation
]


class QuantizedGemmSpec:
    """Spec tests of ``quantized_gemm``; subclasses set how it is called (class attributes).

    ``implementation`` / ``interpret``: the op's arguments. ``native``: the ``lowbit.core.native``
    mode the call is traced under. ``exact``: bit-exact with the XLA emulation (else float32
    accumulation tolerance). ``pairs``: the operand-spec pairs this implementation serves
    (the kernel path: :data:`SUPPORTED`).
    """

    implementation: str | None = "xla"
    interpret: bool = False
    native: str = "off"
    exact: bool = True
    pairs = PAIRS
    numpy_pairs = NUMPY_PAIRS
    hadamard_pairs = HADAMARD_PAIRS
    hadamard_sizes = (16, 64)
    shape = (24, 96, 40)  # N = 40: 2-D tiles pad

    def gemm(self, pair, hadamard=None):
        """The jitted GEMM of this implementation: ``(a, b, key_a, key_b, signs) -> c``,
        traced under this class's ``lowbit.core.native`` mode (the CPU kernel is chosen when a
        function is traced)."""
        fn = jax.jit(functools.partial(
            quantized_gemm, spec_a=pair[0], spec_b=pair[1], hadamard=hadamard,
            implementation=self.implementation, interpret=self.interpret,
        ))

        def call(a, b, key_a, key_b, signs):
            with lb.native.mode(self.native):
                return fn(a, b, key_a=key_a, key_b=key_b, signs=signs)

        return call

    def check(self, c, expected, aq, bq, k):
        assert c.shape == expected.shape and c.dtype == jnp.float32
        if self.exact:
            np.testing.assert_array_equal(np.asarray(c), np.asarray(expected))
        else:
            tol = (2 * k + 8) * U * magnitude(aq, bq)
            err = jnp.abs(c - expected)
            assert bool(jnp.all(err <= tol)), f"worst excess {float(jnp.max(err - tol))}"

    @staticmethod
    def emulation(a, b, pair, key_a, key_b, hadamard=None, signs=None):
        """The pure-XLA emulation and its quantized operands."""
        from lowbit.gemm.operand import quantize_operand

        kw = dict(hadamard=hadamard, signs=signs, native=False)
        aq = quantize_operand(a, pair[0], 1, 0, key_a, **kw)
        bq = quantize_operand(b, pair[1], 0, 1, key_b, **kw)
        c = quantized_gemm_reference(a, b, *pair, key_a, key_b, **kw)
        return c, aq, bq

    # ---------------------------------------------------------------------------------------

    def test_matches_the_numpy_reference(self, numpy_pair):
        pair = numpy_pair
        m, k, n = self.shape
        a, b = data(m, k, n, seed=5)
        c = self.gemm(pair)(a, b, None, None, None)
        aq = _numpy_operand(np.asarray(a), pair[0], 1)
        bq = _numpy_operand(np.asarray(b), pair[1], 0)
        expected = aq @ bq
        tol = (2 * k + 8) * U * (np.abs(aq) @ np.abs(bq))
        err = np.abs(np.asarray(c, np.float64) - expected)
        assert (err <= tol).all(), f"worst excess {(err - tol).max()}"

    def test_matches_the_emulation(self, pair):
        m, k, n = self.shape
        a, b = data(m, k, n)
        c = self.gemm(pair)(a, b, KEY_A, KEY_B, None)
        expected, aq, bq = jax.jit(self.emulation, static_argnums=2)(a, b, pair, KEY_A, KEY_B)
        self.check(c, expected, aq, bq, k)

    def test_hadamard_along_k(self, hadamard_pair, hadamard):
        pair = hadamard_pair
        m, k, n = 16, 128, 24
        a, b = exact_data(m, k, n, seed=hadamard)
        signs = random_signs(jax.random.key(3), hadamard)
        c = self.gemm(pair, hadamard)(a, b, KEY_A, KEY_B, signs)
        expected, aq, bq = jax.jit(self.emulation, static_argnums=(2, 5))(
            a, b, pair, KEY_A, KEY_B, hadamard, signs
        )
        self.check(c, expected, aq, bq, k)
        # really rotated: the GEMM of the unrotated operands differs
        plain, _, _ = jax.jit(self.emulation, static_argnums=2)(a, b, pair, KEY_A, KEY_B)
        assert not np.array_equal(np.asarray(plain), np.asarray(expected))


def parametrize_gemm_spec(metafunc):
    """pytest_generate_tests for modules holding QuantizedGemmSpec subclasses."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, QuantizedGemmSpec):
        return
    for name, cases in (("pair", cls.pairs), ("numpy_pair", cls.numpy_pairs),
                        ("hadamard_pair", cls.hadamard_pairs)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, cases, ids=[pair_id(p) for p in cases])
    if "hadamard" in metafunc.fixturenames:
        metafunc.parametrize("hadamard", cls.hadamard_sizes)
