"""lowbit.io.compressed_tensors and lowbit.io.modelopt without torch: the written directory is
read back with the ``safetensors`` package (its own parser) and decoded by the numpy decoders
below, written from each format's documented convention (cited at each), independently of
lowbit's code; every decoded weight equals ``lb.dequantize`` bit for bit. The JSON files are
checked key by key, and every refusal names the module, the engine and the reason."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors

import lowbit as lb
from lowbit.io.compressed_tensors import (
    compressed_tensors_state,
    exact_tensor_amax,
    write_compressed_tensors,
)
from lowbit.io.modelopt import modelopt_state, write_modelopt
from lowbit.io.safetensors import read_safetensors

K, N = 64, 48  # in_features, out_features


def _w(i: int, shape=(K, N), scale=1.0):
    return jax.random.normal(jax.random.fold_in(jax.random.key(7), i), shape) * scale


def _nvfp4(w, **kw):
    """NVFP4 with a power-of-two tensor scale (exact in compressed-tensors)."""
    return lb.quantize(w, "nvfp4", axis=kw.pop("axis", 0),
                       tensor_amax=exact_tensor_amax(jnp.abs(w).max()), **kw)


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


_ITEM = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


def _load(path) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """name -> (safetensors dtype code, shape, raw bytes ``[*shape(, itemsize)]``), via
    ``safetensors.deserialize`` (numpy's reader cannot build FP8 arrays)."""
    out = {}
    for name, v in safetensors.deserialize((path / "model.safetensors").read_bytes()):
        shape, item = tuple(v["shape"]), _ITEM[v["dtype"]]
        raw = np.frombuffer(v["data"], np.uint8)
        out[name] = (v["dtype"], shape, raw.reshape(*shape, item) if item > 1 else
                     raw.reshape(shape))
    return out


def _raw(arrays: dict[str, np.ndarray]) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """The same view of an in-memory state (``*_state``'s tensors)."""
    code = {"uint8": "U8", "float8_e4m3fn": "F8_E4M3", "bfloat16": "BF16", "float32": "F32"}
    out = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        item = a.dtype.itemsize
        raw = a.reshape(-1).view(np.uint8)
        out[name] = (code[a.dtype.name], a.shape, raw.reshape(*a.shape, item) if item > 1
                     else raw.reshape(a.shape))
    return out


def _f32(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float32)[..., 0]


# --------------------------------------------------------------------------------------------
# Independent decoders, from the formats' documentation

# E2M1 (OCP MX v1.0 table; compressed-tensors nvfp4/helpers.py:20-22, ModelOpt
# nvfp4_tensor.py:27): bit 3 sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fp4_unpack(packed: np.ndarray) -> np.ndarray:
    """uint8 [N, K/2] -> float64 [N, K]; the even column in the low nibble."""
    lo, hi = packed & 0xF, packed >> 4
    nib = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    nib[:, 0::2], nib[:, 1::2] = lo, hi
    return np.where(nib & 8, -1.0, 1.0) * E2M1[nib & 7]


def e4m3(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float64: bias 7, subnormals m * 2**-9, S.1111.111 NaN."""
    b = b.astype(np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(b & 0x80, -mag, mag)


def e8m0(b: np.ndarray) -> np.ndarray:
    """E8M0 biased exponents -> float64 2**(b - 127)."""
    return np.ldexp(1.0, b.astype(np.int64) - 127)


def per_group(scales: np.ndarray, group: int) -> np.ndarray:
    return np.repeat(scales, group, axis=1)


def ct_nvfp4(t: dict, m: str) -> np.ndarray:
    """compressed-tensors: code * (weight_scale / weight_global_scale) in float32
    (forward_helpers.py:549-572)."""
    x = fp4_unpack(t[f"{m}.weight_packed"][2]).astype(np.float32)
    s = per_group(e4m3(t[f"{m}.weight_scale"][2]), 16).astype(np.float32)
    g = _f32(t[f"{m}.weight_global_scale"][2])
    assert g.shape == (1,)
    return x * (s / g[0])


def mx(codes: np.ndarray, scales: np.ndarray, group=32) -> np.ndarray:
    """An MX value code * 2**(e - 127), exact in float64, rounded once to float32."""
    return (codes * per_group(e8m0(scales), group)).astype(np.float32)


def modelopt_nvfp4(t: dict, m: str) -> np.ndarray:
    """ModelOpt: code * weight_scale * weight_scale_2 (exact in float64, then float32)."""
    x = fp4_unpack(t[f"{m}.weight"][2])
    s = per_group(e4m3(t[f"{m}.weight_scale"][2]), 16)
    t2 = _f32(t[f"{m}.weight_scale_2"][2])
    assert t2.shape == ()
    return (x * s * float(t2)).astype(np.float32)


def lowbit_value(q, layout="lowbit") -> np.ndarray:
    y = np.asarray(lb.dequantize(q, jnp.float32))
    return y.T if layout == "lowbit" else y


# --------------------------------------------------------------------------------------------
# compressed-tensors


def _ct_weights():
    return {
        "model.layers.0.self_attn.q_proj": _nvfp4(_w(0)),
        "model.layers.0.self_attn.k_proj": _nvfp4(_w(1), axis=(1, 0), block_shape=(16, 16)),
        "model.layers.0.mlp.up_proj": lb.quantize(_w(2), "mxfp4", axis=0),
        "model.layers.0.mlp.down_proj": lb.quantize(_w(3), "mxfp8", axis=0),
        "model.layers.0.self_attn.o_proj": _w(4).astype(jnp.bfloat16),
    }


def test_compressed_tensors_directory_decodes_to_lowbits_values(tmp_path):
    weights = _ct_weights()
    others = {"model.norm.weight": np.ones(K, np.float32)}
    base = {"model_type": "llama", "hidden_size": K, "quantization_config": {"old": 1}}
    write_compressed_tensors(tmp_path, weights, others, config=base,
                             activation_amax={"model.layers.0.self_attn.q_proj": 5.0})
    t = _load(tmp_path)
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    up, down = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
    o = "model.layers.0.self_attn.o_proj"
    assert {n: (d, shape) for n, (d, shape, _) in t.items()} == {
        f"{q}.weight_packed": ("U8", (N, K // 2)), f"{q}.weight_scale": ("F8_E4M3", (N, 4)),
        f"{q}.weight_global_scale": ("F32", (1,)), f"{q}.input_global_scale": ("F32", (1,)),
        f"{k}.weight_packed": ("U8", (N, K // 2)), f"{k}.weight_scale": ("F8_E4M3", (N, 4)),
        f"{k}.weight_global_scale": ("F32", (1,)),
        f"{up}.weight_packed": ("U8", (N, K // 2)), f"{up}.weight_scale": ("U8", (N, 2)),
        f"{down}.weight": ("F8_E4M3", (N, K)), f"{down}.weight_scale": ("U8", (N, 2)),
        f"{o}.weight": ("BF16", (N, K)), "model.norm.weight": ("F32", (K,)),
    }
    # the codes are lowbit's own bytes: [K, N] quantized along K is stored [N, K/2] already
    np.testing.assert_array_equal(t[f"{q}.weight_packed"][2], np.asarray(weights[q].codes))
    for m in (q, k):
        np.testing.assert_array_equal(_bits(ct_nvfp4(t, m)), _bits(lowbit_value(weights[m])))
    np.testing.assert_array_equal(
        _bits(mx(fp4_unpack(t[f"{up}.weight_packed"][2]), t[f"{up}.weight_scale"][2])),
        _bits(lowbit_value(weights[up])))
    np.testing.assert_array_equal(
        _bits(mx(e4m3(t[f"{down}.weight"][2]), t[f"{down}.weight_scale"][2])),
        _bits(lowbit_value(weights[down])))
    bf16 = np.ascontiguousarray(t[f"{o}.weight"][2]).view(np.uint16)[..., 0]
    np.testing.assert_array_equal(bf16, np.asarray(weights[o]).T.view(np.uint16))
    # input_global_scale = 448 * 6 / amax in float32 (generate_gparam)
    assert _f32(t[f"{q}.input_global_scale"][2])[0] == np.float32(2688.0) / np.float32(5.0)

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == K
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == [o]
    groups = list(qc["config_groups"].values())
    assert [(g["format"], g["targets"]) for g in groups] == [
        ("nvfp4-pack-quantized", [q]), ("nvfp4-pack-quantized", [k]),
        ("mxfp4-pack-quantized", [up]), ("mxfp8-quantized", [down])]
    nv = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
          "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    assert groups[0]["weights"] == nv and groups[1]["weights"] == nv
    assert groups[0]["input_activations"] == {**nv, "dynamic": "local",
                                              "observer": "static_minmax"}
    assert groups[1]["input_activations"] is None
    assert groups[2]["weights"] == {"num_bits": 4, "type": "float", "symmetric": True,
                                    "group_size": 32, "strategy": "group", "dynamic": False,
                                    "scale_dtype": "torch.uint8"}
    assert groups[3]["weights"]["num_bits"] == 8 and groups[3]["input_activations"] is None


def test_hf_layout_input_gives_the_same_bytes(tmp_path):
    w = _w(5)
    a, _ = compressed_tensors_state({"m": _nvfp4(w)})
    b, _ = compressed_tensors_state({"m": _nvfp4(w.T, axis=1)}, layout="hf")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name].view(np.uint8), b[name].view(np.uint8))
    f, _ = compressed_tensors_state({"m": _nvfp4(w), "f": w}, layout="lowbit")
    g, _ = compressed_tensors_state({"m": _nvfp4(w.T, axis=1), "f": w.T}, layout="hf")
    np.testing.assert_array_equal(f["f.weight"], g["f.weight"])


def test_longer_blocks_repeat_their_scale_over_the_groups(tmp_path):
    w = _w(6)
    q = lb.quantize(w, "nvfp4", axis=0, block_shape=(32,),
                    tensor_amax=exact_tensor_amax(jnp.abs(w).max()))
    t, _ = compressed_tensors_state({"m": q})
    np.testing.assert_array_equal(_bits(ct_nvfp4(_raw(t), "m")), _bits(lowbit_value(q)))


def test_single_format_and_mx_activations(tmp_path):
    weights = {"a": lb.quantize(_w(0), "mxfp4", axis=0), "b": lb.quantize(_w(1), "mxfp4", axis=0)}
    _, qc = compressed_tensors_state(weights, mx_activations=True, ignore=["lm_head"])
    assert qc["format"] == "mxfp4-pack-quantized" and qc["ignore"] == ["lm_head"]
    (g,) = qc["config_groups"].values()
    assert g["targets"] == ["a", "b"]
    assert g["input_activations"] == {"num_bits": 4, "type": "float", "symmetric": True,
                                      "group_size": 32, "strategy": "group", "dynamic": True,
                                      "scale_dtype": "torch.uint8"}


def test_exact_tensor_amax_gives_a_power_of_two_tensor_scale():
    for amax in (1e-30, 0.37, 1.0, 2688.0, 2689.0, 7e30):
        a = exact_tensor_amax(amax)
        assert a >= np.float32(amax) and a / 2 < amax
        t = lb.quantize(jnp.full((1, 16), amax, jnp.float32), "nvfp4", tensor_amax=a).tensor_scale
        m, _ = np.frexp(float(t))
        assert m == 0.5, (amax, float(t))


def test_sharded_compressed_tensors_directory(tmp_path):
    weights = _ct_weights()
    write_compressed_tensors(tmp_path, weights, config={}, max_shard_size=3000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    back = read_safetensors(tmp_path)
    one, _ = compressed_tensors_state(weights)
    assert sorted(back) == sorted(one)
    for k in one:
        np.testing.assert_array_equal(back[k].view(np.uint8), one[k].view(np.uint8))


# --------------------------------------------------------------------------------------------
# ModelOpt


def test_modelopt_directory_decodes_to_lowbits_values(tmp_path):
    a, b, c = "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "lm_head"
    weights = {a: lb.quantize(_w(0), "nvfp4", axis=0),  # a tensor scale of any value
               b: lb.quantize(_w(1), "nvfp4", axis=(0, 1), block_shape=(16, 16)),  # [K, N/2]
               c: _w(2, (K, 32))}
    write_modelopt(tmp_path, weights, config={"model_type": "llama"},
                   activation_amax={a: 3.5, b: 7.0}, producer={"name": "t", "version": "0"})
    t = _load(tmp_path)
    assert {n: (d, shape) for n, (d, shape, _) in t.items()} == {
        f"{a}.weight": ("U8", (N, K // 2)), f"{a}.weight_scale": ("F8_E4M3", (N, 4)),
        f"{a}.weight_scale_2": ("F32", ()), f"{a}.input_scale": ("F32", ()),
        f"{b}.weight": ("U8", (N, K // 2)), f"{b}.weight_scale": ("F8_E4M3", (N, 4)),
        f"{b}.weight_scale_2": ("F32", ()), f"{b}.input_scale": ("F32", ()),
        f"{c}.weight": ("F32", (32, K)),
    }
    for m in (a, b):
        np.testing.assert_array_equal(_bits(modelopt_nvfp4(t, m)), _bits(lowbit_value(weights[m])))
        assert _f32(t[f"{m}.weight_scale_2"][2]) == np.float32(weights[m].tensor_scale)
    # input_scale = amax / (6 * 448): lowbit's activation tensor scale, the same division
    assert _f32(t[f"{a}.input_scale"][2]) == np.asarray(
        lb.quantize(jnp.full((1, 16), 3.5), "nvfp4").tensor_scale)

    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert hq == {"producer": {"name": "t", "version": "0"},
                  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                   "group_size": 16, "exclude_modules": [c]}}
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    nv = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert cfg["quantization_config"] == {  # convert_hf_config.py:191-203, 261-280
        "config_groups": {"group_0": {"input_activations": nv, "weights": nv,
                                      "targets": ["Linear"]}},
        "ignore": [c], "quant_algo": "NVFP4", "producer": {"name": "t", "version": "0"},
        "quant_method": "modelopt"}


def test_modelopt_mixed_precision_and_mxfp8(tmp_path):
    a, b, c = "l.0.q", "l.0.k", "l.0.v"
    weights = {a: lb.quantize(_w(0), "nvfp4", axis=0), b: lb.quantize(_w(1), "mxfp8", axis=0),
               c: lb.quantize(_w(2), "nvfp4", axis=0)}
    t, hq, qc = modelopt_state(weights, activation_amax={a: 1.0})
    assert t[f"{b}.weight"].dtype.name == "float8_e4m3fn" and t[f"{b}.weight"].shape == (N, K)
    assert t[f"{b}.weight_scale"].dtype == np.uint8 and f"{b}.input_scale" not in t
    assert f"{c}.input_scale" not in t
    np.testing.assert_array_equal(
        _bits(mx(e4m3(t[f"{b}.weight"].view(np.uint8)), t[f"{b}.weight_scale"])),
        _bits(lowbit_value(weights[b])))
    layers = {a: {"quant_algo": "NVFP4", "group_size": 16},
              b: {"quant_algo": "MXFP8", "group_size": 32},
              c: {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    assert hq["quantization"] == {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                  "quantized_layers": layers}
    assert hq["producer"]["name"] == "lowbit"
    nv = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    f8 = {"dynamic": False, "num_bits": 8, "type": "float", "group_size": 32}
    assert qc["config_groups"] == {
        "group_0": {"input_activations": nv, "weights": nv, "targets": [a]},
        "group_1": {"input_activations": f8, "weights": f8, "targets": [b]},
        "group_2": {"weights": nv, "targets": [c]}}
    assert qc["quantized_layers"] == layers and qc["ignore"] == []
    assert qc["quant_algo"] == "MIXED_PRECISION" and qc["quant_method"] == "modelopt"

    _, hq8, qc8 = modelopt_state({b: weights[b], "head": _w(3)}, exclude=["x"])
    assert hq8["quantization"] == {"quant_algo": "MXFP8", "kv_cache_quant_algo": None,
                                   "group_size": 32, "exclude_modules": ["head", "x"]}
    assert "config_groups" not in qc8 and qc8["ignore"] == ["head", "x"]  # as ModelOpt's


# --------------------------------------------------------------------------------------------
# refusals


def test_compressed_tensors_refuses_an_inexact_global_scale():
    w = _w(0)
    q = lb.quantize(w, "nvfp4", axis=0)  # t = amax / 2688: not a power of two
    with pytest.raises(ValueError, match=r"compressed-tensors: module 'm\.w'.*inexact "
                                         r"reciprocal.*exact_tensor_amax"):
        compressed_tensors_state({"m.w": q})
    t, _, _ = modelopt_state({"m.w": q})  # ModelOpt holds the tensor scale itself
    assert t["m.w.weight_scale_2"] == np.float32(q.tensor_scale)


@pytest.mark.parametrize("state", [compressed_tensors_state, modelopt_state])
@pytest.mark.parametrize("case, msg", [
    ("format", r"module 'm' is mxfp6_e2m3"),
    ("output_axis", r"module 'm': blocks run along axis 1 .* the output axis"),
    ("group", r"module 'm': .* groups (16|32) inputs per scale; blocks of \d+ along K=40"),
    ("nan", r"module 'm': 1 block\(s\) hold NaN or Inf"),
    ("tensor_block", r"module 'm': tensor_block=32"),
    ("rank", r"module 'm': a linear weight is 2-D"),
    ("float_rank", r"module 'm': a float linear weight is a 2-D float array"),
    ("duplicate", r"tensor 'm\.weight\w*' is also written"),
    ("qarray_tensor", r"tensor 'x' is a QArray; quantized linear weights go in weights="),
    ("amax_unknown", r"activation_amax names modules that are no quantized weights: \['z'\]"),
])
def test_refusals_name_the_module_and_the_engine(state, case, msg):
    engine = "compressed-tensors" if state is compressed_tensors_state else "ModelOpt"
    fmt = "nvfp4" if engine == "ModelOpt" else "mxfp4"
    w = _w(0)
    kw: dict = {}
    if case == "format":
        weights = {"m": lb.quantize(w, "mxfp6", axis=0)}
    elif case == "output_axis":
        weights = {"m": lb.quantize(w, fmt, axis=1)}
    elif case == "group":
        weights = {"m": lb.quantize(w[:40], fmt, axis=0)}
    elif case == "nan":
        weights = {"m": lb.quantize(w.at[3, 5].set(jnp.nan), fmt, axis=0)}
    elif case == "tensor_block":
        weights = {"m": lb.quantize(w, "nvfp4", axis=0, tensor_block=32)}
    elif case == "rank":
        weights = {"m": lb.quantize(_w(1, (2, K, N)), fmt, axis=1)}
    elif case == "float_rank":
        weights = {"q": _nvfp4(w), "m": w[0]}
    elif case == "duplicate":
        weights = {"m": _nvfp4(w)}
        kw["tensors"] = {"m.weight_scale": np.zeros(1)}
    elif case == "qarray_tensor":
        weights = {"m": _nvfp4(w)}
        kw["tensors"] = {"x": _nvfp4(w)}
    else:
        weights = {"m": _nvfp4(w)}
        kw["activation_amax"] = {"z": 1.0}
    with pytest.raises(ValueError, match=rf"{engine}: .*{msg}"):
        state(weights, **kw)


@pytest.mark.parametrize("state, fmt", [(compressed_tensors_state, "mxfp4"),
                                        (modelopt_state, "mxfp8")])
def test_mx_modules_take_no_activation_amax(state, fmt):
    with pytest.raises(ValueError, match="scaled dynamically"):
        state({"m": lb.quantize(_w(0), fmt, axis=0)}, activation_amax={"m": 1.0})


@pytest.mark.parametrize("state", [compressed_tensors_state, modelopt_state])
def test_bad_activation_amax_and_no_quantized_module(state):
    with pytest.raises(ValueError, match="module 'm': activation amax"):
        state({"m": _nvfp4(_w(0))}, activation_amax={"m": 0.0})
    with pytest.raises(ValueError, match="no quantized module"):
        state({"m": _w(0)})
    with pytest.raises(ValueError, match="layout='kn'"):
        state({"m": _nvfp4(_w(0))}, layout="kn")
