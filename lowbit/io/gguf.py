"""GGUF files (llama.cpp's model format) of float arrays and MXFP4 / NVFP4 QArrays.

:func:`write_gguf` writes float arrays as F32 / F16 / BF16 and QArrays as GGML's own MXFP4
and NVFP4 types, so that llama.cpp computes lowbit's values; QArray codes and scales are
repacked byte for byte, never requantized. :func:`read_gguf` inverts it. The container itself
is written and read by the ``gguf`` package (llama.cpp's gguf-py).

Orientation. A GGML row is a tensor's innermost dimension (``ne[0]``, NumPy's last axis) and
quantized blocks run along it; a QArray stores its codes with its quantized axis last. A QArray
quantized along ``axis`` is therefore written as the tensor ``np.moveaxis(x, axis, -1)``: a
``[K, N]`` weight quantized along K (axis 0) becomes the ``[N, K]`` tensor (``ne = [K, N]``),
llama.cpp's layout for a linear layer with N outputs, and an ``[E, K, N]`` expert stack
quantized along K becomes ``[E, N, K]``. :func:`read_gguf` returns QArrays in that orientation
(quantized along their last axis), with dtype float32 (GGUF does not record the dtype a tensor
was quantized from).

GGML's blocks (references at the end):

- MXFP4, ``block_mxfp4``: 32 elements in 17 bytes, the E8M0 scale byte ``e`` then ``qs[16]``;
  byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high nibble
  [1, 3] (lowbit packs consecutive elements into a byte, so codes are repacked). Value:
  ``kvalues[code] * 2**(e - 128)`` with ``kvalues`` twice the E2M1 values [2, 4], which is
  ``e2m1 * 2**(e - 127)``, lowbit's value for every ``e`` but 0xFF. E8M0 0xFF (NaN) is
  rejected by llama.cpp's row validation [5].
- NVFP4, ``block_nvfp4``: a 64-element super-block of four 16-element sub-blocks in 36 bytes,
  ``d[4]`` (one unsigned E4M3 scale byte per sub-block) then ``qs[32]``; byte ``8 s + j`` holds
  element ``j`` of sub-block ``s`` low and element ``j + 8`` high [1, 3]. ``d`` decodes as E4M3
  (bias 7, subnormals, no sign) times 1/2 against the doubled ``kvalues``, and 0x7F decodes
  to 0 [4]: the block value is ``e2m1 * e4m3(d)``, lowbit's ``elements * scale``; lowbit's
  scale codes are written verbatim (llama.cpp's converter keeps ModelOpt's E4M3 bits, clearing
  the sign bit) [6]. A quantized axis must hold whole super-blocks: a multiple of 64.
- NVFP4's float32 tensor scale (ModelOpt's ``weight_scale_2``) is not folded into the block
  scales: llama.cpp's converter writes it as a separate F32 tensor, named as the weight with
  ``.weight`` replaced by ``.scale``, of shape ``[1]``, and leaves it out when it is 1 [6];
  llama.cpp loads ``<base>.scale`` (shape ``{1}``, ``{n_expert}`` for expert stacks) and
  multiplies the matmul's output by it [7]. lowbit writes it the same way: ``<base>.scale``
  beside ``<base>.weight`` (``<name>.scale`` for a name without ``.weight``), shape ``[1]``, or
  ``[E]`` (E equal copies) for a 3-D ``[E, N, K]`` expert stack, omitted when the scale is
  exactly 1. llama.cpp then computes ``(x @ W_blocks) * t`` where lowbit dequantizes
  ``(elements * s) * t``: equal in exact arithmetic, rounded differently.

Exact except for one sign: E2M1 code 8 (-0) decodes to +0 in GGML (``kvalues[8] == 0``), so an
element lowbit dequantizes to -0 reads +0 in llama.cpp; the code itself is kept. Nothing else
differs. QArrays GGML cannot hold raise a ValueError that names the tensor: formats other than
mxfp4 and nvfp4, 2-D tiles, blocks other than the format's own (32 for MXFP4, 16 for NVFP4),
zero-padded blocks (an axis that is no multiple of the block), an NVFP4 axis that is no multiple
of 64, NVFP4 outer-block scales (``tensor_block``), NaN blocks (E8M0 0xFF, UE4M3 0x7F) and a
non-finite tensor scale.

Metadata. ``general.architecture`` is required by the format; it defaults to ``"llama"``. A
file meant for llama.cpp must name its real architecture, its hyper-parameters and llama.cpp's
tensor names (``blk.0.attn_q.weight``, ...). llama.cpp checks each key's GGUF type, and its
counts are uint32, its hyper-parameters float32; so a Python int is written as UINT32 (INT32 if
negative, 64-bit beyond 32 bits), a float as FLOAT32 (it reads back rounded to float32), a bool
as BOOL, a str as STRING; a list of one kind as an ARRAY (ints as INT32, or INT64 beyond,
gguf-py's default for llama.cpp's arrays); a NumPy scalar or 1-D array keeps its own type.

References (layout facts; the same ggml tree is vendored by llama.cpp under ``ggml/``):

1. ggml-org/llama.cpp@01243c587feceaa5d6a6c2305535ef2f549c48b8 ggml/src/ggml-common.h:214-227
   (``block_mxfp4``, ``block_nvfp4``; lines 1-227 identical in ggml-org/ggml@d99724f2
   src/ggml-common.h).
2. ggml-org/ggml@d99724f2b141fed9e1a9f402213506c081433465 src/ggml-common.h:1124-1129
   (``kvalues_fp4``: E2M1 doubled, shared by MXFP4 and NVFP4).
3. same commit, src/ggml-quants.c:569-587 (``dequantize_row_mxfp4``), 589-612
   (``dequantize_row_nvfp4``).
4. same commit, src/ggml-impl.h:475-495 (``ggml_e8m0_to_fp32_half``), 500-515
   (``ggml_ue4m3_to_fp32``).
5. same commit, src/ggml-quants.c:5366-5373 (``validate_e_e8m0``: 0xFF is invalid).
6. ggml-org/llama.cpp@00bd27a621f92be9a99d24d7c5117a263b9b3c01 conversion/base.py:283-291
   (``_scale_is_trivial``, ``_write_scale_tensor``), 616-649 (``_nvfp4_pack``: sign bit
   cleared at 631, nibble pairs at 632; ``_repack_nvfp4``: ``.scale`` at 648).
7. ggml-org/llama.cpp src/llama-model.cpp, the "generic pass: load optional
   per-tensor/per-expert ``.scale`` tensors (e.g. NVFP4 scale2)" (not pinned to a line here).
8. gguf 0.19.0 (PyPI; llama.cpp's gguf-py) gguf/quants.py:656-763 (``MXFP4``, ``NVFP4``
   ``dequantize_blocks``), the reference the tests compare against.
9. ggml-org/ggml@d99724f2 src/gguf.cpp:646-650 (a tensor name is shorter than
   ``GGML_MAX_NAME``), include/ggml.h:222 (``GGML_MAX_DIMS`` 4), 229 (``GGML_MAX_NAME`` 64).
"""

