"""The quantizer spec tests (tests/quantizer_base.py) for the compiled CPU kernel
(``lowbit.core.native``): ``lb.fake_quantize`` traced under ``lb.native.mode("on")``. The kernel
computes fake_quantize only (``lb.quantize`` has no kernel), so these tests check values.

Every program is traced afresh inside the mode (the kernel is chosen when a function is
traced, and JAX reuses a function's trace) and must contain the kernel's custom call.
tests/test_native.py holds what is not a spec test: the mode policy, the build, the
transformations (vmap, gradients) and comparisons with the XLA path where there is no
reference (element gain, low-precision inputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import lowbit as lb
from lowbit.core import native, qarray
from tests.quantizer_base import QuantizerSpec, Unsupported


def _kernel_takes_tiles() -> bool | Unsupported:
    plan = qarray.make_plan((32, 32), "mxfp4", (0, 1), (16, 16), None, "nearest", None, None)
    if native.supports(plan):
        return True
    return Unsupported("lowbit.core.native.supports() rejects 2-D tiles (the XLA path serves them)")


@pytest.mark.skipif(
    not native.available(), reason=f"no compiled CPU kernel: {native.why_unavailable()}"
)
class TestNativeQuantizer(QuantizerSpec):
    name = "native"
    tiles = _kernel_takes_tiles()
    large_shape = (512, 384)  # above 2**16 elements the kernel splits work over threads

    def fake_quantize_fn(self, fmt, scale_mode, axis, block_shape, rounding):
        return self.lowbit_entry(lb.fake_quantize, fmt, scale_mode, axis, block_shape, rounding)

    def trace_context(self):
        return native.mode("on")

    def check_program(self, jaxpr, hlo):
        assert native.TARGET in hlo, "the program does not call the compiled CPU kernel"

    def test_check_program_rejects_the_xla_path(self):
        """check_program can fail: the same function traced with the kernel off is refused,
        and traced with it on (a fresh function) accepted."""
        x = jnp.ones((4, 32))
        with native.mode("off"):
            text = jax.jit(lambda x: lb.fake_quantize(x, "mxfp4")).lower(x).as_text()
        with pytest.raises(AssertionError, match="does not call"):
            self.check_program("", text)
        with native.mode("on"):
            text = jax.jit(lambda x: lb.fake_quantize(x, "mxfp4")).lower(x).as_text()
        self.check_program("", text)
