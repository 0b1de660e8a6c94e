"""Tests of GGUF export and import (``lowbit.io.gguf``).

The references are llama.cpp's: every quantized tensor written is decoded by gguf-py's own
``gguf.quants.dequantize`` (llama.cpp's Python port of GGML's dequantizers), times the F32
``<base>.scale`` tensor for NVFP4 (what llama.cpp multiplies the matmul's output by), and must
equal lowbit's ``dequantize`` bit for bit, apart from one documented sign: GGML decodes E2M1
code 8 (-0) as +0. The byte layout is also decoded here, independently, with numpy bit
operations following ``ggml-common.h`` (``block_mxfp4``: ``e`` then ``qs[16]``, byte j = elements
j and j + 16; ``block_nvfp4``: ``d[4]`` then ``qs[32]``, byte 8s + j = elements j and j + 8 of
16-element sub-block s).

Inputs are chosen to hit the extremes (each case asserts that it does): E2M1 codes 7 and 15
(+-6) and 8 (-0), all-zero blocks, MX exponents near 2**+-100, NVFP4 block scales 448 (0x7E),
subnormal E4M3 scales (codes 1..7) and scales that round to zero, with a tensor scale that is
not 1. MX scales below 2**-126 are left out: their values are float32 subnormals, which XLA on
CPU flushes to zero (DESIGN.md) while numpy keeps them.
"""

from __future__ import annotations

import warnings

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.io.gguf import read_gguf, write_gguf

T = gguf.GGMLQuantizationType
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
RNG = np.random.default_rng(0)


def e2m1(codes: np.ndarray) -> np.ndarray:
    """Values of 4-bit E2M1 codes (sign bit 3)."""
    mag = E2M1[codes & 7]
    return np.where(codes >> 3, -mag, mag).astype(np.float32)


def ue4m3(d: np.ndarray) -> np.ndarray:
    """Values of unsigned E4M3 bytes (bias 7; exponent field 0: m * 2**-9)."""
    e, m = (d >> 3) & 0xF, (d & 7).astype(np.float64)
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e.astype(np.float64) - 7))


def codes_of(q) -> np.ndarray:
    """lowbit's packed codes, one per element (two a byte, low nibble first)."""
    b = np.asarray(q.codes)
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def raw_bytes(path, name: str) -> np.ndarray:
    """A tensor's bytes, read from the file at the offset gguf-py's reader reports."""
    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == name]
    with open(path, "rb") as f:
        f.seek(t.data_offset)
        return np.frombuffer(f.read(t.n_bytes), np.uint8)


def lowbit_values(q, axis: int) -> np.ndarray:
    """lowbit's values in GGUF orientation (the quantized axis last)."""
    return np.moveaxis(np.asarray(lb.dequantize(q, jnp.float32)), axis, -1)


def minus_zero_as_ggml(ref: np.ndarray, q) -> np.ndarray:
    """``ref`` with GGML's decoding of code 8 (-0): +0. The one difference allowed."""
    return np.where(codes_of(q) == 8, np.float32(0.0), ref)


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


# --------------------------------------------------------------------------------------------
# Inputs at the extremes


def mx_input() -> np.ndarray:
    """[64, 4] for MXFP4 along axis 0: column 0 holds the whole E2M1 grid times 8 (codes 0..15,
    -0 included) then an all-zero block with -0s; column 1 blocks near 2**-100 and 2**100."""
    x = RNG.standard_normal((64, 4)).astype(np.float32)
    x[:32, 0] = e2m1(RNG.permutation(32) % 16) * 8
    x[32:, 0] = np.where(np.arange(32) % 2, -0.0, 0.0)
    x[:32, 1] *= np.float32(1e-30)
    x[32:, 1] *= np.float32(1e30)
    return x


