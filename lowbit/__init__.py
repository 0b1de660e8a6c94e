"""lowbit: bit-exact MX / NVFP4 block-scaled quantization and low-bit training for JAX.

>>> import jax.numpy as jnp, lowbit as lb
>>> lb.formats.get("mxfp4").bits_per_element
4.25
"""

from lowbit import bits, calibrate
from lowbit.core import formats, hadamard, native, numerics
from lowbit.core.formats import BlockFormat, ElementFormat, ScaleFormat
from lowbit.core.qarray import QArray, dequantize, fake_quantize, quantize
from lowbit.gemm import recipes
from lowbit.gemm.dot_general import dot_general, einsum
from lowbit.gemm.ragged import ragged_dot
from lowbit.gemm.recipes import GemmSpec, QuantSpec, Recipe

__version__ = "0.1.0"


def __getattr__(name: str):
    # lowbit.flax (and what builds on it) imports Flax: load on first use so `import lowbit`
    # stays light; lowbit.io (orbax checkpoints) too.
    if name in ("flax", "ptq", "autoquant", "io"):
        import importlib

        return importlib.import_module(f"lowbit.{name}")
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")


__all__ = [
    "calibrate",
    "flax",
    "ptq",
    "autoquant",
    "io",
    "bits",
    "formats",
    "hadamard",
    "native",
    "numerics",
    "recipes",
    "BlockFormat",
    "ElementFormat",
    "ScaleFormat",
    "QArray",
    "quantize",
    "dequantize",
    "fake_quantize",
    "dot_general",
    "einsum",
    "ragged_dot",
    "QuantSpec",
    "GemmSpec",
    "Recipe",
]
