"""The quantizer spec tests (tests/quantizer_base.py) for the Pallas quantize kernel in
interpret mode: ``pallas_kernels.quantize.quantize(x, fmt, axis, implementation="pallas",
interpret=True)`` (its QArray, and ``lb.dequantize`` of it for values).

The kernel takes 2-D matrices along axis 0 or -1 with the format's own 1-D block. Its tiles
here are smaller than the matrices (two format blocks along the quantized axis, 8 lines
across), so every test runs several programs and padded edge tiles. Each program must hold
exactly one ``pallas_call`` (no silent fallback to the XLA reference). Interpret mode is slow
to compile: the shapes are tiny and shared. tests/test_pallas_quantize.py holds what is not a
spec test: argument checks, default tiles, the CPU fallback, CUDA lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import lowbit as lb
from pallas_kernels.quantize import Config, quantize
from tests.quantizer_base import QuantizerSpec, Unsupported


class TestPallasInterpretQuantizer(QuantizerSpec):
    name = "pallas-interpret"
    tiles = Unsupported("the kernel quantizes 1-D blocks only")
    custom_blocks = Unsupported("the kernel uses the format's own block")

    def takes(self, shape, axis):
        return len(shape) == 2 and axis in (-2, -1, 0, 1)

    @staticmethod
    def config(fmt, axis) -> Config:
        along, across = 2 * lb.formats.get(fmt).block_size, 8
        return Config(across, along) if axis % 2 == 1 else Config(along, across)

    def quantize_fn(self, fmt, scale_mode, axis, block_shape, rounding):
        assert block_shape is None, "the kernel has the format's own block only"

        def q(x, key, tensor_amax):
            key = None if key is None else jax.random.wrap_key_data(key)
            return quantize(
                x,
                fmt,
                axis,
                scale_mode=scale_mode,
                rounding=rounding,
                key=key,
                tensor_amax=tensor_amax,
                implementation="pallas",
                interpret=True,
                config=self.config(fmt, axis),
            )

        return q

    def check_program(self, jaxpr, hlo):
        n = jaxpr.count("pallas_call")
        assert n == 1, f"{n} pallas_call in the program, expected the kernel once"

    def test_check_program_rejects_the_reference(self):
        """check_program can fail: the api's XLA reference (no pallas_call) is refused."""
        x = jnp.ones((16, 64))
        jaxpr = jax.make_jaxpr(lambda x: quantize(x, "mxfp4", implementation="xla"))(x)
        with pytest.raises(AssertionError, match="0 pallas_call"):
            self.check_program(str(jaxpr), "")
