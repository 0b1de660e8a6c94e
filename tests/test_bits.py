"""lowbit.bits: one count of storage bits, checked against the bytes of packed QArrays."""

from __future__ import annotations

import jax
import pytest

import lowbit as lb
from lowbit.bits import bits_per_element, leaf_nbytes, storage_bits
from lowbit.gemm.recipes import QuantSpec

FORMATS = lb.formats.names()
# 1-D blocks along either axis and 2-D tiles, on shapes that divide into blocks and shapes
# that the packing pads (70 and 40 are multiples of no block size but 5 and 8 and 10)
CASES = [
    ((64, 96), -1, None),
    ((64, 96), 0, None),
    ((40, 70), -1, None),
    ((70, 40), 0, None),
    ((3, 40, 70), 1, None),
    ((64, 64), (0, 1), (16, 16)),
    ((40, 70), (0, 1), (16, 32)),
    ((96,), -1, None),
    ((37,), 0, None),
]


def _packed(fmt, shape, axis, block_shape):
    """The QArray ``lb.quantize`` returns, its arrays abstract (shapes and dtypes: all that
    its bytes depend on; ``jax.eval_shape`` traces without compiling)."""
    x = jax.ShapeDtypeStruct(shape, jax.numpy.float32)
    return jax.eval_shape(lambda x: lb.quantize(x, fmt, axis=axis, block_shape=block_shape), x)


# one format of each packing kind: four FP6 codes in three bytes, E4M3 block scales with a tensor
# scale, five ternary codes a byte
@pytest.mark.parametrize("fmt", ["mxfp6_e2m3", "nvfp4", "ternary"])
def test_abstract_packed_arrays_have_the_bytes_of_concrete_ones(fmt):
    shape, axis, block_shape = CASES[2]  # padded along the blocks
    x = jax.random.normal(jax.random.key(0), shape)
    q = lb.quantize(x, fmt, axis=axis, block_shape=block_shape)
    a = _packed(fmt, shape, axis, block_shape)
    assert q.nbytes == a.nbytes and leaf_nbytes(q) == leaf_nbytes(a) == q.nbytes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,axis,block_shape", CASES)
def test_storage_bits_equal_the_bytes_of_packed_arrays(fmt, shape, axis, block_shape):
    f = lb.formats.get(fmt)
    if block_shape is not None and (f.is_absmean or block_shape[-1] % f.elem.pack_group[0]):
        pytest.skip(f"{fmt} takes no {block_shape} tiles")
    q = _packed(fmt, shape, axis, block_shape)
    spec = QuantSpec(fmt, block_shape=block_shape)
    assert storage_bits(spec, shape, axes=q.axes) == 8 * q.nbytes
    assert leaf_nbytes(q) == q.nbytes
    without = storage_bits(spec, shape, axes=q.axes, tensor_scale=False)
    assert 8 * q.nbytes - without == (32 if f.tensor_scale else 0)
    # unpadded: exact where the blocks divide the shape
    blk = block_shape or (f.block_size,)
    axes = [a % len(shape) for a in q.axes]
    if all(shape[a] % b == 0 for a, b in zip(axes, blk, strict=True)):
        assert storage_bits(spec, shape) == 8 * q.nbytes


def test_conventions():
    mx4 = lb.recipes.get("mxfp4").fwd.rhs
    nv = lb.recipes.get("nvfp4").fwd.rhs  # 16x16 tiles
    fp8 = lb.recipes.get("fp8").fwd.rhs  # per tensor
    assert storage_bits(mx4, (1024,)) == 4352.0
    assert storage_bits(nv, (1024,)) == 4160.0
    assert storage_bits(nv, (1024,), tensor_scale=False) == 4128.0
    assert storage_bits(fp8, (1024,)) == 8 * 1024 + 32
    assert storage_bits(fp8, (1024,), tensor_scale=False) == 8 * 1024
    assert storage_bits(None, (1024,)) == 16 * 1024
    assert storage_bits(None, (1024,), float_bits=32) == 32 * 1024
    assert bits_per_element(mx4) == 4.25 and bits_per_element(nv) == 4 + 8 / 256
    assert bits_per_element(None, float_bits=32.0) == 32.0
    assert bits_per_element("ternary") == 1.6 and bits_per_element(fp8) == 8.0
    x = jax.numpy.ones((3, 5), jax.numpy.bfloat16)
    assert leaf_nbytes(x) == 30