from __future__ import annotations

import os
import pathlib
import uuid
from collections.abc import Mapping
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from lowbit.core.qarray import E8M0_NAN, UE4M3_NAN, QArray

__all__ = ["write_gguf", "read_gguf", "DEFAULT_ARCHITECTURE"]

DEFAULT_ARCHITECTURE = "llama"
_T = gguf.GGMLQuantizationType
_V = gguf.GGUFValueType
_FLOAT_TYPES = {
    np.dtype(np.float32): _T.F32,
    np.dtype(np.float16): _T.F16,
    np.dtype(jnp.bfloat16): _T.BF16,
}
_PLAIN_TYPES = (_T.F32, _T.F16, _T.F64, _T.I8, _T.I16, _T.I32, _T.I64)  # NumPy arrays in gguf-py
_MX_BLOCK = 32  # QK_MXFP4 [1]
_NV_BLOCK, _NV_SUPER = 16, 64  # QK_NVFP4_SUB, QK_NVFP4 [1]
_MAX_DIMS = 4  # GGML_MAX_DIMS [9]
_MAX_NAME = 64  # GGML_MAX_NAME: a name holds at most 63 bytes [9]
_GGML_OF = {"mxfp4": _T.MXFP4, "nvfp4": _T.NVFP4}
_NUMPY_KV = {
    np.dtype(np.uint8): _V.UINT8,
    np.dtype(np.int8): _V.INT8,
    np.dtype(np.uint16): _V.UINT16,
    np.dtype(np.int16): _V.INT16,
    np.dtype(np.uint32): _V.UINT32,
    np.dtype(np.int32): _V.INT32,
    np.dtype(np.uint64): _V.UINT64,
    np.dtype(np.int64): _V.INT64,
    np.dtype(np.float32): _V.FLOAT32,
    np.dtype(np.float64): _V.FLOAT64,
    np.dtype(np.bool_): _V.BOOL,
}
_INT_KV = [
    (_V.UINT32, 0, 2**32 - 1),
    (_V.INT32, -(2**31), 2**31 - 1),
    (_V.INT64, -(2**63), 2**63 - 1),
    (_V.UINT64, 0, 2**64 - 1),
]


