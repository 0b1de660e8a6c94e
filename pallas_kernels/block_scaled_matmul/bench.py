"""Time the block-scaled matmul kernel against ``jnp.dot`` in bf16 and the XLA reference.

    python -m pallas_kernels.block_scaled_matmul.bench                  # 8192^3, every format
    python -m pallas_kernels.block_scaled_matmul.bench --mkn 16,8192,8192 --formats mxfp4
    python -m pallas_kernels.block_scaled_matmul.bench --weight-only    # bf16 x quantized

Needs a GPU for the kernel; elsewhere it times the references only. Prints microseconds,
TFLOP/s, GB/s (operand and output bytes over time) and the speed-up over the bf16 dot.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from lowbit.core import formats
from lowbit.core.qarray import QArray
from lowbit.core.qarray import quantize as lowbit_quantize
from pallas_kernels._common import format_unsupported, on_gpu, time_fn
from pallas_kernels.block_scaled_matmul.api import block_scaled_matmul
from pallas_kernels.block_scaled_matmul.reference import block_scaled_matmul_reference


def _nbytes(x) -> int:
    return x.nbytes if isinstance(x, QArray) else x.size * x.dtype.itemsize


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mkn", default="8192,8192,8192")
    p.add_argument(
        "--formats",
        default=",".join(f for f in formats.names() if format_unsupported(formats.get(f)) is None),
    )
    p.add_argument("--weight-only", action="store_true", help="A stays bf16")
    args = p.parse_args(argv)
    m, k, n = (int(s) for s in args.mkn.split(","))
    key = jax.random.key(0)
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.bfloat16)
    flops = 2 * m * n * k
    dot = jax.jit(
        lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    )
    td = time_fn(dot, (x, w))
    gpu = on_gpu()
    print(
        f"{jax.default_backend()}: MKN=({m}, {k}, {n}); bf16 jnp.dot {td * 1e6:.1f} us "
        f"{flops / td / 1e12:.1f} TFLOP/s" + ("" if gpu else " (no GPU: references only)")
    )
    for fmt in args.formats.split(","):
        a = x if args.weight_only else lowbit_quantize(x, fmt, axis=-1)
        b = lowbit_quantize(w, fmt, axis=0)
        nbytes = _nbytes(a) + _nbytes(b) + 2 * m * n
        ref = jax.jit(lambda a, b: block_scaled_matmul_reference(a, b, out_dtype=jnp.bfloat16))
        tr = time_fn(ref, (a, b))
        line = f"{('bf16 x ' if args.weight_only else '') + fmt:<18} xla {tr * 1e6:9.1f} us"
        if gpu:
            kern = jax.jit(
                lambda a, b: block_scaled_matmul(
                    a, b, out_dtype=jnp.bfloat16, implementation="pallas"
                )
            )
            tk = time_fn(kern, (a, b))
            line += (
                f" | pallas {tk * 1e6:9.1f} us {flops / tk / 1e12:7.1f} TFLOP/s "
                f"{nbytes / tk / 1e9:7.1f} GB/s | vs bf16 dot {td / tk:5.2f}x"
            )
        print(line)


if __name__ == "__main__":
    main()
