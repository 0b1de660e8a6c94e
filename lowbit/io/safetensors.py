"""Safetensors files of arrays and QArrays, one file or Hugging Face's sharded layout.

A file holds named tensors. An array is stored as it is, under its name, in its own dtype
(``DTYPES`` lists those safetensors has a code for: bool, integers, float16/32/64, bfloat16,
ml_dtypes' float8_e4m3fn / float8_e5m2 / float8_e8m0fnu and the two ``fnuz`` FP8 types). A
QArray named ``w`` is stored as its fields, packed bytes never decoded::

    w.codes          uint8  packed element codes (storage order: quantized axes last)
    w.scales         uint8  block-scale codes (E8M0, or unsigned E4M3 for NVFP4 and INT4)
    w.tensor_scale   float32 (NVFP4, INT4, ternary) the tensor or outer-block scale

and described in the header's ``__metadata__`` under the key ``"lowbit"``, a JSON string::

    {"version": 1, "qarrays": {"w": {"format": "nvfp4", "shape": [64, 32], "dtype": "float32",
      "axes": [0], "block_shape": [16], "tensor_block": null,
      "fields": {"codes": {"tensor": "w.codes", "shape": [32, 32], "dtype": "uint8"}, ...}}}}

which is everything :class:`~lowbit.core.qarray.QArray` holds besides its arrays, so
:func:`read_safetensors` rebuilds it bit for bit. Any other reader sees plain uint8 / float32
tensors. Other ``__metadata__`` entries are the caller's (``metadata=``, strings only);
``{"format": "pt"}`` is added unless given, as transformers' ``save_pretrained`` writes it
(5.25: ``modeling_utils.py:3436``; the 4.x loaders refuse a file without it).

Sharding is Hugging Face's (huggingface_hub 2.4.0, ``serialization/_base.py:50-180``,
``split_state_dict_into_shards_factory``; the names of transformers 5.25,
``utils/__init__.py:292-293``): with ``max_shard_size``, a directory receives
``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json`` =
``{"metadata": {"total_size": <bytes of all tensors>}, "weight_map": {tensor: file}}``, or a
single ``model.safetensors`` when everything fits in one shard. Tensors fill shards in the
order given, a new shard starting when the next would pass the limit, one larger than the
limit alone in its own; a QArray's fields stay together (each shard's header describes its
own QArrays).

Files are written and parsed by the ``safetensors`` package (``safetensors.numpy.save_file``,
``safe_open``, and, for a file holding FP8 tensors, which its numpy reader cannot create,
``deserialize`` of the whole file in memory).

The last section holds the Hugging Face weight layout shared by the export formats
(:mod:`lowbit.io.compressed_tensors`, :mod:`lowbit.io.modelopt`): a 2-D QArray's codes and
block scales re-laid as ``[out_features, in_features]`` with the quantization groups along the
input axis, and the directory writer (``config.json`` and friends, then the weights).

>>> import jax.numpy as jnp, lowbit as lb, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
>>> q = lb.quantize(jnp.linspace(-1.0, 1.0, 64).reshape(2, 32), "mxfp4")
>>> _ = write_safetensors(path, {"w": q, "b": jnp.zeros(2, jnp.bfloat16)})
>>> back = read_safetensors(path)
>>> bool(jnp.all(back["w"].codes == q.codes)), back["b"].dtype
(True, dtype(bfloat16))
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lowbit.core.qarray import QArray

__all__ = [
    "write_safetensors",
    "read_safetensors",
    "read_metadata",
    "DTYPES",
    "FIELDS",
    "INDEX",
    "SINGLE",
    "shard_name",
    "parse_size",
    "as_numpy",
    "linear_codes",
    "linear_float",
    "write_hf_directory",
]

HEADER_KEY = "lowbit"
VERSION = 1
FIELDS = ("codes", "scales", "tensor_scale")  # QArray w -> tensors "w.codes", ...
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# numpy dtype name -> safetensors dtype code (the codes of safetensors' header).
DTYPES: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
}
_NUMPY = {code: name for name, code in DTYPES.items()}
# codes safetensors' numpy reader turns into arrays itself (the FP8 codes it cannot)
_NATIVE = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32",
           "F64", "C64"}


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


# --------------------------------------------------------------------------------------------
# write


def as_numpy(name: str, x) -> np.ndarray:
    """A C-contiguous little-endian numpy array of ``x``; a TypeError naming ``name`` for
    anything that is not an array of a dtype safetensors can hold."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise TypeError(f"tensor {name!r}: a typed PRNG key; store jax.random.key_data(k)")
        a = np.asarray(jax.device_get(x))
    else:
        raise TypeError(f"tensor {name!r} is a {type(x).__name__}, not an array or QArray")
    if a.dtype.name not in DTYPES:
        raise TypeError(
            f"tensor {name!r} has dtype {a.dtype.name}, which safetensors cannot store; "
            f"storable dtypes: {', '.join(DTYPES)} (FP4 / FP6 codes go in uint8, as a "
            "QArray's do)"
        )
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.require(a, requirements="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)


def _qarray_record(name: str, q: QArray, out: dict[str, np.ndarray]) -> dict:
    fields = {}
    for f in FIELDS:
        a = getattr(q, f)
        if a is None:
            continue
        sub = f"{name}.{f}"
        out[sub] = as_numpy(sub, a)
        fields[f] = {"tensor": sub, "shape": list(out[sub].shape), "dtype": out[sub].dtype.name}
    return {
        "format": q.format_name,
        "shape": list(q.shape),
        "dtype": np.dtype(q.dtype).name,
        "axes": list(q.axes),
        "block_shape": list(q.block_shape),
        "tensor_block": q.tensor_block,
        "fields": fields,
    }


def _units(tensors: Mapping[str, Any]) -> list[tuple[str, dict[str, np.ndarray], dict | None]]:
    """``(name, {tensor name: array}, QArray record or None)`` per entry, in order; a
    ValueError naming both entries when a name is taken twice (a QArray's fields included)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must map names to arrays or QArrays, got a "
                        f"{type(tensors).__name__}")
    units, owner = [], {}
    for name, x in tensors.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        arrays: dict[str, np.ndarray] = {}
        rec = None
        if isinstance(x, QArray):
            rec = _qarray_record(name, x, arrays)
        else:
            arrays[name] = as_numpy(name, x)
        for sub in arrays:
            if sub in owner:
                raise ValueError(
                    f"tensor name {sub!r} is taken twice: by {_role(sub, owner[sub], tensors)} "
                    f"and by {_role(sub, name, tensors)}; rename one of them")
            owner[sub] = name
        units.append((name, arrays, rec))
    return units


def _role(sub: str, name: str, tensors: Mapping[str, Any]) -> str:
    if isinstance(tensors[name], QArray):
        return f"the field {sub[len(name) + 1:]!r} of the QArray {name!r}"
    return f"the array {name!r}"


def parse_size(size: int | str) -> int:
    """Bytes of a shard size: an int, or a string such as ``"5GB"`` (10**9) / ``"500MiB"``
    (2**20), as Hugging Face spells them."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, re.IGNORECASE)
        if not m:
            raise ValueError(f"max_shard_size={size!r} is not a size such as 5GB or 500MiB")
        unit = (m.group(2) or "B").upper()
        mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
                "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
        n = int(float(m.group(1)) * mult)
    else:
        raise TypeError(f"max_shard_size must be an int or a string, got {type(size).__name__}")
    if n <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


def shard_name(i: int, n: int) -> str:
    """Hugging Face's name of shard ``i`` (from 1) of ``n``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _serialize(path: pathlib.Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]):
    from safetensors.numpy import save_file

    save_file(arrays, str(path), metadata=metadata)


def _file_metadata(metadata: Mapping[str, str] | None, records: dict) -> dict[str, str]:
    meta = dict(metadata or {})
    if records:
        meta[HEADER_KEY] = json.dumps({"version": VERSION, "qarrays": records})
    return meta


def _shards(units: list, limit: int | None) -> list[list]:
    """Units into shards as ``split_state_dict_into_shards_factory`` does: in order, a new
    shard when the next unit would pass ``limit``, a unit larger than ``limit`` alone in its
    own shard (placed before the shard being filled)."""
    shards, current, size = [], [], 0
    for unit in units:
        n = sum(a.nbytes for a in unit[1].values())
        if limit is not None and n > limit:
            shards.append([unit])
            continue
        if limit is not None and current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(unit)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    max_shard_size: int | str | None = None,
) -> list[pathlib.Path]:
    """Write arrays and QArrays to a safetensors file, or to a sharded Hugging Face directory.

    Args:
      path: a file (``*.safetensors``), or a directory, which receives ``model.safetensors``
        or, with ``max_shard_size``, the shards and ``model.safetensors.index.json``
        (created if missing; the shards and index of an earlier write there are removed).
      tensors: name -> array (numpy or jax) or QArray (stored as ``<name>.codes``,
        ``<name>.scales``, ``<name>.tensor_scale``; see the module docstring).
      metadata: strings for the header's ``__metadata__`` (``"lowbit"`` is reserved);
        ``{"format": "pt"}`` is added unless ``"format"`` is given.
      max_shard_size: bytes per shard (int, or ``"5GB"``); needs a directory ``path``.

    Returns the files written (the index last).

    Raises:
      TypeError: a value that is no array or QArray, or whose dtype safetensors cannot hold
        (float4 / int4 arrays, PRNG keys); the message names the tensor.
      ValueError: two entries claiming one tensor name (a QArray's fields included), a
        non-string or reserved metadata entry, a shard size with a file ``path``.
    """
    path = pathlib.Path(path)
    if not isinstance(metadata, (Mapping, type(None))):
        raise TypeError(f"metadata must be a mapping of strings, got {type(metadata).__name__}")
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata entries must be str -> str, got {k!r}: {type(v).__name__}")
    if HEADER_KEY in (metadata or {}):
        raise ValueError(f"metadata key {HEADER_KEY!r} is reserved for lowbit's QArray header")
    meta = {"format": "pt", **(metadata or {})}
    units = _units(tensors)
    is_file = path.suffix == ".safetensors"
    if is_file and max_shard_size is not None:
        raise ValueError(f"max_shard_size needs a directory path, got the file name {path}")
    if is_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {k: a for _, arr, _ in units for k, a in arr.items()}
        records = {n: r for n, _, r in units if r is not None}
        _serialize(path, arrays, _file_metadata(meta, records))
        return [path]

    shards = _shards(units, parse_size(max_shard_size) if max_shard_size is not None else None)
    path.mkdir(parents=True, exist_ok=True)
    names = [SINGLE] if len(shards) == 1 else [shard_name(i + 1, len(shards))
                                                for i in range(len(shards))]
    for old in path.iterdir():  # an earlier write's files that this one does not replace
        if (old.name == INDEX or old.name == SINGLE or _SHARD_RE.fullmatch(old.name)) and (
                old.name not in names):
            old.unlink()
    written, weight_map, total = [], {}, 0
    for fname, shard in zip(names, shards, strict=True):
        arrays = {k: a for _, arr, _ in shard for k, a in arr.items()}
        records = {n: r for n, _, r in shard if r is not None}
        _serialize(path / fname, arrays, _file_metadata(meta, records))
        written.append(path / fname)
        weight_map.update({k: fname for k in arrays})
        total += sum(a.nbytes for a in arrays.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(path / INDEX)
    return written


# --------------------------------------------------------------------------------------------
# read


def _read_file(path: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The arrays and ``__metadata__`` of one safetensors file."""
    from safetensors import SafetensorError, deserialize, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            meta = dict(f.metadata() or {})
            codes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
            for k, c in codes.items():
                if c not in _NUMPY:
                    raise ValueError(f"{path}: tensor {k!r} has the safetensors dtype {c}, "
                                     f"which lowbit does not read (it reads {sorted(_NUMPY)})")
            if all(c in _NATIVE for c in codes.values()):
                return {k: f.get_tensor(k) for k in codes}, meta
        arrays = {}  # FP8 tensors: the package parses the bytes, numpy views them
        for k, v in deserialize(path.read_bytes()):
            arrays[k] = np.frombuffer(v["data"], _np_dtype(_NUMPY[v["dtype"]])).reshape(
                v["shape"])
        return arrays, meta
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from e


def _files(path: pathlib.Path) -> tuple[list[pathlib.Path], dict[str, str] | None]:
    """The files to read for ``path`` and, when sharded, the index's weight map."""
    if path.is_dir():
        if (path / INDEX).is_file():
            path = path / INDEX
        elif (path / SINGLE).is_file():
            return [path / SINGLE], None
        else:
            found = sorted(p.name for p in path.glob("*.safetensors"))
            raise FileNotFoundError(f"{path} holds neither {INDEX} nor {SINGLE} "
                                    f"(safetensors files there: {found})")
    if not path.exists():
        raise FileNotFoundError(f"no safetensors file or index at {path}")
    if path.suffix != ".json":
        return [path], None
    try:
        index = json.loads(path.read_text())
        weight_map = dict(index["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a safetensors index (no valid weight_map: {e})") from e
    files: dict[str, list[str]] = {}
    for tensor, fname in weight_map.items():
        files.setdefault(fname, []).append(tensor)
    for fname, held in files.items():
        if not (path.parent / fname).is_file():
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            raise FileNotFoundError(
                f"shard {fname} listed in {path} is missing (it holds {held[:3]}{more})")
    return [path.parent / f for f in files], weight_map


def _rebuild(name: str, rec: dict, arrays: dict[str, np.ndarray], where) -> QArray:
    fields = {}
    for f, fr in rec["fields"].items():
        a = arrays.pop(fr["tensor"], None)
        if a is None:
            raise ValueError(f"{where}: QArray {name!r} lacks its tensor {fr['tensor']!r}")
        if list(a.shape) != fr["shape"] or a.dtype.name != fr["dtype"]:
            raise ValueError(
                f"{where}: QArray {name!r}: tensor {fr['tensor']!r} is {a.dtype.name}"
                f"{list(a.shape)}, its header says {fr['dtype']}{fr['shape']}")
        fields[f] = jnp.asarray(a)
    return QArray(
        codes=fields["codes"],
        scales=fields["scales"],
        tensor_scale=fields.get("tensor_scale"),
        format_name=rec["format"],
        shape=tuple(rec["shape"]),
        dtype=jnp.dtype(rec["dtype"]),
        axes=tuple(rec["axes"]),
        block_shape=tuple(rec["block_shape"]),
        tensor_block=rec["tensor_block"],
    )


def read_safetensors(path: str | os.PathLike) -> dict[str, Any]:
    """Read what :func:`write_safetensors` wrote (or any safetensors checkpoint).

    ``path``: a ``.safetensors`` file, an index (``model.safetensors.index.json``: every
    shard it lists is read), or a directory holding either. Returns name -> array (numpy;
    bfloat16 and FP8 as ml_dtypes types) or QArray (jax arrays, rebuilt bit for bit from the
    ``lowbit`` header). Raises FileNotFoundError for a missing file or shard (naming it and
    the tensors it holds) and ValueError for a file, index or QArray header that does not
    add up.
    """
    path = pathlib.Path(path)
    files, weight_map = _files(path)
    arrays: dict[str, np.ndarray] = {}
    records: dict[str, tuple[dict, pathlib.Path]] = {}
    for f in files:
        got, meta = _read_file(f)
        if weight_map is not None:
            extra = sorted(k for k in got if weight_map.get(k) != f.name)
            want = sorted(k for k, v in weight_map.items() if v == f.name and k not in got)
            if extra or want:
                raise ValueError(f"{f}: shard and index disagree (in the shard but not "
                                 f"mapped to it: {extra[:5]}; mapped but absent: {want[:5]})")
        for k in got:
            if k in arrays:
                raise ValueError(f"{f}: tensor {k!r} is stored in two files")
        arrays.update(got)
        if HEADER_KEY in meta:
            try:
                header = json.loads(meta[HEADER_KEY])
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}: the {HEADER_KEY!r} header is not JSON: {e}") from e
            if header.get("version") != VERSION:
                raise ValueError(f"{f}: lowbit header version {header.get('version')} is not "
                                 f"supported (this lowbit reads version {VERSION})")
            records.update({n: (r, f) for n, r in header["qarrays"].items()})
    out: dict[str, Any] = {}
    for name, (rec, f) in records.items():
        out[name] = _rebuild(name, rec, arrays, f)
    return {**arrays, **out}


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The caller's ``__metadata__`` of a file (of the first shard of an index or directory),
    lowbit's QArray header left out."""
    from safetensors import safe_open

    files, _ = _files(pathlib.Path(path))
    with safe_open(str(files[0]), framework="np") as f:
        meta = dict(f.metadata() or {})
    meta.pop(HEADER_KEY, None)
    return meta


# --------------------------------------------------------------------------------------------
# Hugging Face linear-weight layout (shared by lowbit.io.compressed_tensors and .modelopt)

LAYOUTS = ("lowbit", "hf")


def _unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """One code a byte from lowbit's packing along the last axis (FP4: low nibble first)."""
    if bits == 8:
        return packed
    out = np.stack([packed & 0xF, packed >> 4], axis=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def linear_codes(module: str, q: QArray, *, layout: str, group: int,
                 engine: str) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of a 2-D QArray in the ``[out_features, in_features]`` layout of a
    Hugging Face linear weight: uint8 codes ``[N, K / 2]`` (FP4, two a byte, the element of
    the even column in the low nibble) or ``[N, K]`` (FP8), and uint8 scale codes
    ``[N, K / group]``, one per ``group`` consecutive inputs of a row. Codes and scales are
    moved, never re-encoded; a block longer than ``group`` along the input axis, or a 2-D
    tile, repeats its scale over the groups and rows it covers.

    ``layout``: ``"lowbit"`` for a ``[K_in, N_out]`` kernel (lowbit's ``x @ w``), ``"hf"``
    for ``[N_out, K_in]`` (torch's ``nn.Linear``). The blocks must run along the input axis.
    A ValueError names ``module`` and ``engine`` for anything that cannot be laid out so.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    where = f"{engine}: module {module!r}"
    if q.ndim != 2:
        raise ValueError(f"{where}: a linear weight is 2-D, got a QArray of shape {q.shape}")
    if q.tensor_block is not None:
        raise ValueError(f"{where}: tensor_block={q.tensor_block} (one float32 scale per "
                         f"{q.tensor_block} inputs) has no place in {engine}, which holds one "
                         "per-tensor scale")
    k_axis = 0 if layout == "lowbit" else 1
    n_axis = 1 - k_axis
    if k_axis not in q.axes:
        raise ValueError(
            f"{where}: blocks run along axis {q.axes[0]} of the {layout!r} layout "
            f"{'[K_in, N_out]' if layout == 'lowbit' else '[N_out, K_in]'}, the output axis; "
            f"{engine} needs them along the input axis {k_axis} (quantize with axis={k_axis})")
    k_block = q.block_shape[q.axes.index(k_axis)]
    n_block = q.block_shape[q.axes.index(n_axis)] if n_axis in q.axes else 1
    big_k, big_n = q.shape[k_axis], q.shape[n_axis]
    if k_block % group or big_k % group:
        raise ValueError(f"{where}: {engine} groups {group} inputs per scale; blocks of "
                         f"{k_block} along K={big_k} cannot be expressed (both must be "
                         f"multiples of {group})")
    bits = q.format.elem.bits
    if bits not in (4, 8):
        raise ValueError(f"{where}: {q.format_name} codes are {bits}-bit; expected 4 or 8")
    scales = np.asarray(q.scales)
    nan = (scales == 0xFF) if q.format.is_mx else (scales & 0x7F) == 0x7F
    if nan.any():
        raise ValueError(f"{where}: {int(nan.sum())} block(s) hold NaN or Inf (NaN scale "
                         "code); a weight to serve must be finite")
    storage = [a for a in range(2) if a not in q.axes] + list(q.axes)
    perm = (storage.index(n_axis), storage.index(k_axis))
    codes = _unpack_codes(np.asarray(q.codes), bits).transpose(perm)[:big_n, :big_k]
    scales = scales.transpose(perm)
    scales = np.repeat(np.repeat(scales, n_block, axis=0)[:big_n], k_block // group, axis=1)
    return _pack_codes(codes, bits), np.ascontiguousarray(scales[:, : big_k // group])


def linear_float(module: str, w, *, layout: str, engine: str) -> np.ndarray:
    """A float linear weight as ``[N_out, K_in]`` (transposed from ``layout="lowbit"``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    a = as_numpy(f"{module}.weight", w)
    is_float = a.dtype.name in ("float16", "bfloat16", "float32", "float64")
    if a.ndim != 2 or not is_float:
        raise ValueError(f"{engine}: module {module!r}: a float linear weight is a 2-D float "
                         f"array, got {a.dtype.name}{list(a.shape)}")
    return np.ascontiguousarray(a.T) if layout == "lowbit" else a


def engine_tensors(engine: str, weights: Mapping[str, Any], tensors, activation_amax,
                   layout: str, quantized):
    """The tensors of a serving engine's checkpoint (the compressed-tensors and ModelOpt
    writers'): ``(out, keys, floats)``. Each QArray in ``weights`` (linear module name ->
    QArray or float array) becomes ``quantized(module, q, amax) -> (its tensors, key)`` (``amax``
    the module's entry in ``activation_amax`` or None), ``keys`` its key by module; a float
    weight becomes ``<module>.weight`` (``floats`` lists them); ``tensors`` (every other tensor by
    name) are added as they are. A ValueError names ``engine`` and the module or tensor for an
    amax of a module that is no quantized weight, no quantized module at all, a tensor given
    twice, or a QArray among ``tensors``."""
    activation_amax = dict(activation_amax or {})
    unknown = [m for m in activation_amax if not isinstance(weights.get(m), QArray)]
    if unknown:
        raise ValueError(f"{engine}: activation_amax names modules that are no quantized "
                         f"weights: {unknown}")
    out: dict[str, np.ndarray] = {}
    keys: dict[str, Any] = {}
    floats = []
    for module, w in weights.items():
        if isinstance(w, QArray):
            got, keys[module] = quantized(module, w, activation_amax.get(module))
            out.update(got)
        else:
            out[f"{module}.weight"] = linear_float(module, w, layout=layout, engine=engine)
            floats.append(module)
    if not keys:
        raise ValueError(f"{engine}: no quantized module among the weights (give QArrays)")
    for name, x in (tensors or {}).items():
        if name in out:
            raise ValueError(f"{engine}: tensor {name!r} is also written for a module in "
                             "weights; give it once")
        if isinstance(x, QArray):
            raise ValueError(f"{engine}: tensor {name!r} is a QArray; quantized linear weights "
                             "go in weights=, by module name")
        out[name] = as_numpy(name, x)
    return out, keys, floats


def write_hf_directory(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    json_files: Mapping[str, dict],
    *,
    max_shard_size: int | str | None = None,
) -> pathlib.Path:
    """A Hugging Face model directory: each of ``json_files`` (file name -> content, e.g.
    ``config.json``) and the tensors in ``model.safetensors`` (sharded with
    ``max_shard_size``)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, tensors, max_shard_size=max_shard_size)
    for fname, content in json_files.items():
        (path / fname).write_text(json.dumps(content, indent=2) + "\n")
    return path