# --------------------------------------------------------------------------------------------
# Nibble repacking (last axis; numpy uint8)


def _unpack_consecutive(packed: np.ndarray) -> np.ndarray:
    """lowbit's packing -> one code a byte: byte ``i`` holds elements ``2i`` (low) and
    ``2i + 1`` (high)."""
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _pack_consecutive(codes: np.ndarray) -> np.ndarray:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _pack_halves(codes: np.ndarray, half: int) -> np.ndarray:
    """GGML's packing: in each group of ``2 * half`` codes, byte ``j`` holds code ``j`` (low)
    and code ``j + half`` (high)."""
    g = codes.reshape(*codes.shape[:-1], -1, 2, half)
    return (g[..., 0, :] | (g[..., 1, :] << 4)).reshape(*codes.shape[:-1], -1)


def _unpack_halves(qs: np.ndarray, half: int) -> np.ndarray:
    g = qs.reshape(*qs.shape[:-1], -1, half)
    return np.stack([g & 0xF, g >> 4], axis=-2).reshape(*qs.shape[:-1], -1)


# --------------------------------------------------------------------------------------------
# QArray <-> GGML blocks


def _scale_name(name: str) -> str:
    """The name of an NVFP4 tensor's F32 tensor scale: ``<base>.scale`` for ``<base>.weight``,
    as llama.cpp's converter names it [6]; ``<name>.scale`` otherwise."""
    return name.removesuffix(".weight") + ".scale"


def _gguf_shape(q: QArray) -> tuple[int, ...]:
    """The shape ``q`` is written with: its quantized axis moved last."""
    (axis,) = q.axes
    return tuple(d for i, d in enumerate(q.shape) if i != axis) + (q.shape[axis],)


