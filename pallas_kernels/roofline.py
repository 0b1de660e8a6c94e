"""What each kernel could at best reach on an H200: bytes it must move, flops it must do, and the
lower-bound time that follows.

    python -m pallas_kernels.gpu_check --roofline   # the table of every gpu_check configuration

The roofline of a kernel is ``max(bytes / bandwidth, flops / peak)``: no kernel moving those
bytes and doing those flops can be faster on the device. ``gpu_check`` prints measured time
over this bound per kernel (1.0 would be perfect); this module is what it is judged against.

The device (NVIDIA H200 SXM, datasheet "NVIDIA H200 Tensor Core GPU", 2024): HBM3e at 4.8 TB/s;
dense BF16 tensor cores 989 TFLOP/s and dense FP8 1,979 TFLOP/s (the datasheet's 1,979 and 3,958
are with 2:4 sparsity, twice the dense rate); FP32 without tensor cores 67 TFLOP/s.

Bytes are the least each kernel must move: every operand read once and the result written
once (perfect on-chip reuse), from the exact sizes lowbit's arrays have (packed codes, one
scale byte per block, NVFP4's float32 tensor scale). Two choices of these kernels are charged
as they are:

- the block-scaled matmul decodes both operands to bf16 in registers and runs BF16 MMA, so its
  compute peak is BF16's whatever the format: at the prefill-like shape its bound is the bf16
  GEMM's, and the speed-up a Hopper kernel can reach comes from bytes alone (decode-like shapes).
  Blackwell's native FP4 / FP8 block-scaled MMA is the Mosaic GPU kernels' business;
- NVFP4's per-tensor scale needs the tensor's amax before any element is quantized, so its
  quantize reads the input twice (an amax kernel, then the quantize kernel).

A quantize kernel's flops (scale, round, pack; the fused Hadamard's ``log2 b`` butterfly adds
per element) are a few per byte, far below the machine balance (989e12 / 4.8e12 = 206 flops
per byte), so its bound is its bytes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lowbit.core import formats as _formats
from lowbit.core.qarray import quantize as _quantize

__all__ = [
    "H200",
    "B200",
    "Device",
    "Roofline",
    "quantized_bytes",
    "quantize_roofline",
    "matmul_roofline",
    "bf16_gemm_roofline",
    "gemm_roofline",
    "blackwell_matmul_roofline",
    "hopper_matmul_roofline",
    "roof",
]


@dataclasses.dataclass(frozen=True)
class Device:
    """Peak rates: ``bandwidth`` in bytes/s, the others in flop/s (dense)."""

    name: str
    bandwidth: float
    bf16: float
    fp8: float
    fp32: float
    fp4: float = 0.0  # native FP4 tensor cores (0: none)


H200 = Device("NVIDIA H200 SXM", bandwidth=4.8e12, bf16=989e12, fp8=1979e12, fp32=67e12)
# NVIDIA B200 in an HGX system at 1,000 W, dense (NVIDIA's Blackwell figures, as tabulated at
# glennklockwood.com/garden/processors/B200: BF16 2,250, FP8 / FP6 4,500, FP4 9,000 TFLOP/s,
# FP32 80; the datasheet's figures twice these are with 2:4 sparsity); HBM3e 8 TB/s.
B200 = Device("NVIDIA B200 (HGX)", bandwidth=8e12, bf16=2250e12, fp8=4500e12, fp32=80e12,
              fp4=9000e12)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """``bytes`` and ``flops`` a kernel (or kernels run one after another) must move and do;
    ``seconds``: the lower bound on its time; ``bound``: the roof it sits on ("memory",
    "compute", or "mixed" for a sequence of kernels on different roofs)."""

    bytes: int
    flops: int
    seconds: float
    bound: str

    def __add__(self, other: Roofline) -> Roofline:
        """Two kernels that run one after the other: bytes, flops and bounds add."""
        bound = self.bound if self.bound == other.bound else "mixed"
        return Roofline(self.bytes + other.bytes, self.flops + other.flops,
                        self.seconds + other.seconds, bound)


def roof(nbytes: int, flops: int, peak: float, device: Device = H200) -> Roofline:
    """The roofline of one kernel moving ``nbytes`` and doing ``flops`` at ``peak`` flop/s.

    >>> r = roof(4.8e6, 0, 1.0)  # 4.8 MB at 4.8 TB/s
    >>> round(r.seconds * 1e6, 6), r.bound
    (1.0, 'memory')
    """
    memory_s = nbytes / device.bandwidth
    compute_s = flops / peak if flops else 0.0
    return Roofline(int(nbytes), int(flops), max(memory_s, compute_s),
                    "compute" if compute_s > memory_s else "memory")


def quantized_bytes(shape: tuple[int, int], fmt: str, axis: int, **kw) -> int:
    """Bytes of lowbit's QArray for ``x [shape]`` quantized in ``fmt`` along ``axis`` (codes,
    scales and any tensor scale), from its abstract shape: exact, nothing is computed."""
    q = jax.eval_shape(lambda x: _quantize(x, fmt, axis, **kw),
                       jax.ShapeDtypeStruct(shape, jnp.float32))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(q))


def quantize_roofline(shape: tuple[int, int], fmt: str, axis: int = -1, *,
                      in_itemsize: int = 2, hadamard: int | None = None,
                      device: Device = H200, **kw) -> Roofline:
    """The quantize kernel on ``x [shape]`` (``in_itemsize`` bytes an element: bf16 2): read
    ``x`` (twice for NVFP4's per-tensor amax), write the QArray."""
    fmt_ = _formats.get(fmt)
    reads = 2 if fmt_.is_nvfp4 and kw.get("tensor_block") is None else 1
    n = math.prod(shape)
    nbytes = reads * n * in_itemsize + quantized_bytes(shape, fmt, axis, **kw)
    flops = n * int(math.log2(hadamard)) if hadamard else 0
    return roof(nbytes, flops, device.fp32, device)


def _operand_bytes(fmt: str | None, shape: tuple[int, int], axis: int) -> int:
    return 2 * math.prod(shape) if fmt is None else quantized_bytes(shape, fmt, axis)


def matmul_roofline(m: int, k: int, n: int, a: str | None, b: str | None, *,
                    out_itemsize: int = 2, device: Device = H200) -> Roofline:
    """The block-scaled matmul ``A [m, k] (format a, None: bf16) @ B [k, n] (format b)``:
    read both operands, write ``C`` (``out_itemsize`` bytes an element), ``2 m n k`` flops at
    the BF16 tensor-core peak (the kernel decodes to bf16)."""
    nbytes = _operand_bytes(a, (m, k), 1) + _operand_bytes(b, (k, n), 0) + out_itemsize * m * n
    return roof(nbytes, 2 * m * n * k, device.bf16, device)


def bf16_gemm_roofline(m: int, k: int, n: int, device: Device = H200) -> Roofline:
    """``jnp.dot`` of bf16 ``[m, k] @ [k, n]`` to bf16: what every kernel is compared with."""
    return roof(2 * (m * k + k * n + m * n), 2 * m * n * k, device.bf16, device)


def gemm_roofline(m: int, k: int, n: int, a: str | None, b: str | None, *,
                  hadamard: int | None = None, device: Device = H200) -> Roofline:
    """``quantized_gemm`` end to end: quantize each quantized operand (from bf16) along K, then
    the matmul to float32; the kernels run one after another, so their bounds add."""
    r = matmul_roofline(m, k, n, a, b, out_itemsize=4, device=device)
    if a is not None:
        r = quantize_roofline((m, k), a, 1, hadamard=hadamard, device=device) + r
    if b is not None:
        r = quantize_roofline((k, n), b, 0, hadamard=hadamard, device=device) + r
    return r


def blackwell_matmul_roofline(m: int, k: int, n: int, fmt: str, *, out_itemsize: int = 4,
                              device: Device = B200) -> Roofline:
    """``pallas_kernels.blackwell_matmul``: ``A [m, k] @ B [n, k]^T`` both in ``fmt``, read
    as lowbit packs them (codes, one scale byte per block, NVFP4's tensor scales), ``C``
    written in ``out_itemsize`` bytes; ``2 m n k`` flops at the native block-scaled MMA's
    peak (FP4 for MXFP4 / NVFP4, FP8 for MXFP8)."""
    nbytes = quantized_bytes((m, k), fmt, 1) + quantized_bytes((n, k), fmt, 1)
    peak = device.fp4 if _formats.get(fmt).elem.bits == 4 else device.fp8
    if not peak:
        raise ValueError(f"{device.name} has no native rate for {fmt}")
    return roof(nbytes + out_itemsize * m * n, 2 * m * n * k, peak, device)


def hopper_matmul_roofline(m: int, k: int, n: int, fmt: str, *, out_itemsize: int = 4,
                           device: Device = H200) -> Roofline:
    """``pallas_kernels.hopper_matmul`` as it is built: FP8 ``wgmma`` on E4M3 / E5M2 codes,
    FP4 codes read packed (half a byte a code of the kernel's K) and decoded in shared memory,
    FP6 decoded to one byte a code by its wrapper (that pass not counted), NVFP4's blocks of 16
    each padded to a K step of 32 (twice the codes and the flops); one float32 scale per block
    of each operand (the wrapper's), ``C`` written; ``2 m n k`` flops (NVFP4: doubled) at the
    FP8 peak."""
    f = _formats.get(fmt)
    kk = 2 * k if f.is_nvfp4 else k
    blocks = kk // 32
    code_bytes = kk // 2 if f.elem.bits == 4 else kk
    nbytes = (m + n) * code_bytes + 4 * (m + n) * blocks + out_itemsize * m * n
    return roof(nbytes, 2 * m * n * kk, device.fp8, device)
