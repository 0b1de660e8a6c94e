"""The quantizer spec tests (tests/quantizer_base.py) for lowbit's XLA path: ``lb.quantize``
(the QArray and ``lb.dequantize`` of it) and ``lb.fake_quantize``, traced with the compiled
CPU kernel off."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import lowbit as lb
from tests.quantizer_base import QuantizerSpec, Unsupported


class TestXLAQuantizer(QuantizerSpec):
    name = "xla"
    stochastic_vs_xla = Unsupported("it is the XLA path (tests/test_properties.py: statistics)")

    def quantize_fn(self, fmt, scale_mode, axis, block_shape, rounding):
        return self.lowbit_entry(lb.quantize, fmt, scale_mode, axis, block_shape, rounding)

    def fake_quantize_fn(self, fmt, scale_mode, axis, block_shape, rounding):
        return self.lowbit_entry(lb.fake_quantize, fmt, scale_mode, axis, block_shape, rounding)

    def trace_context(self):
        return lb.native.mode("off")

    def check_program(self, jaxpr, hlo):
        assert lb.native.TARGET not in hlo, "the program calls the compiled CPU kernel"
        assert "pallas_call" not in jaxpr, "the program holds a Pallas kernel"

    @pytest.mark.skipif(not lb.native.available(), reason="no compiled CPU kernel to refuse")
    def test_check_program_rejects_the_kernel(self):
        """check_program can fail: a program traced with the CPU kernel on is refused."""
        with lb.native.mode("on"):
            text = jax.jit(lambda x: lb.fake_quantize(x, "mxfp4")).lower(jnp.ones((4, 32)))
        with pytest.raises(AssertionError, match="calls the compiled CPU kernel"):
            self.check_program("", text.as_text())