def _check_qarray(name: str, q: QArray) -> None:
    """Raise a ValueError, naming ``name``, where GGML has no block for ``q``."""
    if q.format_name not in _GGML_OF:
        raise ValueError(
            f"tensor {name!r}: format {q.format_name!r} has no GGML type; GGUF holds QArrays "
            f"of {sorted(_GGML_OF)} (GGML MXFP4 and NVFP4) and float32 / float16 / bfloat16 "
            f"arrays"
        )
    block = _MX_BLOCK if q.format_name == "mxfp4" else _NV_BLOCK
    if len(q.axes) != 1:
        raise ValueError(
            f"tensor {name!r}: 2-D tiles (block_shape {q.block_shape} over axes {q.axes}) have "
            f"no GGML type; GGML blocks run along one axis (a row)"
        )
    if q.block_shape != (block,):
        raise ValueError(
            f"tensor {name!r}: blocks of {q.block_shape[0]}; GGML {q.format_name.upper()} holds "
            f"blocks of {block}"
        )
    if q.tensor_block is not None:
        raise ValueError(
            f"tensor {name!r}: NVFP4 with outer-block scales (tensor_block={q.tensor_block}); "
            f"GGUF holds one tensor scale per tensor"
        )
    (axis,) = q.axes
    k = q.shape[axis]
    if k % block:
        raise ValueError(
            f"tensor {name!r}: axis {axis} of length {k} is zero-padded to whole blocks of "
            f"{block}; a GGML row holds whole blocks, so the axis must be a multiple of {block}"
        )
    if q.format_name == "nvfp4" and k % _NV_SUPER:
        raise ValueError(
            f"tensor {name!r}: GGML NVFP4 packs four blocks of 16 into a super-block of "
            f"{_NV_SUPER}, and axis {axis} has length {k}, not a multiple of {_NV_SUPER}"
        )
    if q.ndim > _MAX_DIMS:
        raise ValueError(
            f"tensor {name!r}: GGML tensors have at most {_MAX_DIMS} dimensions, "
            f"got shape {q.shape}"
        )


