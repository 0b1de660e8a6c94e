"""A device-less compile of one quantized GEMM on its Mosaic GPU kernel (``make gpu-aot``, the
compile tests): what ``quantized_gemm(..., implementation="pallas")`` lowers for an H100 or a
B200, and the code Mosaic GPU made of it."""

from __future__ import annotations

import re

import jax.numpy as jnp

from lowbit.gemm.recipes import QuantSpec
from pallas_kernels import mosaic_common as mc
from pallas_kernels.quantized_gemm.api import quantized_gemm

__all__ = ["compile_gemm_report"]


_MMA = re.compile(r"(?:tcgen05\.mma|wgmma\.mma_async)[\w:.]*")


def compile_gemm_report(fmt: str, m: int, k: int, n: int, *, target: str,
                        stochastic: bool = False) -> dict:
    """Compile ``quantized_gemm(a [m, k], b [k, n], implementation="pallas")`` with both
    operands in ``fmt`` (``b`` rounded stochastically with ``stochastic``) for the
    device-less ``target`` (``"h100"``, ``"b200"``): the dispatch picks the target's Mosaic
    GPU kernel, as on that GPU. Needs the CUDA plugin; one target per process
    (``pallas_kernels.mosaic_common.compile_with_dump``). Returns the kernel's ptxas numbers
    (``mosaic_common.kernel_stats``: registers, spills, ``triton_kernels`` launched beside
    it) and ``mma``, the distinct MMA instructions of its PTX."""
    spec_a = QuantSpec(fmt)
    spec_b = QuantSpec(fmt, rounding="stochastic" if stochastic else "nearest")

    def fn(a, b, key):
        return quantized_gemm(a, b, spec_a, spec_b, None, key, implementation="pallas")

    f32 = jnp.dtype(jnp.float32)
    shapes = [((m, k), f32), ((k, n), f32), ((2,), jnp.dtype(jnp.uint32))]
    build, stats = mc.compile_tagged(fn, shapes, target)
    return dict(fmt=fmt, shape=(m, k, n), target=target, stochastic=stochastic,
                mma=sorted(set(_MMA.findall(build.ptx))), **stats)
