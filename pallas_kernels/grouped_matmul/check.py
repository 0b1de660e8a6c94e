"""``gpu_check``'s grouped section: the grouped kernel's configurations and their checks.

On a GPU (:func:`check_gpu`): every case against :func:`grouped_matmul_reference` (the
tolerance of tests/test_pallas_grouped.py) and timed against XLA's bf16
``jax.lax.ragged_dot`` on the same rows and groups. Without one (:func:`check_dry`): each
case exported for CUDA at its GPU shape (verified Triton modules) and run in interpret mode on
a small shape with the same blocks. ``benchmarks/gpu_aot.py`` compiles :func:`cases` for the
H100 and B200 targets.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowbit.core.qarray import quantize as quantize_reference
from pallas_kernels import roofline
from pallas_kernels._common import export_for_cuda, time_fn
from pallas_kernels.grouped_matmul.api import (
    GroupedConfig,
    grouped_block_scaled_matmul,
    run_kernel,
)
from pallas_kernels.grouped_matmul.reference import (
    dequantized_stack,
    dequantized_tiles,
    grouped_matmul_reference,
)

__all__ = ["GroupedCase", "cases", "check_gpu", "check_dry", "roofline_of"]

PAIRS = [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"),
         ("mxfp6_e2m3", "mxfp6_e2m3"), (None, "mxfp4")]
SHAPE = (64, 64, 4096, 4096, 8)  # tiles, rows per tile, K, N, groups: 4096 rows, 8 experts


@dataclasses.dataclass(frozen=True)
class GroupedCase:
    a: str | None
    b: str
    shape: tuple[int, int, int, int, int] = SHAPE

    @property
    def name(self) -> str:
        t, bm, k, n, g = self.shape
        return (f"grouped {self.a or 'bf16':<10} x {self.b:<10} "
                f"tiles={t}x{bm} K={k} N={n} G={g}")

    @property
    def config(self) -> GroupedConfig:
        return GroupedConfig()


def cases() -> list[GroupedCase]:
    return [GroupedCase(a, b, SHAPE) for a, b in PAIRS]


def operands(case: GroupedCase, key, shape=None):
    """``(a, b, tile_group)`` of ``case`` (or of ``shape``): random bf16 tiles and weights,
    quantized per tile / per group; tiles cycle through the groups, the last in none."""
    t, bm, k, n, g = shape or case.shape
    x = jax.random.normal(jax.random.fold_in(key, 1), (t, bm, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 2), (g, k, n), jnp.bfloat16)
    a = x if case.a is None else jax.vmap(lambda v: quantize_reference(v, case.a, -1))(x)
    b = jax.vmap(lambda v: quantize_reference(v, case.b, 0))(w)
    tile_group = (jnp.arange(t, dtype=jnp.int32) % (g + 1)).at[-1].set(g)
    return a, b, tile_group


def specs(case: GroupedCase):
    """Abstract operands of ``case`` (nothing computed)."""
    return jax.eval_shape(lambda k: operands(case, k), jax.random.key(0))


def _close(c, a, b, tile_group) -> tuple[bool, float]:
    ref = grouped_matmul_reference(a, b, tile_group)
    x, w = jnp.abs(dequantized_tiles(a)), jnp.abs(dequantized_stack(b))
    mag = jnp.einsum("tmk,tkn->tmn", x, w[jnp.clip(tile_group, 0, w.shape[0] - 1)],
                     precision=jax.lax.Precision.HIGHEST)
    tol = (2 * x.shape[-1] + 4) * 2.0**-24 * mag
    err = jnp.abs(c.astype(jnp.float32) - ref)
    return bool(jnp.all(err <= tol)), float(jnp.max(err))


def roofline_of(case: GroupedCase, device=roofline.H200) -> roofline.Roofline:
    """Read the row tiles and every group's weight once, write bf16 ``C``; ``2 T bm K N``
    flops at the BF16 peak (the kernel decodes to bf16)."""
    a, b, _ = specs(case)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((a, b)))
    t, bm, k, n, _ = case.shape
    return roofline.roof(nbytes + 2 * t * bm * n, 2 * t * bm * k * n, device.bf16, device)


def check_gpu(run) -> None:
    """``run``: gpu_check's GPU run (its key, budget, ``attempt`` and ``failures``)."""
    print("\n-- grouped block-scaled matmul: vs dequantize + a float32 dot per tile; time vs "
          "XLA's bf16 ragged_dot")
    for case in cases():
        if run.over_budget(case.name):
            continue
        t, bm, k, n, g = case.shape
        a, b, tg = operands(case, run.key)
        kern = jax.jit(lambda a, b, tg: grouped_block_scaled_matmul(
            a, b, tg, out_dtype=jnp.bfloat16, implementation="pallas"))
        kern32 = jax.jit(lambda a, b, tg: grouped_block_scaled_matmul(
            a, b, tg, implementation="pallas"))
        x = jax.random.normal(run.key, (t * bm, k), jnp.bfloat16)
        w = jax.random.normal(run.key, (g, k, n), jnp.bfloat16)
        sizes = jnp.bincount(jnp.repeat(tg, bm), length=g + 1)[:g].astype(jnp.int32)
        ragged = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))

        def measure(kern=kern, kern32=kern32, ragged=ragged, a=a, b=b, tg=tg, x=x, w=w,
                    sizes=sizes):
            ok, err = _close(kern32(a, b, tg), a, b, tg)
            return ok, err, time_fn(kern, (a, b, tg)), time_fn(ragged, (x, w, sizes))

        if (got := run.attempt(case.name, measure)) is None:
            continue
        ok, err, tk, tr = got
        if not ok:
            run.failures.append(case.name)
        roof = roofline_of(case).seconds
        print(f"{case.name}: {'ok' if ok else 'OUT OF TOLERANCE'} (max err {err:.2e})  "
              f"{tk * 1e6:9.1f} us {2 * t * bm * k * n / tk / 1e12:7.1f} TFLOP/s | bf16 "
              f"ragged_dot {tr * 1e6:9.1f} us | speed-up {tr / tk:5.2f}x | "
              f"{tk / roof:5.2f}x its roofline ({roof * 1e6:.1f} us)")


def check_dry(failures: list, dry_check) -> None:
    """``dry_check(failures, name, check)``: gpu_check's reporter."""
    key = jax.random.key(0)
    for case in cases():

        def check(case=case):
            export_for_cuda(lambda a, b, tg: run_kernel(a, b, tg, out_dtype=jnp.bfloat16),
                            *specs(case))
            small = (6, 16, 128, 64, 3)
            a, b, tg = operands(case, key, small)
            c = grouped_block_scaled_matmul(a, b, tg, implementation="pallas", interpret=True,
                                            config=GroupedConfig(block_n=32, block_k=64))
            ok, err = _close(c, a, b, tg)
            return ok, (f" {case.config}: lowers for CUDA; interpret {small}: "
                        f"{'ok' if ok else 'FAILED'} (max err {err:.1e})")

        dry_check(failures, case.name, check)