def _qarray_blocks(name: str, q: QArray) -> np.ndarray:
    """The GGML block bytes of ``q`` (checked), shape ``[*other, row bytes]``."""
    _check_qarray(name, q)
    codes = _unpack_consecutive(np.asarray(q.codes))
    scales = np.asarray(q.scales)
    lead = codes.shape[:-1]
    if q.format_name == "mxfp4":
        if np.any(scales == E8M0_NAN):
            raise ValueError(
                f"tensor {name!r} holds NaN blocks (E8M0 scale 0xFF), which "
                f"llama.cpp rejects as invalid"
            )
        qs = _pack_halves(codes, _MX_BLOCK // 2).reshape(*lead, -1, _MX_BLOCK // 2)
        blocks = np.concatenate([scales[..., None], qs], axis=-1)
    else:
        if np.any(scales >= UE4M3_NAN):
            raise ValueError(
                f"tensor {name!r} holds NaN blocks (E4M3 scale 0x7F), which GGML decodes as 0"
            )
        qs = _pack_halves(codes, _NV_BLOCK // 2).reshape(*lead, -1, _NV_SUPER // 2)
        d = scales.reshape(*lead, -1, _NV_SUPER // _NV_BLOCK)
        blocks = np.concatenate([d, qs], axis=-1)
    return np.ascontiguousarray(blocks.reshape(*lead, -1))


def _tensor_scale(name: str, q: QArray) -> np.ndarray | None:
    """The F32 ``.scale`` tensor of an NVFP4 QArray [6, 7]; None for a scale of exactly 1 (the
    converter omits it) and for MXFP4."""
    if q.format_name != "nvfp4":
        return None
    t = np.float32(np.asarray(q.tensor_scale).reshape(()))
    if not np.isfinite(t):
        raise ValueError(f"tensor {name!r}: its NVFP4 tensor scale is {t}, not finite")
    if t == 1.0:
        return None
    n = _gguf_shape(q)[0] if q.ndim == 3 else 1  # one per ne[2]: the experts of a stack [7]
    return np.full((n,), t, np.float32)


def _qarray_from_blocks(
    name: str, blocks: np.ndarray, fmt: str, shape: tuple[int, ...], scale: np.ndarray | None
) -> QArray:
    """Inverse of :func:`_qarray_blocks`: a QArray quantized along the last axis of ``shape``."""
    lead = shape[:-1]
    if fmt == "mxfp4":
        b = blocks.reshape(*lead, -1, 1 + _MX_BLOCK // 2)
        scales, qs = b[..., 0], b[..., 1:]
        codes = _unpack_halves(qs.reshape(*lead, -1), _MX_BLOCK // 2)
        block, t = _MX_BLOCK, None
    else:
        n = _NV_SUPER // _NV_BLOCK
        b = blocks.reshape(*lead, -1, n + _NV_SUPER // 2)
        scales = b[..., :n].reshape(*lead, -1)
        codes = _unpack_halves(b[..., n:].reshape(*lead, -1), _NV_BLOCK // 2)
        block, t = _NV_BLOCK, _read_tensor_scale(name, scale)
    return QArray(
        codes=jnp.asarray(_pack_consecutive(codes)),
        scales=jnp.asarray(np.ascontiguousarray(scales)),
        tensor_scale=t,
        format_name=fmt,
        shape=shape,
        dtype=np.dtype(np.float32),
        axes=(len(shape) - 1,),
        block_shape=(block,),
    )


def _read_tensor_scale(name: str, scale: np.ndarray | None) -> Any:
    """The float32 tensor scale of NVFP4 tensor ``name`` from its ``.scale`` tensor (1 where
    there is none); per-expert scales must agree, since a QArray holds one."""
    if scale is None:
        return jnp.float32(1.0)
    s = np.asarray(scale, np.float32).reshape(-1)
    if s.size == 0 or np.any(s != s[0]):
        raise ValueError(
            f"tensor {name!r}: its {_scale_name(name)!r} holds scales that differ "
            f"({s.tolist()}); a QArray holds one tensor scale"
        )
    return jnp.float32(s[0])


# --------------------------------------------------------------------------------------------
# Float arrays


def _float_array(name: str, x) -> tuple[np.ndarray, Any]:
    """``x`` as the array to write and its GGML type (None: gguf-py infers F32 / F16)."""
    a = np.asarray(x)
    if a.dtype not in _FLOAT_TYPES:
        raise ValueError(
            f"tensor {name!r}: dtype {a.dtype} has no GGUF type here; write float32, float16 or "
            f"bfloat16 arrays (or mxfp4 / nvfp4 QArrays)"
        )
    if not 1 <= a.ndim <= _MAX_DIMS:
        raise ValueError(
            f"tensor {name!r}: GGML tensors have 1 to {_MAX_DIMS} dimensions, got shape {a.shape}"
        )
    a = np.ascontiguousarray(a)
    if _FLOAT_TYPES[a.dtype] == _T.BF16:  # gguf-py writes BF16 as its raw 16-bit words
        return a.view(np.uint16), _T.BF16
    return a, None


# --------------------------------------------------------------------------------------------
# Metadata


def _int_type(key: str, values: list[int], candidates) -> Any:
    for vtype, lo, hi in candidates:
        if all(lo <= v <= hi for v in values):
            return vtype
    raise ValueError(f"metadata {key!r}: {values} does not fit a 64-bit GGUF integer")


def _scalar(key: str, value) -> tuple[Any, Any]:
    """``(value, GGUF type)`` of a scalar metadata value (see the module docstring)."""
    if isinstance(value, np.generic) and value.dtype in _NUMPY_KV:
        return value.item(), _NUMPY_KV[value.dtype]
    if isinstance(value, bool):
        return value, _V.BOOL
    if isinstance(value, int):
        return value, _int_type(key, [value], _INT_KV)
    if isinstance(value, float):
        return value, _V.FLOAT32
    if isinstance(value, str):
        return value, _V.STRING
    raise ValueError(
        f"metadata {key!r}: a {type(value).__name__} is no GGUF value; use str, int, float, "
        f"bool, a NumPy scalar, or a list (or 1-D NumPy array) of one of them"
    )


def _list(key: str, value) -> tuple[list, Any]:
    """``(values, element type)`` of a list (or 1-D NumPy array) metadata value."""
    is_array = isinstance(value, np.ndarray)
    if is_array and (value.ndim != 1 or value.dtype not in _NUMPY_KV):
        raise ValueError(
            f"metadata {key!r}: a NumPy array must be 1-D of a GGUF number type, "
            f"got {value.dtype}{list(value.shape)}"
        )
    values = value.tolist() if is_array else list(value)
    if not values:
        raise ValueError(f"metadata {key!r}: an empty array (gguf-py writes none)")
    if is_array:
        return values, _NUMPY_KV[value.dtype]
    kinds = {type(v) for v in values}
    if len(kinds) != 1 or not kinds <= {str, bool, int, float}:
        raise ValueError(
            f"metadata {key!r}: a GGUF array holds values of one kind (all str, "
            f"bool, int or float), got {sorted(k.__name__ for k in kinds)}"
        )
    (kind,) = kinds
    if kind is int:
        return values, _int_type(key, values, _INT_KV[1:3])  # INT32, else INT64
    return values, {str: _V.STRING, bool: _V.BOOL, float: _V.FLOAT32}[kind]


def _kv(key, value) -> tuple[str, Any, Any, Any]:
    """``(key, value, GGUF type, element type)``, checked."""
    if not isinstance(key, str) or key.startswith("GGUF."):
        raise ValueError(f"metadata key {key!r}: keys are str, and GGUF.* names the header")
    if isinstance(value, (list, tuple, np.ndarray)):
        values, sub = _list(key, value)
        return key, values, _V.ARRAY, sub
    v, vtype = _scalar(key, value)
    if key == "general.alignment" and (vtype != _V.UINT32 or v <= 0 or v & (v - 1)):
        raise ValueError(f"metadata 'general.alignment': {value!r} is not a power of two")
    return key, v, vtype, None


# --------------------------------------------------------------------------------------------
# Writing and reading


def _check_name(name, taken: set) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names are non-empty str, got {name!r}")
    if len(name.encode()) >= _MAX_NAME:
        raise ValueError(f"tensor {name!r}: GGML names hold at most {_MAX_NAME - 1} bytes")
    if name in taken:
        raise ValueError(
            f"tensor {name!r} is named twice (an NVFP4 tensor scale is written as <base>.scale)"
        )
    taken.add(name)


def _entries(tensors: Mapping[str, Any]) -> list[tuple[str, np.ndarray, Any]]:
    """``(name, array, GGML type or None)`` for each tensor to write, checked; an NVFP4
    QArray's tensor scale follows it."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors must be a dict of name -> array or QArray, got {type(tensors).__name__}"
        )
    out, taken = [], set()
    for name, x in tensors.items():
        _check_name(name, taken)
        if not isinstance(x, QArray):
            out.append((name, *_float_array(name, x)))
            continue
        out.append((name, _qarray_blocks(name, x), _GGML_OF[x.format_name]))
        scale = _tensor_scale(name, x)
        if scale is not None:
            if _scale_name(name) in tensors:
                raise ValueError(
                    f"tensor {name!r}: its tensor scale is written as "
                    f"{_scale_name(name)!r}, which is also given"
                )
            _check_name(_scale_name(name), taken)
            out.append((_scale_name(name), scale, None))
    return out


def write_gguf(
    path: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, Any] | None = None
) -> pathlib.Path:
    """Write float arrays and MXFP4 / NVFP4 QArrays to a GGUF file; returns its path.

    Args:
      path: the file to write (replaced whole: written beside it first, then renamed).
      tensors: name -> float32 / float16 / bfloat16 array (written as F32 / F16 / BF16) or
        QArray (MXFP4 or NVFP4, one quantized axis, no padding), written as the tensor whose
        last axis is its quantized axis; an NVFP4 QArray's tensor scale goes to ``<base>.scale``
        (see the module docstring). Names hold at most 63 bytes.
      metadata: GGUF key -> value (str, int, float, bool, NumPy scalar, or a list / 1-D array
        of one kind); ``general.architecture`` defaults to ``"llama"``.

    Everything is checked before the file is opened; what GGUF cannot hold raises a
    ValueError that names the tensor or key.

    >>> import os, tempfile, numpy as np, lowbit as lb
    >>> w = lb.quantize(np.ones((64, 8), np.float32), "mxfp4", axis=0)  # a [K, N] weight
    >>> path = write_gguf(os.path.join(tempfile.mkdtemp(), "w.gguf"), {"blk.0.ffn_up.weight": w})
    >>> tensors, meta = read_gguf(path)
    >>> tensors["blk.0.ffn_up.weight"].shape, meta["general.architecture"]
    ((8, 64), 'llama')
    """
    metadata = dict(metadata or {})
    arch = metadata.pop("general.architecture", DEFAULT_ARCHITECTURE)
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"metadata 'general.architecture' must be a non-empty str, got {arch!r}")
    kvs = [_kv(key, value) for key, value in metadata.items()]
    entries = _entries(tensors)
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        for key, value, vtype, sub in kvs:
            if key == "general.alignment":  # also sets the writer's data alignment
                writer.add_custom_alignment(value)
            else:
                writer.add_key_value(key, value, vtype, sub_type=sub)
        for name, array, raw_dtype in entries:
            writer.add_tensor(name, array, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def _read_tensor(t, scale) -> Any:
    """One tensor of a GGUFReader as a NumPy array or QArray (``scale``: the ReaderTensor of
    an NVFP4 tensor's ``.scale``, or None)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    fmt = {_T.MXFP4: "mxfp4", _T.NVFP4: "nvfp4"}.get(t.tensor_type)
    if fmt is not None:
        if scale is not None and scale.tensor_type != _T.F32:
            raise ValueError(
                f"tensor {scale.name!r}: an NVFP4 tensor scale is F32, got {scale.tensor_type.name}"
            )
        s = None if scale is None else np.array(scale.data)
        return _qarray_from_blocks(t.name, np.array(t.data), fmt, shape, s)
    if t.tensor_type == _T.BF16:
        return np.array(t.data).view(jnp.bfloat16).reshape(shape)
    if t.tensor_type in _PLAIN_TYPES:
        return np.array(t.data).reshape(shape)
    raise ValueError(
        f"tensor {t.name!r}: GGML type {t.tensor_type.name} is not read here; supported: "
        f"MXFP4, NVFP4, BF16, {', '.join(k.name for k in _PLAIN_TYPES)}"
    )


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a GGUF file: ``(tensors, metadata)``.

    ``tensors``: name -> NumPy array (F32, F16, BF16 as ``jnp.bfloat16``, F64, I8..I64) or
    QArray (MXFP4, NVFP4: quantized along the last axis, in the file's orientation, dtype
    float32); an NVFP4 tensor's ``<base>.scale`` becomes its ``tensor_scale`` (1 without one)
    and is not listed. ``metadata``: every key-value pair but gguf-py's ``GGUF.*`` header
    fields, as str, int, float, bool or lists of them. Other GGML types raise a ValueError.

    >>> import os, tempfile, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "n.gguf")
    >>> _ = write_gguf(path, {"norm": np.ones(4, np.float16)}, {"general.name": "tiny"})
    >>> tensors, meta = read_gguf(path)
    >>> tensors["norm"].dtype, meta["general.name"]
    (dtype('float16'), 'tiny')
    """
    reader = gguf.GGUFReader(path)
    metadata = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }
    by_name = {t.name: t for t in reader.tensors}
    scales = {_scale_name(t.name) for t in reader.tensors if t.tensor_type == _T.NVFP4}
    tensors = {}
    for t in reader.tensors:
        if t.name not in scales:
            partner = by_name.get(_scale_name(t.name)) if t.tensor_type == _T.NVFP4 else None
            tensors[t.name] = _read_tensor(t, partner)
    return tensors, metadata
