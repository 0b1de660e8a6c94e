"""The grouped block-scaled matmul (pallas_kernels/grouped_matmul) against its reference.

Reference: dequantize every row tile and every group's weight (``lb.dequantize`` per tensor),
one float32 dot per tile against its group's weight at ``Precision.HIGHEST``; tiles whose group
is outside ``[0, G)`` are zero. The kernel runs in interpret mode on CPU with blocks smaller
than the problem (several N blocks, several K steps per program).

Tolerance: as for the block-scaled matmul (tests/test_pallas_matmul.py), the dequantized
products are exact in the kernel's tiles, so the two differ only in the order of K float32
additions and, for NVFP4, where the tensor scales apply: elementwise
``|C - C_ref| <= (2 K + 4) 2**-24 (|A| @ |B_g|)``.

Without a GPU the Triton path is checked by lowering each configuration for CUDA through
jax.export, each Triton module run through the MLIR verifier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from pallas_kernels._common import export_for_cuda, on_gpu
from pallas_kernels.grouped_matmul import (
    GroupedConfig,
    grouped_block_scaled_matmul,
    grouped_matmul_reference,
)
from pallas_kernels.grouped_matmul.api import run_kernel
from pallas_kernels.grouped_matmul.reference import dequantized_stack, dequantized_tiles

PAIRS = [("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"),
         ("mxfp6_e2m3", "mxfp6_e3m2"), ("mxint8", "mxfp4"), (None, "mxfp4"), (None, "nvfp4"),
         ("mxfp8_e4m3", None)]
TILE_GROUP = np.array([0, 0, 2, 5, 1, -1], np.int32)  # two tiles in no group


def _ids(pair):
    return "-".join(p or "bf16" for p in pair)


def _operands(pair, t=6, bm=16, k=96, n=80, g=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, bm, k)) * np.exp(rng.standard_normal((t, bm, 1)))
    w = rng.standard_normal((g, k, n)) * np.exp(rng.standard_normal((g, 1, 1)))
    x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    fa, fb = pair
    a = x.astype(jnp.bfloat16) if fa is None else jax.vmap(
        lambda v: lb.quantize(v, fa, axis=-1))(x)
    b = w.astype(jnp.bfloat16) if fb is None else jax.vmap(
        lambda v: lb.quantize(v, fb, axis=0))(w)
    return a, b


def _bound(a, b, tile_group):
    x = np.abs(np.asarray(dequantized_tiles(a), np.float64))
    w = np.abs(np.asarray(dequantized_stack(b), np.float64))
    k = x.shape[-1]
    gi = np.clip(tile_group, 0, w.shape[0] - 1)
    return (2 * k + 4) * 2.0**-24 * np.einsum("tmk,tkn->tmn", x, w[gi])


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_kernel_in_interpret_mode_equals_the_reference(pair):
    a, b = _operands(pair)
    tg = jnp.asarray(TILE_GROUP)
    want = np.asarray(grouped_matmul_reference(a, b, tg))
    cfg = GroupedConfig(block_n=32, block_k=32 if "nvfp4" not in pair else 32)
    got = np.asarray(grouped_block_scaled_matmul(a, b, tg, implementation="pallas",
                                                 interpret=True, config=cfg))
    assert got.shape == (6, 16, 80)
    assert np.all(np.abs(got - want) <= _bound(a, b, TILE_GROUP))
    assert np.all(got[3] == 0) and np.all(got[5] == 0)  # tiles in no group
    # each tile used its own group's weight: the reference with another group is far off
    other = np.asarray(grouped_matmul_reference(a, b, jnp.asarray([1, 1, 0, 5, 2, -1])))
    assert np.abs(other[0] - got[0]).max() > 1e-2 * np.abs(got[0]).max()


def test_reference_is_a_dot_per_tile_against_its_group():
    a, b = _operands(("mxfp4", "mxfp4"), seed=3)
    x, w = np.asarray(dequantized_tiles(a), np.float64), np.asarray(dequantized_stack(b),
                                                                     np.float64)
    got = np.asarray(grouped_matmul_reference(a, b, jnp.asarray(TILE_GROUP)))
    for i, g in enumerate(TILE_GROUP):
        want = x[i] @ w[g] if 0 <= g < 3 else np.zeros((16, 80))
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    # per-group NVFP4 tensor scales: each weight is its own tensor
    _, bq = _operands(("nvfp4", "nvfp4"), seed=3)
    assert bq.tensor_scale.shape == (3,)


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_lowers_for_cuda(pair):
    a, b = _operands(pair, t=4, bm=64, k=256, n=256, g=6)
    spec = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    tg = jax.ShapeDtypeStruct((4,), jnp.int32)
    exported = export_for_cuda(lambda a, b, tg: run_kernel(a, b, tg, out_dtype=jnp.bfloat16),
                               spec(a), spec(b), tg)
    assert exported.platforms == ("cuda",)
    assert "xla.gpu.triton" in exported.mlir_module()


@pytest.mark.skipif(on_gpu(), reason="checks the fallback on a machine without a GPU")
def test_without_a_gpu_pallas_warns_and_runs_the_reference():
    a, b = _operands(("mxfp8_e4m3", "mxfp4"))
    tg = jnp.asarray(TILE_GROUP)
    with pytest.warns(UserWarning, match="falling back to the XLA reference"):
        got = grouped_block_scaled_matmul(a, b, tg, implementation="pallas")
    np.testing.assert_array_equal(got, grouped_matmul_reference(a, b, tg))


def test_bad_operands_are_named():
    a, b = _operands(("mxfp8_e4m3", "mxfp4"))
    tg = jnp.asarray(TILE_GROUP)
    with pytest.raises(ValueError, match="tile_group must be an int array of shape \\(6,\\)"):
        grouped_block_scaled_matmul(a, b, tg[:4])
    with pytest.raises(ValueError, match="B must be a QArray stacked over its groups"):
        grouped_block_scaled_matmul(a, lb.quantize(jnp.ones((96, 80)), "mxfp4", axis=0), tg)
    with pytest.raises(ValueError, match="the contraction sizes differ"):
        grouped_block_scaled_matmul(a, jnp.ones((3, 64, 80)), tg)
    with pytest.raises(ValueError, match="at least one operand must be a QArray"):
        grouped_block_scaled_matmul(jnp.ones((6, 16, 96)), jnp.ones((3, 96, 80)), tg)
