"""lowbit.io.safetensors: arrays of every storable dtype and QArrays of every format written
and read back bit for bit, one file and Hugging Face's sharded layout (the index checked with
json and the files with safetensors' own numpy reader), and the errors that name what is
wrong."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import lowbit as lb
from lowbit.io.safetensors import (
    DTYPES,
    INDEX,
    SINGLE,
    parse_size,
    read_metadata,
    read_safetensors,
    write_safetensors,
)

X = jax.random.normal(jax.random.key(0), (48, 64)) * 3.0


def _bits(a) -> np.ndarray:
    """The bytes of an array (bit-for-bit comparison, NaN and -0 included)."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.reshape(-1).view(np.uint8)


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _sample(name: str, shape=(3, 5)) -> np.ndarray:
    """Values of dtype ``name`` from random bytes (every bit pattern, NaNs included)."""
    dt = _dtype(name)
    if name == "bool":
        return np.random.default_rng(1).integers(0, 2, shape).astype(bool)
    raw = np.random.default_rng(1).integers(0, 256, (*shape, dt.itemsize), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def _header(path: pathlib.Path) -> dict:
    """A safetensors file's JSON header, parsed by hand (8-byte little-endian length)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n])


def assert_same_qarray(a: lb.QArray, b: lb.QArray):
    assert isinstance(b, lb.QArray)
    for f in ("format_name", "shape", "axes", "block_shape", "tensor_block"):
        assert getattr(a, f) == getattr(b, f), f
    assert np.dtype(a.dtype) == np.dtype(b.dtype)
    for f in ("codes", "scales", "tensor_scale"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, f
            np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=f)
    np.testing.assert_array_equal(_bits(lb.dequantize(a)), _bits(lb.dequantize(b)))


# --------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_storable_dtype_round_trips_bit_for_bit(tmp_path, name):
    arrays = {"a": _sample(name), "scalar": _sample(name, ()), "empty": _sample(name, (0, 4))}
    write_safetensors(tmp_path / "x.safetensors", arrays)
    back = read_safetensors(tmp_path / "x.safetensors")
    assert sorted(back) == sorted(arrays)
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape, k
        np.testing.assert_array_equal(_bits(back[k]), _bits(a), err_msg=k)


def test_jax_arrays_are_written_as_their_numpy_values(tmp_path):
    arrays = {"f32": X, "bf16": X.astype(jnp.bfloat16), "i32": jnp.arange(7),
              "e8m0": jnp.asarray(np.array([0.5, 1.0, 2.0**-127], ml_dtypes.float8_e8m0fnu))}
    write_safetensors(tmp_path / "x.safetensors", arrays)
    back = read_safetensors(tmp_path / "x.safetensors")
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype, k
        np.testing.assert_array_equal(_bits(back[k]), _bits(a), err_msg=k)


QARRAYS = {
    "mxfp4": dict(fmt="mxfp4", axis=-1),
    "mxfp6_e2m3": dict(fmt="mxfp6", axis=-1),
    "mxfp6_e3m2": dict(fmt="mxfp6_e3m2", axis=0),
    "mxfp8_e4m3": dict(fmt="mxfp8", axis=0),
    "mxfp8_e5m2": dict(fmt="mxfp8_e5m2", axis=-1),
    "mxint8": dict(fmt="mxint8", axis=-1),
    "nvfp4": dict(fmt="nvfp4", axis=0),
    "nvfp4_tile16x16": dict(fmt="nvfp4", axis=(0, 1), block_shape=(16, 16)),
    "nvfp4_tensor_block": dict(fmt="nvfp4", axis=-1, tensor_block=32),
    "int4": dict(fmt="int4", axis=-1),
    "ternary": dict(fmt="ternary", axis=-1),
}


@pytest.mark.parametrize("case", list(QARRAYS))
def test_qarrays_round_trip_bit_for_bit(tmp_path, case):
    kw = dict(QARRAYS[case])
    fmt = kw.pop("fmt")
    x = X.at[0, 0].set(jnp.nan) if case == "mxfp4" else X  # a NaN block survives too
    q = lb.quantize(x, fmt, **kw)
    q16 = lb.quantize(x[:, :40].astype(jnp.bfloat16), fmt, **kw)  # padded, bfloat16 origin
    write_safetensors(tmp_path / "q.safetensors", {"w": q, "v": q16, "bias": X[0]})
    back = read_safetensors(tmp_path / "q.safetensors")
    assert sorted(back) == ["bias", "v", "w"]
    assert_same_qarray(q, back["w"])
    assert_same_qarray(q16, back["v"])
    assert back["v"].dtype == jnp.bfloat16


def test_a_qarray_is_plain_tensors_and_a_json_header_to_other_readers(tmp_path):
    q = lb.quantize(X, "nvfp4", axis=0)
    path = tmp_path / "q.safetensors"
    write_safetensors(path, {"model.w": q, "b": np.ones(3, np.float32)}, {"note": "hi"})
    plain = safetensors.numpy.load_file(path)  # the package's own numpy reader
    assert sorted(plain) == ["b", "model.w.codes", "model.w.scales", "model.w.tensor_scale"]
    np.testing.assert_array_equal(plain["model.w.codes"], np.asarray(q.codes))
    np.testing.assert_array_equal(plain["model.w.scales"], np.asarray(q.scales))
    assert plain["model.w.tensor_scale"].dtype == np.float32
    assert plain["model.w.tensor_scale"].shape == ()
    with safetensors.safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    assert meta["note"] == "hi" and meta["format"] == "pt"
    header = json.loads(meta["lowbit"])
    assert header["version"] == 1
    rec = header["qarrays"]["model.w"]
    assert rec["format"] == "nvfp4" and rec["shape"] == [48, 64] and rec["axes"] == [0]
    assert rec["block_shape"] == [16] and rec["dtype"] == "float32"
    assert rec["tensor_block"] is None
    assert rec["fields"]["codes"] == {"tensor": "model.w.codes", "shape": [64, 24],
                                      "dtype": "uint8"}
    assert read_metadata(path) == {"format": "pt", "note": "hi"}


# --------------------------------------------------------------------------------------------
# sharding


def _tree():
    return {
        "embed": X,
        "w1": lb.quantize(X, "mxfp4", axis=0),
        "w2": lb.quantize(X, "nvfp4", axis=0),
        "norm": np.ones(64, ml_dtypes.bfloat16),
        "w3": lb.quantize(X, "mxfp8", axis=-1),
        "f8": _sample("float8_e4m3fn", (8, 8)),
    }


def test_sharded_write_follows_hugging_face_layout(tmp_path):
    tree = _tree()
    files = write_safetensors(tmp_path, tree, max_shard_size=4000)
    n = len(files) - 1
    assert n >= 3
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert [f.name for f in files] == [*names, INDEX]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, INDEX])

    index = json.loads((tmp_path / INDEX).read_text())
    assert set(index) == {"metadata", "weight_map"}
    held, total = {}, 0
    for name in names:  # every tensor where the index says, from each file's own header
        header = _header(tmp_path / name)
        keys = [k for k in header if k != "__metadata__"]
        held.update({k: name for k in keys})
        total += sum(header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in keys)
    assert index["weight_map"] == held
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == total == sum(
        a.nbytes for v in tree.values()
        for a in ([getattr(v, f) for f in ("codes", "scales", "tensor_scale")
                   if getattr(v, f) is not None] if isinstance(v, lb.QArray) else [v]))
    plain = safetensors.numpy.load_file(tmp_path / held["w1.codes"])  # uint8 / float32 only
    np.testing.assert_array_equal(plain["w1.codes"], np.asarray(tree["w1"].codes))
    for q in ("w1", "w2", "w3"):  # a QArray's fields share one shard
        assert len({held[k] for k in held if k.startswith(q + ".")}) == 1

    for where in (tmp_path, tmp_path / INDEX):
        back = read_safetensors(where)
        assert sorted(back) == sorted(tree)
        for k, v in tree.items():
            if isinstance(v, lb.QArray):
                assert_same_qarray(v, back[k])
            else:
                np.testing.assert_array_equal(_bits(back[k]), _bits(v))


def test_one_shard_is_model_safetensors_and_a_rewrite_removes_stale_shards(tmp_path):
    tree = _tree()
    write_safetensors(tmp_path, tree, max_shard_size=4000)
    files = write_safetensors(tmp_path, tree, max_shard_size="1GB")
    assert [f.name for f in files] == [SINGLE]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE]
    assert sorted(read_safetensors(tmp_path)) == sorted(tree)
    write_safetensors(tmp_path, tree)  # no size: one file too
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE]


def test_shards_match_huggingface_hubs_split(tmp_path):
    hub = pytest.importorskip("huggingface_hub", reason="checks against huggingface_hub's split")
    sizes = [300, 5000, 200, 700, 100, 900, 2500, 50]  # bytes; 5000 and 2500 exceed the limit
    tree = {f"t{i}": np.zeros(n, np.uint8) for i, n in enumerate(sizes)}
    split = hub.split_state_dict_into_shards_factory(
        tree, get_storage_size=lambda a: a.nbytes, max_shard_size=1000,
        filename_pattern="model{suffix}.safetensors")
    write_safetensors(tmp_path, tree, max_shard_size=1000)
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"] == split.metadata


def test_parse_size():
    assert parse_size(1234) == 1234
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("2.5kb") == 2500
    for bad in ("five", "0", "-1MB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


# --------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("value, what", [
    (np.zeros(4, ml_dtypes.float4_e2m1fn), "float4_e2m1fn"),
    (np.zeros(4, ml_dtypes.int4), "int4"),
    (jax.random.key(0), "PRNG key"),
    ([1.0, 2.0], "list"),
])
def test_unstorable_values_name_the_tensor(tmp_path, value, what):
    with pytest.raises(TypeError, match=f"tensor 'bad'.*{what}|tensor 'bad' is a {what}"):
        write_safetensors(tmp_path / "x.safetensors", {"ok": X, "bad": value})


@pytest.mark.parametrize("tree, msg", [
    ({"w": "Q", "w.codes": np.zeros(2)}, "'w.codes' is taken twice: by the field 'codes' of "
                                         "the QArray 'w' and by the array 'w.codes'"),
    ({"w.scales": np.zeros(2), "w": "Q"}, "'w.scales' is taken twice: by the array 'w.scales' "
                                          "and by the field 'scales' of the QArray 'w'"),
])
def test_names_that_collide_with_a_qarrays_fields_are_refused(tmp_path, tree, msg):
    q = lb.quantize(X, "nvfp4")
    tree = {k: (q if isinstance(v, str) else v) for k, v in tree.items()}
    with pytest.raises(ValueError, match=msg):
        write_safetensors(tmp_path / "x.safetensors", tree)


def test_metadata_and_path_errors(tmp_path):
    with pytest.raises(ValueError, match="'lowbit' is reserved"):
        write_safetensors(tmp_path / "x.safetensors", {"a": X}, {"lowbit": "x"})
    with pytest.raises(TypeError, match="str -> str"):
        write_safetensors(tmp_path / "x.safetensors", {"a": X}, {"n": 3})
    with pytest.raises(ValueError, match="needs a directory"):
        write_safetensors(tmp_path / "x.safetensors", {"a": X}, max_shard_size=100)
    with pytest.raises(FileNotFoundError, match="neither"):
        read_safetensors(tmp_path)
    with pytest.raises(FileNotFoundError, match="no safetensors file"):
        read_safetensors(tmp_path / "nope.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_safetensors(tmp_path / "bad.safetensors")


def test_a_missing_shard_is_named_with_what_it_holds(tmp_path):
    write_safetensors(tmp_path, _tree(), max_shard_size=4000)
    index = json.loads((tmp_path / INDEX).read_text())
    victim = index["weight_map"]["w2.codes"]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {victim} .*missing.*'w2.codes'"):
        read_safetensors(tmp_path)


def test_an_index_that_disagrees_with_its_shards_is_refused(tmp_path):
    write_safetensors(tmp_path, _tree(), max_shard_size=4000)
    index = json.loads((tmp_path / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["embed"] = files[-1] if index["weight_map"]["embed"] != files[-1] \
        else files[0]
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shard and index disagree"):
        read_safetensors(tmp_path)


def test_a_qarray_header_without_its_tensor_is_refused(tmp_path):
    q = lb.quantize(X, "mxfp4")
    path = tmp_path / "q.safetensors"
    write_safetensors(path, {"w": q})
    with safetensors.safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    arrays = safetensors.numpy.load_file(path)
    del arrays["w.scales"]
    safetensors.numpy.save_file(arrays, path, metadata=meta)
    with pytest.raises(ValueError, match="QArray 'w' lacks its tensor 'w.scales'"):
        read_safetensors(path)


def test_directory_write_creates_the_directory(tmp_path):
    out = tmp_path / "a" / "b"
    files = write_safetensors(out, {"x": X})
    assert files == [out / SINGLE] and pathlib.Path(out / SINGLE).is_file()
