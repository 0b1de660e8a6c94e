"""Time the quantize kernel against the XLA reference (``lowbit.quantize``).

    python -m pallas_kernels.quantize.bench                       # 8192 x 8192 bf16, all formats
    python -m pallas_kernels.quantize.bench --shape 16,8192 --formats mxfp4,nvfp4 --axis 0
    python -m pallas_kernels.quantize.bench --formats mxfp4 --rounding stochastic \
        --hadamard 32 --prescale 0.75                             # a fused Hadamard and prescale

Needs a GPU for the kernel; elsewhere it times the reference only. Prints microseconds, GB/s
(input read plus packed output written) and the kernel's speed-up over the reference, after
checking that both give the same codes.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from lowbit.core import formats
from lowbit.core.hadamard import random_signs
from pallas_kernels._common import format_unsupported, on_gpu, time_fn
from pallas_kernels.quantize.api import quantize
from pallas_kernels.quantize.reference import quantize_reference


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8192,8192")
    p.add_argument(
        "--formats",
        default=",".join(f for f in formats.names() if format_unsupported(formats.get(f)) is None),
    )
    p.add_argument("--axis", type=int, default=-1)
    p.add_argument("--rounding", default="nearest", choices=["nearest", "stochastic"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hadamard", type=int, default=None, help="fused Hadamard block (16..256)")
    p.add_argument("--prescale", type=float, default=1.0, help="a recipe's QuantSpec.prescale")
    args = p.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    key = jax.random.key(0)
    x = jax.random.normal(key, shape, jnp.dtype(args.dtype))
    gpu = on_gpu()
    print(
        f"{jax.default_backend()}: quantize {shape} {args.dtype} axis={args.axis} "
        f"{args.rounding} hadamard={args.hadamard} prescale={args.prescale}"
        + ("" if gpu else " (no GPU: reference only)")
    )
    for fmt in args.formats.split(","):
        kw = dict(rounding=args.rounding, prescale=args.prescale)
        if args.hadamard is not None:
            kw.update(hadamard=args.hadamard, signs=random_signs(key, args.hadamard))
        ref = jax.jit(lambda x, k, f=fmt, kw=kw: quantize_reference(x, f, args.axis, key=k, **kw))
        tr = time_fn(ref, (x, key))
        q = ref(x, key)
        line = f"{fmt:<11} xla {tr * 1e6:9.1f} us {(x.nbytes + q.nbytes) / tr / 1e9:7.1f} GB/s"
        if gpu:
            kern = jax.jit(
                lambda x, k, f=fmt, kw=kw: quantize(
                    x, f, args.axis, key=k, implementation="pallas", **kw
                )
            )
            same = bool(jnp.all(kern(x, key).codes == q.codes))
            tk = time_fn(kern, (x, key))
            line += (
                f" | pallas {tk * 1e6:9.1f} us {(x.nbytes + q.nbytes) / tk / 1e9:7.1f} GB/s"
                f" {tr / tk:5.2f}x {'same codes' if same else 'CODES DIFFER'}"
            )
        print(line)


if __name__ == "__main__":
    main()