def nv_input(k: int = 128, n: int = 2) -> np.ndarray:
    """[k, n] for NVFP4 along axis 0, with blocks (16 rows) scaled 448 (the tensor's max), 0
    (all zeros and -0s), subnormal E4M3 (1e-5 of the max: 2**-9 * 2.3) and rounding to 0 (1e-7)."""
    x = RNG.standard_normal((k, n)).astype(np.float32)
    amax = np.abs(x).max() * 2
    x[0, 0] = -amax
    x[16:32, 0] = np.where(np.arange(16) % 2, -0.0, 0.0)
    for rows, ratio in [(slice(32, 48), 1e-5), (slice(48, 64), 1e-7)]:  # scale 448 * ratio
        x[rows, 0] *= np.float32(amax * ratio / np.abs(x[rows, 0]).max())
    return x


def quantize(x, fmt, axis, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no padding here
        return lb.quantize(jnp.asarray(x), fmt, axis=axis, **kw)


@pytest.fixture(scope="module")
def mx():
    q = quantize(mx_input(), "mxfp4", 0)
    c, s = codes_of(q), np.asarray(q.scales)
    assert {7, 8, 15} <= set(np.unique(c)) and 0 in s  # +-6, -0, an all-zero block
    assert s.min(initial=255, where=s > 0) < 127 - 90 and s.max() > 127 + 90
    return q


@pytest.fixture(scope="module")
def nv():
    q = quantize(nv_input(), "nvfp4", 0)
    c, s = codes_of(q), np.asarray(q.scales)
    assert {7, 8, 15} <= set(np.unique(c))
    assert 0x7E in s and 0 in s and np.any((s >= 1) & (s <= 7))  # 448, zero, subnormal
    assert float(q.tensor_scale) != 1.0
    return q


# --------------------------------------------------------------------------------------------
# gguf-py's decoding equals lowbit's


def gguf_values(path, name: str) -> np.ndarray:
    """gguf-py's dequantization of tensor ``name``, times its ``.scale`` tensor if any."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    t = tensors[name]
    y = gguf.quants.dequantize(t.data, t.tensor_type)
    y = y.reshape(tuple(reversed(t.shape.tolist()))).astype(np.float32)
    scale = tensors.get(name.removesuffix(".weight") + ".scale")
    if scale is not None:
        assert scale.tensor_type == T.F32
        s = np.asarray(scale.data, np.float32)
        y = y * s.reshape((-1,) + (1,) * (y.ndim - 1)) if y.ndim == 3 else y * s[0]
    return y


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gguf_dequantize_equals_lowbit(tmp_path, fmt, mx, nv):
    q = {"mxfp4": mx, "nvfp4": nv}[fmt]
    path = write_gguf(tmp_path / "q.gguf", {"blk.0.ffn_up.weight": q})
    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight"]
    assert t.tensor_type == {"mxfp4": T.MXFP4, "nvfp4": T.NVFP4}[fmt]
    assert t.shape.tolist() == [q.shape[0], q.shape[1]]  # ne = [K, N]: rows run along K
    got = gguf_values(path, "blk.0.ffn_up.weight")
    ref = lowbit_values(q, 0)
    same_bits(got, minus_zero_as_ggml(ref, q))
    assert np.any(np.signbit(ref) & (ref == 0)) and not np.any(np.signbit(got[codes_of(q) == 8]))


def test_gguf_dequantize_experts(tmp_path):
    """An NVFP4 [E, K, N] expert stack along K: written [E, N, K] (``ne = [K, N, E]``, as
    llama.cpp's ``*_exps``) with its tensor scale once per expert (llama.cpp's ``{n_expert}``)."""
    q = quantize(np.stack([nv_input(64, 3), nv_input(64, 3) * 3]), "nvfp4", 1)
    path = write_gguf(tmp_path / "e.gguf", {"blk.0.ffn_up_exps.weight": q})
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert tensors["blk.0.ffn_up_exps.weight"].shape.tolist() == [64, 3, 2]
    assert tensors["blk.0.ffn_up_exps.scale"].shape.tolist() == [2]
    got = gguf_values(path, "blk.0.ffn_up_exps.weight")
    same_bits(got, minus_zero_as_ggml(lowbit_values(q, 1), q))


def test_floats_are_written_exactly(tmp_path):
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 6e4, -1.5]
    x32 = np.concatenate([specials, RNG.standard_normal(8)]).astype(np.float32).reshape(2, 8)
    arrays = {
        "f32": x32,
        "f16": x32.astype(np.float16),
        "bf16": np.asarray(jnp.asarray(x32, jnp.bfloat16)),
        "v": x32[0],
    }
    path = write_gguf(tmp_path / "f.gguf", arrays)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, ggml_type in [("f32", T.F32), ("f16", T.F16), ("bf16", T.BF16), ("v", T.F32)]:
        x, t = arrays[name], tensors[name]
        assert t.tensor_type == ggml_type
        assert t.shape.tolist() == list(reversed(x.shape))
        assert raw_bytes(path, name).tobytes() == x.tobytes()
        same_bits(gguf.quants.dequantize(t.data, ggml_type).reshape(x.shape), x.astype(np.float32))
    back, _ = read_gguf(path)
    for name, x in arrays.items():
        assert back[name].dtype == x.dtype and back[name].tobytes() == x.tobytes()


# --------------------------------------------------------------------------------------------
# The byte layout, decoded here


def test_mxfp4_block_bytes(tmp_path):
    """One 32-element block with known codes: byte 0 is E8M0 127 + 3, byte 1 + j holds code j
    (low nibble) and code j + 16 (high nibble)."""
    codes = (RNG.permutation(32) % 16).astype(np.uint8)
    q = quantize(e2m1(codes)[None] * 8, "mxfp4", -1)  # amax 48: exponent 5 - 2 = 3
    np.testing.assert_array_equal(codes_of(q)[0], codes)
    raw = raw_bytes(write_gguf(tmp_path / "b.gguf", {"b": q}), "b")
    expected = np.concatenate([[127 + 3], codes[:16] | (codes[16:] << 4)]).astype(np.uint8)
    np.testing.assert_array_equal(raw, expected)
    # and decoded by hand: e2m1(code) * 2**(e - 127)
    lo, hi = raw[1:] & 0xF, raw[1:] >> 4
    values = e2m1(np.concatenate([lo, hi])) * np.float32(2.0 ** (int(raw[0]) - 127))
    np.testing.assert_array_equal(values, np.asarray(lb.dequantize(q))[0])


def test_nvfp4_superblock_bytes(tmp_path, nv):
    """The first 64-element super-block of each row: 4 scale bytes (lowbit's unsigned E4M3
    codes, verbatim) then 32 bytes, byte 8s + j holding elements 16s + j and 16s + j + 8; the
    tensor scale as the F32 ``.scale`` tensor."""
    path = write_gguf(tmp_path / "n.gguf", {"w.weight": nv})
    raw = raw_bytes(path, "w.weight").reshape(nv.shape[1], -1, 36)  # [N rows, super-blocks]
    t = raw_bytes(path, "w.scale").view(np.float32)
    assert t.shape == (1,) and t[0] == np.float32(nv.tensor_scale)
    d, qs = raw[..., :4], raw[..., 4:].reshape(*raw.shape[:2], 4, 8)
    np.testing.assert_array_equal(d.reshape(nv.shape[1], -1), np.asarray(nv.scales))
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [N, super-block, s, 16]
    np.testing.assert_array_equal(codes.reshape(nv.shape[1], -1), codes_of(nv))
    scale = ue4m3(d)[..., None]  # float64: exact for these products
    values = (e2m1(codes) * scale).astype(np.float32) * t[0]
    ref = minus_zero_as_ggml(lowbit_values(nv, 0), nv)
    np.testing.assert_array_equal(values.reshape(ref.shape), ref)


# --------------------------------------------------------------------------------------------
# read_gguf


META = {
    "general.name": "tiny",
    "llama.block_count": 2,
    "x.neg": -3,
    "x.big": 2**40,
    "x.half": 0.5,
    "x.flag": True,
    "x.names": ["a", "b"],
    "x.ids": [1, -2, 3],
    "x.floats": [0.25, 1.5],
    "x.u8": np.uint8(7),
    "x.f64": np.float64(0.1),
    "x.i16": np.array([1, -2], np.int16),
}
KV_TYPES = {
    "llama.block_count": "UINT32",
    "x.neg": "INT32",
    "x.big": "INT64",
    "x.half": "FLOAT32",
    "x.flag": "BOOL",
    "x.u8": "UINT8",
    "x.f64": "FLOAT64",
}


def test_read_roundtrip(tmp_path, mx, nv):
    x = RNG.standard_normal((64, 128)).astype(np.float32)
    given = {
        "blk.0.attn_q.weight": mx,
        "blk.0.ffn_up.weight": nv,
        "blk.0.ffn_gate.weight": quantize(x, "nvfp4", 1),  # already GGUF-oriented
        "blk.0.attn_k.weight": quantize(x, "nvfp4", 1, tensor_amax=448.0 * 6),  # t == 1
        "token_embd.weight": quantize(x[0], "mxfp4", 0),
        "output_norm.weight": x[0],
        "bf16": np.asarray(jnp.asarray(x[:2], jnp.bfloat16)),
    }
    path = write_gguf(tmp_path / "m.gguf", given, META)
    names = [t.name for t in gguf.GGUFReader(path).tensors]
    assert "blk.0.ffn_up.scale" in names and "blk.0.attn_k.scale" not in names
    tensors, meta = read_gguf(path)
    assert list(tensors) == list(given)  # the .scale tensors are folded back in
    for name, q in given.items():
        if not isinstance(q, lb.QArray):
            assert tensors[name].tobytes() == q.tobytes()
            continue
        back, (axis,) = tensors[name], q.axes
        assert (back.format_name, back.block_shape) == (q.format_name, q.block_shape)
        assert back.shape == np.moveaxis(np.empty(q.shape), axis, -1).shape
        assert back.axes == (len(q.shape) - 1,)
        np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(q.codes))
        np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(q.scales))
        if q.format_name == "nvfp4":
            assert np.float32(back.tensor_scale) == np.float32(q.tensor_scale)
        else:
            assert back.tensor_scale is None
        same_bits(np.asarray(lb.dequantize(back)), lowbit_values(q, axis))
    expected = {
        k: v.tolist() if isinstance(v, np.ndarray | np.generic) else v for k, v in META.items()
    }
    assert meta == {"general.architecture": "llama", **expected}
    fields = gguf.GGUFReader(path).fields
    for key, vtype in KV_TYPES.items():
        assert fields[key].types[0].name == vtype, key
    assert [v.name for v in fields["x.ids"].types] == ["ARRAY", "INT32"]
    assert [v.name for v in fields["x.i16"].types] == ["ARRAY", "INT16"]


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_read_converter_style_files(tmp_path):
    """Files written by gguf-py directly: a per-expert ``.scale`` that differs between experts
    has no single tensor scale, and GGML types other than the float and FP4 ones are refused."""
    w = gguf.GGUFWriter(tmp_path / "c.gguf", "llama")
    w.add_tensor("e.weight", np.zeros((2, 1, 36), np.uint8), raw_dtype=T.NVFP4)
    w.add_tensor("e.scale", np.array([0.5, 0.25], np.float32))
    finish(w)
    with pytest.raises(ValueError, match=r"'e.weight': its 'e.scale' holds scales that differ"):
        read_gguf(tmp_path / "c.gguf")
    w = gguf.GGUFWriter(tmp_path / "q8.gguf", "llama")
    w.add_tensor("q", gguf.quants.quantize(np.ones((2, 32), np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    finish(w)
    with pytest.raises(ValueError, match="'q': GGML type Q8_0"):
        read_gguf(tmp_path / "q8.gguf")


# --------------------------------------------------------------------------------------------
# Errors


def nan_block(fmt):
    x = RNG.standard_normal((64, 2)).astype(np.float32)
    x[3, 1] = np.nan
    return quantize(x, fmt, 0)


def zeros_qarray(fmt: str, k: int, block: int) -> lb.QArray:
    """The QArray lowbit's quantize gives a [k, 2] array of zeros along axis 0 (built
    directly, no compilation)."""
    t = jnp.float32(0.0) if fmt == "nvfp4" else None
    return lb.QArray(
        codes=jnp.zeros((2, k // 2), jnp.uint8),
        scales=jnp.zeros((2, k // block), jnp.uint8),
        tensor_scale=t,
        format_name=fmt,
        shape=(k, 2),
        dtype=np.dtype(np.float32),
        axes=(0,),
        block_shape=(block,),
    )


def padded():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the PaddingWarning
        return lb.quantize(jnp.ones((40, 4)), "mxfp4", axis=0)


ERRORS = {
    "tiles": (
        lambda: quantize(np.ones((64, 64)), "nvfp4", (0, 1), block_shape=(16, 16)),
        "'w': 2-D tiles",
    ),
    "padded": (padded, "'w': axis 0 of length 40 is zero-padded"),
    "mxfp6": (
        lambda: quantize(np.ones((64, 2)), "mxfp6", 0),
        r"'w': format 'mxfp6_e2m3' has no GGML type; .*\['mxfp4', 'nvfp4'\]",
    ),
    "nvfp4_32": (lambda: zeros_qarray("nvfp4", 32, 16), "'w': GGML NVFP4 .* of 64"),
    "block_64": (
        lambda: zeros_qarray("mxfp4", 64, 64),
        "'w': blocks of 64; GGML MXFP4 holds blocks of 32",
    ),
    "outer": (
        lambda: quantize(np.ones((128, 2)), "nvfp4", 0, tensor_block=128),
        "'w': NVFP4 with outer-block scales",
    ),
    "nan_mx": (lambda: nan_block("mxfp4"), r"'w' holds NaN blocks \(E8M0"),
    "nan_nv": (lambda: nan_block("nvfp4"), r"'w' holds NaN blocks \(E4M3"),
    "float64": (lambda: np.ones(4), "'w': dtype float64"),
    "scalar": (lambda: np.float32(1.0), "'w': GGML tensors have 1 to 4 dimensions"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_tensor_errors(tmp_path, case):
    make, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        write_gguf(tmp_path / "x.gguf", {"w": make()})
    assert list(tmp_path.iterdir()) == []  # checked before anything is written


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"x.d": {"a": 1}}, "metadata 'x.d': a dict is no GGUF value"),
        ({"x.n": None}, "metadata 'x.n': a NoneType"),
        ({"x.mixed": [1, "a"]}, "metadata 'x.mixed': a GGUF array holds values of one kind"),
        ({"x.empty": []}, "metadata 'x.empty': an empty array"),
        ({"x.huge": 2**70}, "metadata 'x.huge'.* 64-bit"),
        ({"GGUF.version": 3}, "metadata key 'GGUF.version'"),
        ({"general.architecture": 3}, "'general.architecture' must be a non-empty str"),
        ({"general.alignment": 24}, "'general.alignment': 24 is not a power of two"),
    ],
)
def test_metadata_errors(tmp_path, metadata, message):
    with pytest.raises(ValueError, match=message):
        write_gguf(tmp_path / "x.gguf", {"w": np.ones(4, np.float32)}, metadata)
    assert list(tmp_path.iterdir()) == []


def test_name_errors_and_alignment(tmp_path, nv):
    with pytest.raises(ValueError, match="at most 63 bytes"):
        write_gguf(tmp_path / "x.gguf", {"n" * 64: np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="'w.weight': its tensor scale is written as 'w.scale'"):
        write_gguf(tmp_path / "x.gguf", {"w.weight": nv, "w.scale": np.ones(1, np.float32)})
    meta = {"general.alignment": np.uint32(64), "general.architecture": "qwen3"}
    tensors, back = read_gguf(write_gguf(tmp_path / "a.gguf", {"w.weight": nv}, meta))
    assert back == {"general.architecture": "qwen3", "general.alignment": 64}
    np.testing.assert_array_equal(np.asarray(tensors["w.weight"].codes), np.asarray(nv.codes))
